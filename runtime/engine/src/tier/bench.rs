//! The tier's IO against `redis-benchmark` on the same cluster (issue 36, performance
//! requirement 1: the tier's stores and loads move at least 80 % of the bytes per second that
//! `redis-benchmark` reaches with the same value size, values in flight and connections).
//!
//! The tier side runs the engine's own path: [`Tier::launch`] and [`Tier::collect`] with
//! cascade and promotion jobs over CPU pools of the layout's shape, so a store reads the pools,
//! frames each rank's shard with its header and CRC-32 and sends one `MSET` per chunk in
//! pipelines per hash-slot bucket; a load sends one `MGET` per chunk, checks every header and
//! CRC and writes the pools. One batch runs at a time, as one engine step's work does. The other
//! side is `redis-benchmark --cluster -t set,get` with values of the tier's value size (header
//! and key echo included), one client per master (the cluster client's connections: one per
//! node) and `-P` values in flight on each. Both sides count the same bytes: whole values.
//!
//! # When to call what
//!
//! [`redis_benchmark_version`] first (a clear error when it is missing), then
//! [`Bench::connect`] once per value size, then [`Bench::tier_round`] and
//! [`Bench::redis_round`] alternately, as many rounds as the medians need.

use std::process::Command;
use std::time::{Duration, Instant};

use kvrelay_core::{
    BlockHash, ChunkId, KvLayout, LayoutOrder, OffloadKey, RequestId, TierId, TierJobId, TierWork,
};

use super::resp::Cluster;
use super::value::{encode, shard_key};
use super::{Pools, StoreError, Tier, TierConfig, TierFigures};
use crate::content::mix;
use crate::transfer::host::HostPool;

/// The key namespace of the benchmark's values (they overwrite each other from round to round,
/// and are left in the cluster as `redis-benchmark` leaves its own).
const NAMESPACE: &str = "kvrelay-bench";

/// What to measure.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Redis Cluster nodes, `redis://HOST:PORT`; `redis-benchmark` starts from the first.
    pub endpoints: Vec<String>,
    /// One rank's shard of a chunk (the payload of one value): `layers` layers of
    /// `payload / layers` bytes.
    pub payload: u64,
    pub layers: u32,
    /// Ranks: a chunk is one `MSET` (one `MGET`) of this many values.
    pub ranks: u32,
    /// Values in flight per connection (`redis-benchmark -P`).
    pub pipeline: u32,
    /// Values the tier moves per measurement and direction.
    pub values: u64,
    /// Values `redis-benchmark` moves per test (`-n`). It ends a test on its 250 ms
    /// throughput tick, so its rate understates the truth by up to 250 ms over the test's
    /// length: give it seconds of work (see [`Bench::redis_round`]).
    pub redis_values: u64,
    /// Deadline of each tier command.
    pub timeout: Duration,
}

/// Why the benchmark could not measure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// `redis-benchmark` is not installed.
    #[error("redis-benchmark not found on PATH (Debian: apt-get install redis-tools)")]
    NoRedisBenchmark,
    /// The setup cannot be measured.
    #[error("{0}")]
    Setup(String),
    /// The cluster could not be reached or asked.
    #[error("{0} (a local cluster: tests/tier/cluster.sh start)")]
    Cluster(StoreError),
    /// `redis-benchmark` failed or printed no figure.
    #[error("redis-benchmark: {0}")]
    RedisBenchmark(String),
    /// A tier batch did not move every chunk.
    #[error("the tier's {0}")]
    Tier(String),
}

/// `redis-benchmark --version`'s line, or [`BenchError::NoRedisBenchmark`].
pub fn redis_benchmark_version() -> Result<String, BenchError> {
    let out = Command::new("redis-benchmark")
        .arg("--version")
        .output()
        .map_err(|_| BenchError::NoRedisBenchmark)?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A connected benchmark: the tier over its pools, and the chunks it moves.
#[derive(Debug)]
pub struct Bench {
    setup: Setup,
    tier: Tier,
    /// The chunks of one batch: stored from CPU chunk `i`, loaded into chunk `n + i`.
    keys: Vec<OffloadKey>,
    masters: u32,
    /// Bytes of each value, per rank (the key echo's length differs from 10 ranks on).
    value_bytes: Vec<u64>,
    host: String,
    port: u16,
}

impl Bench {
    /// Connects the tier to the cluster, counts its masters and fills the pools.
    pub async fn connect(setup: Setup) -> Result<Self, BenchError> {
        let bad = |s: String| BenchError::Setup(s);
        let first = setup
            .endpoints
            .first()
            .ok_or_else(|| bad("no endpoint".into()))?;
        let node = first.strip_prefix("redis://").unwrap_or(first);
        let (host, port) = node
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| bad(format!("{first:?} is not redis://HOST:PORT")))?;
        if [setup.ranks, setup.layers, setup.pipeline].contains(&0)
            || setup.values == 0
            || setup.redis_values == 0
        {
            return Err(bad(
                "ranks, layers, pipeline and values must be positive".into()
            ));
        }
        if setup.payload == 0 || !setup.payload.is_multiple_of(u64::from(setup.layers)) {
            return Err(bad(format!(
                "a value's payload ({} bytes) must be a positive multiple of the layers ({})",
                setup.payload, setup.layers
            )));
        }
        let cluster = cluster(first, setup.timeout).await?;
        let masters = cluster.masters() as u32;
        let keys = balanced_keys(&cluster, (setup.pipeline / setup.ranks).max(1))?;
        let pools = pools(&setup, keys.len())?;
        let config = TierConfig {
            endpoints: setup.endpoints.clone(),
            namespace: Some(NAMESPACE.into()),
            timeout_ms: setup.timeout.as_millis() as u64,
            ..TierConfig::default()
        };
        let tier = Tier::connect(&config, NAMESPACE.into(), pools)
            .await
            .map_err(BenchError::Cluster)?;
        let value_bytes = (0..setup.ranks)
            .map(|r| {
                let key = shard_key(NAMESPACE, any_key(), r);
                encode(&key, &[]).len() as u64 + setup.payload
            })
            .collect();
        Ok(Self {
            setup,
            tier,
            keys,
            masters,
            value_bytes,
            host,
            port,
        })
    }

    /// The cluster's masters: the connections of each side.
    pub fn masters(&self) -> u32 {
        self.masters
    }

    /// Bytes of one value (rank 0's; `redis-benchmark -d`).
    pub fn value_bytes(&self) -> u64 {
        self.value_bytes[0]
    }

    /// Chunks per tier batch: `pipeline` values in flight per connection.
    pub fn chunks_per_batch(&self) -> usize {
        self.keys.len()
    }

    /// Batches per measurement: at least `values` values each way.
    pub fn batches(&self) -> u64 {
        let per = self.keys.len() as u64 * u64::from(self.setup.ranks);
        self.setup.values.div_ceil(per)
    }

    /// One measurement of the tier: stores, then loads of what was stored (every byte
    /// compared afterwards); bytes per second of each.
    pub async fn tier_round(&mut self) -> Result<(f64, f64), BenchError> {
        let n = self.keys.len() as u32;
        let batches = self.batches();
        let bytes =
            batches as f64 * self.keys.len() as f64 * self.value_bytes.iter().sum::<u64>() as f64;
        let started = Instant::now();
        for b in 0..batches {
            let work = TierWork::Store {
                tier: TierId(0),
                job: TierJobId(b),
                keys: self.keys.clone(),
                chunks: (0..n).map(ChunkId).collect(),
            };
            self.batch(work, "store").await?;
        }
        let store = bytes / started.elapsed().as_secs_f64();
        let started = Instant::now();
        for b in 0..batches {
            let work = TierWork::Load {
                tier: TierId(0),
                request: RequestId(0),
                job: TierJobId(batches + b),
                keys: self.keys.clone(),
                chunks: (n..2 * n).map(ChunkId).collect(),
            };
            self.batch(work, "load").await?;
        }
        let load = bytes / started.elapsed().as_secs_f64();
        self.check_loaded()?;
        Ok((store, load))
    }

    /// Launches one batch and waits for it: an error unless every chunk moved.
    async fn batch(&mut self, work: TierWork, what: &str) -> Result<(), BenchError> {
        self.tier.launch(vec![work]);
        let done = self.tier.collect().await.map_err(BenchError::Cluster)?;
        let f = &done.figures;
        if f.store_failures + f.load_failures > 0 {
            return Err(BenchError::Tier(format!("{what} failed: {}", failures(f))));
        }
        Ok(())
    }

    /// Whether every loaded chunk holds the bytes its stored twin held.
    fn check_loaded(&self) -> Result<(), BenchError> {
        let n = u64::from(self.keys.len() as u32);
        let p = &self.tier.pools;
        let len = p.host.block_bytes() as usize;
        for (r, pool) in p.pools.iter().enumerate() {
            let pool = pool.read();
            for l in 0..p.host.layers() {
                for c in 0..n {
                    let at = |c: u64| p.host.offset(l, c).expect("a chunk of the pool") as usize;
                    let (a, b) = (at(c), at(n + c));
                    if pool[a..a + len] != pool[b..b + len] {
                        return Err(BenchError::Tier(format!(
                            "load wrote other bytes than were stored (rank {r}, chunk {c})"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// One measurement of `redis-benchmark --cluster -t set,get`; bytes per second of each.
    /// redis-benchmark with `--cluster` runs a thread per node and notices the end of a test
    /// on its 250 ms throughput timer: the rate it prints is requests over a time rounded up
    /// to the next tick, a lower bound, within 10 % once a test lasts 2.5 s.
    pub fn redis_round(&self) -> Result<(f64, f64), BenchError> {
        let s = &self.setup;
        let out = Command::new("redis-benchmark")
            .args(["--cluster", "-h", &self.host, "-p", &self.port.to_string()])
            .args([
                "-c",
                &self.masters.to_string(),
                "-P",
                &s.pipeline.to_string(),
            ])
            .args([
                "-n",
                &s.redis_values.to_string(),
                "-d",
                &self.value_bytes().to_string(),
            ])
            .args(["-t", "set,get", "--csv"])
            .output()
            .map_err(|e| BenchError::RedisBenchmark(e.to_string()))?;
        let text = String::from_utf8_lossy(&out.stdout);
        match (out.status.success(), rps(&text, "SET"), rps(&text, "GET")) {
            (true, Some(set), Some(get)) => {
                let v = self.value_bytes() as f64;
                Ok((set * v, get * v))
            }
            _ => Err(BenchError::RedisBenchmark(format!(
                "{}; {}{}",
                out.status,
                text.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ))),
        }
    }
}

/// Requests per second of `test` in `redis-benchmark --csv`'s output (`"SET","120000.00",…`).
fn rps(csv: &str, test: &str) -> Option<f64> {
    csv.lines()
        .find_map(|l| l.strip_prefix(&format!("\"{test}\",\"")))
        .and_then(|rest| rest.split('"').next()?.parse::<f64>().ok())
}

/// The causes of a batch's failures, for the error.
fn failures(f: &TierFigures) -> String {
    format!(
        "{} chunk(s): {} io errors, {} timeouts, {} missing, {} refused",
        f.store_failures + f.load_failures,
        f.io_errors,
        f.timeouts,
        f.values_missing,
        f.values_refused
    )
}

/// The cluster as `CLUSTER SLOTS` on `endpoint` lists it: an error unless a master serves a slot.
async fn cluster(endpoint: &str, timeout: Duration) -> Result<Cluster, BenchError> {
    let node = endpoint.trim_start_matches("redis://").to_owned();
    let cluster = Cluster::connect(vec![node], timeout).await;
    match cluster {
        Ok(c) if c.masters() > 0 => Ok(c),
        Ok(_) => Err("no master serves a slot".to_owned()),
        Err(e) => Err(e),
    }
    .map_err(|reason| {
        BenchError::Cluster(StoreError::Connect {
            endpoints: endpoint.to_string(),
            reason,
        })
    })
}

/// A batch's chunk keys: `per_master` on each of the cluster's masters, so that every
/// connection has the same values in flight, as each of redis-benchmark's has `-P`
/// (content-addressed keys fall where their hash sends them: a batch of random ones loads one
/// node more than another).
fn balanced_keys(cluster: &Cluster, per_master: u32) -> Result<Vec<OffloadKey>, BenchError> {
    let masters = cluster.masters() as u32;
    let mut taken: std::collections::BTreeMap<u16, u32> = std::collections::BTreeMap::new();
    let mut keys = Vec::new();
    for i in 0..1u64 << 16 {
        let key = OffloadKey {
            hash: BlockHash(mix(i ^ 0x6b76_7265_6c61_7900)),
            group: 0,
        };
        let Some(node) = cluster.master_of(&shard_key(NAMESPACE, key, 0)) else {
            continue;
        };
        let n = taken.entry(node).or_default();
        if *n < per_master {
            *n += 1;
            keys.push(key);
        }
        if keys.len() == (masters * per_master) as usize {
            return Ok(keys);
        }
    }
    Err(BenchError::Setup(format!(
        "no {per_master} keys on each of {masters} masters among 65,536 tried"
    )))
}

/// Pools of `2 × chunks` one-block chunks per rank, filled with bytes that differ per rank.
fn pools(setup: &Setup, chunks: usize) -> Result<Pools, BenchError> {
    let block = setup.payload / u64::from(setup.layers);
    let host = KvLayout::new(
        vec![0; setup.layers as usize],
        2 * chunks as u32,
        block,
        LayoutOrder::LayerMajor,
    )
    .map_err(|e| BenchError::Setup(e.to_string()))?;
    let pools = (0..setup.ranks)
        .map(|r| {
            let pool = HostPool::new(host.total_bytes() as usize);
            let mut state = u64::from(r) + 1;
            for word in pool.write().chunks_mut(8) {
                state = mix(state);
                word.copy_from_slice(&state.to_le_bytes()[..word.len()]);
            }
            pool
        })
        .collect();
    Ok(Pools {
        pools,
        host,
        blocks_per_chunk: 1,
    })
}

/// A chunk key (every key's shard names have one length).
fn any_key() -> OffloadKey {
    OffloadKey {
        hash: BlockHash(0),
        group: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects the redis-benchmark side's figures: the rate of each test from its CSV.
    #[test]
    fn redis_benchmark_and_cluster_answers_parse() {
        let csv = "\n\"test\",\"rps\",\"avg_latency_ms\"\n\"SET\",\"120000.00\",\"0.249\"\n\
                   \"GET\",\"39893.62\",\"0.063\"\n";
        assert_eq!(rps(csv, "SET"), Some(120_000.0));
        assert_eq!(rps(csv, "GET"), Some(39_893.62));
        assert_eq!(rps(csv, "MSET"), None);
    }
}
