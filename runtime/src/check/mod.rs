//! `kvrelay check`: model-check the core — every interleaving of an environment, through the
//! real code — as the command line asks.
//!
//! The `kvrelay` binary parses the flags into a [`CheckArgs`] and calls [`run`], which refuses
//! flags of another model, builds the model's configuration from its preset and the flags, and
//! hands the model to `execute`. The files:
//! * `args.rs`: the flags (clap) and the long help ([`HELP`]);
//! * `error.rs`: why a check cannot run (exit status 2);
//! * `execute.rs`: the search options and outputs, the explorer, the checker's run;
//! * `report.rs`: the table of properties, the counterexamples, the trace file;
//! * this file: flags to models.

use std::process::ExitCode;

use kvrelay_core::{Mode, PolicyKind};
use kvrelay_model_check::{
    ChildKind, CompletionConfig, CompletionModel, Connectors, CoreFault, MultiFault, MultiPair,
    OffloadingPair, PdFault, PdPair, PdRole, SchedFault, SystemConfig, SystemModel, check,
    check_with_symmetry,
};

mod args;
mod error;
mod execute;
mod report;

pub use args::{CheckArgs, HELP};

use args::{
    ConnectorArg, FaultArg, ModeArg, ModelArg, PdRoleArg, PolicyArg, Preset, model_flags_given,
    value_name,
};
use error::CheckError;
use execute::{Plan, execute};

/// Runs `kvrelay check` with `args`: refuses flags that do not apply, builds the model, then
/// checks (or explores) it. Returns the exit status: 0 every property holds, 1 one fails, 2 bad
/// flags or configuration (reported on stderr).
pub fn run(args: &CheckArgs) -> ExitCode {
    let outcome = refuse_foreign_flags(args).and_then(|()| match args.model {
        ModelArg::System => check_system_model(args),
        ModelArg::Completion => check_completion_model(args),
    });
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvrelay check: {e}");
            ExitCode::from(2)
        }
    }
}

/// Refuses a flag given for a model it does not apply to.
fn refuse_foreign_flags(a: &CheckArgs) -> Result<(), CheckError> {
    match model_flags_given(a)
        .into_iter()
        .find(|(_, models, _)| !models.contains(&a.model))
    {
        Some((flag, applies_to, why)) => Err(CheckError::NotForModel {
            flag,
            model: a.model,
            applies_to,
            why,
        }),
        None => Ok(()),
    }
}

/// `--model system`: the preset with the flags' overrides, the faults, the connector pair.
fn check_system_model(a: &CheckArgs) -> Result<ExitCode, CheckError> {
    let mut c = match a.config {
        Preset::Ci => SystemConfig::ci(),
        Preset::Deep => SystemConfig::deep(),
    };
    let set = |field: &mut u32, flag: Option<u32>| {
        if let Some(v) = flag {
            *field = v;
        }
    };
    set(&mut c.ranks, a.ranks);
    set(&mut c.requests, a.requests);
    set(&mut c.gpu_blocks, a.gpu_blocks);
    set(&mut c.block_size, a.block_size);
    set(&mut c.cpu_chunks, a.cpu_chunks);
    set(&mut c.blocks_per_chunk, a.blocks_per_chunk);
    set(&mut c.prompt_tokens, a.prompt_tokens);
    set(&mut c.shared_tokens, a.shared_tokens);
    set(&mut c.max_tokens, a.max_tokens);
    set(&mut c.max_batched_tokens, a.max_batched_tokens);
    set(&mut c.async_depth, a.async_depth);
    set(&mut c.aborts, a.aborts);
    set(&mut c.resets, a.resets);
    set(&mut c.idle_steps, a.idle_steps);
    if let Some(m) = a.mode {
        c.mode = mode(m);
    }
    if let Some(p) = a.policy {
        c.policy = match p {
            PolicyArg::Lru => PolicyKind::Lru,
            PolicyArg::Arc => PolicyKind::Arc,
        };
    }
    if a.sliding_window.is_some() {
        c.sliding_window = a.sliding_window;
    }
    if a.unordered_completions {
        c.ordered_completions = false;
    }
    if a.no_prefix_caching {
        c.prefix_caching = false;
    }
    set(&mut c.load_failures, a.load_failures);
    let connector = a.connector.unwrap_or(ConnectorArg::Offloading);
    if matches!(connector, ConnectorArg::Pd | ConnectorArg::Multi) && a.load_failures.is_none() {
        c.load_failures = 1;
    }
    let invalid = |reason: String| CheckError::InvalidConfig {
        model: ModelArg::System,
        reason,
    };
    let mut sched_fault = None;
    let mut pd_fault = None;
    let mut multi_fault = None;
    for &f in &a.fault {
        match f {
            FaultArg::BindFirst => c.faults.bind_first = true,
            FaultArg::SkipHandlePreemptions => c.faults.skip_handle_preemptions = true,
            FaultArg::OneRankOutput => c.faults.one_rank_output = true,
            FaultArg::FreeAbortedWhileLoading => {
                c.faults.scheduler = Some(CoreFault::FreeAbortedWhileLoading);
            }
            FaultArg::ClaimHitsGroupByGroup => {
                c.faults.scheduler = Some(CoreFault::ClaimHitsGroupByGroup);
            }
            FaultArg::DropZeroExternalAlloc | FaultArg::LookupIgnoresJobs => {
                let s = if f == FaultArg::DropZeroExternalAlloc {
                    SchedFault::DropZeroExternalAlloc
                } else {
                    SchedFault::LookupIgnoresJobs
                };
                match sched_fault {
                    Some(other) if other != s => {
                        return Err(invalid(format!(
                            "at most one scheduler-side --fault can be injected, not both \
                             {other:?} and {s:?}"
                        )));
                    }
                    _ => sched_fault = Some(s),
                }
            }
            FaultArg::SwallowLoadFailures => pd_fault = Some(PdFault::SwallowLoadFailures),
            FaultArg::StripExtraSaves => multi_fault = Some(MultiFault::StripExtraSaves),
        }
    }
    if let Some(&f) = a
        .fault
        .iter()
        .find(|f| !f.connectors().contains(&connector))
    {
        let names: Vec<String> = f.connectors().iter().map(|c| value_name(*c)).collect();
        return Err(invalid(format!(
            "--fault {} applies to --connector {}, not {}",
            value_name(f),
            names.join(", "),
            value_name(connector)
        )));
    }
    if a.pd_role.is_some() && connector != ConnectorArg::Pd {
        return Err(invalid(
            "--pd-role applies to --connector pd (the multi connectors fix their children's \
             roles)"
                .to_owned(),
        ));
    }
    match connector {
        ConnectorArg::Offloading => {
            let pair = OffloadingPair { fault: sched_fault };
            check_pair(a, pair, c)
        }
        ConnectorArg::Pd => {
            let role = a.pd_role.unwrap_or(PdRoleArg::Both);
            let pair = PdPair {
                fault: pd_fault,
                role: PdRole {
                    load: role != PdRoleArg::Prefill,
                    send: role != PdRoleArg::Decode,
                    failures_as_blocks: c.sliding_window.is_none(),
                },
            };
            check_pair(a, pair, c)
        }
        ConnectorArg::Multi => {
            let mut pair = MultiPair::pd_then_offloading();
            pair.children[1] = ChildKind::Offloading(sched_fault);
            check_pair(a, pair, c)
        }
        ConnectorArg::MultiSenders => {
            let pair = MultiPair {
                fault: multi_fault,
                ..MultiPair::two_senders()
            };
            check_pair(a, pair, c)
        }
    }
}

/// Checks the system model of `pair` under `c` as the flags say.
fn check_pair<P: Connectors>(
    a: &CheckArgs,
    pair: P,
    c: SystemConfig,
) -> Result<ExitCode, CheckError> {
    let model =
        SystemModel::new(pair.clone(), c.clone()).map_err(|reason| CheckError::InvalidConfig {
            model: ModelArg::System,
            reason,
        })?;
    let plan = Plan::new(a, &model)?;
    execute(
        model,
        &format!("system model of the {} connector, {c:?}", pair.name()),
        plan,
        if a.symmetry {
            check_with_symmetry::<SystemModel<P>>
        } else {
            check::<SystemModel<P>>
        },
    )
}

/// The core's mode for `--mode`.
fn mode(m: ModeArg) -> Mode {
    match m {
        ModeArg::Compat => Mode::Compat,
        ModeArg::Strict => Mode::Strict,
    }
}

/// `--model completion`: the preset with the flags' overrides.
fn check_completion_model(a: &CheckArgs) -> Result<ExitCode, CheckError> {
    let mut c = match a.config {
        Preset::Ci => CompletionConfig::ci(),
        Preset::Deep => CompletionConfig::deep(),
    };
    if let Some(w) = a.ranks {
        c.ranks = w;
    }
    if let Some(r) = a.requests {
        c.requests = r;
    }
    if let Some(m) = a.mode {
        c.mode = mode(m);
    }
    if let Some(f) = a.failures {
        c.failures = f;
    }
    c.faulty_double_report |= a.faulty_double_report;
    c.faulty_bind_first |= a.faulty_bind_first;
    c.validate().map_err(|reason| CheckError::InvalidConfig {
        model: ModelArg::Completion,
        reason,
    })?;
    let model = CompletionModel::new(c);
    let plan = Plan::new(a, &model)?;
    execute(model, &format!("{c:?}"), plan, check::<CompletionModel>)
}
