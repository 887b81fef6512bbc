//! Prefill/decode disaggregation: one engine prefills a request and holds its KV, another loads
//! that KV and decodes — vLLM's NIXL connector protocol, restated sans-IO.
//!
//! * A router sends the request to the prefill engine with `do_remote_decode`
//!   ([`PdParams::for_prefill`]). When it finishes by length, [`PdConnector`] delays the free of
//!   its blocks and returns the params that say where its KV is ([`PdParams::for_decode`]).
//! * The router forwards those params with the request to the decode engine. Its
//!   [`PdConnector`] answers the lookup from them (an async hit), and its [`PdWorker`]s load the
//!   blocks from the prefill engine's [`remote_slot`]s. A failed load is reported the way
//!   vLLM's `recompute` / `fail` policies expect: invalid blocks (one KV-cache group) or
//!   request-level `failed_recving`.
//! * The decode side acknowledges ([`PdConnector::acknowledge`] on the prefill engine). The
//!   blocks are then released: every rank reports the request in `finished_sending` with the
//!   next step ([`PdMeta::releases`]).
//!
//! **Leases (strict).** vLLM holds the blocks until that acknowledgement comes, for ever if the
//! decode side is gone (issue #46283). With [`PdConfig::lease_steps`] set, a held request whose
//! acknowledgement has not come within that many steps is released anyway, and counted
//! ([`PdStats::leases_expired`]). The decode side must give up reading before the lease runs
//! out, and kvrelay checks every loaded byte, so a late read is a failed load, never served.
//! The decode side's own wait — a source that is gone or silent — is bounded by its transfer
//! engine's deadline: such a load completes as failed.
//!
//! Call [`PdConnector::acknowledge`] between engine calls, when the decode side's message
//! arrives; the model checker does the same, and may never call it.

mod connector;
mod params;
mod worker;

#[cfg(test)]
mod tests;

use alloc::vec::Vec;

pub use connector::PdConnector;
pub use params::{
    DO_REMOTE_DECODE, DO_REMOTE_PREFILL, PdParams, PdParamsError, REMOTE_ENGINE_ID,
    REMOTE_NUM_TOKENS, REMOTE_REQUEST_ID, RemotePrefill,
};
pub use worker::PdWorker;

use crate::ids::{BlockId, RequestId};

/// What a P/D connector does, and its lease.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct PdConfig {
    /// This engine's id, named in the params its finished requests return.
    pub engine: u32,
    /// Decode role (`kv_consumer`): load a request's prompt KV when its params say where.
    pub load: bool,
    /// Prefill role (`kv_producer`): hold a request's blocks for a decode engine when its params
    /// ask for it (`do_remote_decode`) and it finished by length.
    pub send: bool,
    /// Load failures as invalid block ids (`true`; one KV-cache group only, vLLM rejects them
    /// for several, I-36) or as request-level `failed_recving`.
    pub failures_as_blocks: bool,
    /// Strict: steps a held request waits for its acknowledgement (at least 1). `None`: for
    /// ever, as vLLM.
    pub lease_steps: Option<u32>,
    /// vLLM's `requires_kv_delivery` for the prefill role (its default for a producer: `true`):
    /// a request preempted in its final step has its in-flight output dropped and recomputes,
    /// so it finishes with its blocks (PR #50297).
    pub kv_delivery: bool,
}

impl PdConfig {
    /// Both roles (`kv_both`), failures as invalid blocks, no lease.
    pub fn both(engine: u32) -> Self {
        Self {
            engine,
            load: true,
            send: true,
            failures_as_blocks: true,
            lease_steps: None,
            kv_delivery: true,
        }
    }
}

/// One load's blocks: a request's GPU blocks and the prefill engine's slots to read them from.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PdCopy {
    /// The request (on this engine).
    pub request: RequestId,
    /// The prefill engine.
    pub engine: u32,
    /// GPU blocks (every group's, non-null), in order.
    pub blocks: Vec<BlockId>,
    /// The KV-cache group of each block.
    pub groups: Vec<u32>,
    /// The prefill engine's slots, one per block ([`remote_slot`]).
    pub slots: Vec<u64>,
}

/// The P/D connector's per-step metadata.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PdMeta {
    /// Async loads admitted since the previous step.
    pub loads: Vec<PdCopy>,
    /// Held requests to report in this step's `finished_sending` (acknowledged, or past their
    /// lease).
    pub releases: Vec<RequestId>,
}

/// What a P/D connector counted.
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub struct PdStats {
    /// Remote loads admitted (decode role).
    pub remote_loads: u64,
    /// Acknowledgements that released a held request (prefill role).
    pub acks: u64,
    /// Acknowledgements for nothing held: late (after the lease) or repeated.
    pub late_acks: u64,
    /// Held requests released because their lease ran out (strict).
    pub leases_expired: u64,
    /// Requests whose P/D params could not be read (treated as absent).
    pub bad_params: u64,
}

/// Where block `index` of the prefill engine's request `request` is read from: the address a
/// decode-side load names, which the transfer engine resolves on the prefill engine.
pub fn remote_slot(request: RequestId, index: u32) -> u64 {
    (1 << 62) | (u64::from(request.0) << 32) | u64::from(index)
}

/// Whether `slot` is a prefill engine's ([`remote_slot`]).
pub fn is_remote_slot(slot: u64) -> bool {
    slot & (1 << 62) != 0
}

/// The prefill engine's request and block index that `slot` names, if it is a
/// [`remote_slot`].
pub fn remote_slot_parts(slot: u64) -> Option<(RequestId, u32)> {
    is_remote_slot(slot).then_some((RequestId(((slot >> 32) & 0x3fff_ffff) as u32), slot as u32))
}
