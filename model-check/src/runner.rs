//! The CLI-friendly runner: one model-checking run of any [`Explain`] model with progress
//! callbacks, returning a [`CheckReport`] whose discoveries come as readable lines, raw actions
//! and sequence-diagram arrows (see [`crate::mermaid`]); and the web explorer behind a loopback
//! guard ([`explorer_address`], [`serve_explorer`]).
//!
//! The runner knows no model: it takes any `M: Explain` (the trait of the `explain` module), so
//! the models never depend on it and it never depends on them. Call [`check`] for a plain run,
//! [`check_with_symmetry`] when the state has a `stateright::Representative` (rank symmetry),
//! [`serve_explorer`] to browse the state space; shorthands that pick a model and its options
//! (`check_completions`) live at the crate root, above both.

use core::convert::Infallible;
use core::fmt;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};

use stateright::{
    Checker, CheckerBuilder, Expectation, HasDiscoveries, Model, Path, Representative,
};

use crate::diagram::{Arrow, mermaid_with_final_note};
use crate::explain::Explain;
use crate::search::{self, Limits, SymmetricDfs};

/// How often `on_progress` is called while a check runs.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// How often the runner looks whether the checker is done.
const POLL_EVERY: Duration = Duration::from_millis(10);

/// Breadth-first or depth-first search.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub enum Strategy {
    /// Breadth-first (the default): with one thread every discovery is a shortest path; memory
    /// grows with the frontier (whole states).
    #[default]
    Bfs,
    /// Depth-first: far less memory, long counterexamples; the only strategy that honours
    /// symmetry reduction in stateright 0.31 ([`check_with_symmetry`]).
    Dfs,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::Bfs => "breadth-first",
            Strategy::Dfs => "depth-first",
        })
    }
}

/// How to run a check. `CheckOptions::default()` is one thread, breadth-first, no depth bound,
/// stop at the first violation.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct CheckOptions {
    /// Checker threads (0 counts as 1).
    pub threads: usize,
    /// The search strategy. [`check_with_symmetry`] always searches depth-first.
    pub strategy: Strategy,
    /// Explore only paths of at most this many states (the initial state counts as depth 1;
    /// `Some(0)` counts as no bound). A bounded run is not exhaustive when the bound was hit.
    pub target_max_depth: Option<usize>,
    /// Stop at the first violated `always`/`eventually` property (the default). Otherwise the
    /// run continues until every property has a discovery or the space is exhausted, so every
    /// property gets its own counterexample or example.
    pub stop_at_first_violation: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            threads: 1,
            strategy: Strategy::Bfs,
            target_max_depth: None,
            stop_at_first_violation: true,
        }
    }
}

/// Why a run ended.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Stop {
    /// Every reachable state (within the model's boundary) was explored.
    Exhaustive,
    /// The run stopped at the first violated property
    /// ([`CheckOptions::stop_at_first_violation`]); the other properties' verdicts only mean
    /// nothing was found before the stop.
    FirstViolation,
    /// Every property had a discovery, so nothing was left to learn (verdicts are final).
    AllDiscovered,
    /// Paths were cut at [`CheckOptions::target_max_depth`]: no violation within the bound is
    /// not a proof.
    DepthBound {
        /// The bound.
        depth: usize,
    },
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Exhaustive => f.write_str("explored exhaustively"),
            Stop::FirstViolation => {
                f.write_str("INCOMPLETE exploration (stopped at the first violation)")
            }
            Stop::AllDiscovered => f.write_str("stopped once every property had a discovery"),
            Stop::DepthBound { depth } => {
                write!(
                    f,
                    "BOUNDED exploration (paths cut at depth {depth}, not exhaustive)"
                )
            }
        }
    }
}

/// The outcome of one model-checking run.
#[derive(Clone, Debug)]
pub struct CheckReport {
    /// States generated (with repeats).
    pub states: usize,
    /// Distinct states visited (with symmetry reduction: distinct representatives).
    pub unique_states: usize,
    /// The deepest path explored (in actions, counting the initial state as depth 1).
    pub max_depth: usize,
    /// Wall-clock time of the run.
    pub seconds: f64,
    /// One entry per property of the model, in the model's order.
    pub properties: Vec<PropertyResult>,
    /// The whole reachable state space was explored (`stop == Stop::Exhaustive`). `false` when
    /// the run stopped at the first violated `always` property: the other properties' `holds`
    /// then only mean that no counterexample was found before the stop.
    pub complete: bool,
    /// Why the run ended.
    pub stop: Stop,
    /// The strategy that ran.
    pub strategy: Strategy,
    /// Symmetry reduction was on.
    pub symmetry: bool,
    /// The threads that ran.
    pub threads: usize,
    /// The model's sequence-diagram participants ([`Explain::participants`]), which the
    /// [`PropertyResult::diagram`] arrows index.
    pub participants: Vec<String>,
}

impl CheckReport {
    /// The result of the property named `name`, if the model has one.
    pub fn property(&self, name: &str) -> Option<&PropertyResult> {
        self.properties.iter().find(|p| p.name == name)
    }

    /// The run was exhaustive (or every property had a discovery), every `always` and
    /// `eventually` property holds and every `sometimes` property has an example.
    pub fn passed(&self) -> bool {
        matches!(self.stop, Stop::Exhaustive | Stop::AllDiscovered)
            && self.properties.iter().all(|p| p.holds)
    }

    /// No property failed within what was explored: like [`CheckReport::passed`], but a
    /// depth-bounded run counts (it is not a proof).
    pub fn passed_within_bound(&self) -> bool {
        self.passed()
            || (matches!(self.stop, Stop::DepthBound { .. })
                && self.properties.iter().all(|p| p.holds))
    }

    /// The first property (in the model's order) that failed: a violated `always`/`eventually`
    /// property, else a `sometimes` property without an example.
    pub fn first_failure(&self) -> Option<&PropertyResult> {
        self.properties
            .iter()
            .find(|p| !p.holds && p.expectation != "sometimes")
            .or_else(|| self.properties.iter().find(|p| !p.holds))
    }

    /// The Mermaid sequence diagram of the discovery (counterexample or example) of the
    /// property named `name`, ending with a note naming the property; `None` if there is no
    /// such property or it has no discovery.
    pub fn mermaid(&self, name: &str) -> Option<String> {
        let p = self.property(name)?;
        let steps = p.diagram.as_ref()?;
        let what = if p.expectation == "sometimes" {
            "example of"
        } else {
            "counterexample to"
        };
        Some(mermaid_with_final_note(
            &self.participants,
            steps,
            Some(&format!("{what} {} \"{}\"", p.expectation, p.name)),
        ))
    }
}

/// The verdict on one property.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct PropertyResult {
    /// The property's name, as the model's `stateright::Property` names it (the models of this
    /// crate list theirs in a `property_names` module).
    pub name: &'static str,
    /// `"always"`, `"sometimes"` or `"eventually"`.
    pub expectation: &'static str,
    /// `always`/`eventually`: no counterexample was found. `sometimes`: an example was found.
    pub holds: bool,
    /// `always`: the counterexample, if any; `sometimes`: the example, if any. One line per
    /// action, with what the action produced ([`Explain::describe`]).
    pub path: Option<Vec<String>>,
    /// The same path as the model's raw actions ([`Model::format_action`]), one per line.
    pub raw_path: Option<Vec<String>>,
    /// The same path as sequence-diagram arrows ([`Explain::arrow`]); render it with
    /// [`crate::mermaid`] and [`CheckReport::participants`] or with [`CheckReport::mermaid`].
    pub diagram: Option<Vec<Arrow>>,
    /// The same path as stateright's action indices (`0/3/1/…`), the explorer's
    /// `#/steps/<encoded>` fragment.
    pub encoded_path: Option<String>,
}

/// A progress snapshot, handed to the callback of [`check`] about every 200 ms and once at the
/// end.
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

impl Progress {
    /// States generated per second so far.
    pub fn states_per_second(&self) -> f64 {
        if self.elapsed_seconds > 0.0 {
            self.states as f64 / self.elapsed_seconds
        } else {
            0.0
        }
    }
}

/// Model-checks `model` as `options` say, calling `on_progress` about every 200 ms and once when
/// done.
///
/// Breadth-first search makes counterexamples short: with `threads == 1` a property's path is
/// a shortest one *if the model reports its first discovery only* (stateright 0.31 overwrites a
/// recorded path with later discoveries; the models of this crate guard against that), and with more
/// threads at most as deep as the threads had got when it was found.
pub fn check<M: Explain + Send + Sync + 'static>(
    model: M,
    options: &CheckOptions,
    on_progress: &mut dyn FnMut(&Progress),
) -> CheckReport {
    let builder = configure(model.checker(), options);
    match options.strategy {
        Strategy::Bfs => drive(
            builder.spawn_bfs(),
            options,
            Strategy::Bfs,
            false,
            on_progress,
        ),
        Strategy::Dfs => drive(
            builder.spawn_dfs(),
            options,
            Strategy::Dfs,
            false,
            on_progress,
        ),
    }
}

/// [`check`] with symmetry reduction: states are deduplicated by their
/// [`Representative::representative`] (e.g. ranks sorted), so `unique_states` counts
/// equivalence classes. This always searches depth-first, whatever `options.strategy` says
/// ([`CheckReport::strategy`] records it); counterexamples are therefore not shortest.
///
/// A model whose properties are all `always` or `sometimes` (every model of this crate) is
/// checked by kvrelay's own depth-first search (`search.rs`): the states stateright's
/// depth-first checker visits with symmetry, without a path per state and with one
/// fingerprint per new state. A model with an `eventually` property is checked by
/// stateright's.
pub fn check_with_symmetry<M>(
    model: M,
    options: &CheckOptions,
    on_progress: &mut dyn FnMut(&Progress),
) -> CheckReport
where
    M: Explain + Send + Sync + 'static,
    M::State: Representative,
{
    if !search::supports(&model) {
        let builder = configure(model.checker(), options).symmetry();
        return drive(
            builder.spawn_dfs(),
            options,
            Strategy::Dfs,
            true,
            on_progress,
        );
    }
    let limits = Limits {
        threads: options.threads.max(1),
        target_max_depth: options.target_max_depth.filter(|&d| d > 0),
        stop_at_first_violation: options.stop_at_first_violation,
    };
    drive(
        SymmetricDfs::spawn(model, limits),
        options,
        Strategy::Dfs,
        true,
        on_progress,
    )
}

fn configure<M: Explain>(builder: CheckerBuilder<M>, options: &CheckOptions) -> CheckerBuilder<M> {
    let mut builder =
        builder
            .threads(options.threads.max(1))
            .finish_when(if options.stop_at_first_violation {
                HasDiscoveries::AnyFailures
            } else {
                HasDiscoveries::All
            });
    if let Some(depth) = options.target_max_depth.filter(|&d| d > 0) {
        builder = builder.target_max_depth(depth);
    }
    builder
}

fn drive<M: Explain, C: Checker<M>>(
    checker: C,
    options: &CheckOptions,
    strategy: Strategy,
    symmetry: bool,
    on_progress: &mut dyn FnMut(&Progress),
) -> CheckReport {
    let started = Instant::now();
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
    let mut discovered = 0usize;
    let properties: Vec<PropertyResult> = model
        .properties()
        .iter()
        .map(|p| {
            let discovery = checker.discovery(p.name);
            discovered += usize::from(discovery.is_some());
            let (expectation, holds) = match p.expectation {
                Expectation::Always => ("always", discovery.is_none()),
                Expectation::Sometimes => ("sometimes", discovery.is_some()),
                Expectation::Eventually => ("eventually", discovery.is_none()),
            };
            failed |= expectation != "sometimes" && !holds;
            let mut result = PropertyResult {
                name: p.name,
                expectation,
                holds,
                path: None,
                raw_path: None,
                diagram: None,
                encoded_path: None,
            };
            if let Some(path) = discovery {
                result.encoded_path = Some(path.encode(model));
                let (lines, raw, arrows) = explain_path(model, path);
                result.path = Some(lines);
                result.raw_path = Some(raw);
                result.diagram = Some(arrows);
            }
            result
        })
        .collect();
    let max_depth = checker.max_depth();
    let bound = options.target_max_depth.filter(|&d| d > 0);
    let stop = if failed && options.stop_at_first_violation {
        Stop::FirstViolation
    } else if !properties.is_empty() && discovered == properties.len() {
        Stop::AllDiscovered
    } else if let Some(depth) = bound.filter(|&d| max_depth >= d) {
        Stop::DepthBound { depth }
    } else {
        Stop::Exhaustive
    };
    CheckReport {
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth,
        seconds,
        properties,
        complete: stop == Stop::Exhaustive,
        stop,
        strategy,
        symmetry,
        threads: options.threads.max(1),
        participants: model.participants(),
    }
}

fn progress<M: Model, C: Checker<M>>(checker: &C, started: Instant) -> Progress {
    Progress {
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed_seconds: started.elapsed().as_secs_f64(),
    }
}

/// A discovery's described lines, raw actions and arrows.
fn explain_path<M: Explain>(
    model: &M,
    path: Path<M::State, M::Action>,
) -> (Vec<String>, Vec<String>, Vec<Arrow>) {
    let mut lines = Vec::new();
    let mut raw = Vec::new();
    let mut arrows = Vec::new();
    for (state, action) in path.into_vec() {
        if let Some(a) = action {
            lines.push(model.describe(&state, &a));
            raw.push(model.format_action(&a));
            arrows.push(model.arrow(&state, &a));
        }
    }
    (lines, raw, arrows)
}

/// Why the explorer cannot be served on an address.
#[derive(Debug)]
pub enum ExploreError {
    /// The address did not parse or resolve.
    BadAddress {
        /// The address as given.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The address is not a loopback address and remote access was not allowed: the explorer
    /// has no authentication and lets anyone who reaches it run the checker.
    NotLoopback {
        /// The address as given.
        addr: String,
        /// The resolved address that is not loopback.
        resolved: SocketAddr,
    },
    /// The address could not be bound (in use, no permission).
    Bind {
        /// The resolved address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

impl fmt::Display for ExploreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExploreError::BadAddress { addr, reason } => {
                write!(f, "cannot use {addr:?} as the explorer's address: {reason}")
            }
            ExploreError::NotLoopback { addr, resolved } => write!(
                f,
                "refusing to serve the explorer on {addr} ({resolved}): not a loopback address, \
                 and the explorer has no authentication; use 127.0.0.1:PORT (and an SSH tunnel), \
                 or pass --allow-remote to serve it on the network anyway"
            ),
            ExploreError::Bind { addr, source } => {
                write!(f, "cannot serve the explorer on {addr}: {source}")
            }
        }
    }
}

impl std::error::Error for ExploreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ExploreError::Bind { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Resolves `addr` (`HOST:PORT`, e.g. `127.0.0.1:3000`, `localhost:3000`, `[::1]:3000`) to
/// the one address the explorer will listen on: the first one it resolves to. Unless
/// `allow_remote`, every address it resolves to must be loopback.
pub fn explorer_address(addr: &str, allow_remote: bool) -> Result<SocketAddr, ExploreError> {
    let bad = |reason: String| ExploreError::BadAddress {
        addr: addr.to_owned(),
        reason,
    };
    let resolved: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| bad(format!("{e} (expected HOST:PORT, e.g. 127.0.0.1:3000)")))?
        .collect();
    let Some(&first) = resolved.first() else {
        return Err(bad("it resolves to no address".to_owned()));
    };
    if let Some(&remote) = resolved
        .iter()
        .find(|a| !allow_remote && !a.ip().is_loopback())
    {
        return Err(ExploreError::NotLoopback {
            addr: addr.to_owned(),
            resolved: remote,
        });
    }
    Ok(first)
}

/// The explorer's URL for `addr`.
pub fn explorer_url(addr: SocketAddr) -> String {
    format!("http://{addr}/")
}

/// Serves stateright's web explorer of `model` on `addr` (from [`explorer_address`]) with
/// `threads` checker threads. Checks first that the address can be bound, then calls
/// `on_listening` (print the URL there) and serves until the process ends: it returns only
/// with an error.
///
/// The explorer evaluates the properties state by state; a model that reports only its first
/// discovery per property (as the models of this crate do) shows each discovery once.
pub fn serve_explorer<M: Explain>(
    model: M,
    addr: SocketAddr,
    threads: usize,
    on_listening: impl FnOnce(&str),
) -> Result<Infallible, ExploreError> {
    // stateright's explorer panics on a bind error: bind once first for a clear message.
    match TcpListener::bind(addr) {
        Ok(listener) => drop(listener),
        Err(source) => return Err(ExploreError::Bind { addr, source }),
    }
    on_listening(&explorer_url(addr));
    let _checker = model.checker().threads(threads.max(1)).serve(addr);
    Err(ExploreError::Bind {
        addr,
        source: std::io::Error::other("the explorer's server stopped"),
    })
}
