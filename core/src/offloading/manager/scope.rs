//! A request's scope of accesses (vLLM's `_RequestCacheAccess` plus the LRU request rank): what
//! the manager remembers about each key a request touched until `on_request_finished` hands it
//! to the policy.
//!
//! One entry per key, in the order the request's calls first named them, found through a small
//! key index (open addressing under the arena's fixed mixer, never iterated): a call admits its
//! keys once (a probe each, a push for a new one, no sort, no merge) and then sets every fact by
//! entry index. The request's first-access order, which the policy needs at the end, is kept
//! as the list of accessed entries in that order, and each key's index in it within its KV
//! cache group.
//!
//! The representation is not canonical — the entries' order and the index's layout follow the
//! calls' history, and a key a call named without recording any fact keeps an empty entry — so
//! equality and hashing are written out to compare **facts only**: the entries that carry a
//! fact, in key order, and the LRU rank. Two scopes holding the same facts are equal and hash
//! equally, whatever order the keys arrived in (the model checker's state identity).

use alloc::vec::Vec;

use super::arena::{NIL, home_of};
use super::types::OffloadKey;

/// What a request did with one key: its facts, and two fields that are not facts (a call's
/// duplicate detection, and where the key's arena node was last seen).
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct KeyAccess {
    pub(super) key: OffloadKey,
    /// Its index in the request's first-access order within its KV cache group; `None` while
    /// only its position is known.
    pub(super) seen: Option<u32>,
    /// Its end-token position in the request, when a caller gave it.
    pub(super) position: Option<u32>,
    /// The request's store reserved a chunk for it.
    pub(super) inserted: bool,
    /// The request reused it (a load, or a ready key in its store offer) without inserting it.
    pub(super) reused: bool,
    /// It was offered for a store while absent (ARC ghosts react once per request).
    pub(super) store_miss: bool,
    /// A store candidate of the `prepare_store` in progress (its duplicates are not); `false`
    /// between calls, and no fact.
    pub(super) candidate: bool,
    /// The arena slot where the key's node was last seen (`NIL`: never): a hint that saves the
    /// key index a probe when it still holds the key (`Arena::slot_hinted`), and no fact.
    pub(super) slot: u32,
}

impl KeyAccess {
    fn new(key: OffloadKey) -> Self {
        Self {
            key,
            seen: None,
            position: None,
            inserted: false,
            reused: false,
            store_miss: false,
            candidate: false,
            slot: NIL,
        }
    }

    /// The facts, for the scope's identity.
    fn facts(&self) -> Facts {
        (
            self.key,
            self.seen,
            self.position,
            self.inserted,
            self.reused,
            self.store_miss,
        )
    }

    /// Whether the request recorded anything about the key.
    fn has_fact(&self) -> bool {
        self.seen.is_some()
            || self.position.is_some()
            || self.inserted
            || self.reused
            || self.store_miss
    }
}

/// A key's facts, in the order compared: key, first-access index, position, inserted, reused,
/// store miss.
type Facts = (OffloadKey, Option<u32>, Option<u32>, bool, bool, bool);

/// One request's scope. See the module docs.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct RequestAccess {
    /// One entry per key named, in the order first named.
    keys: Vec<KeyAccess>,
    /// Key → entry index (`NIL` = empty), at most half full; empty until the first key.
    index: Vec<u32>,
    /// The accessed entries, in first-access order (all groups together).
    order: Vec<u32>,
    /// Per KV cache group (sorted), how many of its keys were seen.
    seen_per_group: Vec<(u32, u32)>,
    /// The LRU provisional rank, allocated on first need.
    pub(super) lru_rank: Option<u64>,
}

impl RequestAccess {
    /// Whether no call ever gave this scope storage (a fresh default).
    pub(super) fn is_blank(&self) -> bool {
        self.index.is_empty()
    }

    /// Forgets every entry, keeping the storage (for reuse by another request).
    pub(super) fn clear(&mut self) {
        self.keys.clear();
        self.order.clear();
        self.seen_per_group.clear();
        self.index.fill(NIL);
        self.lru_rank = None;
    }

    /// The entry of `key`, or the empty index position where it would go.
    #[inline]
    fn probe(&self, key: &OffloadKey) -> Result<u32, usize> {
        let mask = self.index.len() - 1;
        let mut p = home_of(key, self.index.len());
        loop {
            match self.index[p] {
                NIL => return Err(p),
                e if self.keys[e as usize].key == *key => return Ok(e),
                _ => p = (p + 1) & mask,
            }
        }
    }

    /// Makes room for `more` new keys: the entries, the access order, and an index at most
    /// half full (at least 16 positions; grown by doubling, every entry re-inserted).
    fn reserve(&mut self, more: usize) {
        let want = self.keys.len() + more;
        self.keys.reserve(more);
        self.order.reserve(more);
        if want * 2 <= self.index.len() {
            return;
        }
        let mut len = self.index.len().max(16);
        while want * 2 > len {
            len *= 2;
        }
        self.index.clear();
        self.index.resize(len, NIL);
        for e in 0..self.keys.len() as u32 {
            let Err(p) = self.probe(&self.keys[e as usize].key) else {
                unreachable!("one entry per key")
            };
            self.index[p] = e;
        }
    }

    /// The entry of `key`, if a call named it.
    #[cfg(test)]
    fn find(&self, key: &OffloadKey) -> Option<u32> {
        if self.index.is_empty() {
            return None;
        }
        self.probe(key).ok()
    }

    /// What the request did with `key`, if anything (tests).
    #[cfg(test)]
    pub(super) fn get(&self, key: &OffloadKey) -> Option<&KeyAccess> {
        self.find(key).map(|e| &self.keys[e as usize])
    }

    /// Whether any key has a position.
    pub(super) fn has_positions(&self) -> bool {
        self.keys.iter().any(|a| a.position.is_some())
    }

    /// Admits the keys of one call: gives the ones the request never named an entry and fills
    /// `at` with each key's entry index, parallel to `keys`. Every fact of the call is then set
    /// through them ([`Self::at`]), with no further search.
    #[inline]
    pub(super) fn admit(&mut self, keys: &[OffloadKey], at: &mut Vec<u32>) {
        at.clear();
        self.reserve(keys.len());
        for k in keys {
            let e = match self.probe(k) {
                Ok(e) => e,
                Err(p) => {
                    let e = self.keys.len() as u32;
                    self.keys.push(KeyAccess::new(*k));
                    self.index[p] = e;
                    e
                }
            };
            at.push(e);
        }
    }

    /// [`Self::admit`] into a fresh buffer (tests).
    #[cfg(test)]
    pub(super) fn admit_vec(&mut self, keys: &[OffloadKey]) -> Vec<u32> {
        let mut at = Vec::new();
        self.admit(keys, &mut at);
        at
    }

    /// The entry at index `i` (from [`Self::admit`]).
    #[inline]
    pub(super) fn at(&mut self, i: u32) -> &mut KeyAccess {
        &mut self.keys[i as usize]
    }

    /// The entry at index `i` (from [`Self::commit_order`]).
    #[inline]
    pub(super) fn entry(&self, i: u32) -> &KeyAccess {
        &self.keys[i as usize]
    }

    /// Marks the entry at `i` accessed: `true` (and it gets the next index of its group's
    /// first-access order) if this is its first access (tests; the manager records through
    /// [`Self::record`]).
    #[cfg(test)]
    pub(super) fn see(&mut self, i: u32) -> bool {
        Self::sight(
            &mut self.keys[i as usize],
            i,
            &mut self.seen_per_group,
            &mut self.order,
        )
    }

    /// Marks the entry `a` (at index `i`) accessed, given the scope's other fields: `true`
    /// (and it gets the next index of its group's first-access order) if this is its first
    /// access.
    #[inline(always)]
    fn sight(
        a: &mut KeyAccess,
        i: u32,
        seen_per_group: &mut Vec<(u32, u32)>,
        order: &mut Vec<u32>,
    ) -> bool {
        if a.seen.is_some() {
            return false;
        }
        let group = a.key.group;
        // Most requests have one group: try the last one first.
        let n = seen_per_group.len();
        let g = if n > 0 && seen_per_group[n - 1].0 == group {
            n - 1
        } else {
            match seen_per_group.binary_search_by_key(&group, |e| e.0) {
                Ok(g) => g,
                Err(g) => {
                    seen_per_group.insert(g, (group, 0));
                    g
                }
            }
        };
        let seen = &mut seen_per_group[g].1;
        a.seen = Some(*seen);
        *seen += 1;
        order.push(i);
        true
    }

    /// Records the entry at `i` as accessed by the request (one key of
    /// `_record_request_cache_access`): a first access with a position goes to `ranked` (the
    /// LRU's provisional ranks), and a `reused` key this request did not insert is marked
    /// reused. `true` if this was its first access.
    #[inline(always)]
    pub(super) fn record(
        &mut self,
        i: u32,
        reused: bool,
        ranked: &mut Vec<(OffloadKey, u32)>,
    ) -> bool {
        let a = &mut self.keys[i as usize];
        let first = Self::sight(a, i, &mut self.seen_per_group, &mut self.order);
        if first && let Some(p) = a.position {
            ranked.push((a.key, p));
        }
        if reused {
            a.reused |= !a.inserted;
        }
        first
    }

    /// The accessed entries (indices for [`Self::entry`]) into `out`, in the order a finished
    /// request commits them (vLLM's `order_request_keys`): per group (groups ascending) in
    /// first-access order, a group sorted by position when all its keys have one; then, when
    /// every key has one, all of them by position (stable sorts).
    pub(super) fn commit_order(&self, out: &mut Vec<u32>) {
        out.clear();
        out.extend_from_slice(&self.order);
        let keys = &self.keys;
        let group = |e: &u32| keys[*e as usize].key.group;
        let position = |e: &u32| keys[*e as usize].position;
        if self.seen_per_group.len() > 1 {
            // Stable: each group keeps its first-access order.
            out.sort_by_key(group);
        }
        for run in out.chunk_by_mut(|a, b| group(a) == group(b)) {
            if run.iter().all(|e| position(e).is_some()) {
                run.sort_by_key(position);
            }
        }
        if self.seen_per_group.len() > 1 && out.iter().all(|e| position(e).is_some()) {
            out.sort_by_key(position);
        }
    }

    /// The first-access order itself when it is [`Self::commit_order`] (the common case, read
    /// in place): one group at most, and not every key with a position.
    pub(super) fn first_access_commits(&self) -> Option<&[u32]> {
        let unsorted = self.seen_per_group.len() <= 1
            && (self.order.is_empty()
                || self
                    .order
                    .iter()
                    .any(|&e| self.keys[e as usize].position.is_none()));
        unsorted.then_some(self.order.as_slice())
    }

    /// Every key this scope names.
    pub(super) fn keys(&self) -> impl Iterator<Item = OffloadKey> + '_ {
        self.keys.iter().map(|k| k.key)
    }

    /// The keys of [`Self::commit_order`] (tests).
    #[cfg(test)]
    pub(super) fn commit_keys(&self) -> Vec<OffloadKey> {
        let mut order = Vec::new();
        self.commit_order(&mut order);
        order.iter().map(|&e| self.keys[e as usize].key).collect()
    }

    /// The facts of the entries that carry one, in key order: the scope's identity.
    fn facts(&self) -> Vec<Facts> {
        let mut facts: Vec<_> = self
            .keys
            .iter()
            .filter(|a| a.has_fact())
            .map(KeyAccess::facts)
            .collect();
        facts.sort_unstable_by_key(|f| f.0);
        facts
    }
}

impl PartialEq for RequestAccess {
    /// The same facts and LRU rank (see the module docs).
    fn eq(&self, other: &Self) -> bool {
        self.lru_rank == other.lru_rank && self.facts() == other.facts()
    }
}

impl Eq for RequestAccess {}

impl core::hash::Hash for RequestAccess {
    /// The facts in key order and the LRU rank (see the module docs).
    fn hash<H: core::hash::Hasher>(&self, state: &mut H) {
        self.lru_rank.hash(state);
        self.facts().hash(state);
    }
}
