//! vLLM 0.33.0's block hashes for kvrelay's: what a router that hashes a prompt as vLLM does
//! finds in kvrelay's events.
//!
//! kvrelay's core chains a fast 64-bit hash over each full block ([`kvrelay_core::hash_block`]);
//! vLLM chains SHA-256 over the pickled tuple `(parent, tokens, extra_keys)` (its default
//! `prefix_caching_hash_algo`, `sha256`), starting from `NONE_HASH` (the SHA-256 of the pickled
//! seed string, `"vllm-none-hash"` unless `PYTHONHASHSEED` is set), and publishes the low 64
//! bits of each digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by default). Both name a
//! block by its whole prefix, so the map from one to the other is a function: [`VllmHashes`]
//! computes vLLM's digest when the core first stores a block (its event brings the tokens and the
//! parent) and remembers it while the core may still name the block.
//!
//! kvrelay's requests carry no LoRA, multimodal input or cache salt, so `extra_keys` is always
//! `None`, as vLLM's is for such a request.

use kvrelay_core::{BlockHash, Token};
use rustc_hash::FxHashMap;
use sha2::{Digest, Sha256};

/// vLLM's seed for `NONE_HASH` when `PYTHONHASHSEED` is not set.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// A SHA-256 block hash as vLLM keeps it (`BlockHash`, 32 bytes).
pub type Digest32 = [u8; 32];

/// Tokens a block may have for its pickle to fit one pickle frame (64 KiB, as vLLM pickles;
/// larger ones split frames, which this encoder does not write).
pub const MAX_BLOCK_TOKENS: usize = 12_000;

/// The integer vLLM publishes for a digest: its last 8 bytes, big-endian.
pub fn external(d: &Digest32) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&d[24..]);
    u64::from_be_bytes(tail)
}

/// `NONE_HASH`: the SHA-256 of `pickle.dumps(seed, protocol=5)`.
pub fn none_hash(seed: &str) -> Digest32 {
    let s = seed.as_bytes();
    let mut body = Vec::with_capacity(s.len() + 8);
    if s.len() < 256 {
        body.push(0x8c); // SHORT_BINUNICODE
        body.push(s.len() as u8);
    } else {
        body.push(0x58); // BINUNICODE
        body.extend_from_slice(&(s.len() as u32).to_le_bytes());
    }
    body.extend_from_slice(s);
    body.push(0x94); // MEMOIZE
    sha256(&framed(&body))
}

/// `hash_block_tokens(sha256, parent, tokens, None)`: SHA-256 of
/// `pickle.dumps((parent, tuple(tokens), None), protocol=5)`. `tokens` must not exceed
/// [`MAX_BLOCK_TOKENS`].
pub fn block_hash(parent: &Digest32, tokens: &[Token]) -> Digest32 {
    let mut body = Vec::with_capacity(40 + tokens.len() * 5);
    body.extend_from_slice(&[0x43, 32]); // SHORT_BINBYTES, 32 bytes
    body.extend_from_slice(parent);
    body.push(0x94); // MEMOIZE
    match tokens.len() {
        0 => body.push(0x29), // EMPTY_TUPLE (not memoized)
        n => {
            if n > 3 {
                body.push(0x28); // MARK
            }
            for &t in tokens {
                pickle_int(&mut body, t);
            }
            body.push([0, 0x85, 0x86, 0x87, 0x74][n.min(4)]); // TUPLE1..3, TUPLE
            body.push(0x94);
        }
    }
    body.extend_from_slice(&[0x4e, 0x87, 0x94]); // NONE, TUPLE3, MEMOIZE
    sha256(&framed(&body))
}

/// A non-negative int as pickle writes it: BININT1, BININT2, BININT, or LONG1 past `i32`.
fn pickle_int(out: &mut Vec<u8>, t: Token) {
    if t < 0x100 {
        out.extend_from_slice(&[0x4b, t as u8]);
    } else if t < 0x1_0000 {
        out.push(0x4d);
        out.extend_from_slice(&(t as u16).to_le_bytes());
    } else if t < 0x8000_0000 {
        out.push(0x4a);
        out.extend_from_slice(&t.to_le_bytes());
    } else {
        // Two's complement, little-endian, with a zero byte so the sign stays positive.
        out.extend_from_slice(&[0x8a, 5]);
        out.extend_from_slice(&t.to_le_bytes());
        out.push(0);
    }
}

/// PROTO 5, one FRAME holding `body` and STOP, as pickle writes a small object.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 12);
    out.extend_from_slice(&[0x80, 5, 0x95]);
    out.extend_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    out.extend_from_slice(body);
    out.push(0x2e); // STOP
    out
}

fn sha256(bytes: &[u8]) -> Digest32 {
    Sha256::digest(bytes).into()
}

/// A block the map cannot name: kvrelay's bug (the core named a block it never stored), said so.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
#[error("block hash {0:#018x} was never stored (a kvrelay bug)")]
pub struct Unmapped(pub u64);

/// Entries beyond twice what the last sweep kept before the next sweep.
const SWEEP_SLACK: usize = 1 << 16;

/// kvrelay's block hashes → vLLM's digests. Call [`VllmHashes::chain`] for each stored run of
/// blocks, [`VllmHashes::get`] for each hash an event names again, and [`VllmHashes::sweep`]
/// when [`VllmHashes::wants_sweep`] says so, with every hash the core may still name: the map
/// stays about as large as what the core holds (amortized O(1) a block).
#[derive(Debug)]
pub struct VllmHashes {
    none: Digest32,
    map: FxHashMap<BlockHash, Digest32>,
    kept: usize,
}

impl VllmHashes {
    /// An empty map for vLLM's `NONE_HASH` seed `seed` ([`DEFAULT_SEED`] unless the engines
    /// it must agree with set `PYTHONHASHSEED`).
    pub fn new(seed: &str) -> Self {
        Self {
            none: none_hash(seed),
            map: FxHashMap::default(),
            kept: 0,
        }
    }

    /// The digest of a hash the core stored.
    pub fn get(&self, h: BlockHash) -> Result<&Digest32, Unmapped> {
        self.map.get(&h).ok_or(Unmapped(h.0))
    }

    /// vLLM's digests of `hashes`, full blocks of `block_size` `tokens` chained after `parent`
    /// (`None`: the first block), remembered for later events.
    pub fn chain(
        &mut self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        tokens: &[Token],
        block_size: usize,
    ) -> Result<Vec<Digest32>, Unmapped> {
        let mut prev = match parent {
            None => self.none,
            Some(p) => *self.get(p)?,
        };
        let mut out = Vec::with_capacity(hashes.len());
        for (h, block) in hashes.iter().zip(tokens.chunks(block_size.max(1))) {
            let d = *self
                .map
                .entry(*h)
                .or_insert_with(|| block_hash(&prev, block));
            out.push(d);
            prev = d;
        }
        Ok(out)
    }

    /// Whether the map has grown enough since the last sweep to sweep again.
    pub fn wants_sweep(&self) -> bool {
        self.map.len() > 2 * self.kept + SWEEP_SLACK
    }

    /// Keeps only the hashes in `live`.
    pub fn sweep(&mut self, live: impl IntoIterator<Item = BlockHash>) {
        let mut keep = FxHashMap::default();
        for h in live {
            if let Some(d) = self.map.get(&h) {
                keep.insert(h, *d);
            }
        }
        self.kept = keep.len();
        self.map = keep;
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Protects the pickle encoding the digests rest on: the bytes Python 3's
    /// `pickle.dumps((b"\x01" * 32, (1, 2, 300, 70000, 2**31 - 1, 2**31), None), protocol=5)`
    /// writes (taken from CPython; the judge is `tests/kv_events`, which recomputes every
    /// published hash with vLLM's own function).
    #[test]
    fn pickles_as_python_does() {
        let mut body = vec![0x43, 32];
        body.extend_from_slice(&[1u8; 32]);
        body.push(0x94);
        body.push(0x28);
        for t in [1, 2, 300, 70000, 0x7fff_ffff, 0x8000_0000] {
            pickle_int(&mut body, t);
        }
        body.extend_from_slice(&[0x74, 0x94, 0x4e, 0x87, 0x94]);
        assert_eq!(
            hex(&framed(&body)),
            "8005954200000000000000432001010101010101010101010101010101010101010101010101010101\
             0101010194284b014b024d2c014a701101004affffff7f8a05000000800074944e87942e"
        );
    }

    /// Protects `NONE_HASH`: `hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5))`.
    #[test]
    fn none_hash_is_vllms() {
        assert_eq!(
            hex(&none_hash(DEFAULT_SEED)),
            hex(&sha256(&framed(
                &[&[0x8c, 14][..], b"vllm-none-hash", &[0x94]].concat()
            )))
        );
    }

    /// Protects the chain: a block's digest depends on its parent's, and a hash the core names
    /// again maps to the digest first computed; an unknown parent is an error, not a guess.
    #[test]
    fn chains_and_remembers() {
        let mut m = VllmHashes::new(DEFAULT_SEED);
        let (a, b) = (BlockHash(1), BlockHash(2));
        let d = m.chain(None, &[a, b], &[1, 2, 3, 4], 2).unwrap();
        assert_eq!(d[0], block_hash(&none_hash(DEFAULT_SEED), &[1, 2]));
        assert_eq!(d[1], block_hash(&d[0], &[3, 4]));
        assert_eq!(m.chain(Some(a), &[b], &[3, 4], 2).unwrap(), vec![d[1]]);
        assert_eq!(
            m.chain(Some(BlockHash(9)), &[b], &[3, 4], 2),
            Err(Unmapped(9))
        );
        m.sweep([b]);
        assert_eq!(m.get(a), Err(Unmapped(1)));
        assert_eq!(m.get(b), Ok(&d[1]));
    }
}
