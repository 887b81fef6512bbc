//! `check_invariants()` (I-40): the chunk pool's counters and chunks, the arena's free slots and
//! key index, each live node's place, then the policy's own lists (`Policy::check_invariants`,
//! in `lru.rs` and `arc.rs`, which own them).

use super::CpuOffloadingManager;
use super::arena::{Node, Place};
use crate::{InvariantViolation, ensure_invariant};

impl CpuOffloadingManager {
    /// I-40: counters equal the chunk table, `ref_cnt ≥ −1`, allocated chunks within capacity
    /// and distinct (none both free and held), the key index maps exactly the live nodes, no node
    /// keeps a call's `offered` flag, and the policy's lists are well linked and hold exactly
    /// the right keys: LRU the stored ones in `(rank, key)` order, ARC the stored ones in T1/T2 and only ghosts, within capacity, in
    /// B1/B2.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let arena = &self.arena;
        let nodes = &arena.nodes;
        let next_fresh = self.next_fresh as usize;
        ensure_invariant!(
            self.next_fresh <= self.config.capacity_chunks,
            "I-40",
            "allocated chunks exceed capacity"
        );
        let mut chunk_held = alloc::vec![false; next_fresh];
        for c in &self.free {
            let i = c.0 as usize;
            ensure_invariant!(
                i < next_fresh && !chunk_held[i],
                "I-40",
                "free chunk {c:?} unallocated or listed twice"
            );
            chunk_held[i] = true;
        }
        let mut slot_free = alloc::vec![false; nodes.len()];
        for &s in &arena.free_slots {
            let i = s as usize;
            ensure_invariant!(
                i < nodes.len() && !slot_free[i] && nodes[i].place == Place::Free,
                "I-40",
                "free arena slot {s} is in use or listed twice"
            );
            // A free slot holds nothing between calls: an eviction that only tags a node
            // `Free` (ARC's ghost trim) leaves it to `Arena::scrub_free` before the call ends.
            ensure_invariant!(
                nodes[i] == Node::FREE,
                "I-40",
                "free arena slot {s} still holds {:?}",
                nodes[i]
            );
            slot_free[i] = true;
        }
        let (mut live, mut stored, mut idle, mut pending) = (0usize, 0usize, 0usize, 0usize);
        for (s, n) in nodes.iter().enumerate() {
            if n.place == Place::Free {
                ensure_invariant!(slot_free[s], "I-40", "arena slot {s} free but not listed");
                continue;
            }
            live += 1;
            ensure_invariant!(
                !n.offered,
                "I-40",
                "{:?} is still flagged as offered after the call",
                n.key
            );
            ensure_invariant!(
                arena.slot(&n.key) == Some(s as u32),
                "I-40",
                "key index disagrees for {:?}",
                n.key
            );
            if let Some(c) = n.chunk {
                stored += 1;
                ensure_invariant!(c.ref_cnt >= -1, "I-40", "ref_cnt below -1");
                let i = c.chunk.0 as usize;
                ensure_invariant!(
                    i < next_fresh && !chunk_held[i],
                    "I-40",
                    "chunk {:?} of {:?} unallocated, free or shared",
                    c.chunk,
                    n.key
                );
                chunk_held[i] = true;
                idle += usize::from(c.ref_cnt == 0);
                pending += usize::from(c.ref_cnt == -1);
            }
            // Only ARC keeps keys without a chunk: its ghosts.
            ensure_invariant!(
                self.policy.placed(n),
                "I-40",
                "{:?} ({:?}) is in the wrong policy list {:?}",
                n.key,
                n.chunk,
                n.place
            );
        }
        ensure_invariant!(
            arena.index.len == live && arena.stored as usize == stored,
            "I-40",
            "key index holds {} keys, arena {live} ({stored} stored, counted {})",
            arena.index.len,
            arena.stored
        );
        ensure_invariant!(
            idle == self.evictable as usize,
            "I-40",
            "evictable {} != idle chunks {}",
            self.evictable,
            idle
        );
        ensure_invariant!(
            pending == self.write_pending as usize,
            "I-40",
            "write_pending {} != pending chunks {}",
            self.write_pending,
            pending
        );
        ensure_invariant!(
            stored + self.free.len() == next_fresh,
            "I-40",
            "{stored} held + {} free chunks != {next_fresh} allocated",
            self.free.len()
        );
        self.policy
            .check_invariants(nodes, live, stored, self.config.capacity_chunks)
    }
}
