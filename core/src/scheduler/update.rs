//! `update_from_output()`: applying an executed step's output (SEMANTICS.md §2.7): sampled
//! tokens, finishes, async completions, load failures.

use alloc::collections::BTreeSet;
use alloc::vec::Vec;

use super::InFlightStep;
use super::LoadFailurePolicy;
use super::SchedulerConnector;
use super::State;
use super::kv_cache::cdiv;
use super::{FinishReason, RequestOutput, RequestStatus, Scheduler, SchedulerError, StepResult};
use crate::Mode;
use crate::ids::{BlockId, RequestId, StepId};
use crate::messages::{Direction, KvEvent, ModelOutput};
use crate::sorted_set::SortedSet;
use crate::tokens::Token;

impl<C: SchedulerConnector> Scheduler<C> {
    /// The requests of a step in flight that sample a token (every scheduled request but a
    /// partial prefill chunk), each with the index its token will have: what a sampler must
    /// produce for [`Scheduler::update_from_output`], in scheduling order. Empty for a step that
    /// is not in flight.
    pub fn sampling(&self, step: StepId) -> impl Iterator<Item = (RequestId, u32)> + '_ {
        self.state
            .in_flight
            .iter()
            .filter(move |s| s.step == step)
            .flat_map(|s| s.scheduled.iter())
            .filter(|e| e.samples)
            .map(|e| (e.id, e.position))
    }

    /// Checks an output before anything is applied: bad input changes nothing.
    pub(super) fn validate_output(
        &self,
        step: StepId,
        output: &ModelOutput<C::WorkerMeta>,
    ) -> Result<(), SchedulerError> {
        let st = &self.state;
        let front = st.in_flight.front();
        if front.map(|s| s.step) != Some(step) {
            return Err(SchedulerError::StepOutOfOrder {
                expected: front.map(|s| s.step),
                got: step,
            });
        }
        let front = front.expect("checked");
        let mut scheduled: Vec<RequestId> = front.scheduled.iter().map(|e| e.id).collect();
        scheduled.sort_unstable();
        let mut sampled: Vec<RequestId> = output.sampled.iter().map(|(id, _)| *id).collect();
        sampled.sort_unstable();
        for (i, id) in sampled.iter().enumerate() {
            if (i > 0 && sampled[i - 1] == *id) || scheduled.binary_search(id).is_err() {
                return Err(SchedulerError::NotScheduled { step, id: *id });
            }
        }
        if let Some(kv) = &output.kv_connector_output {
            for id in kv
                .finished_sending
                .iter()
                .chain(kv.finished_recving.iter())
                .flat_map(|s| s.iter())
            {
                // (The pre-#32255 scheduler ignored unknown ids in `finished_recving`.)
                let ignored = st.frees_aborted_loads_at_once()
                    && kv.finished_recving.as_ref().is_some_and(|s| s.contains(id));
                if !st.requests.contains_key(id) && !ignored {
                    return Err(SchedulerError::UnknownRequest(*id));
                }
            }
            if st.config.mode == Mode::Strict {
                for id in kv.failed_recving.iter() {
                    if !st.requests.contains_key(id) {
                        return Err(SchedulerError::UnknownRequest(*id));
                    }
                }
            }
            for b in kv.invalid_block_ids.iter() {
                if !st.pool.contains(*b) {
                    return Err(SchedulerError::BlockOutOfRange(*b));
                }
            }
            if !kv.invalid_block_ids.is_empty() && st.config.groups.len() > 1 {
                return Err(SchedulerError::InvalidBlocksWithMultipleGroups);
            }
        }
        Ok(())
    }

    /// `update_from_output(step, output)`: apply the executed step's output (SEMANTICS.md §2.7).
    /// `step` must be the oldest step in flight.
    pub fn update_from_output(
        &mut self,
        step: StepId,
        output: ModelOutput<C::WorkerMeta>,
    ) -> Result<StepResult, SchedulerError> {
        let out = self.update_from_output_unchecked(step, output);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
        out
    }

    fn update_from_output_unchecked(
        &mut self,
        step: StepId,
        output: ModelOutput<C::WorkerMeta>,
    ) -> Result<StepResult, SchedulerError> {
        self.check_broken()?;
        self.validate_output(step, &output)?;
        let record = self.state.in_flight.pop_front().expect("validated");
        let kv = output.kv_connector_output;
        let recompute = self.state.config.load_failure_policy == LoadFailurePolicy::Recompute;

        // 2.–3. Load failures.
        let mut failed: BTreeSet<RequestId> = BTreeSet::new();
        if let Some(kv) = &kv {
            if !kv.failed_recving.is_empty() {
                failed.extend(self.handle_failed_recving(&kv.failed_recving));
            }
            if !kv.invalid_block_ids.is_empty() {
                failed.extend(self.handle_invalid_blocks(&kv.invalid_block_ids, &record));
            }
        }

        // 4. Per scheduled request.
        let mut result = StepResult::default();
        // Outputs usually come in scheduling order: take them by position, look up otherwise.
        let mut sampled: Vec<(RequestId, Vec<Token>)> = output.sampled;
        let in_order = sampled.len() == record.scheduled.len()
            && sampled
                .iter()
                .zip(&record.scheduled)
                .all(|((a, _), e)| *a == e.id);
        if !in_order {
            sampled.sort_unstable_by_key(|(id, _)| *id);
        }
        let mut stopped: Vec<RequestId> = Vec::new();
        for (pos, e) in record.scheduled.iter().enumerate() {
            let st = &mut self.state;
            let mut stale = false;
            if let Some(r) = st.requests.get_mut(&e.id) {
                r.num_in_flight_tokens = r.num_in_flight_tokens.saturating_sub(e.tokens);
                if r.num_stale_output_tokens > 0 {
                    stale = true;
                    r.num_stale_output_tokens = r.num_stale_output_tokens.saturating_sub(e.tokens);
                }
            }
            if failed.contains(&e.id) {
                continue;
            }
            let Some(r) = st.requests.get_mut(&e.id) else {
                continue;
            };
            if r.status.is_finished() || (stale && r.drop_stale_output) {
                continue;
            }
            let tokens = if in_order {
                core::mem::take(&mut sampled[pos].1)
            } else {
                match sampled.binary_search_by_key(&e.id, |(id, _)| *id) {
                    Ok(i) => core::mem::take(&mut sampled[i].1),
                    Err(_) => Vec::new(),
                }
            };
            if tokens.is_empty() {
                continue;
            }
            let was_running = r.status == RequestStatus::Running;
            let had_placeholders = r.num_output_placeholders > 0;
            let n_tokens = tokens.len() as u32;
            let mut kept = tokens;
            let mut finish = None;
            for i in 0..kept.len() {
                let t = kept[i];
                r.append_token(t, st.config.block_size);
                let reason = if Some(t) == r.stop_token {
                    Some(FinishReason::Stopped)
                } else if r.num_tokens() >= st.config.max_model_len
                    || r.num_output_tokens() >= r.max_tokens
                {
                    Some(FinishReason::LengthCapped)
                } else {
                    None
                };
                if let Some(reason) = reason {
                    if !stale {
                        r.num_computed_tokens -= n_tokens - (i as u32 + 1);
                    }
                    finish = Some(reason);
                    kept.truncate(i + 1);
                    break;
                }
            }
            if !stale && r.num_output_placeholders > 0 {
                r.num_output_placeholders = r.num_output_placeholders.saturating_sub(n_tokens);
            }
            if !stale && was_running && had_placeholders {
                let upto = r.num_computed_tokens.saturating_sub(r.num_in_flight_tokens);
                st.cache_blocks(e.id, upto);
            }
            let mut params = None;
            if let Some(reason) = finish {
                st.requests.get_mut(&e.id).expect("held").status = reason.status();
                stopped.push(e.id);
                params = self.free_request(e.id, false)?;
            }
            result.outputs.push(RequestOutput {
                id: e.id,
                new_tokens: kept,
                finish,
                kv_transfer_params: params,
            });
        }
        let st = &mut self.state;
        if !stopped.is_empty() {
            st.running.retain(|id| !stopped.contains(id));
            st.waiting.retain(|id| !stopped.contains(id));
            st.kv_holding_waiting.retain(|id| !stopped.contains(id));
        }

        // 5. Fail-policy errors.
        if !failed.is_empty() && !recompute {
            let ids: Vec<RequestId> = failed.iter().copied().collect();
            let outs = self.finish_requests(&ids, FinishReason::Error)?;
            result.outputs.extend(outs);
        }

        // 6. Transfer completions.
        if let Some(kv) = &kv {
            self.connector
                .update_connector_output(&self.state.view(), kv);
            self.apply_intents()?;
            for &id in kv.finished_recving.iter().flat_map(|s| s.iter()) {
                self.apply_completion(id, Direction::Recv)?;
            }
            for &id in kv.finished_sending.iter().flat_map(|s| s.iter()) {
                self.apply_completion(id, Direction::Send)?;
            }
        }

        // 8. Events.
        result.events = self.publish_events();
        Ok(result)
    }

    /// §2.7 step 8: returns the connector's opaque events (the step result's); with events on,
    /// publishes the step's structured batch for `take_cache_events` — the pool's events, then
    /// the connector's, as vLLM's `update_from_output`. The connector's structured events are
    /// drained every step, so it keeps at most one step's.
    fn publish_events(&mut self) -> Vec<KvEvent> {
        let events = self.connector.take_events();
        let connector_events = self.connector.take_cache_events();
        let st = &mut self.state;
        if st.pool.events_enabled() {
            let pool_events = st.pool.take_events();
            st.cache_events.extend(pool_events);
            st.cache_events.extend(connector_events);
        }
        events
    }

    /// One id of `finished_recving` / `finished_sending` (§2.7 6b–6c, I-15…I-17).
    pub(super) fn apply_completion(
        &mut self,
        id: RequestId,
        dir: Direction,
    ) -> Result<(), SchedulerError> {
        let strict = self.state.config.mode == Mode::Strict;
        let st = &mut self.state;
        if dir == Direction::Recv
            && !st.requests.contains_key(&id)
            && st.frees_aborted_loads_at_once()
        {
            return Ok(());
        }
        let Some(r) = st.requests.get_mut(&id) else {
            // Freed earlier in this call (both directions for one request, issue #46240): vLLM
            // asserts and crashes.
            return Err(self.fail(SchedulerError::StaleCompletion { id, direction: dir }));
        };
        if dir == Direction::Recv && r.status == RequestStatus::WaitingForRemoteKvs {
            if !st.finished_recving_kv_req_ids.insert(id) && strict {
                return Err(self.fail(SchedulerError::DuplicateCompletion { id, direction: dir }));
            }
            return Ok(());
        }
        if !r.status.is_finished() {
            let status = r.status;
            return Err(self.fail(SchedulerError::CompletionForLiveRequest {
                id,
                direction: dir,
                status,
            }));
        }
        if strict {
            let pending = match dir {
                Direction::Recv => &mut r.held_for_recv,
                Direction::Send => &mut r.held_for_send,
            };
            if !*pending {
                return Err(self.fail(SchedulerError::StaleCompletion { id, direction: dir }));
            }
            *pending = false;
            if r.held_for_recv || r.held_for_send {
                return Ok(());
            }
        }
        st.free_request_blocks(id);
        st.requests.remove(&id);
        Ok(())
    }

    /// `_handle_failed_recving` (I-36): returns the ids to error under the `fail` policy.
    pub(super) fn handle_failed_recving(
        &mut self,
        failed: &SortedSet<RequestId>,
    ) -> Vec<RequestId> {
        let st = &mut self.state;
        let recompute = st.config.load_failure_policy == LoadFailurePolicy::Recompute;
        let mut affected = Vec::new();
        for id in failed.iter() {
            if let Some(r) = st.requests.get_mut(id)
                && r.status == RequestStatus::WaitingForRemoteKvs
            {
                affected.push(*id);
                if recompute {
                    r.num_computed_tokens = 0;
                    st.failed_recving_kv_req_ids.insert(*id);
                }
            }
        }
        if recompute { Vec::new() } else { affected }
    }

    /// `_handle_invalid_blocks` (I-33…I-35): scan async loads, then running requests; returns
    /// the ids the per-request loop skips (and, under `fail`, errors).
    pub(super) fn handle_invalid_blocks(
        &mut self,
        invalid: &SortedSet<BlockId>,
        record: &InFlightStep,
    ) -> Vec<RequestId> {
        let st = &mut self.state;
        let recompute = st.config.load_failure_policy == LoadFailurePolicy::Recompute;
        let async_ids: Vec<RequestId> = st
            .kv_holding_waiting
            .iter()
            .copied()
            .filter(|id| st.requests[id].status == RequestStatus::WaitingForRemoteKvs)
            .collect();
        let (async_failed, _) = Self::truncate_invalid(st, &async_ids, invalid, record, false);
        let running = st.running.clone();
        let (sync_failed, evict) = Self::truncate_invalid(st, &running, invalid, record, true);
        if async_failed.is_empty() && sync_failed.is_empty() {
            return Vec::new();
        }
        if !recompute {
            st.pool.evict_blocks(evict);
            let mut all = async_failed;
            all.extend(sync_failed);
            return all;
        }
        st.failed_recving_kv_req_ids.extend(async_failed);
        sync_failed
    }

    /// `_update_requests_with_invalid_blocks`: one scan with its own claimed set (I-34).
    pub(super) fn truncate_invalid(
        st: &mut State,
        ids: &[RequestId],
        invalid: &SortedSet<BlockId>,
        record: &InFlightStep,
        evict: bool,
    ) -> (Vec<RequestId>, Vec<BlockId>) {
        let bs = st.config.block_size;
        let strict = st.config.mode == Mode::Strict;
        let mut affected = Vec::new();
        let mut to_evict = Vec::new();
        let mut claimed: BTreeSet<BlockId> = BTreeSet::new();
        for &id in ids {
            let r = st.requests.get_mut(&id).expect("queued requests are held");
            let scheduled = record
                .scheduled
                .iter()
                .find(|e| e.id == id)
                .map_or(0, |e| e.tokens);
            let pre = r.num_computed_tokens;
            let c0 = pre.saturating_sub(scheduled);
            let nblocks = cdiv(c0, bs) as usize;
            let table = &r.blocks[0];
            let mut is_affected = false;
            let mut marked = false;
            for (idx, b) in table.iter().take(nblocks).enumerate() {
                if !invalid.contains(b) {
                    continue;
                }
                is_affected = true;
                if !claimed.insert(*b) {
                    continue;
                }
                if marked {
                    continue;
                }
                marked = true;
                r.num_computed_tokens = idx as u32 * bs;
                if evict {
                    to_evict.extend_from_slice(&table[idx..]);
                }
            }
            if is_affected {
                if !marked {
                    r.num_computed_tokens = c0;
                }
                if evict && strict && r.num_in_flight_tokens > 0 {
                    // Async scheduling. vLLM skips the affected request's output but keeps the
                    // placeholder that output would have resolved, and counts the steps still
                    // in flight as computed: the request can then never reach `max_tokens`
                    // (`schedule`'s guard counts the placeholder as an output to come) or has
                    // nothing left to schedule, and stays RUNNING forever; compat reproduces
                    // this. Strict rolls back to the materialised frontier, as a preemption
                    // does: the outputs in flight were computed on the failed KV and are
                    // dropped, and their placeholders go with them.
                    let frontier = pre.saturating_sub(r.num_in_flight_tokens);
                    r.num_computed_tokens = r.num_computed_tokens.min(frontier);
                    r.drop_stale_output = true;
                    r.num_stale_output_tokens = r.num_in_flight_tokens;
                    r.num_output_placeholders = 0;
                }
                affected.push(id);
            }
        }
        (affected, to_evict)
    }
}
