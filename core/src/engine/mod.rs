//! One engine step as sans-IO machines: the rank side ([`RankDriver`]) and the engine side
//! ([`EngineCore`]). Every caller — the runtime's engine loop and ranks, the model checker, the
//! conformance harnesses, the test simulations — drives these, so the step that is checked is
//! the step that ships.
//!
//! # One engine step
//!
//! ```text
//! engine                                   each rank r of W (any order, any interleaving)
//! EngineCore::schedule ─── ScheduledStep ──▶ RankDriver::begin
//!                                           RankDriver::poll until Done:
//!                                             Start(transfer) → the DMA engine
//!                                             Forward(pass)   → the layer's KV reads/writes
//!                                             Wait{jobs, ..}  → RankDriver::transfer_done(...)
//!                                             Collect         → feed the transfers done by now
//! EngineCore::rank_output ◀── WorkerOutput ── Done(output)
//! EngineCore::apply (once every rank reported the oldest step)
//! ```
//!
//! With async scheduling, `schedule` runs up to `async_depth` steps ahead of `apply`; ranks run
//! their steps in order. Transfers complete at any time: feed each to its rank's
//! [`RankDriver::transfer_done`].

mod core;
mod rank;

#[cfg(feature = "fault-injection")]
pub use self::core::EngineFault;
pub use self::core::{Applied, EngineCore, EngineError, Scheduled};
#[cfg(feature = "fault-injection")]
pub use rank::RankFault;
pub use rank::{
    BlockAccess, ForwardPass, RankAction, RankConfig, RankDriver, RankError, ReadSpan, tables_reset,
};
