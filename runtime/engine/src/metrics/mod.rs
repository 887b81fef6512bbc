//! Prometheus metrics of a running engine (`kvrelay run --metrics HOST:PORT`,
//! [`crate::RunConfig::metrics`]): vLLM 0.33.0's names, help texts, labels and buckets where
//! vLLM has the figure, kvrelay's own (`kvrelay:` prefix) where it does not. Every series carries
//! vLLM's two engine labels, `model_name` ([`crate::RunConfig::metrics_model_name`]) and
//! `engine` (`"0"`).
//!
//! # Who writes what, and when
//!
//! * The engine side ([`crate::Engine`]) sets its figures after every step: requests running
//!   and waiting, GPU and CPU pool usage, prompt, generated and computed tokens, preemptions,
//!   finishes by reason, the iteration-tokens and engine-step histograms, invariant checks.
//! * The rank side's figures — bytes, blocks and time stored and loaded, copies, flushed stores,
//!   failed transfers, verified blocks and slots, the ranks' invariant checks — come with each
//!   step's reports: every [`crate::rank::RankReport`] (and over the worker wire every
//!   `Up::Output`) carries the rank's counters since its previous report
//!   ([`crate::rank::RankDelta`], as vLLM's workers send per-step `transfer_stats`); the engine
//!   adds them up as it applies the step and publishes the sums ([`Metrics::ranks`]).
//! * When the run ends, `report::publish_ranks` raises them to the ranks' final figures. The
//!   deltas already sum to those, so it adds nothing (what it had to add is returned and said in
//!   a warning; `runtime/cli/tests/metrics.rs` checks there is none).
//!
//! [`Metrics`] is written by the engine task and read by the scrape ([`Server`], a std thread);
//! its values are atomics. [`Metrics::encode`] gives the exposition to an embedder that serves
//! its own `/metrics`.

mod serve;

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{prometheus_text, text as openmetrics_text};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

use crate::rank::RankDelta;

pub use self::serve::{READ_DEADLINE, Server};

/// A series' own labels (besides `model_name` and `engine`).
type Labels = Vec<(&'static str, &'static str)>;
type FGauge = Gauge<f64, AtomicU64>;
type FCounter = Counter<f64, AtomicU64>;

/// vLLM's `iteration_tokens` buckets (`vllm/v1/metrics/buckets.py`).
const ITERATION_TOKENS: [f64; 13] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// kvrelay's buckets for times of microseconds to a tenth of a second.
const STEP_SECONDS: [f64; 14] = [
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
];

/// vLLM's `finished_reason` label values, in `FinishReason` order of kvrelay's core (stop,
/// length, abort, error), then vLLM's `repetition` (never produced here).
pub const FINISHED_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

/// Declares [`Total`] and the list of its values.
macro_rules! totals {
    ($($(#[$doc:meta])* $v:ident,)*) => {
        /// The counters whose running total the engine and the ranks hand over (see
        /// [`Metrics::set`]); the rank side's from `StoreBytes` on, from the ranks' reports.
        #[derive(Clone, Copy, Debug, Eq, PartialEq)]
        pub enum Total {
            $($(#[$doc])* $v,)*
        }

        const ALL_TOTALS: &[Total] = &[$(Total::$v,)*];
    };
}

totals! {
    PromptTokens,
    GenerationTokens,
    Preemptions,
    PromptTokensCached,
    Steps,
    IdleSteps,
    ScheduledAhead,
    RequestsRefused,
    TokensComputed,
    ReportsRejected,
    EngineInvariantChecks,
    StoreBytes,
    LoadBytes,
    BlocksStored,
    BlocksLoaded,
    Copies,
    FlushedStores,
    FailedTransfers,
    LoadedBlocksVerified,
    WrittenSlotsVerified,
    ReadBlocksChecked,
    RankInvariantChecks,
}

/// The gauges the engine sets after each step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Levels {
    pub running: u32,
    pub waiting: u32,
    /// Fraction of the GPU pool in use (vLLM's formula: the null block excluded).
    pub kv_cache_usage: f64,
    /// CPU tier chunks: capacity, free, evictable, pinned, being written.
    pub cpu_chunks: u32,
    pub cpu_free: u32,
    pub cpu_evictable: u32,
    pub cpu_pinned: u32,
    pub cpu_write_pending: u32,
}

/// The registry and every series. See the module docs.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    totals: Vec<(Total, Counter)>,
    running: Gauge,
    waiting: Gauge,
    kv_usage: FGauge,
    cpu_usage: FGauge,
    cpu_write: FGauge,
    cpu_read: FGauge,
    cpu_tier: Family<Labels, Gauge>,
    success: Family<Labels, Counter>,
    iteration_tokens: Histogram,
    step_seconds: Histogram,
    store_time: FCounter,
    load_time: FCounter,
    gpu_blocks: Gauge,
    cpu_blocks: Gauge,
}

/// Name, help (without vLLM's final full stop: the encoder adds one) and own labels of each
/// total's series. Counters are exposed with `_total` appended, as vLLM's are.
fn describe(t: Total) -> (&'static str, &'static str, Labels) {
    use Total::*;
    let (name, help) = match t {
        PromptTokens => ("vllm:prompt_tokens", "Number of prefill tokens processed"),
        GenerationTokens => (
            "vllm:generation_tokens",
            "Number of generation tokens processed",
        ),
        Preemptions => (
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine",
        ),
        PromptTokensCached => (
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external)",
        ),
        Steps => ("kvrelay:engine_steps", "Engine steps"),
        IdleSteps => (
            "kvrelay:idle_steps",
            "Engine steps that scheduled and received nothing",
        ),
        ScheduledAhead => (
            "kvrelay:scheduled_ahead",
            "Steps scheduled while the ranks ran the previous one (async scheduling)",
        ),
        RequestsRefused => (
            "kvrelay:requests_refused",
            "Requests refused at submit: a prompt of max_model_len tokens or more",
        ),
        TokensComputed => (
            "kvrelay:tokens_computed",
            "Tokens the forward passes computed (prefill, recomputation, decode)",
        ),
        ReportsRejected => (
            "kvrelay:reports_rejected",
            "Rank reports refused before the core: duplicate or stale",
        ),
        EngineInvariantChecks | RankInvariantChecks => (
            "kvrelay:invariant_checks",
            "Invariant checks performed, by side (engine or rank)",
        ),
        StoreBytes => (
            "vllm:kv_offload_store_bytes",
            "Total bytes stored from GPU to offload storage",
        ),
        LoadBytes => (
            "vllm:kv_offload_load_bytes",
            "Total bytes loaded from offload storage to GPU",
        ),
        BlocksStored => (
            "kvrelay:blocks_stored",
            "Blocks stored to the CPU tier, over all ranks",
        ),
        BlocksLoaded => (
            "kvrelay:blocks_loaded",
            "Blocks loaded from the CPU tier, over all ranks",
        ),
        Copies => (
            "kvrelay:copies",
            "Copies performed for all transfers (runs coalesced)",
        ),
        FlushedStores => (
            "kvrelay:flushed_stores",
            "Stores waited for before their blocks were reused",
        ),
        FailedTransfers => ("kvrelay:failed_transfers", "Transfers that failed part-way"),
        LoadedBlocksVerified => (
            "kvrelay:loaded_blocks_verified",
            "Loaded blocks checked byte for byte when their load completed",
        ),
        WrittenSlotsVerified => (
            "kvrelay:written_slots_verified",
            "Token slots (per layer) checked right after a forward wrote them",
        ),
        ReadBlocksChecked => (
            "kvrelay:read_blocks_checked",
            "Blocks checked against their tokens when a request first read them",
        ),
    };
    let labels = match t {
        EngineInvariantChecks => vec![("side", "engine")],
        RankInvariantChecks => vec![("side", "rank")],
        _ => Vec::new(),
    };
    (name, help, labels)
}

impl Metrics {
    /// Every series registered and created (vLLM creates its engine series up front, so a
    /// scrape before the first request shows them at 0).
    pub fn new(model_name: &str) -> Self {
        let mut root = Registry::default();
        let labels = [
            ("model_name".into(), model_name.to_owned().into()),
            ("engine".into(), "0".into()),
        ];
        let reg = root.sub_registry_with_labels(labels.into_iter());
        let totals = register_totals(reg);
        let states = ["free", "evictable", "pinned", "write_pending"];
        let cpu_tier = labelled(
            reg,
            "kvrelay:cpu_tier_chunks",
            "CPU tier chunks by state",
            ("state", &states),
        );
        let success_help = "Count of successfully processed requests";
        let reasons = ("finished_reason", &FINISHED_REASONS[..]);
        let success = labelled(reg, "vllm:request_success", success_help, reasons);
        Self {
            totals,
            running: put(
                reg,
                "vllm:num_requests_running",
                "Number of requests in model execution batches",
                Gauge::default(),
            ),
            waiting: put(
                reg,
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed",
                Gauge::default(),
            ),
            kv_usage: put(
                reg,
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage",
                FGauge::default(),
            ),
            cpu_usage: put(
                reg,
                "vllm:kv_offload_cpu_cache_usage_perc",
                CPU_USAGE_HELP,
                FGauge::default(),
            ),
            cpu_write: put(
                reg,
                "vllm:kv_offload_cpu_cache_write_usage_perc",
                CPU_WRITE_HELP,
                FGauge::default(),
            ),
            cpu_read: put(
                reg,
                "vllm:kv_offload_cpu_cache_read_usage_perc",
                CPU_READ_HELP,
                FGauge::default(),
            ),
            cpu_tier,
            success,
            iteration_tokens: put(
                reg,
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step",
                Histogram::new(ITERATION_TOKENS),
            ),
            step_seconds: put(
                reg,
                "kvrelay:engine_step_seconds",
                "Engine-side time per step: schedule, rank outputs, apply",
                Histogram::new(STEP_SECONDS),
            ),
            store_time: put(
                reg,
                "vllm:kv_offload_store_time",
                "Total store time from GPU to offload storage, in seconds",
                FCounter::default(),
            ),
            load_time: put(
                reg,
                "vllm:kv_offload_load_time",
                "Total load time from offload storage to GPU, in seconds",
                FCounter::default(),
            ),
            gpu_blocks: put(
                reg,
                "kvrelay:gpu_blocks",
                "GPU blocks per rank, the null block included",
                Gauge::default(),
            ),
            cpu_blocks: put(
                reg,
                "kvrelay:cpu_blocks",
                "CPU tier blocks per rank",
                Gauge::default(),
            ),
            registry: root,
        }
    }

    /// Raises `t`'s counter to the running total `total` (a counter never goes down: a lower
    /// total is ignored).
    pub fn set(&self, t: Total, total: u64) {
        if let Some((_, c)) = self.totals.iter().find(|(k, _)| *k == t) {
            let now = c.get();
            if total > now {
                c.inc_by(total - now);
            }
        }
    }

    /// [`Metrics::set`] for each pair.
    pub fn set_all(&self, totals: &[(Total, u64)]) {
        for &(t, v) in totals {
            self.set(t, v);
        }
    }

    /// The current value of `t`'s counter.
    pub fn get(&self, t: Total) -> u64 {
        self.totals
            .iter()
            .find(|(k, _)| *k == t)
            .map_or(0, |(_, c)| c.get())
    }

    /// The gauges, after a step.
    pub fn levels(&self, l: &Levels) {
        self.running.set(i64::from(l.running));
        self.waiting.set(i64::from(l.waiting));
        self.kv_usage.set(l.kv_cache_usage);
        let cap = f64::from(l.cpu_chunks.max(1));
        let used = l.cpu_chunks.saturating_sub(l.cpu_free + l.cpu_evictable);
        let usage = f64::from(used) / cap;
        let write = f64::from(l.cpu_write_pending) / cap;
        self.cpu_usage.set(usage);
        self.cpu_write.set(write);
        self.cpu_read.set((usage - write).max(0.0));
        for (s, v) in [
            ("free", l.cpu_free),
            ("evictable", l.cpu_evictable),
            ("pinned", l.cpu_pinned),
            ("write_pending", l.cpu_write_pending),
        ] {
            self.cpu_tier
                .get_or_create(&vec![("state", s)])
                .set(i64::from(v));
        }
    }

    /// The pools per rank, once.
    pub fn pools(&self, gpu_blocks: u32, cpu_blocks: u32) {
        self.gpu_blocks.set(i64::from(gpu_blocks));
        self.cpu_blocks.set(i64::from(cpu_blocks));
    }

    /// A step was scheduled with `tokens` tokens.
    pub fn scheduled(&self, tokens: u32) {
        self.iteration_tokens.observe(f64::from(tokens));
    }

    /// An engine step took `seconds` on the engine side.
    pub fn step_time(&self, seconds: f64) {
        self.step_seconds.observe(seconds);
    }

    /// A request finished; `reason` is one of [`FINISHED_REASONS`].
    pub fn finished(&self, reason: &'static str) {
        self.success
            .get_or_create(&vec![("finished_reason", reason)])
            .inc();
    }

    /// Requests finished, over every reason.
    pub fn finished_total(&self) -> u64 {
        FINISHED_REASONS
            .iter()
            .map(|r| {
                self.success
                    .get_or_create(&vec![("finished_reason", *r)])
                    .get()
            })
            .sum()
    }

    /// Raises the rank-side counters to the ranks' totals `r` (summed over ranks); returns
    /// what each counter had to be raised by (none when nothing changed since the last call).
    pub fn ranks(&self, r: &RankDelta) -> Vec<(Total, u64)> {
        let totals = [
            (Total::StoreBytes, r.bytes_stored),
            (Total::LoadBytes, r.bytes_loaded),
            (Total::BlocksStored, r.blocks_stored),
            (Total::BlocksLoaded, r.blocks_loaded),
            (Total::Copies, r.copies),
            (Total::FlushedStores, r.flushed_stores),
            (Total::FailedTransfers, r.failed_transfers),
            (Total::LoadedBlocksVerified, r.loaded_blocks_verified),
            (Total::WrittenSlotsVerified, r.written_slots_verified),
            (Total::ReadBlocksChecked, r.read_blocks_checked),
            (Total::RankInvariantChecks, r.invariant_checks),
        ];
        let raised = totals
            .iter()
            .filter(|&&(t, v)| v > self.get(t))
            .map(|&(t, v)| (t, v - self.get(t)))
            .collect();
        self.set_all(&totals);
        self.transfer_time(r.store_time.as_secs_f64(), r.load_time.as_secs_f64());
        raised
    }

    /// The ranks' store and load time so far, seconds.
    pub fn transfer_time(&self, store_s: f64, load_s: f64) {
        self.store_time
            .inc_by((store_s - self.store_time.get()).max(0.0));
        self.load_time
            .inc_by((load_s - self.load_time.get()).max(0.0));
    }

    /// The exposition in Prometheus text format 0.0.4 (`openmetrics` false) or OpenMetrics 1.0
    /// text; with its content type.
    pub fn encode(&self, openmetrics: bool) -> (String, &'static str) {
        let mut out = String::new();
        // Writing to a String cannot fail.
        if openmetrics {
            let _ = openmetrics_text::encode(&mut out, &self.registry);
            (out, OPENMETRICS_TYPE)
        } else {
            let _ = prometheus_text::encode(&mut out, &self.registry);
            (out, prometheus_text::CONTENT_TYPE)
        }
    }
}

/// Registers `m` as `name`; returns it (a handle on the registered series).
fn put<M: Metric + Clone>(reg: &mut Registry, name: &str, help: &str, m: M) -> M {
    reg.register(name, help, m.clone());
    m
}

/// Registers a family with one label of its own, every value's series created.
fn labelled<M: Metric + TypedMetric + Default>(
    reg: &mut Registry,
    name: &str,
    help: &str,
    (key, values): (&'static str, &[&'static str]),
) -> Family<Labels, M> {
    let f = put(reg, name, help, Family::<Labels, M>::default());
    for &v in values {
        drop(f.get_or_create(&vec![(key, v)]));
    }
    f
}

fn register_totals(reg: &mut Registry) -> Vec<(Total, Counter)> {
    let mut families: Vec<(&'static str, Family<Labels, Counter>)> = Vec::new();
    let mut out = Vec::new();
    for &t in ALL_TOTALS {
        let (name, help, labels) = describe(t);
        let fam = match families.iter().find(|(n, _)| *n == name) {
            Some((_, f)) => f.clone(),
            None => {
                let f = Family::<Labels, Counter>::default();
                reg.register(name, help, f.clone());
                families.push((name, f.clone()));
                f
            }
        };
        out.push((t, fam.get_or_create(&labels).clone()));
    }
    out
}

const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

const CPU_USAGE_HELP: &str = "Fraction of CPU KV-cache space currently pinned by active \
    transfers (0.0 = idle, 1.0 = saturated). Sustained high values indicate transfers (stores or \
    promotions) may be dropped due to insufficient capacity";
const CPU_WRITE_HELP: &str = "Fraction of CPU KV-cache space currently pinned by in-flight \
    stores that have not yet completed (0.0 = idle, 1.0 = saturated)";
const CPU_READ_HELP: &str = "Fraction of CPU KV-cache space currently pinned by in-flight \
    loads that have not yet completed (0.0 = idle, 1.0 = saturated)";
