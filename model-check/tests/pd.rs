//! The system model with the P/D connector pair: async remote loads (`WAITING_FOR_REMOTE_KVS`),
//! load failures and their recovery, delayed frees for sends. Run in release:
//! `cargo test --release -p kvrelay-model-check --test model_check -- pd::`.

use kvrelay_core::Mode;
use kvrelay_model_check::{
    CheckOptions, CheckReport, MultiPair, PdFault, PdPair, PdRole, Stop, SystemConfig, SystemModel,
    check, system_properties as n,
};

fn run(pair: PdPair, config: SystemConfig) -> CheckReport {
    let model = SystemModel::new(pair.clone(), config.clone()).expect("valid config");
    let report = check(model, &CheckOptions::default(), &mut |_| {});
    println!(
        "{pair:?} {config:?}: {} states, {} unique, depth {}, {:.2} s, {}",
        report.states, report.unique_states, report.max_depth, report.seconds, report.stop
    );
    for p in &report.properties {
        println!("  {:<9} holds={:<5} {}", p.expectation, p.holds, p.name);
        if !p.holds {
            for l in p.path.iter().flatten() {
                println!("      {l}");
            }
        }
    }
    report
}

/// The P/D preset of CI: 2 ranks, 2 requests, one abort, one load failure.
fn ci() -> SystemConfig {
    SystemConfig {
        load_failures: 1,
        ..SystemConfig::ci()
    }
}

#[test]
fn pd_ci_explores_exhaustively_and_every_property_holds() {
    let report = run(PdPair::default(), ci());
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.passed());
    for sometimes in [
        n::PREEMPTED,
        n::ALL_DONE,
        n::DELAYED_FREE,
        n::LOAD_FAILED_RECOMPUTED,
    ] {
        let p = report.property(sometimes).expect("expected example");
        assert!(p.path.is_some(), "{sometimes}: an example");
    }
    // Pinned (see tests/system.rs): `kvrelay check --connector pd`. 72,307 before the GPU free
    // queue took vLLM's order (SEMANTICS.md §1.2): a freed block without a prefix-cache hash
    // (a loaded block is cached only when its load completes; a partial block never) is now
    // reused first instead of after every other free block, so allocations after a free land
    // on the same few ids and more interleavings reach identical states: 69,652. Then 64,492
    // since the engine step keeps a step's aggregated output instead of the ranks' outputs it
    // was folded from: states that differed only in outputs already aggregated are one.
    // 49,643 since the idle bound is the engine's own (see tests/system.rs): a completion no
    // longer resets the idle counter. 39,514 since the pair is the core's P/D connector (issue
    // 37): the prefill side no longer copies a finished request's blocks out with store jobs of
    // its own (their interleavings are gone); the decode side reads them when it acknowledges.
    assert_eq!(report.unique_states, 39_514);
}

/// The P/D pair with several KV groups: load failures are reported per request (vLLM rejects
/// invalid block ids there, I-36), as `kvrelay check --sliding-window` does.
fn two_group_pd() -> PdPair {
    PdPair {
        role: PdRole {
            failures_as_blocks: false,
            ..PdPair::default().role
        },
        ..PdPair::default()
    }
}

/// Two KV groups (full attention and a 3-token sliding window), a tight pool: the second
/// request hits the shared prefix in both groups and loads the rest (a local hit plus external
/// tokens in one admission, the oracle issue's two-group case). Every property holds; with the
/// group-by-group claiming of vLLM before issue #33775 the checker finds a block in two groups
/// (tests/historical_bugs.rs, `issue_33775_hits_claimed_group_by_group`).
#[test]
fn pd_two_groups_with_hits_and_loads_hold() {
    let report = run(
        two_group_pd(),
        SystemConfig {
            sliding_window: Some(3),
            gpu_blocks: 7,
            ..ci()
        },
    );
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.passed());
    // Pinned: `kvrelay check --connector pd --sliding-window 3 --gpu-blocks 7` (68,558 before
    // the engine step folded aggregated outputs, see `pd_ci_...`; 62,398 before the idle
    // bound became the engine's own, see tests/system.rs; 48,113 before the core's P/D
    // connector, see `pd_ci_...`).
    assert_eq!(report.unique_states, 37_984);
}

#[test]
fn pd_request_level_failures_hold_too() {
    let pair = PdPair {
        role: PdRole {
            failures_as_blocks: false,
            ..PdPair::default().role
        },
        ..PdPair::default()
    };
    let report = run(pair, ci());
    assert!(report.passed());
}

#[test]
fn a_swallowed_load_failure_serves_half_written_blocks() {
    let pair = PdPair {
        fault: Some(PdFault::SwallowLoadFailures),
        ..PdPair::default()
    };
    let report = run(pair, ci());
    let data = report.property(n::DATA).expect("property");
    assert!(!data.holds, "a swallowed failure must be caught");
    // Breadth-first, one thread: the shortest counterexample (the table in `docs/MODEL-CHECKING.md`).
    assert_eq!(data.path.as_ref().map(Vec::len), Some(13));
}

fn multi_run(pair: MultiPair, config: SystemConfig) -> CheckReport {
    let model = SystemModel::new(pair.clone(), config.clone()).expect("valid config");
    let report = check(model, &CheckOptions::default(), &mut |_| {});
    println!(
        "{}: {} states, {} unique, depth {}, {:.2} s, {}",
        kvrelay_model_check::Connectors::name(&pair),
        report.states,
        report.unique_states,
        report.max_depth,
        report.seconds,
        report.stop
    );
    for p in &report.properties {
        println!("  {:<9} holds={:<5} {}", p.expectation, p.holds, p.name);
        if !p.holds {
            for l in p.path.iter().flatten() {
                println!("      {l}");
            }
        }
    }
    report
}

#[test]
fn multi_pd_then_offloading_holds() {
    let report = multi_run(MultiPair::pd_then_offloading(), ci());
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.passed());
    // Pinned: `kvrelay check --connector multi`. 348,690 before vLLM's free order (LIFO reuse
    // of uncached blocks), 335,747 before the engine step folded aggregated outputs (both as in
    // `pd_ci_explores_exhaustively_and_every_property_holds`), 317,404 before the offloading
    // manager's LRU kept pinned keys in its rank order (issue 23): the same abstract states, but
    // a load's pin and unpin no longer move a key between the order's list and tree, so fewer
    // histories leave the same state in different layouts (the verdicts are unchanged), and
    // 316,807 before the model recorded only the witnesses its properties read (issue 23): this
    // pair expects no flush and no resumption from offloaded chunks, so the states its
    // offloading child reaches with and without those (unread) flags are now one; 281,649
    // before the idle bound became the engine's own (see tests/system.rs); 245,825 before the
    // offloading child took a step's finished requests in finish order (issue 32, see
    // tests/system.rs).
    assert_eq!(report.unique_states, 248_546);
}

#[test]
fn multi_two_senders_holds() {
    let report = multi_run(MultiPair::two_senders(), ci());
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.passed());
    // Pinned: `kvrelay check --connector multi-senders` (16,331 before the engine step folded
    // aggregated outputs; 15,385 before the idle bound became the engine's own, see
    // tests/system.rs; 11,260 before the core's P/D connector: no store jobs for sends, see
    // `pd_ci_...`).
    assert_eq!(report.unique_states, 3_588);
}

/// The prefill side with a decode side that never answers (vLLM issue #46283): strict mode's
/// lease is what ends the run.
fn silent(mode: Mode) -> (PdPair, SystemConfig) {
    let pair = PdPair {
        role: PdRole {
            load: false,
            ..PdPair::default().role
        },
        ..PdPair::silent_remote()
    };
    (pair, SystemConfig { mode, ..ci() })
}

#[test]
fn a_silent_decode_side_holds_blocks_for_ever_in_compat() {
    // vLLM holds a delayed free until the acknowledgement comes: with a decode side that never
    // answers, a state is reached where nothing can happen and the request's blocks are still
    // held — the bounded I-48 ("no stuck state") fails.
    let (pair, config) = silent(Mode::Compat);
    let report = run(pair, config);
    let stuck = report.property(n::QUIESCENT).expect("property");
    assert!(!stuck.holds, "compat must be stuck on a silent decode side");
    assert!(
        report
            .properties
            .iter()
            .all(|p| p.holds || p.name == n::QUIESCENT)
    );
}

#[test]
fn strict_leases_release_what_a_silent_decode_side_held() {
    // I-54: the same silent decode side, strict: every held request is released when its lease
    // runs out, every request finishes, nothing leaks.
    let (pair, config) = silent(Mode::Strict);
    let report = run(pair, config);
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.passed());
    for sometimes in [n::ALL_DONE, n::DELAYED_FREE] {
        let p = report.property(sometimes).expect("expected example");
        assert!(p.path.is_some(), "{sometimes}: an example");
    }
}

#[test]
fn strict_leases_hold_when_the_decode_side_answers_late_or_in_time() {
    // Both roles, strict, a decode side that may acknowledge at any moment: before the lease
    // runs out (released on the acknowledgement), after (a late acknowledgement changes
    // nothing), or never. The decode side reads the held blocks when it acknowledges: DATA
    // checks they still hold the request's KV.
    let config = SystemConfig {
        mode: Mode::Strict,
        ..ci()
    };
    let report = run(PdPair::default(), config);
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.passed());
}
