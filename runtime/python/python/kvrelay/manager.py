"""``kvrelay.CPUOffloadingManager``: a drop-in for vLLM 0.33's
``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` (LRU and ARC).

The chunk logic is kvrelay-core's manager, reached through the native ``_OffloadManager``
(``src/manager.rs``, whose module doc lists which native call each method makes). This class
only converts: keys go in as vLLM's ``bytes`` keys, results come back as vLLM's own types
(``LookupResult``, ``CPULoadStoreSpec``, ``PrepareStoreOutput``, ``OffloadingEvent``,
``OffloadingConnectorStats``).

Request scopes follow vLLM: a scope belongs to one ``ReqContext`` object (not its ``req_id``),
is kept in the context's state, and is stale after ``reset_cache``. Key positions are read from
the context when a key is accessed (vLLM reads them again when the request finishes; the
scheduler sets them before the first access).

Constructor arguments the core cannot honour raise ``kvrelay.UnsupportedConfig`` (a
``ValueError``): ``cache_policy_module_path`` (only the built-in "lru" and "arc"),
``max_tracker_size`` other than vLLM's default 64 000, and ``num_chunks`` below 1.
"""

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import (
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvrelay._kvrelay import UnsupportedConfig, _OffloadManager

__all__ = ["CPUOffloadingManager", "UnsupportedConfig"]

# vLLM's max_tracker_size default: the core's store-threshold tracker has this size.
_TRACKER_SIZE = 64_000

_GET_POSITION = ReqContext.get_offload_key_position

_LOOKUP = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)


@dataclass(slots=True)
class _Scope:
    """A request's scope in the native manager, kept in its ReqContext's state."""

    owner: object
    generation: int
    rid: int
    finished: bool = False


class CPUOffloadingManager(OffloadingManager):
    """vLLM's CPUOffloadingManager with kvrelay-core's chunk state machine and policies."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = _TRACKER_SIZE,
        info: CPUOffloadingInfo | None = None,
    ):
        if cache_policy_module_path is not None:
            raise UnsupportedConfig(
                "cache_policy_module_path: kvrelay's manager has only the built-in "
                f'"lru" and "arc" policies (got {cache_policy_module_path!r})'
            )
        if max_tracker_size != _TRACKER_SIZE:
            raise UnsupportedConfig(
                f"max_tracker_size {max_tracker_size}: kvrelay's store-threshold tracker "
                f"holds vLLM's default {_TRACKER_SIZE} keys"
            )
        self._native = _OffloadManager(
            num_chunks, cache_policy, store_threshold, enable_events
        )
        self.medium: Medium = Medium.CPU
        self._num_chunks: int = num_chunks
        self._config_info: ConfigInfoMapping = (
            info.as_config_info() if info is not None else {}
        )
        self._enable_events = enable_events
        self.store_threshold: int = store_threshold
        self.max_tracker_size: int = max_tracker_size
        self._generation = 0

    # --- request scopes ---

    def _scope(self, req_context: ReqContext) -> _Scope:
        """The context's scope in this manager, opened on first sight (or after a reset)."""
        state = req_context.get_state(_Scope)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _Scope(self, self._generation, self._native.open_request())
            req_context.set_state(state)
        return state

    def _rid(self, req_context: ReqContext) -> int | None:
        """The scope id for a call (None once finished: the call records no access)."""
        state = self._scope(req_context)
        return None if state.finished else state.rid

    @staticmethod
    def _positions(req_context: ReqContext, keys) -> dict | None:
        """The context's key -> end-token positions (None: none known). A context class that
        overrides get_offload_key_position is asked key by key."""
        if type(req_context).get_offload_key_position is _GET_POSITION:
            return req_context._offload_key_positions or None
        positions = {}
        for key in keys:
            if (p := req_context.get_offload_key_position(key)) is not None:
                positions[key] = p
        return positions or None

    @staticmethod
    def _listed(keys: Collection[OffloadKey]) -> Collection[OffloadKey]:
        """Keys the native call may read twice (keys and positions)."""
        return keys if type(keys) is list or type(keys) is tuple else list(keys)

    # --- OffloadingManager interface ---

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._scope(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self._native.lookup(key)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> LoadStoreSpec:
        rid = self._rid(req_context)
        positions = None
        if rid is not None:
            keys = self._listed(keys)
            positions = self._positions(req_context, keys)
        return CPULoadStoreSpec(self._native.prepare_load(keys, rid, positions))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._native.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._native.complete_load(keys)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        rid = self._rid(req_context)
        positions = None
        if rid is not None:
            keys = self._listed(keys)
            positions = self._positions(req_context, keys)
        out = self._native.prepare_store(keys, rid, positions)
        if out is None:
            return None
        keys_to_store, chunk_ids, evicted = out
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=CPULoadStoreSpec(chunk_ids),
            evicted_keys=evicted,
        )

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        self._native.complete_store(keys, bool(success))

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_Scope)
        if (
            state is None
            or state.owner is not self
            or state.generation != self._generation
            or state.finished
        ):
            return
        state.finished = True
        self._native.request_finished(state.rid)

    def reset_cache(self) -> None:
        self._native.reset()
        self._generation += 1

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._enable_events:
            return
        # A generator, as vLLM's: the batch is taken at the first next().
        for keys, removed, metadata_only in self._native.take_events():
            yield OffloadingEvent(
                keys=keys,
                medium=self.medium,
                removed=removed,
                metadata_only=metadata_only,
            )

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        num_chunks, free, evictable, write_pending = self._native.usage()
        used = num_chunks - free - evictable
        usage = used / num_chunks
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        allocation_sizes, stores_skipped = self._native.take_batch_stats()
        for size in allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        write_usage = write_pending / num_chunks
        read_usage = max(usage - write_usage, 0.0)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read_usage)
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, stores_skipped)
        return stats
