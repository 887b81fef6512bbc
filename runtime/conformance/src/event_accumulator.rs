//! The `event_accumulator` machine: the core's [`EventAccumulator`], which gathers the KV
//! events of the ranks' outputs until they are taken (SEMANTICS.md §4.5).
//!
//! Run by `kvrelay conformance` for a case with `"machine": "event_accumulator"`.

use kvrelay_core::{EventAccumulator, Interner, KvEvent, KvEvents};
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness};
use super::json::{JEvents, arg, only, unknown_call};

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
