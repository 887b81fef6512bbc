//! Where a rank's KV bytes live: [`KvLayout`] maps (layer, block) to a byte offset in one
//! memory space (a rank's GPU KV arena, or its host offload pool), and [`copy_plan`] turns a
//! [`Transfer`] into the byte copies that move it, runs of contiguous blocks coalesced into one
//! copy.
//!
//! # When to call what
//!
//! A runtime builds one [`KvLayout`] per memory space at start-up ([`KvLayout::new`] checks the
//! sizes once), and for every transfer a worker connector starts calls [`copy_plan`] with the
//! GPU and host layouts; it then performs the copies in order, on whatever engine it has (host
//! `memcpy`, CUDA copies on a stream). The plan reads [`Transfer::groups`]: a block of KV cache
//! group `g` holds the KV of the layers of group `g` only.
//!
//! Pure arithmetic: no memory is touched here.

use alloc::vec::Vec;

use crate::ids::BlockId;
use crate::worker::Transfer;

/// How blocks and layers are ordered in a memory space.
#[derive(
    Clone, Copy, Debug, Eq, Hash, PartialEq, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LayoutOrder {
    /// All blocks of layer 0, then all blocks of layer 1, … (vLLM's per-layer KV tensors):
    /// consecutive blocks of one layer are contiguous.
    #[default]
    LayerMajor,
    /// All layers of block 0, then all layers of block 1, …: one block's layers are contiguous.
    BlockMajor,
}

/// A layout that cannot be built.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// No layers, no blocks, or blocks of 0 bytes.
    #[error("a KV layout needs at least one layer, one block and one byte per block")]
    Empty,
    /// The space does not fit in the address space.
    #[error("{layers} layers × {blocks} blocks × {block_bytes} bytes overflows")]
    TooLarge {
        /// Layers.
        layers: u32,
        /// Blocks.
        blocks: u32,
        /// Bytes per block per layer.
        block_bytes: u64,
    },
}

/// One memory space of one rank: `layers` layers of `blocks` blocks of `block_bytes` bytes each
/// (one block of one layer, this rank's shard), in `order`. Layer `l` belongs to KV cache group
/// `layer_groups[l]`.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvLayout {
    layer_groups: Vec<u32>,
    blocks: u32,
    block_bytes: u64,
    order: LayoutOrder,
}

impl KvLayout {
    /// A layout of `layer_groups.len()` layers. Fails when empty or when its size overflows.
    pub fn new(
        layer_groups: Vec<u32>,
        blocks: u32,
        block_bytes: u64,
        order: LayoutOrder,
    ) -> Result<Self, LayoutError> {
        let layers = u32::try_from(layer_groups.len()).map_err(|_| LayoutError::TooLarge {
            layers: u32::MAX,
            blocks,
            block_bytes,
        })?;
        if layers == 0 || blocks == 0 || block_bytes == 0 {
            return Err(LayoutError::Empty);
        }
        let too_large = LayoutError::TooLarge {
            layers,
            blocks,
            block_bytes,
        };
        let total = u64::from(layers)
            .checked_mul(u64::from(blocks))
            .and_then(|n| n.checked_mul(block_bytes))
            .ok_or(too_large.clone())?;
        usize::try_from(total).map_err(|_| too_large)?;
        Ok(Self {
            layer_groups,
            blocks,
            block_bytes,
            order,
        })
    }

    /// The same layers and block size over `blocks` blocks in `order` (e.g. the host pool of a
    /// GPU arena).
    pub fn with_blocks(&self, blocks: u32, order: LayoutOrder) -> Result<Self, LayoutError> {
        Self::new(self.layer_groups.clone(), blocks, self.block_bytes, order)
    }

    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.layer_groups.len() as u32
    }

    /// Number of blocks.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Bytes of one block of one layer.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The order of blocks and layers.
    pub fn order(&self) -> LayoutOrder {
        self.order
    }

    /// The KV cache group of `layer`.
    pub fn group_of(&self, layer: u32) -> Option<u32> {
        self.layer_groups.get(layer as usize).copied()
    }

    /// The layers of `group`, ascending.
    pub fn layers_of(&self, group: u32) -> impl Iterator<Item = u32> + '_ {
        (0..self.layers()).filter(move |&l| self.layer_groups[l as usize] == group)
    }

    /// Bytes of the whole space.
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.layers()) * u64::from(self.blocks) * self.block_bytes
    }

    /// The offset of `block` of `layer`, or `None` outside the space.
    pub fn offset(&self, layer: u32, block: u64) -> Option<u64> {
        if layer >= self.layers() || block >= u64::from(self.blocks) {
            return None;
        }
        let index = match self.order {
            LayoutOrder::LayerMajor => u64::from(layer) * u64::from(self.blocks) + block,
            LayoutOrder::BlockMajor => block * u64::from(self.layers()) + u64::from(layer),
        };
        Some(index * self.block_bytes)
    }
}

/// One copy of `len` bytes between the GPU space and the host space, in the direction of its
/// transfer (a store reads `gpu` and writes `host`; a load the other way).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct CopyRun {
    /// Offset in the GPU space.
    pub gpu: u64,
    /// Offset in the host space.
    pub host: u64,
    /// Bytes.
    pub len: u64,
}

/// A transfer that cannot be planned.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// `gpu_blocks`, `groups` and `external` differ in length.
    #[error("transfer {job}: {blocks} GPU blocks, {groups} groups, {external} external slots")]
    Shape {
        /// The job.
        job: u64,
        /// GPU blocks.
        blocks: usize,
        /// Group entries.
        groups: usize,
        /// External slots.
        external: usize,
    },
    /// A block or slot outside its space.
    #[error("transfer {job}: GPU block {block:?} / host slot {slot} outside the KV spaces")]
    OutOfRange {
        /// The job.
        job: u64,
        /// The GPU block.
        block: BlockId,
        /// The host slot.
        slot: u64,
    },
    /// A group no layer belongs to.
    #[error("transfer {job}: group {group} has no layer")]
    UnknownGroup {
        /// The job.
        job: u64,
        /// The group.
        group: u32,
    },
}

/// The copies that move `transfer` between `gpu` and `host` (both of the same layers and block
/// size): for every block, the bytes of every layer of its group, in the GPU space's order,
/// each copy extended while both sides stay contiguous. A transfer of `n` consecutive blocks to
/// `n` consecutive slots in two layer-major spaces is one copy per layer.
pub fn copy_plan(
    transfer: &Transfer,
    gpu: &KvLayout,
    host: &KvLayout,
) -> Result<Vec<CopyRun>, PlanError> {
    let job = transfer.job.0;
    let n = transfer.gpu_blocks.len();
    if transfer.groups.len() != n || transfer.external.len() != n {
        return Err(PlanError::Shape {
            job,
            blocks: n,
            groups: transfer.groups.len(),
            external: transfer.external.len(),
        });
    }
    for &g in &transfer.groups {
        if gpu.layers_of(g).next().is_none() {
            return Err(PlanError::UnknownGroup { job, group: g });
        }
    }
    let mut runs: Vec<CopyRun> = Vec::new();
    let mut push = |layer: u32, i: usize| -> Result<(), PlanError> {
        let (block, slot) = (transfer.gpu_blocks[i], transfer.external[i]);
        let out_of_range = PlanError::OutOfRange { job, block, slot };
        let g = gpu.offset(layer, block.0).ok_or(out_of_range.clone())?;
        let h = host.offset(layer, slot).ok_or(out_of_range)?;
        let len = gpu.block_bytes;
        match runs.last_mut() {
            Some(r) if r.gpu + r.len == g && r.host + r.len == h => r.len += len,
            _ => runs.push(CopyRun {
                gpu: g,
                host: h,
                len,
            }),
        }
        Ok(())
    };
    match gpu.order {
        LayoutOrder::LayerMajor => {
            for layer in 0..gpu.layers() {
                let group = gpu.layer_groups[layer as usize];
                for i in (0..n).filter(|&i| transfer.groups[i] == group) {
                    push(layer, i)?;
                }
            }
        }
        LayoutOrder::BlockMajor => {
            for i in 0..n {
                for layer in gpu.layers_of(transfer.groups[i]) {
                    push(layer, i)?;
                }
            }
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{JobId, RequestId};
    use crate::worker::TransferDirection;
    use alloc::vec;

    fn transfer(blocks: &[u32], groups: &[u32], slots: &[u64]) -> Transfer {
        Transfer {
            job: JobId(1),
            direction: TransferDirection::Store,
            request: RequestId(0),
            gpu_blocks: blocks.iter().map(|&b| BlockId(u64::from(b))).collect(),
            groups: groups.to_vec(),
            external: slots.to_vec(),
        }
    }

    /// Every (layer, block) byte range the plan copies, one entry per block and layer.
    fn bytes(runs: &[CopyRun], bb: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for r in runs {
            for k in 0..r.len / bb {
                out.push((r.gpu + k * bb, r.host + k * bb));
            }
        }
        out.sort_unstable();
        out
    }

    // Protects coalescing: consecutive blocks to consecutive slots in layer-major spaces are one
    // copy per layer, and the coalesced plan moves exactly the bytes of the naive one.
    #[test]
    fn consecutive_blocks_coalesce_per_layer() {
        let gpu = KvLayout::new(vec![0, 0, 0], 16, 64, LayoutOrder::LayerMajor).unwrap();
        let host = gpu.with_blocks(32, LayoutOrder::LayerMajor).unwrap();
        let t = transfer(&[4, 5, 6], &[0, 0, 0], &[10, 11, 12]);
        let runs = copy_plan(&t, &gpu, &host).unwrap();
        assert_eq!(runs.len(), 3);
        assert!(runs.iter().all(|r| r.len == 3 * 64));
        let mut naive = Vec::new();
        for l in 0..3 {
            for (b, s) in [(4, 10), (5, 11), (6, 12)] {
                naive.push((gpu.offset(l, b).unwrap(), host.offset(l, s).unwrap()));
            }
        }
        naive.sort_unstable();
        assert_eq!(bytes(&runs, 64), naive);
    }

    // Protects correctness after churn: scattered blocks are not merged.
    #[test]
    fn scattered_blocks_do_not_coalesce() {
        let gpu = KvLayout::new(vec![0], 16, 64, LayoutOrder::LayerMajor).unwrap();
        let host = gpu.with_blocks(16, LayoutOrder::LayerMajor).unwrap();
        let t = transfer(&[7, 3, 4], &[0, 0, 0], &[0, 1, 2]);
        let runs = copy_plan(&t, &gpu, &host).unwrap();
        assert_eq!(
            runs,
            vec![
                CopyRun {
                    gpu: 7 * 64,
                    host: 0,
                    len: 64
                },
                CopyRun {
                    gpu: 3 * 64,
                    host: 64,
                    len: 128
                },
            ]
        );
    }

    // Protects the group rule: a block moves the layers of its own group only.
    #[test]
    fn a_block_moves_its_groups_layers_only() {
        let gpu = KvLayout::new(vec![0, 1, 0, 1], 8, 32, LayoutOrder::BlockMajor).unwrap();
        let host = gpu.with_blocks(8, LayoutOrder::BlockMajor).unwrap();
        let t = transfer(&[2, 3], &[1, 0], &[5, 6]);
        let runs = copy_plan(&t, &gpu, &host).unwrap();
        let moved = bytes(&runs, 32);
        let want = {
            let mut w = vec![
                (gpu.offset(1, 2).unwrap(), host.offset(1, 5).unwrap()),
                (gpu.offset(3, 2).unwrap(), host.offset(3, 5).unwrap()),
                (gpu.offset(0, 3).unwrap(), host.offset(0, 6).unwrap()),
                (gpu.offset(2, 3).unwrap(), host.offset(2, 6).unwrap()),
            ];
            w.sort_unstable();
            w
        };
        assert_eq!(moved, want);
    }

    // Protects the plan's input checks (a transfer crossing into a runtime is validated).
    #[test]
    fn bad_transfers_are_typed_errors() {
        let gpu = KvLayout::new(vec![0], 4, 8, LayoutOrder::LayerMajor).unwrap();
        let host = gpu.with_blocks(4, LayoutOrder::LayerMajor).unwrap();
        assert!(matches!(
            copy_plan(&transfer(&[1], &[], &[0]), &gpu, &host),
            Err(PlanError::Shape { .. })
        ));
        assert!(matches!(
            copy_plan(&transfer(&[4], &[0], &[0]), &gpu, &host),
            Err(PlanError::OutOfRange { .. })
        ));
        assert!(matches!(
            copy_plan(&transfer(&[0], &[0], &[4]), &gpu, &host),
            Err(PlanError::OutOfRange { .. })
        ));
        assert!(matches!(
            copy_plan(&transfer(&[0], &[2], &[0]), &gpu, &host),
            Err(PlanError::UnknownGroup { group: 2, .. })
        ));
        assert_eq!(
            KvLayout::new(vec![], 4, 8, LayoutOrder::LayerMajor),
            Err(LayoutError::Empty)
        );
        assert!(matches!(
            KvLayout::new(vec![0; 4], u32::MAX, u64::MAX / 2, LayoutOrder::LayerMajor),
            Err(LayoutError::TooLarge { .. })
        ));
    }
}
