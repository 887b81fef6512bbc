//! The CLI-friendly runner: one exhaustive breadth-first check with progress callbacks.

use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path};

use crate::completion::{CompletionAction, CompletionConfig, CompletionModel, CompletionState};

/// How often `on_progress` is called while a check runs.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// How often the runner looks whether the checker is done.
const POLL_EVERY: Duration = Duration::from_millis(10);

/// The outcome of one model-checking run.
#[derive(Clone, Debug)]
pub struct CheckReport {
    /// States generated (with repeats).
    pub states: usize,
    /// Distinct states visited.
    pub unique_states: usize,
    /// The deepest path explored (in actions, counting the initial state as depth 1).
    pub max_depth: usize,
    /// Wall-clock time of the run.
    pub seconds: f64,
    /// One entry per property of the model, in the model's order.
    pub properties: Vec<PropertyResult>,
    /// The whole reachable state space was explored. `false` when the run stopped at the first
    /// violated `always` property: the other properties' `holds` then only mean that no
    /// counterexample was found before the stop.
    pub complete: bool,
}

impl CheckReport {
    /// The result of the property named `name`, if the model has one.
    pub fn property(&self, name: &str) -> Option<&PropertyResult> {
        self.properties.iter().find(|p| p.name == name)
    }

    /// The run was exhaustive, every `always` property holds and every `sometimes` property has
    /// an example.
    pub fn passed(&self) -> bool {
        self.complete && self.properties.iter().all(|p| p.holds)
    }
}

/// The verdict on one property.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct PropertyResult {
    /// The property's name (see [`crate::property_names`]).
    pub name: &'static str,
    /// `"always"` or `"sometimes"` (the model has no `eventually` properties).
    pub expectation: &'static str,
    /// `always`: no counterexample was found. `sometimes`: an example was found.
    pub holds: bool,
    /// `always`: the counterexample, if any; `sometimes`: the example, if any. One line per
    /// action, with what the action produced (a rank's reported sets, the aggregated output).
    pub path: Option<Vec<String>>,
}

/// A progress snapshot, handed to the callback of [`check_completions`] about every 200 ms and
/// once at the end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// States generated so far (with repeats).
    pub states: usize,
    /// Distinct states so far.
    pub unique_states: usize,
    /// The deepest path so far.
    pub max_depth: usize,
    /// Seconds since the check started.
    pub elapsed_seconds: f64,
}

/// Model-checks the completion model of `config` breadth-first on `threads` threads (at least
/// one), calling `on_progress` about every 200 ms and once when done.
///
/// Breadth-first search makes counterexamples short: each property reports the first state
/// found (see [`CompletionModel`]), which with `threads == 1` is a shortest path and with more
/// threads is at most as deep as the threads had got when it was found. The run stops at the
/// first violated `always` property (`HasDiscoveries::AnyFailures`); `complete` is then
/// `false`, and a `sometimes` property without an example only means none was found before
/// the stop.
///
/// # Panics
/// If `config` is invalid ([`CompletionConfig::validate`]).
pub fn check_completions(
    config: CompletionConfig,
    threads: usize,
    on_progress: &mut dyn FnMut(&Progress),
) -> CheckReport {
    let started = Instant::now();
    let checker = CompletionModel::new(config)
        .checker()
        .threads(threads.max(1))
        .finish_when(HasDiscoveries::AnyFailures)
        .spawn_bfs();
    let mut last_progress = Instant::now();
    while !checker.is_done() {
        std::thread::sleep(POLL_EVERY);
        if last_progress.elapsed() >= PROGRESS_EVERY {
            on_progress(&progress(&checker, started));
            last_progress = Instant::now();
        }
    }
    let checker = checker.join();
    let seconds = started.elapsed().as_secs_f64();
    let mut last = progress(&checker, started);
    last.elapsed_seconds = seconds;
    on_progress(&last);

    let model = checker.model();
    let mut failed = false;
    let properties = model
        .properties()
        .iter()
        .map(|p| {
            let discovery = checker.discovery(p.name);
            let (expectation, holds) = match p.expectation {
                Expectation::Always => ("always", discovery.is_none()),
                Expectation::Sometimes => ("sometimes", discovery.is_some()),
                Expectation::Eventually => ("eventually", discovery.is_none()),
            };
            failed |= expectation != "sometimes" && !holds;
            PropertyResult {
                name: p.name,
                expectation,
                holds,
                path: discovery.map(|path| format_path(model, path)),
            }
        })
        .collect();
    CheckReport {
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        seconds,
        properties,
        complete: !failed,
    }
}

fn progress<C: Checker<CompletionModel>>(checker: &C, started: Instant) -> Progress {
    Progress {
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed_seconds: started.elapsed().as_secs_f64(),
    }
}

fn format_path(
    model: &CompletionModel,
    path: Path<CompletionState, CompletionAction>,
) -> Vec<String> {
    path.into_vec()
        .into_iter()
        .filter_map(|(state, action)| action.map(|a| model.describe(&state, &a)))
        .collect()
}
