//! The generated default workload: seeded and shaped like chat traffic — a few shared system
//! prompts, multi-turn conversations that re-send their whole history with every turn, Poisson
//! arrivals.

use serde::{Deserialize, Serialize};

use super::TraceRecord;
use crate::content::mix;

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
