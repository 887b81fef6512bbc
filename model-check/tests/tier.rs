//! The shared tier in the system model (`model-check/src/system/tier.rs`): kvrelay's tiering
//! manager over an adversarial store (keys vanish, probes and jobs fail, writes land torn,
//! answers get lost), explored exhaustively. Run in release:
//! `cargo test --release -p kvrelay-model-check --test model_check -- tier::`.

use kvrelay_core::Mode;
use kvrelay_model_check::{
    CheckOptions, CheckReport, OffloadingPair, Stop, SystemConfig, SystemModel, TierModel, check,
    system_properties as n,
};

/// One rank, two requests with the same two-block prompt, two CPU chunks, no GPU prefix cache,
/// one cache reset: after the reset the prompt's chunks can only come back from the shared tier.
fn tier_config(mode: Mode, tier: TierModel) -> SystemConfig {
    SystemConfig {
        ranks: 1,
        requests: 2,
        prompt_tokens: 2,
        shared_tokens: 2,
        max_tokens: 1,
        prefix_caching: false,
        gpu_blocks: 4,
        cpu_chunks: 2,
        aborts: 0,
        resets: 1,
        mode,
        tier: Some(tier),
        ..SystemConfig::ci()
    }
}

fn run(config: SystemConfig) -> CheckReport {
    let model = SystemModel::new(OffloadingPair::default(), config.clone()).expect("valid config");
    let report = check(model, &CheckOptions::default(), &mut |_| {});
    println!(
        "{:?} {:?}: {} states, {} unique, depth {}, {:.2} s, {}",
        config.mode,
        config.tier,
        report.states,
        report.unique_states,
        report.max_depth,
        report.seconds,
        report.stop
    );
    for p in &report.properties {
        println!("  {:<9} holds={:<5} {}", p.expectation, p.holds, p.name);
    }
    report
}

/// Every property holds, and every example is found, exhaustively.
fn assert_all_hold(report: &CheckReport) {
    assert_eq!(report.stop, Stop::Exhaustive);
    for p in &report.properties {
        assert!(
            p.holds,
            "{} {:?} does not hold: {:#?}",
            p.expectation, p.name, p.path
        );
    }
    for witness in [n::TIER_PROMOTED_LOADED, n::TIER_FAULT_DONE, n::ALL_DONE] {
        assert!(report.property(witness).is_some(), "{witness} is checked");
    }
}

/// DATA, no stuck state, no leaked tier job or pin (I-49 to I-52) in vLLM's semantics, with a
/// key vanishing and a probe or job failing (a cascade then lands torn) at any moment.
#[test]
fn compat_survives_vanishing_keys_and_failures() {
    let tier = TierModel::adversarial(Mode::Compat);
    assert_eq!(tier.lost, 0);
    assert_all_hold(&run(tier_config(Mode::Compat, tier)));
}

/// vLLM #49829: a probe whose answer never comes keeps its request waiting for ever in vLLM's
/// semantics; the checker finds the stuck state.
#[test]
fn compat_hangs_on_a_lost_probe_answer() {
    let tier = TierModel {
        deadline_steps: None,
        vanish: 0,
        failures: 0,
        lost: 1,
        unchecked: false,
    };
    let report = run(tier_config(Mode::Compat, tier));
    let stuck = report.property(n::QUIESCENT).expect("checked");
    assert!(!stuck.holds, "compat must hang on a lost probe answer");
    let path = stuck.path.as_ref().expect("a counterexample");
    assert!(
        path.iter().any(|l| l.contains("answer is lost")),
        "{path:#?}"
    );
    // The shortest (breadth-first, one thread), as docs/MODEL-CHECKING.md quotes it.
    assert_eq!(path.len(), 14, "{path:#?}");
}

/// `strict` gives a lost answer up after its deadline (here one step): every property holds.
#[test]
fn strict_gives_up_a_lost_probe_answer() {
    let tier = TierModel {
        deadline_steps: Some(1),
        vanish: 0,
        failures: 0,
        lost: 1,
        unchecked: false,
    };
    assert_all_hold(&run(tier_config(Mode::Strict, tier)));
}

/// The environment's own check guards DATA: a runtime that promotes a torn value (a failed
/// cascade's partial write) as if it were whole serves garbage, and the checker finds it.
#[test]
fn a_torn_value_served_unchecked_breaks_data() {
    let tier = TierModel {
        deadline_steps: None,
        vanish: 0,
        failures: 1,
        lost: 0,
        unchecked: true,
    };
    let report = run(tier_config(Mode::Compat, tier));
    let data = report.property(n::DATA).expect("checked");
    assert!(!data.holds, "an unchecked torn value must break DATA");
    let path = data.path.as_ref().expect("a counterexample");
    assert!(path.iter().any(|l| l.contains("fails")), "{path:#?}");
}

/// Two ranks: a cascade stores every rank's shard of the chunk, a promotion writes every rank's
/// CPU pool (a failed one leaves garbage in each), and a load completes only once both ranks
/// report it. Every property holds under the same faults as with one rank (exhaustive: 1.67 M
/// unique states, 10 s on 2 threads with `kvrelay check --tier --ranks 2`), and a runtime
/// promoting a torn chunk unchecked still breaks DATA. The model's contents do not depend on the
/// rank, so it cannot tell one rank's shard from another's: the runtime's keys name the rank
/// (`runtime/engine/src/tier/value.rs`).
#[test]
fn two_ranks_each_get_their_own_shard_back() {
    let two = |mode, tier| SystemConfig {
        ranks: 2,
        ..tier_config(mode, tier)
    };
    assert_all_hold(&run(two(
        Mode::Compat,
        TierModel::adversarial(Mode::Compat),
    )));
    let unchecked = TierModel {
        deadline_steps: None,
        vanish: 0,
        failures: 1,
        lost: 0,
        unchecked: true,
    };
    let report = run(two(Mode::Compat, unchecked));
    assert!(!report.property(n::DATA).expect("checked").holds);
}
