//! The offloading connector end to end through the core's engine step: an [`EngineCore`] (the
//! real scheduler with an [`OffloadingConnector`], and the aggregator) and W [`RankDriver`]s,
//! each over an [`OffloadingWorker`] (SEMANTICS.md §5.5–§5.7, §6.4, §9.5, I-38…I-47).
//!
//! The simulated runtime is the core's [`SimDma`] under each rank: it performs every `Start` a
//! driver asks for, completes exactly the transfer a driver waits for ([`OnWait::CompleteJob`],
//! in the order asked: the transfers ahead of it in its queue stay in flight), and otherwise
//! completes transfers when the driver collects the step's results, in submission order —
//! unless the rank is *held*, then only waited-for transfers complete until it is released.
//! `check_invariants()` of the engine, the connector and every rank runs after every call, and
//! of the rank after every completion.
//!
//! Why this file is long: one end-to-end suite of the offloading connector on the engine step, one
//! test per rule of SEMANTICS.md §5.5–§5.7 and §6.4, sharing one simulated runtime (`Sim`).

use kvrelay_core::testing::{OnWait, SimDma};
use kvrelay_core::{
    AggregatedOutput, BlockId, CacheEvent, ChunkId, EngineCore, GroupKind, JobId, KeyLookup,
    KvEvent, ManagerConfig, Medium, Meta, ModelOutput, OffloadKey, OffloadingConfig,
    OffloadingConnector, OffloadingConnectorMeta, OffloadingWorker, OffloadingWorkerConfig,
    PolicyKind, Rank, RankAction, RankDriver, RequestId, RequestSpec, RequestStatus, Scheduler,
    SchedulerConfig, SchedulerConnector, SchedulerOutput, SortedSet, StepId, Transfer,
    TransferDirection, TransferDone, WorkerConnector,
};
use kvrelay_tests::build::{empty_aggregated, params, rank_config, rid, spec_with};
use kvrelay_tests::drive::computed;

const BS: u32 = 4;
const BPC: u32 = 3;

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 10_000 + i + 1).collect()
}

fn sched_config(num_gpu_blocks: u32, prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        block_size: BS,
        num_gpu_blocks,
        max_num_batched_tokens: 512,
        max_num_seqs: 16,
        max_model_len: 512,
        enable_prefix_caching: prefix_caching,
        ..SchedulerConfig::default()
    }
}

fn manager(capacity_chunks: u32) -> ManagerConfig {
    ManagerConfig {
        capacity_chunks,
        policy: PolicyKind::Lru,
        store_threshold: 0,
    }
}

/// What one step did.
#[derive(Debug)]
struct StepLog {
    output: SchedulerOutput,
    meta: OffloadingConnectorMeta,
    /// Per rank, the transfers started.
    started: Vec<Vec<Transfer>>,
    /// Per rank, the jobs waited for.
    waited: Vec<Vec<JobId>>,
    /// The aggregated finished_recving.
    recving: Vec<RequestId>,
}

impl StepLog {
    fn stored(&self, rank: usize) -> Vec<&Transfer> {
        self.started[rank]
            .iter()
            .filter(|t| t.direction == TransferDirection::Store)
            .collect()
    }
    fn loaded(&self, rank: usize) -> Vec<&Transfer> {
        self.started[rank]
            .iter()
            .filter(|t| t.direction == TransferDirection::Load)
            .collect()
    }
}

struct Sim {
    engine: EngineCore<OffloadingConnector>,
    ranks: Vec<RankDriver<OffloadingWorker>>,
    /// Per rank, its simulated DMA.
    dma: Vec<SimDma>,
    /// Requests finished since the last `schedule()`: vLLM's `has_requests()` keeps the engine
    /// stepping until `finished_req_ids` reached the connector (the model's `has_requests()`
    /// does not count them, so the harness does).
    finished_undelivered: bool,
    /// The opaque KV events of the last step applied.
    events: Vec<KvEvent>,
}

impl Sim {
    fn new(config: SchedulerConfig, off: OffloadingConfig, writers: &[bool]) -> Self {
        let w = off.num_workers as usize;
        assert_eq!(writers.len(), w);
        let per_rank = rank_config(&config, 1);
        let mode = config.mode;
        let conn = OffloadingConnector::new(off.clone(), &config).unwrap();
        let engine = EngineCore::new(config, conn, off.num_workers).unwrap();
        let ranks = writers
            .iter()
            .map(|&is_store_writer| {
                let worker = OffloadingWorker::new(OffloadingWorkerConfig {
                    blocks_per_chunk: off.blocks_per_chunk,
                    is_store_writer,
                    bytes_per_block: 64,
                    mode,
                });
                RankDriver::new(per_rank.clone(), worker)
            })
            .collect();
        let sim = Sim {
            engine,
            ranks,
            dma: vec![SimDma::new(OnWait::CompleteJob); w],
            finished_undelivered: false,
            events: Vec::new(),
        };
        sim.check();
        sim
    }

    fn simple(num_gpu_blocks: u32, prefix_caching: bool, w: u32) -> Self {
        let off = OffloadingConfig::new(BPC, w, manager(64));
        Sim::new(
            sched_config(num_gpu_blocks, prefix_caching),
            off,
            &vec![true; w as usize],
        )
    }

    /// The scheduler.
    fn s(&self) -> &Scheduler<OffloadingConnector> {
        self.engine.scheduler()
    }

    fn conn(&self) -> &OffloadingConnector {
        self.s().connector()
    }

    fn check(&self) {
        self.engine.check_invariants().unwrap();
        self.conn().check_invariants().unwrap();
        for d in &self.ranks {
            d.check_invariants().unwrap();
            d.worker().inner().check_invariants().unwrap();
            assert_eq!(d.error(), None);
        }
    }

    fn add(&mut self, r: RequestSpec) {
        self.engine.add_request(r).unwrap();
        self.check();
    }

    /// Holds `rank` (`true`: its transfers stay in flight at the end of its steps) or releases
    /// it from its next step's end on.
    fn hold(&mut self, rank: usize, held: bool) {
        self.dma[rank].set_held(held);
    }

    /// One engine step: schedule, every rank's step, aggregation, update_from_output.
    fn step(&mut self) -> StepLog {
        let (log, kv) = self.execute();
        self.apply(log.output.step, kv);
        log
    }

    /// Schedules a step and runs every rank's step for it; the output is applied later
    /// ([`Sim::apply`]), so that several steps may be in flight (async scheduling).
    fn execute(&mut self) -> (StepLog, Option<AggregatedOutput>) {
        let st = self.engine.schedule().unwrap().step;
        self.finished_undelivered = false;
        self.check();
        let w = self.ranks.len();
        let mut log = StepLog {
            output: st.output.clone(),
            meta: st.meta.clone(),
            started: vec![Vec::new(); w],
            waited: vec![Vec::new(); w],
            recving: Vec::new(),
        };
        let step = st.output.step;
        for r in 0..w {
            let (started, waited) = (&mut log.started[r], &mut log.waited[r]);
            let mut record = |action: &RankAction<Meta>| match action {
                RankAction::Start(t) => started.push(t.clone()),
                RankAction::Wait { jobs, .. } => waited.extend(jobs.iter()),
                _ => {}
            };
            let out = self.dma[r]
                .run_step(&mut self.ranks[r], &st, &mut record)
                .unwrap();
            assert_eq!(out.finished_sending, None, "offloading never reports sends");
            self.engine
                .rank_output(step, Rank(r as u32), Some(out))
                .unwrap();
            self.check();
        }
        let kv = self
            .engine
            .aggregated(step)
            .cloned()
            .expect("every rank reported");
        if let Some(kv) = &kv {
            log.recving = kv
                .finished_recving
                .iter()
                .flat_map(|s| s.iter().copied())
                .collect();
        }
        (log, kv)
    }

    /// Applies the oldest step with its fake-sampled tokens; `kv` is the aggregated connector
    /// output [`Sim::execute`] returned for it (the engine already holds it).
    fn apply(&mut self, step: StepId, kv: Option<AggregatedOutput>) {
        assert_eq!(self.engine.aggregated(step), Some(&kv));
        let res = self.engine.apply_fake().unwrap();
        assert_eq!(res.step, step);
        self.finished_undelivered |= res.result.outputs.iter().any(|o| o.finish.is_some());
        self.events = res.result.events;
        self.check();
    }

    /// Holds `rank`, runs one step and returns it with the first store job it created.
    fn held_step(&mut self, rank: usize) -> (StepLog, JobId) {
        self.hold(rank, true);
        let log = self.step();
        let job = *log.meta.store_jobs.keys().next().expect("a store job");
        (log, job)
    }

    /// Runs request `id` (prompt `p`, one output token) to the end: its prompt is offloaded.
    fn offload(&mut self, id: u32, p: &[u32]) {
        self.add(spec_with(id, p.to_vec(), 1));
        self.drain(10);
    }

    /// vLLM's `has_requests()`: live or held requests, finished ids not yet delivered, or
    /// connector push work.
    fn busy(&self) -> bool {
        self.s().has_requests() || self.finished_undelivered
    }

    fn abort(&mut self, id: u32) {
        assert!(self.engine.abort(rid(id)).unwrap());
        self.finished_undelivered = true;
        self.check();
    }

    /// Steps until no request is left and no push work is pending (at most `max` steps).
    fn drain(&mut self, max: usize) -> Vec<StepLog> {
        let mut logs = Vec::new();
        for _ in 0..max {
            if !self.busy() {
                return logs;
            }
            logs.push(self.step());
        }
        panic!("not drained after {max} steps");
    }

    fn lookup(&self, hash_of: &[u32], chunk: usize, group: u32) -> KeyLookup {
        self.conn().manager().lookup(key(hash_of, chunk, group))
    }

    /// The manager's answer for the keys of `p`'s first four chunks in `group`.
    fn four_keys(&self, p: &[u32], group: u32) -> Vec<KeyLookup> {
        (0..4).map(|c| self.lookup(p, c, group)).collect()
    }

    fn blocks(&self, id: u32, group: usize) -> Vec<BlockId> {
        self.s()
            .view()
            .request(rid(id))
            .map(|r| r.block_ids(group).to_vec())
            .unwrap_or_default()
    }
}

/// `p` followed by `extra`.
fn extended(p: &[u32], extra: &[u32]) -> Vec<u32> {
    let mut v = p.to_vec();
    v.extend_from_slice(extra);
    v
}

/// The offload key of chunk `chunk` of a token sequence, as the connector derives it.
fn key(tokens: &[u32], chunk: usize, group: u32) -> OffloadKey {
    let mut parent = None;
    let mut h = None;
    for b in 0..(chunk + 1) * BPC as usize {
        let t = &tokens[b * BS as usize..(b + 1) * BS as usize];
        let x = kvrelay_core::hash_block(parent, t);
        parent = Some(x);
        h = Some(x);
    }
    OffloadKey {
        hash: h.unwrap(),
        group,
    }
}

fn gpu_blocks(t: &Transfer) -> Vec<BlockId> {
    t.gpu_blocks.clone()
}

// ---------------------------------------------------------------------------------------------
// S33.

#[test]
fn s33_store_lookup_cycle() {
    let mut sim = Sim::simple(100, false, 1);
    let p = prompt(1, 36);
    sim.add(spec_with(1, p.clone(), 2));
    // Step 0: the 36-token prefill creates one store job for its 3 chunks (9 blocks), deferred
    // to the next step's start.
    let s0 = sim.step();
    assert_eq!(s0.meta.store_jobs.len(), 1);
    let (&job, j) = s0.meta.store_jobs.iter().next().unwrap();
    assert_eq!(j.gpu.block_ids[0].len(), 9);
    assert_eq!(j.chunks[0].len(), 3);
    assert!(s0.started[0].is_empty(), "stores start at the next step");
    assert_eq!(sim.lookup(&p, 0, 0), KeyLookup::HitPending);
    let table = sim.blocks(1, 0);
    // Step 1: submitted in handle_preemptions, completed, acknowledged; the keys are readable.
    let s1 = sim.step();
    let stored = s1.stored(0);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].job, job);
    assert_eq!(gpu_blocks(stored[0]), table[..9].to_vec());
    // Host slots: chunk × 3 + offset, one per block.
    let slots: Vec<u64> = j.chunks[0]
        .iter()
        .flat_map(|c| (0..3).map(move |o| u64::from(c.0) * 3 + o))
        .collect();
    assert_eq!(stored[0].external, slots);
    assert!(
        s1.meta.store_jobs.is_empty(),
        "decode tokens are not offloaded"
    );
    for c in 0..3 {
        assert_eq!(sim.lookup(&p, c, 0), KeyLookup::Hit);
    }
    assert_eq!(sim.conn().pending_count(job), None);
    sim.drain(10);

    // A request with the same 36-token prefix and 1 token more: 3 chunks hit, an async load.
    let p2 = extended(&p, &[7]);
    sim.add(spec_with(2, p2, 1));
    let s = sim.step();
    assert_eq!(
        sim.s().status(rid(2)),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    assert_eq!(s.meta.load_jobs.len(), 1);
    let (&load, lj) = s.meta.load_jobs.iter().next().unwrap();
    assert!(!lj.sync);
    let table = sim.blocks(2, 0);
    assert_eq!(lj.gpu.block_ids[0], table[..9].to_vec(), "loaded {{0..8}}");
    assert_eq!(s.loaded(0).len(), 1);
    assert_eq!(s.recving, vec![rid(2)]);
    assert_eq!(
        sim.conn().pending_count(load),
        None,
        "acknowledged in the same step"
    );
    let s = sim.step();
    assert_eq!(s.output.num_scheduled_tokens, vec![(rid(2), 1)]);
    sim.drain(10);

    // A request whose uncached part is shorter than a chunk: no load.
    let p3 = prompt(3, 11);
    sim.add(spec_with(3, p3, 1));
    let s = sim.step();
    assert!(s.meta.load_jobs.is_empty());
    assert_eq!(s.output.num_scheduled_tokens, vec![(rid(3), 11)]);
    sim.drain(10);
    assert!(!sim.conn().tracks(rid(1)) && !sim.conn().tracks(rid(2)));
}

#[test]
fn s33_a_hit_after_a_two_chunk_gpu_hit_loads_the_third_chunk() {
    // Pool of 11 blocks (10 usable): request 1 holds 10 blocks; after it finishes, a filler of 5
    // blocks evicts the free unused block and the last 4 of request 1 (freed tail first).
    let mut sim = Sim::simple(12, true, 1);
    let p = prompt(1, 36);
    sim.add(spec_with(1, p.clone(), 3));
    sim.drain(10);
    for c in 0..3 {
        assert_eq!(sim.lookup(&p, c, 0), KeyLookup::Hit);
    }
    sim.add(spec_with(9, prompt(9, 18), 1));
    sim.drain(10);
    let p2 = extended(&p, &[5]);
    sim.add(spec_with(2, p2, 1));
    let s = sim.step();
    assert_eq!(s.meta.load_jobs.len(), 1);
    let lj = s.meta.load_jobs.values().next().unwrap();
    let table = sim.blocks(2, 0);
    assert_eq!(
        lj.gpu.block_ids[0],
        table[6..9].to_vec(),
        "loaded {{6,7,8}}"
    );
    assert_eq!(lj.gpu.block_indices[0], 6);
    assert_eq!(lj.chunks[0].len(), 1);
    sim.drain(10);
}

#[test]
fn s33_a_full_manager_stores_nothing_and_counts_the_failure() {
    let off = OffloadingConfig::new(BPC, 1, manager(2));
    let mut sim = Sim::new(sched_config(100, false), off, &[true]);
    let p = prompt(1, 36);
    sim.add(spec_with(1, p.clone(), 1));
    let s = sim.step();
    assert!(s.meta.store_jobs.is_empty(), "3 chunks do not fit 2");
    assert_eq!(sim.conn().allocation_failures(), 1);
    sim.drain(10);
    assert_eq!(sim.lookup(&p, 0, 0), KeyLookup::Miss);
}

// ---------------------------------------------------------------------------------------------
// S34 and re-admission.

#[test]
fn s34_preemption_flushes_and_readmission_waits_for_the_acknowledgement() {
    // Request 1 then request 2, both prefilled in step 0 (store jobs 0 and 1). The rank is held,
    // so the stores stay in flight; the pool runs out during decode and request 2 (the last
    // running) is preempted: its store is flushed (submitted and waited for before the step's
    // writes) but cannot be reported while job 0 is ahead of it in the store queue, so
    // re-admission answers Pending (issue #46014) until the rank is released.
    let mut sim = Sim::simple(18, false, 1);
    let p1 = prompt(1, 24);
    let p2 = prompt(2, 36);
    sim.add(spec_with(1, p1.clone(), 40));
    sim.add(spec_with(2, p2.clone(), 40));
    sim.hold(0, true);
    let s0 = sim.step();
    let jobs: Vec<JobId> = s0.meta.store_jobs.keys().copied().collect();
    assert_eq!(jobs, vec![JobId(0), JobId(1)]);
    assert_eq!(s0.meta.store_jobs[&JobId(1)].request, rid(2));
    let table2 = sim.blocks(2, 0);
    let mut preempted_at = None;
    for _ in 0..40 {
        let s = sim.step();
        if s.output.preempted_req_ids.contains(&rid(2)) {
            assert!(s.meta.jobs_to_flush.contains(&JobId(1)), "I-42");
            assert_eq!(s.waited[0], vec![JobId(1)]);
            preempted_at = Some(s);
            break;
        }
    }
    let s = preempted_at.expect("request 2 is preempted");
    let flushed: Vec<&Transfer> = s.stored(0);
    // Both stores were submitted at step 1's start already; none is started again.
    assert!(flushed.is_empty());
    assert_eq!(sim.conn().request_jobs(rid(2)), vec![JobId(1)]);
    assert_eq!(sim.s().status(rid(2)), Some(RequestStatus::Preempted));
    // Next step: request 2 asks again and is told to wait.
    let s = sim.step();
    assert!(
        s.output
            .num_scheduled_tokens
            .iter()
            .all(|(id, _)| *id != rid(2))
    );
    assert_eq!(sim.s().status(rid(2)), Some(RequestStatus::Preempted));
    // Release: both stores are reported, in order; request 2's keys become readable.
    sim.hold(0, false);
    let _ = sim.step();
    assert!(sim.conn().request_jobs(rid(2)).is_empty());
    for c in 0..3 {
        assert_eq!(sim.lookup(&p2, c, 0), KeyLookup::Hit);
    }
    // Request 1 finishes; request 2 re-admits from the offload tier (3 chunks, 36 tokens).
    let mut loaded = None;
    for _ in 0..60 {
        let s = sim.step();
        if let Some(lj) = s.meta.load_jobs.values().find(|j| j.request == rid(2)) {
            loaded = Some((lj.clone(), sim.blocks(2, 0)));
        }
        if !sim.busy() {
            break;
        }
    }
    let (lj, table) = loaded.expect("request 2 loads its prefix");
    assert_eq!(lj.gpu.block_ids[0], table[..9].to_vec(), "loaded {{0..8}}");
    assert_ne!(table2.len(), 0);
    assert_eq!(
        sim.conn().fenced_blocks().count(),
        0,
        "fence index empty at the end"
    );
    assert!(!sim.conn().has_pending_push_work());
}

#[test]
fn a_preempted_request_without_queue_ahead_is_flushed_and_acknowledged_in_the_same_step() {
    let mut sim = Sim::simple(20, false, 1);
    sim.add(spec_with(1, prompt(1, 36), 10));
    sim.add(spec_with(2, prompt(2, 12), 20));
    sim.hold(0, true);
    let s0 = sim.step();
    assert_eq!(s0.meta.store_jobs.len(), 2);
    sim.hold(0, false);
    let _ = sim.step();
    // Now only new jobs could be in flight; keep holding and run until a preemption.
    sim.hold(0, true);
    for _ in 0..40 {
        let s = sim.step();
        if !s.output.preempted_req_ids.is_empty() {
            // No job of the preempted request is in flight any more: nothing to flush.
            assert!(s.meta.jobs_to_flush.is_empty());
            break;
        }
    }
    sim.hold(0, false);
    sim.drain(100);
}

// ---------------------------------------------------------------------------------------------
// Concurrent lookups, abort while loading.

/// Stores `p` as request `id`, then evicts its GPU blocks with a filler.
fn stored_and_evicted(sim: &mut Sim, id: u32, p: &[u32], pool_usable: u32) {
    sim.add(spec_with(id, p.to_vec(), 1));
    sim.drain(10);
    let filler_len = (pool_usable - 1) * BS;
    sim.add(spec_with(id + 100, prompt(id + 100, filler_len), 1));
    sim.drain(10);
}

#[test]
fn concurrent_lookups_wait_also_without_a_local_hit() {
    // As above, with the prefix gone from the GPU entirely (no local hit): the chunks being
    // loaded are those from token 0 to the end of the hit.
    let mut sim = Sim::simple(40, true, 1);
    let p = prompt(1, 36);
    stored_and_evicted(&mut sim, 1, &p, 40);
    sim.add(spec_with(2, extended(&p, &[1]), 1));
    sim.add(spec_with(3, extended(&p, &[2]), 1));
    sim.hold(0, true);
    let s = sim.step();
    let (_, lj) = s.meta.load_jobs.iter().next().expect("a load");
    assert_eq!(
        (lj.request, lj.chunks[0].len()),
        (rid(2), 3),
        "the whole prefix, no local hit"
    );
    assert_eq!(
        s.meta.load_jobs.len(),
        1,
        "request 3 waits for request 2's load"
    );
    assert_eq!(sim.s().status(rid(3)), Some(RequestStatus::Waiting));
    sim.hold(0, false);
    sim.drain(20);
}

#[test]
fn concurrent_lookups_of_one_prefix_the_second_waits() {
    let mut sim = Sim::simple(40, true, 1);
    let p = prompt(1, 36);
    stored_and_evicted(&mut sim, 1, &p, 39);
    for c in 0..3 {
        assert_eq!(sim.lookup(&p, c, 0), KeyLookup::Hit);
    }
    let mut a = p.clone();
    a.push(1);
    let mut b = p.clone();
    b.push(2);
    sim.add(spec_with(2, a, 1));
    sim.add(spec_with(3, b, 1));
    sim.hold(0, true);
    let s = sim.step();
    assert_eq!(s.meta.load_jobs.len(), 1, "one load job per admission");
    assert_eq!(
        sim.s().status(rid(2)),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    assert_eq!(
        sim.s().status(rid(3)),
        Some(RequestStatus::Waiting),
        "Pending (I-43)"
    );
    assert!(sim.conn().request_jobs(rid(3)).is_empty());
    // Still loading: request 3 keeps waiting.
    let _ = sim.step();
    assert_eq!(sim.s().status(rid(3)), Some(RequestStatus::Waiting));
    sim.hold(0, false);
    sim.drain(20);
}

#[test]
fn abort_while_loading_frees_on_finished_recving() {
    let mut sim = Sim::simple(40, false, 1);
    let p = prompt(1, 36);
    sim.offload(1, &p);
    let p2 = extended(&p, &[3]);
    sim.add(spec_with(2, p2, 5));
    sim.hold(0, true);
    let s = sim.step();
    let (&load, _) = s.meta.load_jobs.iter().next().unwrap();
    assert_eq!(
        sim.s().status(rid(2)),
        Some(RequestStatus::WaitingForRemoteKvs)
    );
    sim.abort(2);
    // The scheduler holds the blocks until finished_recving; the connector keeps the load.
    assert_eq!(sim.s().status(rid(2)), Some(RequestStatus::FinishedAborted));
    assert_eq!(sim.conn().request_jobs(rid(2)), vec![load]);
    let _ = sim.step();
    assert!(sim.s().status(rid(2)).is_some());
    sim.hold(0, false);
    let s = sim.step();
    assert_eq!(s.recving, vec![rid(2)]);
    assert_eq!(sim.s().status(rid(2)), None, "freed on finished_recving");
    assert!(!sim.conn().tracks(rid(2)));
    // The keys were unpinned: still readable.
    assert_eq!(sim.lookup(&p, 2, 0), KeyLookup::Hit);
    assert!(!sim.s().has_requests());
}

// ---------------------------------------------------------------------------------------------
// Finish.

#[test]
fn the_last_chunk_is_stored_after_finish_under_async_scheduling() {
    // Async scheduling: a decode step is scheduled before its input token is sampled, so the
    // chunk it completes has no key yet; request_finished refreshes the keys and the step after
    // the finish stores it.
    let mut config = sched_config(100, false);
    config.async_depth = 2;
    let mut off = OffloadingConfig::new(BPC, 1, manager(64));
    off.offload_prompt_only = false;
    let mut sim = Sim::new(config, off, &[true]);
    let p = prompt(1, 20);
    // 20 prompt + 17 sampled = 37 tokens: tokens 0..36 are committed (36 = 3 chunks).
    sim.add(spec_with(1, p, 17));
    let mut st = Vec::new();
    // Two steps in flight: schedule k+1 before applying k.
    let mut in_flight = std::collections::VecDeque::new();
    for _ in 0..60 {
        if sim.busy() {
            let (log, kv) = sim.execute();
            for (&j, job) in &log.meta.store_jobs {
                let after_finish = log.output.finished_req_ids.contains(&rid(1));
                st.push((j, job.chunks[0].len(), after_finish));
            }
            in_flight.push_back((log.output.step, kv));
        }
        if in_flight.len() == 2 || !sim.busy() {
            let Some((step, kv)) = in_flight.pop_front() else {
                break;
            };
            sim.apply(step, kv);
        }
    }
    assert!(in_flight.is_empty() && !sim.busy());
    let total: usize = st.iter().map(|x| x.1).sum();
    assert_eq!(total, 3, "every committed chunk stored once: {st:?}");
    assert!(
        st.iter().any(|x| x.2),
        "the last chunk is stored in the step after the finish: {st:?}"
    );
}

#[test]
fn block_reuse_after_finish_forces_a_flush() {
    // 11 usable blocks; request 1 (9 blocks) finishes after its prefill while its store is still
    // deferred/in flight; request 2 then gets request 1's blocks: the store must be flushed
    // before step 1 writes them (I-41).
    let mut sim = Sim::simple(12, false, 1);
    sim.add(spec_with(1, prompt(1, 36), 1));
    sim.hold(0, true);
    let s0 = sim.step();
    let (&job, j) = s0.meta.store_jobs.iter().next().unwrap();
    let read: Vec<BlockId> = j.gpu.block_ids[0].clone();
    assert_eq!(
        sim.s().status(rid(1)),
        None,
        "freed at once (request_finished never delays)"
    );
    // Full-attention sources are fenced once the request finished.
    let fenced: Vec<BlockId> = sim.conn().fenced_blocks().collect();
    assert_eq!(fenced, {
        let mut r = read.clone();
        r.sort();
        r
    });
    sim.add(spec_with(2, prompt(2, 36), 1));
    let s1 = sim.step();
    let reused: Vec<BlockId> = sim
        .blocks(2, 0)
        .into_iter()
        .filter(|b| read.contains(b))
        .collect();
    let _ = reused;
    assert!(s1.meta.jobs_to_flush.contains(&job), "{:?}", s1.meta);
    assert_eq!(s1.waited[0], vec![job]);
    sim.hold(0, false);
    sim.drain(10);
    assert_eq!(sim.conn().fenced_blocks().count(), 0);
}

#[test]
fn a_zero_token_admission_still_counts_as_an_allocation_for_fences() {
    // Request 2 is admitted without external tokens; its blocks (request 1's, reused) reach the
    // connector only through update_state_after_alloc(…, 0) and build_connector_meta: the flush
    // happens either way (issue #46951).
    let mut sim = Sim::simple(12, false, 1);
    sim.add(spec_with(1, prompt(1, 24), 1));
    let (_, job) = sim.held_step(0);
    sim.add(spec_with(2, prompt(2, 40), 1));
    let s1 = sim.step();
    assert!(s1.meta.jobs_to_flush.contains(&job));
    sim.hold(0, false);
    sim.drain(10);
}

#[test]
fn an_async_load_into_reused_blocks_flushes_the_store_reading_them() {
    // Request 3 is admitted with an async load and is not scheduled this step, so its blocks
    // (request 2's, reused while request 2's store is in flight) reach the connector only
    // through update_state_after_alloc: the load must not write them before that store is
    // flushed (I-41).
    let mut sim = Sim::simple(11, false, 1);
    let p = prompt(1, 24);
    sim.offload(1, &p);
    sim.add(spec_with(2, prompt(2, 24), 1));
    let (s0, job) = sim.held_step(0);
    let read = s0.meta.store_jobs[&job].gpu.block_ids[0].clone();
    sim.add(spec_with(3, extended(&p, &prompt(3, 5)), 1));
    let s1 = sim.step();
    let (_, lj) = s1.meta.load_jobs.iter().next().expect("an async load");
    assert!(
        lj.gpu.block_ids[0].iter().any(|b| read.contains(b)),
        "{lj:?} {read:?}"
    );
    assert!(s1.output.num_scheduled_tokens.is_empty());
    assert!(s1.meta.jobs_to_flush.contains(&job), "{:?}", s1.meta);
    sim.hold(0, false);
    sim.drain(10);
}

// ---------------------------------------------------------------------------------------------
// Quorum, non-writers.

#[test]
fn a_job_completes_only_when_every_rank_acknowledged() {
    let mut sim = Sim::simple(100, false, 2);
    let p = prompt(1, 24);
    sim.add(spec_with(1, p.clone(), 5));
    let (_, job) = sim.held_step(1);
    assert_eq!(sim.conn().pending_count(job), Some(2));
    let _ = sim.step();
    assert_eq!(
        sim.conn().pending_count(job),
        Some(1),
        "rank 0 acknowledged"
    );
    assert_eq!(sim.lookup(&p, 0, 0), KeyLookup::HitPending);
    let _ = sim.step();
    assert_eq!(sim.conn().pending_count(job), Some(1));
    sim.hold(1, false);
    let _ = sim.step();
    assert_eq!(sim.conn().pending_count(job), None);
    assert_eq!(sim.lookup(&p, 1, 0), KeyLookup::Hit);
    sim.drain(20);
}

#[test]
fn non_writer_ranks_acknowledge_stores_without_transferring_and_still_load() {
    let off = OffloadingConfig::new(BPC, 2, manager(64));
    let mut sim = Sim::new(sched_config(100, false), off, &[true, false]);
    let p = prompt(1, 36);
    sim.add(spec_with(1, p.clone(), 1));
    let logs = sim.drain(10);
    assert!(logs.iter().any(|l| !l.stored(0).is_empty()));
    assert!(logs.iter().all(|l| l.stored(1).is_empty()));
    for c in 0..3 {
        assert_eq!(sim.lookup(&p, c, 0), KeyLookup::Hit, "quorum of 2 met");
    }
    let p2 = extended(&p, &[1]);
    sim.add(spec_with(2, p2, 1));
    let s = sim.step();
    assert_eq!(s.loaded(0).len(), 1);
    assert_eq!(s.loaded(1).len(), 1, "non-writers load");
    assert_eq!(s.recving, vec![rid(2)], "reported once both ranks loaded");
    sim.drain(10);
}

// ---------------------------------------------------------------------------------------------
// Reset.

#[test]
fn reset_with_jobs_in_flight_fences_their_late_acknowledgements() {
    let mut sim = Sim::simple(100, false, 1);
    let p = prompt(1, 36);
    sim.add(spec_with(1, p.clone(), 20));
    let (_, job) = sim.held_step(0);
    let _ = sim.step();
    assert_eq!(sim.engine.reset_connector_cache().unwrap(), Some(true));
    sim.check();
    assert_eq!(sim.conn().reset_fence_len(), 1);
    assert_eq!(sim.conn().resets_flushed(), 0);
    assert!(sim.conn().has_pending_push_work());
    assert!(sim.conn().request_jobs(rid(1)).is_empty());
    assert_eq!(sim.lookup(&p, 0, 0), KeyLookup::Miss);
    // A second reset before the flush was delivered is refused.
    assert_eq!(sim.engine.reset_connector_cache().unwrap(), Some(false));
    // The next step delivers the flush; the stale acknowledgement only drains the fence.
    sim.hold(0, false);
    let s = sim.step();
    assert!(s.meta.jobs_to_flush.contains(&job));
    assert_eq!(sim.conn().reset_fence_len(), 0);
    assert_eq!(sim.conn().resets_flushed(), 1);
    // Store progress restarted from chunk 0: the prompt is offered again (new job ids).
    assert!(s.meta.store_jobs.keys().all(|j| j.0 > job.0));
    sim.drain(40);
    for c in 0..3 {
        assert_eq!(sim.lookup(&p, c, 0), KeyLookup::Hit);
    }
}

#[test]
fn structured_events_publish_each_step_s_gpu_events_then_the_connector_s() {
    // Protects vLLM's batch order in `update_from_output` (the KV cache manager's events, then
    // the connector's), the one switch reaching the connector, and the CPU strings as the
    // rendering of the structured CPU events.
    let mut sim = Sim::simple(100, true, 1);
    sim.engine.set_cache_events(true);
    let p1 = prompt(1, 36);
    sim.add(spec_with(1, p1.clone(), 1));
    // Step 0: the prefill caches 9 GPU blocks; its store is only created.
    sim.step();
    let ev = sim.engine.take_cache_events();
    let gpu_stored = |e: &CacheEvent| match e {
        CacheEvent::Stored {
            medium: Medium::Gpu,
            hashes,
            ..
        } => Some(hashes.len()),
        _ => None,
    };
    assert_eq!(ev.iter().map(gpu_stored).collect::<Vec<_>>(), [Some(9)]);
    assert!(sim.events.is_empty());
    // Step 1: request 2's prefill caches 3 GPU blocks (at schedule), then request 1's store
    // completes (at update): one CPU `Stored` per chunk key.
    let p2 = prompt(2, 12);
    sim.add(spec_with(2, p2.clone(), 1));
    sim.step();
    let ev = sim.engine.take_cache_events();
    let CacheEvent::Stored {
        medium: Medium::Gpu,
        parent: None,
        tokens,
        ..
    } = &ev[0]
    else {
        panic!("{ev:?}")
    };
    assert_eq!(tokens, &p2);
    let cpu: Vec<CacheEvent> = (0..3)
        .map(|c| CacheEvent::Stored {
            medium: Medium::Cpu,
            group: 0,
            hashes: vec![key(&p1, c, 0).hash],
            parent: None,
            tokens: Vec::new(),
            block_size: 0,
        })
        .collect();
    assert_eq!(ev[1..], cpu[..]);
    let rendered: Vec<KvEvent> = cpu.iter().map(KvEvent::from).collect();
    assert_eq!(sim.events, rendered);
    sim.drain(10);
}

#[test]
fn the_prefix_cache_reset_also_resets_the_connector_and_answers_both() {
    // Protects vLLM's `reset_prefix_cache(reset_connector=True)`: `reset_connector_cache() and
    // pool_reset` — the connector resets even when the pool refuses, and the answer is true
    // only if both succeeded; `AllBlocksCleared` follows the pool's own success.
    let mut sim = Sim::simple(100, true, 1);
    sim.engine.set_cache_events(true);
    let p1 = prompt(1, 12);
    sim.offload(1, &p1);
    assert_eq!(sim.lookup(&p1, 0, 0), KeyLookup::Hit);
    sim.engine.take_cache_events();
    // A running request holds blocks (and has a store in flight): the pool refuses, the
    // connector resets all the same.
    sim.add(spec_with(2, prompt(2, 12), 20));
    sim.step();
    sim.engine.take_cache_events();
    assert!(!sim.engine.reset_prefix_cache(true).unwrap());
    sim.check();
    assert_eq!(
        sim.lookup(&p1, 0, 0),
        KeyLookup::Miss,
        "the CPU cache was reset"
    );
    assert_eq!(sim.engine.take_cache_events(), Vec::new());
    sim.abort(2);
    // The pool resets; the connector refuses a second reset before its flush was delivered.
    assert!(!sim.engine.reset_prefix_cache(true).unwrap());
    sim.check();
    assert_eq!(sim.engine.take_cache_events(), vec![CacheEvent::AllCleared]);
    assert_eq!(sim.s().block_pool().num_cached(), 0);
    // The pool alone: true.
    assert!(sim.engine.reset_prefix_cache(false).unwrap());
    sim.drain(10);
}

#[test]
fn reset_without_jobs_flushes_at_once() {
    let mut sim = Sim::simple(100, false, 1);
    assert_eq!(sim.engine.reset_connector_cache().unwrap(), Some(true));
    assert_eq!(sim.conn().resets_flushed(), 1);
    assert!(!sim.s().has_requests());
}

#[test]
fn a_finished_request_leaves_its_tail_chunks_least_recent() {
    // The manager commits a request's accesses in prefix order when it finishes: the head is
    // most recent, so the tail is evicted first. Checked after a request that stored its chunks
    // and after one that loaded them (the positions come from each path).
    let mut sim = Sim::new(
        sched_config(100, false),
        OffloadingConfig::new(BPC, 1, manager(4)),
        &[true],
    );
    let p = prompt(1, 48);
    use KeyLookup::{Hit, Miss};
    sim.offload(1, &p);
    assert_eq!(sim.four_keys(&p, 0), [Hit; 4]);
    sim.offload(2, &prompt(2, 13)); // one new chunk in a full pool
    assert_eq!(
        sim.four_keys(&p, 0),
        [Hit, Hit, Hit, Miss],
        "stored, then evicted from the tail"
    );
    // Load chunks 0–2, then store two new chunks: request 2's chunk (least recent) and chunk 2,
    // the loaded tail, go.
    let mut q = p[..36].to_vec();
    q.push(7);
    sim.add(spec_with(3, q, 1));
    assert_eq!(sim.step().meta.load_jobs.len(), 1);
    sim.drain(10);
    sim.offload(4, &prompt(4, 25));
    assert_eq!(
        sim.four_keys(&p, 0),
        [Hit, Hit, Miss, Miss],
        "loaded, then evicted from the tail"
    );
}

#[test]
fn a_hybrid_request_is_ordered_head_to_tail_across_groups() {
    // `order_request_keys`: one head-to-tail order across groups (by token position), not
    // group after group, so evicting two keys takes chunk 3 of both groups.
    let mut config = sched_config(200, false);
    config.groups = vec![
        GroupKind::FullAttention,
        GroupKind::SlidingWindow { window: 8 },
    ];
    let mut sim = Sim::new(config, OffloadingConfig::new(BPC, 1, manager(8)), &[true]);
    let p = prompt(1, 48);
    sim.offload(1, &p);
    sim.offload(2, &prompt(2, 13)); // one new chunk per group: two evictions
    use KeyLookup::{Hit, Miss};
    for g in 0..2 {
        assert_eq!(sim.four_keys(&p, g), [Hit, Hit, Hit, Miss], "group {g}");
    }
}

// ---------------------------------------------------------------------------------------------
// Hybrid: full attention + sliding window.

#[test]
fn full_and_sliding_window_groups() {
    let mut config = sched_config(200, false);
    config.groups = vec![
        GroupKind::FullAttention,
        GroupKind::SlidingWindow { window: 8 },
    ];
    let off = OffloadingConfig::new(BPC, 1, manager(64));
    let mut sim = Sim::new(config, off, &[true]);
    let p = prompt(1, 48);
    sim.add(spec_with(1, p.clone(), 1));
    let s0 = sim.step();
    let j = s0.meta.store_jobs.values().next().unwrap();
    assert_eq!(j.gpu.block_ids[0].len(), 12);
    // The prefill allocated every sliding-window block too: all 4 chunks are stored.
    assert_eq!(j.chunks[1].len(), 4);
    // Sliding-window sources are fenced from creation.
    assert!(sim.conn().fenced_blocks().count() >= j.gpu.block_ids[1].len());
    sim.drain(10);
    for c in 0..4 {
        assert_eq!(sim.lookup(&p, c, 0), KeyLookup::Hit);
        assert_eq!(sim.lookup(&p, c, 1), KeyLookup::Hit);
    }
    // A request with the same 48 tokens and one more: the whole prefix loads for full
    // attention, only the last window (one chunk, two non-null blocks) for the sliding window.
    let p2 = extended(&p, &[9]);
    sim.add(spec_with(2, p2, 1));
    let s = sim.step();
    let lj = s.meta.load_jobs.values().next().expect("a load");
    assert_eq!(lj.gpu.block_ids[0].len(), 12);
    assert_eq!(lj.chunks[0].len(), 4);
    assert_eq!(lj.chunks[1].len(), 1);
    assert_eq!(lj.gpu.block_indices[1], 10);
    assert_eq!(lj.gpu.block_ids[1], sim.blocks(2, 1)[10..12].to_vec());
    let t = s.loaded(0)[0];
    // The sliding-window blocks land at offsets 1 and 2 of their chunk.
    let c = u64::from(lj.chunks[1][0].0);
    assert_eq!(t.external[12..], [c * 3 + 1, c * 3 + 2]);
    sim.drain(10);
    assert_eq!(sim.conn().fenced_blocks().count(), 0);
}

#[test]
fn the_sliding_window_lookup_needs_only_the_last_window() {
    // Evict the first chunk's sliding-window key by storing only chunks 1..: a request whose
    // full-attention keys all hit but whose early window keys miss still loads.
    let mut config = sched_config(200, false);
    config.groups = vec![GroupKind::SlidingWindow { window: 8 }];
    let off = OffloadingConfig::new(BPC, 1, manager(64));
    let mut sim = Sim::new(config, off, &[true]);
    let p = prompt(1, 48);
    sim.offload(1, &p);
    let p2 = extended(&p, &[4]);
    sim.add(spec_with(2, p2, 1));
    let s = sim.step();
    let lj = s.meta.load_jobs.values().next().expect("a load");
    assert_eq!(lj.chunks[0].len(), 1, "only the last window");
    sim.drain(10);
}

/// A sliding-window-only connector whose window (`window` tokens) spans two 12-token chunks,
/// with a 4-chunk LRU manager, and its first request's 48-token prompt offloaded (keys 0..4
/// stored).
fn two_chunk_window_sim(window: u32) -> (Sim, Vec<u32>) {
    let mut config = sched_config(200, false);
    config.groups = vec![GroupKind::SlidingWindow { window }];
    let off = OffloadingConfig::new(BPC, 1, manager(4));
    let mut sim = Sim::new(config, off, &[true]);
    let p = prompt(1, 48);
    sim.offload(1, &p);
    (sim, p)
}

#[test]
fn a_sliding_window_hit_only_needs_the_last_window_not_the_prefix() {
    // `_sliding_window_lookup` scans from the end: with chunk 1's key evicted, the window ending
    // at chunk 3 (chunks 2 and 3) still hits, where a prefix lookup would stop at chunk 0.
    let (mut sim, p) = two_chunk_window_sim(16);
    // A request with the same prefix loads the last window (the LRU commits chunks 2 and 3 as
    // most recent); then one new chunk evicts the least recent key, chunk 1.
    sim.offload(2, &extended(&p, &[9]));
    sim.offload(3, &prompt(3, 13));
    use KeyLookup::{Hit, Miss};
    assert_eq!(sim.four_keys(&p, 0), [Hit, Miss, Hit, Hit]);
    sim.add(spec_with(4, extended(&p, &[9]), 1));
    let s = sim.step();
    let lj = s
        .meta
        .load_jobs
        .values()
        .next()
        .expect("a load of the last window");
    // The 16-token window ending at token 48: blocks 8..12, in the keys of chunks 2 and 3.
    assert_eq!(lj.gpu.block_indices, [8]);
    assert_eq!(lj.gpu.block_ids[0], sim.blocks(4, 0)[8..12].to_vec());
    assert_eq!(lj.chunks[0].len(), 2);
    sim.drain(10);
}

#[test]
fn a_hit_one_token_short_of_a_chunk_needs_only_the_window_chunks() {
    // `load_window_size_in_chunks` at a hit end that is not chunk-aligned: a 48-token prompt
    // hits at most 47 tokens under a sliding window, and a 24-token window ending there needs
    // tokens 24..47, chunks 2 and 3 (`max(cdiv(24, 12), cdiv(24 - 1 + 1, 12))`), so chunk 1's
    // missing key does not matter.
    let (mut sim, p) = two_chunk_window_sim(24);
    sim.offload(2, &extended(&p, &[9]));
    sim.offload(3, &prompt(3, 13));
    use KeyLookup::{Hit, Miss};
    assert_eq!(sim.four_keys(&p, 0), [Hit, Miss, Hit, Hit]);
    sim.add(spec_with(4, p.clone(), 1));
    let s = sim.step();
    let lj = s
        .meta
        .load_jobs
        .values()
        .next()
        .expect("a load of the last window");
    assert_eq!(lj.chunks[0].len(), 2);
    assert_eq!(lj.gpu.block_indices, [6]);
    assert_eq!(lj.gpu.block_ids[0], sim.blocks(4, 0)[6..12].to_vec());
    assert_eq!(computed(sim.s(), 4), 47);
    sim.drain(10);
}

#[test]
fn a_sliding_window_hit_needs_a_whole_window_also_at_the_end_of_the_cache() {
    // `_sliding_window_lookup` with a hole before the last stored chunk: keys [hit, hit, miss,
    // hit] and a 16-token window (two 12-token chunks). The last chunk alone is no hit (its
    // window reaches into the missing chunk), so the hit is the window ending at chunk 1.
    let mut config = sched_config(25, true);
    config.groups = vec![GroupKind::SlidingWindow { window: 16 }];
    let off = OffloadingConfig::new(BPC, 1, manager(5));
    let mut sim = Sim::new(config, off, &[true]);
    use KeyLookup::{Hit, Miss};
    let p = prompt(1, 48);
    let p5 = extended(&p, &prompt(2, 12));
    // Fillers too short to store a chunk take all 24 GPU blocks at once: no local hit is left.
    let clear_gpu = |sim: &mut Sim, first: u32| {
        for id in first..first + 8 {
            sim.add(spec_with(id, prompt(id, 11), 1));
        }
        assert_eq!(sim.step().output.scheduled_new_reqs.len(), 8);
        sim.drain(10);
    };
    // The LRU order is built by which keys each request touches; a finished request commits
    // its keys head to tail, so its tail is the least recent (least recent first below).
    // Chunks 0..3 stored: [2, 1, 0].
    sim.offload(1, &extended(&p[..36], &[7]));
    assert_eq!(sim.four_keys(&p, 0), [Hit, Hit, Hit, Miss]);
    // A GPU hit of 36 tokens: chunk 3 stored, chunk 2 offered again: [1, 0, 3, 2].
    sim.add(spec_with(2, extended(&p, &[8]), 1));
    let s = sim.step();
    assert!(s.meta.load_jobs.is_empty());
    assert_eq!(s.output.scheduled_new_reqs[0].num_computed_tokens, 36);
    sim.drain(10);
    // A GPU hit of 48 tokens: chunk 4 stored, chunk 3 offered again: [1, 0, 2, 4, 3].
    sim.add(spec_with(3, extended(&p5, &[8]), 1));
    assert_eq!(
        sim.step().output.scheduled_new_reqs[0].num_computed_tokens,
        48
    );
    sim.drain(10);
    // No GPU hit: chunks 0 and 1 loaded: [2, 4, 3, 1, 0].
    clear_gpu(&mut sim, 10);
    sim.add(spec_with(4, extended(&p[..24], &[9]), 1));
    let s = sim.step();
    let lj = s.meta.load_jobs.values().next().expect("a load");
    assert_eq!(lj.chunks[0].len(), 2);
    sim.drain(10);
    // One new chunk evicts the least recent key: chunk 2.
    sim.offload(5, &prompt(5, 13));
    assert_eq!(sim.four_keys(&p, 0), [Hit, Hit, Miss, Hit]);
    clear_gpu(&mut sim, 20);
    sim.add(spec_with(6, extended(&p, &[9]), 1));
    let s = sim.step();
    let lj = s
        .meta
        .load_jobs
        .values()
        .next()
        .expect("a load of the window ending at chunk 1");
    assert_eq!(lj.request, rid(6));
    assert_eq!(
        lj.chunks[0].len(),
        2,
        "chunks 0 and 1, not the lone chunk 3"
    );
    // The 16-token window ending at token 24: blocks 2..6, in the keys of chunks 0 and 1.
    assert_eq!(lj.gpu.block_indices, [2]);
    assert_eq!(lj.gpu.block_ids[0], sim.blocks(6, 0)[2..6].to_vec());
    assert_eq!(computed(sim.s(), 6), 24);
    sim.drain(10);
}

#[test]
fn a_whole_prompt_hit_keeps_the_last_token_only_under_sliding_windows() {
    // `_lookup_complete_chunks`: with a sliding-window group the last prompt token is always
    // recomputed (for its logprobs), so a hit of a chunk-aligned prompt stops one token short;
    // full attention loads the whole prompt.
    for (group, loaded) in [
        (GroupKind::SlidingWindow { window: 8 }, 47),
        (GroupKind::FullAttention, 48),
    ] {
        let mut config = sched_config(200, false);
        config.groups = vec![group];
        let off = OffloadingConfig::new(BPC, 1, manager(64));
        let mut sim = Sim::new(config, off, &[true]);
        let p = prompt(1, 48);
        sim.offload(1, &p);
        sim.add(spec_with(2, p, 1));
        let s = sim.step();
        assert_eq!(s.meta.load_jobs.len(), 1, "{group:?}");
        assert_eq!(computed(sim.s(), 2), loaded, "{group:?}");
        sim.drain(10);
    }
}

#[test]
fn only_prompt_chunks_are_stored_by_default() {
    // vLLM's `offload_prompt_only = true`: a 24-token prompt decoded to 44 tokens stores its two
    // prompt chunks, never the chunk its generated tokens complete; with the option off, that
    // third chunk is stored too.
    for (prompt_only, chunks) in [(true, 2), (false, 3)] {
        let mut off = OffloadingConfig::new(BPC, 1, manager(64));
        off.offload_prompt_only = prompt_only;
        let mut sim = Sim::new(sched_config(100, false), off, &[true]);
        sim.add(spec_with(1, prompt(1, 24), 20));
        let stored: usize = sim
            .drain(40)
            .iter()
            .flat_map(|l| l.meta.store_jobs.values())
            .map(|j| j.chunks[0].len())
            .sum();
        assert_eq!(stored, chunks, "offload_prompt_only = {prompt_only}");
    }
}

#[test]
fn a_sliding_window_chunk_is_stored_when_only_its_reachable_blocks_survive() {
    // A 4-token window needs only the last block of a chunk to serve a hit at the chunk's end
    // (`reachable_block_mask`). Decoding on a 2-block pool reuses each chunk's first block
    // before the chunk completes: the connector zeroes that stale entry, and still stores the
    // chunk from the blocks that remain.
    let mut config = sched_config(3, false);
    config.groups = vec![GroupKind::SlidingWindow { window: 4 }];
    let mut off = OffloadingConfig::new(BPC, 1, manager(64));
    off.offload_prompt_only = false;
    let mut sim = Sim::new(config, off, &[true]);
    sim.add(spec_with(1, prompt(1, 3), 30));
    let stores: Vec<_> = sim
        .drain(40)
        .into_iter()
        .flat_map(|l| l.meta.store_jobs.into_values())
        .collect();
    // Chunk 0 from table index 1 on, chunk 1 from index 4 on: two blocks each.
    let layout: Vec<_> = stores
        .iter()
        .map(|j| (j.gpu.block_indices[0], j.gpu.block_ids[0].len()))
        .collect();
    assert_eq!(layout, [(1, 2), (4, 2)]);
}

// ---------------------------------------------------------------------------------------------
// Direct checks of the connector and the worker.

#[test]
fn job_ids_strictly_increase_across_loads_and_stores() {
    let mut sim = Sim::simple(100, false, 1);
    let p = prompt(1, 36);
    sim.add(spec_with(1, p.clone(), 1));
    let mut ids = Vec::new();
    for l in sim.drain(10) {
        ids.extend(
            l.meta
                .load_jobs
                .keys()
                .chain(l.meta.store_jobs.keys())
                .copied(),
        );
    }
    let mut p2 = p.clone();
    p2.extend(prompt(2, 24));
    sim.add(spec_with(2, p2, 1));
    for l in sim.drain(10) {
        ids.extend(
            l.meta
                .load_jobs
                .keys()
                .chain(l.meta.store_jobs.keys())
                .copied(),
        );
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert!(ids.len() >= 3);
}

#[test]
fn metadata_round_trips_through_serde() {
    let mut sim = Sim::simple(100, false, 1);
    sim.add(spec_with(1, prompt(1, 36), 1));
    let s = sim.step();
    let json = serde_json::to_string(&s.meta).unwrap();
    let back: OffloadingConnectorMeta = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s.meta);
    sim.drain(10);
}

#[test]
fn worker_reports_head_of_line_and_errors_on_unknown_completions() {
    use kvrelay_core::{GpuSpec, TransferJob};
    let mut w = OffloadingWorker::new(OffloadingWorkerConfig {
        blocks_per_chunk: 1,
        is_store_writer: true,
        bytes_per_block: 8,
        mode: kvrelay_core::Mode::Compat,
    });
    let job = |r: u32, b: u64| TransferJob {
        request: rid(r),
        gpu: GpuSpec {
            block_ids: vec![vec![BlockId(b)]],
            block_indices: vec![0],
        },
        chunks: vec![vec![ChunkId(b as u32)]],
        sync: false,
    };
    let mut meta = OffloadingConnectorMeta::default();
    meta.load_jobs.insert(JobId(0), job(1, 1));
    meta.load_jobs.insert(JobId(1), job(2, 2));
    assert!(w.handle_preemptions(&meta).is_empty());
    w.bind(&meta);
    let cmds = w.start_load_kv();
    assert_eq!(cmds.len(), 2);
    assert!(w.wait_for_save().is_empty());
    // The second load completes first: nothing is reported until the first one does.
    w.handle_transfer_done(TransferDone {
        job: JobId(1),
        ok: true,
    });
    let r = w.get_transfer_results(&SortedSet::new());
    assert_eq!(r.finished_recving, None);
    assert_eq!(w.build_connector_worker_meta(), None);
    w.clear();
    w.handle_transfer_done(TransferDone {
        job: JobId(0),
        ok: true,
    });
    let r = w.get_transfer_results(&SortedSet::new());
    assert_eq!(
        r.finished_recving,
        Some(SortedSet::from_vec(vec![rid(1), rid(2)]))
    );
    let Some(Meta::Offload(m)) = w.build_connector_worker_meta() else {
        panic!("acknowledgements")
    };
    assert_eq!(
        m.completed_jobs().collect::<Vec<_>>(),
        vec![(JobId(0), 1), (JobId(1), 1)]
    );
    assert_eq!((m.transfers, m.bytes), (2, 16));
    w.check_invariants().unwrap();
    // A completion for a job not in flight is a sticky typed error.
    w.handle_transfer_done(TransferDone {
        job: JobId(7),
        ok: true,
    });
    assert_eq!(
        w.error(),
        Some(kvrelay_core::WorkerError::UnknownJob(JobId(7)))
    );
}

/// A worker of `mode` with one async load (job 0, request 1, block 1), one sync load (job 1,
/// request 2, blocks 2 and 3 of `sync_groups` groups) and one store (job 2, request 3, block 4)
/// in flight, as one step submits them.
fn worker_with_three_jobs(mode: kvrelay_core::Mode, sync_groups: usize) -> OffloadingWorker {
    use kvrelay_core::{GpuSpec, TransferJob};
    let mut w = OffloadingWorker::new(OffloadingWorkerConfig {
        blocks_per_chunk: 1,
        is_store_writer: true,
        bytes_per_block: 8,
        mode,
    });
    let job = |r: u32, blocks: Vec<Vec<u64>>, sync: bool| TransferJob {
        request: rid(r),
        gpu: GpuSpec {
            block_indices: vec![0; blocks.len()],
            block_ids: blocks
                .iter()
                .map(|g| g.iter().map(|&b| BlockId(b)).collect())
                .collect(),
        },
        chunks: blocks
            .iter()
            .map(|g| g.iter().map(|&b| ChunkId(b as u32)).collect())
            .collect(),
        sync,
    };
    let sync_blocks = if sync_groups == 1 {
        vec![vec![2, 3]]
    } else {
        vec![vec![2], vec![3]]
    };
    let mut meta = OffloadingConnectorMeta::default();
    meta.load_jobs
        .insert(JobId(0), job(1, vec![vec![1]], false));
    meta.load_jobs.insert(JobId(1), job(2, sync_blocks, true));
    meta.store_jobs
        .insert(JobId(2), job(3, vec![vec![4]], false));
    assert!(w.handle_preemptions(&meta).is_empty());
    w.bind(&meta);
    assert_eq!(
        w.start_load_kv().len(),
        3,
        "two starts and the sync load's wait"
    );
    assert!(w.wait_for_save().is_empty());
    w.clear();
    // The store is deferred to the next step's start.
    w.handle_preemptions(&OffloadingConnectorMeta::default());
    w.bind(&OffloadingConnectorMeta::default());
    w
}

#[test]
fn a_strict_worker_reports_failed_transfers_instead_of_stopping() {
    // Protects the strict absorption of transfer failures (issue 22, SEMANTICS.md strict
    // departures): a failed async load reports its request in finished_recving and
    // failed_recving, a failed sync load its blocks as load errors, a failed store a failed
    // acknowledgement; nothing is sticky, and every job is acknowledged exactly once.
    let mut w = worker_with_three_jobs(kvrelay_core::Mode::Strict, 1);
    for job in 0..3 {
        w.handle_transfer_done(TransferDone {
            job: JobId(job),
            ok: false,
        });
    }
    assert_eq!(w.error(), None);
    w.check_invariants().unwrap();
    let r = w.get_transfer_results(&SortedSet::new());
    assert_eq!(r.finished_recving, Some(SortedSet::from_vec(vec![rid(1)])));
    assert_eq!(r.failed_recving, SortedSet::from_vec(vec![rid(1)]));
    assert_eq!(
        w.get_block_ids_with_load_errors(),
        SortedSet::from_vec(vec![BlockId(2), BlockId(3)])
    );
    let Some(Meta::Offload(m)) = w.build_connector_worker_meta() else {
        panic!("acknowledgements")
    };
    assert_eq!(
        m.completed_jobs().collect::<Vec<_>>(),
        vec![(JobId(0), 1), (JobId(1), 1), (JobId(2), 1)]
    );
    assert_eq!(m.failed_jobs(), &[JobId(0), JobId(1), JobId(2)]);
    assert_eq!(
        (m.transfers, m.bytes),
        (0, 0),
        "failed transfers move nothing"
    );
    assert_eq!(w.in_flight().count(), 0);
    w.check_invariants().unwrap();
}

#[test]
fn a_compat_worker_stops_on_a_failed_transfer_as_vllm_asserts() {
    // Protects compat (vLLM asserts `success`): the failure is a sticky typed error and the job
    // is never acknowledged.
    let mut w = worker_with_three_jobs(kvrelay_core::Mode::Compat, 1);
    w.handle_transfer_done(TransferDone {
        job: JobId(2),
        ok: false,
    });
    assert_eq!(
        w.error(),
        Some(kvrelay_core::WorkerError::TransferFailed(JobId(2)))
    );
    assert!(w.in_flight().any(|j| j == JobId(2)));
}

#[test]
fn a_strict_sync_load_over_several_groups_fails_as_in_compat() {
    // Protects the documented limit: block-level load errors need one KV cache group (vLLM's
    // scheduler rejects them otherwise), so such a failure stays a sticky error.
    let mut w = worker_with_three_jobs(kvrelay_core::Mode::Strict, 2);
    w.handle_transfer_done(TransferDone {
        job: JobId(1),
        ok: false,
    });
    assert_eq!(
        w.error(),
        Some(kvrelay_core::WorkerError::TransferFailed(JobId(1)))
    );
}

#[test]
fn unknown_or_excess_acknowledgements_break_the_scheduler_with_a_typed_error() {
    use kvrelay_core::{AggregatedOutput, OffloadMeta, SchedulerError};
    // The scheduler alone: the acknowledgement is forged, not produced by a rank.
    let config = sched_config(100, false);
    let conn =
        OffloadingConnector::new(OffloadingConfig::new(BPC, 1, manager(64)), &config).unwrap();
    let mut s = Scheduler::new(config, conn).unwrap();
    s.add_request(spec_with(1, prompt(1, 12), 3)).unwrap();
    let st = s.schedule().unwrap();
    let sampled = s.fake_sample(st.output.step);
    let kv = AggregatedOutput {
        worker_meta: Some(Meta::Offload(OffloadMeta::from_counts([(JobId(99), 1)]))),
        ..empty_aggregated()
    };
    let e = s
        .update_from_output(
            st.output.step,
            ModelOutput {
                sampled,
                kv_connector_output: Some(kv),
            },
        )
        .unwrap_err();
    assert!(matches!(e, SchedulerError::ConnectorContract(_)), "{e:?}");
}

#[test]
fn request_finished_never_delays_the_free() {
    let mut sim = Sim::simple(100, false, 1);
    sim.add(spec_with(1, prompt(1, 30), 1));
    sim.hold(0, true);
    let s = sim.step();
    assert_eq!(s.output.num_scheduled_tokens, vec![(rid(1), 30)]);
    assert_eq!(s.meta.store_jobs.len(), 1);
    // Finished with its store in flight: freed at once, tracked by the connector until the
    // acknowledgement.
    assert_eq!(sim.s().status(rid(1)), None);
    assert!(sim.conn().tracks(rid(1)));
    assert!(
        sim.s().has_requests(),
        "push work keeps the engine stepping (I-47)"
    );
    assert!(!<OffloadingConnector as SchedulerConnector>::requires_kv_delivery(sim.conn()));
    sim.hold(0, false);
    sim.drain(10);
    assert!(!sim.conn().tracks(rid(1)));
}

// ---------------------------------------------------------------------------------------------
// Sync loads, load limits.

#[test]
fn a_hit_within_the_sync_budget_loads_before_the_forward() {
    let mut off = OffloadingConfig::new(BPC, 1, manager(64));
    off.sync_load_budget_tokens = 40;
    let mut sim = Sim::new(sched_config(100, false), off, &[true]);
    let p = prompt(1, 36);
    sim.offload(1, &p);
    let p2 = extended(&p, &[1]);
    sim.add(spec_with(2, p2, 2));
    let s = sim.step();
    let (&load, lj) = s.meta.load_jobs.iter().next().expect("a load");
    assert!(lj.sync);
    assert!(s.output.has_sync_kv_loads);
    // Admitted and scheduled in the same step for its one remaining token.
    assert_eq!(s.output.num_scheduled_tokens, vec![(rid(2), 1)]);
    assert_eq!(s.waited[0], vec![load], "waited for before the forward");
    assert!(s.recving.is_empty(), "no finished_recving for a sync load");
    assert_eq!(sim.conn().pending_count(load), None);
    sim.drain(10);
    // The budget is per step: a later step has it again.
    let mut p3 = p.clone();
    p3.extend(prompt(3, 30));
    sim.add(spec_with(3, p3, 1));
    let s = sim.step();
    let lj = s.meta.load_jobs.values().next().expect("a load");
    assert!(lj.sync, "36 tokens fit the budget of 40");
    sim.drain(10);
}

#[test]
fn a_request_may_have_several_stores_in_flight() {
    // A chunked prefill on a held rank: each step's chunks become a store job of their own, and
    // none is acknowledged, so the request holds two stores at once (I-39 allows any number of
    // stores, at most one load).
    let mut config = sched_config(200, false);
    config.max_num_batched_tokens = 24;
    let off = OffloadingConfig::new(BPC, 1, manager(64));
    let mut sim = Sim::new(config, off, &[true]);
    sim.hold(0, true);
    sim.add(spec_with(1, prompt(1, 48), 2));
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.extend(sim.step().meta.store_jobs.into_values());
    }
    let jobs = sim.conn().request_jobs(rid(1));
    assert_eq!(jobs.len(), 2, "two unacknowledged stores");
    // Each job names the table index of its first block: chunks 0–1, then chunks 2–3.
    let firsts: Vec<_> = stores.iter().map(|j| j.gpu.block_indices.clone()).collect();
    assert_eq!(firsts, [[0], [6]]);
    sim.hold(0, false);
    sim.drain(10);
    assert_eq!(sim.lookup(&prompt(1, 48), 3, 0), KeyLookup::Hit);
}

#[test]
fn the_sync_budget_boundaries() {
    // One sim per case: a 36-token prefix offloaded, then a request whose hit is that prefix.
    let p = prompt(1, 36);
    let first_load = |budget: u32, second: Vec<u32>| {
        let mut off = OffloadingConfig::new(BPC, 1, manager(64));
        off.sync_load_budget_tokens = budget;
        let mut sim = Sim::new(sched_config(100, false), off, &[true]);
        sim.offload(1, &p);
        sim.add(spec_with(2, second, 2));
        let s = sim.step();
        let lj = s.meta.load_jobs.values().next().expect("a load").clone();
        sim.drain(10);
        lj
    };
    // A hit of exactly the budget is loaded synchronously; one token over is not.
    let lj = first_load(36, extended(&p, &[1]));
    assert_eq!(
        (lj.num_blocks(), lj.sync),
        (9, true),
        "36-token hit, budget 36"
    );
    let lj = first_load(35, extended(&p, &[1]));
    assert_eq!(
        (lj.num_blocks(), lj.sync),
        (9, false),
        "36-token hit, budget 35"
    );
    // A hit of the whole prompt leaves nothing to compute this step: never synchronous.
    let lj = first_load(40, p.clone());
    assert!(!lj.sync, "whole-prompt hit");
}

#[test]
fn max_load_tokens_caps_the_hit_to_whole_chunks() {
    let mut sim = Sim::simple(100, false, 1);
    let p = prompt(1, 36);
    sim.offload(1, &p);
    let p2 = extended(&p, &[1]);
    let mut r = spec_with(2, p2, 1);
    r.kv_transfer_params = Some(params(&[("max_load_tokens", "20")]));
    sim.add(r);
    let s = sim.step();
    let lj = s.meta.load_jobs.values().next().expect("a load");
    assert_eq!(lj.chunks[0].len(), 1, "20 tokens round down to one chunk");
    assert_eq!(computed(sim.s(), 2), 12);
    sim.drain(10);
}

// ---------------------------------------------------------------------------------------------
// Random workloads (I-38…I-48).

mod random {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// A request whose prompt starts with shared prefix `prefix` (0..3) of `chunks` chunks
        /// and a private tail of `tail` tokens.
        Add {
            prefix: u32,
            chunks: u32,
            tail: u32,
            max_tokens: u32,
        },
        Step,
        Hold(usize),
        Release(usize),
        Abort(u32),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u32..3, 0u32..4, 0u32..14, 1u32..12).prop_map(|(prefix, chunks, tail, max_tokens)| {
                Op::Add { prefix, chunks, tail, max_tokens }
            }),
            8 => Just(Op::Step),
            1 => (0usize..2).prop_map(Op::Hold),
            2 => (0usize..2).prop_map(Op::Release),
            1 => (0u32..24).prop_map(Op::Abort),
            1 => Just(Op::Reset),
        ]
    }

    fn run(ops: Vec<Op>, groups: Vec<GroupKind>, prefix_caching: bool, writers: [bool; 2]) {
        let mut config = sched_config(48, prefix_caching);
        config.groups = groups;
        let off = OffloadingConfig::new(BPC, 2, manager(12));
        let mut sim = Sim::new(config, off, &writers);
        let mut next = 0u32;
        for op in ops {
            match op {
                Op::Add {
                    prefix,
                    chunks,
                    tail,
                    max_tokens,
                } => {
                    let mut p = prompt(prefix + 1, chunks * BPC * BS);
                    p.extend(prompt(1000 + next, tail.max(1)));
                    sim.add(spec_with(next, p, max_tokens));
                    next += 1;
                }
                Op::Step => {
                    if sim.busy() {
                        let _ = sim.step();
                    }
                }
                Op::Hold(r) => sim.hold(r, true),
                Op::Release(r) => sim.hold(r, false),
                Op::Abort(id) => {
                    if sim.s().status(rid(id)).is_some_and(|s| !s.is_finished()) {
                        sim.abort(id);
                    }
                }
                Op::Reset => {
                    let _ = sim.engine.reset_connector_cache().unwrap();
                    sim.check();
                }
            }
        }
        sim.hold(0, false);
        sim.hold(1, false);
        sim.drain(400);
        // I-48: everything drained.
        assert_eq!(sim.conn().jobs_in_flight().count(), 0);
        assert_eq!(sim.conn().fenced_blocks().count(), 0);
        assert_eq!(sim.conn().reset_fence_len(), 0);
        for id in 0..next {
            assert!(!sim.conn().tracks(rid(id)), "request {id} still tracked");
        }
        for w in sim.ranks.iter().map(|d| d.worker().inner()) {
            assert_eq!(w.in_flight().count(), 0);
            assert_eq!(w.deferred_stores().count(), 0);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn full_attention(ops in proptest::collection::vec(op(), 1..80), caching: bool) {
            run(ops, vec![GroupKind::FullAttention], caching, [true, true]);
        }

        #[test]
        fn hybrid_with_a_non_writer(ops in proptest::collection::vec(op(), 1..80), caching: bool) {
            run(
                ops,
                vec![GroupKind::FullAttention, GroupKind::SlidingWindow { window: 6 }],
                caching,
                [true, false],
            );
        }
    }
}
