//! Composition: connectors built from other connectors, and the trivial one.
//!
//! * [`MultiConnector`] + [`MultiWorker`] — vLLM's `MultiConnector`, both roles.
//! * [`NoopConnector`] — does nothing (the scheduler benchmark's baseline).
//! * [`Either`] + [`EitherWorker`] — one of two connectors, chosen when an engine is built.

mod either;
mod multi;
mod noop;

pub use either::{Either, EitherWorker};
pub use multi::{
    ExtraAsyncSaves, MultiConnector, MultiMeta, MultiWorker, combine_finished_counts,
    route_worker_meta,
};
pub use noop::NoopConnector;
