//! The engine scheduler as the connector sees it (SEMANTICS.md §1.2, §1.6, §2.2–§2.3, §2.7–§2.9,
//! §6.1, §8.2, §8.3, §8.6): vLLM 0.33.0's `Scheduler` restricted to what decides connector calls
//! and block ownership.
//!
//! # When to call what
//!
//! * [`Scheduler::add_request`] when a request arrives (calls `on_new_request`).
//! * [`Scheduler::schedule`] once per engine step: returns the step's [`SchedulerOutput`] and the
//!   connector metadata for the workers. Up to `async_depth` steps may be scheduled before the
//!   oldest one's output is applied (async scheduling, I-12).
//! * [`Scheduler::update_from_output`] with the executed step's [`ModelOutput`] (sampled tokens
//!   and the *aggregated* connector output), oldest step first.
//! * [`Scheduler::abort`] between steps (client disconnect).
//! * [`Scheduler::has_requests`] to decide whether the engine keeps stepping.
//!
//! # What is modelled
//!
//! Requests with prompt tokens and a chained block-hash list; a shared GPU [`BlockPool`] with
//! prefix caching; one or more KV cache groups, full attention or sliding window (sliding-window
//! blocks below the window are freed while the request runs); chunked prefill under a token
//! budget and `max_num_seqs`; admission with connector lookups; async loads
//! (`WAITING_FOR_REMOTE_KVS`); preemption in recompute mode; finish by stop token, length or
//! abort with `request_finished` exactly once and delayed free; load-failure recovery with the
//! `fail` and `recompute` policies and the shared-block claiming rule (I-33…I-37); async
//! scheduling with placeholders. Not modelled: speculative decoding, encoder inputs, LoRA,
//! structured output, streaming sessions, priority scheduling, `defer_block_free`, Mamba.
//!
//! # Errors
//!
//! Bad input — an unknown or duplicate request id, a block id out of range, an output for a step
//! that is not the oldest in flight — is a typed [`SchedulerError`] and changes nothing. A
//! connector or worker breaking its contract mid-transition (an impossible lookup answer, an
//! intent that cannot be applied, a completion for a request that cannot take it) is detected
//! where vLLM would assert and crash; here it is a typed error that *sticks*: every later call
//! returns it, because the state is no longer one vLLM could be in.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use crate::Mode;
use crate::block_pool::{BlockHash, BlockPool, NULL_BLOCK, Token, hash_block};
use crate::connector::{FinishDecision, Intent, Lookup, Params, SchedulerConnector};
use crate::events::KvEvent;
use crate::ids::{BlockId, RequestId, StepId};
use crate::output::{AggregatedOutput, SortedSet};

// ---------------------------------------------------------------------------------------------
// Configuration.

/// The attention type of a KV cache group.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Every block of the prefix is read at every step.
    FullAttention,
    /// Only the last `window` tokens are read: blocks entirely below the window are freed while
    /// the request runs (replaced by the null block).
    SlidingWindow {
        /// Window length in tokens (≥ 1).
        window: u32,
    },
}

/// What happens to requests whose external KV failed to load (`kv_load_failure_policy`).
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LoadFailurePolicy {
    /// vLLM's default: affected requests finish with `FINISHED_ERROR`.
    #[default]
    Fail,
    /// Affected requests recompute the tokens that failed to load.
    Recompute,
}

/// Scheduler configuration. [`SchedulerConfig::default`] is a small single-group engine.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerConfig {
    /// Tokens per block (≥ 1).
    pub block_size: u32,
    /// GPU blocks in the pool, the null block included (≥ 2).
    pub num_gpu_blocks: u32,
    /// KV cache groups, in order (1 to 8).
    pub groups: Vec<GroupKind>,
    /// Token budget per step (`max_num_batched_tokens`, ≥ 1).
    pub max_num_batched_tokens: u32,
    /// Running requests at most (`max_num_seqs`, ≥ 1).
    pub max_num_seqs: u32,
    /// Prompt plus output tokens at most.
    pub max_model_len: u32,
    /// Whether full blocks are cached and looked up by hash.
    pub enable_prefix_caching: bool,
    /// Whether a prompt may be split over steps.
    pub enable_chunked_prefill: bool,
    /// Cap on tokens per prefill chunk when several requests compete (0 = none).
    pub long_prefill_token_threshold: u32,
    /// Blocks kept free when admitting a waiting request while others run.
    pub watermark_blocks: u32,
    /// `kv_load_failure_policy`.
    pub load_failure_policy: LoadFailurePolicy,
    /// Steps scheduled ahead of their output: 1 = synchronous, 2 = async scheduling.
    pub async_depth: u32,
    /// Compat (vLLM exactly) or strict (stale and duplicate completions are errors).
    pub mode: Mode,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 64,
            groups: alloc::vec![GroupKind::FullAttention],
            max_num_batched_tokens: 256,
            max_num_seqs: 16,
            max_model_len: 1024,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            watermark_blocks: 0,
            load_failure_policy: LoadFailurePolicy::Fail,
            async_depth: 1,
            mode: Mode::Compat,
        }
    }
}

impl SchedulerConfig {
    /// Checks the ranges documented on each field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let bad = |what: &str| Err(SchedulerError::InvalidConfig(String::from(what)));
        if self.block_size == 0 {
            return bad("block_size must be at least 1");
        }
        if self.num_gpu_blocks < 2 || self.num_gpu_blocks == u32::MAX {
            return bad("num_gpu_blocks must be at least 2 (block 0 is the null block)");
        }
        if self.groups.is_empty() || self.groups.len() > 8 {
            return bad("groups must hold 1 to 8 KV cache groups");
        }
        if self
            .groups
            .iter()
            .any(|g| matches!(g, GroupKind::SlidingWindow { window: 0 }))
        {
            return bad("a sliding window must be at least 1 token");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_model_len < 2 {
            return bad("max_model_len must be at least 2");
        }
        if !(1..=8).contains(&self.async_depth) {
            return bad("async_depth must be 1 (synchronous) to 8");
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Requests.

/// A request as it arrives.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestSpec {
    /// Its id (unique among live requests).
    pub id: RequestId,
    /// Prompt tokens (at least one).
    pub prompt: Vec<Token>,
    /// Output tokens at most (≥ 1).
    pub max_tokens: u32,
    /// Sampling this token stops the request (`FINISHED_STOPPED`).
    pub stop_token: Option<Token>,
    /// `kv_transfer_params` (P/D); read by connectors through the view.
    pub kv_transfer_params: Option<Params>,
}

/// vLLM's `RequestStatus`, restricted to the connector-relevant ones.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestStatus {
    /// Queued, never scheduled (or returned from a load).
    Waiting,
    /// Its async load is in flight; it holds blocks.
    WaitingForRemoteKvs,
    /// In the running batch.
    Running,
    /// Preempted (blocks freed, `num_computed_tokens = 0`), queued again.
    Preempted,
    /// Finished: sampled its stop token.
    FinishedStopped,
    /// Finished: reached `max_tokens` or `max_model_len`.
    FinishedLengthCapped,
    /// Finished: aborted from outside.
    FinishedAborted,
    /// Finished: failed (load failure under the `fail` policy).
    FinishedError,
}

impl RequestStatus {
    /// Whether this is a `FINISHED_*` status.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            Self::FinishedStopped
                | Self::FinishedLengthCapped
                | Self::FinishedAborted
                | Self::FinishedError
        )
    }
}

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Request {
    id: RequestId,
    status: RequestStatus,
    tokens: Vec<Token>,
    num_prompt_tokens: u32,
    block_hashes: Vec<BlockHash>,
    max_tokens: u32,
    stop_token: Option<Token>,
    kv_transfer_params: Option<Params>,
    num_computed_tokens: u32,
    num_in_flight_tokens: u32,
    num_output_placeholders: u32,
    num_stale_output_tokens: u32,
    drop_stale_output: bool,
    num_preemptions: u32,
    /// One block table per KV cache group.
    blocks: Vec<Vec<BlockId>>,
    /// Per group: how many leading blocks have been offered to the prefix cache.
    num_cached_blocks: Vec<u32>,
    is_prefill_chunk: bool,
    /// Finished, blocks kept because `request_finished` said `delay_free`.
    held_for_send: bool,
    /// Finished while its async load was in flight: blocks kept until `finished_recving`.
    held_for_recv: bool,
}

impl Request {
    fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    fn num_output_tokens(&self) -> u32 {
        self.num_tokens() - self.num_prompt_tokens
    }

    fn holds_kv_blocks(&self) -> bool {
        self.num_computed_tokens > 0 || self.status == RequestStatus::WaitingForRemoteKvs
    }

    fn append_token(&mut self, t: Token, block_size: u32) {
        self.tokens.push(t);
        let bs = block_size as usize;
        while (self.block_hashes.len() + 1) * bs <= self.tokens.len() {
            let i = self.block_hashes.len();
            let parent = self.block_hashes.last().copied();
            self.block_hashes
                .push(hash_block(parent, &self.tokens[i * bs..(i + 1) * bs]));
        }
    }
}

/// The deterministic "sampler" of tests and simulations: the token a request samples at
/// `position` (the index the new token will have). Reproducible on every platform.
pub fn fake_token(id: RequestId, position: u32) -> Token {
    let h = hash_block(None, &[id.0, position, 0x5eed]);
    (h.0 % 50_000) as Token + 1
}

// ---------------------------------------------------------------------------------------------
// Step input and output.

/// A request scheduled for the first time (or resumed, with the v2 runner), with its whole block
/// table.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NewRequestData {
    /// The request.
    pub id: RequestId,
    /// Its block table, one list per group.
    pub block_ids: Vec<Vec<BlockId>>,
    /// Computed tokens before this step (local hit + synchronously loaded).
    pub num_computed_tokens: u32,
}

/// A request scheduled again: running requests carry only the blocks allocated this step;
/// resumed requests (re-admitted after preemption) carry their whole new table.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CachedRequestData {
    /// The request.
    pub id: RequestId,
    /// Re-admitted after a preemption: `new_block_ids` is the full table.
    pub resumed: bool,
    /// Blocks allocated this step (or the full table when resumed), one list per group; empty
    /// (no list at all, vLLM's `None`) when a running request got no new block in any group.
    pub new_block_ids: Vec<Vec<BlockId>>,
    /// Computed tokens before this step.
    pub num_computed_tokens: u32,
}

/// What one `schedule()` decided (vLLM's `SchedulerOutput`, connector-relevant fields).
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerOutput {
    /// The step this output belongs to (0, 1, 2, …).
    pub step: StepId,
    /// First-time (and, for resumed requests, `resumed`) admissions with full tables.
    pub scheduled_new_reqs: Vec<NewRequestData>,
    /// Running and resumed requests.
    pub scheduled_cached_reqs: Vec<CachedRequestData>,
    /// Tokens per scheduled request, in scheduling order.
    pub num_scheduled_tokens: Vec<(RequestId, u32)>,
    /// Their sum.
    pub total_num_scheduled_tokens: u32,
    /// Requests finished since the previous `schedule()` (they reach the workers one step late).
    pub finished_req_ids: SortedSet<RequestId>,
    /// Requests preempted in this `schedule()`.
    pub preempted_req_ids: SortedSet<RequestId>,
    /// Some request admitted this step loads external KV synchronously.
    pub has_sync_kv_loads: bool,
}

/// One scheduled request as [`SchedulerOutput::scheduled_requests`] yields it (vLLM's
/// `yield_req_data`).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct ScheduledRequest<'a> {
    /// The request.
    pub id: RequestId,
    /// One list per group: the whole block table when `full_table`, else the blocks allocated
    /// this step (no list at all when none was).
    pub block_ids: &'a [Vec<BlockId>],
    /// Computed tokens before this step.
    pub num_computed_tokens: u32,
    /// `block_ids` is the whole table: a first admission or a resumption after preemption.
    pub full_table: bool,
}

impl SchedulerOutput {
    /// Every request with data in this output, first-time admissions first, then running and
    /// resumed ones, each in scheduling order. Use it wherever a worker or connector keeps
    /// block tables or needs each request's computed tokens before the step.
    pub fn scheduled_requests(&self) -> impl Iterator<Item = ScheduledRequest<'_>> + '_ {
        let new = self.scheduled_new_reqs.iter().map(|n| ScheduledRequest {
            id: n.id,
            block_ids: &n.block_ids,
            num_computed_tokens: n.num_computed_tokens,
            full_table: true,
        });
        let cached = self.scheduled_cached_reqs.iter().map(|c| ScheduledRequest {
            id: c.id,
            block_ids: &c.new_block_ids,
            num_computed_tokens: c.num_computed_tokens,
            full_table: c.resumed,
        });
        new.chain(cached)
    }
}

/// A scheduled step: the output and the connector metadata built for it. What the engine sends
/// every rank (serde: it crosses the process boundary to a rank process).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(
    serialize = "M: serde::Serialize",
    deserialize = "M: serde::Deserialize<'de>"
))]
pub struct ScheduledStep<M> {
    /// What was scheduled.
    pub output: SchedulerOutput,
    /// `build_connector_meta(output)`, for every rank.
    pub meta: M,
}

/// The executed step's result as the scheduler receives it.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(
    serialize = "WM: serde::Serialize",
    deserialize = "WM: serde::Deserialize<'de>"
))]
pub struct ModelOutput<WM> {
    /// Tokens sampled per scheduled request (absent = none: a partial prefill chunk).
    pub sampled: Vec<(RequestId, Vec<Token>)>,
    /// The aggregated connector output, `None` when the step produced none.
    pub kv_connector_output: Option<AggregatedOutput<WM>>,
}

impl<WM> Default for ModelOutput<WM> {
    fn default() -> Self {
        Self {
            sampled: Vec::new(),
            kv_connector_output: None,
        }
    }
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// Sampled its stop token.
    Stopped,
    /// Reached `max_tokens` or `max_model_len`.
    LengthCapped,
    /// Aborted.
    Aborted,
    /// Failed (load failure under the `fail` policy).
    Error,
}

impl FinishReason {
    fn status(self) -> RequestStatus {
        match self {
            Self::Stopped => RequestStatus::FinishedStopped,
            Self::LengthCapped => RequestStatus::FinishedLengthCapped,
            Self::Aborted => RequestStatus::FinishedAborted,
            Self::Error => RequestStatus::FinishedError,
        }
    }
}

/// One request's part of a step's result.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// Tokens accepted this step (trimmed at a stop).
    pub new_tokens: Vec<Token>,
    /// Set when the request finished this step.
    pub finish: Option<FinishReason>,
    /// What the connector attached at finish.
    pub kv_transfer_params: Option<Params>,
}

/// The result of [`Scheduler::update_from_output`].
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepResult {
    /// Per-request outputs, in scheduling order, then errored requests.
    pub outputs: Vec<RequestOutput>,
    /// The connector's KV events of this step.
    pub events: Vec<KvEvent>,
}

/// Which completion direction an error is about.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Completion {
    /// `finished_sending`.
    Sending,
    /// `finished_recving`.
    Recving,
}

/// Errors of the scheduler. See the module docs for which ones stick.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
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
        direction: Completion,
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
        direction: Completion,
    },
    /// A second `finished_recving` for a load already reported (strict mode; sticks).
    #[error("duplicate {direction:?} completion for request {id:?}")]
    DuplicateCompletion {
        /// The request.
        id: RequestId,
        /// Which completion.
        direction: Completion,
    },
    /// The connector answered something the contract forbids (sticks).
    #[error("connector broke its contract: {0}")]
    ConnectorContract(String),
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

// ---------------------------------------------------------------------------------------------
// State and the read-only view.

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct ScheduledEntry {
    id: RequestId,
    tokens: u32,
    /// Whether the runner samples a token for it (not a partial prefill chunk).
    samples: bool,
    /// The index the sampled token will have.
    position: u32,
}

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct InFlightStep {
    step: StepId,
    scheduled: Vec<ScheduledEntry>,
}

/// The requests the scheduler holds, indexed densely by [`RequestId`] (ids come from an
/// [`crate::Interner`], which keeps them dense): lookups on the hot path are array indexing, not
/// tree walks. Ids at or above [`MAX_REQUEST_ID`] are rejected at `add_request`. Trailing empty
/// slots are trimmed so that equal contents compare (and hash) equal.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
struct RequestTable {
    slots: Vec<Option<Request>>,
    len: usize,
}

/// Request ids must be below this (about a million live requests).
pub const MAX_REQUEST_ID: u32 = 1 << 20;

impl RequestTable {
    fn get(&self, id: &RequestId) -> Option<&Request> {
        self.slots.get(id.index()).and_then(Option::as_ref)
    }
    fn get_mut(&mut self, id: &RequestId) -> Option<&mut Request> {
        self.slots.get_mut(id.index()).and_then(Option::as_mut)
    }
    fn contains_key(&self, id: &RequestId) -> bool {
        self.get(id).is_some()
    }
    fn insert(&mut self, id: RequestId, r: Request) {
        let i = id.index();
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        if self.slots[i].replace(r).is_none() {
            self.len += 1;
        }
    }
    fn remove(&mut self, id: &RequestId) -> Option<Request> {
        let r = self.slots.get_mut(id.index()).and_then(Option::take);
        if r.is_some() {
            self.len -= 1;
            while matches!(self.slots.last(), Some(None)) {
                self.slots.pop();
            }
        }
        r
    }
    fn values(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().flatten()
    }
    fn keys(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.values().map(|r| r.id)
    }
    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl core::ops::Index<&RequestId> for RequestTable {
    type Output = Request;
    /// Panics on an id the table does not hold: callers index only ids they know are held (queued
    /// or scheduled requests), so a miss is a bookkeeping bug.
    fn index(&self, id: &RequestId) -> &Request {
        self.get(id).expect("request held by the scheduler")
    }
}

/// Everything the scheduler owns except the connector (so that the connector can be called with
/// a view of it).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct State {
    config: SchedulerConfig,
    pool: BlockPool,
    requests: RequestTable,
    waiting: VecDeque<RequestId>,
    kv_holding_waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    finished_req_ids: BTreeSet<RequestId>,
    reset_preempted_req_ids: BTreeSet<RequestId>,
    finished_recving_kv_req_ids: BTreeSet<RequestId>,
    failed_recving_kv_req_ids: BTreeSet<RequestId>,
    inflight_prefills: BTreeSet<RequestId>,
    in_flight: VecDeque<InFlightStep>,
    next_step: u64,
    /// Connector pins: block → references held by the connector.
    pins: BTreeMap<BlockId, u32>,
    requires_kv_delivery: bool,
    broken: Option<SchedulerError>,
    #[cfg(feature = "fault-injection")]
    fault: Option<SchedulerFault>,
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

impl State {
    /// Whether [`SchedulerFault::ClaimHitsGroupByGroup`] was injected (always `false` without
    /// the `fault-injection` feature).
    fn claims_hits_group_by_group(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            self.fault == Some(SchedulerFault::ClaimHitsGroupByGroup)
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }

    /// Whether [`SchedulerFault::FreeAbortedWhileLoading`] was injected: the one place the
    /// fault's three effects ask (always `false` without the `fault-injection` feature).
    fn frees_aborted_loads_at_once(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            self.fault == Some(SchedulerFault::FreeAbortedWhileLoading)
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }
}

/// A read-only view of scheduler state, lent to a connector for one call (SEMANTICS.md §7.3).
///
/// It holds a shared borrow of the scheduler, so it cannot outlive the call and nothing can be
/// mutated through it; everything it returns is a copy or a shared slice.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerView<'a> {
    state: &'a State,
}

/// A read-only view of one request.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    r: &'a Request,
}

impl<'a> RequestView<'a> {
    /// Its id.
    pub fn id(&self) -> RequestId {
        self.r.id
    }
    /// Its status.
    pub fn status(&self) -> RequestStatus {
        self.r.status
    }
    /// Prompt plus output tokens.
    pub fn tokens(&self) -> &'a [Token] {
        &self.r.tokens
    }
    /// Prompt length.
    pub fn num_prompt_tokens(&self) -> u32 {
        self.r.num_prompt_tokens
    }
    /// Hashes of the full blocks of `tokens`, chained.
    pub fn block_hashes(&self) -> &'a [BlockHash] {
        &self.r.block_hashes
    }
    /// Tokens whose KV is computed (or being loaded, for `WAITING_FOR_REMOTE_KVS`).
    pub fn num_computed_tokens(&self) -> u32 {
        self.r.num_computed_tokens
    }
    /// How often it was preempted.
    pub fn num_preemptions(&self) -> u32 {
        self.r.num_preemptions
    }
    /// `kv_transfer_params` of the request.
    pub fn kv_transfer_params(&self) -> Option<&'a Params> {
        self.r.kv_transfer_params.as_ref()
    }
    /// Its block table in `group` (empty for an unknown group).
    pub fn block_ids(&self, group: usize) -> &'a [BlockId] {
        self.r.blocks.get(group).map_or(&[], Vec::as_slice)
    }
}

impl<'a> SchedulerView<'a> {
    /// The configuration.
    pub fn config(&self) -> &'a SchedulerConfig {
        &self.state.config
    }
    /// A request the scheduler holds (live, or finished and held for the connector).
    pub fn request(&self, id: RequestId) -> Option<RequestView<'a>> {
        self.state.requests.get(&id).map(|r| RequestView { r })
    }
    /// Waiting requests in admission order (those holding blocks first).
    pub fn waiting(&self) -> impl Iterator<Item = RequestId> + 'a {
        self.state
            .kv_holding_waiting
            .iter()
            .chain(self.state.waiting.iter())
            .copied()
    }
    /// Running requests in order.
    pub fn running(&self) -> &'a [RequestId] {
        &self.state.running
    }
    /// Free GPU blocks.
    pub fn num_free_blocks(&self) -> u32 {
        self.state.pool.num_free()
    }
    /// Owners of a GPU block (`None` if out of range).
    pub fn block_ref_cnt(&self, b: BlockId) -> Option<u32> {
        self.state
            .pool
            .contains(b)
            .then(|| self.state.pool.ref_cnt(b))
    }
    /// The local prefix-cache hit of a request, per group, in tokens (the query OffloadingConnector
    /// makes through `bind_kv_cache_manager`). Empty for an unknown request.
    pub fn prefix_cache_hits(&self, id: RequestId) -> Vec<u32> {
        match self.state.requests.get(&id) {
            Some(r) => self.state.per_group_hits(r),
            None => Vec::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Block accounting per group (vLLM's single-type managers, simplified to one block size).

fn cdiv(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

/// Tokens of the prefix a group no longer reads when `num_computed` tokens are computed.
fn num_skipped_tokens(kind: GroupKind, num_computed: u32) -> u32 {
    match kind {
        GroupKind::FullAttention => 0,
        GroupKind::SlidingWindow { window } => (num_computed + 1).saturating_sub(window),
    }
}

impl State {
    fn view(&self) -> SchedulerView<'_> {
        SchedulerView { state: self }
    }

    fn bs(&self) -> u32 {
        self.config.block_size
    }

    /// The longest prefix-cache hit of one group, at most `max_len` tokens, as blocks (null
    /// blocks below a sliding window).
    fn group_hit(&self, r: &Request, g: usize, max_len: u32) -> Vec<BlockId> {
        let bs = self.bs();
        let max_blocks = ((max_len / bs) as usize).min(r.block_hashes.len());
        let group = g as u8;
        match self.config.groups[g] {
            GroupKind::FullAttention => {
                let mut out = Vec::new();
                for h in &r.block_hashes[..max_blocks] {
                    match self.pool.get_cached(*h, group) {
                        Some(b) => out.push(b),
                        None => break,
                    }
                }
                out
            }
            GroupKind::SlidingWindow { window } => {
                let needed = cdiv(window - 1, bs).max(1) as usize;
                let mut computed = alloc::vec![NULL_BLOCK; max_blocks];
                let mut contiguous = 0usize;
                for i in (0..max_blocks).rev() {
                    if let Some(b) = self.pool.get_cached(r.block_hashes[i], group) {
                        computed[i] = b;
                        contiguous += 1;
                        if contiguous >= needed {
                            computed.truncate(i + contiguous);
                            return computed;
                        }
                    } else {
                        contiguous = 0;
                    }
                }
                computed.truncate(contiguous);
                computed
            }
        }
    }

    /// The hybrid hit over all groups (vLLM's coordinator): the longest length every group hits.
    fn local_hit(&self, r: &Request) -> (Vec<Vec<BlockId>>, u32) {
        let n = self.config.groups.len();
        if !self.config.enable_prefix_caching || r.num_tokens() == 0 {
            return (alloc::vec![Vec::new(); n], 0);
        }
        let bs = self.bs();
        let mut len = r.num_tokens() - 1;
        loop {
            let hits: Vec<Vec<BlockId>> = (0..n).map(|g| self.group_hit(r, g, len)).collect();
            let common = hits.iter().map(|h| h.len() as u32 * bs).min().unwrap_or(0);
            if common == len || hits.iter().all(|h| h.len() as u32 * bs == common) {
                let mut hits = hits;
                for h in &mut hits {
                    h.truncate((common / bs) as usize);
                }
                return (hits, common);
            }
            len = common;
        }
    }

    fn per_group_hits(&self, r: &Request) -> Vec<u32> {
        let max = r.num_tokens().saturating_sub(1);
        (0..self.config.groups.len())
            .map(|g| self.group_hit(r, g, max).len() as u32 * self.bs())
            .collect()
    }

    /// Blocks `group` must take from the pool to reach `need_slot` tokens, given the table length
    /// and the new hit blocks (a free hit block counts: touching takes it from the pool).
    fn blocks_to_allocate(
        &self,
        g: usize,
        table_len: u32,
        hit: &[BlockId],
        need_slot: u32,
        total_computed: u32,
    ) -> u32 {
        let bs = self.bs();
        let skipped = num_skipped_tokens(self.config.groups[g], total_computed) / bs;
        // Hit blocks below the window are not adopted (`adopt_hit`), so only the rest count.
        let adopted = (skipped.saturating_sub(table_len) as usize).min(hit.len());
        let evictable = hit[adopted..]
            .iter()
            .filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0)
            .count() as u32;
        let have = table_len + hit.len() as u32;
        let required = cdiv(need_slot, bs);
        evictable + required.saturating_sub(have.max(skipped.min(required)))
    }

    /// Free the blocks a sliding-window group no longer reads (vLLM's `remove_skipped_blocks`).
    fn remove_skipped_blocks(&mut self, id: RequestId, num_computed: u32) {
        let bs = self.bs();
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        for (g, kind) in self.config.groups.iter().enumerate() {
            let n = (num_skipped_tokens(*kind, num_computed) / bs) as usize;
            let table = &mut r.blocks[g];
            let mut removed = Vec::new();
            for i in (0..n.min(table.len())).rev() {
                if table[i] == NULL_BLOCK {
                    break;
                }
                removed.push(table[i]);
                table[i] = NULL_BLOCK;
            }
            self.pool.free_blocks(removed);
        }
    }

    /// vLLM's `allocate_slots`. `hit` = new local hit blocks and their token count (fresh
    /// admissions only). Returns the blocks allocated for new tokens, per group, or `None` (only
    /// skipped blocks may have been freed then).
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &mut self,
        id: RequestId,
        num_new_tokens: u32,
        hit: Option<&(Vec<Vec<BlockId>>, u32)>,
        ext: u32,
        delay_cache: bool,
        reserved: u32,
    ) -> Option<Vec<Vec<BlockId>>> {
        let bs = self.bs();
        let ngroups = self.config.groups.len();
        let hit_tokens = hit.map_or(0, |h| h.1);
        let hit_of = |g: usize| -> &[BlockId] { hit.map_or(&[], |h| h.0[g].as_slice()) };
        let r = &self.requests[&id];
        let local = r.num_computed_tokens + hit_tokens;
        let total_computed = (local + ext).min(self.config.max_model_len);
        let watermark = if !self.running.is_empty()
            && matches!(r.status, RequestStatus::Waiting | RequestStatus::Preempted)
        {
            self.config.watermark_blocks
        } else {
            0
        };
        let main = total_computed + num_new_tokens;
        let need_slot = main.min(self.config.max_model_len);
        let processed = total_computed.saturating_sub(r.num_in_flight_tokens);
        self.remove_skipped_blocks(id, processed);
        let r = &self.requests[&id];
        let mut needed = 0;
        for g in 0..ngroups {
            needed += self.blocks_to_allocate(
                g,
                r.blocks[g].len() as u32,
                hit_of(g),
                need_slot,
                local + ext,
            );
        }
        // vLLM: `needed + watermark > free - reserved`, in Python integers; the sum form stays
        // exact in `u32` when in-flight reservations exceed the free blocks (then nothing is
        // admitted, not even a request that needs no block).
        if needed + watermark + reserved > self.pool.num_free() {
            return None;
        }
        if hit_tokens > 0 || ext > 0 {
            self.adopt_computed_blocks(id, hit.map_or(&[][..], |h| &h.0[..]), local, ext);
        }
        let r = self.requests.get_mut(&id).expect("checked above");
        let required = cdiv(need_slot, bs) as usize;
        // vLLM's `get_block_ids(allow_none=True)`: no list at all when no group got a block
        // (most decode steps; and no allocation on the hot path).
        let mut new_blocks = Vec::new();
        for g in 0..ngroups {
            let missing = required.saturating_sub(r.blocks[g].len()) as u32;
            let fresh = self
                .pool
                .get_new_blocks(missing)
                // The count above included every block taken here; running short means the
                // accounting is wrong, a bug.
                .expect("counted in blocks_to_allocate");
            r.blocks[g].extend_from_slice(&fresh);
            if !fresh.is_empty() && new_blocks.is_empty() {
                new_blocks.resize_with(ngroups, Vec::new);
            }
            if !new_blocks.is_empty() {
                new_blocks[g] = fresh;
            }
        }
        if !delay_cache {
            let upto = (total_computed + num_new_tokens).min(r.num_tokens());
            self.cache_blocks(id, upto);
        }
        Some(new_blocks)
    }

    /// A first allocation's computed prefix: the local hit, then blocks for the external
    /// tokens (vLLM's `allocate_new_computed_blocks`, the request's tables empty). In two
    /// phases, as vLLM since issue #33775: first every group adopts its hit, then every group
    /// takes blocks for the external tokens — so one group's new block can never evict a hit
    /// block another group has not claimed yet (which would put one block in two tables).
    ///
    /// In a sliding-window group the window is that of the local *and* external tokens: the
    /// hit blocks below it are not adopted (nulls stand for them), and external tokens below it
    /// get no block (`add_local_computed_blocks`, `allocate_external_computed_blocks`).
    fn adopt_computed_blocks(
        &mut self,
        id: RequestId,
        hits: &[Vec<BlockId>],
        local: u32,
        ext: u32,
    ) {
        let r = &self.requests[&id];
        if r.blocks.iter().any(|t| !t.is_empty()) {
            // Not a first allocation: a 1-token prompt whose async load covered it is looked up
            // again holding its block (promotion leaves 0 computed tokens). vLLM's coordinator
            // skips the request, which is already in its managers' `num_cached_block`; a prompt
            // without a full block has no hit to adopt.
            debug_assert!(hits.iter().all(Vec::is_empty));
            return;
        }
        let hit = |g: usize| hits.get(g).map_or(&[][..], Vec::as_slice);
        let groups = self.config.groups.len();
        if self.claims_hits_group_by_group() {
            for g in 0..groups {
                self.adopt_hit(id, g, hit(g), local + ext);
                self.take_external_blocks(id, g, local, ext);
            }
            return;
        }
        for g in 0..groups {
            self.adopt_hit(id, g, hit(g), local + ext);
        }
        for g in 0..groups {
            self.take_external_blocks(id, g, local, ext);
        }
    }

    /// Group `g` claims the blocks of its hit inside the window of `total` computed tokens and
    /// puts nulls below it (`add_local_computed_blocks`).
    fn adopt_hit(&mut self, id: RequestId, g: usize, hit: &[BlockId], total: u32) {
        let skipped = (num_skipped_tokens(self.config.groups[g], total) / self.bs()) as usize;
        let adopted = &hit[skipped.min(hit.len())..];
        self.pool.touch(adopted.iter().copied());
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        let table = &mut r.blocks[g];
        table.resize(skipped, NULL_BLOCK);
        table.extend_from_slice(adopted);
        r.num_cached_blocks[g] = table.len() as u32;
    }

    /// Group `g` takes blocks for the external tokens inside its window
    /// (`allocate_external_computed_blocks`).
    fn take_external_blocks(&mut self, id: RequestId, g: usize, local: u32, ext: u32) {
        let total = local + ext;
        if ext == 0 || num_skipped_tokens(self.config.groups[g], total) >= total {
            // No external token, or every one lies below the window (a window of 1 token).
            return;
        }
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        let table = &mut r.blocks[g];
        let missing = (cdiv(total, self.config.block_size) as usize).saturating_sub(table.len());
        let fresh = self
            .pool
            .get_new_blocks(missing as u32)
            .expect("counted in blocks_to_allocate");
        table.extend(fresh);
    }

    /// Offer the request's full blocks up to `num_tokens` to the prefix cache.
    fn cache_blocks(&mut self, id: RequestId, num_tokens: u32) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let bs = self.bs();
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        for g in 0..r.blocks.len() {
            let full = ((num_tokens / bs) as usize)
                .min(r.blocks[g].len())
                .min(r.block_hashes.len());
            let from = r.num_cached_blocks[g] as usize;
            // vLLM caches only the blocks a later hit can reach (`reachable_block_mask`): a
            // sliding-window hit needs `cdiv(window - 1, block_size)` contiguous blocks, so a
            // window of one token needs none, reaches no block, and its group caches nothing
            // (its blocks are freed uncached, to the head of the free queue).
            let reachable = !matches!(
                self.config.groups[g],
                GroupKind::SlidingWindow { window } if window <= 1
            );
            for i in (from..full).filter(|_| reachable) {
                self.pool
                    .cache_block(r.blocks[g][i], r.block_hashes[i], g as u8);
            }
            if full > from {
                r.num_cached_blocks[g] = full as u32;
            }
        }
    }

    /// Free every block of the request (tail first, group by group) and empty its tables.
    fn free_request_blocks(&mut self, id: RequestId) {
        let r = self
            .requests
            .get_mut(&id)
            .expect("caller holds the request");
        for g in 0..r.blocks.len() {
            let table = core::mem::take(&mut r.blocks[g]);
            self.pool.free_blocks(table.into_iter().rev());
            r.num_cached_blocks[g] = 0;
        }
    }

    /// The blocks a request still needs to hold its full sequence (reservation of in-flight
    /// prefills against async-load admission).
    fn remaining_blocks(&self, id: RequestId) -> u32 {
        let r = &self.requests[&id];
        let full = r.num_tokens().min(self.config.max_model_len);
        (0..self.config.groups.len())
            .map(|g| {
                self.blocks_to_allocate(
                    g,
                    r.blocks[g].len() as u32,
                    &[],
                    full,
                    r.num_computed_tokens,
                )
            })
            .sum()
    }
}

// ---------------------------------------------------------------------------------------------
// The scheduler.

/// The scheduler with its connector. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Scheduler<C> {
    state: State,
    connector: C,
}

impl<C: SchedulerConnector> Scheduler<C> {
    /// A scheduler with an empty pool and no requests.
    pub fn new(config: SchedulerConfig, connector: C) -> Result<Self, SchedulerError> {
        config.validate()?;
        let pool = BlockPool::new(config.num_gpu_blocks);
        let requires_kv_delivery = connector.requires_kv_delivery();
        Ok(Self {
            state: State {
                config,
                pool,
                requests: RequestTable::default(),
                waiting: VecDeque::new(),
                kv_holding_waiting: VecDeque::new(),
                running: Vec::new(),
                finished_req_ids: BTreeSet::new(),
                reset_preempted_req_ids: BTreeSet::new(),
                finished_recving_kv_req_ids: BTreeSet::new(),
                failed_recving_kv_req_ids: BTreeSet::new(),
                inflight_prefills: BTreeSet::new(),
                in_flight: VecDeque::new(),
                next_step: 0,
                pins: BTreeMap::new(),
                requires_kv_delivery,
                broken: None,
                #[cfg(feature = "fault-injection")]
                fault: None,
            },
            connector,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.state.config
    }

    /// Re-introduces a historical bug (model checking only; see [`SchedulerFault`]).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, fault: SchedulerFault) {
        self.state.fault = Some(fault);
    }

    /// The connector (read-only; it is driven only by the scheduler).
    pub fn connector(&self) -> &C {
        &self.connector
    }

    /// The connector, mutably: for configuring it between calls (a scripted connector's answers,
    /// a runtime connector's settings). The scheduler sees changes only through later calls.
    pub fn connector_mut(&mut self) -> &mut C {
        &mut self.connector
    }

    /// A read-only view, as connectors get it.
    pub fn view(&self) -> SchedulerView<'_> {
        self.state.view()
    }

    /// The GPU block pool (read-only).
    pub fn block_pool(&self) -> &BlockPool {
        &self.state.pool
    }

    /// The sticky error, if a contract breach broke the scheduler.
    pub fn broken(&self) -> Option<&SchedulerError> {
        self.state.broken.as_ref()
    }

    /// Steps scheduled whose output has not been applied yet, oldest first.
    pub fn steps_in_flight(&self) -> impl Iterator<Item = StepId> + '_ {
        self.state.in_flight.iter().map(|s| s.step)
    }

    /// `has_requests()`: unfinished requests, finished ones still holding blocks for the
    /// connector, finished ids not yet delivered in a step's `finished_req_ids`, or connector
    /// push work pending. The engine keeps stepping while it is true.
    pub fn has_requests(&self) -> bool {
        !self.state.requests.is_empty()
            || !self.state.finished_req_ids.is_empty()
            || self.connector.has_pending_push_work()
    }

    /// `reset_connector_cache()`.
    pub fn reset_connector_cache(&mut self) -> Result<Option<bool>, SchedulerError> {
        self.check_broken()?;
        let r = self.connector.reset_cache();
        self.apply_intents()?;
        Ok(r)
    }

    /// The status of a request the scheduler holds.
    pub fn status(&self, id: RequestId) -> Option<RequestStatus> {
        self.state.requests.get(&id).map(|r| r.status)
    }

    /// Ids of every request the scheduler holds, in id order.
    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.state.requests.keys()
    }

    fn check_broken(&self) -> Result<(), SchedulerError> {
        match &self.state.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: SchedulerError) -> SchedulerError {
        self.state.broken = Some(e.clone());
        e
    }

    /// Apply the intents of the connector's last call.
    fn apply_intents(&mut self) -> Result<(), SchedulerError> {
        if let Some(why) = self.connector.take_error() {
            return Err(self.fail(SchedulerError::ConnectorContract(why)));
        }
        for intent in self.connector.take_intents() {
            let st = &mut self.state;
            let why = match &intent {
                Intent::Pin(blocks) => blocks.iter().find_map(|&b| {
                    if !st.pool.contains(b) || b == NULL_BLOCK {
                        Some(format!("block {} is not a pool block", b.0))
                    } else if st.pool.ref_cnt(b) == 0 && st.pool.cached_hash(b).is_none() {
                        Some(format!("block {} is free and holds no cached KV", b.0))
                    } else {
                        None
                    }
                }),
                Intent::Unpin(blocks) => {
                    let mut need: BTreeMap<BlockId, u32> = BTreeMap::new();
                    for &b in blocks {
                        *need.entry(b).or_default() += 1;
                    }
                    need.iter().find_map(|(b, n)| {
                        (st.pins.get(b).copied().unwrap_or(0) < *n)
                            .then(|| format!("block {} is not pinned", b.0))
                    })
                }
            };
            if let Some(why) = why {
                return Err(self.fail(SchedulerError::IntentRejected { intent, why }));
            }
            match intent {
                Intent::Pin(blocks) => {
                    for b in blocks {
                        *st.pins.entry(b).or_default() += 1;
                        st.pool.touch([b]);
                    }
                }
                Intent::Unpin(blocks) => {
                    for b in blocks {
                        let n = st.pins.get_mut(&b).expect("validated above");
                        *n -= 1;
                        if *n == 0 {
                            st.pins.remove(&b);
                        }
                        st.pool.free_blocks([b]);
                    }
                }
            }
        }
        Ok(())
    }

    /// `add_request`: queue the request and call `on_new_request`.
    pub fn add_request(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
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
            id,
            status: RequestStatus::Waiting,
            tokens: Vec::with_capacity(spec.prompt.len() + spec.max_tokens.min(4096) as usize),
            num_prompt_tokens: spec.prompt.len() as u32,
            block_hashes: Vec::new(),
            max_tokens: spec.max_tokens,
            stop_token: spec.stop_token,
            kv_transfer_params: spec.kv_transfer_params,
            num_computed_tokens: 0,
            num_in_flight_tokens: 0,
            num_output_placeholders: 0,
            num_stale_output_tokens: 0,
            drop_stale_output: false,
            num_preemptions: 0,
            blocks: alloc::vec![Vec::new(); ngroups],
            num_cached_blocks: alloc::vec![0; ngroups],
            is_prefill_chunk: true,
            held_for_send: false,
            held_for_recv: false,
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
    fn finish_requests(
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
    fn free_request(
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
    fn preempt(&mut self, id: RequestId) {
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
    fn update_waiting_for_remote_kv(&mut self, id: RequestId) {
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

    /// The tokens the deterministic fake sampler produces for a step in flight: one token per
    /// request that is not a partial prefill chunk. Use it to build a [`ModelOutput`] in tests
    /// and simulations.
    pub fn fake_sample(&self, step: StepId) -> Vec<(RequestId, Vec<Token>)> {
        self.state
            .in_flight
            .iter()
            .find(|s| s.step == step)
            .map(|s| {
                s.scheduled
                    .iter()
                    .filter(|e| e.samples)
                    .map(|e| (e.id, alloc::vec![fake_token(e.id, e.position)]))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Checks an output before anything is applied: bad input changes nothing.
    fn validate_output(
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
                self.apply_completion(id, Completion::Recving)?;
            }
            for &id in kv.finished_sending.iter().flat_map(|s| s.iter()) {
                self.apply_completion(id, Completion::Sending)?;
            }
        }

        // 8. Events.
        result.events = self.connector.take_events();
        Ok(result)
    }

    /// One id of `finished_recving` / `finished_sending` (§2.7 6b–6c, I-15…I-17).
    fn apply_completion(&mut self, id: RequestId, dir: Completion) -> Result<(), SchedulerError> {
        let strict = self.state.config.mode == Mode::Strict;
        let st = &mut self.state;
        if dir == Completion::Recving
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
        if dir == Completion::Recving && r.status == RequestStatus::WaitingForRemoteKvs {
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
                Completion::Recving => &mut r.held_for_recv,
                Completion::Sending => &mut r.held_for_send,
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
    fn handle_failed_recving(&mut self, failed: &SortedSet<RequestId>) -> Vec<RequestId> {
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
    fn handle_invalid_blocks(
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
    fn truncate_invalid(
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

    /// I-14…I-20 and the pool's own invariants. Call after every transition in tests.
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        use crate::ensure_invariant;
        let st = &self.state;
        st.pool.check_invariants()?;
        // Owners per block: requests' tables plus connector pins must equal the ref counts
        // (I-20: a block is shared only through the prefix cache, i.e. as a counted owner).
        // A shared block is a prefix-cache hit, so every table holds it in the same group at
        // the same position (the position its hash chains to): a block in two groups, or twice
        // in one request, is owned twice by mistake even when the counts agree (the oracle
        // issue's two-group hit adoption, vLLM issue #33775).
        let mut owners: BTreeMap<BlockId, u32> = BTreeMap::new();
        let mut slot: BTreeMap<BlockId, (usize, usize)> = BTreeMap::new();
        for r in st.requests.values() {
            for (g, table) in r.blocks.iter().enumerate() {
                for (i, &b) in table.iter().enumerate() {
                    if b == NULL_BLOCK {
                        continue;
                    }
                    *owners.entry(b).or_default() += 1;
                    let first = *slot.entry(b).or_insert((g, i));
                    ensure_invariant!(
                        first == (g, i),
                        "I-20",
                        "block {} is in group {} at position {} and in group {g} at position {i} \
                         (request {:?})",
                        b.0,
                        first.0,
                        first.1,
                        r.id
                    );
                }
            }
            // I-14/I-15: a finished request is held only for the connector.
            if r.status.is_finished() {
                ensure_invariant!(
                    r.held_for_send || r.held_for_recv,
                    "I-14",
                    "finished request {:?} still held without a pending transfer",
                    r.id
                );
            } else {
                ensure_invariant!(
                    !r.held_for_send && !r.held_for_recv,
                    "I-15",
                    "live request {:?} marked as held for the connector",
                    r.id
                );
            }
            // I-17/I-18: loading requests hold their blocks and are not yet cached beyond the
            // local hit.
            if r.status == RequestStatus::WaitingForRemoteKvs {
                ensure_invariant!(
                    st.kv_holding_waiting.contains(&r.id),
                    "I-18",
                    "loading request {:?} not in kv_holding_waiting",
                    r.id
                );
            }
            if matches!(r.status, RequestStatus::Preempted) {
                ensure_invariant!(
                    r.blocks.iter().all(Vec::is_empty) || r.num_computed_tokens > 0,
                    "I-20",
                    "preempted request {:?} holds blocks",
                    r.id
                );
            }
        }
        for (&b, &n) in &st.pins {
            *owners.entry(b).or_default() += n;
        }
        for b in 1..st.pool.num_blocks() {
            let b = BlockId(u64::from(b));
            let want = owners.get(&b).copied().unwrap_or(0);
            ensure_invariant!(
                st.pool.ref_cnt(b) == want,
                "I-20",
                "block {} has ref count {} but {} owners",
                b.0,
                st.pool.ref_cnt(b),
                want
            );
        }
        // Queues: every live request is in exactly one queue; finished ones in none.
        let mut queued: BTreeMap<RequestId, u32> = BTreeMap::new();
        for id in st
            .running
            .iter()
            .chain(st.waiting.iter())
            .chain(st.kv_holding_waiting.iter())
        {
            *queued.entry(*id).or_default() += 1;
        }
        for r in st.requests.values() {
            let n = queued.get(&r.id).copied().unwrap_or(0);
            let want = u32::from(!r.status.is_finished());
            ensure_invariant!(
                n == want,
                "I-16",
                "request {:?} ({:?}) is queued {n} times",
                r.id,
                r.status
            );
            if r.status == RequestStatus::Running {
                ensure_invariant!(
                    st.running.contains(&r.id),
                    "I-16",
                    "running request {:?} not in the running queue",
                    r.id
                );
            }
        }
        ensure_invariant!(
            queued.keys().all(|id| st.requests.contains_key(id)),
            "I-16",
            "a queue names a request the scheduler does not hold"
        );
        ensure_invariant!(
            st.running.len() as u32 <= st.config.max_num_seqs,
            "I-20",
            "{} running requests exceed max_num_seqs",
            st.running.len()
        );
        ensure_invariant!(
            st.in_flight.len() as u32 <= st.config.async_depth,
            "I-12",
            "{} steps in flight exceed the depth {}",
            st.in_flight.len(),
            st.config.async_depth
        );
        for id in st.finished_recving_kv_req_ids.iter() {
            ensure_invariant!(
                st.requests
                    .get(id)
                    .is_some_and(|r| r.status == RequestStatus::WaitingForRemoteKvs),
                "I-18",
                "{id:?} marked as loaded but not waiting for remote KV"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScriptedConnector;

    /// Request `id` with `prompt`, 4 output tokens at most.
    fn request(id: u32, prompt: Vec<Token>) -> RequestSpec {
        RequestSpec {
            id: RequestId(id),
            prompt,
            max_tokens: 4,
            stop_token: None,
            kv_transfer_params: None,
        }
    }

    /// Two requests scheduled in one step (both running, holding blocks; the step in flight).
    fn two_running() -> Scheduler<ScriptedConnector> {
        let mut s = Scheduler::new(SchedulerConfig::default(), ScriptedConnector::new())
            .expect("the default config is valid");
        for id in [1, 2] {
            s.add_request(request(id, (0..20).map(|t| 100 * id + t).collect()))
                .expect("a new request");
        }
        s.schedule().expect("room for both");
        s.check_invariants().expect("a healthy scheduler");
        s
    }

    /// A scheduler with block size 4, groups `[full attention, sliding window of `window`
    /// tokens]`, prefix caching on, and request 1 (33 tokens: 8 full blocks) waiting. Blocks
    /// `full` of its prompt are cached in group 0 and `sliding` in group 1 (block indices),
    /// each in a block of its own.
    fn cached(
        window: u32,
        full: &[usize],
        sliding: &[usize],
    ) -> (Scheduler<ScriptedConnector>, Request) {
        let config = SchedulerConfig {
            block_size: 4,
            groups: alloc::vec![
                GroupKind::FullAttention,
                GroupKind::SlidingWindow { window }
            ],
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(config, ScriptedConnector::new()).expect("a valid config");
        s.add_request(request(1, (1..=33).collect()))
            .expect("a new request");
        let r = s.state.requests[&RequestId(1)].clone();
        assert_eq!(r.block_hashes.len(), 8);
        for (group, indices) in [(0u8, full), (1, sliding)] {
            for &i in indices {
                let b = s.state.pool.get_new_blocks(1).expect("a free block")[0];
                s.state.pool.cache_block(b, r.block_hashes[i], group);
            }
        }
        (s, r)
    }

    /// The block cached for prompt block `i` in `group`, or the null block.
    fn at(s: &Scheduler<ScriptedConnector>, r: &Request, group: u8, i: usize) -> BlockId {
        s.state
            .pool
            .get_cached(r.block_hashes[i], group)
            .unwrap_or(NULL_BLOCK)
    }

    #[test]
    fn a_sliding_window_hit_is_the_last_run_of_window_blocks() {
        // vLLM's `SlidingWindowManager.find_longest_cache_hit`: scanning back from the longest
        // prefix, the first run of `cdiv(window - 1, block_size)` cached blocks ends the hit;
        // blocks before the run are null. (cargo-mutants survivors: no test looked up a
        // sliding-window group with holes in its cache.)
        let n = NULL_BLOCK;
        // Window 8 = a run of 2 blocks: blocks 4 and 5 (6 and 7 are not cached).
        let (s, r) = cached(8, &[], &[0, 1, 2, 4, 5]);
        let want = alloc::vec![n, n, n, n, at(&s, &r, 1, 4), at(&s, &r, 1, 5)];
        assert_eq!(s.state.group_hit(&r, 1, 32), want);
        // Window 5 = a run of 1 block: block 5 alone; nothing before it is scanned.
        let (s, r) = cached(5, &[], &[0, 1, 2, 3, 5]);
        let mut want = alloc::vec![n; 5];
        want.push(at(&s, &r, 1, 5));
        assert_eq!(s.state.group_hit(&r, 1, 32), want);
        // Window 16 = a run of 4 blocks, never found: the leading run of 3 is the hit.
        let (s, r) = cached(16, &[], &[0, 1, 2, 5, 6, 7]);
        let want: Vec<BlockId> = (0..3).map(|i| at(&s, &r, 1, i)).collect();
        assert_eq!(s.state.group_hit(&r, 1, 32), want);
        // The bound: at most `max_len` tokens (20 = 5 blocks: the run 3, 4).
        let (s, r) = cached(8, &[], &[0, 3, 4, 6, 7]);
        let want = alloc::vec![n, n, n, at(&s, &r, 1, 3), at(&s, &r, 1, 4)];
        assert_eq!(s.state.group_hit(&r, 1, 20), want);
    }

    #[test]
    fn a_hybrid_hit_is_the_longest_length_every_group_hits() {
        // Full attention hits 6 blocks; the sliding window (a run of 2) hits 8 blocks at length
        // 32, but only 4 once the length is cut to the full group's 24: the hit converges at 16.
        let (mut s, r) = cached(8, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3, 6, 7]);
        let (hits, tokens) = s.state.local_hit(&r);
        assert_eq!(tokens, 16);
        let full: Vec<BlockId> = (0..4).map(|i| at(&s, &r, 0, i)).collect();
        let sliding = alloc::vec![NULL_BLOCK, NULL_BLOCK, at(&s, &r, 1, 2), at(&s, &r, 1, 3)];
        assert_eq!(hits, alloc::vec![full, sliding]);
        // What the offloading connector sees: each group's own hit at the longest length.
        assert_eq!(
            s.view().prefix_cache_hits(RequestId(1)),
            alloc::vec![24, 32]
        );
        // Without prefix caching nothing is looked up.
        s.state.config.enable_prefix_caching = false;
        assert_eq!(
            s.state.local_hit(&r),
            (alloc::vec![Vec::new(), Vec::new()], 0)
        );
    }

    fn r1(st: &mut State) -> &mut Request {
        st.requests
            .get_mut(&RequestId(1))
            .expect("request 1 is held")
    }

    #[test]
    fn check_invariants_reports_a_corrupt_scheduler() {
        // No test outside this module can corrupt the scheduler, so without these the checks
        // could be replaced by `Ok(())` and every suite would still pass.
        type Corrupt = fn(&mut State);
        let corruptions: [(&str, &str, Corrupt); 11] = [
            (
                "I-16",
                "a running request missing from the running queue",
                |st| {
                    st.running.retain(|id| *id != RequestId(1));
                },
            ),
            ("I-16", "a request queued twice", |st| {
                st.waiting.push_back(RequestId(1));
            }),
            (
                "I-16",
                "a queue naming a request the scheduler does not hold",
                |st| {
                    st.waiting.push_back(RequestId(7));
                },
            ),
            ("I-20", "a connector pin the pool does not count", |st| {
                let b = r1(st).blocks[0][0];
                st.pins.insert(b, 1);
            }),
            ("I-15", "a live request held for the connector", |st| {
                r1(st).held_for_send = true;
            }),
            ("I-14", "a finished request held for no transfer", |st| {
                r1(st).status = RequestStatus::FinishedAborted;
            }),
            (
                "I-18",
                "a loading request outside kv_holding_waiting",
                |st| {
                    r1(st).status = RequestStatus::WaitingForRemoteKvs;
                },
            ),
            ("I-20", "a preempted request holding blocks", |st| {
                let r = r1(st);
                r.status = RequestStatus::Preempted;
                r.num_computed_tokens = 0;
            }),
            ("I-20", "more running requests than max_num_seqs", |st| {
                st.config.max_num_seqs = 1;
            }),
            ("I-12", "more steps in flight than the async depth", |st| {
                st.config.async_depth = 0;
            }),
            (
                "I-18",
                "a loaded mark on a request that is not loading",
                |st| {
                    st.finished_recving_kv_req_ids.insert(RequestId(1));
                },
            ),
        ];
        for (id, what, corrupt) in corruptions {
            let mut s = two_running();
            corrupt(&mut s.state);
            let err = s.check_invariants().expect_err(what);
            assert_eq!(err.id, id, "{what}: {}", err.detail);
        }
    }
}
