//! The shape of a frame between the engine and a worker process: its version, its largest size,
//! and what goes wrong reading one ([`WireError`]). Apart from `wire.rs`, which reads and writes
//! frames, so that the run's error type ([`crate::RunError`]) can carry a wire error without
//! depending on the messages.

/// The wire version; a frame of another version is refused.
pub const WIRE_VERSION: u32 = 6;
/// The largest frame accepted, in bytes.
pub const MAX_FRAME: u32 = 64 << 20;

/// A frame that could not be read or decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The peer closed the connection at a frame boundary.
    #[error("connection closed")]
    Closed,
    /// Reading or writing failed (including a connection closed inside a frame).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A frame longer than [`MAX_FRAME`], or too short for its header.
    #[error("frame of {len} bytes (at most {MAX_FRAME}, at least 4)")]
    Length {
        /// The announced length.
        len: u32,
    },
    /// A frame of another wire version.
    #[error("wire version {found}, expected {WIRE_VERSION}")]
    Version {
        /// The version found.
        found: u32,
    },
    /// The payload does not decode into the expected message.
    #[error("undecodable frame: {0}")]
    Decode(String),
}
