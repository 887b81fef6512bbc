//! `schedule()`: one engine step (SEMANTICS.md §2.3), in vLLM's phases:
//!
//! 1. [`Scheduler::schedule_running`] — running requests, oldest first, preempting from the back
//!    when blocks run out;
//! 2. [`Scheduler::schedule_waiting`] — if nothing was preempted, waiting requests: promote
//!    finished async loads, look up hits ([`Scheduler::lookup`]), allocate, tell the connector;
//!    each request's admission is [`Scheduler::admit`];
//! 3. [`Scheduler::build_output`] — the [`SchedulerOutput`], then the connector's metadata;
//! 4. [`Scheduler::advance`] — computed tokens advance, async scheduling adds placeholders, the
//!    step goes in flight.
//!
//! A [`Pass`] carries what the phases build together: the token budget and the step's lists.

use alloc::collections::VecDeque;
use alloc::vec::Vec;

use super::{
    ConnectorError, InFlightStep, RequestStatus, ScheduledEntry, Scheduler, SchedulerError,
};
use super::{Lookup, SchedulerConnector};
use crate::Mode;
use crate::ids::{BlockId, RequestId, StepId};
use crate::messages::{CachedRequestData, NewRequestData, ScheduledStep, SchedulerOutput};
use crate::sorted_set::SortedSet;

/// One `schedule()` call's work in progress.
struct Pass {
    /// Tokens still schedulable this step.
    budget: u32,
    /// `long_prefill_token_threshold`, or 0 when at most one request is eligible.
    threshold: u32,
    /// (request, tokens) in scheduling order.
    scheduled: Vec<(RequestId, u32)>,
    new_reqs: Vec<NewRequestData>,
    cached_reqs: Vec<CachedRequestData>,
    preempted_any: bool,
    has_sync_kv_loads: bool,
}

/// What [`Scheduler::admit`] did with the request at the head of a waiting queue.
enum Admission {
    /// Scheduled (running now).
    Scheduled,
    /// Not schedulable this step (a pending lookup or load, an async load just started): it
    /// goes back to its queue after the pass.
    Skipped,
    /// The pass stops here (out of blocks, or a whole prompt does not fit the budget).
    Stop,
}

/// The hit a waiting request is admitted with: the local prefix-cache hit and the connector's
/// external tokens.
struct Hit {
    /// Per group, the locally cached blocks (`None` for a resumed request, which keeps its
    /// computed tokens).
    local: Option<(Vec<Vec<BlockId>>, u32)>,
    /// Tokens the connector loads.
    external: u32,
    load_async: bool,
    /// Tokens computed once the hit is in place.
    num_computed: u32,
}

impl<C: SchedulerConnector> Scheduler<C> {
    /// `schedule()`: one engine step. See SEMANTICS.md §2.3 and the module docs.
    pub fn schedule(&mut self) -> Result<ScheduledStep<C::StepMeta>, SchedulerError> {
        let out = self.schedule_unchecked();
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
        out
    }

    fn schedule_unchecked(&mut self) -> Result<ScheduledStep<C::StepMeta>, SchedulerError> {
        self.check_broken()?;
        let depth = self.state.config.async_depth;
        if self.state.in_flight.len() as u32 >= depth {
            return Err(SchedulerError::PipelineFull { depth });
        }
        let n_running = self.state.running.len();
        let n_eligible = n_running + self.state.waiting.len() + self.state.kv_holding_waiting.len();
        let mut pass = Pass {
            budget: self.state.config.max_num_batched_tokens,
            threshold: if n_eligible > 1 {
                self.state.config.long_prefill_token_threshold
            } else {
                0
            },
            scheduled: Vec::with_capacity(n_running),
            new_reqs: Vec::new(),
            cached_reqs: Vec::with_capacity(n_running),
            preempted_any: false,
            has_sync_kv_loads: false,
        };
        self.schedule_running(&mut pass);
        if !pass.preempted_any {
            self.schedule_waiting(&mut pass)?;
        }
        let output = self.build_output(pass);
        let meta = self
            .connector
            .build_connector_meta(&self.state.view(), &output);
        self.apply_intents()?;
        self.advance(&output);
        Ok(ScheduledStep { output, meta })
    }

    /// Phase 1: running requests in order, each as many tokens as it can take; when blocks run
    /// out, the last running request is preempted (FCFS) until the allocation fits or the
    /// request preempted itself. A connector with pending block frees stops the phase instead.
    fn schedule_running(&mut self, pass: &mut Pass) {
        let max_model_len = self.state.config.max_model_len;
        let mut idx = 0;
        while idx < self.state.running.len() && pass.budget > 0 {
            let id = self.state.running[idx];
            let r = &self.state.requests[&id];
            if r.num_output_placeholders > 0
                && (r.num_computed_tokens + 2).saturating_sub(r.num_output_placeholders)
                    >= r.num_prompt_tokens + r.max_tokens
            {
                idx += 1;
                continue;
            }
            let mut n =
                (r.num_tokens() + r.num_output_placeholders).saturating_sub(r.num_computed_tokens);
            if pass.threshold > 0 && pass.threshold < n {
                n = pass.threshold;
            }
            n = n.min(pass.budget);
            n = n.min(max_model_len.saturating_sub(r.num_computed_tokens + 1));
            if n == 0 {
                idx += 1;
                continue;
            }
            let computed_before = r.num_computed_tokens;
            let new_blocks = loop {
                if let Some(b) = self.state.allocate_slots(id, n, None, 0, false, 0) {
                    break Some(b);
                }
                if self.connector.has_pending_block_frees(&self.state.view()) {
                    break None;
                }
                let victim = self.state.running.pop().expect("id itself is running");
                // FCFS: the victim is the last running request, never one scheduled earlier in
                // this loop (those sit before `idx`).
                self.preempt(victim);
                pass.preempted_any = true;
                if victim == id {
                    break None;
                }
            };
            let Some(new_blocks) = new_blocks else {
                break;
            };
            pass.scheduled.push((id, n));
            pass.cached_reqs.push(CachedRequestData {
                id,
                resumed: false,
                new_block_ids: new_blocks,
                num_computed_tokens: computed_before,
            });
            pass.budget -= n;
            idx += 1;
        }
    }

    /// Phase 2: the waiting queues, `kv_holding_waiting` first, while budget and `max_num_seqs`
    /// allow. Requests that cannot be scheduled now are skipped and go back to the front of
    /// their queue afterwards, in order.
    ///
    /// A connector breaking its contract stops the pass with a sticky error; the requests
    /// skipped so far (pending lookups, loads started this pass) still go back to their queues,
    /// so the stopped scheduler's state stays consistent (I-16, I-18).
    fn schedule_waiting(&mut self, pass: &mut Pass) -> Result<(), SchedulerError> {
        let mut skipped_holding: VecDeque<RequestId> = VecDeque::new();
        let mut skipped_waiting: VecDeque<RequestId> = VecDeque::new();
        let mut result = Ok(());
        while pass.budget > 0 {
            let from_holding = !self.state.kv_holding_waiting.is_empty();
            let queue_front = if from_holding {
                self.state.kv_holding_waiting.front()
            } else {
                self.state.waiting.front()
            };
            let Some(&id) = queue_front else { break };
            if self.state.running.len() as u32 >= self.state.config.max_num_seqs {
                break;
            }
            match self.admit(id, from_holding, pass) {
                Ok(Admission::Scheduled) => {}
                Ok(Admission::Skipped) => {
                    let st = &mut self.state;
                    if from_holding {
                        st.kv_holding_waiting.pop_front();
                    } else {
                        st.waiting.pop_front();
                    }
                    if st.requests[&id].holds_kv_blocks() {
                        skipped_holding.push_front(id);
                    } else {
                        skipped_waiting.push_front(id);
                    }
                }
                Ok(Admission::Stop) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        for id in skipped_holding {
            self.state.kv_holding_waiting.push_front(id);
        }
        for id in skipped_waiting {
            self.state.waiting.push_front(id);
        }
        result
    }

    /// One waiting request at the head of its queue (`from_holding`: `kv_holding_waiting`):
    /// (a) a finished async load is promoted, a pending one skipped; (b) the hit is looked up;
    /// (c) slots are allocated; (d) the connector learns of the admission (I-8); (e) an async
    /// load parks the request in `WAITING_FOR_REMOTE_KVS`, anything else runs.
    fn admit(
        &mut self,
        id: RequestId,
        from_holding: bool,
        pass: &mut Pass,
    ) -> Result<Admission, SchedulerError> {
        // a. Blocked on an async load.
        if self.state.requests[&id].status == RequestStatus::WaitingForRemoteKvs {
            if !self.state.finished_recving_kv_req_ids.contains(&id) {
                return Ok(Admission::Skipped);
            }
            self.update_waiting_for_remote_kv(id);
            // A failed load recomputed from scratch gave its blocks back but is still at the
            // head of `kv_holding_waiting`. vLLM (compat) admits it from there: if it cannot
            // allocate, the loop stops, and the finished loads behind it are never promoted and
            // keep their blocks, possibly forever. Strict moves it to the waiting queue (tried
            // from the next step on).
            if self.state.config.mode == Mode::Strict
                && from_holding
                && self.state.requests[&id].blocks.iter().all(Vec::is_empty)
            {
                return Ok(Admission::Skipped);
            }
        }
        let r = &self.state.requests[&id];
        if r.num_stale_output_tokens > 0 && !r.drop_stale_output {
            return Ok(Admission::Skipped);
        }
        // b. Lookups.
        let Some(hit) = self.lookup(id)? else {
            return Ok(Admission::Skipped);
        };
        let r = &self.state.requests[&id];
        let num_new = if hit.load_async {
            0
        } else {
            let mut n = r.num_tokens() - hit.num_computed;
            if pass.threshold > 0 && pass.threshold < n {
                n = pass.threshold;
            }
            if !self.state.config.enable_chunked_prefill && n > pass.budget {
                return Ok(Admission::Stop);
            }
            n.min(pass.budget)
        };
        let reserved = if hit.load_async {
            // vLLM (compat) counts every in-flight prefill's reservation, the request's own
            // included when a failed load left it in the set (`_inflight_prefills` is not
            // cleared by `_update_waiting_for_remote_kv`): admitting it again as an async load
            // then needs its blocks twice, and in a pool that holds them once it never runs.
            // Strict leaves the request's own reservation out.
            let strict = self.state.config.mode == Mode::Strict;
            let ids: Vec<RequestId> = self
                .state
                .inflight_prefills
                .iter()
                .copied()
                .filter(|&p| !(strict && p == id))
                .collect();
            ids.iter().map(|&p| self.state.remaining_blocks(p)).sum()
        } else {
            0
        };
        // c. Allocation.
        let allocated = self.state.allocate_slots(
            id,
            num_new,
            hit.local.as_ref(),
            hit.external,
            hit.load_async,
            reserved,
        );
        if allocated.is_none() {
            return Ok(Admission::Stop);
        }
        // d. The connector learns about every admission (I-8).
        let blocks = self.state.requests[&id].blocks.clone();
        self.connector
            .update_state_after_alloc(&self.state.view(), id, &blocks, hit.external);
        self.apply_intents()?;
        // e. Async load: wait in WAITING_FOR_REMOTE_KVS.
        let st = &mut self.state;
        if hit.load_async {
            let r = st.requests.get_mut(&id).expect("held");
            r.status = RequestStatus::WaitingForRemoteKvs;
            r.num_computed_tokens = hit.num_computed;
            st.inflight_prefills.insert(id);
            return Ok(Admission::Skipped);
        }
        if from_holding {
            st.kv_holding_waiting.pop_front();
        } else {
            st.waiting.pop_front();
        }
        st.running.push(id);
        if hit.external > 0 {
            pass.has_sync_kv_loads = true;
        }
        let r = st.requests.get_mut(&id).expect("held");
        let resumed = r.status == RequestStatus::Preempted;
        r.status = RequestStatus::Running;
        r.num_computed_tokens = hit.num_computed;
        if resumed {
            pass.cached_reqs.push(CachedRequestData {
                id,
                resumed: true,
                new_block_ids: r.blocks.clone(),
                num_computed_tokens: hit.num_computed,
            });
        } else {
            pass.new_reqs.push(NewRequestData {
                id,
                block_ids: r.blocks.clone(),
                num_computed_tokens: hit.num_computed,
            });
        }
        if hit.num_computed + num_new < r.num_tokens() {
            st.inflight_prefills.insert(id);
        }
        pass.scheduled.push((id, num_new));
        pass.budget -= num_new;
        Ok(Admission::Scheduled)
    }

    /// The hit of a waiting request: for a request with nothing computed, the local prefix-cache
    /// hit and the connector's answer to `get_num_new_matched_tokens` (checked: an async load of
    /// 0 tokens, or a hit leaving a sync load no token to compute, breaks the contract);
    /// otherwise (resumed after a failed load, tokens kept) the tokens it has. `None`: the
    /// connector's lookup is pending.
    fn lookup(&mut self, id: RequestId) -> Result<Option<Hit>, SchedulerError> {
        let r = &self.state.requests[&id];
        if r.num_computed_tokens != 0 {
            return Ok(Some(Hit {
                local: None,
                external: 0,
                load_async: false,
                num_computed: r.num_computed_tokens,
            }));
        }
        let local = self.state.local_hit(r);
        // vLLM presents the local hit minus its sub-block tail; here the hit is whole blocks
        // (every group's hit is), so it is the hit itself.
        let answer = self
            .connector
            .get_num_new_matched_tokens(&self.state.view(), id, local.1);
        self.apply_intents()?;
        let Lookup::Hit { tokens, load_async } = answer else {
            return Ok(None);
        };
        let r = &self.state.requests[&id];
        if load_async && tokens == 0 {
            return Err(self.fail(SchedulerError::ConnectorContract(
                ConnectorError::AsyncLoadOfNothing { request: id },
            )));
        }
        // A sync load must leave a token to compute (vLLM asserts it).
        let limit = u64::from(r.num_tokens()) - u64::from(!load_async);
        if u64::from(local.1) + u64::from(tokens) > limit {
            return Err(self.fail(SchedulerError::ConnectorContract(
                ConnectorError::HitBeyondRequest {
                    request: id,
                    local: local.1,
                    external: tokens,
                    num_tokens: r.num_tokens(),
                },
            )));
        }
        let num_computed = local.1 + tokens;
        Ok(Some(Hit {
            local: Some(local),
            external: tokens,
            load_async,
            num_computed,
        }))
    }

    /// Phase 3: the step's [`SchedulerOutput`]; the finished and preempted ids collected since
    /// the last step are delivered in it.
    fn build_output(&mut self, pass: Pass) -> SchedulerOutput {
        let st = &mut self.state;
        SchedulerOutput {
            step: StepId(st.next_step),
            scheduled_new_reqs: pass.new_reqs,
            scheduled_cached_reqs: pass.cached_reqs,
            total_num_scheduled_tokens: pass.scheduled.iter().map(|(_, n)| n).sum(),
            num_scheduled_tokens: pass.scheduled,
            finished_req_ids: SortedSet::from_vec(
                core::mem::take(&mut st.finished_req_ids)
                    .into_iter()
                    .collect(),
            ),
            preempted_req_ids: SortedSet::from_vec(
                core::mem::take(&mut st.reset_preempted_req_ids)
                    .into_iter()
                    .collect(),
            ),
            has_sync_kv_loads: pass.has_sync_kv_loads,
        }
    }

    /// Phase 4: computed tokens advance by what was scheduled; async scheduling adds an output
    /// placeholder per sampling request; the step goes in flight.
    fn advance(&mut self, output: &SchedulerOutput) {
        let st = &mut self.state;
        let asynchronous = st.config.async_depth > 1;
        let mut entries = Vec::with_capacity(output.num_scheduled_tokens.len());
        for &(id, n) in &output.num_scheduled_tokens {
            let r = st
                .requests
                .get_mut(&id)
                .expect("scheduled requests are held");
            r.num_computed_tokens += n;
            r.num_in_flight_tokens += n;
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens() + r.num_output_placeholders;
            if !r.is_prefill_chunk {
                st.inflight_prefills.remove(&id);
            }
            let samples = !r.is_prefill_chunk;
            let position = r.num_tokens() + r.num_output_placeholders;
            if asynchronous && samples {
                r.num_output_placeholders += 1;
            }
            entries.push(ScheduledEntry {
                id,
                tokens: n,
                samples,
                position,
            });
        }
        st.in_flight.push_back(InFlightStep {
            step: output.step,
            scheduled: entries,
        });
        st.next_step += 1;
    }

    /// `_update_waiting_for_remote_kv` + promotion (§2.3 a, I-18, I-37).
    pub(super) fn update_waiting_for_remote_kv(&mut self, id: RequestId) {
        let st = &mut self.state;
        let failed = st.failed_recving_kv_req_ids.remove(&id);
        let computed = st.requests[&id].num_computed_tokens;
        if failed && computed == 0 {
            st.free_request_blocks(id);
        } else {
            st.cache_blocks(id, computed);
        }
        st.finished_recving_kv_req_ids.remove(&id);
        let r = st.requests.get_mut(&id).expect("held");
        if r.num_computed_tokens == r.num_tokens() {
            r.num_computed_tokens = r.num_tokens() - 1;
        }
        r.status = if r.num_preemptions > 0 {
            RequestStatus::Preempted
        } else {
            RequestStatus::Waiting
        };
    }
}
