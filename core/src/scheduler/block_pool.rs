//! The GPU block pool with prefix caching (vLLM's `BlockPool`, SEMANTICS.md §1.2, I-20).
//!
//! One pool serves every KV cache group (vLLM's hybrid allocator shares one pool between groups
//! of equal page size). Block `0` is the *null block*: it stands for a block a sliding-window
//! group no longer needs and is never allocated, freed or cached.
//!
//! * Every block has a reference count: the number of owners (requests holding it in a block
//!   table, plus connector pins, see [`crate::Intent`]).
//! * New blocks are taken from the head of the *free queue*. A block whose count drops to 0 joins
//!   it where vLLM 0.33.0's `free_blocks` puts it (SEMANTICS.md §1.2, "GPU `BlockPool` free
//!   queue"): a block that carries a prefix-cache hash goes to the **tail** and keeps its hash —
//!   it is still a cache hit until it is reused, and the least recently freed cached block is
//!   evicted first (LRU); a block without a hash (never full, or prefix caching off) goes to the
//!   **head**, to be reused first (LIFO). The blocks one call prepends keep their order, so when
//!   a request's blocks are freed tail first, its last uncached block becomes the head. A
//!   request's blocks are freed tail first so that a prefix outlives its suffix.
//! * A cache hit on a free block ([`BlockPool::touch`]) takes it out of the free queue.
//!
//! The free queue is an intrusive doubly linked list over block indices, so touching, freeing and
//! allocating are O(1) and the state stays plain data (it derives `Hash` for the model checker).
//!
//! # Events
//!
//! With events on ([`BlockPool::set_events`], vLLM's `enable_kv_cache_events`; off by default)
//! the pool queues a [`CacheEvent`] for every change of its prefix cache, as vLLM's
//! `kv_event_queue`: `Removed` for each key a block loses (reuse in
//! [`BlockPool::get_new_blocks`], [`BlockPool::evict_blocks`]), `AllCleared` on
//! [`BlockPool::reset_prefix_cache`]; the scheduler adds the `Stored` events of
//! `cache_full_blocks` (`record`). [`BlockPool::take_events`] drains the queue. With
//! events off nothing is built or kept, and the pool is equal (and hashes equal) to one that
//! never had the switch.

use alloc::vec::Vec;

use crate::ids::{BlockId, NULL_BLOCK};
use crate::messages::{CacheEvent, Medium};
use crate::tokens::BlockHash;

mod hit_index;

use self::hit_index::HitIndex;

/// A prefix-cache key: a block hash within one KV cache group.
type CacheKey = (BlockHash, u8);

const NIL: u32 = u32::MAX;

/// The GPU block pool. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    /// The block's cache key and its insertion number.
    hash: Vec<Option<(CacheKey, u64)>>,
    /// Free-queue links; `NIL` ends the list. A block is in the queue iff its count is 0
    /// (and it is not the null block).
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: u32,
    /// Key → the blocks carrying it, by insertion number. Several blocks may carry one key
    /// (vLLM keeps them all); the hit is the earliest inserted. Derived from `hash` (the state
    /// of record) and ignored by `Hash` and `Eq`: a hash lookup for the hot path.
    index: HitIndex,
    inserted: u64,
    /// Prefix-cache events since the last [`BlockPool::take_events`] (vLLM's `kv_event_queue`);
    /// `None` while events are off.
    events: Option<Vec<CacheEvent>>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, the null block included; all others free, in id order.
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        let mut pool = Self {
            ref_cnt: alloc::vec![0; n],
            hash: alloc::vec![None; n],
            prev: alloc::vec![NIL; n],
            next: alloc::vec![NIL; n],
            head: NIL,
            tail: NIL,
            num_free: 0,
            index: HitIndex::default(),
            inserted: 0,
            events: None,
        };
        for b in 1..num_blocks {
            pool.push_back(b);
        }
        pool
    }

    /// Number of blocks, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Blocks that can be handed out now (free, cached or not).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Whether `b` names a block of this pool.
    pub fn contains(&self, b: BlockId) -> bool {
        b.0 < self.ref_cnt.len() as u64
    }

    /// Owners of `b` (0 for a free block). `b` must be in range.
    pub fn ref_cnt(&self, b: BlockId) -> u32 {
        self.ref_cnt[b.0 as usize]
    }

    /// The prefix-cache key of `b`, if it is cached.
    pub fn cached_hash(&self, b: BlockId) -> Option<(BlockHash, u8)> {
        self.hash[b.0 as usize].map(|(k, _)| k)
    }

    /// The cached block for `hash` in `group`, if any.
    pub fn get_cached(&self, hash: BlockHash, group: u8) -> Option<BlockId> {
        self.index.first(hash, group)
    }

    /// Take one more reference on each block (a prefix-cache hit, or a connector pin). A free
    /// block leaves the free queue. Null blocks are skipped.
    pub fn touch(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.touch_unchecked(blocks);
        crate::debug_assert_invariants!(self);
    }

    fn touch_unchecked(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            let i = b.0 as u32;
            if self.ref_cnt[i as usize] == 0 {
                self.unlink(i);
            }
            self.ref_cnt[i as usize] += 1;
        }
    }

    /// Hand out `n` blocks from the head of the free queue, evicting their cached hashes.
    /// Returns `None` (and changes nothing) when fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: u32) -> Option<Vec<BlockId>> {
        let out = self.get_new_blocks_unchecked(n);
        crate::debug_assert_invariants!(self);
        out
    }

    fn get_new_blocks_unchecked(&mut self, n: u32) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let i = self.head;
            self.unlink(i);
            self.evict_hash(i);
            self.ref_cnt[i as usize] = 1;
            out.push(BlockId(u64::from(i)));
        }
        Some(out)
    }

    /// Drop one reference on each block, given in eviction priority (the block to reuse first
    /// first). Of the blocks reaching 0, those without a prefix-cache hash are put in front of
    /// the free queue, in the given order (reused first, LIFO), and the cached ones at its tail,
    /// in the given order (evicted last, LRU) — vLLM's `BlockPool.free_blocks`. Null blocks are
    /// skipped.
    ///
    /// Panics if a block's count is already 0: the caller freed a block it did not own, a bug in
    /// the scheduler (owners are tracked exactly, I-15).
    pub fn free_blocks(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.free_blocks_unchecked(blocks);
        crate::debug_assert_invariants!(self);
    }

    fn free_blocks_unchecked(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        // The uncached blocks reaching 0, linked in front of the old head once all are known:
        // `first_head..=first_tail` is a chain through `next` in the given order.
        let (mut first_head, mut first_tail) = (NIL, NIL);
        for b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            let i = b.0 as u32;
            let rc = &mut self.ref_cnt[i as usize];
            assert!(*rc > 0, "block {i} freed with no owner");
            *rc -= 1;
            if *rc > 0 {
                continue;
            }
            if self.hash[i as usize].is_some() {
                self.push_back(i);
                continue;
            }
            self.prev[i as usize] = first_tail;
            self.next[i as usize] = NIL;
            if first_tail == NIL {
                first_head = i;
            } else {
                self.next[first_tail as usize] = i;
            }
            first_tail = i;
            self.num_free += 1;
        }
        if first_head != NIL {
            self.next[first_tail as usize] = self.head;
            if self.head == NIL {
                self.tail = first_tail;
            } else {
                self.prev[self.head as usize] = first_tail;
            }
            self.head = first_head;
        }
    }

    /// Give `b` the prefix-cache key `(hash, group)` (vLLM's `cache_full_blocks` for one block).
    /// A block that already carries a key keeps it.
    pub fn cache_block(&mut self, b: BlockId, hash: BlockHash, group: u8) {
        self.cache_block_unchecked(b, hash, group);
        crate::debug_assert_invariants!(self);
    }

    fn cache_block_unchecked(&mut self, b: BlockId, hash: BlockHash, group: u8) {
        if b == NULL_BLOCK || self.hash[b.0 as usize].is_some() {
            return;
        }
        let n = self.inserted;
        self.inserted += 1;
        self.hash[b.0 as usize] = Some(((hash, group), n));
        self.index.insert(hash, group, n, b);
    }

    /// Remove the cache keys of these blocks (vLLM's `evict_blocks`, used by the `fail` load
    /// failure policy, I-35). Owners keep the blocks.
    pub fn evict_blocks(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.evict_blocks_unchecked(blocks);
        crate::debug_assert_invariants!(self);
    }

    fn evict_blocks_unchecked(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            if self.contains(b) && b != NULL_BLOCK {
                self.evict_hash(b.0 as u32);
            }
        }
    }

    /// vLLM's `reset_prefix_cache`: succeeds only when no block is in use (every block but the
    /// null block is free); then every block loses its cache key, so nothing hits until blocks
    /// are cached again, and `AllCleared` is queued when events are on. The free queue keeps its
    /// order (vLLM resets only the hashes). `false`: a block is in use; nothing changes.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let out = self.reset_prefix_cache_unchecked();
        crate::debug_assert_invariants!(self);
        out
    }

    fn reset_prefix_cache_unchecked(&mut self) -> bool {
        if self.num_free + 1 != self.num_blocks() {
            return false;
        }
        self.hash.iter_mut().for_each(|h| *h = None);
        self.index = HitIndex::default();
        self.record(|| CacheEvent::AllCleared);
        true
    }

    /// Switches events on or off (off by default). Switching off drops the events not yet
    /// taken; switching on again starts an empty queue.
    pub fn set_events(&mut self, on: bool) {
        match (on, &self.events) {
            (true, None) => self.events = Some(Vec::new()),
            (false, Some(_)) => self.events = None,
            _ => {}
        }
    }

    /// Whether events are on.
    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Queues the event `make` builds, if events are on (it is not built otherwise).
    pub(crate) fn record(&mut self, make: impl FnOnce() -> CacheEvent) {
        if let Some(q) = &mut self.events {
            q.push(make());
        }
    }

    /// The events since the last call, oldest first (vLLM's `take_events`); empty while events
    /// are off.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events
            .as_mut()
            .map(core::mem::take)
            .unwrap_or_default()
    }

    /// The free queue, head (next to be evicted) first. For tests and conformance output.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        let mut i = self.head;
        while i != NIL {
            out.push(BlockId(u64::from(i)));
            i = self.next[i as usize];
        }
        out
    }

    /// Number of blocks that carry a prefix-cache key.
    pub fn num_cached(&self) -> usize {
        self.index.len()
    }

    /// `_maybe_evict_cached_block`: the block loses its key (one `Removed` event per key, as
    /// vLLM's `_emit_block_removed_events`).
    fn evict_hash(&mut self, i: u32) {
        if let Some(((h, g), n)) = self.hash[i as usize].take() {
            self.index.remove(h, g, n);
            self.record(|| CacheEvent::Removed {
                medium: Medium::Gpu,
                group: u32::from(g),
                hashes: alloc::vec![h],
            });
        }
    }

    fn push_back(&mut self, i: u32) {
        self.prev[i as usize] = self.tail;
        self.next[i as usize] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
        self.num_free += 1;
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i as usize] = NIL;
        self.next[i as usize] = NIL;
        self.num_free -= 1;
    }

    /// The pool's own invariants: the free queue holds exactly the blocks with count 0 (the null
    /// block excluded), once each; the cache map and the per-block keys agree (I-20's "free
    /// blocks are never owned").
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        use crate::ensure_invariant;
        let n = self.ref_cnt.len();
        let mut seen = alloc::vec![false; n];
        let mut count = 0u32;
        let mut i = self.head;
        let mut prev = NIL;
        while i != NIL {
            ensure_invariant!(
                (i as usize) < n && i != 0,
                "I-20",
                "free queue holds block {i}"
            );
            ensure_invariant!(
                !seen[i as usize],
                "I-20",
                "block {i} twice in the free queue"
            );
            ensure_invariant!(
                self.prev[i as usize] == prev,
                "I-20",
                "free queue links broken at block {i}"
            );
            seen[i as usize] = true;
            ensure_invariant!(
                self.ref_cnt[i as usize] == 0,
                "I-20",
                "block {i} is in the free queue with {} owners",
                self.ref_cnt[i as usize]
            );
            count += 1;
            prev = i;
            i = self.next[i as usize];
        }
        ensure_invariant!(self.tail == prev, "I-20", "free queue tail is stale");
        ensure_invariant!(
            count == self.num_free,
            "I-20",
            "free count {} but {count} blocks queued",
            self.num_free
        );
        for (b, &rc) in self.ref_cnt.iter().enumerate().skip(1) {
            ensure_invariant!(
                rc > 0 || seen[b],
                "I-20",
                "block {b} has no owner but is not in the free queue"
            );
        }
        for (b, key) in self.hash.iter().enumerate() {
            if let Some(((h, g), n)) = *key {
                ensure_invariant!(
                    self.index.holds(h, g, n, BlockId(b as u64)),
                    "I-20",
                    "block {b} carries a key the hit index does not hold"
                );
            }
        }
        let keyed = self.hash.iter().filter(|h| h.is_some()).count();
        ensure_invariant!(
            keyed == self.num_cached(),
            "I-20",
            "{keyed} blocks carry a key but the map holds {}",
            self.num_cached()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `check_invariants` must reject a broken pool, not just accept good ones (a mutation
    /// that made it always `Ok` went unnoticed by every other test).
    #[test]
    fn check_invariants_rejects_a_corrupt_pool() {
        let mut pool = BlockPool::new(5);
        let a = pool.get_new_blocks(2).unwrap();
        assert!(pool.check_invariants().is_ok());
        // An owned block whose count is dropped behind the pool's back is owned by nobody but
        // missing from the free queue.
        pool.ref_cnt[a[0].0 as usize] = 0;
        let err = pool
            .check_invariants()
            .expect_err("a count-0 block outside the free queue");
        assert_eq!(err.id, "I-20");
        // A free block that gains an owner without leaving the queue.
        let mut pool = BlockPool::new(5);
        pool.ref_cnt[pool.head as usize] = 1;
        assert!(pool.check_invariants().is_err());
        // A stale free count.
        let mut pool = BlockPool::new(5);
        pool.num_free += 1;
        assert!(pool.check_invariants().is_err());
    }

    #[test]
    fn lru_eviction_prefers_least_recently_freed() {
        let mut pool = BlockPool::new(5);
        // The scheduler's I-20 check walks blocks 1..num_blocks: the count includes the null
        // block, and it is the pool's real size.
        assert_eq!(pool.num_blocks(), 5);
        assert_eq!(pool.num_free(), 4);
        let a = pool.get_new_blocks(2).unwrap();
        assert_eq!(a, [BlockId(1), BlockId(2)]);
        pool.cache_block(a[0], BlockHash(10), 0);
        pool.cache_block(a[1], BlockHash(11), 0);
        // Freed tail first: 2 then 1 join the queue after 3, 4.
        pool.free_blocks(a.iter().rev().copied());
        assert_eq!(
            pool.free_queue(),
            [BlockId(3), BlockId(4), BlockId(2), BlockId(1)]
        );
        assert_eq!(pool.get_cached(BlockHash(10), 0), Some(BlockId(1)));
        // A hit takes block 1 out of the free queue.
        pool.touch([BlockId(1)]);
        assert_eq!(pool.num_free(), 3);
        // Taking 3 blocks evicts block 2's hash, not block 1's.
        let b = pool.get_new_blocks(3).unwrap();
        assert_eq!(b, [BlockId(3), BlockId(4), BlockId(2)]);
        assert_eq!(pool.get_cached(BlockHash(11), 0), None);
        assert_eq!(pool.get_cached(BlockHash(10), 0), Some(BlockId(1)));
        assert!(pool.get_new_blocks(1).is_none());
        pool.check_invariants().unwrap();
    }

    /// SEMANTICS.md §1.2 ("GPU `BlockPool` free queue"): freed blocks without a hash are reused
    /// first, in the order one call frees them; cached ones last. vLLM 0.33.0's `free_blocks`
    /// (the oracle issue: kvrelay appended every freed block to the tail).
    #[test]
    fn uncached_blocks_are_reused_first_and_cached_ones_last() {
        let mut pool = BlockPool::new(8);
        let a = pool.get_new_blocks(4).unwrap();
        assert_eq!(a, [BlockId(1), BlockId(2), BlockId(3), BlockId(4)]);
        assert_eq!(pool.free_queue(), [BlockId(5), BlockId(6), BlockId(7)]);
        // A request's table [1, 2, 3, 4], blocks 1 and 2 full and cached, freed tail first.
        pool.cache_block(a[0], BlockHash(10), 0);
        pool.cache_block(a[1], BlockHash(11), 0);
        pool.free_blocks(a.iter().rev().copied());
        // 4 then 3 are prepended keeping that order (4 is the new head); 2 then 1 join the tail.
        assert_eq!(
            pool.free_queue(),
            [4, 3, 5, 6, 7, 2, 1].map(BlockId),
            "uncached blocks LIFO at the head, cached ones at the tail"
        );
        pool.check_invariants().unwrap();
        // The next allocation reuses the last uncached block freed.
        assert_eq!(pool.get_new_blocks(2).unwrap(), [BlockId(4), BlockId(3)]);
        // A second free prepends in front of the blocks prepended before.
        pool.free_blocks([BlockId(3)]);
        pool.free_blocks([BlockId(4)]);
        assert_eq!(pool.free_queue(), [4, 3, 5, 6, 7, 2, 1].map(BlockId));
        // Freeing into an empty queue: every block taken, then an uncached and a cached one
        // freed in one call.
        let all = pool.get_new_blocks(7).unwrap();
        assert_eq!(pool.num_free(), 0);
        pool.cache_block(all[0], BlockHash(12), 0);
        pool.free_blocks([all[0], all[1]]);
        assert_eq!(pool.free_queue(), [all[1], all[0]]);
        pool.check_invariants().unwrap();
    }

    /// A block still owned by another request is not freed: only the count drops.
    #[test]
    fn a_shared_block_joins_the_queue_only_at_its_last_owner() {
        let mut pool = BlockPool::new(4);
        let a = pool.get_new_blocks(1).unwrap();
        pool.touch(a.iter().copied());
        pool.free_blocks(a.iter().copied());
        assert_eq!(pool.free_queue(), [BlockId(2), BlockId(3)]);
        pool.free_blocks(a.iter().copied());
        assert_eq!(pool.free_queue(), [BlockId(1), BlockId(2), BlockId(3)]);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_hashes_keep_the_first_block_as_the_hit() {
        let mut pool = BlockPool::new(4);
        let a = pool.get_new_blocks(2).unwrap();
        pool.cache_block(a[0], BlockHash(7), 0);
        pool.cache_block(a[1], BlockHash(7), 0);
        assert_eq!(pool.get_cached(BlockHash(7), 0), Some(a[0]));
        pool.evict_blocks([a[0]]);
        assert_eq!(pool.get_cached(BlockHash(7), 0), Some(a[1]));
        assert_eq!(pool.get_cached(BlockHash(7), 1), None);
        pool.check_invariants().unwrap();
    }

    /// Protects vLLM's prefix-cache keys: the null block never gets a key, a cached block keeps
    /// its key, and among blocks with the same key a hit takes the one cached first (vLLM's
    /// `get_one_block`: the dict's insertion order).
    #[test]
    fn cache_keys_stick_and_the_oldest_duplicate_wins() {
        let mut pool = BlockPool::new(6);
        pool.cache_block(NULL_BLOCK, BlockHash(7), 0);
        assert_eq!(pool.num_cached(), 0);
        assert_eq!(pool.get_cached(BlockHash(7), 0), None);
        let b = pool.get_new_blocks(3).unwrap();
        pool.cache_block(b[0], BlockHash(7), 0);
        pool.cache_block(b[0], BlockHash(8), 0);
        assert_eq!(pool.cached_hash(b[0]), Some((BlockHash(7), 0)));
        assert_eq!(pool.num_cached(), 1);
        // Two more blocks with the same content: the first cached still answers, and once its
        // key is evicted the next oldest does.
        pool.cache_block(b[1], BlockHash(7), 0);
        pool.cache_block(b[2], BlockHash(7), 0);
        assert_eq!(pool.get_cached(BlockHash(7), 0), Some(b[0]));
        pool.evict_blocks([b[0]]);
        assert_eq!(pool.get_cached(BlockHash(7), 0), Some(b[1]));
        assert!(pool.check_invariants().is_ok());
    }

    /// Load-error block ids come from workers: one outside the pool is ignored, not a panic.
    #[test]
    fn evicting_a_block_outside_the_pool_is_a_no_op() {
        let mut pool = BlockPool::new(3);
        let b = pool.get_new_blocks(1).unwrap();
        pool.cache_block(b[0], BlockHash(1), 0);
        pool.evict_blocks([BlockId(99), NULL_BLOCK]);
        assert_eq!(pool.get_cached(BlockHash(1), 0), Some(b[0]));
        assert!(pool.check_invariants().is_ok());
    }
}
