//! The frames between the engine and a worker process (`kvrelay worker`).
//!
//! A frame is `length: u32 LE` (of what follows), `version: u32 LE` ([`WIRE_VERSION`]), then
//! one postcard-encoded message: `Down` from the engine, `Up` from a worker. Every frame is
//! validated when decoded — its length bounded by [`MAX_FRAME`], its version checked, its
//! payload decoded by the core's validating `Deserialize` impls (a `SortedSet` out of order, an
//! `OffloadMeta` whose counts do not match its jobs, metadata nested too deep are errors) — and
//! a frame that fails is a [`WireError`], never a panic.
//!
//! A session: the worker connects and sends `Up::Hello`; the engine answers `Down::Setup`;
//! then one `Down::Step` per engine step, each answered by `Up::Output` (or
//! `Up::Failed`, after which the worker stops); the engine closes its side to stop the worker,
//! which answers `Up::Stats` and exits.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use kvrelay_core::{RequestId, ScheduledStep, StepId, Token, WorkerOutput};

use crate::connector::EngineMeta;

use crate::rank::{PromotedChunk, RankDelta, RankSetup, RankStats};

pub use super::frame::{MAX_FRAME, WIRE_VERSION, WireError};

/// Engine → worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Down {
    /// The rank to build.
    Setup(RankSetup),
    /// One engine step.
    Step {
        /// The step (its id inside), for every rank.
        step: ScheduledStep<EngineMeta>,
        /// Tokens appended since the previous step.
        tokens: Vec<(RequestId, Vec<Token>)>,
        /// Requests released.
        forget: Vec<RequestId>,
        /// CPU chunks the shared tier promoted since the previous step (the engine wrote them
        /// in the pool this worker shares with it), and what each holds.
        promoted: Vec<PromotedChunk>,
    },
}

/// Worker → engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Up {
    /// The first frame: which rank this worker is.
    Hello {
        /// The rank.
        rank: u32,
    },
    /// A step's output.
    Output {
        /// The step.
        step: StepId,
        /// The rank's output.
        output: WorkerOutput,
        /// The rank's counters since its previous output (version 4 on; boxed, the
        /// figures being larger than the other messages).
        delta: Box<RankDelta>,
    },
    /// The rank stopped with an error.
    Failed {
        /// The step it was running.
        step: StepId,
        /// The error.
        message: String,
    },
    /// The last frame: what the rank did.
    Stats(RankStats),
}

/// The bytes of one frame carrying `msg`.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let payload = postcard::to_allocvec(msg).expect("wire messages serialize");
    let len = u32::try_from(payload.len() + 4).expect("a frame fits in u32");
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes the body of a frame (version and payload, after the length).
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    let Some((version, payload)) = body.split_first_chunk::<4>() else {
        return Err(WireError::Length {
            len: body.len() as u32,
        });
    };
    let found = u32::from_le_bytes(*version);
    if found != WIRE_VERSION {
        return Err(WireError::Version { found });
    }
    let (msg, rest) =
        postcard::take_from_bytes::<T>(payload).map_err(|e| WireError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Decode(format!("{} trailing bytes", rest.len())));
    }
    Ok(msg)
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), WireError> {
    let frame = encode(msg);
    tracing::trace!(bytes = frame.len(), "frame sent");
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame. Not cancel-safe: read from a task of its own.
pub async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
) -> Result<T, WireError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            return Err(if got == 0 {
                WireError::Closed
            } else {
                WireError::Io(std::io::ErrorKind::UnexpectedEof.into())
            });
        }
        got += n;
    }
    let len = u32::from_le_bytes(len);
    if !(4..=MAX_FRAME).contains(&len) {
        return Err(WireError::Length { len });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    tracing::trace!(bytes = len, "frame received");
    decode_body(&body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::{GroupKind, KvLayout, LayoutOrder, OffloadMeta, SchedulerOutput, SortedSet};

    fn setup() -> RankSetup {
        let gpu = KvLayout::new(vec![0, 0], 4, 64, LayoutOrder::LayerMajor).unwrap();
        RankSetup {
            rank: 1,
            backend: crate::Backend::Host,
            host: gpu.with_blocks(8, LayoutOrder::LayerMajor).unwrap(),
            gpu,
            block_size: 4,
            blocks_per_chunk: 1,
            groups: vec![GroupKind::FullAttention],
            mode: kvrelay_core::Mode::Compat,
            check: true,
            timeline: false,
            completions: crate::rank::Completions::AfterSteps(2),
            host_pool: None,
            shared_pool: None,
            pd: None,
            arena: None,
        }
    }

    // Protects the wire format: these bytes are what a worker of this version reads and
    // writes. A change here breaks mixed versions: bump WIRE_VERSION with it.
    #[test]
    fn golden_bytes() {
        let hello = encode(&Up::Hello { rank: 3 });
        assert_eq!(hello, [6, 0, 0, 0, 6, 0, 0, 0, 0, 3]);
        let out = encode(&Up::Output {
            step: StepId(5),
            output: WorkerOutput {
                finished_sending: Some(SortedSet::from_vec(vec![RequestId(2)])),
                worker_meta: Some(kvrelay_core::Meta::Offload(OffloadMeta::default())),
                ..WorkerOutput::default()
            },
            delta: Box::new(RankDelta {
                copies: 2,
                ..RankDelta::default()
            }),
        });
        assert_eq!(
            out,
            [
                44, 0, 0, 0, 6, 0, 0, 0, 1, 5, 1, 1, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                // The delta (a RankStats): four counts, two times (seconds, nanoseconds),
                // copies 2, seven counts, then the empty loaded tokens, hook samples, checks
                // and timeline.
                0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
            ],
            "{out:?}"
        );
        let step = encode(&Down::Step {
            step: ScheduledStep {
                output: SchedulerOutput {
                    step: StepId(7),
                    ..SchedulerOutput::default()
                },
                meta: EngineMeta::default(),
            },
            tokens: vec![(RequestId(1), vec![300])],
            forget: vec![RequestId(4)],
            promoted: vec![PromotedChunk {
                chunk: 3,
                prefixes: vec![9, 10],
            }],
        });
        assert_eq!(&step[..9], [step.len() as u8 - 4, 0, 0, 0, 6, 0, 0, 0, 1]);
        // The promoted chunk last: chunk 3, two prefixes.
        assert_eq!(&step[step.len() - 5..], [1, 3, 2, 9, 10]);
        let back: Down = decode_body(&step[4..]).unwrap();
        assert!(
            matches!(back, Down::Step { ref tokens, ref promoted, .. } if tokens == &vec![(RequestId(1), vec![300])] && promoted[0].chunk == 3)
        );
        let s = setup();
        let back: Down = decode_body(&encode(&Down::Setup(s.clone()))[4..]).unwrap();
        assert_eq!(back, Down::Setup(s));
    }

    // Protects decoding at the process boundary: a wrong version, a truncated or trailing
    // payload, a frame of the other direction, or an invalid core value is a typed error.
    #[test]
    fn bad_frames_are_typed_errors() {
        let mut f = encode(&Up::Hello { rank: 3 });
        f[4] = 1;
        assert!(matches!(
            decode_body::<Up>(&f[4..]),
            Err(WireError::Version { found: 1 })
        ));
        // A worker of version 3 (its outputs carry no delta) is refused, not misread.
        f[4] = 3;
        assert!(matches!(
            decode_body::<Up>(&f[4..]),
            Err(WireError::Version { found: 3 })
        ));
        let f = encode(&Up::Hello { rank: 3 });
        assert!(matches!(
            decode_body::<Up>(&f[4..9]),
            Err(WireError::Decode(_))
        ));
        let mut long = f[4..].to_vec();
        long.push(0);
        assert!(matches!(
            decode_body::<Up>(&long),
            Err(WireError::Decode(_))
        ));
        assert!(matches!(
            decode_body::<Up>(&[1, 0]),
            Err(WireError::Length { .. })
        ));
        // A variant neither direction has.
        let mut bad = encode(&Up::Hello { rank: 3 });
        bad[8] = 9;
        assert!(matches!(
            decode_body::<Up>(&bad[4..]),
            Err(WireError::Decode(_))
        ));
        // A frame of the other direction.
        let f = encode(&Down::Setup(setup()));
        assert!(decode_body::<Up>(&f[4..]).is_err());
    }

    // Protects against hostile bytes: any byte string decodes to a message or a typed error.
    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut x: u64 = 0x1234_5678;
        for n in 0..2_000usize {
            let mut body = WIRE_VERSION.to_le_bytes().to_vec();
            for _ in 0..(n % 64) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                body.push((x >> 24) as u8 % 8);
            }
            let _ = decode_body::<Up>(&body);
            let _ = decode_body::<Down>(&body);
        }
    }
}
