//! The CPU offloading manager (SEMANTICS.md §5.3, I-40): one contract suite run over both
//! policies, with `check_invariants()` after every call.

use kvrelay_core::{
    Access, BlockHash, CpuOffloadingManager, KeyLookup, ManagerConfig, ManagerError, OffloadEvent,
    OffloadKey, PolicyKind, RequestId,
};
use kvrelay_tests::build::cpu_manager;

fn k(n: u64) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(n),
        group: 0,
    }
}

fn ok(m: &CpuOffloadingManager) {
    m.check_invariants().expect("I-40 holds");
}

const POLICIES: [PolicyKind; 2] = [PolicyKind::Lru, PolicyKind::Arc];

// Protects the config check: a pool the arena cannot address is a typed error, not a panic.
#[test]
fn a_pool_beyond_the_arena_is_a_typed_error() {
    let e = CpuOffloadingManager::new(ManagerConfig {
        capacity_chunks: u32::MAX / 2,
        policy: PolicyKind::Arc,
        store_threshold: 1,
    })
    .unwrap_err();
    assert_eq!(e.kind(), "bad_config");
}

// Protects vLLM's empty pool (its CPU spec builds one when a chunk does not fit): every store
// is refused, lookups miss, and the invariants hold.
#[test]
fn an_empty_pool_refuses_every_store() {
    for p in POLICIES {
        let mut m = cpu_manager(p, 0, 1);
        assert!(m.prepare_store(&[k(1), k(2)], Access::default()).is_none());
        assert_eq!(m.lookup(k(1)), KeyLookup::Miss);
        assert_eq!(m.num_free_chunks(), 0);
        m.complete_store(&[k(1)], true);
        ok(&m);
    }
}

#[test]
fn store_then_load_lifecycle() {
    for p in POLICIES {
        let mut m = cpu_manager(p, 4, 1);
        let out = m.prepare_store(&[k(1), k(2)], Access::default()).unwrap();
        ok(&m);
        assert_eq!(out.keys_to_store, vec![k(1), k(2)]);
        assert_eq!(out.chunks.len(), 2);
        assert_eq!(m.lookup(k(1)), KeyLookup::HitPending);
        assert_eq!(m.num_write_pending(), 2);
        assert_eq!(
            m.prepare_load(&[k(1)], Access::default()),
            Err(ManagerError::NotLoadable(k(1)))
        );
        m.complete_store(&[k(1), k(2)], true);
        ok(&m);
        assert_eq!(m.lookup(k(1)), KeyLookup::Hit);
        assert_eq!(m.num_evictable(), 2);
        let chunks = m.prepare_load(&[k(1)], Access::default()).unwrap();
        assert_eq!(chunks, vec![out.chunks[0]]);
        assert_eq!(m.num_evictable(), 1);
        ok(&m);
        m.complete_load(&[k(1)]).unwrap();
        assert_eq!(m.complete_load(&[k(1)]), Err(ManagerError::NotPinned(k(1))));
        ok(&m);
        assert!(!m.has_pending_work());
    }
}

#[test]
fn eviction_is_atomic_and_skips_pinned_and_offered_keys() {
    for p in POLICIES {
        let mut m = cpu_manager(p, 3, 1);
        m.prepare_store(&[k(1), k(2), k(3)], Access::default())
            .unwrap();
        m.complete_store(&[k(1), k(2), k(3)], true);
        m.prepare_load(&[k(3)], Access::default()).unwrap();
        let _ = m.take_events();
        assert!(
            m.prepare_store(&[k(1), k(4), k(5)], Access::default())
                .is_none()
        );
        ok(&m);
        assert!(m.take_events().is_empty());
        assert_eq!(m.num_free_chunks(), 0);
        let out = m.prepare_store(&[k(4)], Access::default()).unwrap();
        assert_eq!(out.evicted, vec![k(1)]);
        ok(&m);
        m.complete_store(&[k(4)], false);
        assert_eq!(m.lookup(k(4)), KeyLookup::Miss);
        let events = m.take_events();
        assert_eq!(events.len(), 2);
        assert!(events.iter().all(|e| e.removed));
        ok(&m);
    }
}

#[test]
fn store_threshold_admits_on_the_nth_offer() {
    for p in POLICIES {
        let mut m = cpu_manager(p, 4, 2);
        let first = m.prepare_store(&[k(1)], Access::default()).unwrap();
        assert!(first.keys_to_store.is_empty());
        let second = m.prepare_store(&[k(1)], Access::default()).unwrap();
        assert_eq!(second.keys_to_store, vec![k(1)]);
        ok(&m);
    }
}

/// A key offered twice in one call is stored once, in first-offer order. (vLLM would reserve a
/// chunk per copy and leak all but the last; the connector never offers a key twice.)
#[test]
fn a_key_offered_twice_in_one_call_is_stored_once() {
    // Protects I-40 on an offer with repeats: one chunk per distinct key, so
    // `write_pending_count` counts the distinct keys and no chunk is left allocated to nothing.
    for p in POLICIES {
        let mut m = cpu_manager(p, 4, 1);
        let same = m.prepare_store(&[k(1), k(1)], Access::default()).unwrap();
        assert_eq!(same.keys_to_store, vec![k(1)]);
        assert_eq!(same.chunks.len(), 1);
        let mixed = m
            .prepare_store(&[k(2), k(3), k(2)], Access::default())
            .unwrap();
        assert_eq!(mixed.keys_to_store, vec![k(2), k(3)]);
        assert_eq!(mixed.chunks.len(), 2);
        assert_eq!((m.num_write_pending(), m.num_free_chunks()), (3, 1));
        ok(&m);
        m.complete_store(&[k(1), k(2), k(3)], true);
        assert_eq!(m.num_evictable(), 3);
        ok(&m);
    }
}

#[test]
fn reset_forgets_everything() {
    for p in POLICIES {
        let mut m = cpu_manager(p, 2, 1);
        m.prepare_store(&[k(1), k(2)], Access::default()).unwrap();
        m.complete_store(&[k(1)], true);
        m.reset();
        ok(&m);
        assert_eq!(m.lookup(k(1)), KeyLookup::Miss);
        assert_eq!(m.num_free_chunks(), 2);
        // As vLLM: a reset clears chunks and the policy, not the events not yet drained.
        assert_eq!(
            m.take_events(),
            vec![OffloadEvent {
                keys: vec![k(1)],
                removed: false
            }]
        );
    }
}

fn stored(m: &mut CpuOffloadingManager, keys: &[OffloadKey], access: Access<'_>) {
    let out = m.prepare_store(keys, access).unwrap();
    m.complete_store(&out.keys_to_store, true);
    ok(m);
}

/// LRU with positions: a request's keys get the provisional rank `(request, −position)`, so its
/// tail is evicted before its head, and an earlier request before a later one; finishing the
/// request commits fresh ranks tail to head (the head ends most recent).
#[test]
fn lru_request_ranks_evict_tails_first_and_commit_at_finish() {
    let mut m = cpu_manager(PolicyKind::Lru, 4, 1);
    let r = RequestId(7);
    let access = |pos: &'static [u32]| Access {
        request: Some(r),
        positions: Some(pos),
    };
    stored(&mut m, &[k(1), k(2), k(3)], access(&[12, 24, 36]));
    stored(&mut m, &[k(9)], Access::default());
    // Provisional: k3 (tail) < k2 < k1 < k9 (a later global rank).
    let out = m.prepare_store(&[k(4), k(5)], Access::default()).unwrap();
    assert_eq!(out.evicted, vec![k(3), k(2)]);
    ok(&m);
    m.complete_store(&[k(4), k(5)], true);
    // Finishing commits k1 with a fresh global rank: now k9 is the oldest.
    m.on_request_finished(r);
    let out = m.prepare_store(&[k(6)], Access::default()).unwrap();
    assert_eq!(out.evicted, vec![k(9)]);
    ok(&m);
}

/// ARC: new keys enter T1; a request reusing a ready key promotes it to T2 at finish; eviction
/// takes from T1 while it is at least the target, and evicted keys become ghosts whose later
/// store miss grows the T1 target.
#[test]
fn arc_promotes_reused_keys_and_adapts_to_ghost_hits() {
    let mut m = cpu_manager(PolicyKind::Arc, 2, 1);
    stored(&mut m, &[k(1), k(2)], Access::default());
    let r = RequestId(1);
    let access = Access {
        request: Some(r),
        positions: None,
    };
    m.prepare_load(&[k(1)], access).unwrap();
    m.complete_load(&[k(1)]).unwrap();
    m.on_request_finished(r);
    // T1 = [k2], T2 = [k1], target 0: T1 is evicted first.
    let out = m.prepare_store(&[k(3)], Access::default()).unwrap();
    assert_eq!(out.evicted, vec![k(2)]);
    m.complete_store(&[k(3)], true);
    ok(&m);
    // k2 is a B1 ghost: its store miss raises the target to 1, so T1 (= [k3], size 1 ≥ 1)
    // still gives the victim.
    let out = m.prepare_store(&[k(2)], Access::default()).unwrap();
    assert_eq!(out.evicted, vec![k(3)]);
    m.complete_store(&[k(2)], true);
    ok(&m);
    // T1 = [k2], target 1, then k4: T1 size 1 ≥ 1 → k2 again; T2's k1 survives throughout.
    let out = m.prepare_store(&[k(4)], Access::default()).unwrap();
    assert_eq!(out.evicted, vec![k(2)]);
    assert_eq!(m.lookup(k(1)), KeyLookup::Hit);
    ok(&m);
}

/// ARC: touching a ready T1 key promotes it; touching a write-pending one keeps it in T1.
#[test]
fn arc_touch_promotes_only_ready_keys() {
    let mut m = cpu_manager(PolicyKind::Arc, 2, 1);
    stored(&mut m, &[k(1)], Access::default());
    m.prepare_store(&[k(2)], Access::default()).unwrap();
    m.touch(&[k(1), k(2)], Access::default());
    m.complete_store(&[k(2)], true);
    // T1 = [k2], T2 = [k1]: target 0 → evict from T1.
    let out = m.prepare_store(&[k(3)], Access::default()).unwrap();
    assert_eq!(out.evicted, vec![k(2)]);
    ok(&m);
}

#[test]
fn hundreds_of_keys_survive_the_index_growing_and_evictions() {
    // The key index grows at half load (64, 128, 256, 512 entries): every stored key must
    // still be found after each growth, and evicted ones must be gone. Batches of 50 keys
    // (hashes spread over a wide range) in a 300-chunk pool: the fourth… seventh batches evict.
    for p in POLICIES {
        let mut m = cpu_manager(p, 300, 1);
        let key = |i: u64| k(i.wrapping_mul(0x9E37_79B9) ^ (i << 40));
        for batch in 0..7u64 {
            let keys: Vec<_> = (batch * 50..batch * 50 + 50).map(key).collect();
            let out = m.prepare_store(&keys, Access::default()).expect("room");
            assert_eq!(out.keys_to_store, keys, "{p:?} batch {batch}");
            m.complete_store(&keys, true);
            ok(&m);
            let hits = (0..batch * 50 + 50)
                .filter(|&i| m.lookup(key(i)) == KeyLookup::Hit)
                .count();
            assert_eq!(
                hits,
                (batch as usize * 50 + 50).min(300),
                "{p:?} batch {batch}"
            );
        }
        // The newest 300 keys are the ones kept.
        assert!(
            (50..350).all(|i| m.lookup(key(i)) == KeyLookup::Hit),
            "{p:?}"
        );
        assert_eq!(m.lookup(key(0)), KeyLookup::Miss, "{p:?}");
    }
}

#[test]
fn a_full_offer_tracker_forgets_its_oldest_unprotected_key() {
    // `store_threshold` counts offers in a tracker of at most 64,000 keys. When it is full, a new
    // key replaces the least recently offered key that is not part of the same offer; when every
    // tracked key is part of the offer, new keys are not tracked at all.
    const N: u64 = 64_000;
    let offer = |m: &mut CpuOffloadingManager, keys: &[OffloadKey]| -> Vec<OffloadKey> {
        m.prepare_store(keys, Access::default())
            .map(|o| o.keys_to_store)
            .unwrap_or_default()
    };
    let all: Vec<OffloadKey> = (0..N).map(k).collect();
    // An LRU manager whose tracker is full: every key of `all` offered once, none stored.
    let full = |store_threshold: u32| {
        let mut m = cpu_manager(PolicyKind::Lru, 4, store_threshold);
        assert!(offer(&mut m, &all).is_empty());
        m
    };

    // Full tracker; offering key 0 again (its second offer: stored) with one new key forgets
    // key 1, the oldest key outside the offer.
    let mut m = full(2);
    assert_eq!(offer(&mut m, &[k(0), k(N)]), [k(0)]);
    assert_eq!(
        offer(&mut m, &[k(3)]),
        [k(3)],
        "still tracked: second offer"
    );
    assert!(
        offer(&mut m, &[k(1)]).is_empty(),
        "forgotten: a first offer again"
    );

    // Every tracked key in the offer: the two new keys are not tracked.
    let mut m = full(2);
    let mut with_new = all.clone();
    with_new.extend([k(N), k(N + 1)]);
    offer(&mut m, &with_new);
    assert!(offer(&mut m, &[k(N)]).is_empty(), "was not tracked");

    // One tracked key outside the offer: the first new key replaces it, the second is dropped.
    let mut m = full(2);
    let mut most: Vec<OffloadKey> = (1..N).map(k).collect();
    most.extend([k(N), k(N + 1)]);
    offer(&mut m, &most);
    assert_eq!(offer(&mut m, &[k(N)]), [k(N)], "tracked: second offer");
    assert!(offer(&mut m, &[k(N + 1)]).is_empty(), "dropped");
    ok(&m);

    // Keys offered again move to the recent end in offer order: re-offer 5 then 2, then every
    // other key; a new key then forgets 5 (threshold 3: no key reaches it before the end).
    let mut m = full(3);
    offer(&mut m, &[k(5), k(2)]);
    let others: Vec<OffloadKey> = (0..N).filter(|&i| i != 5 && i != 2).map(k).collect();
    assert!(offer(&mut m, &others).is_empty());
    offer(&mut m, &[k(N)]);
    assert_eq!(offer(&mut m, &[k(2)]), [k(2)], "still tracked: third offer");
    assert!(
        offer(&mut m, &[k(5)]).is_empty(),
        "forgotten: a first offer again"
    );
    ok(&m);
}
