//! The LRU policy (vLLM 0.33.0's `LRUCachePolicy`, the default): logical recency with
//! provisional per-request ranks.
//!
//! Every stored key has a [`Rank`] in its node, and every stored key — idle, pinned or
//! write-pending — is kept in `(rank, key)` order; eviction walks that order lowest first and
//! takes the idle keys (ready, unpinned), skipping the others. `touch`
//! and a finished request give keys fresh global ranks, tail to head, so a prefix's head ends
//! most recent. While a request runs, the keys it accesses with a known position only move up to
//! the request's provisional rank `(request rank, −position)` (`on_request_access`), committed at
//! `on_request_finished`.
//!
//! The order is vLLM's lazy heap kept exact, split in two: a sorted [`List`] taking the keys
//! whose order falls beyond either end (the common case: a fresh rank, O(1)), and a B-tree for
//! the ranks that arrive between its ends. Eviction merges the two. Pinning a key for a load and
//! unpinning it do not move it: a key's place in the order changes only with its rank, so loads
//! cost no reordering.

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
    /// Stored keys by `(rank, key)` (vLLM's lazy heap, kept exact), split in two: a sorted
    /// list taking the keys that arrive beyond either end (the common case: a fresh rank),
    /// and a tree for the rest. Eviction merges the two.
    list: List,
    tree: BTreeSet<(Rank, OffloadKey, u32)>,
    next_rank: u64,
}

impl Lru {
    pub(super) fn new() -> Self {
        Self {
            list: List::EMPTY,
            tree: BTreeSet::new(),
            next_rank: 0,
        }
    }

    /// Adds a stored key to the order, by its rank.
    #[inline]
    fn link(&mut self, nodes: &mut [Node], s: u32) {
        let list = &mut self.list;
        let o = order(&nodes[s as usize]);
        if list.tail == NIL || order(&nodes[list.tail as usize]) < o {
            list.push_back(nodes, s, Place::RankList);
        } else if o < order(&nodes[list.head as usize]) {
            list.push_front(nodes, s, Place::RankList);
        } else {
            self.tree.insert((o.0, o.1, s));
            nodes[s as usize].place = Place::RankTree;
        }
    }

    /// Takes a key out of the order (no-op for a key that is not in it).
    #[inline]
    fn unlink(&mut self, nodes: &mut [Node], s: u32) {
        let n = &mut nodes[s as usize];
        match n.place {
            Place::RankList => self.list.unlink(nodes, s),
            Place::RankTree => {
                self.tree.remove(&(n.rank, n.key, s));
                n.place = Place::Unlinked;
            }
            _ => {}
        }
    }

    /// `touch`: fresh global ranks for the present keys, processed tail to head so the head ends
    /// most recent.
    pub(super) fn touch(&mut self, arena: &mut Arena, keys: &[OffloadKey]) {
        for k in keys.iter().rev() {
            if let Some(s) = arena.slot(k) {
                self.new_rank(&mut arena.nodes, s);
            }
        }
    }

    /// A fresh global rank for a present key (`touch`, and `on_request_finished` for each of
    /// the request's keys, which the policy walks tail to head in prefix order).
    #[inline]
    pub(super) fn new_rank(&mut self, nodes: &mut [Node], s: u32) {
        self.unlink(nodes, s);
        nodes[s as usize].rank = self.fresh_rank();
        self.list.push_back(nodes, s, Place::RankList);
    }

    /// A fresh global rank: above every rank given so far (global and provisional ranks share
    /// the counter), so its key goes to the list's most recent end without a comparison.
    #[inline]
    fn fresh_rank(&mut self) -> Rank {
        self.next_rank += 1;
        (self.next_rank, 0)
    }

    /// Gives a stored key a new rank that may fall anywhere, keeping the order in step.
    fn rerank(&mut self, nodes: &mut [Node], s: u32, rank: Rank) {
        self.unlink(nodes, s);
        nodes[s as usize].rank = rank;
        self.link(nodes, s);
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

    /// A key just reserved for a store (write-pending) takes its rank — the request's
    /// provisional rank at its position if known, else a fresh global rank — and its place in
    /// the order.
    #[inline]
    pub(super) fn insert(
        &mut self,
        nodes: &mut [Node],
        s: u32,
        position: Option<u32>,
        request_rank: &mut Option<u64>,
    ) {
        match position {
            Some(pos) => {
                nodes[s as usize].rank = (self.request_rank(request_rank), -i64::from(pos));
                self.link(nodes, s);
            }
            None => {
                nodes[s as usize].rank = self.fresh_rank();
                self.list.push_back(nodes, s, Place::RankList);
            }
        }
    }

    /// A write-pending key whose store failed leaves the order (the manager then frees its
    /// node).
    pub(super) fn remove(&mut self, nodes: &mut [Node], s: u32) {
        self.unlink(nodes, s);
    }

    /// Evicts exactly `n` idle keys not `offered` by the store in progress, lowest `(rank, key)` first,
    /// frees their chunks and nodes, and returns them in eviction order; `None` (nothing changed)
    /// if there are fewer. `slots` is a working buffer.
    pub(super) fn evict(
        &mut self,
        arena: &mut Arena,
        free: &mut Vec<ChunkId>,
        n: usize,
        slots: &mut Vec<u32>,
    ) -> Option<Vec<OffloadKey>> {
        slots.clear();
        let mut cursor = self.list.head;
        let mut tree = self.tree.iter().peekable();
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
            let n = &arena.nodes[s as usize];
            let idle = n.chunk.is_some_and(|c| c.ref_cnt == 0);
            if idle && !n.offered {
                slots.push(s);
            }
        }
        if slots.len() < n {
            return None;
        }
        let mut victims = Vec::with_capacity(n);
        for &s in slots.iter() {
            self.unlink(&mut arena.nodes, s);
            let node = &mut arena.nodes[s as usize];
            let chunk = node.chunk.take().expect("idle keys are stored");
            victims.push(node.key);
            free.push(chunk.chunk);
            arena.stored -= 1;
            arena.release(s);
        }
        Some(victims)
    }

    /// Whether a node sits where LRU puts it: every stored key is in the order (list or
    /// tree); LRU keeps no key without a chunk.
    pub(super) fn placed(n: &Node) -> bool {
        n.chunk.is_some() && matches!(n.place, Place::RankList | Place::RankTree)
    }

    /// I-40, LRU part: the list is well linked and in `(rank, key)` order, the tree agrees
    /// with the keys' ranks, and together they hold the `stored` keys.
    pub(super) fn check_invariants(
        &self,
        nodes: &[Node],
        stored: usize,
    ) -> Result<(), InvariantViolation> {
        let Self { list, tree, .. } = self;
        let slots = list.holds(nodes, Place::RankList);
        ensure_invariant!(slots.is_some(), "I-40", "LRU rank list broken");
        let sorted = slots.is_some_and(|slots| {
            slots
                .windows(2)
                .all(|w| order(&nodes[w[0] as usize]) < order(&nodes[w[1] as usize]))
        });
        ensure_invariant!(sorted, "I-40", "LRU rank list out of rank order");
        ensure_invariant!(
            tree.iter().all(|(rank, key, s)| nodes
                .get(*s as usize)
                .is_some_and(|n| n.place == Place::RankTree && n.rank == *rank && n.key == *key)),
            "I-40",
            "LRU rank tree disagrees with the keys' ranks"
        );
        ensure_invariant!(
            list.len as usize + tree.len() == stored,
            "I-40",
            "LRU order holds {} + {} keys, {stored} stored",
            list.len,
            tree.len()
        );
        Ok(())
    }

    /// The rank list, for tests that corrupt it.
    #[cfg(test)]
    pub(super) fn list_mut(&mut self) -> &mut List {
        &mut self.list
    }
}
