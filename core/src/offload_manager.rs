//! The CPU offloading manager (vLLM 0.33.0's `CPUOffloadingManager`; SEMANTICS.md §5.2–§5.4, I-40).
//!
//! The scheduler-side offloading connector asks it, per chunk key, whether a chunk is stored
//! ([`CpuOffloadingManager::lookup`]), pins chunks for loads, and reserves chunks for stores,
//! evicting idle chunks when the host pool is full. It is pure: no clocks, no randomness, and
//! only ordered collections, so the model checker can replay it.
//!
//! Two replacement policies sit behind the chunk state machine, as in vLLM: LRU (logical recency
//! with provisional per-request ranks committed at `on_request_finished`) and ARC (T1/T2, ghost
//! lists B1/B2, adaptive T1 target). Both see the same request-scoped accesses: the manager
//! records which keys each request reused (loads, ready keys in a store offer) and which it only
//! inserted, and hands them to the policy when the request finishes.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use crate::{BlockHash, InvariantViolation, RequestId, ensure_invariant};

/// The hash of a chunk's last block and its KV cache group (vLLM's `OffloadKey`).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
pub struct OffloadKey {
    /// The hash of the chunk's last block.
    pub hash: BlockHash,
    /// The KV cache group.
    pub group: u32,
}

/// A slot in the host chunk pool.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
pub struct ChunkId(pub u32);

/// What [`CpuOffloadingManager::lookup`] found for a key.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum KeyLookup {
    /// Not stored.
    Miss,
    /// Stored and readable.
    Hit,
    /// A store is in flight: present but not yet readable.
    HitPending,
}

/// The eviction policy.
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub enum PolicyKind {
    /// Least recently used (vLLM's default).
    #[default]
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// How a manager is built.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ManagerConfig {
    /// How many chunks the host pool holds.
    pub capacity_chunks: u32,
    /// The eviction policy.
    pub policy: PolicyKind,
    /// Store a key only once it was offered this many times (0 or 1: always).
    pub store_threshold: u32,
}

impl ManagerConfig {
    /// Checks the config before building a manager: the pool must hold at least one chunk.
    pub fn validate(&self) -> Result<(), ManagerError> {
        if self.capacity_chunks == 0 {
            return Err(ManagerError::BadConfig(
                "capacity_chunks must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Who accesses keys: the request (for request-aware recency) and, optionally, each key's
/// end-token position in the request (parallel to `keys`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Access<'a> {
    /// The request on whose behalf the keys are accessed.
    pub request: Option<RequestId>,
    /// Each key's end-token position in the request, parallel to the keys.
    pub positions: Option<&'a [u32]>,
}

/// What [`CpuOffloadingManager::prepare_store`] decided.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrepareStoreOutput {
    /// The offered keys that must be written, in offer order.
    pub keys_to_store: Vec<OffloadKey>,
    /// The chunk each of `keys_to_store` is written to (parallel).
    pub chunks: Vec<ChunkId>,
    /// The keys evicted to make room.
    pub evicted: Vec<OffloadKey>,
}

/// Keys stored or removed since the last [`CpuOffloadingManager::take_events`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadEvent {
    /// The keys.
    pub keys: Vec<OffloadKey>,
    /// `true` for a removal, `false` for a store.
    pub removed: bool,
}

/// A typed refusal of a manager call; the manager is unchanged.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
pub enum ManagerError {
    /// `prepare_load` of a key that is not stored and ready.
    #[error("key {0:?} is not loadable")]
    NotLoadable(OffloadKey),
    /// `complete_load` of a key that is not pinned.
    #[error("key {0:?} is not pinned")]
    NotPinned(OffloadKey),
    /// A config that cannot build a manager.
    #[error("bad config: {0}")]
    BadConfig(&'static str),
}

impl ManagerError {
    /// The stable short name used by the conformance format.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotLoadable(_) => "not_loadable",
            Self::NotPinned(_) => "not_pinned",
            Self::BadConfig(_) => "bad_config",
        }
    }
}

/// One stored (or being-stored) chunk. `ref_cnt` is −1 while write-pending.
/// One key's chunk: `ref_cnt` −1 = write pending, 0 = ready and idle, n ≥ 1 = pinned by n loads.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Chunk {
    ref_cnt: i32,
    chunk: ChunkId,
}

/// An insertion-ordered key set (Python's `OrderedDict` as the policies use it): O(log n) move to
/// the most recent end, removal, and iteration from the least recent end.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct OrderedKeys {
    order: BTreeMap<u64, OffloadKey>,
    seq_of: BTreeMap<OffloadKey, u64>,
    next: u64,
}

impl OrderedKeys {
    fn len(&self) -> usize {
        self.seq_of.len()
    }
    fn contains(&self, k: &OffloadKey) -> bool {
        self.seq_of.contains_key(k)
    }
    /// Inserts at, or moves to, the most recent end.
    fn push_back(&mut self, k: OffloadKey) {
        if let Some(old) = self.seq_of.insert(k, self.next) {
            self.order.remove(&old);
        }
        self.order.insert(self.next, k);
        self.next += 1;
    }
    fn remove(&mut self, k: &OffloadKey) -> bool {
        match self.seq_of.remove(k) {
            Some(seq) => {
                self.order.remove(&seq);
                true
            }
            None => false,
        }
    }
    fn pop_front(&mut self) -> Option<OffloadKey> {
        let (_, k) = self.order.pop_first()?;
        self.seq_of.remove(&k);
        Some(k)
    }
    fn iter(&self) -> impl Iterator<Item = OffloadKey> + '_ {
        self.order.values().copied()
    }
}

/// LRU recency: `(rank, minor)`, lowest evicted first. Global ranks have minor 0; a request's
/// provisional rank is `(request rank, −position)`, so tails go before heads.
type Rank = (u64, i64);

/// The replacement policy's own state (vLLM's `LRUCachePolicy` / `ARCCachePolicy`).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
enum Policy {
    Lru {
        ranks: BTreeMap<OffloadKey, Rank>,
        /// Idle keys by rank (vLLM's lazy heap, kept exact).
        evictable: BTreeSet<(Rank, OffloadKey)>,
        next_rank: u64,
    },
    Arc {
        t1: OrderedKeys,
        t2: OrderedKeys,
        b1: OrderedKeys,
        b2: OrderedKeys,
        /// `target_t1_size`, an f64 kept as its bits so the manager stays `Eq + Hash`.
        target_bits: u64,
    },
}

/// A request's scope of accesses (vLLM's `_RequestCacheAccess` plus the LRU request rank).
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct RequestAccess {
    /// Keys in first-access order, per KV cache group.
    key_groups: BTreeMap<u32, Vec<OffloadKey>>,
    seen: BTreeSet<OffloadKey>,
    inserted: BTreeSet<OffloadKey>,
    reused: BTreeSet<OffloadKey>,
    store_misses: BTreeSet<OffloadKey>,
    /// Each key's end-token position, when the caller gave it.
    positions: BTreeMap<OffloadKey, u32>,
    /// The LRU provisional rank, allocated on first need.
    lru_rank: Option<u64>,
}

/// vLLM's `CPUOffloadingManager`: the chunk pool, the per-key chunk states of SEMANTICS.md §5.3,
/// events, the store-threshold tracker, and one replacement policy.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuOffloadingManager {
    config: ManagerConfig,
    chunks: BTreeMap<OffloadKey, Chunk>,
    policy: Policy,
    requests: BTreeMap<RequestId, RequestAccess>,
    next_fresh: u32,
    free: Vec<ChunkId>,
    evictable: u32,
    write_pending: u32,
    /// Events in order; `true` marks a metadata-only removal (a failed store), filtered at drain.
    events: Vec<(OffloadEvent, bool)>,
    tracker: BTreeMap<OffloadKey, (u32, u64)>,
    tracker_order: BTreeSet<(u64, OffloadKey)>,
    tracker_tick: u64,
}

/// vLLM's `max_tracker_size` default.
const MAX_TRACKER_SIZE: usize = 64_000;

impl CpuOffloadingManager {
    /// A manager with an empty pool of `config.capacity_chunks` chunks.
    pub fn new(config: ManagerConfig) -> Result<Self, ManagerError> {
        config.validate()?;
        Ok(Self {
            config,
            chunks: BTreeMap::new(),
            policy: Self::fresh_policy(config.policy),
            requests: BTreeMap::new(),
            next_fresh: 0,
            free: Vec::new(),
            evictable: 0,
            write_pending: 0,
            events: Vec::new(),
            tracker: BTreeMap::new(),
            tracker_order: BTreeSet::new(),
            tracker_tick: 0,
        })
    }

    fn fresh_policy(kind: PolicyKind) -> Policy {
        match kind {
            PolicyKind::Lru => Policy::Lru {
                ranks: BTreeMap::new(),
                evictable: BTreeSet::new(),
                next_rank: 0,
            },
            PolicyKind::Arc => Policy::Arc {
                t1: OrderedKeys::default(),
                t2: OrderedKeys::default(),
                b1: OrderedKeys::default(),
                b2: OrderedKeys::default(),
                target_bits: 0f64.to_bits(),
            },
        }
    }

    /// Whether `key` is stored and readable (`Hit`), being written (`HitPending`), or absent.
    pub fn lookup(&self, key: OffloadKey) -> KeyLookup {
        match self.chunks.get(&key) {
            None => KeyLookup::Miss,
            Some(c) if c.ref_cnt < 0 => KeyLookup::HitPending,
            Some(_) => KeyLookup::Hit,
        }
    }

    /// Pins ready keys for a load (no eviction until [`Self::complete_load`]); counts as the
    /// request's reuse of them. Atomic: a key that is absent or not ready changes nothing.
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        for k in keys {
            match self.chunks.get(k) {
                Some(c) if c.ref_cnt >= 0 => {}
                _ => return Err(ManagerError::NotLoadable(*k)),
            }
        }
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let c = self
                .chunks
                .get_mut(k)
                .expect("checked above: every key is present");
            if c.ref_cnt == 0 {
                self.evictable -= 1;
                if let Policy::Lru {
                    ranks, evictable, ..
                } = &mut self.policy
                {
                    evictable.remove(&(ranks[k], *k));
                }
            }
            c.ref_cnt += 1;
            out.push(c.chunk);
        }
        let mut ctx = self.take_ctx(access);
        Self::learn_positions(&mut ctx, keys, access);
        self.record_access(&mut ctx, keys, access, keys);
        self.put_ctx(access, ctx);
        Ok(out)
    }

    /// Unpins what [`Self::prepare_load`] pinned. Atomic: an unpinned key changes nothing.
    pub fn complete_load(&mut self, keys: &[OffloadKey]) -> Result<(), ManagerError> {
        let mut need: BTreeMap<OffloadKey, i32> = BTreeMap::new();
        for k in keys {
            *need.entry(*k).or_default() += 1;
        }
        for (k, n) in &need {
            match self.chunks.get(k) {
                Some(c) if c.ref_cnt >= *n => {}
                _ => return Err(ManagerError::NotPinned(*k)),
            }
        }
        for k in keys {
            let c = self
                .chunks
                .get_mut(k)
                .expect("checked above: every key is present");
            c.ref_cnt -= 1;
            if c.ref_cnt == 0 {
                self.mark_evictable(*k);
            }
        }
        Ok(())
    }

    fn mark_evictable(&mut self, k: OffloadKey) {
        self.evictable += 1;
        if let Policy::Lru {
            ranks, evictable, ..
        } = &mut self.policy
        {
            evictable.insert((ranks[&k], k));
        }
    }

    /// Marks keys recently used (also keys served by the GPU prefix cache); processed tail to
    /// head so the head ends most recent.
    pub fn touch(&mut self, keys: &[OffloadKey], _access: Access<'_>) {
        self.policy_touch(keys);
    }

    fn policy_touch(&mut self, keys: &[OffloadKey]) {
        match &mut self.policy {
            Policy::Lru { .. } => {
                for k in keys.iter().rev() {
                    self.lru_new_rank(*k);
                }
            }
            Policy::Arc { .. } => {
                for k in keys.iter().rev() {
                    let ready = self.chunks.get(k).is_some_and(|c| c.ref_cnt >= 0);
                    let Policy::Arc { t1, t2, .. } = &mut self.policy else {
                        unreachable!("matched above");
                    };
                    if t1.contains(k) {
                        if ready {
                            t1.remove(k);
                            t2.push_back(*k);
                        } else {
                            // Just prepared to be stored, not really touched twice.
                            t1.push_back(*k);
                        }
                    } else if t2.contains(k) {
                        t2.push_back(*k);
                    } else {
                        self.arc_ghost_hit(*k);
                    }
                }
            }
        }
    }

    /// LRU: a fresh global rank for a present key.
    fn lru_new_rank(&mut self, k: OffloadKey) {
        let (Some(c), Policy::Lru { next_rank, .. }) = (self.chunks.get(&k), &mut self.policy)
        else {
            return;
        };
        let idle = c.ref_cnt == 0;
        *next_rank += 1;
        let rank = (*next_rank, 0);
        self.lru_rerank(k, rank, idle);
    }

    /// LRU: gives a ranked key its new rank, keeping the idle index in step.
    fn lru_rerank(&mut self, k: OffloadKey, rank: Rank, idle: bool) {
        if let Policy::Lru {
            ranks, evictable, ..
        } = &mut self.policy
            && let Some(old) = ranks.insert(k, rank)
            && idle
        {
            evictable.remove(&(old, k));
            evictable.insert((rank, k));
        }
    }

    /// ARC: a store miss or touch of a ghost adapts the T1 target.
    fn arc_ghost_hit(&mut self, k: OffloadKey) {
        let capacity = f64::from(self.config.capacity_chunks);
        let Policy::Arc {
            b1,
            b2,
            target_bits,
            ..
        } = &mut self.policy
        else {
            return;
        };
        let target = f64::from_bits(*target_bits);
        if b1.contains(&k) {
            let delta = (b2.len() as f64 / b1.len() as f64).max(1.0);
            *target_bits = (target + delta).min(capacity).to_bits();
            b1.push_back(k);
        } else if b2.contains(&k) {
            let delta = (b1.len() as f64 / b2.len() as f64).max(1.0);
            *target_bits = (target - delta).max(0.0).to_bits();
            b2.push_back(k);
        }
    }

    /// The request context for one call: the named request's, or a fresh one.
    fn take_ctx(&mut self, access: Access<'_>) -> RequestAccess {
        access
            .request
            .and_then(|r| self.requests.remove(&r))
            .unwrap_or_default()
    }

    fn put_ctx(&mut self, access: Access<'_>, ctx: RequestAccess) {
        if let Some(r) = access.request {
            self.requests.insert(r, ctx);
        }
    }

    fn learn_positions(ctx: &mut RequestAccess, keys: &[OffloadKey], access: Access<'_>) {
        if let Some(pos) = access.positions {
            for (k, p) in keys.iter().zip(pos) {
                ctx.positions.insert(*k, *p);
            }
        }
    }

    /// `_record_request_cache_access`: first accesses in order (the LRU's provisional ranks),
    /// and the reused keys that were not inserted by this request. Positions must have been
    /// learnt from the whole call first (`access.positions` is parallel to the call's keys).
    fn record_access(
        &mut self,
        ctx: &mut RequestAccess,
        keys: &[OffloadKey],
        access: Access<'_>,
        reused: &[OffloadKey],
    ) {
        if access.request.is_none() {
            // A fresh scope that is dropped after this call: only the provisional LRU ranks of
            // keys with positions outlive it.
            if !ctx.positions.is_empty() {
                self.lru_request_access(ctx, keys);
            }
            return;
        }
        let mut new_keys = Vec::new();
        for k in keys {
            if ctx.seen.insert(*k) {
                ctx.key_groups.entry(k.group).or_default().push(*k);
                new_keys.push(*k);
            }
        }
        if !new_keys.is_empty() {
            self.lru_request_access(ctx, &new_keys);
        }
        for k in reused {
            if !ctx.inserted.contains(k) {
                ctx.reused.insert(*k);
            }
        }
    }

    fn lru_request_rank(next_rank: &mut u64, ctx: &mut RequestAccess) -> u64 {
        *ctx.lru_rank.get_or_insert_with(|| {
            *next_rank += 1;
            *next_rank
        })
    }

    /// LRU `on_request_access`: present keys with a known position move up to the request's
    /// provisional rank (ranks only move up).
    fn lru_request_access(&mut self, ctx: &mut RequestAccess, keys: &[OffloadKey]) {
        let Policy::Lru { next_rank, .. } = &mut self.policy else {
            return;
        };
        let request_rank = Self::lru_request_rank(next_rank, ctx);
        for k in keys {
            let (Some(&pos), Some(c)) = (ctx.positions.get(k), self.chunks.get(k)) else {
                continue;
            };
            let idle = c.ref_cnt == 0;
            let rank = (request_rank, -i64::from(pos));
            let Policy::Lru { ranks, .. } = &self.policy else {
                unreachable!("matched above");
            };
            if ranks.get(k).is_some_and(|old| *old < rank) {
                self.lru_rerank(*k, rank, idle);
            }
        }
    }

    fn track_offer(&mut self, keys: &[OffloadKey]) {
        // Already tracked keys move to the recent end first and are never dropped by this offer.
        let mut protected: BTreeSet<OffloadKey> = BTreeSet::new();
        for k in keys {
            if let Some(entry) = self.tracker.get_mut(k) {
                self.tracker_order.remove(&(entry.1, *k));
                entry.0 += 1;
                entry.1 = self.tracker_tick;
                self.tracker_order.insert((self.tracker_tick, *k));
                self.tracker_tick += 1;
                protected.insert(*k);
            }
        }
        let mut unprotected = self.tracker.len() - protected.len();
        for k in keys {
            if self.tracker.contains_key(k) {
                continue;
            }
            if self.tracker.len() >= MAX_TRACKER_SIZE {
                if unprotected == 0 {
                    continue;
                }
                if let Some((_, old)) = self.tracker_order.pop_first() {
                    self.tracker.remove(&old);
                }
                unprotected -= 1;
            }
            self.tracker.insert(*k, (1, self.tracker_tick));
            self.tracker_order.insert((self.tracker_tick, *k));
            self.tracker_tick += 1;
        }
    }

    /// Chooses which offered keys need writing, reserves chunks for them (evicting idle keys
    /// outside the offer if the pool is full) and marks them write-pending. `None` = cannot
    /// store now (nothing was evicted or allocated); an empty output = nothing to do. Call once
    /// per chunk batch of a request, then [`Self::complete_store`] when the transfer is done.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Option<PrepareStoreOutput> {
        let threshold = self.config.store_threshold;
        if threshold >= 2 {
            self.track_offer(keys);
        }
        // The offer sorted: duplicate detection and eviction protection by binary search.
        let mut sorted: Vec<OffloadKey> = keys.to_vec();
        sorted.sort_unstable();
        let has_dups = sorted.windows(2).any(|w| w[0] == w[1]);
        let mut candidates: Vec<OffloadKey> = Vec::new();
        let mut ready_existing: Vec<OffloadKey> = Vec::new();
        // Per offered key: recorded as an access of the request (a store candidate that passed
        // the threshold, or a ready key).
        let mut recorded_mask: Vec<bool> = Vec::with_capacity(keys.len());
        for k in keys {
            let recorded = match self.chunks.get(k) {
                None => {
                    let admitted =
                        threshold < 2 || self.tracker.get(k).map_or(0, |e| e.0) >= threshold;
                    if admitted && !(has_dups && candidates.contains(k)) {
                        candidates.push(*k);
                    }
                    admitted
                }
                Some(c) if c.ref_cnt >= 0 => {
                    ready_existing.push(*k);
                    true
                }
                Some(_) => false,
            };
            recorded_mask.push(recorded);
        }
        let scoped = access.request.is_some();
        let mut ctx = self.take_ctx(access);
        Self::learn_positions(&mut ctx, keys, access);
        if matches!(self.policy, Policy::Arc { .. }) {
            // LRU's `on_store_miss` is `touch` of absent keys: nothing to do.
            for k in candidates.iter().rev() {
                if !ctx.store_misses.contains(k) {
                    self.arc_ghost_hit(*k);
                }
            }
        }
        if scoped {
            ctx.store_misses.extend(candidates.iter().copied());
        }
        let recorded: Vec<OffloadKey> = keys
            .iter()
            .zip(&recorded_mask)
            .filter(|(_, r)| **r)
            .map(|(k, _)| *k)
            .collect();
        self.record_access(&mut ctx, &recorded, access, &ready_existing);
        let out = self.allocate(&mut ctx, &sorted, candidates, scoped);
        self.put_ctx(access, ctx);
        out
    }

    fn allocate(
        &mut self,
        ctx: &mut RequestAccess,
        sorted_offer: &[OffloadKey],
        candidates: Vec<OffloadKey>,
        scoped: bool,
    ) -> Option<PrepareStoreOutput> {
        if candidates.is_empty() {
            return Some(PrepareStoreOutput::default());
        }
        let need = candidates
            .len()
            .saturating_sub(self.num_free_chunks() as usize);
        let mut evicted = Vec::new();
        if need > 0 {
            if need > self.evictable as usize {
                return None;
            }
            let victims = self.choose_victims(need, sorted_offer)?;
            for k in &victims {
                let c = self.chunks.remove(k).expect("victims are present");
                self.free.push(c.chunk);
            }
            self.evictable -= victims.len() as u32;
            self.events.push((
                OffloadEvent {
                    keys: victims.clone(),
                    removed: true,
                },
                false,
            ));
            evicted = victims;
        }
        let mut chunks = Vec::with_capacity(candidates.len());
        for k in &candidates {
            let chunk = if self.next_fresh < self.config.capacity_chunks {
                self.next_fresh += 1;
                ChunkId(self.next_fresh - 1)
            } else {
                self.free
                    .pop()
                    .expect("`need` was computed so that enough chunks are free")
            };
            self.chunks.insert(*k, Chunk { ref_cnt: -1, chunk });
            self.policy_insert(ctx, *k);
            chunks.push(chunk);
        }
        self.write_pending += candidates.len() as u32;
        if scoped {
            ctx.inserted.extend(candidates.iter().copied());
        }
        Some(PrepareStoreOutput {
            keys_to_store: candidates,
            chunks,
            evicted,
        })
    }

    fn policy_insert(&mut self, ctx: &mut RequestAccess, k: OffloadKey) {
        match &mut self.policy {
            Policy::Lru {
                ranks, next_rank, ..
            } => {
                let rank = match ctx.positions.get(&k) {
                    Some(&pos) => (Self::lru_request_rank(next_rank, ctx), -i64::from(pos)),
                    None => {
                        *next_rank += 1;
                        (*next_rank, 0)
                    }
                };
                ranks.insert(k, rank);
            }
            Policy::Arc { t1, b1, b2, .. } => {
                t1.push_back(k);
                b1.remove(&k);
                b2.remove(&k);
            }
        }
    }

    /// Exactly `n` idle keys outside `protected` (sorted), without changing anything; `None`
    /// if there are fewer. ARC moves the chosen keys to its ghost lists.
    fn choose_victims(&mut self, n: usize, protected: &[OffloadKey]) -> Option<Vec<OffloadKey>> {
        let chunks = &self.chunks;
        let idle = |k: &OffloadKey| {
            chunks.get(k).is_some_and(|c| c.ref_cnt == 0) && protected.binary_search(k).is_err()
        };
        match &mut self.policy {
            Policy::Lru {
                ranks, evictable, ..
            } => {
                let victims: Vec<OffloadKey> = evictable
                    .iter()
                    .map(|(_, k)| *k)
                    .filter(|k| protected.binary_search(k).is_err())
                    .take(n)
                    .collect();
                if victims.len() < n {
                    return None;
                }
                for k in &victims {
                    let rank = ranks.remove(k).expect("evictable keys are ranked");
                    evictable.remove(&(rank, *k));
                }
                Some(victims)
            }
            Policy::Arc {
                t1,
                t2,
                b1,
                b2,
                target_bits,
            } => {
                let target = f64::from_bits(*target_bits) as usize;
                let chosen = {
                    let mut virtual_t1 = t1.len();
                    let mut from_t1 = t1.iter().filter(|k| idle(k));
                    let mut from_t2 = t2.iter().filter(|k| idle(k));
                    let mut chosen: Vec<(OffloadKey, bool)> = Vec::with_capacity(n);
                    for _ in 0..n {
                        let mut pick = None;
                        if virtual_t1 >= target
                            && let Some(k) = from_t1.next()
                        {
                            pick = Some((k, true));
                            virtual_t1 -= 1;
                        }
                        if pick.is_none()
                            && let Some(k) = from_t2.next()
                        {
                            pick = Some((k, false));
                        }
                        if pick.is_none() {
                            let k = from_t1.next()?;
                            pick = Some((k, true));
                            virtual_t1 -= 1;
                        }
                        chosen.extend(pick);
                    }
                    chosen
                };
                let capacity = self.config.capacity_chunks as usize;
                let mut victims = Vec::with_capacity(n);
                for (k, in_t1) in chosen {
                    if in_t1 {
                        t1.remove(&k);
                        b1.push_back(k);
                    } else {
                        t2.remove(&k);
                        b2.push_back(k);
                    }
                    victims.push(k);
                }
                for ghost in [b1, b2] {
                    while ghost.len() > capacity {
                        ghost.pop_front();
                    }
                }
                Some(victims)
            }
        }
    }

    /// Ends stores: success makes write-pending keys loadable ("stored" event); failure removes
    /// them (a metadata-only removal, published only if the key is still absent when drained).
    /// Keys that are not write-pending are ignored, so repeating a call is harmless.
    pub fn complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        let mut done = Vec::new();
        for k in keys {
            let Some(c) = self.chunks.get_mut(k) else {
                continue;
            };
            if c.ref_cnt != -1 {
                continue;
            }
            self.write_pending -= 1;
            if success {
                c.ref_cnt = 0;
                self.mark_evictable(*k);
            } else {
                let chunk = c.chunk;
                self.chunks.remove(k);
                self.free.push(chunk);
                match &mut self.policy {
                    Policy::Lru { ranks, .. } => {
                        ranks.remove(k);
                    }
                    Policy::Arc { t1, t2, .. } => {
                        if !t1.remove(k) {
                            t2.remove(k);
                        }
                    }
                }
            }
            done.push(*k);
        }
        if !done.is_empty() {
            self.events.push((
                OffloadEvent {
                    keys: done,
                    removed: !success,
                },
                !success,
            ));
        }
    }

    /// No more `prepare_*` for this request (`complete_*` of its jobs may still follow): commits
    /// its accesses to the policy in prefix order (LRU: fresh ranks tail to head; ARC: reused
    /// keys promoted to T2, insert-only keys refreshed in their list).
    pub fn on_request_finished(&mut self, request: RequestId) {
        let Some(ctx) = self.requests.remove(&request) else {
            return;
        };
        let mut ordered: Vec<OffloadKey> = Vec::new();
        for keys in ctx.key_groups.values() {
            let mut keys = keys.clone();
            if keys.iter().all(|k| ctx.positions.contains_key(k)) {
                keys.sort_by_key(|k| ctx.positions[k]);
            }
            ordered.extend(keys);
        }
        // `order_request_keys`: one head-to-tail order across groups when every key has a
        // position.
        if ordered.iter().all(|k| ctx.positions.contains_key(k)) {
            ordered.sort_by_key(|k| ctx.positions[k]);
        }
        match &mut self.policy {
            Policy::Lru { .. } => {
                for k in ordered.iter().rev() {
                    self.lru_new_rank(*k);
                }
            }
            Policy::Arc { t1, t2, .. } => {
                for k in ordered.iter().rev() {
                    let insertion_only = ctx.inserted.contains(k) && !ctx.reused.contains(k);
                    if insertion_only {
                        if t1.contains(k) {
                            t1.push_back(*k);
                        } else if t2.contains(k) {
                            t2.push_back(*k);
                        }
                    } else if ctx.reused.contains(k) {
                        // From T1, or to T2's most recent end.
                        if t1.remove(k) || t2.contains(k) {
                            t2.push_back(*k);
                        }
                    }
                }
            }
        }
    }

    /// The events since the last call, in order: stored (`removed: false`) and removed keys.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        let events = core::mem::take(&mut self.events);
        let mut out = Vec::with_capacity(events.len());
        for (mut e, metadata_only) in events {
            if metadata_only {
                e.keys.retain(|k| !self.chunks.contains_key(k));
                if e.keys.is_empty() {
                    continue;
                }
            }
            out.push(e);
        }
        out
    }

    /// Forgets every chunk (pinned and pending ones too), the policy's state, request scopes
    /// and counters. Pending events are kept, as in vLLM.
    pub fn reset(&mut self) {
        self.chunks.clear();
        self.policy = Self::fresh_policy(self.config.policy);
        self.requests.clear();
        self.next_fresh = 0;
        self.free.clear();
        self.evictable = 0;
        self.write_pending = 0;
    }

    /// Whether the manager has work of its own in flight: never, for the CPU manager.
    pub fn has_pending_work(&self) -> bool {
        false
    }

    /// Chunks neither allocated nor holding a key.
    pub fn num_free_chunks(&self) -> u32 {
        self.config.capacity_chunks - self.next_fresh + self.free.len() as u32
    }

    /// Ready, unpinned keys (evictable).
    pub fn num_evictable(&self) -> u32 {
        self.evictable
    }

    /// Keys whose store is in flight.
    pub fn num_write_pending(&self) -> u32 {
        self.write_pending
    }

    /// I-40: counters equal the chunk table, `ref_cnt ≥ −1`, allocated chunks within capacity,
    /// and the policy holds exactly the present keys.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let idle = self.chunks.values().filter(|c| c.ref_cnt == 0).count();
        let pending = self.chunks.values().filter(|c| c.ref_cnt == -1).count();
        ensure_invariant!(
            self.chunks.values().all(|c| c.ref_cnt >= -1),
            "I-40",
            "ref_cnt below -1"
        );
        ensure_invariant!(
            idle == self.evictable as usize,
            "I-40",
            "evictable {} != idle chunks {}",
            self.evictable,
            idle
        );
        ensure_invariant!(
            pending == self.write_pending as usize,
            "I-40",
            "write_pending {} != pending chunks {}",
            self.write_pending,
            pending
        );
        ensure_invariant!(
            self.chunks.len() + self.free.len() == self.next_fresh as usize
                && self.next_fresh <= self.config.capacity_chunks,
            "I-40",
            "allocated chunks exceed capacity"
        );
        match &self.policy {
            Policy::Lru {
                ranks, evictable, ..
            } => {
                ensure_invariant!(
                    ranks.len() == self.chunks.len() && evictable.len() == idle,
                    "I-40",
                    "LRU ranks {} / evictable {} vs {} keys, {idle} idle",
                    ranks.len(),
                    evictable.len(),
                    self.chunks.len()
                );
            }
            Policy::Arc { t1, t2, .. } => {
                ensure_invariant!(
                    t1.len() + t2.len() == self.chunks.len()
                        && self.chunks.keys().all(|k| t1.contains(k) ^ t2.contains(k)),
                    "I-40",
                    "ARC lists do not hold exactly the present keys"
                );
            }
        }
        Ok(())
    }
}
