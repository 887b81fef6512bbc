//! I-22: what the aggregator emits does not depend on the order of ranks within a call, nor on
//! how the reports are split across calls (compat mode, fixed quorum).
//!
//! A scenario is a set of reports: per rank, which ids it finished sending and receiving (each
//! at most once per direction, as I-21 requires of workers), which of its loads failed (reported
//! together with the matching `finished_recving`, as connectors do), invalid blocks, worker
//! metadata and KV events, each with the step it arrives in when the reports are split. The same
//! scenario is delivered to fresh aggregators
//!
//! * in one call, ranks in order;
//! * in one call, ranks permuted: the output is the same (KV events as a multiset);
//! * split over up to 4 calls, ranks permuted differently in every call: the emitted ids,
//!   invalid blocks and folded metadata over all calls are the same, and so is the aggregator's
//!   final state. Where no id gets more than `quorum` reports (so no id is emitted twice, and a
//!   failure can only belong to the one count cycle), the number of emissions per id and the
//!   failed loads are the same too.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::{
    AggregatedOutput, Aggregator, BlockId, KvEvents, Meta, Mode, Rank, RequestId, SortedSet,
    WorkerOutput, merge,
};
use kvrelay_tests::laws::{config, kv_events_strategy, meta_strategy};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

const IDS: u32 = 6;

/// One rank's reports; `usize` = the call it arrives in when split.
#[derive(Clone, Debug)]
struct RankReports {
    send: Vec<(RequestId, usize)>,
    /// `(id, failed, call)`.
    recv: Vec<(RequestId, bool, usize)>,
    invalid: Vec<(BlockId, usize)>,
    meta: Option<(Meta, usize)>,
    events: Option<(KvEvents, usize)>,
}

#[derive(Clone, Debug)]
struct Scenario {
    quorum: u32,
    /// Number of calls when split.
    calls: usize,
    ranks: Vec<RankReports>,
    /// A rank permutation per split call, and one more for the single call.
    perms: Vec<Vec<usize>>,
}

fn rank_reports(calls: usize) -> impl Strategy<Value = RankReports> {
    (
        vec(option::weighted(0.5, 0..calls), IDS as usize),
        vec(
            option::weighted(0.5, (0..calls, proptest::bool::weighted(0.3))),
            IDS as usize,
        ),
        vec((0u64..8, 0..calls), 0..3),
        option::of((meta_strategy(), 0..calls)),
        option::weighted(0.4, (kv_events_strategy(3), 0..calls)),
    )
        .prop_map(|(send, recv, invalid, meta, events)| RankReports {
            send: (0u32..)
                .zip(send)
                .filter_map(|(id, call)| call.map(|c| (RequestId(id), c)))
                .collect(),
            recv: (0u32..)
                .zip(recv)
                .filter_map(|(id, x)| x.map(|(c, failed)| (RequestId(id), failed, c)))
                .collect(),
            invalid: invalid.into_iter().map(|(b, c)| (BlockId(b), c)).collect(),
            meta,
            events,
        })
}

fn scenarios() -> impl Strategy<Value = Scenario> {
    (1u32..=4, 1usize..=4, 1usize..=4).prop_flat_map(|(quorum, world, calls)| {
        let identity: Vec<usize> = (0..world).collect();
        (
            vec(rank_reports(calls), world),
            vec(Just(identity).prop_shuffle(), calls + 1),
        )
            .prop_map(move |(ranks, perms)| Scenario {
                quorum,
                calls,
                ranks,
                perms,
            })
    })
}

impl Scenario {
    /// Without load failures.
    fn without_failures(mut self) -> Self {
        for r in &mut self.ranks {
            for x in &mut r.recv {
                x.1 = false;
            }
        }
        self
    }

    /// Keeps, per direction and id, the reports of the first `quorum` ranks only.
    fn at_most_quorum_reports(mut self) -> Self {
        let q = self.quorum as usize;
        let (mut sends, mut recvs) = (BTreeMap::<RequestId, usize>::new(), BTreeMap::new());
        for r in &mut self.ranks {
            r.send.retain(|&(id, _)| {
                let n = sends.entry(id).or_default();
                *n += 1;
                *n <= q
            });
            r.recv.retain(|&(id, _, _)| {
                let n = recvs.entry(id).or_insert(0usize);
                *n += 1;
                *n <= q
            });
        }
        self
    }

    /// Rank `r`'s output in call `call` (`None`: every report, the single-call delivery).
    fn output(&self, r: usize, call: Option<usize>) -> Option<WorkerOutput> {
        let here = |c: usize| call.is_none_or(|k| k == c);
        let rr = &self.ranks[r];
        let send: SortedSet<RequestId> =
            rr.send.iter().filter(|x| here(x.1)).map(|x| x.0).collect();
        let recv: SortedSet<RequestId> =
            rr.recv.iter().filter(|x| here(x.2)).map(|x| x.0).collect();
        let o = WorkerOutput {
            finished_sending: (!send.is_empty()).then_some(send),
            finished_recving: (!recv.is_empty()).then_some(recv),
            failed_recving: rr
                .recv
                .iter()
                .filter(|x| x.1 && here(x.2))
                .map(|x| x.0)
                .collect(),
            invalid_block_ids: rr
                .invalid
                .iter()
                .filter(|x| here(x.1))
                .map(|x| x.0)
                .collect(),
            expected_finished_count: 0,
            worker_meta: rr.meta.clone().filter(|m| here(m.1)).map(|m| m.0),
            kv_events: rr.events.clone().filter(|e| here(e.1)).map(|e| e.0),
        };
        (!o.is_empty()).then_some(o)
    }

    /// The outputs of one call, rank `r` at position `perm[r]`; position 0 (the output rank)
    /// always has an output.
    fn outputs(&self, call: Option<usize>, perm: &[usize]) -> Vec<Option<WorkerOutput>> {
        let mut outputs = vec![None; self.ranks.len()];
        for r in 0..self.ranks.len() {
            outputs[perm[r]] = self.output(r, call);
        }
        outputs[0].get_or_insert_with(WorkerOutput::default);
        outputs
    }
}

/// What a delivery emitted over all its calls, and the aggregator it left.
#[derive(Debug, PartialEq)]
struct Totals {
    /// Emissions per id.
    sent: BTreeMap<RequestId, usize>,
    recvd: BTreeMap<RequestId, usize>,
    failed: BTreeMap<RequestId, usize>,
    invalid: BTreeSet<BlockId>,
    meta: Option<Meta>,
    end: Aggregator,
}

impl Totals {
    fn new(quorum: u32) -> Self {
        Self {
            sent: BTreeMap::new(),
            recvd: BTreeMap::new(),
            failed: BTreeMap::new(),
            invalid: BTreeSet::new(),
            meta: None,
            end: Aggregator::new(quorum, Mode::Compat),
        }
    }

    fn call(&mut self, outputs: &[Option<WorkerOutput>]) -> AggregatedOutput {
        let out = self
            .end
            .aggregate(outputs, Rank(0))
            .expect("compatible metadata")
            .expect("the output rank has an output");
        self.end.check_invariants().unwrap();
        let count = |m: &mut BTreeMap<RequestId, usize>, ids: Option<&SortedSet<RequestId>>| {
            for &id in ids.into_iter().flatten() {
                *m.entry(id).or_default() += 1;
            }
        };
        count(&mut self.sent, out.finished_sending.as_ref());
        count(&mut self.recvd, out.finished_recving.as_ref());
        count(&mut self.failed, Some(&out.failed_recving));
        self.invalid.extend(out.invalid_block_ids.iter().copied());
        self.meta = merge(self.meta.take(), out.worker_meta.clone()).expect("compatible metadata");
        out
    }

    fn single(s: &Scenario, perm: &[usize]) -> (Self, AggregatedOutput) {
        let mut t = Self::new(s.quorum);
        let out = t.call(&s.outputs(None, perm));
        (t, out)
    }

    fn split(s: &Scenario) -> Self {
        let mut t = Self::new(s.quorum);
        for k in 0..s.calls {
            t.call(&s.outputs(Some(k), &s.perms[k]));
        }
        t
    }
}

/// KV events compare as a multiset.
fn normalized(mut out: AggregatedOutput) -> AggregatedOutput {
    out.kv_events = out.kv_events.map(KvEvents::normalized);
    out
}

proptest! {
    #![proptest_config(config())]

    /// Rank order within one call changes nothing: same output, same state after.
    #[test]
    fn rank_order_within_a_call_does_not_matter(s in scenarios()) {
        let identity: Vec<usize> = (0..s.ranks.len()).collect();
        let (a, out_a) = Totals::single(&s, &identity);
        let (b, out_b) = Totals::single(&s, &s.perms[s.calls]);
        prop_assert_eq!(normalized(out_a), normalized(out_b));
        prop_assert_eq!(a, b);
    }

    /// Splitting the reports over calls (ranks permuted in each) emits the same ids, invalid
    /// blocks and metadata, and leaves the same aggregator. (Without load failures: with more
    /// than `quorum` reports, whether a failure joins the first count cycle depends on the
    /// split, by design of §4.1.)
    #[test]
    fn splitting_reports_over_calls_does_not_change_what_is_emitted(
        s in scenarios().prop_map(Scenario::without_failures)
    ) {
        let identity: Vec<usize> = (0..s.ranks.len()).collect();
        let (one, _) = Totals::single(&s, &identity);
        let split = Totals::split(&s);
        let keys = |m: &BTreeMap<RequestId, usize>| m.keys().copied().collect::<Vec<_>>();
        prop_assert_eq!(keys(&one.sent), keys(&split.sent));
        prop_assert_eq!(keys(&one.recvd), keys(&split.recvd));
        prop_assert_eq!(&one.invalid, &split.invalid);
        prop_assert_eq!(&one.meta, &split.meta);
        prop_assert_eq!(&one.end, &split.end);
    }

    /// With at most `quorum` reports per id, everything emitted is the same, emission counts
    /// and load failures included.
    #[test]
    fn splitting_at_most_quorum_reports_changes_nothing(
        s in scenarios().prop_map(Scenario::at_most_quorum_reports)
    ) {
        let identity: Vec<usize> = (0..s.ranks.len()).collect();
        let (one, _) = Totals::single(&s, &identity);
        let split = Totals::split(&s);
        prop_assert!(one.sent.values().chain(one.recvd.values()).all(|&n| n == 1));
        prop_assert_eq!(one, split);
    }
}

/// The properties above are not vacuous: in a fixed scenario reports are split, emitted and
/// failed (SEMANTICS.md S2's quorum 2 with the acks of one id in different calls).
#[test]
fn a_split_ack_is_emitted_once_in_the_call_that_completes_it() {
    let s = Scenario {
        quorum: 2,
        calls: 2,
        ranks: vec![
            RankReports {
                send: vec![(RequestId(1), 0)],
                recv: vec![(RequestId(2), true, 1)],
                invalid: vec![(BlockId(4), 0)],
                meta: None,
                events: None,
            },
            RankReports {
                send: vec![(RequestId(1), 1)],
                recv: vec![(RequestId(2), false, 0)],
                invalid: vec![(BlockId(5), 1)],
                meta: None,
                events: None,
            },
        ],
        perms: vec![vec![1, 0], vec![0, 1], vec![1, 0]],
    };
    let (one, _) = Totals::single(&s, &[0, 1]);
    let split = Totals::split(&s);
    let once = |id: u32| BTreeMap::from([(RequestId(id), 1)]);
    assert_eq!(split.sent, once(1));
    assert_eq!(split.recvd, once(2));
    assert_eq!(split.failed, once(2));
    assert_eq!(split.invalid, BTreeSet::from([BlockId(4), BlockId(5)]));
    assert_eq!(one, split);
}
