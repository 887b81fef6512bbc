//! The `event_accumulator` machine: the core's [`EventAccumulator`], which gathers the KV
//! events of the ranks' outputs until they are taken (SEMANTICS.md §4.5).
//!
//! Run by `kvrelay conformance` for a case with `"machine": "event_accumulator"`.

use kvrelay_core::{EventAccumulator, Interner, KvEvent, KvEvents};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness};
use super::json::{JEvents, NoArgs, parse_call, parse_config};

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

/// The calls of an `event_accumulator` case.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum EventCall {
    Update {
        #[serde(default)]
        kv_events: Option<JEvents>,
    },
    Take(NoArgs),
}

impl Harness for EventHarness {
    type Op = EventOp;
    type Out = Option<Vec<KvEvent>>;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let NoArgs {} = parse_config(config)?;
        Ok(Self(EventAccumulator::new()))
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        Ok(match parse_call::<EventCall>(call, args)? {
            EventCall::Update { kv_events } => EventOp::Update(kv_events.map(JEvents::into_core)),
            EventCall::Take(NoArgs {}) => EventOp::Take,
        })
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
