//! The worker step protocol: the legal order of one rank's connector calls per step
//! (SEMANTICS.md §2.4, invariants I-1…I-6).
//!
//! A rank's runner opens each step with [`WorkerProtocol::begin_step`], giving the step's shape,
//! then passes every connector hook through [`WorkerProtocol::handle`] before making the call.
//! The legal order of one step is
//!
//! ```text
//! handle_preemptions bind
//!   [start_load_kv]                        (here iff sync_loads)
//!   (wait_for_layer_load save_kv_layer)*   (only if forward)
//!   [start_load_kv]                        (here iff not sync_loads)
//!   [wait_for_save]                        (here iff not defer_finalize)
//!   get_finished get_block_ids_with_load_errors [get_stats] [get_events] build_worker_meta
//!   clear                                  (iff not defer_finalize)
//!   wait_for_save clear                    (iff defer_finalize: the finalisation after the draft)
//! ```
//!
//! Any other order is a [`ProtocolViolation`], and the violation sticks: every later call
//! returns it too, because a rank that broke the protocol cannot be trusted to report
//! completions correctly. This turns bugs like vLLM PR #42676 (bind before handle_preemptions)
//! and PR #20756 (clear not the last call) into errors at the first wrong call.

use crate::ids::StepId;

/// The shape of one step, known from the scheduler output before the step's first hook.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepShape {
    /// The step has synchronous external loads (`has_sync_kv_loads`): `start_load_kv` runs
    /// before the forward, which reads the loaded KV.
    pub sync_loads: bool,
    /// Tokens are scheduled, so the model runs a forward with per-layer hooks; `false` is the
    /// `kv_connector_no_forward` path, which still runs the whole lifecycle (I-6).
    pub forward: bool,
    /// Speculative decoding: `wait_for_save` and `clear` move after the draft model
    /// (`finalize_kv_connector`), after the step's results were collected.
    pub defer_finalize: bool,
}

impl Default for StepShape {
    /// A forward step with async loads and no deferred finalisation.
    fn default() -> Self {
        Self {
            sync_loads: false,
            forward: true,
            defer_finalize: false,
        }
    }
}

/// One worker-side connector hook.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum WorkerCall {
    /// `handle_preemptions(metadata)`: first call of every step.
    HandlePreemptions,
    /// `bind_connector_metadata(metadata)`.
    Bind,
    /// `start_load_kv`: exactly once per step.
    StartLoadKv,
    /// `wait_for_layer_load(layer)`: before a layer's attention.
    WaitForLayerLoad,
    /// `save_kv_layer(layer, ...)`: after a layer's attention.
    SaveKvLayer,
    /// `wait_for_save()`.
    WaitForSave,
    /// `get_finished` / `get_transfer_results`.
    GetFinished,
    /// `get_block_ids_with_load_errors`.
    GetBlockIdsWithLoadErrors,
    /// `get_kv_connector_stats` (optional).
    GetStats,
    /// `get_kv_connector_kv_cache_events` (optional).
    GetEvents,
    /// `build_connector_worker_meta`.
    BuildWorkerMeta,
    /// `clear_connector_metadata`: the last call of the step.
    Clear,
}

impl WorkerCall {
    /// Every hook, in declaration order.
    pub const ALL: [WorkerCall; 12] = [
        WorkerCall::HandlePreemptions,
        WorkerCall::Bind,
        WorkerCall::StartLoadKv,
        WorkerCall::WaitForLayerLoad,
        WorkerCall::SaveKvLayer,
        WorkerCall::WaitForSave,
        WorkerCall::GetFinished,
        WorkerCall::GetBlockIdsWithLoadErrors,
        WorkerCall::GetStats,
        WorkerCall::GetEvents,
        WorkerCall::BuildWorkerMeta,
        WorkerCall::Clear,
    ];

    /// The snake_case name used by conformance cases.
    pub fn name(self) -> &'static str {
        match self {
            WorkerCall::HandlePreemptions => "handle_preemptions",
            WorkerCall::Bind => "bind",
            WorkerCall::StartLoadKv => "start_load_kv",
            WorkerCall::WaitForLayerLoad => "wait_for_layer_load",
            WorkerCall::SaveKvLayer => "save_kv_layer",
            WorkerCall::WaitForSave => "wait_for_save",
            WorkerCall::GetFinished => "get_finished",
            WorkerCall::GetBlockIdsWithLoadErrors => "get_block_ids_with_load_errors",
            WorkerCall::GetStats => "get_stats",
            WorkerCall::GetEvents => "get_events",
            WorkerCall::BuildWorkerMeta => "build_worker_meta",
            WorkerCall::Clear => "clear",
        }
    }

    /// The hook named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Where a rank is within its step.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerPhase {
    /// Between steps: only `begin_step` is legal.
    Idle,
    /// Step opened: `handle_preemptions` is next.
    Opened,
    /// Preemptions handled: `bind` is next.
    Preempted,
    /// Bound, sync loads: `start_load_kv` is next (before the forward).
    AwaitSyncLoad,
    /// Bound; per-layer hooks may run. `loaded` = `start_load_kv` already ran.
    Forward {
        /// Whether this step's `start_load_kv` already ran.
        loaded: bool,
    },
    /// Inside a layer: `save_kv_layer` is next.
    InLayer {
        /// Whether this step's `start_load_kv` already ran.
        loaded: bool,
    },
    /// `wait_for_save` ran: `get_finished` is next.
    Saved,
    /// `get_finished` ran: `get_block_ids_with_load_errors` is next.
    Finished,
    /// Collecting the optional stats and events; `build_worker_meta` ends it.
    Collecting {
        /// `get_stats` ran.
        stats: bool,
        /// `get_events` ran.
        events: bool,
    },
    /// Worker metadata built: `clear` (or, deferred, `wait_for_save`) is next.
    MetaBuilt,
    /// Deferred finalisation: `wait_for_save` ran, `clear` is next.
    Finalizing,
}

/// A call out of order. Error kind `protocol_violation`; it sticks.
#[derive(
    Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize, thiserror::Error,
)]
#[error(
    "protocol violation in step {}: {} is not legal in phase {phase:?} of a {shape:?} step",
    step.0,
    call.map_or("begin_step", WorkerCall::name)
)]
pub struct ProtocolViolation {
    /// The step in which the violation happened.
    pub step: StepId,
    /// The phase the rank was in.
    pub phase: WorkerPhase,
    /// The shape of that step.
    pub shape: StepShape,
    /// The offending call: `None` for `begin_step` (a step opened too early).
    pub call: Option<WorkerCall>,
}

impl ProtocolViolation {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        "protocol_violation"
    }
}

/// The guard of one rank's connector call order.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkerProtocol {
    /// Steps opened so far; the current step is `steps - 1`.
    steps: u64,
    shape: StepShape,
    phase: WorkerPhase,
    broken: Option<ProtocolViolation>,
}

impl Default for WorkerProtocol {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerProtocol {
    /// A rank before its first step.
    pub fn new() -> Self {
        Self {
            steps: 0,
            shape: StepShape::default(),
            phase: WorkerPhase::Idle,
            broken: None,
        }
    }

    /// The current phase.
    pub fn phase(&self) -> WorkerPhase {
        self.phase
    }

    /// The violation this rank is stuck in, if any.
    pub fn violation(&self) -> Option<&ProtocolViolation> {
        self.broken.as_ref()
    }

    /// The step in progress (or the last one, between steps).
    pub fn step(&self) -> StepId {
        StepId(self.steps.saturating_sub(1))
    }

    /// Whether metadata is bound now (between `bind` and `clear`, I-2).
    pub fn is_bound(&self) -> bool {
        !matches!(
            self.phase,
            WorkerPhase::Idle | WorkerPhase::Opened | WorkerPhase::Preempted
        )
    }

    /// Opens the next step (I-5: only after the previous step's final `clear`).
    pub fn begin_step(&mut self, shape: StepShape) -> Result<StepId, ProtocolViolation> {
        let out = self.begin_step_unchecked(shape);
        crate::debug_assert_invariants!(self, stopped: self.violation().is_some());
        out
    }

    fn begin_step_unchecked(&mut self, shape: StepShape) -> Result<StepId, ProtocolViolation> {
        if let Some(v) = &self.broken {
            return Err(v.clone());
        }
        if self.phase != WorkerPhase::Idle {
            return Err(self.fail(None));
        }
        self.steps += 1;
        self.shape = shape;
        self.phase = WorkerPhase::Opened;
        Ok(self.step())
    }

    /// Admits `call` if it is the next legal hook of the step (I-1, I-2, I-4, I-6).
    pub fn handle(&mut self, call: WorkerCall) -> Result<(), ProtocolViolation> {
        let out = self.handle_unchecked(call);
        crate::debug_assert_invariants!(self, stopped: self.violation().is_some());
        out
    }

    fn handle_unchecked(&mut self, call: WorkerCall) -> Result<(), ProtocolViolation> {
        if let Some(v) = &self.broken {
            return Err(v.clone());
        }
        match next_phase(self.shape, self.phase, call) {
            Some(next) => {
                self.phase = next;
                Ok(())
            }
            None => Err(self.fail(Some(call))),
        }
    }

    fn fail(&mut self, call: Option<WorkerCall>) -> ProtocolViolation {
        let v = ProtocolViolation {
            step: self.step(),
            phase: self.phase,
            shape: self.shape,
            call,
        };
        self.broken = Some(v.clone());
        v
    }

    /// Checks that the phase is reachable for the step's shape (I-1) and that a violation only
    /// happens inside a step.
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        use crate::ensure_invariant;
        let s = self.shape;
        let ok = match self.phase {
            WorkerPhase::Idle | WorkerPhase::Opened | WorkerPhase::Preempted => true,
            WorkerPhase::AwaitSyncLoad => s.sync_loads,
            WorkerPhase::Forward { loaded } => loaded || !s.sync_loads,
            WorkerPhase::InLayer { loaded } => s.forward && (loaded || !s.sync_loads),
            WorkerPhase::Saved => !s.defer_finalize,
            WorkerPhase::Finished | WorkerPhase::Collecting { .. } | WorkerPhase::MetaBuilt => true,
            WorkerPhase::Finalizing => s.defer_finalize,
        };
        ensure_invariant!(
            ok,
            "I-1",
            "phase {:?} is unreachable in a {:?} step",
            self.phase,
            s
        );
        if self.phase != WorkerPhase::Idle {
            ensure_invariant!(
                self.steps >= 1,
                "I-5",
                "phase {:?} before any step",
                self.phase
            );
        }
        Ok(())
    }
}

/// The transition function of one step: the phase after `call`, or `None` if `call` is illegal.
fn next_phase(s: StepShape, phase: WorkerPhase, call: WorkerCall) -> Option<WorkerPhase> {
    use WorkerCall as C;
    use WorkerPhase as P;
    let after_loads = |call: WorkerCall| match call {
        C::WaitForSave if !s.defer_finalize => Some(P::Saved),
        C::GetFinished if s.defer_finalize => Some(P::Finished),
        _ => None,
    };
    match (phase, call) {
        (P::Opened, C::HandlePreemptions) => Some(P::Preempted),
        (P::Preempted, C::Bind) if s.sync_loads => Some(P::AwaitSyncLoad),
        (P::Preempted, C::Bind) => Some(P::Forward { loaded: false }),
        (P::AwaitSyncLoad, C::StartLoadKv) => Some(P::Forward { loaded: true }),
        // Layers run only in a forward step, and after an async start_load_kv no more layers run
        // (it is issued after the forward launch).
        (P::Forward { loaded }, C::WaitForLayerLoad) if s.forward && (s.sync_loads || !loaded) => {
            Some(P::InLayer { loaded })
        }
        (P::InLayer { loaded }, C::SaveKvLayer) => Some(P::Forward { loaded }),
        (P::Forward { loaded: false }, C::StartLoadKv) if !s.sync_loads => {
            Some(P::Forward { loaded: true })
        }
        (P::Forward { loaded: true }, c) => after_loads(c),
        (P::Saved, C::GetFinished) => Some(P::Finished),
        (P::Finished, C::GetBlockIdsWithLoadErrors) => Some(P::Collecting {
            stats: false,
            events: false,
        }),
        (
            P::Collecting {
                stats: false,
                events: false,
            },
            C::GetStats,
        ) => Some(P::Collecting {
            stats: true,
            events: false,
        }),
        (
            P::Collecting {
                stats,
                events: false,
            },
            C::GetEvents,
        ) => Some(P::Collecting {
            stats,
            events: true,
        }),
        (P::Collecting { .. }, C::BuildWorkerMeta) => Some(P::MetaBuilt),
        (P::MetaBuilt, C::Clear) if !s.defer_finalize => Some(P::Idle),
        (P::MetaBuilt, C::WaitForSave) if s.defer_finalize => Some(P::Finalizing),
        (P::Finalizing, C::Clear) => Some(P::Idle),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use super::*;

    #[test]
    fn check_invariants_rejects_a_corrupt_protocol() {
        // Protects I-1…I-6 as the model checker sees them (it calls check_invariants after
        // every action): each kind of corruption is reported.
        let mut p = WorkerProtocol::new();
        p.check_invariants().unwrap();
        p.begin_step(StepShape {
            forward: false,
            ..StepShape::default()
        })
        .unwrap();
        p.check_invariants().unwrap();
        // A phase this step's shape cannot reach: finalizing without deferred finalization.
        let mut bad = p.clone();
        bad.phase = WorkerPhase::Finalizing;
        assert_eq!(bad.check_invariants().unwrap_err().id, "I-1");
        // A step in progress before any step was opened.
        let mut bad = WorkerProtocol::new();
        bad.phase = WorkerPhase::Opened;
        assert_eq!(bad.check_invariants().unwrap_err().id, "I-5");
        // Inside a layer of a step without a forward pass.
        let mut bad = p.clone();
        bad.phase = WorkerPhase::InLayer { loaded: false };
        assert_eq!(bad.check_invariants().unwrap_err().id, "I-1");
    }

    #[test]
    fn wait_for_save_after_the_metadata_only_in_a_deferred_step() {
        // In a step that does not defer finalisation, `wait_for_save` comes before
        // `get_finished`; after `build_worker_meta` only `clear` is legal.
        use WorkerCall as C;
        for defer_finalize in [false, true] {
            let mut p = WorkerProtocol::new();
            p.begin_step(StepShape {
                defer_finalize,
                ..StepShape::default()
            })
            .unwrap();
            let mut calls = vec![C::HandlePreemptions, C::Bind, C::StartLoadKv];
            if !defer_finalize {
                calls.push(C::WaitForSave);
            }
            calls.extend([
                C::GetFinished,
                C::GetBlockIdsWithLoadErrors,
                C::BuildWorkerMeta,
            ]);
            for c in calls {
                p.handle(c).unwrap();
            }
            assert_eq!(p.handle(C::WaitForSave).is_ok(), defer_finalize);
        }
    }
}
