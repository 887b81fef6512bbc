//! One rank's step: the worker side of an engine step, as a resumable sans-IO machine.
//!
//! A [`RankDriver`] owns one rank's worker connector (behind [`GuardedWorker`], so the hook order
//! is checked, I-1…I-6) and the rank's block tables, and turns one [`ScheduledStep`] into the
//! rank's [`WorkerOutput`]. It never performs IO: it tells its caller what to do next, and the
//! caller feeds back what happened.
//!
//! # When to call what
//!
//! 1. [`RankDriver::begin`] with the step (every rank gets the same [`ScheduledStep`]; the driver
//!    keeps only what the step's hooks need), in step order, once the previous step returned
//!    [`RankAction::Done`].
//! 2. [`RankDriver::poll`] until it returns [`RankAction::Done`]:
//!    * [`RankAction::Start`]: start this transfer (the DMA engine, a remote peer).
//!    * [`RankAction::Forward`]: perform the forward pass's KV accesses for one layer — read the
//!      computed prefix, write the new tokens' blocks — before polling again.
//!    * [`RankAction::Wait`]: the step is blocked until these jobs complete; poll again after
//!      [`RankDriver::transfer_done`] (it keeps answering `Wait` with the jobs still due).
//!    * [`RankAction::Collect`]: the step's results are collected next; feed the transfers
//!      completed by now, then poll again.
//!    * [`RankAction::Done`]: the rank's output of the step, for the engine's aggregator.
//! 3. [`RankDriver::transfer_done`] whenever a transfer completes, at any time, also between
//!    steps or while no wait is pending.
//!
//! Every call returns the sticky [`RankError`] once the rank stopped: a hook out of order (a
//! [`ProtocolViolation`]) or the worker connector's own [`WorkerError`] (asked after every hook,
//! so a caller cannot forget to look).
//!
//! # The step
//!
//! In vLLM's model-runner order (`gpu_model_runner.py`, SEMANTICS.md §2.4):
//!
//! ```text
//! _update_states (the block tables)      handle_preemptions   bind
//! [start_load_kv]                                             (sync loads only: before the forward)
//! per layer: wait_for_layer_load · the forward's reads and writes · save_kv_layer
//!                                                             (only when tokens are scheduled)
//! [start_load_kv]                                             (async loads: after the forward launch)
//! wait_for_save   (collect)   get_finished   get_block_ids_with_load_errors   build_connector_worker_meta   clear
//! ```
//!
//! A hook's [`TransferCommand`]s come out one by one: `Start`s as [`RankAction::Start`], a `Wait`
//! as [`RankAction::Wait`] for the jobs of it that are in flight on this rank (a job already
//! completed, or never started here, is not waited for).

use alloc::collections::{BTreeMap, VecDeque};
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ops::Range;

use crate::ids::{BlockId, JobId, RequestId, StepId};
use crate::messages::ScheduledStep;
use crate::messages::SchedulerOutput;
use crate::messages::WorkerOutput;
use crate::scheduler::GroupKind;
use crate::sorted_set::SortedSet;
use crate::worker::GuardedWorker;
use crate::worker::ProtocolViolation;
use crate::worker::StepShape;
use crate::worker::Transfer;
use crate::worker::TransferCommand;
use crate::worker::TransferDone;
use crate::worker::TransferResults;
use crate::worker::WorkerCall;
use crate::worker::WorkerConnector;
use crate::worker::WorkerError;
use crate::{InvariantViolation, NULL_BLOCK, ensure_invariant};

/// What a rank's driver needs to know of the engine: the model's layers and the KV cache groups
/// (as the scheduler has them). Nothing in it names the rank: ranks in the same state are
/// interchangeable (the model checker's symmetry reduction relies on it), and the caller, who
/// knows which rank it drives, adds that to errors it reports.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankConfig {
    /// Layers of the model (≥ 1): each runs `wait_for_layer_load` and `save_kv_layer`.
    pub layers: u32,
    /// Tokens per GPU block.
    pub block_size: u32,
    /// The KV cache groups, in the scheduler's order.
    pub groups: Vec<GroupKind>,
}

/// A stopped rank. Sticky: every later call returns it.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RankError {
    /// A hook out of order (the runner's bug, or a fault injected to test the checker).
    #[error(transparent)]
    Protocol(ProtocolViolation),
    /// The worker connector stopped.
    #[error("worker connector failed: {0}")]
    Worker(WorkerError),
    /// `begin` with a step other than the next one, or while a step is running.
    #[error("step {got:?} begun, expected {expected:?}")]
    StepOutOfOrder {
        /// The step the rank can begin now (`None`: a step is running).
        expected: Option<StepId>,
        /// The step given.
        got: StepId,
    },
}

impl RankError {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Protocol(_) => "protocol_violation",
            Self::Worker(error) => error.kind(),
            Self::StepOutOfOrder { .. } => "step_out_of_order",
        }
    }
}

/// One block a forward pass reads or writes: tokens `tokens` (positions in the request) of the
/// request's block `index` in group `group`, which is GPU block `block`.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BlockAccess {
    /// The request.
    pub request: RequestId,
    /// The KV cache group.
    pub group: usize,
    /// The block's index in the request's table.
    pub index: u32,
    /// The GPU block.
    pub block: BlockId,
    /// Token positions of the request held by the block that the pass reads or writes.
    pub tokens: Range<u32>,
}

/// The computed prefix one request's attention reads in one KV cache group: tokens `tokens` of
/// `request`, in the blocks of its table (see [`RankDriver::read_blocks`]).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReadSpan {
    /// The request.
    pub request: RequestId,
    /// The KV cache group.
    pub group: usize,
    /// Token positions read.
    pub tokens: Range<u32>,
}

/// The KV accesses of one layer of a forward pass. The writes land before the reads, as in a
/// layer of vLLM's forward (the new tokens' KV is cached, then attention reads it with the
/// prefix): a request may read a block another request of the same step writes, its prefix-cache
/// hit on a block cached when the step was scheduled.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ForwardPass {
    /// The layer.
    pub layer: u32,
    /// The computed prefix each scheduled request's attention reads, one span per request and
    /// group: every block of it in a full-attention group, the blocks inside the window in a
    /// sliding-window group. [`RankDriver::read_blocks`] lists a span's blocks; a runtime checks
    /// what they hold here (this is where a wrong load shows). A span, not a list of blocks:
    /// a decode step reads the whole context, and a runtime that remembers what each request
    /// already checked need not walk it again.
    pub reads: Vec<ReadSpan>,
    /// The blocks the new tokens are written to, every group (null blocks skipped).
    pub writes: Vec<BlockAccess>,
}

/// What the caller does next for this rank. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum RankAction<WM> {
    /// Start this transfer.
    Start(Transfer),
    /// Perform this layer's KV reads and writes, then poll again.
    Forward(ForwardPass),
    /// Blocked until these jobs complete ([`RankDriver::transfer_done`]).
    Wait {
        /// The jobs still due.
        jobs: SortedSet<JobId>,
        /// The hook that asked for the wait: `HandlePreemptions` (vLLM's flush of a preempted
        /// request's stores before its blocks are reused), `StartLoadKv` (sync loads before the
        /// forward), `WaitForLayerLoad`, `SaveKvLayer` or `WaitForSave`.
        during: WorkerCall,
    },
    /// The step's results are collected next (`get_finished`): feed every transfer completed
    /// by now, then poll again. Nothing is waited for (vLLM's worker polls its transfers'
    /// events here without blocking).
    Collect,
    /// The rank's output of the step; the rank is ready for the next step.
    Done(WorkerOutput<WM>),
    /// No step is running.
    Idle,
}

/// Where a rank is inside its step: the next hook to run. Private: a caller learns what it must
/// do from [`RankAction`], never from where the driver stands.
#[derive(Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd)]
enum StepPoint {
    /// `begin_step` and `handle_preemptions`.
    HandlePreemptions,
    /// `bind_connector_metadata`.
    Bind,
    /// `start_load_kv` before the forward (sync loads).
    SyncLoad,
    /// `wait_for_layer_load(layer)`.
    LayerLoad(u32),
    /// The forward pass's accesses of `layer` ([`RankAction::Forward`]).
    Forward(u32),
    /// `save_kv_layer(layer)`.
    LayerSave(u32),
    /// `start_load_kv` after the forward (async loads).
    AsyncLoad,
    /// `wait_for_save`.
    WaitForSave,
    /// Before the results are collected ([`RankAction::Collect`]).
    Collect,
    /// `get_finished` … `clear`: the step's output.
    Finish,
}

impl StepPoint {
    /// The worker hook this point calls (`Forward` and `Collect` call none; they are reported
    /// as the hook around them).
    fn hook(self) -> WorkerCall {
        match self {
            StepPoint::HandlePreemptions => WorkerCall::HandlePreemptions,
            StepPoint::Bind => WorkerCall::Bind,
            StepPoint::SyncLoad | StepPoint::AsyncLoad => WorkerCall::StartLoadKv,
            StepPoint::LayerLoad(_) | StepPoint::Forward(_) => WorkerCall::WaitForLayerLoad,
            StepPoint::LayerSave(_) => WorkerCall::SaveKvLayer,
            StepPoint::WaitForSave => WorkerCall::WaitForSave,
            StepPoint::Collect | StepPoint::Finish => WorkerCall::GetFinished,
        }
    }
}

/// A rank runner's bug, re-introduced on purpose so that the model checker can show it finds it
/// ([`RankDriver::inject_fault`]). Only with the `fault-injection` feature.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum RankFault {
    /// vLLM PR #42676: `bind_connector_metadata` before `handle_preemptions`.
    BindFirst,
    /// Mooncake PR #52470: the runner has no `handle_preemptions` wait: its transfers start, but
    /// nothing is waited for before the step's writes.
    SkipPreemptionWaits,
}

/// The step in progress: only what its remaining hooks need (a model checker clones this with
/// every state).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Running<M> {
    step: StepId,
    /// The metadata, until `bind` took it.
    meta: Option<M>,
    /// `finished_req_ids`, for `get_finished`.
    finished: SortedSet<RequestId>,
    /// Per scheduled request, in scheduling order: computed tokens before the step and tokens
    /// scheduled (the forward pass's reads and writes).
    scheduled: Vec<(RequestId, u32, u32)>,
    shape: StepShape,
    next: StepPoint,
    /// Commands of the last hook not handed out yet.
    queued: VecDeque<TransferCommand>,
    /// The hook `queued` came from (what a wait is [`RankAction::Wait::during`]).
    queued_by: WorkerCall,
    /// The jobs the step is blocked on.
    waiting: SortedSet<JobId>,
}

/// One rank's step driver. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct RankDriver<W: WorkerConnector> {
    /// Shared: the model checker clones drivers with every state.
    config: Arc<RankConfig>,
    worker: GuardedWorker<W>,
    /// The model runner's input batch: per request, per group, its block table.
    tables: BTreeMap<RequestId, Vec<Vec<BlockId>>>,
    /// Transfers started on this rank whose completion was not fed back.
    in_flight: SortedSet<JobId>,
    running: Option<Running<W::StepMeta>>,
    /// Steps this rank finished.
    steps_done: u64,
    error: Option<RankError>,
    #[cfg(feature = "fault-injection")]
    fault: Option<RankFault>,
}

impl<W: WorkerConnector> RankDriver<W>
where
    W::StepMeta: Clone,
{
    /// A rank before its first step.
    pub fn new(config: RankConfig, worker: W) -> Self {
        Self {
            config: Arc::new(config),
            worker: GuardedWorker::new(worker),
            tables: BTreeMap::new(),
            in_flight: SortedSet::default(),
            running: None,
            steps_done: 0,
            error: None,
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }

    /// Re-introduce a historical runner bug (model checking only).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, fault: RankFault) {
        self.fault = Some(fault);
    }

    /// The configuration.
    pub fn config(&self) -> &RankConfig {
        &self.config
    }

    /// The guarded worker connector.
    pub fn worker(&self) -> &GuardedWorker<W> {
        &self.worker
    }

    /// The worker connector, mutable: for a test double's script, never for a step hook.
    pub fn worker_mut(&mut self) -> &mut W {
        self.worker.inner_mut()
    }

    /// The rank's block tables (vLLM's input batch), as of the steps it has begun.
    pub fn tables(&self) -> &BTreeMap<RequestId, Vec<Vec<BlockId>>> {
        &self.tables
    }

    /// The blocks `span` reads whose index in the request's table is `from` or more, in table
    /// order (null blocks skipped), each with the tokens read in it: what a runtime checks
    /// before a forward reads them. `from` 0 lists the whole span.
    pub fn read_blocks<'a>(
        &'a self,
        span: &'a ReadSpan,
        from: u32,
    ) -> impl Iterator<Item = BlockAccess> + 'a {
        let bs = self.config.block_size.max(1);
        let blocks = self
            .tables
            .get(&span.request)
            .and_then(|t| t.get(span.group))
            .map_or(&[][..], Vec::as_slice);
        let (first, end) = (span.tokens.start / bs, span.tokens.end.div_ceil(bs));
        (first.max(from)..end).filter_map(move |i| {
            let block = *blocks.get(i as usize)?;
            (block != NULL_BLOCK).then(|| BlockAccess {
                request: span.request,
                group: span.group,
                index: i,
                block,
                tokens: (i * bs).max(span.tokens.start)..((i + 1) * bs).min(span.tokens.end),
            })
        })
    }

    /// Transfers started whose completion has not been fed back.
    pub fn in_flight(&self) -> &SortedSet<JobId> {
        &self.in_flight
    }

    /// Steps finished.
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// The step running, if any.
    pub fn current_step(&self) -> Option<StepId> {
        self.running.as_ref().map(|r| r.step)
    }

    /// The hook the running step is blocked in, while it waits for jobs (what the last
    /// [`RankAction::Wait`] said).
    pub fn waiting_during(&self) -> Option<WorkerCall> {
        self.running
            .as_ref()
            .filter(|r| !r.waiting.is_empty())
            .map(|r| r.queued_by)
    }

    /// The jobs the running step is blocked on (empty when it is not blocked).
    pub fn waiting(&self) -> impl Iterator<Item = JobId> + '_ {
        self.running.iter().flat_map(|r| r.waiting.iter().copied())
    }

    /// The error the rank stopped with.
    pub fn error(&self) -> Option<&RankError> {
        self.error.as_ref()
    }

    /// Begin `step` (see the module docs). Updates the block tables as vLLM's `_update_states`
    /// does: finished and preempted requests leave, new and resumed ones get their whole table,
    /// running ones append their new blocks.
    pub fn begin(&mut self, step: &ScheduledStep<W::StepMeta>) -> Result<(), RankError> {
        let out = self.begin_unchecked(step);
        crate::debug_assert_invariants!(self, stopped: self.error().is_some());
        out
    }

    fn begin_unchecked(&mut self, step: &ScheduledStep<W::StepMeta>) -> Result<(), RankError> {
        self.check_stopped()?;
        let id = step.output.step;
        if self.running.is_some() || id.0 != self.steps_done {
            return Err(RankError::StepOutOfOrder {
                expected: self.running.is_none().then_some(StepId(self.steps_done)),
                got: id,
            });
        }
        let out = &step.output;
        update_tables(&mut self.tables, out);
        let shape = StepShape {
            sync_loads: out.has_sync_kv_loads,
            forward: out.total_num_scheduled_tokens > 0,
            defer_finalize: false,
        };
        let computed: BTreeMap<RequestId, u32> = out
            .scheduled_requests()
            .map(|r| (r.id, r.num_computed_tokens))
            .collect();
        let scheduled = out
            .num_scheduled_tokens
            .iter()
            .map(|&(id, n)| (id, computed.get(&id).copied().unwrap_or(0), n))
            .collect();
        self.running = Some(Running {
            step: id,
            meta: Some(step.meta.clone()),
            finished: out.finished_req_ids.clone(),
            scheduled,
            shape,
            next: StepPoint::HandlePreemptions,
            queued: VecDeque::new(),
            queued_by: WorkerCall::HandlePreemptions,
            waiting: SortedSet::default(),
        });
        Ok(())
    }

    /// A transfer completed: passed to the worker connector (at any time).
    pub fn transfer_done(&mut self, done: TransferDone) -> Result<(), RankError> {
        let out = self.transfer_done_unchecked(done);
        crate::debug_assert_invariants!(self, stopped: self.error().is_some());
        out
    }

    fn transfer_done_unchecked(&mut self, done: TransferDone) -> Result<(), RankError> {
        self.check_stopped()?;
        self.in_flight.remove(&done.job);
        if let Some(r) = &mut self.running {
            r.waiting.remove(&done.job);
        }
        self.worker.handle_transfer_done(done);
        self.check_worker()
    }

    /// The next thing to do (see the module docs).
    pub fn poll(&mut self) -> Result<RankAction<W::WorkerMeta>, RankError> {
        let out = self.poll_unchecked();
        crate::debug_assert_invariants!(self, stopped: self.error().is_some());
        out
    }

    fn poll_unchecked(&mut self) -> Result<RankAction<W::WorkerMeta>, RankError> {
        self.check_stopped()?;
        loop {
            let Some(r) = &mut self.running else {
                return Ok(RankAction::Idle);
            };
            if !r.waiting.is_empty() {
                return Ok(RankAction::Wait {
                    jobs: r.waiting.clone(),
                    during: r.queued_by,
                });
            }
            if let Some(cmd) = r.queued.pop_front() {
                match cmd {
                    TransferCommand::Start(t) => {
                        self.in_flight.insert(t.job);
                        return Ok(RankAction::Start(t));
                    }
                    TransferCommand::Wait(jobs) => {
                        let due: Vec<JobId> = jobs
                            .iter()
                            .copied()
                            .filter(|j| self.in_flight.contains(j))
                            .collect();
                        for j in due {
                            r.waiting.insert(j);
                        }
                        continue;
                    }
                }
            }
            let point = r.next;
            if let Some(action) = self.run(point)? {
                return Ok(action);
            }
        }
    }

    /// Runs the hook at `point` and moves past it; returns what the caller must see now.
    fn run(&mut self, point: StepPoint) -> Result<Option<RankAction<W::WorkerMeta>>, RankError> {
        let running = self.running.as_ref().expect("a step is running");
        let shape = running.shape;
        let layers = self.config.layers.max(1);
        let (cmds, next, action) = match point {
            StepPoint::HandlePreemptions => {
                let meta = running.meta.clone().expect("taken at bind");
                let cmds = self.preemptions(shape, &meta)?;
                (cmds, StepPoint::Bind, None)
            }
            StepPoint::Bind => {
                let meta = self
                    .running
                    .as_mut()
                    .and_then(|r| r.meta.take())
                    .expect("taken at bind");
                if !self.binds_first() {
                    self.protocol(|w| w.bind(&meta))?;
                }
                let next = match (shape.sync_loads, shape.forward) {
                    (true, _) => StepPoint::SyncLoad,
                    (false, true) => StepPoint::LayerLoad(0),
                    (false, false) => StepPoint::AsyncLoad,
                };
                (Vec::new(), next, None)
            }
            StepPoint::SyncLoad => {
                let cmds = self.protocol(GuardedWorker::start_load_kv)?;
                let next = if shape.forward {
                    StepPoint::LayerLoad(0)
                } else {
                    StepPoint::WaitForSave
                };
                (cmds, next, None)
            }
            StepPoint::LayerLoad(l) => {
                let cmds = self.protocol(|w| w.wait_for_layer_load(l))?;
                (cmds, StepPoint::Forward(l), None)
            }
            StepPoint::Forward(l) => {
                // Handed out before `save_kv_layer`: the caller performs the accesses before it
                // polls again.
                let pass = self.forward_pass(l);
                (
                    Vec::new(),
                    StepPoint::LayerSave(l),
                    Some(RankAction::Forward(pass)),
                )
            }
            StepPoint::LayerSave(l) => {
                let cmds = self.protocol(|w| w.save_kv_layer(l))?;
                let next = if l + 1 < layers {
                    StepPoint::LayerLoad(l + 1)
                } else if shape.sync_loads {
                    StepPoint::WaitForSave
                } else {
                    StepPoint::AsyncLoad
                };
                (cmds, next, None)
            }
            StepPoint::AsyncLoad => {
                let cmds = self.protocol(GuardedWorker::start_load_kv)?;
                (cmds, StepPoint::WaitForSave, None)
            }
            StepPoint::WaitForSave => {
                let cmds = self.protocol(GuardedWorker::wait_for_save)?;
                (cmds, StepPoint::Collect, None)
            }
            StepPoint::Collect => (Vec::new(), StepPoint::Finish, Some(RankAction::Collect)),
            StepPoint::Finish => {
                let out = self.finish()?;
                self.running = None;
                self.steps_done += 1;
                return Ok(Some(RankAction::Done(out)));
            }
        };
        let r = self.running.as_mut().expect("a step is running");
        if !cmds.is_empty() {
            r.queued_by = point.hook();
        }
        r.queued.extend(cmds);
        r.next = next;
        Ok(action)
    }

    /// `begin_step` and `handle_preemptions` (with the runner faults, when injected).
    fn preemptions(
        &mut self,
        shape: StepShape,
        meta: &W::StepMeta,
    ) -> Result<Vec<TransferCommand>, RankError> {
        self.protocol(|w| w.begin_step(shape))?;
        if self.binds_first() {
            self.protocol(|w| w.bind(meta))?;
        }
        let cmds = self.protocol(|w| w.handle_preemptions(meta))?;
        #[cfg(feature = "fault-injection")]
        if self.fault == Some(RankFault::SkipPreemptionWaits) {
            return Ok(cmds
                .into_iter()
                .filter(|c| matches!(c, TransferCommand::Start(_)))
                .collect());
        }
        Ok(cmds)
    }

    fn binds_first(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            self.fault == Some(RankFault::BindFirst)
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }

    /// `get_finished` … `clear`.
    fn finish(&mut self) -> Result<WorkerOutput<W::WorkerMeta>, RankError> {
        let finished =
            core::mem::take(&mut self.running.as_mut().expect("a step is running").finished);
        let res: TransferResults = self.protocol(|w| w.get_transfer_results(&finished))?;
        let errors = self.protocol(GuardedWorker::get_block_ids_with_load_errors)?;
        let meta = self.protocol(GuardedWorker::build_connector_worker_meta)?;
        self.protocol(GuardedWorker::clear)?;
        Ok(res.into_output(errors, meta))
    }

    /// The forward pass's accesses for `layer`.
    fn forward_pass(&self, layer: u32) -> ForwardPass {
        let running = self.running.as_ref().expect("a step is running");
        let mut pass = ForwardPass {
            layer,
            ..ForwardPass::default()
        };
        let bs = self.config.block_size.max(1);
        for &(id, c, n) in &running.scheduled {
            let Some(table) = self.tables.get(&id) else {
                continue;
            };
            for (g, blocks) in table.iter().enumerate() {
                let read_from = match self.config.groups.get(g) {
                    Some(GroupKind::SlidingWindow { window }) => (c + 1).saturating_sub(*window),
                    _ => 0,
                };
                let access = |list: &mut Vec<BlockAccess>, from: u32, to: u32| {
                    for i in from / bs..to.div_ceil(bs) {
                        let Some(&block) = blocks.get(i as usize) else {
                            continue;
                        };
                        if block == NULL_BLOCK {
                            continue;
                        }
                        let tokens = (i * bs).max(from)..((i + 1) * bs).min(to);
                        list.push(BlockAccess {
                            request: id,
                            group: g,
                            index: i,
                            block,
                            tokens,
                        });
                    }
                };
                if read_from < c {
                    pass.reads.push(ReadSpan {
                        request: id,
                        group: g,
                        tokens: read_from..c,
                    });
                }
                access(&mut pass.writes, c, c + n);
            }
        }
        pass
    }

    /// A guarded hook: a protocol violation or a worker error stops the rank.
    fn protocol<T>(
        &mut self,
        hook: impl FnOnce(&mut GuardedWorker<W>) -> Result<T, ProtocolViolation>,
    ) -> Result<T, RankError> {
        match hook(&mut self.worker) {
            Ok(v) => {
                self.check_worker()?;
                Ok(v)
            }
            Err(violation) => Err(self.stop(RankError::Protocol(violation))),
        }
    }

    fn check_worker(&mut self) -> Result<(), RankError> {
        match self.worker.inner().error() {
            None => Ok(()),
            Some(error) => Err(self.stop(RankError::Worker(error))),
        }
    }

    fn check_stopped(&self) -> Result<(), RankError> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn stop(&mut self, e: RankError) -> RankError {
        self.error = Some(e.clone());
        e
    }

    /// The driver's own invariants: the step protocol's (I-1, I-5), a running step's point
    /// agrees with its shape, and a wait is only for jobs in flight here.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.worker.protocol().check_invariants()?;
        self.worker.inner().check_invariants()?;
        if let Some(r) = &self.running {
            ensure_invariant!(
                r.step.0 == self.steps_done,
                "I-5",
                "a rank runs step {:?} after {} steps",
                r.step,
                self.steps_done
            );
            ensure_invariant!(
                r.waiting.iter().all(|j| self.in_flight.contains(j)),
                "I-4",
                "a rank waits for jobs not in flight"
            );
            let layered = matches!(
                r.next,
                StepPoint::LayerLoad(_) | StepPoint::Forward(_) | StepPoint::LayerSave(_)
            );
            ensure_invariant!(
                !layered || r.shape.forward,
                "I-6",
                "a rank is in a layer of a step without a forward"
            );
        }
        Ok(())
    }
}

/// vLLM's `_update_states`: drop finished and preempted requests, add new ones, append (or, for
/// resumed ones, replace) block tables.
fn update_tables(tables: &mut BTreeMap<RequestId, Vec<Vec<BlockId>>>, out: &SchedulerOutput) {
    for id in tables_reset(out) {
        tables.remove(&id);
    }
    for r in out.scheduled_requests() {
        if r.full_table {
            tables.insert(r.id, r.block_ids.to_vec());
        } else if let Some(t) = tables.get_mut(&r.id) {
            for (list, new) in t.iter_mut().zip(r.block_ids) {
                list.extend_from_slice(new);
            }
        }
    }
}

/// The requests whose block tables `out` ends or replaces on a rank (finished, preempted, or
/// given their whole table: new and resumed ones); every other table only grows. A runtime that
/// remembers what a request's blocks held forgets it for these, before the step begins.
pub fn tables_reset(out: &SchedulerOutput) -> impl Iterator<Item = RequestId> + '_ {
    let replaced = out
        .scheduled_requests()
        .filter(|r| r.full_table)
        .map(|r| r.id);
    out.finished_req_ids
        .iter()
        .chain(out.preempted_req_ids.iter())
        .copied()
        .chain(replaced)
}
