//! KV events as vLLM 0.33.0 publishes them: `--kv-events tcp://HOST:PORT` (and
//! [`RunConfig::kv_events`](crate::RunConfig::kv_events)) puts every step's prefix-cache events
//! — GPU blocks stored and evicted by the block pool, CPU chunks stored and evicted by the
//! offloading manager, `AllBlocksCleared` on a reset — on a ZMQ PUB socket in vLLM's wire
//! format, with a replay socket for subscribers that missed some. A router that subscribes to
//! vLLM engines reads kvrelay's with the same decoder (`docs/KV_EVENTS.md`).
//!
//! | file | what |
//! | --- | --- |
//! | `mod.rs` | [`KvEventsConfig`]; [`Publisher`]: the core's events to vLLM's, one batch a step |
//! | `vllm_hash.rs` | vLLM's block hashes for kvrelay's ([`VllmHashes`]) |
//! | `wire.rs` | the msgpack `KVEventBatch` ([`WireEvent`], [`encode_batch`]) |
//! | `publisher.rs` | the PUB and ROUTER sockets, the replay buffer, the task |
//!
//! The engine calls [`Publisher::step`] after each step with the core's
//! [`CacheEvent`]s, and [`Publisher::finish`] at the end. Events are switched on in the core only
//! when a publisher exists, so a run without `--kv-events` does no event work.

mod publisher;
pub mod vllm_hash;
pub mod wire;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvrelay_core::{BlockHash, CacheEvent};
use serde::{Deserialize, Serialize};

pub use self::publisher::PublisherStats;
pub use self::vllm_hash::{Unmapped, VllmHashes};
pub use self::wire::{WireEvent, encode_batch};
use crate::error::RunError;

/// Where and how KV events are published (vLLM's `KVEventsConfig`, its defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// The PUB endpoint: `tcp://*:PORT` (or `ipc://PATH`) binds, `tcp://HOST:PORT` connects to
    /// a subscriber that bound it, as vLLM's publisher does. Port 0 picks a free one.
    pub endpoint: String,
    /// The ROUTER replay endpoint (always bound), if any.
    pub replay: Option<String>,
    /// The topic frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// vLLM's `NONE_HASH` seed: `"vllm-none-hash"`, or the `PYTHONHASHSEED` of the vLLM
    /// engines whose hashes a router compares with kvrelay's.
    pub hash_seed: String,
    /// Seconds the replay socket keeps answering after the run ended (`kvrelay run` only).
    pub linger_s: f64,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://*:5557".into(),
            replay: None,
            topic: String::new(),
            buffer_steps: 10_000,
            hash_seed: vllm_hash::DEFAULT_SEED.into(),
            linger_s: 0.0,
        }
    }
}

/// How long [`Publisher::finish`] waits for the task beyond the linger.
const FINISH_DEADLINE: Duration = Duration::from_secs(5);

/// The engine's end of the publisher: maps the core's events to vLLM's and hands each step's
/// batch to the publisher task. See the module docs.
#[derive(Debug)]
pub struct Publisher {
    hashes: VllmHashes,
    running: publisher::Running,
    /// Batches handed to the task: the next batch's sequence number.
    published: u64,
}

impl Publisher {
    /// Opens the sockets of `c` and starts publishing. Inside the engine's tokio runtime.
    pub async fn start(c: &KvEventsConfig) -> Result<Self, RunError> {
        let running = publisher::start(c).await.map_err(RunError::Config)?;
        Ok(Self {
            hashes: VllmHashes::new(&c.hash_seed),
            running,
            published: 0,
        })
    }

    /// The PUB endpoint as bound (a port 0 resolved) or connected.
    pub fn endpoint(&self) -> &str {
        &self.running.endpoint
    }

    /// Batches published so far (a subscriber that has seen this many has seen every step).
    pub fn published(&self) -> u64 {
        self.published
    }

    /// The replay endpoint as bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.running.replay.as_deref()
    }

    /// Publishes one step's events (nothing when there are none, as vLLM), then, when the map
    /// has grown, forgets the hashes not in `live` (every block hash the core may still name).
    pub async fn step<I: IntoIterator<Item = BlockHash>>(
        &mut self,
        events: &[CacheEvent],
        live: impl FnOnce() -> I,
    ) -> Result<(), RunError> {
        if !events.is_empty() {
            let mut wire = Vec::with_capacity(events.len());
            for e in events {
                wire.push(
                    self.translate(e)
                        .map_err(|e| RunError::Events(e.to_string()))?,
                );
            }
            let b = publisher::Batch {
                ts: wall_clock(),
                events: wire,
            };
            if self.running.tx.send(b).await.is_err() {
                return Err(RunError::Events("the publisher task ended".into()));
            }
            self.published += 1;
        }
        if self.hashes.wants_sweep() {
            self.hashes.sweep(live());
        }
        Ok(())
    }

    /// vLLM's form of `e`.
    fn translate(&mut self, e: &CacheEvent) -> Result<WireEvent, Unmapped> {
        Ok(match e {
            CacheEvent::Stored {
                medium,
                group,
                hashes,
                parent,
                tokens,
                block_size,
            } => {
                // The CPU placeholder names its key's hash only: stored (with its digest) when
                // the GPU cached the block.
                let digests = if tokens.is_empty() {
                    hashes
                        .iter()
                        .map(|h| self.hashes.get(*h).copied())
                        .collect::<Result<Vec<_>, _>>()?
                } else {
                    self.hashes
                        .chain(*parent, hashes, tokens, *block_size as usize)?
                };
                let parent = match parent {
                    Some(p) => Some(vllm_hash::external(self.hashes.get(*p)?)),
                    None => None,
                };
                WireEvent::Stored {
                    medium: *medium,
                    group: *group,
                    hashes: digests.iter().map(vllm_hash::external).collect(),
                    parent,
                    tokens: tokens.clone(),
                    block_size: *block_size,
                }
            }
            CacheEvent::Removed {
                medium,
                group,
                hashes,
            } => WireEvent::Removed {
                medium: *medium,
                group: *group,
                hashes: hashes
                    .iter()
                    .map(|h| self.hashes.get(*h).map(vllm_hash::external))
                    .collect::<Result<_, _>>()?,
            },
            CacheEvent::AllCleared => WireEvent::AllCleared,
        })
    }

    /// Ends publishing: the task sends what is queued, keeps answering replays for the
    /// configured linger, and returns its figures (`None` if it did not end in time).
    pub async fn finish(self) -> Option<PublisherStats> {
        let Publisher { running, .. } = self;
        drop(running.tx);
        let mut task = running.task;
        match tokio::time::timeout(running.linger + FINISH_DEADLINE, &mut task).await {
            Ok(Ok(stats)) => Some(stats),
            _ => {
                task.abort();
                None
            }
        }
    }
}

/// Seconds since the Unix epoch (vLLM's `time.time()`).
fn wall_clock() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
