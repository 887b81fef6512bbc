//! Unit tests of the scheduler's private parts (hits, the invariant checker).

use super::*;
use crate::ScriptedConnector;

/// Request `id` with `prompt`, 4 output tokens at most.
fn request(id: u32, prompt: Vec<Token>) -> RequestSpec {
    RequestSpec {
        id: RequestId(id),
        prompt,
        max_tokens: 4,
        stop_token: None,
        kv_transfer_params: None,
    }
}

/// Two requests scheduled in one step (both running, holding blocks; the step in flight).
fn two_running() -> Scheduler<ScriptedConnector> {
    let mut s = Scheduler::new(SchedulerConfig::default(), ScriptedConnector::new())
        .expect("the default config is valid");
    for id in [1, 2] {
        s.add_request(request(id, (0..20).map(|t| 100 * id + t).collect()))
            .expect("a new request");
    }
    s.schedule().expect("room for both");
    s.check_invariants().expect("a healthy scheduler");
    s
}

/// A scheduler with block size 4, groups `[full attention, sliding window of `window`
/// tokens]`, prefix caching on, and request 1 (33 tokens: 8 full blocks) waiting. Blocks
/// `full` of its prompt are cached in group 0 and `sliding` in group 1 (block indices),
/// each in a block of its own.
fn cached(
    window: u32,
    full: &[usize],
    sliding: &[usize],
) -> (Scheduler<ScriptedConnector>, Request) {
    let config = SchedulerConfig {
        block_size: 4,
        groups: alloc::vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window }
        ],
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(config, ScriptedConnector::new()).expect("a valid config");
    s.add_request(request(1, (1..=33).collect()))
        .expect("a new request");
    let r = s.state.requests[&RequestId(1)].clone();
    assert_eq!(r.block_hashes.len(), 8);
    for (group, indices) in [(0u8, full), (1, sliding)] {
        for &i in indices {
            let b = s.state.pool.get_new_blocks(1).expect("a free block")[0];
            s.state.pool.cache_block(b, r.block_hashes[i], group);
        }
    }
    (s, r)
}

/// The block cached for prompt block `i` in `group`, or the null block.
fn at(s: &Scheduler<ScriptedConnector>, r: &Request, group: u8, i: usize) -> BlockId {
    s.state
        .pool
        .get_cached(r.block_hashes[i], group)
        .unwrap_or(NULL_BLOCK)
}

#[test]
fn a_sliding_window_hit_is_the_last_run_of_window_blocks() {
    // vLLM's `SlidingWindowManager.find_longest_cache_hit`: scanning back from the longest
    // prefix, the first run of `cdiv(window - 1, block_size)` cached blocks ends the hit;
    // blocks before the run are null. Protects the sliding-window hit on a cache with holes.
    let n = NULL_BLOCK;
    // Window 8 = a run of 2 blocks: blocks 4 and 5 (6 and 7 are not cached).
    let (s, r) = cached(8, &[], &[0, 1, 2, 4, 5]);
    let want = alloc::vec![n, n, n, n, at(&s, &r, 1, 4), at(&s, &r, 1, 5)];
    assert_eq!(s.state.group_hit(&r, 1, 32), want);
    // Window 5 = a run of 1 block: block 5 alone; nothing before it is scanned.
    let (s, r) = cached(5, &[], &[0, 1, 2, 3, 5]);
    let mut want = alloc::vec![n; 5];
    want.push(at(&s, &r, 1, 5));
    assert_eq!(s.state.group_hit(&r, 1, 32), want);
    // Window 16 = a run of 4 blocks, never found: the leading run of 3 is the hit.
    let (s, r) = cached(16, &[], &[0, 1, 2, 5, 6, 7]);
    let want: Vec<BlockId> = (0..3).map(|i| at(&s, &r, 1, i)).collect();
    assert_eq!(s.state.group_hit(&r, 1, 32), want);
    // The bound: at most `max_len` tokens (20 = 5 blocks: the run 3, 4).
    let (s, r) = cached(8, &[], &[0, 3, 4, 6, 7]);
    let want = alloc::vec![n, n, n, at(&s, &r, 1, 3), at(&s, &r, 1, 4)];
    assert_eq!(s.state.group_hit(&r, 1, 20), want);
}

#[test]
fn a_hybrid_hit_is_the_longest_length_every_group_hits() {
    // Full attention hits 6 blocks; the sliding window (a run of 2) hits 8 blocks at length
    // 32, but only 4 once the length is cut to the full group's 24: the hit converges at 16.
    let (mut s, r) = cached(8, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3, 6, 7]);
    let (hits, tokens) = s.state.local_hit(&r);
    assert_eq!(tokens, 16);
    let full: Vec<BlockId> = (0..4).map(|i| at(&s, &r, 0, i)).collect();
    let sliding = alloc::vec![NULL_BLOCK, NULL_BLOCK, at(&s, &r, 1, 2), at(&s, &r, 1, 3)];
    assert_eq!(hits, alloc::vec![full, sliding]);
    // What the offloading connector sees: each group's own hit at the longest length.
    assert_eq!(
        s.view().prefix_cache_hits(RequestId(1)),
        alloc::vec![24, 32]
    );
    // Without prefix caching nothing is looked up.
    s.state.config.enable_prefix_caching = false;
    assert_eq!(
        s.state.local_hit(&r),
        (alloc::vec![Vec::new(), Vec::new()], 0)
    );
}

fn r1(st: &mut State) -> &mut Request {
    st.requests
        .get_mut(&RequestId(1))
        .expect("request 1 is held")
}

#[test]
fn check_invariants_reports_a_corrupt_scheduler() {
    // No test outside this module can corrupt the scheduler, so without these the checks
    // could be replaced by `Ok(())` and every suite would still pass.
    type Corrupt = fn(&mut State);
    let corruptions: [(&str, &str, Corrupt); 11] = [
        (
            "I-16",
            "a running request missing from the running queue",
            |st| {
                st.running.retain(|id| *id != RequestId(1));
            },
        ),
        ("I-16", "a request queued twice", |st| {
            st.waiting.push_back(RequestId(1));
        }),
        (
            "I-16",
            "a queue naming a request the scheduler does not hold",
            |st| {
                st.waiting.push_back(RequestId(7));
            },
        ),
        ("I-20", "a connector pin the pool does not count", |st| {
            let b = r1(st).blocks[0][0];
            st.pins.insert(b, 1);
        }),
        ("I-15", "a live request held for the connector", |st| {
            r1(st).held_for_send = true;
        }),
        ("I-14", "a finished request held for no transfer", |st| {
            r1(st).status = RequestStatus::FinishedAborted;
        }),
        (
            "I-18",
            "a loading request outside kv_holding_waiting",
            |st| {
                r1(st).status = RequestStatus::WaitingForRemoteKvs;
            },
        ),
        ("I-20", "a preempted request holding blocks", |st| {
            let r = r1(st);
            r.status = RequestStatus::Preempted;
            r.num_computed_tokens = 0;
        }),
        ("I-20", "more running requests than max_num_seqs", |st| {
            st.config.max_num_seqs = 1;
        }),
        ("I-12", "more steps in flight than the async depth", |st| {
            st.config.async_depth = 0;
        }),
        (
            "I-18",
            "a loaded mark on a request that is not loading",
            |st| {
                st.finished_recving_kv_req_ids.insert(RequestId(1));
            },
        ),
    ];
    for (id, what, corrupt) in corruptions {
        let mut s = two_running();
        corrupt(&mut s.state);
        let err = s.check_invariants().expect_err(what);
        assert_eq!(err.id, id, "{what}: {}", err.detail);
    }
}
