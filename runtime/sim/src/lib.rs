//! kvrelay-sim: deterministic simulation of the engine with injected faults (TigerBeetle's VOPR,
//! FoundationDB's simulation): the real [`Engine`], rank tasks, rank drivers, offloading connector,
//! shared tier and content checks, with the engine's seams (`kvrelay_engine::transport`'s
//! `Transport` and `Clock`, `kvrelay_engine::transfer`'s `TransferEngine`, the tier's
//! `StoreBackend`) replaced, and every choice drawn from one seed.
//!
//! # What is simulated
//!
//! * **Time**: a current-thread tokio runtime with a paused clock. Every wait (the engine's idle
//!   wait and rank check, a transfer's duration, a frame's delay) is virtual: a run of minutes of
//!   simulated time takes milliseconds, and the interleaving depends on the seed only.
//! * **Transfers** (`world::SimTransferEngine`): one queue per rank, completed in the order started (as
//!   vLLM's worker runs them). A transfer's bytes move when it *completes*, not when it starts, so
//!   a block rewritten under an in-flight store, or read before its load completed, shows as
//!   wrong bytes. Faults: a transfer fails part-way (its destination is garbage; the rank tells
//!   the core `ok: false`), or is slow.
//! * **Frames** (`world::SimTransport`): ranks are tasks of this process, but every step frame and
//!   every report goes through a relay that may delay it (a slow rank; reports of different ranks
//!   reordered) or duplicate it (the engine must refuse the copy). One rank may be lost: it stops
//!   answering after a drawn step (the engine must say which rank, and stop without hanging).
//! * **Inputs**: requests (shared prefixes, preemption under a small GPU pool), aborts at any
//!   step, cache resets with jobs in flight.
//! * **The shared tier** (`tier::SimStore`, one seed in [`TIER_SHARE`], seed 1 too): the
//!   engine's real tier (cascades, probes, promotions, values checked by header and CRC on
//!   every read) over a simulated store on three nodes, each command's deadline 20 ms. Faults:
//!   any key vanishes at any moment (also between probe and load), a write lands truncated or
//!   torn (the reader must refuse it: a failed load), a node goes away for one to three
//!   deadlines (timeouts; then it answers again), slow answers within the deadline. The CPU
//!   pool (ARC under compat) is small enough that chunks leave it and come back as promotions; once the first
//!   engine is quiescent, a second engine (empty CPU pool, no lost rank) runs some of its
//!   prompts over the same store and promotes what the first stored.
//!
//! After every step every machine's `check_invariants()` runs (`check`); every load and every
//! forward write is verified byte for byte, and every block a request reads is checked the first
//! time it reads it and guarded while it trusts it (always on in the rank). After the fault phase, a
//! quiescence phase with every fault off must finish every request and leave nothing behind
//! ([`Engine::leaks`]: no tier batch, tier job or promotion either). A run that ends otherwise —
//! an unexpected error, a hang, a leak — fails with the seed that replays it:
//! `KVRELAY_SEED=<seed> kvrelay sim`.
//!
//! Which seeds: seed 0 is fault-free, seed 1 has every fault kind, every other seed draws its own
//! mix ([`FaultMix::for_seed`]).

//! # Rooms
//!
//! * this file — the fault mix, one seed's run ([`simulate`]) and what it reports;
//! * `world` — the simulated seams: the transport with its faulty relays, the transfer engine;
//! * `tier` — the simulated store of the shared tier, and the tier's figures of a run;
//! * `sweep` — many seeds ([`sweep()`]), and one long soak run ([`soak()`]).
//!
//! `kvrelay sim` (the command line, in `kvrelay-cli`) runs these.

pub mod faults;
mod mix;
mod sweep;
pub mod tamper;
mod tier;
mod world;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvrelay_core::{Mode, RankError, RequestId, Token, WorkerError};
use serde::Serialize;

use self::mix::SimRng;
pub use self::mix::{FaultMix, TIER_SHARE};
pub use self::sweep::{SoakReport, SweepReport, soak, sweep};
use self::tier::SimStore;
pub use self::tier::{StoreFaults, TierSummary};
use self::world::SimTransport;
use kvrelay_engine::content::mix;
use kvrelay_engine::engine::{Engine, Figures, StepOutcome};
use kvrelay_engine::rank::{Completions, RankStats};
use kvrelay_engine::tier::TierConfig;
use kvrelay_engine::{RunConfig, RunError};

/// Steps of the fault phase at most (arrivals come within it).
const FAULT_STEPS: u64 = 400;
/// Steps the quiescence phase may take before the run counts as hung.
const QUIESCE_STEPS: u64 = 3_000;
/// Virtual time a shutdown may take before the run counts as hung.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(60);

/// What a simulated run did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// `compat` or `strict`.
    pub mode: &'static str,
    /// The CPU pool's eviction policy: `lru` or `arc`.
    pub policy: &'static str,
    /// Ranks.
    pub ranks: u32,
    /// Async scheduling depth.
    pub async_depth: u32,
    /// The faults injected.
    pub faults: FaultMix,
    /// What the shared tier did (`None`: the run has none).
    pub tier: Option<TierSummary>,
    /// Engine steps.
    pub steps: u64,
    /// Requests submitted.
    pub requests: u64,
    /// Requests that finished (aborted ones included).
    pub finished: u64,
    /// Aborts issued (of live requests).
    pub aborts: u64,
    /// Cache resets issued.
    pub resets: u64,
    /// Transfers failed by the simulation (all ranks).
    pub transfers_failed: u64,
    /// Duplicate or stale reports the engine refused.
    pub reports_rejected: u64,
    /// Every machine's invariants were checked after every step (engine and ranks).
    pub invariant_checks: u64,
    /// Loaded blocks, written token slots and first reads of blocks checked.
    pub blocks_verified: u64,
    /// How the run ended: `quiescent` (every request finished, nothing left behind), or the
    /// expected stop (`rank N lost`, `transfer failed under compat`).
    pub ending: String,
    /// A digest of everything the run produced (steps, tokens, finishes): equal for equal
    /// seeds.
    pub digest: u64,
}

/// Why a simulated run failed. Its display names the seed and the command that replays it.
#[derive(Clone, Debug, PartialEq, Serialize, thiserror::Error)]
#[error("seed {seed}: {why} (replay: KVRELAY_SEED={seed} kvrelay sim)")]
pub struct SimFailure {
    /// The seed.
    pub seed: u64,
    /// What went wrong.
    pub why: String,
}

/// Test-only switches of a run (to show that the simulation's checks can fail).
#[derive(Clone, Copy, Debug, Default)]
pub struct SimOptions {
    /// The first load reads a corrupted host slot: the run must fail with a byte mismatch.
    pub corrupt_first_load: bool,
}

/// Runs seed `seed` to its end: the run's report, or why it failed.
pub fn simulate(seed: u64) -> Result<SimReport, SimFailure> {
    simulate_with(seed, SimOptions::default())
}

/// [`simulate`] with test-only switches.
pub fn simulate_with(seed: u64, options: SimOptions) -> Result<SimReport, SimFailure> {
    on_paused_clock(seed, run_seed(seed, options))
}

/// Runs `run` (seed `seed`'s) to its end on a current-thread runtime whose clock is paused, so
/// that every wait is virtual and the interleaving depends on the seed only.
fn on_paused_clock<T>(
    seed: u64,
    run: impl Future<Output = Result<T, String>>,
) -> Result<T, SimFailure> {
    let fail = |why: String| SimFailure { seed, why };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| fail(format!("tokio runtime: {e}")))?;
    rt.block_on(run).map_err(fail)
}

/// Between two steps, with the fault phase on: aborts a random live request with probability
/// `faults.abort`, then resets the connector's cache with probability `faults.reset`; counts
/// what it did.
fn disturb(
    engine: &mut Engine,
    r: &mut SimRng,
    faults: &FaultMix,
    live: &[RequestId],
    aborts: &mut u64,
    resets: &mut u64,
) -> Result<(), String> {
    if !live.is_empty() && r.chance(faults.abort) {
        let id = live[r.range(0, live.len() as u64 - 1) as usize];
        if engine.abort(id).map_err(|e| format!("abort: {e}"))? {
            *aborts += 1;
        }
    }
    if r.chance(faults.reset) {
        engine.reset_cache().map_err(|e| format!("reset: {e}"))?;
        *resets += 1;
    }
    Ok(())
}

/// Stops the engine's ranks, within [`SHUTDOWN_LIMIT`] of virtual time (else the run hung).
async fn shut_down(engine: Engine) -> Result<(Figures, Vec<RankStats>), String> {
    tokio::time::timeout(SHUTDOWN_LIMIT, engine.shutdown())
        .await
        .map_err(|_| "the ranks did not stop within a minute (virtual) of shutdown".to_owned())
}

/// With a shared tier in compat, the CPU pool holds at least this many (one-block) chunks: the
/// longest request (`MAX_MODEL_LEN` tokens, 24 blocks) and a few more. In a smaller pool, a
/// request whose chunks outnumber the pool promotes them for ever, each promotion evicting the
/// last (vLLM's livelock, `docs/TIERING.md`). Strict holds a promoted chunk for its request
/// (`TieringConfig::hold_promoted`), so its tier seeds draw pools below that too.
const TIER_CPU_BLOCKS: u32 = 28;

/// A strict second engine's CPU pool, every other seed: far fewer chunks than its requests wait
/// for at once, so that holds, and promotions that find no room, run under the faults.
const SECOND_STRICT_CPU_BLOCKS: u32 = 16;

/// The second engine's CPU pool: every chunk its requests (`second_arrivals`) may wait for at
/// once, so that all of them can be promoted together (its pool starts empty: every hit is a
/// promotion). Another pool size than the first engine's keeps the key namespace.
const SECOND_CPU_BLOCKS: u32 = 8 * 24 + 32;

/// The run's shape, drawn from the seed.
fn config_for(seed: u64, r: &mut SimRng, faults: &FaultMix) -> RunConfig {
    let block_size = 4;
    let config = RunConfig {
        seed,
        ranks: r.range(1, 3) as u32,
        layers: r.range(1, 2) as u32,
        block_size,
        block_bytes: Some(8 * u64::from(block_size) * r.range(1, 2)),
        gpu_blocks: Some(r.range(28, 48) as u32),
        cpu_blocks: Some(r.range(16, 64) as u32),
        blocks_per_chunk: 1,
        policy: if r.chance(0.5) {
            kvrelay_core::PolicyKind::Lru
        } else {
            kvrelay_core::PolicyKind::Arc
        },
        // Failures are absorbed under strict; compat stops on the first (a quarter of the
        // seeds that fail transfers check that it does, cleanly).
        mode: if faults.transfer_fail > 0.0 && r.chance(0.25) {
            Mode::Compat
        } else {
            Mode::Strict
        },
        max_num_seqs: Some(r.range(3, 8) as u32),
        max_num_batched_tokens: Some(r.range(24, 96) as u32),
        async_depth: r.range(1, 2) as u32,
        check: true,
        // The simulated transfer engine decides when each copy finishes.
        completions: Completions::AsArrived,
        // The store is the simulation's (`SimTransport::start` puts it in).
        tier: faults.tier.then(|| TierConfig {
            endpoints: vec!["memory".to_owned()],
            timeout_ms: tier::DEADLINE_MS,
            ..TierConfig::default()
        }),
        ..RunConfig::default()
    };
    if !faults.tier || config.mode != Mode::Compat {
        return config;
    }
    // A compat tier seed uses ARC: under vLLM's LRU, an old request's promotions evict each
    // other for ever (`docs/TIERING.md`); strict ranks a landed promotion most recent.
    RunConfig {
        cpu_blocks: config.cpu_blocks.map(|n| n.max(TIER_CPU_BLOCKS)),
        policy: kvrelay_core::PolicyKind::Arc,
        ..config
    }
}

/// One request of the generated input: when it arrives, its prompt, its output length.
struct Arrival {
    step: u64,
    prompt: Vec<Token>,
    max_tokens: u32,
}

/// Requests sharing a few prefixes (prefix-cache and offload hits), arriving over the first
/// steps.
fn arrivals(r: &mut SimRng) -> Vec<Arrival> {
    let prefixes: Vec<Vec<Token>> = (0..r.range(1, 3))
        .map(|p| {
            (0..r.range(4, 24))
                .map(|i| (p * 1000 + i) as Token)
                .collect()
        })
        .collect();
    let n = r.range(4, 40);
    let mut out: Vec<Arrival> = (0..n)
        .map(|i| {
            let mut prompt = prefixes[r.range(0, prefixes.len() as u64 - 1) as usize].clone();
            prompt.extend((0..r.range(1, 48)).map(|j| (100_000 + i * 100 + j) as Token));
            Arrival {
                step: r.range(0, 200),
                prompt,
                max_tokens: r.range(1, 24) as u32,
            }
        })
        .collect();
    out.sort_by_key(|a| a.step);
    out
}

/// The run of one seed (see the module docs): an engine through the fault phase to quiescence;
/// with a shared tier, then a second engine over the store the first filled.
async fn run_seed(seed: u64, options: SimOptions) -> Result<SimReport, String> {
    let mut r = SimRng::new(seed);
    let faults = FaultMix::for_seed(seed);
    let config = config_for(seed, &mut r, &faults);
    let input = arrivals(&mut r);
    let calm = Arc::new(AtomicBool::new(false));
    let lost = faults.rank_lost.then(|| {
        (
            r.range(0, u64::from(config.ranks) - 1) as u32,
            r.range(3, 80),
        )
    });
    // The tier's own stream: the rest of the run draws as it would without a tier.
    let mut tr = SimRng::new(seed ^ 0x7127);
    let store = (faults.tier).then(|| Arc::new(SimStore::new(faults, calm.clone(), tr.fork(1))));
    let second = store.is_some().then(|| second_arrivals(&mut tr, &input));
    let transport = SimTransport {
        faults,
        calm: calm.clone(),
        lost,
        corrupt_first_load: options.corrupt_first_load,
        seed: r.next_u64(),
        store: store.clone(),
    };
    let mut d = Driver {
        r,
        faults,
        calm,
        digest: seed,
        report: SimReport {
            seed,
            mode: match config.mode {
                Mode::Compat => "compat",
                Mode::Strict => "strict",
            },
            policy: match config.policy {
                kvrelay_core::PolicyKind::Lru => "lru",
                kvrelay_core::PolicyKind::Arc => "arc",
            },
            ranks: config.ranks,
            async_depth: config.async_depth,
            faults,
            tier: faults.tier.then(TierSummary::default),
            ..SimReport::default()
        },
    };
    let mut engine = transport.start(&config).await?;
    let stopped = d.drive(&mut engine, input).await?;
    d.finish(engine, stopped, lost, config.mode).await?;
    if let Some(input) = second
        && d.report.ending == "quiescent"
    {
        // A second engine sharing the store: it promotes what the first stored.
        let transport = SimTransport {
            lost: None,
            corrupt_first_load: false,
            seed: tr.next_u64(),
            ..transport
        };
        let small = config.mode == Mode::Strict && tr.next_u64().is_multiple_of(2);
        let config = RunConfig {
            cpu_blocks: Some(match small {
                true => SECOND_STRICT_CPU_BLOCKS,
                false => SECOND_CPU_BLOCKS,
            }),
            ..config
        };
        let mut engine = transport.start(&config).await?;
        let stopped = d.drive(&mut engine, input).await?;
        d.finish(engine, stopped, None, config.mode).await?;
    }
    if let (Some(t), Some(s)) = (&mut d.report.tier, &store) {
        t.injected = s.injected();
    }
    d.report.digest = d.digest;
    Ok(d.report)
}

/// A second engine's requests: up to eight of the first engine's prompts (their chunks are in
/// the store), arriving over the first 20 steps.
fn second_arrivals(r: &mut SimRng, first: &[Arrival]) -> Vec<Arrival> {
    let mut out: Vec<Arrival> = (0..r.range(1, 8))
        .map(|_| Arrival {
            step: r.range(0, 20),
            prompt: first[r.range(0, first.len() as u64 - 1) as usize]
                .prompt
                .clone(),
            max_tokens: r.range(1, 8) as u32,
        })
        .collect();
    out.sort_by_key(|a| a.step);
    out
}

/// What drives a seed's engines: the seed's stream, its faults, and the report they add to.
struct Driver {
    r: SimRng,
    faults: FaultMix,
    /// Faults off (the quiescence phase): seen by the transport, the transfer engines and the
    /// store.
    calm: Arc<AtomicBool>,
    report: SimReport,
    /// Of everything the engines produced (steps, tokens, finishes).
    digest: u64,
}

impl Driver {
    /// Runs `input` on `engine` through the fault phase and the quiescence phase: the error
    /// the engine stopped with, if it stopped.
    async fn drive(
        &mut self,
        engine: &mut Engine,
        input: Vec<Arrival>,
    ) -> Result<Option<RunError>, String> {
        let mut input: VecDeque<Arrival> = input.into();
        let mut live: Vec<RequestId> = Vec::new();
        let mut next_id = 0u32;
        let mut step = 0u64;
        let stopped = loop {
            let quiet = step >= FAULT_STEPS || input.is_empty();
            self.calm.store(quiet, Ordering::Relaxed);
            while input.front().is_some_and(|a| a.step <= step) {
                let a = input.pop_front().expect("looked at");
                let id = RequestId(next_id);
                next_id += 1;
                engine
                    .add(id, a.prompt, a.max_tokens)
                    .map_err(|e| format!("add: {e}"))?;
                live.push(id);
                self.report.requests += 1;
            }
            if !quiet {
                let (aborts, resets) = (&mut self.report.aborts, &mut self.report.resets);
                disturb(engine, &mut self.r, &self.faults, &live, aborts, resets)?;
            }
            if input.is_empty() && !engine.has_work() {
                break None;
            }
            if step >= FAULT_STEPS + QUIESCE_STEPS {
                return Err(format!(
                    "no quiescence after {step} steps: {} requests live",
                    live.len()
                ));
            }
            let outcome = match engine.step().await {
                Ok(o) => o,
                Err(e) => break Some(e),
            };
            step += 1;
            self.observe(&outcome, &mut live);
            if outcome.idle {
                engine.wait_idle().await;
            }
        };
        self.report.steps += step;
        Ok(stopped)
    }

    /// A step's outcome into the digest; finished requests leave `live`.
    fn observe(&mut self, outcome: &StepOutcome, live: &mut Vec<RequestId>) {
        let digest = &mut self.digest;
        *digest = mix(*digest ^ outcome.step.0 ^ u64::from(outcome.idle));
        for o in &outcome.outputs {
            for &t in &o.new_tokens {
                *digest = mix(*digest ^ (u64::from(o.id.0) << 32) ^ u64::from(t));
            }
            if let Some(f) = &o.finish {
                *digest = mix(*digest ^ u64::from(o.id.0) ^ (format!("{f:?}").len() as u64));
                live.retain(|&id| id != o.id);
                self.report.finished += 1;
            }
        }
    }

    /// Ends an engine's part: its ending (nothing left behind, or the stop its faults call
    /// for), its shutdown, its figures.
    async fn finish(
        &mut self,
        engine: Engine,
        stopped: Option<RunError>,
        lost: Option<(u32, u64)>,
        mode: Mode,
    ) -> Result<(), String> {
        self.report.ending = match &stopped {
            None => {
                let leaks = engine.leaks();
                if !leaks.is_empty() {
                    return Err(format!("left behind at quiescence: {}", leaks.join("; ")));
                }
                "quiescent".to_owned()
            }
            Some(e) => expected_stop(e, lost, mode)?,
        };
        let (figures, ranks) = shut_down(engine).await?;
        let report = &mut self.report;
        report.reports_rejected += figures.reports_rejected;
        report.invariant_checks +=
            figures.invariant_checks + ranks.iter().map(|r| r.invariant_checks).sum::<u64>();
        report.transfers_failed += ranks.iter().map(|r| r.failed_transfers).sum::<u64>();
        report.blocks_verified += ranks
            .iter()
            .map(|r| r.loaded_blocks_verified + r.written_slots_verified + r.read_blocks_checked)
            .sum::<u64>();
        if let (Some(t), Some(f)) = (&mut report.tier, &figures.tier) {
            t.absorb(f);
        }
        Ok(())
    }
}

/// The ending of a run the engine stopped, if the stop is the expected one: the lost rank named
/// (it may also be seen as the rank whose step channel closed), or a failed transfer under
/// compat (vLLM asserts).
fn expected_stop(e: &RunError, lost: Option<(u32, u64)>, mode: Mode) -> Result<String, String> {
    match e {
        RunError::RankGone { rank } if lost.is_some_and(|(r, _)| r == *rank) => {
            Ok(format!("rank {rank} lost"))
        }
        RunError::Rank {
            rank,
            error: RankError::Worker(WorkerError::TransferFailed(job)),
        } if mode == Mode::Compat => Ok(format!(
            "rank {rank}: transfer of job {} failed under compat",
            job.0
        )),
        other => Err(format!("the engine stopped: {other}")),
    }
}
