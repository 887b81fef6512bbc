//! The CPU offloading manager (vLLM 0.33.0's `CPUOffloadingManager`; SEMANTICS.md §5.2–§5.4, I-40).
//!
//! The scheduler-side offloading connector asks it, per chunk key, whether a chunk is stored
//! ([`CpuOffloadingManager::lookup`]), pins chunks for loads, and reserves chunks for stores,
//! evicting idle chunks when the host pool is full. It is pure: no clocks, no randomness, and
//! only ordered collections or a key index with a fixed hash whose order never shows, so the
//! model checker can replay it.
//!
//! Keys live in an arena of nodes that hold their chunk and link into the policy's lists by
//! index (ARC's T1/T2/B1/B2, the LRU's idle order), found through the key index: every
//! operation on a key is O(1) apart from LRU ranks that arrive out of order (a B-tree).
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

/// A key's chunk: `ref_cnt` −1 = write pending, 0 = ready and idle, n ≥ 1 = pinned by n loads.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Chunk {
    ref_cnt: i32,
    chunk: ChunkId,
}

/// The end of a link, and an empty index entry: no node.
const NIL: u32 = u32::MAX;

/// LRU recency: `(rank, minor)`, lowest evicted first. Global ranks have minor 0; a request's
/// provisional rank is `(request rank, −position)`, so tails go before heads.
type Rank = (u64, i64);

/// Where a node of the arena is linked.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
enum Place {
    /// A free slot of the arena.
    Free,
    /// A key linked into no list (LRU: pinned or write-pending).
    Unlinked,
    /// LRU: idle, in the rank-ordered idle list.
    IdleList,
    /// LRU: idle, in the idle tree (ranks that arrived between the list's ends).
    IdleTree,
    /// ARC: stored, seen once.
    T1,
    /// ARC: stored, seen again.
    T2,
    /// ARC: ghost evicted from T1.
    B1,
    /// ARC: ghost evicted from T2.
    B2,
}

/// One key the manager knows: a stored (or being-stored) chunk, or an ARC ghost. Nodes live in
/// an arena (`Vec`) and link into the policy's lists by index.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Node {
    key: OffloadKey,
    /// `None` for an ARC ghost (a key in B1 or B2).
    chunk: Option<Chunk>,
    place: Place,
    prev: u32,
    next: u32,
    /// The LRU rank (unused by ARC).
    rank: Rank,
}

impl Node {
    const FREE: Node = Node {
        key: OffloadKey {
            hash: BlockHash(0),
            group: 0,
        },
        chunk: None,
        place: Place::Free,
        prev: NIL,
        next: NIL,
        rank: (0, 0),
    };

    /// The LRU eviction order: rank, then key.
    fn order(&self) -> (Rank, OffloadKey) {
        (self.rank, self.key)
    }
}

/// An intrusive doubly linked list of arena nodes (Python's `OrderedDict` as the policies use
/// it): O(1) move to the most recent end, removal, and iteration from the least recent end.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct List {
    head: u32,
    tail: u32,
    len: u32,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    fn push_back(&mut self, nodes: &mut [Node], s: u32, place: Place) {
        let n = &mut nodes[s as usize];
        n.prev = self.tail;
        n.next = NIL;
        n.place = place;
        if self.tail == NIL {
            self.head = s;
        } else {
            nodes[self.tail as usize].next = s;
        }
        self.tail = s;
        self.len += 1;
    }

    fn push_front(&mut self, nodes: &mut [Node], s: u32, place: Place) {
        let n = &mut nodes[s as usize];
        n.prev = NIL;
        n.next = self.head;
        n.place = place;
        if self.head == NIL {
            self.tail = s;
        } else {
            nodes[self.head as usize].prev = s;
        }
        self.head = s;
        self.len += 1;
    }

    /// Unlinks a node of this list (its place becomes `Unlinked`).
    fn unlink(&mut self, nodes: &mut [Node], s: u32) {
        let (prev, next) = (nodes[s as usize].prev, nodes[s as usize].next);
        if prev == NIL {
            self.head = next;
        } else {
            nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            nodes[next as usize].prev = prev;
        }
        let n = &mut nodes[s as usize];
        n.prev = NIL;
        n.next = NIL;
        n.place = Place::Unlinked;
        self.len -= 1;
    }

    /// Moves a node of this list to the most recent end.
    fn move_to_back(&mut self, nodes: &mut [Node], s: u32) {
        if self.tail != s {
            let place = nodes[s as usize].place;
            self.unlink(nodes, s);
            self.push_back(nodes, s, place);
        }
    }

    /// The nodes from the least recent end, checking the links (for the invariants).
    fn collect(&self, nodes: &[Node]) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(self.len as usize);
        let mut prev = NIL;
        let mut s = self.head;
        while s != NIL {
            let n = nodes.get(s as usize)?;
            if n.prev != prev || out.len() >= self.len as usize {
                return None;
            }
            out.push(s);
            prev = s;
            s = n.next;
        }
        (prev == self.tail && out.len() == self.len as usize).then_some(out)
    }
}

/// One entry of the key index: a key and its arena slot (`NIL` = empty).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct IndexEntry {
    hash: u64,
    group: u32,
    slot: u32,
}

const EMPTY_ENTRY: IndexEntry = IndexEntry {
    hash: 0,
    group: 0,
    slot: NIL,
};

/// Key → arena slot: open addressing with linear probing and backward-shift deletion under a
/// fixed (unseeded) mixer, so it is deterministic. It is never iterated for behaviour: every
/// order the manager shows comes from the policy's lists.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct KeyIndex {
    table: Vec<IndexEntry>,
    len: usize,
}

impl KeyIndex {
    fn mix(hash: u64, group: u32) -> u64 {
        // splitmix64's finaliser.
        let mut x = hash ^ u64::from(group).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 30;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 27;
        x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    fn home(&self, hash: u64, group: u32) -> usize {
        Self::mix(hash, group) as usize & (self.table.len() - 1)
    }

    fn find(&self, k: &OffloadKey) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        let mask = self.table.len() - 1;
        let mut i = self.home(k.hash.0, k.group);
        loop {
            let e = &self.table[i];
            if e.slot == NIL {
                return None;
            }
            if e.hash == k.hash.0 && e.group == k.group {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    fn get(&self, k: &OffloadKey) -> Option<u32> {
        self.find(k).map(|i| self.table[i].slot)
    }

    /// Inserts a key that is not in the index.
    fn insert(&mut self, k: &OffloadKey, slot: u32) {
        if (self.len + 1) * 2 > self.table.len() {
            self.grow();
        }
        self.place(IndexEntry {
            hash: k.hash.0,
            group: k.group,
            slot,
        });
        self.len += 1;
    }

    fn place(&mut self, e: IndexEntry) {
        let mask = self.table.len() - 1;
        let mut i = self.home(e.hash, e.group);
        while self.table[i].slot != NIL {
            i = (i + 1) & mask;
        }
        self.table[i] = e;
    }

    fn grow(&mut self) {
        let cap = (self.table.len() * 2).max(64);
        let old = core::mem::replace(&mut self.table, alloc::vec![EMPTY_ENTRY; cap]);
        for e in old {
            if e.slot != NIL {
                self.place(e);
            }
        }
    }

    fn remove(&mut self, k: &OffloadKey) -> Option<u32> {
        let mut gap = self.find(k)?;
        let slot = self.table[gap].slot;
        let mask = self.table.len() - 1;
        let mut j = gap;
        loop {
            j = (j + 1) & mask;
            let e = self.table[j];
            if e.slot == NIL {
                break;
            }
            // `e` may fill the gap unless its home lies cyclically in (gap, j].
            let home = self.home(e.hash, e.group);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(gap) & mask {
                self.table[gap] = e;
                gap = j;
            }
        }
        self.table[gap] = EMPTY_ENTRY;
        self.len -= 1;
        Some(slot)
    }
}

/// The arena of nodes and the key index over it.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Arena {
    nodes: Vec<Node>,
    free_slots: Vec<u32>,
    index: KeyIndex,
    /// Nodes holding a chunk.
    stored: u32,
}

impl Arena {
    fn slot(&self, k: &OffloadKey) -> Option<u32> {
        self.index.get(k)
    }

    /// The chunk of a stored key.
    fn chunk(&self, k: &OffloadKey) -> Option<Chunk> {
        self.slot(k).and_then(|s| self.nodes[s as usize].chunk)
    }

    /// A node for a key without one, unlinked and without chunk.
    fn alloc(&mut self, key: OffloadKey) -> u32 {
        let node = Node {
            key,
            place: Place::Unlinked,
            ..Node::FREE
        };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.insert(&key, s);
        s
    }

    /// Frees an unlinked node without chunk.
    fn release(&mut self, s: u32) {
        let key = self.nodes[s as usize].key;
        self.index.remove(&key);
        self.nodes[s as usize] = Node::FREE;
        self.free_slots.push(s);
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// The replacement policy's own state (vLLM's `LRUCachePolicy` / `ARCCachePolicy`); the keys'
/// links and ranks live in the arena's nodes.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
enum Policy {
    Lru {
        /// Idle keys by `(rank, key)` (vLLM's lazy heap, kept exact), split in two: a sorted
        /// list taking the keys that arrive beyond either end (the common case: a fresh rank),
        /// and a tree for the rest. Eviction merges the two.
        idle: List,
        idle_tree: BTreeSet<(Rank, OffloadKey, u32)>,
        next_rank: u64,
    },
    Arc {
        t1: List,
        t2: List,
        b1: List,
        b2: List,
        /// `target_t1_size`, an f64 kept as its bits so the manager stays `Eq + Hash`.
        target_bits: u64,
    },
}

/// LRU: adds an idle key to the idle order.
fn idle_insert(
    nodes: &mut [Node],
    idle: &mut List,
    tree: &mut BTreeSet<(Rank, OffloadKey, u32)>,
    s: u32,
) {
    let o = nodes[s as usize].order();
    if idle.tail == NIL || nodes[idle.tail as usize].order() < o {
        idle.push_back(nodes, s, Place::IdleList);
    } else if o < nodes[idle.head as usize].order() {
        idle.push_front(nodes, s, Place::IdleList);
    } else {
        tree.insert((o.0, o.1, s));
        nodes[s as usize].place = Place::IdleTree;
    }
}

/// LRU: takes a key out of the idle order (no-op for a key that is not idle).
fn idle_remove(
    nodes: &mut [Node],
    idle: &mut List,
    tree: &mut BTreeSet<(Rank, OffloadKey, u32)>,
    s: u32,
) {
    let n = &mut nodes[s as usize];
    match n.place {
        Place::IdleList => idle.unlink(nodes, s),
        Place::IdleTree => {
            tree.remove(&(n.rank, n.key, s));
            n.place = Place::Unlinked;
        }
        _ => {}
    }
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
    /// Stored keys (and ARC ghosts) with their chunks and policy links.
    arena: Arena,
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
            arena: Arena::default(),
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
                idle: List::EMPTY,
                idle_tree: BTreeSet::new(),
                next_rank: 0,
            },
            PolicyKind::Arc => Policy::Arc {
                t1: List::EMPTY,
                t2: List::EMPTY,
                b1: List::EMPTY,
                b2: List::EMPTY,
                target_bits: 0f64.to_bits(),
            },
        }
    }

    /// Whether `key` is stored and readable (`Hit`), being written (`HitPending`), or absent.
    pub fn lookup(&self, key: OffloadKey) -> KeyLookup {
        match self.arena.chunk(&key) {
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
            match self.arena.chunk(k) {
                Some(c) if c.ref_cnt >= 0 => {}
                _ => return Err(ManagerError::NotLoadable(*k)),
            }
        }
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let s = self
                .arena
                .slot(k)
                .expect("checked above: every key is present");
            let nodes = &mut self.arena.nodes;
            let c = nodes[s as usize]
                .chunk
                .as_mut()
                .expect("checked above: every key is stored");
            c.ref_cnt += 1;
            out.push(c.chunk);
            if c.ref_cnt == 1 {
                self.evictable -= 1;
                if let Policy::Lru {
                    idle, idle_tree, ..
                } = &mut self.policy
                {
                    idle_remove(nodes, idle, idle_tree, s);
                }
            }
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
            match self.arena.chunk(k) {
                Some(c) if c.ref_cnt >= *n => {}
                _ => return Err(ManagerError::NotPinned(*k)),
            }
        }
        for k in keys {
            let s = self
                .arena
                .slot(k)
                .expect("checked above: every key is present");
            let c = self.arena.nodes[s as usize]
                .chunk
                .as_mut()
                .expect("checked above: every key is stored");
            c.ref_cnt -= 1;
            if c.ref_cnt == 0 {
                self.mark_evictable(s);
            }
        }
        Ok(())
    }

    fn mark_evictable(&mut self, s: u32) {
        self.evictable += 1;
        if let Policy::Lru {
            idle, idle_tree, ..
        } = &mut self.policy
        {
            idle_insert(&mut self.arena.nodes, idle, idle_tree, s);
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
            Policy::Arc {
                t1,
                t2,
                b1,
                b2,
                target_bits,
            } => {
                let nodes = &mut self.arena.nodes;
                for k in keys.iter().rev() {
                    let Some(s) = self.arena.index.get(k) else {
                        continue;
                    };
                    let n = &nodes[s as usize];
                    let ready = n.chunk.is_some_and(|c| c.ref_cnt >= 0);
                    match n.place {
                        Place::T1 if ready => {
                            t1.unlink(nodes, s);
                            t2.push_back(nodes, s, Place::T2);
                        }
                        // Just prepared to be stored, not really touched twice.
                        Place::T1 => t1.move_to_back(nodes, s),
                        Place::T2 => t2.move_to_back(nodes, s),
                        _ => arc_ghost_hit(
                            nodes,
                            b1,
                            b2,
                            target_bits,
                            self.config.capacity_chunks,
                            s,
                        ),
                    }
                }
            }
        }
    }

    /// LRU: a fresh global rank for a present key.
    fn lru_new_rank(&mut self, k: OffloadKey) {
        let (Some(s), Policy::Lru { next_rank, .. }) = (self.arena.slot(&k), &mut self.policy)
        else {
            return;
        };
        *next_rank += 1;
        let rank = (*next_rank, 0);
        self.lru_rerank(s, rank);
    }

    /// LRU: gives a stored key its new rank, keeping the idle order in step.
    fn lru_rerank(&mut self, s: u32, rank: Rank) {
        let Policy::Lru {
            idle, idle_tree, ..
        } = &mut self.policy
        else {
            return;
        };
        let nodes = &mut self.arena.nodes;
        let was_idle = matches!(nodes[s as usize].place, Place::IdleList | Place::IdleTree);
        if was_idle {
            idle_remove(nodes, idle, idle_tree, s);
        }
        nodes[s as usize].rank = rank;
        if was_idle {
            idle_insert(nodes, idle, idle_tree, s);
        }
    }

    /// ARC: a store miss or touch of a ghost adapts the T1 target.
    fn arc_ghost_hit_key(&mut self, k: &OffloadKey) {
        let Some(s) = self.arena.slot(k) else {
            return;
        };
        if let Policy::Arc {
            b1,
            b2,
            target_bits,
            ..
        } = &mut self.policy
        {
            arc_ghost_hit(
                &mut self.arena.nodes,
                b1,
                b2,
                target_bits,
                self.config.capacity_chunks,
                s,
            );
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
            let (Some(&pos), Some(s)) = (ctx.positions.get(k), self.arena.slot(k)) else {
                continue;
            };
            let rank = (request_rank, -i64::from(pos));
            if self.arena.nodes[s as usize].rank < rank {
                self.lru_rerank(s, rank);
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
        // The offer sorted: duplicate detection and eviction protection by binary search.
        let mut sorted: Vec<OffloadKey> = keys.to_vec();
        sorted.sort_unstable();
        let has_dups = sorted.windows(2).any(|w| w[0] == w[1]);
        let mut candidates: Vec<OffloadKey> = Vec::new();
        let mut ready_existing: Vec<OffloadKey> = Vec::new();
        // The offered keys recorded as accesses of the request: store candidates that passed
        // the threshold, and ready keys.
        let mut recorded: Vec<OffloadKey> = Vec::new();
        // An unscoped call without positions records nothing (see `record_access`).
        let records = access.request.is_some() || access.positions.is_some_and(|p| !p.is_empty());
        // Whether a candidate has a node (an ARC ghost); if none has, none gains one before
        // `allocate` (ghost hits and evictions create no nodes), so their lookups are skipped.
        let mut ghost_candidates = false;
        for k in keys {
            let slot = self.arena.slot(k);
            match slot.and_then(|s| self.arena.nodes[s as usize].chunk) {
                None => {
                    let admitted =
                        threshold < 2 || self.tracker.get(k).map_or(0, |e| e.0) >= threshold;
                    if admitted {
                        ghost_candidates |= slot.is_some();
                        if !(has_dups && candidates.contains(k)) {
                            candidates.push(*k);
                        }
                        if records {
                            recorded.push(*k);
                        }
                    }
                }
                Some(c) if c.ref_cnt >= 0 => {
                    if records {
                        ready_existing.push(*k);
                        recorded.push(*k);
                    }
                }
                Some(_) => {}
            }
        }
        let scoped = access.request.is_some();
        let mut ctx = self.take_ctx(access);
        Self::learn_positions(&mut ctx, keys, access);
        if ghost_candidates {
            // Only ARC has ghosts. LRU's `on_store_miss` is `touch` of absent keys: nothing to do.
            for k in candidates.iter().rev() {
                if !ctx.store_misses.contains(k) {
                    self.arc_ghost_hit_key(k);
                }
            }
        }
        if scoped {
            ctx.store_misses.extend(candidates.iter().copied());
        }
        self.record_access(&mut ctx, &recorded, access, &ready_existing);
        let out = self.allocate(&mut ctx, &sorted, candidates, ghost_candidates, scoped);
        self.put_ctx(access, ctx);
        out
    }

    fn allocate(
        &mut self,
        ctx: &mut RequestAccess,
        sorted_offer: &[OffloadKey],
        candidates: Vec<OffloadKey>,
        ghost_candidates: bool,
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
            let victims = self.evict(need, sorted_offer)?;
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
            // An absent key may still have a node: an ARC ghost.
            let ghost = if ghost_candidates {
                self.arena.slot(k)
            } else {
                None
            };
            let s = match ghost {
                Some(s) => s,
                None => self.arena.alloc(*k),
            };
            self.arena.nodes[s as usize].chunk = Some(Chunk { ref_cnt: -1, chunk });
            self.arena.stored += 1;
            self.policy_insert(ctx, s);
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

    fn policy_insert(&mut self, ctx: &mut RequestAccess, s: u32) {
        let nodes = &mut self.arena.nodes;
        match &mut self.policy {
            Policy::Lru { next_rank, .. } => {
                let k = nodes[s as usize].key;
                nodes[s as usize].rank = match ctx.positions.get(&k) {
                    Some(&pos) => (Self::lru_request_rank(next_rank, ctx), -i64::from(pos)),
                    None => {
                        *next_rank += 1;
                        (*next_rank, 0)
                    }
                };
            }
            Policy::Arc { t1, b1, b2, .. } => {
                match nodes[s as usize].place {
                    Place::B1 => b1.unlink(nodes, s),
                    Place::B2 => b2.unlink(nodes, s),
                    _ => {}
                }
                t1.push_back(nodes, s, Place::T1);
            }
        }
    }

    /// Evicts exactly `n` idle keys outside `protected` (sorted) and frees their chunks,
    /// returning them in eviction order; `None` (nothing changed) if there are fewer. ARC moves
    /// the evicted keys to its ghost lists.
    fn evict(&mut self, n: usize, protected: &[OffloadKey]) -> Option<Vec<OffloadKey>> {
        let arena = &mut self.arena;
        let mut victims = Vec::with_capacity(n);
        match &mut self.policy {
            Policy::Lru {
                idle, idle_tree, ..
            } => {
                let mut slots: Vec<u32> = Vec::with_capacity(n);
                let mut cursor = idle.head;
                let mut tree = idle_tree.iter().peekable();
                while slots.len() < n {
                    let from_list = match (cursor, tree.peek()) {
                        (NIL, None) => break,
                        (NIL, Some(_)) => false,
                        (_, None) => true,
                        (c, Some(t)) => arena.nodes[c as usize].order() < (t.0, t.1),
                    };
                    let s = if from_list {
                        let s = cursor;
                        cursor = arena.nodes[s as usize].next;
                        s
                    } else {
                        tree.next().expect("peeked").2
                    };
                    if protected
                        .binary_search(&arena.nodes[s as usize].key)
                        .is_err()
                    {
                        slots.push(s);
                    }
                }
                if slots.len() < n {
                    return None;
                }
                for s in slots {
                    idle_remove(&mut arena.nodes, idle, idle_tree, s);
                    let node = &mut arena.nodes[s as usize];
                    let chunk = node.chunk.take().expect("idle keys are stored");
                    victims.push(node.key);
                    self.free.push(chunk.chunk);
                    arena.stored -= 1;
                    arena.release(s);
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
                    let nodes = &arena.nodes;
                    let idle = |s: u32| {
                        let n = &nodes[s as usize];
                        n.chunk.is_some_and(|c| c.ref_cnt == 0)
                            && protected.binary_search(&n.key).is_err()
                    };
                    // The next idle node from a cursor, advancing it past that node.
                    let next_idle = |cursor: &mut u32| {
                        while *cursor != NIL {
                            let s = *cursor;
                            *cursor = nodes[s as usize].next;
                            if idle(s) {
                                return Some(s);
                            }
                        }
                        None
                    };
                    let mut virtual_t1 = t1.len as usize;
                    let (mut c1, mut c2) = (t1.head, t2.head);
                    let mut chosen: Vec<(u32, bool)> = Vec::with_capacity(n);
                    for _ in 0..n {
                        let mut pick = None;
                        if virtual_t1 >= target
                            && let Some(s) = next_idle(&mut c1)
                        {
                            pick = Some((s, true));
                            virtual_t1 -= 1;
                        }
                        if pick.is_none()
                            && let Some(s) = next_idle(&mut c2)
                        {
                            pick = Some((s, false));
                        }
                        if pick.is_none() {
                            let s = next_idle(&mut c1)?;
                            pick = Some((s, true));
                            virtual_t1 -= 1;
                        }
                        chosen.extend(pick);
                    }
                    chosen
                };
                for (s, in_t1) in chosen {
                    if in_t1 {
                        t1.unlink(&mut arena.nodes, s);
                        b1.push_back(&mut arena.nodes, s, Place::B1);
                    } else {
                        t2.unlink(&mut arena.nodes, s);
                        b2.push_back(&mut arena.nodes, s, Place::B2);
                    }
                    let node = &mut arena.nodes[s as usize];
                    let chunk = node.chunk.take().expect("idle keys are stored");
                    victims.push(node.key);
                    self.free.push(chunk.chunk);
                    arena.stored -= 1;
                }
                let capacity = self.config.capacity_chunks;
                for ghost in [b1, b2] {
                    while ghost.len > capacity {
                        let s = ghost.head;
                        ghost.unlink(&mut arena.nodes, s);
                        arena.release(s);
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
            let Some(s) = self.arena.slot(k) else {
                continue;
            };
            let node = &mut self.arena.nodes[s as usize];
            let Some(c) = node.chunk.as_mut() else {
                continue;
            };
            if c.ref_cnt != -1 {
                continue;
            }
            self.write_pending -= 1;
            if success {
                c.ref_cnt = 0;
                self.mark_evictable(s);
            } else {
                self.free.push(c.chunk);
                node.chunk = None;
                self.arena.stored -= 1;
                match (&mut self.policy, node.place) {
                    (Policy::Arc { t1, .. }, Place::T1) => t1.unlink(&mut self.arena.nodes, s),
                    (Policy::Arc { t2, .. }, Place::T2) => t2.unlink(&mut self.arena.nodes, s),
                    _ => {}
                }
                self.arena.release(s);
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

    /// Requests with an open access scope: they were named by a `prepare_*`/`touch` call and
    /// [`CpuOffloadingManager::on_request_finished`] has not been called for them since.
    pub fn scoped_requests(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.requests.keys().copied()
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
                let nodes = &mut self.arena.nodes;
                for k in ordered.iter().rev() {
                    let Some(s) = self.arena.index.get(k) else {
                        continue;
                    };
                    let place = nodes[s as usize].place;
                    let reused = ctx.reused.contains(k);
                    if ctx.inserted.contains(k) && !reused {
                        // Insert-only: refreshed in its list.
                        match place {
                            Place::T1 => t1.move_to_back(nodes, s),
                            Place::T2 => t2.move_to_back(nodes, s),
                            _ => {}
                        }
                    } else if reused {
                        // From T1, or to T2's most recent end.
                        match place {
                            Place::T1 => {
                                t1.unlink(nodes, s);
                                t2.push_back(nodes, s, Place::T2);
                            }
                            Place::T2 => t2.move_to_back(nodes, s),
                            _ => {}
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
                e.keys.retain(|k| self.arena.chunk(k).is_none());
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

    /// I-40: counters equal the chunk table, `ref_cnt ≥ −1`, allocated chunks within capacity
    /// and distinct (none both free and held), the key index maps exactly the live nodes, and
    /// the policy's lists are well linked and hold exactly the right keys: LRU the idle ones in
    /// `(rank, key)` order, ARC the stored ones in T1/T2 and only ghosts, within capacity, in
    /// B1/B2.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let arena = &self.arena;
        let nodes = &arena.nodes;
        let next_fresh = self.next_fresh as usize;
        ensure_invariant!(
            self.next_fresh <= self.config.capacity_chunks,
            "I-40",
            "allocated chunks exceed capacity"
        );
        let mut chunk_held = alloc::vec![false; next_fresh];
        for c in &self.free {
            let i = c.0 as usize;
            ensure_invariant!(
                i < next_fresh && !chunk_held[i],
                "I-40",
                "free chunk {c:?} unallocated or listed twice"
            );
            chunk_held[i] = true;
        }
        let mut slot_free = alloc::vec![false; nodes.len()];
        for &s in &arena.free_slots {
            let i = s as usize;
            ensure_invariant!(
                i < nodes.len() && !slot_free[i] && nodes[i].place == Place::Free,
                "I-40",
                "free arena slot {s} is in use or listed twice"
            );
            slot_free[i] = true;
        }
        let (mut live, mut stored, mut idle, mut pending) = (0usize, 0usize, 0usize, 0usize);
        let is_lru = matches!(self.policy, Policy::Lru { .. });
        for (s, n) in nodes.iter().enumerate() {
            if n.place == Place::Free {
                ensure_invariant!(slot_free[s], "I-40", "arena slot {s} free but not listed");
                continue;
            }
            live += 1;
            ensure_invariant!(
                arena.index.get(&n.key) == Some(s as u32),
                "I-40",
                "key index disagrees for {:?}",
                n.key
            );
            let placed_ok = match n.chunk {
                Some(c) => {
                    stored += 1;
                    ensure_invariant!(c.ref_cnt >= -1, "I-40", "ref_cnt below -1");
                    let i = c.chunk.0 as usize;
                    ensure_invariant!(
                        i < next_fresh && !chunk_held[i],
                        "I-40",
                        "chunk {:?} of {:?} unallocated, free or shared",
                        c.chunk,
                        n.key
                    );
                    chunk_held[i] = true;
                    idle += usize::from(c.ref_cnt == 0);
                    pending += usize::from(c.ref_cnt == -1);
                    if is_lru {
                        let in_idle = matches!(n.place, Place::IdleList | Place::IdleTree);
                        in_idle == (c.ref_cnt == 0) && (in_idle || n.place == Place::Unlinked)
                    } else {
                        matches!(n.place, Place::T1 | Place::T2)
                    }
                }
                // Only ARC keeps keys without a chunk: its ghosts.
                None => !is_lru && matches!(n.place, Place::B1 | Place::B2),
            };
            ensure_invariant!(
                placed_ok,
                "I-40",
                "{:?} ({:?}) is in the wrong policy list {:?}",
                n.key,
                n.chunk,
                n.place
            );
        }
        ensure_invariant!(
            arena.index.len == live && arena.stored as usize == stored,
            "I-40",
            "key index holds {} keys, arena {live} ({stored} stored, counted {})",
            arena.index.len,
            arena.stored
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
            stored + self.free.len() == next_fresh,
            "I-40",
            "{stored} held + {} free chunks != {next_fresh} allocated",
            self.free.len()
        );
        let list_holds = |list: &List, place: Place| {
            list.collect(nodes)
                .filter(|slots| slots.iter().all(|&s| nodes[s as usize].place == place))
        };
        match &self.policy {
            Policy::Lru {
                idle: list,
                idle_tree,
                ..
            } => {
                let slots = list_holds(list, Place::IdleList);
                ensure_invariant!(slots.is_some(), "I-40", "LRU idle list broken");
                let sorted = slots.is_some_and(|slots| {
                    slots
                        .windows(2)
                        .all(|w| nodes[w[0] as usize].order() < nodes[w[1] as usize].order())
                });
                ensure_invariant!(sorted, "I-40", "LRU idle list out of rank order");
                ensure_invariant!(
                    idle_tree
                        .iter()
                        .all(|(rank, key, s)| nodes
                            .get(*s as usize)
                            .is_some_and(|n| n.place == Place::IdleTree
                                && n.rank == *rank
                                && n.key == *key)),
                    "I-40",
                    "LRU idle tree disagrees with the keys' ranks"
                );
                ensure_invariant!(
                    list.len as usize + idle_tree.len() == idle,
                    "I-40",
                    "LRU idle order holds {} + {} keys, {idle} idle",
                    list.len,
                    idle_tree.len()
                );
            }
            Policy::Arc {
                t1,
                t2,
                b1,
                b2,
                target_bits,
            } => {
                let lists = [
                    (t1, Place::T1),
                    (t2, Place::T2),
                    (b1, Place::B1),
                    (b2, Place::B2),
                ];
                for (list, place) in lists {
                    ensure_invariant!(
                        list_holds(list, place).is_some(),
                        "I-40",
                        "ARC list {place:?} broken"
                    );
                }
                ensure_invariant!(
                    (t1.len + t2.len) as usize == stored
                        && (b1.len + b2.len) as usize == live - stored,
                    "I-40",
                    "ARC lists do not hold exactly the present keys and ghosts"
                );
                let capacity = self.config.capacity_chunks;
                let target = f64::from_bits(*target_bits);
                ensure_invariant!(
                    b1.len <= capacity
                        && b2.len <= capacity
                        && (0.0..=f64::from(capacity)).contains(&target),
                    "I-40",
                    "ARC ghosts {} + {} or target {target} beyond capacity {capacity}",
                    b1.len,
                    b2.len
                );
            }
        }
        Ok(())
    }
}

/// ARC: a store miss or touch of a ghost adapts the T1 target (no-op for other nodes).
fn arc_ghost_hit(
    nodes: &mut [Node],
    b1: &mut List,
    b2: &mut List,
    target_bits: &mut u64,
    capacity: u32,
    s: u32,
) {
    let capacity = f64::from(capacity);
    let target = f64::from_bits(*target_bits);
    match nodes[s as usize].place {
        Place::B1 => {
            let delta = (f64::from(b2.len) / f64::from(b1.len)).max(1.0);
            *target_bits = (target + delta).min(capacity).to_bits();
            b1.move_to_back(nodes, s);
        }
        Place::B2 => {
            let delta = (f64::from(b1.len) / f64::from(b2.len)).max(1.0);
            *target_bits = (target - delta).max(0.0).to_bits();
            b2.move_to_back(nodes, s);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nodes 0, 1, 2 linked in that order.
    fn three() -> (List, Vec<Node>) {
        let mut nodes = alloc::vec![Node::FREE; 3];
        let mut list = List::EMPTY;
        for s in 0..3 {
            list.push_back(&mut nodes, s, Place::IdleList);
        }
        (list, nodes)
    }

    #[test]
    fn collect_walks_a_list_and_rejects_broken_links() {
        // cargo-mutants survivors: the invariant check's walk only ever saw healthy lists.
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
        // cargo-mutants survivors (`check_invariants -> Ok(())`, and `&&` → `||` in the LRU
        // placement check): no test had ever handed I-40 a broken manager.
        type Corrupt = fn(&mut CpuOffloadingManager, u32);
        let corruptions: [(&str, Corrupt); 6] = [
            ("more chunks handed out than the pool holds", |m, _| {
                m.next_fresh = m.config.capacity_chunks + 1;
            }),
            ("a held chunk also on the free list", |m, s| {
                let chunk = m.arena.nodes[s as usize].chunk.expect("stored").chunk;
                m.free.push(chunk);
            }),
            // Not idle, so it must be unlinked: an LRU key cannot sit in an ARC list.
            ("a write-pending LRU key placed in T1", |m, s| {
                m.arena.nodes[s as usize].place = Place::T1;
            }),
            ("an idle key taken out of the idle order", |m, _| {
                let Policy::Lru { idle, .. } = &mut m.policy else {
                    unreachable!("built as LRU")
                };
                let head = idle.head;
                idle.unlink(&mut m.arena.nodes, head);
            }),
            ("a write-pending key counted as evictable", |m, _| {
                m.evictable += 1;
            }),
            // Only ARC keeps keys without a chunk (its ghosts).
            ("an LRU key without a chunk", |m, _| {
                m.arena.alloc(OffloadKey {
                    hash: crate::BlockHash(9),
                    group: 0,
                });
            }),
        ];
        for (what, corrupt) in corruptions {
            let (mut m, pending) = lru_with_a_pending_key();
            corrupt(&mut m, pending);
            let err = m.check_invariants().expect_err(what);
            assert_eq!(err.id, "I-40", "{what}: {}", err.detail);
        }
    }
}
