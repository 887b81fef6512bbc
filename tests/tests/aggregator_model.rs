//! I-21 (and I-23, I-24, I-26, I-27, §2.6 salvage) against a deliberately naive reference model.
//!
//! [`NaiveAggregator`] follows the prose of SEMANTICS.md §4.1 line by line, with ordered maps
//! instead of dense tables and an explicit list of reporters per count cycle instead of a
//! remaining count: a cycle opens with the quorum in force at its first report and closes (the
//! id is emitted) when it holds that many reports. In strict mode a rank already in the open
//! cycle's list is a duplicate and rejects the call.
//!
//! A proptest state machine drives random `Aggregate` / `Salvage` transitions (quorum and world
//! size 1..=4, request ids 0..6, quorum changes through `expected_finished_count`, `None`
//! outputs, any output rank, an out-of-range rank now and then, an occasional metadata mismatch)
//! through the real [`Aggregator`] and the model, and asserts the same result for every call, the
//! same observable state after it, and `check_invariants()`.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;

use kvrelay_core::{
    AggregateError, AggregatedOutput, Aggregator, Direction, KvEvents, Meta, Mode, Rank, RequestId,
    SortedSet, WorkerOutput, merge,
};
use kvrelay_tests::build::ids;
use kvrelay_tests::laws::{
    AggregatorCall, OutputSpace, arb_outputs, arb_worker_output_with, config,
    offload_meta_strategy, set_meta_strategy,
};
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

/// Request ids are drawn from `0..IDS`.
const IDS: u32 = 6;

/// An open count cycle of one (direction, id): the quorum in force when it opened, and every
/// report since, in order.
#[derive(Clone, Debug)]
struct Cycle {
    quorum: u32,
    reporters: Vec<Rank>,
}

/// `KVOutputAggregator`, as SEMANTICS.md §4.1 tells it.
#[derive(Clone, Debug)]
struct NaiveAggregator {
    mode: Mode,
    quorum: u32,
    send: BTreeMap<RequestId, Cycle>,
    recv: BTreeMap<RequestId, Cycle>,
    failed_pending: BTreeSet<RequestId>,
    salvaged: Vec<(Rank, WorkerOutput)>,
}

type CallResult = Result<Option<AggregatedOutput>, AggregateError>;

impl NaiveAggregator {
    fn new(quorum: u32, mode: Mode) -> Self {
        Self {
            mode,
            quorum,
            send: BTreeMap::new(),
            recv: BTreeMap::new(),
            failed_pending: BTreeSet::new(),
            salvaged: Vec::new(),
        }
    }

    /// The reports `id` still needs in `direction`, if a cycle is open.
    fn remaining(&self, direction: Direction, id: RequestId) -> Option<u32> {
        let cycles = match direction {
            Direction::Send => &self.send,
            Direction::Recv => &self.recv,
        };
        cycles
            .get(&id)
            .map(|c| c.quorum - u32::try_from(c.reporters.len()).unwrap())
    }

    /// §2.6: outputs of a failed step, kept for the next aggregate without their KV events.
    fn salvage(&mut self, outputs: &[Option<WorkerOutput>]) {
        for (rank, output) in outputs.iter().enumerate() {
            if let Some(output) = output {
                let mut output = output.clone();
                output.kv_events = None;
                self.salvaged.push((Rank(rank as u32), output));
            }
        }
    }

    /// §4.1, steps 1 to 5. A rejected call changes nothing.
    fn aggregate(&mut self, outputs: &[Option<WorkerOutput>], output_rank: Rank) -> CallResult {
        // 1. No output at output_rank: nothing happens.
        match outputs.get(output_rank.0 as usize) {
            None => {
                return Err(AggregateError::RankOutOfRange {
                    output_rank,
                    ranks: outputs.len(),
                });
            }
            Some(None) => return Ok(None),
            Some(Some(_)) => {}
        }
        // Work on a copy; commit only if the whole call succeeds.
        let mut next = self.clone();
        // 2. Salvaged outputs first, then the outputs in rank order, skipping None.
        let mut sources: Vec<(Rank, WorkerOutput)> = std::mem::take(&mut next.salvaged);
        for (rank, output) in outputs.iter().enumerate() {
            if let Some(output) = output {
                sources.push((Rank(rank as u32), output.clone()));
            }
        }
        let mut sent = BTreeSet::new();
        let mut recvd = BTreeSet::new();
        let mut invalid = BTreeSet::new();
        let mut worker_meta: Option<Meta> = None;
        let mut kv_events: Option<KvEvents> = None;
        // 3e. Worker meta: a left fold over the outputs in order. kvrelay folds it before
        //     counting anything, so that a mismatch is reported even where strict mode would
        //     also find a duplicate report (vLLM has no duplicate error, so the order is moot
        //     in compat mode).
        for (_, x) in &sources {
            worker_meta = merge(worker_meta, x.worker_meta.clone())?;
        }
        // 3. Each output in order.
        for (rank, x) in &sources {
            // a. a new quorum before this output's sets are counted.
            if x.expected_finished_count > 0 {
                next.quorum = x.expected_finished_count;
            }
            // b, c. count the reports.
            let quorum = next.quorum;
            let strict = next.mode == Mode::Strict;
            for (direction, ids, cycles, emitted) in [
                (
                    Direction::Send,
                    &x.finished_sending,
                    &mut next.send,
                    &mut sent,
                ),
                (
                    Direction::Recv,
                    &x.finished_recving,
                    &mut next.recv,
                    &mut recvd,
                ),
            ] {
                for &id in ids.iter().flatten() {
                    let cycle = cycles.entry(id).or_insert(Cycle {
                        quorum,
                        reporters: Vec::new(),
                    });
                    if strict && cycle.reporters.contains(rank) {
                        return Err(AggregateError::DuplicateReport {
                            rank: *rank,
                            request: id,
                            direction,
                        });
                    }
                    cycle.reporters.push(*rank);
                    if cycle.reporters.len() == cycle.quorum as usize {
                        cycles.remove(&id);
                        emitted.insert(id);
                    }
                }
            }
            // f. events: the first batch as is, then append and one more contributor per batch.
            if let Some(ev) = &x.kv_events {
                match &mut kv_events {
                    None => kv_events = Some(ev.clone()),
                    Some(acc) => {
                        acc.events.extend(ev.events.iter().cloned());
                        acc.workers = acc.workers.checked_add(1).unwrap();
                    }
                }
            }
            // g. invalid blocks: union; failed loads: pending.
            invalid.extend(x.invalid_block_ids.iter().copied());
            next.failed_pending.extend(x.failed_recving.iter().copied());
        }
        // 4. failed = pending ∩ finished_recving of this call.
        let failed: BTreeSet<RequestId> =
            next.failed_pending.intersection(&recvd).copied().collect();
        for id in &failed {
            next.failed_pending.remove(id);
        }
        *self = next;
        // 5. The aggregated output.
        let set_or_none = |s: BTreeSet<RequestId>| {
            (!s.is_empty()).then(|| s.into_iter().collect::<SortedSet<_>>())
        };
        Ok(Some(AggregatedOutput {
            finished_sending: set_or_none(sent),
            finished_recving: set_or_none(recvd),
            invalid_block_ids: invalid.into_iter().collect(),
            failed_recving: failed.into_iter().collect(),
            worker_meta,
            kv_events,
            expected_finished_count: self.quorum,
        }))
    }
}

/// The reference state: the model, the world size transitions are generated for, and the result
/// of the last call (for the real aggregator to be compared with).
#[derive(Clone, Debug)]
struct RefState {
    model: NaiveAggregator,
    world: usize,
    /// The real aggregator runs twice: built with `new`, and with `with_capacity(presize)`.
    presize: usize,
    last: Option<CallResult>,
}

/// Offload metadata (always mergeable), or none; with `mismatch`, a set now and then.
fn meta(mismatch: bool) -> BoxedStrategy<Option<Meta>> {
    let offload = || offload_meta_strategy().prop_map(|m| Some(Meta::Offload(m)));
    if mismatch {
        prop_oneof![10 => Just(None), 9 => offload(), 1 => set_meta_strategy().prop_map(Some)]
            .boxed()
    } else {
        prop_oneof![Just(None), offload()].boxed()
    }
}

/// One step's outputs. Event batches come with 1 or 2 contributors, so that the aggregator's
/// "+1 per further batch" is told apart from "+ the batch's count".
fn outputs(world: usize, mismatch: bool) -> BoxedStrategy<Vec<Option<WorkerOutput>>> {
    let space = OutputSpace {
        ids: IDS,
        blocks: 8,
        max_expected_finished_count: 4,
        event_kinds: 3,
    };
    let output = (arb_worker_output_with(space, meta(mismatch)), 1u32..=2)
        .prop_map(|(mut o, workers)| {
            if let Some(ev) = &mut o.kv_events {
                ev.workers = NonZeroU32::new(workers).unwrap();
            }
            o
        })
        .boxed();
    arb_outputs(world, output)
}

/// Aggregates (output rank out of range one time in 13) and salvages. Salvaged outputs never
/// carry mismatching metadata: it would stay in the stash and reject every later call.
fn transitions(world: usize) -> BoxedStrategy<AggregatorCall> {
    let ranks = world as u32;
    let output_rank = prop_oneof![12 => 0..ranks, 1 => Just(ranks)].prop_map(Rank);
    prop_oneof![
        4 => (outputs(world, true), output_rank)
            .prop_map(|(outputs, output_rank)| AggregatorCall::Aggregate { outputs, output_rank }),
        1 => outputs(world, false).prop_map(|outputs| AggregatorCall::Salvage { outputs }),
    ]
    .boxed()
}

fn init(mode: Mode) -> BoxedStrategy<RefState> {
    (1u32..=4, 1usize..=4, 0usize..10)
        .prop_map(move |(quorum, world, presize)| RefState {
            model: NaiveAggregator::new(quorum, mode),
            world,
            presize,
            last: None,
        })
        .boxed()
}

fn apply_ref(mut state: RefState, t: &AggregatorCall) -> RefState {
    state.last = match t {
        AggregatorCall::Aggregate {
            outputs,
            output_rank,
        } => Some(state.model.aggregate(outputs, *output_rank)),
        AggregatorCall::Salvage { outputs } => {
            state.model.salvage(outputs);
            None
        }
    };
    state
}

/// The real aggregator, built with `new` and with `with_capacity`.
type Sut = (Aggregator, Aggregator);

fn init_sut(state: &RefState, mode: Mode) -> Sut {
    let quorum = state.model.quorum;
    (
        Aggregator::new(quorum, mode),
        Aggregator::with_capacity(quorum, mode, state.presize),
    )
}

/// Runs `t` on the real aggregators and compares them with the model's result.
fn apply_sut((mut sut, mut presized): Sut, state: &RefState, t: AggregatorCall) -> Sut {
    match t {
        AggregatorCall::Aggregate {
            outputs,
            output_rank,
        } => {
            let before = sut.clone();
            let got = sut.aggregate(&outputs, output_rank);
            let want = state.last.as_ref().expect("the model ran the call");
            assert_eq!(&got, want, "aggregate({outputs:?}, {output_rank:?})");
            assert_eq!(&presized.aggregate(&outputs, output_rank), want, "presized");
            if !matches!(got, Ok(Some(_))) {
                // I-27 and "a rejected call changes nothing".
                assert_eq!(sut, before, "a call without result changed the aggregator");
            }
        }
        AggregatorCall::Salvage { outputs } => {
            sut.salvage(outputs.clone());
            presized.salvage(outputs);
        }
    }
    // Pre-sizing is capacity, not state: equal, and equal hashes (the model checker relies on
    // both).
    assert_eq!(sut, presized, "pre-sized aggregator differs");
    assert_eq!(
        hash(&sut),
        hash(&presized),
        "pre-sized aggregator hashes differently"
    );
    (sut, presized)
}

fn hash(a: &Aggregator) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    a.hash(&mut h);
    h.finish()
}

/// The observable state agrees with the model, and the invariants hold.
fn check_sut((sut, _): &Sut, state: &RefState) {
    if let Err(v) = sut.check_invariants() {
        panic!("{v}");
    }
    let model = &state.model;
    assert_eq!(sut.quorum(), model.quorum, "quorum");
    assert_eq!(sut.mode(), model.mode, "mode");
    assert_eq!(sut.salvaged_len(), model.salvaged.len(), "salvaged outputs");
    for id in (0..IDS).map(RequestId) {
        for d in [Direction::Send, Direction::Recv] {
            assert_eq!(
                sut.remaining(d, id),
                model.remaining(d, id),
                "remaining {d:?} {id}"
            );
        }
        let idle = model.remaining(Direction::Send, id).is_none()
            && model.remaining(Direction::Recv, id).is_none()
            && !model.failed_pending.contains(&id);
        assert_eq!(sut.is_idle(id), idle, "is_idle({id})");
    }
}

/// The naive model, in strict mode if `STRICT`, else in compat mode.
struct NaiveModel<const STRICT: bool>;

fn mode(strict: bool) -> Mode {
    if strict { Mode::Strict } else { Mode::Compat }
}

impl<const STRICT: bool> ReferenceStateMachine for NaiveModel<STRICT> {
    type State = RefState;
    type Transition = AggregatorCall;
    fn init_state() -> BoxedStrategy<RefState> {
        init(mode(STRICT))
    }
    fn transitions(state: &RefState) -> BoxedStrategy<AggregatorCall> {
        transitions(state.world)
    }
    fn apply(state: RefState, t: &AggregatorCall) -> RefState {
        apply_ref(state, t)
    }
}

/// The real aggregators against [`NaiveModel`] in the same mode.
struct RealAggregator<const STRICT: bool>;

impl<const STRICT: bool> StateMachineTest for RealAggregator<STRICT> {
    type SystemUnderTest = Sut;
    type Reference = NaiveModel<STRICT>;
    fn init_test(state: &RefState) -> Sut {
        init_sut(state, mode(STRICT))
    }
    fn apply(sut: Sut, state: &RefState, t: AggregatorCall) -> Sut {
        apply_sut(sut, state, t)
    }
    fn check_invariants(sut: &Sut, state: &RefState) {
        check_sut(sut, state);
    }
}

type CompatAggregator = RealAggregator<false>;
type StrictAggregator = RealAggregator<true>;

prop_state_machine! {
    #![proptest_config(config())]

    /// I-21 in compat mode (vLLM 0.33.0 exactly), against the naive model.
    #[test]
    fn compat_aggregator_matches_the_naive_model(sequential 1..40 => CompatAggregator);

    /// The same in strict mode: the model rejects a rank's second report in one cycle.
    #[test]
    fn strict_aggregator_matches_the_naive_model(sequential 1..40 => StrictAggregator);
}

/// The model is not vacuous: on a fixed run it emits, rejects, fails, salvages and changes the
/// quorum, and the real aggregator agrees (SEMANTICS.md S2 plus a strict duplicate).
#[test]
fn the_model_reproduces_scenario_s2_and_a_strict_duplicate() {
    let out = |send: &[u32], recv: &[u32], invalid: &[u64], failed: &[u32]| {
        Some(WorkerOutput {
            finished_sending: (!send.is_empty()).then(|| ids(send)),
            finished_recving: (!recv.is_empty()).then(|| ids(recv)),
            invalid_block_ids: invalid.iter().copied().map(kvrelay_core::BlockId).collect(),
            failed_recving: ids(failed),
            ..WorkerOutput::default()
        })
    };
    let mut real: Aggregator = Aggregator::new(2, Mode::Compat);
    let mut model = NaiveAggregator::new(2, Mode::Compat);
    let steps = [
        [out(&[1], &[2], &[], &[]), out(&[], &[], &[1], &[])],
        [out(&[], &[], &[2], &[]), out(&[1], &[], &[], &[])],
        [out(&[], &[], &[3, 4], &[]), out(&[], &[2], &[4, 5], &[3])],
        [out(&[], &[3], &[], &[]), out(&[], &[3], &[], &[])],
    ];
    let mut results = Vec::new();
    for outputs in &steps {
        let want = model.aggregate(outputs, Rank(0));
        assert_eq!(real.aggregate(outputs, Rank(0)), want);
        let r = want.unwrap().unwrap();
        results.push((
            r.finished_sending,
            r.finished_recving,
            r.invalid_block_ids.into_vec(),
            r.failed_recving,
        ));
    }
    let b = |xs: &[u64]| {
        xs.iter()
            .copied()
            .map(kvrelay_core::BlockId)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        results,
        vec![
            (None, None, b(&[1]), ids(&[])),
            (Some(ids(&[1])), None, b(&[2]), ids(&[])),
            (None, Some(ids(&[2])), b(&[3, 4, 5]), ids(&[])),
            (None, Some(ids(&[3])), b(&[]), ids(&[3])),
        ]
    );

    let mut real: Aggregator = Aggregator::new(2, Mode::Strict);
    let mut model = NaiveAggregator::new(2, Mode::Strict);
    let step = [out(&[4], &[], &[], &[]), None];
    for _ in 0..2 {
        assert_eq!(
            real.aggregate(&step, Rank(0)),
            model.aggregate(&step, Rank(0))
        );
    }
    assert_eq!(
        model.aggregate(&step, Rank(0)),
        Err(AggregateError::DuplicateReport {
            rank: Rank(0),
            request: RequestId(4),
            direction: Direction::Send
        })
    );
}
