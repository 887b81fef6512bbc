//! The simulated shared tier: a store of this process ([`SimStore`]) behind the engine's store
//! seam (`kvrelay_engine::tier::StoreBackend`), its keys spread over [`NODES`] nodes by hash tag
//! as a Redis Cluster spreads its slots; and what the tier did, for the report
//! ([`TierSummary`]).
//!
//! While the fault phase lasts, each command (one slot's pipeline) meets the faults of the run's
//! mix, drawn from the store's own stream of the seed:
//!
//! * a key vanishes: any key of the store, or one the command reads (evicted between probe and
//!   load): the promotion fails, the request recomputes;
//! * a write lands partly: one value of the command truncated, or torn (its tail garbage), under
//!   its key: the reader must refuse it by its header and CRC, a failed load;
//! * the command's node goes away for one to three deadlines: this command and every later one
//!   to that node wait for it to come back, past the deadline (timeouts);
//! * a slow answer, within the deadline.
//!
//! Every wait is a tokio sleep, virtual under the simulation's paused clock; the values live in a
//! `BTreeMap`, so the key a draw picks depends on the seed only.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::mix::{FaultMix, SimRng};
use kvrelay_engine::content::mix;
use kvrelay_engine::tier::TierFigures;
use kvrelay_engine::tier::store::{Answers, StoreBackend, StoreFuture};

/// The store's nodes.
pub(crate) const NODES: usize = 3;

/// The deadline of every store command of a simulated tier (`TierConfig::timeout_ms`).
pub(crate) const DEADLINE_MS: u64 = 20;

/// The faults the simulated store injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StoreFaults {
    /// Keys removed (anywhere, or under a command reading them).
    pub keys_evicted: u64,
    /// Values written truncated or torn.
    pub writes_torn: u64,
    /// Times a node went away.
    pub nodes_away: u64,
    /// Answers slowed within the deadline.
    pub slow_answers: u64,
}

/// The simulated store (see the module docs). Shared by the engines of a run.
#[derive(Debug)]
pub(crate) struct SimStore {
    state: Mutex<State>,
    faults: FaultMix,
    /// Faults off (the quiescence phase).
    calm: Arc<AtomicBool>,
    deadline: Duration,
}

#[derive(Debug)]
struct State {
    values: BTreeMap<String, Vec<u8>>,
    r: SimRng,
    /// Per node, until when it is away.
    away_until: [Option<Instant>; NODES],
    injected: StoreFaults,
}

impl SimStore {
    pub(crate) fn new(faults: FaultMix, calm: Arc<AtomicBool>, r: SimRng) -> Self {
        Self {
            state: Mutex::new(State {
                values: BTreeMap::new(),
                r,
                away_until: [None; NODES],
                injected: StoreFaults::default(),
            }),
            faults,
            calm,
            deadline: Duration::from_millis(DEADLINE_MS),
        }
    }

    /// The faults injected so far.
    pub(crate) fn injected(&self) -> StoreFaults {
        self.state().injected
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The faults of one command as it is sent (`None`: faults are off): maybe a key of the
    /// store vanishes; the time its answer takes (its node away, or slow).
    fn send(&self, first_key: Option<&str>) -> Option<Duration> {
        if self.calm.load(Ordering::Relaxed) {
            return None;
        }
        let f = &self.faults;
        let mut guard = self.state();
        let s = &mut *guard;
        if s.r.chance(f.tier_evict) && !s.values.is_empty() {
            let nth = s.r.range(0, s.values.len() as u64 - 1) as usize;
            let key = s.values.keys().nth(nth).cloned();
            key.and_then(|k| s.values.remove(&k));
            s.injected.keys_evicted += 1;
        }
        let node = node_of(first_key?);
        let now = Instant::now();
        if let Some(until) = s.away_until[node].filter(|&u| u > now) {
            return Some(until - now);
        }
        let deadline_us = self.deadline.as_micros() as u64;
        if s.r.chance(f.tier_away) {
            let away = Duration::from_micros(s.r.range(deadline_us, 3 * deadline_us));
            s.away_until[node] = Some(now + away);
            s.injected.nodes_away += 1;
            return Some(away);
        }
        if s.r.chance(f.tier_slow) {
            s.injected.slow_answers += 1;
            return Some(Duration::from_micros(
                s.r.range(deadline_us / 10, deadline_us * 9 / 10),
            ));
        }
        None
    }

    /// Sends a command whose first key is `first_key` and waits for its answer.
    async fn answer(&self, first_key: Option<&String>) -> bool {
        let faulty = !self.calm.load(Ordering::Relaxed);
        if let Some(wait) = self.send(first_key.map(String::as_str)) {
            tokio::time::sleep(wait).await;
        }
        faulty
    }
}

/// The node serving `key`: its hash tag's (every shard of a chunk on one node).
fn node_of(key: &str) -> usize {
    let tag = match (key.find('{'), key.find('}')) {
        (Some(a), Some(b)) if a < b => &key[a..b],
        _ => key,
    };
    (tag.bytes().fold(0, |h, b| mix(h ^ u64::from(b))) % NODES as u64) as usize
}

fn first<T>(groups: &[Vec<T>]) -> Option<&T> {
    groups.first().and_then(|g| g.first())
}

impl StoreBackend for SimStore {
    fn exists_many<'a>(&'a self, groups: &'a [Vec<String>]) -> StoreFuture<'a, Answers<bool>> {
        Box::pin(async move {
            self.answer(first(groups)).await;
            let s = self.state();
            Ok(groups
                .iter()
                .map(|g| Ok(g.iter().all(|k| s.values.contains_key(k))))
                .collect())
        })
    }

    fn put_many<'a>(
        &'a self,
        groups: &'a [Vec<(String, Vec<u8>)>],
    ) -> StoreFuture<'a, Answers<()>> {
        Box::pin(async move {
            let faulty = self.answer(first(groups).map(|(k, _)| k)).await;
            let mut guard = self.state();
            let s = &mut *guard;
            for g in groups {
                let torn = (faulty && s.r.chance(self.faults.tier_torn))
                    .then(|| s.r.range(0, g.len() as u64 - 1) as usize);
                for (i, (k, v)) in g.iter().enumerate() {
                    let mut v = v.clone();
                    if torn == Some(i) && !v.is_empty() {
                        let at = s.r.range(0, v.len() as u64 - 1) as usize;
                        if s.r.chance(0.5) {
                            v.truncate(at);
                        } else {
                            v[at..].fill(0xa5);
                        }
                        s.injected.writes_torn += 1;
                    }
                    s.values.insert(k.clone(), v);
                }
            }
            // The writer is told nothing: a torn value is the reader's to refuse.
            Ok(groups.iter().map(|_| Ok(())).collect())
        })
    }

    fn get_many<'a>(
        &'a self,
        groups: &'a [Vec<String>],
    ) -> StoreFuture<'a, Answers<Vec<Option<Vec<u8>>>>> {
        Box::pin(async move {
            let faulty = self.answer(first(groups)).await;
            let mut guard = self.state();
            let s = &mut *guard;
            let mut out = Vec::with_capacity(groups.len());
            for g in groups {
                if faulty && !g.is_empty() && s.r.chance(self.faults.tier_evict) {
                    let k = &g[s.r.range(0, g.len() as u64 - 1) as usize];
                    s.injected.keys_evicted += u64::from(s.values.remove(k).is_some());
                }
                out.push(Ok(g.iter().map(|k| s.values.get(k).cloned()).collect()));
            }
            Ok(out)
        })
    }
}

/// What the shared tier did in a run, over its engines (`None` in a run without one).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TierSummary {
    /// Engines over the store: 2 when a second engine ran over what the first stored.
    pub engines: u64,
    /// Existence probes answered, and how many found the chunk.
    pub probes: u64,
    pub probes_found: u64,
    /// Blocks cascaded into the store.
    pub blocks_stored: u64,
    /// Promotion jobs, and the blocks they brought into the CPU pools.
    pub promotions: u64,
    pub blocks_promoted: u64,
    /// Of those, the second engine's: hits on what the first stored.
    pub shared_blocks_promoted: u64,
    /// Chunks a promotion could not read, and why: absent, refused by the header check,
    /// timed out.
    pub load_failures: u64,
    pub values_missing: u64,
    pub values_refused: u64,
    pub timeouts: u64,
    /// Chunks a cascade could not write.
    pub store_failures: u64,
    /// The faults the store injected.
    pub injected: StoreFaults,
}

impl TierSummary {
    /// Adds one engine's figures.
    pub(crate) fn absorb(&mut self, t: &TierFigures) {
        if self.engines == 1 {
            self.shared_blocks_promoted += t.blocks_loaded;
        }
        self.engines += 1;
        self.probes += t.probes;
        self.probes_found += t.probes_found;
        self.blocks_stored += t.blocks_stored;
        self.promotions += t.load_jobs;
        self.blocks_promoted += t.blocks_loaded;
        self.load_failures += t.load_failures;
        self.values_missing += t.values_missing;
        self.values_refused += t.values_refused;
        self.timeouts += t.timeouts;
        self.store_failures += t.store_failures;
    }

    /// Adds another run's.
    pub(crate) fn add(&mut self, o: &TierSummary) {
        self.engines += o.engines;
        self.probes += o.probes;
        self.probes_found += o.probes_found;
        self.blocks_stored += o.blocks_stored;
        self.promotions += o.promotions;
        self.blocks_promoted += o.blocks_promoted;
        self.shared_blocks_promoted += o.shared_blocks_promoted;
        self.load_failures += o.load_failures;
        self.values_missing += o.values_missing;
        self.values_refused += o.values_refused;
        self.timeouts += o.timeouts;
        self.store_failures += o.store_failures;
        let (i, j) = (&mut self.injected, &o.injected);
        i.keys_evicted += j.keys_evicted;
        i.writes_torn += j.writes_torn;
        i.nodes_away += j.nodes_away;
        i.slow_answers += j.slow_answers;
    }
}
