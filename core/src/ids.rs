//! Ids as newtypes, and the interner that turns vLLM's string request ids into dense ones.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

/// A request, as a dense index handed out by an [`Interner`].
///
/// Dense so that per-request counters are array slots: the aggregator's hot path indexes by
/// `RequestId::index()` instead of hashing a string.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct RequestId(pub u32);

impl RequestId {
    /// The slot of this id in dense per-request tables.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A GPU KV-cache block (vLLM's integer block id).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BlockId(pub u64);

/// The null block: what a sliding-window group's table holds for a block below its window. It
/// is never allocated, freed, cached or transferred.
pub const NULL_BLOCK: BlockId = BlockId(0);

/// A transfer job of the offloading connector; strictly increasing per connector (I-38).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct JobId(pub u64);

/// A worker rank, `0..world_size`.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl Rank {
    /// The slot of this rank in per-rank tables.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// An engine step: one `schedule()` and the execution and processing of its output.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    Eq,
    Hash,
    Ord,
    PartialEq,
    PartialOrd,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct StepId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req#{}", self.0)
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// Maps external request ids (vLLM's strings) to dense [`RequestId`]s and back.
///
/// Call [`Interner::intern`] where a request enters the system (the engine's `add_request`, a
/// conformance case's arguments), and [`Interner::resolve`] where ids leave it (logs, outputs to
/// Python). Ids are handed out in first-seen order, so the mapping is deterministic.
///
/// [`Interner::release`] recycles an id once nothing refers to it any more (for the aggregator:
/// [`crate::Aggregator::is_idle`]); without it the dense tables grow with every request ever seen.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Interner {
    by_name: BTreeMap<String, RequestId>,
    names: Vec<Option<String>>,
    free: Vec<RequestId>,
}

impl Interner {
    /// An empty interner.
    pub fn new() -> Self {
        Self::default()
    }

    /// The id of `name`, allocating one on first sight (reusing a released id if any).
    pub fn intern(&mut self, name: &str) -> RequestId {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.names[id.index()] = Some(String::from(name));
                id
            }
            None => {
                let id = RequestId(
                    u32::try_from(self.names.len()).expect("more than u32::MAX live request ids"),
                );
                self.names.push(Some(String::from(name)));
                id
            }
        };
        self.by_name.insert(String::from(name), id);
        id
    }

    /// The id of `name` if it is interned.
    pub fn get(&self, name: &str) -> Option<RequestId> {
        self.by_name.get(name).copied()
    }

    /// The name of `id`, if `id` is live.
    pub fn resolve(&self, id: RequestId) -> Option<&str> {
        self.names.get(id.index()).and_then(|n| n.as_deref())
    }

    /// Forgets `name`; its id may be handed out again. Returns the id it had, if any.
    ///
    /// Call only when no machine still holds state for the id, or the new owner of the id
    /// inherits that state.
    pub fn release(&mut self, name: &str) -> Option<RequestId> {
        let id = self.by_name.remove(name)?;
        self.names[id.index()] = None;
        self.free.push(id);
        Some(id)
    }

    /// Number of live (interned, not released) ids.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether no id is live.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// One past the largest id ever handed out: the size dense tables need.
    pub fn capacity(&self) -> usize {
        self.names.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_is_dense_first_seen_and_recycles_released_ids() {
        let mut i = Interner::new();
        assert_eq!(i.intern("b"), RequestId(0));
        assert_eq!(i.intern("a"), RequestId(1));
        assert_eq!(i.intern("b"), RequestId(0));
        assert_eq!(i.resolve(RequestId(1)), Some("a"));
        assert_eq!(i.release("b"), Some(RequestId(0)));
        assert_eq!(i.release("b"), None);
        assert_eq!(i.resolve(RequestId(0)), None);
        assert_eq!(i.intern("c"), RequestId(0), "released ids are reused");
        assert_eq!((i.len(), i.capacity()), (2, 2));
        // Lookups see releases: `get` of a released name is None, and the interner knows when
        // it is empty.
        assert_eq!(i.get("a"), Some(RequestId(1)));
        assert_eq!(i.get("b"), None, "released");
        assert!(!i.is_empty());
        i.release("a");
        i.release("c");
        assert!(i.is_empty());
        assert_eq!(Interner::new().get("a"), None);
    }
}
