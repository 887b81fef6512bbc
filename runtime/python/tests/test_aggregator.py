"""kvrelay.KVOutputAggregator against vLLM 0.33.0's own KVOutputAggregator, loaded from vLLM's
sources (conftest.py), on the same outputs.

Each test names the property it protects. The differential test drives both with random steps:
any number of ranks, ids finished by some ranks and not others, duplicates, quorum changes
(`expected_finished_count`), failed loads, invalid blocks, worker metadata and KV events folded
by their own methods, salvaged outputs of failed steps, a falsy output rank.
"""

import functools
import random

import pytest

import kvrelay
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator as VllmAggregator
from vllm.v1.outputs import KVConnectorOutput


class Meta:
    """Worker metadata folded by its own `aggregate` (vLLM calls it; so must kvrelay)."""

    def __init__(self, tags):
        self.tags = frozenset(tags)

    def aggregate(self, other):
        return Meta(self.tags | other.tags)


class Events:
    """KV events as vLLM's KVConnectorKVEvents are folded: add_events + increment_workers."""

    def __init__(self, events, workers=1):
        self.events, self.workers = list(events), workers

    def get_all_events(self):
        return list(self.events)

    def add_events(self, events):
        self.events += events

    def increment_workers(self, n):
        self.workers += n


class RankOutput:
    """What the executor hands the aggregator per rank (a ModelRunnerOutput's field)."""

    def __init__(self, kv):
        self.kv_connector_output = kv


def random_kv(rng, ids):
    pick = lambda: set(rng.sample(ids, rng.randint(0, 3)))  # noqa: E731
    return KVConnectorOutput(
        finished_sending=pick() if rng.random() < 0.7 else None,
        finished_recving=pick() if rng.random() < 0.7 else None,
        invalid_block_ids=set(rng.sample(range(20), rng.randint(0, 2))),
        failed_recving=pick() if rng.random() < 0.2 else set(),
        expected_finished_count=rng.choice([0, 0, 0, 0, 1, 2, 3]),
        kv_connector_worker_meta=Meta({rng.randint(0, 9)}) if rng.random() < 0.5 else None,
        kv_cache_events=Events([rng.randint(0, 99)]) if rng.random() < 0.5 else None,
    )


def view(out):
    """A comparable form of one aggregate result."""
    if out is None:
        return None
    kv = out.kv_connector_output
    meta, ev = kv.kv_connector_worker_meta, kv.kv_cache_events
    return (
        kv.finished_sending,
        kv.finished_recving,
        kv.invalid_block_ids,
        kv.failed_recving,
        kv.expected_finished_count,
        meta.tags if meta else None,
        (sorted(ev.events), ev.workers) if ev else None,
    )


def replay(make, script):
    """Runs one script (a list of calls with pre-drawn randomness) on a fresh aggregator."""
    agg, seen = make(), []
    for call in script:
        kvs = call["build"]()
        if call["kind"] == "defer":
            agg.ft_defer_kv_connector_outputs(kvs)
            seen.append("deferred")
        else:
            outputs = [RankOutput(kv) for kv in kvs]
            seen.append(view(agg.aggregate(outputs, call["rank"])))
    return seen


def script_for(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 4)
    ids = [f"req-{i}" for i in range(6)]
    calls = []
    for _ in range(rng.randint(1, 25)):
        step_seed = rng.random()
        kind = "defer" if rng.random() < 0.15 else "aggregate"
        calls.append(
            {
                "kind": kind,
                # Each side builds its own objects from the same seed: the aggregator mutates them.
                "build": (lambda s=step_seed: [random_kv(random.Random(s), ids) if random.Random(s + i).random() < 0.9 else None for i in range(world)]),
                "rank": rng.randrange(world),
            }
        )
    return world, calls


@pytest.mark.parametrize("seed", range(300))
def test_counts_and_folds_like_vllm_on_random_steps(seed):
    """Protects compat: every aggregate returns what vLLM 0.33.0's returns, call for call."""
    world, script = script_for(seed)
    for call in script:
        if call["kind"] == "aggregate":
            # vLLM asserts every rank's ModelRunnerOutput is present: keep them present.
            call["build"] = (lambda b=call["build"]: [kv if kv is not None else KVConnectorOutput() for kv in b()])
    quorum = random.Random(seed).randint(1, world)
    ours = replay(lambda: kvrelay.KVOutputAggregator(quorum), script)
    theirs = replay(lambda: VllmAggregator(quorum), script)
    assert ours == theirs


@pytest.mark.parametrize("seed", range(200))
def test_ranks_reporting_equal_sets_count_like_vllm(seed):
    """Protects the reuse of an equal set's conversion (ranks mostly report the same ids): sets
    drawn from a few candidates, so that a rank's set often equals the last rank's, sometimes
    has its length and not its ids, sometimes is a frozenset or a list (vLLM iterates the
    finished ones); vLLM's results, call for
    call."""
    rng = random.Random(seed)
    world = rng.randint(1, 8)
    candidates = [set(), {"a"}, {"b"}, {"a", "b"}, {"b", "c"}, {"a", "b", "c"}, {"c", "d", "e"}]

    def pick(r, lists=True):
        s = set(r.choice(candidates))
        kind = r.random()
        return frozenset(s) if kind < 0.1 else sorted(s) if kind < 0.15 and lists else s

    def build(step_seed):
        r = random.Random(step_seed)
        return [
            KVConnectorOutput(
                finished_sending=pick(r) if r.random() < 0.9 else None,
                finished_recving=pick(r) if r.random() < 0.9 else None,
                failed_recving=pick(r, lists=False) if r.random() < 0.2 else set(),
            )
            for _ in range(world)
        ]

    script = [{"kind": "aggregate", "build": (lambda s=rng.random(): build(s)), "rank": rng.randrange(world)} for _ in range(20)]
    quorum = rng.randint(1, world)
    assert replay(lambda: kvrelay.KVOutputAggregator(quorum), script) == replay(lambda: VllmAggregator(quorum), script)


def test_a_falsy_output_rank_returns_none_and_counts_nothing():
    """Protects I-27: the execute_model phase of async scheduling consumes nothing."""
    agg = kvrelay.KVOutputAggregator(2)
    done = RankOutput(KVConnectorOutput(finished_sending={"a"}))
    assert agg.aggregate([None, done], 0) is None
    assert agg._send_remaining_count == {}


def test_an_id_is_emitted_once_every_rank_reported_it():
    """Protects I-21: a completion is not counted before every rank finished."""
    agg = kvrelay.KVOutputAggregator(3)
    step = lambda ids: [RankOutput(KVConnectorOutput(finished_recving=set(i))) for i in ids]  # noqa: E731
    assert agg.aggregate(step([{"a"}, {"a"}, set()]), 0).kv_connector_output.finished_recving is None
    assert agg._recv_remaining_count == {"a": 1}
    out = agg.aggregate(step([set(), set(), {"a"}]), 0).kv_connector_output
    assert out.finished_recving == {"a"} and agg._recv_remaining_count == {}


def test_strict_refuses_a_rank_reporting_twice_and_changes_nothing():
    """Protects strict mode's departure: a duplicate report is an error, not a premature emission."""
    # Rank 0 reports "a" in two steps; rank 1 never does.
    step = lambda: [RankOutput(KVConnectorOutput(finished_sending={"a"})), RankOutput(KVConnectorOutput())]  # noqa: E731
    agg = kvrelay.KVOutputAggregator(2, strict=True)
    agg.aggregate(step(), 0)
    with pytest.raises(ValueError, match="twice"):
        agg.aggregate(step(), 0)
    assert agg._send_remaining_count == {"a": 1}
    compat = kvrelay.KVOutputAggregator(2)
    compat.aggregate(step(), 0)
    again = compat.aggregate(step(), 0)
    assert again.kv_connector_output.finished_sending == {"a"}, "compat counts both reports, as vLLM"


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: kvrelay.KVOutputAggregator(0), ValueError),
        (lambda: kvrelay.KVOutputAggregator(-1), ValueError),
        (lambda: kvrelay.KVOutputAggregator(2).aggregate([RankOutput(KVConnectorOutput())], 3), IndexError),
        (lambda: kvrelay.KVOutputAggregator(2).aggregate([RankOutput(KVConnectorOutput()), None], 0), AssertionError),
        (lambda: kvrelay.KVOutputAggregator(1).aggregate([RankOutput(KVConnectorOutput(finished_sending={7}))], 0), TypeError),
        (lambda: kvrelay.KVOutputAggregator(1).aggregate([RankOutput(KVConnectorOutput(invalid_block_ids={-1}))], 0), OverflowError),
        (lambda: kvrelay.KVOutputAggregator(1).aggregate(5, 0), TypeError),
    ],
)
def test_bad_input_is_a_typed_python_error(call, error):
    """Protects the boundary: bad input raises a Python exception, never a panic or a hang."""
    with pytest.raises(error):
        call()


def test_ids_of_finished_requests_are_released():
    """Protects the bound: the id table does not grow with every request ever seen."""
    agg = kvrelay.KVOutputAggregator(1)
    for step in range(2000):
        ids = {f"req-{step}-{i}" for i in range(16)}
        agg.aggregate([RankOutput(KVConnectorOutput(finished_sending=ids))], 0)
    assert agg.live_request_ids < 2 * 16 + 4096 + 16, agg.live_request_ids


def offloading_step(rng_seed, world, odd=None):
    """One step's outputs whose worker metadata is vLLM's OffloadingWorkerMetadata (or None),
    with job counts, bytes, float times and sizes in both directions; `odd(rng, jobs, stats)`
    may return a replacement metadata object to mix in values the one-pass fold declines."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        DirectionalTransferStats,
        OffloadingWorkerMetadata,
        TransferStats,
    )

    rng = random.Random(rng_seed)

    def directional():
        return DirectionalTransferStats(
            bytes=rng.randrange(1 << 40), time=rng.random() / 3, sizes=[rng.randrange(9) for _ in range(rng.randint(0, 3))]
        )

    outputs = []
    for _ in range(world):
        meta = None
        if rng.random() < 0.8:
            jobs = {rng.randrange(40): rng.choice([1, 1, 2]) for _ in range(rng.randint(0, 12))}
            stats = TransferStats(load=directional(), store=directional())
            meta = OffloadingWorkerMetadata(completed_jobs=jobs, transfer_stats=stats)
            if odd is not None and rng.random() < 0.3:
                meta = odd(rng, jobs, stats)
        outputs.append(RankOutput(KVConnectorOutput(kv_connector_worker_meta=meta)))
    return outputs


def meta_view(meta):
    """The folded metadata's type, its jobs in order, its transfer stats."""
    if meta is None:
        return None
    return type(meta), list(meta.completed_jobs.items()), meta.transfer_stats


@pytest.mark.parametrize("seed", range(100))
def test_folds_vllms_offloading_metadata_like_vllm(seed):
    """Protects the one-pass fold of vLLM's OffloadingWorkerMetadata (offload_meta.rs): the same
    completed-job counts in the same order, bytes and float times summed in vLLM's order, sizes
    concatenated."""
    world = random.Random(seed).randint(1, 8)
    ours, theirs = kvrelay.KVOutputAggregator(world), VllmAggregator(world)
    for s in range(5):
        a = ours.aggregate(offloading_step(seed * 100 + s, world), 0).kv_connector_output
        b = theirs.aggregate(offloading_step(seed * 100 + s, world), 0).kv_connector_output
        assert meta_view(a.kv_connector_worker_meta) == meta_view(b.kv_connector_worker_meta)


@functools.cache
def metadata_subclass():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    class Sub(OffloadingWorkerMetadata):
        def aggregate(self, other):
            folded = super().aggregate(other)
            return Sub(completed_jobs=folded.completed_jobs, transfer_stats=folded.transfer_stats)

    return Sub


def odd_metadata(rng, jobs, stats):
    """Metadata the one-pass fold must decline (and fold with `aggregate()` instead)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    kind = rng.randrange(4)
    if kind == 0:
        return metadata_subclass()(completed_jobs=jobs, transfer_stats=stats)
    if kind == 1:  # a count past 64 bits: Python's ints do not overflow
        return OffloadingWorkerMetadata(completed_jobs={7: 1 << 70}, transfer_stats=stats)
    if kind == 2:  # an int-valued time: the sum's type follows Python
        stats.load.time = 3
        return OffloadingWorkerMetadata(completed_jobs=jobs, transfer_stats=stats)
    return OffloadingWorkerMetadata(completed_jobs={True: 1, 1.0: 2}, transfer_stats=stats)


@pytest.mark.parametrize("seed", range(60))
def test_metadata_the_one_pass_fold_declines_is_folded_like_vllm(seed):
    """Protects the one-pass fold's limits: subclasses, ints past 64 bits, int times and non-int
    job ids are folded by the objects' own `aggregate()`, with vLLM's results."""
    world = random.Random(seed).randint(2, 8)
    ours, theirs = kvrelay.KVOutputAggregator(world), VllmAggregator(world)
    for s in range(5):
        a = ours.aggregate(offloading_step(seed * 100 + s, world, odd_metadata), 0).kv_connector_output
        b = theirs.aggregate(offloading_step(seed * 100 + s, world, odd_metadata), 0).kv_connector_output
        assert meta_view(a.kv_connector_worker_meta) == meta_view(b.kv_connector_worker_meta)


def test_a_replaced_aggregate_is_called_as_vllm_calls_it(monkeypatch):
    """Protects the one-pass fold's premise: once vLLM's `aggregate` is replaced, it is called."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    calls = []
    original = OffloadingWorkerMetadata.aggregate

    def spy(self, other):
        calls.append(other)
        return original(self, other)

    outputs = offloading_step(1, 4)
    assert all(o.kv_connector_output.kv_connector_worker_meta is not None for o in outputs)
    kvrelay.KVOutputAggregator(4).aggregate(offloading_step(1, 4), 0)  # the fold's classes seen
    monkeypatch.setattr(OffloadingWorkerMetadata, "aggregate", spy)
    kvrelay.KVOutputAggregator(4).aggregate(outputs, 0)
    assert len(calls) == 3


def test_one_rank_with_metadata_hands_back_that_object():
    """Protects vLLM's identity: a chain of one object is that object, not a copy."""
    outputs = offloading_step(1, 4)
    kvs = [o.kv_connector_output for o in outputs]
    for kv in kvs[1:]:
        kv.kv_connector_worker_meta = None
    meta = kvs[0].kv_connector_worker_meta
    out = kvrelay.KVOutputAggregator(4).aggregate(outputs, 0)
    assert out.kv_connector_output.kv_connector_worker_meta is meta
