//! The `multi` machine: MultiConnector composition rules (SEMANTICS.md §4.3).

use kvrelay_core::Interner;
use serde_json::{Map, Value};

use super::{CaseError, Harness, err};

/// Drives MultiConnector composition rules (SEMANTICS.md §4.3).
#[derive(Debug)]
pub struct MultiHarness;

impl Harness for MultiHarness {
    type Op = ();
    type Out = ();

    fn new(_config: &Map<String, Value>) -> Result<Self, CaseError> {
        err("machine `multi` is not implemented yet (it follows in the offloading issue)")
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
