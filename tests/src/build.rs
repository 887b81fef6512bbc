//! Builders for the values the tests hand to the core: request ids and id sets, request specs,
//! lookup answers, transfer parameters, worker metadata, aggregated connector outputs, and the
//! configurations of ranks and of the CPU offloading manager.
//!
//! Use them wherever a test spells out one of these values; a test that needs a variant starts
//! from a builder and changes fields with struct update syntax
//! (`AggregatedOutput { failed_recving: ids(&[1]), ..empty_aggregated() }`,
//! `RequestSpec { stop_token: Some(42), ..spec(1, 20, 8) }`), so every file builds the same
//! value the same way. The generated values of the proptest strategies are in
//! [`crate::laws`]; these builders never draw anything at random.

use kvrelay_core::{
    AggregatedOutput, CpuOffloadingManager, Lookup, ManagerConfig, Meta, Params, PolicyKind,
    RankConfig, RequestId, RequestSpec, SchedulerConfig, SortedSet,
};

/// Request `n`.
pub fn rid(n: u32) -> RequestId {
    RequestId(n)
}

/// The set of requests `ns` (sorted, duplicates dropped).
pub fn ids(ns: &[u32]) -> SortedSet<RequestId> {
    ns.iter().map(|&n| rid(n)).collect()
}

/// Request `id` with the prompt `prompt`, `max_tokens` output tokens, no stop token and no
/// transfer parameters.
pub fn spec_with(id: u32, prompt: Vec<u32>, max_tokens: u32) -> RequestSpec {
    RequestSpec {
        id: rid(id),
        prompt,
        max_tokens,
        stop_token: None,
        kv_transfer_params: None,
    }
}

/// Request `id` with a `len`-token prompt of its own (token `i` is `1000 * id + i + 1`, so two
/// requests share no prefix), `max_tokens` output tokens; see [`spec_with`].
pub fn spec(id: u32, len: u32, max_tokens: u32) -> RequestSpec {
    spec_with(
        id,
        (0..len).map(|i| 1000 * id + i + 1).collect(),
        max_tokens,
    )
}

/// A connector's lookup answer: `tokens` external tokens, loaded asynchronously or not.
pub fn hit(tokens: u32, load_async: bool) -> Lookup {
    Lookup::Hit { tokens, load_async }
}

/// `kv_transfer_params` (or a connector's finish parameters) from key-value pairs.
pub fn params(kv: &[(&str, &str)]) -> Params {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `Meta::Set` worker metadata of `items`.
pub fn set_meta(items: &[&str]) -> Meta {
    Meta::Set(items.iter().map(|s| s.to_string()).collect())
}

/// An aggregated connector output that reports nothing: no finished sends or receives, no
/// invalid blocks or failed loads, no worker metadata or events, quorum 1. The base of struct
/// update literals for the outputs a test applies.
pub fn empty_aggregated() -> AggregatedOutput {
    AggregatedOutput {
        finished_sending: None,
        finished_recving: None,
        invalid_block_ids: SortedSet::new(),
        failed_recving: SortedSet::new(),
        worker_meta: None,
        kv_events: None,
        expected_finished_count: 1,
    }
}

/// The [`RankConfig`] of a rank that serves a scheduler configured with `config`: its block
/// size and KV cache groups, and `layers` layers.
pub fn rank_config(config: &SchedulerConfig, layers: u32) -> RankConfig {
    RankConfig {
        layers,
        block_size: config.block_size,
        groups: config.groups.clone(),
    }
}

/// A CPU offloading manager of `capacity_chunks` chunks under `policy`, storing a key at its
/// `store_threshold`-th offer.
///
/// # Panics
/// If the configuration is invalid (a capacity of 0).
pub fn cpu_manager(
    policy: PolicyKind,
    capacity_chunks: u32,
    store_threshold: u32,
) -> CpuOffloadingManager {
    CpuOffloadingManager::new(ManagerConfig {
        capacity_chunks,
        policy,
        store_threshold,
    })
    .expect("a valid manager config")
}
