//! The fault seams (`kvrelay_sim::faults`, `kvrelay_sim::tamper`) make the engine's checks fail,
//! and the engine says so: a load that moved the wrong bytes is caught in-process and inside a
//! worker process, a block reused while a transfer or another request still uses it is refused,
//! and a rank that goes silent stops the engine on its own clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay_core::RequestId;
use kvrelay_engine::engine::RANK_CHECK;
use kvrelay_engine::rank::Hazard;
use kvrelay_engine::transport::{BoxFuture, Clock, InProcess};
use kvrelay_engine::workload::WorkloadConfig;
use kvrelay_engine::{Engine, RunConfig, RunError, Workers, requests, run, run_with};
use kvrelay_sim::faults::{CorruptingInProcess, LoseRank};
use kvrelay_sim::tamper::{DropLoadCompletions, StepFault, TamperSteps};

fn small() -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            conversations: 24,
            ..WorkloadConfig::default()
        },
        check: true,
        ..RunConfig::default()
    }
}

// Protects the verification itself: a load whose copies read each other's host slots (real
// bytes, wrong ones) is reported as wrong bytes naming the block, and the run stops.
#[test]
fn a_load_of_the_wrong_bytes_is_caught_when_it_completes() {
    let c = small();
    let records = requests(&c).unwrap();
    match run_with(&c, &records, &mut (), &CorruptingInProcess) {
        Err(RunError::Corrupt { what, rank, .. }) => assert_eq!((what, rank), ("loaded", 0)),
        other => panic!("expected a corruption error, got {other:?}"),
    }
    // The same workload without the fault passes: the error above is the fault's.
    let r = run(&c, &records, &mut ()).unwrap();
    assert_eq!(r.loaded_blocks_verified, r.blocks_loaded);
}

// Protects the process transport's errors: a worker process whose load moved the wrong bytes
// stops the run with the worker's own error, carried over the wire.
#[test]
fn a_worker_process_that_loads_wrong_bytes_stops_the_run_with_its_error() {
    let c = RunConfig {
        workers: Workers::Process,
        worker_exe: Some(env!("CARGO_BIN_EXE_kvrelay-corrupting-worker").into()),
        ..small()
    };
    let records = requests(&c).unwrap();
    match run(&c, &records, &mut ()) {
        Err(RunError::Remote { rank: 0, message }) => {
            assert!(message.contains("holds wrong KV"), "{message}")
        }
        other => panic!("expected the worker's corruption error, got {other:?}"),
    }
}

/// A clock whose sleeps end at once (after a yield) and advance it by their length.
#[derive(Debug, Default)]
struct Skipping {
    slept: Mutex<Vec<Duration>>,
}

impl Clock for Skipping {
    fn now(&self) -> Duration {
        self.slept.lock().unwrap().iter().sum()
    }

    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        self.slept.lock().unwrap().push(d);
        Box::pin(tokio::task::yield_now())
    }
}

// Protects the clock seam (what the simulation relies on): the engine's wait for a lost rank is
// a sleep of the injected clock, so a clock that skips time ends it at once.
#[tokio::test]
async fn the_engine_waits_for_a_lost_rank_on_its_clock() {
    // Two ranks: rank 1 keeps the report channel open while rank 0 is gone.
    let c = RunConfig {
        ranks: 2,
        ..RunConfig::default()
    };
    let clock = Arc::new(Skipping::default());
    let lose = LoseRank {
        inner: InProcess,
        rank: 0,
        after_steps: 2,
    };
    let mut e = Engine::start_with(&c, 256, &lose, clock.clone())
        .await
        .unwrap();
    e.add(RequestId(1), (0..64).collect(), 32).unwrap();
    let wall = std::time::Instant::now();
    let error = loop {
        match e.step().await {
            Ok(_) => continue,
            Err(error) => break error,
        }
    };
    assert!(matches!(error, RunError::RankGone { rank: 0 }), "{error}");
    assert!(clock.slept.lock().unwrap().contains(&RANK_CHECK));
    assert!(wall.elapsed() < RANK_CHECK / 2, "{:?}", wall.elapsed());
    e.stop().await;
}

// Protects the checks that make skipping already-checked blocks sound: a load retargeted into a
// block a running request has read (a block reused while a transfer writes it) stops the run,
// naming the block — the rank refuses the transfer, or catches the read of the wrong content.
#[test]
fn a_load_into_a_block_a_forward_reads_is_refused() {
    let c = small();
    let records = requests(&c).unwrap();
    let tampered = TamperSteps {
        inner: InProcess,
        fault: StepFault::LoadIntoReadBlock,
    };
    match run_with(&c, &records, &mut (), &tampered) {
        Err(RunError::Hazard { hazard, .. }) => {
            assert!(matches!(hazard, Hazard::LoadWhileRead { .. }), "{hazard:?}")
        }
        other => panic!("expected the load to be refused, got {other:?}"),
    }
    run(&c, &records, &mut ()).expect("the same workload, untampered, passes");
}

// Protects the same from the forward's side: a block handed to a second request while the first
// still reads it is refused at the second request's write, naming the reader.
#[test]
fn a_block_in_two_tables_is_refused_at_the_write() {
    let c = small();
    let records = requests(&c).unwrap();
    let tampered = TamperSteps {
        inner: InProcess,
        fault: StepFault::HandOutReadBlock,
    };
    match run_with(&c, &records, &mut (), &tampered) {
        Err(RunError::Hazard {
            hazard: Hazard::WriteWhileRead { reader: Some(r) },
            request,
            ..
        }) => assert_ne!(r, request),
        other => panic!("expected the write to be refused, got {other:?}"),
    }
}

// Protects "never a hang": loads whose completions never come back leave their requests waiting
// with nothing runnable; the run stops as stalled within about a second, naming them.
#[test]
fn lost_load_completions_are_a_named_stall_not_a_hang() {
    let c = small();
    let records = requests(&c).unwrap();
    let started = std::time::Instant::now();
    let lossy = DropLoadCompletions { inner: InProcess };
    match run_with(&c, &records, &mut (), &lossy) {
        Err(e @ RunError::Stalled { .. }) => {
            let RunError::Stalled { requests, .. } = &e else {
                unreachable!()
            };
            assert!(!requests.is_empty(), "{e}");
            assert!(e.to_string().contains("stuck"), "{e}");
        }
        other => panic!("expected a stall, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "stopped after {:?}",
        started.elapsed()
    );
}
