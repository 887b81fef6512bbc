//! What a rank is built from ([`RankSetup`]: the same for an in-process rank and a worker
//! process, which receives it in its first frame), and building it: the backend's arena and
//! transfer engine — or a decode rank's remote engine ([`crate::pd`]) — under the worker
//! connector the engine's connector calls for.

use std::sync::Arc;

use kvrelay_core::{
    GroupKind, KvLayout, Mode, OffloadingWorker, OffloadingWorkerConfig, PdWorker, RankConfig,
    RankDriver,
};
use tokio::sync::{Notify, mpsc};

use super::RankTask;
use crate::RunError;
use crate::pd::fetch::RemoteEngine;
use crate::report::perfetto::Recorder;
use crate::transfer::cuda::{CudaArena, CudaEngine, Device};
use crate::transfer::host::{HostArena, HostEngine, HostPool};
use crate::transfer::{
    Backend, COPY_QUEUE_BOUND, CopyDone, CopyJob, KvArena, TransferEngine, TransferError,
};

/// The rank's fixed shape.
#[derive(Clone, Debug)]
pub struct RankShape {
    pub gpu: KvLayout,
    pub host: KvLayout,
    pub block_size: u32,
    pub blocks_per_chunk: u32,
}

/// Everything a rank is built from: the same for an in-process rank and a worker process
/// (which receives it in its first frame).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankSetup {
    pub rank: u32,
    /// `host` or `cuda` (resolved by the engine, never `auto`).
    pub backend: Backend,
    pub gpu: KvLayout,
    pub host: KvLayout,
    pub block_size: u32,
    pub blocks_per_chunk: u32,
    pub groups: Vec<GroupKind>,
    /// The offloading worker's mode: what a failed transfer does (the engine's mode).
    pub mode: Mode,
    pub check: bool,
    /// Record steps and transfers for the timeline (`--timeline`).
    pub timeline: bool,
    /// When the driver hears of a completed transfer.
    pub completions: Completions,
    /// The CPU pool, when the engine shares it (a shared tier reads and writes it; host backend;
    /// in-process ranks use it as it is, worker processes map `shared_pool`). `None`: the rank
    /// allocates its own.
    #[serde(skip)]
    pub host_pool: Option<HostPool>,
    /// A worker process's CPU pool, when the engine's shared tier reads and writes it: the
    /// engine's memory file to map ([`HostPool::open_shared`]; `None`: the rank allocates its
    /// own, or `host_pool` is given).
    pub shared_pool: Option<std::path::PathBuf>,
    /// The rank's part in P/D (`None`: the offloading connector's worker).
    pub pd: Option<RankPd>,
    /// The "GPU" arena, when the engine shares it (a prefill engine's KV server reads held
    /// blocks from it; host backend, in-process ranks only). `None`: the rank allocates its own.
    #[serde(skip)]
    pub arena: Option<HostArena>,
}

/// A rank's part in prefill/decode disaggregation ([`crate::pd`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankPd {
    /// Failed loads as invalid blocks (`true`) or request-level `failed_recving`.
    pub failures_as_blocks: bool,
    /// A decode engine's: where its loads read (the prefill engine's KV server), and how long
    /// one read may take before it is a failed load.
    pub source: Option<crate::pd::Source>,
}

/// When a rank's driver hears that a transfer completed.
#[derive(Clone, Copy, Debug, Eq, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Completions {
    /// At the `Collect` of the step `n` steps after the one that started it (or sooner, when a
    /// step waits for it), whenever its copies really finished: every run of a workload then
    /// takes the same steps, whatever the machine's speed. 0: the step that started it.
    AfterSteps(u32),
    /// As soon as its copies finish (fed at the next `Collect` or wait): what a real engine
    /// sees; the simulation's order.
    AsArrived,
}

impl Default for Completions {
    fn default() -> Self {
        Self::AfterSteps(1)
    }
}

impl RankSetup {
    /// The rank task with its arena and transfer engine; `wake` is notified after every
    /// completed transfer.
    pub fn build(&self, wake: Arc<Notify>) -> Result<RankTask, RunError> {
        self.build_with(wake, std::convert::identity)
    }

    /// [`RankSetup::build`] with the backend's transfer engine passed through `wrap` first: the
    /// transfer-engine seam, where a test or a simulation puts an engine of its own around the
    /// backend's (to delay, fail or corrupt transfers).
    pub fn build_with(
        &self,
        wake: Arc<Notify>,
        wrap: impl FnOnce(Box<dyn TransferEngine>) -> Box<dyn TransferEngine>,
    ) -> Result<RankTask, RunError> {
        let failed = |error: TransferError| RunError::Transfer {
            rank: self.rank,
            error,
        };
        let (arena_bytes, host_bytes) = (
            self.gpu.total_bytes() as usize,
            self.host.total_bytes() as usize,
        );
        let slot_bytes = (self.gpu.block_bytes() / u64::from(self.block_size)) as usize;
        let (done_tx, done_rx) = mpsc::channel(COPY_QUEUE_BOUND);
        let (arena, engine): (Box<dyn KvArena>, Box<dyn TransferEngine>) = match self.backend {
            Backend::Cuda if self.host_pool.is_some() || self.shared_pool.is_some() => {
                return Err(RunError::Config(
                    "a shared CPU pool (the shared tier) needs the host backend".into(),
                ));
            }
            Backend::Cuda if self.pd.is_some() => {
                return Err(RunError::Config(
                    "P/D (kvrelay pd) needs the host backend for now".into(),
                ));
            }
            Backend::Cuda => {
                let dev = Device::open(arena_bytes).map_err(failed)?;
                let engine = CudaEngine::spawn(self.rank, dev.clone(), host_bytes, done_tx, wake)
                    .map_err(failed)?;
                let arena = CudaArena::new(dev, slot_bytes).map_err(failed)?;
                (Box::new(arena), Box::new(engine))
            }
            Backend::Host | Backend::Auto => {
                let arena =
                    (self.arena.clone()).unwrap_or_else(|| HostArena::new(arena_bytes, slot_bytes));
                let pool = self.pool(host_bytes)?;
                let (done, w) = (done_tx.clone(), wake.clone());
                let host = HostEngine::spawn(self.rank, &arena, pool, done, w).map_err(failed)?;
                let engine: Box<dyn TransferEngine> =
                    match self.pd.as_ref().and_then(|p| p.source.clone()) {
                        Some(s) => Box::new(Dispatch {
                            host,
                            remote: RemoteEngine::spawn(self.rank, &arena, s, done_tx, wake),
                        }),
                        None => Box::new(host),
                    };
                (Box::new(arena), engine)
            }
        };
        Ok(self.build_on(arena, wrap(engine), done_rx))
    }

    /// The rank's CPU pool: the engine's (in-process, or its memory file mapped here), or its own.
    fn pool(&self, bytes: usize) -> Result<HostPool, RunError> {
        match (&self.host_pool, &self.shared_pool) {
            (Some(p), _) => Ok(p.clone()),
            (None, Some(path)) => HostPool::open_shared(path, bytes).map_err(|e| {
                RunError::Config(format!(
                    "rank {}: the CPU pool the engine shares ({}): {e}",
                    self.rank,
                    path.display()
                ))
            }),
            (None, None) => Ok(HostPool::new(bytes)),
        }
    }

    /// The rank task over a given arena and transfer engine whose completions arrive on `done`
    /// (the simulation's engine; [`RankSetup::build`] makes the backend's).
    pub fn build_on(
        &self,
        arena: Box<dyn KvArena>,
        engine: Box<dyn TransferEngine>,
        done_rx: mpsc::Receiver<CopyDone>,
    ) -> RankTask {
        let offloading = OffloadingWorker::new(OffloadingWorkerConfig {
            blocks_per_chunk: self.blocks_per_chunk,
            is_store_writer: true,
            bytes_per_block: self.gpu.block_bytes() * u64::from(self.gpu.layers()),
            mode: self.mode,
        });
        let pd = (self.pd.as_ref()).map(|p| PdWorker::new(p.failures_as_blocks));
        let worker = crate::connector::worker(offloading, pd);
        let rc = RankConfig {
            layers: self.gpu.layers(),
            block_size: self.block_size,
            groups: self.groups.clone(),
        };
        let shape = RankShape {
            gpu: self.gpu.clone(),
            host: self.host.clone(),
            block_size: self.block_size,
            blocks_per_chunk: self.blocks_per_chunk,
        };
        let mut task = RankTask::new(
            self.rank,
            RankDriver::new(rc, worker),
            shape,
            arena,
            engine,
            done_rx,
            self.check,
        );
        task.stats.timeline = Recorder::new(self.timeline);
        task.completions = self.completions;
        task
    }
}

/// A decode rank's transfer engine: its P/D loads ([`CopyJob::remote`]) read from the prefill
/// engine, its offloading transfers move between the arena and the CPU pool. Both report on
/// the rank's one completion channel.
struct Dispatch {
    host: HostEngine,
    remote: RemoteEngine,
}

impl TransferEngine for Dispatch {
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError> {
        match job.remote {
            Some(_) => self.remote.start(job),
            None => self.host.start(job),
        }
    }
}
