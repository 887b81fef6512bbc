//! Unit tests of the MultiConnector's private parts.

use super::*;
use crate::ids::BlockId;
use crate::ids::JobId;
use crate::scheduler::SchedulerConnector;
use crate::sorted_set::SortedSet;
use crate::worker::TransferCommand;
use crate::worker::TransferDone;
use crate::worker::TransferResults;
use crate::worker::WorkerConnector;
use crate::{ScriptedConnector, ScriptedWorker};

#[test]
fn check_invariants_rejects_corrupt_scheduler_state() {
    // Protects I-28 and I-29 as the model checker sees them: the public calls never build
    // these states, so only a corrupted connector shows that the check looks at all.
    let healthy = MultiConnector::new(alloc::vec![ScriptedConnector::quiet(); 2]).unwrap();
    assert_eq!(healthy.check_invariants(), Ok(()));
    let mut stray_loader = healthy.clone();
    stray_loader.loaders.insert(RequestId(1), 2);
    let e = stray_loader.check_invariants().unwrap_err();
    assert!(format!("{e:?}").contains("I-29"), "{e:?}");
    let mut zero_saves = healthy.clone();
    zero_saves.extra_async_saves.insert(RequestId(1), 0);
    let e = zero_saves.check_invariants().unwrap_err();
    assert!(format!("{e:?}").contains("I-28"), "{e:?}");
}

#[test]
fn a_boxed_connector_forwards_every_answer() {
    // Protects boxed children (heterogeneous MultiConnector children): a `Box<T>` answers
    // exactly what `T` answers, for every method, not only the defaults.
    let scheduler =
        crate::Scheduler::new(crate::SchedulerConfig::default(), crate::NoopConnector).unwrap();
    let view = scheduler.view();
    let mut inner = ScriptedConnector::quiet();
    inner.set_pending_block_frees(true);
    inner.set_push_work(true);
    inner.set_finished_count(Some(3));
    inner.set_requires_kv_delivery(true);
    let boxed = alloc::boxed::Box::new(inner);
    assert!(boxed.has_pending_block_frees(&view));
    assert!(boxed.has_pending_push_work());
    assert_eq!(boxed.get_finished_count(), Some(3));
    assert!(boxed.requires_kv_delivery());
    let mut plain = alloc::boxed::Box::new(ScriptedConnector::quiet());
    assert!(!plain.requires_kv_delivery());
    assert_eq!(
        plain.reset_cache(),
        ScriptedConnector::quiet().reset_cache()
    );
    assert_ne!(plain.reset_cache(), Some(false));
    let mut multi = MultiConnector::new(alloc::vec![ScriptedConnector::quiet()]).unwrap();
    multi.record(ConnectorError::FinishedCountConflict {
        counts: alloc::vec![1, 2],
    });
    let mut boxed = alloc::boxed::Box::new(multi);
    assert!(boxed.take_error().is_some());
    assert_eq!(boxed.take_error(), None, "reported once");
}

/// A worker connector that records every call and answers with values no default matches.
#[derive(Debug, Default)]
struct Recorder {
    calls: Vec<&'static str>,
    done: Vec<TransferDone>,
}

impl WorkerConnector for Recorder {
    type StepMeta = u32;
    type WorkerMeta = Meta;

    fn bind(&mut self, _meta: &u32) {
        self.calls.push("bind");
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        Vec::new()
    }
    fn handle_transfer_done(&mut self, done: TransferDone) {
        self.done.push(done);
    }
    fn get_transfer_results(&mut self, finished: &SortedSet<RequestId>) -> TransferResults {
        TransferResults {
            finished_sending: Some(finished.clone()),
            finished_recving: None,
            failed_recving: SortedSet::from_vec(alloc::vec![RequestId(9)]),
        }
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        SortedSet::from_vec(alloc::vec![BlockId(4), BlockId(7)])
    }
    fn build_connector_worker_meta(&mut self) -> Option<Meta> {
        Some(Meta::Set(SortedSet::from_vec(alloc::vec![
            "rank".to_string()
        ])))
    }
    fn clear(&mut self) {
        self.calls.push("clear");
    }
}

#[test]
fn a_boxed_worker_connector_forwards_every_call() {
    // Protects boxed worker children: a `Box<T>` forwards every hook to `T`.
    let mut boxed = alloc::boxed::Box::new(Recorder::default());
    boxed.bind(&1);
    let done = TransferDone {
        job: JobId(3),
        ok: false,
    };
    boxed.handle_transfer_done(done);
    let finished = SortedSet::from_vec(alloc::vec![RequestId(2)]);
    let results = boxed.get_transfer_results(&finished);
    assert_eq!(results.finished_sending, Some(finished));
    assert_eq!(results.failed_recving.as_slice(), &[RequestId(9)]);
    assert_eq!(
        boxed.get_block_ids_with_load_errors().as_slice(),
        &[BlockId(4), BlockId(7)]
    );
    assert!(matches!(
        boxed.build_connector_worker_meta(),
        Some(Meta::Set(_))
    ));
    boxed.clear();
    assert_eq!(boxed.calls, ["bind", "clear"]);
    assert_eq!(boxed.done, [done]);
}

#[test]
fn worker_check_invariants_rejects_corrupt_renumbering() {
    // Protects I-28 and the job renumbering's bijection, as the scheduler side's check above.
    let healthy = MultiWorker::new(alloc::vec![ScriptedWorker::new(); 2]);
    assert_eq!(healthy.check_invariants(), Ok(()));
    let mut zero_saves = healthy.clone();
    zero_saves.extra_async_saves.insert(RequestId(1), 0);
    assert!(format!("{:?}", zero_saves.check_invariants()).contains("I-28"));
    let mut one_way = healthy.clone();
    one_way.jobs.insert(JobId(0), (0, JobId(5)));
    assert!(
        one_way.check_invariants().is_err(),
        "outer job without its inverse"
    );
    let mut stray_child = healthy.clone();
    stray_child.jobs.insert(JobId(0), (2, JobId(5)));
    stray_child.outer.insert((2, JobId(5)), JobId(0));
    assert!(stray_child.check_invariants().is_err(), "child 2 of 2");
}
