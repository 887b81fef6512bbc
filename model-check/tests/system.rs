//! Exhaustive checks of the system model (run them in release:
//! `cargo test --release -p kvrelay-model-check`).

use kvrelay_model_check::{
    CheckOptions, CheckReport, OffloadingPair, Stop, SystemConfig, SystemModel, check,
    system_properties,
};

fn run(config: SystemConfig, options: &CheckOptions) -> CheckReport {
    let model = SystemModel::new(OffloadingPair::default(), config.clone()).expect("valid config");
    let report = check(model, options, &mut |_| {});
    println!(
        "{config:?}: {} states, {} unique, depth {}, {:.2} s, {}",
        report.states, report.unique_states, report.max_depth, report.seconds, report.stop
    );
    for p in &report.properties {
        println!("  {:<9} holds={:<5} {}", p.expectation, p.holds, p.name);
    }
    report
}

#[test]
fn ci_config_explores_exhaustively_and_every_property_holds() {
    let report = run(SystemConfig::ci(), &CheckOptions::default());
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.complete, "ci must be explored exhaustively");
    for p in &report.properties {
        assert!(
            p.holds,
            "{} {:?} does not hold: {:#?}",
            p.expectation, p.name, p.path
        );
    }
    assert!(report.passed());
    use system_properties as n;
    for always in [
        n::PROTOCOL,
        n::NO_WRITE_UNDER_STORE,
        n::DATA,
        n::OWNED_WRITES,
        n::FINISHED_ONCE,
        n::QUORUM,
        n::CORE,
        n::QUIESCENT,
    ] {
        let p = report
            .property(always)
            .unwrap_or_else(|| panic!("the system model has no property {always:?}"));
        assert_eq!(p.expectation, "always", "{always}");
    }
    for sometimes in [
        n::FLUSHED,
        n::PREEMPTED,
        n::RESUMED_FROM_OFFLOAD,
        n::ALL_DONE,
    ] {
        let p = report
            .property(sometimes)
            .unwrap_or_else(|| panic!("the system model has no property {sometimes:?}"));
        assert_eq!(p.expectation, "sometimes", "{sometimes}");
        assert!(p.path.is_some(), "{sometimes}: an example");
    }
    // Pinned: a change that shrinks (or grows) the explored space must be noticed and this
    // number updated deliberately. Computed with `SystemConfig::ci()` (2 ranks, 2 requests of 2
    // one-token blocks sharing the first, 2 output tokens, 4 GPU blocks, 3 CPU chunks of 1
    // block, LRU, synchronous, one abort, ordered completions, 1 idle step, no faults). 16,697
    // until the model ran on the core's engine step, which keeps a step's aggregated output in
    // place of the ranks' outputs it was folded from (states that differed only there are one).
    // 16,266 until the idle bound became the engine's own (issue 23, `system.rs` module docs,
    // *Bounding the space*): a transfer's completion or start no longer resets the idle
    // counter; a completion is progress once a delivered output reports it, and the engine may
    // step past the bound while a rank holds a completion it has no step to report in. So a
    // completion alone no longer buys an idle step, and states that differed only in the
    // counter's value (reset by a completion, or not yet) are one. 14,186 until the offloading
    // connector took a step's finished requests in finish order (issue 32): two requests that
    // finish before one `schedule`, in either order, used to commit their LRU recency in id
    // order and now in the order they finished, so those states are two.
    assert_eq!(report.unique_states, 14_200);
}

#[test]
fn ci_config_unique_states_do_not_depend_on_threads() {
    let options = CheckOptions {
        threads: 2,
        ..CheckOptions::default()
    };
    let report = run(SystemConfig::ci(), &options);
    assert!(report.passed());
    assert_eq!(report.unique_states, 14_200);
}

/// The runner and executor faults are re-introduced inside kvrelay-core, where the step runs:
/// only with the `scheduler-faults` feature (`.ci/run` runs this file with it).
#[cfg(feature = "scheduler-faults")]
#[test]
fn environment_faults_are_found_in_the_ci_config() {
    use kvrelay_model_check::EnvFaults;
    use system_properties as n;
    for (faults, violated) in [
        (
            EnvFaults {
                bind_first: true,
                ..EnvFaults::default()
            },
            n::PROTOCOL,
        ),
        (
            EnvFaults {
                skip_handle_preemptions: true,
                ..EnvFaults::default()
            },
            n::NO_WRITE_UNDER_STORE,
        ),
        (
            EnvFaults {
                one_rank_output: true,
                ..EnvFaults::default()
            },
            n::QUIESCENT,
        ),
    ] {
        let config = SystemConfig {
            faults,
            ..SystemConfig::ci()
        };
        let report = run(config, &CheckOptions::default());
        assert_eq!(report.stop, Stop::FirstViolation, "{faults:?}");
        assert!(!report.passed(), "{faults:?}");
        let failure = report.first_failure().expect("a failure");
        assert_eq!(failure.name, violated, "{faults:?}");
        assert!(
            failure.path.as_ref().is_some_and(|p| !p.is_empty()),
            "{faults:?}: a counterexample"
        );
    }
}

/// The ci configuration with one load and one store failure (issue 22): strict workers absorb
/// them — a failed load is recomputed, a failed store's chunks are freed so no load serves its
/// half-written slots — and every property holds exhaustively; compat keeps vLLM's assertion,
/// which the model reports as a core violation (the engine would have to stop).
#[test]
fn strict_absorbs_transfer_failures_and_compat_stops_on_them() {
    use kvrelay_core::Mode;
    use system_properties as n;
    let failing = |mode| SystemConfig {
        mode,
        load_failures: 1,
        store_failures: 1,
        ..SystemConfig::ci()
    };
    let report = run(failing(Mode::Strict), &CheckOptions::default());
    assert_eq!(report.stop, Stop::Exhaustive);
    for p in &report.properties {
        assert!(p.holds, "{} {:?}: {:#?}", p.expectation, p.name, p.path);
    }
    for sometimes in [n::LOAD_FAILED_RECOMPUTED, n::STORE_FAILED_DONE] {
        let p = report.property(sometimes).expect("expected with failures");
        assert!(p.path.is_some(), "{sometimes}: an example");
    }
    // Pinned (see ci_config_explores_exhaustively_and_every_property_holds; 116,736 before
    // the idle bound became the engine's own, 100,833 before finish order).
    assert_eq!(report.unique_states, 100_867);

    let report = run(failing(Mode::Compat), &CheckOptions::default());
    assert!(!report.passed());
    let failure = report.first_failure().expect("a failure");
    assert_eq!(failure.name, n::CORE);
}
