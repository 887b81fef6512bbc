//! The `worker_meta` machine: the core's merge of worker metadata across ranks
//! ([`kvrelay_core::merge`]) and the MultiConnector's metadata of its children
//! ([`kvrelay_core::build_multi`]); stateless (SEMANTICS.md §4.3–§4.4).
//!
//! Run by `kvrelay conformance` for a case with `"machine": "worker_meta"`.

use kvrelay_core::{Interner, Meta};
use serde_json::{Map, Value};

use super::case::{CaseError, Harness};
use super::json::{JMeta, arg, only, parse_meta, render_opt_meta, unknown_call};

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
