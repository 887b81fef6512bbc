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
use std::time::Instant;

use kvrelay_core::{CopyRun, TransferDirection};
use tokio::sync::{Notify, mpsc};

use crate::content::{fill, holds};
use crate::transfer::shared::SharedBytes;
use crate::transfer::{
    COPY_QUEUE_BOUND, CopyDone, CopyJob, KvArena, Slot, TransferEngine, TransferError,
};

/// A rank's "GPU" KV arena in host memory, shared by its forward pass and its copy thread.
#[derive(Clone, Debug)]
pub struct HostArena {
    bytes: Arc<RwLock<Vec<u8>>>,
    slot_bytes: usize,
}

impl HostArena {
    /// A zeroed arena of `total` bytes whose token slots have `slot_bytes` bytes.
    pub fn new(total: usize, slot_bytes: usize) -> Self {
        Self {
            bytes: Arc::new(RwLock::new(vec![0u8; total])),
            slot_bytes,
        }
    }

    /// The arena's bytes, shared with a transfer engine.
    pub fn shared(&self) -> Arc<RwLock<Vec<u8>>> {
        self.bytes.clone()
    }
}

/// A rank's CPU offload pool in host memory, shared by its copy thread and, with a shared tier,
/// the engine's tier IO (which reads chunks being cascaded and writes chunks being promoted:
/// the core's pins and reservations keep it off every chunk a transfer touches). A worker
/// process's pool is a memory file it shares with the engine ([`HostPool::shared`]).
#[derive(Clone, Debug)]
pub struct HostPool(Arc<RwLock<PoolBytes>>);

/// A pool's bytes: this process's own, or shared with another process.
#[derive(Debug)]
pub enum PoolBytes {
    Own(Vec<u8>),
    Shared(SharedBytes),
}

impl std::ops::Deref for PoolBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Own(v) => v,
            Self::Shared(s) => s,
        }
    }
}

impl std::ops::DerefMut for PoolBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Own(v) => v,
            Self::Shared(s) => s,
        }
    }
}

impl HostPool {
    /// A zeroed pool of `total` bytes.
    pub fn new(total: usize) -> Self {
        Self::of(PoolBytes::Own(vec![0u8; total]))
    }

    /// A zeroed pool of `total` bytes in a memory file a worker process can map
    /// ([`HostPool::open_shared`] with [`HostPool::shared_path`]).
    pub fn shared(total: usize) -> std::io::Result<Self> {
        SharedBytes::create(total).map(|s| Self::of(PoolBytes::Shared(s)))
    }

    /// The pool another process created with [`HostPool::shared`], mapped here.
    pub fn open_shared(path: &std::path::Path, total: usize) -> std::io::Result<Self> {
        SharedBytes::open(path, total).map(|s| Self::of(PoolBytes::Shared(s)))
    }

    fn of(bytes: PoolBytes) -> Self {
        Self(Arc::new(RwLock::new(bytes)))
    }

    /// Where another process maps it (a pool made by [`HostPool::shared`]).
    pub fn shared_path(&self) -> Option<std::path::PathBuf> {
        match &*self.read() {
            PoolBytes::Shared(s) => Some(s.path().to_owned()),
            PoolBytes::Own(_) => None,
        }
    }

    /// Reads the pool.
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, PoolBytes> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the pool.
    pub fn write(&self) -> std::sync::RwLockWriteGuard<'_, PoolBytes> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Two handles are equal when they share the pool.
impl PartialEq for HostPool {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The same arena (shared), not the same bytes.
impl PartialEq for HostArena {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.bytes, &other.bytes)
    }
}

impl KvArena for HostArena {
    fn fill(&mut self, slots: &[Slot]) -> Result<(), TransferError> {
        let mut arena = self.bytes.write().unwrap_or_else(|p| p.into_inner());
        for s in slots {
            fill(&mut arena[s.at..s.at + self.slot_bytes], s.word);
        }
        Ok(())
    }

    fn first_mismatch(&mut self, slots: &[Slot]) -> Result<Option<usize>, TransferError> {
        let arena = self.bytes.read().unwrap_or_else(|p| p.into_inner());
        Ok(slots
            .iter()
            .position(|s| !holds(&arena[s.at..s.at + self.slot_bytes], s.word)))
    }
}

/// The host engine of one rank.
#[derive(Debug)]
pub struct HostEngine {
    tx: Option<SyncSender<CopyJob>>,
    thread: Option<JoinHandle<()>>,
}

impl HostEngine {
    /// Starts the copy thread of a rank whose arena is `gpu` and whose CPU pool is `host`.
    /// Completions go to `done`; `wake` is notified after each.
    pub fn spawn(
        rank: u32,
        gpu: &HostArena,
        host: HostPool,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
    ) -> Result<Self, TransferError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(COPY_QUEUE_BOUND);
        let gpu = gpu.bytes.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvrelay-copy-{rank}"))
            .spawn(move || copy_loop(&rx, &gpu, &host, &done, &wake))
            .map_err(|e| TransferError::Thread(e.to_string()))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }
}

impl TransferEngine for HostEngine {
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError> {
        let tx = self.tx.as_ref().ok_or(TransferError::Stopped)?;
        tx.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => TransferError::QueueFull,
            TrySendError::Disconnected(_) => TransferError::Stopped,
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
    gpu: &RwLock<Vec<u8>>,
    host: &HostPool,
    done: &mpsc::Sender<CopyDone>,
    wake: &Notify,
) {
    while let Ok(job) = rx.recv() {
        let (bytes, elapsed) = match job.direction {
            TransferDirection::Store => {
                let arena = gpu.read().unwrap_or_else(|p| p.into_inner());
                let mut host = host.write();
                let started = Instant::now();
                (store(&job.runs, &arena, &mut host), started.elapsed())
            }
            TransferDirection::Load => {
                let mut arena = gpu.write().unwrap_or_else(|p| p.into_inner());
                let host = host.read();
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
            result: Ok(()),
            failed: false,
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
