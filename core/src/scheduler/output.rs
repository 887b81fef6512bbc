//! What [`super::Scheduler::update_from_output`] returns: per-request outputs and the step's KV
//! events.

use alloc::vec::Vec;

use super::Params;
use super::RequestStatus;
use crate::ids::RequestId;
use crate::messages::KvEvent;
use crate::tokens::Token;

/// Why a request finished.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// Sampled its stop token.
    Stopped,
    /// Reached `max_tokens` or `max_model_len`.
    LengthCapped,
    /// Aborted.
    Aborted,
    /// Failed (load failure under the `fail` policy).
    Error,
}

impl FinishReason {
    pub(super) fn status(self) -> RequestStatus {
        match self {
            Self::Stopped => RequestStatus::FinishedStopped,
            Self::LengthCapped => RequestStatus::FinishedLengthCapped,
            Self::Aborted => RequestStatus::FinishedAborted,
            Self::Error => RequestStatus::FinishedError,
        }
    }
}

/// One request's part of a step's result.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// Tokens accepted this step (trimmed at a stop).
    pub new_tokens: Vec<Token>,
    /// Set when the request finished this step.
    pub finish: Option<FinishReason>,
    /// What the connector attached at finish.
    pub kv_transfer_params: Option<Params>,
}

/// The result of [`crate::Scheduler::update_from_output`].
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepResult {
    /// Per-request outputs, in scheduling order, then errored requests.
    pub outputs: Vec<RequestOutput>,
    /// The connector's KV events of this step.
    pub events: Vec<KvEvent>,
}
