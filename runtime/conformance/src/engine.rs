//! The `engine` machine: the scheduler ([`Scheduler`]) through whole steps, with one of two
//! connectors.
//!
//! * The scripted connector (the default): the case plays the executor — it scripts the
//!   connector's lookup answers and delayed frees, and hands `apply_output` the step's connector
//!   output — and reads the connector calls the scheduler made (`connector_calls`).
//! * The offloading connector (`"connector": {"offloading": {…}}`): the core's engine step with
//!   W simulated ranks and their DMA ([`OffloadEngine`], in [`super::engine_offload`]); the case
//!   runs steps (`execute`, `run_step`, `drain`) and completes transfers (`hold`, `complete`).
//!
//! A case's calls are converted once into [`EngineOp`]s; [`EngineHarness`]'s `apply` runs one
//! on either connector ([`apply_scripted`], [`apply_offload`]); a call for the other connector
//! is the typed error `wrong_connector`. Run by `kvrelay conformance` for a case with
//! `"machine": "engine"`.

use kvrelay_core::{
    BlockId, ConnectorCall, GroupKind, Interner, JobId, KeyLookup, LoadFailurePolicy, Lookup, Mode,
    ModelOutput, RequestId, RequestStatus, ScheduledStep, Scheduler, SchedulerConfig,
    SchedulerError, ScriptedConnector, ScriptedMeta, StepId, StepResult,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness, err};
use super::engine_calls::{EngineCall, EngineOp};
use super::engine_offload::{self, OffloadEngine};
use super::json::{
    normalize_int_set_field, normalize_set_field, parse_call, render_id, render_id_list,
    render_opt_ids, render_step_result, render_tables, scheduled_fields,
};

/// The error of a call the case's connector does not take.
const WRONG_CONNECTOR: &str = "wrong_connector";

/// The `engine` machine: the scheduler ([`Scheduler`]) driven by the [`ScriptedConnector`]
/// (the case plays the executor) or by the offloading connector with simulated ranks
/// ([`OffloadEngine`]).
#[derive(Debug)]
pub struct EngineHarness(EngineInner);

/// The connector an `engine` case runs with.
#[derive(Debug)]
enum EngineInner {
    Scripted(Box<Scheduler<ScriptedConnector>>),
    Offload(Box<OffloadEngine>),
}

/// A request as `request` shows it.
#[derive(Debug, Clone)]
pub struct RequestSnapshot {
    status: RequestStatus,
    num_computed_tokens: u32,
    block_ids: Vec<Vec<BlockId>>,
    num_preemptions: u32,
}

/// What an `engine` call returns, before rendering.
#[derive(Debug)]
pub enum EngineOut {
    /// `"ok"`.
    Ok,
    /// `abort`'s answer.
    Bool(bool),
    /// `schedule`'s step, and the number of KV cache groups.
    Scheduled(Box<ScheduledStep<ScriptedMeta>>, usize),
    /// `apply_output`'s result.
    Applied(StepResult),
    /// `request`'s answer.
    Request(Option<RequestSnapshot>),
    /// `state`'s answer.
    State {
        /// Running requests, in order.
        running: Vec<RequestId>,
        /// Waiting requests, in admission order.
        waiting: Vec<RequestId>,
        /// Free GPU blocks.
        free_blocks: u32,
        /// `has_requests()`.
        has_requests: bool,
        /// Steps in flight, oldest first.
        in_flight: Vec<u64>,
    },
    /// The drained connector call log.
    Calls(Vec<ConnectorCall>),
    /// `schedule`'s step with the offloading connector.
    OffloadScheduled(Box<engine_offload::OffloadScheduled>),
    /// `execute`'s result.
    Executed(Box<engine_offload::Executed>),
    /// `run_step`'s result.
    StepRun(
        Box<(
            engine_offload::OffloadScheduled,
            engine_offload::Executed,
            StepResult,
        )>,
    ),
    /// A job list (`complete`).
    Jobs(Vec<JobId>),
    /// A count (`drain`).
    Count(u32),
    /// `lookup`'s answer, per group and chunk.
    Lookups(Vec<Vec<KeyLookup>>),
    /// `offload_state`'s answer.
    OffloadState(Box<engine_offload::OffloadState>),
    /// `reset_cache`'s answer.
    Reset(Option<bool>),
}

impl Harness for EngineHarness {
    type Op = EngineOp;
    type Out = EngineOut;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let c: EngineConfig = serde_json::from_value(Value::Object(config.clone()))
            .map_err(|e| CaseError(e.to_string()))?;
        let sc = scheduler_config(&c)?;
        match parse_connector(c.connector.as_ref())? {
            ConnectorChoice::Scripted => {
                let mut conn = ScriptedConnector::new();
                conn.set_requires_kv_delivery(c.requires_kv_delivery.unwrap_or(false));
                Scheduler::new(sc, conn)
                    .map(|s| Self(EngineInner::Scripted(Box::new(s))))
                    .map_err(|e| CaseError(e.to_string()))
            }
            ConnectorChoice::Offloading(v) => {
                if c.requires_kv_delivery.is_some() {
                    return err("`requires_kv_delivery` is a scripted-connector key");
                }
                OffloadEngine::new(sc, &v).map(|e| Self(EngineInner::Offload(Box::new(e))))
            }
        }
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        parse_call::<EngineCall>(call, args)?.into_op(ids)
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        match &mut self.0 {
            EngineInner::Scripted(s) => apply_scripted(s, op),
            EngineInner::Offload(e) => apply_offload(e, op),
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        match &self.0 {
            EngineInner::Scripted(s) => s.check_invariants().map_err(|e| e.to_string()),
            EngineInner::Offload(e) => e.check_invariants(),
        }
    }

    fn render(out: &Self::Out, ids: &Interner) -> Value {
        match out {
            EngineOut::Ok => json!("ok"),
            EngineOut::Bool(b) => json!(b),
            EngineOut::Scheduled(s, groups) => render_scheduled(s, *groups, ids),
            EngineOut::Applied(r) => render_step_result(r, ids),
            EngineOut::Request(None) => Value::Null,
            EngineOut::Request(Some(r)) => json!({
                "status": status_name(r.status),
                "num_computed_tokens": r.num_computed_tokens,
                "block_ids": render_tables(&r.block_ids),
                "num_preemptions": r.num_preemptions,
            }),
            EngineOut::State {
                running,
                waiting,
                free_blocks,
                has_requests,
                in_flight,
            } => json!({
                "running": render_id_list(running, ids),
                "waiting": render_id_list(waiting, ids),
                "free_blocks": free_blocks,
                "has_requests": has_requests,
                "in_flight": in_flight,
            }),
            EngineOut::Calls(calls) => {
                Value::Array(calls.iter().map(|c| render_call(c, ids)).collect())
            }
            EngineOut::OffloadScheduled(x) => engine_offload::render_scheduled(x, ids),
            EngineOut::Executed(x) => engine_offload::render_executed(x, ids),
            EngineOut::StepRun(x) => engine_offload::render_step_run(x, ids),
            EngineOut::Jobs(js) => json!(js.iter().map(|j| j.0).collect::<Vec<_>>()),
            EngineOut::Count(n) => json!(n),
            EngineOut::Lookups(l) => engine_offload::render_lookups(l),
            EngineOut::OffloadState(x) => engine_offload::render_state(x, ids),
            EngineOut::Reset(r) => r.map_or(Value::Null, |b| json!(b)),
        }
    }

    fn normalize_expected(call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        let mut v = v.clone();
        match call {
            "schedule" => normalize_scheduled(&mut v)?,
            "execute" => normalize_executed(&mut v)?,
            "run_step" => {
                if let Some(x) = v.get_mut("scheduled") {
                    normalize_scheduled(x)?;
                }
                if let Some(x) = v.get_mut("executed") {
                    normalize_executed(x)?;
                }
            }
            "offload_state" => normalize_int_set_field(&mut v, "fenced_blocks")?,
            "connector_calls" => {
                if let Some(calls) = v.as_array_mut() {
                    for c in calls {
                        if c.get("call").and_then(Value::as_str) == Some("update_connector_output")
                        {
                            normalize_set_field(c, "finished_sending")?;
                            normalize_set_field(c, "finished_recving")?;
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(v)
    }
}

/// The scheduler configuration of a case's `config`: an absent key keeps the default.
fn scheduler_config(c: &EngineConfig) -> Result<SchedulerConfig, CaseError> {
    let d = SchedulerConfig::default();
    let groups = match &c.groups {
        None => d.groups,
        Some(gs) => gs.iter().map(parse_group).collect::<Result<_, _>>()?,
    };
    Ok(SchedulerConfig {
        block_size: c.block_size.unwrap_or(d.block_size),
        num_gpu_blocks: c.num_gpu_blocks.unwrap_or(d.num_gpu_blocks),
        groups,
        max_num_batched_tokens: c.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
        max_num_seqs: c.max_num_seqs.unwrap_or(d.max_num_seqs),
        max_model_len: c.max_model_len.unwrap_or(d.max_model_len),
        enable_prefix_caching: c.enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
        enable_chunked_prefill: c.enable_chunked_prefill.unwrap_or(d.enable_chunked_prefill),
        long_prefill_token_threshold: c
            .long_prefill_token_threshold
            .unwrap_or(d.long_prefill_token_threshold),
        watermark_blocks: c.watermark_blocks.unwrap_or(d.watermark_blocks),
        load_failure_policy: c.load_failure_policy.unwrap_or(d.load_failure_policy),
        async_depth: c.async_depth.unwrap_or(d.async_depth),
        mode: c.mode.unwrap_or(d.mode),
    })
}

/// For the P/D substitution ([`super::engine_pd`]).
impl EngineHarness {
    /// Whether a case's `config` runs the scripted connector.
    pub(super) fn is_scripted(config: &Map<String, Value>) -> bool {
        let c = config.get("connector");
        matches!(parse_connector(c), Ok(ConnectorChoice::Scripted))
    }

    /// A scripted case's scheduler configuration and its `requires_kv_delivery`.
    pub(super) fn scheduler_config(
        config: &Map<String, Value>,
    ) -> Result<(SchedulerConfig, bool), CaseError> {
        let c: EngineConfig = serde_json::from_value(Value::Object(config.clone()))
            .map_err(|e| CaseError(e.to_string()))?;
        Ok((
            scheduler_config(&c)?,
            c.requires_kv_delivery.unwrap_or(false),
        ))
    }

    /// The scripted connector's call log, drained (empty for the offloading connector).
    pub(super) fn take_scripted_calls(&mut self) -> Vec<ConnectorCall> {
        match &mut self.0 {
            EngineInner::Scripted(s) => s.connector_mut().take_calls(),
            EngineInner::Offload(_) => Vec::new(),
        }
    }
}

/// Runs one call on the scheduler with the scripted connector: the case plays the executor
/// (`apply_output` carries the step's connector output), the offloading-only calls are
/// refused.
fn apply_scripted(
    s: &mut Scheduler<ScriptedConnector>,
    op: &EngineOp,
) -> Result<EngineOut, &'static str> {
    let kind = |e: SchedulerError| e.kind();
    match op {
        EngineOp::AddRequest {
            spec,
            lookup,
            delay_free,
        } => {
            // The script is set before `on_new_request`, so that a scripted answer is in
            // place for the first lookup; a rejected request leaves the script as it was.
            let id = spec.id;
            let before = s.connector().clone();
            if let Some(l) = lookup {
                s.connector_mut().set_lookup(id, *l);
            }
            if let Some(d) = delay_free {
                s.connector_mut().set_delay_free(id, *d);
            }
            match s.add_request(spec.clone()) {
                Ok(()) => Ok(EngineOut::Ok),
                Err(e) => {
                    // Nothing was called on the connector; undo the script change.
                    *s.connector_mut() = before;
                    Err(kind(e))
                }
            }
        }
        EngineOp::SetLookup(id, l) => {
            s.connector_mut().set_lookup(*id, *l);
            Ok(EngineOut::Ok)
        }
        EngineOp::SetDelayFree(id, d) => {
            s.connector_mut().set_delay_free(*id, *d);
            Ok(EngineOut::Ok)
        }
        EngineOp::SetDelayAll(v) => {
            s.connector_mut().set_delay_all(*v);
            Ok(EngineOut::Ok)
        }
        EngineOp::SetFinishParams(id, p) => {
            s.connector_mut().set_finish_params(*id, p.clone());
            Ok(EngineOut::Ok)
        }
        EngineOp::SetPendingBlockFrees(v) => {
            s.connector_mut().set_pending_block_frees(*v);
            Ok(EngineOut::Ok)
        }
        EngineOp::SetPushWork(v) => {
            s.connector_mut().set_push_work(*v);
            Ok(EngineOut::Ok)
        }
        EngineOp::Abort(id) => s.abort(*id).map(EngineOut::Bool).map_err(kind),
        EngineOp::Schedule => {
            let groups = s.config().groups.len();
            s.schedule()
                .map(|st| EngineOut::Scheduled(Box::new(st), groups))
                .map_err(kind)
        }
        EngineOp::ApplyOutput {
            step, sampled, kv, ..
        } => apply_given_output(s, *step, sampled, kv.clone()),
        EngineOp::Request(id) => Ok(request_of(s, *id)),
        EngineOp::State => Ok(state_of(s)),
        EngineOp::ConnectorCalls => Ok(EngineOut::Calls(s.connector_mut().take_calls())),
        EngineOp::ResetCache => s
            .reset_connector_cache()
            .map(EngineOut::Reset)
            .map_err(kind),
        EngineOp::Execute(_)
        | EngineOp::RunStep
        | EngineOp::Drain(_)
        | EngineOp::Hold { .. }
        | EngineOp::Complete { .. }
        | EngineOp::Lookup { .. }
        | EngineOp::OffloadState => Err(WRONG_CONNECTOR),
    }
}

/// `apply_output` with the connector output the case gives (the case plays the executor):
/// the fake sampler's tokens with the case's overrides.
pub(super) fn apply_given_output<C>(
    s: &mut Scheduler<C>,
    step: Option<StepId>,
    sampled: &[(RequestId, Vec<kvrelay_core::Token>)],
    kv: Option<kvrelay_core::AggregatedOutput>,
) -> Result<EngineOut, &'static str>
where
    C: kvrelay_core::SchedulerConnector<WorkerMeta = kvrelay_core::Meta>,
{
    // No step in flight and none named: a step that cannot be the oldest one.
    let step = step
        .or_else(|| s.steps_in_flight().next())
        .unwrap_or(StepId(u64::MAX));
    let mut tokens = s.fake_sample(step);
    for (id, t) in sampled {
        match tokens.iter_mut().find(|(x, _)| x == id) {
            Some(slot) => slot.1.clone_from(t),
            None => tokens.push((*id, t.clone())),
        }
    }
    let out = ModelOutput {
        sampled: tokens,
        kv_connector_output: kv,
    };
    s.update_from_output(step, out)
        .map(EngineOut::Applied)
        .map_err(|e| e.kind())
}

/// Runs one call on the engine step with the offloading connector and simulated ranks: the
/// harness plays the executor and the DMA, so the scripted connector's calls, and connector
/// output given by the case, are refused.
fn apply_offload(e: &mut OffloadEngine, op: &EngineOp) -> Result<EngineOut, &'static str> {
    match op {
        EngineOp::AddRequest {
            spec,
            lookup,
            delay_free,
        } => {
            if lookup.is_some() || delay_free.is_some() {
                return Err(WRONG_CONNECTOR);
            }
            e.add(spec.clone()).map_err(|e| e.kind())?;
            Ok(EngineOut::Ok)
        }
        EngineOp::SetLookup(..)
        | EngineOp::SetDelayFree(..)
        | EngineOp::SetDelayAll(_)
        | EngineOp::SetFinishParams(..)
        | EngineOp::SetPendingBlockFrees(_)
        | EngineOp::SetPushWork(_)
        | EngineOp::ConnectorCalls => Err(WRONG_CONNECTOR),
        EngineOp::Abort(id) => e.abort(*id).map(EngineOut::Bool),
        EngineOp::Schedule => e
            .schedule()
            .map(|x| EngineOut::OffloadScheduled(Box::new(x))),
        EngineOp::Execute(step) => e.execute(*step).map(|x| EngineOut::Executed(Box::new(x))),
        EngineOp::ApplyOutput {
            step,
            sampled,
            kv_given,
            ..
        } => {
            if *kv_given {
                return Err(WRONG_CONNECTOR);
            }
            e.apply_output(*step, sampled).map(EngineOut::Applied)
        }
        EngineOp::RunStep => e
            .run_step()
            .map(|(a, b, c)| EngineOut::StepRun(Box::new((a, b, c)))),
        EngineOp::Drain(max) => e.drain(*max).map(EngineOut::Count),
        EngineOp::Hold { rank, value } => e.hold(*rank, *value).map(|()| EngineOut::Ok),
        EngineOp::Complete { rank, jobs } => e
            .complete(*rank as usize, jobs.as_deref())
            .map(EngineOut::Jobs),
        EngineOp::Lookup { id, prompt } => {
            let tokens = match (id, prompt) {
                (Some(id), _) => id
                    .and_then(|id| e.prompt(id))
                    .ok_or("unknown_request")?
                    .to_vec(),
                (None, Some(p)) => p.clone(),
                (None, None) => Vec::new(),
            };
            Ok(EngineOut::Lookups(e.lookup(&tokens)))
        }
        EngineOp::OffloadState => Ok(EngineOut::OffloadState(Box::new(e.state()))),
        EngineOp::ResetCache => e.reset_cache().map(EngineOut::Reset),
        EngineOp::Request(id) => Ok(request_of(e.scheduler(), *id)),
        EngineOp::State => Ok(state_of(e.scheduler())),
    }
}

// ---------------------------------------------------------------------------------------------
// The case's config and arguments

/// An `engine` case's `config`: an absent key keeps the scheduler's default.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineConfig {
    block_size: Option<u32>,
    num_gpu_blocks: Option<u32>,
    groups: Option<Vec<Value>>,
    max_num_batched_tokens: Option<u32>,
    max_num_seqs: Option<u32>,
    max_model_len: Option<u32>,
    enable_prefix_caching: Option<bool>,
    enable_chunked_prefill: Option<bool>,
    long_prefill_token_threshold: Option<u32>,
    watermark_blocks: Option<u32>,
    load_failure_policy: Option<LoadFailurePolicy>,
    async_depth: Option<u32>,
    mode: Option<Mode>,
    requires_kv_delivery: Option<bool>,
    connector: Option<Value>,
}

/// The connector a case's `connector` key names.
#[derive(Debug)]
enum ConnectorChoice {
    /// The scripted connector (the default).
    Scripted,
    /// The offloading connector, with its `{…}` object.
    Offloading(Value),
}

/// Parses the `connector` config value.
fn parse_connector(v: Option<&Value>) -> Result<ConnectorChoice, CaseError> {
    match v {
        None => Ok(ConnectorChoice::Scripted),
        Some(Value::String(s)) if s == "scripted" => Ok(ConnectorChoice::Scripted),
        Some(Value::Object(o)) if o.len() == 1 && o.contains_key("offloading") => {
            Ok(ConnectorChoice::Offloading(o["offloading"].clone()))
        }
        Some(other) => err(format!(
            "connector {other}: expected \"scripted\" or {{\"offloading\": {{…}}}}"
        )),
    }
}

/// A KV-cache group: `"full"` or `{"sliding_window": n}`.
fn parse_group(v: &Value) -> Result<GroupKind, CaseError> {
    if v.as_str() == Some("full") {
        return Ok(GroupKind::FullAttention);
    }
    if let Some(o) = v.as_object()
        && o.len() == 1
        && let Some(w) = o.get("sliding_window").and_then(Value::as_u64)
        && let Ok(window) = u32::try_from(w)
    {
        return Ok(GroupKind::SlidingWindow { window });
    }
    err(format!(
        "group {v}: expected \"full\" or {{\"sliding_window\": n}}"
    ))
}

// ---------------------------------------------------------------------------------------------
// Results

/// `request`'s answer, for either connector.
pub(super) fn request_of<C: kvrelay_core::SchedulerConnector>(
    s: &Scheduler<C>,
    id: RequestId,
) -> EngineOut {
    let v = s.view();
    let n = v.config().groups.len();
    EngineOut::Request(v.request(id).map(|r| RequestSnapshot {
        status: r.status(),
        num_computed_tokens: r.num_computed_tokens(),
        block_ids: (0..n).map(|g| r.block_ids(g).to_vec()).collect(),
        num_preemptions: r.num_preemptions(),
    }))
}

/// `state`'s answer, for either connector.
pub(super) fn state_of<C: kvrelay_core::SchedulerConnector>(s: &Scheduler<C>) -> EngineOut {
    let v = s.view();
    EngineOut::State {
        running: v.running().to_vec(),
        waiting: v.waiting().collect(),
        free_blocks: v.num_free_blocks(),
        has_requests: s.has_requests(),
        in_flight: s.steps_in_flight().map(|x| x.0).collect(),
    }
}

/// A lookup answer as a case writes it.
fn render_lookup(l: &Lookup) -> Value {
    match l {
        Lookup::Pending => Value::Null,
        Lookup::Hit { tokens, load_async } => json!({ "tokens": tokens, "async": load_async }),
    }
}

/// A request status by its name.
fn status_name(s: RequestStatus) -> Value {
    serde_json::to_value(s).unwrap_or(Value::Null)
}

/// One entry of the scripted connector's call log.
fn render_call(c: &ConnectorCall, ids: &Interner) -> Value {
    match c {
        ConnectorCall::OnNewRequest { id } => {
            json!({ "call": "on_new_request", "id": render_id(*id, ids) })
        }
        ConnectorCall::GetNumNewMatchedTokens {
            id,
            num_computed_tokens,
            answer,
        } => json!({
            "call": "get_num_new_matched_tokens",
            "id": render_id(*id, ids),
            "num_computed_tokens": num_computed_tokens,
            "answer": render_lookup(answer),
        }),
        ConnectorCall::UpdateStateAfterAlloc {
            id,
            blocks,
            num_external_tokens,
        } => json!({
            "call": "update_state_after_alloc",
            "id": render_id(*id, ids),
            "blocks": render_tables(blocks),
            "num_external_tokens": num_external_tokens,
        }),
        ConnectorCall::BuildConnectorMeta { step } => {
            json!({ "call": "build_connector_meta", "step": step.0 })
        }
        ConnectorCall::UpdateConnectorOutput {
            finished_sending,
            finished_recving,
        } => json!({
            "call": "update_connector_output",
            "finished_sending": render_opt_ids(finished_sending.as_ref(), ids),
            "finished_recving": render_opt_ids(finished_recving.as_ref(), ids),
        }),
        ConnectorCall::RequestFinished {
            id,
            blocks,
            delay_free,
        } => json!({
            "call": "request_finished",
            "id": render_id(*id, ids),
            "blocks": render_tables(blocks),
            "delay_free": delay_free,
        }),
    }
}

/// `schedule`'s result with the scripted connector: the step and its loads.
fn render_scheduled(s: &ScheduledStep<ScriptedMeta>, groups: usize, ids: &Interner) -> Value {
    let loads: Vec<Value> = s
        .meta
        .loads
        .iter()
        .map(|l| {
            json!({
                "id": render_id(l.id, ids),
                "blocks": render_tables(&l.blocks),
                "tokens": l.tokens,
                "async": l.load_async,
            })
        })
        .collect();
    let mut m = scheduled_fields(&s.output, groups, ids);
    m.insert("meta".into(), json!({ "loads": loads }));
    Value::Object(m)
}

/// An expected `schedule` result with its sets sorted.
fn normalize_scheduled(v: &mut Value) -> Result<(), CaseError> {
    normalize_set_field(v, "finished_req_ids")?;
    normalize_set_field(v, "preempted_req_ids")?;
    if let Some(m) = v.get_mut("meta") {
        normalize_int_set_field(m, "jobs_to_flush")?;
    }
    Ok(())
}

/// An expected `execute` result with its sets sorted.
fn normalize_executed(v: &mut Value) -> Result<(), CaseError> {
    if let Some(a) = v.get_mut("aggregated") {
        normalize_set_field(a, "finished_sending")?;
        normalize_set_field(a, "finished_recving")?;
        normalize_set_field(a, "failed_recving")?;
    }
    if let Some(Value::Array(ranks)) = v.get_mut("ranks") {
        for r in ranks {
            normalize_set_field(r, "finished_recving")?;
        }
    }
    Ok(())
}
