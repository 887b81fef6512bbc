//! Conformance cases: JSON scripts of calls on one pure machine of `kvrelay-core`, with the
//! result each call must return (`shared/conformance/FORMAT.md`, extended in the project's
//! `tests/conformance/README.md`).
//!
//! `kvrelay conformance` collects the case files ([`collect_files`]) and runs each
//! ([`run_file`]), printing its [`Outcome`]; `kvrelay bench` parses one ([`AnyCase::parse`]) and
//! replays it. A case is parsed once into typed operations ([`PreparedCase`]): every argument is
//! converted to core values up front, so that replaying the operations (here, and in
//! [`crate::bench`]) measures only the machine. Anything wrong with a case — malformed JSON, an
//! unknown machine, call or argument, a wrongly typed value — is a [`CaseError`] naming the call,
//! never a panic.
//!
//! The files of this module, each importing only from those above it:
//! * `case.rs`: the case format, the [`Harness`] contract and [`PreparedCase`];
//! * `json.rs`: decoding arguments and encoding results, for every harness;
//! * one file per machine, each a [`Harness`]: `aggregator.rs`, `worker_meta.rs`,
//!   `event_accumulator.rs`, `worker_protocol.rs`, `engine.rs` (with `engine_offload.rs`, its
//!   offloading connector on the engine step), `offload_manager.rs`, `tiering_manager.rs`,
//!   `multi.rs`;
//! * this file: the dispatch on a case's `machine`, and running case files.

use std::fmt;
use std::path::{Path, PathBuf};

mod aggregator;
pub mod bench;
mod case;
mod engine;
mod engine_calls;
pub mod engine_offload;
mod engine_pd;
mod event_accumulator;
mod json;
mod multi;
mod offload_manager;
mod tiering_manager;
mod worker_meta;
mod worker_protocol;

pub use aggregator::{AggregatorHarness, AggregatorOp};
pub use case::{CaseError, Expect, Harness, PreparedCall, PreparedCase, check_one};
pub use engine::{EngineHarness, EngineOut, RequestSnapshot};
pub use engine_calls::{EngineOp, generated_prompt};
pub use engine_offload::OffloadEngine;
pub use engine_pd::{Substituted, substitute_pd};
pub use event_accumulator::{EventHarness, EventOp};
pub use multi::MultiHarness;
pub use offload_manager::OffloadManagerHarness;
pub use tiering_manager::TieringHarness;
pub use worker_meta::{WorkerMetaHarness, WorkerMetaOp};
pub use worker_protocol::{ProtocolHarness, ProtocolOp};

use case::RawCase;

/// The machines a case may name, and whether this build implements them.
pub const MACHINES: [(&str, bool); 8] = [
    ("aggregator", true),
    ("worker_meta", true),
    ("event_accumulator", true),
    ("worker_protocol", true),
    ("engine", true),
    ("offload_manager", true),
    ("tiering_manager", true),
    ("multi", true),
];

/// The result of one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The case's name (its path if the name could not be read).
    pub name: String,
    /// `Err` = the FAIL message.
    pub result: Result<(), String>,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.result {
            Ok(()) => write!(f, "PASS {}", self.name),
            Err(e) => write!(f, "FAIL {}: {e}", self.name),
        }
    }
}

/// A case of any machine, parsed.
#[derive(Debug)]
pub enum AnyCase {
    /// An `aggregator` case.
    Aggregator(PreparedCase<AggregatorHarness>),
    /// A `worker_meta` case.
    WorkerMeta(PreparedCase<WorkerMetaHarness>),
    /// An `event_accumulator` case.
    EventAccumulator(PreparedCase<EventHarness>),
    /// A `worker_protocol` case.
    WorkerProtocol(PreparedCase<ProtocolHarness>),
    /// An `engine` case.
    Engine(PreparedCase<EngineHarness>),
    /// An `offload_manager` case.
    OffloadManager(PreparedCase<OffloadManagerHarness>),
    /// A `tiering_manager` case.
    TieringManager(PreparedCase<TieringHarness>),
    /// A `multi` case.
    Multi(PreparedCase<MultiHarness>),
}

impl AnyCase {
    /// Parses a case from JSON text. `Err` carries the best name known and the reason.
    pub fn parse(text: &str, fallback_name: &str) -> Result<Self, (String, CaseError)> {
        let raw = RawCase::read(text, fallback_name)?;
        match raw.machine.as_str() {
            "aggregator" => PreparedCase::prepare(raw).map(AnyCase::Aggregator),
            "worker_meta" => PreparedCase::prepare(raw).map(AnyCase::WorkerMeta),
            "event_accumulator" => PreparedCase::prepare(raw).map(AnyCase::EventAccumulator),
            "worker_protocol" => PreparedCase::prepare(raw).map(AnyCase::WorkerProtocol),
            "engine" => PreparedCase::prepare(raw).map(AnyCase::Engine),
            "offload_manager" => PreparedCase::prepare(raw).map(AnyCase::OffloadManager),
            "tiering_manager" => PreparedCase::prepare(raw).map(AnyCase::TieringManager),
            "multi" => PreparedCase::prepare(raw).map(AnyCase::Multi),
            m => Err((
                raw.name,
                CaseError(format!(
                    "unknown machine `{m}` (known: {})",
                    MACHINES.map(|(n, _)| n).join(", ")
                )),
            )),
        }
    }

    /// The case's name.
    pub fn name(&self) -> &str {
        match self {
            AnyCase::Aggregator(c) => &c.name,
            AnyCase::WorkerMeta(c) => &c.name,
            AnyCase::EventAccumulator(c) => &c.name,
            AnyCase::WorkerProtocol(c) => &c.name,
            AnyCase::Engine(c) => &c.name,
            AnyCase::OffloadManager(c) => &c.name,
            AnyCase::TieringManager(c) => &c.name,
            AnyCase::Multi(c) => &c.name,
        }
    }

    /// Runs the case once.
    pub fn run(&self) -> Result<(), String> {
        match self {
            AnyCase::Aggregator(c) => c.run(),
            AnyCase::WorkerMeta(c) => c.run(),
            AnyCase::EventAccumulator(c) => c.run(),
            AnyCase::WorkerProtocol(c) => c.run(),
            AnyCase::Engine(c) => c.run(),
            AnyCase::OffloadManager(c) => c.run(),
            AnyCase::TieringManager(c) => c.run(),
            AnyCase::Multi(c) => c.run(),
        }
    }
}

/// Runs the case in file `path`.
pub fn run_file(path: &Path) -> Outcome {
    let fallback = path.display().to_string();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            return Outcome {
                name: fallback,
                result: Err(format!("cannot read: {e}")),
            };
        }
    };
    match AnyCase::parse(&text, &fallback) {
        Ok(case) => Outcome {
            name: case.name().to_string(),
            result: case.run(),
        },
        Err((name, e)) => Outcome {
            name,
            result: Err(e.0),
        },
    }
}

/// The case files under `paths` (files as given; folders recursively, `*.json`), sorted per
/// folder so that runs are reproducible.
pub fn collect_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("cannot read folder {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out)?;
            } else if p.extension().is_some_and(|x| x == "json") {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            walk(p, &mut out)?;
        } else if p.exists() {
            out.push(p.clone());
        } else {
            return Err(format!("no such file or folder: {}", p.display()));
        }
    }
    Ok(out)
}
