//! The requests `kvrelay run` serves: a request trace in the format of the public Mooncake traces
//! (one JSON object a line: `timestamp` in ms, `input_length`, `output_length`, `hash_ids` — one
//! id per prompt block of `hash_block_tokens` tokens, equal ids meaning an equal block), read
//! from a file or generated.
//!
//! The generated default is seeded and shaped like chat traffic: a few shared system prompts,
//! multi-turn conversations that re-send their whole history with every turn, Poisson
//! arrivals. Prompt tokens are derived from the hash ids, so equal ids give equal tokens and
//! therefore prefix-cache and offload hits, exactly where the trace says prefixes repeat.
//!
//! | file | what |
//! | --- | --- |
//! | `mooncake.rs` | the trace format: [`TraceRecord`], [`read_trace`], [`write_trace`] |
//! | `generated.rs` | the generated default: [`WorkloadConfig`], [`generate`] |
//! | `reuse.rs` | the reuse a trace allows at most: [`unbounded_reuse`] |
//! | `split.rs` | one engine's share of a workload (`--trace-split K/N`): [`TraceSplit`] |
//! | this file | the tokens of a record's prompt ([`prompt_tokens`]) |

mod generated;
mod mooncake;
mod reuse;
mod split;

use kvrelay_core::Token;

pub(crate) use self::generated::Rng;
pub use self::generated::{WorkloadConfig, generate};
pub use self::mooncake::{TraceError, TraceRecord, read_trace, write_trace};
pub use self::reuse::{TraceReuse, unbounded_reuse};
pub use self::split::TraceSplit;

/// The prompt tokens of `r`: block `i` holds the tokens of `hash_ids[i]` (equal ids, equal
/// tokens); positions past the hash ids get tokens unique to request `unique`.
pub fn prompt_tokens(r: &TraceRecord, hash_block_tokens: u32, unique: u64) -> Vec<Token> {
    let hb = hash_block_tokens.max(1);
    (0..r.input_length)
        .map(|p| {
            let (block, offset) = (p / hb, p % hb);
            let seed = match r.hash_ids.get(block as usize) {
                Some(&id) => id,
                None => unique.wrapping_mul(0x1000_0001) ^ 0x8000_0000_0000_0000 ^ u64::from(block),
            };
            let mut g = Rng::new(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ u64::from(offset));
            (g.next_u64() % 50_000) as Token
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects where the trace says prefixes repeat: a later turn of a conversation starts with
    // the exact tokens of the earlier turn's prompt.
    #[test]
    fn later_turns_extend_earlier_prompts() {
        let c = WorkloadConfig {
            conversations: 6,
            max_turns: 3,
            ..WorkloadConfig::default()
        };
        let recs = generate(&c, 16, 7);
        assert!(recs.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let mut extended = 0;
        for a in &recs {
            for b in &recs {
                if b.hash_ids.len() > a.hash_ids.len() && b.hash_ids.starts_with(&a.hash_ids) {
                    let (pa, pb) = (prompt_tokens(a, 16, 1), prompt_tokens(b, 16, 2));
                    let whole = (a.hash_ids.len() as u32 - 1) * 16;
                    assert_eq!(pa[..whole as usize], pb[..whole as usize]);
                    extended += 1;
                }
            }
        }
        assert!(extended > 0, "some conversation has a second turn");
        for r in &recs {
            assert_eq!(r.input_length.div_ceil(16) as usize, r.hash_ids.len());
        }
        assert_eq!(generate(&c, 16, 7), recs, "seeded");
    }
}
