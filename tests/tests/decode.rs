//! Everything that crosses a process boundary (engine ↔ rank) decodes to a value or a typed
//! error, never a panic, and a decoded value is safe to use: arbitrary bytes through postcard
//! (the runtime's wire codec), then the operations the receiver performs on the value. The
//! invariants a decoder must check (an [`OffloadMeta`]'s sorted jobs and one count per job,
//! `multi` metadata nesting at most [`MAX_META_DEPTH`] deep) have their own tests below.

use kvrelay_core::{
    AggregatedOutput, Aggregator, JobId, MAX_META_DEPTH, Meta, MultiMeta, OffloadMeta,
    OffloadingConnectorMeta, OffloadingWorker, OffloadingWorkerConfig, Rank, RequestSpec,
    ScheduledStep, ScriptedMeta, TransferCommand, TransferDone, WorkerConnector, WorkerMeta,
    WorkerOutput, merge,
};
use proptest::prelude::*;

/// Decodes `bytes` as `T`; a value must round-trip through the encoder.
fn decode<T>(bytes: &[u8]) -> Option<T>
where
    T: serde::de::DeserializeOwned + serde::Serialize + PartialEq + core::fmt::Debug,
{
    let v: T = postcard::from_bytes(bytes).ok()?;
    let again: T = postcard::from_bytes(&postcard::to_allocvec(&v).unwrap()).unwrap();
    assert_eq!(again, v, "a decoded value round-trips");
    Some(v)
}

/// Uses a decoded worker metadata as the engine would: merges it with itself and with an
/// ordinary value, counts jobs, feeds it to the aggregator as rank 0's output.
fn use_meta(m: Meta) {
    let _ = merge(Some(m.clone()), Some(m.clone()));
    let mut probe = Meta::Offload(OffloadMeta::from_counts([(JobId(1), 1)]));
    let _ = probe.merge_from(&m);
    if let Meta::Offload(o) = &m {
        let _ = o.count(JobId(3));
        let mut x = o.clone();
        x.add(o);
        x.mark_completed(JobId(0));
    }
    let mut agg: Aggregator<Meta> = Aggregator::new(1, kvrelay_core::Mode::Compat);
    let out = WorkerOutput {
        worker_meta: Some(m),
        ..WorkerOutput::default()
    };
    let _ = agg.aggregate(&[Some(out)], Rank(0));
}

/// Runs a decoded offloading step through a worker's hooks, as a rank does.
fn use_offloading_step(step: ScheduledStep<OffloadingConnectorMeta>) {
    let mut w = OffloadingWorker::new(OffloadingWorkerConfig {
        blocks_per_chunk: 2,
        is_store_writer: true,
        bytes_per_block: 1,
        mode: kvrelay_core::Mode::Compat,
    });
    let mut cmds = w.handle_preemptions(&step.meta);
    w.bind(&step.meta);
    cmds.extend(w.start_load_kv());
    cmds.extend(w.wait_for_save());
    for c in cmds {
        if let TransferCommand::Start(t) = c {
            w.handle_transfer_done(TransferDone {
                job: t.job,
                ok: true,
            });
        }
    }
    let _ = w.get_transfer_results(&step.output.finished_req_ids);
    let _ = w.get_block_ids_with_load_errors();
    let _ = w.build_connector_worker_meta();
    w.clear();
    w.check_invariants()
        .expect("a malformed job is a typed error, not a broken worker");
}

/// Bytes biased towards small values (variant tags, lengths and ids of a few), so that random
/// input often decodes into a value of the right shape with wrong contents.
fn wire_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(prop_oneof![3 => 0u8..4, 1 => any::<u8>()], 0..96)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// Rank → engine: a rank's output and the metadata inside it.
    #[test]
    fn rank_outputs_decode_or_fail_cleanly(bytes in wire_bytes()) {
        if let Some(m) = decode::<Meta>(&bytes) {
            use_meta(m);
        }
        if let Some(o) = decode::<WorkerOutput<Meta>>(&bytes) {
            if let Some(m) = o.worker_meta.clone() {
                use_meta(m);
            }
            let mut agg: Aggregator<Meta> = Aggregator::new(2, kvrelay_core::Mode::Strict);
            let _ = agg.aggregate(&[Some(o.clone()), Some(o)], Rank(0));
        }
        let _ = decode::<AggregatedOutput<Meta>>(&bytes);
        let _ = decode::<TransferDone>(&bytes);
    }

    /// Engine → rank: a scheduled step with each of kvrelay's connector metadata.
    #[test]
    fn scheduled_steps_decode_or_fail_cleanly(bytes in wire_bytes()) {
        if let Some(step) = decode::<ScheduledStep<OffloadingConnectorMeta>>(&bytes) {
            use_offloading_step(step);
        }
        let _ = decode::<ScheduledStep<ScriptedMeta>>(&bytes);
        let _ = decode::<ScheduledStep<MultiMeta<OffloadingConnectorMeta>>>(&bytes);
        let _ = decode::<RequestSpec>(&bytes);
    }

    /// Well-formed values survive the trip: what a rank sends is what the engine gets.
    #[test]
    fn offload_metadata_round_trips(counts in proptest::collection::vec((0u64..50, 1u32..4), 0..20)) {
        let m = OffloadMeta::from_counts(counts.into_iter().map(|(j, n)| (JobId(j), n)));
        let bytes = postcard::to_allocvec(&Meta::Offload(m.clone())).unwrap();
        prop_assert_eq!(postcard::from_bytes::<Meta>(&bytes).unwrap(), Meta::Offload(m));
    }
}

/// An [`OffloadMeta`] whose jobs are unsorted, repeated, or not matched one to one by counts,
/// or whose failed jobs are unsorted or not completed jobs, is refused when decoded (before the
/// fix, `add` and `count` indexed past the counts and panicked). The wire layout is the
/// struct's: jobs, counts, failed, bytes, transfers.
#[test]
fn malformed_offload_metadata_is_refused() {
    #[derive(serde::Serialize)]
    struct Raw {
        jobs: Vec<u64>,
        counts: Vec<u32>,
        failed: Vec<u64>,
        bytes: u64,
        transfers: u64,
    }
    let enc = |jobs: Vec<u64>, counts: Vec<u32>, failed: Vec<u64>| {
        postcard::to_allocvec(&Raw {
            jobs,
            counts,
            failed,
            bytes: 0,
            transfers: 0,
        })
        .unwrap()
    };
    let ok = enc(vec![1, 4], vec![1, 2], vec![4]);
    let m: OffloadMeta = postcard::from_bytes(&ok).unwrap();
    assert_eq!(m.count(JobId(4)), 2);
    assert!(m.is_failed(JobId(4)) && !m.is_failed(JobId(1)));
    for (jobs, counts, failed) in [
        (vec![4, 1], vec![1, 1], vec![]),
        (vec![1, 1], vec![1, 1], vec![]),
        (vec![1, 2, 3], vec![1], vec![]),
        (vec![1], vec![1, 1], vec![]),
        (vec![1, 2], vec![1, 1], vec![2, 1]),
        (vec![1, 2], vec![1, 1], vec![3]),
    ] {
        let bytes = enc(jobs.clone(), counts.clone(), failed.clone());
        assert!(
            postcard::from_bytes::<OffloadMeta>(&bytes).is_err(),
            "jobs {jobs:?} counts {counts:?} failed {failed:?}"
        );
    }
    // The same rule holds for JSON, where `failed` may be left out (no job failed).
    let e = serde_json::from_str::<OffloadMeta>(
        r#"{"jobs": [2, 1], "counts": [1, 1], "bytes": 0, "transfers": 0}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("strictly ascending"), "{e}");
    let m = serde_json::from_str::<OffloadMeta>(
        r#"{"jobs": [1, 2], "counts": [1, 1], "bytes": 0, "transfers": 0}"#,
    )
    .unwrap();
    assert!(m.failed_jobs().is_empty());
}

/// `multi` metadata nests at most [`MAX_META_DEPTH`] deep when decoded: deeper input is an error,
/// not an unbounded recursion (a hostile length of nesting would otherwise exhaust the stack).
#[test]
fn multi_metadata_nesting_is_bounded() {
    let nest = |depth: usize| {
        let mut m = Meta::Set(Default::default());
        for _ in 0..depth {
            m = Meta::Multi(vec![None, Some(m)]);
        }
        m
    };
    let ok = nest(MAX_META_DEPTH);
    let bytes = postcard::to_allocvec(&ok).unwrap();
    assert_eq!(postcard::from_bytes::<Meta>(&bytes).unwrap(), ok);
    let deep = postcard::to_allocvec(&nest(MAX_META_DEPTH + 1)).unwrap();
    assert!(postcard::from_bytes::<Meta>(&deep).is_err());
    // A million nested `multi` tags (0x02, one slot, `Some`): refused at depth 9.
    let mut hostile = Vec::new();
    for _ in 0..1_000_000 {
        hostile.extend_from_slice(&[2, 1, 1]);
    }
    assert!(postcard::from_bytes::<Meta>(&hostile).is_err());
    let json = serde_json::to_string(&nest(MAX_META_DEPTH + 1)).unwrap();
    assert!(serde_json::from_str::<Meta>(&json).is_err());
    assert_eq!(
        serde_json::from_str::<Meta>(&serde_json::to_string(&ok).unwrap()).unwrap(),
        ok
    );
}
