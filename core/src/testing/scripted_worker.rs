//! A scripted worker-side connector, the worker twin of [`crate::ScriptedConnector`]: what it
//! reports comes from queues that tests, conformance cases and the model checker fill between
//! calls, so every worker-side composition path (MultiConnector's report suppression, result
//! unions, metadata slots, job routing) is reachable without real transfers.
//!
//! Fill the queues with the `push_*` / `set_*` methods; each step's `get_transfer_results`,
//! `get_block_ids_with_load_errors` and `build_connector_worker_meta` drain them. Transfers
//! queued with [`ScriptedWorker::push_load`] are started by the next `start_load_kv`;
//! completions fed back with `handle_transfer_done` are recorded
//! ([`ScriptedWorker::take_done`]).

use alloc::vec::Vec;

use super::ScriptedMeta;
use crate::ids::{BlockId, JobId, RequestId};
use crate::messages::Meta;
use crate::sorted_set::SortedSet;
use crate::worker::Transfer;
use crate::worker::TransferCommand;
use crate::worker::TransferDone;
use crate::worker::TransferResults;
use crate::worker::WorkerConnector;

/// See the module docs.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScriptedWorker {
    finished_sending: Option<SortedSet<RequestId>>,
    finished_recving: Option<SortedSet<RequestId>>,
    failed_recving: SortedSet<RequestId>,
    load_errors: SortedSet<BlockId>,
    worker_meta: Option<Meta>,
    loads: Vec<Transfer>,
    preemption_waits: SortedSet<JobId>,
    bound: Option<ScriptedMeta>,
    binds: u32,
    done: Vec<TransferDone>,
}

impl ScriptedWorker {
    /// A worker that reports nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// `ids` are reported in the next `finished_sending` (an empty slice reports an empty set).
    pub fn push_finished_sending(&mut self, ids: &[RequestId]) {
        self.finished_sending
            .get_or_insert_with(SortedSet::new)
            .union_with(&ids.iter().copied().collect());
    }

    /// `ids` are reported in the next `finished_recving`.
    pub fn push_finished_recving(&mut self, ids: &[RequestId]) {
        self.finished_recving
            .get_or_insert_with(SortedSet::new)
            .union_with(&ids.iter().copied().collect());
    }

    /// `ids` are reported in the next `failed_recving` (and, as the contract asks, in
    /// `finished_recving`).
    pub fn push_failed_recving(&mut self, ids: &[RequestId]) {
        self.failed_recving
            .union_with(&ids.iter().copied().collect());
        self.push_finished_recving(ids);
    }

    /// `blocks` are reported by the next `get_block_ids_with_load_errors`.
    pub fn push_load_errors(&mut self, blocks: &[BlockId]) {
        self.load_errors
            .union_with(&blocks.iter().copied().collect());
    }

    /// What the next `build_connector_worker_meta` returns.
    pub fn set_worker_meta(&mut self, meta: Option<Meta>) {
        self.worker_meta = meta;
    }

    /// A transfer the next `start_load_kv` starts.
    pub fn push_load(&mut self, transfer: Transfer) {
        self.loads.push(transfer);
    }

    /// Jobs the next `handle_preemptions` waits for.
    pub fn set_preemption_waits(&mut self, jobs: &[JobId]) {
        self.preemption_waits = jobs.iter().copied().collect();
    }

    /// The metadata bound now (`None` outside bind…clear).
    pub fn bound(&self) -> Option<&ScriptedMeta> {
        self.bound.as_ref()
    }

    /// How many times `bind` was called.
    pub fn binds(&self) -> u32 {
        self.binds
    }

    /// Completions fed back since the last call, in order.
    pub fn take_done(&mut self) -> Vec<TransferDone> {
        core::mem::take(&mut self.done)
    }
}

impl WorkerConnector for ScriptedWorker {
    type StepMeta = ScriptedMeta;
    type WorkerMeta = Meta;

    fn handle_preemptions(&mut self, _meta: &ScriptedMeta) -> Vec<TransferCommand> {
        let jobs = core::mem::take(&mut self.preemption_waits);
        if jobs.is_empty() {
            Vec::new()
        } else {
            alloc::vec![TransferCommand::Wait(jobs)]
        }
    }

    fn bind(&mut self, meta: &ScriptedMeta) {
        self.bound = Some(meta.clone());
        self.binds += 1;
    }

    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        self.loads.drain(..).map(TransferCommand::Start).collect()
    }

    fn handle_transfer_done(&mut self, done: TransferDone) {
        self.done.push(done);
    }

    fn get_transfer_results(
        &mut self,
        _finished_req_ids: &SortedSet<RequestId>,
    ) -> TransferResults {
        TransferResults {
            finished_sending: self.finished_sending.take(),
            finished_recving: self.finished_recving.take(),
            failed_recving: core::mem::take(&mut self.failed_recving),
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        core::mem::take(&mut self.load_errors)
    }

    fn build_connector_worker_meta(&mut self) -> Option<Meta> {
        self.worker_meta.take()
    }

    fn clear(&mut self) {
        self.bound = None;
    }
}
