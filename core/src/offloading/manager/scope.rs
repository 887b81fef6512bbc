//! A request's scope of accesses (vLLM's `_RequestCacheAccess` plus the LRU request rank): what
//! the manager remembers about each key a request touched until `on_request_finished` hands it
//! to the policy.
//!
//! One entry per key, kept **sorted by key** in a `Vec`: a call admits its keys once (a binary
//! search each, new keys merged in one pass, no allocation per key) and then sets every fact by
//! index; and the representation is
//! canonical — two scopes holding the same facts are equal and hash equally, whatever order the
//! keys arrived in (the model checker's state identity). The request's first-access order, which
//! the policy needs at the end, is kept per KV cache group as each key's index in it.

use alloc::vec::Vec;

use super::types::OffloadKey;

/// What a request did with one key.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
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
        }
    }
}

/// One request's scope. See the module docs.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct RequestAccess {
    /// Sorted by key, one entry per key.
    keys: Vec<KeyAccess>,
    /// Per KV cache group (sorted), how many of its keys were seen.
    seen_per_group: Vec<(u32, u32)>,
    /// The LRU provisional rank, allocated on first need.
    pub(super) lru_rank: Option<u64>,
    /// A call admitted keys the scope did not hold: some may end the call with no fact, and
    /// [`Self::prune`] drops them. Always `false` between calls.
    admitted_new: bool,
}

impl RequestAccess {
    /// What the request did with `key`, if anything.
    pub(super) fn get(&self, key: &OffloadKey) -> Option<&KeyAccess> {
        self.keys
            .binary_search_by(|a| a.key.cmp(key))
            .ok()
            .map(|i| &self.keys[i])
    }

    /// Whether any key has a position.
    pub(super) fn has_positions(&self) -> bool {
        self.keys.iter().any(|a| a.position.is_some())
    }

    /// Admits the keys of one call: merges the ones the request never touched (one pass) and
    /// returns each key's entry index, parallel to `keys`. The indices stay valid until the
    /// next `admit`; every fact of the call is then set through them ([`Self::at`]), with no
    /// further search.
    pub(super) fn admit(&mut self, keys: &[OffloadKey]) -> Vec<u32> {
        let find = |v: &[KeyAccess], k: &OffloadKey| v.binary_search_by(|a| a.key.cmp(k));
        // Until new keys are merged in: the old index of a present key, `u32::MAX` for a new one.
        let mut at = Vec::with_capacity(keys.len());
        let mut fresh = Vec::new();
        for k in keys {
            match find(&self.keys, k) {
                Ok(i) => at.push(i as u32),
                Err(_) => {
                    fresh.push(*k);
                    at.push(u32::MAX);
                }
            }
        }
        if fresh.is_empty() {
            return at;
        }
        fresh.sort_unstable();
        fresh.dedup();
        let placed = self.merge(&fresh);
        self.admitted_new = true;
        // After the merge a present key moved up by the new keys below it, and a new key is
        // where the merge put it: one search in the (short) list of new keys each, none in the
        // scope.
        for (i, k) in at.iter_mut().zip(keys) {
            let below = fresh.partition_point(|f| f < k);
            *i = if *i == u32::MAX {
                placed[below]
            } else {
                *i + below as u32
            };
        }
        at
    }

    /// Ends a call: drops the entries it admitted without recording any fact, so that a scope
    /// holds exactly the facts of its request (its identity does not depend on which keys a
    /// call merely named).
    pub(super) fn prune(&mut self) {
        if core::mem::take(&mut self.admitted_new) {
            self.keys.retain(|a| {
                a.seen.is_some() || a.position.is_some() || a.inserted || a.reused || a.store_miss
            });
        }
    }

    /// The entry at index `i` (from [`Self::admit`]).
    pub(super) fn at(&mut self, i: u32) -> &mut KeyAccess {
        &mut self.keys[i as usize]
    }

    /// Merges sorted keys absent from the scope, in place from the back (no allocation when
    /// the scope has room); returns where each of them now is.
    fn merge(&mut self, fresh: &[OffloadKey]) -> Vec<u32> {
        let old_len = self.keys.len();
        let mut placed = alloc::vec![0u32; fresh.len()];
        self.keys
            .resize(old_len + fresh.len(), KeyAccess::new(fresh[0]));
        let (mut i, mut j, mut w) = (old_len, fresh.len(), self.keys.len());
        while j > 0 {
            w -= 1;
            if i > 0 && self.keys[i - 1].key > fresh[j - 1] {
                i -= 1;
                self.keys[w] = self.keys[i];
            } else {
                j -= 1;
                self.keys[w] = KeyAccess::new(fresh[j]);
                placed[j] = w as u32;
            }
        }
        placed
    }

    /// Marks the entry at `i` accessed: `true` (and it gets the next index of its group's
    /// first-access order) if this is its first access.
    pub(super) fn see(&mut self, i: u32) -> bool {
        let a = &mut self.keys[i as usize];
        if a.seen.is_some() {
            return false;
        }
        let group = a.key.group;
        let g = match self.seen_per_group.binary_search_by_key(&group, |e| e.0) {
            Ok(g) => g,
            Err(g) => {
                self.seen_per_group.insert(g, (group, 0));
                g
            }
        };
        a.seen = Some(self.seen_per_group[g].1);
        self.seen_per_group[g].1 += 1;
        true
    }

    /// The keys accessed, in the order a finished request commits them (vLLM's
    /// `order_request_keys`): per group (groups ascending) in first-access order, a group
    /// sorted by position when all its keys have one; then, when every key has one, all of
    /// them by position (stable sorts).
    pub(super) fn commit_order(&self) -> Vec<OffloadKey> {
        let mut seen: Vec<(u32, u32, Option<u32>, OffloadKey)> = self
            .keys
            .iter()
            .filter_map(|a| a.seen.map(|i| (a.key.group, i, a.position, a.key)))
            .collect();
        seen.sort_unstable_by_key(|e| (e.0, e.1));
        for run in seen.chunk_by_mut(|a, b| a.0 == b.0) {
            if run.iter().all(|e| e.2.is_some()) {
                run.sort_by_key(|e| e.2);
            }
        }
        if seen.iter().all(|e| e.2.is_some()) {
            seen.sort_by_key(|e| e.2);
        }
        seen.into_iter().map(|e| e.3).collect()
    }
}
