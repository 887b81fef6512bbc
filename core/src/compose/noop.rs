//! [`NoopConnector`]: the connector that does nothing.

use crate::ids::{BlockId, RequestId};
use crate::messages::SchedulerOutput;
use crate::scheduler::FinishDecision;
use crate::scheduler::Lookup;
use crate::scheduler::SchedulerConnector;
use crate::scheduler::SchedulerView;
use alloc::vec::Vec;

/// A connector that does nothing: every lookup misses, nothing is delayed. The scheduler with
/// this connector behaves like vLLM's scheduler with a no-op connector; it is the baseline of
/// the scheduler benchmark.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct NoopConnector;

impl SchedulerConnector for NoopConnector {
    type StepMeta = ();
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
