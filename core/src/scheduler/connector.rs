//! The scheduler side of the connector contract (SEMANTICS.md §3, §7): what the scheduler asks a
//! KV connector, and what a connector may ask back.
//!
//! vLLM's `KVConnectorBase_V1` is one class instantiated twice (scheduler role, worker role per
//! rank). Here the two roles are two traits; this is the scheduler role, [`SchedulerConnector`]
//! (the worker role is `crate::worker::WorkerConnector`). Every call gets a [`SchedulerView`]
//! borrowed for that call only: the connector can read scheduler state but cannot keep the view
//! (its lifetime ends with the call) nor mutate through it (it hands out only shared references
//! and copies). What a connector needs changed in scheduler-owned state it asks for with an
//! [`Intent`], drained by the scheduler right after the call and applied there, where
//! `check_invariants()` and the model checker see it.
//!
//! Metadata crossing a process boundary (the step metadata to the workers, the worker metadata
//! back) is serde-serialisable; the runtime encodes it with postcard.

use alloc::vec::Vec;
use core::fmt::Debug;

use super::{ConnectorError, Intent, Params, SchedulerView};
use crate::InvariantViolation;
use crate::ids::{BlockId, RequestId};
use crate::messages::{AggregatedOutput, CacheEvent, KvEvent, SchedulerOutput, WorkerMeta};

/// The answer of [`SchedulerConnector::get_num_new_matched_tokens`] (vLLM's
/// `(Option<int>, bool)`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lookup {
    /// `None`: not known yet; the request is skipped this step and asked again later.
    Pending,
    /// `tokens` more tokens beyond the local hit can be loaded; `load_async` = the load completes
    /// in a later step (the request waits in `WAITING_FOR_REMOTE_KVS`). `load_async` with
    /// `tokens == 0` breaks the contract ([`crate::SchedulerError::ConnectorContract`]).
    Hit {
        /// Additional tokens beyond `num_computed_tokens`.
        tokens: u32,
        /// Whether the load is asynchronous.
        load_async: bool,
    },
}

impl Lookup {
    /// No external tokens (`(0, false)`).
    pub const MISS: Lookup = Lookup::Hit {
        tokens: 0,
        load_async: false,
    };
}

/// What `request_finished` decides (vLLM returns `(delay_free, kv_transfer_params)`).
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FinishDecision {
    /// `true`: the connector now owns the blocks; the scheduler keeps the request and its blocks
    /// until an aggregated `finished_sending` (or `finished_recving` for a loading request) names
    /// it (I-15).
    pub delay_free: bool,
    /// Attached to the request's final output.
    pub kv_transfer_params: Option<Params>,
}

/// The scheduler side of a connector (vLLM's `KVConnectorBase_V1` in the scheduler role).
///
/// Call order per `schedule()` (I-7…I-13): `get_num_new_matched_tokens` and
/// `update_state_after_alloc` for admitted waiting requests, then `build_connector_meta` exactly
/// once, even for an empty step. Per `update_from_output`: `request_finished` for requests that
/// finish, then `update_connector_output` (only when the step carried a connector output), then
/// `take_events` and `take_cache_events`. `on_new_request` comes from `add_request`;
/// `request_finished` also from `abort`.
pub trait SchedulerConnector: Debug {
    /// The step metadata (vLLM's `KVConnectorMetadata`, scheduler → workers): built once per
    /// step by `build_connector_meta` and delivered, unchanged, to every rank. The other
    /// direction, worker → scheduler, is [`SchedulerConnector::WorkerMeta`].
    type StepMeta: Clone + Debug + Eq + serde::Serialize + serde::de::DeserializeOwned;
    /// The worker → scheduler metadata this connector receives (aggregated).
    type WorkerMeta: WorkerMeta + serde::Serialize + serde::de::DeserializeOwned;

    /// `add_request`: once per request, before any other call about it (I-13).
    fn on_new_request(&mut self, _view: &SchedulerView<'_>, _request: RequestId) {}

    /// Admission of a waiting request with no computed tokens (I-9). `num_computed_tokens` is the
    /// local prefix-cache hit, rounded down to a block boundary. May be asked again in later
    /// steps for the same request, so it should be re-callable.
    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup;

    /// After every successful allocation for an admitted waiting request, with `ext = 0` too
    /// (I-8). `blocks` are the request's blocks, one list per KV cache group. Decide whether to
    /// load from `num_external_tokens`, never from whether `blocks` is empty.
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    );

    /// Exactly once per `schedule()`, after all admission calls of the step (I-7). Resets the
    /// connector's per-step state.
    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> Self::StepMeta;

    /// Once per processed step that carries a connector output, before the scheduler applies
    /// `finished_recving` / `finished_sending` (I-11).
    fn update_connector_output(
        &mut self,
        _view: &SchedulerView<'_>,
        _output: &AggregatedOutput<Self::WorkerMeta>,
    ) {
    }

    /// Exactly once per request that finishes for any reason (stop, length, abort, error), before
    /// its blocks are freed; never on preemption (I-10). `blocks` are the resident blocks of the
    /// computed prefix, one list per group (`request_finished_all_groups`; a single-group
    /// connector reads `blocks[0]`).
    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision;

    /// Events collected since the last call (draining); once per `update_from_output`.
    fn take_events(&mut self) -> Vec<KvEvent> {
        Vec::new()
    }

    /// Switches structured events on or off (vLLM's `enable_kv_cache_events`); called by
    /// [`crate::Scheduler::set_cache_events`]. The default keeps none.
    fn set_cache_events(&mut self, _on: bool) {}

    /// The events of the last [`SchedulerConnector::take_events`] call as [`CacheEvent`]s, in
    /// the same order (draining), while structured events are on; the scheduler calls it right
    /// after `take_events`, so a connector keeps at most one call's worth. The default has none.
    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        Vec::new()
    }

    /// Intents produced by the last call (draining). The scheduler calls this after every
    /// `&mut self` method above.
    fn take_intents(&mut self) -> Vec<Intent> {
        Vec::new()
    }

    /// A breach of the connector contract that the connector itself detected during its last
    /// call (draining), e.g. two children of a [`crate::MultiConnector`] setting the same
    /// `kv_transfer_params` key, where vLLM raises. The methods above have no error channel of
    /// their own; the scheduler calls this after every call, with
    /// [`SchedulerConnector::take_intents`], and stops with the sticky
    /// [`crate::SchedulerError::ConnectorContract`].
    fn take_error(&mut self) -> Option<ConnectorError> {
        None
    }

    /// Asked when a running request cannot get blocks: `true` suppresses preemption because
    /// pending transfers will release blocks.
    fn has_pending_block_frees(&self, _view: &SchedulerView<'_>) -> bool {
        false
    }

    /// Engine liveness: `true` keeps the engine stepping with empty batches.
    fn has_pending_push_work(&self) -> bool {
        false
    }

    /// External cache reset: `Some(false)` = failed, `None` = not supported.
    fn reset_cache(&mut self) -> Option<bool> {
        None
    }

    /// Overrides the world size as the aggregator's ack quorum.
    fn get_finished_count(&self) -> Option<u32> {
        None
    }

    /// Whether `meta` asks the workers for nothing (no load, store or flush, nothing to bind).
    /// An engine step that schedules nothing and carries such metadata is quiet
    /// ([`crate::EngineCore`]), so an engine loop may wait for input instead of stepping. The
    /// default, `false`, never calls a step quiet (safe, but an idle engine then spins).
    fn meta_is_empty(&self, _meta: &Self::StepMeta) -> bool {
        false
    }

    /// Whether the connector still keeps state for `request` (jobs in flight, a send pending):
    /// the engine releases a finished request's id only once this is `false`
    /// ([`crate::EngineCore::take_released`]), so the id cannot be reused while the connector
    /// could still confuse two requests. The default, `true`, never releases an id.
    fn tracks_request(&self, _request: RequestId) -> bool {
        true
    }

    /// The connector's own invariants (`I-xx` of SEMANTICS.md §8); checked by
    /// [`crate::Scheduler::check_invariants`], so after every public transition of the scheduler
    /// in debug builds and after every action of the model checker. The default has none.
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Ok(())
    }

    /// Whether KV must be handed off at finish (P/D producers): a preempted request's in-flight
    /// output is then dropped and recomputed (PR #50297). Asked once, when the scheduler is
    /// built (as vLLM's scheduler does in its constructor): a later change is not seen.
    fn requires_kv_delivery(&self) -> bool {
        false
    }
}

// ---------------------------------------------------------------------------------------------
// Boxed connectors (heterogeneous children).

impl<T: SchedulerConnector + ?Sized> SchedulerConnector for alloc::boxed::Box<T> {
    type StepMeta = T::StepMeta;
    type WorkerMeta = T::WorkerMeta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, request: RequestId) {
        (**self).on_new_request(view, request);
    }
    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        (**self).get_num_new_matched_tokens(view, request, num_computed_tokens)
    }
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        (**self).update_state_after_alloc(view, request, blocks, num_external_tokens);
    }
    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> Self::StepMeta {
        (**self).build_connector_meta(view, output)
    }
    fn update_connector_output(
        &mut self,
        view: &SchedulerView<'_>,
        output: &AggregatedOutput<Self::WorkerMeta>,
    ) {
        (**self).update_connector_output(view, output);
    }
    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        (**self).request_finished(view, request, blocks)
    }
    fn take_events(&mut self) -> Vec<KvEvent> {
        (**self).take_events()
    }
    fn set_cache_events(&mut self, on: bool) {
        (**self).set_cache_events(on);
    }
    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        (**self).take_cache_events()
    }
    fn take_intents(&mut self) -> Vec<Intent> {
        (**self).take_intents()
    }
    fn take_error(&mut self) -> Option<ConnectorError> {
        (**self).take_error()
    }
    fn has_pending_block_frees(&self, view: &SchedulerView<'_>) -> bool {
        (**self).has_pending_block_frees(view)
    }
    fn has_pending_push_work(&self) -> bool {
        (**self).has_pending_push_work()
    }
    fn reset_cache(&mut self) -> Option<bool> {
        (**self).reset_cache()
    }
    fn get_finished_count(&self) -> Option<u32> {
        (**self).get_finished_count()
    }
    fn requires_kv_delivery(&self) -> bool {
        (**self).requires_kv_delivery()
    }
    fn meta_is_empty(&self, meta: &Self::StepMeta) -> bool {
        (**self).meta_is_empty(meta)
    }
    fn tracks_request(&self, request: RequestId) -> bool {
        (**self).tracks_request(request)
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        (**self).check_invariants()
    }
}
