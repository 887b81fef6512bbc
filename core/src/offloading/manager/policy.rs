//! The replacement policy behind the chunk state machine (vLLM's `CachePolicy`): [`Policy`] is
//! the LRU (`lru.rs`) or the ARC (`arc.rs`), and its methods are everything the manager
//! (`mod.rs`) tells a policy. A policy that has nothing to do for an event ignores it.
//!
//! | event (manager call) | LRU | ARC |
//! | --- | --- | --- |
//! | a key becomes idle (`complete_store`, `complete_load`) | joins the idle order | — |
//! | a key is pinned (`prepare_load`) | leaves the idle order | — |
//! | `touch` | fresh ranks | T1 → T2, refresh, ghost hit |
//! | a request accesses keys (`prepare_*`) | provisional ranks | — |
//! | a store miss (`prepare_store`) | — | ghost hit |
//! | a key is reserved for a store (`prepare_store`) | its rank | into T1 |
//! | the pool is full (`prepare_store`) | evicts by rank | evicts T1/T2 into B1/B2 |
//! | a store fails (`complete_store`) | — (the key is in no list) | leaves T1/T2 |
//! | `on_request_finished` | fresh ranks | reused → T2, inserted refreshed |

use alloc::vec::Vec;

use super::arc::Arc;
use super::arena::{Arena, Node};
use super::lru::Lru;
use super::scope::RequestAccess;
use super::types::{ChunkId, OffloadKey, PolicyKind};
use crate::InvariantViolation;

/// The replacement policy's own state (vLLM's `LRUCachePolicy` / `ARCCachePolicy`); the keys'
/// links and ranks live in the arena's nodes.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) enum Policy {
    Lru(Lru),
    Arc(Arc),
}

impl Policy {
    /// A policy that knows no key.
    pub(super) fn new(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::Lru => Self::Lru(Lru::new()),
            PolicyKind::Arc => Self::Arc(Arc::new()),
        }
    }

    /// A stored key became idle (ready and unpinned).
    pub(super) fn on_idle(&mut self, nodes: &mut [Node], s: u32) {
        if let Self::Lru(lru) = self {
            lru.idle_insert(nodes, s);
        }
    }

    /// An idle key was pinned by a load.
    pub(super) fn on_pinned(&mut self, nodes: &mut [Node], s: u32) {
        if let Self::Lru(lru) = self {
            lru.idle_remove(nodes, s);
        }
    }

    /// Keys recently used, processed tail to head so the head ends most recent.
    pub(super) fn touch(&mut self, arena: &mut Arena, keys: &[OffloadKey], capacity: u32) {
        match self {
            Self::Lru(lru) => lru.touch(arena, keys),
            Self::Arc(arc) => arc.touch(arena, keys, capacity),
        }
    }

    /// A request accessed keys for the first time; `positioned` are those of them whose
    /// position is known, in access order, and `request_rank` is the scope's LRU rank.
    pub(super) fn on_request_access(
        &mut self,
        arena: &mut Arena,
        positioned: &[(OffloadKey, u32)],
        request_rank: &mut Option<u64>,
    ) {
        if let Self::Lru(lru) = self {
            lru.on_request_access(arena, positioned, request_rank);
        }
    }

    /// An offered key that is not stored (only ARC's ghosts react).
    pub(super) fn on_store_miss(&mut self, arena: &mut Arena, k: &OffloadKey, capacity: u32) {
        if let Self::Arc(arc) = self {
            arc.on_store_miss(arena, k, capacity);
        }
    }

    /// A key that was just given a chunk for a store (write-pending), at `position` of the
    /// storing request if known.
    pub(super) fn insert(
        &mut self,
        nodes: &mut [Node],
        s: u32,
        position: Option<u32>,
        request_rank: &mut Option<u64>,
    ) {
        match self {
            Self::Lru(lru) => lru.insert(nodes, s, position, request_rank),
            Self::Arc(arc) => arc.insert(nodes, s),
        }
    }

    /// Evicts exactly `n` idle keys outside `protected` (sorted) and frees their chunks onto
    /// `free`, returning them in eviction order; `None` (nothing changed) if there are fewer.
    /// ARC moves the evicted keys to its ghost lists.
    pub(super) fn evict(
        &mut self,
        arena: &mut Arena,
        free: &mut Vec<ChunkId>,
        n: usize,
        protected: &[OffloadKey],
        capacity: u32,
    ) -> Option<Vec<OffloadKey>> {
        match self {
            Self::Lru(lru) => lru.evict(arena, free, n, protected),
            Self::Arc(arc) => arc.evict(arena, free, n, protected, capacity),
        }
    }

    /// A write-pending key's store failed: it leaves the policy before its node is freed.
    pub(super) fn on_store_failed(&mut self, nodes: &mut [Node], s: u32) {
        // LRU: a write-pending key is in no list.
        if let Self::Arc(arc) = self {
            arc.remove(nodes, s);
        }
    }

    /// A request finished: its keys in prefix order (`ordered`); its `scope` says which it
    /// inserted and which it reused.
    pub(super) fn on_request_finished(
        &mut self,
        arena: &mut Arena,
        ordered: &[OffloadKey],
        scope: &RequestAccess,
    ) {
        match self {
            Self::Lru(lru) => lru.on_request_finished(arena, ordered),
            Self::Arc(arc) => arc.on_request_finished(arena, ordered, scope),
        }
    }

    /// Whether a live node sits where this policy puts it (for the invariants).
    pub(super) fn placed(&self, n: &Node) -> bool {
        match self {
            Self::Lru(_) => Lru::placed(n),
            Self::Arc(_) => Arc::placed(n),
        }
    }

    /// I-40, the policy's part: its lists against the arena's `live` nodes, `stored` chunks and
    /// `idle` idle keys.
    pub(super) fn check_invariants(
        &self,
        nodes: &[Node],
        live: usize,
        stored: usize,
        idle: usize,
        capacity: u32,
    ) -> Result<(), InvariantViolation> {
        match self {
            Self::Lru(lru) => lru.check_invariants(nodes, idle),
            Self::Arc(arc) => arc.check_invariants(nodes, live, stored, capacity),
        }
    }
}
