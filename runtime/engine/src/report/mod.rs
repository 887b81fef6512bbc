//! The figures of a run: [`Report`], built from the engine's and ranks' figures (`build`),
//! printed for people (`Display`, in `text.rs`) or as JSON (`--json`, its serde form); the
//! run's Perfetto timeline ([`perfetto`]); bounded per-step samples ([`samples`]); requests'
//! times on the virtual clock (`latency`).

mod latency;
pub mod perfetto;
pub mod samples;
mod text;

use std::time::Duration;

use serde::Serialize;

use crate::RunConfig;
use crate::engine::Figures;
use crate::metrics::{Metrics, Total};
use crate::rank::RankStats;
use crate::workload::TraceRecord;

pub use self::latency::{Latency, LatencyFigures};
pub use self::text::bytes;

/// What a run did. Every figure is counted by the run itself; none is estimated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The seed of the workload and the sampled tokens.
    pub seed: u64,
    /// Ranks.
    pub ranks: u32,
    /// Where the KV lived: `host` or `cuda`.
    pub backend: crate::Backend,
    /// Requests submitted.
    pub requests: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests refused at submit: a prompt of `max_model_len` tokens or more.
    pub refused: u64,
    /// The longest request admitted (prompt and output tokens).
    pub max_model_len: u32,
    /// GPU blocks per rank (the null block included) and CPU blocks per rank, as resolved.
    pub gpu_blocks: u32,
    pub cpu_blocks: u32,
    /// Prompt tokens submitted.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Engine steps, and those that were idle.
    pub steps: u64,
    /// Idle engine steps (nothing scheduled or reported: waiting for a transfer).
    pub idle_steps: u64,
    /// Steps scheduled while the ranks ran the previous one (`--async-depth 2`).
    pub scheduled_ahead: u64,
    /// Requests preempted (their blocks freed, recomputed or loaded later).
    pub preemptions: u64,
    /// Prompt tokens a request did not compute when first scheduled: GPU prefix hits plus
    /// tokens loaded from the CPU pool.
    pub reused_tokens: u64,
    /// What an unbounded cache of the workload's hash blocks would reuse, in % of prompt
    /// tokens: the most any pool could from the run's own requests
    /// ([`crate::workload::unbounded_reuse`]); a shared tier other engines filled gives more.
    pub reuse_bound_pct: f64,
    /// Of those, tokens found in the GPU prefix cache.
    pub gpu_prefix_hit_tokens: u64,
    /// Tokens loaded from the CPU pool.
    pub cpu_loaded_tokens: u64,
    /// Tokens the forward passes computed (prefill, recomputation after preemption, decode).
    pub tokens_computed: u64,
    /// Blocks stored to the CPU pool, over all ranks.
    pub blocks_offloaded: u64,
    /// Blocks loaded from the CPU pool, over all ranks.
    pub blocks_loaded: u64,
    /// Bytes stored to the CPU pool, over all ranks.
    pub bytes_stored: u64,
    /// Bytes loaded from the CPU pool, over all ranks.
    pub bytes_loaded: u64,
    /// Store throughput of the copy threads, GB/s (bytes / time copying).
    pub store_gb_per_s: f64,
    /// Load throughput of the copy threads, GB/s.
    pub load_gb_per_s: f64,
    /// Copies performed for all transfers (runs of contiguous blocks coalesced).
    pub copies: u64,
    /// Stores waited for in `handle_preemptions` before their blocks were reused.
    pub flushed_stores: u64,
    /// Loaded blocks checked byte for byte when their load completed.
    pub loaded_blocks_verified: u64,
    /// Token slots (per layer) whose bytes were checked right after a forward wrote them.
    pub written_slots_verified: u64,
    /// Blocks checked when a request first read them (against its tokens; bytes were
    /// checked when written or loaded, and cannot change while a request trusts them).
    pub read_blocks_checked: u64,
    /// Time to first token on the virtual clock (from the request's trace timestamp to the end
    /// of the step that produced its first token; `step_ms` per step): median over the
    /// requests that produced one, ms. The same on every run for a seed.
    pub ttft_ms_median: f64,
    /// The same, 99th percentile.
    pub ttft_ms_p99: f64,
    /// Time per output token after the first, on the virtual clock: median over the requests
    /// that finished with two tokens or more, ms.
    pub tpot_ms_median: f64,
    /// Engine-side time per step (schedule, rank outputs, apply): median, µs.
    pub core_step_us_median: f64,
    /// The same, 99th percentile.
    pub core_step_us_p99: f64,
    /// Rank-side connector overhead per step and rank: time in the rank driver and the worker
    /// connector's hooks (no forward pass, no copies): median, µs.
    pub rank_hooks_us_median: f64,
    /// The same, 99th percentile.
    pub rank_hooks_us_p99: f64,
    /// Whether every machine's invariants were checked after every step (`--check`); they held
    /// if the run finished.
    pub invariants_checked: bool,
    /// Invariant checks performed (engine and ranks).
    pub invariant_checks: u64,
    /// What the KV-event publisher did (`--kv-events`; absent without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<crate::events::PublisherStats>,
    /// What the shared tier did (`--tier`; absent without it).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierSummary>,
    /// Wall-clock seconds.
    pub wall_s: f64,
}

/// The shared tier's figures, as the report names them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TierSummary {
    /// Existence probes answered, and how many found the chunk (tier hits).
    pub tier_probes: u64,
    pub tier_hits: u64,
    /// Chunks cascaded to the tier: blocks and bytes over every rank's shard.
    pub tier_blocks_stored: u64,
    pub tier_bytes_stored: u64,
    /// Promotions (one job per request and step) and what they loaded into the CPU pools.
    pub tier_promotions: u64,
    pub tier_blocks_loaded: u64,
    pub tier_bytes_loaded: u64,
    /// Chunks a cascade could not write, or a promotion could not read (recomputed).
    pub tier_store_failures: u64,
    pub tier_load_failures: u64,
    /// Why: absent at load, refused by the header check, store errors, past the deadline.
    pub tier_values_missing: u64,
    pub tier_values_refused: u64,
    pub tier_io_errors: u64,
    pub tier_timeouts: u64,
    /// Connections opened since one was lost (a Redis Cluster after a failover).
    pub tier_reconnects: u64,
    /// The first store error of the run, as the store said it (`None`: none).
    pub tier_first_error: Option<String>,
    /// Wall time of a step's tier IO (every command of the step, concurrently): µs.
    pub tier_batch_us_median: f64,
    pub tier_batch_us_p99: f64,
}

impl TierSummary {
    fn of(t: &crate::tier::TierFigures) -> Self {
        let mut us = t.batch_us.values().to_vec();
        us.sort_by(f64::total_cmp);
        Self {
            tier_probes: t.probes,
            tier_hits: t.probes_found,
            tier_blocks_stored: t.blocks_stored,
            tier_bytes_stored: t.bytes_stored,
            tier_promotions: t.load_jobs,
            tier_blocks_loaded: t.blocks_loaded,
            tier_bytes_loaded: t.bytes_loaded,
            tier_store_failures: t.store_failures,
            tier_load_failures: t.load_failures,
            tier_values_missing: t.values_missing,
            tier_values_refused: t.values_refused,
            tier_io_errors: t.io_errors,
            tier_timeouts: t.timeouts,
            tier_reconnects: t.reconnects,
            tier_first_error: t.first_error.clone(),
            tier_batch_us_median: quantile(&us, 0.5),
            tier_batch_us_p99: quantile(&us, 0.99),
        }
    }
}

/// The ranks' figures summed (per-request loaded tokens are read from rank 0 alone).
fn sum_ranks(ranks: &[RankStats]) -> RankStats {
    let mut s = RankStats::default();
    for r in ranks {
        s.blocks_stored += r.blocks_stored;
        s.blocks_loaded += r.blocks_loaded;
        s.bytes_stored += r.bytes_stored;
        s.bytes_loaded += r.bytes_loaded;
        s.store_time += r.store_time;
        s.load_time += r.load_time;
        s.copies += r.copies;
        s.loaded_blocks_verified += r.loaded_blocks_verified;
        s.written_slots_verified += r.written_slots_verified;
        s.read_blocks_checked += r.read_blocks_checked;
        s.flushed_stores += r.flushed_stores;
        s.invariant_checks += r.invariant_checks;
        s.hook_us.absorb(&r.hook_us);
    }
    s
}

/// Raises the rank-side metrics to the ranks' final figures when the run ends. The ranks sent
/// them step by step (see [`crate::metrics`]), so nothing should be left: what was is returned
/// and said in a warning.
pub fn publish_ranks(m: &Metrics, ranks: &[RankStats]) -> Vec<(Total, u64)> {
    let mut total = crate::rank::RankDelta::default();
    for r in ranks {
        total.add(r);
    }
    let left = m.ranks(&total);
    if !left.is_empty() {
        tracing::warn!(?left, "metrics: rank figures that no step's report carried");
    }
    left
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

fn gb_per_s(bytes: u64, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        bytes as f64 / t.as_secs_f64() / 1e9
    }
}

/// The report of a run of `records` on `c`: the engine's figures `f`, the ranks' `ranks`, the
/// request times `latency`, the wall time `wall`.
pub fn build(
    c: &RunConfig,
    records: &[TraceRecord],
    f: &Figures,
    ranks: &[RankStats],
    latency: &Latency,
    wall: Duration,
) -> Report {
    let s = sum_ranks(ranks);
    let times = latency.figures();
    let mut us = f.core_us.values().to_vec();
    us.sort_by(f64::total_cmp);
    let mut hooks: Vec<f64> = s.hook_us.values().iter().map(|&x| f64::from(x)).collect();
    hooks.sort_by(f64::total_cmp);
    // Rank 0 counts the tokens loaded per request; a request's GPU hit is what it reused
    // beyond them.
    let loaded0 = ranks.first().map(|r| &r.loaded_tokens);
    let mut gpu_hits = 0u64;
    let mut cpu_loaded = 0u64;
    for (id, &n) in &f.reused {
        let l = loaded0.and_then(|m| m.get(id)).copied().unwrap_or(0);
        cpu_loaded += u64::from(l.min(n));
        gpu_hits += u64::from(n.saturating_sub(l));
    }
    Report {
        seed: c.seed,
        ranks: c.ranks,
        backend: f.backend,
        requests: records.len() as u64,
        finished: f.finished,
        refused: f.refused,
        max_model_len: f.max_model_len,
        gpu_blocks: f.gpu_blocks,
        cpu_blocks: f.cpu_blocks,
        prompt_tokens: f.prompt_tokens,
        generated_tokens: f.generated_tokens,
        steps: f.steps,
        idle_steps: f.idle_steps,
        scheduled_ahead: f.scheduled_ahead,
        preemptions: f.preemptions,
        reused_tokens: f.reused_tokens,
        reuse_bound_pct: crate::workload::unbounded_reuse(records, c.hash_block()).token_pct(),
        gpu_prefix_hit_tokens: gpu_hits,
        cpu_loaded_tokens: cpu_loaded,
        tokens_computed: f.tokens_computed,
        blocks_offloaded: s.blocks_stored,
        blocks_loaded: s.blocks_loaded,
        bytes_stored: s.bytes_stored,
        bytes_loaded: s.bytes_loaded,
        store_gb_per_s: gb_per_s(s.bytes_stored, s.store_time),
        load_gb_per_s: gb_per_s(s.bytes_loaded, s.load_time),
        copies: s.copies,
        flushed_stores: s.flushed_stores,
        loaded_blocks_verified: s.loaded_blocks_verified,
        written_slots_verified: s.written_slots_verified,
        read_blocks_checked: s.read_blocks_checked,
        ttft_ms_median: times.ttft_ms_median,
        ttft_ms_p99: times.ttft_ms_p99,
        tpot_ms_median: times.tpot_ms_median,
        core_step_us_median: quantile(&us, 0.5),
        core_step_us_p99: quantile(&us, 0.99),
        rank_hooks_us_median: quantile(&hooks, 0.5),
        rank_hooks_us_p99: quantile(&hooks, 0.99),
        invariants_checked: c.check,
        invariant_checks: f.invariant_checks + s.invariant_checks,
        kv_events: f.kv_events,
        tier: f.tier.as_ref().map(TierSummary::of),
        wall_s: wall.as_secs_f64(),
    }
}
