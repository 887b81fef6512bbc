//! Requests: what a caller submits ([`RequestSpec`]), where a request is in its lifecycle
//! ([`RequestStatus`]), and the scheduler's own per-request bookkeeping (token list, chained block
//! hashes; the struct itself lives in `mod.rs` with the rest of the state).

use alloc::string::String;
use alloc::vec::Vec;

use super::Request;
use crate::ids::RequestId;
use crate::tokens::{Token, hash_block};

/// `kv_transfer_params`: string key/value pairs attached to a request (input) or to its final
/// output (returned by `request_finished`). Ordered, so equal maps compare and hash equal.
pub type Params = alloc::collections::BTreeMap<String, String>;

/// A request as it arrives.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestSpec {
    /// Its id (unique among live requests).
    pub id: RequestId,
    /// Prompt tokens (at least one).
    pub prompt: Vec<Token>,
    /// Output tokens at most (≥ 1).
    pub max_tokens: u32,
    /// Sampling this token stops the request (`FINISHED_STOPPED`).
    pub stop_token: Option<Token>,
    /// `kv_transfer_params` (P/D); read by connectors through the view.
    pub kv_transfer_params: Option<Params>,
}

/// vLLM's `RequestStatus`, restricted to the connector-relevant ones.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestStatus {
    /// Queued, never scheduled (or returned from a load).
    Waiting,
    /// Its async load is in flight; it holds blocks.
    WaitingForRemoteKvs,
    /// In the running batch.
    Running,
    /// Preempted (blocks freed, `num_computed_tokens = 0`), queued again.
    Preempted,
    /// Finished: sampled its stop token.
    FinishedStopped,
    /// Finished: reached `max_tokens` or `max_model_len`.
    FinishedLengthCapped,
    /// Finished: aborted from outside.
    FinishedAborted,
    /// Finished: failed (load failure under the `fail` policy).
    FinishedError,
}

impl RequestStatus {
    /// Whether this is a `FINISHED_*` status.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            Self::FinishedStopped
                | Self::FinishedLengthCapped
                | Self::FinishedAborted
                | Self::FinishedError
        )
    }
}

impl Request {
    pub(super) fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    pub(super) fn num_output_tokens(&self) -> u32 {
        self.num_tokens() - self.num_prompt_tokens
    }

    pub(super) fn holds_kv_blocks(&self) -> bool {
        self.num_computed_tokens > 0 || self.status == RequestStatus::WaitingForRemoteKvs
    }

    pub(super) fn append_token(&mut self, t: Token, block_size: u32) {
        self.tokens.push(t);
        let bs = block_size as usize;
        while (self.block_hashes.len() + 1) * bs <= self.tokens.len() {
            let i = self.block_hashes.len();
            let parent = self.block_hashes.last().copied();
            self.block_hashes
                .push(hash_block(parent, &self.tokens[i * bs..(i + 1) * bs]));
        }
    }
}
