//! The worker-metadata law suite, and proptest strategies for kvrelay's own types.
//!
//! # The law suite
//!
//! The [`kvrelay_core::Aggregator`] folds the ranks' worker metadata with
//! [`WorkerMeta::merge_from`]. For the result not to depend on rank order or on how the fold is
//! grouped (SEMANTICS.md I-25), `Option<M>` under [`kvrelay_core::merge`] must be a commutative
//! monoid with `None` as identity, and a failed merge must fail whichever way round it is done
//! and leave the receiver untouched (the aggregator rejects a whole step on a mismatch).
//!
//! **An engine with its own worker-metadata type calls [`check_worker_meta_laws`] in its own
//! tests**, with a proptest strategy for its type:
//!
//! ```
//! use kvrelay_core::{MetaMismatch, WorkerMeta};
//! use proptest::prelude::*;
//!
//! /// The highest offset any rank has flushed.
//! #[derive(Clone, Debug, Eq, PartialEq)]
//! struct MaxWatermark(u64);
//!
//! impl WorkerMeta for MaxWatermark {
//!     fn merge_from(&mut self, other: &Self) -> Result<(), MetaMismatch> {
//!         self.0 = self.0.max(other.0);
//!         Ok(())
//!     }
//! }
//!
//! kvrelay_tests::laws::check_worker_meta_laws((0u64..100).prop_map(MaxWatermark));
//! ```
//!
//! It runs [`config().cases`](config) random triples `(a, b, c)` of `Option<M>` (drawn from the
//! strategy, `None` with probability 0.15) through [`check_laws_on`] and panics on the first
//! broken [`Law`], with proptest's minimal failing triple in the message.
//!
//! # Configuration and determinism
//!
//! [`config`] is proptest's default configuration, environment included (`PROPTEST_CASES`,
//! `PROPTEST_RNG_SEED`, `PROPTEST_MAX_SHRINK_ITERS`, …), except that without `PROPTEST_RNG_SEED`
//! the seed is [`DEFAULT_SEED`] rather than random, and no failures are persisted to files: every
//! run checks the same cases unless the environment asks for others. Set `PROPTEST_RNG_SEED` to
//! explore new cases (a nightly job, say); a failure reproduces with the seed it prints.
//!
//! # Strategies
//!
//! [`meta_strategy`] and [`meta_with_shape`] generate [`Meta`] values that are all mergeable with
//! one another; [`any_meta_strategy`] mixes forms and tuple lengths, so that mismatches occur.
//! [`arb_worker_output`], [`arb_worker_output_with`] and [`arb_outputs`] generate one rank's
//! [`WorkerOutput`] and one step's outputs for aggregator tests; [`AggregatorCall`] is one call of
//! a generated aggregator run.

use std::any::type_name;
use std::fmt;

use kvrelay_core::{
    BlockId, JobId, KvEvent, KvEvents, Meta, OffloadMeta, Rank, RequestId, SortedSet, WorkerMeta,
    WorkerOutput, merge,
};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

/// The RNG seed [`config`] uses when `PROPTEST_RNG_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x6b76_7265_6c61_7901;

/// Probability that one operand of a law check is `Some`.
const SOME_PROBABILITY: f64 = 0.85;

/// Proptest's default configuration with the environment applied (`PROPTEST_CASES` and the other
/// `PROPTEST_*` variables), a fixed seed ([`DEFAULT_SEED`]) unless `PROPTEST_RNG_SEED` is set,
/// and no failure persistence.
///
/// Use it as `#![proptest_config(kvrelay_tests::laws::config())]` for reproducible property
/// tests.
pub fn config() -> Config {
    let mut config = Config {
        failure_persistence: None,
        ..Config::default()
    };
    if config.rng_seed == RngSeed::Random {
        config.rng_seed = RngSeed::Fixed(DEFAULT_SEED);
    }
    config
}

/// One law of the worker-metadata monoid, as checked by [`check_laws_on`].
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Law {
    /// `None ⊕ a = a`.
    LeftIdentity,
    /// `a ⊕ None = a`.
    RightIdentity,
    /// `a ⊕ b` fails iff `b ⊕ a` fails.
    SymmetricErrors,
    /// `a ⊕ b = b ⊕ a` where both succeed.
    Commutativity,
    /// `(a ⊕ b) ⊕ c = a ⊕ (b ⊕ c)`, and one side fails iff the other does.
    Associativity,
    /// A failed `x.merge_from(y)` leaves `x` unchanged.
    UnchangedOnError,
}

impl Law {
    /// The law's name, as used in failure messages.
    pub fn name(self) -> &'static str {
        match self {
            Law::LeftIdentity => "left identity (None ⊕ a = a)",
            Law::RightIdentity => "right identity (a ⊕ None = a)",
            Law::SymmetricErrors => "symmetric errors (a ⊕ b fails iff b ⊕ a fails)",
            Law::Commutativity => "commutativity (a ⊕ b = b ⊕ a)",
            Law::Associativity => "associativity ((a ⊕ b) ⊕ c = a ⊕ (b ⊕ c))",
            Law::UnchangedOnError => {
                "unchanged on error (a failed merge_from leaves self as it was)"
            }
        }
    }
}

impl fmt::Display for Law {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A law that a concrete triple breaks.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct LawViolation {
    /// The broken law.
    pub law: Law,
    /// The operands and results that break it.
    pub detail: String,
}

impl fmt::Display for LawViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "law broken: {}: {}", self.law, self.detail)
    }
}

impl std::error::Error for LawViolation {}

fn violation(law: Law, detail: String) -> Result<(), LawViolation> {
    Err(LawViolation { law, detail })
}

/// Checks every [`Law`] on one triple of operands, returning the first one broken.
///
/// The laws are checked in the order identity, symmetric errors, commutativity, associativity,
/// unchanged-on-error; pairs are taken from all of `(a, b)`, `(a, c)` and `(b, c)` in both
/// orders, associativity on `(a, b, c)` as given.
pub fn check_laws_on<M: WorkerMeta>(
    a: &Option<M>,
    b: &Option<M>,
    c: &Option<M>,
) -> Result<(), LawViolation> {
    let m = |x: &Option<M>, y: &Option<M>| merge(x.clone(), y.clone());
    let operands = [a, b, c];
    for x in operands {
        let left = m(&None, x);
        if left != Ok(x.clone()) {
            return violation(Law::LeftIdentity, format!("None ⊕ {x:?} = {left:?}"));
        }
        let right = m(x, &None);
        if right != Ok(x.clone()) {
            return violation(Law::RightIdentity, format!("{x:?} ⊕ None = {right:?}"));
        }
    }
    let pairs = [(a, b), (a, c), (b, c)];
    for (x, y) in pairs {
        let (xy, yx) = (m(x, y), m(y, x));
        if xy.is_err() != yx.is_err() {
            return violation(
                Law::SymmetricErrors,
                format!("{x:?} ⊕ {y:?} = {xy:?}, but {y:?} ⊕ {x:?} = {yx:?}"),
            );
        }
        if let (Ok(xy), Ok(yx)) = (&xy, &yx)
            && xy != yx
        {
            return violation(
                Law::Commutativity,
                format!("{x:?} ⊕ {y:?} = {xy:?}, but {y:?} ⊕ {x:?} = {yx:?}"),
            );
        }
    }
    let ab = m(a, b);
    let left = ab.clone().and_then(|ab| merge(ab, c.clone()));
    let right = m(b, c).and_then(|bc| merge(a.clone(), bc));
    match (&left, &right) {
        (Ok(l), Ok(r)) if l == r => {}
        (Err(_), Err(_)) => {}
        _ => {
            return violation(
                Law::Associativity,
                format!(
                    "a = {a:?}, b = {b:?}, c = {c:?}: (a ⊕ b) ⊕ c = {left:?}, but a ⊕ (b ⊕ c) = {right:?}"
                ),
            );
        }
    }
    let mut receivers: Vec<(M, &M)> = Vec::new();
    for (x, y) in pairs {
        if let (Some(x), Some(y)) = (x, y) {
            receivers.push((x.clone(), y));
            receivers.push((y.clone(), x));
        }
    }
    if let (Ok(Some(ab)), Some(c)) = (ab, c) {
        receivers.push((ab, c));
    }
    for (x, y) in receivers {
        let mut merged = x.clone();
        if let Err(e) = merged.merge_from(y)
            && merged != x
        {
            return violation(
                Law::UnchangedOnError,
                format!("{x:?}.merge_from({y:?}) failed with {e:?} but left self as {merged:?}"),
            );
        }
    }
    Ok(())
}

/// Checks the worker-metadata laws on random triples from `strategy`, with [`config`].
///
/// An engine with its own worker-metadata type calls this in its own tests (see the module
/// documentation). Checks, on `Option<M>` under [`kvrelay_core::merge`]: associativity,
/// commutativity, `None` as identity on both sides, symmetric errors (`a ⊕ b` fails iff `b ⊕ a`
/// fails; associativity also requires both groupings to fail or neither), and that
/// [`WorkerMeta::merge_from`] leaves `self` unchanged when it fails.
///
/// For the suite to say much, the strategy should produce values that often merge successfully
/// (and, if the type has a failure mode, some that do not).
///
/// # Panics
/// On the first broken law, with the law, the operands and results, and proptest's minimal
/// failing triple.
#[track_caller]
pub fn check_worker_meta_laws<M, S>(strategy: S)
where
    M: WorkerMeta + 'static,
    S: Strategy<Value = M>,
{
    check_worker_meta_laws_with(config(), strategy);
}

/// [`check_worker_meta_laws`] with an explicit proptest configuration.
///
/// # Panics
/// On the first broken law (see [`check_worker_meta_laws`]), or if proptest aborts.
#[track_caller]
pub fn check_worker_meta_laws_with<M, S>(config: Config, strategy: S)
where
    M: WorkerMeta + 'static,
    S: Strategy<Value = M>,
{
    let triples = (
        option::weighted(SOME_PROBABILITY, &strategy),
        option::weighted(SOME_PROBABILITY, &strategy),
        option::weighted(SOME_PROBABILITY, &strategy),
    );
    let mut runner = TestRunner::new(config);
    let outcome = runner.run(&triples, |(a, b, c)| {
        check_laws_on(&a, &b, &c).map_err(|v| TestCaseError::fail(v.to_string()))
    });
    match outcome {
        Ok(()) => {}
        Err(TestError::Fail(reason, (a, b, c))) => panic!(
            "worker-metadata law suite failed for `{}`: {reason}\n\
             minimal failing input:\n  a = {a:?}\n  b = {b:?}\n  c = {c:?}",
            type_name::<M>()
        ),
        Err(TestError::Abort(reason)) => panic!(
            "worker-metadata law suite aborted for `{}`: {reason}",
            type_name::<M>()
        ),
    }
}

/// [`OffloadMeta`] values: up to 4 jobs out of `0..8` with counts mostly in `0..4` (sometimes
/// next to `u32::MAX`, to cover the wrapping count addition), and `bytes`/`transfers` mostly
/// small (sometimes next to `u64::MAX`, to cover saturation); some jobs marked failed (strict
/// workers). All are mergeable.
pub fn offload_meta_strategy() -> BoxedStrategy<OffloadMeta> {
    let count = prop_oneof![4 => 0u32..4, 1 => (u32::MAX - 2)..=u32::MAX];
    let stat = || prop_oneof![4 => 0u64..1_000, 1 => (u64::MAX - 2)..=u64::MAX];
    (
        vec((0u64..8, count), 0..5),
        vec(0u64..8, 0..2),
        stat(),
        stat(),
    )
        .prop_map(|(counts, failed, bytes, transfers)| {
            let mut meta = OffloadMeta::from_counts(counts.into_iter().map(|(j, n)| (JobId(j), n)));
            for j in failed {
                // Only a completed job can be failed: `mark_failed` also sets its count to 1.
                if meta.count(JobId(j)) > 0 {
                    meta.mark_failed(JobId(j));
                }
            }
            meta.bytes = bytes;
            meta.transfers = transfers;
            meta
        })
        .boxed()
}

/// `Meta::Set` values: subsets of `{k0, …, k5}`, up to 3 elements.
pub fn set_meta_strategy() -> BoxedStrategy<Meta> {
    vec(0u8..6, 0..4)
        .prop_map(|keys| Meta::Set(keys.into_iter().map(|k| format!("k{k}")).collect()))
        .boxed()
}

/// The form of a [`Meta`] value, down to the forms of a multi tuple's slots. Values of one shape
/// are all mergeable with one another.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum MetaShape {
    /// `Meta::Offload`.
    Offload,
    /// `Meta::Set`.
    Set,
    /// `Meta::Multi` with one slot per element (each slot `None` or of the given shape).
    Multi(Vec<MetaShape>),
}

impl MetaShape {
    /// A 3-slot multi tuple `(offload, set, (offload, set))`: every form, nesting included.
    pub fn standard() -> Self {
        MetaShape::Multi(vec![
            MetaShape::Offload,
            MetaShape::Set,
            MetaShape::Multi(vec![MetaShape::Offload, MetaShape::Set]),
        ])
    }
}

/// [`Meta`] values of one [`MetaShape`] (a multi slot is `None` half of the time).
pub fn meta_with_shape(shape: &MetaShape) -> BoxedStrategy<Meta> {
    match shape {
        MetaShape::Offload => offload_meta_strategy().prop_map(Meta::Offload).boxed(),
        MetaShape::Set => set_meta_strategy(),
        MetaShape::Multi(slots) => slots
            .iter()
            .map(|s| option::of(meta_with_shape(s)).boxed())
            .collect::<Vec<_>>()
            .prop_map(Meta::Multi)
            .boxed(),
    }
}

/// Compatible [`Meta`] values: offload metas, set metas and multi tuples of a fixed length, as
/// the slots of [`MetaShape::standard`]. Any two values merge successfully.
pub fn meta_strategy() -> BoxedStrategy<Meta> {
    meta_with_shape(&MetaShape::standard())
}

/// [`Meta`] values of mixed forms: offload, set, and multi tuples of 0 to 3 slots nested up to
/// twice. Many pairs do not merge (different forms or tuple lengths).
pub fn any_meta_strategy() -> BoxedStrategy<Meta> {
    let leaf = prop_oneof![
        offload_meta_strategy().prop_map(Meta::Offload),
        set_meta_strategy()
    ];
    leaf.prop_recursive(2, 16, 3, |inner| {
        vec(option::of(inner), 0..=3).prop_map(Meta::Multi)
    })
    .boxed()
}

/// The id spaces and rates of generated [`WorkerOutput`]s.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct OutputSpace {
    /// Request ids are drawn from `0..ids`.
    pub ids: u32,
    /// Block ids are drawn from `0..blocks`.
    pub blocks: u64,
    /// `expected_finished_count` is 0 three times in four, else in `1..=max` (always 0 if 0).
    pub max_expected_finished_count: u32,
    /// KV events are drawn from `e0..e{event_kinds}`; 0 = no output carries events.
    pub event_kinds: u8,
}

impl Default for OutputSpace {
    /// Ids `0..6`, blocks `0..8`, no quorum changes, events from 3 kinds.
    fn default() -> Self {
        Self {
            ids: 6,
            blocks: 8,
            max_expected_finished_count: 0,
            event_kinds: 3,
        }
    }
}

/// Subsets of the request ids `0..ids` (each id in with probability 0.4).
pub fn request_set(ids: u32) -> BoxedStrategy<SortedSet<RequestId>> {
    vec(proptest::bool::weighted(0.4), ids as usize)
        .prop_map(|mask| {
            (0u32..)
                .zip(mask)
                .filter_map(|(i, on)| on.then_some(RequestId(i)))
                .collect()
        })
        .boxed()
}

/// One worker's batch of 0 to 3 KV events (repeats possible) from `e0..e{kinds}`, contributor
/// count 1.
///
/// # Panics
/// If `kinds` is 0.
pub fn kv_events_strategy(kinds: u8) -> BoxedStrategy<KvEvents> {
    assert!(
        kinds > 0,
        "kv_events_strategy needs at least one event kind"
    );
    vec(0..kinds, 0..4)
        .prop_map(|ks| {
            KvEvents::from_worker(ks.into_iter().map(|k| KvEvent(format!("e{k}"))).collect())
        })
        .boxed()
}

/// One rank's [`WorkerOutput`] with worker metadata from `meta`: finished sets `None` three
/// times in ten, failures and invalid blocks present one time in four, events three times in ten.
pub fn arb_worker_output_with<M>(
    space: OutputSpace,
    meta: BoxedStrategy<Option<M>>,
) -> BoxedStrategy<WorkerOutput<M>>
where
    M: Clone + fmt::Debug + 'static,
{
    let finished = || option::weighted(0.7, request_set(space.ids));
    let failed = prop_oneof![3 => Just(SortedSet::new()), 1 => request_set(space.ids)];
    let invalid = if space.blocks == 0 {
        Just(SortedSet::new()).boxed()
    } else {
        prop_oneof![
            3 => Just(SortedSet::new()),
            1 => vec(0..space.blocks, 1..3).prop_map(|bs| bs.into_iter().map(BlockId).collect()),
        ]
        .boxed()
    };
    let expected = if space.max_expected_finished_count == 0 {
        Just(0).boxed()
    } else {
        prop_oneof![3 => Just(0), 1 => 1..=space.max_expected_finished_count].boxed()
    };
    let events = if space.event_kinds == 0 {
        Just(None).boxed()
    } else {
        option::weighted(0.3, kv_events_strategy(space.event_kinds)).boxed()
    };
    (
        finished(),
        finished(),
        invalid,
        failed,
        expected,
        meta,
        events,
    )
        .prop_map(
            |(
                finished_sending,
                finished_recving,
                invalid_block_ids,
                failed_recving,
                expected_finished_count,
                worker_meta,
                kv_events,
            )| WorkerOutput {
                finished_sending,
                finished_recving,
                invalid_block_ids,
                failed_recving,
                expected_finished_count,
                worker_meta,
                kv_events,
            },
        )
        .boxed()
}

/// One rank's [`WorkerOutput`] with `Meta::Offload` metadata half of the time (always mergeable).
pub fn arb_worker_output(space: OutputSpace) -> BoxedStrategy<WorkerOutput<Meta>> {
    let meta = option::of(offload_meta_strategy().prop_map(Meta::Offload)).boxed();
    arb_worker_output_with(space, meta)
}

/// One step's outputs, index = rank: `world` entries, each `None` one time in five.
pub fn arb_outputs<M>(
    world: usize,
    output: BoxedStrategy<WorkerOutput<M>>,
) -> BoxedStrategy<Vec<Option<WorkerOutput<M>>>>
where
    M: Clone + fmt::Debug + 'static,
{
    vec(option::weighted(0.8, output), world).boxed()
}

/// One call on an [`Aggregator`](kvrelay_core::Aggregator) in a generated run: aggregate one
/// step's outputs (index = rank) with an output rank, or salvage outputs for the next call.
#[derive(Clone, Debug)]
pub enum AggregatorCall<M = Meta> {
    /// `Aggregator::aggregate(outputs, output_rank)`.
    Aggregate {
        /// The ranks' outputs, index = rank.
        outputs: Vec<Option<WorkerOutput<M>>>,
        /// The rank whose output the call waits for.
        output_rank: Rank,
    },
    /// `Aggregator::salvage(outputs)`.
    Salvage {
        /// The ranks' outputs, index = rank.
        outputs: Vec<Option<WorkerOutput<M>>>,
    },
}
