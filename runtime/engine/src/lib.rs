//! kvrelay-engine: the engine an inference server embeds — an engine loop over the core's engine
//! step, W ranks moving real KV bytes between a "GPU" arena and a CPU offload pool, every load and
//! every read verified (`kvrelay run` is this crate on a workload).
//!
//! # The loop
//!
//! ```text
//! engine task                                 rank task r (one per rank)          copy thread r
//! add arrived requests (virtual clock)
//! EngineCore::schedule ── StepMsg ──────────▶ RankDriver::begin, poll:
//!                                               Start → copy_plan ─── CopyJob ──▶ memcpy runs
//!                                               Forward → write words, check reads
//!                                               Wait → until ◀────────── CopyDone (load checked)
//! EngineCore::rank_output ◀── RankReport ───── Done(output)
//! EngineCore::apply(sampled tokens)
//! ```
//!
//! Requests arrive on a virtual clock: each engine step advances it by `step_ms`, and an empty
//! engine jumps to the next arrival, so a run is the same workload on any machine; a transfer
//! completes a fixed number of steps after it started (`rank::Completions`), so a run also takes
//! the same steps on any machine. A run that can make no progress stops, naming the requests.
//!
//! # Rooms
//!
//! | room | what |
//! | --- | --- |
//! | [`config`] | [`RunConfig`]: what a run is, its defaults the embedded workload |
//! | [`mod@run`] | [`run()`]: a workload to its end on its virtual clock; [`requests`] |
//! | [`stop`] | stopping a run before its end: [`Stopper`] asks, [`StopSignal`] hears; the grace period |
//! | [`api`] | the embedding API: submit a request and stream its tokens, abort, reset |
//! | [`engine`] | [`Engine`]: the core's engine step with W ranks attached, one step at a time |
//! | [`connector`] | the engine's connector: offloading (`kvrelay run`) or P/D (`kvrelay pd`) |
//! | [`rank`] | the rank task: a `RankDriver` over the offloading worker, the arena, the transfer engine |
//! | `content` | what every KV byte must be, and the per-request token book ranks derive it from |
//! | [`transfer`] | the seam between a rank and its memory (`KvArena`, `TransferEngine`), the backends `host` and `cuda` |
//! | [`transport`] | the seam between the engine and its ranks (in-process, worker processes over `wire`) and the clock it waits on |
//! | [`workload`] | the requests: Mooncake-format traces, the generated default |
//! | [`report`] | the figures of a run (readable and `--json`), its Perfetto timeline |
//! | [`metrics`] | Prometheus metrics with vLLM's names, served on `--metrics HOST:PORT` |
//! | [`events`] | KV events in vLLM's wire format, published on `--kv-events tcp://HOST:PORT` |
//! | [`pd`] | prefill/decode disaggregation: a prefill engine's KV server, a decode rank's reads |
//! | [`tier`] | the shared tier behind the CPU pools (a Redis Cluster), `--tier redis://HOST:PORT` |
//! | [`error`] | [`RunError`] |
//!
//! A simulation (`kvrelay-sim`) replaces the three seams — [`transport::Transport`],
//! [`transport::Clock`], [`transfer::TransferEngine`] — to inject faults; nothing in this crate
//! switches a fault on.

pub mod api;
pub mod config;
pub mod connector;
pub mod content;
pub mod engine;
pub mod error;
pub mod events;
pub mod metrics;
pub mod pd;
pub mod rank;
pub mod report;
pub mod run;
pub mod stop;
pub mod tier;
pub mod transfer;
pub mod transport;
pub mod workload;

pub use self::config::{RunConfig, Workers};
pub use self::engine::{Engine, StepOutcome, Stopped};
pub use self::error::RunError;
pub use self::report::Report;
pub use self::run::{Progress, requests, requests_of_run, run, run_until, run_with, runtime};
pub use self::stop::{StopRequest, StopSignal, Stopper, stop_channel};
pub use self::transfer::{Backend, TransferError};
