//! The offloading connector's configuration.

use alloc::string::String;

use super::manager::ManagerConfig;
use super::tiering::TieringConfig;

/// Configuration of the scheduler-side offloading connector.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadingConfig {
    /// GPU blocks per offloaded chunk (≥ 1).
    pub blocks_per_chunk: u32,
    /// Acknowledgements a job needs: the parallel world size (≥ 1).
    pub num_workers: u32,
    /// Store only prompt tokens (vLLM's default `offload_prompt_only = true`).
    pub offload_prompt_only: bool,
    /// Tokens that may be loaded synchronously per step (vLLM's `sync_load_budget_bytes`
    /// divided by the KV bytes per token); `0` disables synchronous loads.
    pub sync_load_budget_tokens: u32,
    /// The CPU manager's configuration (the primary tier's, when tiered).
    pub manager: ManagerConfig,
    /// Secondary tiers behind the CPU manager (vLLM's `TieringOffloadingManager`); `None`:
    /// the CPU manager alone.
    #[serde(default)]
    pub tiering: Option<TieringConfig>,
}

impl OffloadingConfig {
    /// A configuration with vLLM's defaults (prompt-only stores, no synchronous loads).
    pub fn new(blocks_per_chunk: u32, num_workers: u32, manager: ManagerConfig) -> Self {
        Self {
            blocks_per_chunk,
            num_workers,
            offload_prompt_only: true,
            sync_load_budget_tokens: 0,
            manager,
            tiering: None,
        }
    }
}

/// Errors of the offloading connector's construction.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadingError {
    /// A configuration value out of range.
    #[error("invalid offloading configuration: {0}")]
    InvalidConfig(String),
}
