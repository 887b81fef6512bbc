//! The scheduler-side [`EventAccumulator`] (SEMANTICS.md §4.5) against a naive reference, and the
//! whole event path (ranks → aggregator → accumulator) on one step.
//!
//! The reference keeps the accumulated events as a plain list and the contributor count as vLLM
//! does: no object before the first batch since the last take; the first batch's worker count is
//! taken as is; later batches append their events and add their worker count. A take returns,
//! once each and ascending, the events whose number of occurrences equals the contributor count,
//! and drops back to "no object".

use std::num::NonZeroU32;

use kvrelay_core::{Aggregator, EventAccumulator, KvEvent, KvEvents, Mode, Rank, WorkerOutput};
use kvrelay_tests::laws::config;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

#[derive(Clone, Debug, Default)]
struct NaiveAccumulator {
    pending: Option<(Vec<KvEvent>, u32)>,
}

impl NaiveAccumulator {
    fn update(&mut self, batch: Option<&KvEvents>) {
        let Some(batch) = batch else { return };
        match &mut self.pending {
            None => self.pending = Some((batch.events.clone(), batch.workers.get())),
            Some((events, workers)) => {
                events.extend(batch.events.iter().cloned());
                *workers += batch.workers.get();
            }
        }
    }

    fn take(&mut self) -> Vec<KvEvent> {
        let Some((events, workers)) = self.pending.take() else {
            return Vec::new();
        };
        let mut distinct = events.clone();
        distinct.sort();
        distinct.dedup();
        distinct
            .into_iter()
            .filter(|e| events.iter().filter(|x| *x == e).count() == workers as usize)
            .collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Update(Option<KvEvents>),
    Take,
}

fn event() -> impl Strategy<Value = KvEvent> {
    (0u8..3).prop_map(|k| KvEvent(format!("e{k}")))
}

/// An aggregated step's batch: 0 to 5 events (repeats possible), 1 to 4 contributors.
fn batch() -> impl Strategy<Value = KvEvents> {
    (vec(event(), 0..6), 1u32..=4).prop_map(|(events, workers)| KvEvents {
        events,
        workers: NonZeroU32::new(workers).unwrap(),
    })
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        1 => Just(Op::Update(None)),
        4 => batch().prop_map(|b| Op::Update(Some(b))),
        2 => Just(Op::Take),
    ];
    vec(op, 0..20)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn accumulator_matches_the_naive_reference(ops in ops()) {
        let mut acc = EventAccumulator::new();
        let mut naive = NaiveAccumulator::default();
        for op in ops {
            match op {
                Op::Update(batch) => {
                    let before = acc.clone();
                    acc.update(batch.as_ref());
                    naive.update(batch.as_ref());
                    if batch.is_none() {
                        prop_assert_eq!(&acc, &before, "update(None) changed the accumulator");
                    }
                }
                Op::Take => {
                    prop_assert_eq!(acc.take(), naive.take());
                    prop_assert_eq!(&acc, &EventAccumulator::new(), "take did not reset");
                }
            }
            if let Err(v) = acc.check_invariants() {
                prop_assert!(false, "{}", v);
            }
        }
        prop_assert_eq!(acc.take(), naive.take());
    }

    /// One step through the whole path: ranks report sets of events (or nothing); what the
    /// scheduler takes is exactly the events every *reporting* rank reported (§4.5 (a): ranks
    /// reporting `None` do not count).
    #[test]
    fn one_step_yields_the_events_common_to_the_reporting_ranks(
        ranks in vec(option::of(proptest::collection::btree_set(event(), 0..3)), 1..5)
    ) {
        let outputs: Vec<Option<WorkerOutput>> = ranks
            .iter()
            .map(|events| {
                Some(WorkerOutput {
                    kv_events: events
                        .as_ref()
                        .map(|e| KvEvents::from_worker(e.iter().cloned().collect())),
                    ..WorkerOutput::default()
                })
            })
            .collect();
        let mut agg: Aggregator = Aggregator::new(ranks.len() as u32, Mode::Compat);
        let out = agg.aggregate(&outputs, Rank(0)).unwrap().unwrap();
        let reporting: Vec<_> = ranks.iter().flatten().collect();
        prop_assert_eq!(
            out.kv_events.as_ref().map(|e| e.workers.get() as usize),
            (!reporting.is_empty()).then_some(reporting.len())
        );
        let mut acc = EventAccumulator::new();
        acc.update(out.kv_events.as_ref());
        let common: Vec<KvEvent> = match reporting.split_first() {
            None => Vec::new(),
            Some((first, rest)) => first
                .iter()
                .filter(|e| rest.iter().all(|r| r.contains(*e)))
                .cloned()
                .collect(),
        };
        prop_assert_eq!(acc.take(), common);
    }
}

#[test]
fn the_first_batch_count_is_taken_as_is_and_later_ones_add() {
    let ev = |xs: &[&str], workers: u32| KvEvents {
        events: xs.iter().map(|s| KvEvent(s.to_string())).collect(),
        workers: NonZeroU32::new(workers).unwrap(),
    };
    let mut acc = EventAccumulator::new();
    acc.update(Some(&ev(&["a", "a", "b"], 2)));
    acc.update(Some(&ev(&["a", "b"], 1)));
    // Contributors 3: "a" occurs 3 times, "b" twice.
    assert_eq!(acc.take(), vec![KvEvent("a".into())]);
    assert_eq!(acc.take(), Vec::<KvEvent>::new());
    // §4.5 (b): duplicates inside one batch look like reports by two ranks.
    acc.update(Some(&ev(&["c", "c"], 2)));
    assert_eq!(acc.take(), vec![KvEvent("c".into())]);
}
