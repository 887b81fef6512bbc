//! The system model: the whole connector lifecycle of one engine, built from the core's own
//! machines (SEMANTICS.md §2.9, §8, §12).
//!
//! One state holds the real [`Scheduler`] (with the scheduler-side connector inside), W ranks
//! each running the real worker step protocol ([`GuardedWorker`] around the worker-side
//! connector), the real [`Aggregator`], the steps scheduled and not yet applied, and the
//! environment: transfers in flight per rank, requests still to arrive, budgets for aborts and
//! cache resets. Every action calls the same functions the runtime calls:
//!
//! | action | what runs |
//! | --- | --- |
//! | `Arrive(r)` | `Scheduler::add_request` (requests arrive in id order) |
//! | `Schedule` | `Scheduler::schedule` → `build_connector_meta` (up to `async_depth` steps ahead) |
//! | `Run(rank)` | that rank's hooks for its next step, in protocol order, until a `Wait` on a transfer still in flight or the step's end |
//! | `Complete { rank, job, ok }` | a transfer finishes: the ghost contents move, `handle_transfer_done` |
//! | `Deliver` | `Aggregator::aggregate` of the oldest step's outputs, then `update_from_output` |
//! | `Abort(r)` | `Scheduler::abort` |
//! | `Reset` | `Scheduler::reset_connector_cache` |
//! | `RemoteAck(r)` | a P/D decode side read held request `r`'s blocks (DATA checks them): `PdConnector::acknowledge` ([`Connectors::acknowledge`]) |
//!
//! # What is checked
//!
//! Besides every machine's `check_invariants()` after every action, the model keeps *ghost*
//! state that none of the machines reads: per rank, the abstract content of every GPU block and
//! of every external (host) slot. A forward pass writes the content of the tokens it computes; a
//! store copies GPU contents to its slots when it completes; a load copies slot contents into GPU
//! blocks. Before a forward pass, every block of the request's already-computed prefix must hold
//! exactly the content of those tokens: a load that served bytes stored under another key, a
//! block overwritten while a store read it, a load into a block given to someone else — all end
//! as a wrong content somewhere, or are caught where they happen. See [`property_names`].
//!
//! # Bounding the space
//!
//! Requests, tokens, blocks and chunks are small and fixed by [`SystemConfig`]. Steps are not
//! counted; instead an *idle* engine step (one that schedules no token, preempts nothing and
//! changes neither a request's status nor the scheduler-side connector) is allowed only
//! `idle_steps` times in a row without progress: an arrival, an abort, a reset, a step that is
//! not idle, or a delivered output that carried anything. Past that bound, one more step is
//! allowed while a rank holds a completed transfer and has no step left to report it in (its
//! next output may carry it, and a delivered output that carries it is progress). So only the
//! engine's own actions read or write the idle counter: a rank's actions never do, and a
//! transfer's completion is progress once it is reported, not when it happens. A correct
//! system is quiescent when no action is left; a system that can only spin is not, and the
//! [`property_names::QUIESCENT`] property reports it.
//!
//! # Partial-order reduction
//!
//! [`SystemModel::with_partial_order`] (`kvrelay check --partial-order true`, the default with
//! `--config deep`) explores, in some states, the actions of one rank only: an *ample set*
//! (a stubborn set in Valmari's terms). In a state `s` with no violation, let `r` be a rank and
//! `T` the actions of `r` enabled in `s` (`Run(r)` and its `Complete`s). `T` is explored alone
//! when, besides `T ≠ ∅` and `T` not being every enabled action:
//!
//! - **(A)** `r` has not output the oldest pending step. `Deliver` needs every rank's output of
//!   that step, so no `Deliver` can happen before an action of `r` does; and only `r`'s own
//!   actions change `r`'s driver, transfers and ghost memory, so no action outside `T` enables
//!   or disables an action of `T` (a `Run` needs the rank not waiting, a `Complete` its transfer
//!   in flight).
//! - **(B)** No `Schedule` can happen before an action of `r` does: the pipeline is full
//!   (`async_depth` steps pending, and only `Deliver` pops one), or every request arrived and
//!   none is left. (Otherwise (A3) below applies: a `Schedule` may preempt or finish a
//!   request whose witness a completion reads, which it checks.)
//! - **(C)** No action of `T` is a failing store `Complete` (it also forgets who stored its
//!   slots, which other ranks' stores write), and a failing load `Complete` is in `T` only under
//!   (A), not (A2): it sets the load-failed ghost that a `Schedule` reads, and no `Schedule`
//!   comes first under (A). A failure spends a budget other ranks' failures spend too, so one
//!   rank's failure may disable another's; but the budget is a count, so where `β·f` is
//!   possible for a failing load `f` of `T`, so is `f·β`, to the same state.
//! - **(E)** A `Complete` of a store reads whether its request finished (the delayed-free
//!   witness), which only an abort can change meanwhile (no `Deliver` by (A)): the witness was
//!   already seen, no abort is left, or the request cannot be aborted (it is finished or gone).
//! - **(F)** A `Complete` of a load reads who stored its slots (the shared-prefix witness),
//!   which other ranks' stores write: that witness is not one of the model's properties, or
//!   was already seen. (Neither the offloading pair nor the P/D pairs expect it.)
//! - **(G)** Every action of `T`, taken in `s`, breaks no property and changes the state. (A
//!   violation ends a path: taken first, it would hide what the other actions reach; a
//!   self-loop would postpone the others forever.)
//! - and the pair's ranks read their own external stores (not [`Connectors::shared_external`]),
//!   and there is no shared tier ([`SystemConfig::tier`]: its answers read and write every
//!   rank's primary chunks).
//!
//! Instead of (A) and (B), **(A2)**: the pipeline holds two steps, the oldest is aggregated (so
//! `Deliver` is enabled), no `Reset` can happen any more, and `r` output the oldest step but not
//! the second one. Then what can happen before `r` acts, besides other ranks' actions, is that
//! `Deliver`, at most one `Schedule` after it (the pipeline is then full again, and the next
//! `Deliver` needs `r`'s output), the arrivals still due (in id order) and aborts while the budget
//! lasts, in any order. Their effects do not depend on the ranks — they read the scheduler, which
//! nothing else in β changes, the oldest step's aggregated output, and the aggregator, which only
//! the second step's aggregation changes, and that needs `r` — so the model computes every state
//! they reach (`engine_side`, a handful: with one abort and three requests about twenty) and keeps
//! `r` only if each of its actions commutes with each of them: what a `Run` reports is not what the
//! `Deliver` emits (the quorum ghost resets those bits), its output does not complete the second
//! step, a completion reads no witness input (request finished, request preempted) that they
//! change. The idle counter needs no check: only engine actions read or write it (see *Bounding the
//! space*). A completion may let a `Schedule` past the idle bound (its rank then has a report due)
//! but never stops one, and a `Run` never changes whether its rank has a report due (it needs a
//! step to run, and a step's output collects the report), so no action of `r` disables a
//! `Schedule`. (C), (E), (F), (G) apply as well.
//!
//! Instead of (B), **(A3)**: (A) without a full pipeline — the rank has not output the oldest step,
//! the pipeline has room, and no `Reset` can happen any more. What can happen before the rank acts,
//! besides other ranks' actions, is then a `Schedule` while the pipeline has room, the arrivals
//! still due and aborts while the budget lasts (no `Deliver`: it needs the rank's output of the
//! oldest step). That is (A2)'s engine side without its `Deliver`, and the same `engine_side`
//! computes it (its `Deliver` branch needs the oldest step aggregated, which it is not) and the
//! same checks apply: a `Schedule` only appends a step in flight and the scheduler's state, a
//! rank's output only fills its slot of the oldest step (and aggregates it when it is the last one
//! in, which reads no slot of a later step), so the two commute unless the `Schedule` preempts (or
//! an abort finishes) a request whose witness a completion reads; (C) keeps a failing load out, as
//! under (A2). An `Arrive` only adds a request to the scheduler (and, for a P/D pair, seeds that
//! request's remote slots, which no transfer reads before it is scheduled). Measured on `deep` with
//! 2 requests (`--threads 1`): 136,880 → 116,248 unique states, with one abort 1,035,979 → 868,916,
//! P/D both sides 1,609,580 → 1,295,334, while a transfer's completion still reset the idle
//! counter; most candidates (A3) rejected then had an idle `Schedule` in front of such a
//! completion. Since the idle bound is the engine's own (*Bounding the space*) those commute, and
//! the same shapes take 69,590 unique states (195,066 without the reduction), 501,477 with one
//! abort, 461,306 for P/D.
//!
//! Among the ranks that qualify, the one with the fewest enabled actions is chosen.
//!
//! **Why every verdict is kept.** Call *β* any sequence of actions from `s` that contains no action
//! of `T`: by (A) and (B) it holds only other ranks' `Run`/`Complete`, `Arrive`, `Abort` and
//! `Reset` (by (A2): other ranks' actions, that `Deliver`, that `Schedule`, arrivals and aborts; by
//! (A3): other ranks' actions, `Schedule`s, arrivals and aborts — whose commutation with `T` (A2)
//! and (A3) check). Each of those commutes with each action `a` of `T`, state for state: they write
//! disjoint parts (another rank's driver, transfers and ghost memory; the engine's output slot of
//! another rank; the scheduler), and where both touch the same ghost field the writes commute (no
//! rank action touches the idle counter, and an action of `T` disables no `Schedule` of β: see
//! (A2); `flushed`, `store_failed`, `shared_loaded` are only set; `recv_reports` bits are per
//! rank). What `a` reads is fixed along β: its own rank's state, its step (shared and immutable),
//! and the ghost fields (C), (E), (F) cover; a `Run` reads no ghost state another part writes (the
//! recompute witness is set when the scheduler schedules the request, not in a rank's forward
//! pass). An `Arrive` seeds remote-prefill slots of the arriving request only, which no transfer in
//! flight reads or writes. A rank's output of the oldest step aggregates the step when it is the
//! last one in, whichever rank that is: the same outputs are folded in the same step order either
//! way. The checks after each action are either local to the acting rank (data, owned writes,
//! writes under a store, its reports' quorum bits, its protocol guard) or predicates of the
//! machines' state, which is the same after `a·β` and `β·a`. And no action of β disables a *key*
//! action of `T`: a `Run` or a completion that succeeds (a failing completion always comes with its
//! successful twin, which no β disables; the failure itself may be disabled by a β that spends the
//! last failure). These are the conditions D1 and D2 of a (weak) stubborn set.
//!
//! Every property of the model asks whether some reachable state satisfies a predicate:
//! a property's sticky violation flag, a sticky witness flag, "quiescent and no violation", or
//! "no action enabled and not quiescent". The state space is finite and acyclic: every action
//! either changes nothing (excluded by (G)) or increases the tuple (requests arrived, budgets
//! spent, the scheduler's step counter, steps delivered, each rank's position in its step
//! protocol) or, with all of those unchanged, completes a transfer (one fewer in flight; job
//! ids are never reused). So by induction on (length of the shortest full path from `s` to a
//! target state, longest path from `s`): if that path takes an action `a` of `T` after a β,
//! `a·β` reaches the same state and `s·a` is explored; if it takes none, `s·a·β` (`a` a key
//! action) reaches a
//! state where the same flags are set (sticky, and `a` breaks nothing by (G) and cannot make
//! β's checks fail), and `s·a` is closer to the end. A target "no action enabled" is never
//! reached by a β alone (`a` stays enabled), nor "quiescent" (`r` still has its step or a
//! transfer). So the reduced search reaches a target state of every property that the full
//! search reaches, and every state it reaches is a state of the full search: every verdict,
//! every counterexample's existence and every example's existence are kept. Counterexamples
//! are paths of the full model, replayed action by action ([`Model::actions`] is deterministic).
//! With symmetry the argument holds per representative: the conditions and the properties are
//! invariant under a permutation of ranks.
//!
//! `model-check/tests/system_por.rs` compares the verdict of every property with and without
//! the reduction on small configurations (aborts, transfer failures, both P/D roles, async
//! depth 2, seeded connector, runner and executor faults), breadth-first and depth-first with
//! symmetry.
//!
//! # Cost of a state
//!
//! The checker clones a state for every successor and hashes every state it generates. The
//! engine and each rank are held in a [`Shared`]: successors share the parts an action does not
//! write (a transfer completing writes one rank; a rank's step writes that rank, and the
//! engine once its output is in), a part is hashed once, when the action that wrote it is done,
//! and the machines' invariants are checked again only on the parts an action wrote
//! ([`Shared::same`]: an unwritten part is the very part of the state before, checked when it
//! was written). The successors the reduction computes to choose an ample set are kept for
//! the checker's next calls ([`crate::memo`]). None of this changes a state's identity: a
//! pinned state count is the same with and without it.
//!
//! # Checking your own connector
//!
//! The model is generic over [`Connectors`]: a scheduler-side and a worker-side connector over
//! the same metadata. [`OffloadingPair`] is kvrelay's CPU offloading connector; an engine checks
//! its own pair with the same properties:
//!
//! ```no_run
//! use kvrelay_model_check::{OffloadingPair, SystemConfig, SystemModel};
//! use stateright::{Checker, Model};
//!
//! let model = SystemModel::new(OffloadingPair::default(), SystemConfig::ci()).unwrap();
//! model.checker().spawn_bfs().join().assert_properties();
//! ```
//!
//! Why this file is long: the state, the environment's actions, the ghost state, the properties and
//! the partial-order reduction's conditions (A1)–(A3) are one argument — the reduction is sound
//! only for the actions and ghost fields defined here — so they stay in one file, in that order;
//! splitting it along those lines is open work.

use core::fmt;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvrelay_core::{
    BlockId, EngineCore, FinishDecision, ForwardPass, GroupKind, GuardedWorker, InvariantViolation,
    JobId, KeyLookup, LoadFailurePolicy, Lookup, ManagerConfig, Mode, OffloadKey, OffloadingConfig,
    OffloadingConnector, OffloadingConnectorMeta, OffloadingWorker, OffloadingWorkerConfig, Params,
    PolicyKind, Rank, RankAction, RankConfig, RankDriver, RankError, RequestId, RequestSpec,
    RequestStatus, ScheduledStep, Scheduler, SchedulerConfig, SchedulerConnector, SchedulerOutput,
    SchedulerView, SortedSet, TierReport, TierWork, Transfer, TransferDirection, TransferDone,
    TransferJob, WorkerCall, WorkerConnector, WorkerOutput,
};
use stateright::{Expectation, Model, Property};

use crate::diagram::Arrow;
use crate::explain::Explain;
use crate::memo;
use crate::shared::Shared;

mod tier;
pub use self::tier::{TierEnv, TierModel, TierPending, TierValue, tier_leak};

/// The names of the properties of [`SystemModel`], as they appear in a [`crate::CheckReport`].
pub mod property_names {
    /// `always`: no rank's step protocol guard rejected a call (I-1, I-2, I-6).
    pub const PROTOCOL: &str = "worker protocol order (I-1, I-2)";
    /// `always`: no GPU block is written (by a forward pass or a load) while a store that reads
    /// it is in flight on that rank (I-4, I-41).
    pub const NO_WRITE_UNDER_STORE: &str = "no KV write under an in-flight store (I-4, I-41)";
    /// `always`: before a forward pass, every block of a request's computed prefix holds the
    /// content of those tokens — so no load ever served bytes that were not stored under that
    /// key, and no block was overwritten under a request that still reads it.
    pub const DATA: &str = "loads serve the bytes stored under their key (data)";
    /// `always`: a load never writes a GPU block that, in the rank's own block tables, belongs
    /// to another request (I-17, I-20; vLLM PR #32255).
    pub const OWNED_WRITES: &str = "loads never write another request's block (I-17, I-20)";
    /// `always`: `request_finished` is called at most once per request, and exactly once for
    /// every request that finished (I-10).
    pub const FINISHED_ONCE: &str = "request_finished exactly once (I-10)";
    /// `always`: the aggregator emits a request's `finished_recving` only after every rank
    /// reported it, once per report round, and `failed_recving ⊆ finished_recving` (I-21, I-24).
    pub const QUORUM: &str = "completions emitted once, after every rank (I-21, I-24)";
    /// `always`: every machine's `check_invariants()` holds (scheduler I-12…I-20 and block pool,
    /// connector I-38…I-45, manager I-40, workers I-46/I-47, aggregator I-21…I-27) and no call
    /// returned an error.
    pub const CORE: &str = "core invariants hold, no call fails";
    /// `always`: a state where no action is enabled has every request finished and freed and
    /// no transfer or job in flight (bounded I-48: the system cannot get stuck).
    pub const QUIESCENT: &str = "no stuck state (bounded I-48)";
    /// `sometimes`: `handle_preemptions` made a rank wait for a store before a KV write.
    pub const FLUSHED: &str = "a store is flushed before its block is rewritten";
    /// `sometimes`: the scheduler preempts a running request.
    pub const PREEMPTED: &str = "a running request is preempted";
    /// `sometimes`: a request that was preempted loads offloaded chunks when it resumes.
    pub const RESUMED_FROM_OFFLOAD: &str = "a preempted request resumes from offloaded chunks";
    /// `sometimes`: a request loads chunks that another request stored.
    pub const SHARED_PREFIX_LOADED: &str = "a request loads a prefix another request stored";
    /// `sometimes`: a load failed and the scheduler then scheduled the request to compute
    /// tokens (it recomputes what it could not load).
    pub const LOAD_FAILED_RECOMPUTED: &str = "a load fails and the request recomputes";
    /// `sometimes`: a finished request's transfer (a P/D send) completed while the scheduler
    /// still held its blocks (a delayed free, I-15).
    pub const DELAYED_FREE: &str = "a finished request's blocks are held until its send completes";
    /// `sometimes`: a state with every request finished and nothing in flight.
    pub const ALL_DONE: &str = "all requests finished, nothing in flight";
    /// `sometimes`: a store transfer failed (its chunks were freed, `strict`) and still every
    /// request finished with nothing in flight.
    pub const STORE_FAILED_DONE: &str = "a store fails and every request still finishes";
    /// `sometimes`: a GPU load read a primary chunk that a promotion from the shared tier wrote.
    pub const TIER_PROMOTED_LOADED: &str = "a request loads a chunk promoted from the shared tier";
    /// `sometimes`: a shared-tier fault struck (a failure, a vanished key, a lost answer) and
    /// still every request finished with nothing in flight.
    pub const TIER_FAULT_DONE: &str = "a shared-tier fault and every request still finishes";
}

// ---------------------------------------------------------------------------------------------
// The connector pair under check.

/// A scheduler-side and a worker-side connector that the system model composes. Implement it
/// for your own connector to model-check it with kvrelay's properties.
pub trait Connectors: Clone + fmt::Debug + Eq + core::hash::Hash + Send + Sync + 'static {
    /// The scheduler-side connector.
    type Sched: SchedulerConnector<
            StepMeta: core::hash::Hash + Send + Sync,
            WorkerMeta: core::hash::Hash + Send + Sync,
        > + Clone
        + fmt::Debug
        + Eq
        + core::hash::Hash
        + Send
        + Sync;
    /// The worker-side connector (one per rank).
    type Worker: WorkerConnector<
            StepMeta = <Self::Sched as SchedulerConnector>::StepMeta,
            WorkerMeta = <Self::Sched as SchedulerConnector>::WorkerMeta,
        > + Clone
        + fmt::Debug
        + Eq
        + core::hash::Hash
        + Send
        + Sync;

    /// A short name for reports.
    fn name(&self) -> String;
    /// The scheduler-side connector for a run with `ranks` ranks.
    fn scheduler_connector(
        &self,
        config: &SchedulerConfig,
        model: &SystemConfig,
    ) -> Result<Self::Sched, String>;
    /// The worker-side connector of `rank`.
    fn worker(&self, rank: u32, model: &SystemConfig) -> Self::Worker;
    /// The connector's own invariants (called after every action).
    fn check_sched(&self, _connector: &Self::Sched) -> Result<(), InvariantViolation> {
        Ok(())
    }
    /// A worker connector's own invariants, and whether it recorded an error.
    fn check_worker(&self, _worker: &Self::Worker) -> Result<(), InvariantViolation> {
        Ok(())
    }
    /// One short line for a step's metadata in counterexamples (default: its `Debug`).
    fn describe_meta(&self, meta: &<Self::Sched as SchedulerConnector>::StepMeta) -> String {
        format!("{meta:?}")
    }
    /// The `sometimes` properties this pair is expected to reach under `config` (the others
    /// are not part of its model). Default: preemption and a clean end.
    fn expected_examples(&self, _config: &SystemConfig) -> Vec<&'static str> {
        vec![property_names::PREEMPTED, property_names::ALL_DONE]
    }
    /// Whether every rank reads one shared external store (a replicated layout where only some
    /// ranks write): loads on any rank then read rank 0's slots.
    fn shared_external(&self) -> bool {
        false
    }
    /// Whether a remote prefill instance holds every request's prompt KV at
    /// [`remote_slot`]`(request, index)` (P/D decode side): the model then seeds those
    /// slots, on every rank, with the prompt blocks' contents when the request arrives.
    fn remote_prefill(&self) -> bool {
        false
    }
    /// The `kv_transfer_params` request `id` arrives with (a router's, for a P/D connector).
    /// Default: none.
    fn request_params(&self, _id: RequestId, _model: &SystemConfig) -> Option<Params> {
        None
    }
    /// Requests whose held blocks the remote decode side may acknowledge now (P/D prefill
    /// side; an environment action each). Default: none.
    fn awaiting_ack(&self, _connector: &Self::Sched) -> Vec<RequestId> {
        Vec::new()
    }
    /// The remote decode side acknowledges `request` (one of [`Connectors::awaiting_ack`]).
    fn acknowledge(&self, _connector: &mut Self::Sched, _request: RequestId) {}
    /// Whether the environment may fail this load (connectors whose transfers cannot fail, as
    /// vLLM's offloading connector asserts, answer `false`). Default: no transfer fails.
    fn load_may_fail(&self, _load: &Transfer) -> bool {
        false
    }
    /// Whether the environment may fail this store. Default: no store fails.
    fn store_may_fail(&self, _store: &Transfer) -> bool {
        false
    }
    /// Whether the scheduler-side connector drives a shared tier when [`SystemConfig::tier`]
    /// asks for one (the model refuses the tier otherwise). Default: no.
    fn has_tier(&self) -> bool {
        false
    }
    /// The shared tier's work since the last call ([`SystemConfig::tier`]). Default: none.
    fn take_tier_work(&self, _connector: &mut Self::Sched) -> Vec<TierWork> {
        Vec::new()
    }
    /// Hands the connector what the shared tier did. Default: refused (no tier).
    fn report_tier(&self, _connector: &mut Self::Sched, _report: TierReport) -> Result<(), String> {
        Err("this pair has no shared tier".to_owned())
    }
    /// What the connector still holds once nothing is left to do, if anything (a quiescent
    /// state must hold nothing). Default: nothing to say.
    fn leak(&self, _connector: &Self::Sched) -> Option<String> {
        None
    }
}

/// The external location of prompt block `index` of `request` on the remote prefill instance
/// that the model seeds for a pair with [`Connectors::remote_prefill`]: the core's P/D address
/// (a P/D connector's decode side loads from there).
pub use kvrelay_core::pd::{is_remote_slot, remote_slot};

/// kvrelay's CPU offloading connector ([`OffloadingConnector`] + [`OffloadingWorker`]).
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct OffloadingPair {
    /// Fault injected into the scheduler side (none: kvrelay's code as shipped).
    pub fault: Option<SchedFault>,
}

impl Connectors for OffloadingPair {
    type Sched = Faulty<OffloadingConnector>;
    type Worker = OffloadingWorker;

    fn name(&self) -> String {
        match self.fault {
            None => "offloading".to_owned(),
            Some(f) => format!("offloading with fault {f:?}"),
        }
    }

    fn scheduler_connector(
        &self,
        config: &SchedulerConfig,
        model: &SystemConfig,
    ) -> Result<Self::Sched, String> {
        let off = OffloadingConfig {
            blocks_per_chunk: model.blocks_per_chunk,
            num_workers: model.ranks,
            offload_prompt_only: true,
            sync_load_budget_tokens: 0,
            manager: ManagerConfig {
                capacity_chunks: model.cpu_chunks,
                policy: model.policy,
                store_threshold: 0,
            },
            tiering: model.tier.as_ref().map(TierModel::tiering),
        };
        let inner = OffloadingConnector::new(off, config).map_err(|e| e.to_string())?;
        Ok(Faulty {
            inner,
            fault: self.fault,
        })
    }

    fn worker(&self, _rank: u32, model: &SystemConfig) -> Self::Worker {
        OffloadingWorker::new(OffloadingWorkerConfig {
            blocks_per_chunk: model.blocks_per_chunk,
            is_store_writer: true,
            bytes_per_block: 1,
            mode: model.mode,
        })
    }

    fn check_sched(&self, c: &Self::Sched) -> Result<(), InvariantViolation> {
        c.inner.check_invariants()
    }

    /// Flushes, preemption, resumption from offloaded chunks and a clean end; with transfer
    /// failures, a failed load recomputed and a failed store survived. (A load of chunks
    /// another request stored is not expected: in the small presets the shared prefix stays in
    /// the GPU prefix cache; no exhaustive or random run so far reached it.)
    fn expected_examples(&self, config: &SystemConfig) -> Vec<&'static str> {
        use property_names as n;
        if let Some(t) = &config.tier {
            // The tier's own witnesses (its small configurations are shaped for promotions,
            // not for preemption).
            let mut v = vec![n::ALL_DONE, n::TIER_PROMOTED_LOADED];
            if t.failures + t.vanish + t.lost > 0 {
                v.push(n::TIER_FAULT_DONE);
            }
            return v;
        }
        let mut v = vec![
            n::FLUSHED,
            n::PREEMPTED,
            n::RESUMED_FROM_OFFLOAD,
            n::ALL_DONE,
        ];
        if config.load_failures > 0 {
            v.push(n::LOAD_FAILED_RECOMPUTED);
        }
        if config.store_failures > 0 {
            v.push(n::STORE_FAILED_DONE);
        }
        v
    }

    /// Any offloading transfer may fail (the configuration bounds how many): `strict` workers
    /// absorb the failure, `compat` ones stop with vLLM's assertion as a sticky error (which
    /// [`Connectors::check_worker`] reports).
    fn load_may_fail(&self, _load: &Transfer) -> bool {
        true
    }

    fn store_may_fail(&self, _store: &Transfer) -> bool {
        true
    }

    fn has_tier(&self) -> bool {
        true
    }

    fn take_tier_work(&self, c: &mut Self::Sched) -> Vec<TierWork> {
        c.inner.take_tier_work()
    }

    fn report_tier(&self, c: &mut Self::Sched, report: TierReport) -> Result<(), String> {
        c.inner.report_tier(report).map_err(|e| e.to_string())
    }

    fn leak(&self, c: &Self::Sched) -> Option<String> {
        tier_leak(&c.inner)
    }

    fn describe_meta(&self, meta: &OffloadingConnectorMeta) -> String {
        let jobs = |m: &BTreeMap<JobId, TransferJob>| {
            m.iter()
                .map(|(j, t)| {
                    let blocks: Vec<u64> = t.gpu.block_ids.iter().flatten().map(|b| b.0).collect();
                    format!("job {} req {} blocks {blocks:?}", j.0, t.request.0)
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !meta.load_jobs.is_empty() {
            parts.push(format!("loads [{}]", jobs(&meta.load_jobs)));
        }
        if !meta.store_jobs.is_empty() {
            parts.push(format!("stores [{}]", jobs(&meta.store_jobs)));
        }
        if !meta.jobs_to_flush.is_empty() {
            let f: Vec<u64> = meta.jobs_to_flush.iter().map(|j| j.0).collect();
            parts.push(format!("flush {f:?}"));
        }
        parts.join("; ")
    }

    fn check_worker(&self, w: &Self::Worker) -> Result<(), InvariantViolation> {
        w.check_invariants()?;
        match w.error() {
            None => Ok(()),
            Some(e) => Err(InvariantViolation {
                id: "I-46",
                detail: format!("worker error: {e:?}"),
            }),
        }
    }
}

/// Writes the listed [`SchedulerConnector`] methods as calls of the same method on
/// `self.$field`: for the wrappers of this crate ([`Faulty`], [`Counted`],
/// [`crate::FaultyMulti`]) that change one or two calls and pass every other one through.
macro_rules! forward_scheduler_calls {
    ($field:ident: $($method:ident),* $(,)?) => {
        $( forward_scheduler_calls!(@one $field $method); )*
    };
    (@one $f:ident on_new_request) => {
        fn on_new_request(
            &mut self,
            view: &kvrelay_core::SchedulerView<'_>,
            request: kvrelay_core::RequestId,
        ) {
            self.$f.on_new_request(view, request);
        }
    };
    (@one $f:ident get_num_new_matched_tokens) => {
        fn get_num_new_matched_tokens(
            &mut self,
            view: &kvrelay_core::SchedulerView<'_>,
            request: kvrelay_core::RequestId,
            num_computed_tokens: u32,
        ) -> kvrelay_core::Lookup {
            self.$f
                .get_num_new_matched_tokens(view, request, num_computed_tokens)
        }
    };
    (@one $f:ident update_state_after_alloc) => {
        fn update_state_after_alloc(
            &mut self,
            view: &kvrelay_core::SchedulerView<'_>,
            request: kvrelay_core::RequestId,
            blocks: &[Vec<kvrelay_core::BlockId>],
            num_external_tokens: u32,
        ) {
            self.$f
                .update_state_after_alloc(view, request, blocks, num_external_tokens);
        }
    };
    (@one $f:ident build_connector_meta) => {
        fn build_connector_meta(
            &mut self,
            view: &kvrelay_core::SchedulerView<'_>,
            output: &kvrelay_core::SchedulerOutput,
        ) -> Self::StepMeta {
            self.$f.build_connector_meta(view, output)
        }
    };
    (@one $f:ident update_connector_output) => {
        fn update_connector_output(
            &mut self,
            view: &kvrelay_core::SchedulerView<'_>,
            output: &kvrelay_core::AggregatedOutput<Self::WorkerMeta>,
        ) {
            self.$f.update_connector_output(view, output);
        }
    };
    (@one $f:ident request_finished) => {
        fn request_finished(
            &mut self,
            view: &kvrelay_core::SchedulerView<'_>,
            request: kvrelay_core::RequestId,
            blocks: &[Vec<kvrelay_core::BlockId>],
        ) -> kvrelay_core::FinishDecision {
            self.$f.request_finished(view, request, blocks)
        }
    };
    (@one $f:ident take_events) => {
        fn take_events(&mut self) -> Vec<kvrelay_core::KvEvent> {
            self.$f.take_events()
        }
    };
    (@one $f:ident take_intents) => {
        fn take_intents(&mut self) -> Vec<kvrelay_core::Intent> {
            self.$f.take_intents()
        }
    };
    (@one $f:ident take_error) => {
        fn take_error(&mut self) -> Option<kvrelay_core::ConnectorError> {
            self.$f.take_error()
        }
    };
    (@one $f:ident has_pending_block_frees) => {
        fn has_pending_block_frees(&self, view: &kvrelay_core::SchedulerView<'_>) -> bool {
            self.$f.has_pending_block_frees(view)
        }
    };
    (@one $f:ident has_pending_push_work) => {
        fn has_pending_push_work(&self) -> bool {
            self.$f.has_pending_push_work()
        }
    };
    (@one $f:ident reset_cache) => {
        fn reset_cache(&mut self) -> Option<bool> {
            self.$f.reset_cache()
        }
    };
    (@one $f:ident get_finished_count) => {
        fn get_finished_count(&self) -> Option<u32> {
            self.$f.get_finished_count()
        }
    };
    (@one $f:ident requires_kv_delivery) => {
        fn requires_kv_delivery(&self) -> bool {
            self.$f.requires_kv_delivery()
        }
    };
}
pub(crate) use forward_scheduler_calls;

/// Faults a test can inject into a scheduler-side connector, to show the checker finds the
/// historical bugs they reproduce. Production code has no such switch: the fault lives in the
/// [`Faulty`] wrapper, in this crate.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum SchedFault {
    /// vLLM issue #46951: `update_state_after_alloc` with zero external tokens is not passed on,
    /// so the connector never learns that a fenced block was reallocated.
    DropZeroExternalAlloc,
    /// vLLM issue #46014: a request that still has jobs in flight (a preempted request whose
    /// stores are not acknowledged yet) is looked up as if it had none — the lookup answers the
    /// manager's ready chunks (a chunk still being stored ends the run, as in the connector of
    /// the bug report) instead of `None`, so a load job joins the request's store jobs.
    /// With vLLM 0.33's lookup, where a chunk still being stored defers the answer, the
    /// explored configurations never reach the crash: see `historical_bugs.rs`.
    LookupIgnoresJobs,
}

/// A scheduler-side connector, optionally with a [`SchedFault`]. Without a fault every call is
/// passed through unchanged.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Faulty<C> {
    /// The real connector.
    pub inner: C,
    /// The injected fault.
    pub fault: Option<SchedFault>,
}

impl Faulty<OffloadingConnector> {
    /// The faulty lookup of [`SchedFault::LookupIgnoresJobs`], as in the connector of the bug
    /// report: no check for the request's own jobs, and a chunk whose store is still in flight
    /// counts as not stored (the CPU manager answered "absent" for it before vLLM PR #41795).
    /// For the full-attention group: the run of stored chunks from the chunk holding the first
    /// token not computed locally (`computed / chunk`, rounded down, as the real lookup), fewer
    /// than one chunk's tokens counting as no hit.
    fn ready_prefix(
        &self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed: u32,
    ) -> Lookup {
        let Some(r) = view.request(request) else {
            return Lookup::MISS;
        };
        let bpc = self.inner.config().blocks_per_chunk as usize;
        let chunk_tokens = view.config().block_size * bpc as u32;
        let full_chunks = (r.block_hashes().len() / bpc) as u32;
        let start = num_computed / chunk_tokens;
        let mut end = start;
        while end < full_chunks {
            let hash = r.block_hashes()[(end as usize + 1) * bpc - 1];
            if self.inner.manager().lookup(OffloadKey { hash, group: 0 }) != KeyLookup::Hit {
                break;
            }
            end += 1;
        }
        let reach = (end * chunk_tokens).min(r.tokens().len() as u32);
        let tokens = reach.saturating_sub(num_computed);
        let tokens = if tokens < chunk_tokens { 0 } else { tokens };
        Lookup::Hit {
            tokens,
            load_async: tokens > 0,
        }
    }
}

impl SchedulerConnector for Faulty<OffloadingConnector> {
    type StepMeta = OffloadingConnectorMeta;
    type WorkerMeta = kvrelay_core::Meta;

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let answer = self
            .inner
            .get_num_new_matched_tokens(view, request, num_computed_tokens);
        if answer == Lookup::Pending
            && self.fault == Some(SchedFault::LookupIgnoresJobs)
            && !self.inner.request_jobs(request).is_empty()
        {
            return self.ready_prefix(view, request, num_computed_tokens);
        }
        answer
    }
    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        if num_external_tokens == 0 && self.fault == Some(SchedFault::DropZeroExternalAlloc) {
            return;
        }
        self.inner
            .update_state_after_alloc(view, request, blocks, num_external_tokens);
    }
    forward_scheduler_calls!(inner:
        on_new_request, build_connector_meta, update_connector_output, request_finished,
        take_events, take_intents, take_error, has_pending_block_frees, has_pending_push_work,
        reset_cache, get_finished_count, requires_kv_delivery,
    );
}

/// The scheduler-side connector as the model holds it: the pair's connector, plus how often
/// `request_finished` was called per request (I-10; saturating at 2).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Counted<C> {
    inner: C,
    finished_calls: Vec<u8>,
}

impl<C> Counted<C> {
    /// The pair's connector.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: SchedulerConnector> SchedulerConnector for Counted<C> {
    type StepMeta = C::StepMeta;
    type WorkerMeta = C::WorkerMeta;

    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        if let Some(n) = self.finished_calls.get_mut(request.index()) {
            *n = n.saturating_add(1).min(2);
        }
        self.inner.request_finished(view, request, blocks)
    }
    forward_scheduler_calls!(inner:
        on_new_request, get_num_new_matched_tokens, update_state_after_alloc,
        build_connector_meta, update_connector_output, take_events, take_intents, take_error,
        has_pending_block_frees, has_pending_push_work, reset_cache, get_finished_count,
        requires_kv_delivery,
    );
}

/// The worker → scheduler metadata of a pair.
pub type WMeta<P> = <<P as Connectors>::Sched as SchedulerConnector>::WorkerMeta;

// ---------------------------------------------------------------------------------------------
// Configuration.

/// Faults of the executor and the model runner, each reproducing a historical bug. `None`
/// everywhere is kvrelay's runtime as shipped. The step's sequencing lives in kvrelay-core
/// (its rank driver and engine core), so these faults are re-introduced there, behind its
/// `fault-injection` feature: every fault needs this crate's `scheduler-faults` feature
/// ([`SystemModel::new`] refuses one otherwise).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct EnvFaults {
    /// vLLM PR #42676: the runner binds the step's metadata before `handle_preemptions`.
    pub bind_first: bool,
    /// Mooncake PR #52470: the runner never calls `handle_preemptions` (the guard then rejects
    /// `bind`, so this is modelled as a runner that skips the hook's waits and transfers).
    pub skip_handle_preemptions: bool,
    /// vLLM issue #21070: the executor hands the aggregator only rank 0's output.
    pub one_rank_output: bool,
    /// A historical bug of the core scheduler itself, re-introduced through kvrelay-core's
    /// `fault-injection` feature: needs this crate's `scheduler-faults` feature
    /// ([`SystemModel::new`] refuses it otherwise).
    pub scheduler: Option<CoreFault>,
}

/// Historical bugs of the scheduler (see [`EnvFaults::scheduler`]).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum CoreFault {
    /// Before vLLM PR #32255: a request aborted while its async load is in flight has its
    /// blocks freed at once (I-17).
    FreeAbortedWhileLoading,
    /// Before vLLM issue #33775: a first allocation with a local hit and external tokens
    /// claims and allocates group by group, so one group's new block can be another group's
    /// hit block, which then sits in two groups (I-20). Needs two groups (`sliding_window`).
    ClaimHitsGroupByGroup,
}

/// What the system model explores. Start from a preset ([`SystemConfig::ci`],
/// [`SystemConfig::deep`]) and override fields.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct SystemConfig {
    /// Worker ranks (W), the aggregator's quorum and the jobs' acknowledgement count.
    pub ranks: u32,
    /// Requests; request `i` arrives after request `i − 1`.
    pub requests: u32,
    /// Prompt tokens per request (a multiple of `block_size`).
    pub prompt_tokens: u32,
    /// How many leading prompt tokens all requests share (so one can load what another stored).
    pub shared_tokens: u32,
    /// Output tokens per request.
    pub max_tokens: u32,
    /// Tokens per GPU block.
    pub block_size: u32,
    /// The scheduler's GPU prefix cache (`enable_prefix_caching`). Off, a re-admitted or new
    /// request finds nothing on the GPU and every hit comes from the offloading connector.
    pub prefix_caching: bool,
    /// GPU blocks, the null block included: small, so that preemption and block reuse happen.
    pub gpu_blocks: u32,
    /// Token budget per step.
    pub max_batched_tokens: u32,
    /// A sliding-window group (window in tokens) besides the full-attention group.
    pub sliding_window: Option<u32>,
    /// GPU blocks per offloaded chunk.
    pub blocks_per_chunk: u32,
    /// CPU chunks of the offloading manager.
    pub cpu_chunks: u32,
    /// The manager's replacement policy.
    pub policy: PolicyKind,
    /// Steps scheduled before the oldest one's output is applied (1 = synchronous).
    pub async_depth: u32,
    /// Scheduler and aggregator mode.
    pub mode: Mode,
    /// Aborts the environment may issue.
    pub aborts: u32,
    /// `reset_connector_cache` calls the environment may issue.
    pub resets: u32,
    /// Load transfers the environment may fail (a failed load leaves its blocks half-written).
    pub load_failures: u32,
    /// Store transfers the environment may fail (a failed store leaves its external slots
    /// half-written).
    pub store_failures: u32,
    /// Transfers of one rank complete in submission order (`false`: in any order).
    pub ordered_completions: bool,
    /// Consecutive idle engine steps without progress (see the module docs, *Bounding the
    /// space*).
    pub idle_steps: u32,
    /// Environment faults.
    pub faults: EnvFaults,
    /// A shared tier behind the offloading connector's CPU tier, with an adversarial store
    /// (`system/tier.rs`; [`OffloadingPair`] only). `None`: no tier.
    pub tier: Option<TierModel>,
}

impl SystemConfig {
    /// The configuration CI explores exhaustively: 2 ranks, 2 requests of 2 blocks sharing the
    /// first, 1 output token each, 4 usable GPU blocks, 2 CPU chunks of 1 block, LRU,
    /// synchronous scheduling, one abort.
    pub fn ci() -> Self {
        Self {
            ranks: 2,
            requests: 2,
            prompt_tokens: 2,
            shared_tokens: 1,
            max_tokens: 2,
            block_size: 1,
            prefix_caching: true,
            gpu_blocks: 4,
            max_batched_tokens: 8,
            sliding_window: None,
            blocks_per_chunk: 1,
            cpu_chunks: 3,
            policy: PolicyKind::Lru,
            async_depth: 1,
            mode: Mode::Compat,
            aborts: 1,
            resets: 0,
            load_failures: 0,
            store_failures: 0,
            ordered_completions: true,
            idle_steps: 1,
            faults: EnvFaults::default(),
            tier: None,
        }
    }

    /// A larger configuration: 3 ranks, 3 requests, preemption and resumption from offloaded
    /// chunks (a tight GPU pool), async scheduling depth 2; no abort. Exhaustive with symmetry
    /// over ranks and partial-order reduction in about 30 seconds on 2 cores: `kvrelay check
    /// --config deep --symmetry` (2.6 M unique states; 11.5 M before the engine step, the
    /// engine's own idle bound and the reduction). With one abort (`--aborts 1`): 23.4 M unique
    /// states, about 5 minutes. With the P/D connector (both sides: remote loads, sends) and
    /// one load failure: `kvrelay check --connector pd --pd-role both --config deep
    /// --symmetry` (9.0 M unique states, about a minute and a half, measured likewise).
    pub fn deep() -> Self {
        Self {
            ranks: 3,
            requests: 3,
            gpu_blocks: 5,
            async_depth: 2,
            aborts: 0,
            ..Self::ci()
        }
    }

    /// Checks the configuration can be explored.
    pub fn validate(&self) -> Result<(), String> {
        if self.ranks == 0 || self.ranks > 8 {
            return Err(format!("ranks must be 1..=8, not {}", self.ranks));
        }
        if self.requests == 0 || self.requests > 8 {
            return Err(format!("requests must be 1..=8, not {}", self.requests));
        }
        if self.block_size == 0 || self.prompt_tokens == 0 {
            return Err("block_size and prompt_tokens must be at least 1".to_owned());
        }
        if !self.prompt_tokens.is_multiple_of(self.block_size) {
            return Err(format!(
                "prompt_tokens ({}) must be a multiple of block_size ({})",
                self.prompt_tokens, self.block_size
            ));
        }
        if self.shared_tokens > self.prompt_tokens {
            return Err("shared_tokens cannot exceed prompt_tokens".to_owned());
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".to_owned());
        }
        // vLLM refuses to start when the KV cache cannot hold one request of the model length;
        // here: every group holding every block of a request's prompt and outputs (a fresh
        // prefill needs all of them, sliding window included).
        let groups = 1 + u32::from(self.sliding_window.is_some());
        let tokens = self.prompt_tokens + self.max_tokens - 1;
        let needed = groups * tokens.div_ceil(self.block_size);
        if needed > self.gpu_blocks.saturating_sub(1) {
            return Err(format!(
                "a request needs up to {needed} GPU blocks ({groups} group(s) × {tokens} tokens), \
                 more than the {} usable ones (gpu_blocks minus the null block): it could never \
                 be admitted again after a preemption",
                self.gpu_blocks.saturating_sub(1)
            ));
        }
        if self.async_depth == 0 || self.async_depth > 8 {
            return Err(format!(
                "async_depth must be 1..=8, not {}",
                self.async_depth
            ));
        }
        Ok(())
    }

    fn scheduler_config(&self) -> SchedulerConfig {
        let mut groups = vec![GroupKind::FullAttention];
        if let Some(w) = self.sliding_window {
            groups.push(GroupKind::SlidingWindow { window: w });
        }
        SchedulerConfig {
            block_size: self.block_size,
            num_gpu_blocks: self.gpu_blocks,
            groups,
            max_num_batched_tokens: self.max_batched_tokens,
            max_num_seqs: 16,
            max_model_len: self.prompt_tokens + self.max_tokens + 1,
            enable_prefix_caching: self.prefix_caching,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            watermark_blocks: 0,
            load_failure_policy: LoadFailurePolicy::Recompute,
            async_depth: self.async_depth,
            mode: self.mode,
        }
    }

    /// The prompt of request `i`: the shared prefix, then tokens of its own. Prompt tokens are
    /// at least 100 000, above every token the fake sampler produces.
    fn prompt(&self, i: u32) -> Vec<u32> {
        (0..self.prompt_tokens)
            .map(|p| {
                if p < self.shared_tokens {
                    100_000 + p
                } else {
                    200_000 + i * 1_000 + p
                }
            })
            .collect()
    }
}

impl Default for SystemConfig {
    /// [`SystemConfig::ci`].
    fn default() -> Self {
        Self::ci()
    }
}

// ---------------------------------------------------------------------------------------------
// State.

/// Abstract block contents. `EMPTY`: never written; `PARTIAL`: written by a forward pass that
/// did not complete the block; `CORRUPT`: copied from a block that was overwritten while being
/// read. Any other value is the content of one block of one request: the block hash of a prompt
/// block, or a tag of (request, block index) for generated tokens.
const EMPTY: u64 = 0;
const PARTIAL: u64 = 1;
const CORRUPT: u64 = 2;
const GENERATED: u64 = 1 << 63;

/// A transfer a rank started and that has not completed.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct InFlight {
    /// What the worker asked for (shared: it does not change while in flight).
    pub transfer: Arc<Transfer>,
    /// A store's source block was written while the store was in flight.
    pub dirty: bool,
}

/// One rank: the core's rank driver (its guarded worker connector, block tables and step
/// progress), the transfers the environment has in flight for it and the ghost contents of its
/// memory. The environment keeps its own transfers rather than the tests' simulated DMA
/// (`kvrelay_core::testing::SimDma`), because it offers every order of completions as a choice
/// (`Complete`) where that DMA completes them in one fixed order.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct RankState<P: Connectors> {
    driver: RankDriver<P::Worker>,
    /// Transfers in flight, in submission order.
    in_flight: Vec<InFlight>,
    /// Ghost: the content of every GPU block.
    gpu: Vec<u64>,
    /// Ghost: the content of every external slot written so far.
    external: BTreeMap<u64, u64>,
    /// A transfer of this rank completed since its last step output: the next output may
    /// report it (what lets an engine step past the idle bound, see [`SystemModel`]'s docs).
    uncollected: bool,
    /// This rank is interchangeable with the others (see the `Representative` impl).
    symmetric: bool,
}

impl<P: Connectors> RankState<P> {
    /// The rank's driver.
    pub fn driver(&self) -> &RankDriver<P::Worker> {
        &self.driver
    }

    /// The guarded worker connector.
    pub fn worker(&self) -> &GuardedWorker<P::Worker> {
        self.driver.worker()
    }

    /// Transfers in flight on this rank.
    pub fn in_flight(&self) -> &[InFlight] {
        &self.in_flight
    }

    /// The transfer of `job` in flight on this rank.
    fn in_flight_job(&self, job: JobId) -> Option<&InFlight> {
        self.in_flight.iter().find(|t| t.transfer.job == job)
    }
}

/// A scheduled step whose output has not been applied.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PendingStep<M> {
    /// What was scheduled, with the connector metadata for every rank.
    pub step: ScheduledStep<M>,
    /// Ghost: per scheduled request, the content of each of its blocks, fixed when the step is
    /// scheduled (an abort after that does not stop the step's forward pass).
    pub contents: BTreeMap<RequestId, Vec<u64>>,
}

/// History for the properties. Violations are sticky; a state with one has no successors.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct Ghost {
    /// Why each violated property failed (property name, first detail).
    pub violations: Vec<(&'static str, String)>,
    /// Per request: ranks that reported `finished_recving` since its last emission (bit mask).
    recv_reports: Vec<u32>,
    /// Per request: ranks that reported a load failure since its last emission.
    recv_failed: Vec<u32>,
    /// Per request: the request was preempted at least once.
    preempted: Vec<bool>,
    /// Per request: one of its loads failed.
    load_failed: Vec<bool>,
    /// Per request: the rank and external slots of stores it completed (who stored what).
    stored_by: BTreeMap<u64, u32>,
    /// `sometimes` witnesses.
    flushed: bool,
    resumed_from_offload: bool,
    shared_loaded: bool,
    recomputed_after_failure: bool,
    delayed_free: bool,
    store_failed: bool,
    tier_promoted_loaded: bool,
    /// Consecutive steps without progress.
    idle: u32,
}

impl Ghost {
    fn violate(&mut self, property: &'static str, detail: String) {
        if !self.violations.iter().any(|(p, _)| *p == property) {
            self.violations.push((property, detail));
        }
    }

    fn violated(&self, property: &str) -> bool {
        self.violations.iter().any(|(p, _)| *p == property)
    }

    /// Clears the witness of a shared prefix load, which no property of kvrelay's pairs reads
    /// and which the partial-order reduction may set on one interleaving and not another (its
    /// condition (F)); for tests that compare states of the full and the reduced search.
    #[doc(hidden)]
    pub fn clear_unobserved(&mut self) {
        self.shared_loaded = false;
    }
}

/// For the partial-order reduction's condition (A2): what the engine-side actions that may
/// happen before the chosen rank acts do — `Deliver` of the oldest step, at most one
/// `Schedule` after it, aborts while the budget lasts — in every order they can take.
#[derive(Clone, Debug)]
struct EngineSide {
    /// The quorum ghost after `Deliver` (it resets the bits of what it emits; aborts and
    /// `Schedule` leave them alone, so every `Deliver` of those orders resets the same bits).
    delivered_reports: Vec<u32>,
    delivered_failed: Vec<u32>,
    /// Per request: whether it is finished is not the same in every state they reach.
    finished_moves: Vec<bool>,
    /// Per request: its preempted witness is not the same in every state they reach.
    preempted_moves: Vec<bool>,
}

/// At most this many states are explored to compute an [`EngineSide`] (with one abort and
/// three requests they are about twenty); past it, (A2) does not apply.
const ENGINE_SIDE_BOUND: usize = 256;

/// A state of the system model.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct SystemState<P: Connectors> {
    /// The core's engine side: the real scheduler with the real scheduler-side connector, the
    /// ranks' outputs per step and the executor's aggregator. Shared with the states before
    /// and after an action that does not write it (a transfer completing).
    pub engine: Shared<EngineCore<Counted<P::Sched>>>,
    /// The ranks, each shared with the states before and after an action of another part.
    pub ranks: Vec<Shared<RankState<P>>>,
    /// Steps scheduled, not yet applied, oldest first (what the ranks begin).
    /// Shared: a step does not change once scheduled, so states share it instead of copying.
    pub steps: VecDeque<Shared<PendingStep<<P::Sched as SchedulerConnector>::StepMeta>>>,
    /// Requests that arrived so far (ids `0..arrived`).
    pub arrived: u32,
    /// Aborts left.
    pub aborts_left: u32,
    /// Resets left.
    pub resets_left: u32,
    /// Load failures left.
    pub failures_left: u32,
    /// Store failures left.
    pub store_failures_left: u32,
    /// The shared tier's store and work in flight ([`SystemConfig::tier`]; empty without).
    pub tier: TierEnv,
    /// Property history.
    pub ghost: Ghost,
}

impl<P: Connectors> SystemState<P> {
    /// The scheduler.
    pub fn scheduler(&self) -> &Scheduler<Counted<P::Sched>> {
        self.engine.scheduler()
    }

    /// `a` and `b` are equal but for their ranks: what `Deliver` and `Schedule` read, and what
    /// they write besides the ranks (the reduction's (A2) reuses their effects, computed from
    /// one state, for another that agrees on these parts).
    fn same_but_ranks(a: &Self, b: &Self) -> bool {
        let SystemState {
            engine,
            ranks: _,
            steps,
            arrived,
            aborts_left,
            resets_left,
            failures_left,
            store_failures_left,
            tier,
            ghost,
        } = a;
        *engine == b.engine
            && *steps == b.steps
            && *arrived == b.arrived
            && *aborts_left == b.aborts_left
            && *resets_left == b.resets_left
            && *failures_left == b.failures_left
            && *store_failures_left == b.store_failures_left
            && *tier == b.tier
            && *ghost == b.ghost
    }
}

/// Symmetry over ranks: the ranks are sorted by a fingerprint of their whole state (worker
/// connector, protocol guard, transfers, block tables, ghost contents — its [`Shared::digest`]
/// — and its outputs pending in the engine), and the engine's output slots and the per-rank
/// ghost masks are permuted with them.
///
/// Sound only where the ranks are interchangeable, which the model checks before permuting:
/// the aggregator in `compat` mode (it counts reports; `strict` keeps per-rank masks), no
/// environment fault singling out rank 0, every rank reading its own external store, and every
/// rank's connector built alike. Otherwise the state is its own representative. Any
/// permutation is a valid representative, so a fingerprint collision only costs reduction.
impl<P: Connectors> stateright::Representative for SystemState<P> {
    fn representative(&self) -> Self {
        let symmetric = self.engine.aggregator().mode() == Mode::Compat
            && !self.ranks.is_empty()
            && self.ranks.iter().all(|r| r.symmetric);
        if !symmetric || self.ranks.len() < 2 {
            return self.clone();
        }
        use core::hash::{Hash, Hasher};
        let mut order: Vec<(u64, usize)> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| {
                // SipHash with fixed zero keys: deterministic across runs. The rank's outputs
                // waiting in the engine are part of its state.
                let mut h = std::hash::DefaultHasher::new();
                h.write_u64(r.digest());
                for o in self.engine.rank_outputs(Rank(i as u32)) {
                    o.hash(&mut h);
                }
                (h.finish(), i)
            })
            .collect();
        order.sort_unstable();
        if order.iter().enumerate().all(|(new, &(_, old))| new == old) {
            return self.clone();
        }
        let mut s = self.clone();
        s.ranks = order
            .iter()
            .map(|&(_, old)| self.ranks[old].clone())
            .collect();
        // The engine keeps one output slot per rank: renumber them, unless every rank's slots
        // are alike (then the permutation leaves the engine as it is, and the states share it).
        let outputs = |i: usize| self.engine.rank_outputs(Rank(i as u32));
        if (1..self.ranks.len()).any(|i| !outputs(i).eq(outputs(0))) {
            let olds: Vec<usize> = order.iter().map(|&(_, old)| old).collect();
            s.engine.make_mut().permute_ranks(&olds);
            s.engine.seal();
        }
        let permute = |mask: u32| {
            order
                .iter()
                .enumerate()
                .fold(0u32, |m, (new, &(_, old))| m | (((mask >> old) & 1) << new))
        };
        for m in s
            .ghost
            .recv_reports
            .iter_mut()
            .chain(s.ghost.recv_failed.iter_mut())
        {
            *m = permute(*m);
        }
        s
    }
}

/// An action of the system model.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum SystemAction {
    /// The next request arrives.
    Arrive(RequestId),
    /// The engine schedules a step.
    Schedule,
    /// A rank runs its next hooks.
    Run(Rank),
    /// A transfer finishes on a rank.
    Complete {
        /// The rank.
        rank: Rank,
        /// The transfer's job.
        job: JobId,
        /// Whether it succeeded.
        ok: bool,
    },
    /// The oldest step's outputs are aggregated and applied.
    Deliver,
    /// The environment aborts a request.
    Abort(RequestId),
    /// The environment resets the connector's cache.
    Reset,
    /// The shared tier answers its work item `item` (`ok: false`: it fails).
    TierAnswer {
        /// The index in [`TierEnv::pending`].
        item: u8,
        /// Whether the store did what it was asked.
        ok: bool,
    },
    /// A probe's answer is lost ([`TierEnv::pending`] index).
    TierLose {
        /// The index in [`TierEnv::pending`].
        item: u8,
    },
    /// The store drops a key.
    TierVanish(OffloadKey),
    /// The remote decode side read a held request's blocks and acknowledges them (P/D).
    RemoteAck(RequestId),
}

impl fmt::Display for SystemAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Arrive(r) => write!(f, "request {} arrives", r.0),
            Self::Schedule => write!(f, "schedule"),
            Self::Run(r) => write!(f, "rank {} runs", r.0),
            Self::Complete { rank, job, ok } => write!(
                f,
                "rank {}: job {} {}",
                rank.0,
                job.0,
                if *ok { "completes" } else { "fails" }
            ),
            Self::Deliver => write!(f, "deliver oldest step"),
            Self::Abort(r) => write!(f, "abort request {}", r.0),
            Self::Reset => write!(f, "reset connector cache"),
            Self::TierAnswer { item, ok } => write!(
                f,
                "tier: work {item} {}",
                if *ok { "answered" } else { "fails" }
            ),
            Self::TierLose { item } => write!(f, "tier: probe {item}'s answer is lost"),
            Self::TierVanish(k) => write!(f, "tier: key {:#x} vanishes", k.hash.0),
            Self::RemoteAck(r) => write!(f, "decode side acknowledges request {}", r.0),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model.

/// See the module docs.
#[derive(Debug)]
pub struct SystemModel<P: Connectors> {
    pair: P,
    config: SystemConfig,
    sched_config: SchedulerConfig,
    /// Per property (in [`Model::properties`] order): a discovery was already reported. The
    /// checker keeps the *last* state it saw breaking a property (each report replaces the one
    /// before), so a property reports only its first discovery: breadth-first with one thread,
    /// that is a shortest counterexample.
    discovered: Arc<[AtomicBool; PROPERTIES]>,
    /// Partial-order reduction (the module docs, "Partial-order reduction"): off unless
    /// [`SystemModel::with_partial_order`] turned it on.
    partial_order: bool,
    /// This model's number, for the successors the reduction computes ahead ([`crate::memo`]).
    id: u64,
    /// The `sometimes` properties this model has ([`Connectors::expected_examples`]): only
    /// their ghost witnesses are recorded (a witness no property reads would only split states
    /// that are otherwise equal, and order actions that otherwise commute).
    observed: Vec<&'static str>,
}

/// Numbers models for [`crate::memo`].
static MODELS: AtomicU64 = AtomicU64::new(0);

fn next_model_id() -> u64 {
    MODELS.fetch_add(1, Ordering::Relaxed)
}

/// The number of properties [`SystemModel`] declares (some filtered out per connector pair).
const PROPERTIES: usize = 18;

/// Each property's slot in `discovered`: named as in [`property_names`], numbered in the order
/// `properties()` lists them.
mod slot {
    pub(super) const PROTOCOL: usize = 0;
    pub(super) const NO_WRITE_UNDER_STORE: usize = 1;
    pub(super) const DATA: usize = 2;
    pub(super) const OWNED_WRITES: usize = 3;
    pub(super) const FINISHED_ONCE: usize = 4;
    pub(super) const QUORUM: usize = 5;
    pub(super) const CORE: usize = 6;
    pub(super) const QUIESCENT: usize = 7;
    pub(super) const FLUSHED: usize = 8;
    pub(super) const PREEMPTED: usize = 9;
    pub(super) const RESUMED_FROM_OFFLOAD: usize = 10;
    pub(super) const SHARED_PREFIX_LOADED: usize = 11;
    pub(super) const LOAD_FAILED_RECOMPUTED: usize = 12;
    pub(super) const DELAYED_FREE: usize = 13;
    pub(super) const ALL_DONE: usize = 14;
    pub(super) const STORE_FAILED_DONE: usize = 15;
    pub(super) const TIER_PROMOTED_LOADED: usize = 16;
    pub(super) const TIER_FAULT_DONE: usize = 17;
}

impl<P: Connectors> Clone for SystemModel<P> {
    /// The same model, with no discovery reported yet.
    fn clone(&self) -> Self {
        Self {
            pair: self.pair.clone(),
            config: self.config.clone(),
            sched_config: self.sched_config.clone(),
            discovered: fresh_discoveries(),
            partial_order: self.partial_order,
            id: next_model_id(),
            observed: self.observed.clone(),
        }
    }
}

fn fresh_discoveries() -> Arc<[AtomicBool; PROPERTIES]> {
    Arc::new(core::array::from_fn(|_| AtomicBool::new(false)))
}

impl<P: Connectors> SystemModel<P> {
    /// A model of `pair` under `config`.
    pub fn new(pair: P, config: SystemConfig) -> Result<Self, String> {
        config.validate()?;
        let f = config.faults;
        let core_fault = f
            .scheduler
            .map(|c| format!("{c:?}"))
            .or_else(|| f.bind_first.then(|| "bind_first".to_owned()))
            .or_else(|| {
                f.skip_handle_preemptions
                    .then(|| "skip_handle_preemptions".to_owned())
            })
            .or_else(|| f.one_rank_output.then(|| "one_rank_output".to_owned()));
        if let Some(fault) = core_fault
            && cfg!(not(feature = "scheduler-faults"))
        {
            return Err(format!(
                "the fault {fault} is re-introduced inside kvrelay-core (the step runs there) and \
                 needs kvrelay-model-check's `scheduler-faults` feature (kvrelay: build with \
                 --features scheduler-faults)"
            ));
        }
        if config.tier.is_some() && !pair.has_tier() {
            return Err(format!("{} has no shared tier to model", pair.name()));
        }
        let sched_config = config.scheduler_config();
        sched_config.validate().map_err(|e| e.to_string())?;
        // Build once to surface configuration errors here rather than in init_states.
        pair.scheduler_connector(&sched_config, &config)?;
        let observed = pair.expected_examples(&config);
        Ok(Self {
            pair,
            config,
            sched_config,
            discovered: fresh_discoveries(),
            partial_order: false,
            id: next_model_id(),
            observed,
        })
    }

    /// The same model with partial-order reduction on or off (off by default). With it, a
    /// state where one rank has not output a pending step and nothing else can touch that rank
    /// before it acts explores that rank's actions only; every verdict is kept (the conditions
    /// and the argument are in the docs of `model-check/src/system.rs`, section "Partial-order
    /// reduction").
    pub fn with_partial_order(mut self, on: bool) -> Self {
        self.partial_order = on;
        self
    }

    /// Whether partial-order reduction is on ([`SystemModel::with_partial_order`]).
    pub fn partial_order(&self) -> bool {
        self.partial_order
    }

    /// Whether to report `discovery` (a state breaking an `always` property, an example of a
    /// `sometimes` one) for property `slot`: only the first time.
    fn first(&self, slot: usize, discovery: bool) -> bool {
        discovery && !self.discovered[slot].swap(true, Ordering::Relaxed)
    }

    /// The configuration.
    pub fn config(&self) -> &SystemConfig {
        &self.config
    }

    /// The connector pair.
    pub fn pair(&self) -> &P {
        &self.pair
    }

    fn initial(&self) -> SystemState<P> {
        let c = &self.config;
        let inner = self
            .pair
            .scheduler_connector(&self.sched_config, c)
            .expect("validated in new()");
        let connector = Counted {
            inner,
            finished_calls: vec![0; c.requests as usize],
        };
        #[allow(unused_mut)] // mutated only with the `scheduler-faults` feature
        let mut engine = EngineCore::new(self.sched_config.clone(), connector, c.ranks)
            .expect("validated in new()");
        let faults = c.faults;
        #[cfg(feature = "scheduler-faults")]
        {
            if let Some(f) = faults.scheduler {
                engine.scheduler_mut().inject_fault(match f {
                    CoreFault::FreeAbortedWhileLoading => {
                        kvrelay_core::SchedulerFault::FreeAbortedWhileLoading
                    }
                    CoreFault::ClaimHitsGroupByGroup => {
                        kvrelay_core::SchedulerFault::ClaimHitsGroupByGroup
                    }
                });
            }
            if faults.one_rank_output {
                engine.inject_fault(kvrelay_core::EngineFault::OneRankOutput);
            }
        }
        // The tier's store keeps every rank's shard in rank order: not permuted, so no symmetry.
        let symmetric = !self.pair.shared_external()
            && c.tier.is_none()
            && !faults.one_rank_output
            && (0..c.ranks).all(|r| self.pair.worker(r, c) == self.pair.worker(0, c));
        let rank_config = RankConfig {
            layers: 1,
            block_size: self.sched_config.block_size,
            groups: self.sched_config.groups.clone(),
        };
        let ranks = (0..c.ranks)
            .map(|r| {
                #[allow(unused_mut)] // mutated only with the `scheduler-faults` feature
                let mut driver = RankDriver::new(rank_config.clone(), self.pair.worker(r, c));
                #[cfg(feature = "scheduler-faults")]
                if faults.bind_first {
                    driver.inject_fault(kvrelay_core::RankFault::BindFirst);
                } else if faults.skip_handle_preemptions {
                    driver.inject_fault(kvrelay_core::RankFault::SkipPreemptionWaits);
                }
                Shared::new(RankState {
                    driver,
                    in_flight: Vec::new(),
                    gpu: vec![EMPTY; c.gpu_blocks as usize],
                    external: BTreeMap::new(),
                    uncollected: false,
                    symmetric,
                })
            })
            .collect();
        let n = c.requests as usize;
        let mut s = SystemState {
            engine: Shared::new(engine),
            ranks,
            steps: VecDeque::new(),
            arrived: 0,
            aborts_left: c.aborts,
            resets_left: c.resets,
            failures_left: c.load_failures,
            store_failures_left: c.store_failures,
            tier: TierEnv::new(c.tier.as_ref()),
            ghost: Ghost {
                recv_reports: vec![0; n],
                recv_failed: vec![0; n],
                preempted: vec![false; n],
                load_failed: vec![false; n],
                ..Ghost::default()
            },
        };
        self.check(&mut s, None);
        s
    }

    /// Whether `witness` (a `sometimes` property) is one of this model's properties.
    fn observes(&self, witness: &str) -> bool {
        self.observed.contains(&witness)
    }

    fn all_ranks(&self) -> u32 {
        (1u32 << self.config.ranks) - 1
    }

    /// The first step a rank has not executed yet, if it is scheduled.
    fn next_step_of<'s>(
        &self,
        state: &'s SystemState<P>,
        rank: usize,
    ) -> Option<&'s Shared<PendingStep<<P::Sched as SchedulerConnector>::StepMeta>>> {
        let r = &state.ranks[rank];
        let first = state.steps.front()?.step.output.step.0;
        let idx = r.driver.steps_done().checked_sub(first)?;
        state.steps.get(usize::try_from(idx).ok()?)
    }

    /// Some rank has a completed transfer to report and no step to report it in: an engine
    /// step is then allowed past the idle bound.
    fn report_due(&self, s: &SystemState<P>) -> bool {
        (0..s.ranks.len()).any(|i| s.ranks[i].uncollected && self.next_step_of(s, i).is_none())
    }

    fn quiescent(&self, s: &SystemState<P>) -> bool {
        s.arrived == self.config.requests
            && !s.scheduler().has_requests()
            && s.steps.is_empty()
            && s.ranks.iter().all(|r| r.in_flight.is_empty())
            && s.tier.pending.is_empty()
            && self.pair.leak(&s.scheduler().connector().inner).is_none()
    }

    // -----------------------------------------------------------------------------------------
    // Actions.

    fn schedule(&self, s: &mut SystemState<P>) {
        let before = s.scheduler().connector().clone();
        let statuses = |s: &SystemState<P>| -> Vec<Option<RequestStatus>> {
            (0..s.arrived)
                .map(|i| s.scheduler().status(RequestId(i)))
                .collect()
        };
        let statuses_before = statuses(s);
        let st = match s.engine.make_mut().schedule() {
            Ok(st) => st.step,
            Err(e) => {
                s.ghost
                    .violate(property_names::CORE, format!("schedule failed: {e}"));
                return;
            }
        };
        // A step that schedules nothing, preempts nothing, changes no request's status and
        // leaves the connector as it was only spins. (A step that only preempts frees blocks:
        // the next one may admit; one that only promotes a finished load — strict defers a
        // request whose failed load gave its blocks back — admits it in the next.)
        if st.output.num_scheduled_tokens.is_empty()
            && st.output.preempted_req_ids.is_empty()
            && *s.scheduler().connector() == before
            && statuses(s) == statuses_before
        {
            s.ghost.idle = (s.ghost.idle + 1).min(self.config.idle_steps);
        } else {
            s.ghost.idle = 0;
        }
        let contents = self.expected_contents(s, &st.output);
        // A request whose load failed is scheduled to compute tokens: the scheduler recomputes
        // what it could not load. (Witnessed here, where the scheduler decides it, and not in a
        // rank's forward pass: a rank's step then reads no ghost state another rank writes,
        // which the partial-order reduction relies on.)
        for &(id, _) in &st.output.num_scheduled_tokens {
            if s.ghost
                .load_failed
                .get(id.index())
                .copied()
                .unwrap_or(false)
            {
                s.ghost.recomputed_after_failure |=
                    self.observes(property_names::LOAD_FAILED_RECOMPUTED);
            }
        }
        for &r in st.output.preempted_req_ids.iter() {
            if let Some(p) = s.ghost.preempted.get_mut(r.index()) {
                *p = true;
            }
        }
        s.steps
            .push_back(Shared::new(PendingStep { step: st, contents }));
    }

    /// Runs `rank`'s driver from where it stands until it waits on a transfer in flight or ends
    /// its step: the transfers it starts go in flight, its forward pass reads and writes the
    /// ghost contents, its output goes to the engine.
    fn run(&self, s: &mut SystemState<P>, rank: usize) {
        let Some(pending) = self.next_step_of(s, rank).cloned() else {
            return;
        };
        let (step, contents) = (&pending.step, &pending.contents);
        if s.ranks[rank].driver.current_step().is_none()
            && let Err(e) = s.ranks[rank].make_mut().driver.begin(step)
        {
            self.rank_failed(s, rank, &e);
            return;
        }
        loop {
            let action = match s.ranks[rank].make_mut().driver.poll() {
                Ok(a) => a,
                Err(e) => {
                    self.rank_failed(s, rank, &e);
                    return;
                }
            };
            match action {
                RankAction::Start(t) => {
                    s.ranks[rank].make_mut().in_flight.push(InFlight {
                        transfer: Arc::new(t),
                        dirty: false,
                    });
                }
                RankAction::Forward(pass) => self.forward(s, rank, contents, &pass),
                RankAction::Wait { during, .. } => {
                    if during == WorkerCall::HandlePreemptions {
                        s.ghost.flushed |= self.observes(property_names::FLUSHED);
                    }
                    return;
                }
                RankAction::Collect => {}
                RankAction::Done(output) => {
                    // The output collects every completion so far (the rank is already
                    // written by this `Run`'s polls).
                    s.ranks[rank].make_mut().uncollected = false;
                    self.finish(s, rank, &output);
                    if let Err(e) = s.engine.make_mut().rank_output(
                        step.output.step,
                        Rank(rank as u32),
                        Some(output),
                    ) {
                        s.ghost
                            .violate(property_names::CORE, format!("rank {rank}'s output: {e}"));
                    }
                    return;
                }
                RankAction::Idle => return,
            }
        }
    }

    /// A rank's driver stopped: a hook out of order breaks the protocol property, anything
    /// else the core's.
    fn rank_failed(&self, s: &mut SystemState<P>, rank: usize, e: &RankError) {
        let property = match e {
            RankError::Protocol(_) => property_names::PROTOCOL,
            _ => property_names::CORE,
        };
        s.ghost.violate(property, format!("rank {rank}: {e}"));
    }

    /// The remote decode side reads held request `id`'s prompt blocks and acknowledges them:
    /// every rank's copy must still hold the request's KV (DATA — a block freed or reused
    /// before the acknowledgement would not, I-15), then the connector hears it.
    fn remote_ack(&self, s: &mut SystemState<P>, id: RequestId) {
        if let Some(wrong) = self.held_blocks_wrong(s, id) {
            s.ghost.violate(property_names::DATA, wrong);
        }
        s.ghost.idle = 0;
        let conn = &mut s.engine.make_mut().scheduler_mut().connector_mut().inner;
        self.pair.acknowledge(conn, id);
    }

    /// The first of held request `id`'s prompt blocks some rank no longer holds the KV of.
    fn held_blocks_wrong(&self, s: &SystemState<P>, id: RequestId) -> Option<String> {
        let view = s.scheduler().view();
        let Some(req) = view.request(id) else {
            return Some(format!(
                "the decode side read request {}'s blocks, which were already freed (I-15)",
                id.0
            ));
        };
        let prompt_blocks = (req.num_prompt_tokens() / self.config.block_size) as usize;
        for g in 0..s.scheduler().config().groups.len() {
            for (i, b) in req.block_ids(g).iter().enumerate().take(prompt_blocks) {
                let Some(h) = req.block_hashes().get(i) else {
                    continue;
                };
                if b.0 == 0 {
                    continue;
                }
                for (rank, r) in s.ranks.iter().enumerate() {
                    let held = r.gpu[b.0 as usize];
                    if held != prompt_content(h.0) {
                        return Some(format!(
                            "the decode side read request {}'s block {i} (GPU block {}) on rank \
                             {rank}: it holds {}, not the request's KV",
                            id.0,
                            b.0,
                            content_text(held)
                        ));
                    }
                }
            }
        }
        None
    }

    fn seed_remote(&self, s: &mut SystemState<P>, id: RequestId) {
        let Some(req) = s.scheduler().view().request(id) else {
            return;
        };
        let prompt_blocks = req.num_prompt_tokens() / self.config.block_size;
        let seeds: Vec<(u64, u64)> = (0..prompt_blocks)
            .filter_map(|i| {
                let h = req.block_hashes().get(i as usize)?;
                Some((remote_slot(id, i), prompt_content(h.0)))
            })
            .collect();
        for r in &mut s.ranks {
            r.make_mut().external.extend(seeds.iter().copied());
        }
    }

    /// The expected content of every block of every request scheduled in `out`, read from the
    /// scheduler (tokens are the scheduler's; the rank has none).
    fn expected_contents(
        &self,
        s: &SystemState<P>,
        out: &SchedulerOutput,
    ) -> BTreeMap<RequestId, Vec<u64>> {
        let view = s.scheduler().view();
        let bs = self.config.block_size;
        let mut m = BTreeMap::new();
        for &(id, _) in &out.num_scheduled_tokens {
            let Some(req) = view.request(id) else {
                continue;
            };
            let prompt_blocks = req.num_prompt_tokens() / bs;
            let total = self.config.prompt_tokens + self.config.max_tokens;
            let n = total.div_ceil(bs);
            let v = (0..n)
                .map(|i| {
                    if i < prompt_blocks {
                        req.block_hashes()
                            .get(i as usize)
                            .map_or(PARTIAL, |h| prompt_content(h.0))
                    } else {
                        GENERATED | (u64::from(id.0) << 32) | u64::from(i)
                    }
                })
                .collect();
            m.insert(id, v);
        }
        m
    }

    /// The forward pass of `rank` for one layer, as its driver lays it out: the new tokens'
    /// blocks are written (a block the pass does not fill holds a partial block), then every
    /// block the attention reads must hold its tokens' content (DATA). Writes come first, as in
    /// a layer of vLLM's forward: a request may read a block another request of the same step
    /// writes (its prefix-cache hit on a block cached when the step was scheduled).
    fn forward(
        &self,
        s: &mut SystemState<P>,
        rank: usize,
        contents: &BTreeMap<RequestId, Vec<u64>>,
        pass: &ForwardPass,
    ) {
        let bs = self.config.block_size;
        for w in &pass.writes {
            let Some(want) = contents.get(&w.request) else {
                continue;
            };
            let full = w.tokens.end == (w.index + 1) * bs;
            let content = if full {
                want[w.index as usize]
            } else {
                PARTIAL
            };
            self.write_block(
                s,
                rank,
                w.block,
                content,
                &format!("forward of request {}", w.request.0),
            );
        }
        let driver = &s.ranks[rank].driver;
        let reads: Vec<_> = pass
            .reads
            .iter()
            .flat_map(|span| driver.read_blocks(span, 0))
            .collect();
        for r in &reads {
            let Some(want) = contents.get(&r.request) else {
                continue;
            };
            let got = s.ranks[rank].gpu[r.block.0 as usize];
            let expected = want[r.index as usize];
            if got != expected {
                s.ghost.violate(
                    property_names::DATA,
                    format!(
                        "rank {rank}: request {} reads block {} (index {}, group {}) holding {} \
                         instead of {}",
                        r.request.0,
                        r.block.0,
                        r.index,
                        r.group,
                        content_text(got),
                        content_text(expected)
                    ),
                );
            }
        }
    }

    /// A write of GPU block `b` on `rank`: I-4 against the stores in flight.
    fn write_block(&self, s: &mut SystemState<P>, rank: usize, b: BlockId, content: u64, by: &str) {
        let r = s.ranks[rank].make_mut();
        let mut hit = None;
        for t in &mut r.in_flight {
            if t.transfer.direction == TransferDirection::Store
                && t.transfer.gpu_blocks.contains(&b)
            {
                t.dirty = true;
                hit = Some(t.transfer.job);
            }
        }
        if let Some(j) = hit {
            s.ghost.violate(
                property_names::NO_WRITE_UNDER_STORE,
                format!(
                    "rank {rank}: {by} writes block {} while store job {} reads it",
                    b.0, j.0
                ),
            );
        }
        if let Some(x) = s.ranks[rank].make_mut().gpu.get_mut(b.0 as usize) {
            *x = content;
        }
    }

    /// The rank's output of a step: who reported which load (for the quorum properties).
    fn finish(&self, s: &mut SystemState<P>, rank: usize, out: &WorkerOutput<WMeta<P>>) {
        for id in out.finished_recving.iter().flat_map(|s| s.iter()) {
            let Some(m) = s.ghost.recv_reports.get_mut(id.index()) else {
                continue;
            };
            let twice = *m & (1 << rank) != 0;
            *m |= 1 << rank;
            if twice {
                s.ghost.violate(
                    property_names::QUORUM,
                    format!("rank {rank} reported request {}'s load twice", id.0),
                );
            }
        }
        for id in out.failed_recving.iter() {
            if let Some(m) = s.ghost.recv_failed.get_mut(id.index()) {
                *m |= 1 << rank;
            }
        }
    }

    fn complete(&self, s: &mut SystemState<P>, rank: usize, job: JobId, ok: bool) {
        let Some(pos) = s.ranks[rank]
            .in_flight
            .iter()
            .position(|t| t.transfer.job == job)
        else {
            return;
        };
        let t = s.ranks[rank].make_mut().in_flight.remove(pos);
        s.ranks[rank].make_mut().uncollected = true;
        let domain = if self.pair.shared_external() { 0 } else { rank };
        let req = t.transfer.request;
        match (t.transfer.direction, ok) {
            (TransferDirection::Store, false) => {
                // The transfer stopped part-way: its external slots hold neither the old nor
                // the new bytes (a later load of them would serve garbage: DATA catches it).
                s.store_failures_left = s.store_failures_left.saturating_sub(1);
                s.ghost.store_failed |= self.observes(property_names::STORE_FAILED_DONE);
                for slot in &t.transfer.external {
                    s.ranks[domain].make_mut().external.insert(*slot, CORRUPT);
                    s.ghost.stored_by.remove(slot);
                    s.tier.promoted_slots.remove(slot);
                }
            }
            (TransferDirection::Store, true) => {
                if s.scheduler()
                    .status(req)
                    .is_some_and(RequestStatus::is_finished)
                {
                    s.ghost.delayed_free |= self.observes(property_names::DELAYED_FREE);
                }
                for (b, slot) in t.transfer.gpu_blocks.iter().zip(&t.transfer.external) {
                    let content = if t.dirty {
                        CORRUPT
                    } else {
                        s.ranks[rank].gpu[b.0 as usize]
                    };
                    s.ranks[domain].make_mut().external.insert(*slot, content);
                    s.ghost.stored_by.insert(*slot, req.0);
                    s.tier.promoted_slots.remove(slot);
                }
            }
            (TransferDirection::Load, false) => {
                // The transfer stopped part-way: its blocks hold neither the old nor the new
                // bytes.
                s.failures_left = s.failures_left.saturating_sub(1);
                if let Some(f) = s.ghost.load_failed.get_mut(req.index()) {
                    *f = true;
                }
                self.check_owned(s, rank, &t.transfer);
                for b in &t.transfer.gpu_blocks {
                    self.write_block(s, rank, *b, CORRUPT, &format!("failed load job {}", job.0));
                }
            }
            (TransferDirection::Load, true) => {
                self.check_owned(s, rank, &t.transfer);
                for (b, slot) in t.transfer.gpu_blocks.iter().zip(&t.transfer.external) {
                    let content = s.ranks[domain].external.get(slot).copied().unwrap_or(EMPTY);
                    if s.tier.promoted_slots.contains(slot) {
                        s.ghost.tier_promoted_loaded |=
                            self.observes(property_names::TIER_PROMOTED_LOADED);
                    }
                    if s.ghost.stored_by.get(slot).is_some_and(|&w| w != req.0) {
                        s.ghost.shared_loaded |=
                            self.observes(property_names::SHARED_PREFIX_LOADED);
                    }
                    self.write_block(s, rank, *b, content, &format!("load job {}", job.0));
                }
                if s.ghost.preempted.get(req.index()).copied().unwrap_or(false) {
                    s.ghost.resumed_from_offload |=
                        self.observes(property_names::RESUMED_FROM_OFFLOAD);
                }
            }
        }
        if let Err(e) = s.ranks[rank]
            .make_mut()
            .driver
            .transfer_done(TransferDone { job, ok })
        {
            self.rank_failed(s, rank, &e);
        }
    }

    /// OWNED_WRITES for a load finishing (or failing) on `rank`: the rank's own view of
    /// ownership is its block tables, as of the steps it executed (steps run in order on a
    /// rank, so a block freed by the scheduler is rewritten only by a later step of this rank).
    ///
    /// Only full-attention tables count: a sliding-window block that left the window is freed
    /// by the scheduler while the request runs (and may be reallocated in the same step), but
    /// stays in the worker's table, unread.
    fn check_owned(&self, s: &mut SystemState<P>, rank: usize, t: &Transfer) {
        let full = |table: &Vec<Vec<BlockId>>| table.first().cloned().unwrap_or_default();
        let tables = s.ranks[rank].driver.tables();
        let owner = tables.iter().find_map(|(id, table)| {
            (*id != t.request && full(table).iter().any(|b| t.gpu_blocks.contains(b)))
                .then_some(*id)
        });
        if let Some(other) = owner {
            let b = full(&tables[&other])
                .into_iter()
                .find(|b| t.gpu_blocks.contains(b))
                .map_or(0, |b| b.0);
            s.ghost.violate(
                property_names::OWNED_WRITES,
                format!(
                    "rank {rank}: load job {} of request {} writes block {b}, which request {} holds",
                    t.job.0, t.request.0, other.0
                ),
            );
        }
    }

    fn deliver(&self, s: &mut SystemState<P>) {
        if s.steps.pop_front().is_none() {
            return;
        }
        let applied = match s.engine.make_mut().apply_fake() {
            Ok(applied) => applied,
            Err(e) => {
                s.ghost.violate(
                    property_names::CORE,
                    format!("update_from_output failed: {e}"),
                );
                return;
            }
        };
        if !applied.result.outputs.is_empty() {
            s.ghost.idle = 0;
        }
        // Released ids are forgotten by the engine; nothing in the model reuses them.
        s.engine.make_mut().take_released();
        if let Some(sending) = applied
            .connector_output
            .as_ref()
            .and_then(|kv| kv.finished_sending.as_ref())
            && !sending.is_empty()
        {
            // A held request's send (or P/D release) ends its delayed free.
            s.ghost.delayed_free |= self.observes(property_names::DELAYED_FREE);
        }
        let Some(kv) = &applied.connector_output else {
            return;
        };
        let all = self.all_ranks();
        let recving: Vec<RequestId> = kv
            .finished_recving
            .iter()
            .flat_map(|x| x.iter().copied())
            .collect();
        for id in kv.failed_recving.iter() {
            if !recving.contains(id) {
                s.ghost.violate(
                    property_names::QUORUM,
                    format!("request {} failed but not finished (I-24)", id.0),
                );
            }
        }
        for id in recving {
            let i = id.index();
            let Some(&m) = s.ghost.recv_reports.get(i) else {
                continue;
            };
            if m != all {
                s.ghost.violate(
                    property_names::QUORUM,
                    format!(
                        "request {}'s load emitted after ranks {m:#b} of {all:#b} (I-21)",
                        id.0
                    ),
                );
            }
            let failed = s.ghost.recv_failed[i] != 0;
            if failed != kv.failed_recving.contains(&id) {
                s.ghost.violate(
                    property_names::QUORUM,
                    format!("request {}'s failure not carried (I-24)", id.0),
                );
            }
            s.ghost.recv_reports[i] = 0;
            s.ghost.recv_failed[i] = 0;
        }
        if kv.finished_recving.is_some()
            || kv.finished_sending.is_some()
            || kv.worker_meta.is_some()
        {
            s.ghost.idle = 0;
        }
    }

    /// Every action enabled in `s` (none once a property is violated: such a state is
    /// terminal), without any reduction.
    fn enabled(&self, s: &SystemState<P>, actions: &mut Vec<SystemAction>) {
        if !s.ghost.violations.is_empty() {
            return;
        }
        let c = &self.config;
        if s.arrived < c.requests {
            actions.push(SystemAction::Arrive(RequestId(s.arrived)));
        }
        if s.scheduler().has_requests()
            && (s.steps.len() as u32) < c.async_depth
            && (s.ghost.idle < c.idle_steps || self.report_due(s))
        {
            actions.push(SystemAction::Schedule);
        }
        for (i, r) in s.ranks.iter().enumerate() {
            let blocked = r.driver.waiting().next().is_some();
            if !blocked && r.driver.error().is_none() && self.next_step_of(s, i).is_some() {
                actions.push(SystemAction::Run(Rank(i as u32)));
            }
        }
        for (i, r) in s.ranks.iter().enumerate() {
            let mut seen_dir = [false; 2];
            for t in &r.in_flight {
                let d = t.transfer.direction as usize;
                if c.ordered_completions && seen_dir[d] {
                    continue;
                }
                seen_dir[d] = true;
                actions.push(SystemAction::Complete {
                    rank: Rank(i as u32),
                    job: t.transfer.job,
                    ok: true,
                });
                let may_fail = match t.transfer.direction {
                    TransferDirection::Load => {
                        s.failures_left > 0 && self.pair.load_may_fail(&t.transfer)
                    }
                    TransferDirection::Store => {
                        s.store_failures_left > 0 && self.pair.store_may_fail(&t.transfer)
                    }
                };
                if may_fail {
                    actions.push(SystemAction::Complete {
                        rank: Rank(i as u32),
                        job: t.transfer.job,
                        ok: false,
                    });
                }
            }
        }
        if s.engine.ready() {
            actions.push(SystemAction::Deliver);
        }
        if s.aborts_left > 0 {
            for i in 0..s.arrived {
                let id = RequestId(i);
                if s.scheduler().status(id).is_some_and(|st| !st.is_finished()) {
                    actions.push(SystemAction::Abort(id));
                }
            }
        }
        if s.resets_left > 0 {
            actions.push(SystemAction::Reset);
        }
        self.tier_actions(s, actions);
        let held = self.pair.awaiting_ack(&s.scheduler().connector().inner);
        actions.extend(held.into_iter().map(SystemAction::RemoteAck));
    }

    /// (S) A rank reading another rank's external store, or a shared tier, would make ranks
    /// depend on each other's transfers; an acknowledgement changes what `Schedule` builds.
    fn no_reduction(&self, enabled: &[SystemAction]) -> bool {
        self.pair.shared_external()
            || self.config.tier.is_some()
            || enabled.len() < 2
            || enabled
                .iter()
                .any(|a| matches!(a, SystemAction::RemoteAck(_)))
    }

    /// The ample set of `s` for partial-order reduction (see the module docs): the enabled
    /// actions of one rank that has not yet output a pending step, when each of them is
    /// independent of every action the rest of the system can take before that rank acts.
    /// `None`: explore every enabled action.
    fn ample(&self, s: &SystemState<P>, enabled: &[SystemAction]) -> Option<Vec<SystemAction>> {
        let c = &self.config;
        if self.no_reduction(enabled) {
            return None;
        }
        let full = s.steps.len() as u32 >= c.async_depth;
        // (B) No `Schedule` can happen before the chosen rank acts: the pipeline is full (only
        // `Deliver` empties it, and (A) keeps `Deliver` disabled), or nothing is left to
        // schedule and nothing can arrive.
        let drained = s.arrived == c.requests && !s.scheduler().has_requests();
        let oldest = s.steps.front()?.step.output.step.0;
        // (X) For (A2): no reset can happen any more, the pipeline is full (two steps at
        // most: `async_depth` 2) and its oldest step is aggregated.
        let settled = s.resets_left == 0 && full && s.steps.len() == 2 && s.engine.ready();
        // (A3) The pipeline has room, but no reset can happen any more: what can happen before
        // a rank that has not output the oldest step acts is a `Schedule` (while the pipeline
        // has room), the arrivals still due and aborts — (A2)'s engine side without its
        // `Deliver`.
        let open = s.resets_left == 0 && !full;
        // (A2) What can happen before the chosen rank acts: `Deliver` of the oldest step, one
        // `Schedule` after it (the pipeline is then full again and the next `Deliver` needs
        // the rank), the arrivals still due, aborts while the budget lasts. Their effects do
        // not depend on the ranks: computed once, here (and reused for states that differ in
        // their ranks only).
        let mut after: Option<Option<EngineSide>> = None;
        let mut best: Option<Vec<SystemAction>> = None;
        for (i, r) in s.ranks.iter().enumerate() {
            let done = r.driver.steps_done();
            // (A) The rank has not output the oldest step: `Deliver` stays disabled until it
            // does, and only its own actions can change its state. (A2): it output the oldest
            // but not the next one.
            let a1 = done == oldest && (full || drained);
            let a2 = !a1 && settled && done == oldest + 1;
            let a3 = !a1 && open && done == oldest;
            if !a1 && !a2 && !a3 {
                continue;
            }
            let engine_acts = a2 || a3;
            let rank = Rank(i as u32);
            let mine: Vec<SystemAction> = enabled
                .iter()
                .copied()
                .filter(|a| match a {
                    SystemAction::Run(x) | SystemAction::Complete { rank: x, .. } => *x == rank,
                    _ => false,
                })
                .collect();
            if mine.is_empty()
                || mine.len() == enabled.len()
                || best.as_ref().is_some_and(|b| b.len() <= mine.len())
            {
                continue;
            }
            // (C, E, F) No action of the rank reads what another part may change meanwhile.
            if !mine.iter().all(|a| self.rank_local(s, i, a, engine_acts)) {
                continue;
            }
            let next: Vec<SystemState<P>> = match mine
                .iter()
                .map(|&a| self.next_state(s, a))
                .collect::<Option<Vec<_>>>()
            {
                Some(n) => n,
                None => continue,
            };
            // The checker asks for these successors next (of the ample set, or of every
            // enabled action): computed once.
            for (&a, n) in mine.iter().zip(&next) {
                memo::remember(self.id, s, a, n);
            }
            // (G) None of them breaks a property or leaves the state as it is (a violation
            // ends a path, so it would hide what the other actions reach; a self-loop would
            // postpone them forever).
            if !next
                .iter()
                .all(|n| n.ghost.violations.is_empty() && (n.ranks[i] != s.ranks[i] || n != s))
            {
                continue;
            }
            if engine_acts {
                let side = after.get_or_insert_with(|| {
                    memo::derived(self.id, s, SystemState::same_but_ranks, || {
                        self.engine_side(s)
                    })
                });
                let Some(side) = side.as_ref() else {
                    continue;
                };
                if !mine
                    .iter()
                    .zip(&next)
                    .all(|(a, n)| self.commutes_with_engine(s, i, a, n, side))
                {
                    continue;
                }
            }
            let one = mine.len() == 1;
            best = Some(mine);
            if one {
                break;
            }
        }
        best
    }

    /// For (A2) and (A3): every state the engine-side actions reach from `s` — `Deliver`
    /// (enabled once: the next one needs the chosen rank's output), the arrivals still due,
    /// `Schedule` when the pipeline has room (whatever the idle bound says: another rank's
    /// completion may let it past), `Abort` while the budget lasts — in every order, summed up
    /// in an [`EngineSide`]. `None` when one of them breaks a property, or past
    /// [`ENGINE_SIDE_BOUND`] states. None of them reads a rank (a P/D `Arrive` writes only the
    /// arriving request's remote slots), and the summary reads only their other parts: the
    /// reduction reuses it for the next state that differs from `s` in its ranks only
    /// ([`SystemState::same_but_ranks`], `memo::derived`).
    fn engine_side(&self, s: &SystemState<P>) -> Option<EngineSide> {
        // What a store's completion reads (`complete`: the delayed-free witness).
        let finished = |x: &SystemState<P>, id: RequestId| {
            x.scheduler()
                .status(id)
                .is_some_and(RequestStatus::is_finished)
        };
        let n = self.config.requests as usize;
        let mut side = EngineSide {
            delivered_reports: s.ghost.recv_reports.clone(),
            delivered_failed: s.ghost.recv_failed.clone(),
            finished_moves: vec![false; n],
            preempted_moves: vec![false; n],
        };
        let mut seen: Vec<SystemState<P>> = vec![s.clone()];
        let mut next = 0;
        while next < seen.len() {
            let z = seen[next].clone();
            next += 1;
            let mut moves: Vec<(SystemAction, SystemState<P>)> = Vec::new();
            if z.engine.ready() {
                let d = self.next_state(&z, SystemAction::Deliver)?;
                if next == 1 {
                    // The checker asks for it next if no ample set is found.
                    memo::remember(self.id, s, SystemAction::Deliver, &d);
                }
                side.delivered_reports.clone_from(&d.ghost.recv_reports);
                side.delivered_failed.clone_from(&d.ghost.recv_failed);
                moves.push((SystemAction::Deliver, d));
            }
            if z.arrived < self.config.requests {
                let a = self.next_state(&z, SystemAction::Arrive(RequestId(z.arrived)))?;
                moves.push((SystemAction::Arrive(RequestId(z.arrived)), a));
            }
            if z.scheduler().has_requests() && (z.steps.len() as u32) < self.config.async_depth {
                let u = self.next_state(&z, SystemAction::Schedule)?;
                moves.push((SystemAction::Schedule, u));
            }
            if z.aborts_left > 0 {
                for i in 0..z.arrived {
                    let id = RequestId(i);
                    if z.scheduler().status(id).is_some_and(|st| !st.is_finished()) {
                        let a = self.next_state(&z, SystemAction::Abort(id))?;
                        moves.push((SystemAction::Abort(id), a));
                    }
                }
            }
            for (_, m) in moves {
                if !m.ghost.violations.is_empty() {
                    return None;
                }
                for i in 0..n {
                    let id = RequestId(i as u32);
                    side.finished_moves[i] |= finished(&m, id) != finished(s, id);
                    side.preempted_moves[i] |= m.ghost.preempted.get(i) != s.ghost.preempted.get(i);
                }
                if !seen.contains(&m) {
                    if seen.len() >= ENGINE_SIDE_BOUND {
                        return None;
                    }
                    seen.push(m);
                }
            }
        }
        Some(side)
    }

    /// For (A2) and (A3): `action` of rank `rank` (whose successor is `next`) commutes with every
    /// engine-side action that may happen before it ([`EngineSide`]): what a `Run` reports is
    /// not what the `Deliver` emits (the quorum ghost resets those), its output does not
    /// complete the next step (the `Deliver` releases ids by the aggregator's state), a
    /// completion reads no witness input (request finished, request preempted) that they
    /// change. (The idle counter is the engine's alone: see the module docs.)
    fn commutes_with_engine(
        &self,
        s: &SystemState<P>,
        rank: usize,
        action: &SystemAction,
        next: &SystemState<P>,
        side: &EngineSide,
    ) -> bool {
        match *action {
            SystemAction::Run(_) => {
                let second = s.steps.get(1).map(|st| st.step.output.step);
                let aggregates = second.is_some_and(|st| next.engine.aggregated(st).is_some());
                let emitted_reported = next
                    .ghost
                    .recv_reports
                    .iter()
                    .zip(&s.ghost.recv_reports)
                    .zip(&side.delivered_reports)
                    .chain(
                        next.ghost
                            .recv_failed
                            .iter()
                            .zip(&s.ghost.recv_failed)
                            .zip(&side.delivered_failed),
                    )
                    .any(|((n, o), dd)| n != o && dd != o);
                !aggregates && !emitted_reported
            }
            SystemAction::Complete { job, .. } => {
                let Some(t) = s.ranks[rank].in_flight_job(job) else {
                    return false;
                };
                let req = t.transfer.request.index();
                match t.transfer.direction {
                    TransferDirection::Store => {
                        s.ghost.delayed_free
                            || !self.observes(property_names::DELAYED_FREE)
                            || !side.finished_moves.get(req).copied().unwrap_or(true)
                    }
                    TransferDirection::Load => {
                        s.ghost.resumed_from_offload
                            || !self.observes(property_names::RESUMED_FROM_OFFLOAD)
                            || !side.preempted_moves.get(req).copied().unwrap_or(true)
                    }
                }
            }
            _ => false,
        }
    }

    /// Whether `action` of rank `rank` reads nothing that an action of another rank, an
    /// arrival, an abort or a reset can change (conditions C, E, F of the module docs).
    ///
    /// `engine_acts`: the rank is chosen by (A2) or (A3), so a `Schedule` may come before it.
    fn rank_local(
        &self,
        s: &SystemState<P>,
        rank: usize,
        action: &SystemAction,
        engine_acts: bool,
    ) -> bool {
        match *action {
            SystemAction::Run(_) => true,
            SystemAction::Complete { job, ok, .. } => {
                let Some(t) = s.ranks[rank].in_flight_job(job) else {
                    return false;
                };
                // (C) A failure spends a budget that other ranks' failures also spend, and a
                // failed load sets the load-failed ghost a `Schedule` reads (for its
                // recomputation witness). A failed load is kept under (A) — no `Schedule`
                // comes first, and the budget only orders failures: see the module docs — a
                // failed store never (it also forgets who stored its slots, which other
                // ranks' stores write).
                if !ok {
                    return !engine_acts && t.transfer.direction == TransferDirection::Load;
                }
                match t.transfer.direction {
                    // (E) A store completing reads whether its request finished (the delayed
                    // free witness, recorded only where it is a property): only an abort can
                    // change that meanwhile.
                    TransferDirection::Store => {
                        s.ghost.delayed_free
                            || !self.observes(property_names::DELAYED_FREE)
                            || s.aborts_left == 0
                            || s.scheduler()
                                .status(t.transfer.request)
                                .is_none_or(RequestStatus::is_finished)
                    }
                    // (F) A load completing reads who stored its slots (the shared-prefix
                    // witness), which other ranks' stores write: harmless unless that witness
                    // is one of the model's properties and has not been seen on this path.
                    TransferDirection::Load => {
                        s.ghost.shared_loaded
                            || !self.observes(property_names::SHARED_PREFIX_LOADED)
                    }
                }
            }
            _ => false,
        }
    }

    /// I-10 and the machines' own invariants, after every action (`before`: the state the
    /// action was taken in), then seals the parts the action wrote ([`Shared::seal`]).
    ///
    /// A part the action did not write is the very part of `before` ([`Shared::same`]), whose
    /// invariants were checked when it was written (a state with a violation has no
    /// successors), so only written parts are checked again: the invariants of a machine are
    /// a function of that machine's state.
    fn check(&self, s: &mut SystemState<P>, before: Option<&SystemState<P>>) {
        let mut broken = Vec::new();
        let engine_written = before.is_none_or(|b| !Shared::same(&b.engine, &s.engine));
        if engine_written {
            if let Err(e) = s.engine.check_invariants() {
                broken.push(format!("scheduler: {e}"));
            }
            if let Some(e) = s.scheduler().broken() {
                broken.push(format!("scheduler stopped: {e}"));
            }
            if let Some(e) = s.engine.broken() {
                broken.push(format!("engine stopped: {e}"));
            }
            if let Err(e) = self.pair.check_sched(&s.scheduler().connector().inner) {
                broken.push(format!("connector: {e}"));
            }
        }
        for (i, r) in s.ranks.iter().enumerate() {
            if before.is_some_and(|b| b.ranks.get(i).is_some_and(|x| Shared::same(x, r))) {
                continue;
            }
            if let Err(e) = r
                .driver
                .check_invariants()
                .and_then(|()| self.pair.check_worker(r.driver.worker().inner()))
            {
                broken.push(format!("rank {i}: {e}"));
            }
            if let Some(v) = r.driver.worker().protocol().violation() {
                s.ghost
                    .violate(property_names::PROTOCOL, format!("rank {i}: {v}"));
            }
        }
        if let Some(b) = broken.into_iter().next() {
            s.ghost.violate(property_names::CORE, b);
        }
        // The first request whose count disagrees with its state (violations are sticky, so
        // the first is enough); found before `s.ghost` is borrowed mutably.
        let wrong = s
            .scheduler()
            .connector()
            .finished_calls
            .iter()
            .enumerate()
            .find_map(|(i, &n)| {
                let arrived = (i as u32) < s.arrived;
                let finished = arrived
                    && s.scheduler()
                        .status(RequestId(i as u32))
                        .is_none_or(RequestStatus::is_finished);
                (n != u8::from(finished)).then_some((i, n, finished))
            });
        if let Some((i, n, finished)) = wrong {
            s.ghost.violate(
                property_names::FINISHED_ONCE,
                format!("request {i}: request_finished called {n} times, finished: {finished}"),
            );
        }
        s.engine.seal();
        for r in &mut s.ranks {
            r.seal();
        }
    }
}

/// The ghost content of a prompt block with hash `h` (never one of the reserved values).
fn prompt_content(h: u64) -> u64 {
    h.max(CORRUPT + 1) & !GENERATED
}

fn ids(set: &SortedSet<RequestId>) -> Vec<u32> {
    set.iter().map(|r| r.0).collect()
}

fn transfer_text(t: &Transfer) -> String {
    format!(
        "{} job {} (request {}, blocks {:?})",
        match t.direction {
            TransferDirection::Load => "load",
            TransferDirection::Store => "store",
        },
        t.job.0,
        t.request.0,
        t.gpu_blocks.iter().map(|b| b.0).collect::<Vec<_>>()
    )
}

fn content_text(c: u64) -> String {
    match c {
        EMPTY => "nothing".to_owned(),
        PARTIAL => "a partial block".to_owned(),
        CORRUPT => "bytes overwritten during their store".to_owned(),
        c if c & GENERATED != 0 => format!(
            "generated block {} of request {}",
            c & 0xffff_ffff,
            (c & !GENERATED) >> 32
        ),
        c => format!("prompt block {c:#x}"),
    }
}

impl<P: Connectors> Explain for SystemModel<P> {
    /// `action` and what it produced: the step scheduled (tokens, preemptions, finished ids,
    /// the connector's jobs), the transfers a rank started or waits for, the properties broken.
    fn describe(&self, state: &SystemState<P>, action: &SystemAction) -> String {
        let Some(next) = self.next_state(state, *action) else {
            return format!("{action} (not enabled)");
        };
        let mut line = action.to_string();
        match *action {
            SystemAction::Schedule => {
                // Only a step this action pushed (a failed or idle schedule pushes none).
                let new_step = next.steps.back().filter(|st| {
                    state.steps.back().map(|b| b.step.output.step) != Some(st.step.output.step)
                });
                if new_step.is_none() {
                    line += " → no step";
                }
                if let Some(st) = new_step {
                    let o = &st.step.output;
                    line += &format!(
                        " → step {}: {:?}",
                        o.step.0,
                        o.num_scheduled_tokens
                            .iter()
                            .map(|(r, n)| (r.0, *n))
                            .collect::<Vec<_>>()
                    );
                    if !o.preempted_req_ids.is_empty() {
                        line += &format!(" preempted {:?}", ids(&o.preempted_req_ids));
                    }
                    if !o.finished_req_ids.is_empty() {
                        line += &format!(" finished {:?}", ids(&o.finished_req_ids));
                    }
                    let meta = self.pair.describe_meta(&st.step.meta);
                    if !meta.is_empty() {
                        line += &format!(" — {meta}");
                    }
                }
            }
            SystemAction::Run(rank) => {
                let before = &state.ranks[rank.index()];
                let after = &next.ranks[rank.index()];
                let started: Vec<String> = after
                    .in_flight
                    .iter()
                    .filter(|t| {
                        !before
                            .in_flight
                            .iter()
                            .any(|b| b.transfer.job == t.transfer.job)
                    })
                    .map(|t| transfer_text(&t.transfer))
                    .collect();
                if !started.is_empty() {
                    line += &format!(" → starts {}", started.join(", "));
                }
                let waits: Vec<u64> = after.driver.waiting().map(|j| j.0).collect();
                match after.driver.waiting_during() {
                    Some(hook) => {
                        line += &format!(" → waits in {hook:?} for jobs {waits:?}");
                    }
                    _ => {
                        if let Some(k) = after.driver.steps_done().checked_sub(1) {
                            line += &format!(" → step {k} done");
                        }
                    }
                }
            }
            SystemAction::Deliver => {
                if let Some(st) = state.steps.front() {
                    line += &format!(" (step {})", st.step.output.step.0);
                }
            }
            _ => {}
        }
        for (p, why) in &next.ghost.violations {
            if !state.ghost.violated(p) {
                line += &format!(" ✗ {p}: {why}");
            }
        }
        line
    }

    /// `env` (arrivals, aborts, resets, transfers finishing), the scheduler, the ranks and the
    /// aggregator.
    fn participants(&self) -> Vec<String> {
        let mut p = vec!["env".to_owned(), "scheduler".to_owned()];
        p.extend((0..self.config.ranks).map(|r| format!("rank {r}")));
        p.push("aggregator".to_owned());
        p
    }

    /// Arrivals, aborts and resets: `env` → scheduler; a step scheduled: scheduler → itself; a
    /// rank running: scheduler → rank; a transfer finishing: `env` → rank; a delivery:
    /// aggregator → scheduler. A note names every property the action breaks.
    fn arrow(&self, state: &SystemState<P>, action: &SystemAction) -> Arrow {
        let (env, sched, agg) = (0, 1, 2 + self.config.ranks as usize);
        let rank_at = |r: Rank| 2 + r.index();
        let label = self.describe(state, action);
        let (label, note) = match label.split_once(" ✗ ") {
            Some((l, n)) => (l.to_owned(), Some(n.to_owned())),
            None => (label, None),
        };
        let (from, to) = match *action {
            SystemAction::Arrive(_)
            | SystemAction::Abort(_)
            | SystemAction::Reset
            | SystemAction::TierAnswer { .. }
            | SystemAction::TierLose { .. }
            | SystemAction::TierVanish(_)
            | SystemAction::RemoteAck(_) => (env, sched),
            SystemAction::Schedule => (sched, sched),
            SystemAction::Run(r) => (sched, rank_at(r)),
            SystemAction::Complete { rank, .. } => (env, rank_at(rank)),
            SystemAction::Deliver => (agg, sched),
        };
        let step = Arrow::new(from, to, label);
        match note {
            Some(n) => step.with_note(n),
            None => step,
        }
    }
}

impl<P: Connectors> Model for SystemModel<P> {
    type State = SystemState<P>;
    type Action = SystemAction;

    fn init_states(&self) -> Vec<Self::State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &Self::State, actions: &mut Vec<Self::Action>) {
        let start = actions.len();
        self.enabled(s, actions);
        if self.partial_order
            && let Some(ample) = self.ample(s, &actions[start..])
        {
            actions.truncate(start);
            actions.extend(ample);
        }
    }

    fn next_state(&self, last: &Self::State, action: Self::Action) -> Option<Self::State> {
        if self.partial_order
            && let Some(next) = memo::recall(self.id, last, &action)
        {
            return Some(next);
        }
        let mut s = last.clone();
        match action {
            SystemAction::Arrive(id) => {
                let spec = RequestSpec {
                    id,
                    prompt: self.config.prompt(id.0),
                    max_tokens: self.config.max_tokens,
                    stop_token: None,
                    kv_transfer_params: self.pair.request_params(id, &self.config),
                };
                if let Err(e) = s.engine.make_mut().add_request(spec) {
                    s.ghost
                        .violate(property_names::CORE, format!("add_request failed: {e}"));
                }
                if self.pair.remote_prefill() {
                    self.seed_remote(&mut s, id);
                }
                s.arrived += 1;
                s.ghost.idle = 0;
            }
            SystemAction::Schedule => {
                self.schedule(&mut s);
                self.take_tier_work(&mut s);
            }
            SystemAction::Run(rank) => self.run(&mut s, rank.index()),
            SystemAction::Complete { rank, job, ok } => {
                self.complete(&mut s, rank.index(), job, ok)
            }
            SystemAction::Deliver => {
                self.deliver(&mut s);
                self.take_tier_work(&mut s);
            }
            SystemAction::TierAnswer { item, ok } => self.tier_answer(&mut s, item, ok),
            SystemAction::TierLose { item } => self.tier_lose(&mut s, item),
            SystemAction::TierVanish(key) => self.tier_vanish(&mut s, key),
            SystemAction::RemoteAck(id) => self.remote_ack(&mut s, id),
            SystemAction::Abort(id) => {
                s.aborts_left -= 1;
                s.ghost.idle = 0;
                if let Err(e) = s.engine.make_mut().abort(id) {
                    s.ghost
                        .violate(property_names::CORE, format!("abort failed: {e}"));
                }
                self.take_tier_work(&mut s);
            }
            SystemAction::Reset => {
                s.resets_left -= 1;
                s.ghost.idle = 0;
                if let Err(e) = s.engine.make_mut().reset_connector_cache() {
                    s.ghost
                        .violate(property_names::CORE, format!("reset failed: {e}"));
                }
                self.take_tier_work(&mut s);
            }
        }
        self.check(&mut s, Some(last));
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        use property_names as n;
        let expected = &self.observed;
        // Each property reports its first discovery only (see `discovered`), in its `slot`.
        let mut all = vec![
            Property::always(n::PROTOCOL, |m: &Self, s: &SystemState<P>| {
                !m.first(slot::PROTOCOL, s.ghost.violated(n::PROTOCOL))
            }),
            Property::always(n::NO_WRITE_UNDER_STORE, |m: &Self, s: &SystemState<P>| {
                !m.first(
                    slot::NO_WRITE_UNDER_STORE,
                    s.ghost.violated(n::NO_WRITE_UNDER_STORE),
                )
            }),
            Property::always(n::DATA, |m: &Self, s: &SystemState<P>| {
                !m.first(slot::DATA, s.ghost.violated(n::DATA))
            }),
            Property::always(n::OWNED_WRITES, |m: &Self, s: &SystemState<P>| {
                !m.first(slot::OWNED_WRITES, s.ghost.violated(n::OWNED_WRITES))
            }),
            Property::always(n::FINISHED_ONCE, |m: &Self, s: &SystemState<P>| {
                !m.first(slot::FINISHED_ONCE, s.ghost.violated(n::FINISHED_ONCE))
            }),
            Property::always(n::QUORUM, |m: &Self, s: &SystemState<P>| {
                !m.first(slot::QUORUM, s.ghost.violated(n::QUORUM))
            }),
            Property::always(n::CORE, |m: &Self, s: &SystemState<P>| {
                !m.first(slot::CORE, s.ghost.violated(n::CORE))
            }),
            Property::always(n::QUIESCENT, |m: &Self, s: &SystemState<P>| {
                if !s.ghost.violations.is_empty() {
                    return true;
                }
                let mut a = Vec::new();
                m.enabled(s, &mut a);
                !m.first(slot::QUIESCENT, a.is_empty() && !m.quiescent(s))
            }),
            Property::sometimes(n::FLUSHED, |m: &Self, s: &SystemState<P>| {
                m.first(slot::FLUSHED, s.ghost.flushed)
            }),
            Property::sometimes(n::PREEMPTED, |m: &Self, s: &SystemState<P>| {
                m.first(slot::PREEMPTED, s.ghost.preempted.iter().any(|&p| p))
            }),
            Property::sometimes(n::RESUMED_FROM_OFFLOAD, |m: &Self, s: &SystemState<P>| {
                m.first(slot::RESUMED_FROM_OFFLOAD, s.ghost.resumed_from_offload)
            }),
            Property::sometimes(n::SHARED_PREFIX_LOADED, |m: &Self, s: &SystemState<P>| {
                m.first(slot::SHARED_PREFIX_LOADED, s.ghost.shared_loaded)
            }),
            Property::sometimes(n::LOAD_FAILED_RECOMPUTED, |m: &Self, s: &SystemState<P>| {
                m.first(
                    slot::LOAD_FAILED_RECOMPUTED,
                    s.ghost.recomputed_after_failure,
                )
            }),
            Property::sometimes(n::DELAYED_FREE, |m: &Self, s: &SystemState<P>| {
                m.first(slot::DELAYED_FREE, s.ghost.delayed_free)
            }),
            Property::sometimes(n::ALL_DONE, |m: &Self, s: &SystemState<P>| {
                m.first(
                    slot::ALL_DONE,
                    s.ghost.violations.is_empty() && m.quiescent(s),
                )
            }),
            Property::sometimes(n::STORE_FAILED_DONE, |m: &Self, s: &SystemState<P>| {
                m.first(
                    slot::STORE_FAILED_DONE,
                    s.ghost.store_failed && s.ghost.violations.is_empty() && m.quiescent(s),
                )
            }),
            Property::sometimes(n::TIER_PROMOTED_LOADED, |m: &Self, s: &SystemState<P>| {
                m.first(slot::TIER_PROMOTED_LOADED, s.ghost.tier_promoted_loaded)
            }),
            Property::sometimes(n::TIER_FAULT_DONE, |m: &Self, s: &SystemState<P>| {
                m.first(
                    slot::TIER_FAULT_DONE,
                    s.tier.faulted && s.ghost.violations.is_empty() && m.quiescent(s),
                )
            }),
        ];
        debug_assert_eq!(all.len(), PROPERTIES);
        all.retain(|p| p.expectation != Expectation::Sometimes || expected.contains(&p.name));
        all
    }
}
