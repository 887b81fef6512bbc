//! Tokens and the chained block hashes of the prefix cache (vLLM's `BlockHash`).
//!
//! Every room shares these: the scheduler hashes a request's full blocks as its tokens arrive,
//! the pool keys its prefix cache by them, the offloading connector keys CPU chunks by them.

/// The hash of a full block of tokens, chained over the prefix (vLLM's `BlockHash`).
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// A token id.
pub type Token = u32;

/// The hash of one full block given the hash of the block before it: FNV-1a over the parent
/// hash and the tokens. Deterministic on every platform (no `RandomState`).
pub fn hash_block(parent: Option<BlockHash>, tokens: &[Token]) -> BlockHash {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    };
    match parent {
        Some(p) => eat(&p.0.to_le_bytes()),
        None => eat(&[0xff]),
    }
    for t in tokens {
        eat(&t.to_le_bytes());
    }
    BlockHash(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block's hash names its whole prefix: it depends on the parent and on the tokens, in
    /// order (the prefix cache and the offloading keys rely on it).
    #[test]
    fn hash_chain_depends_on_parent_and_tokens() {
        let a = hash_block(None, &[1, 2]);
        assert_eq!(a, hash_block(None, &[1, 2]));
        assert_ne!(a, hash_block(None, &[2, 1]));
        assert_ne!(hash_block(Some(a), &[3]), hash_block(None, &[3]));
    }
}
