//! Symmetry over ranks in the system model: the reduced search (DFS with ranks sorted into a
//! representative order) reaches the same verdicts as the full one, on fewer states, and still
//! finds a historical bug.

use kvrelay_model_check::{
    CheckOptions, Connectors, MultiFault, MultiPair, OffloadingPair, PdPair, Strategy,
    SystemConfig, SystemModel, check, check_with_symmetry, system_properties,
};
use stateright::{Checker, Model};

fn model(config: SystemConfig) -> SystemModel<OffloadingPair> {
    SystemModel::new(OffloadingPair::default(), config).expect("a valid configuration")
}

fn dfs() -> CheckOptions {
    CheckOptions {
        strategy: Strategy::Dfs,
        ..CheckOptions::default()
    }
}

#[test]
fn symmetry_keeps_the_verdicts_on_fewer_states() {
    let config = SystemConfig::ci();
    let full = check(model(config.clone()), &dfs(), &mut |_| {});
    let reduced = check_with_symmetry(model(config), &dfs(), &mut |_| {});
    assert!(full.passed(), "{:#?}", full.properties);
    assert!(reduced.passed(), "{:#?}", reduced.properties);
    assert!(
        reduced.unique_states < full.unique_states,
        "symmetry must reduce: {} vs {}",
        reduced.unique_states,
        full.unique_states
    );
    eprintln!(
        "ci: {} unique states without symmetry, {} with",
        full.unique_states, reduced.unique_states
    );
}

/// The runner fault lives in the core's rank driver, behind `scheduler-faults` (`.ci/run` runs
/// this file with it).
#[cfg(feature = "scheduler-faults")]
#[test]
fn symmetry_still_finds_a_write_under_a_store() {
    use kvrelay_model_check::{EnvFaults, system_properties as p};
    let config = SystemConfig {
        faults: EnvFaults {
            skip_handle_preemptions: true,
            ..EnvFaults::default()
        },
        ..SystemConfig::ci()
    };
    let r = check_with_symmetry(model(config), &dfs(), &mut |_| {});
    let v = r.property(p::NO_WRITE_UNDER_STORE).expect("the property");
    assert!(
        !v.holds,
        "the reduced search must still find Mooncake #52470"
    );
}

/// `check_with_symmetry` runs kvrelay's own depth-first search (`search.rs`): on one thread it
/// must visit exactly the states stateright's depth-first checker visits with `.symmetry()` —
/// same states, same unique states, same depth — for every pair, reduction on and off.
#[test]
fn the_own_search_explores_what_stateright_explores() {
    fn compare<P: Connectors>(pair: P, config: SystemConfig, partial_order: bool) {
        let model = || {
            SystemModel::new(pair.clone(), config.clone())
                .expect("a valid configuration")
                .with_partial_order(partial_order)
        };
        let ours = check_with_symmetry(model(), &dfs(), &mut |_| {});
        let theirs = model().checker().symmetry().spawn_dfs().join();
        let name = pair.name();
        assert!(ours.passed(), "{name}: {:#?}", ours.properties);
        assert_eq!(
            (ours.states, ours.unique_states, ours.max_depth),
            (
                theirs.state_count(),
                theirs.unique_state_count(),
                theirs.max_depth()
            ),
            "{name}, partial order {partial_order}: states, unique, depth"
        );
        for p in model().properties() {
            assert_eq!(
                ours.property(p.name).map(|r| r.holds),
                Some(match p.expectation {
                    stateright::Expectation::Sometimes => theirs.discovery(p.name).is_some(),
                    _ => theirs.discovery(p.name).is_none(),
                }),
                "{name}: {}",
                p.name
            );
        }
    }
    for partial_order in [false, true] {
        compare(OffloadingPair::default(), SystemConfig::ci(), partial_order);
        compare(PdPair::default(), SystemConfig::ci(), partial_order);
    }
}

/// A counterexample found by the own search comes back as a path of the full model: its
/// parents lead from the initial state to the violating state (the search checks that the
/// replayed path ends in a state of the discovery's fingerprint, and the runner rebuilds it
/// with `Path::from_actions`, which refuses an action the model does not offer). Also with two
/// threads, which hand states to each other.
#[test]
fn the_own_search_reports_replayable_counterexamples() {
    for threads in [1, 2] {
        // vLLM PR #18246 (`historical_bugs.rs`): a second sender's blocks freed while it holds
        // them, then read by its decode side.
        let pair = MultiPair {
            fault: Some(MultiFault::StripExtraSaves),
            ..MultiPair::two_senders()
        };
        let model = SystemModel::new(pair, SystemConfig::ci()).expect("a valid configuration");
        let options = CheckOptions { threads, ..dfs() };
        let report = check_with_symmetry(model, &options, &mut |_| {});
        let failed = report
            .first_failure()
            .unwrap_or_else(|| panic!("{threads} threads: the seeded fault must be found"));
        assert_eq!(failed.name, system_properties::DATA);
        let raw = failed
            .raw_path
            .as_ref()
            .expect("a counterexample has a path");
        assert!(!raw.is_empty(), "{threads} threads: {}", failed.name);
        assert!(
            failed
                .path
                .as_ref()
                .is_some_and(|lines| lines.len() == raw.len()),
            "{threads} threads: one line per action"
        );
    }
}
