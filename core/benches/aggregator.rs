//! Aggregator throughput: one engine step of W ranks, each reporting 256 finished-sending ids,
//! 128 finished-recving ids and an offloading completion map of 256 jobs (the target:
//! ≥ 100× faster than vLLM 0.33.0's Python `KVOutputAggregator`, i.e. ≤ 4–7 µs at W = 8).
//!
//! The aggregator is warm (steady state): every id completes its quorum within the step, so the
//! counters return to idle and each iteration does the same work. Inputs are built once, outside
//! the timed region; the aggregated output is dropped outside it too.
//!
//! Run: `cargo bench -p kvrelay-core --bench aggregator`.

use divan::{Bencher, black_box};
use kvrelay_core::{
    Aggregator, JobId, Meta, Mode, OffloadMeta, Rank, RequestId, SortedSet, WorkerOutput,
};

fn main() {
    divan::main();
}

const SEND: u32 = 256;
const RECV: u32 = 128;
const JOBS: u64 = 256;

/// One step's outputs of `ranks` ranks; every rank reports the same ids and jobs.
fn step(ranks: usize) -> Vec<Option<WorkerOutput>> {
    let sending: SortedSet<RequestId> = (0..SEND).map(RequestId).collect();
    let recving: SortedSet<RequestId> = (SEND..SEND + RECV).map(RequestId).collect();
    let mut meta = OffloadMeta::from_counts((0..JOBS).map(|j| (JobId(1000 + j), 1)));
    meta.bytes = 1 << 20;
    meta.transfers = 4;
    (0..ranks)
        .map(|_| {
            Some(WorkerOutput {
                finished_sending: Some(sending.clone()),
                finished_recving: Some(recving.clone()),
                worker_meta: Some(Meta::Offload(meta.clone())),
                ..WorkerOutput::default()
            })
        })
        .collect()
}

fn run(bencher: Bencher<'_, '_>, ranks: usize, mode: Mode) {
    let outputs = step(ranks);
    let quorum = u32::try_from(ranks).unwrap();
    let mut agg = Aggregator::<Meta>::with_capacity(quorum, mode, (SEND + RECV) as usize);
    // Sanity: the step emits every id, so the aggregator is back to idle after each iteration.
    let out = agg.aggregate(&outputs, Rank(0)).unwrap().unwrap();
    assert_eq!(out.finished_sending.map(|s| s.len()), Some(SEND as usize));
    assert_eq!(out.finished_recving.map(|s| s.len()), Some(RECV as usize));
    bencher.bench_local(|| agg.aggregate(black_box(&outputs), Rank(0)).unwrap());
}

/// Compat mode (vLLM 0.33.0 exactly), W ranks.
#[divan::bench(args = [1, 2, 4, 8])]
fn aggregate_step_compat(bencher: Bencher<'_, '_>, ranks: usize) {
    run(bencher, ranks, Mode::Compat);
}

/// Strict mode (per-rank dedup of reports), W ranks.
#[divan::bench(args = [8])]
fn aggregate_step_strict(bencher: Bencher<'_, '_>, ranks: usize) {
    run(bencher, ranks, Mode::Strict);
}

/// The worker-metadata fold alone: 8 offload maps of 256 jobs.
#[divan::bench]
fn merge_offload_meta_w8(bencher: Bencher<'_, '_>) {
    let metas: Vec<Meta> = step(8)
        .into_iter()
        .map(|o| o.unwrap().worker_meta.unwrap())
        .collect();
    bencher.bench_local(|| {
        let mut acc = black_box(&metas[0]).clone();
        for m in &metas[1..] {
            kvrelay_core::WorkerMeta::merge_from(&mut acc, black_box(m)).unwrap();
        }
        acc
    });
}
