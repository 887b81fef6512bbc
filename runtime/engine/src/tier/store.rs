//! The store behind the shared tier: a Redis Cluster (`redis://HOST:PORT,…`), an in-process
//! map (`memory`, for tests), or a store of the embedder's behind [`StoreBackend`] (the seam the
//! simulation's faulty store enters by). A chunk is one command either way: every rank's shard
//! of it shares a hash slot, so `EXISTS`, `MSET` and `MGET` name all of them at once; commands
//! of a batch go out together over the cluster client's multiplexed connections.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;

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
    Redis(RedisLink),
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
        let nodes: Vec<String> = endpoints
            .iter()
            .map(|e| {
                let node = e.strip_prefix("redis://").filter(|n| is_node(n));
                node.map(|_| e.clone())
                    .ok_or_else(|| StoreError::BadEndpoint(e.clone()))
            })
            .collect::<Result<_, _>>()?;
        if nodes.is_empty() {
            return Err(StoreError::BadEndpoint(String::new()));
        }
        let failed = |e: redis::RedisError| StoreError::Connect {
            endpoints: nodes.join(","),
            reason: e.to_string(),
        };
        // The crate's retries wait 1.28 s at least by default: past any deadline of ours.
        let client = ClusterClientBuilder::new(nodes.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(100)
            .build()
            .map_err(failed)?;
        let connect = client.get_async_connection();
        match tokio::time::timeout(timeout, connect).await {
            Ok(conn) => Ok(Self::Redis(RedisLink::new(
                client,
                conn.map_err(failed)?,
                timeout,
            ))),
            Err(_) => Err(StoreError::Connect {
                endpoints: nodes.join(","),
                reason: format!("no answer within {timeout:?}"),
            }),
        }
    }

    /// Fresh connections that replaced a failing one so far (Redis only: see [`RedisLink`]).
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
            Self::Redis(c) => {
                let mut pipe = redis::pipe();
                for g in groups {
                    pipe.cmd("EXISTS").arg(g);
                }
                let out: Vec<redis::RedisResult<usize>> = c.pipeline(&mut pipe).await?;
                Ok(out
                    .into_iter()
                    .zip(groups)
                    .map(|(r, g)| r.map(|n| n == g.len()).map_err(command))
                    .collect())
            }
        }
    }

    /// Writes every group's pairs (one `MSET` per group; groups as in [`Store::exists_many`]).
    pub async fn put_many(&self, groups: &[Vec<(String, Vec<u8>)>]) -> Answers<()> {
        match self {
            Self::Custom(b) => b.put_many(groups).await,
            Self::Memory(m) => {
                let mut map = m.map();
                for (k, v) in groups.iter().flatten() {
                    map.insert(k.clone(), v.clone());
                }
                Ok(groups.iter().map(|_| Ok(())).collect())
            }
            Self::Redis(c) => {
                let mut pipe = redis::pipe();
                for g in groups {
                    let cmd = pipe.cmd("MSET");
                    for (k, v) in g {
                        cmd.arg(k).arg(v.as_slice());
                    }
                }
                let out: Vec<redis::RedisResult<redis::Value>> = c.pipeline(&mut pipe).await?;
                Ok(out
                    .into_iter()
                    .map(|r| r.map(|_| ()).map_err(command))
                    .collect())
            }
        }
    }

    /// Every group's values (`None`: absent; one `MGET` per group, groups as in
    /// [`Store::exists_many`]).
    pub async fn get_many(&self, groups: &[Vec<String>]) -> Answers<Vec<Option<Vec<u8>>>> {
        match self {
            Self::Custom(b) => b.get_many(groups).await,
            Self::Memory(m) => {
                let map = m.map();
                Ok(groups
                    .iter()
                    .map(|g| Ok(g.iter().map(|k| map.get(k).cloned()).collect()))
                    .collect())
            }
            Self::Redis(c) => {
                let mut pipe = redis::pipe();
                for g in groups {
                    pipe.cmd("MGET").arg(g);
                }
                let out: Vec<redis::RedisResult<Vec<Option<Vec<u8>>>>> =
                    c.pipeline(&mut pipe).await?;
                Ok(out.into_iter().map(|r| r.map_err(command)).collect())
            }
        }
    }
}

/// Whether `node` is `HOST:PORT` (a port from 1): what every Redis endpoint names after
/// `redis://`, from `--tier` or from a config file.
pub fn is_node(node: &str) -> bool {
    node.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
}

fn command(e: redis::RedisError) -> StoreError {
    StoreError::Command(e.to_string())
}

/// A Redis Cluster connection that heals itself. A command that fails, or is dropped unfinished
/// (past its deadline), marks the connection suspect; the next command starts a fresh one in
/// the background (connections to the nodes that answer, the slot map as they see it), at most
/// one at a time and one per [`RECONNECT_EVERY`], and uses the current one meanwhile: no
/// command waits past its deadline for a reconnection. Why: after a master is killed, the
/// redis crate's cluster connection (1.8.1) can stay wedged for good — its slot refresh never
/// completes, every later command times out, those for the promoted replica's slots and the
/// live masters' included (`tests/tier/test_tier.py`, failover). Cheap to clone (a handle).
#[derive(Clone)]
pub struct RedisLink(Arc<Link>);

struct Link {
    client: ClusterClient,
    timeout: Duration,
    state: Mutex<LinkState>,
}

impl std::fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("RedisLink")
            .field("generation", &s.generation)
            .field("suspect", &s.suspect)
            .field("reconnects", &s.reconnects)
            .finish_non_exhaustive()
    }
}

/// At most one reconnection started per this long.
pub const RECONNECT_EVERY: Duration = Duration::from_millis(250);

struct LinkState {
    conn: ClusterConnection,
    /// Which connection `conn` is (a failure of an older one suspects nothing).
    generation: u64,
    suspect: bool,
    reconnecting: bool,
    last_attempt: Option<Instant>,
    reconnects: u64,
}

impl RedisLink {
    fn new(client: ClusterClient, conn: ClusterConnection, timeout: Duration) -> Self {
        let state = LinkState {
            conn,
            generation: 0,
            suspect: false,
            reconnecting: false,
            last_attempt: None,
            reconnects: 0,
        };
        Self(Arc::new(Link {
            client,
            timeout,
            state: Mutex::new(state),
        }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LinkState> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fresh connections that replaced a suspect one so far.
    pub fn reconnects(&self) -> u64 {
        self.state().reconnects
    }

    /// The connection to use and its generation; starts a reconnection if one is due.
    fn current(&self) -> (ClusterConnection, u64) {
        let mut s = self.state();
        let due = s
            .last_attempt
            .is_none_or(|t| t.elapsed() >= RECONNECT_EVERY);
        if s.suspect && !s.reconnecting && due {
            s.reconnecting = true;
            s.last_attempt = Some(Instant::now());
            tokio::spawn(self.clone().reconnect());
        }
        (s.conn.clone(), s.generation)
    }

    async fn reconnect(self) {
        let fresh = tokio::time::timeout(self.0.timeout, self.0.client.get_async_connection());
        let fresh = fresh.await;
        let mut s = self.state();
        s.reconnecting = false;
        match fresh {
            Ok(Ok(conn)) => {
                s.conn = conn;
                s.generation += 1;
                s.suspect = false;
                s.reconnects += 1;
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "tier: reconnecting failed"),
            Err(_) => tracing::debug!("tier: reconnecting timed out"),
        }
    }

    /// Sends `pipe` (one slot) and returns each command's own result.
    async fn pipeline<T: redis::FromRedisValue>(
        &self,
        pipe: &mut redis::Pipeline,
    ) -> Result<Vec<redis::RedisResult<T>>, StoreError> {
        let (mut conn, generation) = self.current();
        let mut watch = Suspect {
            link: self,
            generation,
            armed: true,
        };
        let out = pipe
            .ignore_errors()
            .query_async::<Vec<redis::RedisResult<T>>>(&mut conn)
            .await;
        watch.armed = !matches!(&out, Ok(all) if all.iter().all(Result::is_ok));
        out.map_err(command)
    }
}

/// Suspects its connection when dropped armed: a command that failed, or never finished.
struct Suspect<'a> {
    link: &'a RedisLink,
    generation: u64,
    armed: bool,
}

impl Drop for Suspect<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut s = self.link.state();
            if s.generation == self.generation {
                s.suspect = true;
            }
        }
    }
}
