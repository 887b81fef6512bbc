//! kvrelay-core: the pure, deterministic state machines of the KV-cache connector lifecycle.
//!
//! The behaviour is vLLM 0.33.0's KV-connector API (`shared/spec/SEMANTICS.md`), restated as
//! sans-IO machines. An input is a method call on a machine — named after the vLLM call it
//! stands for (`schedule`, `update_from_output`, `get_num_new_matched_tokens`, `start_load_kv`,
//! …) or after the event it reports (`rank_output`, `transfer_done`) — and everything a machine
//! wants done outside itself comes back as a returned value: a [`ScheduledStep`], a
//! [`RankAction`], a [`TransferCommand`]. Nothing here performs IO, reads a clock or draws a
//! random number, so the same code runs in the engine (`kvrelay-engine`), in the model checker
//! (`kvrelay-model-check`) and under property tests (`kvrelay-tests`).
//!
//! # Where to start
//!
//! An engine drives [`EngineCore`] and one [`RankDriver`] per rank; `engine/mod.rs` lists what to
//! call when. Everything else is what those two compose.
//!
//! # Rooms and machines
//!
//! | room | machine | vLLM counterpart | spec |
//! | --- | --- | --- | --- |
//! | [`engine`] | [`EngineCore`], [`RankDriver`] | `EngineCore` + executor; one worker's `execute_model` | §2, §4 |
//! | [`scheduler`] | [`Scheduler`] + [`BlockPool`] | vLLM's `Scheduler` and `BlockPool`, as connectors see them | §1.2, §2.2–§2.3, §2.7–§2.9, §6.1, I-14…I-20, I-33…I-37 |
//! | [`worker`] | [`WorkerProtocol`], [`GuardedWorker`], [`KvLayout`] | the order of one rank's connector calls per step; where its KV bytes live and the copies of a transfer | §2.4, I-1…I-6 |
//! | (root) | [`Aggregator`] | `KVOutputAggregator` (executor side) | §4.1–§4.2, I-21…I-27 |
//! | [`messages`] | [`WorkerMeta`] / [`Meta`] | `KVConnectorWorkerMetadata.aggregate` | §4.3–§4.4, I-25, I-31 |
//! | [`messages`] | [`EventAccumulator`] | the scheduler connector's `KVConnectorKVEvents` | §4.5 |
//! | [`offloading`] | [`OffloadingConnector`] + [`OffloadingWorker`] | `OffloadingConnector` (both roles) | §1.8, §5.5–§5.7, §6.4, I-38…I-47 |
//! | [`offloading`] | [`CpuOffloadingManager`] | `CPUOffloadingManager` + its LRU/ARC policies | §5.2–§5.4, I-40 |
//! | [`compose`] | [`MultiConnector`] + [`MultiWorker`] | `MultiConnector` (both roles) | §1.7, §4.3, I-28…I-32 |
//! | [`compose`] | [`Either`] + [`EitherWorker`] | (kvrelay's own: one of two connectors, chosen when an engine is built) | — |
//! | [`pd`] | [`PdConnector`] + [`PdWorker`] | NIXL's P/D protocol (both roles) | §2.10, §8.9, I-53, I-54 |
//!
//! Rooms depend downwards only: `ids`/`tokens`/`sorted_set` ← [`messages`] ← [`scheduler`] ←
//! [`worker`] ← the aggregator ← [`offloading`], [`pd`], [`compose`] ← [`engine`]; `testing` (behind the
//! `testing` feature) may use them all.
//!
//! # The connector contract
//!
//! [`SchedulerConnector`] and [`WorkerConnector`] are the two roles of a connector. The scheduler
//! lends a connector a read-only [`SchedulerView`] for each call and applies the [`Intent`]s the
//! connector returns; [`GuardedWorker`] puts the worker side behind the step protocol.
//! [`NoopConnector`] does nothing. With the `testing` feature, `ScriptedConnector` answers from
//! a table set by tests (`ScriptedWorker` is its worker twin).
//!
//! # Ids
//!
//! vLLM's request ids are strings. The core works on dense [`RequestId`] indices so that the hot
//! paths (quorum counting of completion reports) are array lookups, not string hashes. Strings are
//! turned into ids once, where they enter the system, by an [`Interner`].
//!
//! # Modes
//!
//! [`Mode::Compat`] reproduces vLLM 0.33.0 exactly, hazards included, so that real traces replay.
//! [`Mode::Strict`] closes a known hazard where one exists (for the aggregator: a rank reporting
//! the same completion twice is the typed error [`AggregateError::DuplicateReport`]).
//!
//! # Invariants
//!
//! Every machine has a `check_invariants()` that returns the first broken invariant, named after
//! the spec id (`I-xx`). Debug builds check it at the end of every public transition; tests,
//! property tests and the model checker call it after every transition. A broken invariant is
//! a bug in this crate, never a consequence of bad input (a machine stopped by a peer that broke
//! its contract is exempt: it returns the sticky error instead).

#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;

mod aggregator;
pub mod compose;
pub mod engine;
mod ids;
pub mod messages;
pub mod offloading;
pub mod pd;
pub mod scheduler;
mod sorted_set;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod tokens;
pub mod worker;

pub use aggregator::{AggregateError, Aggregator};
pub use compose::{
    Either, EitherWorker, ExtraAsyncSaves, MultiConnector, MultiMeta, MultiWorker, NoopConnector,
    combine_finished_counts, route_worker_meta,
};
pub use engine::{
    Applied, BlockAccess, EngineCore, EngineError, ForwardPass, RankAction, RankConfig, RankDriver,
    RankError, ReadSpan, Scheduled, tables_reset,
};
#[cfg(feature = "fault-injection")]
pub use engine::{EngineFault, RankFault};
pub use ids::{BlockId, Interner, JobId, NULL_BLOCK, Rank, RequestId, StepId};
pub use messages::{
    AggregatedOutput, CacheEvent, CachedRequestData, Direction, EventAccumulator, KvEvent,
    KvEvents, MAX_META_DEPTH, Medium, Meta, MetaMismatch, ModelOutput, NewRequestData, OffloadMeta,
    ScheduledRequest, ScheduledStep, SchedulerOutput, WorkerMeta, WorkerOutput, build_multi, merge,
};
pub use offloading::{
    Access, ChunkId, CpuOffloadingManager, GpuSpec, KeyLookup, LookupResult, ManagerConfig,
    ManagerError, OffloadEvent, OffloadKey, OffloadingConfig, OffloadingConnector,
    OffloadingConnectorMeta, OffloadingError, OffloadingWorker, OffloadingWorkerConfig, PolicyKind,
    PrepareStoreOutput, TierId, TierJobId, TierReport, TierWork, TieringConfig, TieringError,
    TieringManager, TieringStats, TransferJob,
};
pub use pd::{PdConfig, PdConnector, PdMeta, PdParams, PdStats, PdWorker};
#[cfg(feature = "fault-injection")]
pub use scheduler::SchedulerFault;
pub use scheduler::{
    BlockPool, ConnectorError, FinishDecision, FinishReason, GroupKind, Intent, LoadFailurePolicy,
    Lookup, MAX_REQUEST_ID, Params, RequestMirror, RequestOutput, RequestSpec, RequestStatus,
    RequestView, Scheduler, SchedulerConfig, SchedulerConnector, SchedulerError, SchedulerView,
    ShadowState, StepResult,
};
pub use sorted_set::SortedSet;
#[cfg(any(test, feature = "testing"))]
pub use testing::{
    ConnectorCall, ScriptedConnector, ScriptedLoad, ScriptedMeta, ScriptedWorker, fake_token,
};
pub use tokens::{BlockHash, Token, hash_block};
pub use worker::{
    CopyRun, GuardedWorker, KvLayout, LayoutError, LayoutOrder, PlanError, ProtocolViolation,
    StepShape, Transfer, TransferCommand, TransferDirection, TransferDone, TransferResults,
    WorkerCall, WorkerConnector, WorkerError, WorkerPhase, WorkerProtocol, copy_plan,
};

use alloc::string::String;

/// Which semantics a machine follows where vLLM 0.33.0 has a known hazard.
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// vLLM 0.33.0 exactly (the default), so that traces recorded from vLLM replay unchanged.
    #[default]
    Compat,
    /// Hazards closed: what vLLM silently accepts is a typed error instead.
    Strict,
}

/// A broken internal invariant, named after its spec id (`I-xx` in SEMANTICS.md §8).
///
/// Returned by every machine's `check_invariants()`. It is never caused by bad input: it means
/// the machine itself is wrong, so callers in tests and the model checker treat it as a failure.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[error("invariant {id} broken: {detail}")]
pub struct InvariantViolation {
    /// The spec id, e.g. `"I-21"`.
    pub id: &'static str,
    /// What exactly was found.
    pub detail: String,
}

impl InvariantViolation {
    pub(crate) fn new(id: &'static str, detail: String) -> Self {
        Self { id, detail }
    }
}

/// Returns `Err(InvariantViolation)` from the enclosing function unless `cond` holds.
macro_rules! ensure_invariant {
    ($cond:expr, $id:literal, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::InvariantViolation::new($id, alloc::format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure_invariant;

/// Ends a public transition of a machine in debug builds: the machine's invariants hold again
/// (TigerBeetle asserts every step). Release builds compile it away.
///
/// A machine that stopped on a sticky error (`stopped`) is exempt: its state is, by definition,
/// no longer one the invariants describe (a connector broke its contract mid-transition), and
/// every later call returns the error.
macro_rules! debug_assert_invariants {
    ($machine:expr) => {
        debug_assert_eq!(
            $machine.check_invariants(),
            Ok(()),
            "kvrelay-core bug: an invariant broke in a public transition"
        );
    };
    ($machine:expr, stopped: $stopped:expr) => {
        if !$stopped {
            $crate::debug_assert_invariants!($machine);
        }
    };
}
pub(crate) use debug_assert_invariants;
