//! The simulated seams: ranks in this process whose frames go through faulty relays
//! ([`SimTransport`]), and a transfer engine whose transfers take drawn virtual time, move their
//! bytes when they complete, and may fail part-way ([`SimTransferEngine`]). The shared tier's
//! store is `tier.rs`'s.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvrelay_core::TransferDirection;
use tokio::sync::{Notify, mpsc};

use crate::faults::Loss;
use crate::mix::{FaultMix, SimRng};
use crate::tier::SimStore;
use kvrelay_engine::engine::Engine;
use kvrelay_engine::rank::{RankDelta, RankReport, RankSetup, StepMsg};
use kvrelay_engine::tier::Store;
use kvrelay_engine::transfer::host::{HostArena, HostPool, load, store};
use kvrelay_engine::transfer::{
    COPY_QUEUE_BOUND, CopyDone, CopyJob, TransferEngine, TransferError,
};
use kvrelay_engine::transport::{BoxFuture, RankConn, Transport};
use kvrelay_engine::transport::{Clock, TokioClock};
use kvrelay_engine::{RunConfig, RunError};

/// In-process ranks whose transfer engine is a [`SimTransferEngine`] and whose frames go through relays
/// that delay and duplicate them.
#[derive(Debug)]
pub(super) struct SimTransport {
    pub(super) faults: FaultMix,
    /// Faults off (the quiescence phase).
    pub(super) calm: Arc<AtomicBool>,
    /// The rank that stops answering, and after how many steps.
    pub(super) lost: Option<(u32, u64)>,
    /// Rank 0's first load reads a corrupted host slot.
    pub(super) corrupt_first_load: bool,
    pub(super) seed: u64,
    /// The shared tier's store, when the run has one (its engines share it).
    pub(super) store: Option<Arc<SimStore>>,
}

impl SimTransport {
    /// The fault draws of one part of a rank, from its own random stream `r`.
    fn draws(&self, r: SimRng) -> Draws {
        Draws {
            r,
            f: self.faults,
            calm: self.calm.clone(),
        }
    }

    /// An engine of `config` over this transport, on tokio's (paused) clock.
    pub(super) async fn start(&self, config: &RunConfig) -> Result<Engine, String> {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::default());
        // The longest simulated request: a 70-token prompt and 24 output tokens (`arrivals`);
        // the smallest simulated pool (27 usable blocks of 4) holds it.
        let mut engine = Engine::start_with(config, MAX_MODEL_LEN, self, clock)
            .await
            .map_err(|e| format!("engine start: {e}"))?;
        if let Some(s) = &self.store {
            engine.share_tier_store(Store::Custom(s.clone()));
        }
        Ok(engine)
    }
}

/// The simulated engines' `max_model_len`.
pub(super) const MAX_MODEL_LEN: u32 = 96;

impl Transport for SimTransport {
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let mut r = SimRng::new(self.seed ^ u64::from(setup.rank).wrapping_mul(0x9e37));
            let loss = self
                .lost
                .filter(|&(rank, _)| rank == setup.rank)
                .map(|(_, after)| Loss::new(after));
            let slot_bytes = (setup.gpu.block_bytes() / u64::from(setup.block_size)) as usize;
            let arena = HostArena::new(setup.gpu.total_bytes() as usize, slot_bytes);
            let (done_tx, done_rx) = mpsc::channel(COPY_QUEUE_BOUND);
            // The CPU pool the engine shares with the rank when it has a tier (the tier reads
            // and writes it), else the rank's own.
            let host = (setup.host_pool.clone())
                .unwrap_or_else(|| HostPool::new(setup.host.total_bytes() as usize));
            let engine = SimTransferEngine::spawn(
                arena.shared(),
                host,
                done_tx,
                wake,
                self.draws(r.fork(1)),
                self.corrupt_first_load && setup.rank == 0,
            );
            let task = setup.build_on(Box::new(arena), Box::new(engine), done_rx);
            let (steps, from_engine) = mpsc::channel::<StepMsg>(1);
            let (to_rank, rank_steps) = mpsc::channel::<StepMsg>(1);
            let (rank_reports, from_rank) = mpsc::channel::<RankReport>(1);
            let relay = |r| Relay {
                draws: self.draws(r),
                loss: loss.clone(),
            };
            tokio::spawn(relay_steps(from_engine, to_rank, relay(r.fork(2))));
            tokio::spawn(relay_reports(from_rank, reports, relay(r.fork(3))));
            let task = tokio::spawn(task.run(rank_steps, rank_reports));
            Ok(RankConn { steps, task })
        })
    }
}

/// What decides the faults of one part of the simulation: its own random draws, the fault mix,
/// and whether faults are off (the quiescence phase).
struct Draws {
    r: SimRng,
    f: FaultMix,
    calm: Arc<AtomicBool>,
}

/// One direction of a rank's frames: its fault draws, and the rank's loss if it is the lost
/// one.
struct Relay {
    draws: Draws,
    loss: Option<Loss>,
}

impl Relay {
    /// Completes when the rank is lost (never for a rank that is not).
    async fn lost(&self) {
        match &self.loss {
            Some(loss) => loss.cut().await,
            None => std::future::pending().await,
        }
    }
}

/// Engine → rank: each step frame, late with probability `step_delay`. Once the rank is lost its
/// end is dropped (the rank stops), and the next frame ends the relay after its delay, as a send
/// to a stopped rank fails.
async fn relay_steps(
    mut from: mpsc::Receiver<StepMsg>,
    to: mpsc::Sender<StepMsg>,
    mut relay: Relay,
) {
    let mut to = Some(to);
    loop {
        let m = tokio::select! {
            biased;
            () = relay.lost(), if to.is_some() => {
                to = None;
                continue;
            }
            m = from.recv() => m,
        };
        let Some(m) = m else { return };
        let d = &mut relay.draws;
        if !d.calm.load(Ordering::Relaxed) && d.r.chance(d.f.step_delay) {
            tokio::time::sleep(Duration::from_micros(d.r.range(100, 10_000))).await;
        }
        let Some(tx) = &to else { return };
        if tx.send(m).await.is_err() {
            return;
        }
    }
}

/// Rank → engine: each report, late with probability `report_delay`, sent twice with probability
/// `report_duplicate` (the copy at once, or after a delay: then it is stale).
async fn relay_reports(
    mut from: mpsc::Receiver<RankReport>,
    to: mpsc::Sender<RankReport>,
    relay: Relay,
) {
    let Relay {
        draws: Draws { mut r, f, calm },
        loss,
    } = relay;
    let mut nth = 0;
    while let Some(rep) = from.recv().await {
        nth += 1;
        if loss.as_ref().is_some_and(|l| l.lost_at(nth)) {
            return;
        }
        let faulty = !calm.load(Ordering::Relaxed);
        if faulty && r.chance(f.report_delay) {
            tokio::time::sleep(Duration::from_micros(r.range(100, 20_000))).await;
        }
        let copy = match &rep.output {
            Ok(out) if faulty && r.chance(f.report_duplicate) => Some(RankReport {
                rank: rep.rank,
                step: rep.step,
                output: Ok(out.clone()),
                // The copy carries no work of its own.
                delta: RankDelta::default(),
            }),
            _ => None,
        };
        if to.send(rep).await.is_err() {
            return;
        }
        if let Some(copy) = copy {
            let later = Duration::from_micros(r.range(0, 1) * r.range(100, 30_000));
            let to = to.clone();
            tokio::spawn(async move {
                tokio::time::sleep(later).await;
                let _ = to.send(copy).await;
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The simulated transfer engine.

/// A rank's transfers, performed by a task of the simulation in the order started; each takes a
/// drawn (virtual) time, and its bytes move when it completes.
pub(crate) struct SimTransferEngine {
    queue: Arc<Mutex<VecDeque<CopyJob>>>,
    more: Arc<Notify>,
    stopped: Arc<AtomicBool>,
}

impl SimTransferEngine {
    fn spawn(
        gpu: Arc<RwLock<Vec<u8>>>,
        host: HostPool,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
        draws: Draws,
        corrupt_first_load: bool,
    ) -> Self {
        let queue = Arc::new(Mutex::new(VecDeque::new()));
        let more = Arc::new(Notify::new());
        let stopped = Arc::new(AtomicBool::new(false));
        let worker = Completer {
            queue: queue.clone(),
            more: more.clone(),
            stopped: stopped.clone(),
            gpu,
            host,
            done,
            wake,
            draws,
            corrupt_next_load: corrupt_first_load,
        };
        tokio::spawn(worker.run());
        Self {
            queue,
            more,
            stopped,
        }
    }
}

impl TransferEngine for SimTransferEngine {
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= COPY_QUEUE_BOUND {
            return Err(TransferError::QueueFull);
        }
        q.push_back(job);
        self.more.notify_one();
        Ok(())
    }
}

impl Drop for SimTransferEngine {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.more.notify_one();
    }
}

/// The task behind a [`SimTransferEngine`].
struct Completer {
    queue: Arc<Mutex<VecDeque<CopyJob>>>,
    more: Arc<Notify>,
    stopped: Arc<AtomicBool>,
    gpu: Arc<RwLock<Vec<u8>>>,
    host: HostPool,
    done: mpsc::Sender<CopyDone>,
    wake: Arc<Notify>,
    draws: Draws,
    /// The next load flips one byte of its host side first (`SimOptions::corrupt_first_load`).
    corrupt_next_load: bool,
}

impl Completer {
    async fn run(mut self) {
        loop {
            let next = self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            let Some(job) = next else {
                if self.stopped.load(Ordering::Relaxed) {
                    return;
                }
                tokio::select! {
                    () = self.more.notified() => continue,
                    () = self.done.closed() => return,
                }
            };
            let d = &mut self.draws;
            let faulty = !d.calm.load(Ordering::Relaxed);
            let micros = if faulty && d.r.chance(d.f.transfer_slow) {
                d.r.range(5_000, 40_000)
            } else {
                d.r.range(10, 200)
            };
            tokio::time::sleep(Duration::from_micros(micros)).await;
            let failed = faulty && self.draws.r.chance(self.draws.f.transfer_fail);
            let out = self.perform(&job, failed);
            if self.done.send(out).await.is_err() {
                return;
            }
            self.wake.notify_one();
        }
    }

    /// Moves the job's bytes now; a failed job moves its first half and leaves garbage in the
    /// rest of its destination.
    fn perform(&mut self, job: &CopyJob, failed: bool) -> CopyDone {
        if job.direction == TransferDirection::Load
            && std::mem::take(&mut self.corrupt_next_load)
            && let Some(r) = job.runs.first()
        {
            self.host.write()[r.host as usize] ^= 0x5a;
        }
        let keep = if failed {
            job.runs.len() / 2
        } else {
            job.runs.len()
        };
        let (done, garbage) = job.runs.split_at(keep);
        let bytes = match job.direction {
            TransferDirection::Store => {
                let gpu = self.gpu.read().unwrap_or_else(|p| p.into_inner());
                let mut host = self.host.write();
                let n = store(done, &gpu, &mut host);
                for g in garbage {
                    let h = g.host as usize;
                    host[h..h + g.len as usize].fill(0xa5);
                }
                n
            }
            TransferDirection::Load => {
                let mut gpu = self.gpu.write().unwrap_or_else(|p| p.into_inner());
                let n = load(done, &self.host.read(), &mut gpu);
                for g in garbage {
                    let at = g.gpu as usize;
                    gpu[at..at + g.len as usize].fill(0xa5);
                }
                n
            }
        };
        CopyDone {
            job: job.job,
            direction: job.direction,
            bytes,
            copies: keep as u64,
            elapsed: Duration::ZERO,
            result: Ok(()),
            failed,
        }
    }
}
