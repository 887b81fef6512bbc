//! KV events reported by connectors, and their scheduler-side accumulation (SEMANTICS.md §4.5).
//!
//! A worker reports its events with contributor count 1; the aggregator appends the events of
//! every further rank that reported some and adds 1 per such rank; the scheduler-side connector
//! accumulates across steps ([`EventAccumulator::update`]) and, once per `update_from_output`,
//! yields the events that every contributor reported ([`EventAccumulator::take`]).

use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::num::NonZeroU32;

use crate::tokens::{BlockHash, Token};

/// Where a cached block lives (vLLM's `medium` in its KV events).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
pub enum Medium {
    /// The GPU prefix cache (the block pool).
    Gpu,
    /// The CPU offload pool (the offloading manager).
    Cpu,
}

impl Medium {
    /// vLLM's name: `"GPU"` or `"CPU"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

/// A prefix-cache event, structured as vLLM 0.33.0 publishes it (`BlockStored`, `BlockRemoved`,
/// `AllBlocksCleared` in its KV-events module), with kvrelay's block hashes. Built only when an
/// embedder switches events on; a publisher maps the hashes to vLLM's and puts them on a wire.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum CacheEvent {
    /// Blocks entered a cache. `hashes` continue the chain after `parent` (`None`: from the
    /// first block); `tokens` are the blocks' tokens, `block_size` a block's token count. The
    /// CPU placeholder payload (vLLM's default for offloaded chunks) has one hash, no parent,
    /// no tokens and block size 0.
    Stored {
        /// Where the blocks are.
        medium: Medium,
        /// The KV cache group.
        group: u32,
        /// The blocks' hashes, in chain order.
        hashes: Vec<BlockHash>,
        /// The hash of the block before the first one.
        parent: Option<BlockHash>,
        /// The blocks' tokens (`hashes.len() * block_size` of them, or none).
        tokens: Vec<Token>,
        /// Tokens per block (0 in the CPU placeholder).
        block_size: u32,
    },
    /// Blocks left a cache.
    Removed {
        /// Where the blocks were.
        medium: Medium,
        /// The KV cache group.
        group: u32,
        /// Their hashes.
        hashes: Vec<BlockHash>,
    },
    /// The GPU prefix cache was reset: every block left it.
    AllCleared,
}

impl From<&CacheEvent> for KvEvent {
    /// The opaque form the scheduler's event list carries (and conformance compares).
    fn from(e: &CacheEvent) -> Self {
        let raw = |hashes: &[BlockHash]| hashes.iter().map(|h| h.0).collect::<Vec<u64>>();
        KvEvent(match e {
            CacheEvent::Stored {
                medium,
                group,
                hashes,
                block_size,
                ..
            } => format!(
                "BlockStored(medium={}, group={group}, hashes={:?}, block_size={block_size})",
                medium.as_str(),
                raw(hashes)
            ),
            CacheEvent::Removed {
                medium,
                group,
                hashes,
            } => format!(
                "BlockRemoved(medium={}, group={group}, hashes={:?})",
                medium.as_str(),
                raw(hashes)
            ),
            CacheEvent::AllCleared => String::from("AllBlocksCleared()"),
        })
    }
}

/// One KV event (in vLLM a `KVCacheEvent`; here an opaque, comparable value).
#[derive(
    Clone, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct KvEvent(pub String);

/// A batch of events with the number of workers that contributed to it (vLLM's
/// `KVConnectorKVEvents`). `events` is a multiset: an event reported by two ranks appears twice.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvEvents {
    /// The events, as a multiset (order is not significant).
    pub events: Vec<KvEvent>,
    /// Contributors (never 0: a batch exists only because someone reported it).
    pub workers: NonZeroU32,
}

impl KvEvents {
    /// One worker's batch (contributor count 1).
    pub fn from_worker(events: Vec<KvEvent>) -> Self {
        Self {
            events,
            workers: NonZeroU32::MIN,
        }
    }

    /// The events sorted, so that equal multisets compare equal.
    pub fn normalized(mut self) -> Self {
        self.events.sort_unstable();
        self
    }
}

/// The scheduler-side accumulation of connector KV events between two `take_events` calls.
///
/// Call [`update`](Self::update) from `update_connector_output` with the aggregated output's
/// events, and [`take`](Self::take) from `take_events`.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EventAccumulator {
    /// Occurrences per event, and the contributor count; `None` before the first report since the
    /// last take (vLLM keeps no object then, which matters: the first batch's count is taken as
    /// is, later ones add theirs).
    pending: Option<(BTreeMap<KvEvent, u32>, u32)>,
}

impl EventAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one aggregated step's events (`None`: the step reported no events; nothing changes).
    pub fn update(&mut self, events: Option<&KvEvents>) {
        self.update_unchecked(events);
        crate::debug_assert_invariants!(self);
    }

    fn update_unchecked(&mut self, events: Option<&KvEvents>) {
        let Some(batch) = events else { return };
        let (counts, workers) = self.pending.get_or_insert_with(|| (BTreeMap::new(), 0));
        *workers = workers.saturating_add(batch.workers.get());
        for e in &batch.events {
            *counts.entry(e.clone()).or_insert(0) += 1;
        }
    }

    /// The events reported by every contributor since the last take (an event whose occurrence
    /// count equals the contributor count), each once, ascending; then empties.
    pub fn take(&mut self) -> Vec<KvEvent> {
        let out = self.take_unchecked();
        crate::debug_assert_invariants!(self);
        out
    }

    fn take_unchecked(&mut self) -> Vec<KvEvent> {
        match self.pending.take() {
            None => Vec::new(),
            Some((counts, workers)) => counts
                .into_iter()
                .filter(|&(_, n)| n == workers)
                .map(|(e, _)| e)
                .collect(),
        }
    }

    /// Checks the accumulator's invariant: a pending batch has at least one contributor.
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        if let Some((counts, workers)) = &self.pending {
            crate::ensure_invariant!(
                *workers >= 1,
                "§4.5",
                "pending events with contributor count 0"
            );
            crate::ensure_invariant!(
                counts.values().all(|&n| n >= 1),
                "§4.5",
                "an event with zero occurrences is tracked"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_invariants_rejects_corrupt_accumulations() {
        // Protects the event quorum (§4.5) as the model checker sees it: `update` cannot build
        // these states, so only a corrupted accumulator shows that the check looks at all.
        let mut acc = EventAccumulator::new();
        acc.update(Some(&KvEvents::from_worker(alloc::vec![KvEvent(
            "e".into()
        )])));
        assert_eq!(acc.check_invariants(), Ok(()));
        let zero_contributors = EventAccumulator {
            pending: Some((BTreeMap::new(), 0)),
        };
        assert!(zero_contributors.check_invariants().is_err());
        let zero_occurrences = EventAccumulator {
            pending: Some((BTreeMap::from([(KvEvent("e".into()), 0)]), 1)),
        };
        assert!(zero_occurrences.check_invariants().is_err());
    }
}
