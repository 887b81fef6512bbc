//! MultiConnector (SEMANTICS.md §1.7, §4.3, §8.5 I-28…I-32, §9.3 S13): every composition rule on
//! the scheduler side ([`MultiConnector`]) and the worker side ([`MultiWorker`]) over scripted
//! children, the real [`Scheduler`] driving a MultiConnector of two scripted children through a
//! load and a doubly delayed free, and a property test that random interleavings of the
//! children's `finished_sending` reports yield every request exactly once, after its last saver.
//!
//! Why this file is long: one suite per composition rule of one machine (the scheduler side, the
//! worker side, the scheduler driving it, the property test), sharing the scripted children's
//! fixtures.

use kvrelay_core::{
    AggregatedOutput, BlockId, ConnectorCall, ConnectorError, EngineCore, FinishDecision, Intent,
    JobId, KvEvent, Lookup, Meta, MultiConnector, MultiMeta, MultiWorker, NoopConnector,
    OffloadMeta, Params, Rank, RankDriver, RequestId, RequestStatus, ScheduledStep, Scheduler,
    SchedulerConfig, SchedulerConnector, SchedulerError, SchedulerOutput, SchedulerView,
    ScriptedConnector, ScriptedMeta, ScriptedWorker, SortedSet, Transfer, TransferCommand,
    TransferDirection, TransferDone, WorkerConnector, WorkerOutput, combine_finished_counts,
    route_worker_meta,
};
use kvrelay_tests::build::{empty_aggregated, hit, ids, params, rank_config, rid, set_meta, spec};
use kvrelay_tests::drive::run_rank_step;
use proptest::prelude::*;

type Multi = MultiConnector<ScriptedConnector>;

/// An idle scheduler: only its view is used, by direct calls on a MultiConnector.
fn idle() -> Scheduler<NoopConnector> {
    Scheduler::new(SchedulerConfig::default(), NoopConnector).unwrap()
}

fn multi(k: usize) -> Multi {
    MultiConnector::new(vec![ScriptedConnector::new(); k]).unwrap()
}

fn worker(k: usize) -> MultiWorker<ScriptedWorker> {
    MultiWorker::new(vec![ScriptedWorker::new(); k])
}

/// An aggregated output with a finished send and an invalid block, and `meta`.
fn empty_output(meta: Option<Meta>) -> AggregatedOutput {
    AggregatedOutput {
        finished_sending: Some(ids(&[7])),
        invalid_block_ids: [BlockId(3)].into_iter().collect(),
        worker_meta: meta,
        ..empty_aggregated()
    }
}

/// Child `i`'s logged calls, drained.
fn calls(m: &mut Multi, i: usize) -> Vec<ConnectorCall> {
    m.child_mut(i).unwrap().take_calls()
}

fn finish_all(
    m: &mut Multi,
    v: &SchedulerView<'_>,
    r: RequestId,
    delays: &[bool],
) -> FinishDecision {
    for (i, &d) in delays.iter().enumerate() {
        m.child_mut(i).unwrap().set_delay_free(r, d);
    }
    m.try_request_finished(v, r, &[vec![BlockId(1)]]).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Scheduler side.

#[test]
fn build_meta_ships_the_extra_saves_since_the_last_build_then_resets() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    let out = SchedulerOutput::default();
    let meta = m.build_connector_meta(&v, &out);
    assert_eq!(
        meta.metadata.len(),
        3,
        "one child metadata per child, in order"
    );
    assert_eq!(meta.extra_async_saves, None);

    assert!(finish_all(&mut m, &v, rid(1), &[true, true, true]).delay_free);
    assert!(finish_all(&mut m, &v, rid(2), &[false, true, false]).delay_free);
    assert!(!finish_all(&mut m, &v, rid(3), &[false, false, false]).delay_free);
    assert!(finish_all(&mut m, &v, rid(4), &[true, false, true]).delay_free);
    let meta = m.build_connector_meta(&v, &out);
    let want = [(rid(1), 2), (rid(4), 1)].into_iter().collect();
    assert_eq!(meta.extra_async_saves, Some(want));
    assert!(m.pending_extra_async_saves().is_empty());
    assert_eq!(m.build_connector_meta(&v, &out).extra_async_saves, None);
    m.check_invariants().unwrap();
}

#[test]
fn a_request_finished_again_overwrites_its_count_and_one_saver_keeps_it() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    finish_all(&mut m, &v, rid(1), &[true, true, true]);
    finish_all(&mut m, &v, rid(1), &[true, true, false]);
    finish_all(&mut m, &v, rid(1), &[true, false, false]);
    // vLLM assigns `n - 1` only for n > 1, so the last call leaves the earlier count.
    assert_eq!(m.pending_extra_async_saves().get(&rid(1)), Some(&1));
}

#[test]
fn the_lowest_child_with_a_positive_match_loads_and_is_remembered_until_finish() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    for (i, n) in [0, 16, 32].into_iter().enumerate() {
        m.child_mut(i).unwrap().set_lookup(rid(1), hit(n, n > 8));
    }
    assert_eq!(m.get_num_new_matched_tokens(&v, rid(1), 0), hit(16, true));
    assert_eq!(m.loader(rid(1)), Some(1));
    // Every child was asked (no short cut after the first hit).
    for i in 0..3 {
        assert_eq!(calls(&mut m, i).len(), 1);
    }

    // No positive count: a miss, and the earlier choice stays (vLLM never clears it here).
    for i in 0..3 {
        m.child_mut(i).unwrap().set_lookup(rid(1), Lookup::MISS);
    }
    assert_eq!(m.get_num_new_matched_tokens(&v, rid(1), 0), Lookup::MISS);
    assert_eq!(m.loader(rid(1)), Some(1));

    // request_finished forgets it.
    m.try_request_finished(&v, rid(1), &[]).unwrap();
    assert_eq!(m.loader(rid(1)), None);
    m.check_invariants().unwrap();
}

#[test]
fn a_pending_child_makes_the_answer_pending_at_once() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    m.child_mut(0).unwrap().set_lookup(rid(1), hit(16, false));
    m.child_mut(1).unwrap().set_lookup(rid(1), Lookup::Pending);
    m.child_mut(2).unwrap().set_lookup(rid(1), hit(32, false));
    assert_eq!(m.get_num_new_matched_tokens(&v, rid(1), 0), Lookup::Pending);
    assert!(
        calls(&mut m, 2).is_empty(),
        "children after the pending one are not asked"
    );
    // As in vLLM, the choice made before the pending child answered is kept.
    assert_eq!(m.loader(rid(1)), Some(0));

    // A pending first child: nothing chosen.
    m.child_mut(0).unwrap().set_lookup(rid(2), Lookup::Pending);
    assert_eq!(m.get_num_new_matched_tokens(&v, rid(2), 0), Lookup::Pending);
    assert_eq!(m.loader(rid(2)), None);
}

#[test]
fn only_the_loader_gets_the_external_tokens_every_child_gets_the_blocks() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    m.child_mut(1).unwrap().set_lookup(rid(1), hit(16, true));
    m.get_num_new_matched_tokens(&v, rid(1), 0);
    let blocks = vec![vec![BlockId(4), BlockId(5)]];
    m.update_state_after_alloc(&v, rid(1), &blocks, 16);
    for i in 0..3 {
        let got: Vec<_> = calls(&mut m, i)
            .into_iter()
            .filter_map(|c| match c {
                ConnectorCall::UpdateStateAfterAlloc {
                    blocks: b,
                    num_external_tokens,
                    ..
                } => Some((b, num_external_tokens)),
                _ => None,
            })
            .collect();
        let n = if i == 1 { 16 } else { 0 };
        assert_eq!(got, vec![(blocks.clone(), n)], "child {i} (I-29)");
    }
    // No loader: every child gets 0.
    m.update_state_after_alloc(&v, rid(2), &blocks, 0);
    for i in 0..3 {
        assert!(calls(&mut m, i).iter().any(|c| matches!(
            c,
            ConnectorCall::UpdateStateAfterAlloc {
                num_external_tokens: 0,
                ..
            }
        )));
    }
}

#[test]
fn params_of_children_merge_and_empty_params_are_not_none() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    m.child_mut(0)
        .unwrap()
        .set_finish_params(rid(1), params(&[("host", "h")]));
    m.child_mut(2)
        .unwrap()
        .set_finish_params(rid(1), params(&[("port", "5")]));
    let d = m.try_request_finished(&v, rid(1), &[]).unwrap();
    assert_eq!(
        d,
        FinishDecision {
            delay_free: false,
            kv_transfer_params: Some(params(&[("host", "h"), ("port", "5")])),
        }
    );
    m.child_mut(1)
        .unwrap()
        .set_finish_params(rid(2), Params::new());
    let d = m.try_request_finished(&v, rid(2), &[]).unwrap();
    assert_eq!(d.kv_transfer_params, Some(Params::new()));
    let d = m.try_request_finished(&v, rid(3), &[]).unwrap();
    assert_eq!(d.kv_transfer_params, None);
}

#[test]
fn scripted_delay_all_delays_every_free_until_cleared() {
    // Protects the scripted P/D producer of the conformance cases (`set_delay_all`): while on,
    // `request_finished` delays every free, as a vLLM P/D producer holds a finished request's
    // blocks until its KV is sent (I-15); once off, it delays none.
    let s = idle();
    let v = s.view();
    let mut c = ScriptedConnector::quiet();
    assert!(!c.request_finished(&v, rid(1), &[]).delay_free);
    c.set_delay_all(true);
    assert!(c.request_finished(&v, rid(1), &[]).delay_free);
    assert!(c.request_finished(&v, rid(7), &[]).delay_free);
    c.set_delay_all(false);
    assert!(!c.request_finished(&v, rid(7), &[]).delay_free);
}

#[test]
fn scripted_finish_params_are_returned_until_cleared() {
    // Protects the scripted connector's finish parameters (`request_finished`'s
    // `kv_transfer_params`, §3.1), which conformance cases set and clear per request.
    let s = idle();
    let v = s.view();
    let mut c = ScriptedConnector::quiet();
    c.set_finish_params(rid(1), params(&[("k", "1")]));
    let d = c.request_finished(&v, rid(1), &[]);
    assert_eq!(d.kv_transfer_params, Some(params(&[("k", "1")])));
    c.clear_finish_params(rid(1));
    assert_eq!(c.request_finished(&v, rid(1), &[]).kv_transfer_params, None);
}

#[test]
fn a_params_key_clash_is_a_typed_error_that_records_nothing() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    m.child_mut(0).unwrap().set_lookup(rid(1), hit(16, false));
    m.get_num_new_matched_tokens(&v, rid(1), 0);
    for i in 0..3 {
        m.child_mut(i).unwrap().set_delay_free(rid(1), true);
        calls(&mut m, i);
    }
    m.child_mut(0)
        .unwrap()
        .set_finish_params(rid(1), params(&[("a", "1"), ("k", "1")]));
    m.child_mut(1)
        .unwrap()
        .set_finish_params(rid(1), params(&[("k", "2"), ("z", "0")]));
    let e = m.try_request_finished(&v, rid(1), &[]).unwrap_err();
    assert_eq!(
        e,
        ConnectorError::ParamsConflict {
            request: rid(1),
            keys: vec!["k".to_string()],
        }
    );
    assert_eq!(e.kind(), "params_conflict");
    assert!(
        calls(&mut m, 2).is_empty(),
        "children after the clash are not called"
    );
    assert!(m.pending_extra_async_saves().is_empty());
    assert_eq!(m.loader(rid(1)), Some(0));

    // Through the trait: no delay, and the error is handed out once (I-32).
    let d = m.request_finished(&v, rid(1), &[]);
    assert_eq!(d, FinishDecision::default());
    assert_eq!(
        m.take_error(),
        Some(ConnectorError::ParamsConflict {
            request: rid(1),
            keys: vec!["k".to_string()],
        })
    );
    assert_eq!(m.take_error(), None);
    assert_eq!(m.error().map(ConnectorError::kind), Some("params_conflict"));
}

#[test]
fn finished_count_is_none_if_any_child_is_none_else_common_else_conflict() {
    assert_eq!(combine_finished_counts([Some(2), None, Some(3)]), Ok(None));
    assert_eq!(combine_finished_counts([Some(2), Some(2)]), Ok(Some(2)));
    assert_eq!(combine_finished_counts([]), Ok(None));
    let e = combine_finished_counts([Some(4), Some(2), Some(4)]).unwrap_err();
    assert_eq!(
        e,
        ConnectorError::FinishedCountConflict { counts: vec![2, 4] }
    );
    assert_eq!(e.kind(), "finished_count_conflict");

    let mut a = ScriptedConnector::new();
    let mut b = ScriptedConnector::new();
    a.set_finished_count(Some(2));
    b.set_finished_count(Some(3));
    assert_eq!(
        MultiConnector::new(vec![a.clone(), b.clone()])
            .unwrap_err()
            .kind(),
        "finished_count_conflict"
    );
    b.set_finished_count(Some(2));
    let mut m = MultiConnector::new(vec![a, b]).unwrap();
    assert_eq!(m.get_finished_count(), Some(2));
    m.child_mut(1).unwrap().set_finished_count(None);
    assert_eq!(m.finished_count(), Ok(None));
    assert_eq!(
        m.get_finished_count(),
        Some(2),
        "the value checked at construction"
    );
}

#[test]
fn each_child_observes_its_own_worker_meta_slot_and_everything_else_unchanged() {
    let s = idle();
    let v = s.view();
    let mut m = multi(3);
    let offload = Meta::Offload(OffloadMeta::from_counts([(JobId(3), 2)]));
    let multi_meta = Meta::Multi(vec![Some(set_meta(&["a"])), None, Some(offload.clone())]);
    let out = empty_output(Some(multi_meta));
    let before = out.clone();
    m.update_connector_output(&v, &out);
    assert_eq!(out, before, "I-30: the caller's output is untouched");
    let seen: Vec<_> = m
        .children()
        .iter()
        .map(|c| c.observed_worker_meta().cloned())
        .collect();
    assert_eq!(seen, vec![Some(set_meta(&["a"])), None, Some(offload)]);
    for i in 0..3 {
        let got = calls(&mut m, i);
        assert_eq!(
            got,
            vec![ConnectorCall::UpdateConnectorOutput {
                finished_sending: Some(ids(&[7])),
                finished_recving: None,
            }],
            "child {i} sees the finished sets unchanged"
        );
    }
    // None: every child sees None.
    m.update_connector_output(&v, &empty_output(None));
    assert!(
        m.children()
            .iter()
            .all(|c| c.observed_worker_meta().is_none())
    );
    assert_eq!(m.take_error(), None);
}

#[test]
fn worker_meta_that_is_not_one_slot_per_child_reaches_no_child() {
    assert_eq!(route_worker_meta(None, 2), Ok(vec![None, None]));
    assert_eq!(
        route_worker_meta(
            Some(Meta::Multi(vec![Some(set_meta(&["x"])), None, None])),
            2
        ),
        Ok(vec![Some(set_meta(&["x"])), None]),
        "extra slots are ignored, as in vLLM"
    );
    let s = idle();
    let v = s.view();
    let mut m = multi(2);
    for bad in [set_meta(&["x"]), Meta::Multi(vec![None])] {
        let e = m
            .try_update_connector_output(&v, &empty_output(Some(bad)))
            .unwrap_err();
        assert_eq!(e.kind(), "meta_mismatch");
        assert!(calls(&mut m, 0).is_empty() && calls(&mut m, 1).is_empty());
    }
    m.update_connector_output(&v, &empty_output(Some(set_meta(&["y"]))));
    assert!(m.take_error().is_some());
}

#[test]
fn intents_are_concatenated_and_booleans_are_any_child() {
    let s = idle();
    let v = s.view();
    let mut m = multi(2);
    m.child_mut(0)
        .unwrap()
        .push_intent(Intent::Pin(vec![BlockId(1)]));
    m.child_mut(1)
        .unwrap()
        .push_intent(Intent::Unpin(vec![BlockId(2)]));
    assert_eq!(
        m.take_intents(),
        vec![
            Intent::Pin(vec![BlockId(1)]),
            Intent::Unpin(vec![BlockId(2)])
        ]
    );
    assert!(m.take_intents().is_empty());
    assert!(!m.has_pending_block_frees(&v) && !m.has_pending_push_work());
    assert!(!m.requires_kv_delivery());
    m.child_mut(1).unwrap().set_pending_block_frees(true);
    m.child_mut(1).unwrap().set_push_work(true);
    m.child_mut(1).unwrap().set_requires_kv_delivery(true);
    assert!(m.has_pending_block_frees(&v) && m.has_pending_push_work());
    assert!(m.requires_kv_delivery());
    // Children without reset support count as success: the answer is never None.
    assert_eq!(m.reset_cache(), Some(true));
}

/// A child of another type than [`ScriptedConnector`] with the same metadata types: it emits an
/// event per request that finishes, delays every free, and fails cache resets.
#[derive(Debug, Default)]
struct Echo {
    events: Vec<KvEvent>,
}

impl SchedulerConnector for Echo {
    type StepMeta = ScriptedMeta;
    type WorkerMeta = Meta;

    fn get_num_new_matched_tokens(
        &mut self,
        _view: &SchedulerView<'_>,
        _request: RequestId,
        _num_computed_tokens: u32,
    ) -> Lookup {
        hit(4, false)
    }

    fn update_state_after_alloc(
        &mut self,
        _view: &SchedulerView<'_>,
        _request: RequestId,
        _blocks: &[Vec<BlockId>],
        _num_external_tokens: u32,
    ) {
    }

    fn build_connector_meta(
        &mut self,
        _view: &SchedulerView<'_>,
        _output: &SchedulerOutput,
    ) -> ScriptedMeta {
        ScriptedMeta::default()
    }

    fn request_finished(
        &mut self,
        _view: &SchedulerView<'_>,
        request: RequestId,
        _blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        self.events.push(KvEvent(format!("echo {}", request.0)));
        FinishDecision {
            delay_free: true,
            kv_transfer_params: None,
        }
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn reset_cache(&mut self) -> Option<bool> {
        Some(false)
    }
}

type Dyn = Box<dyn SchedulerConnector<StepMeta = ScriptedMeta, WorkerMeta = Meta>>;

#[test]
fn boxed_children_of_different_types_compose() {
    let s = idle();
    let v = s.view();
    let children: Vec<Dyn> = vec![
        Box::new(Echo::default()),
        Box::new(ScriptedConnector::new()),
        Box::new(Echo::default()),
    ];
    let mut m = MultiConnector::new(children).unwrap();
    assert_eq!(m.get_num_new_matched_tokens(&v, rid(1), 0), hit(4, false));
    assert_eq!(m.loader(rid(1)), Some(0));
    assert!(m.request_finished(&v, rid(1), &[]).delay_free);
    assert_eq!(
        m.take_events(),
        vec![KvEvent("echo 1".into()), KvEvent("echo 1".into())],
        "events of all children, in child order"
    );
    let meta = m.build_connector_meta(&v, &SchedulerOutput::default());
    assert_eq!(
        meta.extra_async_saves,
        Some([(rid(1), 1)].into_iter().collect())
    );
    assert_eq!(
        m.reset_cache(),
        Some(false),
        "a child that fails makes the reset fail"
    );
}

#[test]
fn multi_meta_round_trips_through_serde() {
    let meta = MultiMeta {
        metadata: vec![ScriptedMeta::default(), ScriptedMeta::default()],
        extra_async_saves: Some([(rid(3), 2)].into_iter().collect()),
    };
    let text = serde_json::to_string(&meta).unwrap();
    let back: MultiMeta<ScriptedMeta> = serde_json::from_str(&text).unwrap();
    assert_eq!(back, meta);
}

// ---------------------------------------------------------------------------------------------
// Worker side.

fn bind(w: &mut MultiWorker<ScriptedWorker>, extra: &[(u32, u32)]) {
    let k = w.children().len();
    let meta = MultiMeta {
        metadata: vec![ScriptedMeta::default(); k],
        extra_async_saves: (!extra.is_empty())
            .then(|| extra.iter().map(|&(r, n)| (rid(r), n)).collect()),
    };
    w.handle_preemptions(&meta);
    w.bind(&meta);
}

/// One step's `finished_sending` with `reports[i]` reported by child `i`.
fn report(w: &mut MultiWorker<ScriptedWorker>, reports: &[&[u32]]) -> Option<SortedSet<RequestId>> {
    for (i, r) in reports.iter().enumerate() {
        if !r.is_empty() {
            let r: Vec<RequestId> = r.iter().map(|&x| rid(x)).collect();
            w.child_mut(i).unwrap().push_finished_sending(&r);
        }
    }
    let out = w.get_transfer_results(&SortedSet::new()).finished_sending;
    w.check_invariants().unwrap();
    out
}

#[test]
fn s13_two_savers_are_reported_once_after_both() {
    let mut w = worker(2);
    bind(&mut w, &[(1, 1)]);
    assert_eq!(report(&mut w, &[&[1], &[]]), None, "step a: suppressed");
    assert!(w.extra_async_saves().is_empty(), "entry deleted at 0");
    assert_eq!(report(&mut w, &[&[], &[1]]), Some(ids(&[1])), "step b");
}

#[test]
fn s13_same_step_variant_reports_once() {
    let mut w = worker(2);
    bind(&mut w, &[(1, 1)]);
    assert_eq!(report(&mut w, &[&[1], &[1]]), Some(ids(&[1])));
    assert!(w.extra_async_saves().is_empty());
}

#[test]
fn bind_merges_extra_saves_and_a_request_named_again_takes_the_new_count() {
    let mut w = worker(2);
    bind(&mut w, &[(1, 1)]);
    bind(&mut w, &[(2, 1)]);
    bind(&mut w, &[]);
    bind(&mut w, &[(1, 2)]);
    let want = [(rid(1), 2), (rid(2), 1)].into_iter().collect();
    assert_eq!(w.extra_async_saves(), &want);
    assert_eq!(report(&mut w, &[&[1, 2], &[]]), None);
    assert_eq!(report(&mut w, &[&[2], &[1]]), Some(ids(&[2])));
    assert_eq!(report(&mut w, &[&[1], &[]]), Some(ids(&[1])));
    assert_eq!(
        report(&mut w, &[&[1], &[]]),
        Some(ids(&[1])),
        "a report with nothing pending is forwarded (as in vLLM)"
    );
}

#[test]
fn recving_failed_and_load_errors_are_unions() {
    let mut w = worker(3);
    w.child_mut(0).unwrap().push_finished_recving(&[rid(1)]);
    w.child_mut(2).unwrap().push_failed_recving(&[rid(2)]);
    w.child_mut(1).unwrap().push_load_errors(&[BlockId(9)]);
    w.child_mut(2)
        .unwrap()
        .push_load_errors(&[BlockId(4), BlockId(9)]);
    let r = w.get_transfer_results(&SortedSet::new());
    assert_eq!(r.finished_recving, Some(ids(&[1, 2])));
    assert_eq!(r.failed_recving, ids(&[2]));
    assert_eq!(r.finished_sending, None);
    assert_eq!(
        w.get_block_ids_with_load_errors(),
        [BlockId(4), BlockId(9)].into_iter().collect()
    );
    let r = w.get_transfer_results(&SortedSet::new());
    assert_eq!((r.finished_recving, r.finished_sending), (None, None));
}

#[test]
fn worker_meta_is_none_or_one_slot_per_child() {
    let mut w = worker(3);
    assert_eq!(w.build_connector_worker_meta(), None);
    w.child_mut(2)
        .unwrap()
        .set_worker_meta(Some(set_meta(&["z"])));
    assert_eq!(
        w.build_connector_worker_meta(),
        Some(Meta::Multi(vec![None, None, Some(set_meta(&["z"]))])),
        "leading Nones are padded (I-31)"
    );
    w.child_mut(0)
        .unwrap()
        .set_worker_meta(Some(set_meta(&["a"])));
    assert_eq!(
        w.build_connector_worker_meta(),
        Some(Meta::Multi(vec![Some(set_meta(&["a"])), None, None]))
    );
}

#[test]
fn bind_handle_preemptions_and_clear_are_element_wise() {
    let mut w = worker(2);
    let first = ScriptedMeta {
        finished: ids(&[5]),
        ..ScriptedMeta::default()
    };
    let meta = MultiMeta {
        metadata: vec![first.clone(), ScriptedMeta::default()],
        extra_async_saves: None,
    };
    w.bind(&meta);
    assert_eq!(w.children()[0].bound(), Some(&first));
    assert_eq!(w.children()[1].bound(), Some(&ScriptedMeta::default()));
    w.clear();
    assert!(w.children().iter().all(|c| c.bound().is_none()));
    // A metadata with fewer slots binds only the children it covers (Python's `zip`).
    let short = MultiMeta {
        metadata: vec![first],
        extra_async_saves: None,
    };
    w.bind(&short);
    assert_eq!(
        w.children()
            .iter()
            .map(ScriptedWorker::binds)
            .collect::<Vec<_>>(),
        vec![2, 1]
    );
}

fn load(job: u64, request: u32) -> Transfer {
    Transfer {
        job: JobId(job),
        direction: TransferDirection::Load,
        request: rid(request),
        gpu_blocks: vec![BlockId(1)],
        groups: vec![0],
        external: vec![0],
    }
}

#[test]
fn child_jobs_are_renumbered_and_completions_routed_back() {
    let mut w = worker(2);
    w.child_mut(0).unwrap().push_load(load(0, 1));
    w.child_mut(1).unwrap().push_load(load(0, 2));
    let cmds = w.start_load_kv();
    let jobs: Vec<(JobId, RequestId)> = cmds
        .iter()
        .map(|c| match c {
            TransferCommand::Start(t) => (t.job, t.request),
            TransferCommand::Wait(_) => panic!("only starts"),
        })
        .collect();
    assert_eq!(jobs, vec![(JobId(0), rid(1)), (JobId(1), rid(2))]);
    w.check_invariants().unwrap();

    // Child 1 fences its job 0, which is this worker's job 1.
    w.child_mut(1).unwrap().set_preemption_waits(&[JobId(0)]);
    let meta = MultiMeta {
        metadata: vec![ScriptedMeta::default(); 2],
        extra_async_saves: None,
    };
    assert_eq!(
        w.handle_preemptions(&meta),
        vec![TransferCommand::Wait([JobId(1)].into_iter().collect())]
    );

    w.handle_transfer_done(TransferDone {
        job: JobId(1),
        ok: false,
    });
    w.handle_transfer_done(TransferDone {
        job: JobId(99),
        ok: true,
    });
    assert!(w.child_mut(0).unwrap().take_done().is_empty());
    assert_eq!(
        w.child_mut(1).unwrap().take_done(),
        vec![TransferDone {
            job: JobId(0),
            ok: false
        }]
    );
    // A wait for a job already completed has nothing to wait for.
    w.child_mut(1).unwrap().set_preemption_waits(&[JobId(0)]);
    assert!(w.handle_preemptions(&meta).is_empty());
    w.check_invariants().unwrap();
}

// ---------------------------------------------------------------------------------------------
// The real scheduler driving a MultiConnector of two scripted children.

/// One rank: the worker side of the step, driven by the core's rank driver.
struct Rank0 {
    driver: RankDriver<MultiWorker<ScriptedWorker>>,
}

impl Rank0 {
    fn new(children: usize) -> Self {
        let config = rank_config(&SchedulerConfig::default(), 1);
        Self {
            driver: RankDriver::new(config, worker(children)),
        }
    }

    /// The worker, to script what it reports next.
    fn worker(&mut self) -> &mut MultiWorker<ScriptedWorker> {
        self.driver.worker_mut()
    }

    /// The rank's step; the scripted children start no transfer that is waited for.
    fn run(&mut self, step: ScheduledStep<MultiMeta<ScriptedMeta>>) -> WorkerOutput<Meta> {
        self.driver.begin(&step).unwrap();
        let (_, out) = run_rank_step(&mut self.driver);
        self.driver.check_invariants().unwrap();
        self.driver.worker().inner().check_invariants().unwrap();
        out
    }
}

type MultiEngine = EngineCore<MultiConnector<ScriptedConnector>>;

fn engine() -> MultiEngine {
    let multi =
        MultiConnector::new(vec![ScriptedConnector::new(), ScriptedConnector::new()]).unwrap();
    EngineCore::new(SchedulerConfig::default(), multi, 1).unwrap()
}

/// schedule → the rank's step → aggregation → update_from_output, through the core's engine
/// step; returns the scheduled output, the aggregated connector output the scheduler got, and
/// the step result.
fn step(
    s: &mut MultiEngine,
    rank: &mut Rank0,
) -> (
    SchedulerOutput,
    MultiMeta<ScriptedMeta>,
    Option<AggregatedOutput>,
    kvrelay_core::StepResult,
) {
    let st = s.schedule().unwrap().step;
    s.check_invariants().unwrap();
    s.scheduler().connector().check_invariants().unwrap();
    let id = st.output.step;
    let out = rank.run(st.clone());
    s.rank_output(id, Rank(0), Some(out)).unwrap();
    let kv = s.aggregated(id).cloned().expect("the only rank reported");
    let res = s.apply_fake().unwrap().result;
    s.check_invariants().unwrap();
    s.scheduler().connector().check_invariants().unwrap();
    (st.output, st.meta, kv, res)
}

#[test]
fn scheduler_loads_through_child_1_and_reports_a_doubly_saved_request_once() {
    let mut s = engine();
    let mut rank = Rank0::new(2);
    let c = s.scheduler_mut().connector_mut();
    c.child_mut(1).unwrap().set_lookup(rid(1), hit(16, true));
    for i in 0..2 {
        c.child_mut(i).unwrap().set_delay_free(rid(1), true);
    }
    c.child_mut(0)
        .unwrap()
        .set_finish_params(rid(1), params(&[("saver0", "x")]));
    c.child_mut(1)
        .unwrap()
        .set_finish_params(rid(1), params(&[("saver1", "y")]));
    s.add_request(spec(1, 32, 2)).unwrap();

    // Admission: child 1 is the loader (I-29).
    let (_, meta, _, _) = step(&mut s, &mut rank);
    assert_eq!(
        s.scheduler().status(rid(1)),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    assert_eq!(s.scheduler().connector().loader(rid(1)), Some(1));
    assert_eq!(meta.metadata[0].loads, vec![]);
    assert_eq!(meta.metadata[1].loads.len(), 1);
    assert_eq!(meta.metadata[1].loads[0].tokens, 16);
    for i in 0..2 {
        let n = if i == 1 { 16 } else { 0 };
        assert!(
            s.scheduler_mut().connector_mut().child_mut(i).unwrap().take_calls().iter().any(|c| matches!(
                c,
                ConnectorCall::UpdateStateAfterAlloc { num_external_tokens, .. } if *num_external_tokens == n
            )),
            "child {i} learns about the allocation with {n} external tokens"
        );
    }

    // The load completes on child 1's worker.
    rank.worker()
        .child_mut(1)
        .unwrap()
        .push_finished_recving(&[rid(1)]);
    let (_, _, kv, _) = step(&mut s, &mut rank);
    assert_eq!(kv.unwrap().finished_recving, Some(ids(&[1])));

    // Prefill the rest and decode to max_tokens: both children delay the free.
    let mut finished = None;
    for _ in 0..4 {
        let (_, _, _, res) = step(&mut s, &mut rank);
        if let Some(o) = res.outputs.iter().find(|o| o.finish.is_some()) {
            finished = Some(o.clone());
            break;
        }
    }
    let out = finished.expect("request 1 finishes");
    assert_eq!(
        out.kv_transfer_params,
        Some(params(&[("saver0", "x"), ("saver1", "y")])),
        "params of both children merged (I-32)"
    );
    assert_eq!(
        s.scheduler().connector().loader(rid(1)),
        None,
        "forgotten at finish"
    );
    assert!(
        s.scheduler().request_ids().any(|r| r == rid(1)),
        "held for the savers"
    );
    assert_eq!(
        s.scheduler()
            .connector()
            .pending_extra_async_saves()
            .get(&rid(1)),
        Some(&1)
    );

    // Next step: the metadata carries the extra save and the finished id; child 0 reports.
    rank.worker()
        .child_mut(0)
        .unwrap()
        .push_finished_sending(&[rid(1)]);
    let (out, meta, kv, _) = step(&mut s, &mut rank);
    assert!(out.finished_req_ids.contains(&rid(1)));
    assert_eq!(
        meta.extra_async_saves,
        Some([(rid(1), 1)].into_iter().collect())
    );
    assert_eq!(kv.and_then(|k| k.finished_sending), None, "I-28: not yet");
    assert!(s.scheduler().request_ids().any(|r| r == rid(1)));

    // Child 1 reports: completion reported once, the request is freed.
    rank.worker()
        .child_mut(1)
        .unwrap()
        .push_finished_sending(&[rid(1)]);
    let (_, meta, kv, _) = step(&mut s, &mut rank);
    assert_eq!(meta.extra_async_saves, None);
    assert_eq!(kv.and_then(|k| k.finished_sending), Some(ids(&[1])));
    assert!(
        !s.scheduler().request_ids().any(|r| r == rid(1)),
        "freed after the last saver"
    );
    assert!(rank.worker().extra_async_saves().is_empty());
    assert_eq!(s.scheduler().broken(), None);
}

#[test]
fn scheduler_routes_worker_meta_slots_to_the_children() {
    let mut s = engine();
    let mut rank = Rank0::new(2);
    s.add_request(spec(1, 16, 4)).unwrap();
    rank.worker()
        .child_mut(1)
        .unwrap()
        .set_worker_meta(Some(set_meta(&["m"])));
    let (_, _, kv, _) = step(&mut s, &mut rank);
    assert_eq!(
        kv.unwrap().worker_meta,
        Some(Meta::Multi(vec![None, Some(set_meta(&["m"]))])),
        "I-31: one slot per child"
    );
    let seen: Vec<_> = s
        .scheduler()
        .connector()
        .children()
        .iter()
        .map(|c| c.observed_worker_meta().cloned())
        .collect();
    assert_eq!(seen, vec![None, Some(set_meta(&["m"]))]);
}

#[test]
fn a_params_clash_stops_the_scheduler_with_a_sticky_contract_error() {
    let multi =
        MultiConnector::new(vec![ScriptedConnector::new(), ScriptedConnector::new()]).unwrap();
    let mut s = Scheduler::new(SchedulerConfig::default(), multi).unwrap();
    for i in 0..2 {
        s.connector_mut()
            .child_mut(i)
            .unwrap()
            .set_finish_params(rid(1), params(&[("k", "v")]));
    }
    s.add_request(spec(1, 16, 4)).unwrap();
    s.schedule().unwrap();
    let e = s.abort(rid(1)).unwrap_err();
    assert_eq!(
        e,
        SchedulerError::ConnectorContract(ConnectorError::ParamsConflict {
            request: rid(1),
            keys: vec!["k".to_string()],
        })
    );
    assert_eq!(s.broken(), Some(&e));
    assert_eq!(s.schedule().unwrap_err(), e, "sticky");
}

// ---------------------------------------------------------------------------------------------
// Property: random interleavings of the children's reports.

/// `k` children, per request the mask of children that save it, the reports (request, child) in
/// a random order, and after which report a step ends.
type Scenario = (usize, Vec<u32>, Vec<(usize, usize)>, Vec<bool>);

fn scenario() -> impl Strategy<Value = Scenario> {
    (1usize..=4, 1usize..=6)
        .prop_flat_map(|(k, n)| (Just(k), prop::collection::vec(1u32..(1 << k), n)))
        .prop_flat_map(|(k, masks)| {
            let events: Vec<(usize, usize)> = masks
                .iter()
                .enumerate()
                .flat_map(|(r, &m)| {
                    (0..k)
                        .filter(move |c| m & (1 << c) != 0)
                        .map(move |c| (r, c))
                })
                .collect();
            let len = events.len();
            (
                Just(k),
                Just(masks),
                Just(events).prop_shuffle(),
                prop::collection::vec(any::<bool>(), len),
            )
        })
}

proptest! {
    #![proptest_config(kvrelay_tests::laws::config())]

    #[test]
    fn every_request_is_reported_once_after_its_last_saver(
        (k, masks, events, cuts) in scenario()
    ) {
        let s = idle();
        let v = s.view();
        let mut m = multi(k);
        for (r, &mask) in masks.iter().enumerate() {
            let r = rid(r as u32);
            for c in 0..k {
                m.child_mut(c).unwrap().set_delay_free(r, mask & (1 << c) != 0);
            }
            prop_assert!(m.request_finished(&v, r, &[]).delay_free);
        }
        let meta = m.build_connector_meta(&v, &SchedulerOutput::default());
        let mut w = worker(k);
        w.bind(&meta);

        // The step in which each request's last report arrives.
        let mut last_step = vec![0usize; masks.len()];
        let mut steps: Vec<Vec<(usize, usize)>> = vec![Vec::new()];
        for (i, &(r, c)) in events.iter().enumerate() {
            steps.last_mut().unwrap().push((r, c));
            last_step[r] = steps.len() - 1;
            if cuts[i] {
                steps.push(Vec::new());
            }
        }
        let mut seen = vec![0u32; masks.len()];
        for (si, step) in steps.iter().enumerate() {
            for &(r, c) in step {
                w.child_mut(c).unwrap().push_finished_sending(&[rid(r as u32)]);
            }
            let got = w.get_transfer_results(&SortedSet::new()).finished_sending.unwrap_or_default();
            w.check_invariants().unwrap();
            for &r in got.iter() {
                let r = r.index();
                seen[r] += 1;
                prop_assert_eq!(last_step[r], si, "request {} reported before its last saver", r);
            }
        }
        prop_assert!(seen.iter().all(|&n| n == 1), "counts {:?}", seen);
        prop_assert!(w.extra_async_saves().is_empty());
    }
}

// ---------------------------------------------------------------------------------------------
// Composition of compositions.

type DynWorker = Box<dyn WorkerConnector<StepMeta = ScriptedMeta, WorkerMeta = Meta>>;

#[test]
fn boxed_worker_children_compose() {
    let children: Vec<DynWorker> = vec![
        Box::new(ScriptedWorker::new()),
        Box::new(ScriptedWorker::new()),
    ];
    let mut w = MultiWorker::new(children);
    let meta = MultiMeta {
        metadata: vec![ScriptedMeta::default(); 2],
        extra_async_saves: Some([(rid(1), 1)].into_iter().collect()),
    };
    w.bind(&meta);
    assert_eq!(w.build_connector_worker_meta(), None);
    assert_eq!(w.extra_async_saves().get(&rid(1)), Some(&1));
    w.clear();
}

#[test]
fn a_multi_connector_nests_as_a_child() {
    let s = idle();
    let v = s.view();
    let inner = || MultiConnector::new(vec![ScriptedConnector::new(); 2]).unwrap();
    let mut m = MultiConnector::new(vec![inner(), inner()]).unwrap();
    // The second inner connector's second child loads.
    m.child_mut(1)
        .unwrap()
        .child_mut(1)
        .unwrap()
        .set_lookup(rid(1), hit(16, false));
    assert_eq!(m.get_num_new_matched_tokens(&v, rid(1), 0), hit(16, false));
    assert_eq!(m.loader(rid(1)), Some(1));
    assert_eq!(m.children()[1].loader(rid(1)), Some(1));

    // Worker metadata nests slot-wise, and each grandchild sees its own slot.
    let nested = Meta::Multi(vec![
        None,
        Some(Meta::Multi(vec![Some(set_meta(&["g"])), None])),
    ]);
    m.update_connector_output(&v, &empty_output(Some(nested)));
    assert_eq!(
        m.children()[1].children()[0].observed_worker_meta(),
        Some(&set_meta(&["g"]))
    );
    assert!(
        m.children()[0].children()[0]
            .observed_worker_meta()
            .is_none()
    );

    // A clash inside an inner connector reaches the scheduler through take_error.
    for i in 0..2 {
        m.child_mut(0)
            .unwrap()
            .child_mut(i)
            .unwrap()
            .set_finish_params(rid(2), params(&[("k", "v")]));
    }
    assert!(!m.request_finished(&v, rid(2), &[]).delay_free);
    assert_eq!(
        m.take_error(),
        Some(ConnectorError::ParamsConflict {
            request: rid(2),
            keys: vec!["k".to_string()],
        })
    );
    assert_eq!(m.take_error(), None);
}
