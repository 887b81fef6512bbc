//! One secondary tier as vLLM's object-store tier runs it (`tiering/obj/manager.py`): existence
//! probes through an `AsyncLookupManager` (`tiering/async_lookup.py`), stores and loads as jobs.
//! Sans-IO: where vLLM's tier starts a transfer or queues a probe for its worker thread, this
//! one writes [`TierWork`]; what vLLM's worker or transfer poll returns arrives as reports.
//!
//! A probe's answer is cached per key while some request refers to it (one probe serves every
//! request that asks meanwhile); a failed promotion marks its keys missing so that the request
//! stops re-issuing a doomed promotion (vLLM #49176). Answers are applied at the tier's drain
//! points, as vLLM drains its result queue: the first lookup after a flush, and the flush.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use super::super::OffloadKey;
use super::types::{TierId, TierJobId, TierWork, TieringError};
use crate::RequestId;

/// `LookupPhase`.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub(super) enum Phase {
    /// In this step's batch, not yet handed to the runtime.
    Pending,
    /// Handed to the runtime `age` step ends ago (strict; compat: always 0), unanswered.
    InFlight { age: u32 },
    /// A verdict is cached.
    Resolved,
}

/// `LookupState`: one key's probe.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub(super) struct Probe {
    pub(super) generation: u64,
    pub(super) phase: Phase,
    /// `None` until answered; `Some(false)` also after a failed load (`mark_miss`).
    pub(super) found: Option<bool>,
    /// Requests that asked for it.
    pub(super) requests: BTreeSet<RequestId>,
}

/// A job's result, reported and not yet polled (`JobResult`).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub(super) struct JobResult {
    pub(super) job: TierJobId,
    pub(super) success: bool,
    pub(super) successful_keys: Option<Vec<OffloadKey>>,
}

/// A secondary tier's state.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub(super) struct Tier {
    pub(super) id: TierId,
    /// `_lookup_state`.
    pub(super) probes: BTreeMap<OffloadKey, Probe>,
    /// `_req_keys`: the keys each request probed.
    pub(super) request_keys: BTreeMap<RequestId, BTreeSet<OffloadKey>>,
    next_generation: u64,
    /// `_lookup_batch`: this step's new probes, in lookup order.
    batch: Vec<(OffloadKey, u64)>,
    /// `_pending_results`: answers reported, not yet drained, by key and generation (each
    /// key's answer is applied on its own, so their order does not matter).
    answers: BTreeMap<(OffloadKey, u64), bool>,
    need_to_drain: bool,
    /// Jobs handed to the runtime and not reported; the keys of promotions (`_load_job_keys`).
    pub(super) in_flight: BTreeMap<TierJobId, Option<Vec<OffloadKey>>>,
    /// Results reported, not yet polled (`get_finished_jobs`).
    finished: Vec<(JobResult, Option<Vec<OffloadKey>>)>,
}

impl Tier {
    pub(super) fn new(id: TierId) -> Self {
        Self {
            id,
            probes: BTreeMap::new(),
            request_keys: BTreeMap::new(),
            next_generation: 0,
            batch: Vec::new(),
            answers: BTreeMap::new(),
            need_to_drain: false,
            in_flight: BTreeMap::new(),
            finished: Vec::new(),
        }
    }

    /// `lookup`: `Some(found)` when a verdict is cached, `None` = retry (a probe is queued or in
    /// flight).
    pub(super) fn lookup(&mut self, key: OffloadKey, request: RequestId) -> Option<bool> {
        if self.need_to_drain {
            self.drain_answers();
            self.need_to_drain = false;
        }
        let next = &mut self.next_generation;
        let batch = &mut self.batch;
        let probe = self.probes.entry(key).or_insert_with(|| {
            let generation = *next;
            *next += 1;
            batch.push((key, generation));
            Probe {
                generation,
                phase: Phase::Pending,
                found: None,
                requests: BTreeSet::new(),
            }
        });
        probe.requests.insert(request);
        self.request_keys.entry(request).or_default().insert(key);
        probe.found
    }

    /// `flush` (once per step, from `on_schedule_end`): drain answers, then hand this step's
    /// batch to the runtime.
    pub(super) fn flush(&mut self, work: &mut Vec<TierWork>) {
        self.drain_answers();
        self.need_to_drain = true;
        let mut keys = Vec::new();
        for (key, generation) in core::mem::take(&mut self.batch) {
            let Some(p) = self.probes.get_mut(&key) else {
                continue;
            };
            if p.generation != generation {
                continue;
            }
            p.phase = Phase::InFlight { age: 0 };
            keys.push((key, generation));
        }
        if !keys.is_empty() {
            work.push(TierWork::Probe {
                tier: self.id,
                keys,
            });
        }
    }

    /// A probe's answer arrives (validated: the probe must be in flight and unanswered).
    pub(super) fn answer(
        &mut self,
        key: OffloadKey,
        generation: u64,
        found: bool,
    ) -> Result<(), TieringError> {
        let queued = self.answers.contains_key(&(key, generation));
        let live = self.probes.get(&key).is_some_and(|p| {
            p.generation == generation && matches!(p.phase, Phase::InFlight { .. })
        });
        // A stale generation (the probe was dropped and its key probed again) is accepted and
        // ignored at the drain, as in vLLM; only a generation never handed out is refused.
        if queued || (!live && generation >= self.next_generation) {
            return Err(TieringError::UnknownProbe(key, generation));
        }
        self.answers.insert((key, generation), found);
        Ok(())
    }

    /// `drain_results`.
    fn drain_answers(&mut self) {
        for ((key, generation), found) in core::mem::take(&mut self.answers) {
            let Some(p) = self.probes.get_mut(&key) else {
                continue;
            };
            if p.generation != generation || !matches!(p.phase, Phase::InFlight { .. }) {
                continue;
            }
            if p.requests.is_empty() {
                self.probes.remove(&key);
                continue;
            }
            p.found = Some(found);
            p.phase = Phase::Resolved;
        }
    }

    /// Strict, at a step's end: probes in flight grow one step older; those older than `d`
    /// steps are given up as misses. Returns how many.
    pub(super) fn age_probes(&mut self, d: u32) -> u64 {
        let mut expired = 0;
        let mut orphans = Vec::new();
        for (key, p) in &mut self.probes {
            let Phase::InFlight { age } = &mut p.phase else {
                continue;
            };
            *age = age.saturating_add(1);
            if *age > d {
                p.phase = Phase::Resolved;
                p.found = Some(false);
                expired += 1;
                if p.requests.is_empty() {
                    orphans.push(*key);
                }
            }
        }
        for key in orphans {
            self.probes.remove(&key);
        }
        expired
    }

    /// `mark_miss`: resolved verdicts of `keys` become misses.
    fn mark_miss(&mut self, keys: impl Iterator<Item = OffloadKey>) {
        for key in keys {
            if let Some(p) = self.probes.get_mut(&key)
                && p.phase == Phase::Resolved
            {
                p.found = Some(false);
            }
        }
    }

    /// `cleanup` (from `on_request_finished`): drop the request's references; a probe no
    /// request refers to is forgotten unless it is in flight.
    pub(super) fn forget_request(&mut self, request: RequestId) {
        for key in self.request_keys.remove(&request).unwrap_or_default() {
            let Some(p) = self.probes.get_mut(&key) else {
                continue;
            };
            p.requests.remove(&request);
            if p.requests.is_empty() && !matches!(p.phase, Phase::InFlight { .. }) {
                self.probes.remove(&key);
            }
        }
    }

    /// A job handed to the runtime (`submit_store` / `submit_load`).
    pub(super) fn submit(&mut self, job: TierJobId, promotion_keys: Option<Vec<OffloadKey>>) {
        self.in_flight.insert(job, promotion_keys);
    }

    /// A job's result arrives (validated: in flight at this tier).
    pub(super) fn finish(&mut self, result: JobResult) -> Result<(), TieringError> {
        let Some(keys) = self.in_flight.remove(&result.job) else {
            return Err(TieringError::UnknownJob(result.job.0, self.id.0));
        };
        self.finished.push((result, keys));
        Ok(())
    }

    /// `get_finished_jobs`: results since the last poll; a failed promotion marks the keys that
    /// did not load as missing.
    pub(super) fn take_finished(&mut self) -> Vec<JobResult> {
        let finished = core::mem::take(&mut self.finished);
        let mut out = Vec::with_capacity(finished.len());
        for (result, promotion_keys) in finished {
            if let Some(keys) = promotion_keys
                && !result.success
            {
                let ok: BTreeSet<OffloadKey> =
                    result.successful_keys.iter().flatten().copied().collect();
                self.mark_miss(keys.into_iter().filter(|k| !ok.contains(k)));
            }
            out.push(result);
        }
        out
    }

    /// Jobs handed out and not yet polled.
    pub(super) fn jobs_outstanding(&self) -> usize {
        self.in_flight.len() + self.finished.len()
    }
}
