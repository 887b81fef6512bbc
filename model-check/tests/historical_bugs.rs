//! Historical connector bugs, found again by the system model (issue 5, item 3).
//!
//! Each test gives the checker the faulty behaviour — as an environment fault ([`EnvFaults`]) or
//! a wrapper around kvrelay's connector ([`SchedFault`]); production code has no switch — and
//! asserts that a breadth-first search (one thread: shortest counterexample first) finds a
//! violation of the property the bug breaks, with a pinned counterexample length. The same
//! configuration without the fault explores exhaustively with every property holding
//! (`kvrelay_ci_config_has_no_counterexample`).
//!
//! The double report of a completion in compat mode is found by the completion model
//! (tests/completion.rs). Bugs not reproduced here are listed in `docs/MODEL-CHECKING.md` with the reason.

use kvrelay_model_check::{
    CheckOptions, CheckReport, Connectors, EnvFaults, OffloadingPair, SchedFault, SystemConfig,
    SystemModel, check, system_properties as p,
};

fn run<P: Connectors>(pair: P, config: SystemConfig) -> CheckReport {
    let model = SystemModel::new(pair, config).expect("a valid configuration");
    check(model, &CheckOptions::default(), &mut |_| {})
}

/// Asserts `property` is violated with a counterexample of `len` actions whose last line
/// contains `marker`; returns the counterexample.
fn found(report: &CheckReport, property: &str, len: usize, marker: &str) -> Vec<String> {
    let r = report.property(property).expect("the property exists");
    assert!(!r.holds, "{property}: no counterexample found");
    let path = r.path.clone().expect("a counterexample");
    for l in &path {
        eprintln!("  {l}");
    }
    assert!(
        path.last().is_some_and(|l| l.contains(marker)),
        "{property}: last action {:?} lacks {marker:?}",
        path.last()
    );
    assert_eq!(path.len(), len, "{property}: counterexample length changed");
    path
}

fn with(faults: EnvFaults) -> SystemConfig {
    SystemConfig {
        faults,
        ..SystemConfig::ci()
    }
}

#[test]
fn kvrelay_ci_config_has_no_counterexample() {
    let r = run(OffloadingPair::default(), SystemConfig::ci());
    assert!(r.passed(), "{:#?}", r.properties);
}

/// vLLM PR #42676: model runner V2 bound the step's metadata before `handle_preemptions`.
#[cfg(feature = "scheduler-faults")]
#[test]
fn pr_42676_bind_before_handle_preemptions() {
    let r = run(
        OffloadingPair::default(),
        with(EnvFaults {
            bind_first: true,
            ..EnvFaults::default()
        }),
    );
    found(&r, p::PROTOCOL, 3, "bind is not legal");
}

/// Mooncake PR #52470: a connector without `handle_preemptions` — its stores are not waited
/// for before the step's writes, so a reallocated block is rewritten under a store.
#[cfg(feature = "scheduler-faults")]
#[test]
fn mooncake_pr_52470_no_handle_preemptions() {
    let r = run(
        OffloadingPair::default(),
        with(EnvFaults {
            skip_handle_preemptions: true,
            ..EnvFaults::default()
        }),
    );
    found(&r, p::NO_WRITE_UNDER_STORE, 8, "while store job");
}

/// vLLM issue #21070: the executor fed the aggregator a single rank's output, so no quorum was
/// ever reached and the engine could only spin.
#[cfg(feature = "scheduler-faults")]
#[test]
fn issue_21070_aggregator_fed_one_rank() {
    let r = run(
        OffloadingPair::default(),
        with(EnvFaults {
            one_rank_output: true,
            ..EnvFaults::default()
        }),
    );
    found(&r, p::QUIESCENT, 21, "deliver");
}

/// vLLM issue #46951 as a wrapper fault of the offloading connector alone: in the ci
/// configuration the checker finds no counterexample, because kvrelay's connector records the
/// blocks of every scheduled request in `build_connector_meta` (so only a request allocated but
/// not scheduled — a MultiConnector sibling's async load, see
/// `issue_46951_zero_external_alloc_not_recorded` — depends on `update_state_after_alloc` with
/// zero external tokens). Pinned so that a change which makes it reachable is noticed (and the
/// table in `docs/MODEL-CHECKING.md` updated).
#[test]
fn fault_46951_not_reachable_with_the_offloading_connector_alone() {
    let r = run(
        OffloadingPair {
            fault: Some(SchedFault::DropZeroExternalAlloc),
        },
        SystemConfig::ci(),
    );
    assert!(
        r.properties
            .iter()
            .filter(|x| x.expectation == "always")
            .all(|x| x.holds),
        "a counterexample appeared — add it to the table in docs/MODEL-CHECKING.md"
    );
}

/// The configuration of the #46014 test: one rank, three requests, async scheduling depth 2, a
/// pool that forces preemption, 3 output tokens, no abort, and the GPU prefix cache off — so a
/// re-admitted request finds nothing on the GPU and its lookup starts at chunk 0, where its
/// acknowledged prompt chunks lie before the chunk its flushed store is still writing.
fn readmission_config() -> SystemConfig {
    SystemConfig {
        ranks: 1,
        requests: 3,
        max_tokens: 3,
        gpu_blocks: 5,
        async_depth: 2,
        aborts: 0,
        prefix_caching: false,
        ..SystemConfig::ci()
    }
}

/// vLLM issue #46014: a preempted request was re-admitted under async scheduling while the
/// store flushed at its preemption was not acknowledged yet; its lookup hit the chunks stored
/// before, and the load job joined the in-flight store job (vLLM: `assert not
/// req_status.transfer_jobs`; kvrelay: a sticky contract error, I-39). The fault is the lookup
/// of the bug report (no jobs check; a chunk still being stored ends the run of hits). With
/// vLLM 0.33's lookup, where such a chunk defers the answer, the crash is not reached here:
/// the flushed chunk lies inside the looked-up range.
#[test]
fn issue_46014_readmission_with_unacknowledged_stores() {
    let r = run(
        OffloadingPair {
            fault: Some(SchedFault::LookupIgnoresJobs),
        },
        readmission_config(),
    );
    found(&r, p::CORE, 28, "for RequestId(1) next to job");
    let r = run(OffloadingPair::default(), readmission_config());
    assert!(r.passed(), "{:#?}", r.properties);
}

/// vLLM PR #32255: a request aborted while its async load was in flight had its blocks freed at
/// once; another request got them and the load then wrote into them. A bug of the scheduler
/// itself, so the fault is re-introduced inside kvrelay-core, behind its `fault-injection`
/// feature (run: `cargo test --release -p kvrelay-model-check --features scheduler-faults
/// --test model_check -- historical_bugs::`). Without it, the same P/D configuration holds
/// (tests/pd.rs, `pd_ci_explores_exhaustively_and_every_property_holds`).
#[cfg(feature = "scheduler-faults")]
#[test]
fn pr_32255_abort_while_loading_frees_blocks() {
    use kvrelay_model_check::{CoreFault, PdPair};
    let r = run(
        PdPair::default(),
        SystemConfig {
            load_failures: 1,
            ..with(EnvFaults {
                scheduler: Some(CoreFault::FreeAbortedWhileLoading),
                ..EnvFaults::default()
            })
        },
    );
    found(&r, p::OWNED_WRITES, 20, "which request 0 holds");
}

/// Two KV groups with a local prefix hit plus external tokens: the P/D connector loads every
/// prompt beyond its GPU hit, and with a sliding-window group beside full attention the
/// second request hits the shared prefix in both groups. Claimed and allocated group by group
/// (vLLM before issue #33775, kvrelay before the oracle issue), group 0's block for the
/// external tokens is group 1's free hit block, which group 1 then claims too: one block in
/// two groups. The owner counts still agree, so only the invariant that a shared block sits
/// in one group at one position (I-20) sees it; no exhaustive configuration had two groups
/// before, so the checker never reached it. Without the fault the same configuration holds
/// (tests/pd.rs, `pd_two_groups_with_hits_and_loads_hold`).
#[cfg(feature = "scheduler-faults")]
#[test]
fn issue_33775_hits_claimed_group_by_group() {
    use kvrelay_model_check::{CoreFault, PdPair, PdRole};
    // Several groups: load failures are reported per request (I-36), as `kvrelay check` does.
    let pair = PdPair {
        role: PdRole {
            failures_as_blocks: false,
            ..PdPair::default().role
        },
        ..PdPair::default()
    };
    let r = run(
        pair,
        SystemConfig {
            load_failures: 1,
            sliding_window: Some(3),
            gpu_blocks: 7,
            ..with(EnvFaults {
                scheduler: Some(CoreFault::ClaimHitsGroupByGroup),
                ..EnvFaults::default()
            })
        },
    );
    found(
        &r,
        p::CORE,
        26,
        "is in group 0 at position 1 and in group 1",
    );
}

/// Without the `scheduler-faults` feature a scheduler fault is a clear configuration error,
/// never silently ignored.
#[cfg(not(feature = "scheduler-faults"))]
#[test]
fn scheduler_faults_need_the_feature() {
    use kvrelay_model_check::{CoreFault, PdPair};
    let err = SystemModel::new(
        PdPair::default(),
        with(EnvFaults {
            scheduler: Some(CoreFault::FreeAbortedWhileLoading),
            ..EnvFaults::default()
        }),
    )
    .expect_err("refused without the feature");
    assert!(err.contains("scheduler-faults"), "{err}");
}

/// vLLM issue #46951: with MultiConnector, the blocks allocated for the P/D child's async load
/// reach the offloading child through `update_state_after_alloc` with 0 external tokens; a
/// connector that drops that call never fences them, and the load rewrites a block a pending
/// store of another request still reads. Needs a prompt of 3 blocks (so a freed block under a
/// store is the next one allocated); the same configuration without the fault holds.
#[test]
fn issue_46951_zero_external_alloc_not_recorded() {
    use kvrelay_model_check::{ChildKind, MultiPair};
    let config = SystemConfig {
        prompt_tokens: 3,
        max_tokens: 1,
        gpu_blocks: 5,
        load_failures: 1,
        ..SystemConfig::ci()
    };
    // (No preemption in this configuration: a request fills the pool, so the PREEMPTED
    // example is missing and only the `always` properties are asserted.)
    let correct = run(MultiPair::pd_then_offloading(), config.clone());
    assert!(correct.complete);
    for x in correct
        .properties
        .iter()
        .filter(|x| x.expectation == "always")
    {
        assert!(x.holds, "{}: {:#?}", x.name, x.path);
    }
    let mut pair = MultiPair::pd_then_offloading();
    pair.children[1] = ChildKind::Offloading(Some(SchedFault::DropZeroExternalAlloc));
    let r = run(pair, config);
    found(&r, p::NO_WRITE_UNDER_STORE, 19, "while store job");
}

/// vLLM PR #18246: two children send a finished request; the extra save is counted on the
/// scheduler side only, the workers report the request after the first child, and its blocks
/// are freed while the second child still holds them: its decode side reads freed blocks.
#[test]
fn pr_18246_extra_async_saves_not_shipped() {
    use kvrelay_model_check::{MultiFault, MultiPair};
    let pair = MultiPair {
        fault: Some(MultiFault::StripExtraSaves),
        ..MultiPair::two_senders()
    };
    let r = run(pair, SystemConfig::ci());
    found(&r, p::DATA, 15, "acknowledges");
}
