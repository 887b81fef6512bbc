//! [`unbounded_reuse`]: the prefix reuse a trace allows at most — what a cache that never evicts
//! would reuse of its prompts, block by hash block. A run's own reuse is reported beside it.

use std::collections::HashSet;

use serde::Serialize;

use super::TraceRecord;

/// The reuse an unbounded cache of a trace's hash blocks would see.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TraceReuse {
    /// Prompt hash blocks, and those that were hits.
    pub blocks: u64,
    pub hit_blocks: u64,
    /// Prompt tokens, and those in hit blocks.
    pub tokens: u64,
    pub hit_tokens: u64,
}

impl TraceReuse {
    /// Hit tokens, in % of prompt tokens.
    pub fn token_pct(&self) -> f64 {
        pct(self.hit_tokens, self.tokens)
    }

    /// Hit blocks, in % of prompt blocks.
    pub fn block_pct(&self) -> f64 {
        pct(self.hit_blocks, self.blocks)
    }
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

/// Requests in order; a request's hit is the longest run of its leading hash ids that earlier
/// requests carried (at the same position: an id is a prefix hash), in blocks of
/// `hash_block_tokens` (the last one may be partial). Nothing is evicted and nothing waits for a
/// computation to finish: an upper bound for a run's prefix reuse.
pub fn unbounded_reuse(records: &[TraceRecord], hash_block_tokens: u32) -> TraceReuse {
    let hb = u64::from(hash_block_tokens.max(1));
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = TraceReuse::default();
    for r in records {
        let hits = r.hash_ids.iter().take_while(|id| seen.contains(id)).count() as u64;
        out.blocks += r.hash_ids.len() as u64;
        out.hit_blocks += hits;
        out.tokens += u64::from(r.input_length);
        out.hit_tokens += (hits * hb).min(u64::from(r.input_length));
        seen.extend(r.hash_ids.iter().copied());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(input_length: u32, hash_ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: 0,
            input_length,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
        }
    }

    // Protects the bound's definition: a hit is a run of leading ids seen before, stopping at
    // the first miss, and a partial last block counts its own tokens only.
    #[test]
    fn a_hit_is_the_leading_run_of_seen_blocks() {
        let recs = [rec(10, &[1, 2, 3]), rec(9, &[1, 2, 4]), rec(4, &[5, 2])];
        let r = unbounded_reuse(&recs, 4);
        assert_eq!((r.blocks, r.hit_blocks), (8, 2));
        assert_eq!((r.tokens, r.hit_tokens), (23, 8));
        let r = unbounded_reuse(&[rec(10, &[1, 2, 3]), rec(10, &[1, 2, 3])], 4);
        assert_eq!(r.hit_tokens, 10, "the partial last block counts 2 tokens");
    }

    // Protects the figure the docs quote: the shipped Mooncake trace's bound is the one its
    // README states (36.6 % of prompt blocks, 37.4 % of prompt tokens).
    #[test]
    fn the_shipped_trace_allows_what_its_readme_says() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/traces/mooncake/conversation_trace.jsonl.gz"
        );
        let recs = super::super::read_trace(std::path::Path::new(path), 512).unwrap();
        let r = unbounded_reuse(&recs, 512);
        assert_eq!(recs.len(), 12_031);
        assert_eq!(
            format!("{:.1} {:.1}", r.block_pct(), r.token_pct()),
            "36.6 37.4"
        );
    }
}
