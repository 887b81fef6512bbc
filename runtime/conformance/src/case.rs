//! One case file against one machine: the case format (`tests/conformance/FORMAT.md`), the
//! [`Harness`] contract a machine implements to be driven by cases, and a case converted once
//! ([`PreparedCase`]) and run on fresh machines.
//!
//! [`super::AnyCase::parse`] reads a file with [`RawCase::read`] and hands it to
//! [`PreparedCase::prepare`] for the machine it names; `kvrelay conformance` then runs it once
//! ([`PreparedCase::run`]), `kvrelay bench` many times. Nothing here knows a machine: the
//! harnesses import this file, never the reverse.

use std::fmt;

use kvrelay_core::Interner;
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

/// `Err(CaseError(msg))`.
pub(super) fn err<T>(msg: impl Into<String>) -> Result<T, CaseError> {
    Err(CaseError(msg.into()))
}

/// A case file as written: its machine is dispatched on by [`super::AnyCase::parse`], its
/// calls converted by [`PreparedCase::prepare`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCase {
    pub(super) name: String,
    pub(super) machine: String,
    #[serde(default)]
    config: Map<String, Value>,
    calls: Vec<RawCall>,
}

impl RawCase {
    /// Reads a case from JSON text. `Err` carries the best name known (the case's own when at
    /// least that much is readable, else `fallback_name`) and the reason.
    pub(super) fn read(text: &str, fallback_name: &str) -> Result<Self, (String, CaseError)> {
        serde_json::from_str(text).map_err(|e| {
            let name = serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|v| v.get("name").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_else(|| fallback_name.to_string());
            (name, CaseError(format!("malformed case: {e}")))
        })
    }
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
    /// Converts every call of `raw` for machine `H`; the first call that cannot be converted
    /// is the error, under the case's name.
    pub(super) fn prepare(raw: RawCase) -> Result<Self, (String, CaseError)> {
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
