//! [`Engine`]: the core's [`EngineCore`] with W ranks attached — one engine step at a time.
//!
//! # When to call what
//!
//! * [`Engine::start`] once: builds the scheduler, the offloading connector and the ranks
//!   (tasks, or worker processes).
//! * [`Engine::add`], [`Engine::abort`], [`Engine::reset_cache`] between steps, as inputs
//!   arrive.
//! * [`Engine::step`] while [`Engine::has_work`]: schedules, sends the step to every rank,
//!   collects each rank's output once, samples the tokens and applies the step. Its
//!   [`StepOutcome`] carries the requests' new tokens and finishes, and says whether the step
//!   was idle; then [`Engine::wait_idle`] waits for a transfer completion (or a short timeout)
//!   instead of spinning.
//! * [`Engine::shutdown`] at the end: stops the ranks and returns their figures;
//!   [`Engine::shutdown_on`] instead when a [`crate::stop::StopSignal`] may cut the wait short
//!   (it kills the ranks still running at the stop's deadline).
//!
//! The engine loop of `kvrelay run` ([`crate::run()`]) and the embedding API
//! ([`crate::api::EngineHandle`]) both drive this type.

mod build;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use kvrelay_core::{
    BlockHash, BlockId, ChunkId, EngineCore, FinishReason, OffloadingConnector, Params, PdParams,
    PdStats, Rank, RequestId, RequestOutput, RequestSpec, RequestStatus, ScheduledStep, Scheduler,
    StepId, TierWork, Token,
};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use crate::connector::{self, EngineConnector, EngineMeta};
use crate::events::Publisher;
use crate::metrics::{FINISHED_REASONS, Levels, Metrics, Total};
use crate::pd::{HeldTable, KvServer};
use crate::rank::{Completions, PromotedChunk, RankDelta, RankReport, RankStats, StepMsg};
use crate::report::perfetto::{Recorder, now_us};
use crate::report::samples::Samples;
use crate::stop::{STOP_GRACE, StopSignal};
use crate::tier::{StoreError, Tier};
use crate::transfer::host::HostPool;
use crate::transport::{self, Clock, TokioClock, Transport};
use crate::{RunConfig, RunError, workload};

/// How often the engine looks for a rank task that ended while it waits for outputs.
pub const RANK_CHECK: Duration = Duration::from_secs(1);

/// How long an idle engine step waits for a transfer to complete.
const IDLE_WAIT: Duration = Duration::from_millis(5);

/// What the engine side counts.
#[derive(Debug, Default)]
pub struct Figures {
    /// The backend the ranks run on (`host` or `cuda`, resolved).
    pub backend: crate::Backend,
    /// The pools per rank, as resolved from the configuration ([`RunConfig::gpu_blocks_for`]).
    pub gpu_blocks: u32,
    pub cpu_blocks: u32,
    /// The longest request admitted.
    pub max_model_len: u32,
    /// Requests refused at submit (a prompt of `max_model_len` tokens or more).
    pub refused: u64,
    pub finished: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub steps: u64,
    pub idle_steps: u64,
    pub preemptions: u64,
    pub tokens_computed: u64,
    /// Steps scheduled while the ranks ran the previous one (async scheduling).
    pub scheduled_ahead: u64,
    /// Loads reported complete (`finished_recving`, summed over ranks).
    pub loads_reported: u64,
    /// Rank reports refused before they reached the core: a second report of a rank for a
    /// step, or one for a step that is not running (a duplicated or stale frame).
    pub reports_rejected: u64,
    /// Per request, its computed tokens when first scheduled (prefix hit + loaded).
    pub reused: HashMap<RequestId, u32>,
    /// The sum of `reused` (kept as requests are first scheduled, not summed per step).
    pub reused_tokens: u64,
    /// Engine-side time per step (schedule, rank outputs, apply), in µs.
    pub core_us: Samples<f64>,
    pub invariant_checks: u64,
    /// What the KV-event publisher did (`None`: no events published, or the publisher did
    /// not end within its deadline).
    pub kv_events: Option<crate::events::PublisherStats>,
    /// What the shared tier did (`None`: no tier).
    pub tier: Option<crate::tier::TierFigures>,
    /// Engine steps, for the timeline (`--timeline`).
    pub timeline: Recorder,
}

/// One engine step's result.
#[derive(Debug)]
pub struct StepOutcome {
    /// The step.
    pub step: StepId,
    /// Per request scheduled: the tokens it accepted, and its finish.
    pub outputs: Vec<RequestOutput>,
    /// Nothing was scheduled, asked of the ranks or reported back.
    pub idle: bool,
    /// Request ids nothing refers to any more (every rank saw them finish): free for reuse.
    pub released: Vec<RequestId>,
}

/// The engine and its ranks. See the module docs.
#[derive(Debug)]
pub struct Engine {
    config: RunConfig,
    clock: Arc<dyn Clock>,
    core: EngineCore<EngineConnector>,
    to_ranks: Vec<mpsc::Sender<StepMsg>>,
    reports: mpsc::Receiver<RankReport>,
    handles: Vec<JoinHandle<RankStats>>,
    wake: Arc<Notify>,
    /// Tokens the ranks have not been sent yet.
    tokens: Vec<(RequestId, Vec<Token>)>,
    /// Requests released since the last step.
    forget: Vec<RequestId>,
    /// The step the ranks are running.
    at_ranks: Option<StepId>,
    /// A step scheduled ahead (async scheduling), not yet sent.
    ahead: Option<ScheduledStep<EngineMeta>>,
    /// Free GPU blocks of the fresh engine (what [`Engine::leaks`] expects back).
    free_blocks: u32,
    /// The longest request admitted (prompt and output tokens).
    max_model_len: u32,
    /// Where the figures are published as they change ([`Engine::set_metrics`]).
    metrics: Option<Arc<Metrics>>,
    /// The ranks' counters so far: the sum of every report's delta (added as it arrives, fresh
    /// or not: the rank did the work), published after each step.
    ranks_live: RankDelta,
    /// Where each step's KV events go ([`RunConfig::kv_events`]).
    events: Option<Publisher>,
    /// The shared tier ([`RunConfig::tier`]).
    tier: Option<Tier>,
    /// P/D prefill: the requests held for decode engines, as the KV server reads them.
    held: HeldTable,
    /// P/D prefill: the KV server ([`crate::pd`]).
    kv_server: Option<KvServer>,
    /// Per CPU chunk being promoted, the prefix hash of each token slot it will hold.
    promoting: HashMap<ChunkId, Vec<u64>>,
    /// Chunks promoted since the last step sent, for the ranks' checks.
    promoted: Vec<PromotedChunk>,
    pub figures: Figures,
}

/// The token just past the chunk whose last block hash is `hash`, in a request with
/// `block_hashes` (`None`: not a chunk of the request).
fn chunk_end(block_hashes: &[BlockHash], hash: BlockHash, bpc: usize, tpc: usize) -> Option<usize> {
    let last = (bpc - 1..block_hashes.len())
        .step_by(bpc)
        .find(|&i| block_hashes[i] == hash)?;
    Some((last + 1) / bpc * tpc)
}

/// The token sampled for `request` at `position` (seeded, no model).
fn sample(seed: u64, request: RequestId, position: u32) -> Token {
    let mut r = workload::Rng::new(seed ^ (u64::from(request.0) << 32) ^ u64::from(position));
    (r.next_u64() % 50_000) as Token
}

impl Engine {
    /// Builds the engine for requests of at most `max_model_len` tokens and starts its ranks
    /// over the transport `c.workers` names, on tokio's clock.
    pub async fn start(c: &RunConfig, max_model_len: u32) -> Result<Self, RunError> {
        let clock = Arc::new(TokioClock::default());
        Self::start_with(c, max_model_len, &*transport::for_config(c), clock).await
    }

    /// [`Engine::start`] with the ranks reached over `transport` and every wait and
    /// measurement on `clock` (see [`crate::transport`]).
    pub async fn start_with(
        c: &RunConfig,
        max_model_len: u32,
        transport: &dyn Transport,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, RunError> {
        if c.ranks == 0 || c.ranks > 64 {
            return Err(RunError::Config("ranks: 1 to 64".into()));
        }
        if !(1..=2).contains(&c.async_depth) {
            return Err(RunError::Config("async_depth: 1 or 2".into()));
        }
        let max_model_len = max_model_len.max(2);
        let (gpu_blocks, cpu_blocks) = build::pools(c, max_model_len)?;
        let (gpu, host) = build::layouts(c, gpu_blocks, cpu_blocks)?;
        let backend = c.backend.resolve().map_err(RunError::Backend)?;
        let sc = build::scheduler_config(c, gpu_blocks, max_model_len);
        let mut off = build::offloading(c, cpu_blocks);
        let pools = build::tier_pools(c, backend, &host, &mut off)?;
        let connector = build::connector(c, backend, off, &sc)?;
        let arenas = build::served_arenas(c, &gpu);
        let mut core = EngineCore::new(sc.clone(), connector, c.ranks)?;
        let free_blocks = core.scheduler().view().num_free_blocks();
        let events = match &c.kv_events {
            Some(e) => Some(Publisher::start(e).await?),
            None => None,
        };
        core.set_cache_events(events.is_some());

        let wake = Arc::new(Notify::new());
        let (report_tx, reports) = mpsc::channel::<RankReport>(c.ranks as usize);
        let mut to_ranks = Vec::new();
        let mut handles = Vec::new();
        for r in 0..c.ranks {
            let mut setup = build::rank_setup(c, r, backend, (&gpu, &host), &sc);
            setup.host_pool = pools.as_ref().map(|p| p.pools[r as usize].clone());
            setup.shared_pool = setup.host_pool.as_ref().and_then(HostPool::shared_path);
            setup.arena = arenas.as_ref().map(|a| a[r as usize].clone());
            let conn = transport
                .connect(setup, wake.clone(), report_tx.clone())
                .await?;
            to_ranks.push(conn.steps);
            handles.push(conn.task);
        }
        let tier = match (&c.tier, pools) {
            (Some(t), Some(pools)) => Some(Tier::connect(t, build::namespace(c), pools).await?),
            _ => None,
        };
        let held = HeldTable::default();
        let kv_server = match (&c.pd, arenas) {
            (Some(p), Some(arenas)) => {
                Some(KvServer::start(&p.listen, arenas, gpu.clone(), held.clone()).await?)
            }
            _ => None,
        };
        Ok(Self {
            config: c.clone(),
            clock,
            core,
            to_ranks,
            reports,
            handles,
            wake,
            tokens: Vec::new(),
            forget: Vec::new(),
            at_ranks: None,
            ahead: None,
            free_blocks,
            max_model_len,
            metrics: None,
            ranks_live: RankDelta::default(),
            events,
            tier,
            held,
            kv_server,
            promoting: HashMap::new(),
            promoted: Vec::new(),
            figures: Figures {
                backend,
                gpu_blocks,
                cpu_blocks,
                max_model_len,
                timeline: Recorder::new(c.timeline.is_some()),
                ..Figures::default()
            },
        })
    }

    /// Whether a step would do anything (requests, or a step in flight).
    pub fn has_work(&self) -> bool {
        self.core.has_work()
    }

    /// A request arrives. A prompt of `max_model_len` tokens or more is refused
    /// ([`RunError::Refused`], counted; the engine goes on), as vLLM refuses it at submit.
    pub fn add(
        &mut self,
        id: RequestId,
        prompt: Vec<Token>,
        max_tokens: u32,
    ) -> Result<(), RunError> {
        self.add_with(id, prompt, max_tokens, None)
    }

    /// [`Engine::add`] with the request's `kv_transfer_params` (a P/D router's). Params that
    /// do not read as P/D params are refused ([`RunError::BadParams`]; the engine goes on).
    pub fn add_with(
        &mut self,
        id: RequestId,
        prompt: Vec<Token>,
        max_tokens: u32,
        kv_transfer_params: Option<Params>,
    ) -> Result<(), RunError> {
        if let Some(p) = &kv_transfer_params {
            PdParams::parse(p).map_err(|error| RunError::BadParams { request: id, error })?;
        }
        if prompt.len() as u64 >= u64::from(self.max_model_len) {
            self.figures.refused += 1;
            return Err(RunError::Refused {
                request: id,
                prompt_tokens: prompt.len() as u64,
                max_model_len: self.max_model_len,
            });
        }
        self.core.add_request(RequestSpec {
            id,
            prompt: prompt.clone(),
            max_tokens,
            stop_token: None,
            kv_transfer_params,
        })?;
        self.figures.prompt_tokens += prompt.len() as u64;
        self.tokens.push((id, prompt));
        Ok(())
    }

    /// P/D prefill: the decode side is done reading `request`'s blocks (its acknowledgement):
    /// they are released with the next step. `false` if nothing waits for it (late, repeated,
    /// or not a prefill engine).
    pub fn acknowledge(&mut self, request: RequestId) -> bool {
        let conn = self.core.scheduler_mut().connector_mut();
        connector::pd_mut(conn).is_some_and(|pd| pd.acknowledge(request))
    }

    /// What the P/D connector counted (`None`: not a P/D engine).
    pub fn pd_stats(&self) -> Option<PdStats> {
        connector::pd(self.core.scheduler().connector()).map(|pd| *pd.stats())
    }

    /// P/D prefill: the KV server decode engines read from.
    pub fn kv_server(&self) -> Option<&KvServer> {
        self.kv_server.as_ref()
    }

    /// Aborts a request; `false` if it was not live.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, RunError> {
        Ok(self.core.abort(id)?)
    }

    /// Resets the connector's cache (vLLM's `reset_prefix_cache` reaching the connector).
    pub fn reset_cache(&mut self) -> Result<Option<bool>, RunError> {
        Ok(self.core.reset_connector_cache()?)
    }

    /// Resets the GPU prefix cache and the connector's (vLLM's `reset_prefix_cache(
    /// reset_connector=True)`): `false`, and nothing dropped from the GPU cache, while a block
    /// is in use. With KV events on, the next step publishes `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) -> Result<bool, RunError> {
        Ok(self.core.reset_prefix_cache(true)?)
    }

    /// Batches of KV events published so far, when events are published.
    pub fn kv_events_published(&self) -> Option<u64> {
        self.events.as_ref().map(Publisher::published)
    }

    /// The KV-event endpoints as bound (PUB, replay), when events are published.
    pub fn kv_events_endpoints(&self) -> Option<(&str, Option<&str>)> {
        self.events
            .as_ref()
            .map(|p| (p.endpoint(), p.replay_endpoint()))
    }

    /// One engine step (see the module docs): the oldest step in flight is run by the ranks
    /// and applied. With async scheduling (`async_depth` 2), the next step is scheduled while
    /// the ranks run this one — with placeholders for the tokens this one samples — and sent to
    /// them, with those tokens, once this one is applied.
    pub async fn step(&mut self) -> Result<StepOutcome, RunError> {
        let t0 = self.clock.now();
        let started = self.figures.timeline.is_on().then(now_us).unwrap_or(0);
        let mut core_time = Duration::ZERO;
        self.collect_tier().await?;
        let step = match self.at_ranks {
            Some(step) => step,
            None => {
                let s = match self.ahead.take() {
                    Some(s) => s,
                    None => self.schedule()?,
                };
                core_time += self.clock.now().saturating_sub(t0);
                self.send(s).await?
            }
        };
        // Ahead only for requests: an empty step ahead of an empty step would never end.
        if self.config.async_depth >= 2
            && self.ahead.is_none()
            && self.core.scheduler().has_requests()
        {
            let t = self.clock.now();
            self.ahead = Some(self.schedule()?);
            self.figures.scheduled_ahead += 1;
            core_time += self.clock.now().saturating_sub(t);
        }
        let f = &mut self.figures;
        // One timer for the whole step (not one per report): a rank task that ended without
        // reporting (it panicked) must not leave the engine waiting forever.
        let mut check = self.clock.sleep(RANK_CHECK);
        let mut reported = vec![false; self.to_ranks.len()];
        let mut left = reported.len();
        while left > 0 {
            let rep = loop {
                tokio::select! {
                    biased;
                    r = self.reports.recv() => break r,
                    () = &mut check => {
                        if let Some(r) = self.handles.iter().position(JoinHandle::is_finished) {
                            return Err(RunError::RankGone { rank: r as u32 });
                        }
                        check = self.clock.sleep(RANK_CHECK);
                    }
                }
            };
            let Some(rep) = rep.inspect(|r| self.ranks_live.add(&r.delta)) else {
                return Err(RunError::RankGone { rank: 0 });
            };
            // An error is never dropped, whatever step it names.
            let output = rep.output?;
            // A duplicated or stale frame is refused here, before the core would count it.
            let fresh = rep.step == step
                && reported
                    .get_mut(rep.rank as usize)
                    .is_some_and(|seen| !std::mem::replace(seen, true));
            if !fresh {
                f.reports_rejected += 1;
                tracing::warn!(
                    rank = rep.rank,
                    step = rep.step.0,
                    running = step.0,
                    "rank report refused: duplicate or stale"
                );
                continue;
            }
            left -= 1;
            if let Some(l) = output.finished_recving.as_ref() {
                f.loads_reported += l.len() as u64;
            }
            let t = self.clock.now();
            self.core
                .rank_output(rep.step, Rank(rep.rank), Some(output))?;
            core_time += self.clock.now().saturating_sub(t);
        }
        self.at_ranks = None;
        let t = self.clock.now();
        let seed = self.config.seed;
        let sampled: Vec<(RequestId, Vec<Token>)> = self
            .core
            .scheduler()
            .sampling(step)
            .map(|(id, pos)| (id, vec![sample(seed, id, pos)]))
            .collect();
        let applied = self.core.apply(sampled)?;
        crate::pd::sync_held(self.kv_server.as_ref(), &self.held, self.core.scheduler());
        let released = self.core.take_released();
        core_time += self.clock.now().saturating_sub(t);
        if self.config.check {
            self.core.check_invariants()?;
            f.invariant_checks += 1;
        }
        for o in &applied.result.outputs {
            if !o.new_tokens.is_empty() {
                f.generated_tokens += o.new_tokens.len() as u64;
                self.tokens.push((o.id, o.new_tokens.clone()));
            }
            if o.finish.is_some() {
                f.finished += 1;
            }
        }
        self.forget.extend(released.iter().copied());
        f.steps += 1;
        if applied.idle {
            f.idle_steps += 1;
        }
        f.timeline
            .span(|| format!("step {}", step.0), started, 0, 0);
        self.after_step(core_time, &applied.result.outputs).await?;
        if let Some(s) = self.ahead.take() {
            // The step scheduled ahead goes to the ranks with the tokens just sampled.
            self.send(s).await?;
        }
        tracing::debug!(step = step.0, idle = applied.idle, "engine step");
        Ok(StepOutcome {
            step,
            outputs: applied.result.outputs,
            idle: applied.idle,
            released,
        })
    }

    /// Publishes the engine's figures to `metrics` from now on (the engine side's: see
    /// [`crate::metrics`]).
    pub fn set_metrics(&mut self, metrics: Arc<Metrics>) {
        metrics.pools(self.figures.gpu_blocks, self.figures.cpu_blocks);
        self.metrics = Some(metrics);
        self.publish(None, &[]);
    }

    /// After a step that took `core_time` on the engine side (`None`: no step): its time, and
    /// the figures to the metrics, if any.
    fn publish(&mut self, core_time: Option<Duration>, outputs: &[RequestOutput]) {
        let f = &mut self.figures;
        if let Some(t) = core_time {
            f.core_us.push(t.as_secs_f64() * 1e6);
        }
        let Some(m) = &self.metrics else {
            return;
        };
        if let Some(t) = core_time {
            m.step_time(t.as_secs_f64());
        }
        for reason in outputs.iter().filter_map(|o| o.finish) {
            m.finished(finished_reason(reason));
        }
        m.set_all(&[
            (Total::PromptTokens, f.prompt_tokens),
            (Total::GenerationTokens, f.generated_tokens),
            (Total::Preemptions, f.preemptions),
            (Total::PromptTokensCached, f.reused_tokens),
            (Total::Steps, f.steps),
            (Total::IdleSteps, f.idle_steps),
            (Total::ScheduledAhead, f.scheduled_ahead),
            (Total::RequestsRefused, f.refused),
            (Total::TokensComputed, f.tokens_computed),
            (Total::ReportsRejected, f.reports_rejected),
            (Total::EngineInvariantChecks, f.invariant_checks),
        ]);
        let _ = m.ranks(&self.ranks_live);
        let sched = self.core.scheduler();
        let view = sched.view();
        let usable = self.free_blocks.max(1);
        let cpu = connector::offloading(sched.connector()).map(|c| c.manager());
        let count = |f: fn(&kvrelay_core::CpuOffloadingManager) -> u32| cpu.map_or(0, f);
        m.levels(&Levels {
            running: view.running().len() as u32,
            waiting: view.waiting().count() as u32,
            kv_cache_usage: 1.0 - f64::from(view.num_free_blocks()) / f64::from(usable),
            cpu_chunks: f.cpu_blocks / self.config.blocks_per_chunk.max(1),
            cpu_free: count(|c| c.num_free_chunks()),
            cpu_evictable: count(|c| c.num_evictable()),
            cpu_pinned: count(|c| c.num_pinned()),
            cpu_write_pending: count(|c| c.num_write_pending()),
        });
    }

    /// After a step: its figures to the metrics, its KV events to the publisher.
    async fn after_step(
        &mut self,
        core_time: Duration,
        outputs: &[RequestOutput],
    ) -> Result<(), RunError> {
        self.publish(Some(core_time), outputs);
        self.launch_tier();
        self.publish_events().await
    }

    /// Hands the tier's work of this step to the tier (it runs while the next step starts).
    fn launch_tier(&mut self) {
        let Some(tier) = &mut self.tier else {
            return;
        };
        let sched = self.core.scheduler_mut();
        let work = connector::offloading_mut(sched.connector_mut())
            .map(|c| c.take_tier_work())
            .unwrap_or_default();
        let view = sched.view();
        let tpc = (self.config.block_size * self.config.blocks_per_chunk) as usize;
        for w in &work {
            if let TierWork::Load {
                request,
                keys,
                chunks,
                ..
            } = w
                && let Some(r) = view.request(*request)
            {
                let bpc = self.config.blocks_per_chunk as usize;
                let ends: Vec<Option<usize>> = keys
                    .iter()
                    .map(|k| chunk_end(r.block_hashes(), k.hash, bpc, tpc))
                    .collect();
                let upto = ends.iter().flatten().max().copied().unwrap_or(0);
                let mut prefixes = Vec::new();
                crate::content::extend_prefixes(
                    &mut prefixes,
                    &r.tokens()[..upto.min(r.tokens().len())],
                );
                for (end, chunk) in ends.into_iter().zip(chunks) {
                    if let Some(slots) = end.and_then(|e| prefixes.get(e - tpc..e)) {
                        self.promoting.insert(*chunk, slots.to_vec());
                    }
                }
            }
        }
        tier.launch(work);
    }

    /// Waits for the tier's batch in flight and hands its reports to the core, and the chunks
    /// it promoted to the ranks (with the next step).
    async fn collect_tier(&mut self) -> Result<(), RunError> {
        let Some(tier) = &mut self.tier else {
            return Ok(());
        };
        let done = tier.collect().await?;
        let Some(conn) = connector::offloading_mut(self.core.scheduler_mut().connector_mut())
        else {
            return Err(StoreError::Protocol(
                "a shared tier without the offloading connector".into(),
            )
            .into());
        };
        for r in done.reports {
            conn.report_tier(r)
                .map_err(|e| StoreError::Protocol(e.to_string()))?;
        }
        for p in done.promoted {
            let Some(prefixes) = self.promoting.remove(&p.chunk) else {
                return Err(StoreError::Protocol(format!(
                    "promoted chunk {:?} has no recorded content",
                    p.chunk
                ))
                .into());
            };
            self.promoted.push(PromotedChunk {
                chunk: p.chunk.0,
                prefixes,
            });
        }
        // The batch's failed promotions: their chunks hold nothing the ranks must learn.
        self.promoting.clear();
        Ok(())
    }

    /// The shared tier's figures, when there is one.
    pub fn tier_figures(&self) -> Option<&crate::tier::TierFigures> {
        self.tier.as_ref().map(|t| &t.figures)
    }

    /// The shared tier's store, when there is one (tests reach an in-process store through it).
    pub fn tier_store(&self) -> Option<&crate::tier::Store> {
        self.tier.as_ref().map(Tier::store)
    }

    /// Makes the shared tier use `store` (another engine's, for engines of one process that
    /// share an in-process store): before the first step. `false` without a tier.
    pub fn share_tier_store(&mut self, store: crate::tier::Store) -> bool {
        self.tier.as_mut().map(|t| t.use_store(store)).is_some()
    }

    /// Hands this step's KV events to the publisher, if any.
    async fn publish_events(&mut self) -> Result<(), RunError> {
        let Some(p) = &mut self.events else {
            return Ok(());
        };
        let events = self.core.take_cache_events();
        let sched = self.core.scheduler();
        p.step(&events, || live_hashes(sched)).await
    }

    /// Schedules one step.
    fn schedule(&mut self) -> Result<ScheduledStep<EngineMeta>, RunError> {
        let scheduled = self.core.schedule()?;
        crate::pd::sync_held(self.kv_server.as_ref(), &self.held, self.core.scheduler());
        let f = &mut self.figures;
        let out = &scheduled.step.output;
        f.preemptions += out.preempted_req_ids.len() as u64;
        f.tokens_computed += u64::from(out.total_num_scheduled_tokens);
        if let Some(m) = &self.metrics {
            m.scheduled(out.total_num_scheduled_tokens);
        }
        for n in &out.scheduled_new_reqs {
            if let Entry::Vacant(e) = f.reused.entry(n.id) {
                e.insert(n.num_computed_tokens);
                f.reused_tokens += u64::from(n.num_computed_tokens);
            }
        }
        Ok(scheduled.step)
    }

    /// Sends `step` to every rank, with the tokens and releases since the last one.
    async fn send(&mut self, step: ScheduledStep<EngineMeta>) -> Result<StepId, RunError> {
        let id = step.output.step;
        let msg_step = Arc::new(step);
        let msg_tokens = Arc::new(std::mem::take(&mut self.tokens));
        let msg_forget = Arc::new(std::mem::take(&mut self.forget));
        let msg_promoted = Arc::new(std::mem::take(&mut self.promoted));
        for (r, tx) in self.to_ranks.iter().enumerate() {
            let m = StepMsg {
                step: msg_step.clone(),
                tokens: msg_tokens.clone(),
                forget: msg_forget.clone(),
                promoted: msg_promoted.clone(),
            };
            if tx.send(m).await.is_err() {
                return Err(rank_gone(&mut self.reports, r as u32));
            }
        }
        self.at_ranks = Some(id);
        Ok(id)
    }

    /// After an idle step: waits for a transfer of an in-process rank to complete, at most a
    /// few milliseconds (worker processes are polled by stepping again).
    pub async fn wait_idle(&self) {
        if self.config.completions != Completions::AsArrived {
            // Completions come with the steps: stepping again is what brings them.
            return;
        }
        tokio::select! {
            () = self.wake.notified() => {}
            () = self.clock.sleep(IDLE_WAIT) => {}
        }
    }

    /// The requests that can never run, if the engine is stuck: it has requests, and no step
    /// and no transfer is in flight that could change what it schedules. Call after an idle
    /// step.
    pub fn stuck(&self) -> Option<Vec<RequestId>> {
        let sched = self.core.scheduler();
        let busy = self.at_ranks.is_some()
            || self.ahead.is_some()
            || self.core.steps_in_flight().next().is_some()
            || connector::offloading(sched.connector()).is_some_and(|c| {
                c.jobs_in_flight().next().is_some()
                    || c.tiering().is_some_and(|t| t.has_pending_work())
            })
            || sched
                .view()
                .waiting()
                .any(|r| sched.status(r) == Some(RequestStatus::WaitingForRemoteKvs))
            || self.tier.as_ref().is_some_and(Tier::running);
        if busy || !sched.has_requests() || self.awaits_acks() {
            return None;
        }
        Some(self.live_requests())
    }

    /// P/D prefill: a request is held for a decode engine's acknowledgement, so what runs next
    /// may depend on the decode side (its blocks come back with it): not stuck on its own.
    fn awaits_acks(&self) -> bool {
        let sched = self.core.scheduler();
        connector::pd(sched.connector()).is_some_and(|pd| pd.awaiting_ack().next().is_some())
    }

    /// P/D prefill without a lease: every request left is held for a decode engine's
    /// acknowledgement and nothing is in flight, so nothing changes until one comes (compat
    /// waits for ever: a run ends there, and [`Engine::leaks`] names them).
    pub fn awaiting_acks_only(&self) -> bool {
        let sched = self.core.scheduler();
        let Some(pd) = connector::pd(sched.connector()) else {
            return false;
        };
        let awaiting: std::collections::BTreeSet<RequestId> = pd.awaiting_ack().collect();
        pd.config().lease_steps.is_none()
            && !awaiting.is_empty()
            && self.at_ranks.is_none()
            && self.ahead.is_none()
            && self.core.steps_in_flight().next().is_none()
            && sched.request_ids().all(|r| awaiting.contains(&r))
    }

    /// The scheduler's requests, waiting and running, in id order.
    pub fn live_requests(&self) -> Vec<RequestId> {
        let view = self.core.scheduler().view();
        let mut ids: Vec<RequestId> = view
            .waiting()
            .chain(view.running().iter().copied())
            .collect();
        ids.sort();
        ids
    }

    /// What is not back to empty, each as a sentence (empty when nothing is): to call once
    /// every request finished and nothing is in flight, when a run must leave no request, job,
    /// pinned chunk, fenced block, GPU block, tier batch, tier job or promotion behind.
    pub fn leaks(&self) -> Vec<String> {
        let mut out = Vec::new();
        let sched = self.core.scheduler();
        if sched.has_requests() {
            out.push("the scheduler still holds requests".to_owned());
        }
        if let Some(s) = self.core.steps_in_flight().next() {
            out.push(format!("step {} still in flight", s.0));
        }
        let free = sched.view().num_free_blocks();
        if free != self.free_blocks {
            out.push(format!(
                "{} GPU blocks not returned ({free} free of {})",
                self.free_blocks.saturating_sub(free),
                self.free_blocks
            ));
        }
        if let Some(conn) = connector::offloading(sched.connector()) {
            offloading_leaks(conn, &mut out);
        }
        if let Some(pd) = connector::pd(sched.connector()) {
            let held: Vec<u32> = pd.awaiting_ack().map(|r| r.0).collect();
            if !held.is_empty() {
                out.push(format!("requests still held for a decode engine: {held:?}"));
            }
        }
        if self.tier.as_ref().is_some_and(Tier::running) || !self.promoting.is_empty() {
            let n = self.promoting.len();
            out.push(format!(
                "a tier batch not collected ({n} promotions unreported)"
            ));
        }
        out
    }

    /// Stops the ranks and waits for them (and for worker processes to exit).
    pub async fn stop(self) {
        let _ = self.shutdown().await;
    }

    /// Stops the ranks; returns their figures (default figures for a rank that failed).
    pub async fn shutdown(self) -> (Figures, Vec<RankStats>) {
        let stopped = self.shutdown_on(&mut StopSignal::never(), STOP_GRACE).await;
        (stopped.figures, stopped.ranks)
    }

    /// Stops the ranks as [`Engine::shutdown`] does — closes their links and waits for each
    /// to exit — but kills what is left `grace` after `stop` asked for a graceful stop (at
    /// once if it already had, before this call), or as soon as it asks for an immediate one
    /// (see [`crate::stop`]). A killed rank's figures are the default ones.
    pub async fn shutdown_on(self, stop: &mut StopSignal, grace: Duration) -> Stopped {
        let Engine {
            to_ranks,
            mut handles,
            mut figures,
            clock,
            events,
            tier,
            ..
        } = self;
        drop(to_ranks);
        if let Some(p) = events {
            figures.kv_events = p.finish().await;
        }
        if let Some(mut t) = tier {
            // A batch still running is waited for (its commands have deadlines): its figures
            // count, its reports have no engine left to go to.
            let _ = t.collect().await;
            figures.tier = Some(t.figures);
        }
        let mut ranks = Vec::with_capacity(handles.len());
        tokio::select! {
            () = join_in_order(&mut handles, &mut ranks) => {}
            () = stop.deadline(&*clock, grace) => {}
        }
        // The ranks not joined yet: killed (a worker process's link kills its process when
        // its task is dropped), unless they ended meanwhile.
        let mut ranks_killed = 0;
        for h in handles.iter().skip(ranks.len()) {
            h.abort();
        }
        for h in handles.iter_mut().skip(ranks.len()) {
            match h.await {
                Ok(stats) => ranks.push(stats),
                Err(_) => {
                    ranks_killed += 1;
                    ranks.push(RankStats::default());
                }
            }
        }
        if ranks_killed > 0 {
            tracing::info!(ranks_killed, "ranks killed after the stop's grace period");
        }
        Stopped {
            figures,
            ranks,
            ranks_killed,
        }
    }
}

/// Every block hash the core may still name in an event: the GPU pool's cached blocks, the
/// offloading connector's and manager's, the requests' (see [`crate::events`]).
fn live_hashes(s: &Scheduler<EngineConnector>) -> Vec<BlockHash> {
    let pool = s.block_pool();
    let mut out: Vec<BlockHash> = (0..u64::from(pool.num_blocks()))
        .filter_map(|b| pool.cached_hash(BlockId(b)).map(|(h, _)| h))
        .collect();
    if let Some(c) = connector::offloading(s.connector()) {
        out.extend(c.referenced_hashes());
    }
    let view = s.view();
    for id in s.request_ids() {
        if let Some(r) = view.request(id) {
            out.extend_from_slice(r.block_hashes());
        }
    }
    out
}

/// What the offloading connector still holds (see [`Engine::leaks`]).
fn offloading_leaks(conn: &OffloadingConnector, out: &mut Vec<String>) {
    let jobs: Vec<u64> = conn.jobs_in_flight().map(|j| j.0).collect();
    if !jobs.is_empty() {
        out.push(format!("offloading jobs still in flight: {jobs:?}"));
    }
    let fenced: Vec<u64> = conn.fenced_blocks().map(|b| b.0).collect();
    if !fenced.is_empty() {
        out.push(format!("blocks still fenced: {fenced:?}"));
    }
    let m = conn.manager();
    let pinned = m.num_pinned();
    if pinned > 0 || m.num_write_pending() > 0 {
        out.push(format!(
            "{pinned} CPU chunks still pinned, {} stores pending",
            m.num_write_pending()
        ));
    }
    if conn.tiering().is_some_and(|t| t.has_pending_work()) {
        out.push("tier jobs (cascades, promotions) still unreported".to_owned());
    }
}

/// vLLM's `finished_reason` label for a core finish.
fn finished_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stopped => FINISHED_REASONS[0],
        FinishReason::LengthCapped => FINISHED_REASONS[1],
        FinishReason::Aborted => FINISHED_REASONS[2],
        FinishReason::Error => FINISHED_REASONS[3],
    }
}

/// What [`Engine::shutdown_on`] leaves.
#[derive(Debug)]
pub struct Stopped {
    /// The engine's figures.
    pub figures: Figures,
    /// Each rank's figures, in rank order (default figures for a rank that failed or was
    /// killed).
    pub ranks: Vec<RankStats>,
    /// Ranks still running at the stop's deadline, and killed.
    pub ranks_killed: u32,
}

/// Joins `handles` in order, pushing each rank's figures; cancel-safe (a handle joined is
/// pushed before the next is awaited, so `ranks.len()` says how many were).
async fn join_in_order(handles: &mut [JoinHandle<RankStats>], ranks: &mut Vec<RankStats>) {
    for h in handles.iter_mut() {
        ranks.push(h.await.unwrap_or_default());
    }
}

/// The error of a rank whose step channel closed: its own report if it sent one.
fn rank_gone(reports: &mut mpsc::Receiver<RankReport>, rank: u32) -> RunError {
    while let Ok(rep) = reports.try_recv() {
        if let Err(e) = rep.output {
            return e;
        }
    }
    RunError::RankGone { rank }
}
