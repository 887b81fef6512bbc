//! Block accounting per KV cache group: vLLM's `KVCacheManager` and its single-type managers
//! (full attention, sliding window), simplified to one block size, as the scheduler uses them.
//!
//! These are methods of the scheduler's state: prefix-cache hits ([`State::local_hit`]), slot
//! allocation for a step ([`State::allocate_slots`]), adopting hit and externally loaded blocks,
//! caching full blocks, and freeing. The pool itself is [`super::block_pool::BlockPool`].

use alloc::vec::Vec;

use super::RequestStatus;
use super::{GroupKind, Request, State};
use crate::ids::{BlockId, NULL_BLOCK, RequestId};
use crate::messages::{CacheEvent, Medium};

pub(super) fn cdiv(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

/// Tokens of the prefix a group no longer reads when `num_computed` tokens are computed.
pub(super) fn num_skipped_tokens(kind: GroupKind, num_computed: u32) -> u32 {
    match kind {
        GroupKind::FullAttention => 0,
        GroupKind::SlidingWindow { window } => (num_computed + 1).saturating_sub(window),
    }
}

impl State {
    pub(super) fn bs(&self) -> u32 {
        self.config.block_size
    }

    /// The longest prefix-cache hit of one group, at most `max_len` tokens, as blocks (null
    /// blocks below a sliding window).
    pub(super) fn group_hit(&self, r: &Request, g: usize, max_len: u32) -> Vec<BlockId> {
        let bs = self.bs();
        let max_blocks = ((max_len / bs) as usize).min(r.block_hashes.len());
        let group = g as u8;
        match self.config.groups[g] {
            GroupKind::FullAttention => {
                let mut out = Vec::new();
                for h in &r.block_hashes[..max_blocks] {
                    match self.pool.get_cached(*h, group) {
                        Some(b) => out.push(b),
                        None => break,
                    }
                }
                out
            }
            GroupKind::SlidingWindow { window } => {
                let needed = cdiv(window - 1, bs).max(1) as usize;
                let mut computed = alloc::vec![NULL_BLOCK; max_blocks];
                let mut contiguous = 0usize;
                for i in (0..max_blocks).rev() {
                    if let Some(b) = self.pool.get_cached(r.block_hashes[i], group) {
                        computed[i] = b;
                        contiguous += 1;
                        if contiguous >= needed {
                            computed.truncate(i + contiguous);
                            return computed;
                        }
                    } else {
                        contiguous = 0;
                    }
                }
                computed.truncate(contiguous);
                computed
            }
        }
    }

    /// The hybrid hit over all groups (vLLM's coordinator): the longest length every group hits.
    pub(super) fn local_hit(&self, r: &Request) -> (Vec<Vec<BlockId>>, u32) {
        let n = self.config.groups.len();
        if !self.config.enable_prefix_caching || r.num_tokens() == 0 {
            return (alloc::vec![Vec::new(); n], 0);
        }
        let bs = self.bs();
        let mut len = r.num_tokens() - 1;
        loop {
            let hits: Vec<Vec<BlockId>> = (0..n).map(|g| self.group_hit(r, g, len)).collect();
            let common = hits.iter().map(|h| h.len() as u32 * bs).min().unwrap_or(0);
            if common == len || hits.iter().all(|h| h.len() as u32 * bs == common) {
                let mut hits = hits;
                for h in &mut hits {
                    h.truncate((common / bs) as usize);
                }
                return (hits, common);
            }
            len = common;
        }
    }

    pub(super) fn per_group_hits(&self, r: &Request) -> Vec<u32> {
        let max = r.num_tokens().saturating_sub(1);
        (0..self.config.groups.len())
            .map(|g| self.group_hit(r, g, max).len() as u32 * self.bs())
            .collect()
    }

    /// Blocks `group` must take from the pool to reach `need_slot` tokens, given the table length
    /// and the new hit blocks (a free hit block counts: touching takes it from the pool).
    pub(super) fn blocks_to_allocate(
        &self,
        g: usize,
        table_len: u32,
        hit: &[BlockId],
        need_slot: u32,
        total_computed: u32,
    ) -> u32 {
        let bs = self.bs();
        let skipped = num_skipped_tokens(self.config.groups[g], total_computed) / bs;
        // Hit blocks below the window are not adopted (`adopt_hit`), so only the rest count.
        let adopted = (skipped.saturating_sub(table_len) as usize).min(hit.len());
        let evictable = hit[adopted..]
            .iter()
            .filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0)
            .count() as u32;
        let have = table_len + hit.len() as u32;
        let required = cdiv(need_slot, bs);
        evictable + required.saturating_sub(have.max(skipped.min(required)))
    }

    /// Free the blocks a sliding-window group no longer reads (vLLM's `remove_skipped_blocks`).
    pub(super) fn remove_skipped_blocks(&mut self, id: RequestId, num_computed: u32) {
        let bs = self.bs();
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        for (g, kind) in self.config.groups.iter().enumerate() {
            let n = (num_skipped_tokens(*kind, num_computed) / bs) as usize;
            let table = &mut r.blocks[g];
            let mut removed = Vec::new();
            for i in (0..n.min(table.len())).rev() {
                if table[i] == NULL_BLOCK {
                    break;
                }
                removed.push(table[i]);
                table[i] = NULL_BLOCK;
            }
            self.pool.free_blocks(removed);
        }
    }

    /// vLLM's `allocate_slots`. `hit` = new local hit blocks and their token count (fresh
    /// admissions only). Returns the blocks allocated for new tokens, per group, or `None` (only
    /// skipped blocks may have been freed then).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn allocate_slots(
        &mut self,
        id: RequestId,
        num_new_tokens: u32,
        hit: Option<&(Vec<Vec<BlockId>>, u32)>,
        ext: u32,
        delay_cache: bool,
        reserved: u32,
    ) -> Option<Vec<Vec<BlockId>>> {
        let bs = self.bs();
        let ngroups = self.config.groups.len();
        let hit_tokens = hit.map_or(0, |h| h.1);
        let hit_of = |g: usize| -> &[BlockId] { hit.map_or(&[], |h| h.0[g].as_slice()) };
        let r = &self.requests[&id];
        let local = r.num_computed_tokens + hit_tokens;
        let total_computed = (local + ext).min(self.config.max_model_len);
        let watermark = if !self.running.is_empty()
            && matches!(r.status, RequestStatus::Waiting | RequestStatus::Preempted)
        {
            self.config.watermark_blocks
        } else {
            0
        };
        let main = total_computed + num_new_tokens;
        let need_slot = main.min(self.config.max_model_len);
        let processed = total_computed.saturating_sub(r.num_in_flight_tokens);
        self.remove_skipped_blocks(id, processed);
        let r = &self.requests[&id];
        let mut needed = 0;
        for g in 0..ngroups {
            needed += self.blocks_to_allocate(
                g,
                r.blocks[g].len() as u32,
                hit_of(g),
                need_slot,
                local + ext,
            );
        }
        // vLLM: `needed + watermark > free - reserved`, in Python integers; the sum form stays
        // exact in `u32` when in-flight reservations exceed the free blocks (then nothing is
        // admitted, not even a request that needs no block).
        if needed + watermark + reserved > self.pool.num_free() {
            return None;
        }
        if hit_tokens > 0 || ext > 0 {
            self.adopt_computed_blocks(id, hit.map_or(&[][..], |h| &h.0[..]), local, ext);
        }
        let r = self.requests.get_mut(&id).expect("checked above");
        let required = cdiv(need_slot, bs) as usize;
        // vLLM's `get_block_ids(allow_none=True)`: no list at all when no group got a block
        // (most decode steps; and no allocation on the hot path).
        let mut new_blocks = Vec::new();
        for g in 0..ngroups {
            let missing = required.saturating_sub(r.blocks[g].len()) as u32;
            let fresh = self
                .pool
                .get_new_blocks(missing)
                // The count above included every block taken here; running short means the
                // accounting is wrong, a bug.
                .expect("counted in blocks_to_allocate");
            r.blocks[g].extend_from_slice(&fresh);
            if !fresh.is_empty() && new_blocks.is_empty() {
                new_blocks.resize_with(ngroups, Vec::new);
            }
            if !new_blocks.is_empty() {
                new_blocks[g] = fresh;
            }
        }
        if !delay_cache {
            let upto = (total_computed + num_new_tokens).min(r.num_tokens());
            self.cache_blocks(id, upto);
        }
        Some(new_blocks)
    }

    /// A first allocation's computed prefix: the local hit, then blocks for the external
    /// tokens (vLLM's `allocate_new_computed_blocks`, the request's tables empty). In two
    /// phases, as vLLM since issue #33775: first every group adopts its hit, then every group
    /// takes blocks for the external tokens — so one group's new block can never evict a hit
    /// block another group has not claimed yet (which would put one block in two tables).
    ///
    /// In a sliding-window group the window is that of the local *and* external tokens: the
    /// hit blocks below it are not adopted (nulls stand for them), and external tokens below it
    /// get no block (`add_local_computed_blocks`, `allocate_external_computed_blocks`).
    pub(super) fn adopt_computed_blocks(
        &mut self,
        id: RequestId,
        hits: &[Vec<BlockId>],
        local: u32,
        ext: u32,
    ) {
        let r = &self.requests[&id];
        if r.blocks.iter().any(|t| !t.is_empty()) {
            // Not a first allocation: a 1-token prompt whose async load covered it is looked up
            // again holding its block (promotion leaves 0 computed tokens). vLLM's coordinator
            // skips the request, which is already in its managers' `num_cached_block`; a prompt
            // without a full block has no hit to adopt.
            debug_assert!(hits.iter().all(Vec::is_empty));
            return;
        }
        let hit = |g: usize| hits.get(g).map_or(&[][..], Vec::as_slice);
        let groups = self.config.groups.len();
        if self.claims_hits_group_by_group() {
            for g in 0..groups {
                self.adopt_hit(id, g, hit(g), local + ext);
                self.take_external_blocks(id, g, local, ext);
            }
            return;
        }
        for g in 0..groups {
            self.adopt_hit(id, g, hit(g), local + ext);
        }
        for g in 0..groups {
            self.take_external_blocks(id, g, local, ext);
        }
    }

    /// Group `g` claims the blocks of its hit inside the window of `total` computed tokens and
    /// puts nulls below it (`add_local_computed_blocks`).
    pub(super) fn adopt_hit(&mut self, id: RequestId, g: usize, hit: &[BlockId], total: u32) {
        let skipped = (num_skipped_tokens(self.config.groups[g], total) / self.bs()) as usize;
        let adopted = &hit[skipped.min(hit.len())..];
        self.pool.touch(adopted.iter().copied());
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        let table = &mut r.blocks[g];
        table.resize(skipped, NULL_BLOCK);
        table.extend_from_slice(adopted);
        r.num_cached_blocks[g] = table.len() as u32;
    }

    /// Group `g` takes blocks for the external tokens inside its window
    /// (`allocate_external_computed_blocks`).
    pub(super) fn take_external_blocks(&mut self, id: RequestId, g: usize, local: u32, ext: u32) {
        let total = local + ext;
        if ext == 0 || num_skipped_tokens(self.config.groups[g], total) >= total {
            // No external token, or every one lies below the window (a window of 1 token).
            return;
        }
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        let table = &mut r.blocks[g];
        let missing = (cdiv(total, self.config.block_size) as usize).saturating_sub(table.len());
        let fresh = self
            .pool
            .get_new_blocks(missing as u32)
            .expect("counted in blocks_to_allocate");
        table.extend(fresh);
    }

    /// Offer the request's full blocks up to `num_tokens` to the prefix cache (vLLM's
    /// `cache_full_blocks`, per group). With events on, each group that gets new full blocks
    /// `from..full` queues one `Stored`: the hashes of those blocks that were cached (null and
    /// unreachable ones skipped, so a window of one token reports none — vLLM still appends the
    /// event then), the parent hash of block `from - 1`, and the tokens of `from..full` whole.
    pub(super) fn cache_blocks(&mut self, id: RequestId, num_tokens: u32) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let bs = self.bs();
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        for g in 0..r.blocks.len() {
            let full = ((num_tokens / bs) as usize)
                .min(r.blocks[g].len())
                .min(r.block_hashes.len());
            let from = r.num_cached_blocks[g] as usize;
            // vLLM caches only the blocks a later hit can reach (`reachable_block_mask`): a
            // sliding-window hit needs `cdiv(window - 1, block_size)` contiguous blocks, so a
            // window of one token needs none, reaches no block, and its group caches nothing
            // (its blocks are freed uncached, to the head of the free queue).
            let reachable = !matches!(
                self.config.groups[g],
                GroupKind::SlidingWindow { window } if window <= 1
            );
            let cached = |i: &usize| reachable && r.blocks[g][*i] != NULL_BLOCK;
            for i in (from..full).filter(cached) {
                self.pool
                    .cache_block(r.blocks[g][i], r.block_hashes[i], g as u8);
            }
            if full > from {
                self.pool.record(|| CacheEvent::Stored {
                    medium: Medium::Gpu,
                    group: g as u32,
                    hashes: (from..full)
                        .filter(cached)
                        .map(|i| r.block_hashes[i])
                        .collect(),
                    parent: from.checked_sub(1).map(|i| r.block_hashes[i]),
                    tokens: r.tokens[from * bs as usize..full * bs as usize].to_vec(),
                    block_size: bs,
                });
                r.num_cached_blocks[g] = full as u32;
            }
        }
    }

    /// Free every block of the request (tail first, group by group) and empty its tables.
    pub(super) fn free_request_blocks(&mut self, id: RequestId) {
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        for g in 0..r.blocks.len() {
            let table = core::mem::take(&mut r.blocks[g]);
            self.pool.free_blocks(table.into_iter().rev());
            r.num_cached_blocks[g] = 0;
        }
    }

    /// The blocks a request still needs to hold its full sequence (reservation of in-flight
    /// prefills against async-load admission).
    pub(super) fn remaining_blocks(&self, id: RequestId) -> u32 {
        let r = &self.requests[&id];
        let full = r.num_tokens().min(self.config.max_model_len);
        (0..self.config.groups.len())
            .map(|g| {
                self.blocks_to_allocate(
                    g,
                    r.blocks[g].len() as u32,
                    &[],
                    full,
                    r.num_computed_tokens,
                )
            })
            .sum()
    }
}
