//! Conformance cases: JSON scripts of calls on one pure machine of `kvrelay-core`, with the
//! result each call must return (`shared/conformance/FORMAT.md`, extended in the project's
//! `tests/conformance/README.md`).
//!
//! A case is parsed once into typed operations ([`PreparedCase`]): every argument is converted
//! to core values up front, so that replaying the operations (here, and in [`crate::bench`])
//! measures only the machine. Anything wrong with a case — malformed JSON, an unknown machine,
//! call or argument, a wrongly typed value — is a [`CaseError`] naming the call, never a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use kvrelay_core::{
    AggregatedOutput, Aggregator, BlockId, ConnectorCall, EventAccumulator, GroupKind, Interner,
    JobId, KeyLookup, KvEvent, KvEvents, LoadFailurePolicy, Lookup, Meta, Mode, ModelOutput,
    OffloadMeta, Params, Rank, RequestId, RequestSpec, RequestStatus, ScheduledStep, Scheduler,
    SchedulerConfig, SchedulerError, SchedulerOutput, ScriptedConnector, ScriptedMeta, SortedSet,
    StepId, StepResult, StepShape, Token, WorkerCall, WorkerOutput, WorkerProtocol,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

pub mod engine_offload;
mod multi;
mod offload_manager;

pub use engine_offload::OffloadEngine;
pub use multi::MultiHarness;
pub use offload_manager::OffloadManagerHarness;

/// Why a case could not be run as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseError(pub String);

impl fmt::Display for CaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CaseError {}

fn err<T>(msg: impl Into<String>) -> Result<T, CaseError> {
    Err(CaseError(msg.into()))
}

/// The machines a case may name, and whether this build implements them.
pub const MACHINES: [(&str, bool); 7] = [
    ("aggregator", true),
    ("worker_meta", true),
    ("event_accumulator", true),
    ("worker_protocol", true),
    ("engine", true),
    ("offload_manager", true),
    ("multi", true),
];

// ---------------------------------------------------------------------------------------------
// The case file

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCase {
    name: String,
    machine: String,
    #[serde(default)]
    config: Map<String, Value>,
    calls: Vec<RawCall>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCall {
    call: String,
    #[serde(default)]
    args: Map<String, Value>,
    /// `Some(Value::Null)` when the case expects `null`; `None` when it expects nothing.
    #[serde(default, deserialize_with = "present")]
    expect: Option<Value>,
    #[serde(default)]
    expect_error: Option<String>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// What a call must produce.
#[derive(Debug, Clone, PartialEq)]
pub enum Expect {
    /// Only success.
    Success,
    /// This exact (normalised) JSON result.
    Value(Value),
    /// A typed error of this kind.
    Error(String),
}

/// One call, converted to core values.
#[derive(Debug, Clone)]
pub struct PreparedCall<Op> {
    /// The call's name, as written in the case (also the benchmark's call kind).
    pub call: String,
    /// The converted operation.
    pub op: Op,
    /// What it must return.
    pub expect: Expect,
}

/// A machine that conformance cases can drive.
pub trait Harness: Sized {
    /// A call with its arguments converted to core values.
    type Op: Clone + fmt::Debug;
    /// What a call returns, before rendering to JSON.
    type Out;
    /// A fresh machine from the case's `config`.
    fn new(config: &Map<String, Value>) -> Result<Self, CaseError>;
    /// Converts one call (ids are interned in `ids`).
    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError>;
    /// Runs one call: `Err(kind)` is a typed error of the machine.
    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str>;
    /// The machine's `check_invariants()`, run after every call.
    fn check_invariants(&self) -> Result<(), String> {
        Ok(())
    }
    /// The canonical JSON of a result.
    fn render(out: &Self::Out, ids: &Interner) -> Value;
    /// The canonical JSON of an expected result of `call` (so that sets written in any order
    /// compare equal); an expected value that is no valid result is a [`CaseError`].
    fn normalize_expected(call: &str, v: &Value, ids: &mut Interner) -> Result<Value, CaseError>;
}

/// A parsed case, ready to run any number of times on fresh machines.
#[derive(Debug)]
pub struct PreparedCase<H: Harness> {
    /// The case's name.
    pub name: String,
    /// Its machine config.
    pub config: Map<String, Value>,
    /// Its calls.
    pub calls: Vec<PreparedCall<H::Op>>,
    /// The ids the case uses.
    pub ids: Interner,
}

impl<H: Harness> PreparedCase<H> {
    fn prepare(raw: RawCase) -> Result<Self, (String, CaseError)> {
        let name = raw.name;
        let fail = |e: CaseError| (name.clone(), e);
        H::new(&raw.config).map_err(|e| fail(CaseError(format!("config: {e}"))))?;
        let mut ids = Interner::new();
        let mut calls = Vec::with_capacity(raw.calls.len());
        for (i, c) in raw.calls.into_iter().enumerate() {
            let at = |e: CaseError| fail(CaseError(format!("call {i} ({}): {e}", c.call)));
            let op = H::convert(&c.call, &c.args, &mut ids).map_err(at)?;
            let expect = match (c.expect, c.expect_error) {
                (Some(_), Some(_)) => {
                    return Err(at(CaseError("has both `expect` and `expect_error`".into())));
                }
                (Some(v), None) => {
                    Expect::Value(H::normalize_expected(&c.call, &v, &mut ids).map_err(|e| {
                        at(CaseError(format!("`expect` is not a valid result: {e}")))
                    })?)
                }
                (None, Some(k)) => Expect::Error(k),
                (None, None) => Expect::Success,
            };
            calls.push(PreparedCall {
                call: c.call,
                op,
                expect,
            });
        }
        Ok(Self {
            name,
            config: raw.config,
            calls,
            ids,
        })
    }

    /// Runs every call on a fresh machine; the first mismatch is the error.
    pub fn run(&self) -> Result<(), String> {
        let mut m = H::new(&self.config).map_err(|e| format!("config: {e}"))?;
        for (i, c) in self.calls.iter().enumerate() {
            let got = m.apply(&c.op);
            m.check_invariants()
                .map_err(|e| format!("call {i} ({}): core invariant broken: {e}", c.call))?;
            check_one(i, c, got.map(|o| H::render(&o, &self.ids)))?;
        }
        Ok(())
    }
}

/// Compares one call's result with its expectation; `Err` is the FAIL message.
pub fn check_one<Op>(
    i: usize,
    c: &PreparedCall<Op>,
    got: Result<Value, &'static str>,
) -> Result<(), String> {
    let shown = |r: &Result<Value, &str>| match r {
        Ok(v) => v.to_string(),
        Err(k) => json!({ "error": k }).to_string(),
    };
    let ok = match (&c.expect, &got) {
        (Expect::Success, Ok(_)) => true,
        (Expect::Value(want), Ok(v)) => want == v,
        (Expect::Error(kind), Err(k)) => kind == k,
        _ => false,
    };
    if ok {
        return Ok(());
    }
    let want = match &c.expect {
        Expect::Success => "success".to_string(),
        Expect::Value(v) => v.to_string(),
        Expect::Error(k) => json!({ "error": k }).to_string(),
    };
    Err(format!(
        "call {i} ({}): expected {want}, got {}",
        c.call,
        shown(&got)
    ))
}

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
    /// A `multi` case.
    Multi(PreparedCase<MultiHarness>),
}

impl AnyCase {
    /// Parses a case from JSON text. `Err` carries the best name known and the reason.
    pub fn parse(text: &str, fallback_name: &str) -> Result<Self, (String, CaseError)> {
        let raw: RawCase = match serde_json::from_str(text) {
            Ok(r) => r,
            Err(e) => {
                // Report under the case's own name when at least that much is readable.
                let name = serde_json::from_str::<Value>(text)
                    .ok()
                    .and_then(|v| v.get("name").and_then(Value::as_str).map(str::to_string))
                    .unwrap_or_else(|| fallback_name.to_string());
                return Err((name, CaseError(format!("malformed case: {e}"))));
            }
        };
        match raw.machine.as_str() {
            "aggregator" => PreparedCase::prepare(raw).map(AnyCase::Aggregator),
            "worker_meta" => PreparedCase::prepare(raw).map(AnyCase::WorkerMeta),
            "event_accumulator" => PreparedCase::prepare(raw).map(AnyCase::EventAccumulator),
            "worker_protocol" => PreparedCase::prepare(raw).map(AnyCase::WorkerProtocol),
            "engine" => PreparedCase::prepare(raw).map(AnyCase::Engine),
            "offload_manager" => PreparedCase::prepare(raw).map(AnyCase::OffloadManager),
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

// ---------------------------------------------------------------------------------------------
// Argument helpers

/// Deserialises argument `key` (absent = `default`), naming it in the error.
fn arg<T: serde::de::DeserializeOwned>(
    args: &Map<String, Value>,
    key: &str,
    default: Option<T>,
) -> Result<T, CaseError> {
    match args.get(key) {
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| CaseError(format!("argument `{key}`: {e}"))),
        None => default.map_or_else(|| err(format!("missing argument `{key}`")), Ok),
    }
}

/// Rejects arguments other than `known`.
fn only(args: &Map<String, Value>, known: &[&str]) -> Result<(), CaseError> {
    match args.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) if known.is_empty() => {
            err(format!("unknown argument `{k}` (this call takes none)"))
        }
        Some(k) => err(format!(
            "unknown argument `{k}` (expected {})",
            known.join(", ")
        )),
    }
}

fn unknown_call<T>(call: &str, known: &[&str]) -> Result<T, CaseError> {
    err(format!(
        "unknown call `{call}` (expected one of: {})",
        known.join(", ")
    ))
}

// ---------------------------------------------------------------------------------------------
// JSON shapes of the shared values

/// Meta, as written in cases.
#[derive(Deserialize, Clone, Debug)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum JMeta {
    Offload(JOffload),
    Set(Vec<String>),
    Multi(Vec<Option<JMeta>>),
}

#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
struct JOffload {
    #[serde(default)]
    completed_jobs: BTreeMap<u64, u32>,
    #[serde(default)]
    bytes: u64,
    #[serde(default)]
    transfers: u64,
}

impl JMeta {
    fn into_core(self) -> Meta {
        match self {
            JMeta::Offload(o) => {
                let mut m = OffloadMeta::from_counts(
                    o.completed_jobs.into_iter().map(|(j, n)| (JobId(j), n)),
                );
                m.bytes = o.bytes;
                m.transfers = o.transfers;
                Meta::Offload(m)
            }
            JMeta::Set(items) => Meta::Set(SortedSet::from_vec(items)),
            JMeta::Multi(slots) => {
                Meta::Multi(slots.into_iter().map(|s| s.map(JMeta::into_core)).collect())
            }
        }
    }
}

fn render_meta(m: &Meta) -> Value {
    match m {
        Meta::Offload(o) => {
            let jobs: Map<String, Value> = o
                .completed_jobs()
                .map(|(j, n)| (j.0.to_string(), json!(n)))
                .collect();
            json!({ "offload": { "completed_jobs": jobs, "bytes": o.bytes, "transfers": o.transfers } })
        }
        Meta::Set(s) => json!({ "set": s.as_slice() }),
        Meta::Multi(slots) => {
            json!({ "multi": slots.iter().map(|s| s.as_ref().map_or(Value::Null, render_meta)).collect::<Vec<_>>() })
        }
    }
}

fn render_opt_meta(m: Option<&Meta>) -> Value {
    m.map_or(Value::Null, render_meta)
}

fn parse_meta(v: &Value) -> Result<Option<Meta>, CaseError> {
    serde_json::from_value::<Option<JMeta>>(v.clone())
        .map(|m| m.map(JMeta::into_core))
        .map_err(|e| CaseError(format!("not a Meta: {e}")))
}

/// WorkerOutput, as written in cases (every field optional).
#[derive(Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields)]
struct JWorkerOutput {
    #[serde(default)]
    finished_sending: Option<Vec<String>>,
    #[serde(default)]
    finished_recving: Option<Vec<String>>,
    #[serde(default)]
    invalid_block_ids: Vec<u64>,
    #[serde(default)]
    failed_recving: Vec<String>,
    #[serde(default)]
    expected_finished_count: u32,
    #[serde(default)]
    worker_meta: Option<JMeta>,
    #[serde(default)]
    kv_events: Option<Vec<String>>,
}

fn id_set(names: Vec<String>, ids: &mut Interner) -> SortedSet<RequestId> {
    names.iter().map(|n| ids.intern(n)).collect()
}

impl JWorkerOutput {
    fn into_core(self, ids: &mut Interner) -> WorkerOutput {
        WorkerOutput {
            finished_sending: self.finished_sending.map(|s| id_set(s, ids)),
            finished_recving: self.finished_recving.map(|s| id_set(s, ids)),
            invalid_block_ids: self.invalid_block_ids.into_iter().map(BlockId).collect(),
            failed_recving: id_set(self.failed_recving, ids),
            expected_finished_count: self.expected_finished_count,
            worker_meta: self.worker_meta.map(JMeta::into_core),
            kv_events: self
                .kv_events
                .map(|e| KvEvents::from_worker(e.into_iter().map(KvEvent).collect())),
        }
    }
}

/// `{"events": [...], "workers": n}`.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
struct JEvents {
    events: Vec<String>,
    workers: std::num::NonZeroU32,
}

impl JEvents {
    fn into_core(self) -> KvEvents {
        KvEvents {
            events: self.events.into_iter().map(KvEvent).collect(),
            workers: self.workers,
        }
    }
}

fn render_events(e: Option<&KvEvents>) -> Value {
    match e {
        None => Value::Null,
        Some(e) => {
            let mut evs: Vec<&str> = e.events.iter().map(|x| x.0.as_str()).collect();
            evs.sort_unstable();
            json!({ "events": evs, "workers": e.workers.get() })
        }
    }
}

/// A set of request ids as a JSON array sorted by the ids' names (byte order).
fn render_ids(s: &SortedSet<RequestId>, ids: &Interner) -> Value {
    let names: BTreeSet<&str> = s.iter().map(|&id| ids.resolve(id).unwrap_or("?")).collect();
    json!(names)
}

fn render_opt_ids(s: Option<&SortedSet<RequestId>>, ids: &Interner) -> Value {
    s.map_or(Value::Null, |s| render_ids(s, ids))
}

// ---------------------------------------------------------------------------------------------
// aggregator

/// The `aggregator` machine.
#[derive(Debug)]
pub struct AggregatorHarness(Aggregator);

/// A converted `aggregator` call.
#[derive(Debug, Clone)]
pub enum AggregatorOp {
    /// `aggregate`.
    Aggregate {
        /// Index = rank.
        outputs: Vec<Option<WorkerOutput>>,
        /// The rank whose output carries the result.
        output_rank: Rank,
    },
    /// `salvage`.
    Salvage {
        /// Index = rank.
        outputs: Vec<Option<WorkerOutput>>,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AggregatorConfig {
    quorum: u32,
    #[serde(default)]
    mode: Mode,
}

/// AggregatedOutput, as written in `expect` (every field required).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JAggregated {
    finished_sending: Option<Vec<String>>,
    finished_recving: Option<Vec<String>>,
    invalid_block_ids: Vec<u64>,
    failed_recving: Vec<String>,
    worker_meta: Option<JMeta>,
    kv_events: Option<JEvents>,
    expected_finished_count: u32,
}

fn render_aggregated(a: &AggregatedOutput, ids: &Interner) -> Value {
    json!({
        "finished_sending": render_opt_ids(a.finished_sending.as_ref(), ids),
        "finished_recving": render_opt_ids(a.finished_recving.as_ref(), ids),
        "invalid_block_ids": a.invalid_block_ids.iter().map(|b| b.0).collect::<Vec<_>>(),
        "failed_recving": render_ids(&a.failed_recving, ids),
        "worker_meta": render_opt_meta(a.worker_meta.as_ref()),
        "kv_events": render_events(a.kv_events.as_ref()),
        "expected_finished_count": a.expected_finished_count,
    })
}

fn parse_outputs(
    args: &Map<String, Value>,
    ids: &mut Interner,
) -> Result<Vec<Option<WorkerOutput>>, CaseError> {
    let raw: Vec<Option<JWorkerOutput>> = arg(args, "outputs", None)?;
    Ok(raw
        .into_iter()
        .map(|o| o.map(|o| o.into_core(ids)))
        .collect())
}

impl Harness for AggregatorHarness {
    type Op = AggregatorOp;
    type Out = Option<AggregatedOutput>;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let c: AggregatorConfig = serde_json::from_value(Value::Object(config.clone()))
            .map_err(|e| CaseError(e.to_string()))?;
        if c.quorum == 0 {
            return err("`quorum` must be at least 1");
        }
        Ok(Self(Aggregator::new(c.quorum, c.mode)))
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        match call {
            "aggregate" => {
                only(args, &["outputs", "output_rank"])?;
                let outputs = parse_outputs(args, ids)?;
                let output_rank: u32 = arg(args, "output_rank", Some(0))?;
                Ok(AggregatorOp::Aggregate {
                    outputs,
                    output_rank: Rank(output_rank),
                })
            }
            "salvage" => {
                only(args, &["outputs"])?;
                Ok(AggregatorOp::Salvage {
                    outputs: parse_outputs(args, ids)?,
                })
            }
            _ => unknown_call(call, &["aggregate", "salvage"]),
        }
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        match op {
            AggregatorOp::Aggregate {
                outputs,
                output_rank,
            } => self
                .0
                .aggregate(outputs, *output_rank)
                .map_err(|e| e.kind()),
            AggregatorOp::Salvage { outputs } => {
                self.0.salvage(outputs.clone());
                Ok(None)
            }
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.0.check_invariants().map_err(|e| e.to_string())
    }

    fn render(out: &Self::Out, ids: &Interner) -> Value {
        out.as_ref()
            .map_or(Value::Null, |a| render_aggregated(a, ids))
    }

    fn normalize_expected(call: &str, v: &Value, ids: &mut Interner) -> Result<Value, CaseError> {
        if v.is_null() || call != "aggregate" {
            return Ok(v.clone());
        }
        let j: JAggregated =
            serde_json::from_value(v.clone()).map_err(|e| CaseError(e.to_string()))?;
        let a = AggregatedOutput {
            finished_sending: j.finished_sending.map(|s| id_set(s, ids)),
            finished_recving: j.finished_recving.map(|s| id_set(s, ids)),
            invalid_block_ids: j.invalid_block_ids.into_iter().map(BlockId).collect(),
            failed_recving: id_set(j.failed_recving, ids),
            worker_meta: j.worker_meta.map(JMeta::into_core),
            kv_events: j.kv_events.map(JEvents::into_core),
            expected_finished_count: j.expected_finished_count,
        };
        Ok(render_aggregated(&a, ids))
    }
}

// ---------------------------------------------------------------------------------------------
// worker_meta

/// The `worker_meta` machine (stateless: merge and build).
#[derive(Debug)]
pub struct WorkerMetaHarness;

/// A converted `worker_meta` call.
#[derive(Debug, Clone)]
pub enum WorkerMetaOp {
    /// `merge`.
    Merge(Option<Meta>, Option<Meta>),
    /// `build_multi`.
    BuildMulti(Vec<Option<Meta>>),
}

impl Harness for WorkerMetaHarness {
    type Op = WorkerMetaOp;
    type Out = Option<Meta>;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        only(config, &[])?;
        Ok(Self)
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        let meta_arg = |k: &str| -> Result<Option<Meta>, CaseError> {
            parse_meta(args.get(k).unwrap_or(&Value::Null))
                .map_err(|e| CaseError(format!("argument `{k}`: {e}")))
        };
        match call {
            "merge" => {
                only(args, &["a", "b"])?;
                Ok(WorkerMetaOp::Merge(meta_arg("a")?, meta_arg("b")?))
            }
            "build_multi" => {
                only(args, &["children"])?;
                let raw: Vec<Option<JMeta>> = arg(args, "children", None)?;
                Ok(WorkerMetaOp::BuildMulti(
                    raw.into_iter().map(|m| m.map(JMeta::into_core)).collect(),
                ))
            }
            _ => unknown_call(call, &["merge", "build_multi"]),
        }
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        match op {
            WorkerMetaOp::Merge(a, b) => {
                kvrelay_core::merge(a.clone(), b.clone()).map_err(|_| "meta_mismatch")
            }
            WorkerMetaOp::BuildMulti(children) => Ok(kvrelay_core::build_multi(children.clone())),
        }
    }

    fn render(out: &Self::Out, _ids: &Interner) -> Value {
        render_opt_meta(out.as_ref())
    }

    fn normalize_expected(_call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        Ok(render_opt_meta(parse_meta(v)?.as_ref()))
    }
}

// ---------------------------------------------------------------------------------------------
// event_accumulator

/// The `event_accumulator` machine.
#[derive(Debug)]
pub struct EventHarness(EventAccumulator);

/// A converted `event_accumulator` call.
#[derive(Debug, Clone)]
pub enum EventOp {
    /// `update`.
    Update(Option<KvEvents>),
    /// `take`.
    Take,
}

impl Harness for EventHarness {
    type Op = EventOp;
    type Out = Option<Vec<KvEvent>>;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        only(config, &[])?;
        Ok(Self(EventAccumulator::new()))
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        match call {
            "update" => {
                only(args, &["kv_events"])?;
                let e: Option<JEvents> = arg(args, "kv_events", Some(None))?;
                Ok(EventOp::Update(e.map(JEvents::into_core)))
            }
            "take" => {
                only(args, &[])?;
                Ok(EventOp::Take)
            }
            _ => unknown_call(call, &["update", "take"]),
        }
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        match op {
            EventOp::Update(e) => {
                self.0.update(e.as_ref());
                Ok(None)
            }
            EventOp::Take => Ok(Some(self.0.take())),
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.0.check_invariants().map_err(|e| e.to_string())
    }

    fn render(out: &Self::Out, _ids: &Interner) -> Value {
        match out {
            None => Value::Null,
            Some(evs) => {
                let mut v: Vec<&str> = evs.iter().map(|e| e.0.as_str()).collect();
                v.sort_unstable();
                json!(v)
            }
        }
    }

    fn normalize_expected(call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        if call != "take" {
            return Ok(v.clone());
        }
        let mut evs: Vec<String> =
            serde_json::from_value(v.clone()).map_err(|e| CaseError(e.to_string()))?;
        evs.sort_unstable();
        Ok(json!(evs))
    }
}

// ---------------------------------------------------------------------------------------------
// worker_protocol

/// The `worker_protocol` machine.
#[derive(Debug)]
pub struct ProtocolHarness(WorkerProtocol);

/// A converted `worker_protocol` call.
#[derive(Debug, Clone, Copy)]
pub enum ProtocolOp {
    /// `begin_step`.
    BeginStep(StepShape),
    /// A hook.
    Hook(WorkerCall),
}

impl Harness for ProtocolHarness {
    type Op = ProtocolOp;
    type Out = ();

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        only(config, &[])?;
        Ok(Self(WorkerProtocol::new()))
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        if call == "begin_step" {
            only(args, &["sync_loads", "forward", "defer_finalize"])?;
            let d = StepShape::default();
            return Ok(ProtocolOp::BeginStep(StepShape {
                sync_loads: arg(args, "sync_loads", Some(d.sync_loads))?,
                forward: arg(args, "forward", Some(d.forward))?,
                defer_finalize: arg(args, "defer_finalize", Some(d.defer_finalize))?,
            }));
        }
        match WorkerCall::from_name(call) {
            Some(hook) => {
                only(args, &[])?;
                Ok(ProtocolOp::Hook(hook))
            }
            None => {
                let mut known = vec!["begin_step"];
                known.extend(WorkerCall::ALL.map(WorkerCall::name));
                unknown_call(call, &known)
            }
        }
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        match *op {
            ProtocolOp::BeginStep(shape) => self.0.begin_step(shape).map(|_| ()),
            ProtocolOp::Hook(call) => self.0.handle(call),
        }
        .map_err(|v| v.kind())
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.0.check_invariants().map_err(|e| e.to_string())
    }

    fn render(_out: &Self::Out, _ids: &Interner) -> Value {
        json!("ok")
    }

    fn normalize_expected(_call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        Ok(v.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// engine

/// The `engine` machine: the scheduler ([`Scheduler`]) driven by the [`ScriptedConnector`]
/// (the case plays the executor) or by the offloading connector with simulated ranks
/// ([`OffloadEngine`]).
#[derive(Debug)]
pub struct EngineHarness(EngineInner);

/// The connector an `engine` case runs with.
#[derive(Debug)]
enum EngineInner {
    Scripted(Box<Scheduler<ScriptedConnector>>),
    Offload(Box<OffloadEngine>),
}

/// A converted `engine` call.
#[derive(Debug, Clone)]
pub enum EngineOp {
    /// `add_request`: the spec, the scripted lookup answer (if given) and delay-free (if given).
    AddRequest {
        /// The request.
        spec: RequestSpec,
        /// `Some(answer)` when the case gave `lookup`.
        lookup: Option<Lookup>,
        /// `Some(delay)` when the case gave `delay_free`.
        delay_free: Option<bool>,
    },
    /// `set_lookup`.
    SetLookup(RequestId, Lookup),
    /// `set_delay_free`.
    SetDelayFree(RequestId, bool),
    /// `set_delay_all`.
    SetDelayAll(bool),
    /// `set_finish_params`.
    SetFinishParams(RequestId, Params),
    /// `set_pending_block_frees`.
    SetPendingBlockFrees(bool),
    /// `set_push_work`.
    SetPushWork(bool),
    /// `abort`.
    Abort(RequestId),
    /// `schedule`.
    Schedule,
    /// `apply_output`.
    ApplyOutput {
        /// The step (`None`: the oldest in flight).
        step: Option<StepId>,
        /// Per-request overrides of the fake sampler.
        sampled: Vec<(RequestId, Vec<Token>)>,
        /// The aggregated connector output (`None`: the step produced none).
        kv: Option<AggregatedOutput>,
        /// Whether the case gave any connector-output field (scripted connector only).
        kv_given: bool,
    },
    /// `execute` (offloading): every rank's worker step for a scheduled step.
    Execute(Option<StepId>),
    /// `run_step` (offloading): `schedule`, `execute`, `apply_output`.
    RunStep,
    /// `drain` (offloading): `run_step` until no request is left, at most this many steps.
    Drain(u32),
    /// `hold` (offloading).
    Hold {
        /// The rank.
        rank: u32,
        /// Held or not.
        value: bool,
    },
    /// `complete` (offloading): feed completions to one rank.
    Complete {
        /// The rank.
        rank: u32,
        /// The jobs (`None`: every transfer in flight on it).
        jobs: Option<Vec<JobId>>,
    },
    /// `lookup` (offloading): the manager's answer for the chunks of a prompt.
    Lookup {
        /// A request whose prompt to use (`Some(None)`: a name never seen, which `lookup` does
        /// not intern, as the oracle does not: interning order decides the fake sampler's
        /// tokens).
        id: Option<Option<RequestId>>,
        /// Or explicit tokens.
        prompt: Option<Vec<Token>>,
    },
    /// `offload_state` (offloading).
    OffloadState,
    /// `reset_cache`: `reset_connector_cache()`.
    ResetCache,
    /// `request`.
    Request(RequestId),
    /// `state`.
    State,
    /// `connector_calls`.
    ConnectorCalls,
}

/// A request as `request` shows it.
#[derive(Debug, Clone)]
pub struct RequestSnapshot {
    status: RequestStatus,
    num_computed_tokens: u32,
    block_ids: Vec<Vec<BlockId>>,
    num_preemptions: u32,
}

/// What an `engine` call returns, before rendering.
#[derive(Debug)]
pub enum EngineOut {
    /// `"ok"`.
    Ok,
    /// `abort`'s answer.
    Bool(bool),
    /// `schedule`'s step, and the number of KV cache groups.
    Scheduled(Box<ScheduledStep<ScriptedMeta>>, usize),
    /// `apply_output`'s result.
    Applied(StepResult),
    /// `request`'s answer.
    Request(Option<RequestSnapshot>),
    /// `state`'s answer.
    State {
        /// Running requests, in order.
        running: Vec<RequestId>,
        /// Waiting requests, in admission order.
        waiting: Vec<RequestId>,
        /// Free GPU blocks.
        free_blocks: u32,
        /// `has_requests()`.
        has_requests: bool,
        /// Steps in flight, oldest first.
        in_flight: Vec<u64>,
    },
    /// The drained connector call log.
    Calls(Vec<ConnectorCall>),
    /// `schedule`'s step with the offloading connector.
    OffloadScheduled(Box<engine_offload::OffloadScheduled>),
    /// `execute`'s result.
    Executed(Box<engine_offload::Executed>),
    /// `run_step`'s result.
    StepRun(
        Box<(
            engine_offload::OffloadScheduled,
            engine_offload::Executed,
            StepResult,
        )>,
    ),
    /// A job list (`complete`).
    Jobs(Vec<JobId>),
    /// A count (`drain`).
    Count(u32),
    /// `lookup`'s answer, per group and chunk.
    Lookups(Vec<Vec<KeyLookup>>),
    /// `offload_state`'s answer.
    OffloadState(Box<engine_offload::OffloadState>),
    /// `reset_cache`'s answer.
    Reset(Option<bool>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineConfig {
    block_size: Option<u32>,
    num_gpu_blocks: Option<u32>,
    groups: Option<Vec<Value>>,
    max_num_batched_tokens: Option<u32>,
    max_num_seqs: Option<u32>,
    max_model_len: Option<u32>,
    enable_prefix_caching: Option<bool>,
    enable_chunked_prefill: Option<bool>,
    long_prefill_token_threshold: Option<u32>,
    watermark_blocks: Option<u32>,
    load_failure_policy: Option<LoadFailurePolicy>,
    async_depth: Option<u32>,
    mode: Option<Mode>,
    requires_kv_delivery: Option<bool>,
    connector: Option<Value>,
}

fn parse_group(v: &Value) -> Result<GroupKind, CaseError> {
    if v.as_str() == Some("full") {
        return Ok(GroupKind::FullAttention);
    }
    if let Some(o) = v.as_object()
        && o.len() == 1
        && let Some(w) = o.get("sliding_window").and_then(Value::as_u64)
        && let Ok(window) = u32::try_from(w)
    {
        return Ok(GroupKind::SlidingWindow { window });
    }
    err(format!(
        "group {v}: expected \"full\" or {{\"sliding_window\": n}}"
    ))
}

/// A scripted lookup answer: `null` = pending, `{"tokens": n, "async": bool}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JHit {
    tokens: u32,
    #[serde(default, rename = "async")]
    load_async: bool,
}

fn parse_lookup(v: &Value) -> Result<Lookup, CaseError> {
    match serde_json::from_value::<Option<JHit>>(v.clone()) {
        Ok(None) => Ok(Lookup::Pending),
        Ok(Some(h)) => Ok(Lookup::Hit {
            tokens: h.tokens,
            load_async: h.load_async,
        }),
        Err(e) => err(format!(
            "argument `lookup`: {e} (expected null or {{\"tokens\": n, \"async\": bool}})"
        )),
    }
}

/// FNV-1a (32 bit) of a request name: the seed of its generated prompt.
fn name_seed(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The prompt `prompt_len` generates for request `name`: token `i` is
/// `1 + (fnv1a32(name) + i) mod 1_000_000`.
pub fn generated_prompt(name: &str, len: u32) -> Vec<Token> {
    let seed = name_seed(name);
    (0..len)
        .map(|i| 1 + seed.wrapping_add(i) % 1_000_000)
        .collect()
}

fn id_arg(args: &Map<String, Value>, ids: &mut Interner) -> Result<RequestId, CaseError> {
    let name: String = arg(args, "id", None)?;
    Ok(ids.intern(&name))
}

fn opt_id_set(
    args: &Map<String, Value>,
    key: &str,
    ids: &mut Interner,
) -> Result<Option<SortedSet<RequestId>>, CaseError> {
    let v: Option<Vec<String>> = arg(args, key, Some(None))?;
    Ok(v.map(|s| id_set(s, ids)))
}

fn render_id(id: RequestId, ids: &Interner) -> Value {
    json!(ids.resolve(id).unwrap_or("?"))
}

fn render_id_list(list: &[RequestId], ids: &Interner) -> Value {
    Value::Array(list.iter().map(|&id| render_id(id, ids)).collect())
}

fn render_tables(t: &[Vec<BlockId>]) -> Value {
    json!(
        t.iter()
            .map(|g| g.iter().map(|b| b.0).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    )
}

fn render_lookup(l: &Lookup) -> Value {
    match l {
        Lookup::Pending => Value::Null,
        Lookup::Hit { tokens, load_async } => json!({ "tokens": tokens, "async": load_async }),
    }
}

fn status_name(s: RequestStatus) -> Value {
    serde_json::to_value(s).unwrap_or(Value::Null)
}

fn render_params(p: Option<&Params>) -> Value {
    p.map_or(Value::Null, |p| json!(p))
}

fn render_call(c: &ConnectorCall, ids: &Interner) -> Value {
    match c {
        ConnectorCall::OnNewRequest { id } => {
            json!({ "call": "on_new_request", "id": render_id(*id, ids) })
        }
        ConnectorCall::GetNumNewMatchedTokens {
            id,
            num_computed_tokens,
            answer,
        } => json!({
            "call": "get_num_new_matched_tokens",
            "id": render_id(*id, ids),
            "num_computed_tokens": num_computed_tokens,
            "answer": render_lookup(answer),
        }),
        ConnectorCall::UpdateStateAfterAlloc {
            id,
            blocks,
            num_external_tokens,
        } => json!({
            "call": "update_state_after_alloc",
            "id": render_id(*id, ids),
            "blocks": render_tables(blocks),
            "num_external_tokens": num_external_tokens,
        }),
        ConnectorCall::BuildConnectorMeta { step } => {
            json!({ "call": "build_connector_meta", "step": step.0 })
        }
        ConnectorCall::UpdateConnectorOutput {
            finished_sending,
            finished_recving,
        } => json!({
            "call": "update_connector_output",
            "finished_sending": render_opt_ids(finished_sending.as_ref(), ids),
            "finished_recving": render_opt_ids(finished_recving.as_ref(), ids),
        }),
        ConnectorCall::RequestFinished {
            id,
            blocks,
            delay_free,
        } => json!({
            "call": "request_finished",
            "id": render_id(*id, ids),
            "blocks": render_tables(blocks),
            "delay_free": delay_free,
        }),
    }
}

/// The fields of a Scheduled result other than `meta`.
fn scheduled_fields(o: &SchedulerOutput, groups: usize, ids: &Interner) -> Map<String, Value> {
    let name = |id: RequestId| ids.resolve(id).unwrap_or("?").to_string();
    let mut block_ids = Map::new();
    let mut new_block_ids = Map::new();
    for n in &o.scheduled_new_reqs {
        block_ids.insert(name(n.id), render_tables(&n.block_ids));
    }
    let mut resumed = Vec::new();
    for c in &o.scheduled_cached_reqs {
        if c.resumed {
            resumed.push(render_id(c.id, ids));
            block_ids.insert(name(c.id), render_tables(&c.new_block_ids));
        } else if c.new_block_ids.is_empty() {
            // No block in any group (vLLM's `None`): rendered as one empty list per group.
            new_block_ids.insert(name(c.id), json!(vec![Vec::<u32>::new(); groups]));
        } else {
            new_block_ids.insert(name(c.id), render_tables(&c.new_block_ids));
        }
    }
    let v = json!({
        "step": o.step.0,
        "scheduled": o.num_scheduled_tokens.iter().map(|(id, n)| json!([render_id(*id, ids), n])).collect::<Vec<_>>(),
        "total": o.total_num_scheduled_tokens,
        "new": o.scheduled_new_reqs.iter().map(|n| render_id(n.id, ids)).collect::<Vec<_>>(),
        "resumed": resumed,
        "block_ids": block_ids,
        "new_block_ids": new_block_ids,
        "finished_req_ids": render_ids(&o.finished_req_ids, ids),
        "preempted_req_ids": render_ids(&o.preempted_req_ids, ids),
        "has_sync_kv_loads": o.has_sync_kv_loads,
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

fn render_scheduled(s: &ScheduledStep<ScriptedMeta>, groups: usize, ids: &Interner) -> Value {
    let loads: Vec<Value> = s
        .meta
        .loads
        .iter()
        .map(|l| {
            json!({
                "id": render_id(l.id, ids),
                "blocks": render_tables(&l.blocks),
                "tokens": l.tokens,
                "async": l.load_async,
            })
        })
        .collect();
    let mut m = scheduled_fields(&s.output, groups, ids);
    m.insert("meta".into(), json!({ "loads": loads }));
    Value::Object(m)
}

/// `request`'s answer, for either connector.
fn request_of<C: kvrelay_core::SchedulerConnector>(s: &Scheduler<C>, id: RequestId) -> EngineOut {
    let v = s.view();
    let n = v.config().groups.len();
    EngineOut::Request(v.request(id).map(|r| RequestSnapshot {
        status: r.status(),
        num_computed_tokens: r.num_computed_tokens(),
        block_ids: (0..n).map(|g| r.block_ids(g).to_vec()).collect(),
        num_preemptions: r.num_preemptions(),
    }))
}

/// `state`'s answer, for either connector.
fn state_of<C: kvrelay_core::SchedulerConnector>(s: &Scheduler<C>) -> EngineOut {
    let v = s.view();
    EngineOut::State {
        running: v.running().to_vec(),
        waiting: v.waiting().collect(),
        free_blocks: v.num_free_blocks(),
        has_requests: s.has_requests(),
        in_flight: s.steps_in_flight().map(|x| x.0).collect(),
    }
}

fn normalize_scheduled(v: &mut Value) -> Result<(), CaseError> {
    normalize_set_field(v, "finished_req_ids")?;
    normalize_set_field(v, "preempted_req_ids")?;
    if let Some(m) = v.get_mut("meta") {
        normalize_int_set_field(m, "jobs_to_flush")?;
    }
    Ok(())
}

fn normalize_executed(v: &mut Value) -> Result<(), CaseError> {
    if let Some(a) = v.get_mut("aggregated") {
        normalize_set_field(a, "finished_sending")?;
        normalize_set_field(a, "finished_recving")?;
        normalize_set_field(a, "failed_recving")?;
    }
    if let Some(Value::Array(ranks)) = v.get_mut("ranks") {
        for r in ranks {
            normalize_set_field(r, "finished_recving")?;
        }
    }
    Ok(())
}

/// Sorts and deduplicates the integer array at `key` of object `v` (a set-valued field).
fn normalize_int_set_field(v: &mut Value, key: &str) -> Result<(), CaseError> {
    let Some(slot) = v.get_mut(key) else {
        return Ok(());
    };
    if slot.is_null() {
        return Ok(());
    }
    let mut xs: Vec<u64> = serde_json::from_value(slot.clone())
        .map_err(|e| CaseError(format!("`{key}` must be an array of integers: {e}")))?;
    xs.sort_unstable();
    xs.dedup();
    *slot = json!(xs);
    Ok(())
}

fn render_step_result(r: &StepResult, ids: &Interner) -> Value {
    let outputs: Vec<Value> = r
        .outputs
        .iter()
        .map(|o| {
            json!({
                "id": render_id(o.id, ids),
                "new_tokens": o.new_tokens,
                "finish": o.finish.map_or(Value::Null, |f| serde_json::to_value(f).unwrap_or(Value::Null)),
                "kv_transfer_params": render_params(o.kv_transfer_params.as_ref()),
            })
        })
        .collect();
    let mut events: Vec<&str> = r.events.iter().map(|e| e.0.as_str()).collect();
    events.sort_unstable();
    json!({ "outputs": outputs, "events": events })
}

/// Sorts and deduplicates the string array at `key` of object `v` (a set-valued field).
fn normalize_set_field(v: &mut Value, key: &str) -> Result<(), CaseError> {
    let Some(slot) = v.get_mut(key) else {
        return Ok(());
    };
    if slot.is_null() {
        return Ok(());
    }
    let mut names: Vec<String> = serde_json::from_value(slot.clone())
        .map_err(|e| CaseError(format!("`{key}` must be an array of request ids: {e}")))?;
    names.sort_unstable();
    names.dedup();
    *slot = json!(names);
    Ok(())
}

const ENGINE_CALLS: [&str; 21] = [
    "add_request",
    "set_lookup",
    "set_delay_free",
    "set_delay_all",
    "set_finish_params",
    "set_pending_block_frees",
    "set_push_work",
    "abort",
    "schedule",
    "apply_output",
    "request",
    "state",
    "connector_calls",
    "execute",
    "run_step",
    "drain",
    "hold",
    "complete",
    "lookup",
    "offload_state",
    "reset_cache",
];

impl Harness for EngineHarness {
    type Op = EngineOp;
    type Out = EngineOut;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let c: EngineConfig = serde_json::from_value(Value::Object(config.clone()))
            .map_err(|e| CaseError(e.to_string()))?;
        let d = SchedulerConfig::default();
        let groups = match &c.groups {
            None => d.groups,
            Some(gs) => gs.iter().map(parse_group).collect::<Result<_, _>>()?,
        };
        let sc = SchedulerConfig {
            block_size: c.block_size.unwrap_or(d.block_size),
            num_gpu_blocks: c.num_gpu_blocks.unwrap_or(d.num_gpu_blocks),
            groups,
            max_num_batched_tokens: c.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
            max_num_seqs: c.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_model_len: c.max_model_len.unwrap_or(d.max_model_len),
            enable_prefix_caching: c.enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
            enable_chunked_prefill: c.enable_chunked_prefill.unwrap_or(d.enable_chunked_prefill),
            long_prefill_token_threshold: c
                .long_prefill_token_threshold
                .unwrap_or(d.long_prefill_token_threshold),
            watermark_blocks: c.watermark_blocks.unwrap_or(d.watermark_blocks),
            load_failure_policy: c.load_failure_policy.unwrap_or(d.load_failure_policy),
            async_depth: c.async_depth.unwrap_or(d.async_depth),
            mode: c.mode.unwrap_or(d.mode),
        };
        match engine_offload::parse_connector(c.connector.as_ref())? {
            engine_offload::ConnectorChoice::Scripted => {
                let mut conn = ScriptedConnector::new();
                conn.set_requires_kv_delivery(c.requires_kv_delivery.unwrap_or(false));
                Scheduler::new(sc, conn)
                    .map(|s| Self(EngineInner::Scripted(Box::new(s))))
                    .map_err(|e| CaseError(e.to_string()))
            }
            engine_offload::ConnectorChoice::Offloading(v) => {
                if c.requires_kv_delivery.is_some() {
                    return err("`requires_kv_delivery` is a scripted-connector key");
                }
                let mode = sc.mode;
                OffloadEngine::new(sc, &v, mode).map(|e| Self(EngineInner::Offload(Box::new(e))))
            }
        }
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        match call {
            "add_request" => {
                only(
                    args,
                    &[
                        "id",
                        "prompt_len",
                        "prompt",
                        "max_tokens",
                        "stop_token",
                        "lookup",
                        "delay_free",
                    ],
                )?;
                let name: String = arg(args, "id", None)?;
                let id = ids.intern(&name);
                let prompt = match (args.get("prompt"), args.get("prompt_len")) {
                    (Some(_), Some(_)) => {
                        return err("give either `prompt` or `prompt_len`, not both");
                    }
                    (Some(_), None) => arg::<Vec<Token>>(args, "prompt", None)?,
                    (None, Some(_)) => generated_prompt(&name, arg(args, "prompt_len", None)?),
                    (None, None) => return err("missing argument `prompt_len` (or `prompt`)"),
                };
                let lookup = match args.get("lookup") {
                    None => None,
                    Some(v) => Some(parse_lookup(v)?),
                };
                Ok(EngineOp::AddRequest {
                    spec: RequestSpec {
                        id,
                        prompt,
                        max_tokens: arg(args, "max_tokens", None)?,
                        stop_token: arg(args, "stop_token", Some(None))?,
                        kv_transfer_params: None,
                    },
                    lookup,
                    delay_free: arg(args, "delay_free", Some(None))?,
                })
            }
            "set_lookup" => {
                only(args, &["id", "lookup"])?;
                let id = id_arg(args, ids)?;
                let v = args.get("lookup").ok_or_else(|| {
                    CaseError("missing argument `lookup` (null = pending)".into())
                })?;
                Ok(EngineOp::SetLookup(id, parse_lookup(v)?))
            }
            "set_delay_free" => {
                only(args, &["id", "delay"])?;
                Ok(EngineOp::SetDelayFree(
                    id_arg(args, ids)?,
                    arg(args, "delay", None)?,
                ))
            }
            "set_delay_all" => {
                only(args, &["value"])?;
                Ok(EngineOp::SetDelayAll(arg(args, "value", None)?))
            }
            "set_finish_params" => {
                only(args, &["id", "params"])?;
                Ok(EngineOp::SetFinishParams(
                    id_arg(args, ids)?,
                    arg(args, "params", None)?,
                ))
            }
            "set_pending_block_frees" => {
                only(args, &["value"])?;
                Ok(EngineOp::SetPendingBlockFrees(arg(args, "value", None)?))
            }
            "set_push_work" => {
                only(args, &["value"])?;
                Ok(EngineOp::SetPushWork(arg(args, "value", None)?))
            }
            "abort" => {
                only(args, &["id"])?;
                Ok(EngineOp::Abort(id_arg(args, ids)?))
            }
            "schedule" => {
                only(args, &[])?;
                Ok(EngineOp::Schedule)
            }
            "apply_output" => {
                only(
                    args,
                    &[
                        "step",
                        "sampled",
                        "finished_sending",
                        "finished_recving",
                        "failed_recving",
                        "invalid_block_ids",
                        "no_kv_output",
                    ],
                )?;
                let step: Option<u64> = arg(args, "step", Some(None))?;
                let sampled: BTreeMap<String, Vec<Token>> =
                    arg(args, "sampled", Some(BTreeMap::new()))?;
                let sampled = sampled
                    .into_iter()
                    .map(|(n, t)| (ids.intern(&n), t))
                    .collect();
                let no_kv: bool = arg(args, "no_kv_output", Some(false))?;
                let kv_keys = [
                    "finished_sending",
                    "finished_recving",
                    "failed_recving",
                    "invalid_block_ids",
                ];
                let kv_given = no_kv || kv_keys.iter().any(|k| args.contains_key(*k));
                if no_kv && let Some(k) = kv_keys.iter().find(|k| args.contains_key(**k)) {
                    return err(format!("`{k}` given together with `no_kv_output: true`"));
                }
                let kv = if no_kv {
                    None
                } else {
                    let failed: Vec<String> = arg(args, "failed_recving", Some(Vec::new()))?;
                    let invalid: Vec<u64> = arg(args, "invalid_block_ids", Some(Vec::new()))?;
                    Some(AggregatedOutput {
                        finished_sending: opt_id_set(args, "finished_sending", ids)?,
                        finished_recving: opt_id_set(args, "finished_recving", ids)?,
                        invalid_block_ids: invalid.into_iter().map(BlockId).collect(),
                        failed_recving: id_set(failed, ids),
                        worker_meta: None,
                        kv_events: None,
                        expected_finished_count: 1,
                    })
                };
                Ok(EngineOp::ApplyOutput {
                    step: step.map(StepId),
                    sampled,
                    kv,
                    kv_given,
                })
            }
            "execute" => {
                only(args, &["step"])?;
                let step: Option<u64> = arg(args, "step", Some(None))?;
                Ok(EngineOp::Execute(step.map(StepId)))
            }
            "run_step" => {
                only(args, &[])?;
                Ok(EngineOp::RunStep)
            }
            "drain" => {
                only(args, &["max_steps"])?;
                Ok(EngineOp::Drain(arg(args, "max_steps", Some(100))?))
            }
            "hold" => {
                only(args, &["rank", "value"])?;
                Ok(EngineOp::Hold {
                    rank: arg(args, "rank", None)?,
                    value: arg(args, "value", Some(true))?,
                })
            }
            "complete" => {
                only(args, &["rank", "jobs"])?;
                let jobs: Option<Vec<u64>> = arg(args, "jobs", Some(None))?;
                Ok(EngineOp::Complete {
                    rank: arg(args, "rank", None)?,
                    jobs: jobs.map(|v| v.into_iter().map(JobId).collect()),
                })
            }
            "lookup" => {
                only(args, &["id", "prompt"])?;
                match (args.contains_key("id"), args.contains_key("prompt")) {
                    (true, true) => err("give either `id` or `prompt`, not both"),
                    (false, false) => err("missing argument `id` (or `prompt`)"),
                    (true, false) => {
                        let name: String = arg(args, "id", None)?;
                        Ok(EngineOp::Lookup {
                            id: Some(ids.get(&name)),
                            prompt: None,
                        })
                    }
                    (false, true) => Ok(EngineOp::Lookup {
                        id: None,
                        prompt: Some(arg(args, "prompt", None)?),
                    }),
                }
            }
            "offload_state" => {
                only(args, &[])?;
                Ok(EngineOp::OffloadState)
            }
            "reset_cache" => {
                only(args, &[])?;
                Ok(EngineOp::ResetCache)
            }
            "request" => {
                only(args, &["id"])?;
                Ok(EngineOp::Request(id_arg(args, ids)?))
            }
            "state" => {
                only(args, &[])?;
                Ok(EngineOp::State)
            }
            "connector_calls" => {
                only(args, &[])?;
                Ok(EngineOp::ConnectorCalls)
            }
            _ => unknown_call(call, &ENGINE_CALLS),
        }
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        let s = match &mut self.0 {
            EngineInner::Scripted(s) => &mut **s,
            EngineInner::Offload(e) => return e.apply(op),
        };
        let kind = |e: SchedulerError| e.kind();
        match op {
            EngineOp::AddRequest {
                spec,
                lookup,
                delay_free,
            } => {
                // The script is set before `on_new_request`, so that a scripted answer is in
                // place for the first lookup; a rejected request leaves the script as it was.
                let id = spec.id;
                let before = s.connector().clone();
                if let Some(l) = lookup {
                    s.connector_mut().set_lookup(id, *l);
                }
                if let Some(d) = delay_free {
                    s.connector_mut().set_delay_free(id, *d);
                }
                match s.add_request(spec.clone()) {
                    Ok(()) => Ok(EngineOut::Ok),
                    Err(e) => {
                        // Nothing was called on the connector; undo the script change.
                        *s.connector_mut() = before;
                        Err(kind(e))
                    }
                }
            }
            EngineOp::SetLookup(id, l) => {
                s.connector_mut().set_lookup(*id, *l);
                Ok(EngineOut::Ok)
            }
            EngineOp::SetDelayFree(id, d) => {
                s.connector_mut().set_delay_free(*id, *d);
                Ok(EngineOut::Ok)
            }
            EngineOp::SetDelayAll(v) => {
                s.connector_mut().set_delay_all(*v);
                Ok(EngineOut::Ok)
            }
            EngineOp::SetFinishParams(id, p) => {
                s.connector_mut().set_finish_params(*id, p.clone());
                Ok(EngineOut::Ok)
            }
            EngineOp::SetPendingBlockFrees(v) => {
                s.connector_mut().set_pending_block_frees(*v);
                Ok(EngineOut::Ok)
            }
            EngineOp::SetPushWork(v) => {
                s.connector_mut().set_push_work(*v);
                Ok(EngineOut::Ok)
            }
            EngineOp::Abort(id) => s.abort(*id).map(EngineOut::Bool).map_err(kind),
            EngineOp::Schedule => {
                let groups = s.config().groups.len();
                s.schedule()
                    .map(|st| EngineOut::Scheduled(Box::new(st), groups))
                    .map_err(kind)
            }
            EngineOp::ApplyOutput {
                step, sampled, kv, ..
            } => {
                // No step in flight and none named: a step that cannot be the oldest one.
                let step = step
                    .or_else(|| s.steps_in_flight().next())
                    .unwrap_or(StepId(u64::MAX));
                let mut tokens = s.fake_sample(step);
                for (id, t) in sampled {
                    match tokens.iter_mut().find(|(x, _)| x == id) {
                        Some(slot) => slot.1.clone_from(t),
                        None => tokens.push((*id, t.clone())),
                    }
                }
                s.update_from_output(
                    step,
                    ModelOutput {
                        sampled: tokens,
                        kv_connector_output: kv.clone(),
                    },
                )
                .map(EngineOut::Applied)
                .map_err(kind)
            }
            EngineOp::Request(id) => Ok(request_of(s, *id)),
            EngineOp::State => Ok(state_of(s)),
            EngineOp::ConnectorCalls => Ok(EngineOut::Calls(s.connector_mut().take_calls())),
            EngineOp::ResetCache => s
                .reset_connector_cache()
                .map(EngineOut::Reset)
                .map_err(kind),
            EngineOp::Execute(_)
            | EngineOp::RunStep
            | EngineOp::Drain(_)
            | EngineOp::Hold { .. }
            | EngineOp::Complete { .. }
            | EngineOp::Lookup { .. }
            | EngineOp::OffloadState => Err("wrong_connector"),
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        match &self.0 {
            EngineInner::Scripted(s) => s.check_invariants().map_err(|e| e.to_string()),
            EngineInner::Offload(e) => e.check_invariants(),
        }
    }

    fn render(out: &Self::Out, ids: &Interner) -> Value {
        match out {
            EngineOut::Ok => json!("ok"),
            EngineOut::Bool(b) => json!(b),
            EngineOut::Scheduled(s, groups) => render_scheduled(s, *groups, ids),
            EngineOut::Applied(r) => render_step_result(r, ids),
            EngineOut::Request(None) => Value::Null,
            EngineOut::Request(Some(r)) => json!({
                "status": status_name(r.status),
                "num_computed_tokens": r.num_computed_tokens,
                "block_ids": render_tables(&r.block_ids),
                "num_preemptions": r.num_preemptions,
            }),
            EngineOut::State {
                running,
                waiting,
                free_blocks,
                has_requests,
                in_flight,
            } => json!({
                "running": render_id_list(running, ids),
                "waiting": render_id_list(waiting, ids),
                "free_blocks": free_blocks,
                "has_requests": has_requests,
                "in_flight": in_flight,
            }),
            EngineOut::Calls(calls) => {
                Value::Array(calls.iter().map(|c| render_call(c, ids)).collect())
            }
            EngineOut::OffloadScheduled(x) => engine_offload::render_scheduled(x, ids),
            EngineOut::Executed(x) => engine_offload::render_executed(x, ids),
            EngineOut::StepRun(x) => engine_offload::render_step_run(x, ids),
            EngineOut::Jobs(js) => json!(js.iter().map(|j| j.0).collect::<Vec<_>>()),
            EngineOut::Count(n) => json!(n),
            EngineOut::Lookups(l) => engine_offload::render_lookups(l),
            EngineOut::OffloadState(x) => engine_offload::render_state(x, ids),
            EngineOut::Reset(r) => r.map_or(Value::Null, |b| json!(b)),
        }
    }

    fn normalize_expected(call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        let mut v = v.clone();
        match call {
            "schedule" => normalize_scheduled(&mut v)?,
            "execute" => normalize_executed(&mut v)?,
            "run_step" => {
                if let Some(x) = v.get_mut("scheduled") {
                    normalize_scheduled(x)?;
                }
                if let Some(x) = v.get_mut("executed") {
                    normalize_executed(x)?;
                }
            }
            "offload_state" => normalize_int_set_field(&mut v, "fenced_blocks")?,
            "connector_calls" => {
                if let Some(calls) = v.as_array_mut() {
                    for c in calls {
                        if c.get("call").and_then(Value::as_str) == Some("update_connector_output")
                        {
                            normalize_set_field(c, "finished_sending")?;
                            normalize_set_field(c, "finished_recving")?;
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(v)
    }
}
