//! `kvrelay sim`: the command line of the deterministic simulation ([`super`]).

use std::process::ExitCode;

use clap::Args;

use kvrelay_sim::{SimFailure, SimReport, SweepReport, simulate, soak, sweep};

/// `kvrelay sim` flags.
#[derive(Args, Debug)]
pub(crate) struct SimArgs {
    /// Seeds to run, from --from on.
    #[arg(long, default_value_t = 1000)]
    pub seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Threads (each runs whole seeds) [default: the machine's cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the sweep's (or the one seed's) report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Instead of a sweep, one soak run of STEPS engine steps (every fault kind but a lost
    /// rank, requests arriving as others finish, ids reused): resident memory sampled every
    /// 10,000 steps; exits 1 if it grew more than 10 % from step 10,000 to the end.
    #[arg(long, value_name = "STEPS")]
    pub soak: Option<u64>,
}

/// What `kvrelay sim --help` adds after the flags.
pub(crate) const HELP: &str = "\
Seeds: 0 is fault-free, 1 injects every fault kind, every other seed draws its own mix (transfers
that fail or are slow, reports delayed or duplicated, step frames delayed, aborts, cache resets,
a lost rank) and its own shape (ranks, layers, pool sizes, mode, async depth, requests). One seed
in four (seed 1 too) has a shared tier, a simulated store that two engines use in turn, with
faults of its own: keys evicted, writes torn, nodes away (timeouts), slow answers.

A failing seed prints the command that replays it. KVRELAY_SEED=<seed> runs that seed alone and
prints its whole report.

Exit status: 0 when every seed passed, 1 when one failed, 2 on bad flags.";

/// Runs `kvrelay sim`.
pub(crate) fn run(a: &SimArgs) -> ExitCode {
    if let Ok(s) = std::env::var("KVRELAY_SEED") {
        let Ok(seed) = s.trim().parse::<u64>() else {
            eprintln!("kvrelay sim: KVRELAY_SEED must be a number, not {s:?}");
            return ExitCode::from(2);
        };
        return one(seed, a.json);
    }
    if let Some(steps) = a.soak {
        return run_soak(a.from, steps, a.json);
    }
    if a.seeds == 0 {
        eprintln!("kvrelay sim: --seeds must be at least 1");
        return ExitCode::from(2);
    }
    let Some(end) = a.from.checked_add(a.seeds) else {
        eprintln!("kvrelay sim: --from + --seeds overflows");
        return ExitCode::from(2);
    };
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    let bar = indicatif::ProgressBar::new(a.seeds);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} seeds, {msg} [{elapsed}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let started = std::time::Instant::now();
    let mut failed = 0u64;
    let report = sweep(a.from..end, threads, &mut |r: &Result<
        SimReport,
        SimFailure,
    >| {
        if let Err(f) = r {
            failed += 1;
            bar.println(f.to_string());
        }
        bar.set_message(format!("{failed} failed"));
        bar.inc(1);
    });
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    if a.json {
        let v = serde_json::json!({ "seeds": [a.from, end], "seconds": seconds, "sweep": report });
        println!("{v}");
    } else {
        println!(
            "kvrelay sim: seeds {}..{end} on {threads} threads, {seconds:.1} s",
            a.from
        );
        println!(
            "runs {}: {} quiescent (every request finished, nothing left behind), {} stopped as \
             their faults call for ({} lost a rank, {} failed a transfer under compat), {} failed",
            report.runs,
            report.quiescent,
            report.ranks_lost + report.compat_stops,
            report.ranks_lost,
            report.compat_stops,
            report.failures.len()
        );
        println!(
            "steps {}, requests {}; faults survived: {} failed transfers, {} duplicate or stale \
             reports refused, {} aborts, {} cache resets, {} lost ranks; runs with delayed \
             reports {}, delayed steps {}, slow transfers {}",
            report.steps,
            report.requests,
            report.transfers_failed,
            report.reports_rejected,
            report.aborts,
            report.resets,
            report.ranks_lost,
            report.survived("report_delay"),
            report.survived("step_delay"),
            report.survived("transfer_slow"),
        );
        print_tier(&report);
        println!(
            "checked: every machine's invariants {} times (after every step, engine and ranks), \
             {} loaded blocks and read token slots byte for byte",
            report.invariant_checks, report.blocks_verified
        );
        for f in &report.failures {
            println!("FAIL {f}");
        }
    }
    if report.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The sweep's shared-tier line.
fn print_tier(report: &SweepReport) {
    let t = &report.tier;
    let i = &t.injected;
    println!(
        "tier: {} runs, {} engines (a second engine over the store the first filled); {} probes \
         ({} found), {} promotions of {} blocks ({} of them a second engine's hits), {} blocks \
         stored; failed loads {} ({} values missing, {} refused by their header, {} commands past \
         the deadline); injected: {} keys evicted, {} writes torn, {} nodes away, {} slow answers",
        report.tier_runs,
        t.engines,
        t.probes,
        t.probes_found,
        t.promotions,
        t.blocks_promoted,
        t.shared_blocks_promoted,
        t.blocks_stored,
        t.load_failures,
        t.values_missing,
        t.values_refused,
        t.timeouts,
        i.keys_evicted,
        i.writes_torn,
        i.nodes_away,
        i.slow_answers,
    );
}

/// One seed, its whole report.
fn one(seed: u64, json: bool) -> ExitCode {
    match simulate(seed) {
        Ok(r) if json => {
            println!("{}", serde_json::json!(r));
            ExitCode::SUCCESS
        }
        Ok(r) => {
            println!("{r:#?}");
            ExitCode::SUCCESS
        }
        Err(f) => {
            println!("FAIL {f}");
            ExitCode::FAILURE
        }
    }
}

/// `--soak STEPS`.
fn run_soak(seed: u64, steps: u64, json: bool) -> ExitCode {
    let bar = indicatif::ProgressBar::new(steps);
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let started = std::time::Instant::now();
    let report = soak(seed, steps, 10_000, &mut |done| bar.set_position(done));
    bar.finish_and_clear();
    let report = match report {
        Ok(r) => r,
        Err(f) => {
            println!("FAIL {f}");
            return ExitCode::FAILURE;
        }
    };
    let growth = report.growth_since(10_000);
    if json {
        let v = serde_json::json!({ "soak": report, "growth_since_10000": growth });
        println!("{v}");
        return ExitCode::SUCCESS;
    }
    println!(
        "kvrelay sim --soak: seed {seed}, {} steps in {:.1} s, {} requests (ids up to {}), {} \
         failed transfers, {} reports refused, {} aborts, {} resets",
        report.steps,
        started.elapsed().as_secs_f64(),
        report.requests,
        report.max_request_id,
        report.transfers_failed,
        report.reports_rejected,
        report.aborts,
        report.resets
    );
    for (step, kib) in &report.rss_kib {
        println!("  step {step:>9}: resident {kib} KiB");
    }
    if let Some(g) = growth {
        println!(
            "resident memory at the end / at step 10,000: {g:.3} ({:+.1} %)",
            (g - 1.0) * 100.0
        );
        if g > 1.0 + SOAK_GROWTH_LIMIT {
            println!(
                "FAIL resident memory grew more than {:.0} % after step 10,000",
                SOAK_GROWTH_LIMIT * 100.0
            );
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// How much resident memory may grow from step 10,000 to the end of a soak.
const SOAK_GROWTH_LIMIT: f64 = 0.10;
