//! The scheduler's configuration: the KV cache groups, the pool, the budgets, the mode.
//!
//! Build a [`SchedulerConfig`] (its `Default` is the small configuration the tests use) and hand
//! it to [`super::Scheduler::new`], which validates it.

use alloc::string::String;
use alloc::vec::Vec;

use super::SchedulerError;
use crate::Mode;

/// The attention type of a KV cache group.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Every block of the prefix is read at every step.
    FullAttention,
    /// Only the last `window` tokens are read: blocks entirely below the window are freed while
    /// the request runs (replaced by the null block).
    SlidingWindow {
        /// Window length in tokens (≥ 1).
        window: u32,
    },
}

/// What happens to requests whose external KV failed to load (`kv_load_failure_policy`).
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LoadFailurePolicy {
    /// vLLM's default: affected requests finish with `FINISHED_ERROR`.
    #[default]
    Fail,
    /// Affected requests recompute the tokens that failed to load.
    Recompute,
}

/// Scheduler configuration. [`SchedulerConfig::default`] is a small single-group engine.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerConfig {
    /// Tokens per block (≥ 1).
    pub block_size: u32,
    /// GPU blocks in the pool, the null block included (≥ 2).
    pub num_gpu_blocks: u32,
    /// KV cache groups, in order (1 to 8).
    pub groups: Vec<GroupKind>,
    /// Token budget per step (`max_num_batched_tokens`, ≥ 1).
    pub max_num_batched_tokens: u32,
    /// Running requests at most (`max_num_seqs`, ≥ 1).
    pub max_num_seqs: u32,
    /// Prompt plus output tokens at most.
    pub max_model_len: u32,
    /// Whether full blocks are cached and looked up by hash.
    pub enable_prefix_caching: bool,
    /// Whether a prompt may be split over steps.
    pub enable_chunked_prefill: bool,
    /// Cap on tokens per prefill chunk when several requests compete (0 = none).
    pub long_prefill_token_threshold: u32,
    /// Blocks kept free when admitting a waiting request while others run.
    pub watermark_blocks: u32,
    /// `kv_load_failure_policy`.
    pub load_failure_policy: LoadFailurePolicy,
    /// Steps scheduled ahead of their output: 1 = synchronous, 2 = async scheduling.
    pub async_depth: u32,
    /// Compat (vLLM exactly) or strict (stale and duplicate completions are errors).
    pub mode: Mode,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 64,
            groups: alloc::vec![GroupKind::FullAttention],
            max_num_batched_tokens: 256,
            max_num_seqs: 16,
            max_model_len: 1024,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            watermark_blocks: 0,
            load_failure_policy: LoadFailurePolicy::Fail,
            async_depth: 1,
            mode: Mode::Compat,
        }
    }
}

impl SchedulerConfig {
    /// Checks the ranges documented on each field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let bad = |what: &str| Err(SchedulerError::InvalidConfig(String::from(what)));
        if self.block_size == 0 {
            return bad("block_size must be at least 1");
        }
        if self.num_gpu_blocks < 2 || self.num_gpu_blocks == u32::MAX {
            return bad("num_gpu_blocks must be at least 2 (block 0 is the null block)");
        }
        if self.groups.is_empty() || self.groups.len() > 8 {
            return bad("groups must hold 1 to 8 KV cache groups");
        }
        if self
            .groups
            .iter()
            .any(|g| matches!(g, GroupKind::SlidingWindow { window: 0 }))
        {
            return bad("a sliding window must be at least 1 token");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_model_len < 2 {
            return bad("max_model_len must be at least 2");
        }
        if !(1..=8).contains(&self.async_depth) {
            return bad("async_depth must be 1 (synchronous) to 8");
        }
        Ok(())
    }
}
