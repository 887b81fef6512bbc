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
``ValueError``): ``cache_policy_module_path`` (only the built-in "lru" and "arc") and
``num_chunks`` below 0 or beyond what the core's arena addresses (an empty pool is accepted, as
vLLM's: it refuses every store).
Where it departs from vLLM otherwise: ``src/manager.rs``'s module doc.
"""

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
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

_GET_POSITION = ReqContext.get_offload_key_position

_LOOKUP = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)

# numpy.frombuffer, absent where tests replace numpy by a stand-in.
_frombuffer = np.__dict__.get("frombuffer")
_INT32 = np.dtype(np.int32) if _frombuffer is not None else None
_new_spec = object.__new__


def _spec(chunk_ids: bytearray) -> CPULoadStoreSpec:
    """vLLM's CPULoadStoreSpec of the native int32 chunk ids (the same int32 array vLLM's
    constructor builds, without going through a list)."""
    if _frombuffer is None:
        return CPULoadStoreSpec(list(memoryview(chunk_ids).cast("i")))
    spec = _new_spec(CPULoadStoreSpec)
    spec.block_ids = _frombuffer(chunk_ids, _INT32)
    return spec


def _set_usage(stats: OffloadingConnectorStats, usage: tuple[int, int, int, int]) -> None:
    """vLLM's CPU usage gauges from the native ``usage()``: (chunks, free, evictable,
    write-pending)."""
    num_chunks, free, evictable, write_pending = usage
    used = num_chunks - free - evictable
    total = used / num_chunks if num_chunks > 0 else 0.0
    write = write_pending / num_chunks if num_chunks > 0 else 0.0
    stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, total)
    stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
    stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(total - write, 0.0))


@dataclass(slots=True)
class _Scope:
    """A request's scope in the native manager, kept in its ReqContext's state."""

    owner: object
    generation: int
    rid: int
    finished: bool = False


class _Tracker(Mapping):
    """A read-only view of the native tracker, ordered as vLLM's ``OrderedDict``."""

    def __init__(self, native: _OffloadManager):
        self._native = native

    def __getitem__(self, key: OffloadKey) -> int:
        count = self._native.offer_count(key)
        if count == 0:
            raise KeyError(key)
        return count

    def __iter__(self) -> Iterator[OffloadKey]:
        return (key for key, _ in self._native.tracked())

    def __len__(self) -> int:
        return len(self._native.tracked())


class CPUOffloadingManager(OffloadingManager):
    """vLLM's CPUOffloadingManager with kvrelay-core's chunk state machine and policies."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
    ):
        if cache_policy_module_path is not None:
            raise UnsupportedConfig(
                "cache_policy_module_path: kvrelay's manager has only the built-in "
                f'"lru" and "arc" policies (got {cache_policy_module_path!r})'
            )
        self._native = _OffloadManager(
            num_chunks, cache_policy, store_threshold, enable_events, max_tracker_size
        )
        self.medium: Medium = Medium.CPU
        self._num_chunks: int = num_chunks
        self._config_info: ConfigInfoMapping = (
            info.as_config_info() if info is not None else {}
        )
        self._enable_events = enable_events
        if type(self).lookup is CPUOffloadingManager.lookup:
            # The fast path: vLLM's callers call lookup once per key.
            self._native.bind_lookup_results(_LOOKUP)
            self.lookup = self._native.lookup_result
        self.store_threshold: int = store_threshold
        self.max_tracker_size: int = max_tracker_size
        self._generation = 0

    # --- vLLM's public attributes, read-only ---

    @property
    def counts(self) -> "Mapping[OffloadKey, int] | None":
        """The store-threshold tracker (None below a threshold of 2), as vLLM's ``counts``."""
        return _Tracker(self._native) if self.store_threshold >= 2 else None

    @property
    def stores_skipped_in_current_batch(self) -> int:
        return self._native.batch_stats()[1]

    @property
    def allocation_sizes_in_current_batch(self) -> list[int]:
        return self._native.batch_stats()[0]

    # --- request scopes ---

    def _scope(self, req_context: ReqContext) -> _Scope:
        """The context's scope in this manager, opened on first sight (or after a reset)."""
        state = req_context.get_state(_Scope)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _Scope(self, self._generation, self._native.open_request())
            req_context.set_state(state)
        return state

    def _access(self, keys: Collection[OffloadKey], req_context: ReqContext):
        """A prepare call's native arguments: (keys, scope id, positions). A finished scope
        records nothing (None, None); positions are the context's key -> end-token dict (None:
        none known), asked key by key of a context class that overrides
        get_offload_key_position; keys the native call reads twice are made a list."""
        state = req_context._state.get(_Scope)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = self._scope(req_context)
        if state.finished:
            return keys, None, None
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        if type(req_context).get_offload_key_position is _GET_POSITION:
            return keys, state.rid, req_context._offload_key_positions or None
        positions = {}
        for key in keys:
            if (p := req_context.get_offload_key_position(key)) is not None:
                positions[key] = p
        return keys, state.rid, positions or None

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
        return _spec(self._native.prepare_load(*self._access(keys, req_context)))

    def _prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, record_access: bool
    ) -> LoadStoreSpec:
        """vLLM's own hook for its subclasses (the tiering primary tier's prepare_read): pins
        without recording a request access unless ``record_access``."""
        if record_access:
            return self.prepare_load(keys, req_context)
        return _spec(self._native.prepare_load(keys, None, None))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._native.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._native.complete_load(keys)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self._native.prepare_store(*self._access(keys, req_context))
        if out is None:
            return None
        keys_to_store, chunk_ids, evicted = out
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=_spec(chunk_ids),
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
        medium = self.medium
        for keys, removed, metadata_only in self._native.take_events():
            yield OffloadingEvent(keys, medium, removed, None, None, False, metadata_only)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        _set_usage(stats, self._native.usage())
        allocation_sizes, stores_skipped = self._native.take_batch_stats()
        for size in allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, stores_skipped)
        return stats
