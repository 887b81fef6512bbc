//! The read-only view of scheduler state that a connector gets for one call (SEMANTICS.md §7.3).

use alloc::vec::Vec;

use super::request::Params;
use super::{Request, RequestStatus, SchedulerConfig, State};
use crate::ids::{BlockId, RequestId};
use crate::tokens::{BlockHash, Token};

/// A read-only view of scheduler state, lent to a connector for one call (SEMANTICS.md §7.3).
///
/// It holds a shared borrow of the scheduler, so it cannot outlive the call and nothing can be
/// mutated through it; everything it returns is a copy or a shared slice.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerView<'a> {
    state: &'a State,
}

/// A read-only view of one request.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    r: &'a Request,
}

impl<'a> RequestView<'a> {
    /// Its id.
    pub fn id(&self) -> RequestId {
        self.r.id
    }
    /// Its status.
    pub fn status(&self) -> RequestStatus {
        self.r.status
    }
    /// Prompt plus output tokens.
    pub fn tokens(&self) -> &'a [Token] {
        &self.r.tokens
    }
    /// Prompt length.
    pub fn num_prompt_tokens(&self) -> u32 {
        self.r.num_prompt_tokens
    }
    /// Hashes of the full blocks of `tokens`, chained.
    pub fn block_hashes(&self) -> &'a [BlockHash] {
        &self.r.block_hashes
    }
    /// Tokens whose KV is computed (or being loaded, for `WAITING_FOR_REMOTE_KVS`).
    pub fn num_computed_tokens(&self) -> u32 {
        self.r.num_computed_tokens
    }
    /// How often it was preempted.
    pub fn num_preemptions(&self) -> u32 {
        self.r.num_preemptions
    }
    /// `kv_transfer_params` of the request.
    pub fn kv_transfer_params(&self) -> Option<&'a Params> {
        self.r.kv_transfer_params.as_ref()
    }
    /// Its block table in `group` (empty for an unknown group).
    pub fn block_ids(&self, group: usize) -> &'a [BlockId] {
        self.r.blocks.get(group).map_or(&[], Vec::as_slice)
    }
}

impl<'a> SchedulerView<'a> {
    /// The configuration.
    pub fn config(&self) -> &'a SchedulerConfig {
        &self.state.config
    }
    /// A request the scheduler holds (live, or finished and held for the connector).
    pub fn request(&self, id: RequestId) -> Option<RequestView<'a>> {
        self.state.requests.get(&id).map(|r| RequestView { r })
    }
    /// Waiting requests in admission order (those holding blocks first).
    pub fn waiting(&self) -> impl Iterator<Item = RequestId> + 'a {
        self.state
            .kv_holding_waiting
            .iter()
            .chain(self.state.waiting.iter())
            .copied()
    }
    /// Running requests in order.
    pub fn running(&self) -> &'a [RequestId] {
        &self.state.running
    }
    /// Free GPU blocks.
    pub fn num_free_blocks(&self) -> u32 {
        self.state.pool.num_free()
    }
    /// Owners of a GPU block (`None` if out of range).
    pub fn block_ref_cnt(&self, b: BlockId) -> Option<u32> {
        self.state
            .pool
            .contains(b)
            .then(|| self.state.pool.ref_cnt(b))
    }
    /// The local prefix-cache hit of a request, per group, in tokens (the query OffloadingConnector
    /// makes through `bind_kv_cache_manager`). Empty for an unknown request.
    pub fn prefix_cache_hits(&self, id: RequestId) -> Vec<u32> {
        match self.state.requests.get(&id) {
            Some(r) => self.state.per_group_hits(r),
            None => Vec::new(),
        }
    }
}

impl State {
    pub(super) fn view(&self) -> SchedulerView<'_> {
        SchedulerView { state: self }
    }
}
