//! A simulated DMA under one rank: the one loop that runs a [`RankDriver`]'s step for tests, the
//! conformance runner and the fuzz targets (the engine runtime's loop performs real transfers;
//! the model checker enumerates completions as choices instead).
//!
//! # When to call what
//!
//! * [`SimDma::new`] once per rank, with the rule that answers the rank's waits ([`OnWait`]);
//!   [`SimDma::set_held`] to keep the rank's transfers in flight past the end of its steps
//!   ([`SimDma::manual`]: both, for a caller that completes every transfer itself).
//! * [`SimDma::run_step`] for each step of the rank, in step order: it begins the step, starts
//!   every transfer the driver asks for, answers its waits, completes every transfer still in
//!   flight when the driver collects the step's results (unless the rank is held), and returns
//!   the rank's output. [`SimDma::resume`] continues a step already begun (after
//!   [`SimError::Waiting`]). A [`StepObserver`] sees every action on the way.
//! * [`SimDma::complete`], [`SimDma::complete_through`] or [`SimDma::release`] at any time, also
//!   between steps, to complete transfers: each completion is fed back to the driver.
//!
//! Feed every completion of the rank through its `SimDma`, never to the driver directly: both
//! keep the rank's transfers in flight, and they must agree. The driver's `check_invariants()`
//! runs after every poll and every completion.
//!
//! # The queues
//!
//! A rank runs its transfers in vLLM's three DMA queues ([`DmaQueue`]); the transfers of one
//! queue run serially (`cpu/gpu_worker.py`: each waits for the previous one's end event), so
//! waiting for one waits for those ahead of it ([`SimDma::complete_through`]).
//! `tests/conformance/FORMAT.md`, "The simulated DMA", states the rules as conformance cases
//! see them.

use alloc::vec::Vec;

use crate::InvariantViolation;
use crate::engine::{RankAction, RankDriver, RankError};
use crate::ids::JobId;
use crate::messages::{ScheduledStep, WorkerOutput};
use crate::sorted_set::SortedSet;
use crate::worker::{Transfer, TransferDirection, TransferDone, WorkerCall, WorkerConnector};

/// Polls in one [`SimDma::resume`] at most: a step's hooks hand out a bounded number of actions,
/// so a step that is not done by then is a driver that no longer makes progress.
const POLLS_MAX: usize = 1 << 16;

/// One of a rank's DMA queues: the transfers of one queue complete in submission order.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum DmaQueue {
    /// Stores (GPU to external memory).
    Store,
    /// Asynchronous loads.
    Load,
    /// Synchronous (expedited) loads: the step waits for them before its forward pass.
    SyncLoad,
}

impl DmaQueue {
    /// The queue of a transfer by its direction alone: stores, or asynchronous loads.
    pub fn of(direction: TransferDirection) -> Self {
        match direction {
            TransferDirection::Store => Self::Store,
            TransferDirection::Load => Self::Load,
        }
    }
}

/// What the simulated DMA does when the rank waits for jobs.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum OnWait {
    /// Completes each job at once, in the order waited for, with every transfer ahead of it in
    /// its queue ([`SimDma::complete_through`]): vLLM's serial queues.
    CompleteThroughQueue,
    /// Completes exactly the jobs waited for, leaving the transfers ahead of them in flight: a
    /// queue state real DMA cannot reach, for tests that hold an earlier transfer back against a
    /// later one's completion (head-of-line reporting).
    CompleteJob,
    /// Completes nothing: the step stops with [`SimError::Waiting`]; complete transfers, then
    /// [`SimDma::resume`].
    Stop,
}

/// Why a simulated step or completion stopped.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The driver's `check_invariants()` failed after a poll or a completion.
    #[error(transparent)]
    Invariant(InvariantViolation),
    /// A completion for a job not in flight on this rank (never started here, or completed).
    #[error("job {0:?} is not in flight")]
    NotInFlight(JobId),
    /// No step is running on the rank.
    #[error("no step is running")]
    NotScheduled,
    /// A step that did not end within the harness's bound on polls.
    #[error("the step did not end")]
    PollsExhausted,
    /// The rank's driver stopped.
    #[error(transparent)]
    Rank(RankError),
    /// The step waits for these jobs, and the DMA completes nothing on a wait ([`OnWait::Stop`]).
    #[error("the step waits in {during:?} for {jobs:?}")]
    Waiting {
        /// The jobs still due.
        jobs: SortedSet<JobId>,
        /// The hook that waits.
        during: WorkerCall,
    },
}

impl SimError {
    /// The snake_case error kind used by conformance cases (a rank's own error gives its kind).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invariant(_) => "invariant_broken",
            Self::NotInFlight(_) => "not_in_flight",
            Self::NotScheduled => "not_scheduled",
            Self::PollsExhausted => "polls_exhausted",
            Self::Rank(e) => e.kind(),
            Self::Waiting { .. } => "waiting",
        }
    }
}

/// What a caller sees of a simulated step: each action before the DMA performs it, and which
/// queue each transfer runs in. Any `FnMut(&RankAction<WM>)` is one (with the default queues),
/// and so is `()` (sees nothing).
pub trait StepObserver<WM> {
    /// The driver handed out `action` (never `Done` or `Idle`: they end the call).
    fn action(&mut self, _action: &RankAction<WM>) {}

    /// The queue `transfer` runs in. The default tells queues by direction alone; a caller
    /// that knows which loads are synchronous says so here.
    fn queue(&mut self, transfer: &Transfer) -> DmaQueue {
        DmaQueue::of(transfer.direction)
    }
}

impl<WM> StepObserver<WM> for () {}

impl<WM, F: FnMut(&RankAction<WM>)> StepObserver<WM> for F {
    fn action(&mut self, action: &RankAction<WM>) {
        self(action);
    }
}

/// A transfer the simulated DMA has in flight.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
struct Queued {
    job: JobId,
    queue: DmaQueue,
}

/// One rank's simulated DMA. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct SimDma {
    on_wait: OnWait,
    /// Transfers started whose completion was not fed back, in submission order.
    in_flight: Vec<Queued>,
    held: bool,
}

impl SimDma {
    /// A DMA with nothing in flight and the rank not held.
    pub fn new(on_wait: OnWait) -> Self {
        Self {
            on_wait,
            in_flight: Vec::new(),
            held: false,
        }
    }

    /// A DMA that completes nothing by itself (held, [`OnWait::Stop`]): the caller completes
    /// every transfer, in any order.
    pub fn manual() -> Self {
        Self {
            held: true,
            ..Self::new(OnWait::Stop)
        }
    }

    /// Holds the rank (`true`): its transfers in flight no longer complete at the end of its
    /// steps, only when waited for or completed by hand. `false` releases it from the next step
    /// end on.
    pub fn set_held(&mut self, held: bool) {
        self.held = held;
    }

    /// A transfer the driver started, in `queue`. [`SimDma::run_step`] calls it for every
    /// `Start`; call it only for a transfer polled out of the driver by hand.
    pub fn start(&mut self, job: JobId, queue: DmaQueue) {
        self.in_flight.push(Queued { job, queue });
    }

    /// Begins `step` on `driver`, then [`SimDma::resume`].
    pub fn run_step<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        step: &ScheduledStep<W::StepMeta>,
        observer: &mut impl StepObserver<W::WorkerMeta>,
    ) -> Result<WorkerOutput<W::WorkerMeta>, SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        driver.begin(step).map_err(SimError::Rank)?;
        self.resume(driver, observer)
    }

    /// Polls `driver`, whose step has begun, to the step's end and returns the rank's output:
    /// starts each transfer, answers each wait by [`OnWait`], and at `Collect` completes every
    /// transfer in flight (in submission order) unless the rank is held.
    pub fn resume<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        observer: &mut impl StepObserver<W::WorkerMeta>,
    ) -> Result<WorkerOutput<W::WorkerMeta>, SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        for _ in 0..POLLS_MAX {
            let action = driver.poll().map_err(SimError::Rank)?;
            checked(driver)?;
            match action {
                RankAction::Done(output) => return Ok(output),
                RankAction::Idle => return Err(SimError::NotScheduled),
                action => {
                    observer.action(&action);
                    self.perform(driver, action, observer)?;
                }
            }
        }
        Err(SimError::PollsExhausted)
    }

    /// `job` completes (`ok`: successfully) and is fed back to `driver`, whatever is ahead of
    /// it in its queue.
    pub fn complete<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        job: JobId,
        ok: bool,
    ) -> Result<(), SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        let pos = self.position(job).ok_or(SimError::NotInFlight(job))?;
        self.in_flight.remove(pos);
        driver
            .transfer_done(TransferDone { job, ok })
            .map_err(SimError::Rank)?;
        checked(driver)
    }

    /// `job` completes after every transfer ahead of it in its queue (the queue runs serially),
    /// each fed back to `driver` in submission order. Returns the jobs completed; none if `job`
    /// is not in flight (it completed already, for instance with a job behind it).
    pub fn complete_through<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        job: JobId,
    ) -> Result<Vec<JobId>, SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        let Some(pos) = self.position(job) else {
            return Ok(Vec::new());
        };
        let queue = self.in_flight[pos].queue;
        let done: Vec<JobId> = self.in_flight[..=pos]
            .iter()
            .filter(|t| t.queue == queue)
            .map(|t| t.job)
            .collect();
        self.complete_all(driver, &done)?;
        Ok(done)
    }

    /// Every transfer in flight completes, in submission order (held or not). Returns them.
    pub fn release<W>(&mut self, driver: &mut RankDriver<W>) -> Result<Vec<JobId>, SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        let done: Vec<JobId> = self.in_flight().collect();
        self.complete_all(driver, &done)?;
        Ok(done)
    }

    /// Whether the rank is held ([`SimDma::set_held`]).
    pub fn held(&self) -> bool {
        self.held
    }

    /// The transfers in flight, in submission order.
    pub fn in_flight(&self) -> impl Iterator<Item = JobId> + '_ {
        self.in_flight.iter().map(|t| t.job)
    }

    /// Performs one action of the driver other than `Done` and `Idle`.
    fn perform<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        action: RankAction<W::WorkerMeta>,
        observer: &mut impl StepObserver<W::WorkerMeta>,
    ) -> Result<(), SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        match action {
            RankAction::Start(t) => self.start(t.job, observer.queue(&t)),
            RankAction::Wait { jobs, during } => self.answer(driver, jobs, during)?,
            RankAction::Collect if !self.held => {
                self.release(driver)?;
            }
            // A forward pass moves no bytes here; a held rank completes nothing at `Collect`.
            _ => {}
        }
        Ok(())
    }

    /// Answers a wait by the DMA's [`OnWait`].
    fn answer<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        jobs: SortedSet<JobId>,
        during: WorkerCall,
    ) -> Result<(), SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        match self.on_wait {
            OnWait::CompleteThroughQueue => {
                for &job in jobs.iter() {
                    self.complete_through(driver, job)?;
                }
                Ok(())
            }
            OnWait::CompleteJob => self.complete_all(driver, jobs.as_slice()),
            OnWait::Stop => Err(SimError::Waiting { jobs, during }),
        }
    }

    fn complete_all<W>(
        &mut self,
        driver: &mut RankDriver<W>,
        jobs: &[JobId],
    ) -> Result<(), SimError>
    where
        W: WorkerConnector,
        W::StepMeta: Clone,
    {
        jobs.iter()
            .try_for_each(|&job| self.complete(driver, job, true))
    }

    fn position(&self, job: JobId) -> Option<usize> {
        self.in_flight.iter().position(|t| t.job == job)
    }
}

/// The driver's invariants, after a call it answered without an error.
fn checked<W>(driver: &RankDriver<W>) -> Result<(), SimError>
where
    W: WorkerConnector,
    W::StepMeta: Clone,
{
    driver.check_invariants().map_err(SimError::Invariant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::RankConfig;
    use crate::ids::{RequestId, StepId};
    use crate::messages::SchedulerOutput;
    use crate::testing::{ScriptedMeta, ScriptedWorker};

    fn driver() -> RankDriver<ScriptedWorker> {
        let config = RankConfig {
            layers: 1,
            block_size: 4,
            groups: Vec::new(),
        };
        RankDriver::new(config, ScriptedWorker::new())
    }

    fn step(n: u64) -> ScheduledStep<ScriptedMeta> {
        ScheduledStep {
            output: SchedulerOutput {
                step: StepId(n),
                ..SchedulerOutput::default()
            },
            meta: ScriptedMeta::default(),
        }
    }

    /// Starts `transfers` (job, direction) in the next step of `driver`.
    fn start(
        dma: &mut SimDma,
        driver: &mut RankDriver<ScriptedWorker>,
        n: u64,
        transfers: &[(u64, TransferDirection)],
    ) {
        for &(job, direction) in transfers {
            driver.worker_mut().push_load(Transfer {
                job: JobId(job),
                direction,
                request: RequestId(0),
                gpu_blocks: Vec::new(),
                groups: Vec::new(),
                external: Vec::new(),
            });
        }
        dma.run_step(driver, &step(n), &mut ()).unwrap();
    }

    fn jobs(ids: &[u64]) -> Vec<JobId> {
        ids.iter().map(|&j| JobId(j)).collect()
    }

    /// FORMAT.md rule (a): a job completes with every transfer ahead of it in its own queue, in
    /// submission order, and with nothing of another queue.
    #[test]
    fn completing_through_a_queue_completes_only_that_queue_up_to_the_job() {
        use TransferDirection::{Load, Store};
        let (mut dma, mut d) = (SimDma::new(OnWait::CompleteThroughQueue), driver());
        dma.set_held(true);
        start(
            &mut dma,
            &mut d,
            0,
            &[(1, Store), (2, Load), (3, Store), (4, Store)],
        );
        assert_eq!(
            dma.complete_through(&mut d, JobId(3)).unwrap(),
            jobs(&[1, 3])
        );
        assert_eq!(dma.in_flight().collect::<Vec<_>>(), jobs(&[2, 4]));
        assert_eq!(dma.complete_through(&mut d, JobId(3)).unwrap(), jobs(&[]));
        assert_eq!(
            dma.complete(&mut d, JobId(3), true),
            Err(SimError::NotInFlight(JobId(3)))
        );
        assert_eq!(
            d.worker_mut().take_done().len(),
            2,
            "both fed to the driver"
        );
    }

    /// FORMAT.md rule (b): a rank's transfers complete at the end of its step, in submission
    /// order, unless the rank is held; a held rank keeps them until released.
    #[test]
    fn a_held_rank_keeps_its_transfers_past_the_step() {
        use TransferDirection::{Load, Store};
        let (mut dma, mut d) = (SimDma::new(OnWait::CompleteThroughQueue), driver());
        dma.set_held(true);
        start(&mut dma, &mut d, 0, &[(1, Store), (2, Load)]);
        assert_eq!(d.in_flight().len(), 2);
        dma.set_held(false);
        start(&mut dma, &mut d, 1, &[(3, Store)]);
        assert_eq!(dma.in_flight().count(), 0);
        let done: Vec<JobId> = d.worker_mut().take_done().iter().map(|t| t.job).collect();
        assert_eq!(done, jobs(&[1, 2, 3]));
    }

    /// A wait is answered by the DMA's rule: `Stop` hands it to the caller, who completes the
    /// jobs and resumes; `CompleteJob` completes only the job waited for.
    #[test]
    fn a_wait_is_answered_by_the_dmas_rule() {
        use TransferDirection::Store;
        let (mut dma, mut d) = (SimDma::manual(), driver());
        start(&mut dma, &mut d, 0, &[(1, Store), (2, Store)]);
        d.worker_mut().set_preemption_waits(&jobs(&[2]));
        let waiting = dma.run_step(&mut d, &step(1), &mut ()).unwrap_err();
        let due = SortedSet::from_vec(jobs(&[2]));
        assert_eq!(
            waiting,
            SimError::Waiting {
                jobs: due,
                during: WorkerCall::HandlePreemptions
            }
        );
        dma.complete(&mut d, JobId(2), true).unwrap();
        dma.resume(&mut d, &mut ()).unwrap();
        assert_eq!(dma.in_flight().collect::<Vec<_>>(), jobs(&[1]));

        let (mut dma, mut d) = (SimDma::new(OnWait::CompleteJob), driver());
        dma.set_held(true);
        start(&mut dma, &mut d, 0, &[(1, Store), (2, Store)]);
        d.worker_mut().set_preemption_waits(&jobs(&[2]));
        let mut waited = Vec::new();
        let mut observe = |a: &RankAction<_>| {
            if let RankAction::Wait { jobs, .. } = a {
                waited.extend(jobs.iter().copied());
            }
        };
        dma.run_step(&mut d, &step(1), &mut observe).unwrap();
        assert_eq!(waited, jobs(&[2]));
        assert_eq!(dma.in_flight().collect::<Vec<_>>(), jobs(&[1]));
    }
}
