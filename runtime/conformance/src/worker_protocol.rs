//! The `worker_protocol` machine: the core's [`WorkerProtocol`], the guard of the order in
//! which a runner calls a worker connector's hooks within a step (SEMANTICS.md §2.4, I-1…I-6).
//!
//! Cases call `begin_step` with the step's shape, then hooks by name; a hook out of order is
//! the typed error `protocol_violation`. Run by `kvrelay conformance` for a case with
//! `"machine": "worker_protocol"`.

use kvrelay_core::{Interner, StepShape, WorkerCall, WorkerProtocol};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness, err};
use super::json::{NoArgs, parse_call, parse_config};

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

/// `begin_step`, the one call of a `worker_protocol` case with arguments; the others are the
/// worker hooks, by name ([`WorkerCall::from_name`]), with none.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum ProtocolCall {
    BeginStep(BeginStep),
}

/// The step's shape; what is not given is [`StepShape::default`]'s.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, default)]
struct BeginStep {
    sync_loads: bool,
    forward: bool,
    defer_finalize: bool,
}

impl Default for BeginStep {
    fn default() -> Self {
        let d = StepShape::default();
        Self {
            sync_loads: d.sync_loads,
            forward: d.forward,
            defer_finalize: d.defer_finalize,
        }
    }
}

impl Harness for ProtocolHarness {
    type Op = ProtocolOp;
    type Out = ();

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let NoArgs {} = parse_config(config)?;
        Ok(Self(WorkerProtocol::new()))
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        if call == "begin_step" {
            let ProtocolCall::BeginStep(shape) = parse_call(call, args)?;
            return Ok(ProtocolOp::BeginStep(StepShape {
                sync_loads: shape.sync_loads,
                forward: shape.forward,
                defer_finalize: shape.defer_finalize,
            }));
        }
        match WorkerCall::from_name(call) {
            Some(hook) => {
                let NoArgs {} = serde_json::from_value(Value::Object(args.clone()))
                    .map_err(|e| CaseError(format!("call `{call}`: {e}")))?;
                Ok(ProtocolOp::Hook(hook))
            }
            None => {
                let mut known = vec!["begin_step"];
                known.extend(WorkerCall::ALL.map(WorkerCall::name));
                err(format!(
                    "unknown call `{call}` (expected one of: {})",
                    known.join(", ")
                ))
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
