//! The routed replay: a workload's requests on their virtual clock, each sent to one of N
//! engines of this process, by a [`Policy`]; every engine publishes its KV events on loopback
//! ZMQ and the router follows each stream ([`Subscriber`]) into a [`PrefixIndex`].
//!
//! One tick: route the requests that arrived (each routing decision sees every event of every
//! step so far: after each tick the router syncs to the batches each engine says it published,
//! so a run routes the same way on any machine), step every engine that has work, advance the
//! clock. The engines' reports are the single-engine report of their share.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvrelay_core::{RequestId, Token};
use kvrelay_engine::events::KvEventsConfig;
use kvrelay_engine::events::vllm_hash::{self, Digest32};
use kvrelay_engine::report::{self, Latency, Report};
use kvrelay_engine::workload::{self, TraceRecord};
use kvrelay_engine::{Engine, RunConfig, RunError};
use serde::Serialize;

use crate::index::PrefixIndex;
use crate::subscriber::{StreamError, Subscriber};

/// How long the router waits for an engine's batches after a step.
const SYNC_DEADLINE: Duration = Duration::from_secs(30);

/// Idle ticks in a row, nothing runnable anywhere and nothing arriving, after which the run is
/// stuck.
const STUCK_TICKS: u32 = 3;

/// Where each request goes.
#[derive(Clone, Copy, Debug, Eq, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// The engine holding the request's longest cached prefix (GPU or CPU, as its events say);
    /// ties to the engine with fewer live requests, then the lower index (llm-d's and Dynamo's
    /// rule).
    KvAware,
    /// Engine `i mod N` for the i-th request.
    RoundRobin,
}

/// Why a routed run stopped.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// An engine stopped.
    #[error("engine {engine}: {error}")]
    Engine {
        /// Which.
        engine: usize,
        /// Why.
        error: RunError,
    },
    /// An engine's event stream could not be followed.
    #[error("engine {engine}'s KV events: {error}")]
    Stream {
        /// Which.
        engine: usize,
        /// Why.
        error: StreamError,
    },
    /// No engine can make progress.
    #[error("stuck: {live} requests live and no engine can run one")]
    Stuck {
        /// Requests still live.
        live: usize,
    },
}

/// One engine's share of a routed run.
#[derive(Clone, Debug, Serialize)]
pub struct Share {
    /// Requests routed to it.
    pub requests: u64,
    /// Of them, routed for a cached prefix (a score above every other engine's).
    pub by_prefix: u64,
    /// Batches its router stream had to fetch by replay.
    pub replayed_batches: u64,
    /// Removals of blocks its index did not hold (0 unless an event was lost).
    pub unknown_removals: u64,
    /// Its report, as `kvrelay run` would print it for this share.
    pub report: Report,
}

/// A routed run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct RouteReport {
    /// The policy.
    pub policy: Policy,
    /// Per engine.
    pub engines: Vec<Share>,
    /// Prompt tokens of every request.
    pub prompt_tokens: u64,
    /// Prompt tokens not computed: prefix-cache hits and CPU loads.
    pub reused_tokens: u64,
    /// Reused over prompt tokens, %.
    pub reuse_pct: f64,
    /// Tokens the engines computed (prefill and decode).
    pub tokens_computed: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
}

/// Replays `records` through `engines` engines configured as `c` (each with KV events on
/// loopback), routing by `policy`.
pub fn route(
    c: &RunConfig,
    records: &[TraceRecord],
    engines: usize,
    policy: Policy,
) -> Result<RouteReport, RouteError> {
    let rt =
        kvrelay_engine::run::runtime().map_err(|error| RouteError::Engine { engine: 0, error })?;
    rt.block_on(async {
        let mut c = c.clone();
        c.kv_events = Some(KvEventsConfig {
            endpoint: "tcp://*:0".into(),
            replay: Some("tcp://*:0".into()),
            ..KvEventsConfig::default()
        });
        let started = Instant::now();
        let mut fleet = Fleet::start(&c, records, engines.max(1)).await?;
        fleet.replay(&c, records, policy).await?;
        fleet.finish(&c, records, policy, started).await
    })
}

/// The engines, their streams and indexes, and what the router counted.
struct Fleet {
    engines: Vec<Engine>,
    streams: Vec<Subscriber>,
    indexes: Vec<PrefixIndex>,
    latency: Vec<Latency>,
    routed: Vec<u64>,
    by_prefix: Vec<u64>,
    none_hash: Digest32,
    turn: usize,
}

impl Fleet {
    async fn start(c: &RunConfig, records: &[TraceRecord], n: usize) -> Result<Self, RouteError> {
        let max_len = c
            .max_model_len
            .unwrap_or_else(|| kvrelay_engine::run::longest(records));
        let mut engines = Vec::with_capacity(n);
        let mut streams = Vec::with_capacity(n);
        for k in 0..n {
            let e = Engine::start(c, max_len)
                .await
                .map_err(|error| RouteError::Engine { engine: k, error })?;
            let (publ, replay) = e.kv_events_endpoints().expect("events are on");
            let s = Subscriber::connect(&loopback(publ), &loopback(replay.unwrap_or_default()))
                .await
                .map_err(|error| RouteError::Stream { engine: k, error })?;
            engines.push(e);
            streams.push(s);
        }
        let seed = c
            .kv_events
            .as_ref()
            .map_or(vllm_hash::DEFAULT_SEED, |k| &k.hash_seed);
        Ok(Self {
            engines,
            streams,
            indexes: vec![PrefixIndex::default(); n],
            latency: (0..n).map(|_| Latency::new(records)).collect(),
            routed: vec![0; n],
            by_prefix: vec![0; n],
            none_hash: vllm_hash::none_hash(seed),
            turn: 0,
        })
    }

    /// Submits each record when the clock reaches it, to the engine `policy` picks; steps every
    /// engine until all requests finished.
    async fn replay(
        &mut self,
        c: &RunConfig,
        records: &[TraceRecord],
        policy: Policy,
    ) -> Result<(), RouteError> {
        let mut pending: VecDeque<(usize, &TraceRecord)> = records.iter().enumerate().collect();
        let mut now = 0.0f64;
        let mut stuck = 0;
        loop {
            while let Some(&(i, r)) = pending.front()
                && r.timestamp as f64 <= now
            {
                pending.pop_front();
                let prompt = workload::prompt_tokens(r, c.hash_block(), i as u64);
                self.submit(c, RequestId(i as u32), prompt, r.output_length, policy)?;
            }
            if !self.engines.iter().any(Engine::has_work) {
                match pending.front() {
                    Some((_, r)) => {
                        now = r.timestamp as f64;
                        continue;
                    }
                    None => return Ok(()),
                }
            }
            now += c.step_ms;
            let busy = self.tick(now).await?;
            let arriving = pending
                .front()
                .is_some_and(|(_, r)| r.timestamp as f64 <= now);
            stuck = if busy || arriving { 0 } else { stuck + 1 };
            if stuck >= STUCK_TICKS {
                let live = self.engines.iter().map(|e| e.live_requests().len()).sum();
                return Err(RouteError::Stuck { live });
            }
        }
    }

    /// Steps every engine with work once and follows their streams; whether any step did
    /// something or has something in flight.
    async fn tick(&mut self, now: f64) -> Result<bool, RouteError> {
        let mut busy = false;
        for k in 0..self.engines.len() {
            let e = &mut self.engines[k];
            if !e.has_work() {
                continue;
            }
            let out = e
                .step()
                .await
                .map_err(|error| RouteError::Engine { engine: k, error })?;
            self.latency[k].record(now, &out.outputs);
            busy |= !out.idle || e.stuck().is_none();
            if out.idle {
                e.wait_idle().await;
            }
        }
        for k in 0..self.engines.len() {
            let want = self.engines[k].kv_events_published().unwrap_or(0);
            let ix = &mut self.indexes[k];
            self.streams[k]
                .sync(want, SYNC_DEADLINE, &mut |b| {
                    b.events.iter().for_each(|e| ix.apply(e))
                })
                .await
                .map_err(|error| RouteError::Stream { engine: k, error })?;
        }
        Ok(busy)
    }

    /// Routes one request and adds it to its engine (a prompt the engine refuses is counted
    /// there, as `kvrelay run` counts it).
    fn submit(
        &mut self,
        c: &RunConfig,
        id: RequestId,
        prompt: Vec<Token>,
        out: u32,
        policy: Policy,
    ) -> Result<(), RouteError> {
        let (k, prefix) = match policy {
            Policy::RoundRobin => {
                self.turn += 1;
                ((self.turn - 1) % self.engines.len(), false)
            }
            Policy::KvAware => self.longest_prefix(&prompt, c.block_size as usize),
        };
        self.routed[k] += 1;
        self.by_prefix[k] += u64::from(prefix);
        match self.engines[k].add(id, prompt, out) {
            Ok(()) | Err(RunError::Refused { .. }) => Ok(()),
            Err(error) => Err(RouteError::Engine { engine: k, error }),
        }
    }

    /// The engine with the longest cached prefix of `prompt` (vLLM's hash chain over its full
    /// blocks, computed only as far as some engine still matches), ties by load then index;
    /// whether a prefix decided it.
    fn longest_prefix(&self, prompt: &[Token], block_size: usize) -> (usize, bool) {
        let n = self.engines.len();
        let mut matched = vec![0usize; n];
        let mut alive = vec![true; n];
        let mut prev = self.none_hash;
        for (i, block) in prompt.chunks_exact(block_size.max(1)).enumerate() {
            let d = vllm_hash::block_hash(&prev, block);
            let h = vllm_hash::external(&d);
            for k in 0..n {
                alive[k] = alive[k] && self.indexes[k].holds(h);
                if alive[k] {
                    matched[k] = i + 1;
                }
            }
            if !alive.contains(&true) {
                break;
            }
            prev = d;
        }
        let best = *matched.iter().max().unwrap_or(&0);
        let load = |k: usize| self.engines[k].live_requests().len();
        let k = (0..n)
            .filter(|&k| matched[k] == best)
            .min_by_key(|&k| (load(k), k))
            .unwrap_or(0);
        (
            k,
            best > 0 && matched.iter().filter(|&&m| m == best).count() < n,
        )
    }

    /// Stops the engines; their reports and the totals.
    async fn finish(
        self,
        c: &RunConfig,
        records: &[TraceRecord],
        policy: Policy,
        started: Instant,
    ) -> Result<RouteReport, RouteError> {
        let mut shares = Vec::with_capacity(self.engines.len());
        let parts = self.engines.into_iter().zip(self.streams).zip(self.indexes);
        for (k, ((e, s), ix)) in parts.enumerate() {
            let (figures, ranks) = e.shutdown().await;
            let mut report = report::build(
                c,
                records,
                &figures,
                &ranks,
                &self.latency[k],
                started.elapsed(),
            );
            report.requests = self.routed[k];
            shares.push(Share {
                requests: self.routed[k],
                by_prefix: self.by_prefix[k],
                replayed_batches: s.replayed,
                unknown_removals: ix.unknown_removals,
                report,
            });
        }
        let sum = |f: fn(&Report) -> u64| shares.iter().map(|s| f(&s.report)).sum::<u64>();
        let prompt_tokens = sum(|r| r.prompt_tokens);
        let reused_tokens = sum(|r| r.reused_tokens);
        Ok(RouteReport {
            policy,
            prompt_tokens,
            reused_tokens,
            reuse_pct: 100.0 * reused_tokens as f64 / prompt_tokens.max(1) as f64,
            tokens_computed: sum(|r| r.tokens_computed),
            engines: shares,
            wall_s: started.elapsed().as_secs_f64(),
        })
    }
}

/// A bound wildcard endpoint as a local subscriber reaches it.
fn loopback(e: &str) -> String {
    e.replacen("0.0.0.0", "127.0.0.1", 1)
}
