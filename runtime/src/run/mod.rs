//! `kvrelay run`: an engine loop over the core's engine step, W ranks moving real KV bytes
//! between a "GPU" arena and a CPU offload pool, every load and every read verified.
//!
//! # The loop
//!
//! ```text
//! engine task                                 rank task r (one per rank)          copy thread r
//! add arrived requests (virtual clock)
//! EngineCore::schedule ── StepMsg ──────────▶ RankDriver::begin, poll:
//!                                               Start → copy_plan ─── CopyJob ──▶ memcpy runs
//!                                               Forward → write words, check reads
//!                                               Wait → until ◀────────── CopyDone (load checked)
//! EngineCore::rank_output ◀── RankReport ───── Done(output)
//! EngineCore::apply(sampled tokens)
//! ```
//!
//! Requests arrive on a virtual clock: each engine step advances it by `step_ms`, and an empty
//! engine jumps to the next arrival, so a run is the same workload on any machine. An engine
//! step that was idle (nothing scheduled, nothing reported) waits for a transfer to complete (or
//! a short timeout) before stepping again instead of spinning.
//!
//! # Rooms
//!
//! * [`args`] — the command line: flags, config file, progress bar, exit status.
//! * [`workload`] — the requests: Mooncake-format traces, the generated default.
//! * `content` — what every KV byte must be, and the per-request token book ranks derive it from.
//! * `host` — the host transfer engine (one copy thread per rank).
//! * `rank` — the rank task.
//! * [`wire`] — the frames between the engine and a worker process.
//! * [`process`] — worker processes: the engine's side of the link and `kvrelay worker`.
//! * [`report`] — the figures of a run, readable and `--json`.

pub mod args;
mod content;
mod host;
pub mod process;
mod rank;
pub mod report;
pub mod wire;
pub mod workload;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay_core::{
    EngineCore, EngineError, GroupKind, InvariantViolation, KvLayout, LayoutError, LayoutOrder,
    ManagerConfig, Mode, OffloadingConfig, OffloadingConnector, PlanError, PolicyKind, Rank,
    RankError, RequestId, RequestSpec, SchedulerConfig, Token,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc};

use self::rank::{RankReport, RankSetup, RankStats, StepMsg};
pub use self::report::Report;
use self::workload::{TraceError, TraceRecord, WorkloadConfig};

/// Where ranks run.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workers {
    /// Tasks of this process, over channels.
    #[default]
    InProcess,
    /// `kvrelay worker` processes, over Unix sockets (length-delimited postcard frames).
    Process,
}

/// Everything a run needs; the defaults are the embedded workload (`kvrelay run` with no flag).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Seeds the workload and the sampled tokens.
    pub seed: u64,
    /// Ranks (tensor-parallel workers), W.
    pub ranks: u32,
    /// Where ranks run: tasks of this process, or worker processes over Unix sockets.
    pub workers: Workers,
    /// The executable started as `kvrelay worker` (default: `$KVRELAY_WORKER_EXE`, else the
    /// running executable).
    pub worker_exe: Option<PathBuf>,
    /// Layers of the model, all in one full-attention KV cache group.
    pub layers: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes of one block of one layer on one rank (a multiple of 8 × `block_size`).
    pub block_bytes: u64,
    /// GPU blocks per rank (the null block included): small, so that requests are preempted
    /// and offloaded blocks are loaded back.
    pub gpu_blocks: u32,
    /// CPU offload blocks per rank.
    pub cpu_blocks: u32,
    /// GPU blocks per CPU chunk (vLLM's offloaded block size / block size).
    pub blocks_per_chunk: u32,
    /// CPU eviction policy.
    pub policy: PolicyKind,
    /// Running requests at most.
    pub max_num_seqs: u32,
    /// Tokens per step at most.
    pub max_num_batched_tokens: u32,
    /// Virtual milliseconds an engine step takes.
    pub step_ms: f64,
    /// Tokens per trace hash block (`hash_ids`).
    pub hash_block_tokens: u32,
    /// The generated workload (unused with `trace`).
    pub workload: WorkloadConfig,
    /// Replay this trace instead of generating the workload.
    pub trace: Option<PathBuf>,
    /// Call every machine's `check_invariants()` after every step.
    pub check: bool,
    /// Test-only fault: the first load reads a corrupted host slot.
    #[serde(skip)]
    pub corrupt_first_load: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            ranks: 2,
            workers: Workers::InProcess,
            worker_exe: None,
            layers: 4,
            block_size: 16,
            block_bytes: 2048,
            gpu_blocks: 320,
            cpu_blocks: 4096,
            blocks_per_chunk: 1,
            policy: PolicyKind::Lru,
            max_num_seqs: 16,
            max_num_batched_tokens: 1024,
            step_ms: 25.0,
            hash_block_tokens: 64,
            workload: WorkloadConfig::default(),
            trace: None,
            check: false,
            corrupt_first_load: false,
        }
    }
}

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The configuration is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// The trace could not be read or written.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The engine step refused or stopped.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// A rank's driver or worker connector stopped.
    #[error("rank {rank}: {error}")]
    Rank {
        /// The rank.
        rank: u32,
        /// Why.
        error: RankError,
    },
    /// A transfer could not be planned.
    #[error("rank {rank}: {error}")]
    Plan {
        /// The rank.
        rank: u32,
        /// Why.
        error: PlanError,
    },
    /// The transfer engine refused a transfer.
    #[error("rank {rank}: transfer engine: {why}")]
    Transfer {
        /// The rank.
        rank: u32,
        /// Why.
        why: &'static str,
    },
    /// A KV block does not hold what it must.
    #[error(
        "rank {rank}: {what} block {block:?} of request {request:?} holds wrong KV in layer \
         {layer}, token slot {slot}"
    )]
    Corrupt {
        /// `loaded` (checked when its load completed) or `read` (checked before a forward read
        /// it).
        what: &'static str,
        /// The rank.
        rank: u32,
        /// The request.
        request: RequestId,
        /// The GPU block.
        block: kvrelay_core::BlockId,
        /// The layer.
        layer: u32,
        /// The token slot in the block.
        slot: u32,
    },
    /// A rank was asked for a token it was never sent.
    #[error("rank {rank}: token {position} of request {request:?} unknown")]
    UnknownTokens {
        /// The rank.
        rank: u32,
        /// The request.
        request: RequestId,
        /// The token position.
        position: u32,
    },
    /// A worker process could not be started, or its connection failed.
    #[error("rank {rank}: worker process: {why}")]
    Worker {
        /// The rank.
        rank: u32,
        /// Why.
        why: String,
    },
    /// A frame could not be decoded or has the wrong version.
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    /// A worker process stopped with an error.
    #[error("rank {rank}: {message}")]
    Remote {
        /// The rank.
        rank: u32,
        /// The worker's own error.
        message: String,
    },
    /// A rank task ended while the engine still needed it.
    #[error("rank {rank} stopped")]
    RankGone {
        /// The rank.
        rank: u32,
    },
    /// An invariant of a machine does not hold (`--check`).
    #[error("invariant {0}")]
    Invariant(#[from] InvariantViolation),
    /// The engine has work but made no progress for too long.
    #[error("stalled: {steps} idle steps in a row with {requests} request(s) unfinished")]
    Stalled {
        /// Idle steps in a row.
        steps: u64,
        /// Requests unfinished.
        requests: u64,
    },
}

/// Idle engine steps in a row after which a run is declared stalled.
const MAX_IDLE_STEPS: u64 = 100_000;
/// How long an idle engine step waits for a transfer to complete.
const IDLE_WAIT: Duration = Duration::from_millis(5);

/// What the run is told as it goes (e.g. a progress bar).
pub trait Progress: Send {
    /// Called after every engine step.
    fn step(&mut self, finished: u64, total: u64, steps: u64, preemptions: u64, loaded: u64);
}

impl Progress for () {
    fn step(&mut self, _: u64, _: u64, _: u64, _: u64, _: u64) {}
}

/// The requests of a run: the trace, or the generated workload.
pub fn requests(config: &RunConfig) -> Result<Vec<TraceRecord>, RunError> {
    Ok(match &config.trace {
        Some(p) => workload::read_trace(p, config.hash_block_tokens)?,
        None => workload::generate(&config.workload, config.hash_block_tokens, config.seed),
    })
}

/// Runs `records` on a fresh engine and W ranks; returns the report, or the error that stopped
/// the run.
pub fn run(
    config: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
) -> Result<Report, RunError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("kvrelay-rt")
        .build()
        .map_err(|e| RunError::Config(format!("tokio runtime: {e}")))?;
    rt.block_on(engine_loop(config, records, progress))
}

fn layouts(c: &RunConfig) -> Result<(KvLayout, KvLayout), RunError> {
    let bad = |e: LayoutError| RunError::Config(e.to_string());
    if c.block_size == 0 || !c.block_bytes.is_multiple_of(8 * u64::from(c.block_size)) {
        return Err(RunError::Config(format!(
            "block_bytes ({}) must be a positive multiple of 8 × block_size ({})",
            c.block_bytes, c.block_size
        )));
    }
    let gpu = KvLayout::new(
        vec![0; c.layers as usize],
        c.gpu_blocks,
        c.block_bytes,
        LayoutOrder::LayerMajor,
    )
    .map_err(bad)?;
    let host = gpu
        .with_blocks(c.cpu_blocks, LayoutOrder::LayerMajor)
        .map_err(bad)?;
    Ok((gpu, host))
}

fn sample(seed: u64, request: RequestId, position: u32) -> Token {
    let mut r = workload::Rng::new(seed ^ (u64::from(request.0) << 32) ^ u64::from(position));
    (r.next_u64() % 50_000) as Token
}

async fn engine_loop(
    c: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
) -> Result<Report, RunError> {
    if c.ranks == 0 || c.ranks > 64 {
        return Err(RunError::Config("ranks: 1 to 64".into()));
    }
    if c.blocks_per_chunk == 0 || !c.cpu_blocks.is_multiple_of(c.blocks_per_chunk) {
        return Err(RunError::Config(
            "cpu_blocks must be a positive multiple of blocks_per_chunk".into(),
        ));
    }
    let (gpu, host) = layouts(c)?;
    let longest = records
        .iter()
        .map(|r| r.input_length + r.output_length)
        .max()
        .unwrap_or(1);
    let sc = SchedulerConfig {
        block_size: c.block_size,
        num_gpu_blocks: c.gpu_blocks,
        groups: vec![GroupKind::FullAttention],
        max_num_batched_tokens: c.max_num_batched_tokens,
        max_num_seqs: c.max_num_seqs,
        max_model_len: longest,
        enable_prefix_caching: true,
        enable_chunked_prefill: true,
        async_depth: 1,
        mode: Mode::Compat,
        ..SchedulerConfig::default()
    };
    let off = OffloadingConfig::new(
        c.blocks_per_chunk,
        c.ranks,
        ManagerConfig {
            capacity_chunks: c.cpu_blocks / c.blocks_per_chunk,
            policy: c.policy,
            store_threshold: 0,
        },
    );
    let connector =
        OffloadingConnector::new(off, &sc).map_err(|e| RunError::Config(e.to_string()))?;
    let mut core = EngineCore::new(sc.clone(), connector, c.ranks)?;

    // Ranks.
    let wake = Arc::new(Notify::new());
    let (report_tx, mut reports) = mpsc::channel::<RankReport>(c.ranks as usize);
    let mut to_ranks = Vec::new();
    let mut handles = Vec::new();
    for r in 0..c.ranks {
        let setup = RankSetup {
            rank: r,
            gpu: gpu.clone(),
            host: host.clone(),
            block_size: c.block_size,
            blocks_per_chunk: c.blocks_per_chunk,
            groups: sc.groups.clone(),
            check: c.check,
            corrupt_first_load: c.corrupt_first_load && r == 0,
        };
        let (tx, rx) = mpsc::channel::<StepMsg>(1);
        to_ranks.push(tx);
        handles.push(match c.workers {
            Workers::InProcess => {
                let task = setup.build(wake.clone());
                tokio::spawn(task.run(rx, report_tx.clone()))
            }
            Workers::Process => {
                let link = process::spawn_worker(&setup, c.worker_exe.as_deref()).await?;
                tokio::spawn(link.run(rx, report_tx.clone()))
            }
        });
    }
    drop(report_tx);

    let started = Instant::now();
    let mut f = Figures::default();
    let outcome = drive(
        c,
        records,
        &mut core,
        &to_ranks,
        &mut reports,
        &wake,
        &mut f,
        progress,
    )
    .await;
    drop(to_ranks);
    let mut ranks = Vec::new();
    for h in handles {
        ranks.push(h.await.unwrap_or_default());
    }
    outcome?;
    Ok(report::build(c, records, &f, &ranks, started.elapsed()))
}

/// What the engine side counts.
#[derive(Debug, Default)]
pub(crate) struct Figures {
    pub(crate) finished: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) generated_tokens: u64,
    pub(crate) steps: u64,
    pub(crate) idle_steps: u64,
    pub(crate) preemptions: u64,
    pub(crate) tokens_computed: u64,
    /// Per request, its computed tokens when first scheduled (prefix hit + loaded).
    pub(crate) reused: HashMap<RequestId, u32>,
    /// Engine-side time per step (schedule, rank outputs, apply), in µs.
    pub(crate) core_us: Vec<f64>,
    pub(crate) invariant_checks: u64,
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    c: &RunConfig,
    records: &[TraceRecord],
    core: &mut EngineCore<OffloadingConnector>,
    to_ranks: &[mpsc::Sender<StepMsg>],
    reports: &mut mpsc::Receiver<RankReport>,
    wake: &Notify,
    f: &mut Figures,
    progress: &mut dyn Progress,
) -> Result<(), RunError> {
    let total = records.len() as u64;
    let mut pending: VecDeque<(usize, &TraceRecord)> = records.iter().enumerate().collect();
    let mut now = 0.0f64;
    let mut tokens: Vec<(RequestId, Vec<Token>)> = Vec::new();
    let mut forget: Vec<RequestId> = Vec::new();
    let mut idle_in_a_row = 0u64;
    let mut loaded_so_far = 0u64;
    loop {
        while let Some(&(i, r)) = pending.front()
            && r.timestamp as f64 <= now
        {
            pending.pop_front();
            let id = RequestId(i as u32);
            let prompt = workload::prompt_tokens(r, c.hash_block_tokens, i as u64);
            f.prompt_tokens += prompt.len() as u64;
            core.add_request(RequestSpec {
                id,
                prompt: prompt.clone(),
                max_tokens: r.output_length,
                stop_token: None,
                kv_transfer_params: None,
            })?;
            tokens.push((id, prompt));
        }
        if !core.has_work() {
            match pending.front() {
                Some((_, r)) => {
                    now = r.timestamp as f64;
                    continue;
                }
                None => return Ok(()),
            }
        }
        let t0 = Instant::now();
        let scheduled = core.schedule()?;
        let out = &scheduled.step.output;
        let step = out.step;
        f.preemptions += out.preempted_req_ids.len() as u64;
        f.tokens_computed += u64::from(out.total_num_scheduled_tokens);
        for n in &out.scheduled_new_reqs {
            f.reused.entry(n.id).or_insert(n.num_computed_tokens);
        }
        let mut core_time = t0.elapsed();
        let msg_step = Arc::new(scheduled.step);
        let msg_tokens = Arc::new(std::mem::take(&mut tokens));
        let msg_forget = Arc::new(std::mem::take(&mut forget));
        for (r, tx) in to_ranks.iter().enumerate() {
            let m = StepMsg {
                step: msg_step.clone(),
                tokens: msg_tokens.clone(),
                forget: msg_forget.clone(),
            };
            if tx.send(m).await.is_err() {
                return Err(rank_gone(reports, r as u32).await);
            }
        }
        for _ in 0..to_ranks.len() {
            let Some(rep) = reports.recv().await else {
                return Err(RunError::RankGone { rank: 0 });
            };
            let output = rep.output?;
            if let Some(l) = output.finished_recving.as_ref() {
                loaded_so_far += l.len() as u64;
            }
            let t = Instant::now();
            core.rank_output(rep.step, Rank(rep.rank), Some(output))?;
            core_time += t.elapsed();
        }
        let t = Instant::now();
        let sampled: Vec<(RequestId, Vec<Token>)> = core
            .scheduler()
            .sampling(step)
            .map(|(id, pos)| (id, vec![sample(c.seed, id, pos)]))
            .collect();
        let applied = core.apply(sampled)?;
        let released = core.take_released();
        core_time += t.elapsed();
        if c.check {
            core.check_invariants()?;
            f.invariant_checks += 1;
        }
        f.core_us.push(core_time.as_secs_f64() * 1e6);
        for o in &applied.result.outputs {
            if !o.new_tokens.is_empty() {
                f.generated_tokens += o.new_tokens.len() as u64;
                tokens.push((o.id, o.new_tokens.clone()));
            }
            if o.finish.is_some() {
                f.finished += 1;
            }
        }
        forget.extend(released);
        f.steps += 1;
        now += c.step_ms;
        progress.step(f.finished, total, f.steps, f.preemptions, loaded_so_far);
        tracing::debug!(step = step.0, idle = applied.idle, "engine step");
        if applied.idle {
            f.idle_steps += 1;
            idle_in_a_row += 1;
            if idle_in_a_row > MAX_IDLE_STEPS {
                return Err(RunError::Stalled {
                    steps: idle_in_a_row,
                    requests: total - f.finished,
                });
            }
            let arrival_due = pending
                .front()
                .is_some_and(|(_, r)| r.timestamp as f64 <= now);
            if !arrival_due {
                let _ = tokio::time::timeout(IDLE_WAIT, wake.notified()).await;
            }
        } else {
            idle_in_a_row = 0;
        }
    }
}

/// The error of a rank whose step channel closed: its own report if it sent one.
async fn rank_gone(reports: &mut mpsc::Receiver<RankReport>, rank: u32) -> RunError {
    while let Ok(rep) = reports.try_recv() {
        if let Err(e) = rep.output {
            return e;
        }
    }
    RunError::RankGone { rank }
}

/// Per-rank figures, summed for the report.
pub(crate) fn sum_ranks(ranks: &[RankStats]) -> RankStats {
    let mut s = RankStats::default();
    for r in ranks {
        s.blocks_stored += r.blocks_stored;
        s.blocks_loaded += r.blocks_loaded;
        s.bytes_stored += r.bytes_stored;
        s.bytes_loaded += r.bytes_loaded;
        s.store_time += r.store_time;
        s.load_time += r.load_time;
        s.copies += r.copies;
        s.loaded_blocks_verified += r.loaded_blocks_verified;
        s.slots_read_verified += r.slots_read_verified;
        s.flushed_stores += r.flushed_stores;
        s.invariant_checks += r.invariant_checks;
        for (k, v) in &r.loaded_tokens {
            *s.loaded_tokens.entry(*k).or_default() += v;
        }
    }
    s
}
