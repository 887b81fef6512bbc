//! The worker side: what runs on every rank.
//!
//! * [`WorkerConnector`] — the worker role of a connector, sans-IO.
//! * [`WorkerProtocol`] — the legal order of one rank's connector calls per step (I-1…I-6).
//! * [`GuardedWorker`] — a worker connector behind that protocol.
//! * [`KvLayout`] and [`copy_plan`] — where a rank's KV bytes live, and the copies that move a
//!   [`Transfer`].
//!
//! One rank's whole step (block tables, the hook sequence, transfers) is driven by
//! [`crate::RankDriver`], which calls a [`GuardedWorker`].

mod connector;
mod guard;
mod layout;
mod protocol;

pub use connector::{
    Transfer, TransferCommand, TransferDirection, TransferDone, TransferResults, WorkerConnector,
    WorkerError,
};
pub use guard::GuardedWorker;
pub use layout::{CopyRun, KvLayout, LayoutError, LayoutOrder, PlanError, copy_plan};
pub use protocol::{ProtocolViolation, StepShape, WorkerCall, WorkerPhase, WorkerProtocol};
