//! `schedule()`: one engine step (SEMANTICS.md §2.3).

use alloc::collections::VecDeque;
use alloc::format;
use alloc::vec::Vec;

use super::{InFlightStep, RequestStatus, ScheduledEntry, Scheduler, SchedulerError, State};
use crate::Mode;
use crate::ids::{RequestId, StepId};
use crate::messages::{CachedRequestData, NewRequestData, ScheduledStep, SchedulerOutput};
use crate::scheduler::connector::{Lookup, SchedulerConnector};
use crate::sorted_set::SortedSet;

impl<C: SchedulerConnector> Scheduler<C> {
    /// `schedule()`: one engine step. See SEMANTICS.md §2.3.
    pub fn schedule(&mut self) -> Result<ScheduledStep<C::Meta>, SchedulerError> {
        self.check_broken()?;
        let depth = self.state.config.async_depth;
        if self.state.in_flight.len() as u32 >= depth {
            return Err(SchedulerError::PipelineFull { depth });
        }
        let step = StepId(self.state.next_step);
        let max_model_len = self.state.config.max_model_len;
        let mut budget = self.state.config.max_num_batched_tokens;
        let n_running = self.state.running.len();
        let mut scheduled: Vec<(RequestId, u32)> = Vec::with_capacity(n_running);
        let mut new_reqs: Vec<NewRequestData> = Vec::new();
        let mut cached_reqs: Vec<CachedRequestData> = Vec::with_capacity(n_running);
        let mut preempted_any = false;
        let mut has_sync_kv_loads = false;
        let n_eligible = self.state.running.len()
            + self.state.waiting.len()
            + self.state.kv_holding_waiting.len();
        let threshold = if n_eligible > 1 {
            self.state.config.long_prefill_token_threshold
        } else {
            0
        };

        // 1. Running requests.
        let mut idx = 0;
        while idx < self.state.running.len() && budget > 0 {
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
            if threshold > 0 && threshold < n {
                n = threshold;
            }
            n = n.min(budget);
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
                preempted_any = true;
                if victim == id {
                    break None;
                }
            };
            let Some(new_blocks) = new_blocks else {
                break;
            };
            scheduled.push((id, n));
            cached_reqs.push(CachedRequestData {
                id,
                resumed: false,
                new_block_ids: new_blocks,
                num_computed_tokens: computed_before,
            });
            budget -= n;
            idx += 1;
        }

        // 2. Waiting requests, only if nothing was preempted.
        if !preempted_any {
            let mut skipped_holding: VecDeque<RequestId> = VecDeque::new();
            let mut skipped_waiting: VecDeque<RequestId> = VecDeque::new();
            // A connector breaking its contract stops the pass with a sticky error; the
            // requests skipped so far (pending lookups, loads started this pass) still go back
            // to their queues, so the stopped scheduler's state stays consistent (I-16, I-18).
            let waiting: Result<(), SchedulerError> = 'waiting: {
                while budget > 0 {
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
                    let mut skip = |st: &mut State| {
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
                    };
                    // a. Blocked on an async load.
                    if self.state.requests[&id].status == RequestStatus::WaitingForRemoteKvs {
                        if !self.state.finished_recving_kv_req_ids.contains(&id) {
                            skip(&mut self.state);
                            continue;
                        }
                        self.update_waiting_for_remote_kv(id);
                        // A failed load recomputed from scratch gave its blocks back but is still
                        // at the head of `kv_holding_waiting`. vLLM (compat) admits it from there:
                        // if it cannot allocate, the loop stops, and the finished loads behind it
                        // are never promoted and keep their blocks, possibly forever. Strict moves
                        // it to the waiting queue (tried from the next step on).
                        if self.state.config.mode == Mode::Strict
                            && from_holding
                            && self.state.requests[&id].blocks.iter().all(Vec::is_empty)
                        {
                            skip(&mut self.state);
                            continue;
                        }
                    }
                    let r = &self.state.requests[&id];
                    if r.num_stale_output_tokens > 0 && !r.drop_stale_output {
                        skip(&mut self.state);
                        continue;
                    }
                    // b. Lookups.
                    let mut hit = None;
                    let mut ext = 0;
                    let mut load_async = false;
                    let num_computed;
                    if r.num_computed_tokens == 0 {
                        let h = self.state.local_hit(r);
                        // vLLM presents the local hit minus its sub-block tail; here the hit is
                        // whole blocks (every group's hit is), so it is the hit itself.
                        let answer =
                            self.connector
                                .get_num_new_matched_tokens(&self.state.view(), id, h.1);
                        if let Err(e) = self.apply_intents() {
                            break 'waiting Err(e);
                        }
                        match answer {
                            Lookup::Pending => {
                                skip(&mut self.state);
                                continue;
                            }
                            Lookup::Hit {
                                tokens,
                                load_async: la,
                            } => {
                                let r = &self.state.requests[&id];
                                if la && tokens == 0 {
                                    break 'waiting Err(self.fail(
                                        SchedulerError::ConnectorContract(format!(
                                            "lookup for {id:?} answered an async load of 0 tokens"
                                        )),
                                    ));
                                }
                                // A sync load must leave a token to compute (vLLM asserts it).
                                let limit = u64::from(r.num_tokens()) - u64::from(!la);
                                if u64::from(h.1) + u64::from(tokens) > limit {
                                    break 'waiting Err(self.fail(SchedulerError::ConnectorContract(format!(
                                        "lookup for {id:?} answered {tokens} tokens beyond a local \
                                         hit of {} for a request of {} tokens",
                                        h.1,
                                        r.num_tokens()
                                    ))));
                                }
                                ext = tokens;
                                load_async = la;
                            }
                        }
                        num_computed = h.1 + ext;
                        hit = Some(h);
                    } else {
                        num_computed = r.num_computed_tokens;
                    }
                    let r = &self.state.requests[&id];
                    let num_new = if load_async {
                        0
                    } else {
                        let mut n = r.num_tokens() - num_computed;
                        if threshold > 0 && threshold < n {
                            n = threshold;
                        }
                        if !self.state.config.enable_chunked_prefill && n > budget {
                            break;
                        }
                        n.min(budget)
                    };
                    let reserved = if load_async {
                        let ids: Vec<RequestId> =
                            self.state.inflight_prefills.iter().copied().collect();
                        ids.iter().map(|&p| self.state.remaining_blocks(p)).sum()
                    } else {
                        0
                    };
                    // c. Allocation.
                    let Some(_) = self.state.allocate_slots(
                        id,
                        num_new,
                        hit.as_ref(),
                        ext,
                        load_async,
                        reserved,
                    ) else {
                        break;
                    };
                    // d. The connector learns about every admission (I-8).
                    let blocks = self.state.requests[&id].blocks.clone();
                    self.connector
                        .update_state_after_alloc(&self.state.view(), id, &blocks, ext);
                    if let Err(e) = self.apply_intents() {
                        break 'waiting Err(e);
                    }
                    // e. Async load: wait in WAITING_FOR_REMOTE_KVS.
                    let st = &mut self.state;
                    if load_async {
                        let r = st.requests.get_mut(&id).expect("held");
                        r.status = RequestStatus::WaitingForRemoteKvs;
                        r.num_computed_tokens = num_computed;
                        st.inflight_prefills.insert(id);
                        skip(st);
                        continue;
                    }
                    if from_holding {
                        st.kv_holding_waiting.pop_front();
                    } else {
                        st.waiting.pop_front();
                    }
                    st.running.push(id);
                    if ext > 0 {
                        has_sync_kv_loads = true;
                    }
                    let r = st.requests.get_mut(&id).expect("held");
                    let resumed = r.status == RequestStatus::Preempted;
                    r.status = RequestStatus::Running;
                    r.num_computed_tokens = num_computed;
                    if resumed {
                        cached_reqs.push(CachedRequestData {
                            id,
                            resumed: true,
                            new_block_ids: r.blocks.clone(),
                            num_computed_tokens: num_computed,
                        });
                    } else {
                        new_reqs.push(NewRequestData {
                            id,
                            block_ids: r.blocks.clone(),
                            num_computed_tokens: num_computed,
                        });
                    }
                    if num_computed + num_new < r.num_tokens() {
                        st.inflight_prefills.insert(id);
                    }
                    scheduled.push((id, num_new));
                    budget -= num_new;
                }
                Ok(())
            };
            for id in skipped_holding {
                self.state.kv_holding_waiting.push_front(id);
            }
            for id in skipped_waiting {
                self.state.waiting.push_front(id);
            }
            waiting?;
        }

        // 3. The output, 4. the metadata.
        let st = &mut self.state;
        let output = SchedulerOutput {
            step,
            scheduled_new_reqs: new_reqs,
            scheduled_cached_reqs: cached_reqs,
            total_num_scheduled_tokens: scheduled.iter().map(|(_, n)| n).sum(),
            num_scheduled_tokens: scheduled,
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
            has_sync_kv_loads,
        };
        let meta = self
            .connector
            .build_connector_meta(&self.state.view(), &output);
        self.apply_intents()?;

        // 6. Advance computed tokens; async scheduling adds placeholders.
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
            step,
            scheduled: entries,
        });
        st.next_step += 1;
        Ok(ScheduledStep { output, meta })
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
