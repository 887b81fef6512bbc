//! The flags of `kvrelay check` (clap's definitions, the long help) and which of them apply to
//! which model.
//!
//! Parsed by the `kvrelay` binary into a [`CheckArgs`] and handed to [`super::run`]; nothing
//! here validates values against a model (that is [`super::run`]'s, once the model is built).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// The long help's epilogue of `kvrelay check --help`: the models, and when to use what.
pub(crate) const HELP: &str = "\
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
                                     depth-first with symmetry over ranks and, by default with
                                     deep, partial-order reduction (~90 MB; breadth-first
                                     needs many GB): 2.6 million unique states, about 30
                                     seconds on 2 cores. With --aborts 1: 23.4 million
                                     unique states, about 5 minutes (~360 MB).
  kvrelay check --connector pd --pd-role both --config deep --symmetry
                                     the same with remote loads, sends and one load failure:
                                     9.0 million unique states, about 1.5 minutes on 2 cores
                                     (~200 MB).
  --partial-order BOOL               (system model) explore only one rank's actions where they
                                     commute with everything else that can happen first; keeps
                                     every verdict. Default: on with --config deep, off with
                                     --config ci (its counts are pinned).
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
  --diagram FILE                     also write the first counterexample as a Mermaid sequence
                                     diagram (paste into a Markdown ```mermaid block or
                                     mermaid.live); --diagram-of NAME picks a property instead
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
pub(super) enum ModelArg {
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
    /// The model's name, as `--model` takes it.
    pub(super) fn name(self) -> String {
        value_name(self)
    }
}

#[derive(Args, Debug)]
pub(crate) struct CheckArgs {
    /// The model to check.
    #[arg(long, value_enum, default_value_t = ModelArg::System)]
    pub(super) model: ModelArg,
    /// A named configuration of the model; the model's flags below override its fields.
    #[arg(long, value_enum, default_value_t = Preset::Ci)]
    pub(super) config: Preset,

    /// Worker ranks (W).
    #[arg(long, help_heading = "Both models")]
    pub(super) ranks: Option<u32>,
    /// Requests (R). Completion model: each with a load and a save on every rank; system
    /// model: request i arrives after request i − 1.
    #[arg(long, help_heading = "Both models")]
    pub(super) requests: Option<u32>,
    /// Aggregator mode (system model: also the scheduler's).
    #[arg(long, value_enum, help_heading = "Both models")]
    pub(super) mode: Option<ModeArg>,

    /// The connector under check [default: offloading].
    #[arg(long, value_enum, help_heading = "System model")]
    pub(super) connector: Option<ConnectorArg>,
    /// What the P/D connector does (--connector pd) [default: both].
    #[arg(long, value_enum, help_heading = "System model")]
    pub(super) pd_role: Option<PdRoleArg>,
    /// The decode side never acknowledges a held request (vLLM issue #46283): compat then holds
    /// its blocks for ever, strict releases them when the lease runs out (--connector pd).
    #[arg(long, help_heading = "System model")]
    pub(super) pd_silent_remote: bool,
    /// Strict mode's lease on a held request, in steps (--connector pd) [default: 2].
    #[arg(long, value_name = "STEPS", help_heading = "System model")]
    pub(super) pd_lease: Option<u32>,
    /// GPU blocks, the null block included (small, so that preemption and block reuse happen).
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) gpu_blocks: Option<u32>,
    /// Tokens per GPU block.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) block_size: Option<u32>,
    /// Turn the scheduler's GPU prefix cache off: every hit then comes from the connector.
    #[arg(long, help_heading = "System model")]
    pub(super) no_prefix_caching: bool,
    /// CPU chunks of the offloading manager.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) cpu_chunks: Option<u32>,
    /// GPU blocks per offloaded chunk.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) blocks_per_chunk: Option<u32>,
    /// Prompt tokens per request (a multiple of --block-size).
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) prompt_tokens: Option<u32>,
    /// Leading prompt tokens all requests share (so one can load what another stored).
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) shared_tokens: Option<u32>,
    /// Output tokens per request.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) max_tokens: Option<u32>,
    /// Token budget per step.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) max_batched_tokens: Option<u32>,
    /// Steps scheduled before the oldest one's output is applied (1 = synchronous).
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) async_depth: Option<u32>,
    /// Aborts the environment may issue.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) aborts: Option<u32>,
    /// reset_connector_cache calls the environment may issue.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) resets: Option<u32>,
    /// Load transfers the environment may fail (pd: remote loads; offloading: any load, absorbed
    /// under --mode strict, vLLM's assertion as an error under compat) [default: 1 for pd, 0
    /// otherwise].
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) load_failures: Option<u32>,
    /// Store transfers the environment may fail (offloading: the failed store's chunks are
    /// freed under --mode strict; vLLM's assertion as an error under compat) [default: 0].
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) store_failures: Option<u32>,
    /// Consecutive idle engine steps (no token scheduled, nothing changed) explored without
    /// progress (an arrival, an abort, a reset, a step that is not idle, a delivered output
    /// that carried anything); past it, one more step while a rank has a completed transfer
    /// and no step to report it in.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) idle_steps: Option<u32>,
    /// The offloading manager's replacement policy.
    #[arg(long, value_enum, help_heading = "System model")]
    pub(super) policy: Option<PolicyArg>,
    /// Add a sliding-window KV-cache group (window in tokens) besides full attention.
    #[arg(long, value_name = "TOKENS", help_heading = "System model")]
    pub(super) sliding_window: Option<u32>,
    /// Let each rank's transfers complete in any order (the presets: in submission order per
    /// rank and direction).
    #[arg(long, help_heading = "System model")]
    pub(super) unordered_completions: bool,
    /// A shared tier behind the offloading connector's CPU tier (issue 36), over an adversarial
    /// store: by default one key may vanish, one probe or job may fail (a failed cascade lands
    /// torn) and, under --mode strict, one probe answer may be lost (strict gives it up after
    /// 2 steps; under compat a lost answer hangs, vLLM #49829: ask for it with --tier-lost 1).
    /// Turns off symmetry and the partial-order reduction.
    #[arg(long, help_heading = "System model")]
    pub(super) tier: bool,
    /// With --tier: keys the store may drop.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) tier_vanish: Option<u32>,
    /// With --tier: probes and tier jobs that may fail.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) tier_failures: Option<u32>,
    /// With --tier: probe answers that may never come.
    #[arg(long, value_name = "N", help_heading = "System model")]
    pub(super) tier_lost: Option<u32>,
    /// Inject a historical bug (repeatable; at most one of the scheduler-side faults
    /// drop-zero-external-alloc, lookup-ignores-jobs).
    #[arg(long, value_enum, value_name = "FAULT", help_heading = "System model")]
    pub(super) fault: Vec<FaultArg>,

    /// Let loads fail (reported in finished_recving and failed_recving).
    #[arg(long, value_name = "BOOL", help_heading = "Completion model")]
    pub(super) failures: Option<bool>,
    /// Inject the double-report fault (a rank reports a completion twice).
    #[arg(long, help_heading = "Completion model")]
    pub(super) faulty_double_report: bool,
    /// Inject the bind-first fault (runners call bind before handle_preemptions).
    #[arg(long, help_heading = "Completion model")]
    pub(super) faulty_bind_first: bool,

    /// Checker threads (with BFS and more than one thread, counterexamples may not be the
    /// shortest).
    #[arg(long, default_value_t = 2, help_heading = "Search")]
    pub(super) threads: usize,
    /// Depth-first search: little memory, long counterexamples.
    ///
    /// Without it the search is breadth-first: the shortest counterexamples, most memory.
    #[arg(long, help_heading = "Search")]
    pub(super) dfs: bool,
    /// Symmetry reduction (implies --dfs; only for models with interchangeable parts).
    #[arg(long, help_heading = "Search")]
    pub(super) symmetry: bool,
    /// Partial-order reduction (system model): where one rank can only go on with the oldest
    /// step and nothing else can touch it, explore that rank's actions only. Keeps every
    /// verdict (see the system model's docs). Default: on with `--config deep`, off with
    /// `--config ci` (whose state counts are pinned).
    #[arg(long, value_name = "BOOL", help_heading = "Search")]
    pub(super) partial_order: Option<bool>,
    /// Explore paths of at most DEPTH states only (a bounded run, not a proof).
    #[arg(long, value_name = "DEPTH", help_heading = "Search")]
    pub(super) max_depth: Option<usize>,
    /// Do not stop at the first violation: look for every property's counterexample or example.
    #[arg(long, help_heading = "Search")]
    pub(super) keep_going: bool,

    /// Write the first violated property's counterexample as a Mermaid sequence diagram.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub(super) diagram: Option<PathBuf>,
    /// With --diagram: the property whose counterexample (or `sometimes` example) to write,
    /// by its name or a unique case-insensitive part of it (e.g. I-21).
    #[arg(
        long,
        value_name = "NAME",
        requires = "diagram",
        help_heading = "Output"
    )]
    pub(super) diagram_of: Option<String>,

    /// Serve stateright's web explorer of the model on ADDR (HOST:PORT) instead of checking.
    #[arg(
        long,
        value_name = "ADDR",
        conflicts_with_all = ["diagram", "dfs", "symmetry", "max_depth", "keep_going"],
        help_heading = "Explorer"
    )]
    pub(super) explore: Option<String>,
    /// Allow --explore on a non-loopback address (the explorer has no authentication).
    #[arg(long, requires = "explore", help_heading = "Explorer")]
    pub(super) allow_remote: bool,
}

/// `--connector`: the connector pair the system model composes.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub(super) enum ConnectorArg {
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
pub(super) enum PdRoleArg {
    /// Decode and prefill side at once: loads every prompt, sends every finished request.
    Both,
    /// Decode side only: loads every prompt remotely (no sends, no delayed frees).
    Decode,
    /// Prefill side only: sends every finished request (no remote loads).
    Prefill,
}

/// `--config`.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub(super) enum Preset {
    /// The configuration CI runs exhaustively.
    Ci,
    /// A larger configuration.
    Deep,
}

/// `--policy`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum PolicyArg {
    /// Least recently used (vLLM's default).
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// `--fault`: a historical bug injected into the system model.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub(super) enum FaultArg {
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
    pub(super) fn connectors(self) -> &'static [ConnectorArg] {
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
pub(super) fn value_name(v: impl ValueEnum + std::fmt::Debug) -> String {
    v.to_possible_value()
        .map_or_else(|| format!("{v:?}"), |p| p.get_name().to_owned())
}

/// `--mode`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum ModeArg {
    /// vLLM 0.33.0 exactly.
    Compat,
    /// Per-rank dedup of completion reports.
    Strict,
}

/// The model-specific flags of `args` that were given: (flag, the models it applies to, why
/// not elsewhere).
pub(super) fn model_flags_given(
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
        (a.pd_silent_remote, "--pd-silent-remote", SYSTEM),
        (a.pd_lease.is_some(), "--pd-lease", SYSTEM),
        (a.load_failures.is_some(), "--load-failures", SYSTEM),
        (a.store_failures.is_some(), "--store-failures", SYSTEM),
        (a.idle_steps.is_some(), "--idle-steps", SYSTEM),
        (a.policy.is_some(), "--policy", SYSTEM),
        (a.sliding_window.is_some(), "--sliding-window", SYSTEM),
        (a.unordered_completions, "--unordered-completions", SYSTEM),
        (a.tier, "--tier", SYSTEM),
        (a.tier_vanish.is_some(), "--tier-vanish", SYSTEM),
        (a.tier_failures.is_some(), "--tier-failures", SYSTEM),
        (a.tier_lost.is_some(), "--tier-lost", SYSTEM),
        (!a.fault.is_empty(), "--fault", SYSTEM),
        (a.partial_order.is_some(), "--partial-order", SYSTEM),
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
