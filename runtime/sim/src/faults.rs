//! The fault seams: a crashed rank and a transfer engine that moves the wrong bytes, entered
//! only through the engine's seams ([`Transport`], [`TransferEngine`]), for the simulation and
//! for tests of the engine that must see it fail.
//!
//! * [`LoseRank`] — a transport around another whose rank stops answering after N steps, as a
//!   crashed rank does (no report, no error): the engine must name it and stop
//!   (`RunError::RankGone`, or `RunError::Worker` for a worker process).
//! * [`CorruptFirstLoad`] — a transfer engine around another whose first load of two or more
//!   copies reads each copy from the other's host slot: real bytes, wrong ones. The rank's check
//!   must catch it when the load completes (`RunError::Corrupt { what: "loaded", .. }`).
//! * [`CorruptingInProcess`] — in-process ranks, rank 0's transfer engine a [`CorruptFirstLoad`].
//! * the binary `kvrelay-corrupting-worker` — `kvrelay worker` whose rank 0's transfer engine is
//!   a [`CorruptFirstLoad`]: give it as `RunConfig::worker_exe` with `Workers::Process`.
//!
//! Pass a transport to `kvrelay_engine::run_with` or `Engine::start_with`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvrelay_core::TransferDirection;
use kvrelay_engine::RunError;
use kvrelay_engine::rank::{RankReport, RankSetup, StepMsg};
use kvrelay_engine::transfer::{CopyJob, TransferEngine, TransferError};
use kvrelay_engine::transport::{BoxFuture, RankConn, Transport};
use tokio::sync::{Notify, mpsc};

/// Where a lost rank goes silent: its first `after_steps - 1` reports pass, the next is dropped,
/// and from then on nothing passes either way. Shared by the two relays of the rank.
#[derive(Clone, Debug)]
pub(crate) struct Loss {
    after_steps: u64,
    cut: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl Loss {
    pub(crate) fn new(after_steps: u64) -> Self {
        Self {
            after_steps,
            cut: Arc::new(AtomicBool::new(false)),
            notify: Arc::new(Notify::new()),
        }
    }

    /// Whether the rank is lost at its `nth` report (counted from 1).
    pub(crate) fn lost_at(&self, nth: u64) -> bool {
        let lost = nth >= self.after_steps;
        if lost {
            self.cut.store(true, Ordering::Relaxed);
            self.notify.notify_one();
        }
        lost
    }

    /// Whether the rank was lost.
    pub(crate) fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }

    /// Completes once the rank is lost.
    pub(crate) async fn cut(&self) {
        if !self.is_cut() {
            self.notify.notified().await;
        }
    }
}

/// A transport whose rank `rank` is lost after `after_steps` steps (see the module docs).
#[derive(Debug)]
pub struct LoseRank<T> {
    /// The transport that reaches the ranks.
    pub inner: T,
    /// The rank lost.
    pub rank: u32,
    /// Its steps before it goes silent (at least 1).
    pub after_steps: u64,
}

impl<T: Transport> Transport for LoseRank<T> {
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            if setup.rank != self.rank {
                return self.inner.connect(setup, wake, reports).await;
            }
            let (rank_reports, from_rank) = mpsc::channel(1);
            let conn = self.inner.connect(setup, wake, rank_reports).await?;
            let (steps, from_engine) = mpsc::channel(1);
            let loss = Loss::new(self.after_steps);
            tokio::spawn(pass_steps(from_engine, conn.steps, loss.clone()));
            tokio::spawn(pass_reports(from_rank, reports, loss));
            Ok(RankConn {
                steps,
                task: conn.task,
            })
        })
    }
}

/// Engine → rank until the rank is lost; then the rank's end is dropped (it stops), and the
/// next step the engine sends ends the relay (the engine's next send fails).
pub(crate) async fn pass_steps(
    mut from: mpsc::Receiver<StepMsg>,
    to: mpsc::Sender<StepMsg>,
    loss: Loss,
) {
    let mut to = Some(to);
    loop {
        let m = tokio::select! {
            biased;
            () = loss.cut(), if to.is_some() => {
                to = None;
                continue;
            }
            m = from.recv() => m,
        };
        let (Some(m), Some(tx)) = (m, &to) else {
            return;
        };
        if tx.send(m).await.is_err() {
            return;
        }
    }
}

/// Rank → engine until the rank is lost.
async fn pass_reports(
    mut from: mpsc::Receiver<RankReport>,
    to: mpsc::Sender<RankReport>,
    loss: Loss,
) {
    let mut nth = 0;
    while let Some(rep) = from.recv().await {
        nth += 1;
        if loss.lost_at(nth) || to.send(rep).await.is_err() {
            return;
        }
    }
}

/// A transfer engine whose first load of two or more copies swaps the host sources of its first
/// two copies (see the module docs).
pub struct CorruptFirstLoad {
    inner: Box<dyn TransferEngine>,
    done: bool,
}

impl std::fmt::Debug for CorruptFirstLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CorruptFirstLoad")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl CorruptFirstLoad {
    /// `inner`, with its first eligible load corrupted.
    pub fn wrap(inner: Box<dyn TransferEngine>) -> Box<dyn TransferEngine> {
        Box::new(Self { inner, done: false })
    }
}

impl TransferEngine for CorruptFirstLoad {
    fn start(&mut self, mut job: CopyJob) -> Result<(), TransferError> {
        if !self.done
            && job.direction == TransferDirection::Load
            && let [a, b, ..] = job.runs.as_mut_slice()
            && a.len == b.len
        {
            std::mem::swap(&mut a.host, &mut b.host);
            self.done = true;
        }
        self.inner.start(job)
    }
}

/// In-process ranks (as `kvrelay_engine::transport::InProcess`), rank 0's transfer engine a
/// [`CorruptFirstLoad`].
#[derive(Debug, Default)]
pub struct CorruptingInProcess;

impl Transport for CorruptingInProcess {
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let task = if setup.rank == 0 {
                setup.build_with(wake, CorruptFirstLoad::wrap)?
            } else {
                setup.build(wake)?
            };
            let (steps, rx) = mpsc::channel::<StepMsg>(1);
            let task = tokio::spawn(task.run(rx, reports));
            Ok(RankConn { steps, task })
        })
    }
}
