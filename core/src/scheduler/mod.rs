//! The engine scheduler as the connector sees it (SEMANTICS.md §1.2, §1.6, §2.2–§2.3, §2.7–§2.9,
//! §6.1, §8.2, §8.3, §8.6): vLLM 0.33.0's `Scheduler` restricted to what decides connector calls
//! and block ownership.
//!
//! # When to call what
//!
//! * [`Scheduler::add_request`] when a request arrives (calls `on_new_request`).
//! * [`Scheduler::schedule`] once per engine step: returns the step's [`crate::SchedulerOutput`] and the
//!   connector metadata for the workers. Up to `async_depth` steps may be scheduled before the
//!   oldest one's output is applied (async scheduling, I-12).
//! * [`Scheduler::update_from_output`] with the executed step's [`crate::ModelOutput`] (sampled tokens
//!   and the *aggregated* connector output), oldest step first.
//! * [`Scheduler::abort`] between steps (client disconnect).
//! * [`Scheduler::reset_prefix_cache`] / [`Scheduler::reset_connector_cache`] between steps: the
//!   GPU prefix cache (and the connector's), or the connector's alone.
//! * [`Scheduler::set_cache_events`] once, before the first step, to get structured KV cache
//!   events; then [`Scheduler::take_cache_events`] after each `update_from_output` (a publisher
//!   sends them as that step's batch).
//! * [`Scheduler::has_requests`] to decide whether the engine keeps stepping.
//!
//! # What is modelled
//!
//! Requests with prompt tokens and a chained block-hash list; a shared GPU [`BlockPool`] with
//! prefix caching; one or more KV cache groups, full attention or sliding window (sliding-window
//! blocks below the window are freed while the request runs); chunked prefill under a token
//! budget and `max_num_seqs`; admission with connector lookups; async loads
//! (`WAITING_FOR_REMOTE_KVS`); preemption in recompute mode; finish by stop token, length or
//! abort with `request_finished` exactly once and delayed free; load-failure recovery with the
//! `fail` and `recompute` policies and the shared-block claiming rule (I-33…I-37); async
//! scheduling with placeholders. Not modelled: speculative decoding, encoder inputs, LoRA,
//! structured output, streaming sessions, priority scheduling, `defer_block_free`, Mamba.
//!
//! # Errors
//!
//! Bad input — an unknown or duplicate request id, a block id out of range, an output for a step
//! that is not the oldest in flight — is a typed [`SchedulerError`] and changes nothing. A
//! connector or worker breaking its contract mid-transition (an impossible lookup answer, an
//! intent that cannot be applied, a completion for a request that cannot take it) is detected
//! where vLLM would assert and crash; here it is a typed error that *sticks*: every later call
//! returns it, because the state is no longer one vLLM could be in.
//!
//! # Layout
//!
//! | file | what |
//! | --- | --- |
//! | `config.rs` | [`SchedulerConfig`], the KV cache groups |
//! | `request.rs` | [`RequestSpec`], [`RequestStatus`], the request's token and hash bookkeeping |
//! | `connector.rs`, `intent.rs` | the scheduler side of the connector contract: [`SchedulerConnector`], [`Lookup`]; the [`Intent`]s a connector asks for |
//! | `view.rs` | [`SchedulerView`], what a connector may read |
//! | `shadow.rs` | [`ShadowState`]: that view kept by an embedder whose scheduler is not this one (vLLM's) |
//! | `block_pool.rs` | the GPU [`BlockPool`] with prefix caching |
//! | `kv_cache.rs` | block accounting per KV cache group (hits, allocation, caching, freeing) |
//! | `lifecycle.rs` | `add_request`, `abort`, finishing, freeing, preemption |
//! | `schedule.rs` | `schedule()`, in its phases |
//! | `update.rs` | `update_from_output()` |
//! | `invariants.rs` | `check_invariants()` |
//! | `output.rs`, `error.rs` | what the scheduler returns, and its errors |
//!
//! This file holds the state every phase shares.

mod block_pool;
mod config;
mod connector;
mod error;
mod intent;
mod invariants;
mod kv_cache;
mod lifecycle;
mod output;
mod request;
mod schedule;
mod shadow;
mod update;
mod view;

#[cfg(test)]
mod tests;

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::format;
use alloc::vec::Vec;

pub use block_pool::BlockPool;
pub use config::{GroupKind, LoadFailurePolicy, SchedulerConfig};
pub use connector::{FinishDecision, Lookup, SchedulerConnector};
#[cfg(feature = "fault-injection")]
pub use error::SchedulerFault;
pub use error::{ConnectorError, SchedulerError};
pub use intent::Intent;
pub use output::{FinishReason, RequestOutput, StepResult};
pub use request::{Params, RequestSpec, RequestStatus};
pub use shadow::{RequestMirror, ShadowState};
pub use view::{RequestView, SchedulerView};

use crate::ids::{BlockId, NULL_BLOCK, RequestId, StepId};
use crate::messages::CacheEvent;
use crate::tokens::{BlockHash, Token};

// ---------------------------------------------------------------------------------------------
// The state.

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Request {
    id: RequestId,
    status: RequestStatus,
    tokens: Vec<Token>,
    num_prompt_tokens: u32,
    block_hashes: Vec<BlockHash>,
    max_tokens: u32,
    stop_token: Option<Token>,
    kv_transfer_params: Option<Params>,
    num_computed_tokens: u32,
    num_in_flight_tokens: u32,
    num_output_placeholders: u32,
    num_stale_output_tokens: u32,
    drop_stale_output: bool,
    num_preemptions: u32,
    /// One block table per KV cache group.
    blocks: Vec<Vec<BlockId>>,
    /// Per group: how many leading blocks have been offered to the prefix cache.
    num_cached_blocks: Vec<u32>,
    is_prefill_chunk: bool,
    /// Finished, blocks kept because `request_finished` said `delay_free`.
    held_for_send: bool,
    /// Finished while its async load was in flight: blocks kept until `finished_recving`.
    held_for_recv: bool,
}

impl Request {
    /// A waiting request with no tokens, nothing computed and empty block tables in `ngroups`
    /// groups: what `add_request` fills in, and what a shadow mirrors into.
    fn new(id: RequestId, ngroups: usize) -> Self {
        Request {
            id,
            status: RequestStatus::Waiting,
            tokens: Vec::new(),
            num_prompt_tokens: 0,
            block_hashes: Vec::new(),
            max_tokens: 0,
            stop_token: None,
            kv_transfer_params: None,
            num_computed_tokens: 0,
            num_in_flight_tokens: 0,
            num_output_placeholders: 0,
            num_stale_output_tokens: 0,
            drop_stale_output: false,
            num_preemptions: 0,
            blocks: alloc::vec![Vec::new(); ngroups],
            num_cached_blocks: alloc::vec![0; ngroups],
            is_prefill_chunk: false,
            held_for_send: false,
            held_for_recv: false,
        }
    }
}

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct ScheduledEntry {
    id: RequestId,
    tokens: u32,
    /// Whether the runner samples a token for it (not a partial prefill chunk).
    samples: bool,
    /// The index the sampled token will have.
    position: u32,
}

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct InFlightStep {
    step: StepId,
    scheduled: Vec<ScheduledEntry>,
}

/// The requests the scheduler holds, indexed densely by [`RequestId`] (ids come from an
/// [`crate::Interner`], which keeps them dense): lookups on the hot path are array indexing, not
/// tree walks. Ids at or above [`MAX_REQUEST_ID`] are rejected at `add_request`. Trailing empty
/// slots are trimmed so that equal contents compare (and hash) equal.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
struct RequestTable {
    slots: Vec<Option<Request>>,
    len: usize,
}

/// Request ids must be below this (about a million live requests).
pub const MAX_REQUEST_ID: u32 = 1 << 20;

impl RequestTable {
    fn get(&self, id: &RequestId) -> Option<&Request> {
        self.slots.get(id.index()).and_then(Option::as_ref)
    }
    fn get_mut(&mut self, id: &RequestId) -> Option<&mut Request> {
        self.slots.get_mut(id.index()).and_then(Option::as_mut)
    }
    fn contains_key(&self, id: &RequestId) -> bool {
        self.get(id).is_some()
    }
    fn insert(&mut self, id: RequestId, r: Request) {
        let i = id.index();
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        if self.slots[i].replace(r).is_none() {
            self.len += 1;
        }
    }
    fn remove(&mut self, id: &RequestId) -> Option<Request> {
        let r = self.slots.get_mut(id.index()).and_then(Option::take);
        if r.is_some() {
            self.len -= 1;
            while matches!(self.slots.last(), Some(None)) {
                self.slots.pop();
            }
        }
        r
    }
    fn values(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().flatten()
    }
    fn keys(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.values().map(|r| r.id)
    }
    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl core::ops::Index<&RequestId> for RequestTable {
    type Output = Request;
    /// Panics on an id the table does not hold: callers index only ids they know are held (queued
    /// or scheduled requests), so a miss is a bookkeeping bug.
    fn index(&self, id: &RequestId) -> &Request {
        self.get(id).expect("request held by the scheduler")
    }
}

/// Everything the scheduler owns except the connector (so that the connector can be called with
/// a view of it).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct State {
    config: SchedulerConfig,
    pool: BlockPool,
    requests: RequestTable,
    waiting: VecDeque<RequestId>,
    kv_holding_waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    finished_req_ids: BTreeSet<RequestId>,
    reset_preempted_req_ids: BTreeSet<RequestId>,
    finished_recving_kv_req_ids: BTreeSet<RequestId>,
    failed_recving_kv_req_ids: BTreeSet<RequestId>,
    inflight_prefills: BTreeSet<RequestId>,
    in_flight: VecDeque<InFlightStep>,
    next_step: u64,
    /// Connector pins: block → references held by the connector.
    pins: BTreeMap<BlockId, u32>,
    requires_kv_delivery: bool,
    /// KV cache events published by `update_from_output` and not yet taken: each step's pool
    /// events, then its connector events (vLLM's batch order). Empty while events are off.
    cache_events: Vec<CacheEvent>,
    broken: Option<SchedulerError>,
    #[cfg(feature = "fault-injection")]
    fault: Option<SchedulerFault>,
}

impl State {
    /// An empty pool and no requests.
    fn new(config: SchedulerConfig, requires_kv_delivery: bool) -> Self {
        let pool = BlockPool::new(config.num_gpu_blocks);
        State {
            config,
            pool,
            requests: RequestTable::default(),
            waiting: VecDeque::new(),
            kv_holding_waiting: VecDeque::new(),
            running: Vec::new(),
            finished_req_ids: BTreeSet::new(),
            reset_preempted_req_ids: BTreeSet::new(),
            finished_recving_kv_req_ids: BTreeSet::new(),
            failed_recving_kv_req_ids: BTreeSet::new(),
            inflight_prefills: BTreeSet::new(),
            in_flight: VecDeque::new(),
            next_step: 0,
            pins: BTreeMap::new(),
            requires_kv_delivery,
            cache_events: Vec::new(),
            broken: None,
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }

    /// Whether [`SchedulerFault::ClaimHitsGroupByGroup`] was injected (always `false` without
    /// the `fault-injection` feature).
    fn claims_hits_group_by_group(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            self.fault == Some(SchedulerFault::ClaimHitsGroupByGroup)
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }

    /// Whether [`SchedulerFault::FreeAbortedWhileLoading`] was injected: the one place the
    /// fault's three effects ask (always `false` without the `fault-injection` feature).
    fn frees_aborted_loads_at_once(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            self.fault == Some(SchedulerFault::FreeAbortedWhileLoading)
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The scheduler.

/// The scheduler with its connector. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Scheduler<C> {
    state: State,
    connector: C,
}

impl<C: SchedulerConnector> Scheduler<C> {
    /// A scheduler with an empty pool and no requests.
    pub fn new(config: SchedulerConfig, connector: C) -> Result<Self, SchedulerError> {
        config.validate()?;
        let requires_kv_delivery = connector.requires_kv_delivery();
        Ok(Self {
            state: State::new(config, requires_kv_delivery),
            connector,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.state.config
    }

    /// Re-introduces a historical bug (model checking only; see [`SchedulerFault`]).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&mut self, fault: SchedulerFault) {
        self.state.fault = Some(fault);
    }

    /// The connector (read-only; it is driven only by the scheduler).
    pub fn connector(&self) -> &C {
        &self.connector
    }

    /// The connector, mutably: for configuring it between calls (a scripted connector's answers,
    /// a runtime connector's settings). The scheduler sees changes only through later calls.
    pub fn connector_mut(&mut self) -> &mut C {
        &mut self.connector
    }

    /// A read-only view, as connectors get it.
    pub fn view(&self) -> SchedulerView<'_> {
        self.state.view()
    }

    /// The GPU block pool (read-only).
    pub fn block_pool(&self) -> &BlockPool {
        &self.state.pool
    }

    /// The sticky error, if a contract breach broke the scheduler.
    pub fn broken(&self) -> Option<&SchedulerError> {
        self.state.broken.as_ref()
    }

    /// Steps scheduled whose output has not been applied yet, oldest first.
    pub fn steps_in_flight(&self) -> impl Iterator<Item = StepId> + '_ {
        self.state.in_flight.iter().map(|s| s.step)
    }

    /// `has_requests()`: unfinished requests, finished ones still holding blocks for the
    /// connector, finished ids not yet delivered in a step's `finished_req_ids`, or connector
    /// push work pending. The engine keeps stepping while it is true.
    pub fn has_requests(&self) -> bool {
        !self.state.requests.is_empty()
            || !self.state.finished_req_ids.is_empty()
            || self.connector.has_pending_push_work()
    }

    /// `reset_connector_cache()`.
    pub fn reset_connector_cache(&mut self) -> Result<Option<bool>, SchedulerError> {
        let out = self.reset_connector_cache_unchecked();
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
        out
    }

    fn reset_connector_cache_unchecked(&mut self) -> Result<Option<bool>, SchedulerError> {
        self.check_broken()?;
        let r = self.connector.reset_cache();
        self.apply_intents()?;
        Ok(r)
    }

    /// vLLM's `reset_prefix_cache(reset_running_requests=False, reset_connector)`: drops every
    /// key of the GPU prefix cache if no block is in use ([`BlockPool::reset_prefix_cache`];
    /// queues `AllCleared` when events are on), then, with `reset_connector`, resets the
    /// connector as [`Scheduler::reset_connector_cache`] does — even when the pool refused, as
    /// vLLM does. `Ok(true)` when the pool reset and the connector did not answer `Some(false)`
    /// (a connector without a reset, `None`, counts as success, as in vLLM's
    /// `reset_connector_cache`). Call between steps.
    pub fn reset_prefix_cache(&mut self, reset_connector: bool) -> Result<bool, SchedulerError> {
        let out = self.reset_prefix_cache_unchecked(reset_connector);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
        out
    }

    fn reset_prefix_cache_unchecked(
        &mut self,
        reset_connector: bool,
    ) -> Result<bool, SchedulerError> {
        self.check_broken()?;
        let mut ok = self.state.pool.reset_prefix_cache();
        if reset_connector {
            ok = self.reset_connector_cache_unchecked()? != Some(false) && ok;
        }
        Ok(ok)
    }

    /// Switches structured KV cache events on or off, in the pool and in the connector
    /// ([`SchedulerConnector::set_cache_events`]): vLLM's `enable_kv_cache_events`, one switch
    /// for both. Off by default; while off nothing is built or kept, and the scheduler is equal
    /// to one that never had the switch. Switching off drops the events not yet taken.
    pub fn set_cache_events(&mut self, on: bool) {
        self.state.pool.set_events(on);
        if !on {
            self.state.cache_events = Vec::new();
        }
        self.connector.set_cache_events(on);
        crate::debug_assert_invariants!(self, stopped: self.broken().is_some());
    }

    /// The KV cache events since the last call, in vLLM's publication order: per
    /// `update_from_output`, the pool's events (vLLM's `kv_cache_manager.take_events()`) then
    /// the connector's ([`SchedulerConnector::take_cache_events`]); then the pool's events since
    /// the last `update_from_output`. Call after each `update_from_output` to publish what vLLM
    /// publishes that step; between calls the events accumulate (as vLLM's queue does between
    /// its per-step drains). Empty while events are off.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        let mut out = core::mem::take(&mut self.state.cache_events);
        out.extend(self.state.pool.take_events());
        out
    }

    /// The status of a request the scheduler holds.
    pub fn status(&self, id: RequestId) -> Option<RequestStatus> {
        self.state.requests.get(&id).map(|r| r.status)
    }

    /// Ids of every request the scheduler holds, in id order.
    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.state.requests.keys()
    }

    fn check_broken(&self) -> Result<(), SchedulerError> {
        match &self.state.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: SchedulerError) -> SchedulerError {
        self.state.broken = Some(e.clone());
        e
    }

    /// Apply the intents of the connector's last call.
    fn apply_intents(&mut self) -> Result<(), SchedulerError> {
        if let Some(why) = self.connector.take_error() {
            return Err(self.fail(SchedulerError::ConnectorContract(why)));
        }
        for intent in self.connector.take_intents() {
            let st = &mut self.state;
            let why = match &intent {
                Intent::Pin(blocks) => blocks.iter().find_map(|&b| {
                    if !st.pool.contains(b) || b == NULL_BLOCK {
                        Some(format!("block {} is not a pool block", b.0))
                    } else if st.pool.ref_cnt(b) == 0 && st.pool.cached_hash(b).is_none() {
                        Some(format!("block {} is free and holds no cached KV", b.0))
                    } else {
                        None
                    }
                }),
                Intent::Unpin(blocks) => {
                    let mut need: BTreeMap<BlockId, u32> = BTreeMap::new();
                    for &b in blocks {
                        *need.entry(b).or_default() += 1;
                    }
                    need.iter().find_map(|(b, n)| {
                        (st.pins.get(b).copied().unwrap_or(0) < *n)
                            .then(|| format!("block {} is not pinned", b.0))
                    })
                }
            };
            if let Some(why) = why {
                return Err(self.fail(SchedulerError::IntentRejected { intent, why }));
            }
            match intent {
                Intent::Pin(blocks) => {
                    for b in blocks {
                        *st.pins.entry(b).or_default() += 1;
                        st.pool.touch([b]);
                    }
                }
                Intent::Unpin(blocks) => {
                    for b in blocks {
                        let n = st.pins.get_mut(&b).expect("validated above");
                        *n -= 1;
                        if *n == 0 {
                            st.pins.remove(&b);
                        }
                        st.pool.free_blocks([b]);
                    }
                }
            }
        }
        Ok(())
    }
}
