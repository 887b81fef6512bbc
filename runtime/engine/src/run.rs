//! Running a workload to its end: [`run`] replays its requests on their virtual clock through a
//! fresh [`Engine`] and returns the [`Report`]; [`requests`] reads or generates them.
//! [`run_until`] is [`run`] that a [`StopSignal`] can interrupt ([`crate::stop`]).

use std::collections::VecDeque;
use std::time::Instant;

use kvrelay_core::RequestId;

use std::sync::Arc;

use crate::engine::{Figures, Stopped};
use crate::metrics::{Metrics, Server};
use crate::report::{self, Latency, Report, perfetto};
use crate::stop::{STOP_GRACE, StopRequest, StopSignal};
use crate::transport::{self, TokioClock, Transport};
use crate::workload::{self, TraceRecord};
use crate::{Engine, RunConfig, RunError};

/// Idle steps in a row with nothing in flight after which the engine is stuck.
const STUCK_STEPS: u64 = 2;

/// Wall time of idle steps in a row after which a run is stalled even with something in flight
/// (a transfer whose completion never comes). A shared tier that finishes a batch of work
/// during the idle steps is progress: the clock starts again.
const STALL_WALL: std::time::Duration = std::time::Duration::from_secs(1);

/// The idle steps in a row of a run, watched for a stall.
#[derive(Debug, Default)]
struct Stall {
    idle: u64,
    stuck: u64,
    since: Option<Instant>,
    /// The shared tier's batches done when `since` was last set.
    tier_batches: u64,
}

impl Stall {
    /// After an idle step: `Err(Stalled)` naming the requests when the engine is stuck
    /// (nothing runnable, nothing in flight, nothing arriving) for [`STUCK_STEPS`], or has been
    /// idle for [`STALL_WALL`].
    fn idle_step(&mut self, engine: &Engine, arriving: bool) -> Result<(), RunError> {
        self.idle += 1;
        let batches = engine.tier_figures().map_or(0, |t| t.batches);
        if batches != self.tier_batches {
            self.tier_batches = batches;
            self.since = None;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        self.stuck = match engine.stuck() {
            Some(_) if !arriving => self.stuck + 1,
            _ => 0,
        };
        if self.stuck >= STUCK_STEPS || (!arriving && since.elapsed() > STALL_WALL) {
            return Err(RunError::Stalled {
                steps: self.idle,
                requests: engine.live_requests(),
            });
        }
        Ok(())
    }
}

/// What the run is told as it goes (e.g. a progress bar).
pub trait Progress: Send {
    /// Called after every engine step.
    fn step(&mut self, finished: u64, total: u64, steps: u64, preemptions: u64, loaded: u64);

    /// Called once when the metrics are served ([`RunConfig::metrics`]), with the address
    /// bound.
    fn metrics_serving(&mut self, _addr: std::net::SocketAddr) {}

    /// Called once when KV events are published ([`RunConfig::kv_events`]), with the
    /// endpoints as bound.
    fn kv_events_publishing(&mut self, _endpoint: &str, _replay: Option<&str>) {}
}

impl Progress for () {
    fn step(&mut self, _: u64, _: u64, _: u64, _: u64, _: u64) {}
}

/// The requests of a run: the trace, or the generated workload; the first `requests` of
/// them that arrive before `until_s`; of those, the share `trace_split` names.
pub fn requests(config: &RunConfig) -> Result<Vec<TraceRecord>, RunError> {
    share(config, whole_workload(config)?)
}

/// [`requests`], for a run of `config`: with a `trace_split` and no `max_model_len`, the
/// whole workload's longest request becomes `config.max_model_len`, so every share's engine
/// is built as the whole workload's would be (engines of one shape behind a router).
pub fn requests_of_run(config: &mut RunConfig) -> Result<Vec<TraceRecord>, RunError> {
    let all = whole_workload(config)?;
    if config.trace_split.is_some() && config.max_model_len.is_none() {
        config.max_model_len = Some(longest(&all));
    }
    share(config, all)
}

/// `records`' share for `config.trace_split` (all of them without one).
fn share(config: &RunConfig, records: Vec<TraceRecord>) -> Result<Vec<TraceRecord>, RunError> {
    let Some(split) = config.trace_split else {
        return Ok(records);
    };
    let n = records.len();
    let share = split.share(records);
    if share.is_empty() {
        return Err(RunError::Config(format!(
            "--trace-split {split}: no request left of {n} (--requests / --until)"
        )));
    }
    Ok(share)
}

/// The trace or the generated workload, cut by `requests` and `until_s`.
fn whole_workload(config: &RunConfig) -> Result<Vec<TraceRecord>, RunError> {
    let hb = config.hash_block();
    let mut all = match &config.trace {
        Some(p) => workload::read_trace(p, hb)?,
        None => workload::generate(&config.workload, hb, config.seed),
    };
    if let Some(s) = config.until_s {
        all.retain(|r| (r.timestamp as f64) < s * 1000.0);
    }
    if let Some(n) = config.requests {
        all.truncate(n);
    }
    if all.is_empty() {
        return Err(RunError::Config(
            "no request left to run (--requests / --until)".into(),
        ));
    }
    Ok(all)
}

/// The longest request of `records` (prompt and output tokens): the default `max_model_len`.
pub fn longest(records: &[TraceRecord]) -> u32 {
    records
        .iter()
        .map(|r| r.input_length.saturating_add(r.output_length))
        .max()
        .unwrap_or(2)
}

/// The tokio runtime a run uses: one thread for the engine (in-process ranks run on threads of
/// their own, copies on the ranks' copy threads, worker processes on their own).
pub fn runtime() -> Result<tokio::runtime::Runtime, RunError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RunError::Config(format!("tokio runtime: {e}")))
}

/// Runs `records` on a fresh [`Engine`] with W ranks; returns the report, or the error that
/// stopped the run.
pub fn run(
    config: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
) -> Result<Report, RunError> {
    run_with(config, records, progress, &*transport::for_config(config))
}

/// [`run()`] with the ranks reached over `transport` (the transport seam: a test's or a
/// simulation's transport that loses a rank, or builds its ranks on a transfer engine of its
/// own), on tokio's clock.
pub fn run_with(
    config: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
    transport: &dyn Transport,
) -> Result<Report, RunError> {
    run_on(config, records, progress, transport, StopSignal::never())
}

/// [`run()`], unless `stop` asks first (see [`crate::stop`]): then the run stops stepping,
/// stops its ranks (killing those still running [`STOP_GRACE`] later, or at once when an
/// immediate stop is asked) and returns [`RunError::Interrupted`]. A stop asked while the
/// ranks start kills those started at once.
pub fn run_until(
    config: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
    stop: StopSignal,
) -> Result<Report, RunError> {
    run_on(
        config,
        records,
        progress,
        &*transport::for_config(config),
        stop,
    )
}

/// [`run_until`] over `transport`, on a runtime of its own ([`runtime`]). Dropping the runtime
/// on the way out, whatever the way (the report, an error, a panic), drops every rank task
/// still there: a worker process's link kills its process when dropped.
fn run_on(
    config: &RunConfig,
    records: &[TraceRecord],
    progress: &mut dyn Progress,
    transport: &dyn Transport,
    mut stop: StopSignal,
) -> Result<Report, RunError> {
    let rt = runtime()?;
    let served = serve_metrics(config)?;
    if let Some((_, server)) = &served {
        progress.metrics_serving(server.addr());
    }
    rt.block_on(async {
        let max_model_len = config.max_model_len.unwrap_or_else(|| longest(records));
        let clock = Arc::new(TokioClock::default());
        let start = Engine::start_with(config, max_model_len, transport, clock);
        let mut engine = tokio::select! {
            biased;
            () = stop.at_least(StopRequest::Graceful) => {
                return Err(interrupted(&Figures::default(), records, 0));
            }
            e = start => e?,
        };
        if let Some((m, _)) = &served {
            engine.set_metrics(m.clone());
        }
        if let Some((e, r)) = engine.kv_events_endpoints() {
            progress.kv_events_publishing(e, r);
        }
        let started = Instant::now();
        let mut latency = Latency::new(records);
        let outcome = tokio::select! {
            biased;
            () = stop.at_least(StopRequest::Graceful) => Err(None),
            r = replay(config, records, &mut engine, progress, &mut latency) => r.map_err(Some),
        };
        // An error that came with the stop (a rank that heard the signal too) is the stop's.
        let asked = stop.request() != StopRequest::None;
        let stopped = engine.shutdown_on(&mut stop, STOP_GRACE).await;
        if let Err(e) = outcome {
            return Err(match e {
                Some(e) if !asked => e,
                _ => interrupted(&stopped.figures, records, stopped.ranks_killed),
            });
        }
        let Stopped { figures, ranks, .. } = stopped;
        if let Some(path) = &config.timeline {
            let mut recorders = vec![&figures.timeline];
            recorders.extend(ranks.iter().map(|r| &r.timeline));
            perfetto::write(path, &recorders, config.ranks).map_err(|e| RunError::Output {
                path: path.display().to_string(),
                why: e.to_string(),
            })?;
        }
        let report = report::build(
            config,
            records,
            &figures,
            &ranks,
            &latency,
            started.elapsed(),
        );
        if let Some((m, _)) = &served {
            report::publish_ranks(m, &ranks);
            linger(config, &mut stop).await;
        }
        Ok(report)
    })
}

/// The metrics and their server, when the run serves them: a port that cannot be bound is a
/// configuration error.
pub(crate) fn serve_metrics(c: &RunConfig) -> Result<Option<(Arc<Metrics>, Server)>, RunError> {
    let Some(addr) = &c.metrics else {
        return Ok(None);
    };
    let m = Arc::new(Metrics::new(&c.metrics_model_name));
    let server = Server::bind(addr, m.clone())
        .map_err(|e| RunError::Config(format!("metrics: cannot serve on {addr}: {e}")))?;
    Ok(Some((m, server)))
}

/// Serves the final figures for `metrics_linger_s` more, unless a stop comes first.
async fn linger(c: &RunConfig, stop: &mut StopSignal) {
    let s = c.metrics_linger_s;
    if !(s > 0.0 && s.is_finite()) {
        return;
    }
    tokio::select! {
        () = tokio::time::sleep(std::time::Duration::from_secs_f64(s.min(86_400.0))) => {}
        () = stop.at_least(StopRequest::Graceful) => {}
    }
}

/// The error of a run stopped by its [`StopSignal`], with how far it got.
fn interrupted(f: &Figures, records: &[TraceRecord], ranks_killed: u32) -> RunError {
    RunError::Interrupted {
        steps: f.steps,
        finished: f.finished,
        requests: records.len() as u64,
        ranks_killed,
    }
}

/// Submits each record when the virtual clock reaches its timestamp, and steps the engine
/// until every request finished; records when each request's first token and finish came out
/// in `latency`.
async fn replay(
    c: &RunConfig,
    records: &[TraceRecord],
    engine: &mut Engine,
    progress: &mut dyn Progress,
    latency: &mut Latency,
) -> Result<(), RunError> {
    let total = records.len() as u64;
    let mut pending: VecDeque<(usize, &TraceRecord)> = records.iter().enumerate().collect();
    let mut now = 0.0f64;
    let mut stall = Stall::default();
    loop {
        while let Some(&(i, r)) = pending.front()
            && r.timestamp as f64 <= now
        {
            pending.pop_front();
            // The whole workload's index: a share's requests are the whole's, token for token.
            let unique = c.trace_split.map_or(i, |s| s.index(i)) as u64;
            let prompt = workload::prompt_tokens(r, c.hash_block(), unique);
            match engine.add(RequestId(i as u32), prompt, r.output_length) {
                // Counted by the engine; the run goes on, as a server's does.
                Err(RunError::Refused { .. }) => continue,
                other => other?,
            }
        }
        if !engine.has_work() {
            match pending.front() {
                Some((_, r)) => {
                    now = r.timestamp as f64;
                    continue;
                }
                None => return Ok(()),
            }
        }
        let outcome = engine.step().await?;
        now += c.step_ms;
        latency.record(now, &outcome.outputs);
        let f = &engine.figures;
        progress.step(
            f.finished + f.refused,
            total,
            f.steps,
            f.preemptions,
            f.loads_reported,
        );
        if !outcome.idle {
            stall = Stall::default();
            continue;
        }
        let arriving = pending
            .front()
            .is_some_and(|(_, r)| r.timestamp as f64 <= now);
        stall.idle_step(engine, arriving)?;
        if !pending
            .front()
            .is_some_and(|(_, r)| r.timestamp as f64 <= now)
        {
            engine.wait_idle().await;
        }
    }
}
