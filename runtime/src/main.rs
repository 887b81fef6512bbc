//! The `kvrelay` command line: run conformance cases, benchmark a case, model-check the core.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvrelay_core::{Mode, PolicyKind};
use kvrelay_model_check::{
    CheckOptions, CheckReport, ChildKind, CompletionConfig, CompletionModel, Connectors, CoreFault,
    Explain, ExploreError, MultiFault, MultiPair, OffloadingPair, PdFault, PdPair, PdRole,
    Progress, SchedFault, Stop, Strategy, SystemConfig, SystemModel, check, check_with_symmetry,
    explorer_address, serve_explorer,
};
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
    /// Model-check the core: every interleaving of the environment, through the real code.
    ///
    /// Prints progress on stderr, then a table of properties on stdout; a violated property comes
    /// with its counterexample, one numbered action per line. Exits 0 if every property holds
    /// (exhaustively, or within --max-depth), 1 if an `always` property is violated or an
    /// expected `sometimes` example is missing, 2 on bad flags.
    #[command(after_long_help = CHECK_HELP)]
    Check(Box<CheckArgs>),
}

const CHECK_HELP: &str = "\
Models:
  --model system (the default)       the whole connector lifecycle of one engine: the real
                                     scheduler with a connector inside, W ranks through the
                                     real worker step protocol, the aggregator, aborts, cache
                                     resets, load failures, out-of-order transfer completions.
    --connector offloading (default) kvrelay's CPU offloading connector.
    --connector pd                   a P/D connector: every prompt loaded asynchronously from
                                     a remote prefill instance (WAITING_FOR_REMOTE_KVS; loads
                                     may fail: --load-failures, default 1), sends that hold a
                                     finished request's blocks (delayed frees).
    --connector multi                kvrelay's MultiConnector: a P/D loader + the offloading
                                     connector.
    --connector multi-senders        kvrelay's MultiConnector: two P/D senders (extra async
                                     saves).
  --model completion                 only how W ranks report transfer completions through the
                                     step protocol to the aggregator (small, fast).

When to use what:
  kvrelay check                      the CI check: the system model's `ci` preset, exhaustive,
                                     breadth-first.
  kvrelay check --config deep --symmetry
                                     the larger preset (3 ranks, 3 requests, async depth 2):
                                     11.5 million unique states, 9 to 13 minutes on 2 cores,
                                     depth-first with symmetry over ranks (hundreds of MB;
                                     breadth-first needs many GB).
  kvrelay check --connector pd --pd-role decode --config deep --symmetry
                                     the same with remote loads and one load failure: 6.1
                                     million unique states, about 5 minutes.
  --fault NAME                       (system model) inject a known historical bug and see the
                                     counterexample the checker finds (expect exit 1 where the
                                     configuration can reach the bug): bind-first,
                                     skip-handle-preemptions, one-rank-output (any connector;
                                     runner and executor bugs, re-introduced in the core's
                                     step: only in a build with --features scheduler-faults);
                                     drop-zero-external-alloc (offloading, multi: e.g.
                                     --connector multi --prompt-tokens 3 --max-tokens 1
                                     --gpu-blocks 5), lookup-ignores-jobs (offloading, multi);
                                     swallow-load-failures (pd); strip-extra-saves
                                     (multi-senders); free-aborted-while-loading (pd, multi)
                                     and claim-hits-group-by-group (any connector, with
                                     --sliding-window): core scheduler bugs, only in a build
                                     with --features scheduler-faults.
  --faulty-double-report / --faulty-bind-first
                                     the same for the completion model.
  --trace-out FILE                   also write the first counterexample as a Mermaid sequence
                                     diagram (paste into a Markdown ```mermaid block or
                                     mermaid.live); --trace-of NAME picks a property instead
                                     (a unique part of its name, e.g. I-21), including the
                                     example of a `sometimes` property.
  --keep-going                       do not stop at the first violation: every property gets
                                     its own counterexample or example.
  --dfs                              depth-first: far less memory than BFS on large
                                     configurations, but long counterexamples; --symmetry
                                     (models with interchangeable parts only) needs it.
  --max-depth N                      a quick bounded run: no violation within N is no proof.
  --explore ADDR                     browse the state space interactively in stateright's web
                                     explorer (e.g. 127.0.0.1:3000; loopback only unless
                                     --allow-remote: the explorer has no authentication).

Exit status: 0 every property holds (exhaustively or within --max-depth), 1 a property fails or
the run stopped at a violation, 2 bad flags or configuration.";

/// The models `kvrelay check` knows.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
enum ModelArg {
    /// The whole connector lifecycle of one engine: the real scheduler with kvrelay's CPU
    /// offloading connector, W ranks through the real worker step protocol, the aggregator and
    /// an environment of arrivals, aborts, cache resets and transfer completions (SEMANTICS.md
    /// §2.9, §8, §12).
    System,
    /// W ranks report R requests' transfer completions through the real worker-protocol and
    /// aggregator code (SEMANTICS.md §8.1, §8.4).
    Completion,
}

impl ModelArg {
    fn name(self) -> String {
        value_name(self)
    }
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// The model to check.
    #[arg(long, value_enum, default_value_t = ModelArg::System)]
    model: ModelArg,
    /// A named configuration of the model; the model's flags below override its fields.
    #[arg(long, value_enum, default_value_t = Preset::Ci)]
    config: Preset,

    /// Worker ranks (W).
    #[arg(long, help_heading = "Both models")]
    ranks: Option<u32>,
    /// Requests (R). Completion model: each with a load and a save on every rank; system
    /// model: request i arrives after request i − 1.
    #[arg(long, help_heading = "Both models")]
    requests: Option<u32>,
    /// Aggregator mode (system model: also the scheduler's).
    #[arg(long, value_enum, help_heading = "Both models")]
    mode: Option<ModeArg>,

    /// The connector under check [default: offloading].
    #[arg(long, value_enum, help_heading = "System model")]
    connector: Option<ConnectorArg>,
    /// What the P/D connector does (--connector pd) [default: both].
    #[arg(long, value_enum, help_heading = "System model")]
    pd_role: Option<PdRoleArg>,
    /// GPU blocks, the null block included (small, so that preemption and block reuse happen).
    #[arg(long, value_name = "N", help_heading = "System model")]
    gpu_blocks: Option<u32>,
    /// Tokens per GPU block.
    #[arg(long, value_name = "N", help_heading = "System model")]
    block_size: Option<u32>,
    /// Turn the scheduler's GPU prefix cache off: every hit then comes from the connector.
    #[arg(long, help_heading = "System model")]
    no_prefix_caching: bool,
    /// CPU chunks of the offloading manager.
    #[arg(long, value_name = "N", help_heading = "System model")]
    cpu_chunks: Option<u32>,
    /// GPU blocks per offloaded chunk.
    #[arg(long, value_name = "N", help_heading = "System model")]
    blocks_per_chunk: Option<u32>,
    /// Prompt tokens per request (a multiple of --block-size).
    #[arg(long, value_name = "N", help_heading = "System model")]
    prompt_tokens: Option<u32>,
    /// Leading prompt tokens all requests share (so one can load what another stored).
    #[arg(long, value_name = "N", help_heading = "System model")]
    shared_tokens: Option<u32>,
    /// Output tokens per request.
    #[arg(long, value_name = "N", help_heading = "System model")]
    max_tokens: Option<u32>,
    /// Token budget per step.
    #[arg(long, value_name = "N", help_heading = "System model")]
    max_batched_tokens: Option<u32>,
    /// Steps scheduled before the oldest one's output is applied (1 = synchronous).
    #[arg(long, value_name = "N", help_heading = "System model")]
    async_depth: Option<u32>,
    /// Aborts the environment may issue.
    #[arg(long, value_name = "N", help_heading = "System model")]
    aborts: Option<u32>,
    /// reset_connector_cache calls the environment may issue.
    #[arg(long, value_name = "N", help_heading = "System model")]
    resets: Option<u32>,
    /// Load transfers the environment may fail (connectors with remote loads: pd) [default: 1
    /// for pd, 0 otherwise].
    #[arg(long, value_name = "N", help_heading = "System model")]
    load_failures: Option<u32>,
    /// Consecutive engine steps without progress that are explored.
    #[arg(long, value_name = "N", help_heading = "System model")]
    idle_steps: Option<u32>,
    /// The offloading manager's replacement policy.
    #[arg(long, value_enum, help_heading = "System model")]
    policy: Option<PolicyArg>,
    /// Add a sliding-window KV-cache group (window in tokens) besides full attention.
    #[arg(long, value_name = "TOKENS", help_heading = "System model")]
    sliding_window: Option<u32>,
    /// Let each rank's transfers complete in any order (the presets: in submission order per
    /// rank and direction).
    #[arg(long, help_heading = "System model")]
    unordered_completions: bool,
    /// Inject a historical bug (repeatable; at most one of the scheduler-side faults
    /// drop-zero-external-alloc, lookup-ignores-jobs).
    #[arg(long, value_enum, value_name = "FAULT", help_heading = "System model")]
    fault: Vec<FaultArg>,

    /// Let loads fail (reported in finished_recving and failed_recving).
    #[arg(long, value_name = "BOOL", help_heading = "Completion model")]
    failures: Option<bool>,
    /// Inject the double-report fault (a rank reports a completion twice).
    #[arg(long, help_heading = "Completion model")]
    faulty_double_report: bool,
    /// Inject the bind-first fault (runners call bind before handle_preemptions).
    #[arg(long, help_heading = "Completion model")]
    faulty_bind_first: bool,

    /// Checker threads (with BFS and more than one thread, counterexamples may not be the
    /// shortest).
    #[arg(long, default_value_t = 2, help_heading = "Search")]
    threads: usize,
    /// Breadth-first search (the default): shortest counterexamples, most memory.
    #[arg(long, conflicts_with = "dfs", help_heading = "Search")]
    bfs: bool,
    /// Depth-first search: little memory, long counterexamples.
    #[arg(long, help_heading = "Search")]
    dfs: bool,
    /// Symmetry reduction (implies --dfs; only for models with interchangeable parts).
    #[arg(long, conflicts_with = "bfs", help_heading = "Search")]
    symmetry: bool,
    /// Explore paths of at most DEPTH states only (a bounded run, not a proof).
    #[arg(long, value_name = "DEPTH", help_heading = "Search")]
    max_depth: Option<usize>,
    /// Do not stop at the first violation: look for every property's counterexample or example.
    #[arg(long, help_heading = "Search")]
    keep_going: bool,

    /// Write the first violated property's counterexample as a Mermaid sequence diagram.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    trace_out: Option<PathBuf>,
    /// With --trace-out: the property whose counterexample (or `sometimes` example) to write,
    /// by its name or a unique case-insensitive part of it (e.g. I-21).
    #[arg(
        long,
        value_name = "NAME",
        requires = "trace_out",
        help_heading = "Output"
    )]
    trace_of: Option<String>,

    /// Serve stateright's web explorer of the model on ADDR (HOST:PORT) instead of checking.
    #[arg(
        long,
        value_name = "ADDR",
        conflicts_with_all = ["trace_out", "bfs", "dfs", "symmetry", "max_depth", "keep_going"],
        help_heading = "Explorer"
    )]
    explore: Option<String>,
    /// Allow --explore on a non-loopback address (the explorer has no authentication).
    #[arg(long, requires = "explore", help_heading = "Explorer")]
    allow_remote: bool,
}

/// `--connector`: the connector pair the system model composes.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
enum ConnectorArg {
    /// kvrelay's CPU offloading connector (stores, loads, preemption fences, flushes).
    Offloading,
    /// A P/D connector: async loads of every prompt from a remote prefill instance (which may
    /// fail), sends that hold a finished request's blocks (delayed frees).
    Pd,
    /// kvrelay's MultiConnector of a P/D child that loads every prompt remotely and the
    /// offloading connector (a decode instance that also offloads to CPU).
    Multi,
    /// kvrelay's MultiConnector of two P/D children that both send every finished request
    /// (two async savers: extra async saves, I-28).
    MultiSenders,
}

/// `--pd-role`.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
enum PdRoleArg {
    /// Decode and prefill side at once: loads every prompt, sends every finished request.
    Both,
    /// Decode side only: loads every prompt remotely (no sends, no delayed frees).
    Decode,
    /// Prefill side only: sends every finished request (no remote loads).
    Prefill,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Preset {
    /// The configuration CI runs exhaustively.
    Ci,
    /// A larger configuration.
    Deep,
}

/// `--policy`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    /// Least recently used (vLLM's default).
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// `--fault`: a historical bug injected into the system model.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
enum FaultArg {
    /// vLLM PR #42676 (in the core's rank driver; needs --features scheduler-faults): the
    /// runner binds the step's metadata before handle_preemptions.
    BindFirst,
    /// Mooncake PR #52470 (in the core's rank driver; needs --features scheduler-faults): the
    /// runner skips handle_preemptions' waits.
    SkipHandlePreemptions,
    /// vLLM issue #21070 (in the core's engine; needs --features scheduler-faults): the
    /// executor hands the aggregator only rank 0's output.
    OneRankOutput,
    /// vLLM issue #46951 (scheduler side): update_state_after_alloc with zero external tokens
    /// is not passed on to the connector.
    DropZeroExternalAlloc,
    /// vLLM issue #46014 (scheduler side): a request with jobs in flight is looked up as if
    /// it had none.
    LookupIgnoresJobs,
    /// (--connector pd) the worker reports a failed load as a success.
    SwallowLoadFailures,
    /// vLLM PR #18246 (--connector multi-senders): the extra async saves never reach the
    /// workers.
    StripExtraSaves,
    /// vLLM PR #32255 (in the core scheduler; needs a build with --features scheduler-faults):
    /// a request aborted while loading has its blocks freed at once.
    FreeAbortedWhileLoading,
    /// vLLM issue #33775 (in the core scheduler; needs a build with --features
    /// scheduler-faults and two groups, --sliding-window): a first allocation claims its hit
    /// and allocates group by group, so one group's new block can be another's hit block.
    ClaimHitsGroupByGroup,
}

impl FaultArg {
    /// The connectors the fault can be injected into (the one place `--fault` is matched
    /// against `--connector`).
    fn connectors(self) -> &'static [ConnectorArg] {
        use ConnectorArg as C;
        match self {
            Self::BindFirst
            | Self::SkipHandlePreemptions
            | Self::OneRankOutput
            | Self::FreeAbortedWhileLoading
            | Self::ClaimHitsGroupByGroup => &[C::Offloading, C::Pd, C::Multi, C::MultiSenders],
            Self::DropZeroExternalAlloc | Self::LookupIgnoresJobs => &[C::Offloading, C::Multi],
            Self::SwallowLoadFailures => &[C::Pd],
            Self::StripExtraSaves => &[C::MultiSenders],
        }
    }
}

/// A value enum's name as typed on the command line (its `Debug` form for a skipped value).
fn value_name(v: impl ValueEnum + std::fmt::Debug) -> String {
    v.to_possible_value()
        .map_or_else(|| format!("{v:?}"), |p| p.get_name().to_owned())
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
        Command::Check(args) => run_check(&args),
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

/// A `kvrelay check` flag or configuration that cannot run.
#[derive(Debug)]
enum CheckError {
    /// A flag that does not apply to the chosen model.
    NotForModel {
        flag: &'static str,
        model: ModelArg,
        applies_to: &'static [ModelArg],
        why: Option<&'static str>,
    },
    /// The model's configuration is invalid.
    InvalidConfig { model: ModelArg, reason: String },
    /// `--threads 0`.
    ZeroThreads,
    /// `--max-depth 0`.
    ZeroDepth,
    /// `--trace-of NAME` matches no property of the model.
    UnknownProperty {
        name: String,
        available: Vec<&'static str>,
    },
    /// `--trace-of NAME` matches several properties.
    AmbiguousProperty {
        name: String,
        matches: Vec<&'static str>,
    },
    /// `--trace-out FILE` cannot be written (its folder does not exist), found before the run.
    TraceOutFolder { path: PathBuf },
    /// `--explore ADDR` refused or failed.
    Explore(ExploreError),
}

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckError::NotForModel {
                flag,
                model,
                applies_to,
                why,
            } => {
                write!(f, "{flag} does not apply to --model {}", model.name())?;
                if applies_to.is_empty() {
                    write!(f, " (no model supports it yet)")?;
                } else {
                    let names: Vec<String> = applies_to.iter().map(|m| m.name()).collect();
                    write!(f, " (only to --model {})", names.join(", "))?;
                }
                if let Some(why) = why {
                    write!(f, ": {why}")?;
                }
                Ok(())
            }
            CheckError::InvalidConfig { model, reason } => {
                write!(
                    f,
                    "invalid configuration of the {} model: {reason}",
                    model.name()
                )
            }
            CheckError::ZeroThreads => write!(f, "--threads must be at least 1"),
            CheckError::ZeroDepth => write!(f, "--max-depth must be at least 1"),
            CheckError::UnknownProperty { name, available } => write!(
                f,
                "--trace-of {name:?} matches no property of this model; its properties are: {}",
                quoted(available)
            ),
            CheckError::AmbiguousProperty { name, matches } => write!(
                f,
                "--trace-of {name:?} matches several properties: {}; give more of the name",
                quoted(matches)
            ),
            CheckError::TraceOutFolder { path } => write!(
                f,
                "--trace-out {}: the folder it would be written to does not exist",
                path.display()
            ),
            CheckError::Explore(e) => write!(f, "--explore: {e}"),
        }
    }
}

impl std::error::Error for CheckError {}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The model-specific flags of `args` that were given: (flag, the models it applies to, why
/// not elsewhere).
fn model_flags_given(
    a: &CheckArgs,
) -> Vec<(&'static str, &'static [ModelArg], Option<&'static str>)> {
    const BOTH: &[ModelArg] = &[ModelArg::System, ModelArg::Completion];
    const SYSTEM: &[ModelArg] = &[ModelArg::System];
    const COMPLETION: &[ModelArg] = &[ModelArg::Completion];
    let mut given = Vec::new();
    for (set, flag, models) in [
        (a.ranks.is_some(), "--ranks", BOTH),
        (a.requests.is_some(), "--requests", BOTH),
        (a.mode.is_some(), "--mode", BOTH),
        (a.gpu_blocks.is_some(), "--gpu-blocks", SYSTEM),
        (a.block_size.is_some(), "--block-size", SYSTEM),
        (a.no_prefix_caching, "--no-prefix-caching", SYSTEM),
        (a.cpu_chunks.is_some(), "--cpu-chunks", SYSTEM),
        (a.blocks_per_chunk.is_some(), "--blocks-per-chunk", SYSTEM),
        (a.prompt_tokens.is_some(), "--prompt-tokens", SYSTEM),
        (a.shared_tokens.is_some(), "--shared-tokens", SYSTEM),
        (a.max_tokens.is_some(), "--max-tokens", SYSTEM),
        (
            a.max_batched_tokens.is_some(),
            "--max-batched-tokens",
            SYSTEM,
        ),
        (a.async_depth.is_some(), "--async-depth", SYSTEM),
        (a.aborts.is_some(), "--aborts", SYSTEM),
        (a.resets.is_some(), "--resets", SYSTEM),
        (a.connector.is_some(), "--connector", SYSTEM),
        (a.pd_role.is_some(), "--pd-role", SYSTEM),
        (a.load_failures.is_some(), "--load-failures", SYSTEM),
        (a.idle_steps.is_some(), "--idle-steps", SYSTEM),
        (a.policy.is_some(), "--policy", SYSTEM),
        (a.sliding_window.is_some(), "--sliding-window", SYSTEM),
        (a.unordered_completions, "--unordered-completions", SYSTEM),
        (!a.fault.is_empty(), "--fault", SYSTEM),
        (a.failures.is_some(), "--failures", COMPLETION),
        (a.faulty_double_report, "--faulty-double-report", COMPLETION),
        (a.faulty_bind_first, "--faulty-bind-first", COMPLETION),
    ] {
        if set {
            given.push((flag, models, None));
        }
    }
    if a.symmetry {
        given.push((
            "--symmetry",
            SYSTEM,
            Some(
                "symmetry reduction needs a state with a canonical representative \
                 (stateright's Representative); the completion model's ranks are not \
                 interchangeable (rank 0 is the output rank, ranks step in rank order)",
            ),
        ));
    }
    given
}

/// Refuses a flag given for a model it does not apply to.
fn refuse_foreign_flags(a: &CheckArgs) -> Result<(), CheckError> {
    match model_flags_given(a)
        .into_iter()
        .find(|(_, models, _)| !models.contains(&a.model))
    {
        Some((flag, applies_to, why)) => Err(CheckError::NotForModel {
            flag,
            model: a.model,
            applies_to,
            why,
        }),
        None => Ok(()),
    }
}

/// What to do with a model once it is built: the run's options and outputs, validated.
#[derive(Debug)]
struct Plan {
    options: CheckOptions,
    trace_out: Option<PathBuf>,
    /// The property `--trace-of` named, resolved to the model's name for it.
    trace_of: Option<&'static str>,
    explore: Option<SocketAddr>,
}

impl Plan {
    /// Validates the model-independent flags against `model`'s properties.
    fn new<M: Explain>(a: &CheckArgs, model: &M) -> Result<Self, CheckError> {
        if a.threads == 0 {
            return Err(CheckError::ZeroThreads);
        }
        if a.max_depth == Some(0) {
            return Err(CheckError::ZeroDepth);
        }
        let explore = a
            .explore
            .as_deref()
            .map(|addr| explorer_address(addr, a.allow_remote))
            .transpose()
            .map_err(CheckError::Explore)?;
        let names: Vec<&'static str> = model.properties().iter().map(|p| p.name).collect();
        let trace_of = a
            .trace_of
            .as_deref()
            .map(|name| resolve_property(name, &names))
            .transpose()?;
        if let Some(path) = &a.trace_out {
            let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
            if folder.is_some_and(|f| !f.is_dir()) {
                return Err(CheckError::TraceOutFolder { path: path.clone() });
            }
        }
        Ok(Self {
            options: CheckOptions {
                threads: a.threads,
                strategy: if a.dfs || a.symmetry {
                    Strategy::Dfs
                } else {
                    Strategy::Bfs
                },
                target_max_depth: a.max_depth,
                stop_at_first_violation: !a.keep_going,
            },
            trace_out: a.trace_out.clone(),
            trace_of,
            explore,
        })
    }
}

/// The property `name` designates: the one named exactly so, else the one whose name contains
/// it (case-insensitively).
fn resolve_property(name: &str, names: &[&'static str]) -> Result<&'static str, CheckError> {
    if let Some(&exact) = names.iter().find(|n| **n == name) {
        return Ok(exact);
    }
    let needle = name.to_lowercase();
    let matches: Vec<&'static str> = names
        .iter()
        .copied()
        .filter(|n| n.to_lowercase().contains(&needle))
        .collect();
    match matches.as_slice() {
        [one] => Ok(one),
        [] => Err(CheckError::UnknownProperty {
            name: name.to_owned(),
            available: names.to_vec(),
        }),
        _ => Err(CheckError::AmbiguousProperty {
            name: name.to_owned(),
            matches,
        }),
    }
}

fn run_check(args: &CheckArgs) -> ExitCode {
    let outcome = refuse_foreign_flags(args).and_then(|()| match args.model {
        ModelArg::System => check_system_model(args),
        ModelArg::Completion => check_completion_model(args),
    });
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvrelay check: {e}");
            ExitCode::from(2)
        }
    }
}

fn check_system_model(a: &CheckArgs) -> Result<ExitCode, CheckError> {
    let mut c = match a.config {
        Preset::Ci => SystemConfig::ci(),
        Preset::Deep => SystemConfig::deep(),
    };
    let set = |field: &mut u32, flag: Option<u32>| {
        if let Some(v) = flag {
            *field = v;
        }
    };
    set(&mut c.ranks, a.ranks);
    set(&mut c.requests, a.requests);
    set(&mut c.gpu_blocks, a.gpu_blocks);
    set(&mut c.block_size, a.block_size);
    set(&mut c.cpu_chunks, a.cpu_chunks);
    set(&mut c.blocks_per_chunk, a.blocks_per_chunk);
    set(&mut c.prompt_tokens, a.prompt_tokens);
    set(&mut c.shared_tokens, a.shared_tokens);
    set(&mut c.max_tokens, a.max_tokens);
    set(&mut c.max_batched_tokens, a.max_batched_tokens);
    set(&mut c.async_depth, a.async_depth);
    set(&mut c.aborts, a.aborts);
    set(&mut c.resets, a.resets);
    set(&mut c.idle_steps, a.idle_steps);
    if let Some(m) = a.mode {
        c.mode = mode(m);
    }
    if let Some(p) = a.policy {
        c.policy = match p {
            PolicyArg::Lru => PolicyKind::Lru,
            PolicyArg::Arc => PolicyKind::Arc,
        };
    }
    if a.sliding_window.is_some() {
        c.sliding_window = a.sliding_window;
    }
    if a.unordered_completions {
        c.ordered_completions = false;
    }
    if a.no_prefix_caching {
        c.prefix_caching = false;
    }
    set(&mut c.load_failures, a.load_failures);
    let connector = a.connector.unwrap_or(ConnectorArg::Offloading);
    if matches!(connector, ConnectorArg::Pd | ConnectorArg::Multi) && a.load_failures.is_none() {
        c.load_failures = 1;
    }
    let invalid = |reason: String| CheckError::InvalidConfig {
        model: ModelArg::System,
        reason,
    };
    let mut sched_fault = None;
    let mut pd_fault = None;
    let mut multi_fault = None;
    for &f in &a.fault {
        match f {
            FaultArg::BindFirst => c.faults.bind_first = true,
            FaultArg::SkipHandlePreemptions => c.faults.skip_handle_preemptions = true,
            FaultArg::OneRankOutput => c.faults.one_rank_output = true,
            FaultArg::FreeAbortedWhileLoading => {
                c.faults.scheduler = Some(CoreFault::FreeAbortedWhileLoading);
            }
            FaultArg::ClaimHitsGroupByGroup => {
                c.faults.scheduler = Some(CoreFault::ClaimHitsGroupByGroup);
            }
            FaultArg::DropZeroExternalAlloc | FaultArg::LookupIgnoresJobs => {
                let s = if f == FaultArg::DropZeroExternalAlloc {
                    SchedFault::DropZeroExternalAlloc
                } else {
                    SchedFault::LookupIgnoresJobs
                };
                match sched_fault {
                    Some(other) if other != s => {
                        return Err(invalid(format!(
                            "at most one scheduler-side --fault can be injected, not both \
                             {other:?} and {s:?}"
                        )));
                    }
                    _ => sched_fault = Some(s),
                }
            }
            FaultArg::SwallowLoadFailures => pd_fault = Some(PdFault::SwallowLoadFailures),
            FaultArg::StripExtraSaves => multi_fault = Some(MultiFault::StripExtraSaves),
        }
    }
    if let Some(&f) = a
        .fault
        .iter()
        .find(|f| !f.connectors().contains(&connector))
    {
        let names: Vec<String> = f.connectors().iter().map(|c| value_name(*c)).collect();
        return Err(invalid(format!(
            "--fault {} applies to --connector {}, not {}",
            value_name(f),
            names.join(", "),
            value_name(connector)
        )));
    }
    if a.pd_role.is_some() && connector != ConnectorArg::Pd {
        return Err(invalid(
            "--pd-role applies to --connector pd (the multi connectors fix their children's \
             roles)"
                .to_owned(),
        ));
    }
    match connector {
        ConnectorArg::Offloading => {
            let pair = OffloadingPair { fault: sched_fault };
            check_pair(a, pair, c)
        }
        ConnectorArg::Pd => {
            let role = a.pd_role.unwrap_or(PdRoleArg::Both);
            let pair = PdPair {
                fault: pd_fault,
                role: PdRole {
                    load: role != PdRoleArg::Prefill,
                    send: role != PdRoleArg::Decode,
                    failures_as_blocks: c.sliding_window.is_none(),
                },
            };
            check_pair(a, pair, c)
        }
        ConnectorArg::Multi => {
            let mut pair = MultiPair::pd_then_offloading();
            pair.children[1] = ChildKind::Offloading(sched_fault);
            check_pair(a, pair, c)
        }
        ConnectorArg::MultiSenders => {
            let pair = MultiPair {
                fault: multi_fault,
                ..MultiPair::two_senders()
            };
            check_pair(a, pair, c)
        }
    }
}

/// Checks the system model of `pair` under `c` as the flags say.
fn check_pair<P: Connectors>(
    a: &CheckArgs,
    pair: P,
    c: SystemConfig,
) -> Result<ExitCode, CheckError> {
    let model =
        SystemModel::new(pair.clone(), c.clone()).map_err(|reason| CheckError::InvalidConfig {
            model: ModelArg::System,
            reason,
        })?;
    let plan = Plan::new(a, &model)?;
    execute(
        model,
        &format!("system model of the {} connector, {c:?}", pair.name()),
        plan,
        if a.symmetry {
            check_with_symmetry::<SystemModel<P>>
        } else {
            check::<SystemModel<P>>
        },
    )
}

fn mode(m: ModeArg) -> Mode {
    match m {
        ModeArg::Compat => Mode::Compat,
        ModeArg::Strict => Mode::Strict,
    }
}

fn check_completion_model(a: &CheckArgs) -> Result<ExitCode, CheckError> {
    let mut c = match a.config {
        Preset::Ci => CompletionConfig::ci(),
        Preset::Deep => CompletionConfig::deep(),
    };
    if let Some(w) = a.ranks {
        c.ranks = w;
    }
    if let Some(r) = a.requests {
        c.requests = r;
    }
    if let Some(m) = a.mode {
        c.mode = mode(m);
    }
    if let Some(f) = a.failures {
        c.failures = f;
    }
    c.faulty_double_report |= a.faulty_double_report;
    c.faulty_bind_first |= a.faulty_bind_first;
    c.validate().map_err(|reason| CheckError::InvalidConfig {
        model: ModelArg::Completion,
        reason,
    })?;
    let model = CompletionModel::new(c);
    let plan = Plan::new(a, &model)?;
    execute(model, &format!("{c:?}"), plan, check::<CompletionModel>)
}

/// A checker run: [`check`] or [`kvrelay_model_check::check_with_symmetry`].
type CheckFn<M> = fn(M, &CheckOptions, &mut dyn FnMut(&Progress)) -> CheckReport;

/// Runs (or explores) `model` as `plan` says with `run` (`check`, or `check_with_symmetry` for
/// a model whose state has a representative), prints the report and writes the trace.
fn execute<M: Explain>(
    model: M,
    config: &str,
    plan: Plan,
    run: CheckFn<M>,
) -> Result<ExitCode, CheckError> {
    if let Some(addr) = plan.explore {
        let threads = plan.options.threads;
        let err = serve_explorer(model, addr, threads, |url| {
            println!("kvrelay check: serving the explorer of {config} on {url} (Ctrl-C to stop)");
            let _ = std::io::stdout().flush();
        })
        .unwrap_err();
        return Err(CheckError::Explore(err));
    }
    let o = &plan.options;
    eprintln!(
        "kvrelay check: {config}; {}, {} thread{}{}{}",
        o.strategy,
        o.threads,
        if o.threads == 1 { "" } else { "s" },
        o.target_max_depth
            .map_or_else(String::new, |d| format!(", max depth {d}")),
        if o.stop_at_first_violation {
            ""
        } else {
            ", keep going after violations"
        }
    );
    let mut printed = false;
    let mut on_progress = |p: &Progress| {
        let line = format!(
            "  states {:>10}  unique {:>9}  depth {:>4}  {:>10.0} states/s  {:>6.1} s",
            p.states,
            p.unique_states,
            p.max_depth,
            p.states_per_second(),
            p.elapsed_seconds
        );
        printed = true;
        eprint!("\r{line}");
        let _ = std::io::stderr().flush();
    };
    let report = run(model, o, &mut on_progress);
    if printed {
        eprintln!();
    }
    let mut code = print_report(&report);
    let written = plan
        .trace_out
        .as_deref()
        .map(|path| write_trace(&report, path, plan.trace_of));
    if let Some(Err(e)) = written {
        eprintln!("kvrelay check: {e}");
        code = ExitCode::from(2);
    }
    Ok(code)
}

/// Writes the diagram `--trace-out` asks for; a missing discovery is reported, not an error.
fn write_trace(
    report: &CheckReport,
    path: &std::path::Path,
    trace_of: Option<&'static str>,
) -> Result<(), String> {
    let chosen = match trace_of {
        Some(name) => report.property(name),
        None => report
            .properties
            .iter()
            .find(|p| !p.holds && p.expectation != "sometimes" && p.trace.is_some()),
    };
    let Some(p) = chosen.filter(|p| p.trace.is_some()) else {
        let why = match trace_of {
            None => "no property was violated".to_owned(),
            Some(name) => {
                let stopped = if report.stop == Stop::FirstViolation {
                    " before the run stopped at the first violation (try --keep-going)"
                } else {
                    ""
                };
                match report.property(name).map(|p| p.expectation) {
                    Some("sometimes") => format!("no example of {name:?} was found{stopped}"),
                    _ => format!("no counterexample to {name:?} was found{stopped}"),
                }
            }
        };
        eprintln!("kvrelay check: {why}; {} not written", path.display());
        return Ok(());
    };
    let diagram = report.mermaid(p.name).unwrap_or_default();
    std::fs::write(path, diagram)
        .map_err(|e| format!("cannot write --trace-out {}: {e}", path.display()))?;
    eprintln!(
        "kvrelay check: wrote the {} of {:?} ({} actions) to {} as a Mermaid sequence diagram",
        if p.expectation == "sometimes" {
            "example"
        } else {
            "counterexample"
        },
        p.name,
        p.trace.as_ref().map_or(0, Vec::len),
        path.display()
    );
    Ok(())
}

fn print_report(r: &CheckReport) -> ExitCode {
    let rate = if r.seconds > 0.0 {
        r.states as f64 / r.seconds
    } else {
        0.0
    };
    println!(
        "{} — {} states, {} unique, max depth {}, {:.2} s, {:.0} states/s ({}{}, {} thread{})",
        r.stop,
        r.states,
        r.unique_states,
        r.max_depth,
        r.seconds,
        rate,
        r.strategy,
        if r.symmetry { ", symmetry" } else { "" },
        r.threads,
        if r.threads == 1 { "" } else { "s" }
    );
    println!();
    println!("{:<10} {:<10} property", "result", "kind");
    for p in &r.properties {
        let verdict = match (p.expectation, p.holds) {
            ("sometimes", true) => "example",
            ("sometimes", false) => "NO EXAMPLE",
            (_, true) => "holds",
            (_, false) => "VIOLATED",
        };
        println!("{verdict:<10} {:<10} {}", p.expectation, p.name);
    }
    for p in &r.properties {
        if let (false, Some(path)) = (p.holds, &p.path) {
            println!();
            println!(
                "counterexample for \"{}\" ({} action{}):",
                p.name,
                path.len(),
                if path.len() == 1 { "" } else { "s" }
            );
            for (i, line) in path.iter().enumerate() {
                println!("  {:>3}. {line}", i + 1);
            }
            if let Some(encoded) = &p.encoded_path {
                println!("  (in the explorer, --explore ADDR: #/steps/{encoded})");
            }
        }
    }
    if r.passed_within_bound() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
