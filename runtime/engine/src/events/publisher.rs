//! The ZMQ side of vLLM 0.33.0's `ZmqEventPublisher`: a PUB socket sending `(topic, sequence
//! number as 8 big-endian bytes, msgpack batch)` and a ROUTER replay socket that answers a
//! request `(empty, start sequence as 8 bytes)` with every buffered batch from `start` on, then
//! the end marker `(empty, -1 as 8 bytes, empty)`.
//!
//! ZMQ through the pure-Rust `zeromq` crate: no libzmq to install or link, and it speaks ZMTP 3
//! to libzmq peers (pyzmq's, vLLM's subscribers) — `tests/kv_events` proves that with pyzmq.
//! The publisher is a task of the engine's runtime fed by a bounded channel; the engine awaits
//! room in it, as vLLM's scheduler blocks on its bounded queue.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::KvEventsConfig;
use super::wire::{WireEvent, encode_batch};

/// Batches waiting for the publisher task at most (vLLM's `max_queue_size` is 100,000 batches;
/// a batch here is one engine step's events, so fewer do).
const QUEUE: usize = 1024;

/// How long a `connect` endpoint may take to answer (vLLM's PUB connects lazily; a run here
/// must not start publishing into nothing without saying so).
const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

/// vLLM's end-of-replay sequence number.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// One step's events, stamped with the wall clock (vLLM's `time.time()`).
#[derive(Debug)]
pub(super) struct Batch {
    pub ts: f64,
    pub events: Vec<WireEvent>,
}

/// What the publisher did, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PublisherStats {
    /// Batches published (the last sequence number + 1).
    pub batches: u64,
    /// Events in them.
    pub events: u64,
    /// Bytes of msgpack payload.
    pub bytes: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Replay requests refused as malformed (logged, as vLLM does).
    pub bad_replays: u64,
}

/// The sockets and the replay buffer.
struct State {
    topic: bytes::Bytes,
    buffer: VecDeque<(u64, bytes::Bytes)>,
    buffer_steps: usize,
    stats: PublisherStats,
}

/// A bound or connected publisher: its endpoints, and the task.
#[derive(Debug)]
pub(super) struct Running {
    pub tx: mpsc::Sender<Batch>,
    pub task: JoinHandle<PublisherStats>,
    pub endpoint: String,
    pub replay: Option<String>,
    /// How long the task keeps answering replays after the engine's sender is dropped.
    pub linger: Duration,
}

/// Opens the sockets of `c` (binding wildcard and `ipc://` endpoints, connecting to the rest,
/// as vLLM does) and starts the task. Must run inside the engine's tokio runtime.
pub(super) async fn start(c: &KvEventsConfig) -> Result<Running, String> {
    let mut publ = zeromq::PubSocket::new();
    let endpoint = open(&mut publ, &c.endpoint).await?;
    let (router, replay) = match &c.replay {
        Some(r) => {
            let mut s = RouterSocket::new();
            let bound = s
                .bind(&wildcard(r))
                .await
                .map_err(|e| format!("kv-events replay: cannot bind {r}: {e}"))?;
            (Some(s), Some(bound.to_string()))
        }
        None => (None, None),
    };
    let (tx, rx) = mpsc::channel(QUEUE);
    let state = State {
        topic: bytes::Bytes::from(c.topic.clone().into_bytes()),
        buffer: VecDeque::new(),
        buffer_steps: c.buffer_steps.max(1),
        stats: PublisherStats::default(),
    };
    let linger = Duration::from_secs_f64(c.linger_s.clamp(0.0, 86_400.0));
    let task = tokio::spawn(serve(state, publ, router, rx, linger));
    Ok(Running {
        tx,
        task,
        endpoint,
        replay,
        linger,
    })
}

/// Binds `e` if it is a wildcard or `ipc://` endpoint, else connects to it (within
/// [`CONNECT_DEADLINE`]); returns the endpoint as bound (a port 0 resolved).
async fn open(s: &mut zeromq::PubSocket, e: &str) -> Result<String, String> {
    if e.contains('*') || e.contains("::") || e.starts_with("ipc://") {
        let bound = s
            .bind(&wildcard(e))
            .await
            .map_err(|err| format!("kv-events: cannot bind {e}: {err}"))?;
        return Ok(bound.to_string());
    }
    match tokio::time::timeout(CONNECT_DEADLINE, s.connect(e)).await {
        Ok(Ok(())) => Ok(e.to_string()),
        Ok(Err(err)) => Err(format!("kv-events: cannot connect to {e}: {err}")),
        Err(_) => Err(format!(
            "kv-events: {e} did not answer within {} s",
            CONNECT_DEADLINE.as_secs()
        )),
    }
}

/// `tcp://*:P` as the `zeromq` crate binds it (`0.0.0.0`).
fn wildcard(e: &str) -> String {
    e.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// Publishes batches until the engine drops its sender, answering replay requests meanwhile,
/// then keeps answering them for `linger`.
async fn serve(
    mut st: State,
    mut publ: zeromq::PubSocket,
    mut router: Option<RouterSocket>,
    mut rx: mpsc::Receiver<Batch>,
    linger: Duration,
) -> PublisherStats {
    loop {
        tokio::select! {
            b = rx.recv() => match b {
                Some(b) => st.publish(&mut publ, b).await,
                None => break,
            },
            m = recv(&mut router) => st.replay(router.as_mut(), m).await,
        }
    }
    if router.is_some() && !linger.is_zero() {
        let until = tokio::time::sleep(linger);
        tokio::pin!(until);
        loop {
            tokio::select! {
                () = &mut until => break,
                m = recv(&mut router) => st.replay(router.as_mut(), m).await,
            }
        }
    }
    st.stats
}

/// The next replay request, or never when there is no replay socket.
async fn recv(router: &mut Option<RouterSocket>) -> Option<ZmqMessage> {
    match router {
        Some(r) => match r.recv().await {
            Ok(m) => Some(m),
            Err(e) => {
                // Not a request: pause so a socket that keeps failing does not spin.
                tracing::debug!("kv-events: replay receive: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                None
            }
        },
        None => std::future::pending().await,
    }
}

impl State {
    async fn publish(&mut self, publ: &mut zeromq::PubSocket, b: Batch) {
        let seq = self.stats.batches;
        let payload = bytes::Bytes::from(encode_batch(b.ts, &b.events, 0));
        self.stats.batches += 1;
        self.stats.events += b.events.len() as u64;
        self.stats.bytes += payload.len() as u64;
        let frames = vec![
            self.topic.clone(),
            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        if let Ok(m) = ZmqMessage::try_from(frames) {
            // A PUB socket drops what no subscriber takes; subscribers recover by replay.
            if let Err(e) = publ.send(m).await {
                tracing::warn!(seq, "kv-events: publish failed: {e}");
            }
        }
        self.buffer.push_back((seq, payload));
        if self.buffer.len() > self.buffer_steps {
            self.buffer.pop_front();
        }
    }

    /// Answers one replay request `(identity, empty, start)`; a malformed one is logged and
    /// counted, as vLLM logs it.
    async fn replay(&mut self, router: Option<&mut RouterSocket>, m: Option<ZmqMessage>) {
        let (Some(router), Some(m)) = (router, m) else {
            return;
        };
        let frames = m.into_vec();
        let start = match frames.as_slice() {
            [_, empty, start] if empty.is_empty() && start.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(start);
                u64::from_be_bytes(b)
            }
            _ => {
                self.stats.bad_replays += 1;
                tracing::warn!(frames = frames.len(), "kv-events: invalid replay request");
                return;
            }
        };
        self.stats.replays += 1;
        let id = frames[0].clone();
        let empty = bytes::Bytes::new();
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let f = vec![
                id.clone(),
                empty.clone(),
                self.topic.clone(),
                bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if !send(router, f).await {
                return;
            }
        }
        let end = vec![
            id,
            empty.clone(),
            empty.clone(),
            bytes::Bytes::from_static(&END_SEQ),
            empty,
        ];
        send(router, end).await;
    }
}

/// Sends one replay message; a peer gone meanwhile ends its replay (logged).
async fn send(router: &mut RouterSocket, frames: Vec<bytes::Bytes>) -> bool {
    let Ok(m) = ZmqMessage::try_from(frames) else {
        return false;
    };
    match router.send(m).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!("kv-events: replay send failed: {e}");
            false
        }
    }
}
