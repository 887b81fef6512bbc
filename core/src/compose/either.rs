//! [`Either`]: one of two connectors, chosen when an engine is built — so that the engine step
//! and its ranks have one connector type whichever of the two a run uses (`kvrelay run`: the
//! offloading connector; `kvrelay pd`: the P/D connector). Every call goes to the chosen one,
//! unchanged: an engine with `Either::Left(c)` behaves exactly as an engine with `c`.
//!
//! The step metadata is an `Either` too. On the worker side ([`EitherWorker`]) a step whose
//! metadata is the other connector's stops the worker with [`WorkerError::ForeignMeta`]
//! (sticky), never a panic: the metadata may have crossed a process boundary.

use alloc::vec::Vec;

use crate::InvariantViolation;
use crate::ids::{BlockId, RequestId};
use crate::messages::{AggregatedOutput, CacheEvent, KvEvent, SchedulerOutput, WorkerMeta};
use crate::scheduler::{
    ConnectorError, FinishDecision, Intent, Lookup, SchedulerConnector, SchedulerView,
};
use crate::sorted_set::SortedSet;
use crate::worker::{TransferCommand, TransferDone, TransferResults, WorkerConnector, WorkerError};

/// One of two values: a connector, its step metadata, or its worker.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Either<A, B> {
    /// The first kind.
    Left(A),
    /// The second kind.
    Right(B),
}

impl<A, B> Either<A, B> {
    /// The first kind's value, if it is one.
    pub fn left(&self) -> Option<&A> {
        match self {
            Self::Left(a) => Some(a),
            Self::Right(_) => None,
        }
    }

    /// The first kind's value, mutably.
    pub fn left_mut(&mut self) -> Option<&mut A> {
        match self {
            Self::Left(a) => Some(a),
            Self::Right(_) => None,
        }
    }

    /// The second kind's value, if it is one.
    pub fn right(&self) -> Option<&B> {
        match self {
            Self::Left(_) => None,
            Self::Right(b) => Some(b),
        }
    }

    /// The second kind's value, mutably.
    pub fn right_mut(&mut self) -> Option<&mut B> {
        match self {
            Self::Left(_) => None,
            Self::Right(b) => Some(b),
        }
    }
}

impl<A: Default, B> Default for Either<A, B> {
    fn default() -> Self {
        Self::Left(A::default())
    }
}

/// Forwards a call to whichever value `self` holds.
macro_rules! both {
    ($self:expr, $c:ident => $e:expr) => {
        match $self {
            Either::Left($c) => $e,
            Either::Right($c) => $e,
        }
    };
}

impl<M, A, B> SchedulerConnector for Either<A, B>
where
    M: WorkerMeta + serde::Serialize + serde::de::DeserializeOwned,
    A: SchedulerConnector<WorkerMeta = M>,
    B: SchedulerConnector<WorkerMeta = M>,
{
    type StepMeta = Either<A::StepMeta, B::StepMeta>;
    type WorkerMeta = M;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, request: RequestId) {
        both!(self, c => c.on_new_request(view, request));
    }
    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        both!(self, c => c.get_num_new_matched_tokens(view, request, num_computed_tokens))
    }
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        both!(self, c => c.update_state_after_alloc(view, request, blocks, num_external_tokens));
    }
    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> Self::StepMeta {
        match self {
            Self::Left(c) => Either::Left(c.build_connector_meta(view, output)),
            Self::Right(c) => Either::Right(c.build_connector_meta(view, output)),
        }
    }
    fn update_connector_output(&mut self, view: &SchedulerView<'_>, output: &AggregatedOutput<M>) {
        both!(self, c => c.update_connector_output(view, output));
    }
    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        both!(self, c => c.request_finished(view, request, blocks))
    }
    fn take_events(&mut self) -> Vec<KvEvent> {
        both!(self, c => c.take_events())
    }
    fn set_cache_events(&mut self, on: bool) {
        both!(self, c => c.set_cache_events(on));
    }
    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        both!(self, c => c.take_cache_events())
    }
    fn take_intents(&mut self) -> Vec<Intent> {
        both!(self, c => c.take_intents())
    }
    fn take_error(&mut self) -> Option<ConnectorError> {
        both!(self, c => c.take_error())
    }
    fn has_pending_block_frees(&self, view: &SchedulerView<'_>) -> bool {
        both!(self, c => c.has_pending_block_frees(view))
    }
    fn has_pending_push_work(&self) -> bool {
        both!(self, c => c.has_pending_push_work())
    }
    fn reset_cache(&mut self) -> Option<bool> {
        both!(self, c => c.reset_cache())
    }
    fn get_finished_count(&self) -> Option<u32> {
        both!(self, c => c.get_finished_count())
    }
    /// Metadata of the other kind is never empty: the ranks must see it (and refuse it).
    fn meta_is_empty(&self, meta: &Self::StepMeta) -> bool {
        match (self, meta) {
            (Self::Left(c), Either::Left(m)) => c.meta_is_empty(m),
            (Self::Right(c), Either::Right(m)) => c.meta_is_empty(m),
            _ => false,
        }
    }
    fn tracks_request(&self, request: RequestId) -> bool {
        both!(self, c => c.tracks_request(request))
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        both!(self, c => c.check_invariants())
    }
    fn requires_kv_delivery(&self) -> bool {
        both!(self, c => c.requires_kv_delivery())
    }
}

/// The worker side of an [`Either`] connector: the chosen worker, and the sticky error of a
/// step whose metadata was the other kind's.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct EitherWorker<A, B> {
    worker: Either<A, B>,
    error: Option<WorkerError>,
}

impl<A, B> EitherWorker<A, B> {
    /// The worker of `worker`'s kind.
    pub fn new(worker: Either<A, B>) -> Self {
        Self {
            worker,
            error: None,
        }
    }

    /// The chosen worker.
    pub fn inner(&self) -> &Either<A, B> {
        &self.worker
    }
}

impl<M, A, B> WorkerConnector for EitherWorker<A, B>
where
    M: WorkerMeta,
    A: WorkerConnector<WorkerMeta = M>,
    B: WorkerConnector<WorkerMeta = M>,
{
    type StepMeta = Either<A::StepMeta, B::StepMeta>;
    type WorkerMeta = M;

    fn handle_preemptions(&mut self, meta: &Self::StepMeta) -> Vec<TransferCommand> {
        match (&mut self.worker, meta) {
            (Either::Left(w), Either::Left(m)) => w.handle_preemptions(m),
            (Either::Right(w), Either::Right(m)) => w.handle_preemptions(m),
            _ => {
                self.error.get_or_insert(WorkerError::ForeignMeta);
                Vec::new()
            }
        }
    }
    fn bind(&mut self, meta: &Self::StepMeta) {
        match (&mut self.worker, meta) {
            (Either::Left(w), Either::Left(m)) => w.bind(m),
            (Either::Right(w), Either::Right(m)) => w.bind(m),
            _ => {
                self.error.get_or_insert(WorkerError::ForeignMeta);
            }
        }
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        both!(&mut self.worker, w => w.start_load_kv())
    }
    fn wait_for_layer_load(&mut self, layer: u32) -> Vec<TransferCommand> {
        both!(&mut self.worker, w => w.wait_for_layer_load(layer))
    }
    fn save_kv_layer(&mut self, layer: u32) -> Vec<TransferCommand> {
        both!(&mut self.worker, w => w.save_kv_layer(layer))
    }
    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        both!(&mut self.worker, w => w.wait_for_save())
    }
    fn handle_transfer_done(&mut self, done: TransferDone) {
        both!(&mut self.worker, w => w.handle_transfer_done(done));
    }
    fn get_transfer_results(&mut self, finished: &SortedSet<RequestId>) -> TransferResults {
        both!(&mut self.worker, w => w.get_transfer_results(finished))
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        both!(&mut self.worker, w => w.get_block_ids_with_load_errors())
    }
    fn build_connector_worker_meta(&mut self) -> Option<M> {
        both!(&mut self.worker, w => w.build_connector_worker_meta())
    }
    fn clear(&mut self) {
        both!(&mut self.worker, w => w.clear());
    }
    fn error(&self) -> Option<WorkerError> {
        self.error
            .clone()
            .or_else(|| both!(&self.worker, w => w.error()))
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        both!(&self.worker, w => w.check_invariants())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pd::{PdConfig, PdMeta, PdWorker};
    use crate::{OffloadingConnectorMeta, OffloadingWorker, OffloadingWorkerConfig};

    type Worker = EitherWorker<OffloadingWorker, PdWorker>;

    fn pd_worker() -> Worker {
        EitherWorker::new(Either::Right(PdWorker::new(
            PdConfig::both(0).failures_as_blocks,
        )))
    }

    #[test]
    fn a_step_of_the_other_connector_stops_the_worker_with_a_sticky_error() {
        // The metadata crosses a process boundary: the other kind's is a typed error, not a
        // panic, and it sticks.
        let mut w = pd_worker();
        w.bind(&Either::Right(PdMeta::default()));
        assert_eq!(w.error(), None);
        w.clear();
        w.bind(&Either::Left(OffloadingConnectorMeta::default()));
        assert_eq!(w.error(), Some(WorkerError::ForeignMeta));
        w.clear();
        w.bind(&Either::Right(PdMeta::default()));
        assert_eq!(w.error(), Some(WorkerError::ForeignMeta), "sticky");
    }

    #[test]
    fn the_chosen_worker_gets_every_call() {
        let mut w: Worker = EitherWorker::new(Either::Left(OffloadingWorker::new(
            OffloadingWorkerConfig {
                blocks_per_chunk: 1,
                is_store_writer: true,
                bytes_per_block: 8,
                mode: crate::Mode::Compat,
            },
        )));
        assert!(w.inner().left().is_some() && w.inner().right().is_none());
        assert!(
            w.handle_preemptions(&Either::Left(OffloadingConnectorMeta::default()))
                .is_empty()
        );
        assert_eq!(w.error(), None);
        assert!(
            w.handle_preemptions(&Either::Right(PdMeta::default()))
                .is_empty()
        );
        assert_eq!(w.error(), Some(WorkerError::ForeignMeta));
    }
}
