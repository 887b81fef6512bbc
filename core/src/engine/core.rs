//! The engine side of a step: the scheduler, the ranks' outputs and the aggregator composed
//! (vLLM's `EngineCore` with its executor's `KVOutputAggregator`).
//!
//! # When to call what
//!
//! * [`EngineCore::add_request`], [`EngineCore::abort`], [`EngineCore::reset_connector_cache`],
//!   [`EngineCore::reset_prefix_cache`] between steps, as inputs arrive.
//! * [`EngineCore::set_cache_events`] once, before the first step, for structured KV cache
//!   events (off by default); then [`EngineCore::take_cache_events`] after each `apply`: the
//!   step's batch, as vLLM publishes it.
//! * [`EngineCore::schedule`] once per engine step (up to `async_depth` steps ahead): the
//!   [`ScheduledStep`] goes, unchanged, to every rank's [`crate::RankDriver::begin`].
//! * [`EngineCore::rank_output`] with each rank's [`WorkerOutput`] of a step, in any order; a
//!   second output for the same (step, rank) is rejected before it can reach the aggregator
//!   (compat would count its completions twice).
//! * [`EngineCore::apply`] once the oldest step has every rank's output ([`EngineCore::ready`]):
//!   aggregates them, takes the tokens sampled for the step (the caller samples the requests
//!   [`Scheduler::sampling`] lists; the `testing` feature's `apply_fake` uses the fake
//!   sampler) and applies the step with `update_from_output`. Its [`Applied`] says whether the
//!   step was idle — nothing scheduled, nothing asked of the workers, nothing reported back — so
//!   a loop can wait for a transfer completion or new input before stepping again instead of
//!   spinning.
//! * [`EngineCore::take_released`] after `apply`: request ids nothing refers to any more (the
//!   scheduler freed the request, the aggregator counts nothing for it, the connector no longer
//!   tracks it, and every rank has seen it finish), which the caller may release from its
//!   [`crate::Interner`].
//!
//! One number is the world size W: the aggregator's quorum (unless the connector overrides it,
//! `get_finished_count`), the ranks whose outputs a step waits for, and what the caller gives
//! the connector (e.g. the offloading connector's `num_workers`, [`EngineCore::world_size`]).

use alloc::collections::{BTreeSet, VecDeque};
use alloc::vec::Vec;

use crate::aggregator::{AggregateError, Aggregator};
use crate::ids::{Rank, RequestId, StepId};
use crate::messages::AggregatedOutput;
use crate::messages::CacheEvent;
use crate::messages::ModelOutput;
use crate::messages::ScheduledStep;
use crate::messages::WorkerOutput;
use crate::scheduler::RequestSpec;
use crate::scheduler::Scheduler;
use crate::scheduler::SchedulerConfig;
use crate::scheduler::SchedulerConnector;
use crate::scheduler::SchedulerError;
use crate::scheduler::StepResult;
use crate::tokens::Token;
use crate::{InvariantViolation, ensure_invariant};

/// An engine call that failed. Scheduler errors keep their own stickiness (see
/// [`SchedulerError`]); an aggregator error, or a sticky scheduler error while applying a step,
/// stops the engine ([`EngineCore::broken`]); the others change nothing.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The scheduler refused or stopped.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// The aggregator refused the step's outputs (strict mode: a duplicate report).
    #[error(transparent)]
    Aggregate(#[from] AggregateError),
    /// An output for a step that is not in flight.
    #[error("output of rank {rank:?} for step {step:?}, which is not in flight")]
    UnknownStep {
        /// The step named.
        step: StepId,
        /// The rank that sent it.
        rank: Rank,
    },
    /// A rank outside `0..W`.
    #[error("rank {rank:?} is not one of the {world} ranks")]
    RankOutOfRange {
        /// The rank named.
        rank: Rank,
        /// W.
        world: u32,
    },
    /// A second output for the same step and rank.
    #[error("rank {rank:?} already reported step {step:?}")]
    DuplicateOutput {
        /// The step.
        step: StepId,
        /// The rank.
        rank: Rank,
    },
    /// `apply` before every rank reported the oldest step.
    #[error("step {step:?} waits for {missing} rank output(s)")]
    NotReady {
        /// The oldest step in flight.
        step: StepId,
        /// Ranks that did not report it yet.
        missing: u32,
    },
    /// `apply` with no step in flight.
    #[error("no step in flight")]
    NothingInFlight,
}

impl EngineError {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Scheduler(e) => e.kind(),
            Self::Aggregate(e) => e.kind(),
            Self::UnknownStep { .. } => "step_out_of_order",
            Self::RankOutOfRange { .. } => "rank_out_of_range",
            Self::DuplicateOutput { .. } => "duplicate_output",
            Self::NotReady { .. } => "not_executed",
            Self::NothingInFlight => "step_out_of_order",
        }
    }
}

/// A step scheduled: what every rank runs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Scheduled<M> {
    /// The step, for every rank.
    pub step: ScheduledStep<M>,
    /// The step schedules no token, admits, preempts and finishes nothing, and its metadata asks
    /// the workers for nothing (the connector's `meta_is_empty`).
    pub quiet: bool,
}

/// A step applied.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Applied<WM> {
    /// The step.
    pub step: StepId,
    /// The aggregated connector output the scheduler applied (`None`: none at the output rank).
    pub connector_output: Option<AggregatedOutput<WM>>,
    /// The scheduler's result: outputs per request, KV events.
    pub result: StepResult,
    /// The step was quiet and brought nothing back either (no completion, no worker metadata,
    /// no load failure, no request output): stepping again at once would change nothing until a
    /// transfer completes or an input arrives.
    pub idle: bool,
}

/// A step in flight with the ranks' outputs collected so far.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct InFlight<WM> {
    step: StepId,
    quiet: bool,
    /// Per rank: `None` until it reported; then its output (`Some(None)`: no connector output,
    /// or the output was folded into `aggregated`).
    outputs: Vec<Option<Option<WorkerOutput<WM>>>>,
    /// The aggregator's result, once every rank reported (the executor aggregates as it
    /// collects the outputs, before the scheduler sees them).
    aggregated: Option<Option<AggregatedOutput<WM>>>,
    /// Requests the step told every rank are finished.
    finished: Vec<RequestId>,
}

/// The scheduler, the step outputs in flight and the aggregator. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct EngineCore<C: SchedulerConnector> {
    scheduler: Scheduler<C>,
    aggregator: Aggregator<C::WorkerMeta>,
    world: u32,
    in_flight: VecDeque<InFlight<C::WorkerMeta>>,
    /// Requests every rank has seen finish, not released yet.
    finishing: BTreeSet<RequestId>,
    /// A step could not be applied after its outputs were aggregated (sticky).
    broken: Option<EngineError>,
    #[cfg(feature = "fault-injection")]
    fault: Option<EngineFault>,
}

/// An executor bug, re-introduced on purpose so that the model checker can show it finds it
/// ([`EngineCore::inject_fault`]). Only with the `fault-injection` feature.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum EngineFault {
    /// vLLM issue #21070: the aggregator is handed only the output rank's output.
    OneRankOutput,
}

impl<C: SchedulerConnector> EngineCore<C> {
    /// An engine of `world_size` ranks (1 to 64) over a scheduler with `connector`; the
    /// aggregator's quorum is the connector's `get_finished_count`, else W.
    pub fn new(
        config: SchedulerConfig,
        connector: C,
        world_size: u32,
    ) -> Result<Self, EngineError> {
        if world_size == 0 || world_size > 64 {
            return Err(EngineError::Scheduler(SchedulerError::InvalidConfig(
                alloc::format!("the world size must be 1 to 64, not {world_size}"),
            )));
        }
        let aggregator = Aggregator::for_connector(&connector, world_size, config.mode);
        let scheduler = Scheduler::new(config, connector)?;
        Ok(Self {
            scheduler,
            aggregator,
            world: world_size,
            in_flight: VecDeque::new(),
            finishing: BTreeSet::new(),
            broken: None,
            #[cfg(feature = "fault-injection")]
            fault: None,
        })
    }

    /// Re-introduce a historical executor bug (model checking only).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, fault: EngineFault) {
        self.fault = Some(fault);
    }

    /// W.
    pub fn world_size(&self) -> u32 {
        self.world
    }

    /// The scheduler (queries: request states, the block pool, the connector).
    pub fn scheduler(&self) -> &Scheduler<C> {
        &self.scheduler
    }

    /// The scheduler, mutable: for the connector's test script and scheduler fault injection,
    /// not for stepping (which goes through this engine).
    pub fn scheduler_mut(&mut self) -> &mut Scheduler<C> {
        &mut self.scheduler
    }

    /// The aggregator.
    pub fn aggregator(&self) -> &Aggregator<C::WorkerMeta> {
        &self.aggregator
    }

    /// Steps scheduled and not applied, oldest first.
    pub fn steps_in_flight(&self) -> impl Iterator<Item = StepId> + '_ {
        self.in_flight.iter().map(|s| s.step)
    }

    /// Whether the engine should keep stepping (the scheduler's `has_requests`, or a step in
    /// flight).
    pub fn has_work(&self) -> bool {
        self.scheduler.has_requests() || !self.in_flight.is_empty()
    }

    /// A request arrives.
    pub fn add_request(&mut self, spec: RequestSpec) -> Result<(), EngineError> {
        let out = self.add_request_unchecked(spec);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn add_request_unchecked(&mut self, spec: RequestSpec) -> Result<(), EngineError> {
        Ok(self.scheduler.add_request(spec)?)
    }

    /// A client disconnects: `Ok(false)` if the request is not live.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, EngineError> {
        let out = self.abort_unchecked(id);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn abort_unchecked(&mut self, id: RequestId) -> Result<bool, EngineError> {
        Ok(self.scheduler.abort(id)?)
    }

    /// `reset_connector_cache()`.
    pub fn reset_connector_cache(&mut self) -> Result<Option<bool>, EngineError> {
        let out = self.reset_connector_cache_unchecked();
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn reset_connector_cache_unchecked(&mut self) -> Result<Option<bool>, EngineError> {
        Ok(self.scheduler.reset_connector_cache()?)
    }

    /// `reset_prefix_cache(reset_running_requests=False, reset_connector)`: see
    /// [`Scheduler::reset_prefix_cache`].
    pub fn reset_prefix_cache(&mut self, reset_connector: bool) -> Result<bool, EngineError> {
        let out = self.reset_prefix_cache_unchecked(reset_connector);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn reset_prefix_cache_unchecked(&mut self, reset_connector: bool) -> Result<bool, EngineError> {
        Ok(self.scheduler.reset_prefix_cache(reset_connector)?)
    }

    /// Structured KV cache events on or off: see [`Scheduler::set_cache_events`].
    pub fn set_cache_events(&mut self, on: bool) {
        self.scheduler.set_cache_events(on);
    }

    /// The structured KV cache events since the last call, in vLLM's publication order: see
    /// [`Scheduler::take_cache_events`]. Call after each [`EngineCore::apply`].
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.scheduler.take_cache_events()
    }

    /// Schedule the next step (see the module docs).
    pub fn schedule(&mut self) -> Result<Scheduled<C::StepMeta>, EngineError> {
        let out = self.schedule_unchecked();
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn schedule_unchecked(&mut self) -> Result<Scheduled<C::StepMeta>, EngineError> {
        self.check_broken()?;
        let step = self.scheduler.schedule()?;
        let out = &step.output;
        // An async admission schedules no token but puts its load in the metadata.
        let quiet = out.num_scheduled_tokens.is_empty()
            && out.preempted_req_ids.is_empty()
            && out.finished_req_ids.is_empty()
            && self.scheduler.connector().meta_is_empty(&step.meta);
        self.in_flight.push_back(InFlight {
            step: out.step,
            quiet,
            outputs: alloc::vec![None; self.world as usize],
            aggregated: None,
            finished: out.finished_req_ids.iter().copied().collect(),
        });
        Ok(Scheduled { step, quiet })
    }

    fn check_broken(&self) -> Result<(), EngineError> {
        match &self.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn stop(&mut self, e: EngineError) -> EngineError {
        self.broken = Some(e.clone());
        e
    }

    /// The error the engine stopped with (a step that could not be applied), if any.
    pub fn broken(&self) -> Option<&EngineError> {
        self.broken.as_ref()
    }

    /// Rank `rank`'s output of `step` (`None`: the rank produced no connector output). The
    /// last rank's output of a step has the aggregator fold them all, in step order (a rank
    /// runs its steps in order, so the oldest step completes first).
    pub fn rank_output(
        &mut self,
        step: StepId,
        rank: Rank,
        output: Option<WorkerOutput<C::WorkerMeta>>,
    ) -> Result<(), EngineError> {
        let out = self.rank_output_unchecked(step, rank, output);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn rank_output_unchecked(
        &mut self,
        step: StepId,
        rank: Rank,
        output: Option<WorkerOutput<C::WorkerMeta>>,
    ) -> Result<(), EngineError> {
        self.check_broken()?;
        if rank.0 >= self.world {
            return Err(EngineError::RankOutOfRange {
                rank,
                world: self.world,
            });
        }
        let Some(s) = self.in_flight.iter_mut().find(|s| s.step == step) else {
            return Err(EngineError::UnknownStep { step, rank });
        };
        let slot = &mut s.outputs[rank.0 as usize];
        if slot.is_some() {
            return Err(EngineError::DuplicateOutput { step, rank });
        }
        *slot = Some(output);
        self.aggregate_ready()
    }

    /// Aggregates every step, oldest first, whose outputs are all in.
    fn aggregate_ready(&mut self) -> Result<(), EngineError> {
        for i in 0..self.in_flight.len() {
            let s = &self.in_flight[i];
            if s.aggregated.is_some() {
                continue;
            }
            if s.outputs.iter().any(Option::is_none) {
                return Ok(());
            }
            #[allow(unused_mut)] // mutated only with the `fault-injection` feature
            let mut outputs: Vec<Option<WorkerOutput<C::WorkerMeta>>> =
                s.outputs.iter().map(|o| o.clone().flatten()).collect();
            #[cfg(feature = "fault-injection")]
            if self.fault == Some(EngineFault::OneRankOutput) {
                for o in outputs.iter_mut().skip(1) {
                    *o = None;
                }
            }
            let kv = self
                .aggregator
                .aggregate(&outputs, Rank(0))
                .map_err(|e| self.stop(e.into()))?;
            let s = &mut self.in_flight[i];
            s.aggregated = Some(kv);
            // The aggregate is what is applied now; keep only which ranks reported.
            for o in &mut s.outputs {
                *o = Some(None);
            }
        }
        Ok(())
    }

    /// Whether the oldest step in flight has every rank's output (and was aggregated).
    pub fn ready(&self) -> bool {
        self.in_flight
            .front()
            .is_some_and(|s| s.aggregated.is_some())
    }

    /// The aggregated connector output of `step`, once every rank reported it (`Some(None)`:
    /// no connector output at the output rank).
    pub fn aggregated(&self, step: StepId) -> Option<&Option<AggregatedOutput<C::WorkerMeta>>> {
        self.in_flight
            .iter()
            .find(|s| s.step == step)
            .and_then(|s| s.aggregated.as_ref())
    }

    /// Apply the oldest step (see the module docs). `sampled`: the tokens sampled for the
    /// step's requests ([`Scheduler::sampling`] says which; with the `testing` feature,
    /// `apply_fake` uses the fake sampler).
    pub fn apply(
        &mut self,
        sampled: Vec<(RequestId, Vec<Token>)>,
    ) -> Result<Applied<C::WorkerMeta>, EngineError> {
        let out = self.apply_unchecked(sampled);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn apply_unchecked(
        &mut self,
        sampled: Vec<(RequestId, Vec<Token>)>,
    ) -> Result<Applied<C::WorkerMeta>, EngineError> {
        self.check_broken()?;
        let Some(front) = self.in_flight.front() else {
            return Err(EngineError::NothingInFlight);
        };
        let Some(kv) = front.aggregated.clone() else {
            let missing = front.outputs.iter().filter(|o| o.is_none()).count() as u32;
            return Err(EngineError::NotReady {
                step: front.step,
                missing,
            });
        };
        let step = front.step;
        let carried = kv.as_ref().is_some_and(|kv| {
            kv.finished_recving.is_some()
                || kv.finished_sending.is_some()
                || kv.worker_meta.is_some()
                || !kv.failed_recving.is_empty()
                || !kv.invalid_block_ids.is_empty()
        });
        // Bad input (`sampled` naming a request the step did not schedule, an id or a block a
        // rank reported that the scheduler does not know) is refused before anything changes:
        // the step stays in flight, its aggregated output kept, and may be applied again. A
        // sticky scheduler error (a completion it cannot take) stops the engine with it.
        let result = match self.scheduler.update_from_output(
            step,
            ModelOutput {
                sampled,
                kv_connector_output: kv.clone(),
            },
        ) {
            Ok(r) => r,
            Err(e) => {
                if self.scheduler.steps_in_flight().next() != Some(step) {
                    // The scheduler took the step before it stopped: so does the engine.
                    self.in_flight.pop_front();
                }
                if self.scheduler.broken().is_some() {
                    return Err(self.stop(e.into()));
                }
                return Err(e.into());
            }
        };
        let flight = self.in_flight.pop_front().expect("checked above");
        self.finishing.extend(flight.finished);
        let idle = flight.quiet && !carried && result.outputs.is_empty();
        Ok(Applied {
            step,
            connector_output: kv,
            result,
            idle,
        })
    }

    /// Rank `rank`'s output slot of every step in flight, oldest first: `None` until it
    /// reported, then its output (`Some(None)`: no connector output, or the step was aggregated
    /// already).
    pub fn rank_outputs(
        &self,
        rank: Rank,
    ) -> impl Iterator<Item = Option<&Option<WorkerOutput<C::WorkerMeta>>>> + '_ {
        self.in_flight
            .iter()
            .map(move |s| s.outputs.get(rank.0 as usize).and_then(Option::as_ref))
    }

    /// Renumbers the ranks: rank `new` gets the outputs rank `order[new]` reported. For the
    /// model checker's symmetry reduction over interchangeable ranks (compat mode, where the
    /// aggregator keeps no per-rank state); `order` must be a permutation of `0..W`.
    #[doc(hidden)]
    pub fn permute_ranks(&mut self, order: &[usize]) {
        self.permute_ranks_unchecked(order);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
    }

    fn permute_ranks_unchecked(&mut self, order: &[usize]) {
        debug_assert_eq!(order.len(), self.world as usize);
        for s in &mut self.in_flight {
            s.outputs = order.iter().map(|&old| s.outputs[old].clone()).collect();
        }
    }

    /// Request ids that nothing refers to any more (see the module docs); each is returned
    /// once.
    pub fn take_released(&mut self) -> Vec<RequestId> {
        let out = self.take_released_unchecked();
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some() || self.scheduler().broken().is_some());
        out
    }

    fn take_released_unchecked(&mut self) -> Vec<RequestId> {
        let s = &self.scheduler;
        let a = &self.aggregator;
        let gone: Vec<RequestId> = self
            .finishing
            .iter()
            .copied()
            .filter(|&id| {
                s.status(id).is_none() && a.is_idle(id) && !s.connector().tracks_request(id)
            })
            .collect();
        for id in &gone {
            self.finishing.remove(id);
        }
        gone
    }

    /// The engine's own invariants, then the scheduler's and the aggregator's: steps in flight
    /// are consecutive and at most `async_depth` (I-12), one output slot per rank.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.scheduler.check_invariants()?;
        self.aggregator.check_invariants()?;
        let mut prev: Option<StepId> = None;
        for s in &self.in_flight {
            ensure_invariant!(
                prev.is_none_or(|p| p.0 + 1 == s.step.0),
                "I-12",
                "steps in flight are not consecutive at {:?}",
                s.step
            );
            ensure_invariant!(
                s.outputs.len() == self.world as usize,
                "I-21",
                "step {:?} has {} output slots for {} ranks",
                s.step,
                s.outputs.len(),
                self.world
            );
            prev = Some(s.step);
        }
        ensure_invariant!(
            self.scheduler.steps_in_flight().eq(self.steps_in_flight()),
            "I-12",
            "the scheduler has steps {:?} in flight, the engine {:?}",
            self.scheduler.steps_in_flight().collect::<Vec<_>>(),
            self.steps_in_flight().collect::<Vec<_>>()
        );
        Ok(())
    }
}
