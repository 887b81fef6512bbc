//! Stores: which chunks of a request are offloaded each step, and the per-request bookkeeping the
//! scheduler output drives (allocated blocks, fences).

use super::Access;
use super::ChunkId;
use super::GpuSpec;
use super::JobStatus;
use super::OffloadKey;
use super::PrepareStoreOutput;
use super::TieringError;
use super::TransferJob;
use super::{OffloadingConnector, ReqState};
use crate::ids::BlockId;
use crate::ids::JobId;
use crate::ids::NULL_BLOCK;
use crate::ids::RequestId;
use crate::messages::SchedulerOutput;
use crate::scheduler::ConnectorError;
use crate::scheduler::GroupKind;
use crate::scheduler::SchedulerView;
use crate::sorted_set::SortedSet;
use alloc::collections::BTreeMap;
use alloc::string::ToString;
use alloc::vec::Vec;

impl OffloadingConnector {
    /// `_build_store_jobs` for one request.
    pub(super) fn build_store_job(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        scheduled: u32,
        store_jobs: &mut BTreeMap<JobId, TransferJob>,
    ) {
        let Some(st) = self.requests.get(&id) else {
            return;
        };
        let (num_tokens, num_prompt, after_batch, finished) = match (st.finished, view.request(id))
        {
            (Some(f), _) => {
                let n = if f.aborted {
                    f.num_computed_tokens
                } else {
                    f.num_prompt_tokens.max(f.num_tokens.saturating_sub(1))
                };
                (f.num_tokens, f.num_prompt_tokens, n, true)
            }
            (None, Some(r)) => (
                r.tokens().len() as u32,
                r.num_prompt_tokens(),
                r.num_computed_tokens() + scheduled,
                false,
            ),
            (None, None) => return,
        };
        let offloadable = {
            let mut n = after_batch.min(num_tokens);
            if let Some(m) = st.max_offload_tokens {
                n = n.min(m);
            }
            if self.config.offload_prompt_only {
                n = n.min(num_prompt);
            }
            n
        };
        let bpc = self.bpc();
        let tpc = self.tpc();
        let ngroups = self.groups.len();
        let storable = |st: &ReqState, g: usize| -> usize {
            ((offloadable / tpc) as usize)
                .min(st.block_ids[g].len() / bpc)
                .min(st.chunk_hashes.len())
        };
        let mut keys: Vec<OffloadKey> = Vec::new();
        let mut positions: Vec<u32> = Vec::new();
        let mut ranges: [(usize, usize); 8] = [(0, 0); 8];
        for (g, range) in ranges.iter_mut().enumerate().take(ngroups) {
            let num_chunks = storable(st, g);
            let start = st.next_stored_chunk[g] as usize;
            *range = (start, num_chunks);
            let need = self.swa_reachable(g);
            let table = &st.block_ids[g];
            for c in start..num_chunks {
                let blocks = &table[c * bpc..(c + 1) * bpc];
                if blocks[bpc - 1] == NULL_BLOCK {
                    continue;
                }
                // Blocks that can serve a hit: all, or the last `need` of the chunk.
                let first_reachable = match need {
                    None => 0,
                    Some(need) => bpc - need as usize,
                };
                if first_reachable >= bpc {
                    continue;
                }
                if blocks[first_reachable..].contains(&NULL_BLOCK) {
                    continue;
                }
                keys.push(st.key(c, g));
                positions.push((c as u32 + 1) * tpc);
            }
        }
        let advance = |st: &mut ReqState| {
            for g in 0..ngroups {
                let n = storable(st, g) as u32;
                st.next_stored_chunk[g] = st.next_stored_chunk[g].max(n);
            }
        };
        if keys.is_empty() {
            let st = self.requests.get_mut(&id).expect("looked up above");
            advance(st);
            return;
        }
        let out = self.manager.prepare_store(
            &keys,
            Access {
                request: Some(id),
                positions: Some(&positions),
            },
        );
        let Some(out) = self.prepared(id, out) else {
            return;
        };
        let st = self.requests.get_mut(&id).expect("looked up above");
        if out.keys_to_store.is_empty() {
            advance(st);
            return;
        }
        let chunk_of: BTreeMap<OffloadKey, ChunkId> = out
            .keys_to_store
            .iter()
            .copied()
            .zip(out.chunks.iter().copied())
            .collect();
        let mut gpu = GpuSpec {
            block_ids: alloc::vec![Vec::new(); ngroups],
            block_indices: alloc::vec![0; ngroups],
        };
        let mut chunks: Vec<Vec<ChunkId>> = alloc::vec![Vec::new(); ngroups];
        let mut fenced = Vec::new();
        let mut deferred = Vec::new();
        for (g, &(start, num_chunks)) in ranges.iter().enumerate().take(ngroups) {
            let swa = matches!(self.groups[g], GroupKind::SlidingWindow { .. });
            let mut first: Option<u32> = None;
            for c in start..num_chunks {
                let Some(&chunk) = chunk_of.get(&st.key(c, g)) else {
                    continue;
                };
                chunks[g].push(chunk);
                for i in 0..bpc {
                    let b = st.block_ids[g][c * bpc + i];
                    if b == NULL_BLOCK {
                        continue;
                    }
                    first.get_or_insert((c * bpc + i) as u32);
                    gpu.block_ids[g].push(b);
                    if swa {
                        fenced.push(b);
                    } else {
                        deferred.push(b);
                    }
                }
            }
            gpu.block_indices[g] = first.unwrap_or(0);
            st.next_stored_chunk[g] = st.next_stored_chunk[g].max(num_chunks as u32);
        }
        let job = JobId(self.job_counter);
        self.job_counter += 1;
        // A store may join stores or a sync load, never an async load (I-39).
        if let Some(other) = st.jobs.iter().next()
            && let Some(o) = self.jobs.get(other)
            && !(o.is_store || o.is_sync_load)
        {
            let other = *other;
            self.fail(ConnectorError::JobConflict {
                request: id,
                job,
                other,
            });
        }
        let st = self.requests.get_mut(&id).expect("looked up above");
        st.jobs.insert(job);
        for &b in &fenced {
            self.block_to_jobs.entry(b).or_default().insert(job);
        }
        if finished {
            for &b in &deferred {
                self.block_to_jobs.entry(b).or_default().insert(job);
                if self.batch.allocated.binary_search(&b).is_ok() {
                    self.batch.jobs_to_flush.insert(job);
                }
            }
        }
        self.jobs.insert(
            job,
            JobStatus {
                request: id,
                pending: self.config.num_workers,
                keys: out.keys_to_store,
                is_store: true,
                is_sync_load: false,
                fenced,
                deferred_fence: deferred,
                failed: false,
            },
        );
        store_jobs.insert(
            job,
            TransferJob {
                request: id,
                gpu,
                chunks,
                sync: false,
            },
        );
    }

    /// `_update_req_states`.
    pub(super) fn update_request_states(
        &mut self,
        view: &SchedulerView<'_>,
        out: &SchedulerOutput,
    ) {
        let bpc = self.bpc();
        if view.config().mode == crate::Mode::Strict {
            // Strict: a preempted request's blocks are freed (other requests may be given them
            // this very step), so its table is dropped. Under async scheduling a request can
            // still finish after its preemption, from an output in flight, and its finish's
            // stores must not read blocks it no longer holds (vLLM keeps the table and stores
            // from it: docs/COMPAT.md).
            for id in out.preempted_req_ids.iter() {
                if let Some(st) = self.requests.get_mut(id) {
                    st.block_ids.iter_mut().for_each(Vec::clear);
                }
            }
        }
        let mut ends: BTreeMap<RequestId, Vec<usize>> = BTreeMap::new();
        for req in out.scheduled_requests() {
            let (id, blocks, full) = (req.id, req.block_ids, req.full_table);
            let Some(st) = self.requests.get_mut(&id) else {
                continue;
            };
            if let Some(r) = view.request(id) {
                st.update_keys(r.block_hashes(), bpc);
            }
            if full {
                st.block_ids.iter_mut().for_each(Vec::clear);
            }
            if blocks.is_empty() {
                continue;
            }
            if !self.swa_groups.is_empty() {
                ends.insert(
                    id,
                    self.swa_groups
                        .iter()
                        .map(|&g| st.block_ids[g].len())
                        .collect(),
                );
            }
            for (g, table) in st.block_ids.iter_mut().enumerate() {
                let Some(new_blocks) = blocks.get(g) else {
                    continue;
                };
                table.extend_from_slice(new_blocks);
                self.batch
                    .allocated
                    .extend(new_blocks.iter().copied().filter(|&b| b != NULL_BLOCK));
            }
        }
        // The allocated set is needed (sorted, for lookups) only with sliding-window groups, a
        // non-empty fence index, or finished requests whose stores get fenced at creation.
        if !self.swa_groups.is_empty()
            || !self.block_to_jobs.is_empty()
            || !out.finished_req_ids.is_empty()
        {
            self.batch.seal_allocated();
        }
        // Stale sliding-window entries (freed below the window, then reallocated) are zeroed.
        if !self.swa_groups.is_empty() && !self.batch.allocated.is_empty() {
            for (id, st) in self.requests.iter_mut() {
                let ends = ends.get(id);
                for (i, &g) in self.swa_groups.iter().enumerate() {
                    let start = st.next_stored_chunk[g] as usize * bpc;
                    let end = ends.map_or(st.block_ids[g].len(), |e| e[i]);
                    for j in start..end.min(st.block_ids[g].len()) {
                        if self
                            .batch
                            .allocated
                            .binary_search(&st.block_ids[g][j])
                            .is_ok()
                        {
                            st.block_ids[g][j] = NULL_BLOCK;
                        }
                    }
                }
            }
        }
    }

    /// The ids of a step's `finished_req_ids` in the order their requests finished (ids the
    /// connector never saw finish, in id order, after them), taken out of `finish_order`: the
    /// order their last stores are built and `on_request_finished` is signalled in. vLLM
    /// iterates the set there, in Python's hash-seed order; kvrelay fixes finish order, so a
    /// request that finished later is the more recently used.
    pub(super) fn take_finished_in_order(&mut self, ids: &SortedSet<RequestId>) -> Vec<RequestId> {
        let mut ordered: Vec<RequestId> = Vec::with_capacity(ids.len());
        self.finish_order.retain(|id| {
            let delivered = ids.contains(id);
            if delivered {
                ordered.push(*id);
            }
            !delivered
        });
        if ordered.len() < ids.len() {
            let unseen = ids.iter().filter(|id| !ordered.contains(id)).copied();
            ordered.extend(unseen.collect::<Vec<_>>());
        }
        ordered
    }

    pub(super) fn remove_from_fence(&mut self, job: JobId, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(set) = self.block_to_jobs.get_mut(b) {
                set.remove(&job);
                if set.is_empty() {
                    self.block_to_jobs.remove(b);
                }
            }
        }
    }
}

impl OffloadingConnector {
    /// What a store's `prepare_store` came to: the output, or `None` after counting an
    /// allocation failure or failing the connector on a refusal.
    fn prepared(
        &mut self,
        id: RequestId,
        out: Result<Option<PrepareStoreOutput>, TieringError>,
    ) -> Option<PrepareStoreOutput> {
        match out {
            Ok(Some(out)) => Some(out),
            Ok(None) => {
                self.allocation_failures += 1;
                None
            }
            Err(e) => {
                self.fail(ConnectorError::StoreRefused {
                    op: "prepare_store".into(),
                    request: id,
                    kind: e.kind().into(),
                    detail: e.to_string(),
                });
                None
            }
        }
    }
}
