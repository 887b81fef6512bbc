"""``kvrelay.vllm.KvrelayOffloadingConnector``: vLLM 0.33's CPU offloading connector whose
scheduler side, and the CPU manager inside it, is kvrelay-core's; the worker side is vLLM's own.

Select it in vLLM with::

    kv_transfer_config = {
        "kv_connector": "KvrelayOffloadingConnector",
        "kv_connector_module_path": "kvrelay.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30},  # as vLLM's own
    }

Every ``kv_connector_extra_config`` key of vLLM's ``OffloadingConnector`` with the CPU spec is
read as vLLM reads it (``cpu_bytes_to_use``, ``block_size``, ``eviction_policy`` "lru"/"arc",
``store_threshold``, ``max_tracker_size``, ``offload_prompt_only``,
``sync_load_budget_bytes``). Configurations the core does not model raise
``kvrelay.UnsupportedConfig`` when the connector is built, never a silent fallback: another
spec than vLLM's CPU spec, a custom eviction policy, hybrid models whose groups differ in block
size or are not all offloaded, recurrent (Mamba) and EAGLE groups, partial-tail stores,
a positive ``prefix_cache_retention_interval`` and decode context parallelism.

The worker side is vLLM's ``OffloadingConnectorWorker`` unchanged, behind kvrelay's
step-protocol guard (``src/guard.rs``): vLLM's worker owns the GPU and host tensors and their
copy streams (torch, CUDA), which kvrelay's runtime cannot reach inside vLLM's worker processes,
and it reads the metadata this class builds in vLLM's own types; the guard checks every hook's
order against kvrelay-core's worker protocol and stops the worker with
``kvrelay.StepProtocolViolation`` at the first hook out of order. What kvrelay
decides (which chunks to store, load, flush and free, when a job is complete across ranks) is
the core's, run beside vLLM's scheduler through a shadow of its requests (``src/connector.rs``).

Departures from vLLM's connector: KV events carry vLLM's placeholder payload (the
self-describing payload is not recorded); ``get_stats`` reports the workers' transfer figures and
the pool's usage gauges, not the manager's allocation sizes, skipped stores or static info; cache
hits are all reported as coming from the host.
"""

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    SchedulerOffloadConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.kv_offload.base import GPULoadStoreSpec, Medium, OffloadingEvent
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvrelay._kvrelay import (
    StepProtocolViolation,
    UnsupportedConfig,
    _OffloadScheduler,
    _StepGuard,
)
from kvrelay.manager import _set_usage
from kvrelay.manager import _spec as _cpu_spec

__all__ = ["KvrelayOffloadingConnector", "StepProtocolViolation", "UnsupportedConfig"]


def _refuse(why: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"kvrelay's offloading connector: {why}")


def _groups(config: SchedulerOffloadConfig, kv_cache_config) -> list[int | None]:
    """Per group: None (full attention) or its sliding window in tokens; refuses the rest."""
    offloaded = [g.group_idx for g in config.kv_group_configs]
    if offloaded != list(range(len(kv_cache_config.kv_cache_groups))):
        raise _refuse(f"every KV cache group must be offloaded (offloaded: {offloaded})")
    if len({g.tokens_per_block for g in config.kv_group_configs}) != 1:
        raise _refuse("KV cache groups with different block sizes")
    groups: list[int | None] = []
    for g in config.kv_group_configs:
        if g.requires_cow_source or g.is_eagle_group:
            raise _refuse(f"group {g.group_idx} is a recurrent or EAGLE group")
        if g.sliding_window_size_in_chunks is None:
            groups.append(None)
        elif isinstance(g.kv_cache_spec, SlidingWindowSpec):
            groups.append(g.kv_cache_spec.sliding_window)
        else:
            raise _refuse(f"group {g.group_idx}: {type(g.kv_cache_spec).__name__}")
    return groups


def _native(spec, vllm_config, kv_cache_config) -> _OffloadScheduler:
    """The native scheduler for vLLM's own offloading configuration."""
    config = SchedulerOffloadConfig.from_spec(spec, vllm_config, kv_cache_config)
    if config.supports_partial_tail:
        raise _refuse("partial-tail stores")
    if config.retention_interval:
        raise _refuse("a positive prefix_cache_retention_interval")
    if config.dcp_world_size != 1:
        raise _refuse("decode context parallelism")
    num_chunks = getattr(spec, "num_chunks", None)
    if num_chunks is None:
        raise _refuse(f"spec {type(spec).__name__}: only vLLM's CPU spec is modelled")
    if getattr(spec, "cache_policy_module_path", None):
        raise _refuse("a custom cache policy module")
    extra = spec.extra_config
    per_token = config.kv_bytes_per_token
    budget = config.sync_load_budget_bytes // per_token if per_token else 0
    return _OffloadScheduler(
        block_size=config.kv_group_configs[0].tokens_per_block,
        groups=_groups(config, kv_cache_config),
        blocks_per_chunk=config.blocks_per_chunk,
        num_workers=config.num_workers,
        num_chunks=num_chunks,
        policy=str(getattr(spec, "eviction_policy", "lru")),
        store_threshold=int(extra.get("store_threshold", 0)),
        max_tracker_size=int(extra.get("max_tracker_size", 64_000)),
        offload_prompt_only=config.offload_prompt_only,
        sync_load_budget_tokens=budget,
        enable_prefix_caching=vllm_config.cache_config.enable_prefix_caching,
        num_gpu_blocks=kv_cache_config.num_blocks,
        max_model_len=vllm_config.model_config.max_model_len,
    )


def _job(native_job, load: bool) -> tuple[int, TransferJob]:
    """vLLM's TransferJob of a native job tuple (see ``src/connector.rs``)."""
    job_id, req_id, blocks, indices, chunk_ids, sync = native_job
    gpu = GPULoadStoreSpec(
        [b for g in blocks for b in g],
        group_sizes=[len(g) for g in blocks],
        block_indices=indices,
    )
    cpu = _cpu_spec(chunk_ids)
    src, dst = (cpu, gpu) if load else (gpu, cpu)
    return job_id, TransferJob(req_id=req_id, src_spec=src, dst_spec=dst, sync=sync)


class KvrelayOffloadingScheduler:
    """The scheduler side: vLLM's ``OffloadingConnectorScheduler`` methods on the native class.

    Keeps the ``Request`` objects vLLM's scheduler hands it until they finish, so that
    ``build_connector_meta`` can mirror the scheduled ones (vLLM's connector keeps them too).
    """

    def __init__(self, spec, vllm_config, kv_cache_config):
        self._native = _native(spec, vllm_config, kv_cache_config)
        self._requests: dict[str, Any] = {}
        self._stats = OffloadingConnectorStats()
        events = spec.kv_events_config
        self._events = OffloadingEventsTracker(events) if events.enable_kv_cache_events else None

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request
        self._native.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens, max_num_new_tokens=None):
        if max_num_new_tokens is not None:
            raise _refuse("groups this connector does not offload bound the load")
        return self._native.lookup(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}

    def update_state_after_alloc(self, request, blocks: KVCacheBlocks, num_external_tokens):
        self._native.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> OffloadingConnectorMetadata:
        reqs = self._requests
        cached = scheduler_output.scheduled_cached_reqs.req_ids
        new = (r.req_id for r in scheduler_output.scheduled_new_reqs)
        scheduled = [reqs[i] for ids in (new, cached) for i in ids if i in reqs]
        loads, stores, flush = self._native.build_meta(scheduler_output, scheduled)
        return OffloadingConnectorMetadata(
            load_jobs=dict(_job(j, True) for j in loads),
            store_jobs=dict(_job(j, False) for j in stores),
            jobs_to_flush=set(flush),
        )

    def has_pending_push_work(self) -> bool:
        return self._native.has_pending_push_work()

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            meta = OffloadingWorkerMetadata()
        assert isinstance(meta, OffloadingWorkerMetadata), type(meta)
        self._record(meta)
        self._native.update_output(meta.completed_jobs)

    def _record(self, meta: OffloadingWorkerMetadata) -> None:
        """The workers' transfer figures, as vLLM's connector reports them."""
        for name, d in (("load", meta.transfer_stats.load), ("store", meta.transfer_stats.store)):
            if d.is_empty():
                continue
            prefix = f"vllm:kv_offload_{name}"  # vLLM's metric names
            self._stats.increase_counter(f"{prefix}_bytes", d.bytes)
            self._stats.increase_counter(f"{prefix}_time", d.time)
            for size in d.sizes:
                self._stats.observe_histogram(f"{prefix}_size", size)

    def request_finished(self, request, block_ids=()) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._native.request_finished(request, block_ids)
        return False, None

    def take_events(self) -> Iterable:
        raw = self._native.take_events()
        if self._events is None:
            return
        events = [OffloadingEvent(keys=k, medium=Medium.CPU, removed=r) for k, r in raw]
        yield from self._events.take_events(events)

    def reset_cache(self) -> None:
        self._native.reset_cache()
        if self._events is not None:
            self._events.reset()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The workers' transfer figures since the last call, and the CPU pool's usage."""
        stats, self._stats = self._stats, OffloadingConnectorStats()
        _set_usage(stats, self._native.usage())
        return stats

    def shutdown(self) -> None:
        pass


class _WorkerGuard:
    """Passes a rank's hooks through the native guard, opening each step at its first hook.

    The step's shape comes from the metadata (a sync load) and, with speculative decoding, from
    the hooks themselves: a step defers its finalisation when ``get_finished`` comes before
    ``wait_for_save`` (a step with no forward does not defer). Until then the hooks are held and
    replayed once the shape is known; the guard still checks them all.
    """

    def __init__(self, speculative: bool):
        self._native = _StepGuard()
        self._speculative = speculative
        self._held: list[str] | None = None
        self._sync = False

    def open(self, metadata) -> None:
        self._sync = any(job.sync for job in metadata.load_jobs.values())
        if self._speculative and not self._native.in_step:
            self._held = []
        else:
            self._native.begin_step(self._sync, True, False)

    def call(self, name: str) -> None:
        if self._held is not None:
            if name not in ("wait_for_save", "get_finished"):
                self._held.append(name)
                return
            held, self._held = self._held, None
            self._native.begin_step(self._sync, True, name == "get_finished")
            for h in held:
                self._native.handle(h)
        self._native.handle(name)


def _guarded(name: str, hook: str):
    """vLLM's worker-side method ``name`` of OffloadingConnector, behind the guard."""
    parent = getattr(OffloadingConnector, name)

    def method(self, *args, **kwargs):
        if self.connector_worker is not None:
            self._guard.call(hook)
        return parent(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"vLLM's ``{name}``, after kvrelay's step-protocol guard admits it."
    return method


class KvrelayOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with kvrelay's scheduler side (module docs)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        spec = OffloadingSpecFactory.create_spec(offloading_config)
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvrelayOffloadingScheduler(
                spec, vllm_config, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
            self._guard = _WorkerGuard(vllm_config.speculative_config is not None)

    def handle_preemptions(self, kv_connector_metadata):
        self._guard.open(kv_connector_metadata)
        self._guard.call("handle_preemptions")
        super().handle_preemptions(kv_connector_metadata)

    bind_connector_metadata = _guarded("bind_connector_metadata", "bind")
    start_load_kv = _guarded("start_load_kv", "start_load_kv")
    wait_for_layer_load = _guarded("wait_for_layer_load", "wait_for_layer_load")
    save_kv_layer = _guarded("save_kv_layer", "save_kv_layer")
    wait_for_save = _guarded("wait_for_save", "wait_for_save")
    get_finished = _guarded("get_finished", "get_finished")
    get_block_ids_with_load_errors = _guarded("get_block_ids_with_load_errors", "get_block_ids_with_load_errors")
    get_kv_connector_stats = _guarded("get_kv_connector_stats", "get_stats")
    get_kv_connector_kv_cache_events = _guarded("get_kv_connector_kv_cache_events", "get_events")
    build_connector_worker_meta = _guarded("build_connector_worker_meta", "build_worker_meta")
    clear_connector_metadata = _guarded("clear_connector_metadata", "clear")

    def request_finished(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, [block_ids])

    def request_finished_all_groups(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)
