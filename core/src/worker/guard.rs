//! [`GuardedWorker`]: a worker connector behind the step protocol (I-1…I-6).

use alloc::vec::Vec;

use super::connector::{TransferCommand, TransferDone, TransferResults, WorkerConnector};
use super::protocol::{ProtocolViolation, StepShape, WorkerCall, WorkerProtocol};
use crate::ids::{BlockId, RequestId};
use crate::sorted_set::SortedSet;

/// A [`WorkerConnector`] behind the step protocol guard: every hook is first admitted by a
/// [`WorkerProtocol`]; a hook out of order is a sticky [`ProtocolViolation`] and the inner
/// connector is not called.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct GuardedWorker<C> {
    inner: C,
    protocol: WorkerProtocol,
}

impl<C: WorkerConnector> GuardedWorker<C> {
    /// Guard `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            protocol: WorkerProtocol::new(),
        }
    }

    /// The guarded connector (read-only).
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// The guarded connector, mutable: for inputs that are not step hooks (a test double's
    /// script). Hooks go through the guard's methods.
    pub fn inner_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    /// The protocol state.
    pub fn protocol(&self) -> &WorkerProtocol {
        &self.protocol
    }

    /// Open a step of the given shape.
    pub fn begin_step(&mut self, shape: StepShape) -> Result<(), ProtocolViolation> {
        self.protocol.begin_step(shape).map(|_| ())
    }

    /// `handle_preemptions(meta)`.
    pub fn handle_preemptions(
        &mut self,
        meta: &C::StepMeta,
    ) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::HandlePreemptions)?;
        Ok(self.inner.handle_preemptions(meta))
    }

    /// `bind_connector_metadata(meta)`.
    pub fn bind(&mut self, meta: &C::StepMeta) -> Result<(), ProtocolViolation> {
        self.protocol.handle(WorkerCall::Bind)?;
        self.inner.bind(meta);
        Ok(())
    }

    /// `start_load_kv`.
    pub fn start_load_kv(&mut self) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::StartLoadKv)?;
        Ok(self.inner.start_load_kv())
    }

    /// `wait_for_layer_load(layer)`.
    pub fn wait_for_layer_load(
        &mut self,
        layer: u32,
    ) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::WaitForLayerLoad)?;
        Ok(self.inner.wait_for_layer_load(layer))
    }

    /// `save_kv_layer(layer)`.
    pub fn save_kv_layer(&mut self, layer: u32) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::SaveKvLayer)?;
        Ok(self.inner.save_kv_layer(layer))
    }

    /// `wait_for_save`.
    pub fn wait_for_save(&mut self) -> Result<Vec<TransferCommand>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::WaitForSave)?;
        Ok(self.inner.wait_for_save())
    }

    /// A transfer completed (not a step hook: allowed at any time).
    pub fn handle_transfer_done(&mut self, done: TransferDone) {
        self.inner.handle_transfer_done(done);
    }

    /// `get_transfer_results(finished_req_ids)`.
    pub fn get_transfer_results(
        &mut self,
        finished_req_ids: &SortedSet<RequestId>,
    ) -> Result<TransferResults, ProtocolViolation> {
        self.protocol.handle(WorkerCall::GetFinished)?;
        Ok(self.inner.get_transfer_results(finished_req_ids))
    }

    /// `get_block_ids_with_load_errors`.
    pub fn get_block_ids_with_load_errors(
        &mut self,
    ) -> Result<SortedSet<BlockId>, ProtocolViolation> {
        self.protocol
            .handle(WorkerCall::GetBlockIdsWithLoadErrors)?;
        Ok(self.inner.get_block_ids_with_load_errors())
    }

    /// `build_connector_worker_meta`.
    pub fn build_connector_worker_meta(
        &mut self,
    ) -> Result<Option<C::WorkerMeta>, ProtocolViolation> {
        self.protocol.handle(WorkerCall::BuildWorkerMeta)?;
        Ok(self.inner.build_connector_worker_meta())
    }

    /// `clear_connector_metadata`.
    pub fn clear(&mut self) -> Result<(), ProtocolViolation> {
        self.protocol.handle(WorkerCall::Clear)?;
        self.inner.clear();
        Ok(())
    }
}
