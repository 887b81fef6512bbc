//! The store behind the shared tier: a Redis Cluster (`redis://HOST:PORT,…`), an in-process
//! map (`memory`, for tests), or a store of the embedder's behind [`StoreBackend`] (the seam the
//! simulation's faulty store enters by). A chunk is one command either way: every rank's shard
//! of it shares a hash slot, so `EXISTS`, `MSET` and `MGET` name all of them at once; a batch's
//! commands to a node are queued together on its connection (`resp/`, the tier's own Redis
//! Cluster client).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::resp::Cluster;

/// Why a store call failed.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The endpoints are not a store this build reaches.
    #[error("bad tier endpoint {0:?}: expected redis://HOST:PORT[,HOST:PORT...] or memory")]
    BadEndpoint(String),
    /// The cluster could not be reached.
    #[error("cannot connect to the tier at {endpoints}: {reason}")]
    Connect { endpoints: String, reason: String },
    /// A command failed.
    #[error("tier command failed: {0}")]
    Command(String),
    /// The core refused what the tier reported (a bug of the tier's runtime, never of input).
    #[error("the tiering manager refused a report: {0}")]
    Protocol(String),
}

/// The store. Cheap to clone (a handle).
#[derive(Clone)]
pub enum Store {
    /// A Redis Cluster.
    Redis(Cluster),
    /// An in-process map, shared by clones.
    Memory(MemoryStore),
    /// A store of the embedder's (see [`StoreBackend`]).
    Custom(Arc<dyn StoreBackend>),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Redis(_) => f.write_str("Store::Redis"),
            Self::Memory(m) => f.debug_tuple("Store::Memory").field(&m.len()).finish(),
            Self::Custom(b) => f.debug_tuple("Store::Custom").field(b).finish(),
        }
    }
}

/// Per group, a command's own result; `Err`: the whole call failed.
pub type Answers<T> = Result<Vec<Result<T, StoreError>>, StoreError>;

/// A boxed future of [`StoreBackend`] (a trait object).
pub type StoreFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The tier's seam, as `Transport`, `Clock` and `TransferEngine` are the engine's: a store the
/// engine does not know, behind the calls of [`Store`] (groups as in [`Store::exists_many`]).
/// The simulation's (`kvrelay-sim`) takes virtual time and loses, tears and delays values as
/// its seed draws; the engine holds no fault switch. Install it with
/// [`crate::Engine::share_tier_store`].
pub trait StoreBackend: Send + Sync + std::fmt::Debug {
    /// As [`Store::exists_many`].
    fn exists_many<'a>(&'a self, groups: &'a [Vec<String>]) -> StoreFuture<'a, Answers<bool>>;
    /// As [`Store::put_many`].
    fn put_many<'a>(&'a self, groups: &'a [Vec<(String, Vec<u8>)>])
    -> StoreFuture<'a, Answers<()>>;
    /// As [`Store::get_many`].
    fn get_many<'a>(
        &'a self,
        groups: &'a [Vec<String>],
    ) -> StoreFuture<'a, Answers<Vec<Option<Vec<u8>>>>>;
}

/// The in-process store: values by key.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    values: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl MemoryStore {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.values.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many values it holds.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys it holds, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.map().keys().cloned().collect();
        k.sort();
        k
    }

    /// Replaces a value (a test's way to corrupt or evict one: `None` removes it).
    pub fn set_raw(&self, key: &str, value: Option<Vec<u8>>) {
        match value {
            Some(v) => self.map().insert(key.to_string(), v),
            None => self.map().remove(key),
        };
    }

    /// A value as stored.
    pub fn get_raw(&self, key: &str) -> Option<Vec<u8>> {
        self.map().get(key).cloned()
    }
}

impl Store {
    /// Connects to `endpoints` (`memory`, or Redis Cluster nodes, any of which finds the rest),
    /// within `timeout`; every later command has `timeout` too.
    pub async fn connect(endpoints: &[String], timeout: Duration) -> Result<Self, StoreError> {
        if endpoints == ["memory"] {
            return Ok(Self::Memory(MemoryStore::default()));
        }
        let seeds: Vec<String> = endpoints
            .iter()
            .map(|e| {
                let node = e.strip_prefix("redis://").filter(|n| is_node(n));
                node.map(str::to_owned)
                    .ok_or_else(|| StoreError::BadEndpoint(e.clone()))
            })
            .collect::<Result<_, _>>()?;
        if seeds.is_empty() {
            return Err(StoreError::BadEndpoint(String::new()));
        }
        Cluster::connect(seeds, timeout)
            .await
            .map(Self::Redis)
            .map_err(|reason| StoreError::Connect {
                endpoints: endpoints.join(","),
                reason,
            })
    }

    /// Connections opened since one was lost (Redis only: [`Cluster::reconnects`]).
    pub fn reconnects(&self) -> u64 {
        match self {
            Self::Redis(link) => link.reconnects(),
            _ => 0,
        }
    }

    /// Per group, whether every key of it exists. A group is one chunk's shard keys; every
    /// group of a call must hash to one slot (one pipeline, one round trip). `Err`: the whole
    /// call failed; a group's own error is its entry's.
    pub async fn exists_many(&self, groups: &[Vec<String>]) -> Answers<bool> {
        match self {
            Self::Custom(b) => b.exists_many(groups).await,
            Self::Memory(m) => {
                let map = m.map();
                Ok(groups
                    .iter()
                    .map(|g| Ok(g.iter().all(|k| map.contains_key(k))))
                    .collect())
            }
            Self::Redis(c) => Ok(answers(c.exists(groups).await)),
        }
    }

    /// Writes every group's pairs (one `MSET` per group; groups as in [`Store::exists_many`]).
    /// The values are moved to the store (a Redis Cluster's go on the wire uncopied).
    pub async fn put_many(&self, groups: Vec<Vec<(String, Vec<u8>)>>) -> Answers<()> {
        match self {
            Self::Custom(b) => b.put_many(&groups).await,
            Self::Memory(m) => {
                let answers = groups.iter().map(|_| Ok(())).collect();
                m.map().extend(groups.into_iter().flatten());
                Ok(answers)
            }
            Self::Redis(c) => Ok(answers(c.mset(groups).await)),
        }
    }

    /// Every group's values (`None`: absent; one `MGET` per group, groups as in
    /// [`Store::exists_many`]).
    pub async fn get_many(&self, groups: &[Vec<String>]) -> Answers<Vec<Option<Bytes>>> {
        match self {
            Self::Custom(b) => Ok(b
                .get_many(groups)
                .await?
                .into_iter()
                .map(|g| g.map(|values| values.into_iter().map(|v| v.map(Bytes::from)).collect()))
                .collect()),
            Self::Memory(m) => {
                let map = m.map();
                let get = |k: &String| map.get(k).map(|v| Bytes::copy_from_slice(v));
                Ok(groups
                    .iter()
                    .map(|g| Ok(g.iter().map(get).collect()))
                    .collect())
            }
            Self::Redis(c) => Ok(answers(c.mget(groups).await)),
        }
    }
}

/// Whether `node` is `HOST:PORT` (a port from 1): what every Redis endpoint names after
/// `redis://`, from `--tier` or from a config file.
pub fn is_node(node: &str) -> bool {
    node.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
}

fn answers<T>(all: Vec<Result<T, String>>) -> Vec<Result<T, StoreError>> {
    all.into_iter()
        .map(|r| r.map_err(StoreError::Command))
        .collect()
}
