//! `kvrelay bench`: time a conformance case as a workload (the replay is
//! `kvrelay-conformance`'s), or, with `kvrelay bench tier`, the shared tier's IO against
//! `redis-benchmark` on the same cluster ([`tier`]).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use kvrelay_conformance::{self as conformance, bench};

pub(crate) mod tier;

/// `kvrelay bench` flags: a case file, or a subcommand.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    pub what: Option<BenchCommand>,
    /// The case file.
    #[arg(required = true)]
    pub case: Option<PathBuf>,
    /// How many times to replay the case (each way: whole, and call by call).
    #[arg(long, default_value_t = 1000)]
    pub repeat: usize,
    /// Print the figures as JSON (times in ns).
    #[arg(long)]
    pub json: bool,
}

/// What else `kvrelay bench` measures.
#[derive(Subcommand, Debug)]
pub(crate) enum BenchCommand {
    /// The shared tier's stores and loads (the engine's own code: pool reads, value headers
    /// and CRC-32, pipelined MSET and MGET per hash slot) against `redis-benchmark`'s SET and
    /// GET on the same Redis Cluster, value size, values in flight and connections; bytes per
    /// second side by side and their ratio, medians of --repeat rounds.
    #[command(after_long_help = tier::HELP)]
    Tier(tier::TierBenchArgs),
}

/// `kvrelay bench`: a case, or what the subcommand names.
pub(crate) fn run(args: &BenchArgs) -> ExitCode {
    match (&args.what, &args.case) {
        (Some(BenchCommand::Tier(t)), _) => tier::run(t),
        (None, Some(case)) => run_case(case, args.repeat, args.json),
        (None, None) => {
            eprintln!("kvrelay bench: a case file or `tier`");
            ExitCode::from(2)
        }
    }
}

fn case_json(name: &str, r: &bench::BenchReport) -> String {
    let kinds: Vec<serde_json::Value> = r
        .kinds
        .iter()
        .map(|k| {
            serde_json::json!({
                "call": k.call, "samples": k.samples,
                "median_ns": k.median_ns, "p10_ns": k.p10_ns, "p90_ns": k.p90_ns,
            })
        })
        .collect();
    serde_json::json!({
        "case": name,
        "replays": r.replays,
        "calls_per_replay": r.calls,
        "replay_median_ns": r.replay_median_ns,
        "replay_p10_ns": r.replay_p10_ns,
        "replay_p90_ns": r.replay_p90_ns,
        "sum_of_kind_medians_ns": r.sum_of_kind_medians_ns(),
        "kinds": kinds,
    })
    .to_string()
}

fn run_case(path: &PathBuf, repeat: usize, json: bool) -> ExitCode {
    if repeat == 0 {
        eprintln!("kvrelay bench: --repeat must be at least 1");
        return ExitCode::from(2);
    }
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvrelay bench: cannot read {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let case = match conformance::AnyCase::parse(&text, &path.display().to_string()) {
        Ok(c) => c,
        Err((name, e)) => {
            eprintln!("kvrelay bench: {name}: {e}");
            return ExitCode::from(2);
        }
    };
    match bench::bench_case(&case, repeat) {
        Ok(report) if json => {
            println!("{}", case_json(case.name(), &report));
            ExitCode::SUCCESS
        }
        Ok(report) => {
            print_case(case.name(), repeat, &report);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvrelay bench: {}: {e}", case.name());
            ExitCode::FAILURE
        }
    }
}

fn print_case(name: &str, repeat: usize, report: &bench::BenchReport) {
    println!("{name} — {repeat} replays on fresh machines, each way");
    println!(
        "whole replay ({} calls in one timed region): median {} (p10 {}, p90 {})",
        report.calls,
        bench::fmt_ns(report.replay_median_ns),
        bench::fmt_ns(report.replay_p10_ns),
        bench::fmt_ns(report.replay_p90_ns)
    );
    println!(
        "each call timed on its own (sum of median × count: {}, timer included):",
        bench::fmt_ns(report.sum_of_kind_medians_ns())
    );
    println!(
        "{:<32} {:>9} {:>12} {:>12} {:>12}",
        "call", "samples", "median", "p10", "p90"
    );
    for s in &report.kinds {
        println!(
            "{:<32} {:>9} {:>12} {:>12} {:>12}",
            s.call,
            s.samples,
            bench::fmt_ns(s.median_ns),
            bench::fmt_ns(s.p10_ns),
            bench::fmt_ns(s.p90_ns)
        );
    }
}
