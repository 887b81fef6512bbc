//! kvrelay-model-check: stateright models built from kvrelay-core's own transition functions.
//!
//! The models do not restate the core: every transition calls the real machine
//! ([`kvrelay_core::WorkerProtocol`], [`kvrelay_core::Aggregator`]), so what is checked is the
//! code that runs in the engine, under every interleaving of the environment (which rank
//! finishes which transfer when, which rank runs its step first, where a fault strikes).
//!
//! # The system model
//!
//! [`SystemModel`] is the whole connector lifecycle of one engine: the real
//! [`kvrelay_core::Scheduler`] with a scheduler-side connector, W ranks running the real worker
//! step protocol around a worker-side connector, the real aggregator, and an environment that
//! lets requests arrive, completes transfers, aborts requests and resets the cache, with ghost
//! block contents for data-safety properties ([`system_properties`]). It is generic over
//! [`Connectors`]: [`OffloadingPair`] is kvrelay's offloading connector; [`PdPair`] the core's P/D
//! connector (async remote loads that may fail, held blocks released on the decode side's
//! acknowledgement or, strict, at the end of a lease) that reaches the scheduler's
//! `WAITING_FOR_REMOTE_KVS` and load-failure paths; [`MultiPair`] kvrelay's
//! MultiConnector over P/D and offloading children. An engine checks its own pair the same way
//! (see `examples/write_through.rs`). It is what `kvrelay check` runs by default; its state has a
//! representative under rank symmetry ([`check_with_symmetry`]).
//!
//! Historical bugs are given to the model as faults: of the environment ([`EnvFaults`]), of a
//! connector wrapper in this crate ([`SchedFault`], [`PdFault`], [`MultiFault`]), or — for a bug
//! of the core scheduler itself — re-introduced inside kvrelay-core behind its `fault-injection`
//! feature ([`CoreFault`], this crate's `scheduler-faults` feature; off in every engine build).
//!
//! # The completion model
//!
//! [`CompletionModel`] explores how W ranks report the completions of R requests' transfers (one
//! load and one save per request on every rank) through their step protocol to the executor's
//! aggregator, and checks the aggregation invariants of SEMANTICS.md §8.4 (I-21 exactly-once
//! emission after every rank reported, I-24 failed loads travel with their `finished_recving`),
//! the step protocol of §8.1 (I-1…I-6) and every machine's own `check_invariants()`. Faults can
//! be injected to show the checker finds the hazards the spec describes: a rank reporting a
//! completion twice (vLLM's aggregator has no per-rank dedup, §4.2) and a runner calling `bind`
//! before `handle_preemptions` (vLLM PR #42676).
//!
//! # Running a check
//!
//! [`check`] model-checks any model that implements [`Explain`] (a readable line per action and
//! the arrows of a sequence diagram, rendered by [`mermaid`]) as [`CheckOptions`] say: threads,
//! breadth-first (the default: shortest counterexamples) or depth-first search, a depth bound,
//! stop at the first violation or keep going. It calls back with [`Progress`] and returns a
//! [`CheckReport`] whose discoveries come as lines, raw actions and arrows;
//! [`check_with_symmetry`] adds symmetry reduction for states implementing
//! `stateright::Representative`, and [`serve_explorer`] serves stateright's web explorer behind
//! [`explorer_address`]'s loopback guard. `kvrelay check` is the command line over them;
//! [`check_completions`] is the completion model's shorthand. The presets
//! [`CompletionConfig::ci`] and [`CompletionConfig::deep`] are the configurations CI and a longer
//! local run explore exhaustively.
//!
//! ```no_run
//! use kvrelay_model_check::{CompletionConfig, check_completions};
//!
//! let report = check_completions(CompletionConfig::ci(), 2, &mut |_| {});
//! assert!(report.complete && report.properties.iter().all(|p| p.holds));
//! ```
//!
//! # Modules and their dependencies
//!
//! The modules form layers; each imports only from the layers below it, so there is no import
//! circle (everything is re-exported here, at the root, which is the only place that sees all
//! of them):
//!
//! | module | holds | imports from |
//! | --- | --- | --- |
//! | `diagram` | [`Arrow`], [`mermaid`], [`escape_label`] | — |
//! | `explain` | [`Explain`], what a model says about itself | `diagram` |
//! | `shared` | [`Shared`], a state part successors share until one writes it | — |
//! | `memo` | successors computed ahead (for the partial-order reduction), kept per thread | — |
//! | `search` | kvrelay's own depth-first search with symmetry (a stateright `Checker`) | — |
//! | `runner` | [`check`], [`check_with_symmetry`], [`serve_explorer`], [`CheckReport`] | `explain`, `search`, `diagram` |
//! | `completion` | [`CompletionModel`] | `explain`, `diagram` |
//! | `system` | [`SystemModel`], [`Connectors`], [`OffloadingPair`], [`remote_slot`] | `explain`, `memo`, `shared`, `diagram` |
//! | `pd` | [`PdPair`] | `system` |
//! | `multi_pair` | [`MultiPair`] | `pd`, `system` |
//! | crate root | the re-exports, [`check_completions`] | all |
//!
//! When to call what: build a model (a `*Config` preset, then [`CompletionModel::new`] or
//! [`SystemModel::new`] with a [`Connectors`] pair), then hand it to the runner ([`check`], or
//! [`check_with_symmetry`] for the system model's rank symmetry); [`check_completions`] does both
//! for the completion model. A new model implements [`Explain`] and depends on `explain` and
//! `diagram` only; a new connector pair implements [`Connectors`] and depends on `system`. A
//! shorthand that joins a model with the runner belongs at the root, not in either module.

mod completion;
mod diagram;
mod explain;
mod memo;
mod multi_pair;
mod pd;
mod runner;
mod search;
mod shared;
mod system;

pub use completion::{
    CompletionAction, CompletionConfig, CompletionModel, CompletionState, Ghost, RankState,
    ReportingWorker, Transfer, property_names,
};
pub use diagram::{Arrow, escape_label, mermaid};
pub use explain::Explain;
pub use multi_pair::{
    Child, ChildKind, ChildMeta, ChildWorker, FaultyMulti, MultiFault, MultiPair,
};
pub use pd::{PdFault, PdModelWorker, PdPair, PdRole, request_params as pd_request_params};
pub use runner::{
    CheckOptions, CheckReport, ExploreError, Progress, PropertyResult, Stop, Strategy, check,
    check_with_symmetry, explorer_address, explorer_url, serve_explorer,
};
pub use shared::Shared;
pub use system::{
    Connectors, CoreFault, Counted, EnvFaults, Faulty, InFlight, OffloadingPair, PendingStep,
    RankState as SystemRank, SchedFault, SystemAction, SystemConfig, SystemModel, SystemState,
    TierEnv, TierModel, TierPending, TierValue, WMeta, is_remote_slot,
    property_names as system_properties, remote_slot, tier_leak,
};

/// Model-checks the completion model of `config` breadth-first on `threads` threads (at least
/// one), stopping at the first violation; [`check`] with [`CheckOptions`] for the rest.
///
/// It lives here, at the crate root, because it joins a model ([`CompletionModel`]) with the
/// runner ([`check`]): neither module depends on the other.
///
/// # Panics
/// If `config` is invalid ([`CompletionConfig::validate`]).
pub fn check_completions(
    config: CompletionConfig,
    threads: usize,
    on_progress: &mut dyn FnMut(&Progress),
) -> CheckReport {
    let options = CheckOptions {
        threads,
        ..CheckOptions::default()
    };
    check(CompletionModel::new(config), &options, on_progress)
}
