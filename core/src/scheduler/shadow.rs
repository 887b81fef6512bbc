//! [`ShadowState`]: the scheduler state a connector reads, kept by an embedder whose scheduler
//! is not kvrelay's (vLLM's own, through the Python package), so that the core's connectors run
//! beside a foreign scheduler.
//!
//! A connector reads scheduler state only through a [`SchedulerView`]. Here the embedder
//! mirrors into the shadow, before each connector call, the fields of the requests the call may
//! read: status, tokens, prompt length, block hashes, computed tokens, preemptions,
//! `kv_transfer_params`, block tables. The shadow holds no block pool and schedules nothing;
//! [`ShadowState::view`] lends the view. Which fields a connector reads is the connector's
//! business (the offloading connector's are listed in `core/src/offloading/mod.rs`); the test
//! `shadow_view_drives_the_offloading_connector_as_the_scheduler_does` holds the offloading
//! connector to it.

use alloc::vec::Vec;

use super::request::Params;
use super::view::SchedulerView;
use super::{MAX_REQUEST_ID, Request, RequestStatus, SchedulerConfig, SchedulerError, State};
use crate::ids::{BlockId, RequestId};
use crate::tokens::{BlockHash, Token};

/// The mirrored requests and the configuration. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct ShadowState {
    state: State,
}

/// One request's fields as the embedder's scheduler has them now.
#[derive(Clone, Copy, Debug)]
pub struct RequestMirror<'a> {
    /// Its status.
    pub status: RequestStatus,
    /// Prompt plus output tokens.
    pub tokens: &'a [Token],
    /// Prompt length.
    pub num_prompt_tokens: u32,
    /// Hashes of the full blocks of `tokens`, chained (the embedder's own).
    pub block_hashes: &'a [BlockHash],
    /// Tokens whose KV is computed (or being loaded).
    pub num_computed_tokens: u32,
    /// How often it was preempted.
    pub num_preemptions: u32,
    /// `kv_transfer_params`.
    pub kv_transfer_params: Option<&'a Params>,
    /// One block table per KV cache group.
    pub blocks: &'a [Vec<BlockId>],
}

impl ShadowState {
    /// An empty shadow for `config` (validated as the scheduler validates it).
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerError> {
        config.validate()?;
        Ok(Self {
            state: State::new(config, false),
        })
    }

    /// Makes `id`'s fields those of `mirror`, adding the request on first sight. Ids must be
    /// below [`MAX_REQUEST_ID`] (intern them densely).
    pub fn mirror(&mut self, id: RequestId, m: RequestMirror<'_>) -> Result<(), SchedulerError> {
        let r = self.entry(id)?;
        Self::set_scalars(r, &m);
        r.tokens.clear();
        r.tokens.extend_from_slice(m.tokens);
        r.block_hashes.clear();
        r.block_hashes.extend_from_slice(m.block_hashes);
        r.blocks.clear();
        r.blocks.extend_from_slice(m.blocks);
        Ok(())
    }

    /// Like [`ShadowState::mirror`], but `m.tokens` and `m.block_hashes` are only what follows
    /// the first `tokens_from` tokens and `hashes_from` hashes the shadow already holds for
    /// `id` (see [`ShadowState::lengths`]), and `m.blocks` replaces the tables only when it is
    /// not empty: a call costs the new tokens, not the whole request (a long prompt decoding
    /// step after step). Lengths beyond what the shadow holds are a
    /// [`SchedulerError::BadRequest`], with the shadow unchanged.
    pub fn mirror_from(
        &mut self,
        id: RequestId,
        tokens_from: usize,
        hashes_from: usize,
        m: RequestMirror<'_>,
    ) -> Result<(), SchedulerError> {
        let (have_tokens, have_hashes) = self.lengths(id).unwrap_or((0, 0));
        if tokens_from > have_tokens || hashes_from > have_hashes {
            return Err(SchedulerError::BadRequest {
                id,
                why: alloc::format!(
                    "mirror from token {tokens_from} and hash {hashes_from}, but the shadow \
                     holds {have_tokens} and {have_hashes}"
                ),
            });
        }
        let r = self.entry(id)?;
        r.tokens.truncate(tokens_from);
        r.tokens.extend_from_slice(m.tokens);
        r.block_hashes.truncate(hashes_from);
        r.block_hashes.extend_from_slice(m.block_hashes);
        if !m.blocks.is_empty() {
            r.blocks.clear();
            r.blocks.extend_from_slice(m.blocks);
        }
        Self::set_scalars(r, &m);
        Ok(())
    }

    /// The tokens and block hashes the shadow holds for `id` (`None`: not mirrored).
    pub fn lengths(&self, id: RequestId) -> Option<(usize, usize)> {
        let r = self.state.requests.get(&id)?;
        Some((r.tokens.len(), r.block_hashes.len()))
    }

    /// `id`'s request, added on first sight (ids must be below [`MAX_REQUEST_ID`]).
    fn entry(&mut self, id: RequestId) -> Result<&mut Request, SchedulerError> {
        if id.0 >= MAX_REQUEST_ID {
            return Err(SchedulerError::BadRequest {
                id,
                why: alloc::format!(
                    "request ids must be below {MAX_REQUEST_ID} (intern them densely)"
                ),
            });
        }
        if !self.state.requests.contains_key(&id) {
            let groups = self.state.config.groups.len();
            self.state.requests.insert(id, Request::new(id, groups));
        }
        Ok(self.state.requests.get_mut(&id).expect("inserted above"))
    }

    /// Every field of `m` but the lists.
    fn set_scalars(r: &mut Request, m: &RequestMirror<'_>) {
        r.status = m.status;
        r.num_prompt_tokens = m.num_prompt_tokens;
        r.num_computed_tokens = m.num_computed_tokens;
        r.num_preemptions = m.num_preemptions;
        r.kv_transfer_params = m.kv_transfer_params.cloned();
    }

    /// Forgets `id` (the embedder's scheduler freed it).
    pub fn remove(&mut self, id: RequestId) {
        self.state.requests.remove(&id);
    }

    /// Whether `id` is mirrored.
    pub fn contains(&self, id: RequestId) -> bool {
        self.state.requests.contains_key(&id)
    }

    /// The view a connector call gets.
    pub fn view(&self) -> SchedulerView<'_> {
        self.state.view()
    }
}
