//! The flags of `kvrelay run` and the command itself: config file, flags over it, the progress
//! bar, the report.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvrelay_core::PolicyKind;

use kvrelay_engine::tier::TierConfig;
use kvrelay_engine::{Backend, Progress, RunConfig, RunError, Workers, workload};

mod interrupt;

/// The long help's epilogue of `kvrelay run --help`.
pub(crate) const HELP: &str = "\
With no flag, runs the embedded workload: 160 chat conversations of 1 to 4 turns over 4 shared
system prompts, each turn re-sending the conversation so far, Poisson arrivals, on 2 ranks
with a GPU block budget small enough that requests are preempted and offloaded blocks are
loaded back. Every byte a forward pass reads and every loaded block is checked against what
its tokens' KV must be; a mismatch stops the run with exit status 1.

Requests arrive on a virtual clock (--step-ms per engine step), and a transfer completes a
fixed number of steps after it started (whenever its copies really finished), so a run takes
the same steps on any machine: its counts are the same on every run for a seed.

Admission is vLLM's: --max-model-len (default: the workload's longest request) must fit the GPU
pool, or the run is refused at start with the numbers; a longer prompt is refused at submit and
counted (`refused`). A run that can make no progress (nothing runnable, nothing in flight)
stops at once, naming the stuck requests.

Traces: --trace FILE.jsonl[.gz] replays a request trace in the format of the public Mooncake
traces, one JSON object a line: {\"timestamp\": ms, \"input_length\": N, \"output_length\":
N, \"hash_ids\": [..]}, one hash id per prompt block of --hash-block-tokens tokens (512, the
Mooncake traces', by default with --trace). The Mooncake FAST'25 conversation trace ships in
tests/traces/mooncake/. --requests N and --until SECONDS replay a slice. --write-trace FILE
writes the generated workload in that format, with 64-token hash blocks: replay it with
--trace FILE --hash-block-tokens 64 (the same requests, prompts and arrivals; with 512 the
trace is refused, its hash ids too many for its prompts). --trace-split K/N replays engine K
of N's share (a round robin over arrivals, after --requests and --until): N such runs, one a
process, are N engines behind a router that knows nothing of prefixes; with --tier they share
one store (tests/tier/split_trace.py runs the comparison).

Progress: a bar on a terminal; otherwise a plain line on stderr every 5 seconds.

Stopping: SIGINT (Ctrl-C) or SIGTERM stops the run cleanly: it stops stepping, closes its
ranks' links (a worker process finishes its step and exits), kills what is still running 2 s
later, removes its socket files, prints one line saying how far it got and exits. A second
signal kills the ranks at once; a third exits at once. A worker process whose engine dies
exits too (its link closes; on Linux, its parent-death signal).

Exit status: 0 when every request finished and every check held, 1 when the run stopped on an
error (a wrong byte, a rank or engine error, a broken invariant), 2 on bad flags or files (a pool that cannot hold max_model_len included), 130
when interrupted by SIGINT, 143 by SIGTERM.";

/// The flags `kvrelay run` shares with `kvrelay sweep`: the workload, the engine's shape and its
/// semantics. Each overrides the config file (`--config`), which overrides the defaults.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct EngineArgs {
    /// A TOML file with any of the settings below (snake_case keys; `[workload]` for the
    /// generated workload).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Replay this Mooncake-format trace instead of the generated workload.
    #[arg(long, value_name = "FILE.jsonl")]
    pub trace: Option<PathBuf>,
    /// Seed of the generated workload and the sampled tokens [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Ranks (tensor-parallel workers) [default: 2].
    #[arg(long)]
    pub ranks: Option<u32>,
    /// Where ranks run: in-process (tasks, the default) or process (`kvrelay worker`
    /// processes over Unix sockets).
    #[arg(long, value_parser = ["in-process", "process"])]
    pub workers: Option<String>,
    /// Where the KV lives: host (host memory, the default), cuda (a device arena per rank
    /// on CUDA device 0 and a pinned host pool; fails without a CUDA driver or device) or
    /// auto (cuda when present, else host, said on stderr).
    #[arg(long, value_parser = ["host", "cuda", "auto"])]
    pub backend: Option<String>,
    /// Conversations of the generated workload [default: 160].
    #[arg(long)]
    pub conversations: Option<u32>,
    /// The longest request admitted, prompt and output tokens (vLLM's max_model_len)
    /// [default: the workload's longest request].
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Running requests at most [default: 16, 256 with --trace (vLLM's)].
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Tokens per engine step at most [default: 1024, 8192 with --trace (vLLM's)].
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Replay only the requests that arrive before SECONDS.
    #[arg(long, value_name = "SECONDS")]
    pub until: Option<f64>,
    /// Layers [default: 4].
    #[arg(long)]
    pub layers: Option<u32>,
    /// Bytes of one block of one layer on one rank, a multiple of 8 × 16 [default: 2048;
    /// with --trace 128, one 8-byte word a token slot].
    #[arg(long)]
    pub block_bytes: Option<u64>,
    /// Tokens per trace hash block [default: 512 with --trace (the Mooncake traces'), 64 for
    /// the generated workload].
    #[arg(long)]
    pub hash_block_tokens: Option<u32>,
    /// Semantics: compat (vLLM 0.33.0's) or strict (kvrelay's departures where vLLM loses
    /// something) [default: compat].
    #[arg(long, value_parser = ["compat", "strict"])]
    pub mode: Option<String>,
    /// Steps scheduled ahead: 1 (synchronous) or 2 (async scheduling) [default: 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=2))]
    pub async_depth: Option<u32>,
    /// Virtual milliseconds per engine step [default: 25].
    #[arg(long)]
    pub step_ms: Option<f64>,
    /// Check every machine's invariants after every step.
    #[arg(long)]
    pub check: bool,
}

impl EngineArgs {
    /// The configuration these flags give: defaults, then `--config`, then the flags.
    pub(crate) fn config(&self) -> Result<RunConfig, String> {
        let mut c = match &self.config {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                toml::from_str::<RunConfig>(&text).map_err(|e| format!("{}: {e}", p.display()))?
            }
            None => RunConfig::default(),
        };
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f.clone() { c.$f = v; } )* };
        }
        set!(seed, ranks, layers, step_ms, async_depth);
        macro_rules! set_some {
            ($($f:ident),*) => { $( if let Some(v) = self.$f.clone() { c.$f = Some(v); } )* };
        }
        set_some!(
            max_model_len,
            hash_block_tokens,
            requests,
            block_bytes,
            max_num_seqs,
            max_num_batched_tokens
        );
        if let Some(s) = self.until {
            c.until_s = Some(s);
        }
        if let Some(t) = &self.trace {
            c.trace = Some(t.clone());
        }
        if let Some(n) = self.conversations {
            c.workload.conversations = n;
        }
        if let Some(w) = &self.workers {
            c.workers = if w == "process" {
                Workers::Process
            } else {
                Workers::InProcess
            };
        }
        if let Some(b) = &self.backend {
            c.backend = match b.as_str() {
                "cuda" => Backend::Cuda,
                "auto" => Backend::Auto,
                _ => Backend::Host,
            };
        }
        if let Some(m) = &self.mode {
            c.mode = if m == "strict" {
                kvrelay_core::Mode::Strict
            } else {
                kvrelay_core::Mode::Compat
            };
        }
        c.check |= self.check;
        Ok(c)
    }
}

/// The eviction policy a `--policy` value names (`lru` or `arc`).
pub(crate) fn policy(name: &str) -> Option<PolicyKind> {
    match name {
        "lru" => Some(PolicyKind::Lru),
        "arc" => Some(PolicyKind::Arc),
        _ => None,
    }
}

/// `kvrelay run` flags: [`EngineArgs`], the pools, the policy and the outputs.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Write the requests of this run (the generated workload) as a trace, then run them.
    #[arg(long, value_name = "FILE.jsonl")]
    pub write_trace: Option<PathBuf>,
    /// GPU blocks per rank, the null block included [default: 320, or room for two
    /// requests of --max-model-len if more; with --trace room for eight].
    #[arg(long)]
    pub gpu_blocks: Option<u32>,
    /// CPU offload blocks per rank [default: 4096, or four times the GPU pool if more].
    #[arg(long)]
    pub cpu_blocks: Option<u32>,
    /// CPU eviction policy [default: lru].
    #[arg(long, value_parser = ["lru", "arc"])]
    pub policy: Option<String>,
    /// Replay only engine K of N's share of the workload: the requests whose index, after
    /// --requests and --until, is K mod N (a round robin over arrivals). The default
    /// --max-model-len stays the whole workload's. In TOML: trace_split = "K/N".
    #[arg(long, value_name = "K/N")]
    pub trace_split: Option<String>,
    /// Write a Chrome / Perfetto timeline of the engine's and every rank's steps and transfers
    /// (open in ui.perfetto.dev).
    #[arg(long, value_name = "FILE.json")]
    pub timeline: Option<PathBuf>,
    /// Print the report as JSON on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,
    /// Serve Prometheus metrics (vLLM's names) on HOST:PORT while the run lasts; port 0 picks
    /// a free one, printed on stderr. See docs/METRICS.md.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics: Option<String>,
    /// Keep serving the metrics this many seconds after the run ended, so a scraper reads the
    /// final totals [default: 0].
    #[arg(long, value_name = "SECONDS")]
    pub metrics_linger: Option<f64>,
    /// Publish KV events in vLLM's wire format on a ZMQ PUB socket: tcp://*:PORT binds (port 0
    /// picks a free one, printed on stderr), tcp://HOST:PORT connects to a subscriber that
    /// bound it. See docs/KV_EVENTS.md.
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events: Option<String>,
    /// Answer replay requests (vLLM's ROUTER protocol) on this endpoint, always bound.
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_replay: Option<String>,
    /// The topic frame of every event message [default: empty].
    #[arg(long, value_name = "TOPIC")]
    pub kv_events_topic: Option<String>,
    /// Batches (steps with events) kept for replay [default: 10000].
    #[arg(long, value_name = "N")]
    pub kv_events_buffer_steps: Option<usize>,
    /// vLLM's NONE_HASH seed: the PYTHONHASHSEED of the vLLM engines whose block hashes are
    /// compared with kvrelay's [default: vllm-none-hash, vLLM's when it is unset].
    #[arg(long, value_name = "SEED")]
    pub kv_events_hash_seed: Option<String>,
    /// Keep answering replay requests this many seconds after the run ended [default: 0].
    #[arg(long, value_name = "SECONDS")]
    pub kv_events_linger: Option<f64>,
    #[command(flatten)]
    pub tier: TierArgs,
}

/// The `--tier*` flags `kvrelay run` shares with `kvrelay pd`.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct TierArgs {
    /// A shared tier behind the CPU pools: a Redis Cluster (any node finds the others), or
    /// `memory` (in-process, for trying it out). Engines of one KV layout share its chunks;
    /// every value is checked when read. See docs/TIERING.md.
    #[arg(long, value_name = "redis://HOST:PORT[,HOST:PORT...]")]
    pub tier: Option<String>,
    /// The tier's key namespace [default: derived from the KV layout].
    #[arg(long, value_name = "NAME")]
    pub tier_namespace: Option<String>,
    /// Deadline of each tier command, and of connecting, in milliseconds [default: 2000].
    #[arg(long, value_name = "MS")]
    pub tier_timeout_ms: Option<u64>,
}

impl TierArgs {
    /// The `--tier*` flags over the configuration's `[tier]`.
    pub(crate) fn apply(&self, c: &mut RunConfig) -> Result<(), String> {
        if let Some(spec) = &self.tier {
            let parsed = TierConfig::parse(spec)?;
            c.tier.get_or_insert_with(Default::default).endpoints = parsed.endpoints;
        }
        let Some(t) = c.tier.as_mut() else {
            return match self.tier_namespace.is_some() || self.tier_timeout_ms.is_some() {
                true => Err("--tier-*: name the tier with --tier first".into()),
                false => Ok(()),
            };
        };
        if t.endpoints.is_empty() {
            return Err("[tier]: endpoints is empty".into());
        }
        if let Some(n) = &self.tier_namespace {
            if n.is_empty() || n.contains(['{', '}', ' ']) {
                return Err(format!(
                    "--tier-namespace {n:?}: a name without braces or spaces"
                ));
            }
            t.namespace = Some(n.clone());
        }
        if let Some(ms) = self.tier_timeout_ms {
            if ms == 0 {
                return Err("--tier-timeout-ms: 1 or more".into());
            }
            t.timeout_ms = ms;
        }
        Ok(())
    }
}

impl RunArgs {
    /// The run's configuration: defaults, then `--config`, then the flags.
    pub(crate) fn config(&self) -> Result<RunConfig, String> {
        let mut c = self.engine.config()?;
        if let Some(n) = self.gpu_blocks {
            c.gpu_blocks = Some(n);
        }
        if let Some(n) = self.cpu_blocks {
            c.cpu_blocks = Some(n);
        }
        if let Some(p) = self.policy.as_deref().and_then(policy) {
            c.policy = p;
        }
        if let Some(s) = &self.trace_split {
            c.trace_split = Some(s.parse().map_err(|e| format!("--trace-split: {e}"))?);
        }
        if let Some(p) = &self.timeline {
            c.timeline = Some(p.clone());
        }
        if let Some(a) = &self.metrics {
            c.metrics = Some(a.clone());
        }
        if let Some(s) = self.metrics_linger {
            if !(s >= 0.0 && s.is_finite()) {
                return Err(format!("--metrics-linger {s}: seconds, 0 or more"));
            }
            c.metrics_linger_s = s;
        }
        self.kv_events(&mut c)?;
        self.tier.apply(&mut c)?;
        Ok(c)
    }

    /// The `--kv-events*` flags over the configuration's `[kv_events]`.
    fn kv_events(&self, c: &mut RunConfig) -> Result<(), String> {
        if let Some(e) = &self.kv_events {
            c.kv_events.get_or_insert_with(Default::default).endpoint = e.clone();
        }
        let any_other = self.kv_events_replay.is_some()
            || self.kv_events_topic.is_some()
            || self.kv_events_buffer_steps.is_some()
            || self.kv_events_hash_seed.is_some()
            || self.kv_events_linger.is_some();
        let Some(k) = c.kv_events.as_mut() else {
            return match any_other {
                true => Err("--kv-events-*: publish with --kv-events ENDPOINT first".into()),
                false => Ok(()),
            };
        };
        if let Some(r) = &self.kv_events_replay {
            k.replay = Some(r.clone());
        }
        if let Some(t) = &self.kv_events_topic {
            k.topic = t.clone();
        }
        if let Some(n) = self.kv_events_buffer_steps {
            if n == 0 {
                return Err("--kv-events-buffer-steps: 1 or more".into());
            }
            k.buffer_steps = n;
        }
        if let Some(h) = &self.kv_events_hash_seed {
            k.hash_seed = h.clone();
        }
        if let Some(s) = self.kv_events_linger {
            if !(s >= 0.0 && s.is_finite()) {
                return Err(format!("--kv-events-linger {s}: seconds, 0 or more"));
            }
            k.linger_s = s;
        }
        Ok(())
    }
}

/// A bar on a terminal, else a plain line on stderr every [`PLAIN_EVERY`].
struct Bar {
    bar: ProgressBar,
    plain: bool,
    started: std::time::Instant,
    last: std::time::Instant,
}

/// How often progress is printed as a plain line.
const PLAIN_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

impl Bar {
    /// A line above the bar, or on stderr when there is no bar.
    fn say(&self, line: String) {
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }
}

impl Progress for Bar {
    fn step(&mut self, finished: u64, total: u64, steps: u64, preemptions: u64, loaded: u64) {
        if self.plain {
            if steps.is_multiple_of(64) && self.last.elapsed() >= PLAIN_EVERY {
                self.last = std::time::Instant::now();
                eprintln!(
                    "kvrelay run: {finished}/{total} requests done, step {steps}, {preemptions} \
                     preemptions, {loaded} loads done, {:.0} s",
                    self.started.elapsed().as_secs_f64()
                );
            }
            return;
        }
        self.bar.set_length(total);
        self.bar.set_position(finished);
        if steps.is_multiple_of(16) {
            self.bar.set_message(format!(
                "step {steps}, {preemptions} preemptions, {loaded} loads done"
            ));
        }
    }

    fn metrics_serving(&mut self, addr: std::net::SocketAddr) {
        self.say(format!("kvrelay run: metrics on http://{addr}/metrics"));
    }

    fn kv_events_publishing(&mut self, endpoint: &str, replay: Option<&str>) {
        let replay = replay.map_or(String::new(), |r| format!(", replay on {r}"));
        self.say(format!("kvrelay run: KV events on {endpoint}{replay}"));
    }
}

/// `kvrelay run`: see [`HELP`].
pub(crate) fn run(args: &RunArgs) -> ExitCode {
    let mut config = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvrelay run: {e}");
            return ExitCode::from(2);
        }
    };
    let records = match kvrelay_engine::requests_of_run(&mut config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvrelay run: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(p) = &args.write_trace
        && let Err(e) = workload::write_trace(p, &records)
    {
        eprintln!("kvrelay run: {e}");
        return ExitCode::from(2);
    }
    let terminal = std::io::stderr().is_terminal();
    let bar = if args.json || !terminal {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(records.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} requests  {msg}  [{elapsed}]")
            .expect("a valid template"),
    );
    let now = std::time::Instant::now();
    let mut progress = Bar {
        bar: bar.clone(),
        plain: !terminal,
        started: now,
        last: now,
    };
    let interrupts = match interrupt::listen() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("kvrelay run: cannot listen for SIGINT and SIGTERM: {e}");
            return ExitCode::from(1);
        }
    };
    let outcome = kvrelay_engine::run_until(&config, &records, &mut progress, interrupts.signal());
    bar.finish_and_clear();
    match outcome {
        Ok(report) => print_report(args, &report),
        Err(e @ RunError::Interrupted { .. }) => {
            let signal = interrupts.first();
            let by = signal.map_or("stop requested", interrupt::Signal::name);
            eprintln!("kvrelay run: {by}: {e}");
            ExitCode::from(signal.map_or(1, interrupt::Signal::exit_code))
        }
        // Refused at start: the flags asked for an engine that cannot be built.
        Err(e @ (RunError::Config(_) | RunError::PoolTooSmall { .. })) => {
            eprintln!("kvrelay run: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("kvrelay run: stopped: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints the report of a run that ended; its exit status.
fn print_report(args: &RunArgs, report: &kvrelay_engine::Report) -> ExitCode {
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(report).expect("a report serializes")
        );
    } else {
        println!("{report}");
    }
    if report.refused > 0 {
        eprintln!(
            "kvrelay run: {} request(s) refused: prompts of max_model_len ({}) tokens or more",
            report.refused, report.max_model_len
        );
    }
    if report.finished + report.refused == report.requests {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "kvrelay run: {} of {} requests unfinished",
            report.requests - report.finished - report.refused,
            report.requests
        );
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects the help text: the defaults it states are RunConfig's.
    #[test]
    fn the_stated_defaults_are_the_real_ones() {
        let c = RunConfig::default();
        let stated = [
            ("seed", c.seed.to_string(), "0"),
            ("ranks", c.ranks.to_string(), "2"),
            ("conversations", c.workload.conversations.to_string(), "160"),
            ("gpu_blocks", c.gpu_blocks_for(100).to_string(), "320"),
            ("cpu_blocks", c.cpu_blocks_for(320).to_string(), "4096"),
            ("layers", c.layers.to_string(), "4"),
            ("block_bytes", c.block_bytes().to_string(), "2048"),
            ("hash_block_tokens", c.hash_block().to_string(), "64"),
            ("async_depth", c.async_depth.to_string(), "1"),
            ("step_ms", c.step_ms.to_string(), "25"),
        ];
        for (name, real, help) in stated {
            assert_eq!(real, help, "{name}");
        }
        assert_eq!(c.policy, PolicyKind::Lru);
        assert_eq!(c.backend, Backend::Host);
        assert_eq!(c.block_size, 16);
        assert_eq!(RunArgs::default().config().unwrap(), c);
    }
}
