//! The offloading connector, worker side (SEMANTICS.md §5.6–§5.7, I-46, I-47): vLLM 0.33.0's
//! `OffloadingConnectorWorker` with the queue discipline of its `CPUOffloadingWorker`.
//!
//! The DMA itself is outside the core: hooks return [`TransferCommand`]s (start a transfer, wait
//! for jobs) and the runtime feeds every completion back with
//! [`WorkerConnector::handle_transfer_done`]. The worker keeps vLLM's three FIFO queues (stores,
//! loads, expedited sync loads) and reports a transfer only once it and every earlier transfer of
//! its queue completed (head-of-line).
//!
//! Per step, in the order the step protocol admits:
//!
//! * `handle_preemptions`: the step's flushed stores leave the step's store list (so
//!   `wait_for_save` does not queue them again) and are submitted with the stores deferred from
//!   the previous step; then one `Wait` for the flushed jobs in flight, before any KV write.
//! * `start_load_kv`: the step's loads; synchronous ones go to the expedited queue and are
//!   waited for.
//! * `wait_for_save`: the step's stores are deferred to the start of the next step (offloading
//!   starts after the sampling transfers). A non-writer rank (rank > 0 of a replicated layout)
//!   acknowledges stores without transferring.
//! * `get_transfer_results`: completed jobs become acknowledgements in the worker metadata;
//!   async loads also report their request in `finished_recving`. Never `finished_sending`.
//! * `build_connector_worker_meta`: the acknowledgements since the last call, or `None`.
//!
//! # Errors
//!
//! vLLM asserts that transfers never fail and that specs are well formed. Here an unknown
//! completion, or a job whose host chunks do not cover its GPU blocks, is kept as a sticky
//! [`WorkerError`] ([`OffloadingWorker::error`]); the job is not acknowledged.
//!
//! A failed transfer (`TransferDone { ok: false }`) depends on the mode
//! ([`OffloadingWorkerConfig::mode`]):
//!
//! * [`Mode::Compat`]: where vLLM asserts, a sticky [`WorkerError::TransferFailed`]; the job is
//!   never acknowledged, so the engine must stop.
//! * [`Mode::Strict`]: absorbed. The job is reported in its queue's order like any other, as a
//!   failed acknowledgement ([`OffloadMeta::mark_failed`]): the scheduler side then frees a
//!   failed store's chunks (`complete_store(success = false)`). A failed async load also reports
//!   its request in `failed_recving` (with `finished_recving`), so the scheduler recomputes or
//!   fails it per `load_failure_policy`; a failed sync load reports its GPU blocks from
//!   `get_block_ids_with_load_errors` (block-level, as vLLM's scheduler handles them). A sync
//!   load that spans several KV cache groups cannot be reported block by block (the scheduler
//!   accepts block-level errors for one group only, as vLLM does): its failure stays a sticky
//!   `TransferFailed`, documented in SEMANTICS.md's strict departures.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::vec::Vec;

use super::OffloadingConnectorMeta;
use super::TransferJob;
use crate::ids::{BlockId, JobId, RequestId};
use crate::messages::Meta;
use crate::messages::OffloadMeta;
use crate::sorted_set::SortedSet;
use crate::worker::Transfer;
use crate::worker::TransferCommand;
use crate::worker::TransferDirection;
use crate::worker::TransferDone;
use crate::worker::TransferResults;
use crate::worker::WorkerConnector;
use crate::worker::WorkerError;
use crate::{InvariantViolation, Mode, ensure_invariant};

/// Configuration of one rank's offloading worker.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadingWorkerConfig {
    /// GPU blocks per host chunk (as on the scheduler side).
    pub blocks_per_chunk: u32,
    /// `false` on ranks > 0 of a replicated (non-canonical) layout: stores are acknowledged,
    /// not transferred. Loads are performed on every rank.
    pub is_store_writer: bool,
    /// Bytes of one GPU block on this rank, for the transfer statistics.
    pub bytes_per_block: u64,
    /// What a failed transfer does (see the module docs): a sticky error (`compat`, where vLLM
    /// asserts) or a failed acknowledgement the scheduler absorbs (`strict`).
    pub mode: Mode,
}

/// An in-flight load: what its failure reports under [`Mode::Strict`].
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
enum Load {
    /// An async load of this request: `finished_recving` (and `failed_recving` on failure).
    Async(RequestId),
    /// A sync load (its request runs this step): its GPU blocks become load errors on failure;
    /// `None` under `compat` or when the blocks span several groups (not reportable by block).
    Sync(Option<Vec<BlockId>>),
}

/// The three DMA queues of `CPUOffloadingWorker`, reported in this order.
#[derive(Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd)]
enum Queue {
    Store = 0,
    Load = 1,
    Expedited = 2,
}

/// One rank's offloading worker. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct OffloadingWorker {
    config: OffloadingWorkerConfig,
    /// The bound metadata, minus the stores flushed in `handle_preemptions`.
    bound: Option<OffloadingConnectorMeta>,
    /// Jobs flushed by this step's `handle_preemptions`.
    flushed: BTreeSet<JobId>,
    /// In-flight loads.
    load_jobs: BTreeMap<JobId, Load>,
    /// Stores deferred to the start of the next step.
    unsubmitted: Vec<(JobId, TransferJob)>,
    /// Submitted transfers per queue, in submission order, with their block count.
    queues: [VecDeque<(JobId, u64)>; 3],
    /// Submitted transfers whose completion was fed back, not yet reported.
    done: BTreeSet<JobId>,
    /// The subset of `done` whose transfer failed (`strict` only).
    failed: BTreeSet<JobId>,
    /// GPU blocks of failed sync loads, for the next `get_block_ids_with_load_errors`.
    load_errors: Vec<BlockId>,
    /// Acknowledgements since the last `build_connector_worker_meta`.
    completed: OffloadMeta,
    error: Option<WorkerError>,
}

impl OffloadingWorker {
    /// A worker with nothing in flight.
    pub fn new(config: OffloadingWorkerConfig) -> Self {
        Self {
            config,
            bound: None,
            flushed: BTreeSet::new(),
            load_jobs: BTreeMap::new(),
            unsubmitted: Vec::new(),
            queues: [VecDeque::new(), VecDeque::new(), VecDeque::new()],
            done: BTreeSet::new(),
            failed: BTreeSet::new(),
            load_errors: Vec::new(),
            completed: OffloadMeta::new(),
            error: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &OffloadingWorkerConfig {
        &self.config
    }

    /// Submitted transfers not yet reported, in queue order (stores, loads, expedited loads).
    pub fn in_flight(&self) -> impl Iterator<Item = JobId> + '_ {
        self.queues.iter().flatten().map(|&(j, _)| j)
    }

    /// Submitted transfers whose completion has not been fed back yet.
    pub fn awaiting_completion(&self) -> impl Iterator<Item = JobId> + '_ {
        self.in_flight().filter(|j| !self.done.contains(j))
    }

    /// Stores deferred to the next step's start.
    pub fn deferred_stores(&self) -> impl Iterator<Item = JobId> + '_ {
        self.unsubmitted.iter().map(|(j, _)| *j)
    }

    fn fail(&mut self, e: WorkerError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    fn acknowledge(&mut self, job: JobId) {
        self.completed.mark_completed(job);
    }

    /// The host slot (chunk × blocks per chunk + offset) of every GPU block of `job`, in the
    /// order of [`Transfer::gpu_blocks`]; `None` when the chunks do not cover the blocks.
    fn transfer(&self, id: JobId, job: &TransferJob, dir: TransferDirection) -> Option<Transfer> {
        let bpc = u64::from(self.config.blocks_per_chunk);
        let mut gpu_blocks: Vec<BlockId> = Vec::with_capacity(job.num_blocks());
        let mut external = Vec::with_capacity(job.num_blocks());
        let mut groups = Vec::with_capacity(job.num_blocks());
        for (g, blocks) in job.gpu.block_ids.iter().enumerate() {
            if blocks.is_empty() {
                continue;
            }
            let skip = u64::from(*job.gpu.block_indices.get(g)?) % bpc;
            let chunks = job.chunks.get(g)?;
            for (j, &b) in blocks.iter().enumerate() {
                let pos = skip + j as u64;
                let chunk = chunks.get(usize::try_from(pos / bpc).ok()?)?;
                external.push(u64::from(chunk.0) * bpc + pos % bpc);
                gpu_blocks.push(b);
                groups.push(u32::try_from(g).ok()?);
            }
        }
        Some(Transfer {
            job: id,
            direction: dir,
            request: job.request,
            gpu_blocks,
            groups,
            external,
        })
    }

    /// Queues `job` and emits its `Start` (a load is tracked with what its failure reports);
    /// `false` (and a sticky error) when it is malformed.
    fn submit(
        &mut self,
        id: JobId,
        job: &TransferJob,
        queue: Queue,
        out: &mut Vec<TransferCommand>,
    ) -> bool {
        let dir = match queue {
            Queue::Store => TransferDirection::Store,
            Queue::Load | Queue::Expedited => TransferDirection::Load,
        };
        let Some(t) = self.transfer(id, job, dir) else {
            self.fail(WorkerError::MalformedJob(id));
            return false;
        };
        match queue {
            Queue::Store => {}
            Queue::Load => {
                self.load_jobs.insert(id, Load::Async(job.request));
            }
            Queue::Expedited => {
                // What a failure of this sync load reports (strict, one group only).
                let one_group = t.groups.windows(2).all(|p| p[0] == p[1]);
                let blocks =
                    (self.config.mode == Mode::Strict && one_group).then(|| t.gpu_blocks.clone());
                self.load_jobs.insert(id, Load::Sync(blocks));
            }
        }
        self.queues[queue as usize].push_back((id, t.gpu_blocks.len() as u64));
        out.push(TransferCommand::Start(t));
        true
    }

    fn submit_deferred_stores(&mut self, out: &mut Vec<TransferCommand>) {
        for (id, job) in core::mem::take(&mut self.unsubmitted) {
            self.submit(id, &job, Queue::Store, out);
        }
    }

    fn is_in_flight(&self, job: JobId) -> bool {
        self.queues.iter().flatten().any(|&(j, _)| j == job)
    }

    /// I-46 (rank side): every queued job is in exactly one queue, completions are only for
    /// queued jobs, the in-flight loads are queued or reported, no acknowledgement is pending
    /// twice.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let mut seen = BTreeSet::new();
        for &(j, _) in self.queues.iter().flatten() {
            ensure_invariant!(seen.insert(j), "I-46", "job {j:?} queued twice");
        }
        for j in &self.done {
            ensure_invariant!(
                seen.contains(j),
                "I-46",
                "completion of {j:?} kept for a job not queued"
            );
        }
        for j in &self.failed {
            ensure_invariant!(
                self.done.contains(j),
                "I-46",
                "failure of {j:?} kept without its completion"
            );
        }
        for j in self.load_jobs.keys() {
            ensure_invariant!(
                seen.contains(j),
                "I-46",
                "load {j:?} tracked but not queued"
            );
        }
        for (j, _) in self.completed.completed_jobs() {
            ensure_invariant!(
                !seen.contains(&j),
                "I-46",
                "job {j:?} acknowledged while still queued"
            );
        }
        for (j, _) in &self.unsubmitted {
            ensure_invariant!(
                !seen.contains(j) && self.completed.count(*j) == 0,
                "I-47",
                "deferred store {j:?} already submitted or acknowledged"
            );
        }
        Ok(())
    }
}

impl WorkerConnector for OffloadingWorker {
    type StepMeta = OffloadingConnectorMeta;
    type WorkerMeta = Meta;

    fn handle_preemptions(&mut self, meta: &OffloadingConnectorMeta) -> Vec<TransferCommand> {
        let mut out = Vec::new();
        self.flushed = meta.jobs_to_flush.iter().copied().collect();
        for &job in meta.jobs_to_flush.iter() {
            let Some(entry) = meta.store_jobs.get(&job) else {
                continue;
            };
            if self.config.is_store_writer {
                self.unsubmitted.push((job, entry.clone()));
            } else {
                self.acknowledge(job);
            }
        }
        self.submit_deferred_stores(&mut out);
        let wait: Vec<JobId> = meta
            .jobs_to_flush
            .iter()
            .copied()
            .filter(|&j| self.is_in_flight(j) && !self.done.contains(&j))
            .collect();
        if !wait.is_empty() {
            out.push(TransferCommand::Wait(SortedSet::from_vec(wait)));
        }
        out
    }

    fn bind(&mut self, meta: &OffloadingConnectorMeta) {
        let mut m = meta.clone();
        for j in &self.flushed {
            m.store_jobs.remove(j);
        }
        self.bound = Some(m);
    }

    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        let mut out = Vec::new();
        self.submit_deferred_stores(&mut out);
        let Some(meta) = self.bound.take() else {
            return out;
        };
        let mut sync = Vec::new();
        for (&id, job) in &meta.load_jobs {
            if job.sync {
                // Its request runs this step: no finished_recving.
                if self.submit(id, job, Queue::Expedited, &mut out) {
                    sync.push(id);
                }
            } else {
                self.submit(id, job, Queue::Load, &mut out);
            }
        }
        self.bound = Some(meta);
        let sync: Vec<JobId> = sync
            .into_iter()
            .filter(|j| !self.done.contains(j))
            .collect();
        if !sync.is_empty() {
            out.push(TransferCommand::Wait(SortedSet::from_vec(sync)));
        }
        out
    }

    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        let Some(meta) = self.bound.take() else {
            return Vec::new();
        };
        for (&id, job) in &meta.store_jobs {
            if self.config.is_store_writer {
                // Deferred to the start of the next step.
                self.unsubmitted.push((id, job.clone()));
            } else {
                self.acknowledge(id);
            }
        }
        self.bound = Some(meta);
        Vec::new()
    }

    fn handle_transfer_done(&mut self, done: TransferDone) {
        if !self.is_in_flight(done.job) || self.done.contains(&done.job) {
            self.fail(WorkerError::UnknownJob(done.job));
            return;
        }
        if !done.ok {
            let absorbed = self.config.mode == Mode::Strict
                && !matches!(self.load_jobs.get(&done.job), Some(Load::Sync(None)));
            if !absorbed {
                self.fail(WorkerError::TransferFailed(done.job));
                return;
            }
            self.failed.insert(done.job);
        }
        self.done.insert(done.job);
    }

    fn get_transfer_results(&mut self, _finished: &SortedSet<RequestId>) -> TransferResults {
        let mut recving = Vec::new();
        let mut failed_recving = Vec::new();
        for q in 0..self.queues.len() {
            while let Some(&(job, blocks)) = self.queues[q].front() {
                if !self.done.remove(&job) {
                    break;
                }
                self.queues[q].pop_front();
                let failed = self.failed.remove(&job);
                if failed {
                    self.completed.mark_failed(job);
                } else {
                    self.completed.transfers += 1;
                    self.completed.bytes = self
                        .completed
                        .bytes
                        .saturating_add(blocks.saturating_mul(self.config.bytes_per_block));
                    self.acknowledge(job);
                }
                match self.load_jobs.remove(&job) {
                    Some(Load::Async(req)) => {
                        recving.push(req);
                        if failed {
                            failed_recving.push(req);
                        }
                    }
                    Some(Load::Sync(Some(blocks))) if failed => self.load_errors.extend(blocks),
                    _ => {}
                }
            }
        }
        TransferResults {
            finished_sending: None,
            finished_recving: (!recving.is_empty()).then(|| SortedSet::from_vec(recving)),
            failed_recving: SortedSet::from_vec(failed_recving),
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        SortedSet::from_vec(core::mem::take(&mut self.load_errors))
    }

    fn build_connector_worker_meta(&mut self) -> Option<Meta> {
        if self.completed.is_empty() {
            return None;
        }
        Some(Meta::Offload(core::mem::take(&mut self.completed)))
    }

    fn clear(&mut self) {
        self.bound = None;
        self.flushed.clear();
    }

    fn error(&self) -> Option<WorkerError> {
        self.error.clone()
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Self::check_invariants(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_invariants_rejects_a_corrupt_worker() {
        // Protects I-46 and I-47 as the model checker sees them (it calls check_invariants after
        // every action): each kind of corruption is reported.
        let fresh = OffloadingWorker::new(OffloadingWorkerConfig {
            blocks_per_chunk: 1,
            is_store_writer: true,
            bytes_per_block: 1,
            mode: Mode::Compat,
        });
        fresh.check_invariants().unwrap();
        let mut queued = fresh.clone();
        queued.queues[0].push_back((JobId(1), 1));
        queued.check_invariants().unwrap();
        let corruptions: [fn(&mut OffloadingWorker); 4] = [
            |w| w.queues[1].push_back((JobId(1), 1)),
            |w| {
                w.done.insert(JobId(2));
            },
            |w| {
                w.load_jobs.insert(JobId(3), Load::Sync(None));
            },
            |w| {
                w.failed.insert(JobId(1));
            },
        ];
        for corrupt in corruptions {
            let mut w = queued.clone();
            corrupt(&mut w);
            assert_eq!(w.check_invariants().unwrap_err().id, "I-46");
        }
    }
}
