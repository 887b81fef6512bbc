//! The P/D connector on the real scheduler: params in and out, delayed frees released on the
//! acknowledgement or (strict) at the end of their lease, remote loads, failed loads.

use alloc::string::ToString;
use alloc::vec;
use alloc::vec::Vec;

use super::*;
use crate::messages::{AggregatedOutput, ModelOutput};
use crate::scheduler::{Params, RequestSpec, RequestStatus, Scheduler, SchedulerConfig};
use crate::sorted_set::SortedSet;
use crate::worker::{TransferCommand, TransferDone, WorkerConnector};
use crate::{JobId, SchedulerConnector};

const R: RequestId = RequestId(1);

fn scheduler(lease: Option<u32>) -> Scheduler<PdConnector> {
    let config = PdConfig {
        lease_steps: lease,
        ..PdConfig::both(7)
    };
    Scheduler::new(SchedulerConfig::default(), PdConnector::new(config)).expect("valid")
}

fn spec(params: Params) -> RequestSpec {
    RequestSpec {
        id: R,
        prompt: (0..40).collect(),
        max_tokens: 1,
        stop_token: None,
        kv_transfer_params: Some(params),
    }
}

/// The aggregated output of one rank's step.
fn kv(sending: &[RequestId], recving: &[RequestId]) -> AggregatedOutput {
    let set = |v: &[RequestId]| (!v.is_empty()).then(|| v.iter().copied().collect());
    AggregatedOutput {
        finished_sending: set(sending),
        finished_recving: set(recving),
        invalid_block_ids: SortedSet::new(),
        failed_recving: SortedSet::new(),
        worker_meta: None,
        kv_events: None,
        expected_finished_count: 1,
    }
}

/// Runs one step; `sampled` says whether the step computed `R` (and so samples a token).
fn step(s: &mut Scheduler<PdConnector>, kv_out: AggregatedOutput) -> (PdMeta, Option<Params>) {
    let st = s.schedule().expect("schedules");
    let sampled = st
        .output
        .num_scheduled_tokens
        .iter()
        .map(|(r, _)| (*r, vec![5]))
        .collect();
    let out = ModelOutput {
        sampled,
        kv_connector_output: Some(kv_out),
    };
    let res = s.update_from_output(st.output.step, out).expect("applies");
    let params = res.outputs.into_iter().find_map(|o| o.kv_transfer_params);
    (st.meta, params)
}

#[test]
fn params_round_trip_and_bad_ones_are_named() {
    // The params cross processes (router ↔ engines): what one side writes the other reads, and
    // a value that cannot be read is a typed error naming its key.
    let at = RemotePrefill {
        engine: 3,
        request: 9,
        num_tokens: 48,
    };
    let p = PdParams::parse(&PdParams::for_decode(at)).expect("reads");
    assert_eq!(p.remote_prefill, Some(at));
    assert!(
        PdParams::parse(&PdParams::for_prefill())
            .unwrap()
            .remote_decode
    );
    let mut bad = PdParams::for_decode(at);
    bad.insert(REMOTE_NUM_TOKENS.to_string(), "-1".to_string());
    assert!(matches!(
        PdParams::parse(&bad),
        Err(PdParamsError::NotANumber {
            key: REMOTE_NUM_TOKENS,
            ..
        })
    ));
    bad.remove(REMOTE_ENGINE_ID);
    assert_eq!(
        PdParams::parse(&bad),
        Err(PdParamsError::Missing {
            key: REMOTE_ENGINE_ID
        })
    );
    bad.insert(DO_REMOTE_PREFILL.to_string(), "yes".to_string());
    assert!(matches!(
        PdParams::parse(&bad),
        Err(PdParamsError::NotABool { .. })
    ));
}

/// The prefill engine runs `R` to its one token: it finishes held, with decode params.
fn prefilled(lease: Option<u32>) -> Scheduler<PdConnector> {
    let mut s = scheduler(lease);
    s.add_request(spec(PdParams::for_prefill())).expect("added");
    let (_, params) = step(&mut s, kv(&[], &[]));
    let at = PdParams::parse(&params.expect("decode params")).unwrap();
    assert_eq!(
        at.remote_prefill,
        Some(RemotePrefill {
            engine: 7,
            request: 1,
            num_tokens: 40
        })
    );
    assert_eq!(s.status(R), Some(RequestStatus::FinishedLengthCapped));
    s
}

#[test]
fn a_held_request_is_released_by_its_acknowledgement_only_in_compat() {
    // I-15 / I-16: the blocks stay held until the decode side says it is done, and the release
    // reaches the workers only after they heard the request finish. Without a lease (vLLM) a
    // silent decode side holds them for ever.
    let mut s = prefilled(None);
    for _ in 0..20 {
        let (meta, _) = step(&mut s, kv(&[], &[]));
        assert!(meta.releases.is_empty());
    }
    assert_eq!(s.connector().awaiting_ack().collect::<Vec<_>>(), vec![R]);
    let held = s.connector().held_blocks(R).expect("held").to_vec();
    assert_eq!(held.len(), 1, "one KV-cache group");
    assert_eq!(
        held[0].len(),
        3,
        "40 prompt tokens and 1 computed: 3 blocks of 16"
    );
    assert!(s.connector_mut().acknowledge(R));
    assert!(
        !s.connector_mut().acknowledge(R),
        "a repeated ack holds nothing"
    );
    let (meta, _) = step(&mut s, kv(&[], &[]));
    assert_eq!(meta.releases, vec![R]);
    assert!(
        s.connector().held_blocks(R).is_none(),
        "a released request's blocks are no longer readable, before the scheduler frees them"
    );
    step(&mut s, kv(&[R], &[]));
    assert_eq!(
        s.status(R),
        None,
        "freed on the aggregated finished_sending"
    );
    assert_eq!(s.connector().stats().acks, 1);
    assert_eq!(s.connector().stats().late_acks, 1);
    assert!(!s.connector().tracks_request(R));
}

#[test]
fn strict_releases_a_held_request_when_its_lease_runs_out() {
    // I-54 (vLLM #46283): with a lease of 3 steps a silent decode side holds the blocks for 3
    // steps after the workers heard the request finish, then they are released and counted;
    // the acknowledgement that comes after is late.
    let mut s = prefilled(Some(3));
    assert!(
        s.connector().has_pending_push_work(),
        "the lease needs steps"
    );
    let mut releases = Vec::new();
    for _ in 0..3 {
        let (meta, _) = step(&mut s, kv(&[], &[]));
        releases.push(meta.releases);
    }
    assert_eq!(releases, vec![vec![], vec![], vec![R]]);
    assert_eq!(s.connector().stats().leases_expired, 1);
    step(&mut s, kv(&[R], &[]));
    assert_eq!(s.status(R), None);
    assert!(!s.connector_mut().acknowledge(R));
    assert_eq!(s.connector().stats().late_acks, 1);
}

#[test]
fn a_request_without_remote_decode_is_freed_at_once() {
    // Only a request that asked for it is held: a plain request on a prefill engine frees its
    // blocks when it finishes, and returns no params.
    let mut s = scheduler(Some(3));
    s.add_request(spec(Params::new())).expect("added");
    let (_, params) = step(&mut s, kv(&[], &[]));
    assert_eq!(params, None);
    assert_eq!(s.status(R), None);
}

#[test]
fn the_decode_side_loads_from_the_params_and_recovers_a_failed_load() {
    // The lookup answers the remote tokens as an async hit; the load reads the prefill
    // engine's slots of its own request id; a failed load is reported as invalid blocks, and
    // the params are consumed once (the scheduler recomputes, I-33).
    let mut s = scheduler(None);
    let at = RemotePrefill {
        engine: 3,
        request: 9,
        num_tokens: 32,
    };
    s.add_request(spec(PdParams::for_decode(at)))
        .expect("added");
    let (meta, _) = step(&mut s, kv(&[], &[]));
    assert_eq!(s.status(R), Some(RequestStatus::WaitingForRemoteKvs));
    let [load] = &meta.loads[..] else {
        panic!("one load: {meta:?}")
    };
    assert_eq!((load.request, load.engine), (R, 3));
    assert_eq!(
        load.slots,
        vec![remote_slot(RequestId(9), 0), remote_slot(RequestId(9), 1)]
    );
    let mut w = PdWorker::new(true);
    w.bind(&meta);
    let cmds = w.start_load_kv();
    let [TransferCommand::Start(t)] = &cmds[..] else {
        panic!("one job: {cmds:?}")
    };
    assert_eq!(t.gpu_blocks, load.blocks);
    w.handle_transfer_done(TransferDone {
        job: JobId(0),
        ok: false,
    });
    let results = w.get_transfer_results(&SortedSet::new());
    assert_eq!(results.finished_recving, Some(SortedSet::from_vec(vec![R])));
    let invalid = w.get_block_ids_with_load_errors();
    assert_eq!(invalid, load.blocks.iter().copied().collect());
    let mut out = kv(&[], &[R]);
    out.invalid_block_ids = invalid;
    step(&mut s, out);
    assert_eq!(s.connector().stats().remote_loads, 1);
    // Failed under the `fail` policy (the default config's).
    assert_eq!(s.status(R), None);
}

#[test]
fn a_load_names_each_blocks_kv_cache_group() {
    // With two KV-cache groups the load carries both groups' blocks; each block's group tells
    // the transfer engine which layers' bytes to move.
    let config = SchedulerConfig {
        groups: vec![
            crate::scheduler::GroupKind::FullAttention,
            crate::scheduler::GroupKind::SlidingWindow { window: 64 },
        ],
        ..SchedulerConfig::default()
    };
    let pd = PdConfig {
        failures_as_blocks: false,
        ..PdConfig::both(7)
    };
    let mut s = Scheduler::new(config, PdConnector::new(pd)).expect("valid");
    let at = RemotePrefill {
        engine: 3,
        request: 9,
        num_tokens: 32,
    };
    s.add_request(spec(PdParams::for_decode(at)))
        .expect("added");
    let st = s.schedule().expect("schedules");
    let [load] = &st.meta.loads[..] else {
        panic!("one load: {:?}", st.meta)
    };
    assert_eq!(load.groups, vec![0, 0, 1, 1]);
    assert_eq!(
        load.slots[..2],
        load.slots[2..],
        "the same prompt blocks, per group"
    );
    let mut w = PdWorker::new(false);
    w.bind(&st.meta);
    let cmds = w.start_load_kv();
    let [TransferCommand::Start(t)] = &cmds[..] else {
        panic!("one job: {cmds:?}")
    };
    assert_eq!(t.groups, load.groups);
}

#[test]
fn a_remote_slot_names_its_request_and_block() {
    let s = remote_slot(RequestId(0x3fff_ffff), 7);
    assert!(is_remote_slot(s));
    assert_eq!(remote_slot_parts(s), Some((RequestId(0x3fff_ffff), 7)));
    assert_eq!(remote_slot_parts(5), None, "a host slot is not remote");
}
