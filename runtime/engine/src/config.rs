//! What a run is: [`RunConfig`], everything `kvrelay run` (or an embedding server) fixes before
//! the engine starts; the defaults are the embedded workload.

use std::path::PathBuf;

use kvrelay_core::{Mode, PolicyKind};
use serde::{Deserialize, Serialize};

use crate::events::KvEventsConfig;
use crate::pd::PdRunConfig;
use crate::rank::Completions;
use crate::tier::TierConfig;
use crate::transfer::Backend;
use crate::workload::{TraceSplit, WorkloadConfig};

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
    /// Bytes of one block of one layer on one rank (a multiple of 8 × `block_size`). Default:
    /// 2,048 (128 bytes a token slot) for the generated workload; with a trace 8 × `block_size`,
    /// one 8-byte word a token slot — a trace's hundreds of millions of tokens would otherwise
    /// be hundreds of GB to write, check and copy, and every byte is still checked.
    pub block_bytes: Option<u64>,
    /// GPU blocks per rank (the null block included). Default ([`RunConfig::gpu_blocks_for`]):
    /// with a trace, room for eight requests of `max_model_len`; without, 320 — small, so that
    /// the generated workload's requests are preempted and offloaded blocks are loaded back —
    /// or room for two requests of `max_model_len`, if more.
    pub gpu_blocks: Option<u32>,
    /// CPU offload blocks per rank. Default ([`RunConfig::cpu_blocks_for`]): 4,096, or four
    /// times the GPU pool, if more.
    pub cpu_blocks: Option<u32>,
    /// The longest request (prompt and output tokens) the engine admits, as vLLM's
    /// `max_model_len`: a pool that cannot hold one is refused at start, a longer prompt at
    /// submit. Default: the workload's longest request.
    pub max_model_len: Option<u32>,
    /// GPU blocks per CPU chunk (vLLM's offloaded block size / block size).
    pub blocks_per_chunk: u32,
    /// CPU eviction policy.
    pub policy: PolicyKind,
    /// `compat` (vLLM 0.33.0's semantics: a failed transfer stops the engine, as vLLM asserts)
    /// or `strict` (kvrelay's departures, a failed transfer absorbed: see `docs/COMPAT.md`).
    pub mode: Mode,
    /// Running requests at most. Default: 16 for the generated workload (small, so that
    /// requests wait and are preempted), 256 with a trace (vLLM's server default).
    pub max_num_seqs: Option<u32>,
    /// Tokens per step at most. Default: 1,024 for the generated workload, 8,192 with a trace
    /// (vLLM's server default with chunked prefill).
    pub max_num_batched_tokens: Option<u32>,
    /// Steps scheduled ahead of their output: 1 = synchronous, 2 = async scheduling (the next
    /// step is scheduled while the ranks run this one).
    pub async_depth: u32,
    /// Virtual milliseconds an engine step takes.
    pub step_ms: f64,
    /// Tokens per trace hash block (`hash_ids`). Default: 512 with a trace (the Mooncake
    /// format's), 64 for the generated workload.
    pub hash_block_tokens: Option<u32>,
    /// The generated workload (unused with `trace`).
    pub workload: WorkloadConfig,
    /// Replay this request trace (Mooncake format, `.jsonl` or `.jsonl.gz`) instead of
    /// generating the workload.
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests.
    pub requests: Option<usize>,
    /// Replay only the requests that arrive before this many seconds.
    pub until_s: Option<f64>,
    /// Replay only engine K of N's share (`"K/N"`: the requests whose index, after `requests`
    /// and `until_s`, is K mod N; see [`TraceSplit`]). The default `max_model_len` stays the
    /// whole workload's, so each share's engine has the pools the whole's would.
    pub trace_split: Option<TraceSplit>,
    /// Call every machine's `check_invariants()` after every step.
    pub check: bool,
    /// Write a Chrome / Perfetto timeline of steps and transfers here.
    pub timeline: Option<PathBuf>,
    /// When a rank's driver hears that a transfer completed: `after-steps` N (the default, 1:
    /// every run of a workload takes the same steps) or `as-arrived` (a real engine's
    /// timing; the simulation's).
    pub completions: Completions,
    /// Serve Prometheus metrics on `HOST:PORT` while the run lasts (port 0 picks a free one;
    /// see `docs/METRICS.md`).
    pub metrics: Option<String>,
    /// Seconds the metrics stay served after the run ended, so a scraper reads the final
    /// totals (`kvrelay run` only; a stop cuts it short).
    pub metrics_linger_s: f64,
    /// The `model_name` label of every series (vLLM's served model name).
    pub metrics_model_name: String,
    /// Publish KV events in vLLM's wire format (see `docs/KV_EVENTS.md`); `None`: none.
    pub kv_events: Option<KvEventsConfig>,
    /// A shared tier behind the CPU pools (see `docs/TIERING.md`); `None`: the CPU pools only.
    /// Needs the host backend (worker processes share their pools with the engine).
    pub tier: Option<TierConfig>,
    /// This engine's side of prefill/decode disaggregation (`kvrelay pd`, [`crate::pd`]): the
    /// P/D connector instead of the offloading one. Needs in-process ranks, the host backend
    /// and no tier.
    pub pd: Option<PdRunConfig>,
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
            block_bytes: None,
            gpu_blocks: None,
            cpu_blocks: None,
            max_model_len: None,
            blocks_per_chunk: 1,
            policy: PolicyKind::Lru,
            mode: Mode::Compat,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            async_depth: 1,
            step_ms: 25.0,
            hash_block_tokens: None,
            workload: WorkloadConfig::default(),
            trace: None,
            requests: None,
            until_s: None,
            trace_split: None,
            check: false,
            timeline: None,
            completions: Completions::default(),
            metrics: None,
            metrics_linger_s: 0.0,
            metrics_model_name: "kvrelay".into(),
            kv_events: None,
            tier: None,
            pd: None,
        }
    }
}

impl RunConfig {
    /// Why this configuration cannot run as (one side of) a P/D pair, `None` if it can: the
    /// KV server reads the ranks' arenas, so they must be in-process and in host memory; a
    /// decode engine needs its source. `backend` is [`RunConfig::backend`] resolved (the
    /// engine's check) or not (the pair's, before any process starts: `auto` passes, its
    /// engines resolve it).
    pub fn pd_unsupported(&self, backend: Backend) -> Option<&'static str> {
        if self.workers != Workers::InProcess {
            Some(
                "P/D needs in-process ranks (--workers in-process): the KV server reads their arenas",
            )
        } else if backend == Backend::Cuda {
            Some("P/D needs the host backend (--backend host) for now")
        } else if (self.pd.as_ref())
            .is_some_and(|p| p.role == crate::pd::PdRole::Decode && p.source.is_none())
        {
            Some("a P/D decode engine needs its source (the prefill engine's KV server)")
        } else {
            None
        }
    }

    /// Bytes of one block of one layer on one rank: as given, else 2,048, or one word a token
    /// slot with a trace.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes.unwrap_or(if self.trace.is_some() {
            8 * u64::from(self.block_size)
        } else {
            2048
        })
    }

    /// Running requests at most: as given, else 256 with a trace, 16 without.
    pub fn max_seqs(&self) -> u32 {
        self.max_num_seqs
            .unwrap_or(if self.trace.is_some() { 256 } else { 16 })
    }

    /// Tokens per step at most: as given, else 8,192 with a trace, 1,024 without.
    pub fn max_batched_tokens(&self) -> u32 {
        self.max_num_batched_tokens
            .unwrap_or(if self.trace.is_some() { 8192 } else { 1024 })
    }

    /// Tokens per trace hash block: as given, else 512 with a trace, 64 without.
    pub fn hash_block(&self) -> u32 {
        self.hash_block_tokens
            .unwrap_or(if self.trace.is_some() { 512 } else { 64 })
            .max(1)
    }

    /// GPU blocks per rank for requests of at most `max_model_len` tokens: as given, else room
    /// for eight such requests with a trace (a production pool, where a request waits for
    /// compute rather than for memory), and without one 320 (small, so that the generated
    /// workload's requests are preempted and offloaded blocks loaded back) or room for two,
    /// if more. The null block comes on top.
    pub fn gpu_blocks_for(&self, max_model_len: u32) -> u32 {
        self.gpu_blocks.unwrap_or_else(|| {
            let one = max_model_len.div_ceil(self.block_size.max(1));
            let times = if self.trace.is_some() { 8 } else { 2 };
            320u32.max(one.saturating_mul(times).saturating_add(1))
        })
    }

    /// CPU blocks per rank beside a GPU pool of `gpu_blocks`: as given, else 4,096 or four
    /// times the GPU pool, if more (a multiple of `blocks_per_chunk`).
    pub fn cpu_blocks_for(&self, gpu_blocks: u32) -> u32 {
        self.cpu_blocks.unwrap_or_else(|| {
            let n = 4096u32.max(gpu_blocks.saturating_mul(4));
            let per = self.blocks_per_chunk.max(1);
            n.div_ceil(per).saturating_mul(per)
        })
    }
}
