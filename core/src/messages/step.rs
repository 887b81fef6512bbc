//! The step's messages between the scheduler and the ranks: what the scheduler scheduled
//! ([`SchedulerOutput`], with the connector's metadata as a [`ScheduledStep`]) and what comes back
//! from the executor ([`ModelOutput`]).

use alloc::vec::Vec;

use super::output::AggregatedOutput;
use crate::ids::{BlockId, RequestId, StepId};
use crate::sorted_set::SortedSet;
use crate::tokens::Token;

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
