//! The tiering manager's public vocabulary: tier and job ids, what a lookup finds, the config,
//! the work it hands the runtime and the reports it takes back, its figures and its errors.
//! Re-exported from [`crate::offloading`].

use alloc::vec::Vec;

use super::super::{ChunkId, OffloadKey};
use crate::RequestId;

/// A secondary tier: its index in [`TieringConfig::tiers`] order (vLLM's `tier_idx`).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
pub struct TierId(pub u8);

/// A transfer job between the primary tier and a secondary tier (vLLM's `JobId`: one counter
/// for promotions and cascades of every tier).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
pub struct TierJobId(pub u64);

/// What a lookup through every tier found (vLLM's `LookupResult`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LookupResult {
    /// In no tier (or the primary tier has no room to promote it).
    Miss,
    /// Stored in the primary tier and readable.
    Hit,
    /// In the primary tier, not yet readable: a store or a promotion is writing it.
    HitPending,
    /// Unknown yet: a secondary tier's existence probe is in flight. Ask again next step.
    Retry,
}

/// How a tiering manager is built (the primary tier's own config is the
/// [`ManagerConfig`](super::super::ManagerConfig)).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TieringConfig {
    /// How many secondary tiers (1 to [`TieringConfig::MAX_TIERS`]).
    pub tiers: u8,
    /// `None`: vLLM 0.33.0 (compat), where a probe or a promotion that never reports keeps its
    /// request waiting for ever (vLLM #49829). `Some(n)` (strict): a probe unanswered, or a
    /// promotion unfinished, `n` steps after it was handed to the runtime stops being waited
    /// for: the probe counts as a miss and the promoting key as a miss for lookups (its primary
    /// chunk stays reserved until the runtime reports the job, so a late write cannot land in
    /// a reused chunk).
    pub deadline_steps: Option<u32>,
    /// `false`: vLLM 0.33.0 (compat), where a promoted chunk keeps the rank its promotion
    /// reserved it with, its request's provisional one under LRU: older than whatever finished
    /// since, so a request that waited long enough evicts its own last promotion with each new
    /// one, for ever (`docs/TIERING.md`). `true` (strict): a promotion that lands ranks its
    /// chunks most recent, as a touch does.
    pub promoted_most_recent: bool,
    /// `false`: vLLM 0.33.0 (compat), where a promoted chunk is evictable as soon as it lands,
    /// so when the requests waiting for promotions need more chunks than the primary tier
    /// holds, each step's promotions evict the previous step's and no request ever loads (a
    /// livelock, `docs/TIERING.md`). `true` (strict): a promoted chunk stays pinned for the
    /// request that promoted it until that request loads it or finishes; a promotion that
    /// finds no room is then a miss, and the request recomputes those tokens.
    pub hold_promoted: bool,
}

impl TieringConfig {
    /// The most secondary tiers a manager takes.
    pub const MAX_TIERS: u8 = 4;
}

/// Work for the runtime, taken with
/// [`TieringManager::take_tier_work`](super::TieringManager::take_tier_work) after each step.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum TierWork {
    /// Ask the tier's store whether each key exists; answer each with
    /// [`TierReport::Probed`], echoing its generation.
    Probe {
        /// The tier.
        tier: TierId,
        /// Keys with the generation of their probe.
        keys: Vec<(OffloadKey, u64)>,
    },
    /// Copy the primary chunks to the tier's store under the keys (a cascade).
    Store {
        /// The tier.
        tier: TierId,
        /// The job, reported with [`TierReport::Finished`].
        job: TierJobId,
        /// The keys, in order.
        keys: Vec<OffloadKey>,
        /// The primary chunk of each key (parallel), pinned until the job is reported.
        chunks: Vec<ChunkId>,
    },
    /// Copy the keys' values from the tier's store into the primary chunks (a promotion).
    Load {
        /// The tier.
        tier: TierId,
        /// The request whose lookup started the promotion (vLLM's `req_context`).
        request: RequestId,
        /// The job, reported with [`TierReport::Finished`].
        job: TierJobId,
        /// The keys, in order.
        keys: Vec<OffloadKey>,
        /// The primary chunk each key is written to (parallel), reserved until the job is
        /// reported.
        chunks: Vec<ChunkId>,
    },
}

/// What the runtime reports back, with
/// [`TieringManager::report`](super::TieringManager::report).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum TierReport {
    /// A probe's answer (a failed probe is `found: false`, as in vLLM).
    Probed {
        /// The tier.
        tier: TierId,
        /// The key.
        key: OffloadKey,
        /// The generation [`TierWork::Probe`] gave it.
        generation: u64,
        /// Whether the store holds the key.
        found: bool,
    },
    /// A job ended. After this the runtime must not touch the job's primary chunks again.
    Finished {
        /// The tier.
        tier: TierId,
        /// The job.
        job: TierJobId,
        /// Whether every key was copied.
        success: bool,
        /// On a failed promotion, the keys that were copied all the same (`None`: none).
        successful_keys: Option<Vec<OffloadKey>>,
    },
}

/// The tiering manager's running figures.
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub struct TieringStats {
    /// Promotions started (keys).
    pub promotions: u64,
    /// Promoted keys that failed to load.
    pub promotion_failures: u64,
    /// Promotions refused because the primary tier had no room.
    pub promotion_allocation_failures: u64,
    /// Cascade (store) jobs that failed.
    pub cascade_failures: u64,
    /// Keys cascaded to a tier successfully.
    pub keys_cascaded: u64,
    /// Keys promoted successfully.
    pub keys_promoted: u64,
    /// Strict: probes given up after their deadline.
    pub probes_expired: u64,
    /// Strict: promotions given up after their deadline.
    pub promotions_expired: u64,
}

/// A typed refusal; the manager is unchanged.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TieringError {
    /// A config that cannot build a manager.
    #[error("bad config: {0}")]
    BadConfig(&'static str),
    /// A call named a request without `on_new_request` first, or named none.
    #[error("unknown request {0:?}")]
    UnknownRequest(Option<RequestId>),
    /// `complete_store` with no `prepare_store` outstanding for the request (vLLM: an
    /// assertion).
    #[error("request {0:?} has no store in flight")]
    NoPendingStore(RequestId),
    /// A report named a tier the manager does not have.
    #[error("unknown tier {0}")]
    UnknownTier(u8),
    /// A report named a job the tier does not hold in flight (or reported it twice).
    #[error("job {0} is not in flight at tier {1}")]
    UnknownJob(u64, u8),
    /// A probe answer for a probe that was never handed out, or answered twice.
    #[error("probe of {0:?} (generation {1}) is not in flight")]
    UnknownProbe(OffloadKey, u64),
    /// A promotion reported keys it was not asked to load.
    #[error("job {0} reported keys it does not hold")]
    ForeignKeys(u64),
    /// The primary tier refused a call the tiering protocol makes (vLLM: an assertion).
    #[error("primary tier: {0}")]
    Primary(super::super::ManagerError),
    /// `reset` while tier jobs are in flight: the runtime must report them first (vLLM blocks
    /// in `drain_jobs`).
    #[error("{0} tier jobs in flight")]
    JobsInFlight(usize),
}

impl TieringError {
    /// The stable short name used by the conformance format.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BadConfig(_) => "bad_config",
            Self::UnknownRequest(_) => "unknown_request",
            Self::NoPendingStore(_) => "no_pending_store",
            Self::UnknownTier(_) => "unknown_tier",
            Self::UnknownJob(..) => "unknown_job",
            Self::UnknownProbe(..) => "unknown_probe",
            Self::ForeignKeys(_) => "foreign_keys",
            Self::Primary(e) => e.kind(),
            Self::JobsInFlight(_) => "jobs_in_flight",
        }
    }
}
