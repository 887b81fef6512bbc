//! The scheduler side of the P/D connector: lookups answered from a request's params, loads
//! handed to the workers, delayed frees held until the decode side acknowledges them (or, in
//! strict mode, until their lease runs out).

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use super::params::{PdParams, RemotePrefill};
use super::{PdConfig, PdCopy, PdMeta, PdStats, remote_slot};
use crate::ids::{BlockId, RequestId};
use crate::messages::{Meta, SchedulerOutput};
use crate::scheduler::{FinishDecision, Lookup, RequestStatus, SchedulerConnector, SchedulerView};
use crate::{InvariantViolation, ensure_invariant};

/// A finished request whose blocks wait for the decode side (prefill role).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Held {
    /// Its id reached the workers in a step's `finished_req_ids`: only then may they report it
    /// in `finished_sending` (I-16).
    announced: bool,
    /// The decode side acknowledged it; released with the next step.
    acked: bool,
    /// Strict: steps built since it was announced (its lease runs out at `lease_steps`).
    steps: u32,
    /// Its blocks, one list per KV-cache group: what the decode side reads
    /// ([`PdConnector::held_blocks`]).
    blocks: Vec<Vec<BlockId>>,
}

/// See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdConnector {
    config: PdConfig,
    /// Decode role: requests whose remote prefill was used (params are consumed once, as
    /// NIXL's are: a preempted request recomputes), until they finish.
    consumed: BTreeSet<RequestId>,
    /// Decode role: lookups answered with a remote hit, with the local hit passed in.
    hits: BTreeMap<RequestId, (u32, RemotePrefill)>,
    /// Loads admitted since the last step was built.
    loads: Vec<PdCopy>,
    /// Prefill role: delayed frees awaiting the decode side.
    held: BTreeMap<RequestId, Held>,
    stats: PdStats,
}

impl PdConnector {
    /// A connector in `config`'s roles.
    pub fn new(config: PdConfig) -> Self {
        Self {
            config,
            consumed: BTreeSet::new(),
            hits: BTreeMap::new(),
            loads: Vec::new(),
            held: BTreeMap::new(),
            stats: PdStats::default(),
        }
    }

    /// The decode side read `request`'s blocks and is done with them: they are released with
    /// the next step. `false` if nothing waits for it (a late or repeated acknowledgement,
    /// counted in [`PdStats::late_acks`]).
    pub fn acknowledge(&mut self, request: RequestId) -> bool {
        match self.held.get_mut(&request) {
            Some(h) if !h.acked => {
                h.acked = true;
                self.stats.acks += 1;
                true
            }
            _ => {
                self.stats.late_acks += 1;
                false
            }
        }
    }

    /// The blocks `request` holds for the decode side, one list per KV-cache group: block
    /// `index` of group `g` is what [`remote_slot`]`(request, index)` names. `None` once it is
    /// released (acknowledged or past its lease): a read then must fail, never touch the
    /// blocks, which the scheduler may already have given to another request.
    pub fn held_blocks(&self, request: RequestId) -> Option<&[Vec<BlockId>]> {
        self.held.get(&request).map(|h| h.blocks.as_slice())
    }

    /// Every held request (acknowledged or not, until its release is built) with its blocks,
    /// oldest id first: what a KV server may read.
    pub fn held(&self) -> impl Iterator<Item = (RequestId, &[Vec<BlockId>])> + '_ {
        self.held.iter().map(|(r, h)| (*r, h.blocks.as_slice()))
    }

    /// Requests whose blocks wait for the decode side's acknowledgement, oldest id first.
    pub fn awaiting_ack(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.held.iter().filter(|(_, h)| !h.acked).map(|(r, _)| *r)
    }

    /// The connector's counters.
    pub fn stats(&self) -> &PdStats {
        &self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &PdConfig {
        &self.config
    }

    /// The request's P/D params; unreadable ones count as absent ([`PdStats::bad_params`]: the
    /// runtime refuses them at its boundary, so none should get here).
    fn params(&mut self, view: &SchedulerView<'_>, request: RequestId) -> PdParams {
        let Some(p) = view.request(request).and_then(|r| r.kv_transfer_params()) else {
            return PdParams::default();
        };
        PdParams::parse(p).unwrap_or_else(|_| {
            self.stats.bad_params += 1;
            PdParams::default()
        })
    }

    /// Held requests to release with this step: acknowledged, or (strict) past their lease.
    fn releases(&mut self, out: &SchedulerOutput) -> Vec<RequestId> {
        let lease = self.config.lease_steps;
        let mut released = Vec::new();
        for (r, h) in &mut self.held {
            h.announced |= out.finished_req_ids.contains(r);
            if !h.announced {
                continue;
            }
            if !h.acked {
                // Without a lease nothing counts: a held request changes nothing while it waits.
                let Some(lease) = lease else {
                    continue;
                };
                h.steps += 1;
                if h.steps < lease {
                    continue;
                }
                self.stats.leases_expired += 1;
            }
            released.push(*r);
        }
        for r in &released {
            self.held.remove(r);
        }
        released
    }
}

/// Every non-null block of `blocks[g][first..last]`, every group, at the prefill engine's
/// slots of `at`.
fn copy_of(
    request: RequestId,
    blocks: &[Vec<BlockId>],
    first: u32,
    last: u32,
    at: RemotePrefill,
) -> PdCopy {
    let mut c = PdCopy {
        request,
        engine: at.engine,
        blocks: Vec::new(),
        groups: Vec::new(),
        slots: Vec::new(),
    };
    for (g, group) in (0u32..).zip(blocks) {
        for idx in first..last.min(group.len() as u32) {
            let b = group[idx as usize];
            if b.0 != 0 {
                c.blocks.push(b);
                c.groups.push(g);
                c.slots.push(remote_slot(RequestId(at.request), idx));
            }
        }
    }
    c
}

impl SchedulerConnector for PdConnector {
    type StepMeta = PdMeta;
    type WorkerMeta = Meta;

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        if !self.config.load || self.consumed.contains(&request) {
            return Lookup::MISS;
        }
        let Some(r) = view.request(request) else {
            return Lookup::MISS;
        };
        let prompt = r.num_prompt_tokens();
        let Some(at) = self.params(view, request).remote_prefill else {
            return Lookup::MISS;
        };
        // NIXL: the remote holds the prompt; the scheduler recomputes its last token.
        let tokens = at
            .num_tokens
            .min(prompt)
            .saturating_sub(num_computed_tokens);
        self.hits.insert(request, (num_computed_tokens, at));
        Lookup::Hit {
            tokens,
            load_async: tokens > 0,
        }
    }

    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        let Some((hit, at)) = self.hits.remove(&request) else {
            return;
        };
        self.consumed.insert(request);
        if num_external_tokens == 0 {
            return;
        }
        let bs = view.config().block_size;
        let last = (hit + num_external_tokens).div_ceil(bs);
        let copy = copy_of(request, blocks, hit / bs, last, at);
        if !copy.blocks.is_empty() {
            self.stats.remote_loads += 1;
            self.loads.push(copy);
        }
    }

    fn build_connector_meta(&mut self, _view: &SchedulerView<'_>, out: &SchedulerOutput) -> PdMeta {
        PdMeta {
            loads: core::mem::take(&mut self.loads),
            releases: self.releases(out),
        }
    }

    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        self.hits.remove(&request);
        self.consumed.remove(&request);
        let Some(r) = view.request(request) else {
            return FinishDecision::default();
        };
        let (status, computed, prompt) =
            (r.status(), r.num_computed_tokens(), r.num_prompt_tokens());
        let holds = blocks.iter().any(|g| g.iter().any(|b| b.0 != 0));
        // NIXL: only a request that ran to its length (the prefill's one token) is handed on.
        if !self.config.send
            || status != RequestStatus::FinishedLengthCapped
            || !holds
            || !self.params(view, request).remote_decode
        {
            return FinishDecision::default();
        }
        self.held.insert(
            request,
            Held {
                announced: false,
                acked: false,
                steps: 0,
                blocks: blocks.to_vec(),
            },
        );
        let at = RemotePrefill {
            engine: self.config.engine,
            request: request.0,
            num_tokens: computed.min(prompt),
        };
        FinishDecision {
            delay_free: true,
            kv_transfer_params: Some(PdParams::for_decode(at)),
        }
    }

    fn meta_is_empty(&self, meta: &PdMeta) -> bool {
        meta.loads.is_empty() && meta.releases.is_empty()
    }

    /// A held request keeps the engine stepping: its lease counts steps.
    fn has_pending_push_work(&self) -> bool {
        self.config.lease_steps.is_some() && !self.held.is_empty()
    }

    fn tracks_request(&self, request: RequestId) -> bool {
        self.consumed.contains(&request)
            || self.hits.contains_key(&request)
            || self.held.contains_key(&request)
    }

    fn requires_kv_delivery(&self) -> bool {
        self.config.send && self.config.kv_delivery
    }

    /// I-53: loads only for requests whose params were consumed; I-54: a held request waits at
    /// most its lease.
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for l in &self.loads {
            ensure_invariant!(
                self.consumed.contains(&l.request),
                "I-53",
                "a load for {:?}, whose params were not consumed",
                l.request
            );
        }
        for (r, h) in &self.held {
            ensure_invariant!(
                self.config.lease_steps.is_none_or(|l| h.steps < l),
                "I-54",
                "{r:?} held {} steps, past its lease",
                h.steps
            );
            ensure_invariant!(
                h.announced || h.steps == 0,
                "I-54",
                "{r:?} counts lease steps before the workers heard it finish"
            );
        }
        Ok(())
    }
}
