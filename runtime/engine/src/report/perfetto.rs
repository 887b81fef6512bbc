//! `--timeline FILE`: a Chrome / Perfetto timeline (the JSON "trace event" format, open it in
//! ui.perfetto.dev or chrome://tracing) of the engine's steps and each rank's steps and
//! transfers. Process 0 is the engine; process `r + 1` is rank `r`, with its steps on thread
//! 0, its stores on thread 1 and its loads on thread 2. Timestamps are wall-clock
//! microseconds, so worker processes line up with the engine.

use std::io::Write;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Events one recorder keeps at most; later ones are counted, not kept.
pub const MAX_EVENTS: usize = 1 << 20;

/// One complete event ("ph": "X").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    pub ts: u64,
    pub dur: u64,
    pub pid: u32,
    pub tid: u32,
}

/// A bounded list of events, off unless asked for.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Recorder {
    on: bool,
    pub events: Vec<TraceEvent>,
    pub dropped: u64,
}

/// Wall-clock microseconds.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Recorder {
    pub fn new(on: bool) -> Self {
        Self {
            on,
            ..Self::default()
        }
    }

    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Records `name` from `start` (from [`now_us`]) until now.
    pub fn span(&mut self, name: impl FnOnce() -> String, start: u64, pid: u32, tid: u32) {
        if !self.on {
            return;
        }
        if self.events.len() >= MAX_EVENTS {
            self.dropped += 1;
            return;
        }
        self.events.push(TraceEvent {
            name: name(),
            ts: start,
            dur: now_us().saturating_sub(start),
            pid,
            tid,
        });
    }
}

#[derive(Serialize)]
struct Event<'a> {
    name: &'a str,
    ph: &'static str,
    ts: u64,
    dur: u64,
    pid: u32,
    tid: u32,
}

#[derive(Serialize)]
struct Meta<'a> {
    name: &'static str,
    ph: &'static str,
    pid: u32,
    tid: u32,
    args: MetaArgs<'a>,
}

#[derive(Serialize)]
struct MetaArgs<'a> {
    name: &'a str,
}

/// Writes the events of every recorder as one trace.
pub fn write(path: &Path, recorders: &[&Recorder], ranks: u32) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "{{\"traceEvents\": [")?;
    let mut first = true;
    let mut line = |f: &mut std::io::BufWriter<std::fs::File>, json: String| {
        let sep = if first { "" } else { ",\n" };
        first = false;
        write!(f, "{sep}{json}")
    };
    let mut names = vec![(0, 0, "engine".to_string(), "steps".to_string())];
    for r in 0..ranks {
        for (tid, t) in ["steps", "stores", "loads"].iter().enumerate() {
            names.push((r + 1, tid as u32, format!("rank {r}"), t.to_string()));
        }
    }
    for (pid, tid, process, thread) in &names {
        for (kind, name) in [("process_name", process), ("thread_name", thread)] {
            let m = Meta {
                name: kind,
                ph: "M",
                pid: *pid,
                tid: *tid,
                args: MetaArgs { name },
            };
            line(&mut f, serde_json::to_string(&m).expect("serializes"))?;
        }
    }
    for rec in recorders {
        for e in &rec.events {
            let ev = Event {
                name: &e.name,
                ph: "X",
                ts: e.ts,
                dur: e.dur.max(1),
                pid: e.pid,
                tid: e.tid,
            };
            line(&mut f, serde_json::to_string(&ev).expect("serializes"))?;
        }
    }
    writeln!(f, "\n]}}")?;
    f.flush()
}
