//! The messages of one engine step: what the scheduler, the ranks and the executor hand each other.
//!
//! | message | from → to | vLLM |
//! | --- | --- | --- |
//! | [`SchedulerOutput`] + the connector's step metadata ([`ScheduledStep`]) | scheduler → every rank | `SchedulerOutput`, `KVConnectorMetadata` |
//! | [`WorkerOutput`] | one rank → executor | `KVConnectorOutput` |
//! | [`Meta`] (a [`WorkerMeta`]) | inside a worker output | `KVConnectorWorkerMetadata` |
//! | [`KvEvents`] | inside a worker output | `KVConnectorKVEvents` |
//! | [`AggregatedOutput`], [`ModelOutput`] | executor → scheduler | the aggregated `KVConnectorOutput`, `ModelRunnerOutput` |
//!
//! These are plain data, `serde`-serialisable: the runtime puts the first three on a wire, and
//! decoding validates them (a malformed value is an error, never a panic).

mod events;
mod meta;
mod output;
mod step;

pub use events::{CacheEvent, EventAccumulator, KvEvent, KvEvents, Medium};
pub use meta::{MAX_META_DEPTH, Meta, MetaMismatch, OffloadMeta, WorkerMeta, build_multi, merge};
pub use output::{AggregatedOutput, Direction, WorkerOutput};
pub use step::{
    CachedRequestData, ModelOutput, NewRequestData, ScheduledRequest, ScheduledStep,
    SchedulerOutput,
};
