//! The scripted connector's `engine` cases re-run with the core's P/D connector in its place
//! (issue 37): the cases hold vLLM 0.33.0's scheduler around a remote-loading, delayed-freeing
//! connector, so the P/D connector must pass them.
//!
//! A case's script becomes the params a router would give: a scripted asynchronous hit of `T`
//! tokens is a decode request whose prefill engine holds `c + T` tokens (`c` the local hit its
//! first lookup saw, read from a first run with the scripted connector), `delay_free` is a
//! prefill request held for a decode side. The P/D connector then answers on its own, and the
//! case's expectations must hold: scheduler outputs, request states and the connector calls
//! the scheduler made (logged as the scripted connector logs them). The case still plays the
//! executor, so nothing is acknowledged and no lease runs; the params the P/D connector returns
//! at a finish are checked here (the cases script none) and left out of the outputs.
//!
//! A case that scripts what a P/D connector cannot say — a synchronous or pending lookup, the
//! script changed mid-run, pending block frees, push work, returned params, a cache reset — is
//! [`Substituted::NotExpressible`], with the reason. Run by [`substitute_pd`].

use std::collections::BTreeMap;

use kvrelay_core::pd::{PdParams, RemotePrefill};
use kvrelay_core::{
    AggregatedOutput, BlockId, ConnectorCall, FinishDecision, Lookup, Meta, Params, PdConfig,
    PdConnector, PdMeta, RequestId, ScheduledStep, Scheduler, SchedulerConnector, SchedulerOutput,
    SchedulerView, ScriptedLoad, ScriptedMeta,
};

use super::case::{Harness, PreparedCase, check_one};
use super::engine::{EngineHarness, EngineOut, apply_given_output, request_of, state_of};
use super::engine_calls::EngineOp;

/// How a scripted case fared with the P/D connector substituted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Substituted {
    /// Every expectation held.
    Passed,
    /// The case scripts something a P/D connector cannot say (the reason).
    NotExpressible(String),
    /// An expectation failed (the FAIL message).
    Failed(String),
    /// Not a scripted-connector case.
    NotScripted,
}

/// The P/D connector with the scripted connector's call log, the admitted loads' tables (to
/// render its metadata as the cases write it) and the params it returned.
#[derive(Debug, Clone)]
struct Logged {
    inner: PdConnector,
    calls: Vec<ConnectorCall>,
    loads: BTreeMap<RequestId, (Vec<Vec<BlockId>>, u32)>,
    returned: Vec<(RequestId, Params, u32)>,
}

impl SchedulerConnector for Logged {
    type StepMeta = PdMeta;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, id: RequestId) {
        self.calls.push(ConnectorCall::OnNewRequest { id });
        self.inner.on_new_request(view, id);
    }
    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let answer = self
            .inner
            .get_num_new_matched_tokens(view, id, num_computed_tokens);
        self.calls.push(ConnectorCall::GetNumNewMatchedTokens {
            id,
            num_computed_tokens,
            answer,
        });
        answer
    }
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        if num_external_tokens > 0 {
            self.loads
                .insert(id, (blocks.to_vec(), num_external_tokens));
        }
        self.calls.push(ConnectorCall::UpdateStateAfterAlloc {
            id,
            blocks: blocks.to_vec(),
            num_external_tokens,
        });
        self.inner
            .update_state_after_alloc(view, id, blocks, num_external_tokens);
    }
    fn build_connector_meta(&mut self, view: &SchedulerView<'_>, out: &SchedulerOutput) -> PdMeta {
        self.calls
            .push(ConnectorCall::BuildConnectorMeta { step: out.step });
        self.inner.build_connector_meta(view, out)
    }
    fn update_connector_output(&mut self, view: &SchedulerView<'_>, output: &AggregatedOutput) {
        self.calls.push(ConnectorCall::UpdateConnectorOutput {
            finished_sending: output.finished_sending.clone(),
            finished_recving: output.finished_recving.clone(),
        });
        self.inner.update_connector_output(view, output);
    }
    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        let computed = view.request(id).map_or(0, |r| r.num_computed_tokens());
        let mut d = self.inner.request_finished(view, id, blocks);
        self.calls.push(ConnectorCall::RequestFinished {
            id,
            blocks: blocks.to_vec(),
            delay_free: d.delay_free,
        });
        if let Some(p) = d.kv_transfer_params.take() {
            self.returned.push((id, p, computed));
        }
        d
    }
    fn requires_kv_delivery(&self) -> bool {
        self.inner.requires_kv_delivery()
    }
    fn check_invariants(&self) -> Result<(), kvrelay_core::InvariantViolation> {
        self.inner.check_invariants()
    }
}

/// Why the case cannot be said with params, if it cannot.
fn not_expressible(case: &PreparedCase<EngineHarness>) -> Option<String> {
    for (i, c) in case.calls.iter().enumerate() {
        let why = match &c.op {
            EngineOp::AddRequest {
                lookup: Some(Lookup::Pending),
                ..
            } => "a pending lookup",
            EngineOp::AddRequest {
                lookup:
                    Some(Lookup::Hit {
                        tokens: 1..,
                        load_async: false,
                    }),
                ..
            } => "a synchronous load",
            EngineOp::SetLookup(..) | EngineOp::SetDelayFree(..) | EngineOp::SetDelayAll(_) => {
                "its script changed mid-run"
            }
            EngineOp::SetFinishParams(..) => "returned params",
            EngineOp::SetPendingBlockFrees(_) => "pending block frees",
            EngineOp::SetPushWork(_) => "push work",
            EngineOp::ResetCache => "a cache reset",
            _ => continue,
        };
        return Some(format!("call {i} ({}): {why}", c.call));
    }
    None
}

/// The local hit each request's first lookup saw, from a run with the scripted connector.
fn first_lookups(case: &PreparedCase<EngineHarness>) -> Result<BTreeMap<RequestId, u32>, String> {
    let mut h = EngineHarness::new(&case.config).map_err(|e| e.to_string())?;
    let mut seen = BTreeMap::new();
    for c in &case.calls {
        let _ = h.apply(&c.op);
        for call in h.take_scripted_calls() {
            if let ConnectorCall::GetNumNewMatchedTokens {
                id,
                num_computed_tokens,
                ..
            } = call
            {
                seen.entry(id).or_insert(num_computed_tokens);
            }
        }
    }
    Ok(seen)
}

/// Runs scripted `engine` case `case` with the P/D connector substituted (see the module docs).
pub fn substitute_pd(case: &PreparedCase<EngineHarness>) -> Substituted {
    if !EngineHarness::is_scripted(&case.config) {
        return Substituted::NotScripted;
    }
    if let Some(why) = not_expressible(case) {
        return Substituted::NotExpressible(why);
    }
    match run(case) {
        Ok(()) => Substituted::Passed,
        Err(e) => Substituted::Failed(e),
    }
}

fn run(case: &PreparedCase<EngineHarness>) -> Result<(), String> {
    let first = first_lookups(case)?;
    let (sc, kv_delivery) = EngineHarness::scheduler_config(&case.config).map_err(|e| e.0)?;
    let config = PdConfig {
        kv_delivery,
        ..PdConfig::both(1)
    };
    let logged = Logged {
        inner: PdConnector::new(config),
        calls: Vec::new(),
        loads: BTreeMap::new(),
        returned: Vec::new(),
    };
    let mut s = Scheduler::new(sc, logged).map_err(|e| e.to_string())?;
    for (i, c) in case.calls.iter().enumerate() {
        let got = apply(&mut s, &c.op, &first);
        s.check_invariants()
            .map_err(|e| format!("call {i} ({}): core invariant broken: {e}", c.call))?;
        check_one(i, c, got.map(|o| EngineHarness::render(&o, &case.ids)))?;
        check_returned(&mut s.connector_mut().returned)
            .map_err(|e| format!("call {i} ({}): {e}", c.call))?;
    }
    Ok(())
}

/// The params the P/D connector returned at a finish say where the request's KV is: this
/// engine, the request, the tokens it computed.
fn check_returned(returned: &mut Vec<(RequestId, Params, u32)>) -> Result<(), String> {
    for (id, p, computed) in returned.drain(..) {
        let at = PdParams::parse(&p)
            .map_err(|e| e.to_string())?
            .remote_prefill;
        let ok = at.is_some_and(|a: RemotePrefill| {
            a.engine == 1 && a.request == id.0 && a.num_tokens <= computed
        });
        if !ok {
            return Err(format!("{id:?} finished with params {p:?}"));
        }
    }
    Ok(())
}

/// The router's params for a scripted request.
fn params(
    op_lookup: Option<Lookup>,
    delay: Option<bool>,
    id: RequestId,
    local: u32,
) -> Option<Params> {
    let mut p = Params::new();
    if let Some(Lookup::Hit {
        tokens,
        load_async: true,
    }) = op_lookup
    {
        p.extend(PdParams::for_decode(RemotePrefill {
            engine: 0,
            request: id.0,
            num_tokens: local + tokens,
        }));
    }
    if delay == Some(true) {
        p.extend(PdParams::for_prefill());
    }
    (!p.is_empty()).then_some(p)
}

/// One call on the scheduler with the substituted connector.
fn apply(
    s: &mut Scheduler<Logged>,
    op: &EngineOp,
    first: &BTreeMap<RequestId, u32>,
) -> Result<EngineOut, &'static str> {
    let kind = |e: kvrelay_core::SchedulerError| e.kind();
    match op {
        EngineOp::AddRequest {
            spec,
            lookup,
            delay_free,
        } => {
            let mut spec = spec.clone();
            let local = first.get(&spec.id).copied().unwrap_or(0);
            spec.kv_transfer_params = params(*lookup, *delay_free, spec.id, local);
            s.add_request(spec).map(|()| EngineOut::Ok).map_err(kind)
        }
        EngineOp::Abort(id) => s.abort(*id).map(EngineOut::Bool).map_err(kind),
        EngineOp::Schedule => {
            let groups = s.config().groups.len();
            let st = s.schedule().map_err(kind)?;
            let meta = scripted_meta(s.connector(), &st)?;
            let step = ScheduledStep {
                output: st.output,
                meta,
            };
            Ok(EngineOut::Scheduled(Box::new(step), groups))
        }
        EngineOp::ApplyOutput {
            step, sampled, kv, ..
        } => apply_given_output(s, *step, sampled, kv.clone()),
        EngineOp::Request(id) => Ok(request_of(s, *id)),
        EngineOp::State => Ok(state_of(s)),
        EngineOp::ConnectorCalls => Ok(EngineOut::Calls(std::mem::take(
            &mut s.connector_mut().calls,
        ))),
        _ => Err("wrong_connector"),
    }
}

/// The P/D connector's loads as the scripted connector's metadata shows them: each with the
/// table and tokens of its allocation. A load whose blocks are not in that table, or that
/// loads nothing, is `load_mismatch`.
fn scripted_meta(c: &Logged, st: &ScheduledStep<PdMeta>) -> Result<ScriptedMeta, &'static str> {
    let mut loads = Vec::with_capacity(st.meta.loads.len());
    for l in &st.meta.loads {
        let (blocks, tokens) = c.loads.get(&l.request).cloned().ok_or("load_mismatch")?;
        let in_table = l
            .blocks
            .iter()
            .all(|b| blocks.iter().flatten().any(|x| x == b));
        if l.blocks.is_empty() || !in_table {
            return Err("load_mismatch");
        }
        loads.push(ScriptedLoad {
            id: l.request,
            blocks,
            tokens,
            load_async: true,
        });
    }
    Ok(ScriptedMeta {
        loads,
        finished: st.output.finished_req_ids.clone(),
        preempted: st.output.preempted_req_ids.clone(),
    })
}
