//! CUDA transfer engine throughput: stores and loads of `TOTAL` bytes as `copy_plan` + the CUDA
//! engine's issue and completion threads (`cuda::CudaCopier`, the path a rank uses), for blocks
//! of 2 MiB, 256 KiB, 32 KiB and 8 KiB, against one `cuMemcpy` of the same bytes between the
//! same kinds of memory (device arena, pinned host) — the practical limit. `contiguous` and
//! `churned` as in the host benchmark (`benches/transfer.rs`); `call_per_copy` rows issue one
//! driver call a copy instead of batched calls (the backend's path before CUDA 12.8).
//!
//! Run on a machine with a GPU: `cargo bench -p kvrelay-engine --bench cuda`. Without one it
//! prints why and measures nothing. Compare each median with `one_copy` of the same direction
//! in the same run (divan prints bytes/s).

use divan::counter::BytesCount;
use divan::{Bencher, black_box};
use kvrelay_core::{TransferDirection, copy_plan};
use kvrelay_engine::transfer::CopyJob;
use kvrelay_engine::transfer::cuda::{self, CudaCopier};

#[path = "common/plans.rs"]
mod plans;

fn main() {
    match cuda::probe() {
        Ok(name) => {
            println!("CUDA device 0: {name}");
            divan::main();
        }
        Err(why) => println!("skipped: {why}"),
    }
}

/// Bytes moved per iteration.
const TOTAL: usize = 256 << 20;
const SIZES: [usize; 4] = [2 << 20, 256 << 10, 32 << 10, 8 << 10];

/// `batched`: many copies a driver call (`cuMemcpyBatchAsync`) or one call each.
fn through(b: Bencher, block: usize, churned: bool, direction: TransferDirection, batched: bool) {
    let (gpu, host, transfer) = plans::plan(block, TOTAL, churned);
    let mut copier =
        CudaCopier::open(gpu.total_bytes() as usize, host.total_bytes() as usize).unwrap();
    copier.set_batched(batched);
    b.counter(BytesCount::new(TOTAL)).bench_local(|| {
        let runs = copy_plan(black_box(&transfer), &gpu, &host).unwrap();
        let job = CopyJob {
            job: transfer.job,
            direction,
            runs,
            remote: None,
        };
        copier.copy(job).unwrap()
    });
}

#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn store_contiguous(b: Bencher, block: usize) {
    through(b, block, false, TransferDirection::Store, true);
}

#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn store_churned(b: Bencher, block: usize) {
    through(b, block, true, TransferDirection::Store, true);
}

#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn load_churned(b: Bencher, block: usize) {
    through(b, block, true, TransferDirection::Load, true);
}

#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn store_churned_call_per_copy(b: Bencher, block: usize) {
    through(b, block, true, TransferDirection::Store, false);
}

#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn load_churned_call_per_copy(b: Bencher, block: usize) {
    through(b, block, true, TransferDirection::Load, false);
}

/// One copy of the same bytes (block size does not matter; the argument keeps the rows side by
/// side).
#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn one_copy_store(b: Bencher, _block: usize) {
    let mut copier = CudaCopier::open(TOTAL, TOTAL).unwrap();
    b.counter(BytesCount::new(TOTAL))
        .bench_local(|| copier.one_copy(TransferDirection::Store, TOTAL).unwrap());
}

#[divan::bench(args = SIZES, sample_count = 20, sample_size = 1)]
fn one_copy_load(b: Bencher, _block: usize) {
    let mut copier = CudaCopier::open(TOTAL, TOTAL).unwrap();
    b.counter(BytesCount::new(TOTAL))
        .bench_local(|| copier.one_copy(TransferDirection::Load, TOTAL).unwrap());
}
