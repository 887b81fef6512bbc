//! Scheduler paths with the scripted connector: SEMANTICS.md §9.4 and the rules of §2.3, §2.7,
//! §2.8, §6.1, §8.3 and §8.6. `check_invariants()` runs after every call.

use kvrelay_core::{
    AggregatedOutput, BlockId, ConnectorCall, FinishReason, GroupKind, LoadFailurePolicy, Lookup,
    Mode, ModelOutput, RequestId, RequestSpec, RequestStatus, Scheduler, SchedulerConfig,
    SchedulerError, ScriptedConnector, SortedSet, StepId,
};

fn rid(n: u32) -> RequestId {
    RequestId(n)
}

fn spec(id: u32, len: u32, max_tokens: u32) -> RequestSpec {
    RequestSpec {
        id: rid(id),
        prompt: (0..len).map(|i| 1000 * id + i + 1).collect(),
        max_tokens,
        stop_token: None,
        kv_transfer_params: None,
    }
}

fn sched(config: SchedulerConfig) -> Scheduler<ScriptedConnector> {
    Scheduler::new(config, ScriptedConnector::new()).unwrap()
}

fn check(s: &Scheduler<ScriptedConnector>) {
    s.check_invariants().unwrap();
}

fn agg() -> AggregatedOutput {
    AggregatedOutput {
        finished_sending: None,
        finished_recving: None,
        invalid_block_ids: SortedSet::new(),
        failed_recving: SortedSet::new(),
        worker_meta: None,
        kv_events: None,
        expected_finished_count: 1,
    }
}

fn recv(ids: &[u32]) -> AggregatedOutput {
    AggregatedOutput {
        finished_recving: Some(SortedSet::from_vec(ids.iter().map(|&i| rid(i)).collect())),
        ..agg()
    }
}

fn send(ids: &[u32]) -> AggregatedOutput {
    AggregatedOutput {
        finished_sending: Some(SortedSet::from_vec(ids.iter().map(|&i| rid(i)).collect())),
        ..agg()
    }
}

/// Runs one step: schedule, fake-sample, apply `kv`.
fn step(
    s: &mut Scheduler<ScriptedConnector>,
    kv: Option<AggregatedOutput>,
) -> (kvrelay_core::SchedulerOutput, kvrelay_core::StepResult) {
    let st = s.schedule().unwrap();
    check(s);
    let sampled = s.fake_sample(st.output.step);
    let res = s
        .update_from_output(
            st.output.step,
            ModelOutput {
                sampled,
                kv_connector_output: kv,
            },
        )
        .unwrap();
    check(s);
    (st.output, res)
}

#[test]
fn s19_async_load_happy_path() {
    let mut s = sched(SchedulerConfig::default());
    for id in [1, 2] {
        s.connector_mut().set_lookup(
            rid(id),
            Lookup::Hit {
                tokens: 16,
                load_async: true,
            },
        );
        s.add_request(spec(id, 32, 4)).unwrap();
    }
    let (out, _) = step(&mut s, None);
    assert_eq!(out.total_num_scheduled_tokens, 0);
    for id in [1, 2] {
        assert_eq!(s.status(rid(id)), Some(RequestStatus::WaitingForRemoteKvs));
        assert_eq!(s.view().request(rid(id)).unwrap().num_computed_tokens(), 16);
    }
    let calls = s.connector_mut().take_calls();
    let lookups = calls
        .iter()
        .filter(|c| matches!(c, ConnectorCall::GetNumNewMatchedTokens { .. }))
        .count();
    assert_eq!(lookups, 2);
    assert!(calls.iter().any(|c| matches!(
        c,
        ConnectorCall::UpdateStateAfterAlloc {
            num_external_tokens: 16,
            ..
        }
    )));
    // The loads finish: both are promoted and scheduled for their remaining 16 tokens.
    let (_, _) = step(&mut s, Some(recv(&[1, 2])));
    let (out, _) = step(&mut s, None);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(1), 16), (rid(2), 16)]);
    let calls = s.connector_mut().take_calls();
    let lookups = calls
        .iter()
        .filter(|c| matches!(c, ConnectorCall::GetNumNewMatchedTokens { .. }))
        .count();
    assert_eq!(lookups, 0, "no lookup after a load");
    let allocs: Vec<_> = calls
        .iter()
        .filter_map(|c| match c {
            ConnectorCall::UpdateStateAfterAlloc {
                id,
                num_external_tokens,
                ..
            } => Some((*id, *num_external_tokens)),
            _ => None,
        })
        .collect();
    assert_eq!(allocs, vec![(rid(1), 0), (rid(2), 0)]);
}

#[test]
fn requests_run_to_length_and_free_their_blocks() {
    let mut s = sched(SchedulerConfig::default());
    s.add_request(spec(1, 20, 3)).unwrap();
    let free0 = s.block_pool().num_free();
    let mut finished = None;
    for _ in 0..10 {
        let (_, res) = step(&mut s, None);
        if let Some(o) = res.outputs.iter().find(|o| o.finish.is_some()) {
            finished = o.finish;
            break;
        }
    }
    assert_eq!(finished, Some(FinishReason::LengthCapped));
    assert!(!s.has_requests());
    assert_eq!(s.block_pool().num_free(), free0);
}

#[test]
fn two_groups_with_sliding_window() {
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        groups: vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 4 },
        ],
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 20, 8)).unwrap();
    for _ in 0..6 {
        step(&mut s, None);
    }
    let v = s.view();
    let r = v.request(rid(1)).unwrap();
    assert!(r.block_ids(1).iter().take(3).all(|b| *b == BlockId(0)));
    assert!(r.block_ids(0).iter().all(|b| *b != BlockId(0)));
}

#[test]
fn bad_inputs_are_typed_errors() {
    let mut s = sched(SchedulerConfig::default());
    s.add_request(spec(1, 20, 3)).unwrap();
    assert_eq!(
        s.add_request(spec(1, 20, 3)),
        Err(SchedulerError::DuplicateRequest(rid(1)))
    );
    let st = s.schedule().unwrap();
    let e = s
        .update_from_output(
            st.output.step,
            ModelOutput {
                sampled: vec![],
                kv_connector_output: Some(send(&[9])),
            },
        )
        .unwrap_err();
    assert_eq!(e, SchedulerError::UnknownRequest(rid(9)));
    let e = s
        .update_from_output(StepId(5), ModelOutput::default())
        .unwrap_err();
    assert_eq!(e.kind(), "step_out_of_order");
    let bad = AggregatedOutput {
        invalid_block_ids: SortedSet::from_vec(vec![BlockId(10_000)]),
        ..agg()
    };
    let e = s
        .update_from_output(
            st.output.step,
            ModelOutput {
                sampled: vec![],
                kv_connector_output: Some(bad),
            },
        )
        .unwrap_err();
    assert_eq!(e, SchedulerError::BlockOutOfRange(BlockId(10_000)));
    check(&s);
    // Nothing was consumed: the real output still applies.
    s.update_from_output(st.output.step, ModelOutput::default())
        .unwrap();
    check(&s);
    let _ = (Mode::Strict, LoadFailurePolicy::Recompute);
}
