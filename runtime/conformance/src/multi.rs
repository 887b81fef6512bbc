//! The `multi` machine: MultiConnector composition rules (SEMANTICS.md §4.3).
//!
//! The case drives the real [`MultiConnector`] and [`MultiWorker`] of `kvrelay-core`, composed of
//! scripted children ([`ScriptedConnector`], [`ScriptedWorker`]): each call first sets what every
//! child answers, then makes the MultiConnector call, so the composition rules under test are
//! the core's own. The scheduler-side calls get the read-only view of an idle scheduler.
//!
//! `kv_transfer_params` values may be any JSON value: each is carried through the core as its
//! JSON text (the core's `Params` maps strings to strings) and rendered back, so values compare
//! exactly as written.
//!
//! Run by `kvrelay conformance` for a case with `"machine": "multi"`.

use std::collections::BTreeMap;

use kvrelay_core::{
    AggregatedOutput, ExtraAsyncSaves, FinishDecision, Interner, Lookup, Meta, MultiConnector,
    MultiMeta, MultiWorker, NoopConnector, Params, RequestId, Scheduler, SchedulerConfig,
    SchedulerConnector, SchedulerOutput, ScriptedConnector, ScriptedMeta, ScriptedWorker,
    SortedSet, WorkerConnector,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness, err};
use super::json::{JMeta, NoArgs, id_set, parse_call, parse_meta, render_ids, render_opt_meta};

/// The `multi` machine: a [`MultiConnector`] and one rank's [`MultiWorker`] over `children`
/// scripted children.
#[derive(Debug)]
pub struct MultiHarness {
    scheduler: MultiConnector<ScriptedConnector>,
    worker: MultiWorker<ScriptedWorker>,
    /// An idle scheduler, only to lend its view to scheduler-side calls.
    idle: Scheduler<NoopConnector>,
}

/// One child's answer to `request_finished`.
#[derive(Debug, Clone)]
pub struct ChildFinish {
    /// Whether the child delays the free.
    pub delay: bool,
    /// Its `kv_transfer_params` (values as JSON text).
    pub params: Option<Params>,
}

/// A converted `multi` call.
#[derive(Debug, Clone)]
pub enum MultiOp {
    /// `request_finished`.
    RequestFinished {
        /// The request.
        request: RequestId,
        /// Per child.
        results: Vec<ChildFinish>,
    },
    /// `build_meta`.
    BuildMeta,
    /// `bind`.
    Bind(Option<ExtraAsyncSaves>),
    /// `child_finished_sending`.
    ChildFinishedSending {
        /// The reporting child.
        child: usize,
        /// What it reports.
        ids: Vec<RequestId>,
    },
    /// `matched_tokens`: per child, `None` = not known yet.
    MatchedTokens {
        /// The request.
        request: RequestId,
        /// Per child.
        answers: Vec<Option<u32>>,
    },
    /// `finished_count`.
    FinishedCount(Vec<Option<u32>>),
    /// `route_worker_meta`.
    RouteWorkerMeta(Option<Meta>),
}

/// What a `multi` call returns, before rendering.
#[derive(Debug)]
pub enum MultiOut {
    /// `request_finished`.
    Finish(FinishDecision),
    /// `build_meta`.
    Extra(Option<ExtraAsyncSaves>),
    /// `"ok"`.
    Ok,
    /// `child_finished_sending`.
    Ids(SortedSet<RequestId>),
    /// `matched_tokens`.
    Matched {
        /// `None` = not known yet.
        tokens: Option<u32>,
        /// The remembered loader.
        chosen: Option<usize>,
    },
    /// `finished_count`.
    Count(Option<u32>),
    /// `route_worker_meta`.
    Routed(Vec<Option<Meta>>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MultiConfig {
    children: usize,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct JChildFinish {
    delay: bool,
    #[serde(default)]
    params: Option<Map<String, Value>>,
}

fn extra_map(raw: Option<BTreeMap<String, u32>>, ids: &mut Interner) -> Option<ExtraAsyncSaves> {
    raw.map(|m| m.into_iter().map(|(k, n)| (ids.intern(&k), n)).collect())
}

fn render_extra(extra: Option<&ExtraAsyncSaves>, ids: &Interner) -> Value {
    match extra {
        None => json!({ "extra_async_saves": null }),
        Some(m) => {
            let obj: Map<String, Value> = m
                .iter()
                .map(|(&r, &n)| (ids.resolve(r).unwrap_or("?").to_string(), json!(n)))
                .collect();
            json!({ "extra_async_saves": obj })
        }
    }
}

fn render_params(p: Option<&Params>) -> Value {
    match p {
        None => Value::Null,
        Some(p) => Value::Object(
            p.iter()
                .map(|(k, v)| {
                    let v = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.clone()));
                    (k.clone(), v)
                })
                .collect(),
        ),
    }
}

impl MultiHarness {
    /// A per-child argument must name every child (else the error `children_mismatch`).
    fn arity<T>(&self, per_child: &[T]) -> Result<(), &'static str> {
        if per_child.len() == self.scheduler.children().len() {
            Ok(())
        } else {
            Err("children_mismatch")
        }
    }

    fn child(&mut self, i: usize) -> Result<&mut ScriptedConnector, &'static str> {
        self.scheduler.child_mut(i).ok_or("children_mismatch")
    }
}

/// The calls of a `multi` case.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum MultiCall {
    RequestFinished {
        request: String,
        results: Vec<JChildFinish>,
    },
    BuildMeta(NoArgs),
    Bind {
        #[serde(default)]
        extra_async_saves: Option<BTreeMap<String, u32>>,
    },
    ChildFinishedSending {
        child: usize,
        ids: Vec<String>,
    },
    MatchedTokens {
        request: String,
        answers: Vec<Option<u32>>,
    },
    FinishedCount {
        counts: Vec<Option<u32>>,
    },
    RouteWorkerMeta {
        #[serde(default)]
        meta: Option<JMeta>,
    },
}

impl JChildFinish {
    fn into_core(self) -> ChildFinish {
        ChildFinish {
            delay: self.delay,
            params: self
                .params
                .map(|m| m.into_iter().map(|(k, v)| (k, v.to_string())).collect()),
        }
    }
}

impl Harness for MultiHarness {
    type Op = MultiOp;
    type Out = MultiOut;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let c: MultiConfig = serde_json::from_value(Value::Object(config.clone()))
            .map_err(|e| CaseError(e.to_string()))?;
        if c.children == 0 {
            return err("`children` must be at least 1");
        }
        let idle = Scheduler::new(SchedulerConfig::default(), NoopConnector)
            .map_err(|e| CaseError(e.to_string()))?;
        let scheduler = MultiConnector::new(vec![ScriptedConnector::quiet(); c.children])
            .map_err(|e| CaseError(e.to_string()))?;
        let worker = MultiWorker::new(vec![ScriptedWorker::new(); c.children]);
        Ok(Self {
            scheduler,
            worker,
            idle,
        })
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        Ok(match parse_call::<MultiCall>(call, args)? {
            MultiCall::RequestFinished { request, results } => MultiOp::RequestFinished {
                request: ids.intern(&request),
                results: results.into_iter().map(JChildFinish::into_core).collect(),
            },
            MultiCall::BuildMeta(NoArgs {}) => MultiOp::BuildMeta,
            MultiCall::Bind { extra_async_saves } => {
                MultiOp::Bind(extra_map(extra_async_saves, ids))
            }
            MultiCall::ChildFinishedSending { child, ids: names } => {
                MultiOp::ChildFinishedSending {
                    child,
                    ids: names.iter().map(|n| ids.intern(n)).collect(),
                }
            }
            MultiCall::MatchedTokens { request, answers } => MultiOp::MatchedTokens {
                request: ids.intern(&request),
                answers,
            },
            MultiCall::FinishedCount { counts } => MultiOp::FinishedCount(counts),
            MultiCall::RouteWorkerMeta { meta } => {
                MultiOp::RouteWorkerMeta(meta.map(JMeta::into_core))
            }
        })
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        match op {
            MultiOp::RequestFinished { request, results } => {
                self.arity(results)?;
                for (i, r) in results.iter().enumerate() {
                    let c = self.child(i)?;
                    c.set_delay_free(*request, r.delay);
                    match &r.params {
                        Some(p) => c.set_finish_params(*request, p.clone()),
                        None => c.clear_finish_params(*request),
                    }
                }
                self.scheduler
                    .try_request_finished(&self.idle.view(), *request, &[])
                    .map(MultiOut::Finish)
                    .map_err(|e| e.kind())
            }
            MultiOp::BuildMeta => {
                let meta = self
                    .scheduler
                    .build_connector_meta(&self.idle.view(), &SchedulerOutput::default());
                Ok(MultiOut::Extra(meta.extra_async_saves))
            }
            MultiOp::Bind(extra) => {
                let meta = MultiMeta {
                    metadata: vec![ScriptedMeta::default(); self.worker.children().len()],
                    extra_async_saves: extra.clone(),
                };
                self.worker.bind(&meta);
                Ok(MultiOut::Ok)
            }
            MultiOp::ChildFinishedSending { child, ids } => {
                self.worker
                    .child_mut(*child)
                    .ok_or("children_mismatch")?
                    .push_finished_sending(ids);
                let r = self.worker.get_transfer_results(&SortedSet::new());
                Ok(MultiOut::Ids(r.finished_sending.unwrap_or_default()))
            }
            MultiOp::MatchedTokens { request, answers } => {
                self.arity(answers)?;
                for (i, a) in answers.iter().enumerate() {
                    let answer = a.map_or(Lookup::Pending, |tokens| Lookup::Hit {
                        tokens,
                        load_async: false,
                    });
                    self.child(i)?.set_lookup(*request, answer);
                }
                let got = self
                    .scheduler
                    .get_num_new_matched_tokens(&self.idle.view(), *request, 0);
                Ok(MultiOut::Matched {
                    tokens: match got {
                        Lookup::Pending => None,
                        Lookup::Hit { tokens, .. } => Some(tokens),
                    },
                    chosen: self.scheduler.loader(*request),
                })
            }
            MultiOp::FinishedCount(counts) => {
                self.arity(counts)?;
                for (i, &n) in counts.iter().enumerate() {
                    self.child(i)?.set_finished_count(n);
                }
                self.scheduler
                    .finished_count()
                    .map(MultiOut::Count)
                    .map_err(|e| e.kind())
            }
            MultiOp::RouteWorkerMeta(meta) => {
                let output = AggregatedOutput {
                    finished_sending: None,
                    finished_recving: None,
                    invalid_block_ids: SortedSet::new(),
                    failed_recving: SortedSet::new(),
                    worker_meta: meta.clone(),
                    kv_events: None,
                    expected_finished_count: 1,
                };
                self.scheduler
                    .try_update_connector_output(&self.idle.view(), &output)
                    .map_err(|e| e.kind())?;
                Ok(MultiOut::Routed(
                    self.scheduler
                        .children()
                        .iter()
                        .map(|c| c.observed_worker_meta().cloned())
                        .collect(),
                ))
            }
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.scheduler
            .check_invariants()
            .and_then(|()| self.worker.check_invariants())
            .map_err(|e| e.to_string())
    }

    fn render(out: &Self::Out, ids: &Interner) -> Value {
        match out {
            MultiOut::Finish(d) => json!({
                "delay": d.delay_free,
                "params": render_params(d.kv_transfer_params.as_ref()),
            }),
            MultiOut::Extra(extra) => render_extra(extra.as_ref(), ids),
            MultiOut::Ok => json!("ok"),
            MultiOut::Ids(s) => render_ids(s, ids),
            MultiOut::Matched { tokens, chosen } => json!({ "tokens": tokens, "chosen": chosen }),
            MultiOut::Count(n) => json!(n),
            MultiOut::Routed(slots) => {
                Value::Array(slots.iter().map(|m| render_opt_meta(m.as_ref())).collect())
            }
        }
    }

    fn normalize_expected(call: &str, v: &Value, ids: &mut Interner) -> Result<Value, CaseError> {
        match call {
            "child_finished_sending" => {
                let names: Vec<String> =
                    serde_json::from_value(v.clone()).map_err(|e| CaseError(e.to_string()))?;
                Ok(render_ids(&id_set(names, ids), ids))
            }
            "route_worker_meta" => {
                let slots: Vec<Value> =
                    serde_json::from_value(v.clone()).map_err(|e| CaseError(e.to_string()))?;
                let slots = slots
                    .iter()
                    .map(|s| parse_meta(s).map(|m| render_opt_meta(m.as_ref())))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Value::Array(slots))
            }
            "build_meta" => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct JExtra {
                    extra_async_saves: Option<BTreeMap<String, u32>>,
                }
                let j: JExtra =
                    serde_json::from_value(v.clone()).map_err(|e| CaseError(e.to_string()))?;
                let extra = extra_map(j.extra_async_saves, ids);
                Ok(render_extra(extra.as_ref(), ids))
            }
            _ => Ok(v.clone()),
        }
    }
}
