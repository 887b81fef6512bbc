//! The manager the offloading connector drives (vLLM's `OffloadingManager` interface): the CPU
//! manager alone, or the tiering manager with the CPU manager as its primary tier
//! ([`OffloadingConfig::tiering`](super::OffloadingConfig::tiering)). The connector calls only
//! these methods, so both run through the same connector code.

use alloc::vec::Vec;

use super::{
    Access, ChunkId, CpuOffloadingManager, KeyLookup, LookupResult, OffloadEvent, OffloadKey,
    PrepareStoreOutput, TierReport, TierWork, TieringError, TieringManager,
};
use crate::{InvariantViolation, RequestId};

/// The CPU manager, or tiers over it.
// One per connector, never in a collection: the size of the larger variant costs nothing, and
// boxing it would add an indirection to every lookup.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum OffloadingManager {
    /// vLLM's `CPUOffloadingManager`.
    Cpu(CpuOffloadingManager),
    /// vLLM's `TieringOffloadingManager`.
    Tiering(TieringManager),
}

impl OffloadingManager {
    /// The CPU manager (the primary tier when tiered).
    pub fn primary(&self) -> &CpuOffloadingManager {
        match self {
            Self::Cpu(m) => m,
            Self::Tiering(t) => t.primary(),
        }
    }

    /// The tiering manager, when tiered.
    pub fn tiering(&self) -> Option<&TieringManager> {
        match self {
            Self::Cpu(_) => None,
            Self::Tiering(t) => Some(t),
        }
    }

    /// `lookup` of one key of `request`, whose chunk ends at token `position`.
    pub fn lookup(&mut self, key: OffloadKey, request: RequestId, position: u32) -> LookupResult {
        match self {
            Self::Cpu(m) => match m.lookup(key) {
                KeyLookup::Miss => LookupResult::Miss,
                KeyLookup::Hit => LookupResult::Hit,
                KeyLookup::HitPending => LookupResult::HitPending,
            },
            Self::Tiering(t) => t.lookup(key, request, position),
        }
    }

    /// `on_new_request`.
    pub fn on_new_request(&mut self, request: RequestId) {
        if let Self::Tiering(t) = self {
            t.on_new_request(request);
        }
    }

    /// `prepare_load`.
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Result<Vec<ChunkId>, TieringError> {
        match self {
            Self::Cpu(m) => m.prepare_load(keys, access).map_err(TieringError::Primary),
            Self::Tiering(t) => t.prepare_load(keys, access),
        }
    }

    /// `complete_load`.
    pub fn complete_load(&mut self, keys: &[OffloadKey]) -> Result<(), TieringError> {
        match self {
            Self::Cpu(m) => m.complete_load(keys).map_err(TieringError::Primary),
            Self::Tiering(t) => t.complete_load(keys),
        }
    }

    /// `prepare_store`.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        access: Access<'_>,
    ) -> Result<Option<PrepareStoreOutput>, TieringError> {
        match self {
            Self::Cpu(m) => Ok(m.prepare_store(keys, access)),
            Self::Tiering(t) => t.prepare_store(keys, access),
        }
    }

    /// `complete_store` of a store job of `request`.
    pub fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        request: RequestId,
        success: bool,
    ) -> Result<(), TieringError> {
        match self {
            Self::Cpu(m) => {
                m.complete_store(keys, success);
                Ok(())
            }
            Self::Tiering(t) => t.complete_store(keys, request, success),
        }
    }

    /// `on_request_finished` of a request the manager was told of with
    /// [`Self::on_new_request`], or of one it never saw (vLLM's untracked path:
    /// `on_new_request` then `on_request_finished`).
    pub fn on_request_finished(&mut self, request: RequestId) {
        match self {
            Self::Cpu(m) => m.on_request_finished(request),
            Self::Tiering(t) => {
                if !t.knows(request) {
                    t.on_new_request(request);
                }
                t.on_request_finished(request)
                    .expect("the request was made known above");
            }
        }
    }

    /// `on_schedule_end`, the last manager call of a step.
    pub fn on_schedule_end(&mut self) {
        if let Self::Tiering(t) = self {
            t.on_schedule_end();
        }
    }

    /// `has_pending_work`.
    pub fn has_pending_work(&self) -> bool {
        self.tiering().is_some_and(TieringManager::has_pending_work)
    }

    /// Whether `reset` would be refused now: tier jobs are in flight (vLLM blocks until they
    /// end; here the runtime reports them and asks again).
    pub fn reset_blocked(&self) -> bool {
        self.tiering().is_some_and(TieringManager::jobs_in_flight)
    }

    /// `reset_cache`. Call only when [`Self::reset_blocked`] is false.
    pub fn reset(&mut self) {
        match self {
            Self::Cpu(m) => m.reset(),
            Self::Tiering(t) => {
                if let Err(e) = t.reset() {
                    debug_assert!(false, "reset while blocked: {e}");
                }
            }
        }
    }

    /// `on_reset_flushed`.
    pub fn on_reset_flushed(&mut self) {
        if let Self::Tiering(t) = self {
            t.on_reset_flushed();
        }
    }

    /// The events since the last call (the primary tier's).
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        match self {
            Self::Cpu(m) => m.take_events(),
            Self::Tiering(t) => t.take_events(),
        }
    }

    /// The tiers' work since the last call (none without tiers).
    pub fn take_tier_work(&mut self) -> Vec<TierWork> {
        match self {
            Self::Cpu(_) => Vec::new(),
            Self::Tiering(t) => t.take_tier_work(),
        }
    }

    /// A tier's report ([`TieringManager::report`]); refused without tiers.
    pub fn report(&mut self, report: TierReport) -> Result<(), TieringError> {
        match self {
            Self::Cpu(_) => Err(TieringError::UnknownTier(match &report {
                TierReport::Probed { tier, .. } | TierReport::Finished { tier, .. } => tier.0,
            })),
            Self::Tiering(t) => t.report(report),
        }
    }

    /// I-40 (and I-49 to I-52 when tiered).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        match self {
            Self::Cpu(m) => m.check_invariants(),
            Self::Tiering(t) => t.check_invariants(),
        }
    }
}
