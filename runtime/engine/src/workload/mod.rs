//! The requests `kvrelay run` serves: a request trace in the format of the public Mooncake traces
//! (one JSON object a line: `timestamp` in ms, `input_length`, `output_length`, `hash_ids` — one
//! id per prompt block of `hash_block_tokens` tokens, equal ids meaning an equal block), read
//! from a file or generated.
//!
//! The generated default is seeded and shaped like chat traffic: a few shared system prompts,
//! multi-turn conversations that re-send their whole history with every turn, Poisson
//! arrivals. Prompt tokens are derived from the hash ids, so equal ids give equal tokens and
//! therefore prefix-cache and offload hits, exactly where the trace says prefixes repeat.

use std::io::{BufRead, Write};
use std::path::Path;

use kvrelay_core::Token;

use crate::content::mix;
use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Clone, Debug, Eq, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    /// Arrival, in ms from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// One id per prompt block of `hash_block_tokens` tokens (the last block may be partial).
    pub hash_ids: Vec<u64>,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a trace record.
    #[error("{path}:{line}: {why}")]
    Record {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// Why.
        why: String,
    },
    /// The trace holds no request.
    #[error("{path}: no request")]
    Empty {
        /// The file.
        path: String,
    },
}

/// Reads a JSONL trace. Blank lines are skipped; records must arrive in timestamp order, have at
/// least one prompt and one output token, and no more hash ids than prompt blocks.
pub fn read_trace(path: &Path, hash_block_tokens: u32) -> Result<Vec<TraceRecord>, TraceError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    let mut out: Vec<TraceRecord> = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: name.clone(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| TraceError::Record {
            path: name.clone(),
            line: i + 1,
            why,
        };
        let r: TraceRecord = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        if r.input_length == 0 || r.output_length == 0 {
            return Err(bad(
                "input_length and output_length must be at least 1".into()
            ));
        }
        let blocks = r.input_length.div_ceil(hash_block_tokens.max(1));
        if r.hash_ids.len() as u64 > u64::from(blocks) {
            return Err(bad(format!(
                "{} hash_ids for {} prompt blocks of {hash_block_tokens} tokens",
                r.hash_ids.len(),
                blocks
            )));
        }
        if let Some(prev) = out.last()
            && r.timestamp < prev.timestamp
        {
            return Err(bad(format!(
                "timestamp {} before the previous {}",
                r.timestamp, prev.timestamp
            )));
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(TraceError::Empty { path: name });
    }
    Ok(out)
}

/// Writes `records` as a JSONL trace.
pub fn write_trace(path: &Path, records: &[TraceRecord]) -> Result<(), TraceError> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for r in records {
        let line = serde_json::to_string(r).expect("a trace record serializes");
        writeln!(f, "{line}").map_err(io)?;
    }
    f.flush().map_err(io)
}

/// A small deterministic generator (splitmix64).
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponentially distributed with mean `mean`.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// The shape of the generated default workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkloadConfig {
    /// Conversations.
    pub conversations: u32,
    /// Turns per conversation, at most (each has 1 to this many).
    pub max_turns: u32,
    /// Shared system prompts (each conversation starts with one).
    pub system_prompts: u32,
    /// Blocks of `hash_block_tokens` tokens per system prompt.
    pub system_prompt_blocks: u32,
    /// Tokens of a user message, at least and at most.
    pub user_tokens: (u32, u32),
    /// Output tokens of a turn, at least and at most.
    pub output_tokens: (u32, u32),
    /// Conversations started per second (Poisson).
    pub arrival_rate: f64,
    /// Mean time between a turn's arrival and the next turn's, in ms.
    pub think_ms: f64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            conversations: 160,
            max_turns: 4,
            system_prompts: 4,
            system_prompt_blocks: 8,
            user_tokens: (32, 256),
            output_tokens: (16, 96),
            arrival_rate: 8.0,
            think_ms: 2_000.0,
        }
    }
}

/// Generates the default workload: `conversations` conversations arriving as a Poisson process,
/// each on one of the shared system prompts, each turn re-sending the conversation so far (the
/// system prompt, every earlier user message and answer) plus a new user message.
pub fn generate(c: &WorkloadConfig, hash_block_tokens: u32, seed: u64) -> Vec<TraceRecord> {
    let hb = hash_block_tokens.max(1);
    let mut rng = Rng::new(seed);
    let mut next_id: u64 = 1;
    let mut fresh = |n: u32| -> Vec<u64> {
        let ids = (next_id..next_id + u64::from(n)).collect();
        next_id += u64::from(n);
        ids
    };
    let systems: Vec<Vec<u64>> = (0..c.system_prompts.max(1))
        .map(|_| fresh(c.system_prompt_blocks.max(1)))
        .collect();
    let mut out = Vec::new();
    let mut t = 0.0f64;
    for _ in 0..c.conversations {
        t += rng.exp(1_000.0 / c.arrival_rate.max(1e-3));
        let system = &systems[rng.range(0, systems.len() as u32 - 1) as usize];
        // The conversation so far, as whole hash blocks: a partial message is padded to a
        // block boundary by the next message's ids (each message starts a fresh block).
        let mut history: Vec<u64> = system.clone();
        let mut at = t;
        let turns = rng.range(1, c.max_turns.max(1));
        for _ in 0..turns {
            let user = rng.range(c.user_tokens.0, c.user_tokens.1.max(c.user_tokens.0));
            let output = rng.range(c.output_tokens.0, c.output_tokens.1.max(c.output_tokens.0));
            let mut ids = history.clone();
            ids.extend(fresh(user.div_ceil(hb)));
            let input = (ids.len() as u32 - 1) * hb + (user - 1) % hb + 1;
            out.push(TraceRecord {
                timestamp: at as u64,
                input_length: input,
                output_length: output,
                hash_ids: ids.clone(),
            });
            history = ids;
            history.extend(fresh(output.div_ceil(hb)));
            at += rng.exp(c.think_ms.max(1.0));
        }
    }
    out.sort_by_key(|r| r.timestamp);
    out
}

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

    // Protects trace validation: a bad line is a typed error naming the line.
    #[test]
    fn bad_trace_lines_name_the_line() {
        let dir = std::env::temp_dir().join(format!("kvrelay-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1]}\n\n\
             {\"timestamp\":5,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1,2]}\n",
        )
        .unwrap();
        let e = read_trace(&p, 16).unwrap_err().to_string();
        assert!(
            e.ends_with(":3: 2 hash_ids for 1 prompt blocks of 16 tokens"),
            "{e}"
        );
        assert_eq!(read_trace(&p, 5).unwrap().len(), 2);
        std::fs::write(&p, "{\"timestamp\":0}\n").unwrap();
        assert!(matches!(
            read_trace(&p, 8),
            Err(TraceError::Record { line: 1, .. })
        ));
        std::fs::write(&p, "\n").unwrap();
        assert!(matches!(read_trace(&p, 8), Err(TraceError::Empty { .. })));
        let recs = generate(&WorkloadConfig::default(), 64, 1);
        write_trace(&p, &recs).unwrap();
        assert_eq!(
            read_trace(&p, 64).unwrap(),
            recs,
            "written traces read back"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
