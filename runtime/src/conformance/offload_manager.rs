//! The `offload_manager` machine: the CPU offloading manager (SEMANTICS.md §5.2–§5.4).

use kvrelay_core::Interner;
use serde_json::{Map, Value};

use super::{CaseError, Harness, err};

/// Drives the CPU offloading manager (SEMANTICS.md §5.2–§5.4).
#[derive(Debug)]
pub struct OffloadManagerHarness;

impl Harness for OffloadManagerHarness {
    type Op = ();
    type Out = ();

    fn new(_config: &Map<String, Value>) -> Result<Self, CaseError> {
        err("machine `offload_manager` is not implemented yet (it follows in the offloading issue)")
    }

    fn convert(
        _call: &str,
        _args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        Ok(())
    }

    fn apply(&mut self, _op: &Self::Op) -> Result<Self::Out, &'static str> {
        Ok(())
    }

    fn render(_out: &Self::Out, _ids: &Interner) -> Value {
        Value::Null
    }

    fn normalize_expected(_call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        Ok(v.clone())
    }
}
