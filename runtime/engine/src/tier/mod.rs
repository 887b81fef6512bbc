//! The shared tier: vLLM 0.33.0's tiered offloading with a store that several engines share (a
//! Redis Cluster), behind the CPU pools (`docs/TIERING.md`).
//!
//! The core's tiering manager decides (cascade every stored chunk, probe the store on a CPU
//! miss, promote hits into the CPU pool before the GPU reads them); this module carries out
//! what it decides and reports back. As in vLLM, the tier's IO runs on the scheduler side and
//! reads and writes the CPU pools directly (vLLM shares the primary tier's memory with its
//! scheduler process; here the ranks are tasks of the engine's process).
//!
//! # When to call what
//!
//! * [`Tier::connect`] once, in [`crate::Engine::start`], with the ranks' pools: a store that
//!   cannot be reached is an error, never a silent CPU-only run.
//! * [`Tier::launch`] after each engine step, with the step's work (it runs in the background).
//! * [`Tier::collect`] before the next step: waits for the last batch (each command has its
//!   deadline, so this wait is bounded) and hands back the reports for the core and the chunks
//!   the ranks must learn the content of. A run therefore takes the same steps whatever the
//!   store's latency.
//!
//! | file | what |
//! | --- | --- |
//! | `value.rs` | keys (content-addressed, one hash slot per chunk) and values (header checked on every read) |
//! | `store.rs` | the store: Redis Cluster, or an in-process map |
//! | `resp/` | the Redis Cluster client: commands per node, replies checked as they are parsed |
//! | `exec.rs` | one step's work against the store and the pools |
//! | `bench.rs` | that work against `redis-benchmark` on the same cluster (`kvrelay bench tier`) |

pub mod bench;
mod exec;
pub mod resp;
pub mod store;
pub mod value;

use std::sync::Arc;
use std::time::Duration;

use kvrelay_core::TierWork;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

pub use self::exec::{Done, Pools, Promoted};
pub use self::store::{MemoryStore, Store, StoreError};

use crate::report::samples::Samples;

/// The shared tier of a run (`--tier`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierConfig {
    /// Redis Cluster nodes, `redis://HOST:PORT` (any one finds the others), or `memory`.
    pub endpoints: Vec<String>,
    /// The key namespace: engines share chunks only within one. Default: derived from the KV
    /// layout (layers, block bytes and size, blocks per chunk, ranks), so engines of one
    /// layout share and others never read each other's chunks.
    pub namespace: Option<String>,
    /// Deadline of each store command and of connecting, in milliseconds.
    pub timeout_ms: u64,
    /// Strict mode only: steps after which the core stops waiting for a probe or a promotion.
    pub deadline_steps: u32,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            namespace: None,
            timeout_ms: 2_000,
            deadline_steps: 8,
        }
    }
}

impl TierConfig {
    /// Parses `--tier`'s value: `redis://HOST:PORT[,HOST:PORT...]` (the scheme once, or on every
    /// node) or `memory`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut endpoints = Vec::new();
        if spec == "memory" {
            endpoints.push(spec.to_string());
        } else {
            let rest = spec.strip_prefix("redis://").ok_or_else(|| {
                format!("--tier {spec:?}: expected redis://HOST:PORT[,HOST:PORT...] or memory")
            })?;
            for node in rest.split(',') {
                let node = node.strip_prefix("redis://").unwrap_or(node);
                if !store::is_node(node) {
                    return Err(format!("--tier: {node:?} is not HOST:PORT"));
                }
                endpoints.push(format!("redis://{node}"));
            }
        }
        Ok(Self {
            endpoints,
            ..Self::default()
        })
    }
}

/// What the tier did (names carry `tier` in the report and `--json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TierFigures {
    /// Existence probes answered, and how many found the chunk.
    pub probes: u64,
    pub probes_found: u64,
    /// Cascade jobs, and what they wrote (blocks and bytes over every rank's shard).
    pub store_jobs: u64,
    pub blocks_stored: u64,
    pub bytes_stored: u64,
    /// Promotion jobs, and what they read into the CPU pools.
    pub load_jobs: u64,
    pub blocks_loaded: u64,
    pub bytes_loaded: u64,
    /// Chunks a cascade could not write, or a promotion could not read.
    pub store_failures: u64,
    pub load_failures: u64,
    /// Why: values absent at load (evicted between probe and load), refused by their header
    /// (truncated, foreign, another key's, checksum), store errors, commands past the deadline.
    pub values_missing: u64,
    pub values_refused: u64,
    pub io_errors: u64,
    pub timeouts: u64,
    /// Connections to the store's nodes opened since one was lost (a Redis Cluster after a
    /// failover: the dead master's, the promoted replica's; [`resp::Cluster`]).
    pub reconnects: u64,
    /// The first store error (a command that failed, as the store said why).
    pub first_error: Option<String>,
    /// Batches (one per step with work) and their wall time, µs.
    pub batches: u64,
    #[serde(skip)]
    pub batch_us: Samples<f64>,
}

impl TierFigures {
    fn absorb(&mut self, o: &TierFigures) {
        self.probes += o.probes;
        self.probes_found += o.probes_found;
        self.store_jobs += o.store_jobs;
        self.blocks_stored += o.blocks_stored;
        self.bytes_stored += o.bytes_stored;
        self.load_jobs += o.load_jobs;
        self.blocks_loaded += o.blocks_loaded;
        self.bytes_loaded += o.bytes_loaded;
        self.store_failures += o.store_failures;
        self.load_failures += o.load_failures;
        self.values_missing += o.values_missing;
        self.values_refused += o.values_refused;
        self.io_errors += o.io_errors;
        self.timeouts += o.timeouts;
        if self.first_error.is_none() {
            self.first_error.clone_from(&o.first_error);
        }
        self.batches += o.batches;
        self.batch_us.absorb(&o.batch_us);
    }
}

/// The tier of a running engine. See the module docs.
#[derive(Debug)]
pub struct Tier {
    store: Store,
    namespace: Arc<str>,
    pools: Pools,
    timeout: Duration,
    running: Option<JoinHandle<Done>>,
    pub figures: TierFigures,
}

impl Tier {
    /// Connects to the store of `config` (within its deadline) for the ranks' `pools`.
    pub async fn connect(
        config: &TierConfig,
        namespace: String,
        pools: Pools,
    ) -> Result<Self, StoreError> {
        let timeout = Duration::from_millis(config.timeout_ms.max(1));
        let store = Store::connect(&config.endpoints, timeout).await?;
        Ok(Self {
            store,
            namespace: config.namespace.clone().unwrap_or(namespace).into(),
            pools,
            timeout,
            running: None,
            figures: TierFigures::default(),
        })
    }

    /// The store (a handle: tests reach the in-process map through it).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Uses `store` from now on (see [`crate::Engine::share_tier_store`]).
    pub fn use_store(&mut self, store: Store) {
        self.store = store;
    }

    /// Whether a batch is in flight.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// The key namespace in use.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Starts carrying out `work` in the background. Call [`Tier::collect`] first: one batch
    /// runs at a time.
    pub fn launch(&mut self, work: Vec<TierWork>) {
        debug_assert!(self.running.is_none(), "collect before launching again");
        if work.is_empty() {
            return;
        }
        let fut = exec::run(
            work,
            self.store.clone(),
            self.namespace.clone(),
            self.pools.clone(),
            self.timeout,
        );
        self.running = Some(tokio::spawn(fut));
    }

    /// Waits for the batch in flight (if any) and returns what it came to. A batch whose task
    /// died (it cannot panic by design; this is the last line) is an error.
    pub async fn collect(&mut self) -> Result<Done, StoreError> {
        let Some(handle) = self.running.take() else {
            return Ok(Done::default());
        };
        let done = handle
            .await
            .map_err(|e| StoreError::Command(format!("tier task: {e}")))?;
        self.figures.absorb(&done.figures);
        self.figures.reconnects = self.store.reconnects();
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects `--tier`'s grammar: every node becomes a redis:// endpoint; anything else is a
    // clear error naming the bad part.
    #[test]
    fn tier_endpoints_parse_or_say_what_is_wrong() {
        let t = TierConfig::parse("redis://127.0.0.1:7100,127.0.0.1:7101,redis://h:7102").unwrap();
        assert_eq!(
            t.endpoints,
            [
                "redis://127.0.0.1:7100",
                "redis://127.0.0.1:7101",
                "redis://h:7102"
            ]
        );
        assert_eq!(TierConfig::parse("memory").unwrap().endpoints, ["memory"]);
        for bad in [
            "127.0.0.1:7100",
            "redis://",
            "redis://h",
            "redis://h:0",
            "redis://h:x",
            "redis://:7100",
        ] {
            assert!(TierConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
