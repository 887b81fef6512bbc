//! The `engine` machine with the offloading connector (SEMANTICS.md §5.5–§5.7, §6.4, §9.5):
//! the core's engine step — an [`EngineCore`] (the real scheduler with an
//! [`OffloadingConnector`], and the real aggregator) and W [`RankDriver`]s, each over an
//! [`OffloadingWorker`] behind the step protocol guard — with a simulated DMA under each rank.
//!
//! The simulated DMA is the core's [`SimDma`] (one per rank, [`OnWait::CompleteThroughQueue`]):
//! it performs every `Start` a hook asks for and completes a transfer
//! * when a hook returns `Wait` for it (at once, in the order asked: the hook blocks on it) —
//!   and with it every earlier transfer of its queue (stores, async loads, sync loads), because
//!   vLLM's worker runs the transfers of one queue serially (`cpu/gpu_worker.py`: each waits for
//!   the previous one's end event), so waiting for one waits for those before it,
//! * at the end of the rank's worker step, every transfer still in flight in submission order,
//!   unless the rank is *held* (`hold`),
//! * when the case says so (`complete`).
//!
//! This file tells the DMA which loads are synchronous (their own queue) and records what each
//! rank did (`StepRecorder`).
//!
//! Completions reach the scheduler only through the worker's `get_finished` (head-of-line per
//! queue), the worker metadata and the aggregator, as in vLLM.
//!
//! The `engine` harness (`engine.rs`) builds an [`OffloadEngine`] for an `engine` case whose
//! `connector` is `{"offloading": {…}}` and maps each call of the case onto one of its methods;
//! the `render_*` functions here give their results' JSON. This file knows nothing of the
//! case's calls: it imports only the case's error type and the shared JSON helpers.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kvrelay_core::testing::{DmaQueue, OnWait, SimDma, StepObserver};
use kvrelay_core::{
    AggregatedOutput, BlockId, ChunkId, EngineCore, Interner, JobId, KeyLookup, ManagerConfig,
    Meta, NULL_BLOCK, OffloadKey, OffloadingConfig, OffloadingConnector, OffloadingConnectorMeta,
    OffloadingWorker, OffloadingWorkerConfig, PolicyKind, Rank, RankAction, RankConfig, RankDriver,
    RequestId, RequestSpec, ScheduledStep, Scheduler, SchedulerConfig, SchedulerConnector,
    SchedulerError, StepId, StepResult, Token, Transfer, TransferDirection, TransferJob,
    WorkerCall, WorkerOutput, hash_block,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, err};
use super::json::{
    render_aggregated, render_id, render_opt_ids, render_opt_meta, render_step_result,
    render_tables, scheduled_fields,
};

/// The `{"offloading": {…}}` value of the engine's `connector` config key.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JOffloading {
    blocks_per_chunk: u32,
    capacity_chunks: u32,
    #[serde(default = "lru")]
    policy: String,
    #[serde(default = "one")]
    store_threshold: u32,
    #[serde(default = "one")]
    ranks: u32,
    #[serde(default)]
    non_writers: Vec<u32>,
    #[serde(default)]
    sync_load_budget_tokens: u32,
    #[serde(default = "yes")]
    offload_prompt_only: bool,
    #[serde(default = "one_u64")]
    bytes_per_block: u64,
}

fn lru() -> String {
    "lru".into()
}
fn one() -> u32 {
    1
}
fn one_u64() -> u64 {
    1
}
fn yes() -> bool {
    true
}

/// One job as the harness remembers it: what the metadata carried, and where its GPU blocks
/// sit in the request's block table.
#[derive(Debug, Clone)]
pub struct JobRecord {
    id: JobId,
    job: TransferJob,
    /// Per group, per block of `job.gpu.block_ids`: its index in the request's block table.
    indexes: Vec<Vec<Option<u32>>>,
}

/// A transfer one rank started.
#[derive(Debug, Clone)]
pub struct TransferView {
    transfer: Transfer,
    indexes: Vec<Option<u32>>,
}

/// What one rank did in one worker step.
#[derive(Debug, Clone, Default)]
pub struct RankStep {
    stored: Vec<TransferView>,
    loaded: Vec<TransferView>,
    /// Jobs waited for in `handle_preemptions` (the flush), with their record.
    flushed: Vec<JobRecord>,
    /// Jobs waited for in `start_load_kv` (synchronous loads).
    sync_waited: Vec<JobId>,
    output: Option<WorkerOutput<Meta>>,
}

/// `schedule`'s result with the offloading metadata.
#[derive(Debug)]
pub struct OffloadScheduled {
    step: ScheduledStep<OffloadingConnectorMeta>,
    groups: usize,
    load_jobs: Vec<JobRecord>,
    store_jobs: Vec<JobRecord>,
}

/// `execute`'s result.
#[derive(Debug)]
pub struct Executed {
    step: StepId,
    ranks: Vec<RankStep>,
    aggregated: Option<AggregatedOutput<Meta>>,
}

/// `offload_state`'s result.
#[derive(Debug)]
pub struct OffloadState {
    jobs: Vec<(JobId, u32)>,
    requests: Vec<(RequestId, Vec<JobId>)>,
    fenced_blocks: Vec<BlockId>,
    reset_fence: usize,
    resets_flushed: u64,
    allocation_failures: u64,
    next_job: u64,
    push_work: bool,
    ranks: Vec<RankState>,
}

/// One rank in `offload_state`.
#[derive(Debug)]
pub struct RankState {
    in_flight: Vec<JobId>,
    awaiting_completion: Vec<JobId>,
    deferred_stores: Vec<JobId>,
    held: bool,
}

/// The scheduler, its offloading connector, and the simulated ranks.
#[derive(Debug)]
pub struct OffloadEngine {
    engine: EngineCore<OffloadingConnector>,
    ranks: Vec<RankDriver<OffloadingWorker>>,
    /// Per rank, its simulated DMA.
    dma: Vec<SimDma>,
    /// Steps scheduled and not executed yet, oldest first.
    to_execute: VecDeque<ScheduledStep<OffloadingConnectorMeta>>,
    /// Every job created so far.
    jobs: BTreeMap<JobId, JobRecord>,
    /// Per request, its block table as last shown by the scheduler, keeping blocks it has since
    /// dropped below a sliding window (null there now); fresh once it was seen without blocks.
    tables: BTreeMap<RequestId, Vec<Vec<BlockId>>>,
    /// Requests seen without blocks since their table was taken: the next one is fresh.
    stale: BTreeSet<RequestId>,
    /// Prompts of the requests added, for `lookup`.
    prompts: BTreeMap<RequestId, Vec<Token>>,
    /// Requests added, in order.
    added: Vec<RequestId>,
}

impl OffloadEngine {
    /// A fresh engine from the scheduler config and the `{"offloading": …}` object.
    pub fn new(sc: SchedulerConfig, v: &Value) -> Result<Self, CaseError> {
        let c: JOffloading = serde_json::from_value(v.clone())
            .map_err(|e| CaseError(format!("connector.offloading: {e}")))?;
        let policy = match c.policy.as_str() {
            "lru" => PolicyKind::Lru,
            "arc" => PolicyKind::Arc,
            p => return err(format!("unknown policy `{p}` (expected lru or arc)")),
        };
        if c.ranks == 0 || c.ranks > 64 {
            return err("connector.offloading.ranks: expected 1 to 64");
        }
        if let Some(r) = c.non_writers.iter().find(|&&r| r >= c.ranks) {
            return err(format!("connector.offloading.non_writers: no rank {r}"));
        }
        let mut off = OffloadingConfig::new(
            c.blocks_per_chunk,
            c.ranks,
            ManagerConfig {
                capacity_chunks: c.capacity_chunks,
                policy,
                store_threshold: c.store_threshold,
            },
        );
        off.sync_load_budget_tokens = c.sync_load_budget_tokens;
        off.offload_prompt_only = c.offload_prompt_only;
        let conn = OffloadingConnector::new(off, &sc).map_err(|e| CaseError(e.to_string()))?;
        let rank_config = RankConfig {
            layers: 1,
            block_size: sc.block_size,
            groups: sc.groups.clone(),
        };
        let ranks = (0..c.ranks)
            .map(|r| {
                let worker = OffloadingWorker::new(OffloadingWorkerConfig {
                    blocks_per_chunk: c.blocks_per_chunk,
                    is_store_writer: !c.non_writers.contains(&r),
                    bytes_per_block: c.bytes_per_block,
                    mode: sc.mode,
                });
                RankDriver::new(rank_config.clone(), worker)
            })
            .collect();
        let engine = EngineCore::new(sc, conn, c.ranks).map_err(|e| CaseError(e.to_string()))?;
        let w = c.ranks as usize;
        Ok(Self {
            engine,
            ranks,
            dma: vec![SimDma::new(OnWait::CompleteThroughQueue); w],
            to_execute: VecDeque::new(),
            jobs: BTreeMap::new(),
            tables: BTreeMap::new(),
            stale: BTreeSet::new(),
            prompts: BTreeMap::new(),
            added: Vec::new(),
        })
    }

    /// The engine's (scheduler, aggregator), the connector's and every rank's invariants.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.engine.check_invariants().map_err(|e| e.to_string())?;
        self.engine
            .scheduler()
            .connector()
            .check_invariants()
            .map_err(|e| e.to_string())?;
        for (r, d) in self.ranks.iter().enumerate() {
            d.check_invariants()
                .and_then(|()| d.worker().inner().check_invariants())
                .map_err(|e| format!("rank {r}: {e}"))?;
            if let Some(e) = d.error() {
                return Err(format!("rank {r}: {e}"));
            }
        }
        Ok(())
    }

    /// `add_request`: the scheduler admits the request; its prompt is kept for `lookup`.
    pub fn add(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        let (id, prompt) = (spec.id, spec.prompt.clone());
        self.engine.scheduler_mut().add_request(spec)?;
        self.prompts.insert(id, prompt);
        self.added.push(id);
        Ok(())
    }

    /// `abort`: whether the request was known.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, &'static str> {
        self.engine.abort(id).map_err(|e| e.kind())
    }

    /// `hold`: while `rank` is held, its transfers in flight do not complete at the end of its
    /// worker step.
    pub fn hold(&mut self, rank: u32, value: bool) -> Result<(), &'static str> {
        let dma = self.dma.get_mut(rank as usize).ok_or("rank_out_of_range")?;
        dma.set_held(value);
        Ok(())
    }

    /// `reset_cache`: `reset_connector_cache()`.
    pub fn reset_cache(&mut self) -> Result<Option<bool>, &'static str> {
        self.engine.reset_connector_cache().map_err(|e| e.kind())
    }

    /// The scheduler, for `request` and `state`.
    pub fn scheduler(&self) -> &Scheduler<OffloadingConnector> {
        self.engine.scheduler()
    }

    /// The prompt of request `id`, if it was added.
    pub fn prompt(&self, id: RequestId) -> Option<&[Token]> {
        self.prompts.get(&id).map(Vec::as_slice)
    }

    /// `schedule`: `schedule()`, then the tables and job records.
    pub fn schedule(&mut self) -> Result<OffloadScheduled, &'static str> {
        let st = self.engine.schedule().map_err(|e| e.kind())?.step;
        let s = self.engine.scheduler();
        let groups = s.config().groups.len();
        // Tables, after every schedule: a request seen without blocks (preempted, or its failed
        // load gave them back) gets a fresh table when it has blocks again; otherwise the
        // scheduler's table is merged in (a null keeps the block it replaced).
        let view = s.view();
        for &id in &self.added {
            let Some(r) = view.request(id) else {
                continue;
            };
            let now: Vec<Vec<BlockId>> = (0..groups).map(|g| r.block_ids(g).to_vec()).collect();
            if now.iter().all(Vec::is_empty) {
                if self.tables.contains_key(&id) {
                    self.stale.insert(id);
                }
                continue;
            }
            if self.stale.remove(&id) || !self.tables.contains_key(&id) {
                self.tables.insert(id, now);
                continue;
            }
            let t = self.tables.get_mut(&id).expect("checked above");
            for (old, new) in t.iter_mut().zip(now) {
                for (i, b) in new.into_iter().enumerate() {
                    if i >= old.len() {
                        old.push(b);
                    } else if b != NULL_BLOCK {
                        old[i] = b;
                    }
                }
            }
        }
        let mut record = |id: JobId, job: &TransferJob| {
            let table = self.tables.get(&job.request);
            let indexes = job
                .gpu
                .block_ids
                .iter()
                .enumerate()
                .map(|(g, blocks)| {
                    blocks
                        .iter()
                        .map(|b| {
                            table
                                .and_then(|t| t.get(g))
                                .and_then(|t| t.iter().position(|x| x == b))
                                .map(|i| i as u32)
                        })
                        .collect()
                })
                .collect();
            let rec = JobRecord {
                id,
                job: job.clone(),
                indexes,
            };
            self.jobs.insert(id, rec.clone());
            rec
        };
        let load_jobs = st
            .meta
            .load_jobs
            .iter()
            .map(|(&id, j)| record(id, j))
            .collect();
        let store_jobs = st
            .meta
            .store_jobs
            .iter()
            .map(|(&id, j)| record(id, j))
            .collect();
        self.to_execute.push_back(st.clone());
        Ok(OffloadScheduled {
            step: st,
            groups,
            load_jobs,
            store_jobs,
        })
    }

    /// One rank's worker step for `step`, through its driver, with the simulated DMA.
    fn run_rank(
        &mut self,
        rank: usize,
        step: &ScheduledStep<OffloadingConnectorMeta>,
    ) -> Result<RankStep, &'static str> {
        let mut recorder = StepRecorder {
            jobs: &self.jobs,
            out: RankStep::default(),
        };
        let output = self.dma[rank]
            .run_step(&mut self.ranks[rank], step, &mut recorder)
            .map_err(|e| e.kind())?;
        recorder.out.output = Some(output);
        Ok(recorder.out)
    }

    /// `execute`: every rank's worker step for the oldest step not executed yet.
    pub fn execute(&mut self, step: Option<StepId>) -> Result<Executed, &'static str> {
        let Some(front) = self.to_execute.front() else {
            return Err("not_scheduled");
        };
        if step.is_some_and(|s| s != front.output.step) {
            return Err("step_out_of_order");
        }
        let st = self.to_execute.pop_front().expect("checked above");
        let id = st.output.step;
        let mut ranks = Vec::with_capacity(self.ranks.len());
        for r in 0..self.ranks.len() {
            let rs = self.run_rank(r, &st)?;
            self.engine
                .rank_output(id, Rank(r as u32), rs.output.clone())
                .map_err(|e| e.kind())?;
            ranks.push(rs);
        }
        let aggregated = self.engine.aggregated(id).cloned().ok_or("not_executed")?;
        Ok(Executed {
            step: id,
            ranks,
            aggregated,
        })
    }

    /// `apply_output`: the oldest step's sampled tokens (the fake sampler's, overridden by
    /// `sampled`) and its aggregated connector output applied.
    pub fn apply_output(
        &mut self,
        step: Option<StepId>,
        sampled: &[(RequestId, Vec<Token>)],
    ) -> Result<StepResult, &'static str> {
        let oldest = self.engine.steps_in_flight().next();
        let step = step.or(oldest).unwrap_or(StepId(u64::MAX));
        if oldest != Some(step) {
            return Err("step_out_of_order");
        }
        if self.engine.aggregated(step).is_none() {
            return Err("not_executed");
        }
        let mut tokens = self.engine.scheduler().fake_sample(step);
        for (id, t) in sampled {
            match tokens.iter_mut().find(|(x, _)| x == id) {
                Some(slot) => slot.1.clone_from(t),
                None => tokens.push((*id, t.clone())),
            }
        }
        self.engine
            .apply(tokens)
            .map(|a| a.result)
            .map_err(|e| e.kind())
    }

    /// `run_step`: `schedule`, `execute`, `apply_output`, with no step in flight before.
    pub fn run_step(&mut self) -> Result<(OffloadScheduled, Executed, StepResult), &'static str> {
        if self.engine.steps_in_flight().next().is_some() {
            return Err("step_out_of_order");
        }
        let a = self.schedule()?;
        let b = self.execute(None)?;
        let c = self.apply_output(None, &[])?;
        Ok((a, b, c))
    }

    /// `drain`: `run_step` until no request is left, at most `max` steps; the steps run.
    pub fn drain(&mut self, max: u32) -> Result<u32, &'static str> {
        if self.engine.steps_in_flight().next().is_some() {
            return Err("step_out_of_order");
        }
        let mut n = 0;
        while self.engine.scheduler().has_requests() {
            if n == max {
                return Err("not_drained");
            }
            self.run_step()?;
            n += 1;
        }
        Ok(n)
    }

    /// `complete`: the transfers in flight on `rank` complete (`jobs`, each after those ahead
    /// of it in its queue; `None`: all of them). Returns the jobs completed, in order.
    pub fn complete(
        &mut self,
        rank: usize,
        jobs: Option<&[JobId]>,
    ) -> Result<Vec<JobId>, &'static str> {
        let dma = self.dma.get_mut(rank).ok_or("rank_out_of_range")?;
        let driver = &mut self.ranks[rank];
        let Some(js) = jobs else {
            return dma.release(driver).map_err(|e| e.kind());
        };
        let pending: Vec<JobId> = dma.in_flight().collect();
        let mut seen: Vec<JobId> = Vec::new();
        for j in js {
            if !pending.contains(j) || seen.contains(j) {
                return Err("not_in_flight");
            }
            seen.push(*j);
        }
        // The transfers of one queue run serially: a job completes after those ahead of it.
        let mut done = Vec::new();
        for j in seen {
            done.extend(dma.complete_through(driver, j).map_err(|e| e.kind())?);
        }
        Ok(done)
    }

    /// `lookup`: the manager's answer for every complete chunk of `tokens`, per group.
    pub fn lookup(&self, tokens: &[Token]) -> Vec<Vec<KeyLookup>> {
        let c = self.engine.scheduler().config();
        let bs = c.block_size as usize;
        let bpc = self
            .engine
            .scheduler()
            .connector()
            .config()
            .blocks_per_chunk as usize;
        let mut hashes = Vec::new();
        let mut parent = None;
        for b in 0..tokens.len() / bs {
            let h = hash_block(parent, &tokens[b * bs..(b + 1) * bs]);
            parent = Some(h);
            hashes.push(h);
        }
        let chunks = hashes.len() / bpc;
        let m = self.engine.scheduler().connector().manager();
        (0..c.groups.len())
            .map(|g| {
                (0..chunks)
                    .map(|ch| {
                        m.lookup(OffloadKey {
                            hash: hashes[(ch + 1) * bpc - 1],
                            group: g as u32,
                        })
                    })
                    .collect()
            })
            .collect()
    }

    /// `offload_state`: the connector's jobs, requests and fences, and every rank's transfers.
    pub fn state(&self) -> OffloadState {
        let c = self.engine.scheduler().connector();
        OffloadState {
            jobs: c
                .jobs_in_flight()
                .map(|j| (j, c.pending_count(j).unwrap_or(0)))
                .collect(),
            requests: self
                .added
                .iter()
                .filter(|&&id| c.tracks(id))
                .map(|&id| (id, c.request_jobs(id)))
                .collect(),
            fenced_blocks: c.fenced_blocks().collect(),
            reset_fence: c.reset_fence_len(),
            resets_flushed: c.resets_flushed(),
            allocation_failures: c.allocation_failures(),
            next_job: c.next_job_id().0,
            push_work: c.has_pending_push_work(),
            ranks: self
                .ranks
                .iter()
                .map(|d| d.worker().inner())
                .zip(&self.dma)
                .map(|(w, dma)| RankState {
                    in_flight: w.in_flight().collect(),
                    awaiting_completion: w.awaiting_completion().collect(),
                    deferred_stores: w.deferred_stores().collect(),
                    held: dma.held(),
                })
                .collect(),
        }
    }
}

/// What one rank's step shows a case: the transfers started (with their block indexes), the
/// jobs flushed and the sync loads waited for; and which loads run in the sync queue.
struct StepRecorder<'a> {
    jobs: &'a BTreeMap<JobId, JobRecord>,
    out: RankStep,
}

impl StepRecorder<'_> {
    /// A transfer the rank's driver started.
    fn started(&mut self, t: &Transfer) {
        let indexes = self
            .jobs
            .get(&t.job)
            .map(|r| r.indexes.iter().flatten().copied().collect())
            .unwrap_or_default();
        let v = TransferView {
            transfer: t.clone(),
            indexes,
        };
        match v.transfer.direction {
            TransferDirection::Store => self.out.stored.push(v),
            TransferDirection::Load => self.out.loaded.push(v),
        }
    }

    /// The rank blocks on `jobs`: in handle_preemptions (the flush) or in start_load_kv (sync
    /// loads).
    fn waited(&mut self, jobs: &[JobId], during: WorkerCall) {
        for j in jobs {
            if during != WorkerCall::HandlePreemptions {
                self.out.sync_waited.push(*j);
            } else if let Some(r) = self.jobs.get(j) {
                self.out.flushed.push(r.clone());
            }
        }
    }
}

impl StepObserver<Meta> for StepRecorder<'_> {
    fn action(&mut self, action: &RankAction<Meta>) {
        match action {
            RankAction::Start(t) => self.started(t),
            RankAction::Wait { jobs, during } => self.waited(jobs.as_slice(), *during),
            _ => {}
        }
    }

    /// Stores, async loads, or sync loads (expedited: the step waits for them).
    fn queue(&mut self, t: &Transfer) -> DmaQueue {
        let sync = self.jobs.get(&t.job).is_some_and(|r| r.job.sync);
        match t.direction {
            TransferDirection::Load if sync => DmaQueue::SyncLoad,
            direction => DmaQueue::of(direction),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rendering

fn render_opt_index(i: &Option<u32>) -> Value {
    i.map_or(Value::Null, |i| json!(i))
}

fn render_chunks(c: &[Vec<ChunkId>]) -> Value {
    json!(
        c.iter()
            .map(|g| g.iter().map(|c| c.0).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    )
}

fn render_job(r: &JobRecord, ids: &Interner) -> Value {
    json!({
        "request": render_id(r.job.request, ids),
        "blocks": render_tables(&r.job.gpu.block_ids),
        "indexes": r.indexes.iter().map(|g| g.iter().map(render_opt_index).collect::<Vec<_>>()).collect::<Vec<_>>(),
        "chunks": render_chunks(&r.job.chunks),
        "sync": r.job.sync,
    })
}

fn render_jobs(list: &[JobRecord], ids: &Interner) -> Value {
    let mut m = Map::new();
    for r in list {
        m.insert(r.id.0.to_string(), render_job(r, ids));
    }
    Value::Object(m)
}

/// `schedule`'s result.
pub fn render_scheduled(s: &OffloadScheduled, ids: &Interner) -> Value {
    let mut m = scheduled_fields(&s.step.output, s.groups, ids);
    m.insert(
        "meta".into(),
        json!({
            "load_jobs": render_jobs(&s.load_jobs, ids),
            "store_jobs": render_jobs(&s.store_jobs, ids),
            "jobs_to_flush": s.step.meta.jobs_to_flush.iter().map(|j| j.0).collect::<Vec<_>>(),
        }),
    );
    Value::Object(m)
}

fn render_transfer(t: &TransferView, ids: &Interner) -> Value {
    json!({
        "job": t.transfer.job.0,
        "request": render_id(t.transfer.request, ids),
        "blocks": t.transfer.gpu_blocks.iter().map(|b| b.0).collect::<Vec<_>>(),
        "indexes": t.indexes.iter().map(render_opt_index).collect::<Vec<_>>(),
        "slots": t.transfer.external,
    })
}

/// `execute`'s result.
pub fn render_executed(e: &Executed, ids: &Interner) -> Value {
    let ranks: Vec<Value> = e
        .ranks
        .iter()
        .map(|r| {
            let o = r.output.as_ref();
            json!({
                "stored": r.stored.iter().map(|t| render_transfer(t, ids)).collect::<Vec<_>>(),
                "loaded": r.loaded.iter().map(|t| render_transfer(t, ids)).collect::<Vec<_>>(),
                "flushed": r.flushed.iter().map(|f| json!({
                    "job": f.id.0,
                    "blocks": f.job.gpu.block_ids.iter().flatten().map(|b| b.0).collect::<Vec<_>>(),
                    "indexes": f.indexes.iter().flatten().map(render_opt_index).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
                "sync_waited": r.sync_waited.iter().map(|j| j.0).collect::<Vec<_>>(),
                "finished_recving": render_opt_ids(o.and_then(|o| o.finished_recving.as_ref()), ids),
                "worker_meta": render_opt_meta(o.and_then(|o| o.worker_meta.as_ref())),
            })
        })
        .collect();
    json!({
        "step": e.step.0,
        "ranks": ranks,
        "aggregated": e.aggregated.as_ref().map_or(Value::Null, |a| render_aggregated(a, ids)),
    })
}

/// `run_step`'s result.
pub fn render_step_run(x: &(OffloadScheduled, Executed, StepResult), ids: &Interner) -> Value {
    json!({
        "scheduled": render_scheduled(&x.0, ids),
        "executed": render_executed(&x.1, ids),
        "applied": render_step_result(&x.2, ids),
    })
}

/// `lookup`'s result.
pub fn render_lookups(l: &[Vec<KeyLookup>]) -> Value {
    json!(
        l.iter()
            .map(|g| g
                .iter()
                .map(|k| match k {
                    KeyLookup::Miss => "miss",
                    KeyLookup::Hit => "hit",
                    KeyLookup::HitPending => "hit_pending",
                })
                .collect::<Vec<_>>())
            .collect::<Vec<_>>()
    )
}

/// `offload_state`'s result.
pub fn render_state(s: &OffloadState, ids: &Interner) -> Value {
    let jobs: Map<String, Value> = s
        .jobs
        .iter()
        .map(|(j, n)| (j.0.to_string(), json!(n)))
        .collect();
    let requests: Map<String, Value> = s
        .requests
        .iter()
        .map(|(id, js)| {
            (
                ids.resolve(*id).unwrap_or("?").to_string(),
                json!(js.iter().map(|j| j.0).collect::<Vec<_>>()),
            )
        })
        .collect();
    let ids_of = |v: &[JobId]| v.iter().map(|j| j.0).collect::<Vec<_>>();
    json!({
        "jobs": jobs,
        "requests": requests,
        "fenced_blocks": s.fenced_blocks.iter().map(|b| b.0).collect::<Vec<_>>(),
        "reset_fence": s.reset_fence,
        "resets_flushed": s.resets_flushed,
        "allocation_failures": s.allocation_failures,
        "next_job": s.next_job,
        "push_work": s.push_work,
        "ranks": s.ranks.iter().map(|r| json!({
            "in_flight": ids_of(&r.in_flight),
            "awaiting_completion": ids_of(&r.awaiting_completion),
            "deferred_stores": ids_of(&r.deferred_stores),
            "held": r.held,
        })).collect::<Vec<_>>(),
    })
}

/// A rank runner's historical bug in the harness's rank driver (model-checking builds only).
#[cfg(feature = "scheduler-faults")]
impl OffloadEngine {
    /// Re-introduce `fault` into rank `rank`'s driver.
    pub fn inject_rank_fault(&mut self, rank: usize, fault: kvrelay_core::RankFault) {
        self.ranks[rank].inject_fault(fault);
    }
}

#[cfg(all(test, feature = "scheduler-faults"))]
mod tests {
    use super::*;

    /// The harness drives its workers through the core's rank driver, whose guard checks the
    /// order of every hook: a runner that binds before `handle_preemptions` (vLLM PR #42676),
    /// re-introduced in rank 1, stops that rank's step with a typed protocol violation instead
    /// of running the worker out of order unnoticed (before the engine step, the harness called
    /// the worker connector directly and checked no order at all).
    #[test]
    fn a_worker_called_out_of_order_is_caught() {
        let sc = SchedulerConfig {
            block_size: 4,
            ..SchedulerConfig::default()
        };
        let v = json!({"blocks_per_chunk": 1, "capacity_chunks": 8, "ranks": 2});
        let mut e = OffloadEngine::new(sc, &v).unwrap();
        let spec = RequestSpec {
            id: RequestId(0),
            prompt: (1..=8).collect(),
            max_tokens: 2,
            stop_token: None,
            kv_transfer_params: None,
        };
        assert!(e.add(spec).is_ok());
        assert!(e.run_step().is_ok(), "a correct runner");
        e.inject_rank_fault(1, kvrelay_core::RankFault::BindFirst);
        assert!(e.schedule().is_ok());
        assert_eq!(e.execute(None).err(), Some("protocol_violation"));
        let why = e.check_invariants().unwrap_err();
        assert!(why.contains("rank 1") && why.contains("bind"), "{why}");
    }
}
