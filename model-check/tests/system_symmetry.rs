//! Symmetry over ranks in the system model: the reduced search (DFS with ranks sorted into a
//! representative order) reaches the same verdicts as the full one, on fewer states, and still
//! finds a historical bug.

use kvrelay_model_check::{
    CheckOptions, OffloadingPair, Strategy, SystemConfig, SystemModel, check, check_with_symmetry,
};

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
