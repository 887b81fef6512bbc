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
        if id.0 >= MAX_REQUEST_ID {
            return Err(SchedulerError::BadRequest {
                id,
                why: alloc::format!(
                    "request ids must be below {MAX_REQUEST_ID} (intern them densely)"
                ),
            });
        }
        if !self.state.requests.contains_key(&id) {
            self.state
                .requests
                .insert(id, Request::new(id, self.state.config.groups.len()));
        }
        let r = self.state.requests.get_mut(&id).expect("inserted above");
        r.status = m.status;
        r.num_prompt_tokens = m.num_prompt_tokens;
        r.num_computed_tokens = m.num_computed_tokens;
        r.num_preemptions = m.num_preemptions;
        r.tokens.clear();
        r.tokens.extend_from_slice(m.tokens);
        r.block_hashes.clear();
        r.block_hashes.extend_from_slice(m.block_hashes);
        r.kv_transfer_params = m.kv_transfer_params.cloned();
        r.blocks.clear();
        r.blocks.extend_from_slice(m.blocks);
        Ok(())
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
