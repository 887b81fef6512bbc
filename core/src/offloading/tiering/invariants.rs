//! `check_invariants()` (I-49 to I-52): jobs agree with the tiers that hold them, the primary
//! chunks they use are pinned or reserved, probe bookkeeping agrees with itself, and finished
//! requests do not linger.

use alloc::collections::BTreeMap;

use super::TieringManager;
use super::tier::Phase;
use crate::{InvariantViolation, ensure_invariant};

impl TieringManager {
    /// I-49 to I-52 and the primary tier's I-40; a sticky protocol error is reported as I-50.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.primary.check_invariants()?;
        ensure_invariant!(
            self.error.is_none(),
            "I-50",
            "primary tier refused: {:?}",
            self.error
        );
        self.check_jobs()?;
        self.check_pins()?;
        self.check_probes()?;
        self.check_requests()
    }

    /// I-49: every job is held by its tier (in flight or reported and not yet polled), and
    /// every job a tier holds is the manager's, of the same kind.
    fn check_jobs(&self) -> Result<(), InvariantViolation> {
        let held: usize = self.tiers.iter().map(|t| t.jobs_outstanding()).sum();
        ensure_invariant!(
            held == self.jobs.len(),
            "I-49",
            "tiers hold {held} jobs, the manager {}",
            self.jobs.len()
        );
        for tier in &self.tiers {
            for (id, keys) in &tier.in_flight {
                let job = self.jobs.get(id);
                ensure_invariant!(
                    job.is_some_and(|j| j.tier == tier.id && j.promotion == keys.is_some()),
                    "I-49",
                    "job {id:?} in flight at tier {:?} is not the manager's",
                    tier.id
                );
            }
        }
        Ok(())
    }

    /// I-50: a cascade pins each primary chunk it reads, and so does a hold (a key's pins ≥ its
    /// cascades and holds); a promotion's keys, handed out or queued, are write-pending and
    /// promoted once.
    fn check_pins(&self) -> Result<(), InvariantViolation> {
        let mut cascades: BTreeMap<_, i32> = BTreeMap::new();
        let mut promoting = BTreeMap::new();
        let queued = self
            .promotions
            .iter()
            .flat_map(|(_, r)| r.iter().flat_map(|(_, p)| &p.keys));
        let handed = self.jobs.values().filter(|j| j.promotion);
        for key in queued.chain(handed.flat_map(|j| &j.keys)) {
            ensure_invariant!(
                promoting.insert(*key, ()).is_none(),
                "I-50",
                "key {key:?} promoted twice"
            );
            ensure_invariant!(
                self.primary.ref_count(*key) == Some(-1),
                "I-50",
                "promoted key {key:?} is not write-pending in the primary tier"
            );
        }
        for job in self.jobs.values().filter(|j| !j.promotion) {
            for key in &job.keys {
                *cascades.entry(*key).or_default() += 1;
            }
        }
        for key in self.held.values().flatten() {
            *cascades.entry(*key).or_default() += 1;
        }
        for (key, n) in cascades {
            let pins = self.primary.ref_count(key).unwrap_or(0);
            ensure_invariant!(
                pins >= n,
                "I-50",
                "key {key:?}: {n} cascades and holds, {pins} pins"
            );
        }
        Ok(())
    }

    /// I-51: a probe and the requests that asked for it name each other; a verdict exactly
    /// when resolved.
    fn check_probes(&self) -> Result<(), InvariantViolation> {
        for tier in &self.tiers {
            for (key, p) in &tier.probes {
                ensure_invariant!(
                    (p.phase == Phase::Resolved) == p.found.is_some(),
                    "I-51",
                    "probe of {key:?} at tier {:?}: phase {:?} with verdict {:?}",
                    tier.id,
                    p.phase,
                    p.found
                );
                for r in &p.requests {
                    ensure_invariant!(
                        tier.request_keys.get(r).is_some_and(|k| k.contains(key)),
                        "I-51",
                        "probe of {key:?} names {r:?}, which does not name it"
                    );
                }
            }
            for (r, keys) in &tier.request_keys {
                for key in keys {
                    ensure_invariant!(
                        tier.probes.get(key).is_some_and(|p| p.requests.contains(r)),
                        "I-51",
                        "{r:?} names the probe of {key:?}, which does not name it"
                    );
                }
            }
        }
        Ok(())
    }

    /// I-52: a finished request with no store in flight is finalised, and holds nothing;
    /// overdue keys belong to expired promotions, and only in strict mode.
    fn check_requests(&self) -> Result<(), InvariantViolation> {
        for (r, s) in &self.requests {
            ensure_invariant!(
                !s.finished || s.pending_primary_stores > 0,
                "I-52",
                "{r:?} finished with no store in flight but was not finalised"
            );
        }
        for r in self.held.keys() {
            ensure_invariant!(
                self.config.hold_promoted && self.requests.get(r).is_some_and(|s| !s.finished),
                "I-52",
                "promoted chunks held for {r:?}, finished or unknown (or holds off)"
            );
        }
        ensure_invariant!(
            self.config.deadline_steps.is_some() || self.overdue.is_empty(),
            "I-52",
            "overdue promotions without a deadline"
        );
        for key in &self.overdue {
            let owned = self
                .jobs
                .values()
                .any(|j| j.promotion && j.expired && j.keys.contains(key));
            ensure_invariant!(
                owned,
                "I-52",
                "overdue key {key:?} has no expired promotion"
            );
        }
        Ok(())
    }
}
