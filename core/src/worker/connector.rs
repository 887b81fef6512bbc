//! The worker side of the connector contract (SEMANTICS.md §2.4, §3.2): [`WorkerConnector`],
//! one per rank, sans-IO. Hooks return [`TransferCommand`]s for the runtime to perform, and the
//! runtime feeds completions back with [`WorkerConnector::handle_transfer_done`].
//! [`super::GuardedWorker`] puts a worker connector behind the step protocol so that no hook runs
//! out of order (I-1…I-6).

use alloc::vec::Vec;
use core::fmt::Debug;

use crate::InvariantViolation;
use crate::ids::{BlockId, JobId, RequestId};
use crate::messages::{WorkerMeta, WorkerOutput};
use crate::sorted_set::SortedSet;

/// Which way a transfer moves KV.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TransferDirection {
    /// External store → GPU blocks.
    Load,
    /// GPU blocks → external store.
    Store,
}

/// One transfer a worker connector asks the runtime to perform.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Transfer {
    /// Identifies the completion fed back in [`TransferDone`].
    pub job: JobId,
    /// Load or store.
    pub direction: TransferDirection,
    /// The request the transfer serves.
    pub request: RequestId,
    /// The GPU blocks read (store) or written (load), in order.
    pub gpu_blocks: Vec<BlockId>,
    /// The KV cache group of each GPU block (one per block): which layers' KV the block holds,
    /// so a runtime knows the bytes to move ([`crate::KvLayout`]).
    pub groups: Vec<u32>,
    /// The external locations (host slots, remote keys), one per GPU block.
    pub external: Vec<u64>,
}

/// What a worker hook asks the runtime to do.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferCommand {
    /// Start this transfer.
    Start(Transfer),
    /// Block until these jobs completed (their [`TransferDone`] were fed back) before the hook's
    /// caller proceeds: `handle_preemptions` fencing stores before the forward writes (I-4),
    /// `wait_for_layer_load`, `wait_for_save`.
    Wait(SortedSet<JobId>),
}

/// Why a worker connector stopped: a completion or a job it cannot take, where vLLM's worker
/// asserts. Sticky: once a worker reports one, its results can no longer be trusted, and the rank
/// driver ([`crate::RankDriver`]) stops the rank with it.
#[derive(
    Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize, thiserror::Error,
)]
#[non_exhaustive]
pub enum WorkerError {
    /// A transfer reported failure, and the connector cannot absorb failed transfers.
    #[error("transfer of job {0:?} failed")]
    TransferFailed(JobId),
    /// A completion for a job that is not in flight on this rank.
    #[error("completion for job {0:?}, which is not in flight")]
    UnknownJob(JobId),
    /// A job the connector cannot perform (e.g. host chunks that do not cover its GPU blocks).
    #[error("job {0:?} is malformed: its host chunks do not cover its GPU blocks")]
    MalformedJob(JobId),
    /// The step's metadata is another connector's ([`crate::Either`]: the engine built one
    /// connector and its ranks another).
    #[error("the step's metadata belongs to another connector")]
    ForeignMeta,
}

impl WorkerError {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TransferFailed(_) => "transfer_failed",
            Self::UnknownJob(_) => "unknown_job",
            Self::MalformedJob(_) => "malformed_job",
            Self::ForeignMeta => "foreign_meta",
        }
    }
}

/// A transfer's completion, fed back to the worker connector.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferDone {
    /// The job that completed.
    pub job: JobId,
    /// `false`: the transfer failed (a load's blocks are then reported invalid).
    pub ok: bool,
}

/// vLLM's `KVConnectorTransferResults`.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferResults {
    /// Requests whose sends/saves finished on this rank.
    pub finished_sending: Option<SortedSet<RequestId>>,
    /// Requests whose loads finished on this rank (failed ones included).
    pub finished_recving: Option<SortedSet<RequestId>>,
    /// Request-level load failures.
    pub failed_recving: SortedSet<RequestId>,
}

impl TransferResults {
    /// The rank's output of the step: these results with the step's
    /// `get_block_ids_with_load_errors` and `build_connector_worker_meta` answers (no quorum
    /// change, no KV events). What a worker runtime hands the executor after the step's hooks.
    pub fn into_output<M>(
        self,
        invalid_block_ids: SortedSet<BlockId>,
        worker_meta: Option<M>,
    ) -> WorkerOutput<M> {
        WorkerOutput {
            finished_sending: self.finished_sending,
            finished_recving: self.finished_recving,
            invalid_block_ids,
            failed_recving: self.failed_recving,
            expected_finished_count: 0,
            worker_meta,
            kv_events: None,
        }
    }
}

/// The worker side of a connector, one per rank (SEMANTICS.md §2.4, §3.2), sans-IO.
///
/// Hooks are called in the order [`crate::WorkerProtocol`] admits; use [`crate::GuardedWorker`] to enforce it.
pub trait WorkerConnector: Debug {
    /// The scheduler connector's step metadata ([`crate::SchedulerConnector::StepMeta`]), read
    /// by `handle_preemptions` and `bind`.
    type StepMeta;
    /// What this rank reports back, folded across ranks by the aggregator.
    type WorkerMeta: WorkerMeta;

    /// First call of every step, before any KV write of the step (I-4): return `Wait` for every
    /// in-flight transfer that reads a block the step may overwrite. The default fences nothing:
    /// right for a connector whose transfers never read a block the scheduler may reallocate
    /// while they run.
    fn handle_preemptions(&mut self, _meta: &Self::StepMeta) -> Vec<TransferCommand> {
        Vec::new()
    }
    /// Bind the step's metadata.
    fn bind(&mut self, meta: &Self::StepMeta);
    /// Start the step's loads (once per step, I-1).
    fn start_load_kv(&mut self) -> Vec<TransferCommand>;
    /// Before layer `layer`'s attention.
    fn wait_for_layer_load(&mut self, _layer: u32) -> Vec<TransferCommand> {
        Vec::new()
    }
    /// After layer `layer`'s attention.
    fn save_kv_layer(&mut self, _layer: u32) -> Vec<TransferCommand> {
        Vec::new()
    }
    /// End of the step's saves (`wait_for_save`). The default starts and waits for nothing.
    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        Vec::new()
    }
    /// A transfer completed. May come at any time, also between steps.
    fn handle_transfer_done(&mut self, done: TransferDone);
    /// Completions since the last call. `finished_req_ids` are the ids the scheduler finished
    /// since the previous step: sends may be reported only for ids received here (§2.9).
    fn get_transfer_results(&mut self, finished_req_ids: &SortedSet<RequestId>) -> TransferResults;
    /// Blocks whose load failed since the last call.
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId>;
    /// Worker → scheduler metadata of this step.
    fn build_connector_worker_meta(&mut self) -> Option<Self::WorkerMeta> {
        None
    }
    /// Unbind the step's metadata (last call of the step).
    fn clear(&mut self);
    /// The error this connector stopped with, if any (sticky). Asked after every call by the
    /// rank driver, which then stops the rank: the typed error channel of the worker side.
    fn error(&self) -> Option<WorkerError> {
        None
    }
    /// The connector's own invariants (`I-xx` of SEMANTICS.md §8); checked by
    /// [`crate::RankDriver::check_invariants`], so after every public transition of the rank in
    /// debug builds and after every action of the model checker. The default has none.
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Ok(())
    }
}

impl<T: WorkerConnector + ?Sized> WorkerConnector for alloc::boxed::Box<T> {
    type StepMeta = T::StepMeta;
    type WorkerMeta = T::WorkerMeta;

    fn handle_preemptions(&mut self, meta: &Self::StepMeta) -> Vec<TransferCommand> {
        (**self).handle_preemptions(meta)
    }
    fn bind(&mut self, meta: &Self::StepMeta) {
        (**self).bind(meta);
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        (**self).start_load_kv()
    }
    fn wait_for_layer_load(&mut self, layer: u32) -> Vec<TransferCommand> {
        (**self).wait_for_layer_load(layer)
    }
    fn save_kv_layer(&mut self, layer: u32) -> Vec<TransferCommand> {
        (**self).save_kv_layer(layer)
    }
    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        (**self).wait_for_save()
    }
    fn handle_transfer_done(&mut self, done: TransferDone) {
        (**self).handle_transfer_done(done);
    }
    fn get_transfer_results(&mut self, finished_req_ids: &SortedSet<RequestId>) -> TransferResults {
        (**self).get_transfer_results(finished_req_ids)
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        (**self).get_block_ids_with_load_errors()
    }
    fn build_connector_worker_meta(&mut self) -> Option<Self::WorkerMeta> {
        (**self).build_connector_worker_meta()
    }
    fn clear(&mut self) {
        (**self).clear();
    }
    fn error(&self) -> Option<WorkerError> {
        (**self).error()
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        (**self).check_invariants()
    }
}
