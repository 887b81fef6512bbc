//! The completion model: W ranks report R requests' transfer completions through the real
//! worker step protocol to the real aggregator (SEMANTICS.md §2.4, §4.1–§4.2, §8.1, §8.4).
//!
//! Each rank's step is run by the core's [`RankDriver`] (the hook order the engine ships) over a
//! [`ReportingWorker`], a worker connector that reports the transfers the environment finished.
//! A driver is built for each step: between steps a rank is only its worker (its transfers), so
//! step counters never enter the state, which stays finite.
//!
//! Why this file is long: the model's state, its actions, the ghost state its properties read and
//! the properties themselves are one argument — each property names the ghost field an action sets
//! — and they are read together; the faulty wrappers of the historical bugs it re-finds sit beside
//! the step they break.

use core::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvrelay_core::{
    AggregateError, AggregatedOutput, Aggregator, BlockId, Direction, Meta, Mode,
    ProtocolViolation, Rank, RankAction, RankConfig, RankDriver, RankError, RequestId,
    ScheduledStep, SchedulerOutput, SortedSet, StepId, TransferCommand, TransferDone,
    TransferResults, WorkerConnector, WorkerOutput,
};
use stateright::{Model, Property};

use crate::diagram::Arrow;
use crate::explain::Explain;

/// The names of the properties of [`CompletionModel`], as they appear in a
/// [`crate::CheckReport`].
pub mod property_names {
    /// `always`: every (request, direction) is emitted by the aggregator at most once, and only
    /// once every rank has reported it (I-21).
    pub const EXACTLY_ONCE: &str = "exactly-once emission after all ranks (I-21)";
    /// `always`: every aggregated `failed_recving` is a subset of the same call's
    /// `finished_recving` (I-24).
    pub const FAILED_SUBSET: &str = "failed ⊆ finished (I-24)";
    /// `always`: an emitted load is in `failed_recving` exactly when some rank reported it failed
    /// (I-24, second half).
    pub const FAILURES_TRAVEL: &str = "failed loads emitted with their recv (I-24)";
    /// `always`: no rank's [`kvrelay_core::WorkerProtocol`] ever rejected a call (I-1…I-6).
    pub const PROTOCOL: &str = "protocol never violated";
    /// `always`: `check_invariants()` of the aggregator and of every rank's protocol holds in
    /// every state and after every single hook, and the aggregator never fails unexpectedly.
    pub const CORE_INVARIANTS: &str = "core invariants hold";
    /// `sometimes`: a state where every transfer of every request has been emitted is reachable.
    pub const ALL_EMITTED: &str = "all transfers emitted";
    /// `sometimes`, only with [`super::CompletionConfig::faulty_double_report`] in strict mode:
    /// the strict aggregator rejected a duplicate report (so the fault was really exercised) and
    /// still every transfer was emitted afterwards (the rejected step lost nothing).
    pub const DUPLICATE_REJECTED: &str = "duplicate rejected, then all transfers emitted (strict)";
}

/// Per-layer hook pairs a forward step runs (`wait_for_layer_load` + `save_kv_layer`).
const LAYERS: u32 = 2;

/// What the completion model explores. Build one from a preset ([`CompletionConfig::ci`],
/// [`CompletionConfig::deep`]) and override fields.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct CompletionConfig {
    /// Worker ranks (W); the aggregator's quorum. At least 1.
    pub ranks: u32,
    /// Requests (R); each has one recv (load) and one send (save) transfer on every rank.
    pub requests: u32,
    /// The aggregator's mode.
    pub mode: Mode,
    /// Loads may fail: a failed load is reported in both `finished_recving` and
    /// `failed_recving` of that rank's next output, as vLLM workers do.
    pub failures: bool,
    /// Fault: one rank may include one already-reported completion again in a later output
    /// (at most one such fault per run). vLLM's aggregator counts it as a second report.
    pub faulty_double_report: bool,
    /// Fault: every rank's runner calls `bind` before `handle_preemptions` (vLLM PR #42676's
    /// model runner V2 bug). Used to show the protocol property catches a wrong runner. The
    /// runner is the core's rank driver, so this needs the `scheduler-faults` feature.
    pub faulty_bind_first: bool,
}

impl CompletionConfig {
    /// The configuration CI explores exhaustively: W=2, R=2, loads and saves, load failures on,
    /// compat mode, no faults. 83,592 unique states (198,397 generated), about 0.3 s and 40 MB
    /// in release on 2 cores.
    pub fn ci() -> Self {
        Self {
            ranks: 2,
            requests: 2,
            mode: Mode::Compat,
            failures: true,
            faulty_double_report: false,
            faulty_bind_first: false,
        }
    }

    /// A larger configuration: W=3 ranks (partial quorums of 1 and 2 reports), R=2 requests,
    /// otherwise as [`CompletionConfig::ci`]. 15.6 M unique states (37.3 M generated), about
    /// 65–80 s and **5.3 GB** of memory in release on 2 cores (breadth-first search keeps whole
    /// states on its frontier). Without load failures the same size is 1.2 M states and 6 s.
    pub fn deep() -> Self {
        Self {
            ranks: 3,
            ..Self::ci()
        }
    }

    /// Checks the configuration can be explored: at least one rank (the aggregator's quorum),
    /// at most 64 requests (a rank's output is a bitmask over requests).
    pub fn validate(&self) -> Result<(), String> {
        if self.ranks == 0 {
            return Err("the completion model needs at least one rank".to_owned());
        }
        if self.requests > 64 {
            return Err(format!(
                "the completion model supports at most 64 requests, not {}",
                self.requests
            ));
        }
        if self.faulty_bind_first && cfg!(not(feature = "scheduler-faults")) {
            return Err(
                "the bind-first fault is re-introduced in kvrelay-core's rank driver and \
                        needs kvrelay-model-check's `scheduler-faults` feature (kvrelay: build \
                        with --features scheduler-faults)"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

impl Default for CompletionConfig {
    /// [`CompletionConfig::ci`].
    fn default() -> Self {
        Self::ci()
    }
}

/// One transfer (a request's load or save) on one rank.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Transfer {
    /// Still in flight.
    Pending,
    /// Finished, not yet reported by the rank's `get_finished`.
    Done {
        /// The load failed (recv only).
        failed: bool,
    },
    /// Finished and reported in one of the rank's outputs. (Whether a reported load failed is
    /// kept per request, in [`Ghost`], until the load is emitted: a per-rank flag would multiply
    /// the states without being read.)
    Reported,
}

/// One rank's worker connector in the completion model: its `get_finished` reports every
/// transfer the environment finished since the last report (a failed load in both
/// `finished_recving` and `failed_recving`, as vLLM workers do), plus the armed re-report fault.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct ReportingWorker {
    /// Indexed by request: `[send, recv]`.
    transfers: Vec<[Transfer; 2]>,
    /// Fault: an already-reported completion this rank includes again in its next output; kept
    /// until the step is aggregated (a strict rejection must know which report was the fault).
    rereport: Option<(RequestId, Direction)>,
}

impl WorkerConnector for ReportingWorker {
    type StepMeta = ();
    type WorkerMeta = Meta;

    fn bind(&mut self, _meta: &()) {}
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        Vec::new()
    }
    fn handle_transfer_done(&mut self, _done: TransferDone) {}

    /// Every finished, unreported transfer, now reported; plus the re-report fault.
    fn get_transfer_results(&mut self, _finished: &SortedSet<RequestId>) -> TransferResults {
        let mut out = Reports::default();
        for (i, pair) in self.transfers.iter_mut().enumerate() {
            for dir in [Direction::Send, Direction::Recv] {
                let t = &mut pair[slot(dir)];
                if let Transfer::Done { failed } = *t {
                    *out.mask(dir) |= 1 << i;
                    if failed {
                        out.failed |= 1 << i;
                    }
                    *t = Transfer::Reported;
                }
            }
        }
        if let Some((request, dir)) = self.rereport {
            *out.mask(dir) |= 1 << request.0;
        }
        let o = out.to_worker_output();
        TransferResults {
            finished_sending: o.finished_sending,
            finished_recving: o.finished_recving,
            failed_recving: o.failed_recving,
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        SortedSet::new()
    }

    fn clear(&mut self) {}
}

/// One rank: its worker connector (its transfers), the output of the current step, and the
/// protocol violation its last step stopped with.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct RankState {
    worker: ReportingWorker,
    /// The output this rank produced in the current step, awaiting aggregation; `None` = the
    /// rank has not run the current step yet. Kept as bitmasks (a state is cloned and hashed
    /// millions of times); it becomes a [`WorkerOutput`] at the aggregate.
    output: Option<Reports>,
    /// The protocol violation the rank's last step stopped with (terminal).
    violation: Option<ProtocolViolation>,
}

impl RankState {
    /// The violation the rank's runner stopped with, if any.
    pub fn violation(&self) -> Option<&ProtocolViolation> {
        self.violation.as_ref()
    }

    /// The state of `request`'s transfer in `dir` on this rank.
    pub fn transfer(&self, request: RequestId, dir: Direction) -> Transfer {
        self.worker.transfers[request.index()][slot(dir)]
    }

    /// The output of the current step, if the rank has run it.
    pub fn output(&self) -> Option<WorkerOutput> {
        self.output.map(Reports::to_worker_output)
    }
}

/// One rank's output of one step, as bitmasks over request indices.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
struct Reports {
    /// `finished_sending`.
    sending: u64,
    /// `finished_recving` (failed loads included).
    recving: u64,
    /// `failed_recving`.
    failed: u64,
}

impl Reports {
    /// The bitmasks of a rank's output.
    fn of(o: &WorkerOutput) -> Self {
        let mask = |ids: Option<&SortedSet<RequestId>>| {
            ids.iter()
                .flat_map(|s| s.iter())
                .fold(0u64, |m, id| m | (1 << id.0))
        };
        Self {
            sending: mask(o.finished_sending.as_ref()),
            recving: mask(o.finished_recving.as_ref()),
            failed: mask(Some(&o.failed_recving)),
        }
    }

    fn mask(&mut self, dir: Direction) -> &mut u64 {
        match dir {
            Direction::Send => &mut self.sending,
            Direction::Recv => &mut self.recving,
        }
    }

    fn get(self, dir: Direction) -> u64 {
        match dir {
            Direction::Send => self.sending,
            Direction::Recv => self.recving,
        }
    }

    /// The rank's `KVConnectorOutput`: empty finished sets are `None`.
    fn to_worker_output(self) -> WorkerOutput {
        let set = |mask: u64| (mask != 0).then(|| ids_of(mask).collect::<SortedSet<_>>());
        WorkerOutput {
            finished_sending: set(self.sending),
            finished_recving: set(self.recving),
            failed_recving: ids_of(self.failed).collect(),
            ..WorkerOutput::default()
        }
    }
}

/// The request ids of the bits set in `mask`, ascending.
fn ids_of(mask: u64) -> impl Iterator<Item = RequestId> {
    (0..64u32)
        .filter(move |i| mask & (1 << i) != 0)
        .map(RequestId)
}

/// History kept for the properties ("ghost" state: neither the ranks nor the aggregator read
/// it), plus the environment's fault budget.
///
/// Violations are sticky flags; a state with a flag set has no successors, so a counterexample
/// ends at the step that broke the property.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct Ghost {
    /// Indexed by request: `[send, recv]` emissions by the aggregator, saturating at 2.
    emitted: Vec<[u8; 2]>,
    /// Some id was emitted before every rank had reported it (I-21).
    emitted_early: bool,
    /// Some aggregated `failed_recving` was not a subset of its `finished_recving` (I-24).
    failed_not_subset: bool,
    /// Some emitted load was in `failed_recving` without a failure report, or missing from it
    /// despite one (I-24).
    failure_mismatch: bool,
    /// Indexed by request: some rank reported the load failed since its last emission.
    load_failed: Vec<bool>,
    /// Some protocol call was rejected.
    protocol_violated: bool,
    /// Some `check_invariants()` failed: a protocol guard's between two hooks of a step, or the
    /// aggregator's after a call.
    invariant_broken: bool,
    /// The aggregator returned an error other than a strict-mode `DuplicateReport`, or no output
    /// although rank 0 produced one.
    unexpected_error: bool,
    /// The single double-report fault was injected.
    fault_injected: bool,
    /// Strict mode rejected a step's outputs with `DuplicateReport`.
    duplicate_rejected: bool,
}

impl Ghost {
    /// How often the aggregator emitted `request` in `dir` (saturating at 2).
    pub fn emitted(&self, request: RequestId, dir: Direction) -> u8 {
        self.emitted[request.index()][slot(dir)]
    }

    /// Whether some property-relevant violation was recorded.
    pub fn violated(&self) -> bool {
        self.emitted_early
            || self.failed_not_subset
            || self.failure_mismatch
            || self.protocol_violated
            || self.invariant_broken
            || self.unexpected_error
            || self.emitted.iter().flatten().any(|&n| n > 1)
    }

    /// Whether strict mode rejected a duplicate report on the way to this state.
    pub fn duplicate_rejected(&self) -> bool {
        self.duplicate_rejected
    }
}

/// A state of the completion model.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct CompletionState {
    /// Index = rank.
    ranks: Vec<RankState>,
    /// The real executor-side aggregator.
    aggregator: Aggregator,
    ghost: Ghost,
}

impl CompletionState {
    /// The ranks, index = rank.
    pub fn ranks(&self) -> &[RankState] {
        &self.ranks
    }

    /// The real aggregator.
    pub fn aggregator(&self) -> &Aggregator {
        &self.aggregator
    }

    /// The property history.
    pub fn ghost(&self) -> &Ghost {
        &self.ghost
    }

    /// How many ranks have reported `request`'s transfer in `dir`.
    pub fn ranks_reported(&self, request: RequestId, dir: Direction) -> usize {
        self.ranks
            .iter()
            .filter(|r| r.transfer(request, dir) == Transfer::Reported)
            .count()
    }
}

/// One step of the environment or of a rank.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum CompletionAction {
    /// A transfer finishes on a rank (environment).
    Complete {
        /// The rank.
        rank: Rank,
        /// The request.
        request: RequestId,
        /// Load (`Recv`) or save (`Send`).
        dir: Direction,
        /// The load failed (only with [`CompletionConfig::failures`], only for `Recv`).
        failed: bool,
    },
    /// A rank runs one whole step through its protocol guard and produces its output.
    RunStep {
        /// The rank.
        rank: Rank,
        /// Tokens are scheduled (per-layer hooks run) or not (`kv_connector_no_forward`).
        forward: bool,
    },
    /// Fault: the rank will include an already-reported completion again in its next output.
    Rereport {
        /// The faulty rank.
        rank: Rank,
        /// The request reported again.
        request: RequestId,
        /// The direction reported again.
        dir: Direction,
    },
    /// The executor aggregates every rank's output of the step (output rank 0) and the next
    /// step begins.
    Aggregate,
}

impl fmt::Display for CompletionAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CompletionAction::Complete {
                rank,
                request,
                dir,
                failed,
            } => write!(
                f,
                "{rank}: {} of {request} completes{}",
                dir_name(dir),
                if failed { " (FAILED)" } else { "" }
            ),
            CompletionAction::RunStep { rank, forward } => write!(
                f,
                "{rank} runs a step ({})",
                if forward { "forward" } else { "no forward" }
            ),
            CompletionAction::Rereport { rank, request, dir } => write!(
                f,
                "FAULT {rank}: will report the {} of {request} again",
                dir_name(dir)
            ),
            CompletionAction::Aggregate => write!(f, "aggregate"),
        }
    }
}

/// The completion model.
///
/// **What it checks.** W ranks each finish, in any order and at any time, one load and one save
/// per request (a load may fail). Each rank runs its connector steps through the real
/// [`WorkerProtocol`](kvrelay_core::WorkerProtocol) (`begin_step`, `handle_preemptions`, `bind`,
/// per-layer hooks if forward, `start_load_kv` after the forward — the steps have async loads,
/// which are what produce `finished_recving` —, `wait_for_save`, `get_finished`,
/// `get_block_ids_with_load_errors`, `get_stats`, `get_events`, `build_worker_meta`, `clear`);
/// `get_finished` reports every completion the rank has not reported yet. Once all ranks ran the
/// step the real [`Aggregator`] folds their outputs (output rank 0) and the next step begins.
/// The properties (see [`property_names`]) are that every completion is emitted at most once and
/// only after every rank reported it (I-21), that failed loads are emitted exactly with their
/// recv (I-24), that the protocol guard accepts the runner's order, and that the core's
/// `check_invariants()` hold.
///
/// **Why.** The aggregator's quorum counting is only correct if every rank reports every
/// completion exactly once (§4.2: no per-rank dedup in vLLM). The model shows the real code
/// meets I-21/I-24 under every interleaving of completions, steps and failures — and, with
/// [`CompletionConfig::faulty_double_report`], that compat mode emits a request before every
/// rank finished it (the vLLM hazard) while strict mode rejects the step instead.
///
/// **Strict rejection.** When strict mode answers `DuplicateReport { rank, .. }`, the aggregator
/// changed nothing. The model then treats the step like one in which that rank failed (§2.6): the
/// other ranks' outputs are stashed with [`Aggregator::salvage`] and counted first at the next
/// aggregate; the faulty rank's output is dropped and its genuinely new completions in it return
/// to "finished, not reported", so that rank reports them again in its next step.
///
/// **Reduction.** Ranks share nothing until the aggregate, so the ranks run each step in rank
/// order and transfers finish (and the fault strikes) only on the next rank to run; any other
/// interleaving reaches the same aggregator inputs (see `actions`). A state that broke a
/// property has no successors.
///
/// **Finite state space.** There is no step counter: a protocol guard that completed a step
/// cleanly (phase `Idle`, no violation) is replaced by `WorkerProtocol::new()`. This is sound
/// because from `Idle` the guard's answers depend only on its phase (`begin_step` resets the
/// shape); only the step number inside a future violation message would differ. Emission counts
/// saturate at 2, and at most one double-report fault is injected per run.
///
/// **First discoveries only.** stateright 0.31 overwrites a property's recorded path with every
/// later state that violates it (or, for `sometimes`, satisfies it; CRATES.md §1.7.2), so a
/// breadth-first run would report the *last* path found, not the shortest. Each property
/// therefore reports a discovery once per model value — the first state found, which
/// breadth-first is a shortest one — and answers "nothing to report" for later states. A clone
/// starts afresh; use one model value per checker run ([`crate::check_completions`] does).
#[derive(Debug)]
pub struct CompletionModel {
    config: CompletionConfig,
    /// Per property slot (`SLOT_*`): a discovery was already reported.
    discovered: Arc<[AtomicBool; SLOTS]>,
}

impl Clone for CompletionModel {
    /// The same configuration, with no discovery reported yet.
    fn clone(&self) -> Self {
        Self::new(self.config)
    }
}

const SLOT_EXACTLY_ONCE: usize = 0;
const SLOT_FAILED_SUBSET: usize = 1;
const SLOT_FAILURES_TRAVEL: usize = 2;
const SLOT_PROTOCOL: usize = 3;
const SLOT_CORE_INVARIANTS: usize = 4;
const SLOT_ALL_EMITTED: usize = 5;
const SLOT_DUPLICATE_REJECTED: usize = 6;
const SLOTS: usize = 7;

impl CompletionModel {
    /// The model of `config`.
    ///
    /// # Panics
    /// If `config` is invalid ([`CompletionConfig::validate`]).
    pub fn new(config: CompletionConfig) -> Self {
        if let Err(e) = config.validate() {
            panic!("invalid completion model configuration: {e}");
        }
        Self {
            config,
            discovered: Arc::new(core::array::from_fn(|_| AtomicBool::new(false))),
        }
    }

    /// Whether to report `discovery` (a violation of an `always` property, an example of a
    /// `sometimes` one) for the property in `slot`: only the first time.
    fn first(&self, slot: usize, discovery: bool) -> bool {
        discovery && !self.discovered[slot].swap(true, Ordering::Relaxed)
    }

    /// The configuration.
    pub fn config(&self) -> &CompletionConfig {
        &self.config
    }

    fn all_requests(&self) -> impl Iterator<Item = RequestId> + use<> {
        (0..self.config.requests).map(RequestId)
    }

    /// Runs one whole step of `rank` through a rank driver (the core's hook order, `LAYERS`
    /// layers when `forward`); its output waits for the aggregate. A rejected call stops the
    /// step (the rank stays without output). The driver's and the protocol guard's invariants are
    /// checked after every hook.
    fn run_step(&self, rank: &mut RankState, forward: bool, ghost: &mut Ghost) {
        let config = RankConfig {
            layers: LAYERS,
            block_size: 1,
            groups: Vec::new(),
        };
        #[allow(unused_mut)] // mutated only with the `scheduler-faults` feature
        let mut driver = RankDriver::new(config, rank.worker.clone());
        #[cfg(feature = "scheduler-faults")]
        if self.config.faulty_bind_first {
            driver.inject_fault(kvrelay_core::RankFault::BindFirst);
        }
        let step = ScheduledStep {
            output: SchedulerOutput {
                step: StepId(0),
                total_num_scheduled_tokens: u32::from(forward),
                ..SchedulerOutput::default()
            },
            meta: (),
        };
        let mut result = driver.begin(&step);
        let output = loop {
            if driver.check_invariants().is_err() {
                ghost.invariant_broken = true;
            }
            if let Err(e) = result {
                if let RankError::Protocol(v) = e {
                    rank.violation = Some(v);
                }
                ghost.protocol_violated = true;
                return;
            }
            match driver.poll() {
                Ok(RankAction::Done(o)) => break o,
                Ok(_) => result = Ok(()),
                Err(e) => result = Err(e),
            }
        };
        rank.worker = driver.worker().inner().clone();
        let reports = Reports::of(&output);
        for id in ids_of(reports.failed) {
            ghost.load_failed[id.index()] = true;
        }
        rank.output = Some(reports);
    }

    /// Records an aggregated output in the ghost history.
    fn record(&self, state: &mut CompletionState, out: &AggregatedOutput) {
        let w = state.ranks.len();
        for (dir, set) in [
            (Direction::Send, &out.finished_sending),
            (Direction::Recv, &out.finished_recving),
        ] {
            for &id in set.iter().flatten() {
                if state.ranks_reported(id, dir) != w {
                    state.ghost.emitted_early = true;
                }
                let n = &mut state.ghost.emitted[id.index()][slot(dir)];
                *n = (*n + 1).min(2);
            }
        }
        let recvd = out.finished_recving.clone().unwrap_or_default();
        if !out.failed_recving.iter().all(|id| recvd.contains(id)) {
            state.ghost.failed_not_subset = true;
        }
        for &id in recvd.iter() {
            let reported_failed = core::mem::take(&mut state.ghost.load_failed[id.index()]);
            if reported_failed != out.failed_recving.contains(&id) {
                state.ghost.failure_mismatch = true;
            }
        }
    }

    /// Strict mode rejected the step because `bad` reported something twice: salvage the other
    /// ranks' outputs, drop `bad`'s and let it report its new completions again.
    fn reject_step(&self, state: &mut CompletionState, bad: Rank) {
        state.ghost.duplicate_rejected = true;
        let mut salvaged = Vec::with_capacity(state.ranks.len());
        for (i, rank) in state.ranks.iter_mut().enumerate() {
            let output = rank.output.take();
            if i != bad.index() {
                salvaged.push(output.map(Reports::to_worker_output));
                continue;
            }
            salvaged.push(None);
            let Some(output) = output else { continue };
            for dir in [Direction::Send, Direction::Recv] {
                for id in ids_of(output.get(dir)) {
                    if rank.worker.rereport == Some((id, dir)) {
                        continue;
                    }
                    // The failure flag of a dropped failed load stays in the ghost: the rank
                    // reports the failure again in its next step.
                    let failed = dir == Direction::Recv && output.failed & (1 << id.0) != 0;
                    rank.worker.transfers[id.index()][slot(dir)] = Transfer::Done { failed };
                }
            }
        }
        state.aggregator.salvage(salvaged);
    }
}

impl Model for CompletionModel {
    type State = CompletionState;
    type Action = CompletionAction;

    fn init_states(&self) -> Vec<CompletionState> {
        let (w, r) = (self.config.ranks, self.config.requests as usize);
        let rank = RankState {
            worker: ReportingWorker {
                transfers: vec![[Transfer::Pending; 2]; r],
                rereport: None,
            },
            output: None,
            violation: None,
        };
        vec![CompletionState {
            ranks: vec![rank; w as usize],
            aggregator: Aggregator::with_capacity(w, self.config.mode, r),
            ghost: Ghost {
                emitted: vec![[0; 2]; r],
                load_failed: vec![false; r],
                ..Ghost::default()
            },
        }]
    }

    fn actions(&self, state: &CompletionState, actions: &mut Vec<CompletionAction>) {
        // A state that broke a property is terminal: counterexamples end where it broke.
        if state.ghost.violated() {
            return;
        }
        // Partial-order reduction. Ranks share nothing until the aggregate, and the aggregate
        // never looks at finished-but-unreported transfers, so everything a rank does before its
        // step (a transfer finishing, the fault being armed) commutes with everything the other
        // ranks do, and only matters at the rank's own `get_finished`. The ranks therefore run
        // the step in rank order, and transfers finish (and the fault strikes) only on the next
        // rank to run: any interleaving is reordered into one of these by moving each rank's
        // actions to just before its step. Every tuple of outputs the aggregator can see, every
        // protocol run and every ghost history stays reachable; only intermediate states where
        // two ranks hold unreported completions at once are skipped.
        if let Some(i) = state.ranks.iter().position(|r| r.output.is_none()) {
            let r = &state.ranks[i];
            let rank = Rank(i as u32);
            for request in self.all_requests() {
                for dir in [Direction::Recv, Direction::Send] {
                    if r.transfer(request, dir) != Transfer::Pending {
                        continue;
                    }
                    actions.push(CompletionAction::Complete {
                        rank,
                        request,
                        dir,
                        failed: false,
                    });
                    if dir == Direction::Recv && self.config.failures {
                        actions.push(CompletionAction::Complete {
                            rank,
                            request,
                            dir,
                            failed: true,
                        });
                    }
                }
            }
            if r.violation.is_none() {
                for forward in [true, false] {
                    actions.push(CompletionAction::RunStep { rank, forward });
                }
            }
            if self.config.faulty_double_report && !state.ghost.fault_injected {
                for request in self.all_requests() {
                    for dir in [Direction::Recv, Direction::Send] {
                        if r.transfer(request, dir) == Transfer::Reported {
                            actions.push(CompletionAction::Rereport { rank, request, dir });
                        }
                    }
                }
            }
        }
        if state.ranks.iter().all(|r| r.output.is_some()) {
            actions.push(CompletionAction::Aggregate);
        }
    }

    fn next_state(
        &self,
        last: &CompletionState,
        action: CompletionAction,
    ) -> Option<CompletionState> {
        let mut state = last.clone();
        match action {
            CompletionAction::Complete {
                rank,
                request,
                dir,
                failed,
            } => {
                let t = &mut state.ranks[rank.index()].worker.transfers[request.index()][slot(dir)];
                if *t != Transfer::Pending {
                    return None;
                }
                *t = Transfer::Done { failed };
            }
            CompletionAction::RunStep { rank, forward } => {
                let CompletionState { ranks, ghost, .. } = &mut state;
                let r = &mut ranks[rank.index()];
                if r.output.is_some() || r.violation.is_some() {
                    return None;
                }
                self.run_step(r, forward, ghost);
            }
            CompletionAction::Rereport { rank, request, dir } => {
                let r = &mut state.ranks[rank.index()];
                if state.ghost.fault_injected || r.output.is_some() {
                    return None;
                }
                r.worker.rereport = Some((request, dir));
                state.ghost.fault_injected = true;
            }
            CompletionAction::Aggregate => {
                let outputs: Vec<Option<WorkerOutput>> =
                    state.ranks.iter().map(RankState::output).collect();
                if outputs.iter().any(Option::is_none) {
                    return None;
                }
                match state.aggregator.aggregate(&outputs, Rank(0)) {
                    Ok(Some(out)) => self.record(&mut state, &out),
                    Err(AggregateError::DuplicateReport { rank, .. })
                        if self.config.mode == Mode::Strict =>
                    {
                        self.reject_step(&mut state, rank);
                    }
                    Ok(None) | Err(_) => state.ghost.unexpected_error = true,
                }
                if state.aggregator.check_invariants().is_err() {
                    state.ghost.invariant_broken = true;
                }
                for r in &mut state.ranks {
                    r.output = None;
                    r.worker.rereport = None;
                }
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut p = vec![
            Property::always(property_names::EXACTLY_ONCE, exactly_once),
            Property::always(property_names::FAILED_SUBSET, failed_subset),
            Property::always(property_names::FAILURES_TRAVEL, failures_travel),
            Property::always(property_names::PROTOCOL, protocol_kept),
            Property::always(property_names::CORE_INVARIANTS, core_invariants),
            Property::sometimes(property_names::ALL_EMITTED, all_emitted),
        ];
        if self.config.faulty_double_report && self.config.mode == Mode::Strict {
            p.push(Property::sometimes(
                property_names::DUPLICATE_REJECTED,
                duplicate_rejected,
            ));
        }
        p
    }

    fn format_action(&self, action: &CompletionAction) -> String {
        action.to_string()
    }
}

impl Explain for CompletionModel {
    /// `action` taken in `state`, with what it produced (a rank's reported sets, the aggregated
    /// output): one line of a counterexample.
    fn describe(&self, state: &CompletionState, action: &CompletionAction) -> String {
        let Some(next) = self.next_state(state, *action) else {
            return format!("{action} (not enabled)");
        };
        match *action {
            CompletionAction::RunStep { rank, .. } => {
                let r = &next.ranks[rank.index()];
                match (r.violation(), r.output()) {
                    (Some(v), _) => format!("{action} → {v}"),
                    (None, Some(o)) => format!(
                        "{action} → sending {} recving {} failed {}",
                        ids(o.finished_sending.as_ref()),
                        ids(o.finished_recving.as_ref()),
                        ids(Some(&o.failed_recving))
                    ),
                    (None, None) => format!("{action} → no output"),
                }
            }
            CompletionAction::Aggregate => {
                let outputs: Vec<_> = state.ranks.iter().map(RankState::output).collect();
                match state.aggregator.clone().aggregate(&outputs, Rank(0)) {
                    Ok(Some(o)) => format!(
                        "{action} → emitted sending {} recving {} failed {}",
                        ids(o.finished_sending.as_ref()),
                        ids(o.finished_recving.as_ref()),
                        ids(Some(&o.failed_recving))
                    ),
                    Ok(None) => format!("{action} → no output"),
                    Err(e) => format!("{action} → rejected: {e}"),
                }
            }
            _ => action.to_string(),
        }
    }

    /// `env` (transfers finishing, faults), the ranks, the aggregator and the scheduler (which
    /// receives the aggregated output).
    fn participants(&self) -> Vec<String> {
        let mut p = vec!["env".to_owned()];
        p.extend((0..self.config.ranks).map(|r| Rank(r).to_string()));
        p.extend(["aggregator".to_owned(), "scheduler".to_owned()]);
        p
    }

    /// A transfer finishing or an armed fault: `env` → the rank. A step: the rank → the
    /// aggregator with its output (a rejected protocol call: a note over the rank). An aggregate:
    /// the aggregator → the scheduler with what it emitted (a strict rejection: a note). A note
    /// also names every property the action breaks.
    fn arrow(&self, state: &CompletionState, action: &CompletionAction) -> Arrow {
        let w = self.config.ranks as usize;
        let (env, aggregator, scheduler) = (0, w + 1, w + 2);
        let rank_at = |rank: Rank| 1 + rank.index();
        let Some(next) = self.next_state(state, *action) else {
            return Arrow::new(env, env, format!("{action} (not enabled)"));
        };
        let mut step = match *action {
            CompletionAction::Complete {
                rank,
                request,
                dir,
                failed,
            } => Arrow::new(
                env,
                rank_at(rank),
                format!(
                    "{} of {request} completes{}",
                    dir_name(dir),
                    if failed { " (FAILED)" } else { "" }
                ),
            ),
            CompletionAction::RunStep { rank, forward } => {
                let label = if forward {
                    "step (forward)"
                } else {
                    "step (no forward)"
                };
                let r = &next.ranks[rank.index()];
                match (r.violation(), r.output()) {
                    (Some(v), _) => {
                        Arrow::new(rank_at(rank), rank_at(rank), label).with_note(v.to_string())
                    }
                    (None, Some(o)) => Arrow::new(
                        rank_at(rank),
                        aggregator,
                        format!(
                            "{label}: sending {} recving {} failed {}",
                            ids(o.finished_sending.as_ref()),
                            ids(o.finished_recving.as_ref()),
                            ids(Some(&o.failed_recving))
                        ),
                    ),
                    (None, None) => {
                        Arrow::new(rank_at(rank), rank_at(rank), format!("{label}: no output"))
                    }
                }
            }
            CompletionAction::Rereport { rank, request, dir } => Arrow::new(
                env,
                rank_at(rank),
                format!("will report the {} of {request} again", dir_name(dir)),
            )
            .with_note("FAULT: double report armed"),
            CompletionAction::Aggregate => {
                let outputs: Vec<_> = state.ranks.iter().map(RankState::output).collect();
                match state.aggregator.clone().aggregate(&outputs, Rank(0)) {
                    Ok(Some(o)) => Arrow::new(
                        aggregator,
                        scheduler,
                        format!(
                            "emitted sending {} recving {} failed {}",
                            ids(o.finished_sending.as_ref()),
                            ids(o.finished_recving.as_ref()),
                            ids(Some(&o.failed_recving))
                        ),
                    ),
                    Ok(None) => Arrow::new(aggregator, aggregator, "aggregate: no output"),
                    Err(e) => Arrow::new(aggregator, aggregator, "aggregate: rejected")
                        .with_note(e.to_string()),
                }
            }
        };
        let broken = newly_broken(&state.ghost, &next.ghost);
        if !broken.is_empty() {
            let broken = format!("VIOLATION: {}", broken.join(", "));
            step.note = Some(match step.note.take() {
                Some(n) => format!("{n} — {broken}"),
                None => broken,
            });
        }
        step
    }
}

/// The violations recorded in `after` but not in `before`, in words.
fn newly_broken(before: &Ghost, after: &Ghost) -> Vec<&'static str> {
    let twice = |g: &Ghost| g.emitted.iter().flatten().any(|&n| n > 1);
    [
        (
            !before.emitted_early && after.emitted_early,
            "emitted before every rank reported",
        ),
        (!twice(before) && twice(after), "emitted twice"),
        (
            !before.failed_not_subset && after.failed_not_subset,
            "failed_recving not within finished_recving",
        ),
        (
            !before.failure_mismatch && after.failure_mismatch,
            "failed load not emitted as failed",
        ),
        (
            !before.protocol_violated && after.protocol_violated,
            "step protocol violated",
        ),
        (
            !before.invariant_broken && after.invariant_broken,
            "core invariant broken",
        ),
        (
            !before.unexpected_error && after.unexpected_error,
            "unexpected aggregator error",
        ),
    ]
    .into_iter()
    .filter_map(|(hit, what)| hit.then_some(what))
    .collect()
}

// The property conditions: each evaluates a pure predicate on the state and reports only the
// first discovery (see `CompletionModel` on why).

fn exactly_once(m: &CompletionModel, s: &CompletionState) -> bool {
    let holds = !s.ghost.emitted_early && s.ghost.emitted.iter().flatten().all(|&n| n <= 1);
    !m.first(SLOT_EXACTLY_ONCE, !holds)
}

fn failed_subset(m: &CompletionModel, s: &CompletionState) -> bool {
    !m.first(SLOT_FAILED_SUBSET, s.ghost.failed_not_subset)
}

fn failures_travel(m: &CompletionModel, s: &CompletionState) -> bool {
    !m.first(SLOT_FAILURES_TRAVEL, s.ghost.failure_mismatch)
}

fn protocol_kept(m: &CompletionModel, s: &CompletionState) -> bool {
    let holds = !s.ghost.protocol_violated && s.ranks.iter().all(|r| r.violation.is_none());
    !m.first(SLOT_PROTOCOL, !holds)
}

fn core_invariants(m: &CompletionModel, s: &CompletionState) -> bool {
    let holds = !s.ghost.invariant_broken
        && !s.ghost.unexpected_error
        && s.aggregator.check_invariants().is_ok();
    !m.first(SLOT_CORE_INVARIANTS, !holds)
}

fn all_emitted(m: &CompletionModel, s: &CompletionState) -> bool {
    m.first(SLOT_ALL_EMITTED, every_transfer_emitted(s))
}

fn duplicate_rejected(m: &CompletionModel, s: &CompletionState) -> bool {
    m.first(
        SLOT_DUPLICATE_REJECTED,
        s.ghost.duplicate_rejected && every_transfer_emitted(s),
    )
}

fn every_transfer_emitted(s: &CompletionState) -> bool {
    s.ghost.emitted.iter().flatten().all(|&n| n >= 1)
}

/// Index of a direction in the `[send, recv]` per-request arrays.
fn slot(dir: Direction) -> usize {
    match dir {
        Direction::Send => 0,
        Direction::Recv => 1,
    }
}

fn dir_name(dir: Direction) -> &'static str {
    match dir {
        Direction::Send => "send",
        Direction::Recv => "recv",
    }
}

fn ids(set: Option<&SortedSet<RequestId>>) -> String {
    let items: Vec<String> = set.into_iter().flatten().map(|id| id.to_string()).collect();
    format!("{{{}}}", items.join(","))
}
