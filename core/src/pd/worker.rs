//! The worker side of the P/D connector, one per rank: a step's loads become transfer jobs
//! (started in `start_load_kv`, after the forward's launch, as async loads are) and are reported
//! when they complete; a step's releases are reported in that step's `finished_sending`.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use super::{PdCopy, PdMeta};
use crate::ids::{BlockId, JobId, RequestId};
use crate::messages::Meta;
use crate::sorted_set::SortedSet;
use crate::worker::{
    Transfer, TransferCommand, TransferDirection, TransferDone, TransferResults, WorkerConnector,
};
use crate::{InvariantViolation, ensure_invariant};

/// A load the worker started and that has not completed.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Job {
    request: RequestId,
    blocks: Vec<BlockId>,
}

/// See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdWorker {
    failures_as_blocks: bool,
    bound: Option<PdMeta>,
    next_job: u64,
    jobs: BTreeMap<JobId, Job>,
    /// Requests with a failed load whose other jobs are still in flight.
    failing: BTreeSet<RequestId>,
    finished_sending: SortedSet<RequestId>,
    finished_recving: SortedSet<RequestId>,
    failed_recving: SortedSet<RequestId>,
    invalid_blocks: SortedSet<BlockId>,
}

impl PdWorker {
    /// A worker reporting failed loads as invalid blocks (`true`: one KV-cache group only) or
    /// as request-level `failed_recving`.
    pub fn new(failures_as_blocks: bool) -> Self {
        Self {
            failures_as_blocks,
            bound: None,
            next_job: 0,
            jobs: BTreeMap::new(),
            failing: BTreeSet::new(),
            finished_sending: SortedSet::new(),
            finished_recving: SortedSet::new(),
            failed_recving: SortedSet::new(),
            invalid_blocks: SortedSet::new(),
        }
    }

    fn start(&mut self, copy: &PdCopy) -> TransferCommand {
        let job = JobId(self.next_job);
        self.next_job += 1;
        self.jobs.insert(
            job,
            Job {
                request: copy.request,
                blocks: copy.blocks.clone(),
            },
        );
        TransferCommand::Start(Transfer {
            job,
            direction: TransferDirection::Load,
            request: copy.request,
            gpu_blocks: copy.blocks.clone(),
            groups: copy.groups.clone(),
            external: copy.slots.clone(),
        })
    }
}

/// `handle_preemptions` keeps its default, nothing to fence: loads write only the loading
/// request's own blocks (held by the scheduler until reported, I-17), and held blocks are read
/// by the decode side, not by this rank.
impl WorkerConnector for PdWorker {
    type StepMeta = PdMeta;
    type WorkerMeta = Meta;

    fn bind(&mut self, meta: &PdMeta) {
        self.finished_sending
            .union_with(&meta.releases.iter().copied().collect());
        self.bound = Some(meta.clone());
    }

    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        let Some(meta) = self.bound.take() else {
            return Vec::new();
        };
        meta.loads.iter().map(|c| self.start(c)).collect()
    }

    fn handle_transfer_done(&mut self, done: TransferDone) {
        let Some(job) = self.jobs.remove(&done.job) else {
            return;
        };
        let r = job.request;
        if !done.ok {
            self.failing.insert(r);
            if self.failures_as_blocks {
                self.invalid_blocks
                    .union_with(&job.blocks.iter().copied().collect());
            }
        }
        if self.jobs.values().any(|j| j.request == r) {
            return;
        }
        self.finished_recving.insert(r);
        if self.failing.remove(&r) && !self.failures_as_blocks {
            self.failed_recving.insert(r);
        }
    }

    fn get_transfer_results(&mut self, _finished: &SortedSet<RequestId>) -> TransferResults {
        let take = |s: &mut SortedSet<RequestId>| {
            let s = core::mem::take(s);
            (!s.is_empty()).then_some(s)
        };
        TransferResults {
            finished_sending: take(&mut self.finished_sending),
            finished_recving: take(&mut self.finished_recving),
            failed_recving: core::mem::take(&mut self.failed_recving),
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        core::mem::take(&mut self.invalid_blocks)
    }

    fn clear(&mut self) {
        self.bound = None;
    }

    /// I-46: a request failing its load still has a job in flight.
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for r in &self.failing {
            ensure_invariant!(
                self.jobs.values().any(|j| j.request == *r),
                "I-46",
                "{r:?} is failing with no load in flight"
            );
        }
        Ok(())
    }
}
