//! A scripted scheduler-side connector, so that every scheduler path is reachable in tests,
//! conformance cases and the model checker.
//!
//! Its answers come from a table the test sets between calls (through
//! [`crate::Scheduler::connector_mut`]): lookups per request (default: miss), which requests
//! `request_finished` delays, whether it reports pending block frees or push work, and pins or
//! unpins to ask for. Every call it receives is appended to a log ([`ScriptedConnector::take_calls`])
//! so tests can assert the exact call sequence (I-7…I-13). Async loads complete "when the
//! environment says so": the test puts the request into an aggregated `finished_recving`; load
//! failures are the blocks or requests the test reports as failed.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use crate::ids::{BlockId, RequestId, StepId};
use crate::messages::AggregatedOutput;
use crate::messages::Meta;
use crate::messages::SchedulerOutput;
use crate::scheduler::FinishDecision;
use crate::scheduler::Intent;
use crate::scheduler::Lookup;
use crate::scheduler::Params;
use crate::scheduler::SchedulerConnector;
use crate::scheduler::SchedulerView;
use crate::sorted_set::SortedSet;

/// One call the scripted connector received, with its arguments and answer.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "call")]
pub enum ConnectorCall {
    /// `on_new_request`.
    OnNewRequest {
        /// The request.
        id: RequestId,
    },
    /// `get_num_new_matched_tokens` and its answer.
    GetNumNewMatchedTokens {
        /// The request.
        id: RequestId,
        /// The block-aligned local hit passed in.
        num_computed_tokens: u32,
        /// What the script answered.
        answer: Lookup,
    },
    /// `update_state_after_alloc`.
    UpdateStateAfterAlloc {
        /// The request.
        id: RequestId,
        /// Its blocks, per group.
        blocks: Vec<Vec<BlockId>>,
        /// External tokens to load.
        num_external_tokens: u32,
    },
    /// `build_connector_meta`.
    BuildConnectorMeta {
        /// The step.
        step: StepId,
    },
    /// `update_connector_output`.
    UpdateConnectorOutput {
        /// Aggregated `finished_sending`.
        finished_sending: Option<SortedSet<RequestId>>,
        /// Aggregated `finished_recving`.
        finished_recving: Option<SortedSet<RequestId>>,
    },
    /// `request_finished` and its answer.
    RequestFinished {
        /// The request.
        id: RequestId,
        /// The blocks passed in, per group.
        blocks: Vec<Vec<BlockId>>,
        /// What the script answered.
        delay_free: bool,
    },
}

/// A load the scripted connector put into a step's metadata.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScriptedLoad {
    /// The request.
    pub id: RequestId,
    /// The blocks to load into, per group.
    pub blocks: Vec<Vec<BlockId>>,
    /// External tokens.
    pub tokens: u32,
    /// Whether the load is asynchronous.
    pub load_async: bool,
}

/// The scripted connector's per-step metadata.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScriptedMeta {
    /// Loads admitted this step.
    pub loads: Vec<ScriptedLoad>,
    /// `finished_req_ids` of the step (what workers may report sends for).
    pub finished: SortedSet<RequestId>,
    /// `preempted_req_ids` of the step.
    pub preempted: SortedSet<RequestId>,
}

/// See the module docs.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct ScriptedConnector {
    lookups: BTreeMap<RequestId, Lookup>,
    delay_free: BTreeSet<RequestId>,
    delay_all: bool,
    finish_params: BTreeMap<RequestId, Params>,
    pending_block_frees: bool,
    push_work: bool,
    requires_kv_delivery: bool,
    finished_count: Option<u32>,
    observed_worker_meta: Option<Meta>,
    /// Loads admitted since the last `build_connector_meta`, and the async-load answers per
    /// request, so `update_state_after_alloc` knows whether the load is async.
    step_loads: Vec<ScriptedLoad>,
    last_answer: BTreeMap<RequestId, Lookup>,
    intents: Vec<Intent>,
    calls: Vec<ConnectorCall>,
    log_calls: bool,
}

impl ScriptedConnector {
    /// A connector that misses every lookup and delays nothing, logging every call.
    pub fn new() -> Self {
        Self {
            log_calls: true,
            ..Self::default()
        }
    }

    /// A connector that logs nothing (for long random runs).
    pub fn quiet() -> Self {
        Self::default()
    }

    /// What `get_num_new_matched_tokens(id, ·)` answers from now on.
    pub fn set_lookup(&mut self, id: RequestId, answer: Lookup) {
        self.lookups.insert(id, answer);
    }

    /// Whether `request_finished(id)` delays the free.
    pub fn set_delay_free(&mut self, id: RequestId, delay: bool) {
        if delay {
            self.delay_free.insert(id);
        } else {
            self.delay_free.remove(&id);
        }
    }

    /// Delay the free of every request (a P/D producer).
    pub fn set_delay_all(&mut self, delay: bool) {
        self.delay_all = delay;
    }

    /// `kv_transfer_params` returned when `id` finishes.
    pub fn set_finish_params(&mut self, id: RequestId, params: Params) {
        self.finish_params.insert(id, params);
    }

    /// `request_finished(id)` returns no `kv_transfer_params` again.
    pub fn clear_finish_params(&mut self, id: RequestId) {
        self.finish_params.remove(&id);
    }

    /// The worker metadata the last `update_connector_output` carried.
    pub fn observed_worker_meta(&self) -> Option<&Meta> {
        self.observed_worker_meta.as_ref()
    }

    /// What `get_finished_count` answers.
    pub fn set_finished_count(&mut self, count: Option<u32>) {
        self.finished_count = count;
    }

    /// What `has_pending_block_frees` answers.
    pub fn set_pending_block_frees(&mut self, pending: bool) {
        self.pending_block_frees = pending;
    }

    /// What `has_pending_push_work` answers.
    pub fn set_push_work(&mut self, pending: bool) {
        self.push_work = pending;
    }

    /// What `requires_kv_delivery` answers (read once, when the scheduler is built).
    pub fn set_requires_kv_delivery(&mut self, yes: bool) {
        self.requires_kv_delivery = yes;
    }

    /// Ask for an intent with the next call the scheduler makes.
    pub fn push_intent(&mut self, intent: Intent) {
        self.intents.push(intent);
    }

    /// The calls received since the last `take_calls`.
    pub fn take_calls(&mut self) -> Vec<ConnectorCall> {
        core::mem::take(&mut self.calls)
    }

    fn log(&mut self, call: ConnectorCall) {
        if self.log_calls {
            self.calls.push(call);
        }
    }
}

impl SchedulerConnector for ScriptedConnector {
    type StepMeta = ScriptedMeta;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, _view: &SchedulerView<'_>, id: RequestId) {
        self.log(ConnectorCall::OnNewRequest { id });
    }

    fn get_num_new_matched_tokens(
        &mut self,
        _view: &SchedulerView<'_>,
        id: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let answer = self.lookups.get(&id).copied().unwrap_or(Lookup::MISS);
        self.last_answer.insert(id, answer);
        self.log(ConnectorCall::GetNumNewMatchedTokens {
            id,
            num_computed_tokens,
            answer,
        });
        answer
    }

    fn update_state_after_alloc(
        &mut self,
        _view: &SchedulerView<'_>,
        id: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        if num_external_tokens > 0 {
            let load_async = matches!(
                self.last_answer.get(&id),
                Some(Lookup::Hit {
                    load_async: true,
                    ..
                })
            );
            self.step_loads.push(ScriptedLoad {
                id,
                blocks: blocks.to_vec(),
                tokens: num_external_tokens,
                load_async,
            });
        }
        self.last_answer.remove(&id);
        self.log(ConnectorCall::UpdateStateAfterAlloc {
            id,
            blocks: blocks.to_vec(),
            num_external_tokens,
        });
    }

    fn build_connector_meta(
        &mut self,
        _view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> ScriptedMeta {
        self.log(ConnectorCall::BuildConnectorMeta { step: output.step });
        ScriptedMeta {
            loads: core::mem::take(&mut self.step_loads),
            finished: output.finished_req_ids.clone(),
            preempted: output.preempted_req_ids.clone(),
        }
    }

    fn update_connector_output(&mut self, _view: &SchedulerView<'_>, output: &AggregatedOutput) {
        self.observed_worker_meta.clone_from(&output.worker_meta);
        self.log(ConnectorCall::UpdateConnectorOutput {
            finished_sending: output.finished_sending.clone(),
            finished_recving: output.finished_recving.clone(),
        });
    }

    fn request_finished(
        &mut self,
        _view: &SchedulerView<'_>,
        id: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        let delay_free = self.delay_all || self.delay_free.contains(&id);
        self.log(ConnectorCall::RequestFinished {
            id,
            blocks: blocks.to_vec(),
            delay_free,
        });
        self.last_answer.remove(&id);
        FinishDecision {
            delay_free,
            kv_transfer_params: self.finish_params.get(&id).cloned(),
        }
    }

    fn take_intents(&mut self) -> Vec<Intent> {
        core::mem::take(&mut self.intents)
    }

    fn has_pending_block_frees(&self, _view: &SchedulerView<'_>) -> bool {
        self.pending_block_frees
    }

    fn has_pending_push_work(&self) -> bool {
        self.push_work
    }

    fn get_finished_count(&self) -> Option<u32> {
        self.finished_count
    }

    fn requires_kv_delivery(&self) -> bool {
        self.requires_kv_delivery
    }

    fn meta_is_empty(&self, meta: &ScriptedMeta) -> bool {
        meta.loads.is_empty() && meta.finished.is_empty() && meta.preempted.is_empty()
    }

    /// A scripted connector keeps only its script, which outlives requests by design.
    fn tracks_request(&self, _request: RequestId) -> bool {
        false
    }
}
