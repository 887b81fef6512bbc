//! Running a built model as the flags say: the search options and outputs validated against the
//! model ([`Plan`]), then either stateright's explorer or the checker — its configuration as
//! `key = value` lines and its progress on stderr — followed by the report and the diagram file.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use kvrelay_model_check::{
    CheckOptions, CheckReport, Explain, Progress, Strategy, explorer_address, serve_explorer,
};

use super::args::CheckArgs;
use super::config::{Line, optional};
use super::error::CheckError;
use super::report::{print_report, write_diagram};

/// What to do with a model once it is built: the run's options and outputs, validated.
#[derive(Debug)]
pub(super) struct Plan {
    options: CheckOptions,
    /// `--symmetry`.
    symmetry: bool,
    diagram: Option<PathBuf>,
    /// The property `--diagram-of` named, resolved to the model's name for it.
    diagram_of: Option<&'static str>,
    explore: Option<SocketAddr>,
}

impl Plan {
    /// Validates the model-independent flags against `model`'s properties.
    pub(super) fn new<M: Explain>(a: &CheckArgs, model: &M) -> Result<Self, CheckError> {
        if a.threads == 0 {
            return Err(CheckError::ZeroThreads);
        }
        if a.max_depth == Some(0) {
            return Err(CheckError::ZeroDepth);
        }
        let explore = a
            .explore
            .as_deref()
            .map(|addr| explorer_address(addr, a.allow_remote))
            .transpose()
            .map_err(CheckError::Explore)?;
        let names: Vec<&'static str> = model.properties().iter().map(|p| p.name).collect();
        let diagram_of = a
            .diagram_of
            .as_deref()
            .map(|name| resolve_property(name, &names))
            .transpose()?;
        if let Some(path) = &a.diagram {
            let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
            if folder.is_some_and(|f| !f.is_dir()) {
                return Err(CheckError::TraceOutFolder { path: path.clone() });
            }
        }
        Ok(Self {
            options: CheckOptions {
                threads: a.threads,
                strategy: if a.dfs || a.symmetry {
                    Strategy::Dfs
                } else {
                    Strategy::Bfs
                },
                target_max_depth: a.max_depth,
                stop_at_first_violation: !a.keep_going,
            },
            symmetry: a.symmetry,
            diagram: a.diagram.clone(),
            diagram_of,
            explore,
        })
    }

    /// The search's settings, one line each as their flags name them (the explorer takes only
    /// `--threads`).
    fn lines(&self) -> Vec<Line> {
        let o = &self.options;
        let mut lines = vec![("threads", o.threads.to_string())];
        if self.explore.is_none() {
            lines.extend([
                ("dfs", (o.strategy == Strategy::Dfs).to_string()),
                ("symmetry", self.symmetry.to_string()),
                ("max_depth", optional(o.target_max_depth)),
                ("keep_going", (!o.stop_at_first_violation).to_string()),
            ]);
        }
        lines
    }
}

/// The property `name` designates: the one named exactly so, else the one whose name contains
/// it (case-insensitively).
fn resolve_property(name: &str, names: &[&'static str]) -> Result<&'static str, CheckError> {
    if let Some(&exact) = names.iter().find(|n| **n == name) {
        return Ok(exact);
    }
    let needle = name.to_lowercase();
    let matches: Vec<&'static str> = names
        .iter()
        .copied()
        .filter(|n| n.to_lowercase().contains(&needle))
        .collect();
    match matches.as_slice() {
        [one] => Ok(one),
        [] => Err(CheckError::UnknownProperty {
            name: name.to_owned(),
            available: names.to_vec(),
        }),
        _ => Err(CheckError::AmbiguousProperty {
            name: name.to_owned(),
            matches,
        }),
    }
}

/// A checker run: [`kvrelay_model_check::check`] or [`kvrelay_model_check::check_with_symmetry`].
pub(super) type CheckFn<M> = fn(M, &CheckOptions, &mut dyn FnMut(&Progress)) -> CheckReport;

/// Runs (or explores) `model`, described by `title` and its configuration's lines, as `plan`
/// says with `run` (`check`, or `check_with_symmetry` for a model whose state has a
/// representative), prints the report and writes the diagram.
pub(super) fn execute<M: Explain>(
    model: M,
    title: &str,
    config: &[Line],
    plan: Plan,
    run: CheckFn<M>,
) -> Result<ExitCode, CheckError> {
    eprintln!("kvrelay check: {title}");
    for (key, value) in config.iter().chain(&plan.lines()) {
        eprintln!("  {key} = {value}");
    }
    if let Some(addr) = plan.explore {
        let threads = plan.options.threads;
        let Err(err) = serve_explorer(model, addr, threads, |url| {
            println!(
                "kvrelay check: serving the explorer of the {title} on {url} (Ctrl-C to stop)"
            );
            let _ = std::io::stdout().flush();
        });
        return Err(CheckError::Explore(err));
    }
    let o = &plan.options;
    let mut printed = false;
    let mut on_progress = |p: &Progress| {
        let line = format!(
            "  states {:>10}  unique {:>9}  depth {:>4}  {:>10.0} states/s  {:>6.1} s",
            p.states,
            p.unique_states,
            p.max_depth,
            p.states_per_second(),
            p.elapsed_seconds
        );
        printed = true;
        eprint!("\r{line}");
        let _ = std::io::stderr().flush();
    };
    let report = run(model, o, &mut on_progress);
    if printed {
        eprintln!();
    }
    let mut code = print_report(&report);
    let written = plan
        .diagram
        .as_deref()
        .map(|path| write_diagram(&report, path, plan.diagram_of));
    if let Some(Err(e)) = written {
        eprintln!("kvrelay check: {e}");
        code = ExitCode::from(2);
    }
    Ok(code)
}
