//! `kvrelay check`: model-check the core — every interleaving of an environment, through the
//! real code — as the command line asks.
//!
//! The `kvrelay` binary parses the flags into a [`CheckArgs`] and calls [`run`], which refuses
//! flags of another model, builds the model's configuration from its preset and the flags, and
//! hands the model to `execute`, which prints the configuration as `key = value` lines on
//! stderr before checking. The files, each importing only from those listed before it:
//! * `args.rs`: the flags (clap) and the long help ([`HELP`]);
//! * `error.rs`: why a check cannot run (exit status 2);
//! * `config.rs`: a model's configuration from its preset and the flags, and its lines;
//! * `report.rs`: the table of properties, the counterexamples, the diagram file;
//! * `execute.rs`: the search options and outputs, the explorer, the checker's run;
//! * this file: flags to models.

use std::process::ExitCode;

use kvrelay_model_check::{
    ChildKind, CompletionModel, Connectors, MultiPair, OffloadingPair, PdPair, PdRole, SystemModel,
    check, check_with_symmetry,
};

mod args;
mod config;
mod error;
mod execute;
mod report;

pub(crate) use args::{CheckArgs, HELP};

use args::{ConnectorArg, ModelArg, PdRoleArg, model_flags_given};
use config::SystemSetup;
use error::CheckError;
use execute::{Plan, execute};

/// Runs `kvrelay check` with `args`: refuses flags that do not apply, builds the model, then
/// checks (or explores) it. Returns the exit status: 0 every property holds, 1 one fails, 2 bad
/// flags or configuration (reported on stderr).
pub(crate) fn run(args: &CheckArgs) -> ExitCode {
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

/// `--model system`: the configuration, then the connector pair it names, checked.
fn check_system_model(a: &CheckArgs) -> Result<ExitCode, CheckError> {
    let setup = config::system(a)?;
    let sched_fault = setup.sched_fault;
    match setup.connector {
        ConnectorArg::Offloading => {
            let pair = OffloadingPair { fault: sched_fault };
            check_pair(a, pair, &setup)
        }
        ConnectorArg::Pd => {
            let role = setup.pd_role;
            let pair = PdPair {
                fault: setup.pd_fault,
                role: PdRole {
                    load: role != PdRoleArg::Prefill,
                    send: role != PdRoleArg::Decode,
                    failures_as_blocks: setup.config.sliding_window.is_none(),
                },
                remote_answers: !setup.pd_silent_remote,
                lease_steps: setup.pd_lease,
            };
            check_pair(a, pair, &setup)
        }
        ConnectorArg::Multi => {
            let mut pair = MultiPair::pd_then_offloading();
            pair.children[1] = ChildKind::Offloading(sched_fault);
            check_pair(a, pair, &setup)
        }
        ConnectorArg::MultiSenders => {
            let pair = MultiPair {
                fault: setup.multi_fault,
                ..MultiPair::two_senders()
            };
            check_pair(a, pair, &setup)
        }
    }
}

/// Checks the system model of `pair` under `setup` as the flags say.
fn check_pair<P: Connectors>(
    a: &CheckArgs,
    pair: P,
    setup: &SystemSetup,
) -> Result<ExitCode, CheckError> {
    let model = SystemModel::new(pair, setup.config.clone())
        .map_err(|reason| CheckError::InvalidConfig {
            model: ModelArg::System,
            reason,
        })?
        .with_partial_order(setup.partial_order);
    let plan = Plan::new(a, &model)?;
    execute(
        model,
        &setup.title(),
        &setup.lines(),
        plan,
        if a.symmetry {
            check_with_symmetry::<SystemModel<P>>
        } else {
            check::<SystemModel<P>>
        },
    )
}

/// `--model completion`: the configuration, checked.
fn check_completion_model(a: &CheckArgs) -> Result<ExitCode, CheckError> {
    let c = config::completion(a)?;
    let model = CompletionModel::new(c);
    let plan = Plan::new(a, &model)?;
    execute(
        model,
        "completion model",
        &config::completion_lines(a.config, &c),
        plan,
        check::<CompletionModel>,
    )
}
