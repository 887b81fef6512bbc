//! The seam between a rank and the memory it moves: its KV arena (`KvArena`: what the forward
//! pass writes and what the checks read) and its transfer engine (`TransferEngine`: stores and
//! loads between the arena and the CPU offload pool). Two backends implement both:
//!
//! | backend | "GPU" arena | CPU pool | copies | module |
//! | --- | --- | --- | --- | --- |
//! | `host` | host memory | host memory | `memcpy` on a copy thread per rank | [`crate::transfer::host`] |
//! | `cuda` | device memory (cudarc) | one pinned allocation | `cuMemcpy*Async` on a transfer stream ordered after the compute stream | `cuda` |
//!
//! # When to call what
//!
//! * [`Backend::resolve`] once, in the engine, before any rank is built: `auto` becomes `host`
//!   or `cuda` here (with a printed line when it falls back), and `cuda` without a driver or a
//!   device is an error, so that a run never silently moves bytes somewhere else than asked.
//! * A rank then builds its arena and engine for the resolved backend
//!   (`RankSetup`), starts transfers in the order the rank driver hands them out
//!   and feeds each `CopyDone` back in the order they arrive: one queue per rank, completed
//!   in the order started, as vLLM's CPU offloading worker runs its transfers.

mod backend;
pub mod cuda;
pub mod host;
mod kernels;
pub mod shared;

pub use self::backend::Backend;

use kvrelay_core::{CopyRun, JobId, TransferDirection};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Transfers started and not yet completed, at most (per rank).
pub const COPY_QUEUE_BOUND: usize = 4096;

/// Why a transfer engine or an arena failed.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TransferError {
    /// The rank's copy queue is full (4,096 transfers in flight).
    #[error("copy queue full ({COPY_QUEUE_BOUND} transfers in flight)")]
    QueueFull,
    /// The copy thread stopped (it panicked, or the engine is shutting down).
    #[error("copy thread stopped")]
    Stopped,
    /// A copy thread could not be started.
    #[error("could not start a copy thread: {0}")]
    Thread(String),
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// One token slot of the arena and the word it must hold: `at` is its byte offset, its length
/// the arena's slot size.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Slot {
    pub at: usize,
    pub word: u64,
}

/// A rank's KV arena as the forward pass and the checks see it.
pub trait KvArena: Send {
    /// Fills each slot with its word (the forward's writes of one layer).
    fn fill(&mut self, slots: &[Slot]) -> Result<(), TransferError>;
    /// The index in `slots` of the first slot that does not hold its word in every byte.
    fn first_mismatch(&mut self, slots: &[Slot]) -> Result<Option<usize>, TransferError>;
}

/// One transfer to perform.
#[derive(Debug)]
pub struct CopyJob {
    pub job: JobId,
    pub direction: TransferDirection,
    pub runs: Vec<CopyRun>,
    /// A P/D load's source ([`crate::pd`]): its runs' `host` offsets are into the bytes read
    /// from the prefill engine, not into the CPU pool. `None`: a transfer with the CPU pool.
    pub remote: Option<RemoteRead>,
}

/// What a P/D load reads from the prefill engine: blocks `(index, group)` of its request.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct RemoteRead {
    pub request: kvrelay_core::RequestId,
    pub blocks: Vec<(u32, u32)>,
}

/// One transfer performed.
#[derive(Debug)]
pub struct CopyDone {
    pub job: JobId,
    pub direction: TransferDirection,
    pub bytes: u64,
    pub copies: u64,
    /// Time copying, not waiting in the queue.
    pub elapsed: Duration,
    /// `Err` when the copies failed (CUDA); the rank stops with it.
    pub result: Result<(), TransferError>,
    /// The transfer failed part-way (the simulation's injected fault): its destination holds
    /// neither the old nor the new bytes. The rank tells its driver `ok: false`; a strict
    /// worker absorbs it, a compat one stops (vLLM asserts).
    pub failed: bool,
}

/// Where transfers go: started in order, completions reported in that order on the channel
/// given at construction.
pub trait TransferEngine: Send {
    /// Starts `job`. Fails when the queue is full or the engine stopped.
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError>;
}
