//! The replacement policy behind the chunk state machine (vLLM's `CachePolicy`): [`Policy`] is
//! the LRU (`lru.rs`) or the ARC (`arc.rs`), and its methods are everything the manager
//! (`mod.rs`) tells a policy. A policy that has nothing to do for an event ignores it.
//!
//! | event (manager call) | LRU | ARC |
//! | --- | --- | --- |
//! | `touch` | fresh ranks | T1 → T2, refresh, ghost hit |
//! | a request accesses keys (`prepare_*`) | provisional ranks | — |
//! | a store miss (`prepare_store`) | — | ghost hit |
//! | a key is reserved for a store (`prepare_store`) | its rank, into the order | into T1 |
//! | the pool is full (`prepare_store`) | evicts idle keys by rank | evicts idle T1/T2 keys into B1/B2 |
//! | a store fails (`complete_store`) | leaves the order | leaves T1/T2 |
//!
//! Neither policy moves a key when a load pins it or when it becomes idle: both keep every
//! stored key in their lists and skip the keys that are not idle when they evict.
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
    /// The most nodes the arena holds under `kind` with a pool of `capacity` chunks: one per
    /// stored key, and for ARC up to `capacity` ghosts in each of B1 and B2.
    pub(super) fn max_nodes(kind: PolicyKind, capacity: u32) -> usize {
        let capacity = capacity as usize;
        match kind {
            PolicyKind::Lru => capacity,
            PolicyKind::Arc => capacity.saturating_mul(3),
        }
    }

    /// A policy that knows no key.
    pub(super) fn new(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::Lru => Self::Lru(Lru::new()),
            PolicyKind::Arc => Self::Arc(Arc::new()),
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

    /// A store miss of a key whose node (at `s`) holds no chunk: an ARC ghost adapts the
    /// target (LRU keeps no such node).
    #[inline]
    pub(super) fn on_ghost_miss(&mut self, nodes: &mut [Node], s: u32, capacity: u32) {
        if let Self::Arc(arc) = self {
            arc.ghost_hit(nodes, capacity, s);
        }
    }

    /// A key that was just given a chunk for a store (write-pending), at `position` of the
    /// storing request if known.
    #[inline]
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

    /// Evicts exactly `n` idle keys not `offered` by the store in progress and frees their chunks onto
    /// `free`, returning them in eviction order; `None` (nothing changed) if there are fewer.
    /// ARC moves the evicted keys to its ghost lists; a ghost it trims is removed from the
    /// index and its slot listed free, but the node is only tagged `Free`: the caller resets
    /// the slots the store does not reuse with [`Arena::scrub_free`] before the call returns.
    /// `slots` is a working buffer.
    pub(super) fn evict(
        &mut self,
        arena: &mut Arena,
        free: &mut Vec<ChunkId>,
        n: usize,
        capacity: u32,
        slots: &mut Vec<u32>,
    ) -> Option<Vec<OffloadKey>> {
        match self {
            Self::Lru(lru) => lru.evict(arena, free, n, slots),
            Self::Arc(arc) => arc.evict(arena, free, n, capacity, slots),
        }
    }

    /// A write-pending key's store failed: it leaves the policy before its node is freed.
    pub(super) fn on_store_failed(&mut self, nodes: &mut [Node], s: u32) {
        match self {
            Self::Lru(lru) => lru.remove(nodes, s),
            Self::Arc(arc) => arc.remove(nodes, s),
        }
    }

    /// A request finished: its `scope`'s entries in prefix order (`ordered`, indices into the
    /// scope); the scope says which keys it inserted and which it reused. Its keys are walked
    /// tail to head (so the head ends most recent); absent ones are skipped.
    pub(super) fn on_request_finished(
        &mut self,
        arena: &mut Arena,
        ordered: &[u32],
        scope: &RequestAccess,
    ) {
        if let Self::Arc(arc) = self
            && arc.commit_run(&mut arena.nodes, ordered, scope)
        {
            return;
        }
        for &e in ordered.iter().rev() {
            let access = scope.entry(e);
            let Some(s) = arena.slot_hinted(&access.key, access.slot) else {
                continue;
            };
            match self {
                Self::Lru(lru) => lru.new_rank(&mut arena.nodes, s),
                Self::Arc(arc) => arc.commit(&mut arena.nodes, s, access),
            }
        }
    }

    /// Whether a live node sits where this policy puts it (for the invariants).
    pub(super) fn placed(&self, n: &Node) -> bool {
        match self {
            Self::Lru(_) => Lru::placed(n),
            Self::Arc(_) => Arc::placed(n),
        }
    }

    /// I-40, the policy's part: its lists against the arena's `live` nodes and `stored`
    /// chunks.
    pub(super) fn check_invariants(
        &self,
        nodes: &[Node],
        live: usize,
        stored: usize,
        capacity: u32,
    ) -> Result<(), InvariantViolation> {
        match self {
            Self::Lru(lru) => lru.check_invariants(nodes, stored),
            Self::Arc(arc) => arc.check_invariants(nodes, live, stored, capacity),
        }
    }
}
