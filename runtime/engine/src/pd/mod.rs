//! Prefill/decode disaggregation between two engines: the core's P/D connector
//! ([`kvrelay_core::PdConnector`]) in an engine, and the KV path between them.
//!
//! A prefill engine ([`PdRole::Prefill`]) holds each finished request's blocks and serves them
//! on its KV server ([`KvServer`], started by [`crate::Engine::start`]): a decode engine's rank
//! `r` asks for blocks of a held request by `(request, index, group)` and gets the bytes of
//! rank `r`'s arena. The server reads only blocks the connector still holds
//! ([`kvrelay_core::PdConnector::held_blocks`], synced after every schedule and apply, before
//! the scheduler can free them): a read of a released request is answered `Gone`, never with
//! blocks that may already hold another request's KV.
//!
//! A decode engine's ranks load through [`fetch::RemoteEngine`]: one connection per rank, every
//! read under a deadline ([`Source::deadline_ms`]); an error, a `Gone`, a short answer or a
//! deadline passed is a failed load, which the core recovers with vLLM's policies (the blocks
//! are recomputed). Every loaded block is checked byte for byte against the request's tokens
//! when the load lands (`rank`), as an offloading load is against its host slots.
//!
//! Why engine to engine over TCP rather than through the shared tier: the KV moves once, from
//! the blocks the prefill engine holds to the decode engine's, as NIXL moves it; the hold and
//! its lease are what keeps those blocks valid while they are read; and P/D needs no Redis.
//! The engines' control (requests, params, acknowledgements) goes through a router:
//! `kvrelay pd`.

pub mod fetch;
pub mod process;
pub mod route;
mod run;
mod serve;

pub use self::process::{EngineProcess, engine_main};
pub use self::route::{EngineSummary, PdLink, RouteCounts, Routed, Submit, Tick, Ticked, route};
pub use self::run::{PdReport, pair_configs, run_processes};
pub(crate) use self::serve::sync_held;
pub use self::serve::{HeldTable, KvServer, ServeCounts};

use kvrelay_core::{BlockId, PdConfig, RequestId};
use serde::{Deserialize, Serialize};

/// Blocks one read asks for, at most (a reply of 1,024 blocks of the default layout is 8 MiB,
/// well under the frame limit).
pub const READ_BLOCKS: usize = 1024;

/// Which side of a disaggregated pair an engine is.
#[derive(Clone, Copy, Debug, Eq, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PdRole {
    /// Prefills requests sent with `do_remote_decode`, holds their blocks, serves them.
    Prefill,
    /// Loads a request's prompt KV from the prefill engine its params name, then decodes.
    Decode,
}

/// An engine's part in P/D ([`crate::RunConfig::pd`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PdRunConfig {
    pub role: PdRole,
    /// This engine's id (named in the params its finished requests return).
    pub engine: u32,
    /// Strict: steps a held request waits for the decode side's acknowledgement before its
    /// blocks are released anyway. `None`: for ever, as vLLM (compat).
    pub lease_steps: Option<u32>,
    /// Prefill: where the KV server listens (`HOST:PORT`; port 0 picks a free one).
    pub listen: String,
    /// Decode: the prefill engine's KV server.
    pub source: Option<Source>,
}

impl PdRunConfig {
    /// The core connector's configuration for this engine in `mode`.
    pub fn connector(&self) -> PdConfig {
        let prefill = self.role == PdRole::Prefill;
        PdConfig {
            load: !prefill,
            send: prefill,
            lease_steps: self.lease_steps,
            ..PdConfig::both(self.engine)
        }
    }
}

/// Where a decode engine's loads read.
#[derive(Clone, Debug, Eq, PartialEq, Serialize, Deserialize)]
pub struct Source {
    /// The prefill engine's KV server, `HOST:PORT`.
    pub addr: String,
    /// How long one read (connecting included) may take before the load fails.
    pub deadline_ms: u64,
}

/// A decode rank's read: blocks of a held request, each `(index, group)` as the core's
/// [`kvrelay_core::pd::remote_slot`] names it.
#[derive(Clone, Debug, Eq, PartialEq, Serialize, Deserialize)]
pub struct KvRead {
    pub rank: u32,
    pub request: RequestId,
    pub blocks: Vec<(u32, u32)>,
}

/// The prefill engine's answer.
#[derive(Clone, Debug, Eq, PartialEq, Serialize, Deserialize)]
pub enum KvReply {
    /// The blocks' bytes, in the order asked: per block, its group's layers in order.
    Blocks(Vec<u8>),
    /// The request is not held (released, its lease ran out, or never held).
    Gone(RequestId),
    /// The read names a rank, group or block the request does not have.
    Refused(String),
}

/// The block `index` of `group` of a held request with `blocks`, if it has one.
pub fn held_block(blocks: &[Vec<BlockId>], index: u32, group: u32) -> Option<BlockId> {
    let b = *blocks.get(group as usize)?.get(index as usize)?;
    (b.0 != 0).then_some(b)
}
