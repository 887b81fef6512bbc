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

    /// Moves a node of this list to the most recent end.
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
///
/// It is a function of the arena's nodes (each live node's key → its slot, I-40), so it is no
/// part of the manager's identity: equality and hashing ignore it, and two managers whose
/// tables differ only in layout (keys inserted in another order) are the same state.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct KeyIndex {
    table: Vec<IndexEntry>,
    pub(super) len: usize,
}

/// Where `k` starts its probe in a table of `len` (a power of two) positions: Fibonacci
/// hashing — one multiplication by 2⁶⁴/φ, top bits — under a fixed (unseeded) constant, so it
/// is deterministic; it spreads sequential ids as well as random hashes.
pub(super) fn home_of(k: &OffloadKey, len: usize) -> usize {
    const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
    let x = (k.hash.0 ^ u64::from(k.group).wrapping_mul(PHI)).wrapping_mul(PHI);
    // `len` ≥ 2, so the shift is at most 63.
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
            table: alloc::vec![EMPTY_ENTRY; Self::table_len(n)],
            len: 0,
        }
    }

    /// The table length for `n` keys: at most a quarter full (short probe runs), at least 64
    /// entries.
    fn table_len(n: usize) -> usize {
        n.saturating_mul(4).next_power_of_two().max(64)
    }

    /// Forgets every key, keeping the table.
    fn clear(&mut self) {
        self.table.fill(EMPTY_ENTRY);
        self.len = 0;
    }

    fn home(&self, hash: u64, group: u32) -> usize {
        let key = OffloadKey {
            hash: BlockHash(hash),
            group,
        };
        home_of(&key, self.table.len())
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

    pub(super) fn get(&self, k: &OffloadKey) -> Option<u32> {
        self.find(k).map(|i| self.table[i].slot)
    }

    /// Inserts a key that is not in the index.
    fn insert(&mut self, k: &OffloadKey, slot: u32) {
        if (self.len + 1) * 4 > self.table.len() {
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

    pub(super) fn slot(&self, k: &OffloadKey) -> Option<u32> {
        self.index.get(k)
    }

    /// [`Self::slot`], trying `hint` first: a slot whose live node holds `k` is its node (one
    /// node per key).
    pub(super) fn slot_hinted(&self, k: &OffloadKey, hint: u32) -> Option<u32> {
        match self.nodes.get(hint as usize) {
            Some(n) if n.key == *k && n.place != Place::Free => Some(hint),
            _ => self.slot(k),
        }
    }

    /// The chunk of a stored key.
    pub(super) fn chunk(&self, k: &OffloadKey) -> Option<Chunk> {
        self.slot(k).and_then(|s| self.nodes[s as usize].chunk)
    }

    /// A node for a key without one, unlinked and without chunk.
    pub(super) fn alloc(&mut self, key: OffloadKey) -> u32 {
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
    pub(super) fn release(&mut self, s: u32) {
        let n = &mut self.nodes[s as usize];
        let key = n.key;
        *n = Node::FREE;
        self.index.remove(&key);
        self.free_slots.push(s);
    }

    /// Forgets every node, keeping the storage.
    pub(super) fn clear(&mut self) {
        self.nodes.clear();
        self.free_slots.clear();
        self.index.clear();
        self.stored = 0;
    }
}
