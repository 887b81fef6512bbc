//! [`HitIndex`]: per prefix-cache key, the blocks carrying it by insertion number — a hash
//! lookup where an ordered map would take a tree descent. A prefix-cache lookup walks a prompt
//! block by block, and vLLM's scheduler repeats it for the request at the head of the queue
//! every step it cannot be admitted: on a 100 k-token prompt, thousands of lookups a step.
//!
//! The index is derived from the pool's per-block keys (the state of record) and is ignored by
//! `Hash` and `Eq`: two pools equal in everything else have equal indexes, so the model
//! checker's state identity is unchanged. Its hasher is fixed (no per-process seed) and it is
//! never iterated, so nothing depends on hash order.

use alloc::vec::Vec;
use core::hash::{BuildHasher, Hash, Hasher};

use hashbrown::HashMap;

use crate::ids::BlockId;
use crate::tokens::BlockHash;

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub(super) struct HitIndex {
    keys: HashMap<(u64, u8), Carriers, Fixed>,
    blocks: usize,
}

/// The blocks carrying one key, by insertion number (almost always one).
#[derive(Clone, Debug)]
enum Carriers {
    One(u64, BlockId),
    Many(Vec<(u64, BlockId)>),
}

impl HitIndex {
    /// The block a hit on `(hash, group)` returns: the earliest inserted.
    pub(super) fn first(&self, hash: BlockHash, group: u8) -> Option<BlockId> {
        match self.keys.get(&(hash.0, group))? {
            Carriers::One(_, b) => Some(*b),
            Carriers::Many(v) => v.first().map(|&(_, b)| b),
        }
    }

    /// Block `b` carries `(hash, group)` from now on, as insertion `n` (the latest).
    pub(super) fn insert(&mut self, hash: BlockHash, group: u8, n: u64, b: BlockId) {
        self.blocks += 1;
        let key = (hash.0, group);
        match self.keys.get_mut(&key) {
            None => {
                self.keys.insert(key, Carriers::One(n, b));
            }
            Some(Carriers::One(m, c)) => {
                let v = alloc::vec![(*m, *c), (n, b)];
                self.keys.insert(key, Carriers::Many(v));
            }
            Some(Carriers::Many(v)) => v.push((n, b)),
        }
    }

    /// Insertion `n` of `(hash, group)` no longer carries it.
    pub(super) fn remove(&mut self, hash: BlockHash, group: u8, n: u64) {
        let key = (hash.0, group);
        let emptied = match self.keys.get_mut(&key) {
            None => return,
            Some(Carriers::One(m, _)) => *m == n,
            Some(Carriers::Many(v)) => {
                v.retain(|&(m, _)| m != n);
                v.is_empty()
            }
        };
        self.blocks -= 1;
        if emptied {
            self.keys.remove(&key);
        }
    }

    /// Whether insertion `n` of `(hash, group)` is block `b` here.
    pub(super) fn holds(&self, hash: BlockHash, group: u8, n: u64, b: BlockId) -> bool {
        match self.keys.get(&(hash.0, group)) {
            None => false,
            Some(Carriers::One(m, c)) => (*m, *c) == (n, b),
            Some(Carriers::Many(v)) => v.contains(&(n, b)),
        }
    }

    /// Blocks indexed.
    pub(super) fn len(&self) -> usize {
        self.blocks
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
/// so one multiply-and-rotate per word spreads them (no per-process seed).
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
