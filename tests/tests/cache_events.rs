//! Structured KV cache events of the GPU block pool (vLLM 0.33.0's `BlockPool`:
//! `cache_full_blocks`, `_maybe_evict_cached_block`, `reset_prefix_cache`, `take_events`) through
//! the scheduler with the scripted connector, and the GPU prefix-cache reset.
//! `check_invariants()` runs after every call (the `drive` helpers).
//!
//! The pool has block size 4 and 7 usable blocks, so a scenario can name which block is reused.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use kvrelay_core::{
    BlockHash, CacheEvent, GroupKind, Medium, Scheduler, SchedulerConfig, ScriptedConnector, Token,
    hash_block,
};
use kvrelay_tests::build::{rid, spec_with};
use kvrelay_tests::drive::{check, step};

const BS: u32 = 4;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: BS,
        num_gpu_blocks: 8,
        max_model_len: 64,
        ..SchedulerConfig::default()
    }
}

fn sched(config: SchedulerConfig, events: bool) -> Scheduler<ScriptedConnector> {
    let mut s = Scheduler::new(config, ScriptedConnector::new()).unwrap();
    if events {
        s.set_cache_events(true);
    }
    s
}

/// A `len`-token prompt of its own for `seed`.
fn prompt(seed: u32, len: u32) -> Vec<Token> {
    (0..len).map(|i| 1000 * seed + i + 1).collect()
}

/// The chained hashes of the full blocks of `tokens`, as the scheduler computes them.
fn chain(tokens: &[Token]) -> Vec<BlockHash> {
    let mut parent = None;
    tokens
        .chunks_exact(BS as usize)
        .map(|b| {
            let h = hash_block(parent, b);
            parent = Some(h);
            h
        })
        .collect()
}

fn stored(
    group: u32,
    hashes: &[BlockHash],
    parent: Option<BlockHash>,
    tokens: &[Token],
) -> CacheEvent {
    CacheEvent::Stored {
        medium: Medium::Gpu,
        group,
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.to_vec(),
        block_size: BS,
    }
}

fn removed(hash: BlockHash) -> CacheEvent {
    CacheEvent::Removed {
        medium: Medium::Gpu,
        group: 0,
        hashes: vec![hash],
    }
}

/// Runs request `id` (prompt `p`, one output token) to its end in one step.
fn run(s: &mut Scheduler<ScriptedConnector>, id: u32, p: &[Token]) {
    s.add_request(spec_with(id, p.to_vec(), 1)).unwrap();
    let (_, res) = step(s, None);
    assert!(
        res.outputs
            .iter()
            .any(|o| o.id == rid(id) && o.finish.is_some())
    );
}

/// A scheduler with events on after request 1 (a 10-token prompt of its own) ran to its end:
/// the scheduler, the prompt and its block hashes.
fn after_request_1() -> (Scheduler<ScriptedConnector>, Vec<Token>, Vec<BlockHash>) {
    let mut s = sched(config(), true);
    let p1 = prompt(1, 10);
    run(&mut s, 1, &p1);
    let h1 = chain(&p1);
    (s, p1, h1)
}

#[test]
fn a_request_s_new_full_blocks_are_one_stored_event_and_a_prefix_hit_chains_on_it() {
    // Protects `cache_full_blocks`' event: one `BlockStored` per call and group, with the
    // hashes of the newly cached blocks, the parent of the first one and their tokens; a
    // request resuming a cached prefix reports only its own blocks, chained on the hit's last.
    let (mut s, p1, h1) = after_request_1();
    // Two full blocks of 10 tokens (the sampled token makes 11: still two).
    assert_eq!(
        s.take_cache_events(),
        vec![stored(0, &h1[..2], None, &p1[..8])]
    );
    assert!(s.take_cache_events().is_empty(), "drained");
    // Request 2 shares p1's two blocks and adds two of its own.
    let mut p2 = p1[..8].to_vec();
    p2.extend(prompt(2, 8));
    let h2 = chain(&p2);
    assert_eq!(h2[..2], h1[..2]);
    s.add_request(spec_with(2, p2.clone(), 1)).unwrap();
    let (out, _) = step(&mut s, None);
    assert_eq!(
        out.num_scheduled_tokens,
        vec![(rid(2), 8)],
        "an 8-token hit"
    );
    assert_eq!(
        s.take_cache_events(),
        vec![stored(0, &h2[2..4], Some(h1[1]), &p2[8..16])]
    );
}

#[test]
fn eviction_under_pressure_removes_exactly_the_reused_blocks_hashes() {
    // Protects `_maybe_evict_cached_block`: a cached block handed out again reports one
    // `BlockRemoved` per hash it loses, before the new owner's blocks are stored; the cached
    // blocks it did not need keep their keys and report nothing.
    let (mut s, _, h1) = after_request_1();
    s.take_cache_events();
    // Request 1 held blocks 1, 2 (cached) and 3; freed tail first, the free queue is
    // [3, 4, 5, 6, 7, 2, 1]: 6 blocks reuse block 2 (hash h1[1]) and leave block 1.
    let p3 = prompt(3, 24);
    run(&mut s, 3, &p3);
    assert_eq!(
        s.take_cache_events(),
        vec![removed(h1[1]), stored(0, &chain(&p3), None, &p3)]
    );
    assert!(s.block_pool().get_cached(h1[0], 0).is_some());
    assert!(s.block_pool().get_cached(h1[1], 0).is_none());
}

#[test]
fn the_prefix_cache_resets_only_with_every_block_free() {
    // Protects vLLM's `reset_prefix_cache`: refused (no event, keys kept) while a block is in
    // use; once all are free every key goes, `AllBlocksCleared` is the one event, the free
    // queue keeps its order, and the same prompt then misses the prefix cache.
    let mut s = sched(config(), true);
    let p1 = prompt(1, 10);
    let h1 = chain(&p1);
    s.add_request(spec_with(1, p1.clone(), 10)).unwrap();
    step(&mut s, None);
    s.take_cache_events();
    assert_eq!(s.reset_prefix_cache(false), Ok(false));
    check(&s);
    assert!(s.take_cache_events().is_empty());
    assert!(s.block_pool().get_cached(h1[0], 0).is_some());
    assert!(s.abort(rid(1)).unwrap());
    let queue = s.block_pool().free_queue();
    assert_eq!(s.reset_prefix_cache(false), Ok(true));
    check(&s);
    assert_eq!(s.take_cache_events(), vec![CacheEvent::AllCleared]);
    assert_eq!(s.block_pool().num_cached(), 0);
    assert_eq!(s.block_pool().free_queue(), queue);
    // The same prompt again: no hit, all 10 tokens computed, its blocks stored from the start.
    s.add_request(spec_with(2, p1.clone(), 1)).unwrap();
    let (out, _) = step(&mut s, None);
    assert_eq!(out.num_scheduled_tokens, vec![(rid(2), 10)]);
    assert_eq!(
        s.take_cache_events(),
        vec![stored(0, &h1[..2], None, &p1[..8])]
    );
}

#[test]
fn a_group_that_caches_nothing_still_reports_its_stored_event() {
    // Protects the match with vLLM's `cache_full_blocks` under `block_mask`: a sliding window of
    // one token reaches no block, caches none, and still appends a `BlockStored` with no
    // hashes (and the range's tokens).
    let cfg = SchedulerConfig {
        groups: vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 1 },
        ],
        num_gpu_blocks: 16,
        ..config()
    };
    let mut s = sched(cfg, true);
    let p = prompt(1, 10);
    let h = chain(&p);
    run(&mut s, 1, &p);
    assert_eq!(
        s.take_cache_events(),
        vec![
            stored(0, &h[..2], None, &p[..8]),
            stored(1, &[], None, &p[..8]),
        ]
    );
    assert!(s.block_pool().get_cached(h[0], 1).is_none());
}

fn hash_of<T: Hash>(x: &T) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

#[test]
fn with_events_off_nothing_is_kept_and_the_state_is_unchanged() {
    // Protects `enable_kv_cache_events = False` (the default): no event is kept, and the
    // scheduler is equal (and hashes equal, for the model checker) to one that never had the
    // switch, also after events were on for a while.
    let workload = |s: &mut Scheduler<ScriptedConnector>| {
        run(s, 1, &prompt(1, 10));
        run(s, 3, &prompt(3, 24));
    };
    let mut plain = sched(config(), false);
    let mut off = sched(config(), false);
    off.set_cache_events(false);
    let mut toggled = sched(config(), true);
    workload(&mut plain);
    workload(&mut off);
    run(&mut toggled, 1, &prompt(1, 10));
    assert!(!toggled.take_cache_events().is_empty());
    run(&mut toggled, 3, &prompt(3, 24));
    toggled.set_cache_events(false);
    check(&toggled);
    assert!(off.take_cache_events().is_empty());
    assert!(toggled.take_cache_events().is_empty());
    assert!(plain == off && plain == toggled);
    assert_eq!(hash_of(&plain), hash_of(&toggled));
    // The reset behaves the same with events off, without an event.
    assert_eq!(plain.reset_prefix_cache(false), Ok(true));
    assert!(plain.take_cache_events().is_empty());
    assert_eq!(plain.block_pool().num_cached(), 0);
}
