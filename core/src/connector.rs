//! The connector contract: what the scheduler asks a KV connector, and what a connector may ask
//! back (SEMANTICS.md §3, §7).
//!
//! vLLM's `KVConnectorBase_V1` is one class instantiated twice (scheduler role, worker role per
//! rank). Here the two roles are two traits:
//!
//! * [`SchedulerConnector`] — called by [`crate::Scheduler`] at the points listed on each method.
//!   Every call gets a [`SchedulerView`] borrowed for that call only: the connector can read
//!   scheduler state but cannot keep the view (its lifetime ends with the call) nor mutate through
//!   it (it hands out only shared references and copies). What a connector needs changed in
//!   scheduler-owned state it asks for with an [`Intent`], drained by the scheduler right after the
//!   call and applied there, where `check_invariants()` and the model checker see it.
//! * [`WorkerConnector`] — one per rank, sans-IO: hooks return [`TransferCommand`]s for the
//!   runtime to perform, and the runtime feeds completions back with
//!   [`WorkerConnector::handle_transfer_done`]. [`GuardedWorker`] wraps a worker connector in the
//!   foundation's [`WorkerProtocol`] so that no hook runs out of order (I-1…I-6).
//!
//! Metadata crossing a process boundary (`Meta` to the workers, `WorkerMeta` back) is
//! serde-serialisable; the runtime encodes it with postcard.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Debug;

use crate::events::KvEvent;
use crate::ids::{BlockId, JobId, RequestId};
use crate::meta::WorkerMeta;
use crate::output::{AggregatedOutput, SortedSet, WorkerOutput};
use crate::protocol::{ProtocolViolation, StepShape, WorkerCall, WorkerProtocol};
use crate::scheduler::{SchedulerOutput, SchedulerView};

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

/// `kv_transfer_params`: string key/value pairs attached to a request (input) or to its final
/// output (returned by `request_finished`). Ordered, so equal maps compare and hash equal.
pub type Params = alloc::collections::BTreeMap<String, String>;

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

/// A change to scheduler-owned state that a connector asks for (SEMANTICS.md §7.3). Drained with
/// [`SchedulerConnector::take_intents`] after every mutable call and applied by the scheduler;
/// an intent the scheduler cannot apply is the sticky error
/// [`crate::SchedulerError::IntentRejected`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Intent {
    /// Take a reference on these GPU blocks so they are neither reused nor evicted while a
    /// transfer reads them (what `bind_gpu_block_pool` users do by touching ref counts). Each
    /// block must be in use or prefix-cached.
    Pin(Vec<BlockId>),
    /// Drop a reference taken by [`Intent::Pin`].
    Unpin(Vec<BlockId>),
}

/// The scheduler side of a connector (vLLM's `KVConnectorBase_V1` in the scheduler role).
///
/// Call order per `schedule()` (I-7…I-13): `get_num_new_matched_tokens` and
/// `update_state_after_alloc` for admitted waiting requests, then `build_connector_meta` exactly
/// once, even for an empty step. Per `update_from_output`: `request_finished` for requests that
/// finish, then `update_connector_output` (only when the step carried a connector output), then
/// `take_events`. `on_new_request` comes from `add_request`; `request_finished` also from `abort`.
pub trait SchedulerConnector: Debug {
    /// Metadata built once per step and delivered, unchanged, to every rank.
    type Meta: Clone + Debug + Eq + serde::Serialize + serde::de::DeserializeOwned;
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
    ) -> Self::Meta;

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

    /// Intents produced by the last call (draining). The scheduler calls this after every
    /// `&mut self` method above.
    fn take_intents(&mut self) -> Vec<Intent> {
        Vec::new()
    }

    /// A breach of the connector contract that the connector itself detected during its last
    /// call (draining), e.g. two children of a [`crate::MultiConnector`] setting the same
    /// `kv_transfer_params` key, where vLLM raises. The methods above have no error channel;
    /// the scheduler calls this with [`SchedulerConnector::take_intents`] and stops with the
    /// sticky [`crate::SchedulerError::ConnectorContract`].
    fn take_error(&mut self) -> Option<String> {
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
    fn meta_is_empty(&self, _meta: &Self::Meta) -> bool {
        false
    }

    /// Whether the connector still keeps state for `request` (jobs in flight, a send pending):
    /// the engine releases a finished request's id only once this is `false`
    /// ([`crate::EngineCore::take_released`]), so the id cannot be reused while the connector
    /// could still confuse two requests. The default, `true`, never releases an id.
    fn tracks_request(&self, _request: RequestId) -> bool {
        true
    }

    /// Whether KV must be handed off at finish (P/D producers): a preempted request's in-flight
    /// output is then dropped and recomputed (PR #50297). Asked once, when the scheduler is
    /// built (as vLLM's scheduler does in its constructor): a later change is not seen.
    fn requires_kv_delivery(&self) -> bool {
        false
    }
}

/// A connector that does nothing: every lookup misses, nothing is delayed. The scheduler with
/// this connector behaves like vLLM's scheduler with a no-op connector; it is the baseline of
/// the scheduler benchmark.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct NoopConnector;

impl SchedulerConnector for NoopConnector {
    type Meta = ();
    type WorkerMeta = crate::Meta;

    fn get_num_new_matched_tokens(
        &mut self,
        _view: &SchedulerView<'_>,
        _request: RequestId,
        _num_computed_tokens: u32,
    ) -> Lookup {
        Lookup::MISS
    }

    fn update_state_after_alloc(
        &mut self,
        _view: &SchedulerView<'_>,
        _request: RequestId,
        _blocks: &[Vec<BlockId>],
        _num_external_tokens: u32,
    ) {
    }

    fn build_connector_meta(&mut self, _view: &SchedulerView<'_>, _output: &SchedulerOutput) {}

    fn meta_is_empty(&self, _meta: &()) -> bool {
        true
    }

    fn tracks_request(&self, _request: RequestId) -> bool {
        false
    }

    fn request_finished(
        &mut self,
        _view: &SchedulerView<'_>,
        _request: RequestId,
        _blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        FinishDecision::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Worker side.

/// Which way a transfer moves KV.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TransferDirection {
    /// External store → GPU blocks.
    Load,
    /// GPU blocks → external store.
    Store,
}

/// One transfer a worker connector asks the runtime to perform.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Transfer {
    /// Identifies the completion fed back in [`TransferDone`].
    pub job: JobId,
    /// Load or store.
    pub direction: TransferDirection,
    /// The request the transfer serves.
    pub request: RequestId,
    /// The GPU blocks read (store) or written (load), in order.
    pub gpu_blocks: Vec<BlockId>,
    /// The external locations (host slots, remote keys), one per GPU block.
    pub external: Vec<u64>,
}

/// What a worker hook asks the runtime to do.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferCommand {
    /// Start this transfer.
    Start(Transfer),
    /// Block until these jobs completed (their [`TransferDone`] were fed back) before the hook's
    /// caller proceeds: `handle_preemptions` fencing stores before the forward writes (I-4),
    /// `wait_for_layer_load`, `wait_for_save`.
    Wait(SortedSet<JobId>),
}

/// Why a worker connector stopped: a completion or a job it cannot take, where vLLM's worker
/// asserts. Sticky: once a worker reports one, its results can no longer be trusted, and the rank
/// driver ([`crate::RankDriver`]) stops the rank with it.
#[derive(
    Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize, thiserror::Error,
)]
#[non_exhaustive]
pub enum WorkerError {
    /// A transfer reported failure, and the connector cannot absorb failed transfers.
    #[error("transfer of job {0:?} failed")]
    TransferFailed(JobId),
    /// A completion for a job that is not in flight on this rank.
    #[error("completion for job {0:?}, which is not in flight")]
    UnknownJob(JobId),
    /// A job the connector cannot perform (e.g. host chunks that do not cover its GPU blocks).
    #[error("job {0:?} is malformed: its host chunks do not cover its GPU blocks")]
    MalformedJob(JobId),
}

impl WorkerError {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TransferFailed(_) => "transfer_failed",
            Self::UnknownJob(_) => "unknown_job",
            Self::MalformedJob(_) => "malformed_job",
        }
    }
}

/// A transfer's completion, fed back to the worker connector.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferDone {
    /// The job that completed.
    pub job: JobId,
    /// `false`: the transfer failed (a load's blocks are then reported invalid).
    pub ok: bool,
}

/// vLLM's `KVConnectorTransferResults`.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferResults {
    /// Requests whose sends/saves finished on this rank.
    pub finished_sending: Option<SortedSet<RequestId>>,
    /// Requests whose loads finished on this rank (failed ones included).
    pub finished_recving: Option<SortedSet<RequestId>>,
    /// Request-level load failures.
    pub failed_recving: SortedSet<RequestId>,
}

impl TransferResults {
    /// The rank's output of the step: these results with the step's
    /// `get_block_ids_with_load_errors` and `build_connector_worker_meta` answers (no quorum
    /// change, no KV events). What a worker runtime hands the executor after the step's hooks.
    pub fn into_output<M>(
        self,
        invalid_block_ids: SortedSet<BlockId>,
        worker_meta: Option<M>,
    ) -> WorkerOutput<M> {
        WorkerOutput {
            finished_sending: self.finished_sending,
            finished_recving: self.finished_recving,
            invalid_block_ids,
            failed_recving: self.failed_recving,
            expected_finished_count: 0,
            worker_meta,
            kv_events: None,
        }
    }
}

/// The worker side of a connector, one per rank (SEMANTICS.md §2.4, §3.2), sans-IO.
///
/// Hooks are called in the order [`WorkerProtocol`] admits; use [`GuardedWorker`] to enforce it.
pub trait WorkerConnector: Debug {
    /// The scheduler connector's per-step metadata.
    type Meta;
    /// What this rank reports back, folded across ranks by the aggregator.
    type WorkerMeta: WorkerMeta;

    /// First call of every step, before any KV write of the step (I-4): return `Wait` for every
    /// in-flight transfer that reads a block the step may overwrite.
    fn handle_preemptions(&mut self, meta: &Self::Meta) -> Vec<TransferCommand>;
    /// Bind the step's metadata.
    fn bind(&mut self, meta: &Self::Meta);
    /// Start the step's loads (once per step, I-1).
    fn start_load_kv(&mut self) -> Vec<TransferCommand>;
    /// Before layer `layer`'s attention.
    fn wait_for_layer_load(&mut self, _layer: u32) -> Vec<TransferCommand> {
        Vec::new()
    }
    /// After layer `layer`'s attention.
    fn save_kv_layer(&mut self, _layer: u32) -> Vec<TransferCommand> {
        Vec::new()
    }
    /// End of the step's saves (`wait_for_save`).
    fn wait_for_save(&mut self) -> Vec<TransferCommand>;
    /// A transfer completed. May come at any time, also between steps.
    fn handle_transfer_done(&mut self, done: TransferDone);
    /// Completions since the last call. `finished_req_ids` are the ids the scheduler finished
    /// since the previous step: sends may be reported only for ids received here (§2.9).
    fn get_transfer_results(&mut self, finished_req_ids: &SortedSet<RequestId>) -> TransferResults;
    /// Blocks whose load failed since the last call.
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId>;
    /// Worker → scheduler metadata of this step.
    fn build_connector_worker_meta(&mut self) -> Option<Self::WorkerMeta> {
        None
    }
    /// Unbind the step's metadata (last call of the step).
    fn clear(&mut self);
    /// The error this connector stopped with, if any (sticky). Asked after every call by the
    /// rank driver, which then stops the rank: the typed error channel of the worker side.
    fn error(&self) -> Option<WorkerError> {
        None
    }
}

/// A [`WorkerConnector`] behind the step protocol guard: every hook is first admitted by a
/// [`WorkerProtocol`]; a hook out of order is a sticky [`ProtocolViolation`] and the inner
/// connector is not called.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct GuardedWorker<C> {
    inner: C,
    protocol: WorkerProtocol,
}

impl<C: WorkerConnector> GuardedWorker<C> {
    /// Guard `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            protocol: WorkerProtocol::new(),
        }
    }

    /// The guarded connector (read-only).
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// The guarded connector, mutable: for inputs that are not step hooks (a test double's
    /// script). Hooks go through the guard's methods.
    pub fn inner_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    /// The protocol state.
    pub fn protocol(&self) -> &WorkerProtocol {
        &self.protocol
    }

    /// Open a step of the given shape.
    pub fn begin_step(&mut self, shape: StepShape) -> Result<(), ProtocolViolation> {
        self.protocol.begin_step(shape).map(|_| ())
    }

    /// `handle_preemptions(meta)`.
    pub fn handle_preemptions(
        &mut self,
        meta: &C::Meta,
    ) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::HandlePreemptions)?;
        Ok(self.inner.handle_preemptions(meta))
    }

    /// `bind_connector_metadata(meta)`.
    pub fn bind(&mut self, meta: &C::Meta) -> Result<(), ProtocolViolation> {
        self.protocol.handle(WorkerCall::Bind)?;
        self.inner.bind(meta);
        Ok(())
    }

    /// `start_load_kv`.
    pub fn start_load_kv(&mut self) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::StartLoadKv)?;
        Ok(self.inner.start_load_kv())
    }

    /// `wait_for_layer_load(layer)`.
    pub fn wait_for_layer_load(
        &mut self,
        layer: u32,
    ) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::WaitForLayerLoad)?;
        Ok(self.inner.wait_for_layer_load(layer))
    }

    /// `save_kv_layer(layer)`.
    pub fn save_kv_layer(&mut self, layer: u32) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::SaveKvLayer)?;
        Ok(self.inner.save_kv_layer(layer))
    }

    /// `wait_for_save`.
    pub fn wait_for_save(&mut self) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::WaitForSave)?;
        Ok(self.inner.wait_for_save())
    }

    /// A transfer completed (not a step hook: allowed at any time).
    pub fn handle_transfer_done(&mut self, done: TransferDone) {
        self.inner.handle_transfer_done(done);
    }

    /// `get_transfer_results(finished_req_ids)`.
    pub fn get_transfer_results(
        &mut self,
        finished_req_ids: &SortedSet<RequestId>,
    ) -> Result<TransferResults, ProtocolViolation> {
        self.protocol.handle(WorkerCall::GetFinished)?;
        Ok(self.inner.get_transfer_results(finished_req_ids))
    }

    /// `get_block_ids_with_load_errors`.
    pub fn get_block_ids_with_load_errors(
        &mut self,
    ) -> Result<SortedSet<BlockId>, ProtocolViolation> {
        self.protocol
            .handle(WorkerCall::GetBlockIdsWithLoadErrors)?;
        Ok(self.inner.get_block_ids_with_load_errors())
    }

    /// `build_connector_worker_meta`.
    pub fn build_connector_worker_meta(
        &mut self,
    ) -> Result<Option<C::WorkerMeta>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::BuildWorkerMeta)?;
        Ok(self.inner.build_connector_worker_meta())
    }

    /// `clear_connector_metadata`.
    pub fn clear(&mut self) -> Result<(), ProtocolViolation> {
        self.protocol.handle(WorkerCall::Clear)?;
        self.inner.clear();
        Ok(())
    }
}
