//! Host transfer engine throughput: a store of `TOTAL` bytes as `copy_plan` + the host engine's
//! copies, for blocks of 2 MiB, 256 KiB, 32 KiB and 8 KiB, against one plain `memcpy` of the
//! same bytes (the practical limit). `contiguous`: consecutive GPU blocks to consecutive host
//! slots (coalesced into one copy per layer); `churned`: GPU blocks in a shuffled order, as after
//! LRU churn of the free queue (no run longer than a block on the GPU side).
//!
//! Run: `cargo bench -p kvrelay-engine --bench transfer`. Compare each `plan_and_copy` median
//! with `memcpy` of the same size in the same run (divan prints bytes/s).

use divan::counter::BytesCount;
use divan::{Bencher, black_box};
use kvrelay_core::{KvLayout, Transfer, copy_plan};
use kvrelay_engine::transfer::host;

fn main() {
    divan::main();
}

/// Bytes moved per iteration.
const TOTAL: usize = 32 << 20;
const SIZES: [usize; 4] = [2 << 20, 256 << 10, 32 << 10, 8 << 10];

#[path = "common/plans.rs"]
mod plans;

struct Setup {
    gpu: KvLayout,
    host: KvLayout,
    transfer: Transfer,
    gpu_mem: Vec<u8>,
    host_mem: Vec<u8>,
}

fn setup(block: usize, churned: bool) -> Setup {
    let (gpu, host, transfer) = plans::plan(block, TOTAL, churned);
    Setup {
        gpu_mem: vec![1u8; gpu.total_bytes() as usize],
        host_mem: vec![0u8; host.total_bytes() as usize],
        gpu,
        host,
        transfer,
    }
}

#[divan::bench(args = SIZES)]
fn plan_and_copy_contiguous(b: Bencher, block: usize) {
    let mut s = setup(block, false);
    b.counter(BytesCount::new(TOTAL)).bench_local(|| {
        let runs = copy_plan(black_box(&s.transfer), &s.gpu, &s.host).unwrap();
        host::store(&runs, &s.gpu_mem, &mut s.host_mem)
    });
}

#[divan::bench(args = SIZES)]
fn plan_and_copy_churned(b: Bencher, block: usize) {
    let mut s = setup(block, true);
    b.counter(BytesCount::new(TOTAL)).bench_local(|| {
        let runs = copy_plan(black_box(&s.transfer), &s.gpu, &s.host).unwrap();
        host::store(&runs, &s.gpu_mem, &mut s.host_mem)
    });
}

/// One `memcpy` of the same bytes (block size does not matter; the argument keeps the rows
/// side by side).
#[divan::bench(args = SIZES)]
fn memcpy(b: Bencher, _block: usize) {
    let src = vec![1u8; TOTAL];
    let mut dst = vec![0u8; TOTAL];
    b.counter(BytesCount::new(TOTAL)).bench_local(|| {
        dst.copy_from_slice(black_box(&src));
    });
}
