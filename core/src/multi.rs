//! MultiConnector: K child connectors composed in order, as vLLM 0.33.0's `MultiConnector`
//! (SEMANTICS.md §1.7, §4.3, I-28…I-32, S13).
//!
//! Use it when one engine needs several connectors at once, e.g. a P/D sender that also
//! offloads to CPU: every child sees every request, every child may save it, and at most one
//! child loads it.
//!
//! * [`MultiConnector`] is the scheduler side. Loads come from the lowest child with a positive
//!   match (remembered per request until `request_finished`); every child saves. When `n > 1`
//!   children delay a request's free, the `n − 1` extra saves are counted in
//!   `extra_async_saves` and shipped to the workers in the next [`MultiMeta`].
//! * [`MultiWorker`] is the worker side of one rank. It merges the shipped counts into its own
//!   map and suppresses a child's `finished_sending` report for a request while an extra save
//!   of it is pending, so the request is reported exactly once, after its last saving child
//!   (I-28).
//!
//! Children are any [`SchedulerConnector`] / [`WorkerConnector`] whose worker metadata is
//! [`Meta`]; a homogeneous `Vec<C>` is the simple case, and `Box<dyn SchedulerConnector<..>>`
//! (the traits are object safe, and boxes implement them) composes children of different types
//! that share a metadata type.
//!
//! # Errors
//!
//! Where vLLM raises, this module returns a [`MultiError`]: two children setting the same
//! `kv_transfer_params` key (I-32), children disagreeing on the finished count, a worker
//! metadata that is not one slot per child. The trait methods have no error channel of their
//! own, so [`MultiConnector`] keeps the error and hands it to the scheduler through
//! [`SchedulerConnector::take_error`]; the scheduler then stops with the sticky
//! [`crate::SchedulerError::ConnectorContract`], as vLLM's engine stops on the exception.
//! Callers that drive a [`MultiConnector`] directly use the `try_*` methods.

use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::connector::{
    FinishDecision, Intent, Lookup, SchedulerConnector, TransferCommand, TransferDone,
    TransferResults, WorkerConnector, WorkerError,
};
use crate::events::KvEvent;
use crate::ids::{BlockId, JobId, RequestId};
use crate::meta::{Meta, build_multi};
use crate::output::{AggregatedOutput, SortedSet};
use crate::scheduler::{SchedulerOutput, SchedulerView};
use crate::{InvariantViolation, ensure_invariant};

/// `extra_async_saves`: per request, the number of async saves beyond the first still to be
/// reported (always ≥ 1 while present).
pub type ExtraAsyncSaves = BTreeMap<RequestId, u32>;

/// The MultiConnector's per-step metadata (vLLM's `MultiKVConnectorMetadata`), delivered
/// unchanged to every rank's [`MultiWorker`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MultiMeta<M> {
    /// Child `i`'s metadata of this step, in child order.
    pub metadata: Vec<M>,
    /// Extra async saves recorded since the previous step (`None` when there were none). The
    /// worker merges them before any child can report the request (I-28).
    pub extra_async_saves: Option<ExtraAsyncSaves>,
}

/// What vLLM's MultiConnector raises, as a value.
#[derive(
    Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize, thiserror::Error,
)]
#[serde(rename_all = "snake_case")]
pub enum MultiError {
    /// Two children returned `kv_transfer_params` with a common key (I-32). Kind
    /// `params_conflict`.
    #[error(
        "children of the MultiConnector set the same kv_transfer_params keys {keys:?} for {request:?}"
    )]
    ParamsConflict {
        /// The finishing request.
        request: RequestId,
        /// The clashing keys, sorted.
        keys: Vec<String>,
    },
    /// Children answered different finished counts. Kind `finished_count_conflict`.
    #[error("MultiConnector children returned incompatible finished counts: {counts:?}")]
    FinishedCountConflict {
        /// The distinct counts, sorted.
        counts: Vec<u32>,
    },
    /// The aggregated worker metadata is not a `multi` tuple with a slot for every child.
    /// Kind `meta_mismatch`.
    #[error("worker metadata {found} cannot be routed to {children} children")]
    WorkerMetaShape {
        /// What was found: a form name or `"multi with N slots"`.
        found: String,
        /// The number of children.
        children: usize,
    },
}

impl MultiError {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            MultiError::ParamsConflict { .. } => "params_conflict",
            MultiError::FinishedCountConflict { .. } => "finished_count_conflict",
            MultiError::WorkerMetaShape { .. } => "meta_mismatch",
        }
    }
}

/// vLLM's `get_finished_count` over the children's answers: `None` if any child answers
/// `None`, else their common value; two different values are
/// [`MultiError::FinishedCountConflict`].
pub fn combine_finished_counts(
    counts: impl IntoIterator<Item = Option<u32>>,
) -> Result<Option<u32>, MultiError> {
    let mut distinct: Vec<u32> = Vec::new();
    for c in counts {
        let Some(c) = c else { return Ok(None) };
        if !distinct.contains(&c) {
            distinct.push(c);
        }
    }
    if distinct.len() > 1 {
        distinct.sort_unstable();
        return Err(MultiError::FinishedCountConflict { counts: distinct });
    }
    Ok(distinct.first().copied())
}

/// Splits an aggregated worker metadata into what each of `children` children observes in
/// `update_connector_output`: `None` gives every child `None`; a `multi` tuple gives child `i`
/// slot `i` (slots beyond the children are ignored, as in vLLM); anything else, or a tuple
/// with fewer slots than children, is [`MultiError::WorkerMetaShape`].
pub fn route_worker_meta(
    meta: Option<Meta>,
    children: usize,
) -> Result<Vec<Option<Meta>>, MultiError> {
    match meta {
        None => Ok(alloc::vec![None; children]),
        Some(Meta::Multi(mut slots)) if slots.len() >= children => {
            slots.truncate(children);
            Ok(slots)
        }
        Some(Meta::Multi(slots)) => Err(MultiError::WorkerMetaShape {
            found: format!("multi with {} slots", slots.len()),
            children,
        }),
        Some(other) => Err(MultiError::WorkerMetaShape {
            found: other.form().to_string(),
            children,
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Scheduler side.

/// The scheduler side of vLLM's MultiConnector over children `C` (see the module docs).
///
/// Build it with [`MultiConnector::new`] and hand it to [`crate::Scheduler`] like any connector;
/// configure children between calls through [`MultiConnector::child_mut`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MultiConnector<C> {
    children: Vec<C>,
    /// `_requests_to_connector`: the child chosen to load each request.
    loaders: BTreeMap<RequestId, usize>,
    /// `_extra_async_saves` since the last `build_connector_meta`.
    extra_async_saves: ExtraAsyncSaves,
    /// The finished count checked at construction.
    finished_count: Option<u32>,
    /// The first error met (sticky), and whether the scheduler has been told.
    error: Option<MultiError>,
    error_reported: bool,
}

impl<C: SchedulerConnector<WorkerMeta = Meta>> MultiConnector<C> {
    /// Composes `children` in order (their order decides the loader).
    ///
    /// vLLM reads `get_finished_count` once, at executor start, and raises if children
    /// disagree; here that check runs now, and [`SchedulerConnector::get_finished_count`]
    /// answers the value checked here.
    pub fn new(children: Vec<C>) -> Result<Self, MultiError> {
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
    pub fn error(&self) -> Option<&MultiError> {
        self.error.as_ref()
    }

    /// `get_finished_count` over the children's current answers (the trait method answers the
    /// value checked at construction).
    pub fn finished_count(&self) -> Result<Option<u32>, MultiError> {
        combine_finished_counts(self.children.iter().map(C::get_finished_count))
    }

    /// `request_finished`: every child in order; the free is delayed iff some child delays it,
    /// and with `n > 1` delaying children `extra_async_saves[request] = n − 1` is recorded for
    /// the next metadata. Params are merged; a key set by two children is
    /// [`MultiError::ParamsConflict`], returned as soon as the clashing child answered (later
    /// children are not called, nothing is recorded and the loader is kept, as when vLLM
    /// raises). On success the remembered loader is forgotten.
    pub fn try_request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> Result<FinishDecision, MultiError> {
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
                        return Err(MultiError::ParamsConflict { request, keys });
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
    ) -> Result<(), MultiError> {
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

    fn record(&mut self, e: MultiError) {
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
        Ok(())
    }
}

impl<C: SchedulerConnector<WorkerMeta = Meta>> SchedulerConnector for MultiConnector<C> {
    type Meta = MultiMeta<C::Meta>;
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
    ) -> Self::Meta {
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

    fn take_intents(&mut self) -> Vec<Intent> {
        self.children
            .iter_mut()
            .flat_map(SchedulerConnector::take_intents)
            .collect()
    }

    /// This connector's error once (the first one met), else the first child's.
    fn take_error(&mut self) -> Option<String> {
        let mut found = None;
        if let (Some(e), false) = (&self.error, self.error_reported) {
            self.error_reported = true;
            found = Some(e.to_string());
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

    fn meta_is_empty(&self, meta: &Self::Meta) -> bool {
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
}

// ---------------------------------------------------------------------------------------------
// Worker side.

/// The worker side of vLLM's MultiConnector for one rank (see the module docs).
///
/// Children's transfer jobs are renumbered so that jobs of different children never share an
/// id: the runtime sees only this worker's job ids, and [`WorkerConnector::handle_transfer_done`]
/// routes each completion back to the child that started the job.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MultiWorker<W> {
    children: Vec<W>,
    /// `_extra_async_saves`, merged from every bound metadata.
    extra_async_saves: ExtraAsyncSaves,
    /// Live jobs: outer id → (child, the child's id), and back.
    jobs: BTreeMap<JobId, (usize, JobId)>,
    outer: BTreeMap<(usize, JobId), JobId>,
    next_job: u64,
}

impl<W: WorkerConnector<WorkerMeta = Meta>> MultiWorker<W> {
    /// Composes `children` (one per child of the scheduler-side [`MultiConnector`], same order).
    pub fn new(children: Vec<W>) -> Self {
        Self {
            children,
            extra_async_saves: BTreeMap::new(),
            jobs: BTreeMap::new(),
            outer: BTreeMap::new(),
            next_job: 0,
        }
    }

    /// The children, in order.
    pub fn children(&self) -> &[W] {
        &self.children
    }

    /// Child `i`, mutably (to configure it between calls; `None` if out of range).
    pub fn child_mut(&mut self, i: usize) -> Option<&mut W> {
        self.children.get_mut(i)
    }

    /// Extra async saves still pending on this rank.
    pub fn extra_async_saves(&self) -> &ExtraAsyncSaves {
        &self.extra_async_saves
    }

    /// The bind half that concerns this worker: merges `extra` into the pending map (a request
    /// named again takes the new count, as `dict.update` does).
    pub fn merge_extra_async_saves(&mut self, extra: Option<&ExtraAsyncSaves>) {
        for (&r, &n) in extra.into_iter().flatten() {
            if n == 0 {
                // Never produced by MultiConnector (it records n − 1 only for n > 1); a 0
                // would make the next report of r vanish, so it is not recorded.
                self.extra_async_saves.remove(&r);
            } else {
                self.extra_async_saves.insert(r, n);
            }
        }
    }

    /// Folds one child's `finished_sending` report into `out`: an id with a pending extra save
    /// consumes one unit (the entry goes at 0) and is not forwarded; any other id is (I-28).
    pub fn consume_finished_sending<'a>(
        &mut self,
        reported: impl IntoIterator<Item = &'a RequestId>,
        out: &mut SortedSet<RequestId>,
    ) {
        for &r in reported {
            match self.extra_async_saves.get_mut(&r) {
                None => {
                    out.insert(r);
                }
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    self.extra_async_saves.remove(&r);
                }
            }
        }
    }

    /// Renumbers child `i`'s commands into this worker's job ids. A wait for a job no longer
    /// live (its completion was fed back already) is dropped: there is nothing to wait for.
    fn lift(&mut self, i: usize, cmds: Vec<TransferCommand>) -> Vec<TransferCommand> {
        cmds.into_iter()
            .filter_map(|cmd| match cmd {
                TransferCommand::Start(mut t) => {
                    let outer = JobId(self.next_job);
                    self.next_job += 1;
                    self.jobs.insert(outer, (i, t.job));
                    self.outer.insert((i, t.job), outer);
                    t.job = outer;
                    Some(TransferCommand::Start(t))
                }
                TransferCommand::Wait(jobs) => {
                    let lifted: SortedSet<JobId> = jobs
                        .iter()
                        .filter_map(|&j| self.outer.get(&(i, j)).copied())
                        .collect();
                    (!lifted.is_empty()).then_some(TransferCommand::Wait(lifted))
                }
            })
            .collect()
    }

    /// Runs `hook` on every child in order and concatenates their (renumbered) commands.
    fn each(
        &mut self,
        mut hook: impl FnMut(&mut W) -> Vec<TransferCommand>,
    ) -> Vec<TransferCommand> {
        let mut out = Vec::new();
        for i in 0..self.children.len() {
            let cmds = hook(&mut self.children[i]);
            out.extend(self.lift(i, cmds));
        }
        out
    }

    /// The invariants of one rank: pending extra saves are at least 1 (I-28), and the job
    /// renumbering is a bijection onto live child jobs (`multi-jobs`: not a spec invariant, the
    /// renumbering is kvrelay's own).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for (r, &n) in &self.extra_async_saves {
            ensure_invariant!(n >= 1, "I-28", "worker extra_async_saves[{r:?}] is 0");
        }
        ensure_invariant!(
            self.jobs.len() == self.outer.len(),
            "multi-jobs",
            "job renumbering has {} outer and {} inner entries",
            self.jobs.len(),
            self.outer.len()
        );
        for (&o, &(i, j)) in &self.jobs {
            ensure_invariant!(
                i < self.children.len() && self.outer.get(&(i, j)) == Some(&o),
                "multi-jobs",
                "job {o:?} maps to child {i} job {j:?}, which does not map back"
            );
        }
        Ok(())
    }
}

impl<W: WorkerConnector<WorkerMeta = Meta>> WorkerConnector for MultiWorker<W> {
    type Meta = MultiMeta<W::Meta>;
    type WorkerMeta = Meta;

    /// Child `i` handles `meta.metadata[i]` (children beyond the metadata are skipped, as
    /// Python's `zip` does).
    fn handle_preemptions(&mut self, meta: &Self::Meta) -> Vec<TransferCommand> {
        let mut out = Vec::new();
        for (i, m) in meta.metadata.iter().enumerate().take(self.children.len()) {
            let cmds = self.children[i].handle_preemptions(m);
            out.extend(self.lift(i, cmds));
        }
        out
    }

    /// Merges `extra_async_saves` first, then binds child `i` to `meta.metadata[i]`.
    fn bind(&mut self, meta: &Self::Meta) {
        self.merge_extra_async_saves(meta.extra_async_saves.as_ref());
        for (c, m) in self.children.iter_mut().zip(&meta.metadata) {
            c.bind(m);
        }
    }

    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        self.each(W::start_load_kv)
    }

    fn wait_for_layer_load(&mut self, layer: u32) -> Vec<TransferCommand> {
        self.each(|c| c.wait_for_layer_load(layer))
    }

    fn save_kv_layer(&mut self, layer: u32) -> Vec<TransferCommand> {
        self.each(|c| c.save_kv_layer(layer))
    }

    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        self.each(W::wait_for_save)
    }

    /// Routed to the child that started the job; a job this worker never started is ignored.
    fn handle_transfer_done(&mut self, done: TransferDone) {
        if let Some((i, inner)) = self.jobs.remove(&done.job) {
            self.outer.remove(&(i, inner));
            self.children[i].handle_transfer_done(TransferDone {
                job: inner,
                ok: done.ok,
            });
        }
    }

    /// Unions `finished_recving` and `failed_recving` over the children; `finished_sending`
    /// goes through [`MultiWorker::consume_finished_sending`], child by child in order. Empty
    /// sets are `None`, as vLLM's `get_finished` gives them.
    fn get_transfer_results(&mut self, finished_req_ids: &SortedSet<RequestId>) -> TransferResults {
        let mut sending = SortedSet::new();
        let mut recving = SortedSet::new();
        let mut failed = SortedSet::new();
        for i in 0..self.children.len() {
            let r = self.children[i].get_transfer_results(finished_req_ids);
            if let Some(s) = &r.finished_recving {
                recving.union_with(s);
            }
            failed.union_with(&r.failed_recving);
            self.consume_finished_sending(r.finished_sending.iter().flatten(), &mut sending);
        }
        TransferResults {
            finished_sending: (!sending.is_empty()).then_some(sending),
            finished_recving: (!recving.is_empty()).then_some(recving),
            failed_recving: failed,
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        let mut out = SortedSet::new();
        for c in &mut self.children {
            out.union_with(&c.get_block_ids_with_load_errors());
        }
        out
    }

    /// `None` if every child built `None`, else one slot per child (I-31).
    fn build_connector_worker_meta(&mut self) -> Option<Meta> {
        build_multi(
            self.children
                .iter_mut()
                .map(W::build_connector_worker_meta)
                .collect(),
        )
    }

    fn clear(&mut self) {
        for c in &mut self.children {
            c.clear();
        }
    }

    /// The first child's error, in child order (vLLM: the first assertion ends the worker);
    /// a job id in it is the child's own numbering.
    fn error(&self) -> Option<WorkerError> {
        self.children.iter().find_map(W::error)
    }
}

// ---------------------------------------------------------------------------------------------
// Boxed connectors (heterogeneous children).

impl<T: SchedulerConnector + ?Sized> SchedulerConnector for alloc::boxed::Box<T> {
    type Meta = T::Meta;
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
    ) -> Self::Meta {
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
    fn take_intents(&mut self) -> Vec<Intent> {
        (**self).take_intents()
    }
    fn take_error(&mut self) -> Option<String> {
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
    fn meta_is_empty(&self, meta: &Self::Meta) -> bool {
        (**self).meta_is_empty(meta)
    }
    fn tracks_request(&self, request: RequestId) -> bool {
        (**self).tracks_request(request)
    }
}

impl<T: WorkerConnector + ?Sized> WorkerConnector for alloc::boxed::Box<T> {
    type Meta = T::Meta;
    type WorkerMeta = T::WorkerMeta;

    fn handle_preemptions(&mut self, meta: &Self::Meta) -> Vec<TransferCommand> {
        (**self).handle_preemptions(meta)
    }
    fn bind(&mut self, meta: &Self::Meta) {
        (**self).bind(meta);
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        (**self).start_load_kv()
    }
    fn wait_for_layer_load(&mut self, layer: u32) -> Vec<TransferCommand> {
        (**self).wait_for_layer_load(layer)
    }
    fn save_kv_layer(&mut self, layer: u32) -> Vec<TransferCommand> {
        (**self).save_kv_layer(layer)
    }
    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        (**self).wait_for_save()
    }
    fn handle_transfer_done(&mut self, done: TransferDone) {
        (**self).handle_transfer_done(done);
    }
    fn get_transfer_results(&mut self, finished_req_ids: &SortedSet<RequestId>) -> TransferResults {
        (**self).get_transfer_results(finished_req_ids)
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        (**self).get_block_ids_with_load_errors()
    }
    fn build_connector_worker_meta(&mut self) -> Option<Self::WorkerMeta> {
        (**self).build_connector_worker_meta()
    }
    fn clear(&mut self) {
        (**self).clear();
    }
    fn error(&self) -> Option<WorkerError> {
        (**self).error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ScriptedConnector, ScriptedWorker};

    #[test]
    fn check_invariants_rejects_corrupt_scheduler_state() {
        // A cargo-mutants survivor: the public calls never build these states, so only a
        // corrupted connector shows that the check looks at all.
        let healthy = MultiConnector::new(alloc::vec![ScriptedConnector::quiet(); 2]).unwrap();
        assert_eq!(healthy.check_invariants(), Ok(()));
        let mut stray_loader = healthy.clone();
        stray_loader.loaders.insert(RequestId(1), 2);
        let e = stray_loader.check_invariants().unwrap_err();
        assert!(format!("{e:?}").contains("I-29"), "{e:?}");
        let mut zero_saves = healthy.clone();
        zero_saves.extra_async_saves.insert(RequestId(1), 0);
        let e = zero_saves.check_invariants().unwrap_err();
        assert!(format!("{e:?}").contains("I-28"), "{e:?}");
    }

    #[test]
    fn a_boxed_connector_forwards_every_answer() {
        // cargo-mutants survivors: the `Box<T>` forwarding impl was only ever asked defaults.
        let scheduler =
            crate::Scheduler::new(crate::SchedulerConfig::default(), crate::NoopConnector).unwrap();
        let view = scheduler.view();
        let mut inner = ScriptedConnector::quiet();
        inner.set_pending_block_frees(true);
        inner.set_push_work(true);
        inner.set_finished_count(Some(3));
        inner.set_requires_kv_delivery(true);
        let boxed = alloc::boxed::Box::new(inner);
        assert!(boxed.has_pending_block_frees(&view));
        assert!(boxed.has_pending_push_work());
        assert_eq!(boxed.get_finished_count(), Some(3));
        assert!(boxed.requires_kv_delivery());
        let mut plain = alloc::boxed::Box::new(ScriptedConnector::quiet());
        assert!(!plain.requires_kv_delivery());
        assert_eq!(
            plain.reset_cache(),
            ScriptedConnector::quiet().reset_cache()
        );
        assert_ne!(plain.reset_cache(), Some(false));
        let mut multi = MultiConnector::new(alloc::vec![ScriptedConnector::quiet()]).unwrap();
        multi.record(MultiError::FinishedCountConflict {
            counts: alloc::vec![1, 2],
        });
        let mut boxed = alloc::boxed::Box::new(multi);
        assert!(boxed.take_error().is_some());
        assert_eq!(boxed.take_error(), None, "reported once");
    }

    /// A worker connector that records every call and answers with values no default matches.
    #[derive(Debug, Default)]
    struct Recorder {
        calls: Vec<&'static str>,
        done: Vec<TransferDone>,
    }

    impl WorkerConnector for Recorder {
        type Meta = u32;
        type WorkerMeta = Meta;

        fn handle_preemptions(&mut self, _meta: &u32) -> Vec<TransferCommand> {
            Vec::new()
        }
        fn bind(&mut self, _meta: &u32) {
            self.calls.push("bind");
        }
        fn start_load_kv(&mut self) -> Vec<TransferCommand> {
            Vec::new()
        }
        fn wait_for_save(&mut self) -> Vec<TransferCommand> {
            Vec::new()
        }
        fn handle_transfer_done(&mut self, done: TransferDone) {
            self.done.push(done);
        }
        fn get_transfer_results(&mut self, finished: &SortedSet<RequestId>) -> TransferResults {
            TransferResults {
                finished_sending: Some(finished.clone()),
                finished_recving: None,
                failed_recving: SortedSet::from_vec(alloc::vec![RequestId(9)]),
            }
        }
        fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
            SortedSet::from_vec(alloc::vec![BlockId(4), BlockId(7)])
        }
        fn build_connector_worker_meta(&mut self) -> Option<Meta> {
            Some(Meta::Set(SortedSet::from_vec(alloc::vec![
                "rank".to_string()
            ])))
        }
        fn clear(&mut self) {
            self.calls.push("clear");
        }
    }

    #[test]
    fn a_boxed_worker_connector_forwards_every_call() {
        // cargo-mutants survivors: the worker side of the `Box<T>` forwarding impl.
        let mut boxed = alloc::boxed::Box::new(Recorder::default());
        boxed.bind(&1);
        let done = TransferDone {
            job: JobId(3),
            ok: false,
        };
        boxed.handle_transfer_done(done);
        let finished = SortedSet::from_vec(alloc::vec![RequestId(2)]);
        let results = boxed.get_transfer_results(&finished);
        assert_eq!(results.finished_sending, Some(finished));
        assert_eq!(results.failed_recving.as_slice(), &[RequestId(9)]);
        assert_eq!(
            boxed.get_block_ids_with_load_errors().as_slice(),
            &[BlockId(4), BlockId(7)]
        );
        assert!(matches!(
            boxed.build_connector_worker_meta(),
            Some(Meta::Set(_))
        ));
        boxed.clear();
        assert_eq!(boxed.calls, ["bind", "clear"]);
        assert_eq!(boxed.done, [done]);
    }

    #[test]
    fn worker_check_invariants_rejects_corrupt_renumbering() {
        // A cargo-mutants survivor, like the scheduler side's check above.
        let healthy = MultiWorker::new(alloc::vec![ScriptedWorker::new(); 2]);
        assert_eq!(healthy.check_invariants(), Ok(()));
        let mut zero_saves = healthy.clone();
        zero_saves.extra_async_saves.insert(RequestId(1), 0);
        assert!(format!("{:?}", zero_saves.check_invariants()).contains("I-28"));
        let mut one_way = healthy.clone();
        one_way.jobs.insert(JobId(0), (0, JobId(5)));
        assert!(
            one_way.check_invariants().is_err(),
            "outer job without its inverse"
        );
        let mut stray_child = healthy.clone();
        stray_child.jobs.insert(JobId(0), (2, JobId(5)));
        stray_child.outer.insert((2, JobId(5)), JobId(0));
        assert!(stray_child.check_invariants().is_err(), "child 2 of 2");
    }
}
