//! One connection to a node. A caller's framed commands go on the wire at once when the socket
//! takes them (so the node works while the caller frames its next), else they queue and a
//! writer task sends what queued in vectored writes; a reader task hands each caller its
//! replies, in order. A connection that
//! breaks, sends what is not RESP, or whose caller stopped waiting (its deadline: the node may
//! not be answering at all) is dead for good, and every command waiting on it fails.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::BytesMut;
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};
use tokio::task::AbortHandle;

use super::wire::{Reply, parse};

/// Commands waiting for their replies on one connection, at most: past it a command fails at
/// once (the node is not keeping up).
pub(crate) const IN_FLIGHT_BOUND: usize = 1 << 16;

/// Queued bytes from which a caller writes them itself rather than leave them to the writer:
/// the node starts on them while the caller frames more, in writes large enough to be cheap.
const WRITE_THROUGH: usize = 64 << 10;

/// Segments one vectored write takes at most (a value and its framing are two).
const MAX_SLICES: usize = 256;

type Replies = Result<Vec<Reply>, String>;

pub(crate) struct Conn {
    addr: String,
    shared: Arc<Shared>,
    tasks: [AbortHandle; 2],
}

/// What the callers, the writer and the reader share.
struct Shared {
    stream: TcpStream,
    queue: Mutex<Queue>,
    /// Something was left queued: the writer's wake-up.
    queued: Notify,
    dead: AtomicBool,
}

#[derive(Default)]
struct Queue {
    /// Framed commands not yet written, as segments (written in this order, under the lock;
    /// never empty ones).
    outbox: VecDeque<Vec<u8>>,
    /// Bytes of the first one already written.
    head_sent: usize,
    /// Bytes in `outbox`, the first one's written part included.
    queued_bytes: usize,
    /// Per batch queued and not yet answered: how many replies it waits for, and where they
    /// go (in the order of `outbox` and of the wire).
    pending: VecDeque<(usize, oneshot::Sender<Replies>)>,
    /// Commands queued and not yet answered.
    in_flight: usize,
}

/// A batch's replies to come. Dropped before they came (its caller's deadline), it kills the
/// connection.
pub(crate) struct Waiting {
    rx: oneshot::Receiver<Replies>,
    conn: Arc<Conn>,
    armed: bool,
}

impl Waiting {
    pub(crate) async fn replies(mut self) -> Replies {
        let out = (&mut self.rx).await;
        self.armed = false;
        out.unwrap_or_else(|_| Err(format!("{}: connection lost", self.conn.addr)))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.armed {
            self.conn.kill();
        }
    }
}

impl Conn {
    /// Connects to `addr` (`HOST:PORT`) within `timeout`.
    pub(crate) async fn open(addr: &str, timeout: Duration) -> Result<Self, String> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| format!("{addr}: no connection within {timeout:?}"))?
            .map_err(|e| format!("{addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let shared = Arc::new(Shared {
            stream,
            queue: Mutex::new(Queue::default()),
            queued: Notify::new(),
            dead: AtomicBool::new(false),
        });
        let writer = tokio::spawn(write_queued(shared.clone()));
        let reader = tokio::spawn(read_replies(shared.clone()));
        Ok(Self {
            addr: addr.to_owned(),
            shared,
            tasks: [writer.abort_handle(), reader.abort_handle()],
        })
    }

    pub(crate) fn alive(&self) -> bool {
        !self.shared.dead.load(Ordering::Acquire)
    }

    /// Marks it dead and fails every batch waiting on it.
    fn kill(&self) {
        self.shared.fail("dropped by its caller");
        self.tasks.iter().for_each(AbortHandle::abort);
    }

    /// Queues `segments` (`n` framed commands, in order); their replies come through the
    /// returned [`Waiting`].
    pub(crate) fn submit(
        self: &Arc<Self>,
        segments: Vec<Vec<u8>>,
        n: usize,
    ) -> Result<Waiting, String> {
        let (tx, rx) = oneshot::channel();
        {
            let mut q = self.shared.queue();
            if !self.alive() {
                return Err(format!("{}: connection lost", self.addr));
            }
            if q.in_flight + n > IN_FLIGHT_BOUND {
                return Err(format!(
                    "{}: {IN_FLIGHT_BOUND} commands unanswered",
                    self.addr
                ));
            }
            q.in_flight += n;
            for segment in segments.into_iter().filter(|s| !s.is_empty()) {
                q.queued_bytes += segment.len();
                q.outbox.push_back(segment);
            }
            q.pending.push_back((n, tx));
            // Small commands wait for the writer, which takes everything queued by then.
            let flush = if q.queued_bytes >= WRITE_THROUGH {
                q.flush(&self.shared.stream)
            } else {
                Ok(true)
            };
            match flush {
                Ok(false) => {}
                Ok(true) => self.shared.queued.notify_one(),
                Err(e) => {
                    drop(q);
                    self.shared.fail(&e.to_string());
                    return Err(format!("{}: {e}", self.addr));
                }
            }
        }
        Ok(Waiting {
            rx,
            conn: self.clone(),
            armed: true,
        })
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.tasks.iter().for_each(AbortHandle::abort);
    }
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the connection dead and fails every batch waiting on it.
    fn fail(&self, why: &str) {
        self.dead.store(true, Ordering::Release);
        let mut q = self.queue();
        q.outbox.clear();
        q.head_sent = 0;
        q.queued_bytes = 0;
        q.in_flight = 0;
        for (_, done) in q.pending.drain(..) {
            let _ = done.send(Err(format!("connection lost: {why}")));
        }
    }
}

impl Queue {
    /// Writes what the socket takes without waiting: whether some is left (the socket is
    /// full).
    fn flush(&mut self, stream: &TcpStream) -> io::Result<bool> {
        while !self.outbox.is_empty() {
            let slices: Vec<IoSlice<'_>> = (self.outbox.iter().enumerate())
                .take(MAX_SLICES)
                .map(|(i, b)| IoSlice::new(if i == 0 { &b[self.head_sent..] } else { b }))
                .collect();
            let mut n = match stream.try_write_vectored(&slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) => return Err(e),
            };
            while let Some(first) = self.outbox.front() {
                let left = first.len() - self.head_sent;
                if n < left {
                    self.head_sent += n;
                    break;
                }
                n -= left;
                self.head_sent = 0;
                self.queued_bytes -= first.len();
                self.outbox.pop_front();
            }
        }
        Ok(false)
    }
}

/// Writes what callers left queued, as the socket takes it, until the connection breaks.
async fn write_queued(shared: Arc<Shared>) {
    loop {
        shared.queued.notified().await;
        loop {
            let left = shared.queue().flush(&shared.stream);
            match left {
                Ok(false) => break,
                Ok(true) => {
                    if let Err(e) = shared.stream.writable().await {
                        return shared.fail(&e.to_string());
                    }
                }
                Err(e) => return shared.fail(&e.to_string()),
            }
        }
    }
}

/// Reads replies and hands each batch its own, in order, until the connection breaks or
/// sends what is not RESP.
async fn read_replies(shared: Arc<Shared>) {
    let mut buf = BytesMut::with_capacity(1 << 16);
    let mut got: Vec<Reply> = Vec::new();
    loop {
        loop {
            match parse(&mut buf) {
                Ok(Some(reply)) => got.push(reply),
                Ok(None) => break,
                Err(e) => return shared.fail(&e),
            }
            let mut q = shared.queue();
            let Some(&(want, _)) = q.pending.front() else {
                drop(q);
                return shared.fail("a reply to no command");
            };
            if got.len() == want {
                let (_, done) = q.pending.pop_front().expect("looked at");
                q.in_flight -= want;
                drop(q);
                let _ = done.send(Ok(std::mem::take(&mut got)));
            }
        }
        buf.reserve(1 << 16);
        if let Err(e) = shared.stream.readable().await {
            return shared.fail(&e.to_string());
        }
        match shared.stream.try_read_buf(&mut buf) {
            Ok(0) => return shared.fail("closed by the node"),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return shared.fail(&e.to_string()),
        }
    }
}
