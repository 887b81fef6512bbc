//! The shared tier in the system model (issue 36; SEMANTICS.md §5.9, I-49 to I-52): an
//! adversarial store behind kvrelay's tiering manager, for [`OffloadingPair`] with
//! [`SystemConfig::tier`].
//!
//! After every engine action the model takes the connector's tier work (existence probes,
//! cascades, promotions: `take_tier_work`, as the runtime does after a step) into
//! [`TierEnv::pending`]. The environment answers any of it, in any order, at any moment
//! ([`SystemAction::TierAnswer`]) through `report_tier`, the call the runtime makes. The store
//! keeps, per key, what every rank's shard of the primary chunk held *when the cascade is
//! answered* (the chunk is pinned meanwhile: a chunk reused under its cascade stores the wrong
//! bytes, and DATA finds them when they are promoted and read). The adversary:
//!
//! - a key may vanish at any moment ([`TierModel::vanish`]: eviction, a node's data lost);
//! - a probe or a job may fail ([`TierModel::failures`]: a node away past the deadline). A
//!   failed cascade leaves its values torn (a write that landed partly); a failed promotion
//!   leaves its primary slots holding garbage;
//! - a probe's answer may never come ([`TierModel::lost`]): vLLM #49829. `compat` then waits
//!   for ever (QUIESCENT finds the stuck request); `strict` gives up after its deadline.
//!
//! The runtime's own checks are the environment's honest part: a promotion of a torn or missing
//! value (its header or checksum does not match, or `MGET` answers nil) fails that key and
//! serves none of its bytes.
//!
//! What is checked, besides the system model's properties: DATA covers promoted chunks (a GPU
//! block loaded from one holds exactly its tokens' content), and a quiescent state holds no tier
//! work, no tier job in the manager and no pinned or reserved primary chunk ([`tier_leak`]).

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::{ChunkId, Mode, OffloadKey, TierId, TierReport, TierWork, TieringConfig};

use super::{
    CORRUPT, Connectors, EMPTY, OffloadingConnector, SystemAction, SystemModel, SystemState,
    property_names,
};
#[cfg(doc)]
use super::{OffloadingPair, SystemConfig};

/// The shared tier and its faults ([`SystemConfig::tier`]).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct TierModel {
    /// The tiering manager's strict deadline ([`TieringConfig::deadline_steps`]; `None`: vLLM).
    pub deadline_steps: Option<u32>,
    /// Keys the store may drop.
    pub vanish: u32,
    /// Probes and jobs that may fail.
    pub failures: u32,
    /// Probe answers that may never come.
    pub lost: u32,
    /// Fault: the runtime promotes a torn value without checking its header and checksum
    /// (LMCache #4991's class of bug, a failed store served as a hit). DATA must find it.
    pub unchecked: bool,
}

impl TierModel {
    /// A key vanishing and a probe or job failing; under `strict` also an answer lost, which
    /// strict gives up after two steps (under `compat` a lost answer hangs, vLLM #49829: set
    /// [`TierModel::lost`] to see it).
    pub fn adversarial(mode: Mode) -> Self {
        let strict = mode == Mode::Strict;
        Self {
            deadline_steps: strict.then_some(2),
            vanish: 1,
            failures: 1,
            lost: u32::from(strict),
            unchecked: false,
        }
    }

    /// The manager's config.
    pub(super) fn tiering(&self) -> TieringConfig {
        TieringConfig {
            tiers: 1,
            deadline_steps: self.deadline_steps,
            promoted_most_recent: self.deadline_steps.is_some(),
            hold_promoted: self.deadline_steps.is_some(),
        }
    }
}

/// A value under a key of the store.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum TierValue {
    /// A write that landed partly: the reader's checksum refuses it.
    Torn,
    /// Every rank's shard: the contents of the chunk's slots, rank after rank.
    Shards(Vec<u64>),
}

/// Tier work handed out and not answered yet (a probe of several keys is one item per key).
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub enum TierPending {
    /// An existence probe.
    Probe {
        /// The tier.
        tier: TierId,
        /// The key.
        key: OffloadKey,
        /// Its generation.
        generation: u64,
    },
    /// A cascade ([`TierWork::Store`]) or a promotion ([`TierWork::Load`]).
    Job(TierWork),
}

/// The environment's side of the tier: the store, the work in flight, the fault budgets left.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct TierEnv {
    /// What the store holds.
    pub store: BTreeMap<OffloadKey, TierValue>,
    /// Work in flight, in the order it was handed out (bounded by the manager's probes and jobs).
    pub pending: Vec<TierPending>,
    /// Vanishings left.
    pub vanish_left: u32,
    /// Failures left.
    pub failures_left: u32,
    /// Lost answers left.
    pub lost_left: u32,
    /// Ghost: primary slots a promotion wrote and no store rewrote since (the witness of
    /// [`property_names::TIER_PROMOTED_LOADED`]).
    pub promoted_slots: BTreeSet<u64>,
    /// Ghost: a fault struck (a failure, a vanished key or a lost answer).
    pub faulted: bool,
}

impl TierEnv {
    pub(super) fn new(model: Option<&TierModel>) -> Self {
        let Some(m) = model else {
            return Self::default();
        };
        Self {
            vanish_left: m.vanish,
            failures_left: m.failures,
            lost_left: m.lost,
            ..Self::default()
        }
    }
}

/// For the quiescence property: what a tiered connector still holds when nothing is left to do
/// (a tier job, a pinned or reserved primary chunk), if anything.
pub fn tier_leak(c: &OffloadingConnector) -> Option<String> {
    let tiering = c.tiering()?;
    let primary = c.manager();
    if tiering.jobs_in_flight() {
        return Some("a tier job is still in flight".to_owned());
    }
    if primary.num_pinned() != 0 || primary.num_write_pending() != 0 {
        return Some(format!(
            "{} primary chunks pinned, {} being written",
            primary.num_pinned(),
            primary.num_write_pending()
        ));
    }
    None
}

impl<P: Connectors> SystemModel<P> {
    /// After an engine action: the tier work it produced goes in flight.
    pub(super) fn take_tier_work(&self, s: &mut SystemState<P>) {
        if self.config.tier.is_none() {
            return;
        }
        let conn = &mut s.engine.make_mut().scheduler_mut().connector_mut().inner;
        for w in self.pair.take_tier_work(conn) {
            match w {
                TierWork::Probe { tier, keys } => {
                    s.tier
                        .pending
                        .extend(
                            keys.into_iter()
                                .map(|(key, generation)| TierPending::Probe {
                                    tier,
                                    key,
                                    generation,
                                }),
                        );
                }
                job => s.tier.pending.push(TierPending::Job(job)),
            }
        }
    }

    /// The tier's actions enabled in `s`.
    pub(super) fn tier_actions(&self, s: &SystemState<P>, actions: &mut Vec<SystemAction>) {
        let t = &s.tier;
        for (i, p) in t.pending.iter().enumerate() {
            let item = i as u8;
            actions.push(SystemAction::TierAnswer { item, ok: true });
            if t.failures_left > 0 {
                actions.push(SystemAction::TierAnswer { item, ok: false });
            }
            if t.lost_left > 0 && matches!(p, TierPending::Probe { .. }) {
                actions.push(SystemAction::TierLose { item });
            }
        }
        if t.vanish_left > 0 {
            actions.extend(t.store.keys().map(|&k| SystemAction::TierVanish(k)));
        }
    }

    /// The store answers item `item` (`ok: false`: it fails), and the report goes to the
    /// connector.
    pub(super) fn tier_answer(&self, s: &mut SystemState<P>, item: u8, ok: bool) {
        let Some(p) = s.tier.pending.get(usize::from(item)).cloned() else {
            return;
        };
        s.tier.pending.remove(usize::from(item));
        if !ok {
            s.tier.failures_left = s.tier.failures_left.saturating_sub(1);
            s.tier.faulted = true;
        }
        let report = match p {
            TierPending::Probe {
                tier,
                key,
                generation,
            } => TierReport::Probed {
                tier,
                key,
                generation,
                found: ok && s.tier.store.contains_key(&key),
            },
            TierPending::Job(TierWork::Store {
                tier,
                job,
                keys,
                chunks,
            }) => {
                for (k, c) in keys.iter().zip(&chunks) {
                    let value = match ok {
                        true => TierValue::Shards(self.read_chunk(s, *c)),
                        false => TierValue::Torn,
                    };
                    s.tier.store.insert(*k, value);
                }
                TierReport::Finished {
                    tier,
                    job,
                    success: ok,
                    successful_keys: None,
                }
            }
            TierPending::Job(TierWork::Load {
                tier,
                job,
                keys,
                chunks,
                ..
            }) => self.promote(s, tier, job, &keys, &chunks, ok),
            TierPending::Job(TierWork::Probe { .. }) => return,
        };
        s.ghost.idle = 0;
        let conn = &mut s.engine.make_mut().scheduler_mut().connector_mut().inner;
        if let Err(e) = self.pair.report_tier(conn, report) {
            s.ghost
                .violate(property_names::CORE, format!("tier report refused: {e}"));
        }
    }

    /// A promotion: every key whose value is whole lands in its primary chunk on every rank;
    /// the others (missing, torn, or all of them when the job fails) leave garbage there.
    fn promote(
        &self,
        s: &mut SystemState<P>,
        tier: TierId,
        job: kvrelay_core::TierJobId,
        keys: &[OffloadKey],
        chunks: &[ChunkId],
        ok: bool,
    ) -> TierReport {
        let Some(model) = self.config.tier else {
            return TierReport::Finished {
                tier,
                job,
                success: false,
                successful_keys: None,
            };
        };
        let bpc = self.config.blocks_per_chunk as usize;
        let mut copied = Vec::new();
        for (k, c) in keys.iter().zip(chunks) {
            let value = match (ok, s.tier.store.get(k)) {
                (true, Some(TierValue::Shards(v))) => Some(v.clone()),
                (true, Some(TierValue::Torn)) if model.unchecked => {
                    Some(vec![CORRUPT; s.ranks.len() * bpc])
                }
                _ => None,
            };
            if value.is_some() {
                copied.push(*k);
            }
            self.write_chunk(s, *c, value.as_deref());
        }
        let success = copied.len() == keys.len();
        TierReport::Finished {
            tier,
            job,
            success,
            successful_keys: (!success && !copied.is_empty()).then_some(copied),
        }
    }

    /// The slots of primary chunk `c`.
    fn chunk_slots(&self, c: ChunkId) -> impl Iterator<Item = u64> {
        let bpc = u64::from(self.config.blocks_per_chunk);
        (0..bpc).map(move |i| u64::from(c.0) * bpc + i)
    }

    /// Every rank's shard of primary chunk `c`, rank after rank.
    fn read_chunk(&self, s: &SystemState<P>, c: ChunkId) -> Vec<u64> {
        s.ranks
            .iter()
            .flat_map(|r| {
                self.chunk_slots(c)
                    .map(|slot| r.external.get(&slot).copied().unwrap_or(EMPTY))
            })
            .collect()
    }

    /// Writes `shards` (rank after rank) into primary chunk `c` on every rank, or garbage.
    fn write_chunk(&self, s: &mut SystemState<P>, c: ChunkId, shards: Option<&[u64]>) {
        let bpc = self.config.blocks_per_chunk as usize;
        for (r, rank) in s.ranks.iter_mut().enumerate() {
            let rank = rank.make_mut();
            for (i, slot) in self.chunk_slots(c).enumerate() {
                let content = shards.map_or(CORRUPT, |v| v[r * bpc + i]);
                rank.external.insert(slot, content);
            }
        }
        for slot in self.chunk_slots(c) {
            if shards.is_some() {
                s.tier.promoted_slots.insert(slot);
            } else {
                s.tier.promoted_slots.remove(&slot);
            }
        }
    }

    /// A probe's answer is lost: the probe stays in flight for ever.
    pub(super) fn tier_lose(&self, s: &mut SystemState<P>, item: u8) {
        if usize::from(item) < s.tier.pending.len() {
            s.tier.pending.remove(usize::from(item));
            s.tier.lost_left = s.tier.lost_left.saturating_sub(1);
            s.tier.faulted = true;
        }
    }

    /// The store drops `key`.
    pub(super) fn tier_vanish(&self, s: &mut SystemState<P>, key: OffloadKey) {
        if s.tier.store.remove(&key).is_some() {
            s.tier.vanish_left = s.tier.vanish_left.saturating_sub(1);
            s.tier.faulted = true;
        }
    }
}
