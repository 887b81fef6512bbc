//! kvrelay's [`MultiConnector`] / [`MultiWorker`] composing P/D and offloading children, for the
//! system model: what vLLM deployments run when a P/D connector and CPU offloading are used at
//! once (SEMANTICS.md §4.3, I-28…I-32).
//!
//! The core's MultiConnector composes children of one type; [`Child`] and [`ChildWorker`] are
//! that one type here: each is either the [`PdPair`]'s connector or kvrelay's offloading
//! connector, with the metadata of whichever it is ([`ChildMeta`]). The MultiConnector hands
//! child `i` exactly the metadata child `i` built, so a child never sees the other kind's.
//!
//! Two historical bugs live here: vLLM issue #46951 (the offloading child not told of blocks
//! allocated for the P/D child's async load, [`SchedFault::DropZeroExternalAlloc`] on the
//! offloading child) and PR #18246 (extra async saves not shipped to the workers,
//! [`MultiFault::StripExtraSaves`]).

use kvrelay_core::{
    AggregatedOutput, BlockId, FinishDecision, Intent, InvariantViolation, KvEvent, Lookup, Meta,
    MultiConnector, MultiMeta, MultiWorker, OffloadingConnector, OffloadingConnectorMeta,
    OffloadingWorker, Params, RequestId, SchedulerConfig, SchedulerConnector, SchedulerOutput,
    SchedulerView, SortedSet, Transfer, TransferCommand, TransferDone, TransferResults,
    WorkerConnector,
};

use kvrelay_core::{PdConnector, PdMeta};

use crate::pd::{PdModelWorker, PdPair, PdRole, request_params};
use crate::system::{
    Connectors, Faulty, OffloadingPair, SchedFault, SystemConfig, forward_scheduler_calls,
    is_remote_slot, property_names,
};

/// Which connector a child is.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum ChildKind {
    /// The P/D connector in this role.
    Pd(PdRole),
    /// kvrelay's CPU offloading connector (with an optional fault).
    Offloading(Option<SchedFault>),
}

/// A child's per-step metadata.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ChildMeta {
    /// The P/D child's.
    Pd(PdMeta),
    /// The offloading child's.
    Offloading(OffloadingConnectorMeta),
}

/// A scheduler-side child.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum Child {
    /// The P/D connector.
    Pd(PdConnector),
    /// A P/D connector whose finished requests return no `kv_transfer_params` (a second sender
    /// beside a first: vLLM's MultiConnector refuses two children setting the same keys, I-32).
    QuietPd(PdConnector),
    /// kvrelay's offloading connector (boxed: far larger than the P/D one).
    Offloading(Box<Faulty<OffloadingConnector>>),
}

/// Forwards a call to whichever connector `self` is.
macro_rules! each {
    ($self:expr, $c:ident => $e:expr) => {
        match $self {
            Child::Pd($c) | Child::QuietPd($c) => $e,
            Child::Offloading($c) => $e,
        }
    };
}

impl SchedulerConnector for Child {
    type StepMeta = ChildMeta;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, request: RequestId) {
        each!(self, c => c.on_new_request(view, request));
    }
    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        each!(self, c => c.get_num_new_matched_tokens(view, request, num_computed_tokens))
    }
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        each!(self, c => c.update_state_after_alloc(view, request, blocks, num_external_tokens));
    }
    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        out: &SchedulerOutput,
    ) -> ChildMeta {
        match self {
            Child::Pd(c) | Child::QuietPd(c) => ChildMeta::Pd(c.build_connector_meta(view, out)),
            Child::Offloading(c) => ChildMeta::Offloading(c.build_connector_meta(view, out)),
        }
    }
    fn update_connector_output(&mut self, view: &SchedulerView<'_>, output: &AggregatedOutput) {
        each!(self, c => c.update_connector_output(view, output));
    }
    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        let mut d = each!(self, c => c.request_finished(view, request, blocks));
        if matches!(self, Child::QuietPd(_)) {
            d.kv_transfer_params = None;
        }
        d
    }
    fn take_events(&mut self) -> Vec<KvEvent> {
        each!(self, c => c.take_events())
    }
    fn take_intents(&mut self) -> Vec<Intent> {
        each!(self, c => c.take_intents())
    }
    fn take_error(&mut self) -> Option<kvrelay_core::ConnectorError> {
        each!(self, c => c.take_error())
    }
    fn has_pending_block_frees(&self, view: &SchedulerView<'_>) -> bool {
        each!(self, c => c.has_pending_block_frees(view))
    }
    fn has_pending_push_work(&self) -> bool {
        each!(self, c => c.has_pending_push_work())
    }
    fn reset_cache(&mut self) -> Option<bool> {
        each!(self, c => c.reset_cache())
    }
    fn get_finished_count(&self) -> Option<u32> {
        each!(self, c => c.get_finished_count())
    }
    fn requires_kv_delivery(&self) -> bool {
        each!(self, c => c.requires_kv_delivery())
    }
}

/// A worker-side child.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum ChildWorker {
    /// The P/D worker (boxed, as the offloading one: the two differ in size).
    Pd(Box<PdModelWorker>),
    /// kvrelay's offloading worker.
    Offloading(Box<OffloadingWorker>),
}

/// Forwards a metadata-taking call to the worker of the metadata's kind.
macro_rules! with_meta {
    ($self:expr, $meta:expr, $w:ident, $m:ident => $e:expr) => {
        match ($self, $meta) {
            (ChildWorker::Pd($w), ChildMeta::Pd($m)) => $e,
            (ChildWorker::Offloading($w), ChildMeta::Offloading($m)) => $e,
            // MultiWorker hands child i the metadata child i built (I-31): a mismatch is a bug
            // of the composition, not an input error.
            _ => unreachable!("a child received another kind of child's metadata"),
        }
    };
}

/// Forwards a call to whichever worker `self` is.
macro_rules! each_worker {
    ($self:expr, $w:ident => $e:expr) => {
        match $self {
            ChildWorker::Pd($w) => $e,
            ChildWorker::Offloading($w) => $e,
        }
    };
}

impl WorkerConnector for ChildWorker {
    type StepMeta = ChildMeta;
    type WorkerMeta = Meta;

    fn handle_preemptions(&mut self, meta: &ChildMeta) -> Vec<TransferCommand> {
        with_meta!(self, meta, w, m => w.handle_preemptions(m))
    }
    fn bind(&mut self, meta: &ChildMeta) {
        with_meta!(self, meta, w, m => w.bind(m));
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        each_worker!(self, w => w.start_load_kv())
    }
    fn wait_for_layer_load(&mut self, layer: u32) -> Vec<TransferCommand> {
        each_worker!(self, w => w.wait_for_layer_load(layer))
    }
    fn save_kv_layer(&mut self, layer: u32) -> Vec<TransferCommand> {
        each_worker!(self, w => w.save_kv_layer(layer))
    }
    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        each_worker!(self, w => w.wait_for_save())
    }
    fn handle_transfer_done(&mut self, done: TransferDone) {
        each_worker!(self, w => w.handle_transfer_done(done));
    }
    fn get_transfer_results(&mut self, finished: &SortedSet<RequestId>) -> TransferResults {
        each_worker!(self, w => w.get_transfer_results(finished))
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        each_worker!(self, w => w.get_block_ids_with_load_errors())
    }
    fn build_connector_worker_meta(&mut self) -> Option<Meta> {
        each_worker!(self, w => w.build_connector_worker_meta())
    }
    fn clear(&mut self) {
        each_worker!(self, w => w.clear());
    }
}

/// Faults of the composition itself.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum MultiFault {
    /// Before vLLM PR #18246: the extra async saves are counted on the scheduler side only and
    /// never reach the workers, so a request two children send is reported after the first.
    StripExtraSaves,
}

/// The scheduler side with an optional [`MultiFault`].
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct FaultyMulti {
    /// The real MultiConnector.
    pub inner: MultiConnector<Child>,
    /// The injected fault.
    pub fault: Option<MultiFault>,
}

impl SchedulerConnector for FaultyMulti {
    type StepMeta = MultiMeta<ChildMeta>;
    type WorkerMeta = Meta;

    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        out: &SchedulerOutput,
    ) -> Self::StepMeta {
        let mut meta = self.inner.build_connector_meta(view, out);
        if self.fault == Some(MultiFault::StripExtraSaves) {
            meta.extra_async_saves = None;
        }
        meta
    }
    forward_scheduler_calls!(inner:
        on_new_request, get_num_new_matched_tokens, update_state_after_alloc,
        update_connector_output, request_finished, take_events, take_intents, take_error,
        has_pending_block_frees, has_pending_push_work, reset_cache, get_finished_count,
        requires_kv_delivery,
    );
}

/// A MultiConnector of the given children, for [`crate::SystemModel`].
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct MultiPair {
    /// The children, in order (the first with a positive lookup loads a request).
    pub children: Vec<ChildKind>,
    /// A fault of the composition.
    pub fault: Option<MultiFault>,
}

impl MultiPair {
    /// A P/D child that loads every prompt (no sends), then kvrelay's offloading connector:
    /// a decode instance that also offloads to CPU.
    pub fn pd_then_offloading() -> Self {
        Self {
            children: vec![
                ChildKind::Pd(PdRole {
                    load: true,
                    send: false,
                    failures_as_blocks: true,
                }),
                ChildKind::Offloading(None),
            ],
            fault: None,
        }
    }

    /// Two P/D children that both send every finished request (two async savers, S13).
    pub fn two_senders() -> Self {
        let sender = ChildKind::Pd(PdRole {
            load: false,
            send: true,
            failures_as_blocks: true,
        });
        Self {
            children: vec![sender, sender],
            fault: None,
        }
    }

    fn pd_roles(&self) -> impl Iterator<Item = PdRole> + '_ {
        self.children.iter().filter_map(|c| match c {
            ChildKind::Pd(r) => Some(*r),
            ChildKind::Offloading(_) => None,
        })
    }
}

impl Connectors for MultiPair {
    type Sched = FaultyMulti;
    type Worker = MultiWorker<ChildWorker>;

    fn name(&self) -> String {
        let kids: Vec<String> = self
            .children
            .iter()
            .map(|c| match c {
                ChildKind::Pd(_) => "p/d".to_owned(),
                ChildKind::Offloading(None) => "offloading".to_owned(),
                ChildKind::Offloading(Some(f)) => format!("offloading with fault {f:?}"),
            })
            .collect();
        let mut name = format!("multi [{}]", kids.join(", "));
        if let Some(f) = self.fault {
            name += &format!(" with fault {f:?}");
        }
        name
    }

    fn scheduler_connector(
        &self,
        config: &SchedulerConfig,
        model: &SystemConfig,
    ) -> Result<FaultyMulti, String> {
        let mut children = Vec::with_capacity(self.children.len());
        let mut senders = 0;
        for c in &self.children {
            children.push(match *c {
                ChildKind::Pd(role) => {
                    let pair = PdPair {
                        role,
                        ..PdPair::default()
                    };
                    let c = pair.scheduler_connector(config, model)?;
                    senders += u32::from(role.send);
                    if role.send && senders > 1 {
                        Child::QuietPd(c)
                    } else {
                        Child::Pd(c)
                    }
                }
                ChildKind::Offloading(fault) => Child::Offloading(Box::new(
                    OffloadingPair { fault }.scheduler_connector(config, model)?,
                )),
            });
        }
        let inner = MultiConnector::new(children).map_err(|e| e.to_string())?;
        Ok(FaultyMulti {
            inner,
            fault: self.fault,
        })
    }

    fn worker(&self, rank: u32, model: &SystemConfig) -> MultiWorker<ChildWorker> {
        MultiWorker::new(
            self.children
                .iter()
                .map(|c| match *c {
                    ChildKind::Pd(role) => ChildWorker::Pd(Box::new(
                        PdPair {
                            role,
                            ..PdPair::default()
                        }
                        .worker(rank, model),
                    )),
                    ChildKind::Offloading(fault) => ChildWorker::Offloading(Box::new(
                        OffloadingPair { fault }.worker(rank, model),
                    )),
                })
                .collect(),
        )
    }

    fn check_sched(&self, c: &FaultyMulti) -> Result<(), InvariantViolation> {
        c.inner.check_invariants()?;
        for child in c.inner.children() {
            if let Child::Offloading(o) = child {
                o.inner.check_invariants()?;
            }
        }
        Ok(())
    }

    fn check_worker(&self, w: &MultiWorker<ChildWorker>) -> Result<(), InvariantViolation> {
        w.check_invariants()?;
        for child in w.children() {
            if let ChildWorker::Offloading(o) = child {
                OffloadingPair::default().check_worker(o)?;
            }
        }
        Ok(())
    }

    fn remote_prefill(&self) -> bool {
        self.pd_roles().any(|r| r.load)
    }

    /// Every P/D child's params: the router's for the roles of all of them.
    fn request_params(&self, id: RequestId, model: &SystemConfig) -> Option<Params> {
        let role = PdRole {
            load: self.pd_roles().any(|r| r.load),
            send: self.pd_roles().any(|r| r.send),
            failures_as_blocks: true,
        };
        request_params(role, id, model.prompt_tokens)
    }

    /// Each P/D child that holds a request waits for an acknowledgement of its own.
    fn awaiting_ack(&self, c: &FaultyMulti) -> Vec<RequestId> {
        let mut held: Vec<RequestId> = c
            .inner
            .children()
            .iter()
            .filter_map(|child| match child {
                Child::Pd(p) | Child::QuietPd(p) => Some(p.awaiting_ack()),
                Child::Offloading(_) => None,
            })
            .flatten()
            .collect();
        held.sort();
        held.dedup();
        held
    }

    /// The first P/D child still waiting for `request` hears it.
    fn acknowledge(&self, c: &mut FaultyMulti, request: RequestId) {
        for i in 0..c.inner.children().len() {
            if let Some(Child::Pd(p) | Child::QuietPd(p)) = c.inner.child_mut(i)
                && p.awaiting_ack().any(|r| r == request)
            {
                p.acknowledge(request);
                return;
            }
        }
    }

    /// The P/D child's remote loads may fail; the offloading child's cannot.
    fn load_may_fail(&self, load: &Transfer) -> bool {
        load.external.iter().copied().all(is_remote_slot)
    }

    fn describe_meta(&self, meta: &MultiMeta<ChildMeta>) -> String {
        let mut parts: Vec<String> = meta
            .metadata
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                let text = match m {
                    ChildMeta::Pd(m) => PdPair::default().describe_meta(m),
                    ChildMeta::Offloading(m) => OffloadingPair::default().describe_meta(m),
                };
                (!text.is_empty()).then(|| format!("child {i}: {text}"))
            })
            .collect();
        if let Some(extra) = &meta.extra_async_saves {
            let e: Vec<(u32, u32)> = extra.iter().map(|(r, n)| (r.0, *n)).collect();
            parts.push(format!("extra async saves {e:?}"));
        }
        parts.join("; ")
    }

    /// Preemption and a clean end; a delayed free when a child sends; a failed load
    /// recomputed when a child loads remotely and loads may fail.
    fn expected_examples(&self, config: &SystemConfig) -> Vec<&'static str> {
        use property_names as n;
        let mut v = vec![n::PREEMPTED, n::ALL_DONE];
        if self.pd_roles().any(|r| r.send) {
            v.push(n::DELAYED_FREE);
        }
        if self.pd_roles().any(|r| r.load) && config.load_failures > 0 {
            v.push(n::LOAD_FAILED_RECOMPUTED);
        }
        v
    }
}
