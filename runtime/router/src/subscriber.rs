//! One engine's event stream, gap-free: a SUB socket on its PUB endpoint and a DEALER on its
//! replay endpoint (vLLM's protocol). [`Subscriber::sync`] applies batches in sequence order
//! until it has seen every batch the engine says it published; a batch that does not come live
//! (ZMQ's PUB drops what a subscriber is too new or too slow to take) is fetched by replay.
//! Every wait has a deadline.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::decode::{Batch, DecodeError, decode_batch};

/// How long a batch may be late live before it is asked for by replay.
const LIVE_GRACE: Duration = Duration::from_millis(100);

/// How long a replay answer may pause before the request is given up (and asked again).
const REPLAY_WAIT: Duration = Duration::from_secs(5);

/// Why a stream could not be followed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A socket could not be opened.
    #[error("{endpoint}: {why}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// Why.
        why: String,
    },
    /// A frame was not a batch.
    #[error("batch {seq}: {error}")]
    Decode {
        /// Its sequence number.
        seq: u64,
        /// Why.
        error: DecodeError,
    },
    /// The batches up to `want` did not all come, live or replayed, within the deadline.
    #[error("batches up to {want} did not come within {secs} s (have {have})")]
    Timeout {
        /// Batches wanted.
        want: u64,
        /// Batches applied.
        have: u64,
        /// The deadline.
        secs: u64,
    },
}

/// An engine's stream. See the module docs.
pub struct Subscriber {
    sub: SubSocket,
    replay: DealerSocket,
    /// Batches applied: the next sequence number expected.
    next: u64,
    /// Batches that came by replay.
    pub replayed: u64,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("next", &self.next)
            .field("replayed", &self.replayed)
            .finish_non_exhaustive()
    }
}

impl Subscriber {
    /// Connects to a publisher's PUB and replay endpoints (`tcp://HOST:PORT`).
    pub async fn connect(publ: &str, replay: &str) -> Result<Self, StreamError> {
        let err = |endpoint: &str| {
            let endpoint = endpoint.to_string();
            move |e: zeromq::ZmqError| StreamError::Connect {
                endpoint,
                why: e.to_string(),
            }
        };
        let mut sub = SubSocket::new();
        sub.connect(publ).await.map_err(err(publ))?;
        sub.subscribe("").await.map_err(err(publ))?;
        let mut dealer = DealerSocket::new();
        dealer.connect(replay).await.map_err(err(replay))?;
        Ok(Self {
            sub,
            replay: dealer,
            next: 0,
            replayed: 0,
        })
    }

    /// Batches applied so far.
    pub fn seen(&self) -> u64 {
        self.next
    }

    /// Hands `apply` every batch from the last one seen up to batch `want - 1`, in order,
    /// within `deadline`.
    pub async fn sync(
        &mut self,
        want: u64,
        deadline: Duration,
        apply: &mut dyn FnMut(Batch),
    ) -> Result<(), StreamError> {
        let until = Instant::now() + deadline;
        while self.next < want {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StreamError::Timeout {
                    want,
                    have: self.next,
                    secs: deadline.as_secs(),
                });
            }
            match timeout(LIVE_GRACE.min(left), self.sub.recv()).await {
                Ok(Ok(m)) => self.live(m, apply)?,
                Ok(Err(e)) => tracing::debug!("kv events: live receive: {e}"),
                Err(_) => self.fetch(left, apply).await?,
            }
        }
        Ok(())
    }

    /// A live message: applied if it is the next one, skipped if already seen; a gap before it
    /// is fetched by replay on the next pause.
    fn live(&mut self, m: ZmqMessage, apply: &mut dyn FnMut(Batch)) -> Result<(), StreamError> {
        if let Some((seq, payload)) = frames(&m.into_vec(), 0) {
            self.take(seq, &payload, apply)?;
        }
        Ok(())
    }

    /// Applies batch `seq` if it is the next one.
    fn take(
        &mut self,
        seq: u64,
        payload: &[u8],
        apply: &mut dyn FnMut(Batch),
    ) -> Result<bool, StreamError> {
        if seq != self.next {
            return Ok(false);
        }
        let b = decode_batch(payload).map_err(|error| StreamError::Decode { seq, error })?;
        apply(b);
        self.next += 1;
        Ok(true)
    }

    /// Asks the replay socket for every batch from the next one on and applies them, until its
    /// end marker (or `left` runs out).
    async fn fetch(
        &mut self,
        left: Duration,
        apply: &mut dyn FnMut(Batch),
    ) -> Result<(), StreamError> {
        let req = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&self.next.to_be_bytes()),
        ];
        let Ok(m) = ZmqMessage::try_from(req) else {
            return Ok(());
        };
        if let Err(e) = self.replay.send(m).await {
            tracing::debug!("kv events: replay request: {e}");
            return Ok(());
        }
        loop {
            let Ok(Ok(m)) = timeout(left.min(REPLAY_WAIT), self.replay.recv()).await else {
                return Ok(());
            };
            // DEALER receives (empty, topic, seq, payload); the end marker has an empty payload.
            let Some((seq, payload)) = frames(&m.into_vec(), 1) else {
                return Ok(());
            };
            if self.take(seq, &payload, apply)? {
                self.replayed += 1;
            }
        }
    }
}

/// `(seq, payload)` of a `(topic, seq, payload)` message after `skip` leading frames; `None`
/// for anything else, the end-of-replay marker included.
fn frames(f: &[Bytes], skip: usize) -> Option<(u64, Bytes)> {
    let [_, seq, payload] = f.get(skip..)? else {
        return None;
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    if payload.is_empty() {
        return None;
    }
    Some((u64::from_be_bytes(seq), payload.clone()))
}
