"""kvrelay.CPUOffloadingManager against vLLM 0.33.0's own CPUOffloadingManager.

The differential tests drive both managers with the same random call sequences, in the order
vLLM's offloading scheduler makes them (a store job's keys complete after its prepare_store, a
load's keys after its prepare_load, nothing from before a reset completes after it), and
compare every result: lookups, prepare_store's keys, chunk ids and evictions (and refusals),
prepare_load's chunk ids, events with their flags, and the stats gauges. vLLM's modules come
from its source tree (conftest.py).

The error tests check that bad input is a Python exception of vLLM's kind, never a crash.
"""

import random

import pytest

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    ReqContext,
    RequestOffloadingContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvrelay.manager import UnsupportedConfig
from kvrelay import CPUOffloadingManager as KvManager


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(f"hash-{i}".encode(), group)


def ids(spec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(x) for x in spec.block_ids]


def store_view(out):
    if out is None:
        return None
    return (list(out.keys_to_store), ids(out.store_spec), list(out.evicted_keys))


def events_view(manager):
    return [
        (list(e.keys), e.medium, e.removed, e.metadata_only) for e in manager.take_events()
    ]


def stats_view(manager):
    return manager.get_stats().reduce()


class Pair:
    """vLLM's manager and kvrelay's, driven alike; every result is compared."""

    def __init__(
        self, rng: random.Random, policy: str, num_chunks: int, threshold: int, tracker=64_000
    ):
        kw = dict(
            cache_policy=policy,
            enable_events=True,
            store_threshold=threshold,
            max_tracker_size=tracker,
        )
        self.v = VllmManager(num_chunks, **kw)
        self.k = KvManager(num_chunks, **kw)
        # Sweep the key table often, so that freed and reused key ids are compared too.
        self.k._native._set_key_sweep_slack(rng.choice([0, 4, 1 << 16]))
        self.rng = rng
        self.universe = [key(i, g) for i in range(14) for g in (0, 1)]
        self.requests: list[ReqContext] = []
        self.stores: list[tuple[list[bytes], ReqContext]] = []
        self.loads: list[tuple[list[bytes], ReqContext]] = []
        self.serial = 0

    def both(self, method: str, *args, **kwargs):
        """Calls `method` on both managers; they must agree (or both raise AssertionError)."""
        try:
            a = getattr(self.v, method)(*args, **kwargs)
        except AssertionError:
            with pytest.raises(AssertionError):
                getattr(self.k, method)(*args, **kwargs)
            return None
        b = getattr(self.k, method)(*args, **kwargs)
        return a, b

    def request(self) -> ReqContext:
        if not self.requests or self.rng.random() < 0.2:
            self.serial += 1
            ctx = ReqContext(req_id=f"r{self.serial}")
            assert self.v.on_new_request(ctx) == self.k.on_new_request(ctx)
            self.requests.append(ctx)
        return self.rng.choice(self.requests)

    def offer(self, ctx: ReqContext) -> list[bytes]:
        keys = self.rng.sample(self.universe, self.rng.randint(1, 5))
        if self.rng.random() < 0.5:
            # The scheduler's end-token positions: one per block hash, so that the groups of
            # a hash share it. (Different hashes at one position of a request tie in vLLM's
            # LRU and break by their bytes; kvrelay's core breaks them by first sight.)
            for k in keys:
                ctx.set_offload_key_position(k, 16 * int(k[5:-4]) + 7)
        return keys

    def step(self) -> None:
        rng, op = self.rng, self.rng.random()
        if op < 0.35:
            ctx = self.request()
            keys = self.offer(ctx)
            a, b = self.both("prepare_store", keys, ctx)
            assert store_view(a) == store_view(b), keys
            if a is not None and a.keys_to_store:
                self.stores.append((list(a.keys_to_store), ctx))
        elif op < 0.55 and self.stores:
            keys, ctx = self.stores.pop(rng.randrange(len(self.stores)))
            self.both("complete_store", keys, ctx, rng.random() < 0.8)
        elif op < 0.68:
            ctx = self.request()
            hits = [k for k in self.universe if self.v.lookup(k, ctx) == LookupResult.HIT]
            if hits:
                keys = rng.sample(hits, rng.randint(1, min(3, len(hits))))
                if rng.random() < 0.8:
                    a, b = self.both("prepare_load", keys, ctx)
                else:  # the tiering primary tier's prepare_read: no request access
                    a, b = self.both("_prepare_load", keys, ctx, record_access=False)
                assert ids(a) == ids(b)
                self.loads.append((keys, ctx))
        elif op < 0.78 and self.loads:
            keys, ctx = self.loads.pop(rng.randrange(len(self.loads)))
            self.both("complete_load", keys, ctx)
        elif op < 0.84:
            self.both("touch", rng.sample(self.universe, 3), self.request())
        elif op < 0.92 and self.requests:
            ctx = self.requests.pop(rng.randrange(len(self.requests)))
            self.both("on_request_finished", ctx)
        elif op < 0.97:
            assert events_view(self.v) == events_view(self.k)
        elif op < 0.985:
            self.check_attributes()
            assert stats_view(self.v) == pytest.approx(stats_view(self.k))
        else:
            self.both("reset_cache")
            # The scheduler never completes a job from before a reset.
            self.stores.clear()
            self.loads.clear()
        self.check_lookups()

    def check_attributes(self) -> None:
        """vLLM's public attributes: the tracker (in its order) and the batch's figures."""
        if self.v.counts is None:
            assert self.k.counts is None
        else:
            assert list(self.v.counts.items()) == list(self.k.counts.items())
        for name in ("stores_skipped_in_current_batch", "allocation_sizes_in_current_batch"):
            assert getattr(self.v, name) == getattr(self.k, name), name

    def check_lookups(self) -> None:
        ctx = ReqContext(req_id="lookup")
        for k in self.universe:
            assert self.v.lookup(k, ctx) == self.k.lookup(k, ctx), k


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("threshold", [0, 2, 3])
@pytest.mark.parametrize("seed", range(30))
def test_random_sequences_match_vllm(policy, threshold, seed):
    """Protects: the manager is vLLM's, call for call — hits and pending hits, stores with
    eviction and refusals, failed stores, loads and pins, touch, request recency (with and
    without key positions), the store threshold with a full tracker, events with their
    metadata-only flag, reset, and the stats."""
    rng = random.Random(seed * 7919 + threshold)
    tracker = rng.choice([3, 8, 64_000]) if threshold >= 2 else 64_000
    pair = Pair(rng, policy, rng.choice([3, 6, 10]), threshold, tracker)
    for _ in range(300):
        pair.step()
    assert events_view(pair.v) == events_view(pair.k)
    assert stats_view(pair.v) == pytest.approx(stats_view(pair.k))


def test_vllm_types_come_back():
    """Protects: callers get vLLM's own result types (the drop-in contract)."""
    m = KvManager(4, enable_events=True)
    ctx = ReqContext(req_id="a")
    assert isinstance(m.on_new_request(ctx), RequestOffloadingContext)
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    out = m.prepare_store([key(1), key(2)], ctx)
    assert out.keys_to_store == [key(1), key(2)] and out.evicted_keys == []
    assert ids(out.store_spec) == [0, 1]
    assert m.lookup(key(1), ctx) is LookupResult.HIT_PENDING
    m.complete_store([key(1)], ctx)
    assert m.lookup(key(1), ctx) is LookupResult.HIT
    assert m.get_load_source(key(1), ctx) is CacheHitSource.HOST
    assert ids(m.prepare_load([key(1)], ctx)) == [0]
    (event,) = list(m.take_events())
    assert (event.keys, event.medium, event.removed) == ([key(1)], Medium.CPU, False)
    assert m.config_info() == [{}]
    assert CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC in m.get_stats().reduce()


def test_keys_in_any_collection():
    """Protects: keys are accepted as vLLM's callers pass them (lists, tuples, generators)."""
    m = KvManager(4)
    ctx = ReqContext(req_id="a")
    ctx.set_offload_key_position(key(1), 16)
    out = m.prepare_store((k for k in [key(1), key(2)]), ctx)
    assert out.keys_to_store == [key(1), key(2)]
    m.complete_store(iter([key(1), key(2)]), ctx)
    assert ids(m.prepare_load((key(2), key(1)), ctx)) == [1, 0]


def test_load_assertions_match_vllm():
    """Protects: a load vLLM asserts against (missing key, pending key, unpinned key) is an
    AssertionError, and a refused call pins or unpins nothing."""
    m = KvManager(4)
    ctx = ReqContext(req_id="a")
    with pytest.raises(AssertionError, match="not found"):
        m.prepare_load([key(9)], ctx)
    m.prepare_store([key(1), key(2)], ctx)
    m.complete_store([key(1)], ctx)
    with pytest.raises(AssertionError, match="not ready"):
        m.prepare_load([key(1), key(2)], ctx)
    with pytest.raises(AssertionError):
        m.complete_load([key(1)], ctx)
    # key(1) was not pinned by the refused load: three new keys evict it.
    m.complete_store([key(2)], ctx)
    out = m.prepare_store([key(3), key(4), key(5)], ctx)
    assert out is not None and key(1) in out.evicted_keys


@pytest.mark.parametrize(
    "bad, error",
    [("str-key", TypeError), (17, TypeError), (b"abc", ValueError), (bytearray(8), TypeError)],
)
def test_bad_keys_raise(bad, error):
    """Protects: a key that is not vLLM's bytes key is a TypeError/ValueError, never a crash,
    and the refused call changes nothing."""
    m = KvManager(4)
    ctx = ReqContext(req_id="a")
    for call in (
        lambda: m.lookup(bad, ctx),
        lambda: m.prepare_store([key(1), bad], ctx),
        lambda: m.touch([bad], ctx),
        lambda: m.complete_store([bad], ctx),
        lambda: m.prepare_load([bad], ctx),
    ):
        with pytest.raises(error):
            call()
    assert m.lookup(key(1), ctx) is LookupResult.MISS
    with pytest.raises(TypeError):
        m.prepare_store(5, ctx)


def test_unsupported_config_is_refused():
    """Protects: constructor values the core cannot honour are refused with a typed error
    (UnsupportedConfig, a ValueError), never ignored."""
    for kwargs in (
        dict(num_chunks=-1),
        dict(num_chunks=4, cache_policy_module_path="my.policy"),
        dict(num_chunks=4, cache_policy="fifo"),
    ):
        with pytest.raises(UnsupportedConfig):
            KvManager(**kwargs)
    assert issubclass(UnsupportedConfig, ValueError)


def test_scope_is_per_context_object_and_reset_makes_it_stale():
    """Protects: a request scope belongs to its ReqContext object, as vLLM's state does, and a
    reset starts fresh scopes (a finished or stale context never reaches the core's scope of
    another request)."""
    for policy in ("lru", "arc"):
        rng = random.Random(5)
        pair = Pair(rng, policy, 4, 0)
        a, b = ReqContext(req_id="same"), ReqContext(req_id="same")
        for ctx in (a, b):
            pair.both("on_new_request", ctx)
        for ctx, keys in ((a, [key(1), key(2)]), (b, [key(3)])):
            out, _ = pair.both("prepare_store", keys, ctx)
            pair.both("complete_store", keys, ctx)
        pair.both("prepare_load", [key(1)], b)
        pair.both("complete_load", [key(1)], b)
        pair.both("on_request_finished", a)
        pair.both("reset_cache")
        pair.both("on_request_finished", b)
        out, mine = pair.both("prepare_store", [key(4), key(5)], a)
        assert store_view(out) == store_view(mine)
        pair.check_lookups()
        assert events_view(pair.v) == events_view(pair.k)


def test_usable_from_another_thread():
    """Protects: a manager built on one thread serves calls from another (vLLM's tiering
    manager enters its tiers from a background thread, under its lock)."""
    import threading

    m = KvManager(4)
    ctx = ReqContext(req_id="a")
    out = []
    t = threading.Thread(target=lambda: out.append(m.prepare_store([key(1)], ctx)))
    t.start()
    t.join()
    assert out[0] is not None and out[0].keys_to_store == [key(1)]
    assert m.lookup(key(1), ctx) is LookupResult.HIT_PENDING


def test_the_key_table_stays_bounded_by_what_the_manager_holds():
    """Protects memory: the table of interned key hashes does not grow with every hash ever
    offered (a long-running vLLM offers new hashes all the time), and keys still stored come
    back intact after sweeps."""
    m = KvManager(16, cache_policy="lru")
    for i in range(200_000):
        ctx = ReqContext(req_id=f"r{i}")
        out = m.prepare_store([key(i, 0)], ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
    assert m._native.interned_hashes <= 2 * 16 + (1 << 16) + 1, m._native.interned_hashes
    ctx = ReqContext(req_id="lookup")
    assert [m.lookup(key(i, 0), ctx) for i in range(200_000 - 16, 200_000)] == [LookupResult.HIT] * 16


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(5))
def test_an_empty_pool_matches_vllm(policy, seed):
    """Protects vLLM's empty pool (its CPU spec builds one when a chunk does not fit the
    bytes given): every store refused, lookups miss, stats and events as vLLM's."""
    pair = Pair(random.Random(seed), policy, 0, 0)
    for _ in range(100):
        pair.step()
    assert events_view(pair.v) == events_view(pair.k)
    assert stats_view(pair.v) == pytest.approx(stats_view(pair.k))
