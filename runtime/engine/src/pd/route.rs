//! The P/D router: each request goes to the prefill engine with `do_remote_decode` and one
//! output token, then — with the params its finish returned — to the decode engine with its
//! own output length, as vLLM's disaggregation proxy sends it. When the decode engine is done
//! reading (the request's first token, or its finish), the router acknowledges the prefill
//! engine, which then releases the blocks.
//!
//! [`route`] drives both engines in lockstep on one virtual clock: every tick each engine with
//! work takes one step, and the clock advances `step_ms` (jumping to the next arrival when
//! both are idle), so a run's figures are the same on every machine. The engines are reached
//! through [`PdLink`]: an [`Engine`] of this process, or an engine process (`kvrelay pd`).

use std::collections::HashMap;

use kvrelay_core::{FinishReason, Params, PdParams, PdStats, RequestId, RequestOutput, Token};
use serde::{Deserialize, Serialize};

use crate::report::Latency;
use crate::workload::{self, TraceRecord};
use crate::{Engine, RunConfig, RunError};

/// Ticks in a row in which an engine is stuck (requests, nothing runnable or in flight), or
/// the pair is (both idle, nothing handed between them, requests in flight), after which the
/// run stops with [`RunError::Stalled`].
const STUCK_TICKS: u32 = 3;

/// What an engine is told in one tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    pub submit: Vec<Submit>,
    /// Prefill: requests the decode side is done reading.
    pub acks: Vec<RequestId>,
    /// Requests to abort (after the submissions: a request submitted and aborted in one tick
    /// is aborted as it waits for its KV).
    pub aborts: Vec<RequestId>,
}

/// A request for an engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Submit {
    pub id: RequestId,
    pub prompt: Vec<Token>,
    pub max_tokens: u32,
    pub params: Option<Params>,
}

/// What an engine did in one tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ticked {
    /// The step's outputs, then a finish (`Aborted`) per request the tick aborted.
    pub outputs: Vec<RequestOutput>,
    /// Requests refused at submit, with why.
    pub refused: Vec<(RequestId, String)>,
    /// Requests left, or a step in flight (not: only requests held for acknowledgements
    /// that nothing but the decode side can bring, [`Engine::awaiting_acks_only`]).
    pub busy: bool,
    /// Requests that can never run (after an idle step).
    pub stuck: Option<Vec<RequestId>>,
    /// No step, or an idle one (nothing scheduled, nothing came back).
    pub idle: bool,
}

/// What an engine did in the whole run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineSummary {
    pub steps: u64,
    pub preemptions: u64,
    pub tokens_computed: u64,
    pub prefix_hit_tokens: u64,
    /// Loads of every kind (from the prefill engine and from the CPU pool).
    pub blocks_loaded: u64,
    pub bytes_loaded: u64,
    /// Of those, read from the prefill engine.
    pub remote_blocks_loaded: u64,
    pub remote_bytes_loaded: u64,
    pub failed_loads: u64,
    pub loaded_blocks_verified: u64,
    pub read_blocks_checked: u64,
    pub pd: PdStats,
    /// Prefill: the KV server's reads, blocks and bytes served, reads of released requests.
    pub served_reads: u64,
    pub served_blocks: u64,
    pub served_bytes: u64,
    pub served_gone: u64,
    /// What the shared tier did (`None`: no tier).
    pub tier: Option<crate::tier::TierFigures>,
    /// What the engine did not give back (see [`Engine::leaks`]).
    pub leaks: Vec<String>,
}

/// One engine of a P/D pair, as the router reaches it.
pub trait PdLink {
    /// Hands the engine its tick; it steps once if it has work.
    fn tick(&mut self, tick: Tick) -> impl Future<Output = Result<Ticked, RunError>>;
    /// Stops the engine; what it did.
    fn finish(self) -> impl Future<Output = Result<EngineSummary, RunError>>;
}

impl PdLink for Engine {
    async fn tick(&mut self, tick: Tick) -> Result<Ticked, RunError> {
        let mut out = Ticked {
            idle: true,
            ..Ticked::default()
        };
        for s in tick.submit {
            match self.add_with(s.id, s.prompt, s.max_tokens, s.params) {
                Ok(()) => {}
                Err(e @ (RunError::Refused { .. } | RunError::BadParams { .. })) => {
                    out.refused.push((s.id, e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        for r in tick.acks {
            self.acknowledge(r);
        }
        let mut aborted = Vec::new();
        for r in tick.aborts {
            if self.abort(r)? {
                aborted.push(RequestOutput {
                    id: r,
                    new_tokens: Vec::new(),
                    finish: Some(FinishReason::Aborted),
                    kv_transfer_params: None,
                });
            }
        }
        if self.has_work() {
            let o = self.step().await?;
            out.stuck = if o.idle { self.stuck() } else { None };
            out.idle = o.idle;
            out.outputs = o.outputs;
        }
        out.outputs.extend(aborted);
        out.busy = self.has_work() && !self.awaiting_acks_only();
        Ok(out)
    }

    async fn finish(self) -> Result<EngineSummary, RunError> {
        let leaks = self.leaks();
        let tier = self.tier_figures().cloned();
        let pd = self.pd_stats().unwrap_or_default();
        let served = self.kv_server().map(|s| {
            let c = s.counts();
            let get =
                |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            [get(&c.reads), get(&c.blocks), get(&c.bytes), get(&c.gone)]
        });
        let (f, ranks) = self.shutdown().await;
        let [served_reads, served_blocks, served_bytes, served_gone] = served.unwrap_or_default();
        let mut r = crate::rank::RankStats::default();
        for rank in &ranks {
            r.add(rank);
        }
        Ok(EngineSummary {
            steps: f.steps,
            preemptions: f.preemptions,
            tokens_computed: f.tokens_computed,
            prefix_hit_tokens: f.reused_tokens,
            blocks_loaded: r.blocks_loaded,
            bytes_loaded: r.bytes_loaded,
            remote_blocks_loaded: r.remote_blocks_loaded,
            remote_bytes_loaded: r.remote_bytes_loaded,
            failed_loads: r.failed_transfers,
            loaded_blocks_verified: r.loaded_blocks_verified,
            read_blocks_checked: r.read_blocks_checked,
            pd,
            served_reads,
            served_blocks,
            served_bytes,
            served_gone,
            tier,
            leaks,
        })
    }
}

/// What a routed run did, end to end.
#[derive(Clone, Debug, Default)]
pub struct Routed {
    pub counts: RouteCounts,
    /// On the virtual clock, from each request's arrival.
    pub latency: Latency,
}

/// The router's counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RouteCounts {
    pub requests: u64,
    pub finished: u64,
    pub refused: u64,
    /// Requests the prefill engine handed on with params (the others went without: the decode
    /// engine computes them whole).
    pub handed_off: u64,
    pub acks_sent: u64,
    pub ticks: u64,
}

/// A request between its arrival and its finish on the decode engine.
#[derive(Debug)]
struct InFlight {
    prompt: Vec<Token>,
    max_tokens: u32,
    /// Handed on with params and not acknowledged yet.
    unacked: bool,
}

/// The router's state (see the module docs).
#[derive(Debug)]
struct Router<'a> {
    records: &'a [TraceRecord],
    hash_block: u32,
    next: usize,
    now_ms: f64,
    flight: HashMap<RequestId, InFlight>,
    to_decode: Vec<Submit>,
    acks: Vec<RequestId>,
    stuck: [u32; 2],
    /// Ticks in a row in which both engines were idle and nothing passed between them.
    quiet: u32,
    routed: Routed,
}

/// Replays `records` through `prefill` and `decode` (see the module docs); `progress` hears
/// `(finished, total)` after every tick.
pub async fn route<P: PdLink, D: PdLink>(
    c: &RunConfig,
    records: &[TraceRecord],
    prefill: &mut P,
    decode: &mut D,
    mut progress: impl FnMut(u64, u64),
) -> Result<Routed, RunError> {
    let mut r = Router {
        records,
        hash_block: c.hash_block(),
        next: 0,
        now_ms: 0.0,
        flight: HashMap::new(),
        to_decode: Vec::new(),
        acks: Vec::new(),
        stuck: [0; 2],
        quiet: 0,
        routed: Routed {
            counts: RouteCounts {
                requests: records.len() as u64,
                ..RouteCounts::default()
            },
            latency: Latency::new(records),
        },
    };
    loop {
        let submit = r.arrivals();
        let acks = std::mem::take(&mut r.acks);
        let mut handed = !submit.is_empty() || !acks.is_empty() || !r.to_decode.is_empty();
        let p = (prefill.tick(Tick {
            submit,
            acks,
            ..Tick::default()
        }))
        .await?;
        r.heard_prefill(&p)?;
        let submit = std::mem::take(&mut r.to_decode);
        let d = decode
            .tick(Tick {
                submit,
                ..Tick::default()
            })
            .await?;
        r.heard_decode(&d)?;
        handed |= !p.outputs.is_empty() || !d.outputs.is_empty();
        r.check_quiet(p.idle && d.idle && !handed)?;
        r.routed.counts.ticks += 1;
        progress(
            r.routed.counts.finished + r.routed.counts.refused,
            r.routed.counts.requests,
        );
        if r.done() && !p.busy && !d.busy && r.acks.is_empty() {
            return Ok(r.routed);
        }
        r.advance(
            p.busy || d.busy || !r.to_decode.is_empty() || !r.acks.is_empty(),
            c.step_ms,
        );
    }
}

impl Router<'_> {
    /// The requests arrived by now, for the prefill engine.
    fn arrivals(&mut self) -> Vec<Submit> {
        let mut out = Vec::new();
        while let Some(rec) = self.records.get(self.next)
            && rec.timestamp as f64 <= self.now_ms
        {
            let id = RequestId(self.next as u32);
            let prompt = workload::prompt_tokens(rec, self.hash_block, self.next as u64);
            out.push(Submit {
                id,
                prompt: prompt.clone(),
                max_tokens: 1,
                params: Some(PdParams::for_prefill()),
            });
            let max_tokens = rec.output_length.max(1);
            self.flight.insert(
                id,
                InFlight {
                    prompt,
                    max_tokens,
                    unacked: false,
                },
            );
            self.next += 1;
        }
        out
    }

    /// Prefill finishes go on to the decode engine, with the params they returned.
    fn heard_prefill(&mut self, t: &Ticked) -> Result<(), RunError> {
        self.check_stuck(0, t)?;
        self.refused(&t.refused);
        for o in t.outputs.iter().filter(|o| o.finish.is_some()) {
            let Some(f) = self.flight.get_mut(&o.id) else {
                continue;
            };
            if o.finish != Some(FinishReason::LengthCapped) {
                // Aborted or failed on the prefill engine: the client sees it end there.
                self.flight.remove(&o.id);
                self.routed.counts.finished += 1;
                continue;
            }
            let params = o.kv_transfer_params.clone();
            f.unacked = params.is_some();
            self.routed.counts.handed_off += u64::from(params.is_some());
            self.to_decode.push(Submit {
                id: o.id,
                prompt: std::mem::take(&mut f.prompt),
                max_tokens: f.max_tokens,
                params,
            });
        }
        Ok(())
    }

    /// Decode outputs: acknowledgements once a request read its KV, latencies, finishes.
    fn heard_decode(&mut self, t: &Ticked) -> Result<(), RunError> {
        self.check_stuck(1, t)?;
        self.refused(&t.refused);
        self.routed.latency.record(self.now_ms, &t.outputs);
        for o in &t.outputs {
            let Some(f) = self.flight.get_mut(&o.id) else {
                continue;
            };
            if f.unacked && (!o.new_tokens.is_empty() || o.finish.is_some()) {
                f.unacked = false;
                self.acks.push(o.id);
                self.routed.counts.acks_sent += 1;
            }
            if o.finish.is_some() {
                self.flight.remove(&o.id);
                self.routed.counts.finished += 1;
            }
        }
        Ok(())
    }

    fn refused(&mut self, refused: &[(RequestId, String)]) {
        for (id, why) in refused {
            tracing::warn!(request = id.0, why, "P/D: request refused");
            if self.flight.remove(id).is_some() {
                self.routed.counts.refused += 1;
            }
        }
    }

    /// An engine stuck for [`STUCK_TICKS`] ticks in a row stops the run.
    fn check_stuck(&mut self, which: usize, t: &Ticked) -> Result<(), RunError> {
        self.stuck[which] = match &t.stuck {
            Some(_) => self.stuck[which] + 1,
            None => 0,
        };
        match &t.stuck {
            Some(requests) if self.stuck[which] >= STUCK_TICKS => Err(RunError::Stalled {
                steps: u64::from(self.stuck[which]),
                requests: requests.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Both engines idle with requests in flight, for [`STUCK_TICKS`] ticks in a row: each
    /// waits on the other (a prefill engine holding blocks for acknowledgements that no
    /// decode-side progress can bring), and the run stops naming the requests in flight.
    fn check_quiet(&mut self, quiet: bool) -> Result<(), RunError> {
        self.quiet = if quiet && !self.flight.is_empty() {
            self.quiet + 1
        } else {
            0
        };
        if self.quiet < STUCK_TICKS {
            return Ok(());
        }
        let mut requests: Vec<RequestId> = self.flight.keys().copied().collect();
        requests.sort();
        Err(RunError::Stalled {
            steps: u64::from(self.quiet),
            requests,
        })
    }

    fn done(&self) -> bool {
        self.next == self.records.len() && self.flight.is_empty()
    }

    /// One step of virtual time; to the next arrival when nothing is going on.
    fn advance(&mut self, busy: bool, step_ms: f64) {
        self.now_ms += step_ms;
        if !busy
            && self.flight.is_empty()
            && let Some(rec) = self.records.get(self.next)
        {
            self.now_ms = self.now_ms.max(rec.timestamp as f64);
        }
    }
}
