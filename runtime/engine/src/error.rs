//! Why a run stopped: [`RunError`], one variant per cause, each naming the rank, request or
//! file involved.

use kvrelay_core::{EngineError, InvariantViolation, PlanError, RankError, RequestId};

use crate::transfer::TransferError;
use crate::transport::wire::WireError;
use crate::workload::TraceError;

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The configuration is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// The KV-event publisher stopped (`--kv-events`): its task ended, or the core named a
    /// block the publisher never saw stored.
    #[error("kv-events: {0}")]
    Events(String),
    /// The shared tier could not be reached at start, or its IO stopped (`--tier`).
    #[error("tier: {0}")]
    Tier(#[from] crate::tier::StoreError),
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
        /// `loaded` (checked when its load completed), `written` (checked right after a
        /// forward wrote it) or `read` (its request's first read found another prefix's KV).
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
    /// A block was about to change while something trusted or used it (see
    /// `rank::Watch`): a block reused too early.
    #[error("rank {rank}: block {block:?} (request {request:?}) {hazard}")]
    Hazard {
        /// The rank.
        rank: u32,
        /// The request whose write, read or transfer it was.
        request: RequestId,
        /// The GPU block.
        block: kvrelay_core::BlockId,
        /// What was refused.
        hazard: crate::rank::Hazard,
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
    Wire(#[from] WireError),
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
    /// [`crate::api::EngineHandle`] cannot be served.
    #[error("the engine stopped")]
    EngineStopped,
    /// The run was asked to stop before its end ([`crate::stop`]); its ranks are stopped.
    #[error(
        "interrupted after {steps} steps, {finished} of {requests} requests finished; ranks \
         stopped ({ranks_killed} killed after the grace period)"
    )]
    Interrupted {
        /// Engine steps taken.
        steps: u64,
        /// Requests finished.
        finished: u64,
        /// Requests of the run.
        requests: u64,
        /// Ranks still running when the grace period ended (or an immediate stop was asked),
        /// and killed.
        ranks_killed: u32,
    },
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
    /// The engine has requests it can never run: nothing runnable, nothing in flight.
    #[error("stalled after {steps} idle steps: nothing runnable and nothing in flight; {} request(s) stuck: {}", requests.len(), names(requests))]
    Stalled {
        /// Idle steps in a row.
        steps: u64,
        /// The requests stuck (the scheduler's, waiting and running).
        requests: Vec<RequestId>,
    },
    /// The GPU pool cannot hold one request of `max_model_len` tokens (vLLM refuses this at
    /// start-up too).
    #[error(
        "the GPU pool ({gpu_blocks} blocks of {block_size} tokens, the null block included) cannot \
         hold one request of max_model_len {max_model_len} tokens, which needs {needed} blocks: \
         give --gpu-blocks {} or more, or a smaller --max-model-len", needed + 1
    )]
    PoolTooSmall {
        /// The longest request admitted.
        max_model_len: u32,
        /// Tokens per block.
        block_size: u32,
        /// Blocks one such request needs.
        needed: u32,
        /// GPU blocks per rank.
        gpu_blocks: u32,
    },
    /// A prompt of `max_model_len` tokens or more (vLLM refuses it at submit).
    #[error(
        "request {request:?} refused: a prompt of {prompt_tokens} tokens does not fit max_model_len {max_model_len}"
    )]
    Refused {
        /// The request.
        request: RequestId,
        /// Its prompt tokens.
        prompt_tokens: u64,
        /// The engine's `max_model_len`.
        max_model_len: u32,
    },
    /// A P/D engine process failed, or its link did (`kvrelay pd`).
    #[error("{engine} engine process: {why}")]
    EngineProcess {
        /// Which engine (`prefill`, `decode`).
        engine: String,
        /// What happened.
        why: String,
    },
    /// A request whose `kv_transfer_params` do not read as P/D params (refused at submit,
    /// never treated as absent).
    #[error("request {request:?} refused: {error}")]
    BadParams {
        /// The request.
        request: RequestId,
        /// What is wrong with them.
        error: kvrelay_core::pd::PdParamsError,
    },
}

/// Up to 8 request ids, then how many more.
fn names(ids: &[RequestId]) -> String {
    let mut s: Vec<String> = ids.iter().take(8).map(|r| r.0.to_string()).collect();
    if ids.len() > 8 {
        s.push(format!("and {} more", ids.len() - 8));
    }
    s.join(", ")
}
