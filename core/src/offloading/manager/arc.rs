//! The ARC policy (vLLM 0.33.0's `ARCCachePolicy`): adaptive replacement between recency and
//! frequency.
//!
//! Stored keys sit in T1 (seen once) or T2 (seen again); evicted keys stay as ghosts (nodes
//! without a chunk) in B1 or B2, each bounded by the capacity. A touch or store miss of a ghost
//! moves the T1 target size towards the list it came from; eviction takes idle keys from T1
//! while T1 is at or above its target, else from T2, else from T1. Every list is in recency
//! order, least recent first. Unlike LRU, pinned and write-pending keys stay in their lists;
//! eviction skips them.

use alloc::vec::Vec;

use super::arena::{Arena, List, NIL, Node, Place};
use super::scope::{KeyAccess, RequestAccess};
use super::types::{ChunkId, OffloadKey};
use crate::{InvariantViolation, ensure_invariant};

/// The ARC's own state: the heads of its four lists, threaded through the arena's nodes.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Arc {
    t1: List,
    t2: List,
    b1: List,
    b2: List,
    /// `target_t1_size`, an f64 kept as its bits so the manager stays `Eq + Hash`.
    target_bits: u64,
}

impl Arc {
    pub(super) fn new() -> Self {
        Self {
            t1: List::EMPTY,
            t2: List::EMPTY,
            b1: List::EMPTY,
            b2: List::EMPTY,
            target_bits: 0f64.to_bits(),
        }
    }

    /// `touch`, processed tail to head so the head ends most recent: a ready key in T1 moves to
    /// T2, a write-pending one (just prepared to be stored) stays in T1 as most recent, a key in
    /// T2 becomes its most recent, and a ghost adapts the target.
    pub(super) fn touch(&mut self, arena: &mut Arena, keys: &[OffloadKey], capacity: u32) {
        for k in keys.iter().rev() {
            let Some(s) = arena.slot(k) else {
                continue;
            };
            let nodes = &mut arena.nodes;
            let n = &nodes[s as usize];
            let ready = n.chunk.is_some_and(|c| c.ref_cnt >= 0);
            match n.place {
                Place::T1 if ready => {
                    self.t1.unlink(nodes, s);
                    self.t2.push_back(nodes, s, Place::T2);
                }
                // Just prepared to be stored, not really touched twice.
                Place::T1 => self.t1.move_to_back(nodes, s),
                Place::T2 => self.t2.move_to_back(nodes, s),
                _ => self.ghost_hit(nodes, capacity, s),
            }
        }
    }

    /// A store miss or touch of a ghost adapts the T1 target (no-op for other nodes).
    #[inline]
    pub(super) fn ghost_hit(&mut self, nodes: &mut [Node], capacity: u32, s: u32) {
        let capacity = f64::from(capacity);
        let target = f64::from_bits(self.target_bits);
        match nodes[s as usize].place {
            Place::B1 => {
                let delta = (f64::from(self.b2.len) / f64::from(self.b1.len)).max(1.0);
                self.target_bits = (target + delta).min(capacity).to_bits();
                self.b1.move_to_back(nodes, s);
            }
            Place::B2 => {
                let delta = (f64::from(self.b1.len) / f64::from(self.b2.len)).max(1.0);
                self.target_bits = (target - delta).max(0.0).to_bits();
                self.b2.move_to_back(nodes, s);
            }
            _ => {}
        }
    }

    /// A key just reserved for a store (a fresh node or a ghost that got its chunk back) enters
    /// T1 as most recent.
    #[inline]
    pub(super) fn insert(&mut self, nodes: &mut [Node], s: u32) {
        match nodes[s as usize].place {
            Place::B1 => self.b1.unlink(nodes, s),
            Place::B2 => self.b2.unlink(nodes, s),
            _ => {}
        }
        self.t1.push_back(nodes, s, Place::T1);
    }

    /// A key whose store failed leaves T1/T2 (the manager then frees its node).
    pub(super) fn remove(&mut self, nodes: &mut [Node], s: u32) {
        match nodes[s as usize].place {
            Place::T1 => self.t1.unlink(nodes, s),
            Place::T2 => self.t2.unlink(nodes, s),
            _ => {}
        }
    }

    /// Evicts exactly `n` idle keys not `offered` by the store in progress, frees their chunks and moves
    /// them to the ghost lists (trimmed to `capacity`), returning them in eviction order; `None`
    /// (nothing changed) if there are fewer. A trimmed ghost's node is only tagged `Free`
    /// (see [`Policy::evict`](super::policy::Policy::evict)). `chosen` is a working buffer.
    ///
    /// Each list's victims are taken in its order, so they join their ghost list in that order
    /// whatever the interleaving of the two lists' picks: when a list's victims are its first
    /// nodes (none skipped), they move as one run (a splice), else one by one; the ghosts
    /// trimmed are the first nodes of their list, cut as one run.
    pub(super) fn evict(
        &mut self,
        arena: &mut Arena,
        free: &mut Vec<ChunkId>,
        n: usize,
        capacity: u32,
        chosen: &mut Vec<u32>,
    ) -> Option<Vec<OffloadKey>> {
        chosen.clear();
        let Self {
            t1,
            t2,
            b1,
            b2,
            target_bits,
        } = self;
        let target = f64::from_bits(*target_bits) as usize;
        // Per list: its picks, the last one, and whether a node before it was skipped.
        let mut picked = [(0u32, NIL, false); 2];
        {
            let nodes = &arena.nodes;
            let idle = |s: u32| {
                let n = &nodes[s as usize];
                n.chunk.is_some_and(|c| c.ref_cnt == 0) && !n.offered
            };
            // The next idle node from a cursor, advancing it past that node.
            let next_idle = |cursor: &mut u32, skipped: &mut bool| {
                while *cursor != NIL {
                    let s = *cursor;
                    *cursor = nodes[s as usize].next;
                    if idle(s) {
                        return Some(s);
                    }
                    *skipped = true;
                }
                None
            };
            let mut virtual_t1 = t1.len as usize;
            let (mut c1, mut c2) = (t1.head, t2.head);
            let (mut skip1, mut skip2) = (false, false);
            for _ in 0..n {
                let mut pick = None;
                if virtual_t1 >= target
                    && let Some(s) = next_idle(&mut c1, &mut skip1)
                {
                    pick = Some((s, 0));
                    virtual_t1 -= 1;
                }
                if pick.is_none()
                    && let Some(s) = next_idle(&mut c2, &mut skip2)
                {
                    pick = Some((s, 1));
                }
                if pick.is_none() {
                    pick = Some((next_idle(&mut c1, &mut skip1)?, 0));
                    virtual_t1 -= 1;
                }
                let (s, list) = pick.expect("picked above");
                let p = &mut picked[list];
                p.0 += 1;
                p.1 = s;
                p.2 = if list == 0 { skip1 } else { skip2 };
                chosen.push(s);
            }
        }
        free.reserve(n);
        let nodes = &mut arena.nodes;
        let victims: Vec<OffloadKey> = chosen
            .iter()
            .map(|&s| {
                let node = &mut nodes[s as usize];
                let chunk = node.chunk.take().expect("idle keys are stored");
                free.push(chunk.chunk);
                node.key
            })
            .collect();
        arena.stored -= n as u32;
        for (list, ghosts, place, (count, last, skipped)) in [
            (&mut *t1, &mut *b1, Place::B1, picked[0]),
            (&mut *t2, &mut *b2, Place::B2, picked[1]),
        ] {
            if count == 0 {
                continue;
            }
            if skipped {
                // One by one, in list order (their order among `chosen`).
                let from = if place == Place::B1 {
                    Place::T1
                } else {
                    Place::T2
                };
                for &s in chosen.iter() {
                    if nodes[s as usize].place == from {
                        list.unlink(nodes, s);
                        ghosts.push_back(nodes, s, place);
                    }
                }
            } else {
                let first = list.head;
                list.cut_front(nodes, last, count);
                ghosts.append(nodes, first, last, count, place);
            }
        }
        for ghosts in [b1, b2] {
            if ghosts.len > capacity {
                // The oldest ghosts leave, their nodes freed in list order.
                let count = ghosts.len - capacity;
                let mut s = ghosts.head;
                for _ in 0..count {
                    let next = nodes[s as usize].next;
                    // Reset once the store is done (`Arena::scrub_free`), unless reused.
                    arena.index.remove(nodes, s);
                    nodes[s as usize].place = Place::Free;
                    arena.free_slots.push(s);
                    s = next;
                }
                ghosts.head = s;
                if s == NIL {
                    ghosts.tail = NIL;
                } else {
                    nodes[s as usize].prev = NIL;
                }
                ghosts.len = capacity;
            }
        }
        Some(victims)
    }

    /// `on_request_finished`, for one of the request's keys (at slot `s`; the policy walks
    /// them tail to head in prefix order): a reused key is promoted from T1 or becomes T2's
    /// most recent; a key it only inserted is refreshed in its list.
    #[inline]
    pub(super) fn commit(&mut self, nodes: &mut [Node], s: u32, access: &KeyAccess) {
        let place = nodes[s as usize].place;
        if access.inserted && !access.reused {
            // Insert-only: refreshed in its list.
            match place {
                Place::T1 => self.t1.move_to_back(nodes, s),
                Place::T2 => self.t2.move_to_back(nodes, s),
                _ => {}
            }
        } else if access.reused {
            // From T1, or to T2's most recent end.
            match place {
                Place::T1 => {
                    self.t1.unlink(nodes, s);
                    self.t2.push_back(nodes, s, Place::T2);
                }
                Place::T2 => self.t2.move_to_back(nodes, s),
                _ => {}
            }
        }
    }

    /// `on_request_finished` at once, when the request's keys in prefix order (`ordered`,
    /// indices into `scope`) are exactly T1's most recent nodes in that order and were only
    /// inserted by it: committing them one by one, tail to head, refreshes each in T1, which
    /// reverses the run; `false` (nothing changed) otherwise.
    ///
    /// The run is checked by walking `ordered` and T1 together from their ends: a T1 node that
    /// holds an entry's key is that key's node (one node per key), so no key is looked up.
    pub(super) fn commit_run(
        &mut self,
        nodes: &mut [Node],
        ordered: &[u32],
        scope: &RequestAccess,
    ) -> bool {
        let last = self.t1.tail;
        let mut first = NIL;
        let mut s = last;
        for &e in ordered.iter().rev() {
            let access = scope.entry(e);
            if !access.inserted || access.reused || s == NIL {
                return false;
            }
            let n = &nodes[s as usize];
            if n.key != access.key {
                return false;
            }
            first = s;
            s = n.prev;
        }
        if first == NIL {
            return true;
        }
        // `s` is the node before the run. Each node's links swap, walking the run from its
        // first node by the old `next` links (the new `prev` ones).
        let before = s;
        let mut s = first;
        for _ in 0..ordered.len() {
            let n = &mut nodes[s as usize];
            core::mem::swap(&mut n.prev, &mut n.next);
            s = n.prev;
        }
        nodes[last as usize].prev = before;
        nodes[first as usize].next = NIL;
        if before == NIL {
            self.t1.head = last;
        } else {
            nodes[before as usize].next = last;
        }
        self.t1.tail = first;
        true
    }

    /// Whether a node sits where ARC puts it: a stored key in T1 or T2, a ghost in B1 or B2.
    pub(super) fn placed(n: &Node) -> bool {
        match n.chunk {
            Some(_) => matches!(n.place, Place::T1 | Place::T2),
            None => matches!(n.place, Place::B1 | Place::B2),
        }
    }

    /// I-40, ARC part: the four lists are well linked, T1/T2 hold the `stored` keys and B1/B2 the
    /// other `live` nodes (the ghosts), each ghost list and the target within `capacity`.
    pub(super) fn check_invariants(
        &self,
        nodes: &[Node],
        live: usize,
        stored: usize,
        capacity: u32,
    ) -> Result<(), InvariantViolation> {
        let (t1, t2, b1, b2) = (&self.t1, &self.t2, &self.b1, &self.b2);
        let lists = [
            (t1, Place::T1),
            (t2, Place::T2),
            (b1, Place::B1),
            (b2, Place::B2),
        ];
        for (list, place) in lists {
            ensure_invariant!(
                list.holds(nodes, place).is_some(),
                "I-40",
                "ARC list {place:?} broken"
            );
        }
        ensure_invariant!(
            (t1.len + t2.len) as usize == stored && (b1.len + b2.len) as usize == live - stored,
            "I-40",
            "ARC lists do not hold exactly the present keys and ghosts"
        );
        let target = f64::from_bits(self.target_bits);
        ensure_invariant!(
            b1.len <= capacity
                && b2.len <= capacity
                && (0.0..=f64::from(capacity)).contains(&target),
            "I-40",
            "ARC ghosts {} + {} or target {target} beyond capacity {capacity}",
            b1.len,
            b2.len
        );
        Ok(())
    }
}
