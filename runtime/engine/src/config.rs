//! What a run is: [`RunConfig`], everything `kvrelay run` (or an embedding server) fixes before
//! the engine starts; the defaults are the embedded workload.

use std::path::PathBuf;

use kvrelay_core::{Mode, PolicyKind};
use serde::{Deserialize, Serialize};

use crate::transfer::Backend;
use crate::workload::WorkloadConfig;

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
    /// or `strict` (kvrelay's departures, a failed transfer absorbed: see `docs/COMPAT.md`).
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
    /// Replay this request trace (Mooncake format) instead of generating the workload.
    pub trace: Option<PathBuf>,
    /// Call every machine's `check_invariants()` after every step.
    pub check: bool,
    /// Write a Chrome / Perfetto timeline of steps and transfers here.
    pub timeline: Option<PathBuf>,
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
            timeline: None,
        }
    }
}
