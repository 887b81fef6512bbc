//! Many seeds ([`sweep()`]) and one long run ([`soak()`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvrelay_core::{Mode, RequestId, Token};
use serde::Serialize;

use super::world::SimTransport;
use super::{SimFailure, SimReport, TierSummary, disturb, on_paused_clock, shut_down, simulate};
use crate::mix::{FaultMix, SimRng};
use kvrelay_engine::RunConfig;
use kvrelay_engine::rank::Completions;

/// The runs of a sweep, summed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    /// Seeds run.
    pub runs: u64,
    /// Runs that ended quiescent (the others ended in the stop their faults call for).
    pub quiescent: u64,
    /// Engine steps, all runs.
    pub steps: u64,
    /// Requests, all runs.
    pub requests: u64,
    /// Faults survived, all runs: failed transfers, refused reports, aborts, resets, lost ranks.
    pub transfers_failed: u64,
    /// Duplicate or stale reports refused.
    pub reports_rejected: u64,
    /// Aborts.
    pub aborts: u64,
    /// Cache resets.
    pub resets: u64,
    /// Runs that lost a rank (and stopped cleanly, naming it).
    pub ranks_lost: u64,
    /// Runs that stopped on a failed transfer under compat (cleanly).
    pub compat_stops: u64,
    /// Runs with each fault kind in their mix.
    pub runs_with: std::collections::BTreeMap<&'static str, u64>,
    /// Invariant checks and verified blocks and slots, all runs.
    pub invariant_checks: u64,
    /// Loaded blocks and read token slots verified byte for byte, all runs.
    pub blocks_verified: u64,
    /// Runs with a shared tier, and what their tiers did.
    pub tier_runs: u64,
    pub tier: TierSummary,
    /// Seeds that failed.
    pub failures: Vec<SimFailure>,
}

impl SweepReport {
    fn add(&mut self, r: &SimReport) {
        self.runs += 1;
        self.quiescent += u64::from(r.ending == "quiescent");
        self.steps += r.steps;
        self.requests += r.requests;
        self.transfers_failed += r.transfers_failed;
        self.reports_rejected += r.reports_rejected;
        self.aborts += r.aborts;
        self.resets += r.resets;
        self.ranks_lost += u64::from(r.ending.ends_with("lost"));
        self.compat_stops += u64::from(r.ending.ends_with("under compat"));
        for k in r.faults.kinds() {
            *self.runs_with.entry(k).or_default() += 1;
        }
        self.invariant_checks += r.invariant_checks;
        self.blocks_verified += r.blocks_verified;
        if let Some(t) = &r.tier {
            self.tier_runs += 1;
            self.tier.add(t);
        }
    }

    /// How many times a fault of `kind` was injected and survived (runs for the per-run kinds).
    pub fn survived(&self, kind: &str) -> u64 {
        match kind {
            "transfer_fail" => self.transfers_failed,
            "report_duplicate" => self.reports_rejected,
            "abort" => self.aborts,
            "reset" => self.resets,
            "rank_lost" => self.ranks_lost,
            "tier_evict" => self.tier.injected.keys_evicted,
            "tier_torn" => self.tier.values_refused,
            "tier_away" => self.tier.timeouts,
            "tier_slow" => self.tier.injected.slow_answers,
            other => self.runs_with.get(other).copied().unwrap_or(0),
        }
    }
}

/// Runs every seed of `seeds` on `threads` threads; `progress` hears of each run (in seed order
/// per thread).
pub fn sweep(
    seeds: std::ops::Range<u64>,
    threads: usize,
    progress: &mut (dyn FnMut(&Result<SimReport, SimFailure>) + Send),
) -> SweepReport {
    let next = std::sync::atomic::AtomicU64::new(seeds.start);
    let results = Mutex::new(Vec::new());
    let progress = Mutex::new(progress);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end {
                        return;
                    }
                    let out = simulate(seed);
                    (progress.lock().unwrap_or_else(|p| p.into_inner()))(&out);
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(out);
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|r| match r {
        Ok(r) => r.seed,
        Err(f) => f.seed,
    });
    let mut out = SweepReport::default();
    for r in results {
        match r {
            Ok(r) => out.add(&r),
            Err(f) => {
                out.runs += 1;
                out.failures.push(f);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Soak.

/// One long simulated run: resident memory as it goes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SoakReport {
    /// The seed.
    pub seed: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Requests submitted (their ids reused once released).
    pub requests: u64,
    /// The highest request id used (ids are reused: it stays near the live count).
    pub max_request_id: u32,
    /// Faults survived.
    pub transfers_failed: u64,
    /// Duplicate or stale reports refused.
    pub reports_rejected: u64,
    /// Aborts and cache resets.
    pub aborts: u64,
    /// Cache resets.
    pub resets: u64,
    /// `(step, resident KiB)` samples.
    pub rss_kib: Vec<(u64, u64)>,
}

impl SoakReport {
    /// Resident memory at the last sample over that at `step` (e.g. 100,000 over 10,000).
    pub fn growth_since(&self, step: u64) -> Option<f64> {
        let at = self.rss_kib.iter().find(|(s, _)| *s >= step)?.1;
        let last = self.rss_kib.last()?.1;
        (at > 0).then(|| last as f64 / at as f64)
    }
}

/// Resident memory of this process, in KiB (Linux; 0 elsewhere).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// A soak: `steps` engine steps of seed 1's fault mix without the lost rank (strict, 2 ranks),
/// requests arriving as others finish so that 8 are live, ids reused once released; resident
/// memory sampled every `sample_every` steps.
pub fn soak(
    seed: u64,
    steps: u64,
    sample_every: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<SoakReport, SimFailure> {
    on_paused_clock(seed, soak_run(seed, steps, sample_every.max(1), progress))
}

async fn soak_run(
    seed: u64,
    steps: u64,
    sample_every: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<SoakReport, String> {
    // No tier: the store keeps every chunk ever stored (no capacity), so it would grow.
    let faults = FaultMix {
        rank_lost: false,
        tier: false,
        ..FaultMix::every()
    };
    let mut r = SimRng::new(seed);
    let config = RunConfig {
        seed,
        ranks: 2,
        layers: 2,
        block_size: 4,
        block_bytes: Some(32),
        gpu_blocks: Some(48),
        cpu_blocks: Some(64),
        mode: Mode::Strict,
        max_num_seqs: Some(6),
        max_num_batched_tokens: Some(64),
        check: true,
        // The simulated transfer engine decides when each copy finishes.
        completions: Completions::AsArrived,
        ..RunConfig::default()
    };
    let transport = SimTransport {
        faults,
        calm: Arc::new(AtomicBool::new(false)),
        lost: None,
        corrupt_first_load: false,
        seed: r.next_u64(),
        store: None,
    };
    let mut engine = transport.start(&config).await?;
    let mut report = SoakReport {
        seed,
        ..SoakReport::default()
    };
    let prefixes: Vec<Vec<Token>> = (0..4)
        .map(|p| (0..16).map(|i| p * 1000 + i).collect())
        .collect();
    let mut live: Vec<RequestId> = Vec::new();
    let mut free: Vec<RequestId> = Vec::new();
    let mut next_id = 0u32;
    for step in 0..steps {
        while live.len() < 8 {
            let id = free.pop().unwrap_or_else(|| {
                next_id += 1;
                RequestId(next_id - 1)
            });
            let mut prompt = prefixes[r.range(0, 3) as usize].clone();
            prompt
                .extend((0..r.range(1, 40)).map(|j| (100_000 + j + 50 * report.requests) as Token));
            engine
                .add(id, prompt, r.range(1, 16) as u32)
                .map_err(|e| format!("step {step}: add: {e}"))?;
            live.push(id);
            report.requests += 1;
        }
        let (aborts, resets) = (&mut report.aborts, &mut report.resets);
        disturb(&mut engine, &mut r, &faults, &live, aborts, resets)?;
        let o = engine
            .step()
            .await
            .map_err(|e| format!("step {step}: {e}"))?;
        for out in &o.outputs {
            if out.finish.is_some() {
                live.retain(|&id| id != out.id);
            }
        }
        // An aborted request leaves `live` once the engine no longer holds it.
        live.retain(|id| !o.released.contains(id));
        free.extend(o.released.iter().copied());
        if o.idle {
            engine.wait_idle().await;
        }
        report.steps = step + 1;
        if report.steps.is_multiple_of(sample_every) {
            report.rss_kib.push((report.steps, rss_kib()));
            progress(report.steps);
        }
    }
    report.max_request_id = next_id.saturating_sub(1);
    let (figures, ranks) = shut_down(engine).await?;
    report.reports_rejected = figures.reports_rejected;
    report.transfers_failed = ranks.iter().map(|r| r.failed_transfers).sum();
    Ok(report)
}
