//! [`MultiConnector`]: the scheduler side.

use super::ExtraAsyncSaves;
use super::MultiMeta;
use super::combine_finished_counts;
use super::route_worker_meta;
use crate::InvariantViolation;
use crate::ensure_invariant;
use crate::ids::BlockId;
use crate::ids::RequestId;
use crate::messages::AggregatedOutput;
use crate::messages::Meta;
use crate::messages::SchedulerOutput;
use crate::messages::{CacheEvent, KvEvent};
use crate::scheduler::ConnectorError;
use crate::scheduler::FinishDecision;
use crate::scheduler::Intent;
use crate::scheduler::Lookup;
use crate::scheduler::SchedulerConnector;
use crate::scheduler::SchedulerView;
use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
/// The scheduler side of vLLM's MultiConnector over children `C` (see the module docs).
///
/// Build it with [`MultiConnector::new`] and hand it to [`crate::Scheduler`] like any connector;
/// configure children between calls through [`MultiConnector::child_mut`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MultiConnector<C> {
    pub(super) children: Vec<C>,
    /// `_requests_to_connector`: the child chosen to load each request.
    pub(super) loaders: BTreeMap<RequestId, usize>,
    /// `_extra_async_saves` since the last `build_connector_meta`.
    pub(super) extra_async_saves: ExtraAsyncSaves,
    /// The finished count checked at construction.
    pub(super) finished_count: Option<u32>,
    /// The first error met (sticky), and whether the scheduler has been told.
    pub(super) error: Option<ConnectorError>,
    pub(super) error_reported: bool,
}

impl<C: SchedulerConnector<WorkerMeta = Meta>> MultiConnector<C> {
    /// Composes `children` in order (their order decides the loader).
    ///
    /// vLLM reads `get_finished_count` once, at executor start, and raises if children
    /// disagree; here that check runs now, and [`SchedulerConnector::get_finished_count`]
    /// answers the value checked here.
    pub fn new(children: Vec<C>) -> Result<Self, ConnectorError> {
        let finished_count = combine_finished_counts(children.iter().map(C::get_finished_count))?;
        Ok(Self {
            children,
            loaders: BTreeMap::new(),
            extra_async_saves: BTreeMap::new(),
            finished_count,
            error: None,
            error_reported: false,
        })
    }

    /// The children, in order.
    pub fn children(&self) -> &[C] {
        &self.children
    }

    /// Child `i`, mutably (to configure it between calls; `None` if out of range).
    pub fn child_mut(&mut self, i: usize) -> Option<&mut C> {
        self.children.get_mut(i)
    }

    /// The child chosen to load `request`, if one is remembered.
    pub fn loader(&self, request: RequestId) -> Option<usize> {
        self.loaders.get(&request).copied()
    }

    /// Extra async saves recorded since the last `build_connector_meta`.
    pub fn pending_extra_async_saves(&self) -> &ExtraAsyncSaves {
        &self.extra_async_saves
    }

    /// The first error met, if any (it stays).
    pub fn error(&self) -> Option<&ConnectorError> {
        self.error.as_ref()
    }

    /// `get_finished_count` over the children's current answers (the trait method answers the
    /// value checked at construction).
    pub fn finished_count(&self) -> Result<Option<u32>, ConnectorError> {
        combine_finished_counts(self.children.iter().map(C::get_finished_count))
    }

    /// `request_finished`: every child in order; the free is delayed iff some child delays it,
    /// and with `n > 1` delaying children `extra_async_saves[request] = n − 1` is recorded for
    /// the next metadata. Params are merged; a key set by two children is
    /// [`ConnectorError::ParamsConflict`], returned as soon as the clashing child answered (later
    /// children are not called, nothing is recorded and the loader is kept, as when vLLM
    /// raises). On success the remembered loader is forgotten.
    pub fn try_request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> Result<FinishDecision, ConnectorError> {
        let out = self.try_request_finished_unchecked(view, request, blocks);
        crate::debug_assert_invariants!(self);
        out
    }

    fn try_request_finished_unchecked(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> Result<FinishDecision, ConnectorError> {
        let mut saves = 0u32;
        let mut merged: Option<crate::Params> = None;
        for c in &mut self.children {
            let d = c.request_finished(view, request, blocks);
            saves += u32::from(d.delay_free);
            match (&mut merged, d.kv_transfer_params) {
                (_, None) => {}
                (None, Some(p)) => merged = Some(p),
                (Some(m), Some(p)) => {
                    let keys: Vec<String> =
                        p.keys().filter(|k| m.contains_key(*k)).cloned().collect();
                    if !keys.is_empty() {
                        return Err(ConnectorError::ParamsConflict { request, keys });
                    }
                    m.extend(p);
                }
            }
        }
        if saves > 1 {
            self.extra_async_saves.insert(request, saves - 1);
        }
        self.loaders.remove(&request);
        Ok(FinishDecision {
            delay_free: saves > 0,
            kv_transfer_params: merged,
        })
    }

    /// `update_connector_output`: every child sees `output` with `worker_meta` replaced by its
    /// own slot (see [`route_worker_meta`]); a metadata that cannot be routed reaches no child.
    pub fn try_update_connector_output(
        &mut self,
        view: &SchedulerView<'_>,
        output: &AggregatedOutput<Meta>,
    ) -> Result<(), ConnectorError> {
        let out = self.try_update_connector_output_unchecked(view, output);
        crate::debug_assert_invariants!(self);
        out
    }

    fn try_update_connector_output_unchecked(
        &mut self,
        view: &SchedulerView<'_>,
        output: &AggregatedOutput<Meta>,
    ) -> Result<(), ConnectorError> {
        if output.worker_meta.is_none() {
            for c in &mut self.children {
                c.update_connector_output(view, output);
            }
            return Ok(());
        }
        let mut own = output.clone();
        let slots = route_worker_meta(own.worker_meta.take(), self.children.len())?;
        for (c, slot) in self.children.iter_mut().zip(slots) {
            own.worker_meta = slot;
            c.update_connector_output(view, &own);
        }
        Ok(())
    }

    pub(super) fn record(&mut self, e: ConnectorError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    /// The invariants of the scheduler side: every remembered loader is a child (I-29), and
    /// every recorded extra save count is at least 1 (I-28).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for (r, &i) in &self.loaders {
            ensure_invariant!(
                i < self.children.len(),
                "I-29",
                "loader {i} of {r:?} is not one of {} children",
                self.children.len()
            );
        }
        for (r, &n) in &self.extra_async_saves {
            ensure_invariant!(n >= 1, "I-28", "extra_async_saves[{r:?}] is 0");
        }
        for c in &self.children {
            SchedulerConnector::check_invariants(c)?;
        }
        Ok(())
    }
}

impl<C: SchedulerConnector<WorkerMeta = Meta>> SchedulerConnector for MultiConnector<C> {
    type StepMeta = MultiMeta<C::StepMeta>;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, request: RequestId) {
        for c in &mut self.children {
            c.on_new_request(view, request);
        }
    }

    /// Asks every child in order. `Pending` from any child answers `Pending` at once (a loader
    /// chosen by an earlier child of this query stays remembered, as in vLLM); otherwise the
    /// first child with a positive count becomes the request's loader and its answer is the
    /// answer; with no positive count the answer is a miss (and an earlier choice stays).
    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let mut answer = Lookup::MISS;
        for (i, c) in self.children.iter_mut().enumerate() {
            match c.get_num_new_matched_tokens(view, request, num_computed_tokens) {
                Lookup::Pending => return Lookup::Pending,
                hit @ Lookup::Hit { tokens, .. } => {
                    if answer == Lookup::MISS && tokens > 0 {
                        self.loaders.insert(request, i);
                        answer = hit;
                    }
                }
            }
        }
        answer
    }

    /// The loader gets `num_external_tokens`; every other child gets the same blocks with 0
    /// (I-29).
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        let loader = self.loaders.get(&request).copied();
        for (i, c) in self.children.iter_mut().enumerate() {
            let n = if loader == Some(i) {
                num_external_tokens
            } else {
                0
            };
            c.update_state_after_alloc(view, request, blocks, n);
        }
    }

    /// Every child's metadata, plus the extra async saves recorded since the last call (then
    /// forgotten here: the workers own them now).
    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> Self::StepMeta {
        let metadata = self
            .children
            .iter_mut()
            .map(|c| c.build_connector_meta(view, output))
            .collect();
        let extra = core::mem::take(&mut self.extra_async_saves);
        MultiMeta {
            metadata,
            extra_async_saves: (!extra.is_empty()).then_some(extra),
        }
    }

    /// See [`MultiConnector::try_update_connector_output`]; an error is kept for
    /// [`SchedulerConnector::take_error`].
    fn update_connector_output(&mut self, view: &SchedulerView<'_>, output: &AggregatedOutput) {
        if let Err(e) = self.try_update_connector_output(view, output) {
            self.record(e);
        }
    }

    /// See [`MultiConnector::try_request_finished`]; on a params conflict the answer is "no
    /// delay, no params" and the error is kept for [`SchedulerConnector::take_error`].
    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        self.try_request_finished(view, request, blocks)
            .unwrap_or_else(|e| {
                self.record(e);
                FinishDecision::default()
            })
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        self.children
            .iter_mut()
            .flat_map(SchedulerConnector::take_events)
            .collect()
    }

    fn set_cache_events(&mut self, on: bool) {
        for c in &mut self.children {
            c.set_cache_events(on);
        }
    }

    /// The children's, in child order (as `take_events`).
    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.children
            .iter_mut()
            .flat_map(SchedulerConnector::take_cache_events)
            .collect()
    }

    fn take_intents(&mut self) -> Vec<Intent> {
        self.children
            .iter_mut()
            .flat_map(SchedulerConnector::take_intents)
            .collect()
    }

    /// This connector's error once (the first one met), else the first child's.
    fn take_error(&mut self) -> Option<ConnectorError> {
        let mut found = None;
        if let (Some(e), false) = (&self.error, self.error_reported) {
            self.error_reported = true;
            found = Some(e.clone());
        }
        for c in &mut self.children {
            if let Some(e) = c.take_error() {
                found.get_or_insert(e);
            }
        }
        found
    }

    fn has_pending_block_frees(&self, view: &SchedulerView<'_>) -> bool {
        self.children
            .iter()
            .any(|c| c.has_pending_block_frees(view))
    }

    fn has_pending_push_work(&self) -> bool {
        self.children.iter().any(C::has_pending_push_work)
    }

    /// Every child is reset; `Some(false)` iff some child answered `Some(false)` (children
    /// without support count as success, so the answer is never `None`, as in vLLM).
    fn reset_cache(&mut self) -> Option<bool> {
        let mut ok = true;
        for c in &mut self.children {
            ok &= c.reset_cache() != Some(false);
        }
        Some(ok)
    }

    fn get_finished_count(&self) -> Option<u32> {
        self.finished_count
    }

    fn requires_kv_delivery(&self) -> bool {
        self.children.iter().any(C::requires_kv_delivery)
    }

    fn meta_is_empty(&self, meta: &Self::StepMeta) -> bool {
        meta.extra_async_saves.is_none()
            && self
                .children
                .iter()
                .zip(&meta.metadata)
                .all(|(c, m)| c.meta_is_empty(m))
    }

    /// A child still tracks it, or a loader choice or an extra async save names it.
    fn tracks_request(&self, request: RequestId) -> bool {
        self.loaders.contains_key(&request)
            || self.extra_async_saves.contains_key(&request)
            || self.children.iter().any(|c| c.tracks_request(request))
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Self::check_invariants(self)
    }
}
