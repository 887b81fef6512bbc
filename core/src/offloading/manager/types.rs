//! The manager's public vocabulary: keys and chunks, what a lookup finds, the config and the
//! policy kind, who accesses keys, what a store offer decided, events and errors. Every file of
//! the manager uses these; they are re-exported from [`crate::offloading`].

use alloc::vec::Vec;

use crate::{BlockHash, RequestId};

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

/// What [`CpuOffloadingManager::lookup`](super::CpuOffloadingManager::lookup) found for a key.
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

/// Who accesses keys: the request (for request-aware recency) and, optionally, each key's
/// end-token position in the request (parallel to `keys`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Access<'a> {
    /// The request on whose behalf the keys are accessed.
    pub request: Option<RequestId>,
    /// Each key's end-token position in the request, parallel to the keys
    /// ([`Access::NO_POSITION`]: this key's is unknown).
    pub positions: Option<&'a [u32]>,
}

impl Access<'_> {
    /// In [`Access::positions`], a key whose position is unknown (vLLM's `None`).
    pub const NO_POSITION: u32 = u32::MAX;
}

/// What [`CpuOffloadingManager::prepare_store`](super::CpuOffloadingManager::prepare_store) decided.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrepareStoreOutput {
    /// The offered keys that must be written, in offer order.
    pub keys_to_store: Vec<OffloadKey>,
    /// The chunk each of `keys_to_store` is written to (parallel).
    pub chunks: Vec<ChunkId>,
    /// The keys evicted to make room.
    pub evicted: Vec<OffloadKey>,
}

/// Keys stored or removed since the last [`CpuOffloadingManager::take_events`](super::CpuOffloadingManager::take_events).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadEvent {
    /// The keys.
    pub keys: Vec<OffloadKey>,
    /// `true` for a removal, `false` for a store.
    pub removed: bool,
}

/// A typed refusal of a manager call; the manager is unchanged.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
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
