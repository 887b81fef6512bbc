//! The `kvrelay` command line: run the engine, run conformance cases, benchmark a case,
//! model-check the core.
//!
//! A thin shell: each subcommand's work is in a library crate (`kvrelay-engine` for `run` and
//! `worker`, `kvrelay-sim`, `kvrelay-conformance` for `conformance` and `bench`,
//! `kvrelay-model-check` for `check`); this crate parses the command line and prints. Each
//! subcommand's flags and printing are a module of their own: [`run`], [`sim`], [`check`],
//! [`bench`](mod@bench), [`sweep`] (its chart: [`plot`]), [`route`], [`pd`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvrelay_conformance as conformance;

mod bench;
mod check;
mod pd;
mod plot;
mod route;
mod run;
mod sim;
mod sweep;

use check::CheckArgs;
use run::{self as run_args, RunArgs};
use sim::{self as sim_args, SimArgs};
use sweep::SweepArgs;

/// The binary's allocator: mimalloc. The model checker clones and drops a state per transition
/// and the manager's calls allocate small vectors; with glibc's allocator, malloc and free were
/// a third of the checker's instructions (callgrind, `kvrelay check`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvrelay: the KV-cache connector layer whose lifecycle is a model-checked state machine.
#[derive(Parser, Debug)]
#[command(name = "kvrelay", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the engine: W ranks serving a workload with CPU offloading, real KV bytes moved and
    /// verified; prints a report (--json for machines).
    #[command(after_long_help = run_args::HELP)]
    Run(Box<RunArgs>),
    /// One rank as a process of its own: started by `kvrelay run --workers process`, not by
    /// hand.
    Worker {
        /// The engine's Unix socket.
        #[arg(long)]
        socket: PathBuf,
        /// The rank.
        #[arg(long)]
        rank: u32,
    },
    /// Run conformance cases (JSON files, or folders searched recursively for *.json).
    ///
    /// Prints `PASS <name>` or `FAIL <name>: <reason>` per case, then `N passed, M failed`.
    /// Exits 0 iff every case passed.
    Conformance {
        /// Case files or folders.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Time a conformance case as a workload: a whole replay, and the median per call kind;
    /// or, `kvrelay bench tier`, the shared tier's IO against `redis-benchmark`.
    ///
    /// The case is parsed and converted once and checked once against its expectations; then its
    /// calls are replayed on fresh machines REPEAT times with every call in one timed region
    /// (the figure to compare with another implementation), and REPEAT times with each call
    /// timed on its own (where the time goes). Parsing and conversion are not timed.
    Bench(Box<bench::BenchArgs>),
    /// Model-check the core: every interleaving of the environment, through the real code.
    ///
    /// Prints the configuration checked (`key = value`, one setting a line, named after its flag)
    /// and progress on stderr, then a table of properties on stdout; a violated property comes
    /// with its counterexample, one numbered action per line. Exits 0 if every property holds
    /// (exhaustively, or within --max-depth), 1 if an `always` property is violated or an
    /// expected `sometimes` example is missing, 2 on bad flags.
    #[command(after_long_help = check::HELP)]
    Check(Box<CheckArgs>),
    /// Simulate the runtime deterministically with injected faults, one seed per run: transfers
    /// that fail or are slow, frames delayed or duplicated, aborts, cache resets, a lost rank.
    ///
    /// Every run checks every machine's invariants after every step and every loaded or read KV
    /// byte, then (faults off) must end quiescent with nothing left behind, or in the stop its
    /// faults call for. Prints a summary (--json for machines); a failing seed, the command that
    /// replays it.
    #[command(after_long_help = sim_args::HELP)]
    Sim(SimArgs),
    /// What-if sweeps: run one workload under a grid of CPU pools × eviction policies (× GPU
    /// pools), in parallel; a table (--json for machines) and a plot of prefix reuse and tokens
    /// computed against the CPU pool (--plot OUT.svg|png).
    #[command(after_long_help = sweep::HELP)]
    Sweep(Box<SweepArgs>),
    /// A KV-aware router over N engines: each request to the engine holding its longest cached
    /// prefix (as the engines' KV events say), against round robin, side by side (--json for
    /// machines).
    #[command(after_long_help = route::HELP)]
    Route(Box<route::RouteArgs>),
    /// Prefill/decode disaggregation: a prefill and a decode engine process with the P/D
    /// connector, a router between them, every handed-off block verified; a report per engine
    /// and end to end (--json for machines).
    #[command(after_long_help = pd::HELP)]
    Pd(Box<pd::PdArgs>),
    /// One P/D engine as a process of its own: started by `kvrelay pd`, not by hand.
    #[command(hide = true)]
    PdEngine,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            init_tracing();
            run_args::run(&args)
        }
        Command::Worker { socket, rank } => {
            init_tracing();
            kvrelay_engine::transport::process::worker_main(&socket, rank)
        }
        Command::Conformance { paths } => run_conformance(&paths),
        Command::Bench(args) => bench::run(&args),
        Command::Check(args) => check::run(&args),
        Command::Sim(args) => sim_args::run(&args),
        Command::Sweep(args) => {
            init_tracing();
            sweep::run(&args)
        }
        Command::Route(args) => {
            init_tracing();
            route::run(&args)
        }
        Command::Pd(args) => {
            init_tracing();
            pd::run(&args)
        }
        Command::PdEngine => {
            init_tracing();
            kvrelay_engine::pd::engine_main()
        }
    }
}

/// Logs and spans on stderr, filtered by `RUST_LOG` (default: warnings).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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
