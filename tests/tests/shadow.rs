//! [`ShadowState`] carries everything the offloading connector reads (issue 35: the vLLM bridge
//! drives the core's connector from vLLM's own requests through a shadow, not through kvrelay's
//! scheduler). Protects that view contract: a twin [`OffloadingConnector`] fed the shadow's view
//! — mirrored from the real scheduler's view before each call — decides exactly as the one the
//! scheduler drives, call for call, over workloads with shared prefixes, CPU hits and loads,
//! preemptions, aborts, delayed acknowledgements and a cache reset; whole (`mirror`) and
//! incremental (`mirror_from`) mirroring alike.

use std::collections::BTreeSet;

use kvrelay_core::{
    AggregatedOutput, BlockId, FinishDecision, InvariantViolation, KvEvent, Lookup, ManagerConfig,
    Meta, OffloadMeta, OffloadingConfig, OffloadingConnector, OffloadingConnectorMeta, PolicyKind,
    RequestId, RequestMirror, Scheduler, SchedulerConfig, SchedulerConnector, SchedulerOutput,
    SchedulerView, ShadowState, SortedSet,
};
use kvrelay_tests::build::{rid, spec_with};
use kvrelay_tests::drive;

/// The scheduler's connector, with a twin on the shadow; every answer compared.
#[derive(Debug)]
struct Mirrored {
    real: OffloadingConnector,
    twin: OffloadingConnector,
    shadow: ShadowState,
    seen: BTreeSet<RequestId>,
    groups: usize,
}

impl Mirrored {
    /// Mirrors every request the scheduler still has into the shadow (and forgets the others).
    fn sync(&mut self, view: &SchedulerView<'_>) {
        for &id in &self.seen {
            let Some(r) = view.request(id) else {
                self.shadow.remove(id);
                continue;
            };
            let blocks: Vec<Vec<BlockId>> =
                (0..self.groups).map(|g| r.block_ids(g).to_vec()).collect();
            let mirror = RequestMirror {
                status: r.status(),
                tokens: r.tokens(),
                num_prompt_tokens: r.num_prompt_tokens(),
                block_hashes: r.block_hashes(),
                num_computed_tokens: r.num_computed_tokens(),
                num_preemptions: r.num_preemptions(),
                kv_transfer_params: r.kv_transfer_params(),
                blocks: &blocks,
            };
            // Odd ids are mirrored incrementally (the Python package's way): only the tokens and
            // hashes past what the shadow holds.
            if id.0 % 2 == 1 {
                let (t, h) = self.shadow.lengths(id).unwrap_or((0, 0));
                let tail = RequestMirror {
                    tokens: &r.tokens()[t..],
                    block_hashes: &r.block_hashes()[h..],
                    ..mirror
                };
                self.shadow.mirror_from(id, t, h, tail).unwrap();
            } else {
                self.shadow.mirror(id, mirror).unwrap();
            }
        }
    }
}

impl SchedulerConnector for Mirrored {
    type StepMeta = OffloadingConnectorMeta;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, id: RequestId) {
        self.seen.insert(id);
        self.sync(view);
        self.real.on_new_request(view, id);
        self.twin.on_new_request(&self.shadow.view(), id);
    }

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        n: u32,
    ) -> Lookup {
        self.sync(view);
        let a = self.real.get_num_new_matched_tokens(view, id, n);
        let b = self
            .twin
            .get_num_new_matched_tokens(&self.shadow.view(), id, n);
        assert_eq!(a, b, "lookup of {id:?}");
        a
    }

    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        blocks: &[Vec<BlockId>],
        ext: u32,
    ) {
        self.sync(view);
        self.real.update_state_after_alloc(view, id, blocks, ext);
        self.twin
            .update_state_after_alloc(&self.shadow.view(), id, blocks, ext);
    }

    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> OffloadingConnectorMeta {
        self.sync(view);
        let a = self.real.build_connector_meta(view, output);
        let b = self.twin.build_connector_meta(&self.shadow.view(), output);
        assert_eq!(a, b, "metadata of step {:?}", output.step);
        a
    }

    fn update_connector_output(
        &mut self,
        view: &SchedulerView<'_>,
        output: &AggregatedOutput<Meta>,
    ) {
        self.sync(view);
        self.real.update_connector_output(view, output);
        self.twin
            .update_connector_output(&self.shadow.view(), output);
    }

    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        self.sync(view);
        let a = self.real.request_finished(view, id, blocks);
        let b = self.twin.request_finished(&self.shadow.view(), id, blocks);
        assert_eq!(a, b, "finish of {id:?}");
        a
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        let a = self.real.take_events();
        assert_eq!(a, self.twin.take_events());
        a
    }

    fn take_intents(&mut self) -> Vec<kvrelay_core::Intent> {
        let a = self.real.take_intents();
        assert_eq!(a, self.twin.take_intents());
        a
    }

    fn take_error(&mut self) -> Option<kvrelay_core::ConnectorError> {
        let a = self.real.take_error();
        assert_eq!(a, self.twin.take_error());
        a
    }

    fn has_pending_push_work(&self) -> bool {
        let a = self.real.has_pending_push_work();
        assert_eq!(a, self.twin.has_pending_push_work());
        a
    }

    fn reset_cache(&mut self) -> Option<bool> {
        let a = self.real.reset_cache();
        assert_eq!(a, self.twin.reset_cache());
        a
    }

    fn get_finished_count(&self) -> Option<u32> {
        self.real.get_finished_count()
    }

    fn meta_is_empty(&self, meta: &OffloadingConnectorMeta) -> bool {
        self.real.meta_is_empty(meta)
    }

    fn tracks_request(&self, id: RequestId) -> bool {
        let a = self.real.tracks_request(id);
        assert_eq!(a, self.twin.tracks_request(id));
        a
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.real.check_invariants()?;
        self.twin.check_invariants()
    }
}

fn configs(gpu_blocks: u32, cpu_chunks: u32) -> (SchedulerConfig, OffloadingConfig) {
    let sched = SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: gpu_blocks,
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        max_model_len: 256,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    };
    let manager = ManagerConfig {
        capacity_chunks: cpu_chunks,
        policy: PolicyKind::Lru,
        store_threshold: 0,
    };
    (sched, OffloadingConfig::new(2, 1, manager))
}

/// The acknowledgements of a step's jobs (one rank), and the requests whose loads finished.
fn acks(meta: &OffloadingConnectorMeta) -> AggregatedOutput<Meta> {
    let jobs = meta
        .load_jobs
        .keys()
        .chain(meta.store_jobs.keys())
        .map(|&j| (j, 1));
    let loaded: Vec<RequestId> = meta
        .load_jobs
        .values()
        .filter(|j| !j.sync)
        .map(|j| j.request)
        .collect();
    AggregatedOutput {
        finished_sending: None,
        finished_recving: (!loaded.is_empty()).then(|| SortedSet::from_vec(loaded)),
        invalid_block_ids: SortedSet::new(),
        failed_recving: SortedSet::new(),
        worker_meta: Some(Meta::Offload(OffloadMeta::from_counts(jobs))),
        kv_events: None,
        expected_finished_count: 1,
    }
}

/// What a run exercised: load jobs, store jobs, preemptions.
#[derive(Debug, Default)]
struct Tally {
    loads: usize,
    stores: usize,
    preemptions: usize,
}

/// Runs a workload of `n` requests over a few shared prefixes; acknowledgements are held back
/// one step on odd steps when `delay`, request 3 is aborted at step 6, the cache is reset once.
fn run(seed: u32, n: u32, gpu_blocks: u32, cpu_chunks: u32, delay: bool, tally: &mut Tally) {
    let (sched, off) = configs(gpu_blocks, cpu_chunks);
    let connector = |s: &SchedulerConfig| OffloadingConnector::new(off.clone(), s).unwrap();
    let mirrored = Mirrored {
        real: connector(&sched),
        twin: connector(&sched),
        shadow: ShadowState::new(sched.clone()).unwrap(),
        seen: BTreeSet::new(),
        groups: sched.groups.len(),
    };
    let mut s = Scheduler::new(sched, mirrored).unwrap();
    for i in 0..n {
        let prefix = (seed + i) % 3;
        let prompt: Vec<u32> = (0..16 + (i % 4) * 8)
            .map(|t| {
                if t < 16 {
                    prefix * 1000 + t + 1
                } else {
                    i * 100 + t
                }
            })
            .collect();
        s.add_request(spec_with(i, prompt, 3 + i % 5)).unwrap();
    }
    let mut held: Option<AggregatedOutput<Meta>> = None;
    for step in 0..400 {
        if step == 6 {
            s.abort(rid(3)).unwrap();
        }
        let scheduled = s.schedule().unwrap();
        tally.loads += scheduled.meta.load_jobs.len();
        tally.stores += scheduled.meta.store_jobs.len();
        tally.preemptions += scheduled.output.preempted_req_ids.len();
        let mut kv = acks(&scheduled.meta);
        if delay && step % 2 == 1 {
            kv = held
                .replace(kv)
                .unwrap_or_else(|| acks(&OffloadingConnectorMeta::default()));
        } else if let Some(h) = held.take() {
            drive::apply(&mut s, scheduled.output.step, Some(h));
            continue;
        }
        drive::apply(&mut s, scheduled.output.step, Some(kv));
        if step == 40 {
            s.reset_connector_cache().unwrap();
        }
        if !s.has_requests() && held.is_none() {
            break;
        }
    }
}

#[test]
fn shadow_view_drives_the_offloading_connector_as_the_scheduler_does() {
    let mut tally = Tally::default();
    for seed in 0..6 {
        run(seed, 12, 64, 32, false, &mut tally);
        run(seed, 12, 24, 16, true, &mut tally);
    }
    // The runs reach what the contract is about: CPU hits loaded back, stores, preemptions.
    assert!(
        tally.loads > 0 && tally.stores > 0 && tally.preemptions > 0,
        "{tally:?}"
    );
}
