//! Partial-order reduction of the system model (`SystemModel::with_partial_order`, issue 23
//! item 4) keeps every verdict: on small configurations, the reduced search and the full one
//! agree on every property — each `always` property holds in both or is violated in both, each
//! `sometimes` property has an example in both or in neither — with and without symmetry,
//! breadth-first and depth-first, with aborts, transfer failures and seeded faults; and the
//! reduced search visits fewer states. Run in release:
//! `cargo test --release -p kvrelay-model-check --test model_check -- system_por::`.
//!
//! Each comparison runs with `stop_at_first_violation: false`, so a property's verdict is final
//! (every property has its own counterexample or example, or the space was exhausted).

use kvrelay_core::Mode;
use kvrelay_model_check::{
    CheckOptions, CheckReport, Connectors, OffloadingPair, PdFault, PdPair, PdRole, SchedFault,
    Stop, Strategy, SystemConfig, SystemModel, SystemState, check, check_with_symmetry,
    system_properties as n,
};
use stateright::Model;

/// How to search: breadth-first (no symmetry) or depth-first with symmetry.
#[derive(Clone, Copy, Debug)]
enum Search {
    Bfs,
    DfsSymmetry,
}

fn run<P: Connectors>(pair: P, config: SystemConfig, por: bool, search: Search) -> CheckReport {
    let model = SystemModel::new(pair, config)
        .expect("a valid configuration")
        .with_partial_order(por);
    let options = CheckOptions {
        threads: 2,
        strategy: Strategy::Dfs,
        stop_at_first_violation: false,
        ..CheckOptions::default()
    };
    match search {
        Search::Bfs => check(
            model,
            &CheckOptions {
                strategy: Strategy::Bfs,
                ..options
            },
            &mut |_| {},
        ),
        Search::DfsSymmetry => check_with_symmetry(model, &options, &mut |_| {}),
    }
}

/// The verdicts of the full and the reduced search, property by property; returns both.
fn compare<P: Connectors>(
    what: &str,
    pair: P,
    config: SystemConfig,
    search: Search,
) -> (CheckReport, CheckReport) {
    let full = run(pair.clone(), config.clone(), false, search);
    let reduced = run(pair, config, true, search);
    println!(
        "{what} ({search:?}): full {} states / {} unique ({}), reduced {} / {} ({})",
        full.states,
        full.unique_states,
        full.stop,
        reduced.states,
        reduced.unique_states,
        reduced.stop
    );
    assert!(
        matches!(full.stop, Stop::Exhaustive | Stop::AllDiscovered),
        "{what}: the full search must be final, not {}",
        full.stop
    );
    assert!(
        matches!(reduced.stop, Stop::Exhaustive | Stop::AllDiscovered),
        "{what}: the reduced search must be final, not {}",
        reduced.stop
    );
    assert_eq!(full.properties.len(), reduced.properties.len(), "{what}");
    for (f, r) in full.properties.iter().zip(&reduced.properties) {
        assert_eq!(f.name, r.name, "{what}");
        println!(
            "  {:<9} full holds={:<5} reduced holds={:<5} {}",
            f.expectation, f.holds, r.holds, f.name
        );
        assert_eq!(
            f.holds, r.holds,
            "{what}: {} {:?} differs: full {:#?}, reduced {:#?}",
            f.expectation, f.name, f.path, r.path
        );
        // A discovery of the reduced search is a real path: replayed and explained.
        if let Some(path) = &r.path {
            assert!(!path.is_empty() || r.expectation == "sometimes", "{what}");
        }
    }
    assert_eq!(full.passed(), reduced.passed(), "{what}");
    assert!(
        reduced.unique_states <= full.unique_states,
        "{what}: the reduction never adds states ({} vs {})",
        reduced.unique_states,
        full.unique_states
    );
    // A configuration that holds is explored whole, and there the reduction must reduce; one
    // with a seeded fault may end at its first violations before any state has a stubborn set
    // (bind-first: 42 states, a violation 3 actions deep).
    if full.passed() {
        assert!(
            reduced.unique_states < full.unique_states,
            "{what}: the reduction must reduce ({} vs {})",
            reduced.unique_states,
            full.unique_states
        );
    }
    (full, reduced)
}

fn offloading(fault: Option<SchedFault>) -> OffloadingPair {
    OffloadingPair { fault }
}

/// Protects every property of the ci configuration (offloading, one abort) under the reduction.
#[test]
fn offloading_ci_same_verdicts_with_and_without_reduction() {
    for search in [Search::Bfs, Search::DfsSymmetry] {
        let (full, _) = compare(
            "offloading ci",
            offloading(None),
            SystemConfig::ci(),
            search,
        );
        assert!(full.passed());
    }
}

/// The ci configuration with async scheduling (depth 2), three requests' worth of GPU pressure
/// and no abort: the deep preset's shape on two ranks.
#[test]
fn offloading_async_same_verdicts_with_and_without_reduction() {
    let config = SystemConfig {
        async_depth: 2,
        ..SystemConfig::ci()
    };
    for search in [Search::Bfs, Search::DfsSymmetry] {
        compare(
            "offloading async depth 2",
            offloading(None),
            config.clone(),
            search,
        );
    }
}

/// Transfer failures (strict: absorbed; compat: the worker's assertion, a core violation) keep
/// their verdicts: LOAD_FAILED_RECOMPUTED and STORE_FAILED_DONE examples, the compat stop.
#[test]
fn transfer_failures_same_verdicts_with_and_without_reduction() {
    for mode in [Mode::Strict, Mode::Compat] {
        let config = SystemConfig {
            mode,
            load_failures: 1,
            store_failures: 1,
            ..SystemConfig::ci()
        };
        let (full, _) = compare(
            &format!("offloading failures {mode:?}"),
            offloading(None),
            config,
            Search::Bfs,
        );
        assert_eq!(full.passed(), mode == Mode::Strict);
    }
}

/// Seeded faults: the historical bugs the connector wrapper re-introduces are found with the
/// reduction as without it, property by property.
#[test]
fn seeded_connector_faults_are_found_with_the_reduction() {
    for fault in [
        SchedFault::DropZeroExternalAlloc,
        SchedFault::LookupIgnoresJobs,
    ] {
        for search in [Search::Bfs, Search::DfsSymmetry] {
            compare(
                &format!("offloading {fault:?}"),
                offloading(Some(fault)),
                SystemConfig {
                    prefix_caching: false,
                    ..SystemConfig::ci()
                },
                search,
            );
        }
    }
}

/// The P/D pair (loads, load failures, sends with delayed frees, aborts): the DELAYED_FREE and
/// LOAD_FAILED_RECOMPUTED witnesses and every invariant keep their verdicts; and the P/D
/// connector's seeded fault (swallowed load failures) is still found.
#[test]
fn pd_same_verdicts_with_and_without_reduction() {
    let config = SystemConfig {
        load_failures: 1,
        ..SystemConfig::ci()
    };
    let both = PdPair::default();
    for search in [Search::Bfs, Search::DfsSymmetry] {
        let (full, _) = compare("pd both", both.clone(), config.clone(), search);
        assert!(full.passed());
        let async2 = SystemConfig {
            async_depth: 2,
            ..config.clone()
        };
        compare("pd both async depth 2", both.clone(), async2, search);
    }
    let decode = PdPair {
        role: PdRole {
            send: false,
            ..both.role
        },
        ..PdPair::default()
    };
    compare("pd decode", decode, config.clone(), Search::Bfs);
    let faulty = PdPair {
        fault: Some(PdFault::SwallowLoadFailures),
        ..PdPair::default()
    };
    let (full, _) = compare("pd swallowed failures", faulty, config, Search::Bfs);
    assert!(!full.passed(), "the seeded fault must be found");
    let _ = n::ALL_DONE;
}

/// The runner and executor faults live in the core's rank driver and engine, behind
/// `scheduler-faults` (`.ci/run` runs this file with it): each is found with the reduction as
/// without it.
#[cfg(feature = "scheduler-faults")]
#[test]
fn seeded_environment_faults_are_found_with_the_reduction() {
    use kvrelay_model_check::EnvFaults;
    for faults in [
        EnvFaults {
            bind_first: true,
            ..EnvFaults::default()
        },
        EnvFaults {
            skip_handle_preemptions: true,
            ..EnvFaults::default()
        },
        EnvFaults {
            one_rank_output: true,
            ..EnvFaults::default()
        },
    ] {
        let config = SystemConfig {
            faults,
            ..SystemConfig::ci()
        };
        let (full, _) = compare(
            &format!("{faults:?}"),
            offloading(None),
            config,
            Search::Bfs,
        );
        assert!(!full.passed(), "{faults:?} must be found");
    }
}

/// The terminal states a search from the initial state reaches (no action enabled): those
/// without a violation by their full state (the witness of a shared prefix load, which no
/// property of these pairs reads and the reduction may reorder, cleared), those with one by
/// the set of properties they violate. A stubborn-set reduction keeps both exactly (see the
/// system model's docs): a much finer check than the verdicts.
fn terminal_states<P: Connectors>(
    model: &SystemModel<P>,
) -> (
    std::collections::HashSet<u64>,
    std::collections::BTreeSet<Vec<&'static str>>,
    usize,
) {
    use std::collections::{BTreeSet, HashSet};
    use std::hash::{Hash, Hasher};
    let fp = |s: &SystemState<P>| {
        let mut h = std::hash::DefaultHasher::new();
        s.hash(&mut h);
        h.finish()
    };
    let mut seen = HashSet::new();
    let mut quiet = HashSet::new();
    let mut broken = BTreeSet::new();
    let mut stack = model.init_states();
    for s in &stack {
        seen.insert(fp(s));
    }
    let mut actions = Vec::new();
    while let Some(s) = stack.pop() {
        actions.clear();
        model.actions(&s, &mut actions);
        if actions.is_empty() {
            if s.ghost.violations.is_empty() {
                let mut t = s.clone();
                t.ghost.clear_unobserved();
                quiet.insert(fp(&t));
            } else {
                let mut v: Vec<&'static str> = s.ghost.violations.iter().map(|(p, _)| *p).collect();
                v.sort_unstable();
                broken.insert(v);
            }
        }
        for &a in &actions {
            if let Some(n) = model.next_state(&s, a)
                && seen.insert(fp(&n))
            {
                stack.push(n);
            }
        }
    }
    (quiet, broken, seen.len())
}

fn same_terminal_states<P: Connectors>(what: &str, pair: P, config: SystemConfig) {
    let full = SystemModel::new(pair.clone(), config.clone()).expect("a valid configuration");
    let reduced = SystemModel::new(pair, config)
        .expect("a valid configuration")
        .with_partial_order(true);
    let (fq, fb, fs) = terminal_states(&full);
    let (rq, rb, rs) = terminal_states(&reduced);
    println!(
        "{what}: full {fs} states, {} terminal, {:?}; reduced {rs} states, {} terminal, {:?}",
        fq.len(),
        fb,
        rq.len(),
        rb
    );
    assert!(rs < fs, "{what}: the reduction must reduce");
    assert_eq!(fq, rq, "{what}: the violation-free terminal states differ");
    assert_eq!(fb, rb, "{what}: the sets of violated properties differ");
}

/// Protects the reduction's core claim, finer than the verdicts: every terminal state of the
/// full search — quiescent, stuck, or violating (by the properties it violates) — is a terminal
/// state of the reduced one.
#[test]
fn reduction_keeps_every_terminal_state() {
    same_terminal_states("offloading ci", offloading(None), SystemConfig::ci());
    same_terminal_states(
        "offloading async depth 2",
        offloading(None),
        SystemConfig {
            async_depth: 2,
            ..SystemConfig::ci()
        },
    );
    same_terminal_states(
        "offloading failures strict",
        offloading(None),
        SystemConfig {
            mode: Mode::Strict,
            load_failures: 1,
            store_failures: 1,
            ..SystemConfig::ci()
        },
    );
    same_terminal_states(
        "offloading DropZeroExternalAlloc",
        offloading(Some(SchedFault::DropZeroExternalAlloc)),
        SystemConfig {
            prefix_caching: false,
            ..SystemConfig::ci()
        },
    );
    let pd = SystemConfig {
        load_failures: 1,
        ..SystemConfig::ci()
    };
    same_terminal_states("pd both", PdPair::default(), pd.clone());
    same_terminal_states(
        "pd both async depth 2",
        PdPair::default(),
        SystemConfig {
            async_depth: 2,
            ..pd.clone()
        },
    );
    same_terminal_states(
        "pd swallowed failures",
        PdPair {
            fault: Some(PdFault::SwallowLoadFailures),
            ..PdPair::default()
        },
        pd,
    );
}
