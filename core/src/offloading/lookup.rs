//! Hits: how many tokens beyond the local hit can be loaded from ready chunks (full attention:
//! the longest prefix; sliding window: the last window), and the hybrid convergence of groups.

use super::LookupResult;
use super::cdiv;
use super::{OffloadingConnector, ReqState};
use crate::ids::RequestId;
use crate::scheduler::GroupKind;

impl OffloadingConnector {
    /// Chunks a sliding-window group must have ready at the end of a hit of `num_tokens`
    /// (`load_window_size_in_chunks`); `None` for full attention.
    pub(super) fn load_window(&self, g: usize, num_tokens: u32) -> Option<u32> {
        let GroupKind::SlidingWindow { window } = self.groups[g] else {
            return None;
        };
        let tpc = self.tpc();
        let right_padding = (tpc - num_tokens % tpc) % tpc;
        Some(cdiv(window, tpc).max(cdiv(window - 1 + right_padding, tpc)))
    }

    pub(super) fn window_chunks(&self, g: usize) -> Option<u32> {
        match self.groups[g] {
            GroupKind::SlidingWindow { window } => Some(cdiv(window, self.tpc())),
            GroupKind::FullAttention => None,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Lookup.

    /// `_maximal_prefix_lookup`: consecutive ready-or-pending chunks from `from`; `None` when a
    /// counted one is write-pending or a tier asks to retry (the scan goes on past a retry, so
    /// that every tier probe of the prefix starts this step).
    pub(super) fn prefix_lookup(
        &mut self,
        st: &ReqState,
        request: RequestId,
        g: usize,
        from: usize,
        to: usize,
    ) -> Option<u32> {
        let mut hits = 0;
        let mut defer = false;
        for c in from..to {
            match self.lookup_key(st, request, c, g) {
                LookupResult::Hit => hits += 1,
                LookupResult::HitPending => {
                    hits += 1;
                    defer = true;
                }
                LookupResult::Retry => defer = true,
                LookupResult::Miss => break,
            }
        }
        (!defer).then_some(hits)
    }

    /// `_sliding_window_lookup`: the end (relative to `from`) of the last run of `window`
    /// consecutive hits, scanning from the end; the first (rightmost) run may need `initial`.
    pub(super) fn window_lookup(
        &mut self,
        st: &ReqState,
        request: RequestId,
        g: usize,
        (from, to): (usize, usize),
        window: u32,
        initial: u32,
    ) -> Option<u32> {
        let mut pending = false;
        let mut defer = false;
        let mut run = 0;
        let mut required = if initial == 0 { window } else { initial };
        for idx in (0..to - from).rev() {
            match self.lookup_key(st, request, from + idx, g) {
                LookupResult::Hit => run += 1,
                LookupResult::HitPending => {
                    pending = true;
                    run += 1;
                }
                LookupResult::Retry => {
                    // Not a hit either, but the answer is deferred.
                    defer = true;
                    run = 0;
                    pending = false;
                    required = window;
                }
                LookupResult::Miss => {
                    run = 0;
                    pending = false;
                    required = window;
                }
            }
            if run == required {
                return (!(defer || pending)).then_some(idx as u32 + required);
            }
        }
        (!(defer || pending)).then_some(run)
    }

    /// The manager's lookup of chunk `c` of group `g` (its key ends at token `(c + 1) × tpc`).
    fn lookup_key(
        &mut self,
        st: &ReqState,
        request: RequestId,
        c: usize,
        g: usize,
    ) -> LookupResult {
        let position = (c as u32 + 1) * self.tpc();
        self.manager.lookup(st.key(c, g), request, position)
    }

    /// `_lookup_complete_chunks`: tokens loadable beyond the local hit, `None` = ask again.
    pub(super) fn lookup_chunks(
        &mut self,
        st: &ReqState,
        request: RequestId,
        num_tokens: u32,
    ) -> Option<u32> {
        // The group orders are shared (`Arc`), so holding them does not hold `self`.
        let (lookup_groups, swa_groups) = (self.lookup_groups.clone(), self.swa_groups.clone());
        let tpc = i64::from(self.tpc());
        let computed = i64::from(st.num_locally_computed_tokens);
        let mut max_hit = i64::from(num_tokens);
        if let Some(m) = st.max_load_tokens {
            max_hit = max_hit.min(computed + i64::from(m));
        }
        if !self.swa_groups.is_empty() {
            // The last prompt token is recomputed for its logprobs under sliding windows.
            max_hit -= 1;
        }
        let nkeys = st.chunk_hashes.len() as i64;
        let mut num_hit: i64 = 0;
        let mut defer = false;
        let mut groups: &[usize] = &lookup_groups;
        while !groups.is_empty() {
            let mut looked_up_swa = false;
            let current = groups;
            groups = &[];
            for &g in current {
                max_hit = max_hit.min(nkeys * tpc);
                if st.max_load_tokens.is_some() {
                    max_hit = max_hit.div_euclid(tpc) * tpc;
                }
                if max_hit - computed < tpc {
                    return Some(0);
                }
                let num_chunks = ((max_hit + tpc - 1) / tpc).min(nkeys) as usize;
                let start = (computed / tpc) as usize;
                let hits = match self.window_chunks(g) {
                    None => self.prefix_lookup(st, request, g, start, num_chunks),
                    Some(window) => {
                        let candidate_end = max_hit.min(num_chunks as i64 * tpc);
                        let initial = self
                            .load_window(g, candidate_end as u32)
                            .expect("a sliding-window group");
                        self.window_lookup(st, request, g, (start, num_chunks), window, initial)
                    }
                };
                match hits {
                    Some(0) => return Some(0),
                    None => defer = true,
                    Some(n) => max_hit = max_hit.min(tpc * (start as i64 + i64::from(n))),
                }
                let new_hit = max_hit - computed;
                if new_hit < tpc {
                    return Some(0);
                }
                if new_hit < num_hit {
                    if defer {
                        defer = false;
                        groups = &lookup_groups;
                    } else if looked_up_swa && groups.is_empty() {
                        groups = &swa_groups;
                    }
                }
                looked_up_swa |= self.window_chunks(g).is_some();
                num_hit = new_hit;
            }
        }
        if defer {
            return None;
        }
        let num_hit = num_hit as u32;
        if let Some(loading) = &self.chunks_being_loaded
            && !loading.is_empty()
        {
            let end = st.num_locally_computed_tokens + num_hit;
            let start = (st.num_locally_computed_tokens / self.tpc()) as usize;
            let num_chunks = (cdiv(end, self.tpc()) as usize).min(st.chunk_hashes.len());
            for g in 0..self.groups.len() {
                let mut from = start.min(num_chunks);
                if let Some(w) = self.load_window(g, end) {
                    from = from.max(num_chunks.saturating_sub(w as usize));
                }
                if (from..num_chunks).any(|c| loading.contains(&st.key(c, g))) {
                    return None;
                }
            }
        }
        Some(num_hit)
    }

    // -----------------------------------------------------------------------------------------
    // Store jobs.

    /// Whether block `i` (absolute table index) of a sliding-window group can serve a hit at a
    /// chunk boundary (`reachable_block_mask` with chunk alignment); `None` = every block.
    pub(super) fn swa_reachable(&self, g: usize) -> Option<u32> {
        let GroupKind::SlidingWindow { window } = self.groups[g] else {
            return None;
        };
        let need = cdiv(window - 1, self.block_size);
        (need < self.config.blocks_per_chunk).then_some(need)
    }
}
