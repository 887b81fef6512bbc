//! The CPU offloading manager (SEMANTICS.md §5.3, I-40): one contract suite run over both
//! policies, with `check_invariants()` after every call.

use kvrelay_core::{
    Access, BlockHash, CpuOffloadingManager, KeyLookup, ManagerConfig, ManagerError, OffloadKey,
    PolicyKind,
};

fn k(n: u64) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(n),
        group: 0,
    }
}

fn manager(policy: PolicyKind, capacity_chunks: u32, store_threshold: u32) -> CpuOffloadingManager {
    CpuOffloadingManager::new(ManagerConfig {
        capacity_chunks,
        policy,
        store_threshold,
    })
    .expect("a valid config")
}

fn ok(m: &CpuOffloadingManager) {
    m.check_invariants().expect("I-40 holds");
}

const POLICIES: [PolicyKind; 2] = [PolicyKind::Lru, PolicyKind::Arc];

#[test]
fn zero_capacity_is_a_typed_error() {
    let e = CpuOffloadingManager::new(ManagerConfig {
        capacity_chunks: 0,
        policy: PolicyKind::Lru,
        store_threshold: 1,
    })
    .unwrap_err();
    assert_eq!(e.kind(), "bad_config");
}

#[test]
fn store_then_load_lifecycle() {
    for p in POLICIES {
        let mut m = manager(p, 4, 1);
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
        let mut m = manager(p, 3, 1);
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
        let mut m = manager(p, 4, 2);
        let first = m.prepare_store(&[k(1)], Access::default()).unwrap();
        assert!(first.keys_to_store.is_empty());
        let second = m.prepare_store(&[k(1)], Access::default()).unwrap();
        assert_eq!(second.keys_to_store, vec![k(1)]);
        ok(&m);
    }
}

#[test]
fn reset_forgets_everything() {
    for p in POLICIES {
        let mut m = manager(p, 2, 1);
        m.prepare_store(&[k(1), k(2)], Access::default()).unwrap();
        m.complete_store(&[k(1)], true);
        m.reset();
        ok(&m);
        assert_eq!(m.lookup(k(1)), KeyLookup::Miss);
        assert_eq!(m.num_free_chunks(), 2);
        assert!(m.take_events().is_empty());
    }
}
