//! The `worker_meta` machine: the core's merge of worker metadata across ranks
//! ([`kvrelay_core::merge`]) and the MultiConnector's metadata of its children
//! ([`kvrelay_core::build_multi`]); stateless (SEMANTICS.md §4.3–§4.4).
//!
//! Run by `kvrelay conformance` for a case with `"machine": "worker_meta"`.

use kvrelay_core::{Interner, Meta};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::case::{CaseError, Harness};
use super::json::{JMeta, NoArgs, parse_call, parse_config, parse_meta, render_opt_meta};

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

/// The calls of a `worker_meta` case.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum WorkerMetaCall {
    Merge {
        #[serde(default)]
        a: Option<JMeta>,
        #[serde(default)]
        b: Option<JMeta>,
    },
    BuildMulti {
        children: Vec<Option<JMeta>>,
    },
}

impl Harness for WorkerMetaHarness {
    type Op = WorkerMetaOp;
    type Out = Option<Meta>;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let NoArgs {} = parse_config(config)?;
        Ok(Self)
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        _ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        Ok(match parse_call::<WorkerMetaCall>(call, args)? {
            WorkerMetaCall::Merge { a, b } => {
                WorkerMetaOp::Merge(a.map(JMeta::into_core), b.map(JMeta::into_core))
            }
            WorkerMetaCall::BuildMulti { children } => WorkerMetaOp::BuildMulti(
                children
                    .into_iter()
                    .map(|m| m.map(JMeta::into_core))
                    .collect(),
            ),
        })
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
