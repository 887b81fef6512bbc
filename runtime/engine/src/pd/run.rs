//! `kvrelay pd` as a library: a prefill and a decode engine process of one configuration, the
//! router between them ([`run_processes`]), and what they did ([`PdReport`]: readable, or JSON).

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::process::EngineProcess;
use super::route::{EngineSummary, PdLink, RouteCounts, Routed, route};
use super::{PdRole, PdRunConfig, Source};
use crate::report::bytes;
use crate::workload::TraceRecord;
use crate::{RunConfig, RunError};

/// What a P/D run did, end to end and per engine.
#[derive(Clone, Debug, Serialize)]
pub struct PdReport {
    #[serde(flatten)]
    pub counts: RouteCounts,
    /// On the virtual clock, from each request's arrival to its first token on the decode
    /// engine (the prefill engine's one token is not the client's).
    pub ttft_ms_median: f64,
    pub ttft_ms_p99: f64,
    pub tpot_ms_median: f64,
    pub wall_s: f64,
    pub ranks: u32,
    pub prefill: EngineSummary,
    pub decode: EngineSummary,
}

/// The configurations of the two engines of `c`: the prefill engine (id 0) with `lease_steps`
/// (strict only) and a KV server on loopback, the decode engine (id 1) reading from
/// `source_addr` within `deadline_ms`.
pub fn pair_configs(
    c: &RunConfig,
    lease_steps: Option<u32>,
    source_addr: &str,
    deadline_ms: u64,
) -> (RunConfig, RunConfig) {
    let side = |role, engine, source| RunConfig {
        pd: Some(PdRunConfig {
            role,
            engine,
            lease_steps,
            listen: "127.0.0.1:0".into(),
            source,
        }),
        ..c.clone()
    };
    let source = Source {
        addr: source_addr.to_owned(),
        deadline_ms,
    };
    (
        side(PdRole::Prefill, 0, None),
        side(PdRole::Decode, 1, Some(source)),
    )
}

/// Starts both engine processes (`exe`: see [`EngineProcess::spawn`]), routes `records`
/// through them and stops them; `progress` hears `(done, total)` after every tick.
pub async fn run_processes(
    c: &RunConfig,
    records: &[TraceRecord],
    exe: Option<&Path>,
    lease_steps: Option<u32>,
    deadline_ms: u64,
    progress: impl FnMut(u64, u64),
) -> Result<PdReport, RunError> {
    check(c, lease_steps)?;
    let started = Instant::now();
    let max_len = c
        .max_model_len
        .unwrap_or_else(|| crate::run::longest(records));
    let (p, _) = pair_configs(c, lease_steps, "", deadline_ms);
    let (mut prefill, addr) = EngineProcess::spawn("prefill", exe, &p, max_len).await?;
    let addr = addr.ok_or_else(|| RunError::EngineProcess {
        engine: "prefill".into(),
        why: "started without a KV server".into(),
    })?;
    let (_, d) = pair_configs(c, lease_steps, &addr, deadline_ms);
    let (mut decode, _) = EngineProcess::spawn("decode", exe, &d, max_len).await?;
    let routed = route(c, records, &mut prefill, &mut decode, progress).await?;
    let prefill = prefill.finish().await?;
    let decode = decode.finish().await?;
    Ok(PdReport::new(
        c,
        &routed,
        prefill,
        decode,
        started.elapsed(),
    ))
}

/// What a pair refuses before any process starts (the engines check the rest).
fn check(c: &RunConfig, lease_steps: Option<u32>) -> Result<(), RunError> {
    let why = if lease_steps.is_some() && c.mode != kvrelay_core::Mode::Strict {
        Some("a lease (--lease-steps) is strict mode's departure: add --mode strict")
    } else {
        c.pd_unsupported(c.backend)
    };
    match why {
        Some(why) => Err(RunError::Config(why.into())),
        None => Ok(()),
    }
}

impl PdReport {
    /// The report of a routed run.
    pub fn new(
        c: &RunConfig,
        r: &Routed,
        prefill: EngineSummary,
        decode: EngineSummary,
        wall: Duration,
    ) -> Self {
        let l = r.latency.figures();
        Self {
            counts: r.counts.clone(),
            ttft_ms_median: l.ttft_ms_median,
            ttft_ms_p99: l.ttft_ms_p99,
            tpot_ms_median: l.tpot_ms_median,
            wall_s: wall.as_secs_f64(),
            ranks: c.ranks,
            prefill,
            decode,
        }
    }

    /// Every request finished (or was refused at submit) and neither engine left anything
    /// behind.
    pub fn clean(&self) -> bool {
        let n = &self.counts;
        n.finished + n.refused == n.requests
            && self.prefill.leaks.is_empty()
            && self.decode.leaks.is_empty()
    }

    /// The readable report, one figure per line.
    pub fn text(&self) -> String {
        let (p, d, n) = (&self.prefill, &self.decode, &self.counts);
        let mut out = String::new();
        let mut line = |label: &str, text: String| out += &format!("{label:<16}{text}\n");
        line(
            "requests",
            format!(
                "{} submitted, {} finished, {} refused (a prefill and a decode engine process, {} ranks each, {:.1} s)",
                n.requests, n.finished, n.refused, self.ranks, self.wall_s
            ),
        );
        line(
            "handoff",
            format!(
                "{} handed off with params, {} remote loads, {} acknowledged, {} leases expired, {} late acks",
                n.handed_off, d.pd.remote_loads, p.pd.acks, p.pd.leases_expired, p.pd.late_acks
            ),
        );
        line(
            "kv moved",
            format!(
                "{} blocks ({}) in {} reads, prefill to decode; {} reads of released requests refused",
                d.remote_blocks_loaded,
                bytes(d.remote_bytes_loaded),
                p.served_reads,
                p.served_gone
            ),
        );
        line(
            "verified",
            format!(
                "{} loaded blocks at landing ({} read from the prefill engine, {} from the CPU pool), {} blocks at their first read; {} failed loads recomputed",
                d.loaded_blocks_verified,
                d.remote_blocks_loaded,
                d.blocks_loaded.saturating_sub(d.remote_blocks_loaded),
                d.read_blocks_checked,
                d.failed_loads
            ),
        );
        line("prefill engine", engine_line(p));
        line("decode engine", engine_line(d));
        for (name, e) in [("prefill tier", p), ("decode tier", d)] {
            if let Some(t) = &e.tier {
                line(name, tier_line(t));
            }
        }
        line(
            "latency",
            format!(
                "{:.0} ms to first token median, {:.0} ms p99; {:.1} ms per output token median (virtual clock)",
                self.ttft_ms_median, self.ttft_ms_p99, self.tpot_ms_median
            ),
        );
        let leaks: Vec<String> = (p.leaks.iter().map(|l| format!("prefill: {l}")))
            .chain(d.leaks.iter().map(|l| format!("decode: {l}")))
            .collect();
        line(
            "left behind",
            if leaks.is_empty() {
                "nothing".into()
            } else {
                leaks.join("; ")
            },
        );
        out
    }
}

fn engine_line(e: &EngineSummary) -> String {
    format!(
        "{} steps, {} tokens computed, {} reused at admission (prefix hits and loads), {} preemptions",
        e.steps, e.tokens_computed, e.prefix_hit_tokens, e.preemptions
    )
}

fn tier_line(t: &crate::tier::TierFigures) -> String {
    format!(
        "{} blocks stored ({}), {} loaded ({}); {} store and {} load failures",
        t.blocks_stored,
        bytes(t.bytes_stored),
        t.blocks_loaded,
        bytes(t.bytes_loaded),
        t.store_failures,
        t.load_failures
    )
}
