//! Unit tests that reach inside the manager: the list walk the invariants rely on, and I-40 on
//! deliberately corrupted managers. The behaviour is tested from outside, against reference
//! models (`tests/tests/offload_manager*.rs`) and by the conformance cases.

use super::arena::{List, Node, Place};
use super::policy::Policy;
use super::scope::{KeyAccess, RequestAccess};
use super::*;
use crate::BlockHash;

/// Nodes 0, 1, 2 linked in that order.
fn three() -> (List, Vec<Node>) {
    let mut nodes = alloc::vec![Node::FREE; 3];
    let mut list = List::EMPTY;
    for s in 0..3 {
        list.push_back(&mut nodes, s, Place::RankList);
    }
    (list, nodes)
}

#[test]
fn collect_walks_a_list_and_rejects_broken_links() {
    // Protects I-40's list walk: a broken link is reported, not followed.
    let (list, nodes) = three();
    assert_eq!(list.collect(&nodes), Some(alloc::vec![0, 1, 2]));
    // A back link that does not point at the predecessor.
    let mut bad_prev = nodes.clone();
    bad_prev[2].prev = 0;
    assert_eq!(list.collect(&bad_prev), None);
    // A tail that is not where the walk ends.
    let bad_tail = List { tail: 1, ..list };
    assert_eq!(bad_tail.collect(&nodes), None);
    // A length that the walk does not match.
    let short = List { len: 2, ..list };
    assert_eq!(short.collect(&nodes), None);
}

/// An LRU manager with `k(1)`, `k(2)` stored and `k(3)` write-pending, and the slot of `k(3)`.
fn lru_with_a_pending_key() -> (CpuOffloadingManager, u32) {
    let k = |n| OffloadKey {
        hash: crate::BlockHash(n),
        group: 0,
    };
    let mut m = CpuOffloadingManager::new(ManagerConfig {
        capacity_chunks: 4,
        policy: PolicyKind::Lru,
        store_threshold: 1,
    })
    .expect("a valid config");
    m.prepare_store(&[k(1), k(2)], Access::default())
        .expect("room for two");
    m.complete_store(&[k(1), k(2)], true);
    m.prepare_store(&[k(3)], Access::default())
        .expect("room for one more");
    let pending = m.arena.slot(&k(3)).expect("k(3) has a node");
    m.check_invariants().expect("a healthy manager");
    (m, pending)
}

#[test]
fn check_invariants_reports_a_corrupt_manager() {
    // Protects I-40 as the model checker sees it: each kind of corruption of the chunk pool
    // and of the LRU placement is reported.
    type Corrupt = fn(&mut CpuOffloadingManager, u32);
    let corruptions: [(&str, Corrupt); 7] = [
        ("more chunks handed out than the pool holds", |m, _| {
            m.next_fresh = m.config.capacity_chunks + 1;
        }),
        ("a held chunk also on the free list", |m, s| {
            let chunk = m.arena.nodes[s as usize].chunk.expect("stored").chunk;
            m.free.push(chunk);
        }),
        // An LRU key sits in the rank order, never in an ARC list.
        ("a write-pending LRU key placed in T1", |m, s| {
            m.arena.nodes[s as usize].place = Place::T1;
        }),
        ("a stored key taken out of the rank order", |m, _| {
            let Policy::Lru(lru) = &mut m.policy else {
                unreachable!("built as LRU")
            };
            let list = lru.list_mut();
            let head = list.head;
            list.unlink(&mut m.arena.nodes, head);
        }),
        // A flag that outlived its `prepare_store` would shield the key from every later
        // eviction.
        ("a key left flagged as offered", |m, s| {
            m.arena.nodes[s as usize].offered = true;
        }),
        ("a write-pending key counted as evictable", |m, _| {
            m.evictable += 1;
        }),
        // Only ARC keeps keys without a chunk (its ghosts).
        ("an LRU key without a chunk", |m, _| {
            let key = OffloadKey {
                hash: crate::BlockHash(9),
                group: 0,
            };
            m.arena.alloc(key, None, super::arena::mix(&key));
        }),
    ];
    for (what, corrupt) in corruptions {
        let (mut m, pending) = lru_with_a_pending_key();
        corrupt(&mut m, pending);
        let err = m.check_invariants().expect_err(what);
        assert_eq!(err.id, "I-40", "{what}: {}", err.detail);
    }
}

// The request scope (`scope.rs`).

fn key(hash: u64, group: u32) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(hash),
        group,
    }
}

/// The scope's hash under a fixed hasher.
fn hash_of(s: &RequestAccess) -> u64 {
    use core::hash::{Hash, Hasher};
    let mut h = rustc_hash_free::Fnv(0xcbf2_9ce4_8422_2325);
    s.hash(&mut h);
    h.finish()
}

/// FNV-1a, a fixed hasher for the tests (`core` has no `DefaultHasher`).
mod rustc_hash_free {
    pub(super) struct Fnv(pub(super) u64);

    impl core::hash::Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }

        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
}

fn admit_all(s: &mut RequestAccess, keys: &[OffloadKey], f: impl Fn(&mut KeyAccess)) {
    for i in s.admit_vec(keys) {
        f(s.at(i));
    }
}

// Protects the model checker's state identity: the same facts in another arrival order
// make an equal scope.
#[test]
fn arrival_order_does_not_show() {
    let (mut a, mut b) = (RequestAccess::default(), RequestAccess::default());
    admit_all(&mut a, &[key(3, 0), key(1, 0)], |e| e.inserted = true);
    admit_all(&mut a, &[key(2, 1)], |e| e.reused = true);
    admit_all(&mut b, &[key(2, 1)], |e| e.reused = true);
    admit_all(&mut b, &[key(1, 0)], |e| e.inserted = true);
    admit_all(&mut b, &[key(3, 0)], |e| e.inserted = true);
    assert_eq!(a, b);
    assert_eq!(hash_of(&a), hash_of(&b));
    admit_all(&mut b, &[key(3, 0)], |e| e.store_miss = true);
    assert_ne!(a, b);
    // A key named by a call but given no fact leaves no trace.
    admit_all(&mut a, &[key(8, 0)], |_| ());
    admit_all(&mut a, &[key(3, 0)], |e| e.store_miss = true);
    assert_eq!(a, b);
    assert_eq!(hash_of(&a), hash_of(&b));
}

// Protects the first-access order the policy commits at the end: per group, in the order
// of first access, later accesses not moving a key; indices from `admit` follow merges.
#[test]
fn first_access_order_is_kept_per_group() {
    let mut s = RequestAccess::default();
    for k in [
        key(9, 0),
        key(5, 1),
        key(1, 0),
        key(9, 0),
        key(7, 0),
        key(5, 1),
        key(2, 1),
    ] {
        let at = s.admit_vec(&[k]);
        s.see(at[0]);
    }
    assert_eq!(
        s.commit_keys(),
        alloc::vec![key(9, 0), key(1, 0), key(7, 0), key(5, 1), key(2, 1)]
    );
    let keys = [key(4, 0), key(0, 0), key(4, 0), key(1, 0)];
    let at = s.admit_vec(&keys);
    for (n, (&i, k)) in at.iter().zip(&keys).enumerate() {
        assert_eq!(s.at(i).key, *k);
        s.at(i).position = Some(n as u32);
    }
    assert_eq!(
        s.get(&key(4, 0)).unwrap().position,
        Some(2),
        "the later position wins"
    );
    assert_eq!(
        s.get(&key(0, 0)).unwrap().seen,
        None,
        "a position is not an access"
    );
    assert!(s.has_positions());
    // Every seen key of group 0 has a position now: that group goes by position.
    for k in [key(9, 0), key(1, 0), key(7, 0)] {
        let at = s.admit_vec(&[k]);
        s.at(at[0]).position = Some(10 - k.hash.0 as u32);
    }
    assert_eq!(
        s.commit_keys(),
        alloc::vec![key(9, 0), key(7, 0), key(1, 0), key(5, 1), key(2, 1)]
    );
    // And once every seen key has one, all of them go by position.
    for (k, p) in [(key(5, 1), 0), (key(2, 1), 20)] {
        let at = s.admit_vec(&[k]);
        s.at(at[0]).position = Some(p);
    }
    assert_eq!(
        s.commit_keys(),
        alloc::vec![key(5, 1), key(9, 0), key(7, 0), key(1, 0), key(2, 1)]
    );
}

// Protects `admit`'s indices (every later fact of a call is set through them): as new keys join
// old ones and the index grows, duplicates included, each index names its key and the index
// finds every key.
#[test]
fn admitted_indices_name_their_keys() {
    let mut s = RequestAccess::default();
    let mut x: u64 = 7;
    for round in 0..200u32 {
        let keys: Vec<OffloadKey> = (0..1 + round % 9)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                key((x >> 33) % 97, (x >> 20) as u32 % 2)
            })
            .collect();
        let at = s.admit_vec(&keys);
        for (&i, k) in at.iter().zip(&keys) {
            assert_eq!(s.at(i).key, *k, "round {round}");
            assert_eq!(
                s.get(k).map(|a| a.key),
                Some(*k),
                "round {round}: the index lost a key"
            );
        }
    }
    let all = s.admit_vec(&[]);
    assert!(all.is_empty());
}

// Protects the model checker's state identity of the whole manager: the working buffers and
// the spare scopes (`scratch.rs`) carry nothing from call to call, so a manager that also made
// refused calls, and whose buffers hold their leftovers, is the same state.
#[test]
fn working_buffers_are_not_state() {
    let config = ManagerConfig {
        capacity_chunks: 2,
        policy: PolicyKind::Arc,
        store_threshold: 1,
    };
    let scoped = |r| Access {
        request: Some(RequestId(r)),
        positions: None,
    };
    let drive = |extra: bool| {
        let mut m = CpuOffloadingManager::new(config).expect("a valid config");
        m.prepare_store(&[key(1, 0), key(2, 0)], scoped(1))
            .expect("room for two");
        m.complete_store(&[key(1, 0), key(2, 0)], true);
        m.on_request_finished(RequestId(1));
        if extra {
            // Refused: they change nothing but fill the buffers.
            assert!(m.prepare_load(&[key(1, 0), key(7, 0)], scoped(2)).is_err());
            assert!(m.complete_load(&[key(2, 0), key(2, 0)]).is_err());
        }
        m.prepare_store(&[key(3, 0)], scoped(3))
            .expect("an idle key to evict");
        m
    };
    let (plain, mut busy) = (drive(false), drive(true));
    let buffers = busy.scratch.get();
    assert!(!buffers.spare_scopes.is_empty() || !buffers.slots.is_empty());
    assert_eq!(plain, busy);
    let hash = |m: &CpuOffloadingManager| {
        use core::hash::{Hash, Hasher};
        let mut h = rustc_hash_free::Fnv(0xcbf2_9ce4_8422_2325);
        m.hash(&mut h);
        h.finish()
    };
    assert_eq!(hash(&plain), hash(&busy));
    assert_eq!(plain.clone(), busy);
}
