//! The scheduler's typed errors, and the historical bugs it can re-introduce for the model
//! checker (`fault-injection` only).

use alloc::string::String;
use alloc::vec::Vec;

use super::RequestStatus;
use super::intent::Intent;
use crate::ids::{BlockId, JobId, RequestId, StepId};
use crate::messages::Direction;

/// A connector broke its contract (SEMANTICS.md §3): an answer the scheduler cannot take, or a
/// call the connector cannot honour, where vLLM asserts or raises. It reaches the scheduler
/// through [`crate::SchedulerConnector::take_error`] (or is found by the scheduler itself) and
/// stops it with the sticky [`SchedulerError::ConnectorContract`]; a connector driven directly
/// returns it from its `try_*` methods.
#[derive(
    Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize, thiserror::Error,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ConnectorError {
    /// `get_num_new_matched_tokens` answered an async load of 0 tokens.
    #[error("lookup for {request:?} answered an async load of 0 tokens")]
    AsyncLoadOfNothing {
        /// The request looked up.
        request: RequestId,
    },
    /// `get_num_new_matched_tokens` answered more tokens than the request can take beyond its
    /// local hit (a sync load must leave one token to compute).
    #[error(
        "lookup for {request:?} answered {external} tokens beyond a local hit of {local} for a \
         request of {num_tokens} tokens"
    )]
    HitBeyondRequest {
        /// The request looked up.
        request: RequestId,
        /// Its local prefix-cache hit, in tokens.
        local: u32,
        /// The tokens the connector answered.
        external: u32,
        /// The request's tokens.
        num_tokens: u32,
    },
    /// A call named a request the connector does not track.
    #[error("{call} for {request:?}, which the connector does not track")]
    UntrackedRequest {
        /// The connector call.
        call: String,
        /// The request.
        request: RequestId,
    },
    /// A transfer job created next to a job it may not share a request with (I-39: a load
    /// only for a request without jobs; a store never next to an async load).
    #[error("job {job:?} for {request:?} next to job {other:?} in flight")]
    JobConflict {
        /// The request.
        request: RequestId,
        /// The new job.
        job: JobId,
        /// A job of the request in flight.
        other: JobId,
    },
    /// An acknowledgement of a job that is not in flight.
    #[error("acknowledgement for unknown job {job:?}")]
    UnknownJob {
        /// The job acknowledged.
        job: JobId,
    },
    /// An acknowledgement count of 0, or more than the job still has due.
    #[error("job {job:?} acknowledged {count} times, {due} due")]
    BadAcknowledgement {
        /// The job.
        job: JobId,
        /// The count acknowledged.
        count: u32,
        /// The acknowledgements still due.
        due: u32,
    },
    /// The connector's own store refused what the connector had promised (e.g. pinning keys
    /// it reported as a hit).
    #[error("the connector's store refused {op} for {request:?}: {detail}")]
    StoreRefused {
        /// The store operation.
        op: String,
        /// The request it was for.
        request: RequestId,
        /// The store's own error kind.
        kind: String,
        /// The store's own error.
        detail: String,
    },
    /// The aggregated worker metadata is not of the form the connector reads (a MultiConnector:
    /// a `multi` tuple with a slot for every child). Kind `meta_mismatch`.
    #[error("worker metadata {found} where {expected} was expected")]
    WorkerMetaShape {
        /// What was found: a form name or `"multi with N slots"`.
        found: String,
        /// What the connector reads.
        expected: String,
    },
    /// Two children of a MultiConnector returned `kv_transfer_params` with a common key
    /// (I-32). Kind `params_conflict`.
    #[error(
        "children of the MultiConnector set the same kv_transfer_params keys {keys:?} for \
         {request:?}"
    )]
    ParamsConflict {
        /// The finishing request.
        request: RequestId,
        /// The clashing keys, sorted.
        keys: Vec<String>,
    },
    /// Children of a MultiConnector answered different finished counts. Kind
    /// `finished_count_conflict`.
    #[error("MultiConnector children returned incompatible finished counts: {counts:?}")]
    FinishedCountConflict {
        /// The distinct counts, sorted.
        counts: Vec<u32>,
    },
}

impl ConnectorError {
    /// The snake_case kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::AsyncLoadOfNothing { .. } => "async_load_of_nothing",
            Self::HitBeyondRequest { .. } => "hit_beyond_request",
            Self::UntrackedRequest { .. } => "untracked_request",
            Self::JobConflict { .. } => "job_conflict",
            Self::UnknownJob { .. } => "unknown_job",
            Self::BadAcknowledgement { .. } => "bad_acknowledgement",
            Self::StoreRefused { .. } => "store_refused",
            Self::WorkerMetaShape { .. } => "meta_mismatch",
            Self::ParamsConflict { .. } => "params_conflict",
            Self::FinishedCountConflict { .. } => "finished_count_conflict",
        }
    }
}

/// Errors of the scheduler. See the module docs for which ones stick.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// A configuration value out of range.
    #[error("invalid scheduler configuration: {0}")]
    InvalidConfig(String),
    /// `add_request` with the id of a live request.
    #[error("request {0:?} already exists")]
    DuplicateRequest(RequestId),
    /// `add_request` with an empty prompt, `max_tokens == 0`, or a prompt that does not fit.
    #[error("request {id:?} rejected: {why}")]
    BadRequest {
        /// The request.
        id: RequestId,
        /// What is wrong.
        why: String,
    },
    /// An output names a request the scheduler does not hold.
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// An output carries tokens for a request not scheduled in that step (or twice).
    #[error("request {id:?} was not scheduled in step {step:?} (or appears twice)")]
    NotScheduled {
        /// The step.
        step: StepId,
        /// The request.
        id: RequestId,
    },
    /// `update_from_output` for a step that is not the oldest in flight.
    #[error("output for step {got:?}, but the oldest step in flight is {expected:?}")]
    StepOutOfOrder {
        /// The oldest step in flight (`None`: none is).
        expected: Option<StepId>,
        /// The step named.
        got: StepId,
    },
    /// `schedule()` with `async_depth` steps already in flight.
    #[error("{depth} steps already in flight; apply the oldest output first")]
    PipelineFull {
        /// The configured depth.
        depth: u32,
    },
    /// A block id outside the pool.
    #[error("block {0:?} is out of range")]
    BlockOutOfRange(BlockId),
    /// `invalid_block_ids` with several KV cache groups (I-36; vLLM raises too).
    #[error("block-level load failures need a single KV cache group; report failed_recving")]
    InvalidBlocksWithMultipleGroups,
    /// A completion for a request that is not finished and not loading (sticks).
    #[error("{direction:?} completion for live request {id:?} (status {status:?})")]
    CompletionForLiveRequest {
        /// The request.
        id: RequestId,
        /// Which completion.
        direction: Direction,
        /// Its status.
        status: RequestStatus,
    },
    /// A completion for a request with nothing pending in that direction, or already freed
    /// (strict mode, or vLLM's crash cases in both modes; sticks).
    #[error("stale {direction:?} completion for request {id:?}")]
    StaleCompletion {
        /// The request.
        id: RequestId,
        /// Which completion.
        direction: Direction,
    },
    /// A second `finished_recving` for a load already reported (strict mode; sticks).
    #[error("duplicate {direction:?} completion for request {id:?}")]
    DuplicateCompletion {
        /// The request.
        id: RequestId,
        /// Which completion.
        direction: Direction,
    },
    /// The connector broke its contract (sticks).
    #[error("connector broke its contract: {0}")]
    ConnectorContract(ConnectorError),
    /// The connector asked for an intent that cannot be applied (sticks).
    #[error("connector intent {intent:?} rejected: {why}")]
    IntentRejected {
        /// The intent.
        intent: Intent,
        /// Why.
        why: String,
    },
}

impl SchedulerError {
    /// The snake_case kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidConfig(_) => "invalid_config",
            Self::DuplicateRequest(_) => "duplicate_request",
            Self::BadRequest { .. } => "bad_request",
            Self::UnknownRequest(_) => "unknown_request",
            Self::NotScheduled { .. } => "not_scheduled",
            Self::StepOutOfOrder { .. } => "step_out_of_order",
            Self::PipelineFull { .. } => "pipeline_full",
            Self::BlockOutOfRange(_) => "block_out_of_range",
            Self::InvalidBlocksWithMultipleGroups => "invalid_blocks_with_multiple_groups",
            Self::CompletionForLiveRequest { .. } => "completion_for_live_request",
            Self::StaleCompletion { .. } => "stale_completion",
            Self::DuplicateCompletion { .. } => "duplicate_completion",
            Self::ConnectorContract(_) => "connector_contract",
            Self::IntentRejected { .. } => "intent_rejected",
        }
    }
}

/// A historical vLLM scheduler bug, re-introduced on purpose so that the model checker can show
/// it finds it ([`Scheduler::inject_fault`]). Only with the `fault-injection` feature.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum SchedulerFault {
    /// Before vLLM PR #32255: a request aborted in `WAITING_FOR_REMOTE_KVS` has its blocks freed
    /// at once, while its async load may still be writing them (I-17); its `finished_recving`
    /// arriving later is ignored, as that scheduler ignored unknown ids there.
    FreeAbortedWhileLoading,
    /// Before vLLM issue #33775: a first allocation with a local hit and external tokens
    /// claims and allocates group by group, so one group's blocks for the external tokens can
    /// evict (take from the free queue) a hit block of a later group before that group claims
    /// it; both groups then hold the block (I-20).
    ClaimHitsGroupByGroup,
}
