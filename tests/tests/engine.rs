//! The core's engine step (`core/src/engine/`): what a [`RankDriver`] hands its caller, in what
//! order, and how an [`EngineCore`] collects the ranks' outputs. The model checker, the
//! conformance harness and the simulations drive these same machines; these tests pin the
//! contract each of them relies on.

use kvrelay_core::{
    EngineCore, EngineError, JobId, OffloadingWorker, OffloadingWorkerConfig, Rank, RankAction,
    RankDriver, RankError, ScheduledStep, SchedulerConfig, SchedulerOutput, ScriptedConnector,
    ScriptedMeta, ScriptedWorker, SortedSet, StepId, Transfer, TransferDirection, TransferDone,
    WorkerCall, WorkerError, WorkerOutput,
};
use kvrelay_tests::build::{rank_config, rid, spec};
use kvrelay_tests::drive::run_rank_step;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: 32,
        ..SchedulerConfig::default()
    }
}

/// The forward pass comes once per layer, between `wait_for_layer_load` and `save_kv_layer`,
/// and tells which blocks the new tokens go to (writes) and which computed blocks attention
/// reads; an async load starts after the forward; the step ends with `Collect`, then `Done`.
#[test]
fn a_step_hands_out_its_layers_accesses_then_the_async_load_then_the_output() {
    let mut e = EngineCore::new(config(), ScriptedConnector::new(), 1).unwrap();
    e.add_request(spec(1, 10, 2)).unwrap();
    let step0 = e.schedule().unwrap().step;
    assert_eq!(step0.output.num_scheduled_tokens, vec![(rid(1), 10)]);
    let mut d = RankDriver::new(rank_config(&config(), 2), ScriptedWorker::new());
    let load = Transfer {
        job: JobId(4),
        direction: TransferDirection::Load,
        request: rid(9),
        gpu_blocks: vec![],
        groups: vec![],
        external: vec![],
    };
    d.worker_mut().push_load(load.clone());
    d.begin(&step0).unwrap();
    let (actions, out) = run_rank_step(&mut d);
    let shape: Vec<&str> = actions
        .iter()
        .map(|a| match a {
            RankAction::Start(_) => "start",
            RankAction::Forward(_) => "forward",
            RankAction::Collect => "collect",
            _ => "other",
        })
        .collect();
    assert_eq!(shape, ["forward", "forward", "start", "collect"]);
    let RankAction::Forward(pass) = &actions[0] else {
        unreachable!()
    };
    assert_eq!(pass.layer, 0);
    assert!(pass.reads.is_empty(), "nothing computed before the prompt");
    let writes: Vec<(u64, std::ops::Range<u32>)> = pass
        .writes
        .iter()
        .map(|w| (w.block.0, w.tokens.clone()))
        .collect();
    let table = &step0.output.scheduled_new_reqs[0].block_ids[0];
    assert_eq!(
        writes,
        vec![(table[0].0, 0..4), (table[1].0, 4..8), (table[2].0, 8..10)],
        "10 tokens: two full blocks and a partial one"
    );
    assert_eq!(actions[2], RankAction::Start(load));
    assert_eq!(
        d.in_flight().iter().copied().collect::<Vec<_>>(),
        [JobId(4)]
    );
    assert_eq!(
        d.tables()[&rid(1)],
        step0.output.scheduled_new_reqs[0].block_ids
    );
    assert_eq!(
        d.worker().inner().bound(),
        None,
        "cleared at the end of the step"
    );
    // The next step (decoding token 10) reads the computed prefix and writes the third block.
    e.rank_output(step0.output.step, Rank(0), Some(out))
        .unwrap();
    e.apply_fake().unwrap();
    let step1 = e.schedule().unwrap().step;
    d.begin(&step1).unwrap();
    let (actions, _) = run_rank_step(&mut d);
    let RankAction::Forward(pass) = &actions[0] else {
        panic!("{actions:?}")
    };
    assert_eq!(
        pass.reads.len(),
        1,
        "one span: the request's computed prefix"
    );
    let reads: Vec<(u64, std::ops::Range<u32>)> = d
        .read_blocks(&pass.reads[0], 0)
        .map(|r| (r.block.0, r.tokens.clone()))
        .collect();
    let from_second: Vec<u64> = d
        .read_blocks(&pass.reads[0], 1)
        .map(|r| r.block.0)
        .collect();
    assert_eq!(
        from_second,
        [table[1].0, table[2].0],
        "from a block index on"
    );
    assert_eq!(
        reads,
        vec![(table[0].0, 0..4), (table[1].0, 4..8), (table[2].0, 8..10)]
    );
    assert_eq!(pass.writes.len(), 1);
    assert_eq!(
        (pass.writes[0].block, pass.writes[0].tokens.clone()),
        (table[2], 10..11)
    );
}

/// A `Wait` blocks the step until every job in it completed; completions may come at any
/// time, and a wait names only jobs still in flight on the rank.
#[test]
fn a_wait_blocks_until_its_jobs_complete() {
    let mut d = RankDriver::new(rank_config(&config(), 1), ScriptedWorker::new());
    let step = |n: u64| ScheduledStep {
        output: SchedulerOutput {
            step: StepId(n),
            ..SchedulerOutput::default()
        },
        meta: ScriptedMeta::default(),
    };
    let load = |j: u64| Transfer {
        job: JobId(j),
        direction: TransferDirection::Load,
        request: rid(1),
        gpu_blocks: vec![],
        groups: vec![],
        external: vec![],
    };
    d.worker_mut().push_load(load(1));
    d.worker_mut().push_load(load(2));
    d.begin(&step(0)).unwrap();
    run_rank_step(&mut d);
    // Job 2 completes between steps; the next step's handle_preemptions waits for 1 and 2.
    d.transfer_done(TransferDone {
        job: JobId(2),
        ok: true,
    })
    .unwrap();
    d.worker_mut().set_preemption_waits(&[JobId(1), JobId(2)]);
    d.begin(&step(1)).unwrap();
    let want = SortedSet::from_vec(vec![JobId(1)]);
    let wait = RankAction::Wait {
        jobs: want,
        during: WorkerCall::HandlePreemptions,
    };
    assert_eq!(d.poll().unwrap(), wait, "blocked in handle_preemptions");
    assert_eq!(d.waiting_during(), Some(WorkerCall::HandlePreemptions));
    assert_eq!(d.poll().unwrap(), wait, "still blocked");
    d.transfer_done(TransferDone {
        job: JobId(1),
        ok: true,
    })
    .unwrap();
    let (_, out) = run_rank_step(&mut d);
    assert_eq!(out.finished_recving, None);
    assert!(d.in_flight().is_empty());
    assert_eq!(
        d.worker_mut().take_done().len(),
        2,
        "both completions reached the worker"
    );
}

/// A step begun out of order is refused, and the rank's worker-connector error surfaces through
/// the driver as a typed, sticky error (not a side getter).
#[test]
fn errors_come_through_the_driver_and_stick() {
    let mut d = RankDriver::new(rank_config(&config(), 1), ScriptedWorker::new());
    let step = ScheduledStep {
        output: SchedulerOutput {
            step: StepId(1),
            ..SchedulerOutput::default()
        },
        meta: ScriptedMeta::default(),
    };
    assert_eq!(
        d.begin(&step).unwrap_err(),
        RankError::StepOutOfOrder {
            expected: Some(StepId(0)),
            got: StepId(1)
        }
    );
    // An offloading worker told of a completion it never started stops, and so does the rank.
    let mut off = RankDriver::new(
        rank_config(&config(), 1),
        OffloadingWorker::new(OffloadingWorkerConfig {
            blocks_per_chunk: 1,
            is_store_writer: true,
            bytes_per_block: 1,
            mode: kvrelay_core::Mode::Compat,
        }),
    );
    let e = off
        .transfer_done(TransferDone {
            job: JobId(7),
            ok: true,
        })
        .unwrap_err();
    assert_eq!(e, RankError::Worker(WorkerError::UnknownJob(JobId(7))));
    assert_eq!(e.kind(), "unknown_job");
    assert_eq!(off.poll().unwrap_err(), e, "sticky");
    assert_eq!(off.error(), Some(&e));
}

/// A second output for the same (step, rank) is refused before it reaches the aggregator
/// (compat would count its completions twice, I-21); the step applies once every rank reported.
#[test]
fn the_engine_takes_one_output_per_step_and_rank() {
    let mut e = EngineCore::new(config(), ScriptedConnector::new(), 2).unwrap();
    e.add_request(spec(1, 8, 1)).unwrap();
    let s = e.schedule().unwrap().step.output.step;
    assert!(matches!(
        e.apply_fake(),
        Err(EngineError::NotReady { missing: 2, .. })
    ));
    e.rank_output(s, Rank(0), Some(WorkerOutput::default()))
        .unwrap();
    assert_eq!(
        e.rank_output(s, Rank(0), Some(WorkerOutput::default())),
        Err(EngineError::DuplicateOutput {
            step: s,
            rank: Rank(0)
        })
    );
    assert_eq!(
        e.rank_output(s, Rank(2), None),
        Err(EngineError::RankOutOfRange {
            rank: Rank(2),
            world: 2
        })
    );
    assert_eq!(
        e.rank_output(StepId(9), Rank(1), None),
        Err(EngineError::UnknownStep {
            step: StepId(9),
            rank: Rank(1)
        })
    );
    assert!(!e.ready());
    e.rank_output(s, Rank(1), Some(WorkerOutput::default()))
        .unwrap();
    assert!(e.ready());
    let applied = e.apply_fake().unwrap();
    assert_eq!(applied.result.outputs.len(), 1);
    assert!(!applied.idle);
    e.check_invariants().unwrap();
    // The request finished: once the next step told the ranks, its id may be released, once.
    let s1 = e.schedule().unwrap();
    assert!(s1.step.output.finished_req_ids.contains(&rid(1)));
    assert!(
        e.take_released().is_empty(),
        "the ranks have not seen it finish yet"
    );
    for r in 0..2 {
        e.rank_output(s1.step.output.step, Rank(r), None).unwrap();
    }
    let applied = e.apply_fake().unwrap();
    assert!(!applied.idle, "the step told the ranks a request finished");
    assert_eq!(e.take_released(), vec![rid(1)]);
    assert!(e.take_released().is_empty());
    // Nothing left: a step that schedules nothing and brings nothing back is idle.
    let s2 = e.schedule().unwrap();
    assert!(s2.quiet);
    for r in 0..2 {
        e.rank_output(s2.step.output.step, Rank(r), None).unwrap();
    }
    assert!(e.apply_fake().unwrap().idle);
}
