//! The host transfer engine: a rank's "GPU" KV arena and its CPU offload pool are both host
//! memory, and a transfer is the [`copy_plan`](kvrelay_core::copy_plan) of its blocks performed
//! with `memcpy` on a copy thread of the rank.
//!
//! # Ordering
//!
//! One copy thread per rank runs the transfers in the order they were started and reports each
//! completion in that order, as vLLM's CPU offloading worker runs its transfers serially. The
//! rank's forward pass and the copy thread share the arena behind a `RwLock`: a store reads the
//! arena, a load and the forward's writes write it. The lock makes the sharing memory-safe; it
//! is the core's fences (I-4: no block rewritten while a store reads it, no block read before
//! its load completed) that make it *correct*, and the content checks of the rank show when
//! they do not hold.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvrelay_core::{CopyRun, JobId, TransferDirection};
use tokio::sync::{Notify, mpsc};

/// Transfers started and not yet copied, at most (per rank).
pub(crate) const COPY_QUEUE_BOUND: usize = 4096;

/// A rank's "GPU" KV arena, shared by its forward pass and its copy thread.
pub(crate) type Arena = Arc<RwLock<Vec<u8>>>;

/// One transfer to perform.
#[derive(Debug)]
pub(crate) struct CopyJob {
    pub(crate) job: JobId,
    pub(crate) direction: TransferDirection,
    pub(crate) runs: Vec<CopyRun>,
    /// Test-only fault: flip one byte of the host side before a load copies it.
    pub(crate) corrupt: bool,
}

/// One transfer performed.
#[derive(Debug)]
pub(crate) struct CopyDone {
    pub(crate) job: JobId,
    pub(crate) direction: TransferDirection,
    pub(crate) bytes: u64,
    pub(crate) copies: u64,
    /// Time copying (the arena lock held), not waiting for the lock.
    pub(crate) elapsed: Duration,
}

/// Where transfers go: started in order, completions reported in order on the channel given at
/// construction.
pub(crate) trait TransferEngine: Send {
    /// Starts `job`. Fails when the engine's queue is full or the engine stopped.
    fn start(&mut self, job: CopyJob) -> Result<(), EngineGone>;
}

/// The transfer engine stopped or its queue is full.
#[derive(Debug, thiserror::Error)]
#[error("transfer engine: {0}")]
pub(crate) struct EngineGone(pub(crate) &'static str);

/// The host engine of one rank.
#[derive(Debug)]
pub(crate) struct HostEngine {
    tx: Option<SyncSender<CopyJob>>,
    thread: Option<JoinHandle<()>>,
}

impl HostEngine {
    /// Starts the copy thread of a rank whose arena is `gpu` and whose host pool has
    /// `host_bytes` bytes. Completions go to `done`; `wake` is notified after each.
    pub(crate) fn spawn(
        rank: u32,
        gpu: Arena,
        host_bytes: usize,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
    ) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel(COPY_QUEUE_BOUND);
        let thread = std::thread::Builder::new()
            .name(format!("kvrelay-copy-{rank}"))
            .spawn(move || copy_loop(&rx, &gpu, vec![0u8; host_bytes], &done, &wake))
            .expect("spawn a copy thread");
        Self {
            tx: Some(tx),
            thread: Some(thread),
        }
    }
}

impl TransferEngine for HostEngine {
    fn start(&mut self, job: CopyJob) -> Result<(), EngineGone> {
        let tx = self.tx.as_ref().ok_or(EngineGone("stopped"))?;
        tx.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => EngineGone("copy queue full"),
            TrySendError::Disconnected(_) => EngineGone("copy thread gone"),
        })
    }
}

impl Drop for HostEngine {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn copy_loop(
    rx: &Receiver<CopyJob>,
    gpu: &Arena,
    mut host: Vec<u8>,
    done: &mpsc::Sender<CopyDone>,
    wake: &Notify,
) {
    while let Ok(job) = rx.recv() {
        if job.corrupt
            && let Some(r) = job.runs.first()
        {
            host[r.host as usize] ^= 0x5a;
        }
        let (bytes, elapsed) = match job.direction {
            TransferDirection::Store => {
                let arena = gpu.read().unwrap_or_else(|p| p.into_inner());
                let started = Instant::now();
                (store(&job.runs, &arena, &mut host), started.elapsed())
            }
            TransferDirection::Load => {
                let mut arena = gpu.write().unwrap_or_else(|p| p.into_inner());
                let started = Instant::now();
                (load(&job.runs, &host, &mut arena), started.elapsed())
            }
        };
        let out = CopyDone {
            job: job.job,
            direction: job.direction,
            bytes,
            copies: job.runs.len() as u64,
            elapsed,
        };
        if done.blocking_send(out).is_err() {
            return;
        }
        wake.notify_one();
    }
}

/// Copies `runs` from `gpu` into `host`; returns the bytes copied.
pub fn store(runs: &[CopyRun], gpu: &[u8], host: &mut [u8]) -> u64 {
    let mut n = 0;
    for r in runs {
        let (g, h, len) = (r.gpu as usize, r.host as usize, r.len as usize);
        host[h..h + len].copy_from_slice(&gpu[g..g + len]);
        n += r.len;
    }
    n
}

/// Copies `runs` from `host` into `gpu`; returns the bytes copied.
pub fn load(runs: &[CopyRun], host: &[u8], gpu: &mut [u8]) -> u64 {
    let mut n = 0;
    for r in runs {
        let (g, h, len) = (r.gpu as usize, r.host as usize, r.len as usize);
        gpu[g..g + len].copy_from_slice(&host[h..h + len]);
        n += r.len;
    }
    n
}
