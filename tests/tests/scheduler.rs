//! Scheduler paths with the scripted connector: SEMANTICS.md §9.4 and the rules of §2.3, §2.7,
//! §2.8, §6.1, §8.3 and §8.6. `check_invariants()` runs after every call.
//!
//! Why this file is long: one scenario per rule of the scheduler with the scripted connector
//! (SEMANTICS.md §9.4), each short, sharing the same builders; grouped by section of the spec.

use kvrelay_core::{
    AggregatedOutput, BlockId, ConnectorCall, FinishReason, GroupKind, LoadFailurePolicy, Lookup,
    Mode, ModelOutput, RequestId, RequestSpec, RequestStatus, Scheduler, SchedulerConfig,
    SchedulerError, ScriptedConnector, SortedSet, StepId, fake_token,
};
use kvrelay_tests::build::{empty_aggregated, hit, ids, rid, spec, spec_with};
use kvrelay_tests::drive::{apply, check, computed, schedule, step};

fn sched(config: SchedulerConfig) -> Scheduler<ScriptedConnector> {
    Scheduler::new(config, ScriptedConnector::new()).unwrap()
}

fn recv(ns: &[u32]) -> AggregatedOutput {
    AggregatedOutput {
        finished_recving: Some(ids(ns)),
        ..empty_aggregated()
    }
}

fn send(ns: &[u32]) -> AggregatedOutput {
    AggregatedOutput {
        finished_sending: Some(ids(ns)),
        ..empty_aggregated()
    }
}

#[test]
fn s19_async_load_happy_path() {
    let mut s = sched(SchedulerConfig::default());
    for id in [1, 2] {
        s.connector_mut().set_lookup(rid(id), hit(16, true));
        s.add_request(spec(id, 32, 4)).unwrap();
    }
    let (out, _) = step(&mut s, None);
    assert_eq!(out.total_num_scheduled_tokens, 0);
    for id in [1, 2] {
        assert_eq!(s.status(rid(id)), Some(RequestStatus::WaitingForRemoteKvs));
        assert_eq!(computed(&s, id), 16);
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
    assert_drained(&mut s);
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

/// A sliding window skips whole blocks only: a prefill chunk that ends mid-block (3 of 4 slots,
/// 2 tokens already out of a 2-token window) keeps its block, and the next chunk gets a fresh
/// block for its slots — no null.
#[test]
fn a_chunk_after_a_partly_skipped_block_gets_a_fresh_block() {
    // Protects vLLM's sliding-window allocation (`allocate_slots` pads with the null block only
    // the whole blocks that left the window) where the skipped tokens end mid-block, so that
    // the rounding to whole blocks shows.
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        groups: vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 2 },
        ],
        max_num_batched_tokens: 3,
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 6, 2)).unwrap();
    let (one, _) = step(&mut s, None);
    assert_eq!(one.num_scheduled_tokens, vec![(rid(1), 3)]);
    let free = s.block_pool().num_free();
    let (two, _) = step(&mut s, None);
    assert_eq!(two.num_scheduled_tokens, vec![(rid(1), 3)]);
    let v = s.view();
    let r = v.request(rid(1)).unwrap();
    for g in 0..2 {
        assert_eq!(r.block_ids(g).len(), 2, "group {g}");
        assert!(r.block_ids(g).iter().all(|b| *b != BlockId(0)), "group {g}");
    }
    assert_eq!(s.block_pool().num_free(), free - 2);
}

/// Every documented range of [`SchedulerConfig`], checked at both sides of each edge.
#[test]
fn config_ranges_are_checked_at_their_edges() {
    type Edit = fn(&mut SchedulerConfig);
    let cases: [(&str, Edit, bool); 17] = [
        ("block_size 0", |c| c.block_size = 0, false),
        ("block_size 1", |c| c.block_size = 1, true),
        ("num_gpu_blocks 1", |c| c.num_gpu_blocks = 1, false),
        ("num_gpu_blocks 2", |c| c.num_gpu_blocks = 2, true),
        (
            "num_gpu_blocks u32::MAX",
            |c| c.num_gpu_blocks = u32::MAX,
            false,
        ),
        (
            "num_gpu_blocks u32::MAX - 1",
            |c| c.num_gpu_blocks = u32::MAX - 1,
            true,
        ),
        ("no groups", |c| c.groups.clear(), false),
        (
            "8 groups",
            |c| c.groups = vec![GroupKind::FullAttention; 8],
            true,
        ),
        (
            "9 groups",
            |c| c.groups = vec![GroupKind::FullAttention; 9],
            false,
        ),
        (
            "window 0",
            |c| c.groups.push(GroupKind::SlidingWindow { window: 0 }),
            false,
        ),
        (
            "window 1",
            |c| c.groups.push(GroupKind::SlidingWindow { window: 1 }),
            true,
        ),
        (
            "max_num_batched_tokens 0",
            |c| c.max_num_batched_tokens = 0,
            false,
        ),
        ("max_num_seqs 0", |c| c.max_num_seqs = 0, false),
        ("max_model_len 1", |c| c.max_model_len = 1, false),
        ("max_model_len 2", |c| c.max_model_len = 2, true),
        ("async_depth 0", |c| c.async_depth = 0, false),
        ("async_depth 9", |c| c.async_depth = 9, false),
    ];
    for (what, edit, valid) in cases {
        let mut c = SchedulerConfig::default();
        edit(&mut c);
        match c.validate() {
            Ok(()) => assert!(valid, "{what} accepted"),
            Err(e) => {
                assert!(!valid, "{what} rejected: {e}");
                assert_eq!(e.kind(), "invalid_config", "{what}");
            }
        }
    }
    for depth in [1, 8] {
        let c = SchedulerConfig {
            async_depth: depth,
            max_num_batched_tokens: 1,
            max_num_seqs: 1,
            ..SchedulerConfig::default()
        };
        assert_eq!(c.validate(), Ok(()), "async_depth {depth}");
    }
    // The scheduler refuses a bad config with the same typed error.
    let bad = SchedulerConfig {
        block_size: 0,
        ..SchedulerConfig::default()
    };
    let Err(e) = Scheduler::new(bad, ScriptedConnector::new()) else {
        panic!("block_size 0 accepted by Scheduler::new");
    };
    assert_eq!(e.kind(), "invalid_config");
}

/// Admits request 2 with request 1's first 8 tokens and one more, runs a step, and returns how
/// many tokens its lookup found computed (the local prefix-cache hit; lookups answer a miss).
fn hit_of_request_2(s: &mut Scheduler<ScriptedConnector>, first_8: &[u32]) -> u32 {
    let mut prompt = first_8.to_vec();
    prompt.push(7777);
    s.add_request(RequestSpec {
        prompt,
        ..spec(2, 1, 4)
    })
    .unwrap();
    let (out, _) = step(s, None);
    out.scheduled_new_reqs
        .iter()
        .find(|n| n.id == rid(2))
        .expect("request 2 admitted")
        .num_computed_tokens
}

/// vLLM's `allocate_slots`: the blocks for externally computed tokens are taken for every
/// group first, then the blocks for the tokens to compute (so the ids interleave by group).
#[test]
fn external_blocks_come_before_new_blocks_in_every_group() {
    // Protects the block order of vLLM's `allocate_slots` (the external tokens' blocks of every
    // group, then the new blocks), which reaches the connector in `update_state_after_alloc`
    // (I-8): any other order allocates as many blocks, so only the ids tell it apart.
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        groups: vec![GroupKind::FullAttention; 2],
        ..SchedulerConfig::default()
    });
    s.connector_mut().set_lookup(rid(1), hit(8, false));
    s.add_request(spec(1, 20, 4)).unwrap();
    let (out, _) = step(&mut s, None);
    let new = &out.scheduled_new_reqs[0];
    assert_eq!(new.num_computed_tokens, 8);
    let ids = |v: &[u64]| v.iter().map(|&b| BlockId(b)).collect::<Vec<_>>();
    assert_eq!(
        new.block_ids,
        vec![ids(&[1, 2, 5, 6, 7]), ids(&[3, 4, 8, 9, 10])]
    );
}

/// A block filled by decoding is offered to the prefix cache in the step that fills it.
#[test]
fn a_block_filled_by_decoding_is_cached() {
    // Protects vLLM's prefix caching of a running request: its cached blocks follow its
    // computed tokens, not its block table, so the block decoding fills is cached when full
    // (a local prefix hit of request 2 finds it).
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 6, 8)).unwrap();
    // Prefill (6 tokens), then two decode steps: the 8th token fills block 1.
    for _ in 0..3 {
        step(&mut s, None);
    }
    let tokens = s.view().request(rid(1)).unwrap().tokens().to_vec();
    assert_eq!(tokens.len(), 9);
    assert_eq!(hit_of_request_2(&mut s, &tokens[..8]), 8, "both blocks hit");
}

/// The hit request 2 gets on request 1's first 8 tokens (block size 4) after request 1 (a
/// `prompt_len`-token prompt, `max_tokens` output tokens) ran `steps` steps and finished.
fn hit_on_the_prefix_of(
    mut s: Scheduler<ScriptedConnector>,
    prompt_len: u32,
    max_tokens: u32,
    steps: usize,
) -> u32 {
    let first = spec(1, prompt_len, max_tokens);
    // Its sequence: the prompt, then what `fake_sample` samples at each position.
    let mut tokens = first.prompt.clone();
    tokens.extend((prompt_len..8).map(|p| fake_token(rid(1), p)));
    s.add_request(first).unwrap();
    for _ in 0..steps {
        step(&mut s, None);
    }
    assert_eq!(s.status(rid(1)), None, "request 1 finished and was freed");
    hit_of_request_2(&mut s, &tokens)
}

/// Blocks are cached as their tokens are computed: not before (a sampled token has no KV until
/// the next step computes it), and not later than the step that computes them.
#[test]
fn blocks_are_cached_when_their_last_token_is_computed() {
    // Protects when vLLM caches a block: once all its tokens are computed, counting whole
    // blocks of computed tokens, the tokens of the step that computes them included.
    let bs4 = |budget| SchedulerConfig {
        block_size: 4,
        max_num_batched_tokens: budget,
        ..SchedulerConfig::default()
    };
    // A 6-token prompt, 2 output tokens: the 8th token is sampled, never computed, so block 1
    // is never full of KV and only block 0 is served.
    assert_eq!(hit_on_the_prefix_of(sched(bs4(256)), 6, 2, 2), 4);
    // An 8-token prompt prefilled in two chunks of 4, finishing at once (1 output token):
    // the second chunk's block is cached in the step that computes it.
    assert_eq!(hit_on_the_prefix_of(sched(bs4(4)), 8, 1, 2), 8);
    // A prefill chunk of 3 tokens leaves block 0 a token short: aborted there, nothing of it
    // is served (its tokens are all known, so only the computed count keeps it out).
    let mut s = sched(bs4(3));
    s.add_request(spec(1, 8, 4)).unwrap();
    step(&mut s, None);
    assert!(s.abort(rid(1)).unwrap());
    assert_eq!(hit_of_request_2(&mut s, &spec(1, 8, 4).prompt), 0);
}

/// With async scheduling a block filled by decoding holds placeholders until the outputs
/// arrive, so it is cached when the output carrying its last token is applied: here the output
/// that finishes the request, after which no allocation would cache it.
#[test]
fn async_decoding_caches_a_block_when_its_last_token_arrives() {
    // Protects vLLM's caching under async scheduling (steps scheduled ahead, I-12): a block
    // whose last token is a placeholder is cached when the output with that token is applied,
    // even when that output finishes the request.
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        async_depth: 2,
        ..SchedulerConfig::default()
    });
    let first = spec(1, 6, 3);
    let mut tokens = first.prompt.clone();
    tokens.extend((6..8).map(|p| fake_token(rid(1), p)));
    s.add_request(first).unwrap();
    // Prefill, decodes at 6 and 7 (the 3rd output token is sampled at 8), then an empty step;
    // each output arrives when two steps are in flight.
    let mut in_flight = Vec::new();
    for _ in 0..4 {
        in_flight.push(schedule(&mut s).step);
        if in_flight.len() == 2 {
            let oldest = in_flight.remove(0);
            apply(&mut s, oldest, None);
        }
    }
    for step in in_flight {
        apply(&mut s, step, None);
    }
    assert_eq!(s.status(rid(1)), None, "request 1 finished and was freed");
    assert_eq!(hit_of_request_2(&mut s, &tokens), 8, "both blocks hit");
}

/// Sampled tokens are matched to requests by id: an output listing them in another order than
/// the step scheduled them gives each request its own tokens.
#[test]
fn sampled_tokens_in_any_order_go_to_their_requests() {
    // Protects vLLM's `update_from_output`, which looks each request's sampled tokens up by id:
    // the order of the output is not part of the contract.
    let mut s = sched(SchedulerConfig::default());
    s.add_request(spec(1, 5, 4)).unwrap();
    s.add_request(spec(2, 5, 4)).unwrap();
    let out = schedule(&mut s);
    let mut sampled = s.fake_sample(out.step);
    assert_eq!(sampled.len(), 2);
    sampled.reverse();
    s.update_from_output(
        out.step,
        ModelOutput {
            sampled,
            kv_connector_output: None,
        },
    )
    .unwrap();
    check(&s);
    for id in [1, 2] {
        assert_eq!(
            s.view().request(rid(id)).unwrap().tokens().last(),
            Some(&fake_token(rid(id), 5))
        );
    }
}

/// An output may carry several tokens for a request (vLLM's speculative decoding): those after
/// a stop are dropped, and so is their share of the computed tokens (`num_computed_tokens -=
/// num_tokens - (i + 1)` for a stop at index `i`).
#[test]
fn tokens_after_a_stop_in_a_multi_token_output_are_dropped() {
    // Protects vLLM's stop check on multi-token outputs (speculative decoding): the tokens
    // after the stop and their share of `num_computed_tokens` are discarded together.
    let mut s = sched(SchedulerConfig::default());
    // Held after finishing, so that its counts stay visible.
    s.connector_mut().set_delay_free(rid(1), true);
    s.add_request(RequestSpec {
        stop_token: Some(42),
        ..spec(1, 20, 8)
    })
    .unwrap();
    let out = schedule(&mut s);
    assert_eq!(computed(&s, 1), 20);
    let res = s
        .update_from_output(
            out.step,
            ModelOutput {
                sampled: vec![(rid(1), vec![7, 42, 8, 9])],
                kv_connector_output: None,
            },
        )
        .unwrap();
    check(&s);
    assert_eq!(res.outputs[0].finish, Some(FinishReason::Stopped));
    assert_eq!(res.outputs[0].new_tokens, vec![7, 42]);
    assert_eq!(s.status(rid(1)), Some(RequestStatus::FinishedStopped));
    let r = s.view().request(rid(1)).unwrap();
    assert_eq!(r.tokens().len(), 22);
    assert_eq!(
        r.num_computed_tokens(),
        20 - 2,
        "the 2 tokens after the stop"
    );
}

/// A running request that gets no new block carries no block list at all (vLLM's `None`);
/// one that crosses a block boundary carries one list per group.
#[test]
fn a_decode_step_without_a_new_block_carries_no_block_list() {
    // Protects vLLM's `CachedRequestData.new_block_ids`: `None` when no group got a block, one
    // list per group otherwise (workers extend their block tables with it).
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        groups: vec![GroupKind::FullAttention; 2],
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 6, 8)).unwrap();
    step(&mut s, None);
    // Token 7 goes into block 1, which exists: nothing new.
    let (out, _) = step(&mut s, None);
    assert_eq!(out.scheduled_cached_reqs.len(), 1);
    assert!(out.scheduled_cached_reqs[0].new_block_ids.is_empty());
    step(&mut s, None);
    // Token 9 needs block 2 in both groups.
    let (out, _) = step(&mut s, None);
    let new = &out.scheduled_cached_reqs[0].new_block_ids;
    assert_eq!(new.len(), 2);
    assert!(new.iter().all(|g| g.len() == 1), "{new:?}");
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
        ..empty_aggregated()
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
    // Sampled tokens for a request the step did not schedule, or twice for one it did.
    // (vLLM's output has one entry per scheduled request: a second one is as bad as one for a
    // request the step did not schedule.)
    let before = s.clone();
    for (sampled, id) in [
        (vec![(rid(2), vec![7])], rid(2)),
        (vec![(rid(1), vec![7]), (rid(1), vec![8])], rid(1)),
    ] {
        let e = s
            .update_from_output(
                st.output.step,
                ModelOutput {
                    sampled,
                    kv_connector_output: None,
                },
            )
            .unwrap_err();
        assert_eq!(
            e,
            SchedulerError::NotScheduled {
                step: st.output.step,
                id
            }
        );
        assert!(s == before, "a rejected output changes nothing");
    }
    // Nothing was consumed: the real output still applies.
    s.update_from_output(st.output.step, ModelOutput::default())
        .unwrap();
    check(&s);
    let _ = (Mode::Strict, LoadFailurePolicy::Recompute);
}

/// `failed_recving` naming a request the scheduler does not hold: vLLM ignores it (compat);
/// strict rejects the output with `unknown_request`, and nothing of it is applied.
#[test]
fn an_unknown_id_in_failed_recving_is_ignored_in_compat_and_rejected_in_strict() {
    // Protects the mode split of the `failed_recving` input check: vLLM ignores an id it does
    // not hold, and so does compat; strict rejects the output.
    for mode in [Mode::Compat, Mode::Strict] {
        let mut s = sched(SchedulerConfig {
            mode,
            ..SchedulerConfig::default()
        });
        s.add_request(spec(1, 20, 3)).unwrap();
        let st = s.schedule().unwrap();
        let before = s.clone();
        let output = ModelOutput {
            sampled: s.fake_sample(st.output.step),
            kv_connector_output: Some(AggregatedOutput {
                failed_recving: SortedSet::from_vec(vec![rid(9)]),
                ..empty_aggregated()
            }),
        };
        let r = s.update_from_output(st.output.step, output);
        match mode {
            Mode::Compat => {
                r.unwrap();
                assert_eq!(s.view().request(rid(1)).unwrap().tokens().len(), 21);
            }
            Mode::Strict => {
                assert_eq!(r.unwrap_err(), SchedulerError::UnknownRequest(rid(9)));
                assert!(s == before, "a rejected output changes nothing");
            }
        }
        check(&s);
    }
}

/// `finished_recving` naming a request the scheduler does not hold is bad input in both modes:
/// `unknown_request`, nothing of the output applied, and the scheduler still takes the step's
/// output once it is corrected (only the pre-#32255 fault injection ignores such ids).
#[test]
fn an_unknown_id_in_finished_recving_is_rejected_and_changes_nothing() {
    // Protects the scheduler's check of aggregated completions (vLLM asserts every id exists,
    // I-16 for sends) on the receive side: an unknown `finished_recving` id is rejected as an
    // unknown `finished_sending` id is, and only PR #32255's fault injection lets it through.
    for mode in [Mode::Compat, Mode::Strict] {
        let mut s = sched(SchedulerConfig {
            mode,
            ..SchedulerConfig::default()
        });
        s.add_request(spec(1, 20, 3)).unwrap();
        let st = s.schedule().unwrap();
        let before = s.clone();
        let sampled = s.fake_sample(st.output.step);
        let r = s.update_from_output(
            st.output.step,
            ModelOutput {
                sampled: sampled.clone(),
                kv_connector_output: Some(recv(&[9])),
            },
        );
        assert_eq!(r.unwrap_err(), SchedulerError::UnknownRequest(rid(9)));
        assert!(s == before, "a rejected output changes nothing");
        s.update_from_output(
            st.output.step,
            ModelOutput {
                sampled,
                kv_connector_output: None,
            },
        )
        .unwrap();
        assert_eq!(s.view().request(rid(1)).unwrap().tokens().len(), 21);
        check(&s);
    }
}

/// A lookup answer the request cannot hold breaks the scheduler with a sticky, typed
/// `connector_contract` error: a synchronous load must leave the last token to compute (vLLM
/// asserts it), an asynchronous one may cover the whole prompt, and an asynchronous load of no
/// token is not a load.
#[test]
fn lookup_answers_beyond_the_request_are_contract_errors() {
    // Protects the contract of `get_num_new_matched_tokens` (§3.1; vLLM asserts it) at its
    // bounds: the largest legal answer of each kind, one token past it, and an asynchronous
    // answer of no token.
    let lookup = |tokens, load_async| {
        let mut s = sched(SchedulerConfig {
            block_size: 4,
            ..SchedulerConfig::default()
        });
        s.connector_mut()
            .set_lookup(rid(1), hit(tokens, load_async));
        s.add_request(spec(1, 8, 4)).unwrap();
        let r = s.schedule().map(|st| st.output.num_scheduled_tokens);
        (s, r)
    };
    assert_eq!(lookup(7, false).1, Ok(vec![(rid(1), 1)]));
    assert_eq!(lookup(8, true).1, Ok(vec![]));
    for (tokens, load_async) in [(8, false), (9, true), (0, true)] {
        let (mut s, r) = lookup(tokens, load_async);
        let e = r.unwrap_err();
        assert_eq!(
            e.kind(),
            "connector_contract",
            "{tokens} tokens, async {load_async}"
        );
        assert_eq!(s.schedule().map(|_| ()), Err(e), "sticky");
    }
}

/// The oracle issue: a sticky `connector_contract` error stops the scheduler, but must not
/// leave it corrupt. In one pass r1's lookup is pending (skipped) and r2 starts an async load
/// (moved to loading) before r3's lookup breaks the contract; both go back to their queues, so
/// every invariant still holds (before the fix: I-16 for r1, I-18 for r2), in both modes.
#[test]
fn a_contract_error_mid_pass_leaves_the_skipped_requests_queued() {
    for mode in [Mode::Compat, Mode::Strict] {
        let mut s = sched(SchedulerConfig {
            block_size: 4,
            mode,
            ..SchedulerConfig::default()
        });
        s.connector_mut().set_lookup(rid(1), Lookup::Pending);
        s.connector_mut().set_lookup(rid(2), hit(8, true));
        s.connector_mut().set_lookup(rid(3), hit(0, true));
        for id in 1..=3 {
            s.add_request(spec(id, 8, 4)).unwrap();
        }
        let e = s.schedule().map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), "connector_contract", "{mode:?}");
        s.check_invariants()
            .unwrap_or_else(|v| panic!("{mode:?}: the stopped scheduler is corrupt: {v:?}"));
        assert_eq!(s.status(rid(1)), Some(RequestStatus::Waiting));
        assert_eq!(s.status(rid(2)), Some(RequestStatus::WaitingForRemoteKvs));
        assert_eq!(s.status(rid(3)), Some(RequestStatus::Waiting));
        let waiting: Vec<RequestId> = s.view().waiting().collect();
        assert_eq!(waiting, [rid(2), rid(1), rid(3)], "{mode:?}");
        assert_eq!(s.schedule().map(|_| ()), Err(e), "sticky");
    }
}

/// Nothing left but finished ids not yet delivered: one empty step delivers them (vLLM's
/// `has_finished_requests` keeps the engine stepping until then), and then the scheduler is idle.
fn assert_drained(s: &mut Scheduler<ScriptedConnector>) {
    assert!(
        s.has_requests(),
        "finished ids are delivered by one more step"
    );
    let out = schedule(s);
    assert!(out.num_scheduled_tokens.is_empty(), "{out:?}");
    assert!(!out.finished_req_ids.is_empty(), "{out:?}");
    apply(s, out.step, None);
    assert!(!s.has_requests());
}

/// §6.1: the last running request is preempted when blocks run out; its id is in the same step's
/// `preempted_req_ids`, its blocks are freed, and it is looked up again on re-admission.
#[test]
fn preemption_frees_blocks_and_relooks_up_on_readmission() {
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: 9, // 8 usable
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 12, 20)).unwrap();
    s.add_request(spec(2, 12, 20)).unwrap();
    let mut preempted = None;
    for _ in 0..20 {
        let (out, _) = step(&mut s, None);
        if !out.preempted_req_ids.is_empty() {
            preempted = Some(out);
            break;
        }
    }
    let out = preempted.expect("the pool runs out");
    assert_eq!(out.preempted_req_ids.as_slice(), &[rid(2)]);
    assert_eq!(s.status(rid(2)), Some(RequestStatus::Preempted));
    assert_eq!(computed(&s, 2), 0);
    assert!(s.view().request(rid(2)).unwrap().block_ids(0).is_empty());
    // No request_finished for a preemption.
    let calls = s.connector_mut().take_calls();
    assert!(
        !calls
            .iter()
            .any(|c| matches!(c, ConnectorCall::RequestFinished { .. }))
    );
    // Once request 1 finishes, request 2 is re-admitted with a new lookup.
    for _ in 0..40 {
        step(&mut s, None);
        if s.status(rid(2)) == Some(RequestStatus::Running) {
            break;
        }
    }
    assert_eq!(s.status(rid(2)), Some(RequestStatus::Running));
    let calls = s.connector_mut().take_calls();
    assert!(calls.iter().any(|c| matches!(
        c,
        ConnectorCall::GetNumNewMatchedTokens { id, .. } if *id == rid(2)
    )));
}

/// §2.3 step 1: `has_pending_block_frees() == true` suppresses preemption.
#[test]
fn pending_block_frees_veto_preemption() {
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: 9,
        ..SchedulerConfig::default()
    });
    s.connector_mut().set_pending_block_frees(true);
    s.add_request(spec(1, 12, 20)).unwrap();
    s.add_request(spec(2, 12, 20)).unwrap();
    for _ in 0..20 {
        let (out, _) = step(&mut s, None);
        assert!(out.preempted_req_ids.is_empty());
    }
    assert_eq!(s.status(rid(2)), Some(RequestStatus::Running));
}

/// I-15 and §2.9: a delayed free keeps the request and its blocks until the aggregated
/// `finished_sending`; its id reaches the workers in the next step's `finished_req_ids`.
#[test]
fn delayed_free_holds_blocks_until_finished_sending() {
    let mut s = sched(SchedulerConfig::default());
    s.connector_mut().set_delay_free(rid(1), true);
    s.add_request(spec(1, 20, 1)).unwrap();
    let free0 = s.block_pool().num_free();
    let (_, res) = step(&mut s, None);
    assert_eq!(res.outputs[0].finish, Some(FinishReason::LengthCapped));
    assert_eq!(s.status(rid(1)), Some(RequestStatus::FinishedLengthCapped));
    assert!(s.has_requests());
    assert!(s.block_pool().num_free() < free0);
    let out = schedule(&mut s);
    assert_eq!(out.finished_req_ids.as_slice(), &[rid(1)]);
    apply(&mut s, out.step, Some(send(&[1])));
    assert_eq!(s.status(rid(1)), None);
    assert_eq!(s.block_pool().num_free(), free0);
    assert!(!s.has_requests());
}

/// I-17 (PR #32255): an abort while loading keeps the blocks until `finished_recving`; an
/// abort after the load was reported frees at once.
#[test]
fn abort_while_loading_holds_blocks_until_the_load_reports() {
    let mut s = sched(SchedulerConfig::default());
    let free0 = s.block_pool().num_free();
    for id in [1, 2] {
        s.connector_mut().set_lookup(rid(id), hit(32, true));
        s.add_request(spec(id, 40, 4)).unwrap();
    }
    step(&mut s, None);
    assert!(s.abort(rid(1)).unwrap());
    check(&s);
    assert_eq!(s.status(rid(1)), Some(RequestStatus::FinishedAborted));
    assert!(!s.abort(rid(1)).unwrap(), "a finished request is not live");
    // Request 2's load is reported, then it is aborted before promotion: freed at once.
    step(&mut s, Some(recv(&[2])));
    assert!(s.abort(rid(2)).unwrap());
    check(&s);
    assert_eq!(s.status(rid(2)), None);
    // Request 1's load reports: now its blocks go back.
    step(&mut s, Some(recv(&[1])));
    assert_eq!(s.status(rid(1)), None);
    assert_eq!(s.block_pool().num_free(), free0);
}

/// A `finished_recving` for a request that the same output finishes and frees: vLLM asserts
/// the request still exists and crashes; both modes break with a sticky `stale_completion`.
#[test]
fn finished_recving_for_a_request_freed_by_the_same_output_is_stale() {
    // Protects the stale-completion check within one output: a completion for a request the
    // same output already freed is stale in both modes; only PR #32255's fault injection, for
    // loads freed at abort (I-17), accepts such a completion.
    for mode in [Mode::Compat, Mode::Strict] {
        let mut s = sched(SchedulerConfig {
            mode,
            ..SchedulerConfig::default()
        });
        s.add_request(spec(1, 20, 1)).unwrap();
        let out = schedule(&mut s);
        let r = s.update_from_output(
            out.step,
            ModelOutput {
                sampled: s.fake_sample(out.step),
                kv_connector_output: Some(recv(&[1])),
            },
        );
        let e = r.unwrap_err();
        assert_eq!(e.kind(), "stale_completion", "{mode:?}");
        assert_eq!(s.schedule().map(|_| ()), Err(e), "sticky");
    }
}

/// Strict mode rejects what compat (vLLM) accepts: a duplicate `finished_recving`, and a
/// `finished_recving` for a request held only for a send.
#[test]
fn strict_mode_rejects_stale_and_duplicate_completions() {
    for mode in [Mode::Compat, Mode::Strict] {
        // Two steps in flight, so the second report arrives before the promotion.
        let mut s = sched(SchedulerConfig {
            mode,
            async_depth: 2,
            ..SchedulerConfig::default()
        });
        s.connector_mut().set_lookup(rid(1), hit(16, true));
        s.add_request(spec(1, 20, 4)).unwrap();
        let a = schedule(&mut s);
        let out = schedule(&mut s);
        apply(&mut s, a.step, Some(recv(&[1])));
        let r = s.update_from_output(
            out.step,
            ModelOutput {
                sampled: vec![],
                kv_connector_output: Some(recv(&[1])),
            },
        );
        match mode {
            Mode::Compat => {
                r.unwrap();
            }
            Mode::Strict => assert_eq!(r.unwrap_err().kind(), "duplicate_completion"),
        }
        check(&s);
    }
    for mode in [Mode::Compat, Mode::Strict] {
        let mut s = sched(SchedulerConfig {
            mode,
            ..SchedulerConfig::default()
        });
        s.connector_mut().set_delay_free(rid(1), true);
        s.add_request(spec(1, 20, 1)).unwrap();
        step(&mut s, None);
        let out = schedule(&mut s);
        let r = s.update_from_output(
            out.step,
            ModelOutput {
                sampled: vec![],
                kv_connector_output: Some(recv(&[1])),
            },
        );
        match mode {
            // vLLM frees the blocks of a request whose send is still in flight.
            Mode::Compat => {
                r.unwrap();
                assert_eq!(s.status(rid(1)), None);
            }
            Mode::Strict => {
                assert_eq!(r.unwrap_err().kind(), "stale_completion");
                // The error sticks.
                assert_eq!(s.schedule().unwrap_err().kind(), "stale_completion");
            }
        }
    }
}

/// A shared prefix: request 1 computes and caches three blocks; request 2 hits the first two.
fn shared_prefix(policy: LoadFailurePolicy) -> (Scheduler<ScriptedConnector>, StepId, BlockId) {
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        load_failure_policy: policy,
        ..SchedulerConfig::default()
    });
    let p1: Vec<u32> = (1..=12).collect();
    let mut p2: Vec<u32> = (1..=8).collect();
    p2.extend([100, 101, 102, 103]);
    s.add_request(spec_with(1, p1, 10)).unwrap();
    step(&mut s, None);
    s.add_request(spec_with(2, p2, 10)).unwrap();
    let out = schedule(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(1), 1), (rid(2), 4)]);
    let shared = s.view().request(rid(1)).unwrap().block_ids(0)[0];
    assert_eq!(s.view().request(rid(2)).unwrap().block_ids(0)[0], shared);
    (s, out.step, shared)
}

/// I-33/I-34: the first request of the scan claims a shared invalid block and truncates at it;
/// the later sharer treats it as computed and reverts to its pre-step count.
#[test]
fn recompute_policy_truncates_the_first_claimant_only() {
    let (mut s, step_id, shared) = shared_prefix(LoadFailurePolicy::Recompute);
    let bad = AggregatedOutput {
        invalid_block_ids: SortedSet::from_vec(vec![shared]),
        ..empty_aggregated()
    };
    let res = apply(&mut s, step_id, Some(bad));
    assert!(
        res.outputs.is_empty(),
        "affected requests consume no output"
    );
    assert_eq!(computed(&s, 1), 0);
    assert_eq!(computed(&s, 2), 8);
    assert_eq!(s.status(rid(1)), Some(RequestStatus::Running));
    // Recompute never evicts (I-35).
    assert!(s.block_pool().cached_hash(shared).is_some());
}

/// I-35: under `fail`, affected requests finish with an error and the invalid block and the
/// blocks after it are evicted from the prefix cache.
#[test]
fn fail_policy_errors_affected_requests_and_evicts() {
    let (mut s, step_id, shared) = shared_prefix(LoadFailurePolicy::Fail);
    let bad = AggregatedOutput {
        invalid_block_ids: SortedSet::from_vec(vec![shared]),
        ..empty_aggregated()
    };
    let res = apply(&mut s, step_id, Some(bad));
    let errors: Vec<_> = res
        .outputs
        .iter()
        .filter(|o| o.finish == Some(FinishReason::Error))
        .map(|o| o.id)
        .collect();
    assert_eq!(errors, vec![rid(1), rid(2)]);
    assert!(s.block_pool().cached_hash(shared).is_none());
    assert_drained(&mut s);
}

/// I-36/I-37: `failed_recving` under `recompute` resets a loading request to 0 computed tokens;
/// after its `finished_recving` it is promoted, frees its blocks and is looked up again.
#[test]
fn failed_recving_with_recompute_restarts_the_request() {
    let mut s = sched(SchedulerConfig {
        load_failure_policy: LoadFailurePolicy::Recompute,
        groups: vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 32 },
        ],
        ..SchedulerConfig::default()
    });
    s.connector_mut().set_lookup(rid(1), hit(32, true));
    s.add_request(spec(1, 40, 4)).unwrap();
    step(&mut s, None);
    let failed = AggregatedOutput {
        failed_recving: SortedSet::from_vec(vec![rid(1)]),
        ..recv(&[1])
    };
    step(&mut s, Some(failed));
    assert_eq!(computed(&s, 1), 0);
    s.connector_mut().set_lookup(rid(1), Lookup::MISS);
    s.connector_mut().take_calls();
    let out = schedule(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(1), 40)]);
    let calls = s.connector_mut().take_calls();
    assert!(
        calls
            .iter()
            .any(|c| matches!(c, ConnectorCall::GetNumNewMatchedTokens { .. }))
    );
}

/// I-36: block-level failures with several KV cache groups are refused (vLLM raises).
#[test]
fn invalid_blocks_with_two_groups_is_an_error() {
    let mut s = sched(SchedulerConfig {
        groups: vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 32 },
        ],
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 20, 4)).unwrap();
    let out = schedule(&mut s);
    let bad = AggregatedOutput {
        invalid_block_ids: SortedSet::from_vec(vec![BlockId(1)]),
        ..empty_aggregated()
    };
    let before = s.clone();
    let e = s
        .update_from_output(
            out.step,
            ModelOutput {
                sampled: vec![],
                kv_connector_output: Some(bad),
            },
        )
        .unwrap_err();
    assert_eq!(e, SchedulerError::InvalidBlocksWithMultipleGroups);
    assert_eq!(s, before, "a rejected output changes nothing");
}

/// I-12: with async depth 2, step k+1 is built before step k's output is applied; a third
/// schedule is refused and outputs must come oldest first.
#[test]
fn async_depth_two_schedules_ahead() {
    let mut s = sched(SchedulerConfig {
        async_depth: 2,
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 20, 8)).unwrap();
    let a = schedule(&mut s);
    let b = schedule(&mut s);
    assert_eq!(
        b.num_scheduled_tokens,
        vec![(rid(1), 1)],
        "a decode on a placeholder"
    );
    assert_eq!(s.schedule().unwrap_err().kind(), "pipeline_full");
    assert_eq!(
        s.update_from_output(b.step, ModelOutput::default())
            .unwrap_err()
            .kind(),
        "step_out_of_order"
    );
    apply(&mut s, a.step, None);
    apply(&mut s, b.step, None);
    assert_eq!(
        s.view().request(rid(1)).unwrap().tokens().len(),
        22,
        "two sampled tokens"
    );
}

/// §7.3: pins are applied by the scheduler and counted as owners; an unpin of a block that is
/// not pinned is a sticky `intent_rejected`.
#[test]
fn intents_pin_and_unpin_blocks() {
    use kvrelay_core::Intent;
    let mut s = sched(SchedulerConfig::default());
    s.add_request(spec(1, 20, 1)).unwrap();
    let out = schedule(&mut s);
    let b = s.view().request(rid(1)).unwrap().block_ids(0)[0];
    s.connector_mut().push_intent(Intent::Pin(vec![b]));
    apply(&mut s, out.step, None);
    // Finished and freed, but the pin keeps block b owned.
    assert_eq!(s.status(rid(1)), None);
    assert_eq!(s.view().block_ref_cnt(b), Some(1));
    s.connector_mut().push_intent(Intent::Unpin(vec![b]));
    let out = schedule(&mut s);
    assert_eq!(s.view().block_ref_cnt(b), Some(0));
    apply(&mut s, out.step, None);
    s.connector_mut().push_intent(Intent::Unpin(vec![b]));
    assert_eq!(s.schedule().unwrap_err().kind(), "intent_rejected");
}

/// An async load holds its blocks for the whole transfer and cannot be preempted, so it is
/// admitted only if it fits beside the blocks that the prefills in flight still need (vLLM's
/// `_inflight_prefill_reserved_blocks`), including a prefill admitted earlier in the same step.
#[test]
fn an_async_load_leaves_room_for_the_prefills_in_flight() {
    // Protects vLLM's `_inflight_prefill_reserved_blocks` at both sides of its edge: an async
    // load holds its blocks until its `finished_recving` (I-18), so it is admitted only beside
    // the blocks a chunked prefill in flight still needs.
    let admitted = |num_gpu_blocks, loaded| {
        let mut s = sched(SchedulerConfig {
            block_size: 4,
            num_gpu_blocks,
            max_num_batched_tokens: 8,
            long_prefill_token_threshold: 4,
            ..SchedulerConfig::default()
        });
        if loaded > 0 {
            s.connector_mut().set_lookup(rid(1), hit(loaded, false));
        }
        s.add_request(spec(1, 16, 1)).unwrap();
        s.connector_mut().set_lookup(rid(2), hit(8, true));
        s.add_request(spec(2, 12, 1)).unwrap();
        // Request 1 computes 4-token chunks (1 block each, after its `loaded` tokens); request
        // 2's load needs 2 blocks.
        let mut loading = Vec::new();
        for _ in 0..2 {
            let (out, _) = step(&mut s, None);
            assert_eq!(out.num_scheduled_tokens, vec![(rid(1), 4)]);
            loading.push(s.status(rid(2)) == Some(RequestStatus::WaitingForRemoteKvs));
        }
        loading
    };
    // Request 1 still needs 3 blocks, then 2: 2 + 3 reserved > 4 free, 2 + 2 reserved > 3 free.
    assert_eq!(admitted(6, 0), [false, false]);
    // 2 + 3 reserved <= 5 free.
    assert_eq!(admitted(7, 0), [true, true]);
    // After a synchronous load of 4 tokens, request 1 still needs 2 blocks, then 1: 2 + 2 > 3
    // free, 2 + 1 > 2 free; and 2 + 2 <= 4 free.
    assert_eq!(admitted(6, 4), [false, false]);
    assert_eq!(admitted(7, 4), [true, true]);
}

/// Without chunked prefill a prompt is scheduled whole or not at all: one that needs exactly
/// the budget left is scheduled, one that needs more waits for the next step.
#[test]
fn without_chunked_prefill_a_prompt_takes_the_budget_whole_or_waits() {
    // Protects vLLM's rule without chunked prefill at its edge: exactly the budget left is
    // enough, one token more is not.
    let mut s = sched(SchedulerConfig {
        max_num_batched_tokens: 16,
        enable_chunked_prefill: false,
        ..SchedulerConfig::default()
    });
    s.add_request(spec(1, 6, 1)).unwrap();
    s.add_request(spec(2, 10, 1)).unwrap();
    s.add_request(spec(3, 10, 1)).unwrap();
    let (out, _) = step(&mut s, None);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(1), 6), (rid(2), 10)]);
    let (out, _) = step(&mut s, None);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(3), 10)]);
}

/// `long_prefill_token_threshold` caps a prefill chunk only when another request (running,
/// waiting or loading) is eligible: alone, a prompt uses the whole budget.
#[test]
fn the_long_prefill_cap_applies_only_with_company() {
    // Protects vLLM's count of the requests eligible beside a long prefill: running, waiting and
    // loading requests all count, so a request in the loading queue makes the cap apply.
    let config = SchedulerConfig {
        block_size: 4,
        long_prefill_token_threshold: 4,
        ..SchedulerConfig::default()
    };
    let mut s = sched(config.clone());
    s.add_request(spec(1, 16, 4)).unwrap();
    assert_eq!(schedule(&mut s).num_scheduled_tokens, vec![(rid(1), 16)]);
    // Request 1 loads asynchronously (it waits in the loading queue); request 2 is capped.
    let mut s = sched(config);
    s.connector_mut().set_lookup(rid(1), hit(8, true));
    s.add_request(spec(1, 16, 4)).unwrap();
    step(&mut s, None);
    assert_eq!(s.status(rid(1)), Some(RequestStatus::WaitingForRemoteKvs));
    s.add_request(spec(2, 16, 4)).unwrap();
    let out = schedule(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(2), 4)]);
    apply(&mut s, out.step, None);
    // Running now, its next chunk is capped too.
    assert_eq!(schedule(&mut s).num_scheduled_tokens, vec![(rid(2), 4)]);
}

/// vLLM clamps every step to `max_model_len - 1 - num_computed_tokens`: the last token of a
/// full-length sequence is sampled, never computed. With async scheduling the placeholder of
/// the step in flight would otherwise schedule one more.
#[test]
fn no_step_computes_past_max_model_len_minus_one() {
    // Protects vLLM's clamp of a running request's step to `max_model_len - 1 -
    // num_computed_tokens`, with one step in flight and with two.
    for depth in [1, 2] {
        let mut s = sched(SchedulerConfig {
            block_size: 4,
            max_model_len: 12,
            async_depth: depth,
            ..SchedulerConfig::default()
        });
        s.add_request(spec(1, 8, 100)).unwrap();
        let mut in_flight = std::collections::VecDeque::new();
        let mut scheduled = Vec::new();
        for _ in 0..8 {
            let out = schedule(&mut s);
            scheduled.push(out.total_num_scheduled_tokens);
            in_flight.push_back(out.step);
            if in_flight.len() as u32 == depth {
                apply(&mut s, in_flight.pop_front().unwrap(), None);
            }
        }
        // 8 prompt tokens, then one decode step each for positions 8, 9, 10: 11 computed.
        assert_eq!(
            scheduled,
            vec![8, 1, 1, 1, 0, 0, 0, 0],
            "async depth {depth}"
        );
    }
}

/// `watermark_blocks`: while others run, a waiting request is admitted only if its blocks
/// leave the watermark free.
#[test]
fn admission_keeps_the_watermark_free() {
    // Protects vLLM's `watermark_blocks` check on admission, at both sides of its edge.
    // Request 1 (8 tokens) holds 3 blocks from its first decode on; request 2 needs
    // `cdiv(len, 4)` blocks of the `num_gpu_blocks - 1 - 3` free ones, plus 2 kept free.
    let admitted = |num_gpu_blocks: u32, len: u32| {
        let mut s = sched(SchedulerConfig {
            block_size: 4,
            num_gpu_blocks,
            watermark_blocks: 2,
            ..SchedulerConfig::default()
        });
        s.add_request(spec(1, 8, 8)).unwrap();
        step(&mut s, None);
        s.add_request(spec(2, len, 4)).unwrap();
        let (out, _) = step(&mut s, None);
        out.scheduled_new_reqs.iter().any(|n| n.id == rid(2))
    };
    assert!(admitted(7, 4), "1 block + 2 kept free of 3");
    assert!(!admitted(7, 8), "2 blocks + 2 kept free > 3");
    assert!(!admitted(6, 4), "1 block + 2 kept free > 2");
}

/// Preemption with async scheduling (PR #50297): when the connector requires KV delivery, the
/// preempted request's in-flight output is stale and dropped; otherwise it is applied when it
/// arrives (and the request waits for it).
#[test]
fn a_preempted_request_drops_its_in_flight_output_when_kv_delivery_is_required() {
    // Protects the first half of vLLM's `_preempt_request` condition (PR #50297): a preempted
    // request's in-flight output is dropped exactly when the connector requires KV delivery.
    for requires in [true, false] {
        // The scheduler asks the connector once, when it is built.
        let mut connector = ScriptedConnector::new();
        connector.set_requires_kv_delivery(requires);
        let config = SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: 5,
            async_depth: 2,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(config, connector).unwrap();
        s.add_request(spec(1, 7, 8)).unwrap();
        s.add_request(spec(2, 7, 8)).unwrap();
        let one = schedule(&mut s); // both prefill: all 4 blocks
        let two = schedule(&mut s); // both decode slot 8
        apply(&mut s, one.step, None);
        let three = schedule(&mut s); // request 1 needs a 3rd block: request 2 is preempted
        assert_eq!(
            three.preempted_req_ids.iter().copied().collect::<Vec<_>>(),
            vec![rid(2)]
        );
        assert_eq!(s.view().request(rid(2)).unwrap().tokens().len(), 8);
        apply(&mut s, two.step, None);
        let want = if requires { 8 } else { 9 };
        assert_eq!(
            s.view().request(rid(2)).unwrap().tokens().len(),
            want,
            "requires_kv_delivery = {requires}"
        );
        apply(&mut s, three.step, None);
    }
}

/// A request whose in-flight output strict mode dropped (a load failure rolled it back under
/// async scheduling) keeps dropping that output if it is preempted before the output arrives;
/// once the output has drained, a later preemption delivers the in-flight output again, as any
/// preemption without `requires_kv_delivery` does (vLLM's `_preempt_request`:
/// `drop_stale_output or (request.drop_stale_output and request.num_stale_output_tokens > 0)`).
#[test]
fn a_stale_drop_outlives_a_preemption_only_while_its_output_is_in_flight() {
    // Protects the second half of vLLM's `_preempt_request` condition (`request.drop_stale_output
    // and request.num_stale_output_tokens > 0`): an earlier drop carries over a preemption only
    // while the dropped output is still in flight.
    let mut s = sched(SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: 7,
        async_depth: 2,
        enable_prefix_caching: false,
        load_failure_policy: LoadFailurePolicy::Recompute,
        mode: Mode::Strict,
        ..SchedulerConfig::default()
    });
    let tokens =
        |s: &Scheduler<ScriptedConnector>, id| s.view().request(rid(id)).unwrap().tokens().len();
    // Request 1 runs ahead of request 2, whose first 8 tokens load synchronously.
    s.add_request(spec(1, 7, 20)).unwrap();
    s.connector_mut().set_lookup(rid(2), hit(8, false));
    s.add_request(spec(2, 12, 20)).unwrap();
    let zero = schedule(&mut s); // 1: 7 tokens, 2 blocks; 2: 4 tokens, 3 blocks
    let one = schedule(&mut s); // 1 decodes slot 7; 2 decodes slot 12 (a 4th block): pool full
    assert_eq!(s.block_pool().num_free(), 0);
    let loaded = s.view().request(rid(2)).unwrap().block_ids(0)[0];
    apply(
        &mut s,
        zero.step,
        Some(AggregatedOutput {
            invalid_block_ids: SortedSet::from_vec(vec![loaded]),
            ..empty_aggregated()
        }),
    );
    // Strict rolls request 2 back to 0 computed tokens and drops step 1's output for it.
    assert_eq!(computed(&s, 2), 0);
    assert_eq!(tokens(&s, 2), 12);
    // Request 1 needs a 3rd block for slot 8: request 2 is preempted, step 1 still in flight.
    let two = schedule(&mut s);
    assert_eq!(two.preempted_req_ids.as_slice(), &[rid(2)]);
    apply(&mut s, one.step, None);
    assert_eq!(tokens(&s, 1), 9);
    assert_eq!(
        tokens(&s, 2),
        12,
        "step 1's output for request 2 is still dropped"
    );
    // Request 2 comes back (no lookup hit now) and its prefill is in flight when it needs a
    // 4th block for slot 12 and preempts itself.
    s.connector_mut().set_lookup(rid(2), Lookup::MISS);
    let three = schedule(&mut s);
    assert_eq!(three.num_scheduled_tokens, vec![(rid(1), 1), (rid(2), 12)]);
    apply(&mut s, two.step, None);
    let four = schedule(&mut s);
    assert_eq!(four.preempted_req_ids.as_slice(), &[rid(2)]);
    apply(&mut s, three.step, None);
    assert_eq!(
        tokens(&s, 2),
        13,
        "the stale drop drained with step 1: step 3's output is delivered"
    );
    apply(&mut s, four.step, None);
}

/// A preempted request whose in-flight output will be delivered waits for it before it is
/// admitted again (vLLM's "deliverable stale output still in flight"); one whose output is
/// dropped (`requires_kv_delivery`) is admitted at once.
#[test]
fn a_preempted_request_waits_for_its_deliverable_output() {
    // Protects vLLM's re-admission rule for preempted requests: wait for an in-flight output
    // that will be delivered, not for one that is dropped.
    for requires in [true, false] {
        let mut connector = ScriptedConnector::new();
        connector.set_requires_kv_delivery(requires);
        // Three steps in flight, so that a step can be scheduled between the preemption and
        // the arrival of the preempted request's last output.
        let config = SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: 5,
            async_depth: 3,
            enable_prefix_caching: false,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(config, connector).unwrap();
        s.add_request(spec(1, 7, 8)).unwrap();
        s.add_request(spec(2, 7, 8)).unwrap();
        let one = schedule(&mut s); // both prefill: all 4 blocks
        let two = schedule(&mut s); // both decode slot 7
        let three = schedule(&mut s); // request 1 needs a 3rd block: request 2 is preempted
        assert_eq!(three.preempted_req_ids.as_slice(), &[rid(2)]);
        apply(&mut s, one.step, None);
        // Request 1 goes away: request 2 would fit, but step 2's output for it is in flight.
        assert_eq!(s.abort(rid(1)), Ok(true));
        check(&s);
        let four = schedule(&mut s);
        let want: &[(RequestId, u32)] = if requires { &[(rid(2), 7)] } else { &[] };
        assert_eq!(
            four.num_scheduled_tokens, want,
            "requires_kv_delivery = {requires}"
        );
        apply(&mut s, two.step, None);
        if !requires {
            assert_eq!(s.view().request(rid(2)).unwrap().tokens().len(), 9);
            apply(&mut s, three.step, None);
            let five = schedule(&mut s);
            assert_eq!(five.num_scheduled_tokens, vec![(rid(2), 9)]);
        }
    }
}

/// §7.3: a pin must name a pool block that is owned or holds cached KV; anything else is a
/// sticky `intent_rejected`.
#[test]
fn pins_need_an_owned_or_cached_pool_block() {
    // Protects the validation of pin intents (§7.3) on invalid pins as well as valid ones: the
    // null block, a block never used, a block out of range.
    use kvrelay_core::Intent;
    // Request 1 (20 tokens, block size 16) is running: block 0 is full and cached, block 1 is
    // owned but not full (uncached); block 60 has never been used.
    let running = || {
        let mut s = sched(SchedulerConfig::default());
        s.add_request(spec(1, 20, 16)).unwrap();
        step(&mut s, None);
        let blocks = s.view().request(rid(1)).unwrap().block_ids(0).to_vec();
        (s, blocks)
    };
    let (mut s, blocks) = running();
    s.connector_mut()
        .push_intent(Intent::Pin(vec![blocks[0], blocks[1]]));
    step(&mut s, None);
    assert_eq!(
        s.view().block_ref_cnt(blocks[1]),
        Some(2),
        "owned, uncached: pinned"
    );
    // Pins count: pinned twice, unpinned once, the block is still pinned once.
    s.connector_mut().push_intent(Intent::Pin(vec![blocks[1]]));
    step(&mut s, None);
    s.connector_mut()
        .push_intent(Intent::Unpin(vec![blocks[1]]));
    step(&mut s, None);
    assert_eq!(s.view().block_ref_cnt(blocks[1]), Some(2));
    s.connector_mut()
        .push_intent(Intent::Unpin(vec![blocks[1]]));
    step(&mut s, None);
    assert_eq!(
        s.view().block_ref_cnt(blocks[1]),
        Some(1),
        "only the request owns it"
    );
    for bad in [BlockId(0), BlockId(60), BlockId(10_000)] {
        let (mut s, _) = running();
        s.connector_mut().push_intent(Intent::Pin(vec![bad]));
        let e = s.schedule().unwrap_err();
        assert_eq!(e.kind(), "intent_rejected", "pin of {bad:?}");
        assert_eq!(s.schedule().unwrap_err(), e, "sticky");
    }
}

/// A failed async load recomputed from scratch at the head of `kv_holding_waiting` (vLLM 0.33.0,
/// reproduced by compat): it gives its blocks back on promotion but stays at the head; its
/// recompute (a sliding window needs every block of a fresh prefill, fewer for a load) does not
/// fit beside the finished load behind it, so the loop stops there, the load behind it is never
/// promoted and nothing ever runs again. Strict moves the freed request to the waiting queue.
fn head_of_line_after_failed_load(mode: Mode) -> Scheduler<ScriptedConnector> {
    let mut s = sched(SchedulerConfig {
        block_size: 8,
        num_gpu_blocks: 23,
        groups: vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 11 },
        ],
        max_num_batched_tokens: 84,
        max_model_len: 84,
        enable_prefix_caching: false,
        enable_chunked_prefill: false,
        load_failure_policy: LoadFailurePolicy::Recompute,
        mode,
        ..SchedulerConfig::default()
    });
    s.connector_mut().set_lookup(rid(1), hit(64, true));
    s.connector_mut().set_lookup(rid(2), hit(24, true));
    s.add_request(spec(1, 65, 1)).unwrap();
    s.add_request(spec(2, 25, 1)).unwrap();
    let out = schedule(&mut s);
    assert!(out.num_scheduled_tokens.is_empty());
    // Request 1: 8 full + 2 window blocks; request 2: 3 + 2.
    assert_eq!(s.block_pool().num_free(), 22 - 15);
    apply(
        &mut s,
        out.step,
        Some(AggregatedOutput {
            failed_recving: SortedSet::from_vec(vec![rid(1)]),
            ..recv(&[1, 2])
        }),
    );
    s.connector_mut().set_lookup(rid(1), Lookup::MISS);
    s
}

#[test]
fn compat_failed_load_at_the_head_blocks_the_loads_behind_it() {
    let mut s = head_of_line_after_failed_load(Mode::Compat);
    for _ in 0..5 {
        let out = schedule(&mut s);
        assert!(out.num_scheduled_tokens.is_empty(), "{out:?}");
        apply(&mut s, out.step, None);
    }
    // Request 1 gave its blocks back and needs 9 + 9; request 2 keeps its 5.
    assert_eq!(s.status(rid(1)), Some(RequestStatus::Waiting));
    assert_eq!(s.status(rid(2)), Some(RequestStatus::WaitingForRemoteKvs));
    assert_eq!(s.block_pool().num_free(), 22 - 5);
}

#[test]
fn strict_failed_load_at_the_head_moves_to_the_waiting_queue() {
    let mut s = head_of_line_after_failed_load(Mode::Strict);
    let out = schedule(&mut s);
    // Request 2 is promoted and computes its last token; request 1 waits for a later step.
    assert_eq!(out.num_scheduled_tokens, vec![(rid(2), 1)]);
    apply(&mut s, out.step, None);
    assert_eq!(s.status(rid(2)), None);
    let out = schedule(&mut s);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(1), 65)]);
    apply(&mut s, out.step, None);
    assert_drained(&mut s);
    assert_eq!(s.block_pool().num_free(), 22);
}
