//! The CPU offloading manager (vLLM 0.33.0's `CPUOffloadingManager`; SEMANTICS.md §5.2–§5.4, I-40).
//!
//! The scheduler-side offloading connector asks it, per chunk key, whether a chunk is stored
//! ([`CpuOffloadingManager::lookup`]), pins chunks for loads, and reserves chunks for stores,
//! evicting idle chunks when the host pool is full. It is pure: no clocks, no randomness, and
//! only ordered collections, so the model checker can replay it.
//!
//! Status: the chunk state machine, events, the store threshold and a global-counter LRU are in
//! place; request-aware provisional ranks and the ARC policy are not yet (ARC currently behaves
//! as LRU).

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
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Chunk {
    ref_cnt: i32,
    chunk: ChunkId,
    rank: u64,
}

/// The CPU offloading manager (SEMANTICS.md §5.3).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuOffloadingManager {
    config: ManagerConfig,
    chunks: BTreeMap<OffloadKey, Chunk>,
    /// Idle (ref 0) keys by recency rank, lowest evicted first.
    idle: BTreeSet<(u64, OffloadKey)>,
    next_rank: u64,
    next_fresh: u32,
    free: Vec<ChunkId>,
    write_pending: u32,
    events: Vec<OffloadEvent>,
    /// Failed stores: removal published only if the key is still absent when drained.
    failed: Vec<OffloadKey>,
    /// Store-threshold tracker: key → (access count, last access tick).
    tracker: BTreeMap<OffloadKey, (u32, u64)>,
    tracker_order: BTreeSet<(u64, OffloadKey)>,
    tracker_tick: u64,
}

impl CpuOffloadingManager {
    /// Builds an empty manager; fails on an invalid config.
    pub fn new(config: ManagerConfig) -> Result<Self, ManagerError> {
        config.validate()?;
        Ok(Self {
            config,
            chunks: BTreeMap::new(),
            idle: BTreeSet::new(),
            next_rank: 0,
            next_fresh: 0,
            free: Vec::new(),
            write_pending: 0,
            events: Vec::new(),
            failed: Vec::new(),
            tracker: BTreeMap::new(),
            tracker_order: BTreeSet::new(),
            tracker_tick: 0,
        })
    }

    /// Whether `key` is stored: call before `prepare_load` to find the loadable prefix.
    pub fn lookup(&self, key: OffloadKey) -> KeyLookup {
        match self.chunks.get(&key) {
            None => KeyLookup::Miss,
            Some(c) if c.ref_cnt < 0 => KeyLookup::HitPending,
            Some(_) => KeyLookup::Hit,
        }
    }

    /// Pins `keys` for a load until [`Self::complete_load`]. All must be ready; atomic on `Err`.
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        _access: Access<'_>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        for k in keys {
            match self.chunks.get(k) {
                Some(c) if c.ref_cnt >= 0 => {}
                _ => return Err(ManagerError::NotLoadable(*k)),
            }
        }
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(c) = self.chunks.get_mut(k) else {
                unreachable!("checked above: every key is present");
            };
            if c.ref_cnt == 0 {
                self.idle.remove(&(c.rank, *k));
            }
            c.ref_cnt += 1;
            out.push(c.chunk);
        }
        Ok(out)
    }

    /// Unpins what [`Self::prepare_load`] pinned, once the load finished. Atomic on `Err`.
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
            let Some(c) = self.chunks.get_mut(k) else {
                unreachable!("checked above: every key is present");
            };
            c.ref_cnt -= 1;
            if c.ref_cnt == 0 {
                self.idle.insert((c.rank, *k));
            }
        }
        Ok(())
    }

    /// Marks `keys` recently used (also keys served by the GPU prefix cache); the head of the
    /// list ends up most recent. Unknown keys are ignored.
    pub fn touch(&mut self, keys: &[OffloadKey], _access: Access<'_>) {
        for k in keys.iter().rev() {
            self.refresh(*k);
        }
    }

    fn refresh(&mut self, k: OffloadKey) {
        let rank = self.next_rank;
        if let Some(c) = self.chunks.get_mut(&k) {
            self.next_rank += 1;
            if c.ref_cnt == 0 {
                self.idle.remove(&(c.rank, k));
                self.idle.insert((rank, k));
            }
            c.rank = rank;
        }
    }

    fn track(&mut self, k: OffloadKey) -> u32 {
        let tick = self.tracker_tick;
        self.tracker_tick += 1;
        let entry = self.tracker.entry(k).or_insert((0, tick));
        self.tracker_order.remove(&(entry.1, k));
        entry.0 += 1;
        entry.1 = tick;
        let count = entry.0;
        self.tracker_order.insert((tick, k));
        // vLLM's `max_tracker_size` default.
        let bound = 64_000;
        while self.tracker.len() > bound {
            let Some((_, old)) = self.tracker_order.pop_first() else {
                break;
            };
            self.tracker.remove(&old);
        }
        count
    }

    /// Chooses which offered keys need writing, reserves chunks and evicts idle chunks if
    /// needed (SEMANTICS.md §5.3). `None` = cannot store; on `None` nothing changed.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        _access: Access<'_>,
    ) -> Option<PrepareStoreOutput> {
        let threshold = self.config.store_threshold;
        let mut counts = Vec::new();
        if threshold >= 2 {
            counts = keys.iter().map(|k| self.track(*k)).collect();
        }
        let mut candidates: Vec<OffloadKey> = Vec::new();
        // The offer, sorted: duplicate detection and eviction protection by binary search.
        let mut offer: Vec<OffloadKey> = keys.to_vec();
        offer.sort_unstable();
        offer.dedup();
        let mut seen: Vec<OffloadKey> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if self.chunks.contains_key(k) || (threshold >= 2 && counts[i] < threshold) {
                continue;
            }
            if offer.len() == keys.len() || !seen.contains(k) {
                seen.push(*k);
                candidates.push(*k);
            }
        }
        if candidates.is_empty() {
            return Some(PrepareStoreOutput::default());
        }
        let free = self.num_free_chunks() as usize;
        let need = candidates.len().saturating_sub(free);
        let mut evicted = Vec::new();
        if need > 0 {
            let victims: Vec<(u64, OffloadKey)> = self
                .idle
                .iter()
                .filter(|(_, k)| offer.binary_search(k).is_err())
                .take(need)
                .copied()
                .collect();
            if victims.len() < need {
                return None;
            }
            for v in victims {
                self.idle.remove(&v);
                if let Some(c) = self.chunks.remove(&v.1) {
                    self.free.push(c.chunk);
                }
                evicted.push(v.1);
            }
            self.events.push(OffloadEvent {
                keys: evicted.clone(),
                removed: true,
            });
        }
        let mut chunks = Vec::with_capacity(candidates.len());
        for k in &candidates {
            let chunk = if self.next_fresh < self.config.capacity_chunks {
                self.next_fresh += 1;
                ChunkId(self.next_fresh - 1)
            } else {
                let Some(c) = self.free.pop() else {
                    unreachable!("need was computed so that enough chunks are free");
                };
                c
            };
            let rank = self.next_rank;
            self.next_rank += 1;
            self.chunks.insert(
                *k,
                Chunk {
                    ref_cnt: -1,
                    chunk,
                    rank,
                },
            );
            self.write_pending += 1;
            chunks.push(chunk);
        }
        Some(PrepareStoreOutput {
            keys_to_store: candidates,
            chunks,
            evicted,
        })
    }

    /// Reports the end of a store job: on success its write-pending keys become loadable, on
    /// failure they are removed. Keys not write-pending are ignored (idempotent).
    pub fn complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        let mut stored = Vec::new();
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
                self.idle.insert((c.rank, *k));
                stored.push(*k);
            } else {
                let chunk = c.chunk;
                self.chunks.remove(k);
                self.free.push(chunk);
                self.failed.push(*k);
            }
        }
        if !stored.is_empty() {
            self.events.push(OffloadEvent {
                keys: stored,
                removed: false,
            });
        }
    }

    /// Call when a request finished: no more `prepare_*` follow for it.
    pub fn on_request_finished(&mut self, _request: RequestId) {}

    /// Drains the stored/removed events since the last call.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        let failed = core::mem::take(&mut self.failed);
        let gone: Vec<OffloadKey> = failed
            .into_iter()
            .filter(|k| !self.chunks.contains_key(k))
            .collect();
        if !gone.is_empty() {
            self.events.push(OffloadEvent {
                keys: gone,
                removed: true,
            });
        }
        core::mem::take(&mut self.events)
    }

    /// Forgets every chunk (vLLM's `reset_cache`).
    pub fn reset(&mut self) {
        let config = self.config;
        let Ok(fresh) = Self::new(config) else {
            unreachable!("the config was validated when the manager was built");
        };
        *self = fresh;
    }

    /// Whether asynchronous work is outstanding: never, for the CPU manager.
    pub fn has_pending_work(&self) -> bool {
        false
    }

    /// Chunks neither allocated nor reserved.
    pub fn num_free_chunks(&self) -> u32 {
        self.config.capacity_chunks - self.next_fresh + self.free.len() as u32
    }

    /// Ready, unpinned chunks (ref 0).
    pub fn num_evictable(&self) -> u32 {
        self.idle.len() as u32
    }

    /// Chunks reserved by `prepare_store` whose store has not completed.
    pub fn num_write_pending(&self) -> u32 {
        self.write_pending
    }

    /// Checks I-40: counters match the chunk table; chunks ≤ capacity.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let idle = self.chunks.values().filter(|c| c.ref_cnt == 0).count();
        let pending = self.chunks.values().filter(|c| c.ref_cnt == -1).count();
        ensure_invariant!(
            self.chunks.values().all(|c| c.ref_cnt >= -1),
            "I-40",
            "ref_cnt below -1"
        );
        ensure_invariant!(
            idle == self.idle.len(),
            "I-40",
            "evictable {} != idle chunks {}",
            self.idle.len(),
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
        Ok(())
    }
}
