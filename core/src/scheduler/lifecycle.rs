//! A request's way in and out: `add_request`, `abort`, vLLM's `finish_requests`, `_free_request`
//! (with the connector's `request_finished`) and `_preempt_request`.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::kv_cache::cdiv;
use super::{FinishDecision, Params, SchedulerConnector};
use super::{
    FinishReason, MAX_REQUEST_ID, Request, RequestOutput, RequestSpec, RequestStatus, Scheduler,
    SchedulerError,
};
use crate::ids::{BlockId, RequestId};

impl<C: SchedulerConnector> Scheduler<C> {
    /// `add_request`: queue the request and call `on_new_request`.
    pub fn add_request(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        let out = self.add_request_unchecked(spec);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
        out
    }

    fn add_request_unchecked(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        self.check_broken()?;
        let id = spec.id;
        if self.state.requests.contains_key(&id) {
            return Err(SchedulerError::DuplicateRequest(id));
        }
        if id.0 >= MAX_REQUEST_ID {
            return Err(SchedulerError::BadRequest {
                id,
                why: format!("request ids must be below {MAX_REQUEST_ID} (intern them densely)"),
            });
        }
        let bad = |why: &str| {
            Err(SchedulerError::BadRequest {
                id,
                why: String::from(why),
            })
        };
        if spec.prompt.is_empty() {
            return bad("empty prompt");
        }
        if spec.max_tokens == 0 {
            return bad("max_tokens must be at least 1");
        }
        if spec.prompt.len() as u64 >= u64::from(self.state.config.max_model_len) {
            return bad("prompt does not fit max_model_len");
        }
        let ngroups = self.state.config.groups.len();
        let mut r = Request {
            tokens: Vec::with_capacity(spec.prompt.len() + spec.max_tokens.min(4096) as usize),
            num_prompt_tokens: spec.prompt.len() as u32,
            max_tokens: spec.max_tokens,
            stop_token: spec.stop_token,
            kv_transfer_params: spec.kv_transfer_params,
            is_prefill_chunk: true,
            ..Request::new(id, ngroups)
        };
        for t in spec.prompt {
            r.append_token(t, self.state.config.block_size);
        }
        self.state.requests.insert(id, r);
        self.state.waiting.push_back(id);
        self.connector.on_new_request(&self.state.view(), id);
        self.apply_intents()
    }

    /// `finish_requests(ids, FINISHED_ABORTED)` for one request, between steps. Returns `false`
    /// when the request is not live (unknown, or already finished: vLLM ignores those).
    pub fn abort(&mut self, id: RequestId) -> Result<bool, SchedulerError> {
        let out = self.abort_unchecked(id);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
        out
    }

    fn abort_unchecked(&mut self, id: RequestId) -> Result<bool, SchedulerError> {
        self.check_broken()?;
        let live = self
            .state
            .requests
            .get(&id)
            .is_some_and(|r| !r.status.is_finished());
        if !live {
            return Ok(false);
        }
        self.finish_requests(&[id], FinishReason::Aborted)?;
        Ok(true)
    }

    /// vLLM's `finish_requests`: remove from the queues, then finish each (delaying the free of
    /// a request whose load is in flight, I-17). The outputs carry no `kv_transfer_params`.
    pub(super) fn finish_requests(
        &mut self,
        ids: &[RequestId],
        reason: FinishReason,
    ) -> Result<Vec<RequestOutput>, SchedulerError> {
        let st = &mut self.state;
        let valid: Vec<RequestId> = ids
            .iter()
            .copied()
            .filter(|id| st.requests.get(id).is_some_and(|r| !r.status.is_finished()))
            .collect();
        st.running.retain(|id| !valid.contains(id));
        st.waiting.retain(|id| !valid.contains(id));
        st.kv_holding_waiting.retain(|id| !valid.contains(id));
        let mut outs = Vec::with_capacity(valid.len());
        for id in valid {
            let st = &mut self.state;
            let free_at_once = st.frees_aborted_loads_at_once();
            let r = st.requests.get_mut(&id).expect("filtered above");
            let mut delay = false;
            if r.status == RequestStatus::WaitingForRemoteKvs {
                delay = !st.finished_recving_kv_req_ids.contains(&id) && !free_at_once;
                st.finished_recving_kv_req_ids.remove(&id);
                st.failed_recving_kv_req_ids.remove(&id);
            }
            r.status = reason.status();
            // vLLM's `finish_requests` drops what `_free_request` returns, and its error outputs
            // are built without `kv_transfer_params` (`update_from_output`): a request errored
            // by a load failure reports none, whatever `request_finished` answered.
            self.free_request(id, delay)?;
            outs.push(RequestOutput {
                id,
                new_tokens: Vec::new(),
                finish: Some(reason),
                kv_transfer_params: None,
            });
        }
        Ok(outs)
    }

    /// vLLM's `_free_request`: `request_finished`, then free now or hold for the connector.
    pub(super) fn free_request(
        &mut self,
        id: RequestId,
        delay_for_recv: bool,
    ) -> Result<Option<Params>, SchedulerError> {
        let st = &mut self.state;
        st.inflight_prefills.remove(&id);
        let r = &st.requests[&id];
        let processed = r.num_computed_tokens.saturating_sub(r.num_in_flight_tokens);
        st.remove_skipped_blocks(id, processed);
        let r = &st.requests[&id];
        let n = cdiv(r.num_computed_tokens, st.config.block_size) as usize;
        let blocks: Vec<Vec<BlockId>> = r
            .blocks
            .iter()
            .map(|t| t[..n.min(t.len())].to_vec())
            .collect();
        let FinishDecision {
            delay_free,
            kv_transfer_params,
        } = self
            .connector
            .request_finished(&self.state.view(), id, &blocks);
        self.apply_intents()?;
        let st = &mut self.state;
        st.finished_req_ids.insert(id);
        let r = st.requests.get_mut(&id).expect("still held");
        r.held_for_send = delay_free;
        r.held_for_recv = delay_for_recv;
        if !delay_free && !delay_for_recv {
            st.free_request_blocks(id);
            st.requests.remove(&id);
        }
        Ok(kv_transfer_params)
    }

    /// vLLM's `_preempt_request` for the last running request.
    pub(super) fn preempt(&mut self, id: RequestId) {
        let st = &mut self.state;
        st.free_request_blocks(id);
        st.inflight_prefills.remove(&id);
        let drop_output = st.requires_kv_delivery;
        let r = st.requests.get_mut(&id).expect("running requests are held");
        r.status = RequestStatus::Preempted;
        r.num_computed_tokens = 0;
        r.drop_stale_output = drop_output || (r.drop_stale_output && r.num_stale_output_tokens > 0);
        r.num_stale_output_tokens = r.num_in_flight_tokens;
        r.num_output_placeholders = 0;
        r.num_preemptions += 1;
        st.waiting.push_front(id);
        st.reset_preempted_req_ids.insert(id);
    }
}
