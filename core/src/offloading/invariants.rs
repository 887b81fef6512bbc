//! The connector's invariants (I-38…I-46) and its manager's (I-40).

use crate::{InvariantViolation, ensure_invariant};

use super::OffloadingConnector;
use alloc::format;

impl OffloadingConnector {
    /// Checks I-38…I-46 (connector side) and the manager's own invariants (I-40).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.manager.check_invariants()?;
        for (&id, j) in &self.jobs {
            ensure_invariant!(
                id.0 >= self.stale_job_threshold && id.0 < self.job_counter,
                "I-38",
                "job {id:?} outside [{}, {})",
                self.stale_job_threshold,
                self.job_counter
            );
            ensure_invariant!(
                j.pending >= 1 && j.pending <= self.config.num_workers,
                "I-38",
                "job {id:?} has pending count {}",
                j.pending
            );
            ensure_invariant!(
                self.requests
                    .get(&j.request)
                    .is_some_and(|r| r.jobs.contains(&id)),
                "I-39",
                "job {id:?} not listed by its request {:?}",
                j.request
            );
        }
        for &id in self.reset_fence.keys() {
            ensure_invariant!(
                id.0 < self.stale_job_threshold,
                "I-45",
                "reset-fenced job {id:?} is not stale"
            );
        }
        let mut listed = 0;
        for (&rid, r) in &self.requests {
            listed += r.jobs.len();
            let mut async_loads = 0;
            for id in &r.jobs {
                let Some(j) = self.jobs.get(id) else {
                    return Err(InvariantViolation::new(
                        "I-39",
                        format!("{rid:?} lists unknown job {id:?}"),
                    ));
                };
                ensure_invariant!(
                    j.request == rid,
                    "I-39",
                    "{rid:?} lists job {id:?} of {:?}",
                    j.request
                );
                async_loads += usize::from(!j.is_store && !j.is_sync_load);
            }
            ensure_invariant!(
                async_loads == 0 || r.jobs.len() == 1,
                "I-39",
                "{rid:?} has an async load next to other jobs"
            );
            let loads = r.jobs.iter().filter(|id| !self.jobs[id].is_store).count();
            ensure_invariant!(loads <= 1, "I-39", "{rid:?} has {loads} load jobs");
            ensure_invariant!(
                !r.finished_signaled || !r.jobs.is_empty(),
                "I-48",
                "{rid:?} finished and idle but still tracked"
            );
        }
        // I-44: `on_request_finished` comes after the request's last `prepare_store` and is
        // the last call about it: no scope stays open for a request already signalled finished,
        // or for one the connector no longer tracks (it would never be closed).
        for rid in self.manager.primary().scoped_requests() {
            let open = self
                .requests
                .get(&rid)
                .is_some_and(|r| !r.finished_signaled);
            ensure_invariant!(
                open,
                "I-44",
                "the manager keeps an access scope for {rid:?}, already finished or untracked"
            );
        }
        // I-44, its order: a request waits in `finish_order` from `request_finished` until a
        // step hands its id over, once, tracked and not yet signalled finished.
        for (i, rid) in self.finish_order.iter().enumerate() {
            ensure_invariant!(
                self.requests.get(rid).is_some_and(|r| !r.finished_signaled),
                "I-44",
                "{rid:?} waits to be signalled finished, but is untracked or signalled already"
            );
            ensure_invariant!(
                !self.finish_order[..i].contains(rid),
                "I-44",
                "{rid:?} waits twice to be signalled finished"
            );
        }
        ensure_invariant!(
            listed == self.jobs.len(),
            "I-39",
            "requests list {listed} jobs, {} in flight",
            self.jobs.len()
        );
        for (b, set) in &self.block_to_jobs {
            ensure_invariant!(!set.is_empty(), "I-41", "block {} has an empty fence", b.0);
            for id in set {
                let Some(j) = self.jobs.get(id) else {
                    return Err(InvariantViolation::new(
                        "I-41",
                        format!("block {} fenced by finished job {id:?}", b.0),
                    ));
                };
                let finished = self.requests[&j.request].finished.is_some();
                ensure_invariant!(
                    j.fenced.contains(b) || (finished && j.deferred_fence.contains(b)),
                    "I-41",
                    "block {} fenced by job {id:?} that does not read it",
                    b.0
                );
            }
        }
        for (id, j) in &self.jobs {
            let finished = self.requests[&j.request].finished.is_some();
            let watched = j
                .fenced
                .iter()
                .chain(j.deferred_fence.iter().filter(|_| finished));
            for b in watched {
                ensure_invariant!(
                    self.block_to_jobs.get(b).is_some_and(|s| s.contains(id)),
                    "I-41",
                    "job {id:?} reads block {} that is not fenced",
                    b.0
                );
            }
        }
        if let Some(loading) = &self.chunks_being_loaded {
            for k in loading {
                ensure_invariant!(
                    self.jobs
                        .values()
                        .any(|j| !j.is_store && !j.is_sync_load && j.keys.contains(k)),
                    "I-43",
                    "key {k:?} marked as being loaded without an async load"
                );
            }
        }
        Ok(())
    }
}
