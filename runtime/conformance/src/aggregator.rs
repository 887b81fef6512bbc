//! The `aggregator` machine: the core's [`Aggregator`], which folds the W ranks' worker
//! outputs of a step into one connector output (SEMANTICS.md §4.1–§4.2).
//!
//! Cases call `aggregate` (a step's outputs, one per rank, `null` for a rank with none) and
//! `salvage`; run by `kvrelay conformance` for a case with `"machine": "aggregator"`.

use kvrelay_core::{AggregatedOutput, Aggregator, BlockId, Interner, Mode, Rank, WorkerOutput};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::case::{CaseError, Harness, err};
use super::json::{JEvents, JMeta, JWorkerOutput, id_set, parse_call, render_aggregated};

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

/// The calls of an `aggregator` case.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum AggregatorCall {
    Aggregate {
        outputs: Vec<Option<JWorkerOutput>>,
        #[serde(default)]
        output_rank: u32,
    },
    Salvage {
        outputs: Vec<Option<JWorkerOutput>>,
    },
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
        let outputs = |raw: Vec<Option<JWorkerOutput>>, ids: &mut Interner| -> Vec<_> {
            raw.into_iter()
                .map(|o| o.map(|o| o.into_core(ids)))
                .collect()
        };
        Ok(match parse_call::<AggregatorCall>(call, args)? {
            AggregatorCall::Aggregate {
                outputs: raw,
                output_rank,
            } => AggregatorOp::Aggregate {
                outputs: outputs(raw, ids),
                output_rank: Rank(output_rank),
            },
            AggregatorCall::Salvage { outputs: raw } => AggregatorOp::Salvage {
                outputs: outputs(raw, ids),
            },
        })
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
