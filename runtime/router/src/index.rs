//! What one engine holds, as its KV events tell it: a multiset of block hashes per medium (GPU
//! prefix cache, CPU offload pool), and the longest cached prefix of a prompt.
//!
//! Apply every event of every batch in sequence order ([`PrefixIndex::apply`]); ask
//! [`PrefixIndex::holds`] for each block of a prompt's vLLM hash chain, from the first, and stop
//! at the first block the engine holds in neither medium — that is the engine's longest cached
//! prefix, what its scheduler would find (a GPU hit) or load (a CPU hit).

use kvrelay_core::Medium;
use kvrelay_engine::events::WireEvent;
use rustc_hash::FxHashMap;

/// One engine's cached blocks, by vLLM block hash. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    gpu: FxHashMap<u64, u32>,
    cpu: FxHashMap<u64, u32>,
    /// Removals of a hash the index did not hold (an event lost, or a publisher's bug).
    pub unknown_removals: u64,
}

impl PrefixIndex {
    /// Applies one event.
    pub fn apply(&mut self, e: &WireEvent) {
        match e {
            WireEvent::Stored { medium, hashes, .. } => {
                let m = self.medium(*medium);
                for h in hashes {
                    *m.entry(*h).or_insert(0) += 1;
                }
            }
            WireEvent::Removed { medium, hashes, .. } => {
                for h in hashes {
                    let m = self.medium(*medium);
                    match m.get_mut(h) {
                        Some(n) if *n > 1 => *n -= 1,
                        Some(_) => {
                            m.remove(h);
                        }
                        None => self.unknown_removals += 1,
                    }
                }
            }
            WireEvent::AllCleared => self.gpu.clear(),
        }
    }

    fn medium(&mut self, m: Medium) -> &mut FxHashMap<u64, u32> {
        match m {
            Medium::Gpu => &mut self.gpu,
            Medium::Cpu => &mut self.cpu,
        }
    }

    /// Whether the engine holds block `h` in either medium.
    pub fn holds(&self, h: u64) -> bool {
        self.gpu.contains_key(&h) || self.cpu.contains_key(&h)
    }

    /// Distinct blocks held: GPU, CPU.
    pub fn sizes(&self) -> (usize, usize) {
        (self.gpu.len(), self.cpu.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(medium: Medium, hashes: &[u64]) -> WireEvent {
        WireEvent::Stored {
            medium,
            group: 0,
            hashes: hashes.to_vec(),
            parent: None,
            tokens: Vec::new(),
            block_size: 0,
        }
    }

    /// Protects the multiset: a block stored twice (two GPU blocks with one hash) is held until
    /// both are removed; a CPU copy keeps it held after the GPU's go; a reset clears the GPU
    /// cache only; an unknown removal is counted, not applied.
    #[test]
    fn holds_what_was_stored_and_not_removed() {
        let mut ix = PrefixIndex::default();
        ix.apply(&stored(Medium::Gpu, &[1, 1, 2]));
        ix.apply(&stored(Medium::Cpu, &[2]));
        let removed = |m, h: &[u64]| WireEvent::Removed {
            medium: m,
            group: 0,
            hashes: h.to_vec(),
        };
        ix.apply(&removed(Medium::Gpu, &[1]));
        assert!(ix.holds(1));
        ix.apply(&removed(Medium::Gpu, &[1, 2]));
        assert!(!ix.holds(1));
        assert!(ix.holds(2), "the CPU copy");
        ix.apply(&stored(Medium::Gpu, &[3]));
        ix.apply(&WireEvent::AllCleared);
        assert!(!ix.holds(3) && ix.holds(2));
        ix.apply(&removed(Medium::Cpu, &[9]));
        assert_eq!(ix.unknown_removals, 1);
    }
}
