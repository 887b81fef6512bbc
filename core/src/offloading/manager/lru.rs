//! The LRU policy (vLLM 0.33.0's `LRUCachePolicy`, the default): logical recency with
//! provisional per-request ranks.
//!
//! Every stored key has a [`Rank`] in its node; the idle keys (ready, unpinned) are kept in
//! `(rank, key)` order and evicted lowest first. `touch` and a finished request give keys fresh
//! global ranks, tail to head, so a prefix's head ends most recent. While a request runs, the keys
//! it accesses with a known position only move up to the request's provisional rank
//! `(request rank, −position)` (`on_request_access`), committed at `on_request_finished`.
//! Write-pending and pinned keys are in no list: they cannot be evicted.
//!
//! The idle order is vLLM's lazy heap kept exact, split in two: a sorted [`List`] taking the
//! keys whose order falls beyond either end (the common case: a fresh rank, O(1)), and a B-tree
//! for the ranks that arrive between its ends. Eviction merges the two.

use alloc::collections::BTreeSet;
use alloc::vec::Vec;

use super::arena::{Arena, List, NIL, Node, Place, Rank};
use super::types::{ChunkId, OffloadKey};
use crate::{InvariantViolation, ensure_invariant};

/// The LRU eviction order of a node: rank, then key.
fn order(n: &Node) -> (Rank, OffloadKey) {
    (n.rank, n.key)
}

/// The LRU's own state; each key's rank lives in its node.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Lru {
    /// Idle keys by `(rank, key)` (vLLM's lazy heap, kept exact), split in two: a sorted
    /// list taking the keys that arrive beyond either end (the common case: a fresh rank),
    /// and a tree for the rest. Eviction merges the two.
    idle: List,
    idle_tree: BTreeSet<(Rank, OffloadKey, u32)>,
    next_rank: u64,
}

impl Lru {
    pub(super) fn new() -> Self {
        Self {
            idle: List::EMPTY,
            idle_tree: BTreeSet::new(),
            next_rank: 0,
        }
    }

    /// Adds an idle key to the idle order.
    pub(super) fn idle_insert(&mut self, nodes: &mut [Node], s: u32) {
        let idle = &mut self.idle;
        let o = order(&nodes[s as usize]);
        if idle.tail == NIL || order(&nodes[idle.tail as usize]) < o {
            idle.push_back(nodes, s, Place::IdleList);
        } else if o < order(&nodes[idle.head as usize]) {
            idle.push_front(nodes, s, Place::IdleList);
        } else {
            self.idle_tree.insert((o.0, o.1, s));
            nodes[s as usize].place = Place::IdleTree;
        }
    }

    /// Takes a key out of the idle order (no-op for a key that is not idle).
    pub(super) fn idle_remove(&mut self, nodes: &mut [Node], s: u32) {
        let n = &mut nodes[s as usize];
        match n.place {
            Place::IdleList => self.idle.unlink(nodes, s),
            Place::IdleTree => {
                self.idle_tree.remove(&(n.rank, n.key, s));
                n.place = Place::Unlinked;
            }
            _ => {}
        }
    }

    /// `touch`: fresh global ranks for the present keys, processed tail to head so the head ends
    /// most recent.
    pub(super) fn touch(&mut self, arena: &mut Arena, keys: &[OffloadKey]) {
        for k in keys.iter().rev() {
            self.new_rank(arena, *k);
        }
    }

    /// `on_request_finished`: the request's keys (in prefix order) get fresh global ranks, tail
    /// to head, as by [`Self::touch`].
    pub(super) fn on_request_finished(&mut self, arena: &mut Arena, ordered: &[OffloadKey]) {
        self.touch(arena, ordered);
    }

    /// A fresh global rank for a present key.
    fn new_rank(&mut self, arena: &mut Arena, k: OffloadKey) {
        let Some(s) = arena.slot(&k) else {
            return;
        };
        self.next_rank += 1;
        let rank = (self.next_rank, 0);
        self.rerank(&mut arena.nodes, s, rank);
    }

    /// Gives a stored key its new rank, keeping the idle order in step.
    fn rerank(&mut self, nodes: &mut [Node], s: u32, rank: Rank) {
        let was_idle = matches!(nodes[s as usize].place, Place::IdleList | Place::IdleTree);
        if was_idle {
            self.idle_remove(nodes, s);
        }
        nodes[s as usize].rank = rank;
        if was_idle {
            self.idle_insert(nodes, s);
        }
    }

    /// The request's provisional rank (kept in its scope), allocated on first need.
    fn request_rank(&mut self, request_rank: &mut Option<u64>) -> u64 {
        *request_rank.get_or_insert_with(|| {
            self.next_rank += 1;
            self.next_rank
        })
    }

    /// `on_request_access`: the request's provisional rank is allocated if it has none, and
    /// present keys (with their known positions, in access order) move up to it (ranks only
    /// move up).
    pub(super) fn on_request_access(
        &mut self,
        arena: &mut Arena,
        positioned: &[(OffloadKey, u32)],
        request_rank: &mut Option<u64>,
    ) {
        let request_rank = self.request_rank(request_rank);
        for (k, pos) in positioned {
            let Some(s) = arena.slot(k) else {
                continue;
            };
            let rank = (request_rank, -i64::from(*pos));
            if arena.nodes[s as usize].rank < rank {
                self.rerank(&mut arena.nodes, s, rank);
            }
        }
    }

    /// A key just reserved for a store (write-pending, so in no list) takes its rank: the
    /// request's provisional rank at its position if known, else a fresh global rank.
    pub(super) fn insert(
        &mut self,
        nodes: &mut [Node],
        s: u32,
        position: Option<u32>,
        request_rank: &mut Option<u64>,
    ) {
        nodes[s as usize].rank = match position {
            Some(pos) => (self.request_rank(request_rank), -i64::from(pos)),
            None => {
                self.next_rank += 1;
                (self.next_rank, 0)
            }
        };
    }

    /// Evicts exactly `n` idle keys outside `protected` (sorted), lowest `(rank, key)` first,
    /// frees their chunks and nodes, and returns them in eviction order; `None` (nothing changed)
    /// if there are fewer.
    pub(super) fn evict(
        &mut self,
        arena: &mut Arena,
        free: &mut Vec<ChunkId>,
        n: usize,
        protected: &[OffloadKey],
    ) -> Option<Vec<OffloadKey>> {
        let mut victims = Vec::with_capacity(n);
        let mut slots: Vec<u32> = Vec::with_capacity(n);
        let mut cursor = self.idle.head;
        let mut tree = self.idle_tree.iter().peekable();
        while slots.len() < n {
            let from_list = match (cursor, tree.peek()) {
                (NIL, None) => break,
                (NIL, Some(_)) => false,
                (_, None) => true,
                (c, Some(t)) => order(&arena.nodes[c as usize]) < (t.0, t.1),
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
            self.idle_remove(&mut arena.nodes, s);
            let node = &mut arena.nodes[s as usize];
            let chunk = node.chunk.take().expect("idle keys are stored");
            victims.push(node.key);
            free.push(chunk.chunk);
            arena.stored -= 1;
            arena.release(s);
        }
        Some(victims)
    }

    /// Whether a node sits where LRU puts it: a stored key is in the idle order exactly when it
    /// is idle and otherwise unlinked; LRU keeps no key without a chunk.
    pub(super) fn placed(n: &Node) -> bool {
        match n.chunk {
            Some(c) => {
                let in_idle = matches!(n.place, Place::IdleList | Place::IdleTree);
                in_idle == (c.ref_cnt == 0) && (in_idle || n.place == Place::Unlinked)
            }
            None => false,
        }
    }

    /// I-40, LRU part: the idle list is well linked and in `(rank, key)` order, the tree agrees
    /// with the keys' ranks, and together they hold the `idle` idle keys.
    pub(super) fn check_invariants(
        &self,
        nodes: &[Node],
        idle: usize,
    ) -> Result<(), InvariantViolation> {
        let Self {
            idle: list,
            idle_tree,
            ..
        } = self;
        let slots = list.holds(nodes, Place::IdleList);
        ensure_invariant!(slots.is_some(), "I-40", "LRU idle list broken");
        let sorted = slots.is_some_and(|slots| {
            slots
                .windows(2)
                .all(|w| order(&nodes[w[0] as usize]) < order(&nodes[w[1] as usize]))
        });
        ensure_invariant!(sorted, "I-40", "LRU idle list out of rank order");
        ensure_invariant!(
            idle_tree.iter().all(|(rank, key, s)| nodes
                .get(*s as usize)
                .is_some_and(|n| n.place == Place::IdleTree && n.rank == *rank && n.key == *key)),
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
        Ok(())
    }

    /// The idle list, for tests that corrupt it.
    #[cfg(test)]
    pub(super) fn idle_mut(&mut self) -> &mut List {
        &mut self.idle
    }
}
