//! The `kvrelay` command line: run conformance cases, benchmark a case, model-check the core.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use kvrelay_core::Mode;
use kvrelay_model_check::{CheckReport, CompletionConfig, Progress, check_completions};
use kvrelay_runtime::{bench, conformance};

/// kvrelay: the KV-cache connector layer whose lifecycle is a model-checked state machine.
#[derive(Parser, Debug)]
#[command(name = "kvrelay", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run conformance cases (JSON files, or folders searched recursively for *.json).
    ///
    /// Prints `PASS <name>` or `FAIL <name>: <reason>` per case, then `N passed, M failed`.
    /// Exits 0 iff every case passed.
    Conformance {
        /// Case files or folders.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Time a conformance case as a workload: median time per call kind.
    ///
    /// The case is parsed and converted once and checked once against its expectations; then its
    /// calls are replayed on fresh machines REPEAT times. Parsing and conversion are not timed.
    Bench {
        /// The case file.
        case: PathBuf,
        /// How many times to replay the case.
        #[arg(long, default_value_t = 1000)]
        repeat: usize,
    },
    /// Model-check the core: every interleaving of W ranks reporting R requests' transfers
    /// through the real worker-protocol and aggregator code.
    ///
    /// Prints progress on stderr, then a table of properties; a violated property comes with its
    /// counterexample, one action per line. Exits 1 if any `always` property is violated or an
    /// expected `sometimes` example is missing.
    Check {
        /// A named configuration; flags below override its fields.
        #[arg(long, value_enum, default_value_t = Preset::Ci)]
        config: Preset,
        /// Worker ranks (W).
        #[arg(long)]
        ranks: Option<u32>,
        /// Requests (R), each with a load and a save on every rank.
        #[arg(long)]
        requests: Option<u32>,
        /// Aggregator mode.
        #[arg(long, value_enum)]
        mode: Option<ModeArg>,
        /// Let loads fail (reported in finished_recving and failed_recving).
        #[arg(long)]
        failures: Option<bool>,
        /// Inject the double-report fault (a rank reports a completion twice).
        #[arg(long)]
        faulty_double_report: bool,
        /// Checker threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Preset {
    /// The configuration CI runs exhaustively.
    Ci,
    /// A larger configuration.
    Deep,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ModeArg {
    /// vLLM 0.33.0 exactly.
    Compat,
    /// Per-rank dedup of completion reports.
    Strict,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Conformance { paths } => run_conformance(&paths),
        Command::Bench { case, repeat } => run_bench(&case, repeat),
        Command::Check {
            config,
            ranks,
            requests,
            mode,
            failures,
            faulty_double_report,
            threads,
        } => {
            let mut c = match config {
                Preset::Ci => CompletionConfig::ci(),
                Preset::Deep => CompletionConfig::deep(),
            };
            if let Some(w) = ranks {
                c.ranks = w;
            }
            if let Some(r) = requests {
                c.requests = r;
            }
            if let Some(m) = mode {
                c.mode = match m {
                    ModeArg::Compat => Mode::Compat,
                    ModeArg::Strict => Mode::Strict,
                };
            }
            if let Some(f) = failures {
                c.failures = f;
            }
            c.faulty_double_report |= faulty_double_report;
            run_check(c, threads)
        }
    }
}

fn run_conformance(paths: &[PathBuf]) -> ExitCode {
    let files = match conformance::collect_files(paths) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("kvrelay conformance: {e}");
            return ExitCode::from(2);
        }
    };
    let (mut passed, mut failed) = (0usize, 0usize);
    for f in &files {
        let outcome = conformance::run_file(f);
        if outcome.result.is_ok() {
            passed += 1;
        } else {
            failed += 1;
        }
        println!("{outcome}");
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run_bench(path: &PathBuf, repeat: usize) -> ExitCode {
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
        Ok(stats) => {
            println!("{} — {repeat} replays on fresh machines", case.name());
            println!(
                "{:<32} {:>9} {:>12} {:>12} {:>12}",
                "call", "samples", "median", "p10", "p90"
            );
            for s in stats {
                println!(
                    "{:<32} {:>9} {:>12} {:>12} {:>12}",
                    s.call,
                    s.samples,
                    bench::fmt_ns(s.median_ns),
                    bench::fmt_ns(s.p10_ns),
                    bench::fmt_ns(s.p90_ns)
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvrelay bench: {}: {e}", case.name());
            ExitCode::FAILURE
        }
    }
}

fn run_check(config: CompletionConfig, threads: usize) -> ExitCode {
    if let Err(e) = config.validate() {
        eprintln!("kvrelay check: invalid configuration: {e}");
        return ExitCode::from(2);
    }
    if threads == 0 {
        eprintln!("kvrelay check: --threads must be at least 1");
        return ExitCode::from(2);
    }
    eprintln!("kvrelay check: {config:?}, {threads} threads");
    let mut last_line_len = 0;
    let mut on_progress = |p: &Progress| {
        let rate = if p.elapsed_seconds > 0.0 {
            p.states as f64 / p.elapsed_seconds
        } else {
            0.0
        };
        let line = format!(
            "  states {:>10}  unique {:>9}  depth {:>4}  {:>10.0} states/s  {:>6.1} s",
            p.states, p.unique_states, p.max_depth, rate, p.elapsed_seconds
        );
        last_line_len = line.len();
        eprint!("\r{line}");
        let _ = std::io::stderr().flush();
    };
    let report = check_completions(config, threads, &mut on_progress);
    if last_line_len > 0 {
        eprintln!();
    }
    print_report(&report)
}

fn print_report(r: &CheckReport) -> ExitCode {
    let rate = if r.seconds > 0.0 {
        r.states as f64 / r.seconds
    } else {
        0.0
    };
    println!(
        "{} — {} states, {} unique, max depth {}, {:.2} s, {:.0} states/s",
        if r.complete {
            "explored exhaustively"
        } else {
            "INCOMPLETE exploration"
        },
        r.states,
        r.unique_states,
        r.max_depth,
        r.seconds,
        rate
    );
    println!();
    println!("{:<10} {:<9} property", "result", "kind");
    let mut ok = r.complete;
    for p in &r.properties {
        let verdict = match (p.expectation, p.holds) {
            ("sometimes", true) => "example",
            ("sometimes", false) => "NO EXAMPLE",
            (_, true) => "holds",
            (_, false) => "VIOLATED",
        };
        ok &= p.holds;
        println!("{verdict:<10} {:<9} {}", p.expectation, p.name);
    }
    for p in &r.properties {
        if let (false, Some(path)) = (p.holds, &p.path) {
            println!();
            println!(
                "counterexample for \"{}\" ({} actions):",
                p.name,
                path.len()
            );
            for (i, line) in path.iter().enumerate() {
                println!("  {:>3}. {line}", i + 1);
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
