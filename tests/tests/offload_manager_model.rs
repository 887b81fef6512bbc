//! The CPU offloading manager (SEMANTICS.md §5.3–§5.4) driven by random operation sequences
//! against a deliberately naive reference model, for both replacement policies.
//!
//! The model is a restatement of vLLM's `CPUOffloadingManager` and its `LRUCachePolicy` /
//! `ARCCachePolicy` (`vllm/v1/kv_offload/cpu/manager.py`, `cpu/policies/{lru,arc}.py`): a plain
//! `Vec` of chunk records `{key, ref_cnt, chunk, rank}` scanned linearly, the chunk pool as an
//! allocation counter plus a LIFO free list, ARC's T1/T2/B1/B2 as `Vec`s ordered oldest→newest
//! with an `f64` target, and for LRU explicit `(rank, minor)` timestamps: a global counter, the
//! provisional `(request rank, −position)` of a request's first access (ranks only move up),
//! fresh ranks tail→head at `touch` and at request finish. Per named request it keeps vLLM's
//! `_RequestCacheAccess` (first-access order per group, inserted / reused / store-miss keys) and
//! the positions learnt from its calls; an unnamed call gets a fresh, throw-away scope.
//!
//! A proptest state machine generates, over a random configuration (LRU or ARC, 1–4 chunks,
//! `store_threshold` 1 or 2, a per-request position table), sequences of `lookup`,
//! `prepare_store` (1–4 distinct keys of 8, two KV cache groups, for request 0, 1 or none, with or
//! without positions), `complete_store` (success or failure, of pending keys and sometimes a key
//! that is not pending), `prepare_load` of ready keys (or with a key that is not loadable:
//! `NotLoadable` and no change), `complete_load` of pinned keys (or with an unpinned one:
//! `NotPinned` and no change), `touch`, `on_request_finished`, `take_events` and `reset`.
//!
//! After every call it compares every result (lookup answers, `prepare_store`'s
//! `keys_to_store`, chunk ids and `evicted` in exact order or `None`, load chunk ids, errors,
//! events), the answer of `lookup` for every key, `num_free_chunks`, `num_evictable`,
//! `num_write_pending`, and runs `check_invariants()`. Refused calls must leave the manager equal
//! (`Clone` + `Eq`) to the one before. The test counts what the cases exercised (evictions,
//! `None` stores, ghost hits, threshold skips, …) and fails if one was never reached.
//!
//! Why this file is long: the naive reference model of vLLM's manager and both of its policies must
//! be read beside the state machine that runs it against kvrelay's manager, and the model is
//! deliberately plain (linear scans, explicit timestamps), so it is long by design.

use std::collections::BTreeMap;

use kvrelay_core::{
    Access, BlockHash, ChunkId, CpuOffloadingManager, KeyLookup, ManagerError, OffloadEvent,
    OffloadKey, PolicyKind, PrepareStoreOutput, RequestId,
};
use kvrelay_tests::build::cpu_manager;
use kvrelay_tests::runner::{self, assert_reached, run_state_machine};
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest};

/// Keys `0..NKEYS`; key `i` is `(hash i, group i % 2)`.
const NKEYS: usize = 8;
/// Named requests `0..NREQ`; slot `NREQ` of the position table is for unnamed calls.
const NREQ: u8 = 2;
/// Cases of the main property (a few seconds in release mode).
const CASES: u32 = 15000;
/// Transitions per case at most.
const MAX_TRANSITIONS: usize = 100;

fn key(i: usize) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(i as u64),
        group: (i % 2) as u32,
    }
}

fn index(k: &OffloadKey) -> usize {
    k.hash.0 as usize
}

fn keys(ix: &[usize]) -> Vec<OffloadKey> {
    ix.iter().map(|&i| key(i)).collect()
}

fn indices(ks: &[OffloadKey]) -> Vec<usize> {
    ks.iter().map(index).collect()
}

// ---------------------------------------------------------------------------------------------
// The naive reference model.

/// LRU recency: lower is evicted first.
type Rank = (u64, i64);

#[derive(Clone, Debug)]
struct Rec {
    key: usize,
    /// −1 write pending, 0 idle, n pinned by n loads.
    ref_cnt: i32,
    chunk: u32,
    /// LRU only.
    rank: Rank,
}

/// vLLM's `_RequestCacheAccess` plus the LRU request rank and the request's known positions.
#[derive(Clone, Debug, Default)]
struct ReqState {
    /// Keys in first-access order (all groups).
    seen: Vec<usize>,
    inserted: Vec<usize>,
    reused: Vec<usize>,
    store_misses: Vec<usize>,
    positions: BTreeMap<usize, u32>,
    lru_rank: Option<u64>,
}

#[derive(Clone, Debug)]
struct Event {
    keys: Vec<usize>,
    removed: bool,
    metadata_only: bool,
}

#[derive(Clone, Debug)]
struct Model {
    capacity: u32,
    policy: PolicyKind,
    threshold: u32,
    recs: Vec<Rec>,
    allocated: u32,
    free: Vec<u32>,
    next_rank: u64,
    t1: Vec<usize>,
    t2: Vec<usize>,
    b1: Vec<usize>,
    b2: Vec<usize>,
    target: f64,
    requests: Vec<(u8, ReqState)>,
    /// The store-threshold tracker: offers per key (never trimmed: 8 keys ≪ 64 000).
    counts: Vec<(usize, u32)>,
    events: Vec<Event>,
}

#[derive(Clone, Debug, PartialEq)]
struct StoreOut {
    keys_to_store: Vec<usize>,
    chunks: Vec<u32>,
    evicted: Vec<usize>,
}

fn remove_item(list: &mut Vec<usize>, k: usize) -> bool {
    match list.iter().position(|&x| x == k) {
        Some(i) => {
            list.remove(i);
            true
        }
        None => false,
    }
}

fn move_to_end(list: &mut Vec<usize>, k: usize) {
    remove_item(list, k);
    list.push(k);
}

impl Model {
    fn new(setup: &Setup) -> Self {
        Model {
            capacity: setup.capacity,
            policy: setup.policy,
            threshold: setup.threshold,
            recs: Vec::new(),
            allocated: 0,
            free: Vec::new(),
            next_rank: 0,
            t1: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            target: 0.0,
            requests: Vec::new(),
            counts: Vec::new(),
            events: Vec::new(),
        }
    }

    fn is_lru(&self) -> bool {
        self.policy == PolicyKind::Lru
    }

    fn rec(&self, k: usize) -> Option<&Rec> {
        self.recs.iter().find(|r| r.key == k)
    }

    fn rec_mut(&mut self, k: usize) -> Option<&mut Rec> {
        self.recs.iter_mut().find(|r| r.key == k)
    }

    fn lookup(&self, k: usize) -> KeyLookup {
        match self.rec(k) {
            None => KeyLookup::Miss,
            Some(r) if r.ref_cnt == -1 => KeyLookup::HitPending,
            Some(_) => KeyLookup::Hit,
        }
    }

    fn num_free(&self) -> u32 {
        self.capacity - self.allocated + self.free.len() as u32
    }

    fn num_idle(&self) -> u32 {
        self.recs.iter().filter(|r| r.ref_cnt == 0).count() as u32
    }

    fn num_pending(&self) -> u32 {
        self.recs.iter().filter(|r| r.ref_cnt == -1).count() as u32
    }

    fn take_req(&mut self, req: Option<u8>) -> ReqState {
        if let Some(r) = req
            && let Some(i) = self.requests.iter().position(|(id, _)| *id == r)
        {
            return self.requests.remove(i).1;
        }
        ReqState::default()
    }

    fn put_req(&mut self, req: Option<u8>, st: ReqState) {
        if let Some(r) = req {
            self.requests.push((r, st));
        }
    }

    fn fresh_rank(&mut self) -> Rank {
        self.next_rank += 1;
        (self.next_rank, 0)
    }

    fn request_rank(&mut self, st: &mut ReqState) -> u64 {
        if st.lru_rank.is_none() {
            self.next_rank += 1;
            st.lru_rank = Some(self.next_rank);
        }
        st.lru_rank.unwrap()
    }

    /// `_record_request_cache_access` and LRU `on_request_access`.
    fn record(&mut self, st: &mut ReqState, ks: &[usize], reused: &[usize]) {
        let mut new_keys = Vec::new();
        for &k in ks {
            if !st.seen.contains(&k) {
                st.seen.push(k);
                new_keys.push(k);
            }
        }
        if !new_keys.is_empty() && self.is_lru() {
            let rr = self.request_rank(st);
            for k in new_keys {
                let Some(&pos) = st.positions.get(&k) else {
                    continue;
                };
                if let Some(rec) = self.rec_mut(k) {
                    let provisional = (rr, -i64::from(pos));
                    if rec.rank < provisional {
                        rec.rank = provisional;
                    }
                }
            }
        }
        for &k in reused {
            if !st.inserted.contains(&k) && !st.reused.contains(&k) {
                st.reused.push(k);
            }
        }
    }

    /// ARC: a store miss or touch of a ghost adapts the T1 target.
    fn ghost_hit(&mut self, k: usize) -> bool {
        let cap = f64::from(self.capacity);
        if self.b1.contains(&k) {
            let delta = (self.b2.len() as f64 / self.b1.len() as f64).max(1.0);
            self.target = (self.target + delta).min(cap);
            move_to_end(&mut self.b1, k);
            true
        } else if self.b2.contains(&k) {
            let delta = (self.b1.len() as f64 / self.b2.len() as f64).max(1.0);
            self.target = (self.target - delta).max(0.0);
            move_to_end(&mut self.b2, k);
            true
        } else {
            false
        }
    }

    fn evictable(&self, k: usize, protected: &[usize]) -> bool {
        self.rec(k).is_some_and(|r| r.ref_cnt == 0) && !protected.contains(&k)
    }

    /// Exactly `n` victims (not yet removed), or `None` with nothing changed.
    fn evict(&mut self, n: usize, protected: &[usize]) -> Option<Vec<usize>> {
        if self.is_lru() {
            let mut idle: Vec<(Rank, usize)> = self
                .recs
                .iter()
                .filter(|r| r.ref_cnt == 0 && !protected.contains(&r.key))
                .map(|r| (r.rank, r.key))
                .collect();
            idle.sort();
            if idle.len() < n {
                return None;
            }
            return Some(idle[..n].iter().map(|(_, k)| *k).collect());
        }
        let evictable_in = |list: &[usize]| -> Vec<usize> {
            list.iter()
                .copied()
                .filter(|&k| self.evictable(k, protected))
                .collect()
        };
        let (t1_ok, t2_ok) = (evictable_in(&self.t1), evictable_in(&self.t2));
        let (mut i1, mut i2) = (0, 0);
        let mut virtual_t1 = self.t1.len();
        let mut chosen: Vec<(usize, bool)> = Vec::new();
        for _ in 0..n {
            let mut pick = None;
            if virtual_t1 >= self.target as usize && i1 < t1_ok.len() {
                pick = Some((t1_ok[i1], true));
                i1 += 1;
                virtual_t1 -= 1;
            }
            if pick.is_none() && i2 < t2_ok.len() {
                pick = Some((t2_ok[i2], false));
                i2 += 1;
            }
            if pick.is_none() {
                if i1 >= t1_ok.len() {
                    return None;
                }
                pick = Some((t1_ok[i1], true));
                i1 += 1;
                virtual_t1 -= 1;
            }
            chosen.push(pick.unwrap());
        }
        for &(k, from_t1) in &chosen {
            if from_t1 {
                remove_item(&mut self.t1, k);
                self.b1.push(k);
            } else {
                remove_item(&mut self.t2, k);
                self.b2.push(k);
            }
        }
        let cap = self.capacity as usize;
        while self.b1.len() > cap {
            self.b1.remove(0);
        }
        while self.b2.len() > cap {
            self.b2.remove(0);
        }
        Some(chosen.into_iter().map(|(k, _)| k).collect())
    }

    fn prepare_store(
        &mut self,
        offer: &[usize],
        req: Option<u8>,
        positions: Option<&[u32]>,
    ) -> Option<StoreOut> {
        if self.threshold >= 2 {
            for &k in offer {
                if let Some(e) = self.counts.iter_mut().find(|e| e.0 == k) {
                    e.1 += 1;
                }
            }
            for &k in offer {
                if !self.counts.iter().any(|e| e.0 == k) {
                    self.counts.push((k, 1));
                }
            }
        }
        let mut candidates = Vec::new();
        let mut ready = Vec::new();
        for &k in offer {
            match self.rec(k) {
                None => candidates.push(k),
                Some(r) if r.ref_cnt >= 0 => ready.push(k),
                Some(_) => {}
            }
        }
        if self.threshold >= 2 {
            let before = candidates.len();
            let counts = self.counts.clone();
            candidates.retain(|k| {
                counts
                    .iter()
                    .find(|e| e.0 == *k)
                    .is_some_and(|e| e.1 >= self.threshold)
            });
            if candidates.len() < before {
                bump(|s| s.threshold_skips += 1);
            }
        }
        let mut st = self.take_req(req);
        if let Some(pos) = positions {
            for (k, p) in offer.iter().zip(pos) {
                st.positions.insert(*k, *p);
            }
        }
        let new_misses: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|k| !st.store_misses.contains(k))
            .collect();
        if !self.is_lru() {
            for &k in new_misses.iter().rev() {
                if self.ghost_hit(k) {
                    bump(|s| s.ghost_hits += 1);
                }
            }
        }
        st.store_misses.extend(new_misses);
        let recorded: Vec<usize> = offer
            .iter()
            .copied()
            .filter(|k| candidates.contains(k) || ready.contains(k))
            .collect();
        self.record(&mut st, &recorded, &ready);
        let out = self.allocate(&mut st, offer, &candidates);
        if out.as_ref().is_some_and(|o| !o.keys_to_store.is_empty()) {
            st.inserted.extend(candidates.iter().copied());
        }
        self.put_req(req, st);
        out
    }

    fn allocate(
        &mut self,
        st: &mut ReqState,
        offer: &[usize],
        candidates: &[usize],
    ) -> Option<StoreOut> {
        let mut out = StoreOut {
            keys_to_store: Vec::new(),
            chunks: Vec::new(),
            evicted: Vec::new(),
        };
        if candidates.is_empty() {
            return Some(out);
        }
        let need = candidates.len() as i64 - i64::from(self.num_free());
        if need > 0 {
            if need > i64::from(self.num_idle()) {
                return None;
            }
            let victims = self.evict(need as usize, offer)?;
            for &v in &victims {
                let i = self.recs.iter().position(|r| r.key == v).unwrap();
                let rec = self.recs.remove(i);
                self.free.push(rec.chunk);
            }
            self.events.push(Event {
                keys: victims.clone(),
                removed: true,
                metadata_only: false,
            });
            out.evicted = victims;
        }
        for &k in candidates {
            let chunk = if self.allocated < self.capacity {
                self.allocated += 1;
                self.allocated - 1
            } else {
                self.free.pop().unwrap()
            };
            let rank = if self.is_lru() {
                match st.positions.get(&k).copied() {
                    Some(pos) => (self.request_rank(st), -i64::from(pos)),
                    None => self.fresh_rank(),
                }
            } else {
                (0, 0)
            };
            self.recs.push(Rec {
                key: k,
                ref_cnt: -1,
                chunk,
                rank,
            });
            if !self.is_lru() {
                self.t1.push(k);
                remove_item(&mut self.b1, k);
                remove_item(&mut self.b2, k);
            }
            out.chunks.push(chunk);
        }
        out.keys_to_store = candidates.to_vec();
        Some(out)
    }

    fn complete_store(&mut self, ks: &[usize], success: bool) {
        let mut done = Vec::new();
        for &k in ks {
            if self.rec(k).is_none_or(|r| r.ref_cnt != -1) {
                continue;
            }
            if success {
                self.rec_mut(k).unwrap().ref_cnt = 0;
            } else {
                let i = self.recs.iter().position(|r| r.key == k).unwrap();
                let rec = self.recs.remove(i);
                self.free.push(rec.chunk);
                if !remove_item(&mut self.t1, k) {
                    remove_item(&mut self.t2, k);
                }
            }
            done.push(k);
        }
        if !done.is_empty() {
            self.events.push(Event {
                keys: done,
                removed: !success,
                metadata_only: !success,
            });
        }
    }

    fn prepare_load(
        &mut self,
        ks: &[usize],
        req: Option<u8>,
        positions: Option<&[u32]>,
    ) -> Result<Vec<u32>, Vec<usize>> {
        let bad: Vec<usize> = ks
            .iter()
            .copied()
            .filter(|&k| self.rec(k).is_none_or(|r| r.ref_cnt < 0))
            .collect();
        if !bad.is_empty() {
            return Err(bad);
        }
        let mut chunks = Vec::new();
        for &k in ks {
            let r = self.rec_mut(k).unwrap();
            r.ref_cnt += 1;
            chunks.push(r.chunk);
        }
        let mut st = self.take_req(req);
        if let Some(pos) = positions {
            for (k, p) in ks.iter().zip(pos) {
                st.positions.insert(*k, *p);
            }
        }
        self.record(&mut st, ks, ks);
        self.put_req(req, st);
        Ok(chunks)
    }

    fn complete_load(&mut self, ks: &[usize]) -> Result<(), Vec<usize>> {
        let bad: Vec<usize> = ks
            .iter()
            .copied()
            .filter(|&k| {
                let n = ks.iter().filter(|&&x| x == k).count() as i32;
                self.rec(k).is_none_or(|r| r.ref_cnt < n)
            })
            .collect();
        if !bad.is_empty() {
            return Err(bad);
        }
        for &k in ks {
            self.rec_mut(k).unwrap().ref_cnt -= 1;
        }
        Ok(())
    }

    fn touch(&mut self, ks: &[usize]) {
        for &k in ks.iter().rev() {
            if self.is_lru() {
                if self.rec(k).is_some() {
                    let rank = self.fresh_rank();
                    self.rec_mut(k).unwrap().rank = rank;
                }
            } else if self.t1.contains(&k) {
                remove_item(&mut self.t1, k);
                if self.rec(k).is_some_and(|r| r.ref_cnt >= 0) {
                    self.t2.push(k);
                } else {
                    self.t1.push(k);
                }
            } else if self.t2.contains(&k) {
                move_to_end(&mut self.t2, k);
            } else if self.ghost_hit(k) {
                bump(|s| s.ghost_hits += 1);
            }
        }
    }

    fn finish(&mut self, req: u8) {
        let Some(i) = self.requests.iter().position(|(id, _)| *id == req) else {
            return;
        };
        let (_, st) = self.requests.remove(i);
        let known = |ks: &[usize]| ks.iter().all(|k| st.positions.contains_key(k));
        let mut order = Vec::new();
        for group in 0..2 {
            let mut g: Vec<usize> = st.seen.iter().copied().filter(|k| k % 2 == group).collect();
            if known(&g) {
                g.sort_by_key(|k| st.positions[k]);
            }
            order.extend(g);
        }
        if known(&order) {
            order.sort_by_key(|k| st.positions[k]);
        }
        for &k in order.iter().rev() {
            if self.is_lru() {
                if self.rec(k).is_some() {
                    let rank = self.fresh_rank();
                    self.rec_mut(k).unwrap().rank = rank;
                }
                continue;
            }
            let reused = st.reused.contains(&k);
            if st.inserted.contains(&k) && !reused {
                if self.t1.contains(&k) {
                    move_to_end(&mut self.t1, k);
                } else if self.t2.contains(&k) {
                    move_to_end(&mut self.t2, k);
                }
            } else if reused {
                if remove_item(&mut self.t1, k) {
                    self.t2.push(k);
                    bump(|s| s.promotions += 1);
                } else if self.t2.contains(&k) {
                    move_to_end(&mut self.t2, k);
                }
            }
        }
    }

    fn take_events(&mut self) -> Vec<Event> {
        let events = std::mem::take(&mut self.events);
        let mut out = Vec::new();
        for mut e in events {
            if e.metadata_only {
                e.keys.retain(|&k| self.rec(k).is_none());
                if e.keys.is_empty() {
                    continue;
                }
            }
            out.push(e);
        }
        out
    }

    fn reset(&mut self) {
        self.recs.clear();
        self.allocated = 0;
        self.free.clear();
        self.next_rank = 0;
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.target = 0.0;
        self.requests.clear();
    }
}

// ---------------------------------------------------------------------------------------------
// Generation.

#[derive(Clone, Debug)]
struct Setup {
    capacity: u32,
    policy: PolicyKind,
    threshold: u32,
    /// `positions[slot][key]`: request `slot`'s end-token position of a key (slot `NREQ`:
    /// unnamed calls). A permutation per slot, so ranks never tie.
    positions: Vec<Vec<u32>>,
}

#[derive(Clone, Debug)]
enum Transition {
    Lookup(usize),
    Store {
        offer: Vec<usize>,
        req: Option<u8>,
        with_positions: bool,
    },
    /// Pending keys chosen by `mask`, plus `extra` (whatever its state).
    CompleteStore {
        mask: u8,
        extra: Option<usize>,
        success: bool,
    },
    /// Ready keys chosen by `mask`, and `bad`: a key that is not loadable (if any) inserted;
    /// `dup` repeats the last key (pinned twice by one call).
    Load {
        mask: u8,
        bad: Option<usize>,
        dup: bool,
        req: Option<u8>,
        with_positions: bool,
    },
    /// Pinned keys chosen by `mask`, plus an unpinned key (if any) when `unpinned`; `dup`
    /// repeats the last key (refused unless it is pinned twice).
    CompleteLoad {
        mask: u8,
        unpinned: Option<usize>,
        dup: bool,
    },
    Touch(Vec<usize>),
    Finish(u8),
    TakeEvents,
    Reset,
}

fn offer_strategy() -> impl Strategy<Value = Vec<usize>> {
    proptest::sample::subsequence((0..NKEYS).collect::<Vec<_>>(), 1..=4).prop_shuffle()
}

fn req_strategy() -> impl Strategy<Value = Option<u8>> {
    prop_oneof![Just(None), (0..NREQ).prop_map(Some)]
}

struct ManagerModel;

impl ReferenceStateMachine for ManagerModel {
    type State = Setup;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Setup> {
        let perm = Just((0..NKEYS as u32).collect::<Vec<_>>()).prop_shuffle();
        (
            1u32..=4,
            prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Arc)],
            1u32..=2,
            proptest::collection::vec(perm, NREQ as usize + 1),
        )
            .prop_map(|(capacity, policy, threshold, positions)| Setup {
                capacity,
                policy,
                threshold,
                positions,
            })
            .boxed()
    }

    fn transitions(_: &Setup) -> BoxedStrategy<Transition> {
        prop_oneof![
            1 => (0..NKEYS).prop_map(Transition::Lookup),
            6 => (offer_strategy(), req_strategy(), any::<bool>()).prop_map(
                |(offer, req, with_positions)| Transition::Store {
                    offer,
                    req,
                    with_positions,
                }
            ),
            6 => (any::<u8>(), proptest::option::weighted(0.2, 0..NKEYS), proptest::bool::weighted(0.85))
                .prop_map(|(mask, extra, success)| Transition::CompleteStore {
                    mask,
                    extra,
                    success,
                }),
            4 => (
                any::<u8>(),
                proptest::option::weighted(0.2, 0..NKEYS),
                proptest::bool::weighted(0.15),
                req_strategy(),
                any::<bool>()
            )
                .prop_map(|(mask, bad, dup, req, with_positions)| Transition::Load {
                    mask,
                    bad,
                    dup,
                    req,
                    with_positions,
                }),
            4 => (any::<u8>(), proptest::option::weighted(0.2, 0..NKEYS), proptest::bool::weighted(0.15))
                .prop_map(|(mask, unpinned, dup)| Transition::CompleteLoad { mask, unpinned, dup }),
            3 => offer_strategy().prop_map(Transition::Touch),
            3 => (0..NREQ).prop_map(Transition::Finish),
            1 => Just(Transition::TakeEvents),
            1 => Just(Transition::Reset),
        ]
        .boxed()
    }

    fn apply(state: Setup, _: &Transition) -> Setup {
        state
    }
}

// ---------------------------------------------------------------------------------------------
// Coverage counters.

#[derive(Clone, Debug, Default)]
struct Stats {
    cases: u64,
    stores: u64,
    stores_none: u64,
    evictions: u64,
    threshold_skips: u64,
    ghost_hits: u64,
    promotions: u64,
    failed_stores: u64,
    loads: u64,
    load_refusals: u64,
    unpin_refusals: u64,
    filtered_events: u64,
    finishes: u64,
}

fn bump(f: impl FnOnce(&mut Stats)) {
    runner::bump(f);
}

// ---------------------------------------------------------------------------------------------
// The harness: the manager and the model side by side.

struct Harness {
    setup: Setup,
    m: CpuOffloadingManager,
    model: Model,
}

fn pick(list: &[usize], mask: u8) -> Vec<usize> {
    list.iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << (i % 8)) != 0)
        .map(|(_, k)| *k)
        .collect()
}

impl Harness {
    fn new(setup: &Setup) -> Self {
        let m = cpu_manager(setup.policy, setup.capacity, setup.threshold);
        Harness {
            setup: setup.clone(),
            m,
            model: Model::new(setup),
        }
    }

    fn positions(&self, req: Option<u8>, ks: &[usize], on: bool) -> Option<Vec<u32>> {
        let slot = req.map_or(NREQ as usize, usize::from);
        on.then(|| ks.iter().map(|&k| self.setup.positions[slot][k]).collect())
    }

    fn keys_with(&self, f: impl Fn(i32) -> bool) -> Vec<usize> {
        (0..NKEYS)
            .filter(|&k| self.model.rec(k).is_some_and(|r| f(r.ref_cnt)))
            .collect()
    }

    fn check(&self) {
        self.m.check_invariants().expect("I-40");
        for k in 0..NKEYS {
            assert_eq!(
                self.m.lookup(key(k)),
                self.model.lookup(k),
                "lookup of key {k}"
            );
        }
        assert_eq!(
            self.m.num_free_chunks(),
            self.model.num_free(),
            "free chunks"
        );
        assert_eq!(self.m.num_evictable(), self.model.num_idle(), "evictable");
        assert_eq!(
            self.m.num_write_pending(),
            self.model.num_pending(),
            "write pending"
        );
    }

    fn apply(&mut self, t: Transition) {
        match t {
            Transition::Lookup(k) => {
                assert_eq!(self.m.lookup(key(k)), self.model.lookup(k));
            }
            Transition::Store {
                offer,
                req,
                with_positions,
            } => {
                let pos = self.positions(req, &offer, with_positions);
                let access = Access {
                    request: req.map(|r| RequestId(u32::from(r))),
                    positions: pos.as_deref(),
                };
                let got = self.m.prepare_store(&keys(&offer), access);
                let want = self.model.prepare_store(&offer, req, pos.as_deref());
                let got = got.map(|o: PrepareStoreOutput| StoreOut {
                    keys_to_store: indices(&o.keys_to_store),
                    chunks: o.chunks.iter().map(|c: &ChunkId| c.0).collect(),
                    evicted: indices(&o.evicted),
                });
                assert_eq!(got, want, "prepare_store({offer:?}, {req:?})");
                bump(|s| {
                    s.stores += 1;
                    match &want {
                        None => s.stores_none += 1,
                        Some(o) if !o.evicted.is_empty() => s.evictions += 1,
                        Some(_) => {}
                    }
                });
            }
            Transition::CompleteStore {
                mask,
                extra,
                success,
            } => {
                let mut ks = pick(&self.keys_with(|r| r == -1), mask);
                ks.extend(extra);
                if !success && !ks.is_empty() {
                    bump(|s| s.failed_stores += 1);
                }
                self.m.complete_store(&keys(&ks), success);
                self.model.complete_store(&ks, success);
            }
            Transition::Load {
                mask,
                bad,
                dup,
                req,
                with_positions,
            } => {
                let mut ks = pick(&self.keys_with(|r| r >= 0), mask);
                let bad = bad.filter(|&k| self.model.rec(k).is_none_or(|r| r.ref_cnt < 0));
                if let Some(b) = bad {
                    let at = usize::from(mask) % (ks.len() + 1);
                    ks.insert(at, b);
                }
                if dup && let Some(&k) = ks.last() {
                    ks.push(k);
                }
                if ks.is_empty() {
                    return;
                }
                let pos = self.positions(req, &ks, with_positions);
                let access = Access {
                    request: req.map(|r| RequestId(u32::from(r))),
                    positions: pos.as_deref(),
                };
                let before = self.m.clone();
                let got = self.m.prepare_load(&keys(&ks), access);
                let want = self.model.prepare_load(&ks, req, pos.as_deref());
                match (got, want) {
                    (Ok(c), Ok(w)) => {
                        assert_eq!(c.iter().map(|c| c.0).collect::<Vec<_>>(), w);
                        bump(|s| s.loads += 1);
                    }
                    (Err(ManagerError::NotLoadable(k)), Err(bad)) => {
                        assert!(bad.contains(&index(&k)), "{k:?} not in {bad:?}");
                        assert_eq!(self.m, before, "a refused prepare_load changed the manager");
                        bump(|s| s.load_refusals += 1);
                    }
                    (got, want) => panic!("prepare_load({ks:?}): {got:?} vs model {want:?}"),
                }
            }
            Transition::CompleteLoad {
                mask,
                unpinned,
                dup,
            } => {
                let mut ks = pick(&self.keys_with(|r| r >= 1), mask);
                if let Some(u) = unpinned
                    && self.model.rec(u).is_none_or(|r| r.ref_cnt < 1)
                {
                    ks.push(u);
                }
                if dup && let Some(&k) = ks.last() {
                    ks.push(k);
                }
                if ks.is_empty() {
                    return;
                }
                let before = self.m.clone();
                let got = self.m.complete_load(&keys(&ks));
                let want = self.model.complete_load(&ks);
                match (got, want) {
                    (Ok(()), Ok(())) => {}
                    (Err(ManagerError::NotPinned(k)), Err(bad)) => {
                        assert!(bad.contains(&index(&k)), "{k:?} not in {bad:?}");
                        assert_eq!(
                            self.m, before,
                            "a refused complete_load changed the manager"
                        );
                        bump(|s| s.unpin_refusals += 1);
                    }
                    (got, want) => panic!("complete_load({ks:?}): {got:?} vs model {want:?}"),
                }
            }
            Transition::Touch(ks) => {
                self.m.touch(&keys(&ks), Access::default());
                self.model.touch(&ks);
            }
            Transition::Finish(r) => {
                self.m.on_request_finished(RequestId(u32::from(r)));
                self.model.finish(r);
                bump(|s| s.finishes += 1);
            }
            Transition::TakeEvents => {
                let got: Vec<OffloadEvent> = self.m.take_events();
                let got: Vec<(Vec<usize>, bool)> =
                    got.iter().map(|e| (indices(&e.keys), e.removed)).collect();
                let raw = self.model.events.len();
                let want: Vec<(Vec<usize>, bool)> = self
                    .model
                    .take_events()
                    .into_iter()
                    .map(|e| (e.keys, e.removed))
                    .collect();
                if want.len() < raw {
                    bump(|s| s.filtered_events += 1);
                }
                assert_eq!(got, want, "events");
            }
            Transition::Reset => {
                self.m.reset();
                self.model.reset();
            }
        }
    }
}

struct ManagerTest;

impl StateMachineTest for ManagerTest {
    type SystemUnderTest = Harness;
    type Reference = ManagerModel;

    fn init_test(state: &Setup) -> Harness {
        bump(|s| s.cases += 1);
        Harness::new(state)
    }

    fn apply(mut h: Harness, _: &Setup, t: Transition) -> Harness {
        h.apply(t);
        h
    }

    fn check_invariants(h: &Harness, _: &Setup) {
        h.check();
    }
}

#[test]
fn offload_manager_matches_the_reference_model() {
    // PROPTEST_CASES overrides the default case count (for longer local runs).
    let stats: Stats = run_state_machine::<ManagerTest, Stats>(CASES, MAX_TRANSITIONS);
    assert_reached(
        &stats,
        &[
            ("stores", stats.stores),
            ("stores refused (None)", stats.stores_none),
            ("evictions", stats.evictions),
            ("threshold skips", stats.threshold_skips),
            ("ARC ghost hits", stats.ghost_hits),
            ("ARC promotions at finish", stats.promotions),
            ("failed stores", stats.failed_stores),
            ("loads", stats.loads),
            ("refused loads", stats.load_refusals),
            ("refused unpins", stats.unpin_refusals),
            ("filtered metadata-only events", stats.filtered_events),
            ("request finishes", stats.finishes),
        ],
    );
}
