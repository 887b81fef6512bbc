//! What the scheduler side ships to every rank each step: [`OffloadingConnectorMeta`], the
//! transfer jobs and the jobs to flush. It crosses a process boundary (serde).

use alloc::vec::Vec;

use super::manager::ChunkId;
use crate::ids::{BlockId, JobId, RequestId};
use crate::sorted_set::SortedSet;
use alloc::collections::BTreeMap;

/// The GPU side of a transfer (vLLM's `GPULoadStoreSpec`): per KV cache group, the blocks read or
/// written, and the index in the request's block table of each group's first block.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuSpec {
    /// Per group, the non-null GPU blocks, in table order.
    pub block_ids: Vec<Vec<BlockId>>,
    /// Per group, the table index of `block_ids[g][0]` (0 when the group has no block). Its
    /// remainder modulo `blocks_per_chunk` is the offset of the first block inside the first
    /// host chunk.
    pub block_indices: Vec<u32>,
}

/// One transfer job as the workers receive it (vLLM's `TransferJob`).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferJob {
    /// The request it serves.
    pub request: RequestId,
    /// GPU blocks: the source of a store, the destination of a load.
    pub gpu: GpuSpec,
    /// Per group, the host chunks: the destination of a store, the source of a load.
    pub chunks: Vec<Vec<ChunkId>>,
    /// Loads only: completed before this step's forward (`sync`).
    pub sync: bool,
}

impl TransferJob {
    /// Number of GPU blocks moved.
    pub fn num_blocks(&self) -> usize {
        self.gpu.block_ids.iter().map(Vec::len).sum()
    }
}

/// `OffloadingConnectorMetadata`: the step's new jobs and the jobs the workers must complete
/// before any KV write of the step.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadingConnectorMeta {
    /// Loads created this step.
    pub load_jobs: BTreeMap<JobId, TransferJob>,
    /// Stores created this step.
    pub store_jobs: BTreeMap<JobId, TransferJob>,
    /// Jobs to finish in `handle_preemptions` (I-41, I-42).
    pub jobs_to_flush: SortedSet<JobId>,
}
