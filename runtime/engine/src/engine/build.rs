//! Building an engine: its pools and KV layouts, its scheduler's configuration, its connector
//! (offloading, with a shared tier's pools; or P/D, with a prefill engine's served arenas),
//! each rank's setup — every configuration error found here, before a rank starts.

use kvrelay_core::{
    Either, GroupKind, KvLayout, LayoutError, LayoutOrder, ManagerConfig, Mode, OffloadingConfig,
    OffloadingConnector, PdConnector, SchedulerConfig, TieringConfig,
};

use crate::connector::EngineConnector;
use crate::pd::PdRole;
use crate::rank::{RankPd, RankSetup};
use crate::tier::Pools;
use crate::transfer::host::{HostArena, HostPool};
use crate::{RunConfig, RunError};

/// The offloading connector's configuration: `cpu_blocks` per rank, the run's policy.
pub(super) fn offloading(c: &RunConfig, cpu_blocks: u32) -> OffloadingConfig {
    OffloadingConfig::new(
        c.blocks_per_chunk,
        c.ranks,
        ManagerConfig {
            capacity_chunks: cpu_blocks / c.blocks_per_chunk,
            policy: c.policy,
            store_threshold: 0,
        },
    )
}

/// The engine's connector: the offloading connector of `off`; on one side of a P/D pair
/// ([`RunConfig::pd`]) the MultiConnector over the P/D connector and it.
pub(super) fn connector(
    c: &RunConfig,
    backend: crate::Backend,
    off: OffloadingConfig,
    sc: &SchedulerConfig,
) -> Result<EngineConnector, RunError> {
    let off = OffloadingConnector::new(off, sc).map_err(|e| RunError::Config(e.to_string()))?;
    match &c.pd {
        None => Ok(Either::Left(Box::new(off))),
        Some(p) => {
            check_pd(c, backend)?;
            crate::connector::pd_engine(PdConnector::new(p.connector()), off)
                .map_err(|e| RunError::Config(e.to_string()))
        }
    }
}

/// Rank `r`'s setup (without the pools and arenas the engine shares with it).
pub(super) fn rank_setup(
    c: &RunConfig,
    r: u32,
    backend: crate::Backend,
    (gpu, host): (&KvLayout, &KvLayout),
    sc: &SchedulerConfig,
) -> RankSetup {
    RankSetup {
        rank: r,
        backend,
        gpu: gpu.clone(),
        host: host.clone(),
        block_size: c.block_size,
        blocks_per_chunk: c.blocks_per_chunk,
        groups: sc.groups.clone(),
        mode: sc.mode,
        check: c.check,
        timeline: c.timeline.is_some(),
        completions: c.completions,
        host_pool: None,
        shared_pool: None,
        pd: c.pd.as_ref().map(|p| RankPd {
            failures_as_blocks: true,
            source: p.source.clone(),
        }),
        arena: None,
    }
}

pub(super) fn layouts(
    c: &RunConfig,
    gpu_blocks: u32,
    cpu_blocks: u32,
) -> Result<(KvLayout, KvLayout), RunError> {
    let bad = |e: LayoutError| RunError::Config(e.to_string());
    let block_bytes = c.block_bytes();
    if c.block_size == 0 || !block_bytes.is_multiple_of(8 * u64::from(c.block_size)) {
        return Err(RunError::Config(format!(
            "block_bytes ({}) must be a positive multiple of 8 × block_size ({})",
            block_bytes, c.block_size
        )));
    }
    let gpu = KvLayout::new(
        vec![0; c.layers as usize],
        gpu_blocks,
        block_bytes,
        LayoutOrder::LayerMajor,
    )
    .map_err(bad)?;
    let host = gpu
        .with_blocks(cpu_blocks, LayoutOrder::LayerMajor)
        .map_err(bad)?;
    Ok((gpu, host))
}

/// The GPU and CPU pools per rank for requests of at most `max_model_len` tokens: refused when
/// the GPU pool cannot hold one (as vLLM refuses it at start-up).
pub(super) fn pools(c: &RunConfig, max_model_len: u32) -> Result<(u32, u32), RunError> {
    let gpu_blocks = c.gpu_blocks_for(max_model_len);
    let cpu_blocks = c.cpu_blocks_for(gpu_blocks);
    if c.blocks_per_chunk == 0 || !cpu_blocks.is_multiple_of(c.blocks_per_chunk) {
        return Err(RunError::Config(
            "cpu_blocks must be a positive multiple of blocks_per_chunk".into(),
        ));
    }
    let needed = max_model_len.div_ceil(c.block_size.max(1));
    if gpu_blocks.saturating_sub(1) < needed {
        return Err(RunError::PoolTooSmall {
            max_model_len,
            block_size: c.block_size,
            needed,
            gpu_blocks,
        });
    }
    Ok((gpu_blocks, cpu_blocks))
}

/// The scheduler of a run: one full-attention group, prefix caching and chunked prefill on.
pub(super) fn scheduler_config(
    c: &RunConfig,
    gpu_blocks: u32,
    max_model_len: u32,
) -> SchedulerConfig {
    SchedulerConfig {
        block_size: c.block_size,
        num_gpu_blocks: gpu_blocks,
        groups: vec![GroupKind::FullAttention],
        max_num_batched_tokens: c.max_batched_tokens(),
        max_num_seqs: c.max_seqs(),
        max_model_len,
        enable_prefix_caching: true,
        enable_chunked_prefill: true,
        async_depth: c.async_depth,
        mode: c.mode,
        ..SchedulerConfig::default()
    }
}

/// With a shared tier: its manager in the connector's config, and the CPU pools the engine
/// shares with its ranks (`None` without a tier).
pub(super) fn tier_pools(
    c: &RunConfig,
    backend: crate::Backend,
    host: &KvLayout,
    off: &mut OffloadingConfig,
) -> Result<Option<Pools>, RunError> {
    let Some(t) = &c.tier else {
        return Ok(None);
    };
    check_tier(backend)?;
    off.tiering = Some(TieringConfig {
        tiers: 1,
        deadline_steps: (c.mode == Mode::Strict).then_some(t.deadline_steps.max(1)),
        promoted_most_recent: c.mode == Mode::Strict,
        hold_promoted: c.mode == Mode::Strict,
    });
    // A worker process's pool is a memory file the engine's tier maps too.
    let bytes = host.total_bytes() as usize;
    let pools = (0..c.ranks)
        .map(|_| match c.workers {
            crate::config::Workers::InProcess => Ok(HostPool::new(bytes)),
            crate::config::Workers::Process => HostPool::shared(bytes).map_err(|e| {
                RunError::Config(format!(
                    "--tier with worker processes: a shared CPU pool of {bytes} bytes: {e}"
                ))
            }),
        })
        .collect::<Result<_, _>>()?;
    Ok(Some(Pools {
        pools,
        host: host.clone(),
        blocks_per_chunk: c.blocks_per_chunk,
    }))
}

/// A P/D engine: see [`RunConfig::pd_unsupported`] (`backend` resolved).
fn check_pd(c: &RunConfig, backend: crate::Backend) -> Result<(), RunError> {
    match c.pd_unsupported(backend) {
        Some(why) => Err(RunError::Config(why.into())),
        None => Ok(()),
    }
}

/// A P/D prefill engine's rank arenas, made here so that its KV server can read them.
pub(super) fn served_arenas(c: &RunConfig, gpu: &KvLayout) -> Option<Vec<HostArena>> {
    let p = c.pd.as_ref()?;
    let slot_bytes = (gpu.block_bytes() / u64::from(c.block_size.max(1))) as usize;
    (p.role == PdRole::Prefill).then(|| {
        (0..c.ranks)
            .map(|_| HostArena::new(gpu.total_bytes() as usize, slot_bytes))
            .collect()
    })
}

/// A shared tier reads and writes the ranks' CPU pools: host memory (the host backend), in this
/// process or in a memory file it shares with each worker process.
fn check_tier(backend: crate::Backend) -> Result<(), RunError> {
    if backend != crate::Backend::Host {
        return Err(RunError::Config(
            "--tier needs the host backend (--backend host) for now: the CUDA backend's CPU \
             pool is pinned memory the tier does not map"
                .into(),
        ));
    }
    Ok(())
}

/// The shared tier's default key namespace: the KV layout, so that only engines whose chunks
/// are interchangeable share them.
pub(super) fn namespace(c: &RunConfig) -> String {
    format!(
        "l{}-b{}-t{}-c{}-w{}",
        c.layers,
        c.block_bytes(),
        c.block_size,
        c.blocks_per_chunk,
        c.ranks
    )
}
