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
//! * [`api`] — the embedding API: submit a request and stream its tokens, abort, reset.
//! * [`args`] — the command line: flags, config file, progress bar, exit status.
//! * [`workload`] — the requests: Mooncake-format traces, the generated default.
//! * `content` — what every KV byte must be, and the per-request token book ranks derive it from.
//! * [`transfer`] — the seam between a rank and its memory: the arena and transfer-engine
//!   traits, and the backend choice (`host`, `cuda`, `auto`).
//! * [`host`] — the host backend (one copy thread per rank).
//! * [`cuda`] — the CUDA backend (cudarc, loaded at run time).
//! * `engine` — [`Engine`]: the core's engine step with W ranks attached, one step at a time.
//! * `rank` — the rank task.
//! * `transport` — how the engine reaches its ranks (in-process, worker processes) and the
//!   clock it waits on: the seams a simulation replaces.
//! * [`wire`] — the frames between the engine and a worker process.
//! * [`process`] — worker processes: the engine's side of the link and `kvrelay worker`.
//! * `trace` — `--trace-out`: steps and transfers as a Chrome / Perfetto trace.
//! * [`sim`] — deterministic simulation of all of the above with injected faults, one seed per
//!   run (`kvrelay sim`).
//! * [`report`] — the figures of a run, readable and `--json`; `samples` keeps a long run's
//!   per-step times in bounded memory.

pub mod api;
pub mod args;
mod content;
pub mod cuda;
mod engine;
pub mod host;
pub mod process;
mod rank;
pub mod report;
mod samples;
pub mod sim;

mod trace;
pub mod transfer;
mod transport;
pub mod wire;
pub mod workload;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use kvrelay_core::{
    EngineError, InvariantViolation, Mode, PlanError, PolicyKind, RankError, RequestId,
};
use serde::{Deserialize, Serialize};

pub use self::engine::{Engine, StepOutcome};
pub use self::report::Report;
pub use self::transfer::{Backend, TransferError};
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
    /// Where the KV lives and how it moves: `host` memory, a `cuda` device, or `auto` (CUDA
    /// when a driver and a device are present, else host).
    pub backend: Backend,
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
    /// `compat` (vLLM 0.33.0's semantics: a failed transfer stops the engine, as vLLM asserts)
    /// or `strict` (kvrelay's departures, a failed transfer absorbed: see the README's *compat
    /// and strict*).
    pub mode: Mode,
    /// Running requests at most.
    pub max_num_seqs: u32,
    /// Tokens per step at most.
    pub max_num_batched_tokens: u32,
    /// Steps scheduled ahead of their output: 1 = synchronous, 2 = async scheduling (the next
    /// step is scheduled while the ranks run this one).
    pub async_depth: u32,
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
    /// Write a Chrome / Perfetto trace of steps and transfers here.
    pub trace_out: Option<PathBuf>,
    /// Test-only fault: the first load reads a corrupted host slot.
    #[serde(skip)]
    pub corrupt_first_load: bool,
    /// Test-only fault: rank 0 stops silently (no output, as a crashed rank) after this many
    /// steps.
    #[serde(skip)]
    pub vanish_after_steps: Option<u64>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            ranks: 2,
            workers: Workers::InProcess,
            backend: Backend::Host,
            worker_exe: None,
            layers: 4,
            block_size: 16,
            block_bytes: 2048,
            gpu_blocks: 320,
            cpu_blocks: 4096,
            blocks_per_chunk: 1,
            policy: PolicyKind::Lru,
            mode: Mode::Compat,
            max_num_seqs: 16,
            max_num_batched_tokens: 1024,
            async_depth: 1,
            step_ms: 25.0,
            hash_block_tokens: 64,
            workload: WorkloadConfig::default(),
            trace: None,
            check: false,
            trace_out: None,
            corrupt_first_load: false,
            vanish_after_steps: None,
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
    #[error("rank {rank}: transfer engine: {error}")]
    Transfer {
        /// The rank.
        rank: u32,
        /// Why.
        error: TransferError,
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
    /// An output file could not be written.
    #[error("{path}: {why}")]
    Output {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
    /// `--backend cuda` where CUDA cannot be used.
    #[error("backend cuda: {0}")]
    Backend(String),
    /// A rank task ended while the engine still needed it.
    #[error("rank {rank} stopped")]
    RankGone {
        /// The rank.
        rank: u32,
    },
    /// The engine task is gone (shut down, or stopped on an earlier error): a call through an
    /// [`api::EngineHandle`] cannot be served.
    #[error("the engine stopped")]
    EngineStopped,
    /// The arena has no such block (a block id beyond the configured GPU blocks).
    #[error("rank {rank}: block {block:?} of layer {layer} is outside the KV arena")]
    OutOfArena {
        /// The rank.
        rank: u32,
        /// The block.
        block: kvrelay_core::BlockId,
        /// The layer.
        layer: u32,
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

/// The tokio runtime a run uses: one thread for the engine and its in-process rank tasks
/// (a step's messages then hop between tasks, not threads; copies run on the ranks' copy
/// threads, worker processes on their own).
pub fn runtime() -> Result<tokio::runtime::Runtime, RunError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RunError::Config(format!("tokio runtime: {e}")))
}

/// Runs `records` on a fresh [`Engine`] with W ranks; returns the report, or the error that
/// stopped the run.
pub fn run(
    config: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
) -> Result<Report, RunError> {
    let rt = runtime()?;
    rt.block_on(async {
        let longest = records
            .iter()
            .map(|r| r.input_length + r.output_length)
            .max()
            .unwrap_or(1);
        let mut engine = Engine::start(config, longest).await?;
        let started = Instant::now();
        let outcome = replay(config, records, &mut engine, progress).await;
        let (figures, ranks) = engine.shutdown().await;
        outcome?;
        if let Some(path) = &config.trace_out {
            let mut recorders = vec![&figures.trace];
            recorders.extend(ranks.iter().map(|r| &r.trace));
            trace::write(path, &recorders, config.ranks).map_err(|e| RunError::Output {
                path: path.display().to_string(),
                why: e.to_string(),
            })?;
        }
        Ok(report::build(
            config,
            records,
            &figures,
            &ranks,
            started.elapsed(),
        ))
    })
}

/// Submits each record when the virtual clock reaches its timestamp, and steps the engine
/// until every request finished.
async fn replay(
    c: &RunConfig,
    records: &[TraceRecord],
    engine: &mut Engine,
    progress: &mut dyn Progress,
) -> Result<(), RunError> {
    let total = records.len() as u64;
    let mut pending: VecDeque<(usize, &TraceRecord)> = records.iter().enumerate().collect();
    let mut now = 0.0f64;
    let mut idle_in_a_row = 0u64;
    loop {
        while let Some(&(i, r)) = pending.front()
            && r.timestamp as f64 <= now
        {
            pending.pop_front();
            let prompt = workload::prompt_tokens(r, c.hash_block_tokens, i as u64);
            engine.add(RequestId(i as u32), prompt, r.output_length)?;
        }
        if !engine.has_work() {
            match pending.front() {
                Some((_, r)) => {
                    now = r.timestamp as f64;
                    continue;
                }
                None => return Ok(()),
            }
        }
        let outcome = engine.step().await?;
        now += c.step_ms;
        let f = &engine.figures;
        progress.step(f.finished, total, f.steps, f.preemptions, f.loads_reported);
        if !outcome.idle {
            idle_in_a_row = 0;
            continue;
        }
        idle_in_a_row += 1;
        if idle_in_a_row > MAX_IDLE_STEPS {
            return Err(RunError::Stalled {
                steps: idle_in_a_row,
                requests: total - f.finished,
            });
        }
        if !pending
            .front()
            .is_some_and(|(_, r)| r.timestamp as f64 <= now)
        {
            engine.wait_idle().await;
        }
    }
}
