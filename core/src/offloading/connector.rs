//! The offloading connector as a [`SchedulerConnector`]: the scheduler's calls, in the order the
//! module docs of `offloading` list them.

use super::Access;
use super::ChunkId;
use super::Finished;
use super::GpuSpec;
use super::JobStatus;
use super::OffloadingConnector;
use super::OffloadingConnectorMeta;
use super::ReqState;
use super::TransferJob;
use super::cdiv;
use super::param_u32;
use crate::InvariantViolation;
use crate::ids::BlockId;
use crate::ids::NULL_BLOCK;
use crate::ids::RequestId;
use crate::messages::AggregatedOutput;
use crate::messages::CacheEvent;
use crate::messages::KvEvent;
use crate::messages::Medium;
use crate::messages::Meta;
use crate::messages::SchedulerOutput;
use crate::scheduler::ConnectorError;
use crate::scheduler::FinishDecision;
use crate::scheduler::Lookup;
use crate::scheduler::RequestStatus;
use crate::scheduler::SchedulerConnector;
use crate::scheduler::SchedulerView;
use crate::sorted_set::SortedSet;
use crate::tokens::BlockHash;
use alloc::collections::BTreeMap;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

impl SchedulerConnector for OffloadingConnector {
    type StepMeta = OffloadingConnectorMeta;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, request: RequestId) {
        let st = ReqState::new(
            self.groups.len(),
            param_u32(view, request, "max_load_tokens"),
            param_u32(view, request, "max_offload_tokens"),
        );
        self.requests.insert(request, st);
        self.manager.on_new_request(request);
    }

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let bpc = self.bpc();
        let Some(r) = view.request(request) else {
            return Lookup::MISS;
        };
        let Some(st) = self.requests.get_mut(&request) else {
            return Lookup::MISS;
        };
        for g in 0..st.block_ids.len() {
            st.block_ids[g].clear();
            st.next_stored_chunk[g] = 0;
        }
        if !st.jobs.is_empty() {
            // Still in flight (e.g. preempted with unflushed stores): ask again (issue #46014).
            return Lookup::Pending;
        }
        st.update_keys(r.block_hashes(), bpc);
        st.num_locally_computed_tokens = num_computed_tokens;
        let num_tokens = r.tokens().len() as u32;
        // Out of the map for the lookup, which may change the manager (a tier's promotion).
        let st = self.requests.remove(&request).expect("tracked above");
        let found = self.lookup_chunks(&st, request, num_tokens);
        self.requests.insert(request, st);
        let Some(hit) = found else {
            return Lookup::Pending;
        };
        // `_reserve_sync_load`.
        self.batch.sync_loads.remove(&request);
        let budget = self.config.sync_load_budget_tokens;
        let sync = budget > 0
            && hit > 0
            && num_computed_tokens + hit < num_tokens
            && self.batch.sync_load_tokens + hit <= budget;
        if sync {
            self.batch.sync_load_tokens += hit;
            self.batch.sync_loads.insert(request);
        }
        Lookup::Hit {
            tokens: hit,
            load_async: hit > 0 && !sync,
        }
    }

    fn update_state_after_alloc(
        &mut self,
        _view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        for group in blocks {
            self.batch
                .allocated
                .extend(group.iter().copied().filter(|&b| b != NULL_BLOCK));
        }
        if num_external_tokens == 0 {
            return;
        }
        let bs = self.block_size;
        let bpc = self.bpc();
        let tpc = self.tpc();
        let sync = self.batch.sync_loads.contains(&request);
        let Some(st) = self.requests.get_mut(&request) else {
            self.fail(ConnectorError::UntrackedRequest {
                call: "update_state_after_alloc".into(),
                request,
            });
            return;
        };
        let local = st.num_locally_computed_tokens;
        let cached = local + num_external_tokens;
        let ngroups = st.block_ids.len();
        let mut keys = Vec::new();
        let mut key_chunks = Vec::new();
        let mut per_group_keys = alloc::vec![0usize; ngroups];
        let mut gpu = GpuSpec {
            block_ids: alloc::vec![Vec::new(); ngroups],
            block_indices: alloc::vec![0; ngroups],
        };
        let num_chunks = cdiv(cached, tpc) as usize;
        for (g, group_keys) in per_group_keys.iter_mut().enumerate() {
            let table = blocks.get(g).map_or(&[][..], Vec::as_slice);
            let num_gpu_blocks = (cdiv(cached, bs) as usize).min(table.len());
            let first_fresh = cdiv(local, bs) as usize;
            // Fresh (unhashed) blocks start at the local hit; nulls lie below a window.
            let start = (first_fresh..num_gpu_blocks)
                .find(|&i| table[i] != NULL_BLOCK)
                .unwrap_or(num_gpu_blocks);
            if start < num_gpu_blocks {
                let first_chunk = start / bpc;
                for c in first_chunk..num_chunks.min(st.chunk_hashes.len()) {
                    keys.push(st.key(c, g));
                    key_chunks.push(c);
                    *group_keys += 1;
                }
            }
            gpu.block_ids[g] = table[start..num_gpu_blocks].to_vec();
            gpu.block_indices[g] = start as u32;
            // CHUNK_LEVEL: chunks hit (locally or loaded) are not offered for storing.
            st.next_stored_chunk[g] = num_chunks as u32;
        }
        let positions: Vec<u32> = key_chunks.iter().map(|&c| (c as u32 + 1) * tpc).collect();
        let host = match self.manager.prepare_load(
            &keys,
            Access {
                request: Some(request),
                positions: Some(&positions),
            },
        ) {
            Ok(h) => h,
            Err(e) => {
                self.fail(ConnectorError::StoreRefused {
                    op: "prepare_load".into(),
                    request,
                    kind: e.kind().into(),
                    detail: e.to_string(),
                });
                return;
            }
        };
        let mut chunks = Vec::with_capacity(ngroups);
        let mut it = host.into_iter();
        for n in per_group_keys {
            chunks.push(it.by_ref().take(n).collect::<Vec<ChunkId>>());
        }
        let job = self.new_job_id();
        if let Some(&other) = self.requests[&request].jobs.iter().next() {
            // A load is created only for a request without jobs (I-39; vLLM asserts).
            self.fail(ConnectorError::JobConflict {
                request,
                job,
                other,
            });
        }
        let st = self.requests.get_mut(&request).expect("looked up above");
        st.jobs.insert(job);
        if !sync && let Some(loading) = &mut self.chunks_being_loaded {
            loading.extend(keys.iter().copied());
        }
        self.jobs.insert(
            job,
            JobStatus {
                request,
                pending: self.config.num_workers,
                keys,
                is_store: false,
                is_sync_load: sync,
                fenced: Vec::new(),
                deferred_fence: Vec::new(),
                failed: false,
            },
        );
        self.batch.load_jobs.insert(
            job,
            TransferJob {
                request,
                gpu,
                chunks,
                sync,
            },
        );
    }

    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> OffloadingConnectorMeta {
        self.update_request_states(view, output);
        // Jobs of preempted requests, except loads created in this very batch.
        for id in output.preempted_req_ids.iter() {
            let Some(st) = self.requests.get(id) else {
                continue;
            };
            for j in &st.jobs {
                if !self.batch.load_jobs.contains_key(j) {
                    self.batch.jobs_to_flush.insert(*j);
                }
            }
        }
        // Jobs reading a block reallocated in this step.
        if !self.block_to_jobs.is_empty() {
            for b in &self.batch.allocated {
                if let Some(set) = self.block_to_jobs.get(b) {
                    self.batch.jobs_to_flush.extend(set.iter().copied());
                }
            }
        }
        let mut store_jobs = BTreeMap::new();
        for &(id, n) in &output.num_scheduled_tokens {
            self.build_store_job(view, id, n, &mut store_jobs);
        }
        let finished = self.take_finished_in_order(&output.finished_req_ids);
        for &id in &finished {
            self.build_store_job(view, id, 0, &mut store_jobs);
        }
        let batch = core::mem::take(&mut self.batch);
        let meta = OffloadingConnectorMeta {
            load_jobs: batch.load_jobs,
            store_jobs,
            jobs_to_flush: SortedSet::from_vec(batch.jobs_to_flush.into_iter().collect()),
        };
        for id in finished {
            let Some(st) = self.requests.get_mut(&id) else {
                continue;
            };
            st.finished_signaled = true;
            let idle = st.jobs.is_empty();
            self.manager.on_request_finished(id);
            if idle {
                self.requests.remove(&id);
            }
        }
        // The last manager call of the step (tiers hand out their promotions and probes).
        self.manager.on_schedule_end();
        meta
    }

    fn update_connector_output(
        &mut self,
        _view: &SchedulerView<'_>,
        output: &AggregatedOutput<Meta>,
    ) {
        let meta = match &output.worker_meta {
            None => return,
            Some(Meta::Offload(m)) => m,
            Some(other) => {
                self.fail(ConnectorError::WorkerMetaShape {
                    found: String::from(other.form()),
                    expected: String::from("offload"),
                });
                return;
            }
        };
        for (job, count) in meta.completed_jobs() {
            if count == 0 {
                let due = self.jobs.get(&job).map_or(0, |j| j.pending);
                self.fail(ConnectorError::BadAcknowledgement { job, count, due });
                continue;
            }
            if job.0 < self.stale_job_threshold {
                if let Some(left) = self.reset_fence.get_mut(&job) {
                    *left = left.saturating_sub(count);
                    if *left == 0 {
                        self.reset_fence.remove(&job);
                        if self.reset_fence.is_empty() {
                            self.resets_flushed += 1;
                            self.manager.on_reset_flushed();
                        }
                    }
                }
                continue;
            }
            let Some(j) = self.jobs.get_mut(&job) else {
                self.fail(ConnectorError::UnknownJob { job });
                continue;
            };
            if count > j.pending {
                let due = j.pending;
                self.fail(ConnectorError::BadAcknowledgement { job, count, due });
                continue;
            }
            j.pending -= count;
            j.failed |= meta.is_failed(job);
            if j.pending > 0 {
                continue;
            }
            let j = self.jobs.remove(&job).expect("present above");
            if j.is_store {
                // A store that failed on any rank left its chunks incomplete: freed.
                if let Err(e) = self.manager.complete_store(&j.keys, j.request, !j.failed) {
                    self.fail(ConnectorError::StoreRefused {
                        op: "complete_store".into(),
                        request: j.request,
                        kind: e.kind().into(),
                        detail: e.to_string(),
                    });
                }
            } else {
                if let Err(e) = self.manager.complete_load(&j.keys) {
                    self.fail(ConnectorError::StoreRefused {
                        op: "complete_load".into(),
                        request: j.request,
                        kind: e.kind().into(),
                        detail: e.to_string(),
                    });
                }
                if let Some(loading) = &mut self.chunks_being_loaded {
                    for k in &j.keys {
                        loading.remove(k);
                    }
                }
            }
            let finished = self
                .requests
                .get(&j.request)
                .is_some_and(|r| r.finished.is_some());
            if !self.block_to_jobs.is_empty() {
                self.remove_from_fence(job, &j.fenced);
                if finished {
                    self.remove_from_fence(job, &j.deferred_fence);
                }
            }
            if let Some(st) = self.requests.get_mut(&j.request) {
                st.jobs.remove(&job);
                if st.finished_signaled && st.jobs.is_empty() {
                    self.requests.remove(&j.request);
                }
            }
        }
    }

    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        _blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        let bpc = self.bpc();
        let Some(st) = self.requests.get_mut(&request) else {
            // Untracked: nothing in flight, nothing deferred; finalize at once.
            self.manager.on_request_finished(request);
            return FinishDecision::default();
        };
        if !self.finish_order.contains(&request) {
            self.finish_order.push(request);
        }
        if let Some(r) = view.request(request) {
            st.update_keys(r.block_hashes(), bpc);
            st.finished = Some(Finished {
                aborted: r.status() == RequestStatus::FinishedAborted,
                num_tokens: r.tokens().len() as u32,
                num_prompt_tokens: r.num_prompt_tokens(),
                num_computed_tokens: r.num_computed_tokens(),
            });
        }
        for job in &st.jobs {
            if let Some(j) = self.jobs.get(job) {
                for &b in &j.deferred_fence {
                    self.block_to_jobs.entry(b).or_default().insert(*job);
                }
            }
        }
        FinishDecision::default()
    }

    /// The manager's events as vLLM's placeholder payloads (medium CPU): one `Stored` per key
    /// (one hash, no parent, no tokens, block size 0), one `Removed` per group of a removal
    /// (groups ascending, hashes in the removal's order); rendered with [`KvEvent::from`].
    fn take_events(&mut self) -> Vec<KvEvent> {
        let mut events = Vec::new();
        for e in self.manager.take_events() {
            if e.removed {
                // One removal per group (the placeholder payload of vLLM's events tracker).
                let mut by_group: BTreeMap<u32, Vec<BlockHash>> = BTreeMap::new();
                for k in &e.keys {
                    by_group.entry(k.group).or_default().push(k.hash);
                }
                events.extend(
                    by_group
                        .into_iter()
                        .map(|(group, hashes)| CacheEvent::Removed {
                            medium: Medium::Cpu,
                            group,
                            hashes,
                        }),
                );
            } else {
                events.extend(e.keys.iter().map(|k| CacheEvent::Stored {
                    medium: Medium::Cpu,
                    group: k.group,
                    hashes: alloc::vec![k.hash],
                    parent: None,
                    tokens: Vec::new(),
                    block_size: 0,
                }));
            }
        }
        let out = events.iter().map(KvEvent::from).collect();
        if let Some(kept) = &mut self.cache_events {
            // Replaced, not appended: at most one call's events are kept (the scheduler drains
            // them right after this call).
            *kept = events;
        }
        out
    }

    fn set_cache_events(&mut self, on: bool) {
        match (on, &self.cache_events) {
            (true, None) => self.cache_events = Some(Vec::new()),
            (false, Some(_)) => self.cache_events = None,
            _ => {}
        }
    }

    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.cache_events
            .as_mut()
            .map(core::mem::take)
            .unwrap_or_default()
    }

    fn take_error(&mut self) -> Option<ConnectorError> {
        self.error.take()
    }

    fn has_pending_push_work(&self) -> bool {
        !self.jobs.is_empty() || !self.reset_fence.is_empty() || self.manager.has_pending_work()
    }

    fn meta_is_empty(&self, meta: &OffloadingConnectorMeta) -> bool {
        meta.load_jobs.is_empty() && meta.store_jobs.is_empty() && meta.jobs_to_flush.is_empty()
    }

    fn tracks_request(&self, request: RequestId) -> bool {
        self.tracks(request)
    }

    /// `reset_cache`. vLLM asserts that no step is half-built; the one case reachable between
    /// steps — a second reset before the first one's flush was delivered — answers `Some(false)`
    /// here and changes nothing.
    fn reset_cache(&mut self) -> Option<bool> {
        if !self.batch.load_jobs.is_empty()
            || !self.batch.sync_loads.is_empty()
            || !self.batch.jobs_to_flush.is_empty()
            || !self.batch.allocated.is_empty()
        {
            return Some(false);
        }
        if self.manager.reset_blocked() {
            // vLLM blocks until every tier job ended; here the runtime reports them first.
            return Some(false);
        }
        self.batch.jobs_to_flush.extend(self.jobs.keys().copied());
        let finished: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.finished.is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in finished {
            let st = self.requests.remove(&id).expect("listed above");
            if !st.finished_signaled {
                self.manager.on_request_finished(id);
            }
        }
        self.finish_order
            .retain(|id| self.requests.contains_key(id));
        self.manager.reset();
        for st in self.requests.values_mut() {
            st.next_stored_chunk.iter_mut().for_each(|n| *n = 0);
            st.jobs.clear();
        }
        self.stale_job_threshold = self.job_counter;
        if !self.jobs.is_empty() {
            for (&id, j) in &self.jobs {
                self.reset_fence.insert(id, j.pending);
            }
        } else if self.reset_fence.is_empty() {
            self.resets_flushed += 1;
            self.manager.on_reset_flushed();
        }
        self.jobs.clear();
        self.block_to_jobs.clear();
        if let Some(loading) = &mut self.chunks_being_loaded {
            loading.clear();
        }
        Some(true)
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Self::check_invariants(self)
    }
}
