//! The scheduler's invariants (I-14…I-20, I-33…I-37) and its pool's.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use super::SchedulerConnector;
use super::{RequestStatus, Scheduler, State};
use crate::ids::{BlockId, NULL_BLOCK, RequestId};

impl<C: SchedulerConnector> Scheduler<C> {
    /// I-14…I-20, the pool's own invariants and the connector's. Call after every transition in
    /// tests (debug builds check them after every public transition).
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        use crate::ensure_invariant;
        let st = &self.state;
        st.check_pool()?;
        self.connector.check_invariants()?;
        // Owners per block: requests' tables plus connector pins must equal the ref counts
        // (I-20: a block is shared only through the prefix cache, i.e. as a counted owner).
        // A shared block is a prefix-cache hit, so every table holds it in the same group at
        // the same position (the position its hash chains to): a block in two groups, or twice
        // in one request, is owned twice by mistake even when the counts agree (the oracle
        // issue's two-group hit adoption, vLLM issue #33775).
        let mut owners: BTreeMap<BlockId, u32> = BTreeMap::new();
        let mut slot: BTreeMap<BlockId, (usize, usize)> = BTreeMap::new();
        for r in st.requests.values() {
            for (g, table) in r.blocks.iter().enumerate() {
                for (i, &b) in table.iter().enumerate() {
                    if b == NULL_BLOCK {
                        continue;
                    }
                    *owners.entry(b).or_default() += 1;
                    let first = *slot.entry(b).or_insert((g, i));
                    ensure_invariant!(
                        first == (g, i),
                        "I-20",
                        "block {} is in group {} at position {} and in group {g} at position {i} \
                         (request {:?})",
                        b.0,
                        first.0,
                        first.1,
                        r.id
                    );
                }
            }
            // I-14/I-15: a finished request is held only for the connector.
            if r.status.is_finished() {
                ensure_invariant!(
                    r.held_for_send || r.held_for_recv,
                    "I-14",
                    "finished request {:?} still held without a pending transfer",
                    r.id
                );
            } else {
                ensure_invariant!(
                    !r.held_for_send && !r.held_for_recv,
                    "I-15",
                    "live request {:?} marked as held for the connector",
                    r.id
                );
            }
            // I-17/I-18: loading requests hold their blocks and are not yet cached beyond the
            // local hit.
            if r.status == RequestStatus::WaitingForRemoteKvs {
                ensure_invariant!(
                    st.kv_holding_waiting.contains(&r.id),
                    "I-18",
                    "loading request {:?} not in kv_holding_waiting",
                    r.id
                );
            }
            if matches!(r.status, RequestStatus::Preempted) {
                ensure_invariant!(
                    r.blocks.iter().all(Vec::is_empty) || r.num_computed_tokens > 0,
                    "I-20",
                    "preempted request {:?} holds blocks",
                    r.id
                );
            }
        }
        for (&b, &n) in &st.pins {
            *owners.entry(b).or_default() += n;
        }
        for b in 1..st.pool.num_blocks() {
            let b = BlockId(u64::from(b));
            let want = owners.get(&b).copied().unwrap_or(0);
            ensure_invariant!(
                st.pool.ref_cnt(b) == want,
                "I-20",
                "block {} has ref count {} but {} owners",
                b.0,
                st.pool.ref_cnt(b),
                want
            );
        }
        // Queues: every live request is in exactly one queue; finished ones in none.
        let mut queued: BTreeMap<RequestId, u32> = BTreeMap::new();
        for id in st
            .running
            .iter()
            .chain(st.waiting.iter())
            .chain(st.kv_holding_waiting.iter())
        {
            *queued.entry(*id).or_default() += 1;
        }
        for r in st.requests.values() {
            let n = queued.get(&r.id).copied().unwrap_or(0);
            let want = u32::from(!r.status.is_finished());
            ensure_invariant!(
                n == want,
                "I-16",
                "request {:?} ({:?}) is queued {n} times",
                r.id,
                r.status
            );
            if r.status == RequestStatus::Running {
                ensure_invariant!(
                    st.running.contains(&r.id),
                    "I-16",
                    "running request {:?} not in the running queue",
                    r.id
                );
            }
        }
        ensure_invariant!(
            queued.keys().all(|id| st.requests.contains_key(id)),
            "I-16",
            "a queue names a request the scheduler does not hold"
        );
        ensure_invariant!(
            st.running.len() as u32 <= st.config.max_num_seqs,
            "I-20",
            "{} running requests exceed max_num_seqs",
            st.running.len()
        );
        ensure_invariant!(
            st.in_flight.len() as u32 <= st.config.async_depth,
            "I-12",
            "{} steps in flight exceed the depth {}",
            st.in_flight.len(),
            st.config.async_depth
        );
        for id in st.finished_recving_kv_req_ids.iter() {
            ensure_invariant!(
                st.requests
                    .get(id)
                    .is_some_and(|r| r.status == RequestStatus::WaitingForRemoteKvs),
                "I-18",
                "{id:?} marked as loaded but not waiting for remote KV"
            );
        }
        Ok(())
    }
}

impl State {
    /// The pool's invariants, and §2.7 step 8: with events off nothing is kept (the state
    /// equals one without the switch).
    fn check_pool(&self) -> Result<(), crate::InvariantViolation> {
        self.pool.check_invariants()?;
        let kept = self.cache_events.len();
        crate::ensure_invariant!(
            kept == 0 || self.pool.events_enabled(),
            "§2.7",
            "{kept} published KV cache events kept with events off"
        );
        Ok(())
    }
}
