//! The tier's Redis Cluster client: the few commands the tier sends (`EXISTS`, `MSET`, `MGET`,
//! `CLUSTER SLOTS`), pipelined per node over one connection each, framed and parsed here
//! (`wire.rs`). Why not the `redis` crate: it copied every value five times on its way out and
//! cloned each pipeline for its retries, so the tier moved a third of what `redis-benchmark`
//! does on the same cluster (`docs/TIERING.md`, "Against redis-benchmark"); and its cluster
//! connection stayed wedged after a master was killed. Here a value is copied once into the
//! socket buffer, and a reply's bulk string once out of it.
//!
//! # Failures
//!
//! Nothing here retries: a command that fails is a failed chunk, which the core turns into a
//! miss or a failed job. A connection that breaks, or whose caller gave up waiting (its
//! deadline), is dropped and every command waiting on it fails; the next command to that node
//! opens a fresh one. A `MOVED` or `ASK` answer, or a node that cannot be reached, refreshes the
//! slot map in the background (one refresh at a time, one per [`REFRESH_EVERY`]) from any node
//! that answers: after a failover, the promoted replica serves its slots within one refresh.
//!
//! # When to call what
//!
//! [`Cluster::connect`] once (it fails unless a node answers `CLUSTER SLOTS` in time), then
//! [`Cluster::exists`], [`Cluster::mset`] and [`Cluster::mget`] from any task, each under its
//! caller's deadline.

mod conn;
mod wire;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use self::conn::{Conn, Waiting};
pub(crate) use self::wire::Reply;
use self::wire::{Command, Frames, key_slot};

/// At most one slot-map refresh started per this long.
pub const REFRESH_EVERY: Duration = Duration::from_millis(250);

/// A Redis Cluster: its slot map and a connection per node. Cheap to clone (a handle).
#[derive(Clone)]
pub struct Cluster(Arc<Inner>);

struct Inner {
    /// The endpoints given (`HOST:PORT`): where a refresh asks when no known node answers.
    seeds: Vec<String>,
    timeout: Duration,
    state: Mutex<State>,
}

struct State {
    /// Per slot, the index in `nodes` of its master (`None`: no node serves it).
    slots: Vec<Option<u16>>,
    nodes: Vec<Node>,
    refreshing: bool,
    last_refresh: Option<Instant>,
    /// Whether a connection was ever lost.
    lost: bool,
    /// Connections opened since one was lost (to its node again, or to one a refreshed slot
    /// map named: a promoted replica).
    reconnects: u64,
}

struct Node {
    addr: String,
    conn: Option<Arc<Conn>>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        let nodes: Vec<&str> = s.nodes.iter().map(|n| n.addr.as_str()).collect();
        f.debug_struct("Cluster")
            .field("nodes", &nodes)
            .field("reconnects", &s.reconnects)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Asks `seeds` (`HOST:PORT`) for the slot map, within `timeout`; every later command is
    /// its caller's to bound.
    pub async fn connect(seeds: Vec<String>, timeout: Duration) -> Result<Self, String> {
        let map = tokio::time::timeout(timeout, slot_map(&seeds, timeout))
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))??;
        let cluster = Self(Arc::new(Inner {
            seeds,
            timeout,
            state: Mutex::new(State {
                slots: vec![None; wire::SLOTS],
                nodes: Vec::new(),
                refreshing: false,
                last_refresh: Some(Instant::now()),
                lost: false,
                reconnects: 0,
            }),
        }));
        cluster.install(map);
        Ok(cluster)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connections opened since one was lost (to its node again, or to a promoted replica).
    pub fn reconnects(&self) -> u64 {
        self.state().reconnects
    }

    /// The masters serving slots.
    pub fn masters(&self) -> usize {
        let s = self.state();
        let mut used: Vec<u16> = s.slots.iter().flatten().copied().collect();
        used.sort_unstable();
        used.dedup();
        used.len()
    }

    /// The master serving `key`'s slot (an index among the nodes this client knows), if any.
    pub fn master_of(&self, key: &str) -> Option<u16> {
        self.state().slots[key_slot(key)]
    }

    /// Per group, whether every key of it exists (one `EXISTS` per group).
    pub async fn exists(&self, groups: &[Vec<String>]) -> Vec<Result<bool, String>> {
        let cmds = groups.iter().map(|g| Command::keys("EXISTS", g)).collect();
        let replies = self.send(cmds).await;
        replies
            .into_iter()
            .zip(groups)
            .map(|(r, g)| match r? {
                Reply::Int(n) => Ok(n == g.len() as i64),
                other => Err(unexpected("EXISTS", &other)),
            })
            .collect()
    }

    /// Writes every group's pairs (one `MSET` per group; the values go on the wire uncopied).
    pub async fn mset(&self, groups: Vec<Vec<(String, Vec<u8>)>>) -> Vec<Result<(), String>> {
        let cmds = groups
            .into_iter()
            .map(|g| Command::pairs("MSET", g))
            .collect();
        let replies = self.send(cmds).await;
        replies
            .into_iter()
            .map(|r| match r? {
                Reply::Simple(_) => Ok(()),
                other => Err(unexpected("MSET", &other)),
            })
            .collect()
    }

    /// Every group's values (`None`: absent; one `MGET` per group), views of the read buffer.
    pub async fn mget(&self, groups: &[Vec<String>]) -> Vec<Result<Vec<Option<Bytes>>, String>> {
        let cmds = groups.iter().map(|g| Command::keys("MGET", g)).collect();
        let replies = self.send(cmds).await;
        replies
            .into_iter()
            .zip(groups)
            .map(|(r, g)| match r? {
                Reply::Array(items) if items.len() == g.len() => items
                    .into_iter()
                    .map(|i| match i {
                        Reply::Bulk(v) => Ok(v),
                        other => Err(unexpected("MGET", &other)),
                    })
                    .collect(),
                other => Err(unexpected("MGET", &other)),
            })
            .collect()
    }

    /// Sends each command to the master of its first key's slot (a node's queued together)
    /// and returns each one's reply, in order.
    async fn send(&self, cmds: Vec<Command<'_>>) -> Vec<Result<Reply, String>> {
        let mut out: Vec<Result<Reply, String>> =
            (0..cmds.len()).map(|_| Err("not sent".into())).collect();
        let mut by_node: BTreeMap<u16, (Vec<usize>, Frames)> = BTreeMap::new();
        let mut unrouted = false;
        {
            let s = self.state();
            for (i, cmd) in cmds.into_iter().enumerate() {
                let node = cmd.first_key().and_then(|k| s.slots[key_slot(k)]);
                match node {
                    Some(n) => {
                        let (idx, frames) = by_node.entry(n).or_default();
                        idx.push(i);
                        cmd.write(frames);
                    }
                    None => {
                        out[i] = Err("no node serves the key's slot".into());
                        unrouted = true;
                    }
                }
            }
        }
        if unrouted {
            self.refresh_soon();
        }
        // Every node's commands go out first, then the replies are awaited: all in flight at once.
        let mut waiting = Vec::with_capacity(by_node.len());
        for (node, (idx, frames)) in by_node {
            let n = idx.len();
            waiting.push((idx, self.submit(node, frames, n).await));
        }
        for (idx, sent) in waiting {
            let replies = match sent {
                Ok(w) => w.replies().await,
                Err(e) => Err(e),
            };
            match replies {
                Ok(replies) => {
                    if replies.iter().any(Reply::is_redirect) {
                        self.refresh_soon();
                    }
                    for (i, r) in idx.into_iter().zip(replies) {
                        out[i] = match r {
                            Reply::Error(e) => Err(e),
                            r => Ok(r),
                        };
                    }
                }
                Err(e) => {
                    self.refresh_soon();
                    idx.into_iter().for_each(|i| out[i] = Err(e.clone()));
                }
            }
        }
        out
    }
}

impl Cluster {
    /// Writes `frames` (`n` commands) on `node`'s connection, opening one if it has none.
    async fn submit(&self, node: u16, frames: Frames, n: usize) -> Result<Waiting, String> {
        let conn = self.conn(node).await?;
        conn.submit(frames.into_segments(), n)
    }

    /// `node`'s live connection, or a fresh one.
    async fn conn(&self, node: u16) -> Result<Arc<Conn>, String> {
        let addr = {
            let mut s = self.state();
            let n = &s.nodes[usize::from(node)];
            match &n.conn {
                Some(c) if c.alive() => return Ok(c.clone()),
                Some(_) => s.lost = true,
                None => {}
            }
            s.nodes[usize::from(node)].addr.clone()
        };
        let fresh = Arc::new(Conn::open(&addr, self.0.timeout).await?);
        let mut s = self.state();
        let n = &mut s.nodes[usize::from(node)];
        // Another task may have opened one meanwhile: the first stays, so one serves a node.
        if let Some(c) = n.conn.as_ref().filter(|c| c.alive()) {
            return Ok(c.clone());
        }
        n.conn = Some(fresh.clone());
        s.reconnects += u64::from(s.lost);
        Ok(fresh)
    }

    /// Starts a slot-map refresh in the background, unless one runs or one started less than
    /// [`REFRESH_EVERY`] ago.
    fn refresh_soon(&self) {
        let mut s = self.state();
        let due = s.last_refresh.is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
        if s.refreshing || !due {
            return;
        }
        s.refreshing = true;
        s.last_refresh = Some(Instant::now());
        drop(s);
        let this = self.clone();
        tokio::spawn(async move {
            let mut asked: Vec<String> =
                this.state().nodes.iter().map(|n| n.addr.clone()).collect();
            asked.extend(this.0.seeds.iter().cloned());
            let timeout = this.0.timeout;
            let map = tokio::time::timeout(timeout, slot_map(&asked, timeout)).await;
            match map {
                Ok(Ok(map)) => this.install(map),
                Ok(Err(e)) => tracing::debug!(error = %e, "tier: slot map refresh failed"),
                Err(_) => tracing::debug!("tier: slot map refresh timed out"),
            }
            this.state().refreshing = false;
        });
    }

    /// Takes `map` (slot ranges and their masters' addresses) as the slot map, keeping the
    /// connections of nodes that stay.
    fn install(&self, map: Vec<(u16, u16, String)>) {
        let mut s = self.state();
        let mut slots = vec![None; wire::SLOTS];
        for (from, to, addr) in map {
            let idx = match s.nodes.iter().position(|n| n.addr == addr) {
                Some(i) => i,
                None => {
                    s.nodes.push(Node { addr, conn: None });
                    s.nodes.len() - 1
                }
            };
            for slot in &mut slots[usize::from(from)..=usize::from(to)] {
                *slot = u16::try_from(idx).ok();
            }
        }
        s.slots = slots;
    }
}

/// The slot map as the first of `nodes` to answer `CLUSTER SLOTS` sees it: (first slot, last
/// slot, master's `HOST:PORT`).
async fn slot_map(nodes: &[String], timeout: Duration) -> Result<Vec<(u16, u16, String)>, String> {
    let mut last = String::from("no node to ask");
    for addr in nodes {
        let asked = async {
            let conn = Arc::new(Conn::open(addr, timeout).await?);
            let mut frames = Frames::default();
            Command::keys("CLUSTER", &["SLOTS".to_owned()]).write(&mut frames);
            let reply = conn.submit(frames.into_segments(), 1)?.replies().await?;
            wire::slot_ranges(&reply[0], addr)
        };
        match asked.await {
            Ok(map) if !map.is_empty() => return Ok(map),
            Ok(_) => last = format!("{addr}: no slot assigned"),
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    Err(last)
}

fn unexpected(cmd: &str, reply: &Reply) -> String {
    match reply {
        Reply::Error(e) => format!("{cmd}: {e}"),
        other => format!("{cmd}: unexpected reply {other:?}"),
    }
}
