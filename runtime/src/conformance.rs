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
    AggregatedOutput, Aggregator, BlockId, EventAccumulator, Interner, JobId, KvEvent, KvEvents,
    Meta, Mode, OffloadMeta, Rank, RequestId, SortedSet, StepShape, WorkerCall, WorkerOutput,
    WorkerProtocol,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

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
pub const MACHINES: [(&str, bool); 6] = [
    ("aggregator", true),
    ("worker_meta", true),
    ("event_accumulator", true),
    ("worker_protocol", true),
    ("offload_manager", false),
    ("multi", false),
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
            m @ ("offload_manager" | "multi") => Err((
                raw.name,
                CaseError(format!(
                    "machine `{m}` is not implemented yet (it follows in the offloading issue)"
                )),
            )),
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
        }
    }

    /// Runs the case once.
    pub fn run(&self) -> Result<(), String> {
        match self {
            AnyCase::Aggregator(c) => c.run(),
            AnyCase::WorkerMeta(c) => c.run(),
            AnyCase::EventAccumulator(c) => c.run(),
            AnyCase::WorkerProtocol(c) => c.run(),
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
