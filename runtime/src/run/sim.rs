//! Deterministic simulation of the runtime with injected faults (TigerBeetle's VOPR, FoundationDB's
//! simulation): the real [`Engine`], rank tasks, rank drivers, offloading connector and content
//! checks, with the three seams of [`super::transport`] and [`super::transfer`] replaced, and
//! every choice drawn from one seed.
//!
//! # What is simulated
//!
//! * **Time**: a current-thread tokio runtime with a paused clock. Every wait (the engine's idle
//!   wait and rank check, a transfer's duration, a frame's delay) is virtual: a run of minutes of
//!   simulated time takes milliseconds, and the interleaving depends on the seed only.
//! * **Transfers** ([`SimEngine`]): one queue per rank, completed in the order started (as
//!   vLLM's worker runs them). A transfer's bytes move when it *completes*, not when it starts, so
//!   a block rewritten under an in-flight store, or read before its load completed, shows as
//!   wrong bytes. Faults: a transfer fails part-way (its destination is garbage; the rank tells
//!   the core `ok: false`), or is slow.
//! * **Frames** ([`SimTransport`]): ranks are tasks of this process, but every step frame and
//!   every report goes through a relay that may delay it (a slow rank; reports of different ranks
//!   reordered) or duplicate it (the engine must refuse the copy). One rank may be lost: it stops
//!   answering after a drawn step (the engine must say which rank, and stop without hanging).
//! * **Inputs**: requests (shared prefixes, preemption under a small GPU pool), aborts at any
//!   step, cache resets with jobs in flight.
//!
//! After every step every machine's `check_invariants()` runs (`check`), and every load and every
//! forward read is verified byte for byte (always on in the rank). After the fault phase, a
//! quiescence phase with every fault off must finish every request and leave nothing behind
//! ([`Engine::leaks`]). A run that ends otherwise — an unexpected error, a hang, a leak — fails
//! with the seed that replays it: `KVRELAY_SEED=<seed> kvrelay sim`.
//!
//! Which seeds: seed 0 is fault-free, seed 1 has every fault kind, every other seed draws its own
//! mix ([`FaultMix::for_seed`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvrelay_core::{Mode, RankError, RequestId, Token, TransferDirection, WorkerError};
use serde::Serialize;
use tokio::sync::{Notify, mpsc};

use super::content::mix;
use super::engine::Engine;
use super::host::{HostArena, load, store};
use super::rank::{RankReport, RankSetup, StepMsg};
use super::transfer::{COPY_QUEUE_BOUND, CopyDone, CopyJob, TransferEngine, TransferError};
use super::transport::{BoxFuture, Clock, RankConn, TokioClock, Transport};
use super::{RunConfig, RunError};

/// Steps of the fault phase at most (arrivals come within it).
const FAULT_STEPS: u64 = 400;
/// Steps the quiescence phase may take before the run counts as hung.
const QUIESCE_STEPS: u64 = 3_000;
/// Virtual time a shutdown may take before the run counts as hung.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(60);

/// The seeded generator of every choice of a run.
#[derive(Clone, Debug)]
pub(crate) struct SimRng(u64);

impl SimRng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(mix(seed ^ 0x6a09_e667_f3bc_c908))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// `true` with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// An independent generator for a part of the run (a rank's transfers, a relay).
    fn fork(&mut self, salt: u64) -> Self {
        Self(mix(self.next_u64() ^ salt))
    }
}

/// The faults of one run: each a probability per opportunity (a transfer, a frame, a step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct FaultMix {
    /// A transfer fails part-way.
    pub transfer_fail: f64,
    /// A transfer is slow (5–40 ms instead of tens of µs).
    pub transfer_slow: f64,
    /// A rank's report is delayed (0.1–20 ms): a slow rank, reports reordered across ranks.
    pub report_delay: f64,
    /// A report is sent twice (the copy at once or later: a duplicate or a stale frame).
    pub report_duplicate: f64,
    /// A step frame reaches a rank late (0.1–10 ms).
    pub step_delay: f64,
    /// Per engine step: a live request is aborted.
    pub abort: f64,
    /// Per engine step: the connector's cache is reset (jobs may be in flight).
    pub reset: f64,
    /// One rank stops answering after a drawn step.
    pub rank_lost: bool,
}

impl FaultMix {
    /// No fault.
    pub fn none() -> Self {
        Self::default()
    }

    /// Every fault kind, at rates that still let most requests finish.
    pub fn every() -> Self {
        Self {
            transfer_fail: 0.05,
            transfer_slow: 0.05,
            report_delay: 0.2,
            report_duplicate: 0.1,
            step_delay: 0.2,
            abort: 0.03,
            reset: 0.01,
            rank_lost: true,
        }
    }

    /// Seed 0: none; seed 1: every kind; others: each kind off, low or high, drawn from the
    /// seed (a rank is lost in about one seed in eight).
    pub fn for_seed(seed: u64) -> Self {
        match seed {
            0 => return Self::none(),
            1 => return Self::every(),
            _ => {}
        }
        let mut r = SimRng::new(seed ^ 0xfa17);
        let mut rate = |low: f64, high: f64| match r.range(0, 2) {
            0 => 0.0,
            1 => low,
            _ => high,
        };
        Self {
            transfer_fail: rate(0.01, 0.1),
            transfer_slow: rate(0.02, 0.2),
            report_delay: rate(0.05, 0.5),
            report_duplicate: rate(0.02, 0.2),
            step_delay: rate(0.05, 0.5),
            abort: rate(0.01, 0.05),
            reset: rate(0.003, 0.02),
            rank_lost: r.range(0, 7) == 0,
        }
    }

    /// The kinds this mix injects, by name.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (on, name) in [
            (self.transfer_fail > 0.0, "transfer_fail"),
            (self.transfer_slow > 0.0, "transfer_slow"),
            (self.report_delay > 0.0, "report_delay"),
            (self.report_duplicate > 0.0, "report_duplicate"),
            (self.step_delay > 0.0, "step_delay"),
            (self.abort > 0.0, "abort"),
            (self.reset > 0.0, "reset"),
            (self.rank_lost, "rank_lost"),
        ] {
            if on {
                v.push(name);
            }
        }
        v
    }
}

/// What a simulated run did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// `compat` or `strict`.
    pub mode: &'static str,
    /// Ranks.
    pub ranks: u32,
    /// Async scheduling depth.
    pub async_depth: u32,
    /// The faults injected.
    pub faults: FaultMix,
    /// Engine steps.
    pub steps: u64,
    /// Requests submitted.
    pub requests: u64,
    /// Requests that finished (aborted ones included).
    pub finished: u64,
    /// Aborts issued (of live requests).
    pub aborts: u64,
    /// Cache resets issued.
    pub resets: u64,
    /// Transfers failed by the simulation (all ranks).
    pub transfers_failed: u64,
    /// Duplicate or stale reports the engine refused.
    pub reports_rejected: u64,
    /// Every machine's invariants were checked after every step (engine and ranks).
    pub invariant_checks: u64,
    /// Loaded blocks and read token slots verified byte for byte.
    pub blocks_verified: u64,
    /// How the run ended: `quiescent` (every request finished, nothing left behind), or the
    /// expected stop (`rank N lost`, `transfer failed under compat`).
    pub ending: String,
    /// A digest of everything the run produced (steps, tokens, finishes): equal for equal
    /// seeds.
    pub digest: u64,
}

/// Why a simulated run failed. Its display names the seed and the command that replays it.
#[derive(Clone, Debug, PartialEq, Serialize, thiserror::Error)]
#[error("seed {seed}: {why} (replay: KVRELAY_SEED={seed} kvrelay sim)")]
pub struct SimFailure {
    /// The seed.
    pub seed: u64,
    /// What went wrong.
    pub why: String,
}

/// Test-only switches of a run (to show that the simulation's checks can fail).
#[derive(Clone, Copy, Debug, Default)]
pub struct SimOptions {
    /// The first load reads a corrupted host slot: the run must fail with a byte mismatch.
    pub corrupt_first_load: bool,
}

/// Runs seed `seed` to its end: the run's report, or why it failed.
pub fn simulate(seed: u64) -> Result<SimReport, SimFailure> {
    simulate_with(seed, SimOptions::default())
}

/// [`simulate`] with test-only switches.
pub fn simulate_with(seed: u64, options: SimOptions) -> Result<SimReport, SimFailure> {
    let fail = |why: String| SimFailure { seed, why };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| fail(format!("tokio runtime: {e}")))?;
    rt.block_on(run_seed(seed, options)).map_err(fail)
}

/// The run's shape, drawn from the seed.
fn config_for(seed: u64, r: &mut SimRng, faults: &FaultMix) -> RunConfig {
    let block_size = 4;
    RunConfig {
        seed,
        ranks: r.range(1, 3) as u32,
        layers: r.range(1, 2) as u32,
        block_size,
        block_bytes: 8 * u64::from(block_size) * r.range(1, 2),
        gpu_blocks: r.range(28, 48) as u32,
        cpu_blocks: r.range(16, 64) as u32,
        blocks_per_chunk: 1,
        policy: if r.chance(0.5) {
            kvrelay_core::PolicyKind::Lru
        } else {
            kvrelay_core::PolicyKind::Arc
        },
        // Failures are absorbed under strict; compat stops on the first (a quarter of the
        // seeds that fail transfers check that it does, cleanly).
        mode: if faults.transfer_fail > 0.0 && r.chance(0.25) {
            Mode::Compat
        } else {
            Mode::Strict
        },
        max_num_seqs: r.range(3, 8) as u32,
        max_num_batched_tokens: r.range(24, 96) as u32,
        async_depth: r.range(1, 2) as u32,
        check: true,
        ..RunConfig::default()
    }
}

/// One request of the generated input: when it arrives, its prompt, its output length.
struct Arrival {
    step: u64,
    prompt: Vec<Token>,
    max_tokens: u32,
}

/// Requests sharing a few prefixes (prefix-cache and offload hits), arriving over the first
/// steps.
fn arrivals(r: &mut SimRng) -> Vec<Arrival> {
    let prefixes: Vec<Vec<Token>> = (0..r.range(1, 3))
        .map(|p| {
            (0..r.range(4, 24))
                .map(|i| (p * 1000 + i) as Token)
                .collect()
        })
        .collect();
    let n = r.range(4, 40);
    let mut out: Vec<Arrival> = (0..n)
        .map(|i| {
            let mut prompt = prefixes[r.range(0, prefixes.len() as u64 - 1) as usize].clone();
            prompt.extend((0..r.range(1, 48)).map(|j| (100_000 + i * 100 + j) as Token));
            Arrival {
                step: r.range(0, 200),
                prompt,
                max_tokens: r.range(1, 24) as u32,
            }
        })
        .collect();
    out.sort_by_key(|a| a.step);
    out
}

/// The run of one seed (see the module docs).
async fn run_seed(seed: u64, options: SimOptions) -> Result<SimReport, String> {
    let mut r = SimRng::new(seed);
    let faults = FaultMix::for_seed(seed);
    let mut config = config_for(seed, &mut r, &faults);
    config.corrupt_first_load = options.corrupt_first_load;
    let mut input: VecDeque<Arrival> = arrivals(&mut r).into();
    let calm = Arc::new(AtomicBool::new(false));
    let lost = faults.rank_lost.then(|| {
        (
            r.range(0, u64::from(config.ranks) - 1) as u32,
            r.range(3, 80),
        )
    });
    let transport = SimTransport {
        faults,
        calm: calm.clone(),
        lost,
        seed: r.next_u64(),
    };
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::default());
    let mut engine = Engine::start_with(&config, 256, &transport, clock)
        .await
        .map_err(|e| format!("engine start: {e}"))?;
    let mut report = SimReport {
        seed,
        mode: match config.mode {
            Mode::Compat => "compat",
            Mode::Strict => "strict",
        },
        ranks: config.ranks,
        async_depth: config.async_depth,
        faults,
        ..SimReport::default()
    };
    let mut live: Vec<RequestId> = Vec::new();
    let mut next_id = 0u32;
    let mut digest = seed;
    let mut stopped: Option<RunError> = None;
    let mut step = 0u64;
    loop {
        let quiet = step >= FAULT_STEPS || input.is_empty();
        calm.store(quiet, Ordering::Relaxed);
        while input.front().is_some_and(|a| a.step <= step) {
            let a = input.pop_front().expect("looked at");
            let id = RequestId(next_id);
            next_id += 1;
            engine
                .add(id, a.prompt, a.max_tokens)
                .map_err(|e| format!("add: {e}"))?;
            live.push(id);
            report.requests += 1;
        }
        if !quiet && !live.is_empty() && r.chance(faults.abort) {
            let id = live[r.range(0, live.len() as u64 - 1) as usize];
            if engine.abort(id).map_err(|e| format!("abort: {e}"))? {
                report.aborts += 1;
            }
        }
        if !quiet && r.chance(faults.reset) {
            engine.reset_cache().map_err(|e| format!("reset: {e}"))?;
            report.resets += 1;
        }
        if input.is_empty() && !engine.has_work() {
            break;
        }
        if step >= FAULT_STEPS + QUIESCE_STEPS {
            return Err(format!(
                "no quiescence after {step} steps: {} requests live",
                live.len()
            ));
        }
        let outcome = match engine.step().await {
            Ok(o) => o,
            Err(e) => {
                stopped = Some(e);
                break;
            }
        };
        step += 1;
        digest = mix(digest ^ outcome.step.0 ^ u64::from(outcome.idle));
        for o in &outcome.outputs {
            for &t in &o.new_tokens {
                digest = mix(digest ^ (u64::from(o.id.0) << 32) ^ u64::from(t));
            }
            if let Some(f) = &o.finish {
                digest = mix(digest ^ u64::from(o.id.0) ^ (format!("{f:?}").len() as u64));
                live.retain(|&id| id != o.id);
                report.finished += 1;
            }
        }
        if outcome.idle {
            engine.wait_idle().await;
        }
    }
    report.steps = step;
    report.ending = match &stopped {
        None => {
            let leaks = engine.leaks();
            if !leaks.is_empty() {
                return Err(format!("left behind at quiescence: {}", leaks.join("; ")));
            }
            "quiescent".to_owned()
        }
        Some(e) => expected_stop(e, lost, config.mode)?,
    };
    let (figures, ranks) = tokio::time::timeout(SHUTDOWN_LIMIT, engine.shutdown())
        .await
        .map_err(|_| "the ranks did not stop within a minute (virtual) of shutdown".to_owned())?;
    report.reports_rejected = figures.reports_rejected;
    report.invariant_checks =
        figures.invariant_checks + ranks.iter().map(|r| r.invariant_checks).sum::<u64>();
    report.transfers_failed = ranks.iter().map(|r| r.failed_transfers).sum();
    report.blocks_verified = ranks
        .iter()
        .map(|r| r.loaded_blocks_verified + r.slots_read_verified)
        .sum();
    report.digest = digest;
    Ok(report)
}

/// The ending of a run the engine stopped, if the stop is the expected one: the lost rank named
/// (it may also be seen as the rank whose step channel closed), or a failed transfer under
/// compat (vLLM asserts).
fn expected_stop(e: &RunError, lost: Option<(u32, u64)>, mode: Mode) -> Result<String, String> {
    match e {
        RunError::RankGone { rank } if lost.is_some_and(|(r, _)| r == *rank) => {
            Ok(format!("rank {rank} lost"))
        }
        RunError::Rank {
            rank,
            error: RankError::Worker(WorkerError::TransferFailed(job)),
        } if mode == Mode::Compat => Ok(format!(
            "rank {rank}: transfer of job {} failed under compat",
            job.0
        )),
        other => Err(format!("the engine stopped: {other}")),
    }
}

// ---------------------------------------------------------------------------------------------
// The simulated transport: ranks in this process, frames through faulty relays.

/// In-process ranks whose transfer engine is a [`SimEngine`] and whose frames go through relays
/// that delay and duplicate them.
#[derive(Debug)]
struct SimTransport {
    faults: FaultMix,
    /// Faults off (the quiescence phase).
    calm: Arc<AtomicBool>,
    /// The rank that stops answering, and after how many steps.
    lost: Option<(u32, u64)>,
    seed: u64,
}

impl Transport for SimTransport {
    fn connect(
        &self,
        mut setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let mut r = SimRng::new(self.seed ^ u64::from(setup.rank).wrapping_mul(0x9e37));
            if let Some((rank, after)) = self.lost
                && rank == setup.rank
            {
                setup.vanish_after_steps = Some(after);
            }
            let slot_bytes = (setup.gpu.block_bytes() / u64::from(setup.block_size)) as usize;
            let arena = HostArena::new(setup.gpu.total_bytes() as usize, slot_bytes);
            let (done_tx, done_rx) = mpsc::channel(COPY_QUEUE_BOUND);
            let engine = SimEngine::spawn(
                arena.shared(),
                setup.host.total_bytes() as usize,
                done_tx,
                wake,
                r.fork(1),
                self.faults,
                self.calm.clone(),
            );
            let task = setup.build_on(Box::new(arena), Box::new(engine), done_rx);
            let (steps, from_engine) = mpsc::channel::<StepMsg>(1);
            let (to_rank, rank_steps) = mpsc::channel::<StepMsg>(1);
            let (rank_reports, from_rank) = mpsc::channel::<RankReport>(1);
            tokio::spawn(relay_steps(
                from_engine,
                to_rank,
                r.fork(2),
                self.faults,
                self.calm.clone(),
            ));
            tokio::spawn(relay_reports(
                from_rank,
                reports,
                r.fork(3),
                self.faults,
                self.calm.clone(),
            ));
            let task = tokio::spawn(task.run(rank_steps, rank_reports));
            Ok(RankConn { steps, task })
        })
    }
}

/// Engine → rank: each step frame, late with probability `step_delay`.
async fn relay_steps(
    mut from: mpsc::Receiver<StepMsg>,
    to: mpsc::Sender<StepMsg>,
    mut r: SimRng,
    f: FaultMix,
    calm: Arc<AtomicBool>,
) {
    while let Some(m) = from.recv().await {
        if !calm.load(Ordering::Relaxed) && r.chance(f.step_delay) {
            tokio::time::sleep(Duration::from_micros(r.range(100, 10_000))).await;
        }
        if to.send(m).await.is_err() {
            return;
        }
    }
}

/// Rank → engine: each report, late with probability `report_delay`, sent twice with probability
/// `report_duplicate` (the copy at once, or after a delay: then it is stale).
async fn relay_reports(
    mut from: mpsc::Receiver<RankReport>,
    to: mpsc::Sender<RankReport>,
    mut r: SimRng,
    f: FaultMix,
    calm: Arc<AtomicBool>,
) {
    while let Some(rep) = from.recv().await {
        let faulty = !calm.load(Ordering::Relaxed);
        if faulty && r.chance(f.report_delay) {
            tokio::time::sleep(Duration::from_micros(r.range(100, 20_000))).await;
        }
        let copy = match &rep.output {
            Ok(out) if faulty && r.chance(f.report_duplicate) => Some(RankReport {
                rank: rep.rank,
                step: rep.step,
                output: Ok(out.clone()),
            }),
            _ => None,
        };
        if to.send(rep).await.is_err() {
            return;
        }
        if let Some(copy) = copy {
            let later = Duration::from_micros(r.range(0, 1) * r.range(100, 30_000));
            let to = to.clone();
            tokio::spawn(async move {
                tokio::time::sleep(later).await;
                let _ = to.send(copy).await;
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The simulated transfer engine.

/// A rank's transfers, performed by a task of the simulation in the order started; each takes a
/// drawn (virtual) time, and its bytes move when it completes.
pub(crate) struct SimEngine {
    queue: Arc<Mutex<VecDeque<CopyJob>>>,
    more: Arc<Notify>,
    stopped: Arc<AtomicBool>,
}

impl SimEngine {
    fn spawn(
        gpu: Arc<RwLock<Vec<u8>>>,
        host_bytes: usize,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
        r: SimRng,
        f: FaultMix,
        calm: Arc<AtomicBool>,
    ) -> Self {
        let queue = Arc::new(Mutex::new(VecDeque::new()));
        let more = Arc::new(Notify::new());
        let stopped = Arc::new(AtomicBool::new(false));
        let worker = Completer {
            queue: queue.clone(),
            more: more.clone(),
            stopped: stopped.clone(),
            gpu,
            host: vec![0u8; host_bytes],
            done,
            wake,
            r,
            f,
            calm,
        };
        tokio::spawn(worker.run());
        Self {
            queue,
            more,
            stopped,
        }
    }
}

impl TransferEngine for SimEngine {
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= COPY_QUEUE_BOUND {
            return Err(TransferError::QueueFull);
        }
        q.push_back(job);
        self.more.notify_one();
        Ok(())
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.more.notify_one();
    }
}

/// The task behind a [`SimEngine`].
struct Completer {
    queue: Arc<Mutex<VecDeque<CopyJob>>>,
    more: Arc<Notify>,
    stopped: Arc<AtomicBool>,
    gpu: Arc<RwLock<Vec<u8>>>,
    host: Vec<u8>,
    done: mpsc::Sender<CopyDone>,
    wake: Arc<Notify>,
    r: SimRng,
    f: FaultMix,
    calm: Arc<AtomicBool>,
}

impl Completer {
    async fn run(mut self) {
        loop {
            let next = self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            let Some(job) = next else {
                if self.stopped.load(Ordering::Relaxed) {
                    return;
                }
                tokio::select! {
                    () = self.more.notified() => continue,
                    () = self.done.closed() => return,
                }
            };
            let faulty = !self.calm.load(Ordering::Relaxed);
            let micros = if faulty && self.r.chance(self.f.transfer_slow) {
                self.r.range(5_000, 40_000)
            } else {
                self.r.range(10, 200)
            };
            tokio::time::sleep(Duration::from_micros(micros)).await;
            let failed = faulty && self.r.chance(self.f.transfer_fail);
            let out = self.perform(&job, failed);
            if self.done.send(out).await.is_err() {
                return;
            }
            self.wake.notify_one();
        }
    }

    /// Moves the job's bytes now; a failed job moves its first half and leaves garbage in the
    /// rest of its destination.
    fn perform(&mut self, job: &CopyJob, failed: bool) -> CopyDone {
        if job.corrupt
            && let Some(r) = job.runs.first()
        {
            self.host[r.host as usize] ^= 0x5a;
        }
        let keep = if failed {
            job.runs.len() / 2
        } else {
            job.runs.len()
        };
        let (done, garbage) = job.runs.split_at(keep);
        let bytes = match job.direction {
            TransferDirection::Store => {
                let gpu = self.gpu.read().unwrap_or_else(|p| p.into_inner());
                let n = store(done, &gpu, &mut self.host);
                for g in garbage {
                    let h = g.host as usize;
                    self.host[h..h + g.len as usize].fill(0xa5);
                }
                n
            }
            TransferDirection::Load => {
                let mut gpu = self.gpu.write().unwrap_or_else(|p| p.into_inner());
                let n = load(done, &self.host, &mut gpu);
                for g in garbage {
                    let at = g.gpu as usize;
                    gpu[at..at + g.len as usize].fill(0xa5);
                }
                n
            }
        };
        CopyDone {
            job: job.job,
            direction: job.direction,
            bytes,
            copies: keep as u64,
            elapsed: Duration::ZERO,
            result: Ok(()),
            failed,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sweeps.

/// The runs of a sweep, summed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    /// Seeds run.
    pub runs: u64,
    /// Runs that ended quiescent (the others ended in the stop their faults call for).
    pub quiescent: u64,
    /// Engine steps, all runs.
    pub steps: u64,
    /// Requests, all runs.
    pub requests: u64,
    /// Faults survived, all runs: failed transfers, refused reports, aborts, resets, lost ranks.
    pub transfers_failed: u64,
    /// Duplicate or stale reports refused.
    pub reports_rejected: u64,
    /// Aborts.
    pub aborts: u64,
    /// Cache resets.
    pub resets: u64,
    /// Runs that lost a rank (and stopped cleanly, naming it).
    pub ranks_lost: u64,
    /// Runs that stopped on a failed transfer under compat (cleanly).
    pub compat_stops: u64,
    /// Runs with each fault kind in their mix.
    pub runs_with: std::collections::BTreeMap<&'static str, u64>,
    /// Invariant checks and verified blocks and slots, all runs.
    pub invariant_checks: u64,
    /// Loaded blocks and read token slots verified byte for byte, all runs.
    pub blocks_verified: u64,
    /// Seeds that failed.
    pub failures: Vec<SimFailure>,
}

impl SweepReport {
    fn add(&mut self, r: &SimReport) {
        self.runs += 1;
        self.quiescent += u64::from(r.ending == "quiescent");
        self.steps += r.steps;
        self.requests += r.requests;
        self.transfers_failed += r.transfers_failed;
        self.reports_rejected += r.reports_rejected;
        self.aborts += r.aborts;
        self.resets += r.resets;
        self.ranks_lost += u64::from(r.ending.ends_with("lost"));
        self.compat_stops += u64::from(r.ending.ends_with("under compat"));
        for k in r.faults.kinds() {
            *self.runs_with.entry(k).or_default() += 1;
        }
        self.invariant_checks += r.invariant_checks;
        self.blocks_verified += r.blocks_verified;
    }

    /// How many times a fault of `kind` was injected and survived (runs for the per-run kinds).
    pub fn survived(&self, kind: &str) -> u64 {
        match kind {
            "transfer_fail" => self.transfers_failed,
            "report_duplicate" => self.reports_rejected,
            "abort" => self.aborts,
            "reset" => self.resets,
            "rank_lost" => self.ranks_lost,
            other => self.runs_with.get(other).copied().unwrap_or(0),
        }
    }
}

/// Runs every seed of `seeds` on `threads` threads; `progress` hears of each run (in seed order
/// per thread).
pub fn sweep(
    seeds: std::ops::Range<u64>,
    threads: usize,
    progress: &mut (dyn FnMut(&Result<SimReport, SimFailure>) + Send),
) -> SweepReport {
    let next = std::sync::atomic::AtomicU64::new(seeds.start);
    let results = Mutex::new(Vec::new());
    let progress = Mutex::new(progress);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end {
                        return;
                    }
                    let out = simulate(seed);
                    (progress.lock().unwrap_or_else(|p| p.into_inner()))(&out);
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(out);
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|r| match r {
        Ok(r) => r.seed,
        Err(f) => f.seed,
    });
    let mut out = SweepReport::default();
    for r in results {
        match r {
            Ok(r) => out.add(&r),
            Err(f) => {
                out.runs += 1;
                out.failures.push(f);
            }
        }
    }
    out
}
