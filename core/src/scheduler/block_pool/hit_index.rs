//! [`HitIndex`]: per prefix-cache key, the block a hit returns — a hash lookup where the block
//! pool's ordered map would take a tree descent. A prefix-cache lookup walks a prompt block by
//! block, and vLLM's scheduler repeats it for the request at the head of the queue every step
//! it cannot be admitted: on a 100 k-token prompt that is thousands of lookups per step.
//!
//! The index is derived from the pool's ordered map (which stays the state of record) and is
//! ignored by `Hash` and `Eq`: two pools equal in everything else have equal indexes, so the
//! model checker's state identity is unchanged. Its hasher is fixed (no per-process seed) and
//! it is never iterated, so nothing depends on hash order.

use core::hash::{BuildHasher, Hash, Hasher};

use hashbrown::HashMap;

use crate::ids::BlockId;
use crate::tokens::BlockHash;

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub(super) struct HitIndex(HashMap<(u64, u8), BlockId, Fixed>);

impl HitIndex {
    /// The block a hit on `(hash, group)` returns.
    pub(super) fn get(&self, hash: BlockHash, group: u8) -> Option<BlockId> {
        self.0.get(&(hash.0, group)).copied()
    }

    /// `b` carries `(hash, group)` now; it is the answer unless an earlier block carries it.
    pub(super) fn insert_if_absent(&mut self, hash: BlockHash, group: u8, b: BlockId) {
        self.0.entry((hash.0, group)).or_insert(b);
    }

    /// The answer for `(hash, group)` becomes `b` (`None`: no block carries it).
    pub(super) fn set(&mut self, hash: BlockHash, group: u8, b: Option<BlockId>) {
        match b {
            Some(b) => {
                self.0.insert((hash.0, group), b);
            }
            None => {
                self.0.remove(&(hash.0, group));
            }
        }
    }

    /// Keys indexed.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}

impl PartialEq for HitIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for HitIndex {}

impl Hash for HitIndex {
    fn hash<H: Hasher>(&self, _: &mut H) {}
}

/// A fixed hasher for keys that are hashes already: block hashes are uniformly distributed,
/// so one multiply-and-mix per word spreads them (no per-process seed).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Fixed;

impl BuildHasher for Fixed {
    type Hasher = Mixer;
    fn build_hasher(&self) -> Mixer {
        Mixer(0)
    }
}

/// See [`Fixed`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Mixer(u64);

impl Hasher for Mixer {
    fn finish(&self) -> u64 {
        let z = self.0 ^ (self.0 >> 29);
        z.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (z >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(23) ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
