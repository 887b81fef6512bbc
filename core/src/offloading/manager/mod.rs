//! The CPU offloading manager (vLLM 0.33.0's `CPUOffloadingManager`; SEMANTICS.md §5.2–§5.4, I-40).
//!
//! The scheduler-side offloading connector asks it, per chunk key, whether a chunk is stored
//! ([`CpuOffloadingManager::lookup`]), pins chunks for loads, and reserves chunks for stores,
//! evicting idle chunks when the host pool is full. It is pure: no clocks, no randomness, and
//! only ordered collections or a key index with a fixed hash whose order never shows, so the
//! model checker can replay it.
//!
//! Keys live in an arena of nodes that hold their chunk and link into the policy's lists by
//! index (ARC's T1/T2/B1/B2, the LRU's rank order), found through the key index: every
//! operation on a key is O(1) apart from LRU ranks that arrive out of order (a B-tree). A call
//! allocates only what it returns: its working lists live in reused buffers (`scratch.rs`),
//! and a new request's scope takes the storage of a finished one.
//!
//! Two replacement policies sit behind the chunk state machine, as in vLLM: LRU (logical recency
//! with provisional per-request ranks committed at `on_request_finished`) and ARC (T1/T2, ghost
//! lists B1/B2, adaptive T1 target). Both see the same request-scoped accesses: the manager
//! records which keys each request reused (loads, ready keys in a store offer) and which it only
//! inserted, and hands them to the policy when the request finishes.
//!
//! # When the connector calls what
//!
//! | connector (`crate::offloading`) | manager call |
//! | --- | --- |
//! | `get_num_new_matched_tokens` | [`CpuOffloadingManager::lookup`] of each chunk beyond the local hit |
//! | `update_state_after_alloc` | [`CpuOffloadingManager::prepare_load`] of the hit chunks (pins them) |
//! | `build_connector_meta` | [`CpuOffloadingManager::prepare_store`] per store job, then [`CpuOffloadingManager::on_request_finished`] for the finished requests |
//! | `update_connector_output` | [`CpuOffloadingManager::complete_store`] / [`CpuOffloadingManager::complete_load`] once every worker acknowledged a job |
//! | `request_finished` | [`CpuOffloadingManager::on_request_finished`] of a request it does not track |
//! | `take_events` | [`CpuOffloadingManager::take_events`] |
//! | `reset_cache` | [`CpuOffloadingManager::on_request_finished`] of the finished requests, then [`CpuOffloadingManager::reset`] |
//!
//! # Layout
//!
//! Storage and scopes ← policies ← state machine: each file imports only from the rows above it (the
//! invariants and the tests read everything).
//!
//! | file | what |
//! | --- | --- |
//! | `types.rs` | the public vocabulary: [`OffloadKey`], [`ChunkId`], [`ManagerConfig`], [`Access`], outputs, events, errors |
//! | `arena.rs` | the arena of nodes (a key, its chunk, its links), the intrusive list, the key index (sized for a full pool up front) |
//! | `scope.rs` | a request's scope of accesses: the facts per key it touched, its first-access order, its key index |
//! | `lru.rs` | the LRU policy: ranks, the rank order of every stored key, eviction of the idle ones by rank |
//! | `arc.rs` | the ARC policy: T1/T2, ghosts B1/B2, the adaptive target, eviction into the ghosts |
//! | `policy.rs` | `Policy`, LRU or ARC: every event the manager hands a policy |
//! | `scratch.rs` | the working buffers a call reuses, so that it allocates only what it returns |
//! | `mod.rs` | the chunk state machine ([`CpuOffloadingManager`]): chunks and their states, request scopes, the store-threshold tracker, events |
//! | `invariants.rs` | `check_invariants()` (I-40): counters, chunks, arena and index, then the policy's lists |
//! | `tests.rs` | unit tests of the list walk and of I-40 on corrupted managers |

mod arc;
mod arena;
mod invariants;
mod lru;
mod policy;
mod scope;
mod scratch;
mod types;

#[cfg(test)]
mod tests;

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use self::arena::{Arena, Chunk, NIL, Place, mix};
use self::policy::Policy;
use self::scope::RequestAccess;
use self::scratch::{SPARE_SCOPES, Scratch, ScratchBox};
use crate::RequestId;

pub use self::types::{
    Access, ChunkId, KeyLookup, ManagerConfig, ManagerError, OffloadEvent, OffloadKey, PolicyKind,
    PrepareStoreOutput,
};

/// vLLM's `CPUOffloadingManager`: the chunk pool, the per-key chunk states of SEMANTICS.md §5.3,
/// events, the store-threshold tracker, and one replacement policy.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuOffloadingManager {
    config: ManagerConfig,
    /// Stored keys (and ARC ghosts) with their chunks and policy links.
    arena: Arena,
    policy: Policy,
    /// Open request scopes, sorted by request (a map: hashed and compared as a `BTreeMap`
    /// would be, entry by entry in key order; a few at a time, so a sorted vector).
    requests: Vec<(RequestId, RequestAccess)>,
    next_fresh: u32,
    free: Vec<ChunkId>,
    evictable: u32,
    write_pending: u32,
    /// Events in order; `true` marks a metadata-only removal (a failed store), filtered at drain.
    events: Vec<(OffloadEvent, bool)>,
    tracker: BTreeMap<OffloadKey, (u32, u64)>,
    tracker_order: BTreeSet<(u64, OffloadKey)>,
    tracker_tick: u64,
    /// How many keys the tracker keeps (vLLM's `max_tracker_size`).
    max_tracker_size: usize,
    /// Working buffers reused by every call (not state: see `scratch.rs`).
    #[serde(skip)]
    scratch: ScratchBox,
}

/// vLLM's `max_tracker_size` default.
const MAX_TRACKER_SIZE: usize = 64_000;

impl CpuOffloadingManager {
    /// A manager with an empty pool of `config.capacity_chunks` chunks. The arena and its key
    /// index are sized for a full pool (and, for ARC, full ghost lists) up front.
    ///
    /// Refuses ([`ManagerError::BadConfig`]) a pool whose nodes (the chunks, and ARC's ghosts:
    /// three times the chunks) the arena's `u32` slots cannot address, one value of which marks
    /// "none". An empty pool is valid, as in vLLM (its CPU spec builds one when a chunk does not
    /// fit the bytes given): it refuses every store.
    pub fn new(config: ManagerConfig) -> Result<Self, ManagerError> {
        let nodes = Policy::max_nodes(config.policy, config.capacity_chunks);
        if nodes >= u32::MAX as usize {
            return Err(ManagerError::BadConfig(
                "capacity_chunks too large for the arena (ARC: below 2^32 / 3)",
            ));
        }
        Ok(Self {
            config,
            arena: Arena::with_capacity(nodes),
            policy: Policy::new(config.policy),
            requests: Vec::new(),
            next_fresh: 0,
            free: Vec::new(),
            evictable: 0,
            write_pending: 0,
            events: Vec::new(),
            tracker: BTreeMap::new(),
            tracker_order: BTreeSet::new(),
            tracker_tick: 0,
            max_tracker_size: MAX_TRACKER_SIZE,
            scratch: ScratchBox::default(),
        })
    }

    /// The same manager with a store-threshold tracker of `n` keys (vLLM's
    /// `max_tracker_size`; default 64 000). Call right after [`Self::new`].
    pub fn with_max_tracker_size(mut self, n: usize) -> Self {
        self.max_tracker_size = n;
        self
    }

    /// Whether `key` is stored and readable (`Hit`), being written (`HitPending`), or absent.
    #[inline]
    pub fn lookup(&self, key: OffloadKey) -> KeyLookup {
        match self.arena.chunk(&key) {
            None => KeyLookup::Miss,
            Some(c) if c.ref_cnt < 0 => KeyLookup::HitPending,
            Some(_) => KeyLookup::Hit,
        }
    }

    /// The key's `ref_cnt` (−1: being written; n ≥ 0: ready, pinned n times); `None` when
    /// absent. Read-only: for the tiering manager's invariants.
    pub fn ref_count(&self, key: OffloadKey) -> Option<i32> {
        self.arena.chunk(&key).map(|c| c.ref_cnt)
    }

    /// Pins ready keys for a load (no eviction until [`Self::complete_load`]); counts as the
    /// request's reuse of them. Atomic: a key that is absent or not ready changes nothing.
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        let slots = &mut self.scratch.get().slots;
        slots.clear();
        for k in keys {
            match self.arena.slot(k) {
                Some(s)
                    if self.arena.nodes[s as usize]
                        .chunk
                        .is_some_and(|c| c.ref_cnt >= 0) =>
                {
                    slots.push(s);
                }
                _ => return Err(ManagerError::NotLoadable(*k)),
            }
        }
        let mut scratch = self.scratch.take();
        let mut out = Vec::with_capacity(keys.len());
        for &s in &scratch.slots {
            let c = self.arena.nodes[s as usize]
                .chunk
                .as_mut()
                .expect("checked above: every key is stored");
            c.ref_cnt += 1;
            out.push(c.chunk);
            if c.ref_cnt == 1 {
                self.evictable -= 1;
            }
        }
        let (mut ctx, open) = self.take_ctx(access, &mut scratch);
        ctx.admit(keys, &mut scratch.at);
        Self::learn_positions(&mut ctx, &scratch.at, access);
        for (&e, &s) in scratch.at.iter().zip(&scratch.slots) {
            ctx.at(e).slot = s;
        }
        self.record_load(&mut ctx, keys, &mut scratch, access);
        self.put_ctx(open, ctx, &mut scratch);
        self.scratch.put(scratch);
        Ok(out)
    }

    /// Unpins what [`Self::prepare_load`] pinned. Atomic: an unpinned key changes nothing.
    pub fn complete_load(&mut self, keys: &[OffloadKey]) -> Result<(), ManagerError> {
        // One pass unpins; a key not pinned as often as it is named undoes the pass.
        let mut slots = core::mem::take(&mut self.scratch.get().slots);
        slots.clear();
        let mut complete = true;
        for k in keys {
            let chunk = self
                .arena
                .slot(k)
                .and_then(|s| Some((s, self.arena.nodes[s as usize].chunk.as_mut()?)));
            match chunk {
                Some((s, c)) if c.ref_cnt >= 1 => {
                    c.ref_cnt -= 1;
                    self.evictable += u32::from(c.ref_cnt == 0);
                    slots.push(s);
                }
                _ => {
                    complete = false;
                    break;
                }
            }
        }
        if !complete {
            for &s in slots.iter().rev() {
                let c = self.arena.nodes[s as usize]
                    .chunk
                    .as_mut()
                    .expect("unpinned above: stored");
                self.evictable -= u32::from(c.ref_cnt == 0);
                c.ref_cnt += 1;
            }
        }
        self.scratch.get().slots = slots;
        if complete {
            Ok(())
        } else {
            Err(ManagerError::NotPinned(self.first_unpinned(keys)))
        }
    }

    /// The smallest key of a refused `complete_load` that is not pinned as often as it is
    /// named.
    fn first_unpinned(&self, keys: &[OffloadKey]) -> OffloadKey {
        // A key is checked only if it is below the best found so far (few are), by counting
        // its copies: no sort, no allocation.
        let mut best: Option<OffloadKey> = None;
        for k in keys {
            if best.is_some_and(|b| b <= *k) {
                continue;
            }
            // Copies are counted only for a key pinned at all (every key is named at least
            // once).
            let unpinned = self.arena.chunk(k).is_none_or(|c| {
                c.ref_cnt < 1 || c.ref_cnt < keys.iter().filter(|x| *x == k).count() as i32
            });
            if unpinned {
                best = Some(*k);
            }
        }
        best.unwrap_or_else(|| *keys.iter().min().expect("a refused call names a key"))
    }

    /// Marks keys recently used (also keys served by the GPU prefix cache); processed tail to
    /// head so the head ends most recent.
    pub fn touch(&mut self, keys: &[OffloadKey], _access: Access<'_>) {
        self.policy
            .touch(&mut self.arena, keys, self.config.capacity_chunks);
    }

    /// The request scope for one call: the named request's, or a fresh one (dropped after the
    /// call), with its index in `requests` (`None`: the fresh one) for [`Self::put_ctx`].
    /// A new scope takes the storage of a spare one (`scratch`, taken out of the manager for
    /// the call).
    fn take_ctx(
        &mut self,
        access: Access<'_>,
        scratch: &mut Scratch,
    ) -> (RequestAccess, Option<usize>) {
        let (ctx, open) = match access.request {
            Some(r) => match self.requests.binary_search_by_key(&r, |e| e.0) {
                Ok(i) => (core::mem::take(&mut self.requests[i].1), Some(i)),
                Err(i) => {
                    self.requests.insert(i, (r, RequestAccess::default()));
                    (RequestAccess::default(), Some(i))
                }
            },
            None => (RequestAccess::default(), None),
        };
        if ctx.is_blank() {
            (scratch.spare_scopes.pop().unwrap_or(ctx), open)
        } else {
            (ctx, open)
        }
    }

    /// Puts back the scope [`Self::take_ctx`] took (`open`: its index; `requests` has not
    /// changed since).
    fn put_ctx(&mut self, open: Option<usize>, ctx: RequestAccess, scratch: &mut Scratch) {
        match open {
            Some(i) => self.requests[i].1 = ctx,
            None => Self::spare_scope(scratch, ctx),
        }
    }

    /// Keeps a scope that is done with for reuse, if there is room.
    fn spare_scope(scratch: &mut Scratch, mut ctx: RequestAccess) {
        if scratch.spare_scopes.len() < SPARE_SCOPES && !ctx.is_blank() {
            ctx.clear();
            scratch.spare_scopes.push(ctx);
        }
    }

    /// Learns the call's positions (`access.positions`, parallel to the call's keys, whose
    /// scope indices are `at`).
    fn learn_positions(ctx: &mut RequestAccess, at: &[u32], access: Access<'_>) {
        if let Some(pos) = access.positions {
            for (&i, &p) in at.iter().zip(pos) {
                if p != Access::NO_POSITION {
                    ctx.at(i).position = Some(p);
                }
            }
        }
    }

    /// `_record_request_cache_access` of a load: every key of the call (scope indices
    /// `scratch.at`) is accessed — first accesses in order (the LRU's provisional ranks) — and
    /// reused unless this request inserted it. Positions must have been learnt from the whole
    /// call first. (`prepare_store` records its accesses in its own pass over the offer.)
    fn record_load(
        &mut self,
        ctx: &mut RequestAccess,
        keys: &[OffloadKey],
        scratch: &mut Scratch,
        access: Access<'_>,
    ) {
        let Scratch { at, ranked, .. } = scratch;
        ranked.clear();
        if access.request.is_none() {
            // A fresh scope that is dropped after this call: only the provisional LRU ranks of
            // keys with positions outlive it.
            if ctx.has_positions() {
                ranked.extend(
                    (0..keys.len()).filter_map(|i| ctx.at(at[i]).position.map(|p| (keys[i], p))),
                );
                self.policy
                    .on_request_access(&mut self.arena, ranked, &mut ctx.lru_rank);
            }
            return;
        }
        // First accesses, and of them those with a position (for the LRU); every key reused.
        let mut first = false;
        for &e in at.iter() {
            first |= ctx.record(e, true, ranked);
        }
        if first {
            self.policy
                .on_request_access(&mut self.arena, ranked, &mut ctx.lru_rank);
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
            if self.tracker.len() >= self.max_tracker_size {
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
    /// A key offered twice in one call is stored once (vLLM would reserve a chunk per copy and
    /// leak all but the last; the offloading connector never offers a key twice).
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Option<PrepareStoreOutput> {
        let threshold = self.config.store_threshold;
        if threshold >= 2 {
            self.track_offer(keys);
        }
        let mut scratch = self.scratch.take();
        let scoped = access.request.is_some();
        let (mut ctx, open) = self.take_ctx(access, &mut scratch);
        ctx.admit(keys, &mut scratch.at);
        Self::learn_positions(&mut ctx, &scratch.at, access);
        // One pass over the offer finds the store candidates (indices into `keys`, first
        // occurrences) and records the request's accesses (candidates that passed the
        // threshold, and ready keys; ready keys are reused). Stored keys are flagged
        // `offered`: the eviction that makes room for the candidates must not take them. A
        // candidate's scope entry keeps its ghost's slot (`NIL`: none), and the ghosts that
        // react to this store miss are listed in `ghosts`.
        let Scratch {
            at,
            candidates,
            offered,
            ranked,
            ghosts,
            ..
        } = &mut *scratch;
        candidates.clear();
        offered.clear();
        ranked.clear();
        ghosts.clear();
        // An unscoped call without positions records nothing, and an unscoped call records
        // only the provisional LRU ranks of keys with positions (its scope is dropped after
        // the call).
        let records = scoped || access.positions.is_some_and(|p| !p.is_empty());
        // Whether the request accessed a key for the first time.
        let mut first = false;
        for (i, (k, &e)) in keys.iter().zip(at.iter()).enumerate() {
            // Hashed once: a candidate's node is inserted with it.
            let x = mix(k);
            let slot = self.arena.slot_mixed(k, x);
            let stored = slot.and_then(|s| {
                let n = &mut self.arena.nodes[s as usize];
                let c = n.chunk?;
                if !n.offered {
                    n.offered = true;
                    offered.push(s);
                }
                Some((s, c.ref_cnt >= 0))
            });
            let (recorded, reused) = match stored {
                Some((s, ready)) => {
                    ctx.at(e).slot = s;
                    (ready, ready)
                }
                None => {
                    let admitted =
                        threshold < 2 || self.tracker.get(k).map_or(0, |e| e.0) >= threshold;
                    if admitted {
                        let entry = ctx.at(e);
                        if !entry.candidate {
                            entry.candidate = true;
                            candidates.push((i, x));
                            // An absent key may still have a node: an ARC ghost, which reacts
                            // once per request.
                            match slot {
                                Some(s) => {
                                    entry.slot = s;
                                    if !entry.store_miss {
                                        ghosts.push(s);
                                    }
                                }
                                None => entry.slot = NIL,
                            }
                            entry.store_miss |= scoped;
                        }
                    }
                    (admitted, false)
                }
            };
            if !(records && recorded) {
                continue;
            }
            if scoped {
                first |= ctx.record(e, reused, ranked);
            } else if let Some(p) = ctx.at(e).position {
                ranked.push((*k, p));
            }
        }
        // Only ARC has ghosts (LRU's `on_store_miss` is `touch` of absent keys: nothing to
        // do); they react tail to head.
        for &s in ghosts.iter().rev() {
            self.policy
                .on_ghost_miss(&mut self.arena.nodes, s, self.config.capacity_chunks);
        }
        if (scoped && first) || (!scoped && ctx.has_positions()) {
            self.policy
                .on_request_access(&mut self.arena, ranked, &mut ctx.lru_rank);
        }
        let out = self.allocate(&mut ctx, keys, &mut scratch, scoped);
        for &s in &scratch.offered {
            self.arena.nodes[s as usize].offered = false;
        }
        self.put_ctx(open, ctx, &mut scratch);
        self.scratch.put(scratch);
        out
    }

    /// Reserves chunks for `scratch.candidates` (indices into the call's `keys`, scope indices
    /// `scratch.at`, whose entries hold their ghost's slot or `NIL` and are flagged
    /// `candidate`: the flags are cleared here); eviction skips the `offered` keys.
    fn allocate(
        &mut self,
        ctx: &mut RequestAccess,
        keys: &[OffloadKey],
        scratch: &mut Scratch,
        scoped: bool,
    ) -> Option<PrepareStoreOutput> {
        let Scratch {
            at,
            candidates,
            slots,
            ..
        } = scratch;
        if candidates.is_empty() {
            return Some(PrepareStoreOutput::default());
        }
        let need = candidates
            .len()
            .saturating_sub(self.num_free_chunks() as usize);
        let mut evicted = Vec::new();
        // Slots the eviction frees past this mark are reset after the loop unless reused.
        let free_mark = self.arena.free_slots.len();
        if need > 0 {
            let victims = if need > self.evictable as usize {
                None
            } else {
                self.policy.evict(
                    &mut self.arena,
                    &mut self.free,
                    need,
                    self.config.capacity_chunks,
                    slots,
                )
            };
            let Some(victims) = victims else {
                for &(i, _) in candidates.iter() {
                    ctx.at(at[i]).candidate = false;
                }
                return None;
            };
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
        // Fresh chunks first, then freed ones, most recently freed first.
        let capacity = self.config.capacity_chunks;
        let mut keys_to_store = Vec::with_capacity(candidates.len());
        let mut chunks = Vec::with_capacity(candidates.len());
        for &(i, x) in candidates.iter() {
            let chunk = if self.next_fresh < capacity {
                self.next_fresh += 1;
                ChunkId(self.next_fresh - 1)
            } else {
                self.free
                    .pop()
                    .expect("`need` was computed so that enough chunks are free")
            };
            let k = keys[i];
            keys_to_store.push(k);
            chunks.push(chunk);
            let chunk = Some(Chunk { ref_cnt: -1, chunk });
            let entry = ctx.at(at[i]);
            // The ghost's node, unless the eviction trimmed it (its slot is then free, or
            // another candidate's); an absent key gained no node since the offer was read.
            let ghost = entry.slot;
            let s = match self.arena.nodes.get_mut(ghost as usize) {
                Some(n) if n.key == k && n.place != Place::Free => {
                    n.chunk = chunk;
                    self.arena.stored += 1;
                    ghost
                }
                _ => self.arena.alloc(k, chunk, x),
            };
            entry.slot = s;
            entry.inserted |= scoped;
            entry.candidate = false;
            let position = entry.position;
            self.policy
                .insert(&mut self.arena.nodes, s, position, &mut ctx.lru_rank);
        }
        self.arena.scrub_free(free_mark);
        self.write_pending += candidates.len() as u32;
        Some(PrepareStoreOutput {
            keys_to_store,
            chunks,
            evicted,
        })
    }

    /// Ends stores: success makes write-pending keys loadable ("stored" event); failure removes
    /// them (a metadata-only removal, published only if the key is still absent when drained).
    /// Keys that are not write-pending are ignored, so repeating a call is harmless.
    pub fn complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        // Sized for every key at once (a repeated call, which completes none, drops it unused).
        let mut done = Vec::with_capacity(keys.len());
        let arena = &mut self.arena;
        for k in keys {
            let Some(s) = arena.slot(k) else {
                continue;
            };
            let node = &mut arena.nodes[s as usize];
            let Some(c) = node.chunk.as_mut() else {
                continue;
            };
            if c.ref_cnt != -1 {
                continue;
            }
            if success {
                c.ref_cnt = 0;
            } else {
                self.free.push(c.chunk);
                node.chunk = None;
                arena.stored -= 1;
                self.policy.on_store_failed(&mut arena.nodes, s);
                arena.release(s);
            }
            done.push(*k);
        }
        if done.is_empty() {
            return;
        }
        self.write_pending -= done.len() as u32;
        if success {
            self.evictable += done.len() as u32;
        }
        self.events.push((
            OffloadEvent {
                keys: done,
                removed: !success,
            },
            !success,
        ));
    }

    /// Requests with an open access scope: they were named by a `prepare_*`/`touch` call and
    /// [`CpuOffloadingManager::on_request_finished`] has not been called for them since.
    pub fn scoped_requests(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.requests.iter().map(|e| e.0)
    }

    /// No more `prepare_*` for this request (`complete_*` of its jobs may still follow): commits
    /// its accesses to the policy in prefix order (LRU: fresh ranks tail to head; ARC: reused
    /// keys promoted to T2, insert-only keys refreshed in their list).
    pub fn on_request_finished(&mut self, request: RequestId) {
        let Ok(i) = self.requests.binary_search_by_key(&request, |e| e.0) else {
            return;
        };
        let ctx = self.requests.remove(i).1;
        match ctx.first_access_commits() {
            Some(ordered) => self
                .policy
                .on_request_finished(&mut self.arena, ordered, &ctx),
            None => {
                let mut ordered = core::mem::take(&mut self.scratch.get().order);
                ctx.commit_order(&mut ordered);
                self.policy
                    .on_request_finished(&mut self.arena, &ordered, &ctx);
                self.scratch.get().order = ordered;
            }
        }
        Self::spare_scope(self.scratch.get(), ctx);
    }

    /// The events since the last call, in order: stored (`removed: false`) and removed keys.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        // Drained in place: the buffer keeps its storage for the next events.
        let mut out = Vec::with_capacity(self.events.len());
        let arena = &self.arena;
        for (mut e, metadata_only) in self.events.drain(..) {
            if metadata_only {
                e.keys.retain(|k| arena.chunk(k).is_none());
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
        self.arena.clear();
        self.policy = Policy::new(self.config.policy);
        self.requests.clear();
        self.next_fresh = 0;
        self.free.clear();
        self.evictable = 0;
        self.write_pending = 0;
    }

    /// The configuration.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// Keys held but neither evictable nor being written: pinned by loads in flight (or by
    /// requests whose scope holds them). Zero when nothing is in flight.
    pub fn num_pinned(&self) -> u32 {
        self.config.capacity_chunks - self.num_free_chunks() - self.evictable - self.write_pending
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

    /// How many offers of `key` the store-threshold tracker counts (0: untracked; always 0
    /// below a threshold of 2). Read-only: for callers reporting vLLM's skipped-store figures.
    pub fn offer_count(&self, key: OffloadKey) -> u32 {
        self.tracker.get(&key).map_or(0, |e| e.0)
    }

    /// The store-threshold tracker's keys with their offer counts, least recently offered
    /// first (vLLM's `counts`, an `OrderedDict`). Read-only.
    pub fn tracked_offers(&self) -> impl ExactSizeIterator<Item = (OffloadKey, u32)> + '_ {
        self.tracker_order
            .iter()
            .map(|(_, k)| (*k, self.tracker.get(k).map_or(0, |e| e.0)))
    }

    /// Every key the manager may still name: the arena's (stored, being stored, ARC ghosts, and
    /// slots freed but not yet cleared), the store-threshold tracker's and the open request
    /// scopes'; a key may come more than once. For an embedder that maps its own keys to
    /// [`OffloadKey`]s: a mapping whose key is not among these can be freed (the Python
    /// package's key table does, in sweeps). Read-only.
    pub fn referenced_keys(&self) -> impl Iterator<Item = OffloadKey> + '_ {
        let arena = self.arena.nodes.iter().map(|n| n.key);
        let scopes = self.requests.iter().flat_map(|(_, scope)| scope.keys());
        arena.chain(self.tracker.keys().copied()).chain(scopes)
    }

    /// Keys whose store is in flight.
    pub fn num_write_pending(&self) -> u32 {
        self.write_pending
    }
}
