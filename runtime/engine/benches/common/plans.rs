//! The transfers both transfer benchmarks move: `total` bytes as blocks of `block` bytes, from a
//! GPU arena of twice the blocks to a host pool of as many, one layer.

use kvrelay_core::{BlockId, JobId, KvLayout, LayoutOrder, RequestId, Transfer, TransferDirection};

/// The GPU layout, the host layout and a store of `total` bytes between them: `contiguous`
/// (consecutive GPU blocks to consecutive host slots) or `churned` (GPU blocks in a fixed
/// shuffled order, as after LRU churn of the free queue).
pub(crate) fn plan(block: usize, total: usize, churned: bool) -> (KvLayout, KvLayout, Transfer) {
    let n = total / block;
    // Twice the blocks moved, so that a shuffled order spans the whole arena.
    let blocks = (2 * n) as u32;
    let gpu = KvLayout::new(vec![0], blocks, block as u64, LayoutOrder::LayerMajor).unwrap();
    let host = gpu.with_blocks(n as u32, LayoutOrder::LayerMajor).unwrap();
    let mut ids: Vec<u64> = (0..n as u64).collect();
    if churned {
        // A fixed shuffle over twice the range (xorshift).
        let mut x = 0x9e37_79b9u64;
        let mut pool: Vec<u64> = (0..2 * n as u64).collect();
        for i in (1..pool.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            pool.swap(i, (x % (i as u64 + 1)) as usize);
        }
        ids = pool[..n].to_vec();
    }
    let transfer = Transfer {
        job: JobId(1),
        direction: TransferDirection::Store,
        request: RequestId(0),
        gpu_blocks: ids.into_iter().map(BlockId).collect(),
        groups: vec![0; n],
        external: (0..n as u64).collect(),
    };
    (gpu, host, transfer)
}
