//! The manager's policy-agnostic storage: the arena of nodes (one per key the manager knows),
//! the intrusive doubly linked [`List`] that the policies thread through it, and the
//! [`KeyIndex`] that finds a key's node.
//!
//! A node holds its key's chunk (none for an ARC ghost), its links, the tag of the list it is
//! linked into ([`Place`]) and the LRU's rank. The policies (`lru.rs`, `arc.rs`) own the lists'
//! heads and decide what the places mean; this file only keeps the links and the index right.
//! Nothing here is iterated for behaviour except the lists, so the fixed-hash index never shows
//! its order.

use alloc::vec::Vec;

use super::types::{ChunkId, OffloadKey};
use crate::BlockHash;

/// A key's chunk: `ref_cnt` −1 = write pending, 0 = ready and idle, n ≥ 1 = pinned by n loads.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Chunk {
    pub(super) ref_cnt: i32,
    pub(super) chunk: ChunkId,
}

/// The end of a link, and an empty index entry: no node.
pub(super) const NIL: u32 = u32::MAX;

/// LRU recency (`lru.rs`): `(rank, minor)`, lowest evicted first. Global ranks have minor 0; a
/// request's provisional rank is `(request rank, −position)`, so tails go before heads. Kept in
/// the node, unused by ARC.
pub(super) type Rank = (u64, i64);

/// Where a node of the arena is linked.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) enum Place {
    /// A free slot of the arena.
    Free,
    /// A key linked into no list (only between calls of a policy).
    Unlinked,
    /// LRU: stored, in the rank-ordered list.
    RankList,
    /// LRU: stored, in the rank tree (ranks that arrived between the list's ends).
    RankTree,
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
pub(super) struct Node {
    pub(super) key: OffloadKey,
    /// `None` for an ARC ghost (a key in B1 or B2).
    pub(super) chunk: Option<Chunk>,
    pub(super) place: Place,
    pub(super) prev: u32,
    pub(super) next: u32,
    /// The LRU rank (unused by ARC).
    pub(super) rank: Rank,
    /// Named by the `prepare_store` in progress, so not evictable by it; `false` between
    /// calls.
    pub(super) offered: bool,
}

impl Node {
    pub(super) const FREE: Node = Node {
        key: OffloadKey {
            hash: BlockHash(0),
            group: 0,
        },
        chunk: None,
        place: Place::Free,
        prev: NIL,
        next: NIL,
        rank: (0, 0),
        offered: false,
    };
}

/// An intrusive doubly linked list of arena nodes (Python's `OrderedDict` as the policies use
/// it): O(1) move to the most recent end, removal, and iteration from the least recent end.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct List {
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
}

impl List {
    pub(super) const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    #[inline]
    pub(super) fn push_back(&mut self, nodes: &mut [Node], s: u32, place: Place) {
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

    #[inline]
    pub(super) fn push_front(&mut self, nodes: &mut [Node], s: u32, place: Place) {
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
    #[inline]
    pub(super) fn unlink(&mut self, nodes: &mut [Node], s: u32) {
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

    /// Cuts the first `count` nodes of this list, up to `last`, off its front (their own links
    /// among them are kept).
    #[inline]
    pub(super) fn cut_front(&mut self, nodes: &mut [Node], last: u32, count: u32) {
        let after = nodes[last as usize].next;
        self.head = after;
        if after == NIL {
            self.tail = NIL;
        } else {
            nodes[after as usize].prev = NIL;
        }
        self.len -= count;
    }

    /// Appends a run of `count` nodes linked from `first` to `last` (cut off another list) at
    /// the most recent end, tagging them `place`: the links `push_back` of each in turn gives.
    #[inline]
    pub(super) fn append(
        &mut self,
        nodes: &mut [Node],
        first: u32,
        last: u32,
        count: u32,
        place: Place,
    ) {
        nodes[first as usize].prev = self.tail;
        nodes[last as usize].next = NIL;
        if self.tail == NIL {
            self.head = first;
        } else {
            nodes[self.tail as usize].next = first;
        }
        self.tail = last;
        self.len += count;
        let mut s = first;
        for _ in 0..count {
            let n = &mut nodes[s as usize];
            n.place = place;
            s = n.next;
        }
    }

    /// Moves a node of this list to the most recent end.
    #[inline]
    pub(super) fn move_to_back(&mut self, nodes: &mut [Node], s: u32) {
        if self.tail != s {
            let place = nodes[s as usize].place;
            self.unlink(nodes, s);
            self.push_back(nodes, s, place);
        }
    }

    /// The nodes from the least recent end, checking the links (for the invariants).
    pub(super) fn collect(&self, nodes: &[Node]) -> Option<Vec<u32>> {
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

    /// The nodes from the least recent end if the links hold and every node is tagged `place`
    /// (for the invariants).
    pub(super) fn holds(&self, nodes: &[Node], place: Place) -> Option<Vec<u32>> {
        self.collect(nodes)
            .filter(|slots| slots.iter().all(|&s| nodes[s as usize].place == place))
    }
}

/// Key → arena slot: a chained hash table under a fixed (unseeded) mixer, so it is
/// deterministic. Each bucket holds the first slot of its chain, and the chains are doubly
/// linked through two arrays parallel to the arena's nodes, so a node leaves the index in O(1)
/// by its slot (no search), and a key is found by comparing the nodes' own keys. It is never
/// iterated for behaviour: every order the manager shows comes from the policy's lists.
///
/// It is a function of the arena's nodes (each live node's key → its slot, I-40), so it is no
/// part of the manager's identity: equality and hashing ignore it, and two managers whose
/// tables differ only in layout (keys inserted in another order) are the same state.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct KeyIndex {
    /// Bucket → the first slot of its chain (`NIL`: empty); a power of two long, or empty.
    heads: Vec<u32>,
    /// Per arena slot: the next slot of its chain (`NIL`: the last).
    next: Vec<u32>,
    /// Per arena slot: the previous slot of its chain (`NIL`: the first).
    prev: Vec<u32>,
    pub(super) len: usize,
}

/// Where `k` starts its probe in a table of `len` (a power of two) positions: Fibonacci
/// hashing — one multiplication by 2⁶⁴/φ, top bits — under a fixed (unseeded) constant, so it
/// is deterministic; it spreads sequential ids as well as random hashes. (An empty table, `len`
/// 0, gets a position beyond it.)
#[inline]
pub(super) fn home_of(k: &OffloadKey, len: usize) -> usize {
    bucket(mix(k), len)
}

/// The product [`home_of`] takes its top bits from: computed once, it serves every table
/// (a call that looks a key up and then inserts it hashes it once).
#[inline]
pub(super) fn mix(k: &OffloadKey) -> u64 {
    const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
    (k.hash.0 ^ u64::from(k.group).wrapping_mul(PHI)).wrapping_mul(PHI)
}

/// [`home_of`] of a key whose [`mix`] is `x`.
#[inline]
fn bucket(x: u64, len: usize) -> usize {
    // `len` ≥ 2 or 0, so the shift is at most 63 (0 for an empty table).
    (x >> (64 - len.trailing_zeros())) as usize
}

impl PartialEq for KeyIndex {
    /// Always equal: the nodes carry the identity (see the type's docs).
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for KeyIndex {}

impl core::hash::Hash for KeyIndex {
    /// Nothing: the nodes carry the identity (see the type's docs).
    fn hash<H: core::hash::Hasher>(&self, _: &mut H) {}
}

impl KeyIndex {
    /// An empty index that holds `n` keys without growing.
    fn with_capacity(n: usize) -> Self {
        Self {
            heads: alloc::vec![NIL; Self::table_len(n)],
            next: Vec::with_capacity(n),
            prev: Vec::with_capacity(n),
            len: 0,
        }
    }

    /// The bucket count for `n` keys: at most half as many keys as buckets (short chains), at
    /// least 64 buckets.
    fn table_len(n: usize) -> usize {
        n.saturating_mul(2).next_power_of_two().max(64)
    }

    /// Forgets every key, keeping the storage.
    fn clear(&mut self) {
        self.heads.fill(NIL);
        self.next.clear();
        self.prev.clear();
        self.len = 0;
    }

    /// The slot of the live node holding `k`, whose [`mix`] is `x`.
    #[inline]
    fn get(&self, nodes: &[Node], k: &OffloadKey, x: u64) -> Option<u32> {
        // An empty table (a default index) has no bucket to find.
        let mut s = *self.heads.get(bucket(x, self.heads.len()))?;
        while s != NIL {
            if nodes[s as usize].key == *k {
                return Some(s);
            }
            s = self.next[s as usize];
        }
        None
    }

    /// Links the node at `s`, whose key is not in the index and has [`mix`] `x`.
    #[inline]
    fn insert(&mut self, nodes: &[Node], s: u32, x: u64) {
        if (self.len + 1) * 2 > self.heads.len() {
            self.grow(nodes);
        }
        if self.next.len() <= s as usize {
            self.next.resize(s as usize + 1, NIL);
            self.prev.resize(s as usize + 1, NIL);
        }
        self.link(x, s);
        self.len += 1;
    }

    /// Pushes `s` at the front of the chain of its key, whose [`mix`] is `x`.
    #[inline]
    fn link(&mut self, x: u64, s: u32) {
        let h = bucket(x, self.heads.len());
        let first = self.heads[h];
        self.next[s as usize] = first;
        self.prev[s as usize] = NIL;
        if first != NIL {
            self.prev[first as usize] = s;
        }
        self.heads[h] = s;
    }

    /// Doubles the buckets, relinking every key.
    fn grow(&mut self, nodes: &[Node]) {
        let cap = (self.heads.len() * 2).max(64);
        let old = core::mem::replace(&mut self.heads, alloc::vec![NIL; cap]);
        for head in old {
            let mut s = head;
            while s != NIL {
                let next = self.next[s as usize];
                self.link(mix(&nodes[s as usize].key), s);
                s = next;
            }
        }
    }

    /// Unlinks the live node at `s` (its key still in the node).
    #[inline]
    pub(super) fn remove(&mut self, nodes: &[Node], s: u32) {
        let (prev, next) = (self.prev[s as usize], self.next[s as usize]);
        if prev == NIL {
            let h = home_of(&nodes[s as usize].key, self.heads.len());
            self.heads[h] = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next != NIL {
            self.prev[next as usize] = prev;
        }
        self.len -= 1;
    }
}

/// The arena of nodes and the key index over it.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Arena {
    pub(super) nodes: Vec<Node>,
    pub(super) free_slots: Vec<u32>,
    pub(super) index: KeyIndex,
    /// Nodes holding a chunk.
    pub(super) stored: u32,
}

impl Arena {
    /// An empty arena that holds `n` nodes without growing (its nodes and its index).
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            nodes: Vec::with_capacity(n),
            free_slots: Vec::new(),
            index: KeyIndex::with_capacity(n),
            stored: 0,
        }
    }

    #[inline]
    pub(super) fn slot(&self, k: &OffloadKey) -> Option<u32> {
        self.index.get(&self.nodes, k, mix(k))
    }

    /// [`Self::slot`] of a key whose [`mix`] is `x`.
    #[inline]
    pub(super) fn slot_mixed(&self, k: &OffloadKey, x: u64) -> Option<u32> {
        self.index.get(&self.nodes, k, x)
    }

    /// [`Self::slot`], trying `hint` first: a slot whose live node holds `k` is its node (one
    /// node per key).
    #[inline]
    pub(super) fn slot_hinted(&self, k: &OffloadKey, hint: u32) -> Option<u32> {
        match self.nodes.get(hint as usize) {
            Some(n) if n.key == *k && n.place != Place::Free => Some(hint),
            _ => self.slot(k),
        }
    }

    /// The chunk of a stored key.
    #[inline]
    pub(super) fn chunk(&self, k: &OffloadKey) -> Option<Chunk> {
        self.slot(k).and_then(|s| self.nodes[s as usize].chunk)
    }

    /// A node for a key without one (whose [`mix`] is `x`), unlinked, holding `chunk`
    /// (counted in `stored` if any).
    #[inline]
    pub(super) fn alloc(&mut self, key: OffloadKey, chunk: Option<Chunk>, x: u64) -> u32 {
        let node = Node {
            key,
            chunk,
            place: Place::Unlinked,
            ..Node::FREE
        };
        self.stored += u32::from(chunk.is_some());
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
        self.index.insert(&self.nodes, s, x);
        s
    }

    /// Frees an unlinked node without chunk.
    #[inline]
    pub(super) fn release(&mut self, s: u32) {
        self.index.remove(&self.nodes, s);
        self.nodes[s as usize] = Node::FREE;
        self.free_slots.push(s);
    }

    /// Resets to [`Node::FREE`] the slots freed since `free_slots` was `mark` long that
    /// [`Self::alloc`] has not reused since (those still listed past `mark`): a policy's
    /// eviction may free a node by tagging it `Free` only, since the store that evicts
    /// reuses most such slots at once (`alloc` writes the whole node).
    #[inline]
    pub(super) fn scrub_free(&mut self, mark: usize) {
        if let Some(stale) = self.free_slots.get(mark..) {
            for &s in stale {
                self.nodes[s as usize] = Node::FREE;
            }
        }
    }

    /// Forgets every node, keeping the storage.
    pub(super) fn clear(&mut self) {
        self.nodes.clear();
        self.free_slots.clear();
        self.index.clear();
        self.stored = 0;
    }
}
