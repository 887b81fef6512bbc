//! What the bytes of a KV block must be, so that every load and every read can be checked.
//!
//! There is no model: the forward pass writes, into the slot of every token it computes, a word
//! derived from the token's **prefix** (a rolling hash over the request's tokens up to and
//! including it), the layer, the KV cache group and the rank. Two requests with the same prefix
//! therefore write the same bytes, as a real model's KV would be — which is what makes prefix
//! caching and offloading correct — and any block holding another prefix's KV (a wrong load, a
//! block reused while a transfer still wrote it, a corrupted host slot) shows at the next check.
//!
//! A token's slot is `block_bytes / block_size` bytes of its block in each layer, filled with its
//! word repeated (little-endian).

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

use kvrelay_core::{RequestId, Token};

/// `0` marks a slot never written (a rolling hash is never 0: see [`roll`]).
pub const UNWRITTEN: u64 = 0;

/// Marks a slot a failed transfer left half-written: no token has this prefix hash (as far as a
/// 64-bit hash can promise), so a check that expects real content there reports it.
pub const POISON: u64 = u64::MAX;

pub fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The prefix hash after `token`, given the prefix hash before it (`0` for the first token).
pub fn roll(prefix: u64, token: Token) -> u64 {
    let h = mix(prefix ^ mix(u64::from(token) ^ 0x9e37_79b9_7f4a_7c15));
    if h == UNWRITTEN { 1 } else { h }
}

/// Appends to `prefixes` (the prefix hashes of a request's tokens so far) those of `tokens`,
/// which follow them.
pub fn extend_prefixes(prefixes: &mut Vec<u64>, tokens: &[Token]) {
    let mut h = prefixes.last().copied().unwrap_or(0);
    prefixes.reserve(tokens.len());
    for &t in tokens {
        h = roll(h, t);
        prefixes.push(h);
    }
}

/// The word a token with prefix hash `prefix` has in `layer` of `group` on `rank`.
pub fn word(prefix: u64, layer: u32, group: u32, rank: u32) -> u64 {
    salted(prefix, salt(layer, group, rank))
}

/// What [`word`] mixes in for `layer` of `group` on `rank`: computed once per layer.
pub fn salt(layer: u32, group: u32, rank: u32) -> u64 {
    mix((u64::from(layer) << 40) | (u64::from(group) << 20) | u64::from(rank))
}

/// [`word`] given its [`salt`].
pub fn salted(prefix: u64, salt: u64) -> u64 {
    mix(prefix ^ salt)
}

/// Fills `slot` with `w`.
pub fn fill(slot: &mut [u8], w: u64) {
    let bytes = w.to_le_bytes();
    for chunk in slot.chunks_exact_mut(8) {
        chunk.copy_from_slice(&bytes);
    }
}

/// Whether `slot` holds `w` in every word.
pub fn holds(slot: &[u8], w: u64) -> bool {
    let bytes = w.to_le_bytes();
    slot.chunks_exact(8).all(|c| c == bytes)
}

/// Per request, the prefix hash of every token known so far: what a rank needs to derive the
/// content of any block of the request. Fed by the engine with each step (prompts of new
/// requests, tokens sampled since), emptied when the engine releases a request.
#[derive(Debug, Default)]
pub struct TokenBook {
    prefixes: HashMap<RequestId, Vec<u64>>,
}

impl TokenBook {
    /// Appends `tokens` to `request`'s tokens.
    pub fn extend(&mut self, request: RequestId, tokens: &[Token]) {
        extend_prefixes(self.prefixes.entry(request).or_default(), tokens);
    }

    /// Forgets `request`.
    pub fn forget(&mut self, request: RequestId) {
        self.prefixes.remove(&request);
    }

    /// The prefix hashes of `request`'s tokens at `positions`, if all are known.
    pub fn prefixes(&self, request: RequestId, positions: Range<u32>) -> Option<&[u64]> {
        let v = self.prefixes.get(&request)?;
        v.get(positions.start as usize..positions.end as usize)
    }

    /// How many of `request`'s tokens are known.
    pub fn known(&self, request: RequestId) -> u32 {
        self.prefixes.get(&request).map_or(0, |v| v.len() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects what makes prefix caching checkable: equal prefixes give equal words, a
    // different earlier token changes every later word.
    #[test]
    fn words_follow_the_prefix_not_the_request() {
        let mut b = TokenBook::default();
        b.extend(RequestId(1), &[5, 6, 7]);
        b.extend(RequestId(2), &[5, 6]);
        b.extend(RequestId(2), &[7]);
        b.extend(RequestId(3), &[9, 6, 7]);
        let p = |r, i: u32| b.prefixes(RequestId(r), i..i + 1).unwrap()[0];
        assert_eq!(p(1, 2), p(2, 2));
        assert_ne!(p(1, 1), p(3, 1));
        assert_ne!(p(1, 2), p(3, 2));
        assert_ne!(
            word(p(1, 0), 0, 0, 0),
            word(p(1, 0), 1, 0, 0),
            "layers differ"
        );
        assert_ne!(
            word(p(1, 0), 0, 0, 0),
            word(p(1, 0), 0, 0, 1),
            "ranks differ"
        );
        let mut slot = [0u8; 32];
        fill(&mut slot, word(p(1, 2), 0, 0, 0));
        assert!(holds(&slot, word(p(2, 2), 0, 0, 0)));
        assert!(!holds(&slot, word(p(3, 2), 0, 0, 0)));
        slot[31] ^= 1;
        assert!(
            !holds(&slot, word(p(2, 2), 0, 0, 0)),
            "one flipped bit shows"
        );
        b.forget(RequestId(1));
        assert_eq!(b.prefixes(RequestId(1), 0..1), None);
        assert_eq!(b.prefixes(RequestId(2), 2..4), None, "token 3 unknown");
        assert_eq!(b.known(RequestId(2)), 3);
    }
}
