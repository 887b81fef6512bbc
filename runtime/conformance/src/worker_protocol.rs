//! The `worker_protocol` machine: the core's [`WorkerProtocol`], the guard of the order in
//! which a runner calls a worker connector's hooks within a step (SEMANTICS.md §2.4, I-1…I-6).
//!
//! Cases call `begin_step` with the step's shape, then hooks by name; a hook out of order is
//! the typed error `protocol_violation`. Run by `kvrelay conformance` for a case with
//! `"machine": "worker_protocol"`.

use kvrelay_core::{Interner, StepShape, WorkerCall, WorkerProtocol};
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness};
use super::json::{arg, only, unknown_call};

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
