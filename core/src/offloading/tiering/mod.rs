//! Tiered offloading (vLLM 0.33.0's `TieringOffloadingManager`; SEMANTICS.md §5.9, I-49 to I-52):
//! the CPU manager as the primary tier, with secondary tiers (a shared store, such as a Redis
//! Cluster) behind it.
//!
//! Every chunk stored in the primary tier is cascaded to every secondary tier (a store job that
//! pins the primary chunks until it ends). A lookup that misses the primary tier asks the
//! secondary tiers: a hit there reserves a primary chunk and promotes the key into it (a load
//! job, one per tier and request, handed out at the end of the step); the lookup answers
//! `HitPending` until the promotion ends, and `Retry` while a tier's existence probe is in
//! flight. The GPU only ever reads the primary tier.
//!
//! Sans-IO: after each step the runtime takes the tiers' work
//! ([`TieringManager::take_tier_work`]: probes, stores, loads) and hands back what happened
//! ([`TieringManager::report`]); a failure is a value, never a panic. Reports are applied where
//! vLLM polls its tiers: the step's first lookup, every `prepare_store`, and
//! `on_schedule_end`.
//!
//! # When the connector calls what
//!
//! As the CPU manager's table in `offloading/manager`, plus: `on_new_request` from the
//! scheduler's `add_request`, [`TieringManager::lookup`] per chunk (it may start a promotion),
//! [`TieringManager::on_schedule_end`] as the last call of `build_connector_meta`, and
//! [`TieringManager::on_reset_flushed`] when the reset fence drains.
//!
//! # Strict mode
//!
//! vLLM waits for ever on a probe or a promotion that never reports (vLLM #49829). With
//! [`TieringConfig::deadline_steps`] set, an overdue probe is a miss and an overdue promotion's
//! key looks missing, so its request recomputes; the promotion's primary chunk stays reserved
//! until the runtime reports the job, so a late write never lands in a reused chunk. And a
//! promotion that lands ranks its chunks most recent ([`TieringConfig::promoted_most_recent`]):
//! under vLLM's ranks, an old request's promotions evict each other for ever. And a promoted
//! chunk stays pinned for its request until it loads it or finishes
//! ([`TieringConfig::hold_promoted`]): when promotions want more chunks than the primary tier
//! holds, they then miss instead of evicting each other for ever.
//!
//! # Layout
//!
//! | file | what |
//! | --- | --- |
//! | `types.rs` | ids, [`LookupResult`], [`TieringConfig`], [`TierWork`], [`TierReport`], [`TieringStats`], [`TieringError`] |
//! | `tier.rs` | one secondary tier as vLLM's object-store tier runs it: cached existence probes, jobs in flight |
//! | `mod.rs` | the manager: cascades, promotions, polling, per-request finalisation, reset |
//! | `invariants.rs` | `check_invariants()` (I-49 to I-52) |
//! | `tests.rs` | unit tests |

mod invariants;
mod tier;
mod types;

#[cfg(test)]
mod tests;

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use self::tier::{JobResult, Tier};
use super::{
    Access, ChunkId, CpuOffloadingManager, KeyLookup, ManagerConfig, OffloadEvent, OffloadKey,
    PrepareStoreOutput,
};
use crate::RequestId;

pub use self::types::{
    LookupResult, TierId, TierJobId, TierReport, TierWork, TieringConfig, TieringError,
    TieringStats,
};

/// A job between the primary tier and a secondary tier (`TransferJob` + `tier_idx`).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Job {
    tier: TierId,
    keys: Vec<OffloadKey>,
    /// A promotion (tier → primary) or a cascade (primary → tier).
    promotion: bool,
    /// Strict: steps ended since it was handed to the runtime (saturating past the deadline;
    /// compat: always 0, so a spinning engine's state does not change).
    age: u32,
    /// Strict: a promotion past its deadline (its keys are in `overdue`).
    expired: bool,
    /// A promotion's request (`None`: a cascade).
    request: Option<RequestId>,
}

/// `RequestState` (object-store tiers never ask for request-level stores, so no parked keys).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
struct RequestState {
    pending_primary_stores: u32,
    finished: bool,
}

/// `PendingPromotion`: keys of one (tier, request) waiting for the end of the step.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
struct Promotion {
    keys: Vec<OffloadKey>,
    chunks: Vec<ChunkId>,
}

/// vLLM's `TieringOffloadingManager` over the CPU manager. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct TieringManager {
    config: TieringConfig,
    primary: CpuOffloadingManager,
    tiers: Vec<Tier>,
    job_counter: u64,
    /// Jobs handed to the runtime and not yet polled back (`_jobs`).
    jobs: BTreeMap<TierJobId, Job>,
    requests: BTreeMap<RequestId, RequestState>,
    /// `_pending_load_submissions`: by tier, then by request, in first-promotion order.
    promotions: Vec<(TierId, Vec<(RequestId, Promotion)>)>,
    /// `_processed_jobs_this_step`.
    polled_this_step: bool,
    /// `_promotions_held`: from a reset until its flush is acknowledged.
    promotions_held: bool,
    /// Strict: keys of promotions past their deadline (looked up as misses).
    overdue: BTreeSet<OffloadKey>,
    /// Strict ([`TieringConfig::hold_promoted`]): per request, the promoted keys pinned for it
    /// until it loads them or finishes.
    held: BTreeMap<RequestId, Vec<OffloadKey>>,
    /// Work for the runtime, taken every step (bounded by one step's lookups and stores).
    work: Vec<TierWork>,
    stats: TieringStats,
    /// A refusal of the primary tier inside the protocol (vLLM: an assertion); sticks.
    error: Option<TieringError>,
}

impl TieringManager {
    /// A manager with an empty primary tier and `config.tiers` secondary tiers.
    pub fn new(primary: ManagerConfig, config: TieringConfig) -> Result<Self, TieringError> {
        if config.tiers == 0 || config.tiers > TieringConfig::MAX_TIERS {
            return Err(TieringError::BadConfig("tiers must be 1 to 4"));
        }
        if config.deadline_steps == Some(0) {
            return Err(TieringError::BadConfig("deadline_steps must be at least 1"));
        }
        Ok(Self {
            config,
            primary: CpuOffloadingManager::new(primary).map_err(TieringError::Primary)?,
            tiers: (0..config.tiers).map(|t| Tier::new(TierId(t))).collect(),
            job_counter: 0,
            jobs: BTreeMap::new(),
            requests: BTreeMap::new(),
            promotions: Vec::new(),
            polled_this_step: false,
            promotions_held: false,
            overdue: BTreeSet::new(),
            held: BTreeMap::new(),
            work: Vec::new(),
            stats: TieringStats::default(),
            error: None,
        })
    }

    /// The primary tier (read-only).
    pub fn primary(&self) -> &CpuOffloadingManager {
        &self.primary
    }

    /// The configuration.
    pub fn config(&self) -> &TieringConfig {
        &self.config
    }

    /// The running figures.
    pub fn stats(&self) -> TieringStats {
        self.stats
    }

    /// The first refusal of the primary tier inside the protocol, if any (it sticks).
    pub fn error(&self) -> Option<&TieringError> {
        self.error.as_ref()
    }

    /// Whether `request` has per-request state (from `on_new_request` until finalised).
    pub fn knows(&self, request: RequestId) -> bool {
        self.requests.contains_key(&request)
    }

    /// Whether tier jobs are in flight (handed out, not reported): `reset` is refused until
    /// they are reported.
    pub fn jobs_in_flight(&self) -> bool {
        self.tiers.iter().any(|t| !t.in_flight.is_empty())
    }

    /// The same manager with a store-threshold tracker of `n` keys in its primary tier
    /// ([`CpuOffloadingManager::with_max_tracker_size`]). Call right after [`Self::new`].
    pub fn with_max_tracker_size(mut self, n: usize) -> Self {
        self.primary = self.primary.with_max_tracker_size(n);
        self
    }

    /// `on_new_request`: sets up the request's state. Object-store tiers store chunk by chunk
    /// (`CHUNK_LEVEL`), so there is no policy to return.
    pub fn on_new_request(&mut self, request: RequestId) {
        self.requests.insert(request, RequestState::default());
    }

    /// `lookup`: the primary tier first, then each secondary tier; a secondary hit starts a
    /// promotion (`HitPending`), or is a `Miss` when the primary tier has no room.
    pub fn lookup(&mut self, key: OffloadKey, request: RequestId, position: u32) -> LookupResult {
        self.poll_once();
        match self.primary.lookup(key) {
            KeyLookup::Hit => return LookupResult::Hit,
            KeyLookup::HitPending if self.overdue.contains(&key) => return LookupResult::Miss,
            KeyLookup::HitPending => return LookupResult::HitPending,
            KeyLookup::Miss => {}
        }
        if self.promotions_held {
            return LookupResult::Miss;
        }
        let mut retry = false;
        for t in 0..self.tiers.len() {
            match self.tiers[t].lookup(key, request) {
                Some(true) if self.promote(t, key, request, position) => {
                    return LookupResult::HitPending;
                }
                Some(true) => return LookupResult::Miss,
                Some(false) => {}
                None => retry = true,
            }
        }
        if retry {
            LookupResult::Retry
        } else {
            LookupResult::Miss
        }
    }

    /// `_initiate_promotion`: reserve a primary chunk now (so later lookups see it pending) and
    /// queue the load for the end of the step. `false`: the primary tier is full.
    fn promote(&mut self, t: usize, key: OffloadKey, request: RequestId, position: u32) -> bool {
        let access = Access {
            request: Some(request),
            positions: Some(&[position]),
        };
        let Some(out) = self.primary.prepare_store(&[key], access) else {
            self.stats.promotion_allocation_failures += 1;
            return false;
        };
        let tier = TierId(t as u8);
        let i = match self.promotions.iter().position(|e| e.0 == tier) {
            Some(i) => i,
            None => {
                self.promotions.push((tier, Vec::new()));
                self.promotions.len() - 1
            }
        };
        let by_request = &mut self.promotions[i].1;
        let j = match by_request.iter().position(|e| e.0 == request) {
            Some(j) => j,
            None => {
                by_request.push((request, Promotion::default()));
                by_request.len() - 1
            }
        };
        let entry = &mut by_request[j].1;
        self.stats.promotions += out.keys_to_store.len() as u64;
        entry.keys.extend_from_slice(&out.keys_to_store);
        entry.chunks.extend_from_slice(&out.chunks);
        true
    }

    /// `prepare_store` (GPU → primary): polls finished jobs first, so that chunks they free are
    /// evictable for this store. Refuses a request without `on_new_request`.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Result<Option<PrepareStoreOutput>, TieringError> {
        let request = self.known(access.request)?;
        self.polled_this_step = true;
        self.poll();
        let out = self.primary.prepare_store(keys, access);
        if out.as_ref().is_some_and(|o| !o.keys_to_store.is_empty()) {
            self.requests
                .get_mut(&request)
                .expect("checked above")
                .pending_primary_stores += 1;
        }
        Ok(out)
    }

    /// `complete_store`: ends a GPU → primary store; a successful one is cascaded to every
    /// secondary tier (a store job per tier, its primary chunks pinned until it ends).
    pub fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        request: RequestId,
        success: bool,
    ) -> Result<(), TieringError> {
        let state = self
            .requests
            .get(&request)
            .ok_or(TieringError::UnknownRequest(Some(request)))?;
        if state.pending_primary_stores == 0 {
            return Err(TieringError::NoPendingStore(request));
        }
        self.primary.complete_store(keys, success);
        if success {
            for t in 0..self.tiers.len() {
                self.cascade(keys, TierId(t as u8));
            }
        }
        let state = self.requests.get_mut(&request).expect("checked above");
        state.pending_primary_stores -= 1;
        self.maybe_finalize(request);
        Ok(())
    }

    /// `create_store_job` + `submit_store`: pin the primary chunks and hand the copy out.
    fn cascade(&mut self, keys: &[OffloadKey], tier: TierId) {
        let chunks = match self.primary.prepare_load(keys, Access::default()) {
            Ok(chunks) => chunks,
            Err(e) => {
                self.error.get_or_insert(TieringError::Primary(e));
                return;
            }
        };
        let job = self.next_job();
        self.jobs.insert(
            job,
            Job {
                tier,
                keys: keys.to_vec(),
                promotion: false,
                age: 0,
                expired: false,
                request: None,
            },
        );
        self.tiers[tier.0 as usize].submit(job, None);
        self.work.push(TierWork::Store {
            tier,
            job,
            keys: keys.to_vec(),
            chunks,
        });
    }

    /// `prepare_load` (primary → GPU) of keys a lookup found `Hit`: pins them.
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Result<Vec<ChunkId>, TieringError> {
        let request = access.request;
        let chunks = self
            .primary
            .prepare_load(keys, access)
            .map_err(TieringError::Primary)?;
        if let Some(r) = request {
            self.release_held(r, |k| keys.contains(k));
        }
        Ok(chunks)
    }

    /// Unpins the keys held for `request` that `which` picks (its load pinned them itself, or
    /// it finished).
    fn release_held(&mut self, request: RequestId, which: impl Fn(&OffloadKey) -> bool) {
        let Some(held) = self.held.get_mut(&request) else {
            return;
        };
        let (release, keep): (Vec<OffloadKey>, Vec<OffloadKey>) =
            held.iter().partition(|k| which(k));
        if keep.is_empty() {
            self.held.remove(&request);
        } else {
            *held = keep;
        }
        self.unpin(&release);
    }

    /// `complete_load`: unpins what [`Self::prepare_load`] pinned.
    pub fn complete_load(&mut self, keys: &[OffloadKey]) -> Result<(), TieringError> {
        self.primary
            .complete_load(keys)
            .map_err(TieringError::Primary)
    }

    /// `touch`: recency in the primary tier (object-store tiers keep none).
    pub fn touch(&mut self, keys: &[OffloadKey], access: Access<'_>) {
        self.primary.touch(keys, access);
    }

    /// `on_request_finished`: commits the request's recency in the primary tier; its state is
    /// dropped (and the tiers forget its probes) once its last GPU → primary store ended.
    pub fn on_request_finished(&mut self, request: RequestId) -> Result<(), TieringError> {
        let state = self
            .requests
            .get_mut(&request)
            .ok_or(TieringError::UnknownRequest(Some(request)))?;
        state.finished = true;
        self.release_held(request, |_| true);
        self.primary.on_request_finished(request);
        self.maybe_finalize(request);
        Ok(())
    }

    /// `_maybe_finalize_request`.
    fn maybe_finalize(&mut self, request: RequestId) {
        let Some(state) = self.requests.get(&request) else {
            return;
        };
        if !state.finished || state.pending_primary_stores != 0 {
            return;
        }
        for tier in &mut self.tiers {
            tier.forget_request(request);
        }
        self.requests.remove(&request);
    }

    /// `on_schedule_end`, the last manager call of a step: poll finished jobs, hand out this
    /// step's promotions (one load job per tier and request) and probes; strict: give up what
    /// is past its deadline.
    pub fn on_schedule_end(&mut self) {
        self.poll_once();
        self.polled_this_step = false;
        self.flush_promotions();
        for tier in &mut self.tiers {
            tier.flush(&mut self.work);
        }
        if let Some(d) = self.config.deadline_steps {
            self.expire(d);
        }
    }

    /// `_flush_pending_promotions`.
    fn flush_promotions(&mut self) {
        for (tier, by_request) in core::mem::take(&mut self.promotions) {
            for (request, p) in by_request {
                let job = self.next_job();
                self.jobs.insert(
                    job,
                    Job {
                        tier,
                        keys: p.keys.clone(),
                        promotion: true,
                        age: 0,
                        expired: false,
                        request: Some(request),
                    },
                );
                self.tiers[tier.0 as usize].submit(job, Some(p.keys.clone()));
                self.work.push(TierWork::Load {
                    tier,
                    request,
                    job,
                    keys: p.keys,
                    chunks: p.chunks,
                });
            }
        }
    }

    /// Strict, at the end of every step: probes and promotions in flight grow one step older,
    /// and those handed out `d` steps ago (counting the step that handed them out) are given
    /// up. Ages, not an absolute clock: the state of a manager waiting on nothing does not
    /// change from step to step (what lets the model checker see an idle engine as idle).
    fn expire(&mut self, d: u32) {
        for tier in &mut self.tiers {
            self.stats.probes_expired += tier.age_probes(d);
        }
        for job in self.jobs.values_mut() {
            if !job.promotion || job.expired {
                continue;
            }
            job.age = job.age.saturating_add(1);
            if job.age > d {
                job.expired = true;
                self.stats.promotions_expired += 1;
                self.overdue.extend(job.keys.iter().copied());
            }
        }
    }

    /// `has_pending_work`: tier jobs handed out and not yet polled back.
    pub fn has_pending_work(&self) -> bool {
        !self.jobs.is_empty()
    }

    /// The primary tier's events since the last call.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        self.primary.take_events()
    }

    /// `reset_cache`: the primary tier forgets everything (secondary tiers keep their data);
    /// promotions are held until [`Self::on_reset_flushed`]. Every tier job must have been
    /// reported first (vLLM blocks in `drain_jobs`): [`TieringError::JobsInFlight`] otherwise.
    pub fn reset(&mut self) -> Result<(), TieringError> {
        let in_flight: usize = self.tiers.iter().map(|t| t.in_flight.len()).sum();
        if in_flight > 0 {
            return Err(TieringError::JobsInFlight(in_flight));
        }
        self.poll();
        self.promotions.clear();
        for request in self.held.keys().copied().collect::<Vec<_>>() {
            self.release_held(request, |_| true);
        }
        let finished: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, s)| s.finished)
            .map(|(r, _)| *r)
            .collect();
        for state in self.requests.values_mut() {
            state.pending_primary_stores = 0;
        }
        for request in finished {
            for tier in &mut self.tiers {
                tier.forget_request(request);
            }
            self.requests.remove(&request);
        }
        self.primary.reset();
        self.overdue.clear();
        self.polled_this_step = false;
        self.promotions_held = true;
        Ok(())
    }

    /// `on_reset_flushed`: every job in flight at the reset was acknowledged; promotions resume.
    pub fn on_reset_flushed(&mut self) {
        self.promotions_held = false;
    }

    /// The work handed out since the last call, in order.
    pub fn take_tier_work(&mut self) -> Vec<TierWork> {
        core::mem::take(&mut self.work)
    }

    /// A report from the runtime, validated (a tier, probe or job the manager did not hand out
    /// is refused and changes nothing). It takes effect at the next poll.
    pub fn report(&mut self, report: TierReport) -> Result<(), TieringError> {
        match report {
            TierReport::Probed {
                tier,
                key,
                generation,
                found,
            } => self.tier_mut(tier)?.answer(key, generation, found),
            TierReport::Finished {
                tier,
                job,
                success,
                successful_keys,
            } => {
                if let (Some(ok), Some(j)) = (&successful_keys, self.jobs.get(&job))
                    && ok.iter().any(|k| !j.keys.contains(k))
                {
                    return Err(TieringError::ForeignKeys(job.0));
                }
                self.tier_mut(tier)?.finish(JobResult {
                    job,
                    success,
                    successful_keys,
                })
            }
        }
    }

    fn tier_mut(&mut self, tier: TierId) -> Result<&mut Tier, TieringError> {
        self.tiers
            .get_mut(tier.0 as usize)
            .ok_or(TieringError::UnknownTier(tier.0))
    }

    fn known(&self, request: Option<RequestId>) -> Result<RequestId, TieringError> {
        match request {
            Some(r) if self.requests.contains_key(&r) => Ok(r),
            Some(r) => Err(TieringError::UnknownRequest(Some(r))),
            None => Err(TieringError::UnknownRequest(None)),
        }
    }

    fn next_job(&mut self) -> TierJobId {
        let job = TierJobId(self.job_counter);
        self.job_counter += 1;
        job
    }

    /// `_maybe_process_finished_jobs`: at most once per step.
    fn poll_once(&mut self) {
        if !self.polled_this_step {
            self.polled_this_step = true;
            self.poll();
        }
    }

    /// `_process_finished_jobs`: a finished cascade unpins its primary chunks; a finished
    /// promotion makes its loaded keys readable and frees the chunks of the rest.
    fn poll(&mut self) {
        for t in 0..self.tiers.len() {
            for result in self.tiers[t].take_finished() {
                let Some(job) = self.jobs.remove(&result.job) else {
                    self.error
                        .get_or_insert(TieringError::UnknownJob(result.job.0, t as u8));
                    continue;
                };
                if job.promotion {
                    self.complete_promotion(&job, &result);
                } else if !result.success {
                    self.stats.cascade_failures += 1;
                    self.unpin(&job.keys);
                } else {
                    self.stats.keys_cascaded += job.keys.len() as u64;
                    self.unpin(&job.keys);
                }
            }
        }
    }

    fn unpin(&mut self, keys: &[OffloadKey]) {
        if let Err(e) = self.primary.complete_load(keys) {
            self.error.get_or_insert(TieringError::Primary(e));
        }
    }

    /// `_complete_promotion`.
    fn complete_promotion(&mut self, job: &Job, result: &JobResult) {
        let (ok, failed): (Vec<OffloadKey>, Vec<OffloadKey>) = if result.success {
            (job.keys.clone(), Vec::new())
        } else {
            let ok = result.successful_keys.clone().unwrap_or_default();
            let failed = job.keys.iter().filter(|k| !ok.contains(k)).copied();
            (ok.clone(), failed.collect())
        };
        for k in &job.keys {
            self.overdue.remove(k);
        }
        self.stats.keys_promoted += ok.len() as u64;
        self.stats.promotion_failures += failed.len() as u64;
        self.primary.complete_store(&ok, true);
        self.primary.complete_store(&failed, false);
        if self.config.promoted_most_recent {
            self.primary.touch(&ok, Access::default());
        }
        self.hold(job.request, ok);
    }

    /// Strict: pins `keys`, just promoted, for `request` while it is live.
    fn hold(&mut self, request: Option<RequestId>, keys: Vec<OffloadKey>) {
        let Some(r) = request.filter(|r| self.requests.get(r).is_some_and(|s| !s.finished)) else {
            return;
        };
        if !self.config.hold_promoted || keys.is_empty() {
            return;
        }
        match self.primary.prepare_load(&keys, Access::default()) {
            Ok(_) => self.held.entry(r).or_default().extend(keys),
            Err(e) => {
                self.error.get_or_insert(TieringError::Primary(e));
            }
        }
    }
}
