//! What one rank reports per step ([`WorkerOutput`], vLLM's `KVConnectorOutput`) and what the
//! aggregator hands the scheduler ([`AggregatedOutput`]).

use super::events::KvEvents;
use super::meta::Meta;
use crate::ids::{BlockId, RequestId};
use crate::sorted_set::SortedSet;

/// Which of a worker output's two completion sets: `finished_sending` (async sends and saves)
/// or `finished_recving` (async receives and loads). The aggregator counts each direction's
/// quorum apart; the scheduler applies each direction's completions by its own rules.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// `finished_sending`: async send/save completions.
    Send,
    /// `finished_recving`: async recv/load completions.
    Recv,
}

/// One rank's connector output for one step (vLLM's `KVConnectorOutput`).
///
/// Built by the worker side after `build_connector_worker_meta`, handed to the executor's
/// [`crate::Aggregator`]. `None` and the empty set are different for the finished sets, as in
/// vLLM (`None` = the connector reported nothing).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(
    serialize = "M: serde::Serialize",
    deserialize = "M: serde::Deserialize<'de>"
))]
pub struct WorkerOutput<M = Meta> {
    /// Requests whose async send/save finished on this rank since its last report.
    pub finished_sending: Option<SortedSet<RequestId>>,
    /// Requests whose async recv/load finished on this rank (failed loads included).
    pub finished_recving: Option<SortedSet<RequestId>>,
    /// GPU blocks whose external load failed.
    pub invalid_block_ids: SortedSet<BlockId>,
    /// Requests whose load failed (request-level, for multi-group layouts).
    pub failed_recving: SortedSet<RequestId>,
    /// The new ack quorum for the aggregator; `0` = no change.
    pub expected_finished_count: u32,
    /// Worker → scheduler metadata ([`crate::WorkerMeta`]).
    pub worker_meta: Option<M>,
    /// KV events of the connector, with their contributor count.
    pub kv_events: Option<KvEvents>,
}

impl<M> Default for WorkerOutput<M> {
    fn default() -> Self {
        Self {
            finished_sending: None,
            finished_recving: None,
            invalid_block_ids: SortedSet::new(),
            failed_recving: SortedSet::new(),
            expected_finished_count: 0,
            worker_meta: None,
            kv_events: None,
        }
    }
}

impl<M> WorkerOutput<M> {
    /// vLLM's `is_empty()`: every field but `expected_finished_count` is empty. An empty output of
    /// a step without forward is not sent at all (`kv_connector_output = None`).
    pub fn is_empty(&self) -> bool {
        self.finished_sending
            .as_ref()
            .is_none_or(SortedSet::is_empty)
            && self
                .finished_recving
                .as_ref()
                .is_none_or(SortedSet::is_empty)
            && self.invalid_block_ids.is_empty()
            && self.failed_recving.is_empty()
            && self.worker_meta.is_none()
            && self.kv_events.is_none()
    }
}

/// The fold of all ranks' outputs of one step, as the scheduler receives it.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(
    serialize = "M: serde::Serialize",
    deserialize = "M: serde::Deserialize<'de>"
))]
pub struct AggregatedOutput<M = Meta> {
    /// Ids whose send quorum completed in this call; `None` when none did.
    pub finished_sending: Option<SortedSet<RequestId>>,
    /// Ids whose recv quorum completed in this call; `None` when none did.
    pub finished_recving: Option<SortedSet<RequestId>>,
    /// Union of the ranks' (and salvaged outputs') invalid blocks.
    pub invalid_block_ids: SortedSet<BlockId>,
    /// Ids reported failed by some rank whose recv quorum completed in this call (I-24).
    pub failed_recving: SortedSet<RequestId>,
    /// The fold of the ranks' worker metadata.
    pub worker_meta: Option<M>,
    /// The ranks' KV events appended, with the number of contributors.
    pub kv_events: Option<KvEvents>,
    /// The quorum in force after this call.
    pub expected_finished_count: u32,
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use super::*;

    #[test]
    fn a_sorted_set_sorts_deduplicates_and_counts() {
        let s = SortedSet::from_vec(vec![3u32, 1, 3, 2]);
        assert_eq!(s.len(), 3);
        assert!(!s.is_empty());
        assert!(s.contains(&2) && !s.contains(&4));
        assert_eq!(SortedSet::<u32>::new().len(), 0);
    }

    #[test]
    fn a_worker_output_is_empty_until_any_field_carries_something() {
        let empty: WorkerOutput = WorkerOutput::default();
        assert!(empty.is_empty());
        let counted = WorkerOutput::<crate::Meta> {
            expected_finished_count: 3,
            ..WorkerOutput::default()
        };
        assert!(counted.is_empty(), "the quorum alone is not content");
        let recving = WorkerOutput::<crate::Meta> {
            finished_recving: Some(SortedSet::from_vec(vec![crate::RequestId(1)])),
            ..WorkerOutput::default()
        };
        assert!(!recving.is_empty());
        let sending_none = WorkerOutput::<crate::Meta> {
            finished_sending: Some(SortedSet::new()),
            ..WorkerOutput::default()
        };
        assert!(sending_none.is_empty(), "an empty set is no content");
    }
}
