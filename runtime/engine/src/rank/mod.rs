//! One rank: a task that owns a [`RankDriver`] over the offloading worker, the rank's KV arena
//! and its transfer engine, and runs the steps the engine sends it.
//!
//! # What it does with each [`RankAction`]
//!
//! * `Start(transfer)` — plans the copies ([`copy_plan`]) and hands them to the transfer engine.
//!   A store's host slots take the content record of its GPU blocks now (the blocks cannot
//!   change until the store completes: I-4).
//! * `Forward(pass)` — writes every computed token's word into its slot and checks the bytes it
//!   wrote, then checks every block the layer's attention reads that its request has not
//!   checked yet (prefix-cache hits and loaded blocks included) against the request's own
//!   tokens, in the rank's shadow ([`crate::content`]). What a request has checked it trusts
//!   while the block cannot change ([`Watch`]): a decode step costs its new tokens, not its
//!   context.
//! * `Wait` — returns to the task loop, which feeds completions until the driver moves on.
//! * `Collect` — feeds the completions the step is due to hear of ([`Completions`]).
//! * `Done(output)` — sends the output to the engine.
//!
//! A completed load is checked byte for byte against what its host slots must hold before the
//! driver hears of it. Any mismatch, and any error of the driver or of the worker connector
//! (polled after every hook by the driver), stops the rank with a typed error the engine
//! reports.

mod delta;
mod setup;
mod watch;

pub use self::delta::RankDelta;
pub use self::setup::{Completions, RankPd, RankSetup, RankShape};
pub use self::watch::{Hazard, Watch};

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay_core::{
    BlockAccess, BlockId, JobId, RankAction, RankDriver, RequestId, ScheduledStep, StepId, Token,
    Transfer, TransferDirection, TransferDone, WorkerCall, WorkerOutput, copy_plan, tables_reset,
};
use tokio::sync::mpsc;

use crate::RunError;
use crate::connector::{EngineMeta, EngineWorker};
use crate::content::{POISON, TokenBook, UNWRITTEN, salt, salted};
use crate::report::perfetto::{Recorder, now_us};
use crate::report::samples::Samples;
use crate::transfer::{CopyDone, CopyJob, KvArena, Slot, TransferEngine, TransferError};
use kvrelay_core::pd::{is_remote_slot, remote_slot_parts};

/// What the engine sends a rank.
#[derive(Debug)]
pub struct StepMsg {
    pub step: Arc<ScheduledStep<EngineMeta>>,
    /// Tokens appended since the previous step: new requests' prompts, tokens sampled since.
    pub tokens: Arc<Vec<(RequestId, Vec<Token>)>>,
    /// Requests the engine released: their tokens are forgotten.
    pub forget: Arc<Vec<RequestId>>,
    /// CPU chunks the shared tier filled since the previous step (promotions): what each now
    /// holds, for the checks of later loads.
    pub promoted: Arc<Vec<PromotedChunk>>,
}

/// A CPU chunk the shared tier filled, and the prefix hash of each of its token slots (what
/// the chunk must hold, derived by the engine from the tokens of the request that promoted it).
#[derive(Clone, Debug, Eq, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PromotedChunk {
    pub chunk: u32,
    pub prefixes: Vec<u64>,
}

/// What a rank sends the engine.
#[derive(Debug)]
pub struct RankReport {
    pub rank: u32,
    pub step: StepId,
    pub output: Result<WorkerOutput, RunError>,
    /// The rank's counters since its previous report (zero with an error).
    pub delta: RankDelta,
}

/// What a rank did, for the report.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankStats {
    pub blocks_stored: u64,
    pub blocks_loaded: u64,
    pub bytes_stored: u64,
    pub bytes_loaded: u64,
    pub store_time: Duration,
    pub load_time: Duration,
    /// Copies performed (after coalescing).
    pub copies: u64,
    /// Blocks of completed loads checked against their host slots.
    pub loaded_blocks_verified: u64,
    /// Token slots (per layer) whose bytes were checked right after a forward wrote them.
    pub written_slots_verified: u64,
    /// Blocks a request read for the first time, checked against its tokens (the blocks it
    /// had checked before are trusted: see `watch`).
    pub read_blocks_checked: u64,
    /// Stores waited for in `handle_preemptions` before their blocks were rewritten.
    pub flushed_stores: u64,
    /// Transfers that failed part-way (injected by the simulation), stores and loads.
    pub failed_transfers: u64,
    /// Of the blocks and bytes loaded, those read from a prefill engine (P/D, [`crate::pd`]).
    pub remote_blocks_loaded: u64,
    pub remote_bytes_loaded: u64,
    /// Tokens loaded, per request (rank 0 reports them). Ordered, so that its encoding does
    /// not depend on hash order (a fuzz finding: a decoded report re-encoded differently).
    pub loaded_tokens: BTreeMap<RequestId, u32>,
    /// Per step, the time in the rank driver and the worker connector's hooks (no forward, no
    /// copies), in µs.
    pub hook_us: Samples<f32>,
    /// Steps after which the driver's invariants were checked.
    pub invariant_checks: u64,
    /// Steps and transfers, for the timeline (`--timeline`).
    pub timeline: Recorder,
}

/// A checked slot, as an error names it.
#[derive(Clone, Copy, Debug)]
struct SlotName {
    request: RequestId,
    block: BlockId,
    layer: u32,
    slot: u32,
}

pub struct RankTask {
    rank: u32,
    driver: RankDriver<EngineWorker>,
    shape: RankShape,
    slot_bytes: usize,
    arena: Box<dyn KvArena>,
    /// Per GPU block and token slot, the prefix hash it holds (`UNWRITTEN`: none).
    gpu_shadow: Vec<u64>,
    /// Per host slot and token slot, the prefix hash it holds.
    host_shadow: Vec<u64>,
    loads: HashMap<JobId, Transfer>,
    stores: HashMap<JobId, Transfer>,
    /// What each GPU block may be trusted for.
    watch: Watch,
    /// When the driver hears of completions.
    completions: Completions,
    /// Transfers started, in start order, with the step that started them; and those whose
    /// copies finished and that the driver has not heard of yet (with [`Completions::AfterSteps`]).
    started: VecDeque<(JobId, u64)>,
    arrived: HashMap<JobId, CopyDone>,
    /// What the step waits for before the driver can go on (with [`Completions::AfterSteps`]).
    blocked: Option<Due>,
    /// The running step's number.
    step_no: u64,
    book: TokenBook,
    engine: Box<dyn TransferEngine>,
    done: mpsc::Receiver<CopyDone>,
    /// Reused buffers: the slots a forward writes or a check reads, and what each one is.
    slots: Vec<Slot>,
    whose: Vec<SlotName>,
    flush_counted: bool,
    /// Check the driver's invariants after every step.
    check: bool,
    /// When the running step began, and when each transfer in flight started (tracing only).
    step_started: u64,
    transfer_started: HashMap<JobId, u64>,
    /// Time in the driver's calls during the running step.
    hook_time: Duration,
    stats: RankStats,
    /// The counters at the previous report.
    reported: RankDelta,
}

impl std::fmt::Debug for RankTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankTask")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl RankTask {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: u32,
        driver: RankDriver<EngineWorker>,
        shape: RankShape,
        arena: Box<dyn KvArena>,
        engine: Box<dyn TransferEngine>,
        done: mpsc::Receiver<CopyDone>,
        check: bool,
    ) -> Self {
        let bs = shape.block_size as usize;
        let slot_bytes = (shape.gpu.block_bytes() as usize) / bs;
        let watch = Watch::new(shape.gpu.blocks());
        Self {
            rank,
            driver,
            slot_bytes,
            arena,
            gpu_shadow: vec![UNWRITTEN; shape.gpu.blocks() as usize * bs],
            host_shadow: vec![UNWRITTEN; shape.host.blocks() as usize * bs],
            shape,
            loads: HashMap::default(),
            stores: HashMap::default(),
            watch,
            completions: Completions::default(),
            started: VecDeque::new(),
            arrived: HashMap::default(),
            blocked: None,
            step_no: 0,
            book: TokenBook::default(),
            engine,
            done,
            slots: Vec::new(),
            whose: Vec::new(),
            flush_counted: false,
            check,
            step_started: 0,
            transfer_started: HashMap::default(),
            hook_time: Duration::ZERO,
            stats: RankStats::default(),
            reported: RankDelta::default(),
        }
    }

    /// Runs steps until the engine hangs up or an error stops the rank; returns what it did.
    pub async fn run(
        mut self,
        mut steps: mpsc::Receiver<StepMsg>,
        reports: mpsc::Sender<RankReport>,
    ) -> RankStats {
        let mut current: Option<StepId> = None;
        loop {
            let progressed = tokio::select! {
                biased;
                d = self.done.recv() => match d {
                    Some(d) => self.arrive(d).map(|()| current.is_some()),
                    // The copy thread is gone: said to the engine, never a silent exit.
                    None => Err(RunError::Transfer { rank: self.rank, error: TransferError::Stopped }),
                },
                m = steps.recv(), if current.is_none() => match m {
                    Some(m) => {
                        current = Some(m.step.output.step);
                        self.begin(&m).map(|()| true)
                    }
                    None => break,
                },
            };
            let result = match progressed {
                Ok(true) => self
                    .unblock()
                    .and_then(|go| if go { self.drive() } else { Ok(None) }),
                Ok(false) => Ok(None),
                Err(e) => Err(e),
            };
            let (output, delta) = match result {
                Ok(Some((out, delta))) => (Ok(out), delta),
                Ok(None) => continue,
                Err(e) => (Err(e), RankDelta::default()),
            };
            let failed = output.is_err();
            let step = current.take().unwrap_or(StepId(u64::MAX));
            let report = RankReport {
                rank: self.rank,
                step,
                output,
                delta,
            };
            if reports.send(report).await.is_err() || failed {
                break;
            }
        }
        // Completions still arriving are drained so the copy thread can finish.
        self.done.close();
        while self.done.recv().await.is_some() {}
        self.stats
    }

    fn begin(&mut self, m: &StepMsg) -> Result<(), RunError> {
        for r in m.forget.iter() {
            self.book.forget(*r);
        }
        for (r, t) in m.tokens.iter() {
            self.book.extend(*r, t);
        }
        for p in m.promoted.iter() {
            self.learn_promoted(p)?;
        }
        for r in tables_reset(&m.step.output) {
            self.watch.reset(r);
        }
        self.flush_counted = false;
        self.step_no = m.step.output.step.0;
        if self.stats.timeline.is_on() {
            self.step_started = now_us();
        }
        let t = Instant::now();
        let begun = self.driver.begin(&m.step);
        self.hook_time += t.elapsed();
        begun.map_err(|error| RunError::Rank {
            rank: self.rank,
            error,
        })
    }

    /// Polls the driver until it waits, or the step is done.
    fn drive(&mut self) -> Result<Option<(WorkerOutput, RankDelta)>, RunError> {
        loop {
            let t = Instant::now();
            let polled = self.driver.poll();
            self.hook_time += t.elapsed();
            let action = polled.map_err(|error| RunError::Rank {
                rank: self.rank,
                error,
            })?;
            match action {
                RankAction::Start(t) => self.start(t)?,
                RankAction::Forward(pass) => self.forward(&pass)?,
                RankAction::Wait { jobs, during } => {
                    if during == WorkerCall::HandlePreemptions && !self.flush_counted {
                        self.flush_counted = true;
                        self.stats.flushed_stores += jobs.len() as u64;
                    }
                    if self.block_on(Due::Jobs(jobs.iter().copied().collect()))? {
                        continue;
                    }
                    return Ok(None);
                }
                RankAction::Collect => {
                    if !self.block_on(Due::Collect)? {
                        return Ok(None);
                    }
                }
                RankAction::Done(out) => return self.done_step(out).map(Some),
                RankAction::Idle => return Ok(None),
            }
        }
    }

    /// The step's output is ready: its figures, its invariants, its timeline span; with the
    /// counters since the previous report.
    fn done_step(&mut self, out: WorkerOutput) -> Result<(WorkerOutput, RankDelta), RunError> {
        let hooks = std::mem::take(&mut self.hook_time);
        self.stats.hook_us.push(hooks.as_secs_f32() * 1e6);
        if self.check {
            self.driver.check_invariants()?;
            self.stats.invariant_checks += 1;
        }
        let step = self.driver.steps_done().saturating_sub(1);
        let (start, pid) = (self.step_started, self.rank + 1);
        self.stats
            .timeline
            .span(|| format!("step {step}"), start, pid, 0);
        let delta = self.stats.since(&self.reported);
        self.reported.add(&delta);
        Ok((out, delta))
    }

    /// A transfer's copies finished: the driver hears of it now ([`Completions::AsArrived`]), or
    /// when it is due.
    fn arrive(&mut self, d: CopyDone) -> Result<(), RunError> {
        match self.completions {
            Completions::AsArrived => self.complete(d),
            Completions::AfterSteps(_) => {
                self.arrived.insert(d.job, d);
                Ok(())
            }
        }
    }

    /// Waits (as far as the driver is concerned) for what `due` names: `true` when the driver
    /// may go on now, `false` when the rank must wait for more copies to finish first.
    fn block_on(&mut self, due: Due) -> Result<bool, RunError> {
        if self.completions == Completions::AsArrived {
            if due == Due::Collect {
                while let Ok(d) = self.done.try_recv() {
                    self.complete(d)?;
                }
            }
            return Ok(due == Due::Collect);
        }
        self.blocked = Some(due);
        self.unblock()
    }

    /// Feeds the driver, in start order, the completions the blocked step is due to hear of:
    /// at a collect, every transfer started `n` steps before or earlier; at a wait, every
    /// transfer started up to the last one waited for. `true` when all of them were fed (or
    /// nothing is blocked).
    fn unblock(&mut self) -> Result<bool, RunError> {
        let Some(due) = self.blocked.take() else {
            return Ok(true);
        };
        let lag = match self.completions {
            Completions::AfterSteps(n) => u64::from(n),
            Completions::AsArrived => 0,
        };
        // At a wait: how many of the started transfers lead up to the last one waited for.
        let mut upto = match &due {
            Due::Collect => 0,
            Due::Jobs(jobs) => self
                .started
                .iter()
                .rposition(|(j, _)| jobs.contains(j))
                .map_or(0, |i| i + 1),
        };
        loop {
            let next = self.started.front().copied();
            let is_due = match (&due, next) {
                (_, None) => false,
                (Due::Collect, Some((_, step))) => step + lag <= self.step_no,
                (Due::Jobs(_), Some(_)) => upto > 0,
            };
            if !is_due {
                return Ok(true);
            }
            let (job, _) = next.expect("checked");
            let Some(d) = self.arrived.remove(&job) else {
                self.blocked = Some(due);
                return Ok(false);
            };
            self.started.pop_front();
            upto = upto.saturating_sub(1);
            self.complete(d)?;
        }
    }

    fn start(&mut self, t: Transfer) -> Result<(), RunError> {
        let planned = if t.external.first().is_some_and(|&s| is_remote_slot(s)) {
            crate::pd::fetch::plan(&t, &self.shape.gpu).map(|(runs, r)| (runs, Some(r)))
        } else {
            copy_plan(&t, &self.shape.gpu, &self.shape.host).map(|runs| (runs, None))
        };
        let (runs, remote) = planned.map_err(|error| RunError::Plan {
            rank: self.rank,
            error,
        })?;
        let bs = self.shape.block_size as usize;
        if self.stats.timeline.is_on() {
            self.transfer_started.insert(t.job, now_us());
        }
        tracing::trace!(rank = self.rank, job = t.job.0, direction = ?t.direction, blocks = t.gpu_blocks.len(), copies = runs.len(), "transfer started");
        let hazard = match t.direction {
            TransferDirection::Store => self.watch.start_store(&t.gpu_blocks),
            TransferDirection::Load => self.watch.start_load(t.job, &t.gpu_blocks),
        };
        hazard.map_err(|(block, hazard)| RunError::Hazard {
            rank: self.rank,
            request: t.request,
            block,
            hazard,
        })?;
        match t.direction {
            TransferDirection::Store => {
                for (b, &slot) in t.gpu_blocks.iter().zip(&t.external) {
                    let (g, h) = (b.0 as usize * bs, slot as usize * bs);
                    let (src, dst) = (g..g + bs, h..h + bs);
                    self.host_shadow[dst].copy_from_slice(&self.gpu_shadow[src]);
                }
                self.stores.insert(t.job, t.clone());
            }
            TransferDirection::Load => {
                self.loads.insert(t.job, t.clone());
            }
        }
        if self.completions != Completions::AsArrived {
            self.started.push_back((t.job, self.step_no));
        }
        self.engine
            .start(CopyJob {
                job: t.job,
                direction: t.direction,
                runs,
                remote,
            })
            .map_err(|error| RunError::Transfer {
                rank: self.rank,
                error,
            })
    }

    /// A transfer completed: a load is checked, then the driver hears of it.
    fn complete(&mut self, d: CopyDone) -> Result<(), RunError> {
        tracing::trace!(
            rank = self.rank,
            job = d.job.0,
            bytes = d.bytes,
            "transfer done"
        );
        d.result.clone().map_err(|error| RunError::Transfer {
            rank: self.rank,
            error,
        })?;
        if d.failed {
            return self.failed(&d);
        }
        self.stats.copies += d.copies;
        if let Some(start) = self.transfer_started.remove(&d.job) {
            let (what, tid) = match d.direction {
                TransferDirection::Store => ("store", 1),
                TransferDirection::Load => ("load", 2),
            };
            let name = || format!("{what} job {} ({} bytes)", d.job.0, d.bytes);
            self.stats.timeline.span(name, start, self.rank + 1, tid);
        }
        match d.direction {
            TransferDirection::Store => {
                self.stats.bytes_stored += d.bytes;
                self.stats.store_time += d.elapsed;
                if let Some(t) = self.stores.remove(&d.job) {
                    self.stats.blocks_stored += t.gpu_blocks.len() as u64;
                    self.watch.end_store(&t.gpu_blocks);
                }
            }
            TransferDirection::Load => {
                self.stats.bytes_loaded += d.bytes;
                self.stats.load_time += d.elapsed;
                if let Some(t) = self.loads.remove(&d.job) {
                    self.stats.blocks_loaded += t.gpu_blocks.len() as u64;
                    if t.external.first().is_some_and(|&s| is_remote_slot(s)) {
                        self.stats.remote_blocks_loaded += t.gpu_blocks.len() as u64;
                        self.stats.remote_bytes_loaded += d.bytes;
                    }
                    if self.rank == 0 {
                        let tokens = t.gpu_blocks.len() as u32 * self.shape.block_size;
                        *self.stats.loaded_tokens.entry(t.request).or_default() += tokens;
                    }
                    self.check_load(&t)?;
                    self.watch.end_load(&t.gpu_blocks);
                }
            }
        }
        self.tell_driver(TransferDone {
            job: d.job,
            ok: true,
        })
    }

    /// The driver hears of a completed (or failed) transfer.
    fn tell_driver(&mut self, done: TransferDone) -> Result<(), RunError> {
        let t = Instant::now();
        let heard = self.driver.transfer_done(done);
        self.hook_time += t.elapsed();
        heard.map_err(|error| RunError::Rank {
            rank: self.rank,
            error,
        })
    }

    /// A transfer failed part-way: its destination is marked [`POISON`] (a load's GPU blocks, a
    /// store's host slots), so that any later check expecting content there reports it — the
    /// core must never let a request read them — and the driver hears `ok: false`.
    fn failed(&mut self, d: &CopyDone) -> Result<(), RunError> {
        self.stats.failed_transfers += 1;
        self.transfer_started.remove(&d.job);
        let bs = self.shape.block_size as usize;
        match d.direction {
            TransferDirection::Store => {
                if let Some(t) = self.stores.remove(&d.job) {
                    for &slot in &t.external {
                        let h = slot as usize * bs;
                        self.host_shadow[h..h + bs].fill(POISON);
                    }
                    self.watch.end_store(&t.gpu_blocks);
                }
            }
            TransferDirection::Load => {
                if let Some(t) = self.loads.remove(&d.job) {
                    for b in &t.gpu_blocks {
                        let g = b.0 as usize * bs;
                        self.gpu_shadow[g..g + bs].fill(POISON);
                    }
                    self.watch.end_load(&t.gpu_blocks);
                }
            }
        }
        self.tell_driver(TransferDone {
            job: d.job,
            ok: false,
        })
    }

    /// Takes each loaded block's content record from its host slot and checks the block's
    /// bytes against it; a block counts as verified once at least one of its slots was checked
    /// (a slot never written has no record to check against).
    fn check_load(&mut self, t: &Transfer) -> Result<(), RunError> {
        let bs = self.shape.block_size as usize;
        let (mut slots, mut whose) = (
            std::mem::take(&mut self.slots),
            std::mem::take(&mut self.whose),
        );
        slots.clear();
        whose.clear();
        let mut checked = 0u64;
        for ((&b, &slot), &group) in t.gpu_blocks.iter().zip(&t.external).zip(&t.groups) {
            let g = b.0 as usize * bs;
            if let Some((_, index)) = remote_slot_parts(slot) {
                self.shadow_from_book(t.request, index, g);
            } else {
                let h = slot as usize * bs;
                self.gpu_shadow[g..g + bs].copy_from_slice(&self.host_shadow[h..h + bs]);
            }
            let before = slots.len();
            for layer in self.shape.gpu.layers_of(group) {
                let salt = salt(layer, group, self.rank);
                for (i, &prefix) in self.gpu_shadow[g..g + bs].iter().enumerate() {
                    if prefix == UNWRITTEN {
                        continue;
                    }
                    slots.push(Slot {
                        at: self.slot(layer, b, i as u32)?,
                        word: salted(prefix, salt),
                    });
                    whose.push(SlotName {
                        request: t.request,
                        block: b,
                        layer,
                        slot: i as u32,
                    });
                }
            }
            checked += u64::from(slots.len() > before);
        }
        let bad = self.arena.first_mismatch(&slots);
        let named = self.mismatch("loaded", bad, |i| whose.get(i).copied());
        (self.slots, self.whose) = (slots, whose);
        named?;
        self.stats.loaded_blocks_verified += checked;
        Ok(())
    }

    /// What block `index` of `request` must hold after a P/D load, from the request's own
    /// tokens (the prefill engine computed the same prompt): the prefix hash of each of its
    /// token slots up to the tokens known (the prompt), unwritten past them.
    fn shadow_from_book(&mut self, request: RequestId, index: u32, at: usize) {
        let bs = self.shape.block_size as usize;
        let shadow = &mut self.gpu_shadow[at..at + bs];
        shadow.fill(UNWRITTEN);
        let first = index.saturating_mul(bs as u32);
        let last = (first + bs as u32).min(self.book.known(request));
        if let Some(p) = (first < last)
            .then(|| self.book.prefixes(request, first..last))
            .flatten()
        {
            shadow[..p.len()].copy_from_slice(p);
        }
    }

    /// `Ok` when no slot mismatched; else the error naming the slot (`name(i)` of the first
    /// mismatch `i`).
    fn mismatch(
        &self,
        what: &'static str,
        found: Result<Option<usize>, TransferError>,
        name: impl Fn(usize) -> Option<SlotName>,
    ) -> Result<(), RunError> {
        let found = found.map_err(|error| RunError::Transfer {
            rank: self.rank,
            error,
        })?;
        match found.and_then(name) {
            None => Ok(()),
            Some(n) => Err(RunError::Corrupt {
                what,
                rank: self.rank,
                request: n.request,
                block: n.block,
                layer: n.layer,
                slot: n.slot,
            }),
        }
    }

    /// The byte offset of token slot `index` of `block` in `layer`.
    fn slot(&self, layer: u32, block: BlockId, index: u32) -> Result<usize, RunError> {
        match self.shape.gpu.offset(layer, block.0) {
            Some(base) => Ok(base as usize + index as usize * self.slot_bytes),
            None => Err(RunError::OutOfArena {
                rank: self.rank,
                block,
                layer,
            }),
        }
    }

    /// One layer of a forward: its writes, then (at the group's last layer) its reads.
    fn forward(&mut self, pass: &kvrelay_core::ForwardPass) -> Result<(), RunError> {
        let layer = pass.layer;
        let Some(group) = self.shape.gpu.group_of(layer) else {
            return Ok(());
        };
        self.write(pass, group)?;
        // Reads are checked once the group's last layer wrote: a request may read a block
        // another one writes in the same step (a prefix hit on a block cached when the step was
        // scheduled), layer after layer, and trusts it only once every layer was written.
        if self.shape.gpu.layers_of(group).last() == Some(layer) {
            self.read(pass, group)?;
        }
        Ok(())
    }

    /// Writes every new token's word into its slot, then checks the bytes written. A block
    /// someone else trusts, or that a transfer uses, is not written ([`Watch::may_write`]).
    fn write(&mut self, pass: &kvrelay_core::ForwardPass, group: u32) -> Result<(), RunError> {
        let (layer, bs) = (pass.layer, self.shape.block_size);
        let mut slots = std::mem::take(&mut self.slots);
        slots.clear();
        let (sb, rank) = (self.slot_bytes, self.rank);
        let salt = salt(layer, group, rank);
        let writes = || pass.writes.iter().filter(|a| a.group as u32 == group);
        for a in writes() {
            self.watch.may_write(a).map_err(|h| self.hazard(a, h))?;
            let base = self.slot(layer, a.block, 0)?;
            let prefixes = prefixes(&self.book, rank, a.request, &a.tokens)?;
            let shadow = a.block.0 as usize * bs as usize;
            for (p, &prefix) in a.tokens.clone().zip(prefixes) {
                let i = (p % bs) as usize;
                slots.push(Slot {
                    at: base + i * sb,
                    word: salted(prefix, salt),
                });
                self.gpu_shadow[shadow + i] = prefix;
            }
        }
        let bad = match self.arena.fill(&slots) {
            Ok(()) => self.arena.first_mismatch(&slots),
            Err(e) => Err(e),
        };
        // The i-th slot written, named only when one mismatched.
        let name = |i: usize| {
            let mut all = writes().flat_map(|a| a.tokens.clone().map(move |p| (a, p)));
            all.nth(i).map(|(a, p)| SlotName {
                request: a.request,
                block: a.block,
                layer,
                slot: p % bs,
            })
        };
        let named = self.mismatch("written", bad, name);
        self.stats.written_slots_verified += slots.len() as u64;
        self.slots = slots;
        named
    }

    /// Checks, in the shadow, every block the layer reads that its request has not checked
    /// yet; the request trusts it from then on ([`Watch`]).
    fn read(&mut self, pass: &kvrelay_core::ForwardPass, group: u32) -> Result<(), RunError> {
        let bs = self.shape.block_size;
        for span in pass.reads.iter().filter(|s| s.group as u32 == group) {
            let (r, g) = (span.request, span.group);
            self.watch.window_from(r, g, span.tokens.start / bs);
            let from = self.watch.checked_up_to(r, g);
            let new: Vec<BlockAccess> = self.driver.read_blocks(span, from).collect();
            for a in &new {
                self.watch.may_read(a).map_err(|h| self.hazard(a, h))?;
                let want = prefixes(&self.book, self.rank, r, &a.tokens)?;
                let base = a.block.0 as usize * bs as usize;
                let held = a
                    .tokens
                    .clone()
                    .map(|p| self.gpu_shadow[base + (p % bs) as usize]);
                if let Some(p) = a
                    .tokens
                    .clone()
                    .zip(held.zip(want))
                    .find_map(|(p, (h, w))| (h != *w).then_some(p))
                {
                    return Err(RunError::Corrupt {
                        what: "read",
                        rank: self.rank,
                        request: r,
                        block: a.block,
                        layer: pass.layer,
                        slot: p % bs,
                    });
                }
                self.watch.trust(a);
                self.stats.read_blocks_checked += 1;
            }
        }
        Ok(())
    }

    fn hazard(&self, a: &BlockAccess, hazard: Hazard) -> RunError {
        RunError::Hazard {
            rank: self.rank,
            request: a.request,
            block: a.block,
            hazard,
        }
    }
}

/// What the blocked step waits for before its driver can go on.
#[derive(Debug, Eq, PartialEq)]
enum Due {
    /// The step's collect: the transfers due by now ([`Completions`]).
    Collect,
    /// A wait for these jobs.
    Jobs(Vec<JobId>),
}

impl RankTask {
    /// Records what a promoted CPU chunk holds (the prefix hashes of its tokens), so that a
    /// later load from it is checked as one the rank stored itself would be.
    fn learn_promoted(&mut self, p: &PromotedChunk) -> Result<(), RunError> {
        let slots = self.shape.blocks_per_chunk as usize * self.shape.block_size as usize;
        let at = p.chunk as usize * slots;
        match self.host_shadow.get_mut(at..at + slots) {
            Some(shadow) if p.prefixes.len() == slots => {
                shadow.copy_from_slice(&p.prefixes);
                Ok(())
            }
            _ => Err(RunError::Config(format!(
                "rank {}: promoted chunk {} is not a chunk of the pool ({} slot hashes)",
                self.rank,
                p.chunk,
                p.prefixes.len()
            ))),
        }
    }
}

/// The prefix hashes of `request`'s tokens at `positions`, or the error naming the first
/// unknown one.
fn prefixes<'b>(
    book: &'b TokenBook,
    rank: u32,
    request: RequestId,
    positions: &Range<u32>,
) -> Result<&'b [u64], RunError> {
    book.prefixes(request, positions.clone())
        .ok_or_else(|| RunError::UnknownTokens {
            rank,
            request,
            position: book.known(request).max(positions.start),
        })
}
