//! Proptest runner loops for tests that cannot use the `proptest!` macro: random cases of a
//! strategy run by hand ([`check_cases`]), proptest state machines run against a reference model
//! with a case count of their own ([`run_state_machine`]), and the coverage counters that make
//! such a test fail when its checks never had anything to check ([`bump`], [`assert_reached`]).
//!
//! All of them run under [`crate::laws::config`] (a fixed seed unless `PROPTEST_RNG_SEED` is
//! set, no failure persistence), so a test produces the same cases as before it used them.
//!
//! A state-machine test keeps a `Stats` struct of counters (`Default + Clone + Debug`), bumps
//! them from its system under test with [`bump`], and ends like this:
//!
//! ```text
//! let stats: Stats = run_state_machine::<MyTest, Stats>(CASES, MAX_TRANSITIONS);
//! assert_reached(&stats, &[("preemptions", stats.preemptions), ("aborts", stats.aborts)]);
//! ```

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Debug;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest};

use crate::laws::config;

/// Runs `test` on [`config`]`().cases` values of `strategy` (shrinking a failure, as `proptest!`
/// does).
///
/// # Panics
/// With proptest's report of the minimal failing case, if a case fails.
pub fn check_cases<S: Strategy>(
    strategy: &S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let mut runner = TestRunner::new(config());
    if let Err(e) = runner.run(strategy, test) {
        panic!("{e}");
    }
}

/// Runs the state machine test `T` sequentially on `cases` cases (or on `PROPTEST_CASES` cases
/// if that is set, for longer local runs) of 1 to `max_transitions - 1` transitions, with
/// [`config`] otherwise. The coverage counters `S` start from `S::default()`; what the cases
/// [`bump`]ed is returned (and printed to stderr).
///
/// # Panics
/// With proptest's report of the minimal failing case, if a case fails.
pub fn run_state_machine<T, S>(cases: u32, max_transitions: usize) -> S
where
    T: StateMachineTest,
    S: Default + Debug + 'static,
{
    COVERAGE.with(|c| c.borrow_mut().remove(&TypeId::of::<S>()));
    let base = config();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .map_or(cases, |_| base.cases);
    let config = Config { cases, ..base };
    let mut runner = TestRunner::new(config.clone());
    let result = runner.run(
        &T::Reference::sequential_strategy(1..max_transitions),
        |(state, transitions, seen)| {
            T::test_sequential(config.clone(), state, transitions, seen);
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    let stats = COVERAGE
        .with(|c| c.borrow_mut().remove(&TypeId::of::<S>()))
        .map_or_else(S::default, |s| {
            *s.downcast::<S>()
                .expect("coverage counters are keyed by type")
        });
    eprintln!("{stats:#?}");
    stats
}

thread_local! {
    /// Coverage counters by type, per thread: proptest runs a test's cases on the test's thread.
    static COVERAGE: RefCell<HashMap<TypeId, Box<dyn Any>>> = RefCell::new(HashMap::new());
}

/// Updates this thread's coverage counters of type `S` (starting from `S::default()`).
///
/// A test file wraps it once for its own counters, so that call sites need no type annotation:
/// `fn bump(f: impl FnOnce(&mut Stats)) { kvrelay_tests::runner::bump(f) }`.
pub fn bump<S: Default + 'static>(f: impl FnOnce(&mut S)) {
    COVERAGE.with(|c| {
        let mut c = c.borrow_mut();
        let s = c
            .entry(TypeId::of::<S>())
            .or_insert_with(|| Box::new(S::default()));
        f(s.downcast_mut()
            .expect("coverage counters are keyed by type"));
    });
}

/// Asserts that every counter of `counters` (a name and a count) is positive: the cases reached
/// every path the test's checks are about, so they did not pass vacuously.
///
/// # Panics
/// Naming the first path no case reached, with all of `stats`.
#[track_caller]
pub fn assert_reached(stats: &impl Debug, counters: &[(&str, u64)]) {
    for (what, n) in counters {
        assert!(*n > 0, "no case reached {what}: {stats:#?}");
    }
}
