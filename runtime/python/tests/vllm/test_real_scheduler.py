"""vLLM 0.33.0's real Scheduler running an offloading KV connector (issue 35, item 2).

Every scenario runs twice: with vLLM's own ``OffloadingConnector`` and with kvrelay's
``kvrelay.vllm.KvrelayOffloadingConnector`` (a failed import fails its runs). Both are named the way a user names them, in ``KVTransferConfig``; the scheduler side
runs vLLM's real CPU offloading spec (``CPUOffloadingSpec``, a pool of ``CPU_CHUNKS`` chunks),
so vLLM's connector runs vLLM's real CPU manager. The worker side is each connector's own
WORKER role (kvrelay's: vLLM's worker behind kvrelay's step-protocol guard) over vLLM's test
``MockOffloadingSpec``: transfers are recorded, and complete only when the test says so (a
flush completes its jobs at once). The worker's hooks come in the model runner's order, all of
them, so kvrelay's guard checks a real step.

Each engine step is what vLLM's engine core and model runner do with a connector: schedule,
hand the metadata to the worker connector, start loads, complete the transfers the scenario
allows, queue the step's stores, collect finished loads and completed jobs, sample one token
for every request whose prompt is done, and give it all back to ``update_from_output``.

The assertions are the same for both connectors and read only what the scheduler and the
worker see: the store and load jobs that reached the worker (GPU block ids, chunk counts),
what was flushed, tokens computed and scheduled, the scheduler's connector prefix-cache
stats, requests finishing. kvrelay's run also replays the scenario with vLLM's connector and
requires the same sequence of jobs, step by step.

Run it with scripts/connector.sh (it builds and installs the wheel into the vLLM test
harness's venv and runs pytest from vLLM's source root, so ``tests.v1...`` imports work).
"""

from __future__ import annotations

import inspect
import mmap
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID, create_vllm_config
from vllm import SamplingParams
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 4  # tokens per GPU block
BLOCKS_PER_CHUNK = 2  # GPU blocks per offloaded chunk
CHUNK = BLOCK_SIZE * BLOCKS_PER_CHUNK  # tokens per chunk
CPU_CHUNKS = 64  # the CPU pool
TOKEN = 7  # every sampled token (never EOS)
MOCK_SPEC_MODULE = "tests.v1.kv_connector.unit.offloading_connector.utils"


# --- the two connectors ---------------------------------------------------------------------


@dataclass(frozen=True)
class Connector:
    name: str
    module_path: str | None


VLLM = Connector("OffloadingConnector", None)
KVRELAY = Connector("KvrelayOffloadingConnector", "kvrelay.vllm")


CONNECTORS = [pytest.param(VLLM, id="vllm"), pytest.param(KVRELAY, id="kvrelay")]


# --- what reached the worker ----------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    kind: str  # "store" | "load"
    req_id: str
    gpu_blocks: tuple[int, ...]
    num_chunks: int
    sync: bool


@dataclass
class StepTrace:
    scheduled: dict[str, int]
    stores: list[Job]
    loads: list[Job]
    flushed: list[Job]


def _job(kind: str, entry: Any) -> Job:
    gpu, cpu = (entry.src_spec, entry.dst_spec) if kind == "store" else (entry.dst_spec, entry.src_spec)
    assert isinstance(gpu, GPULoadStoreSpec), gpu
    assert isinstance(cpu, CPULoadStoreSpec), cpu
    return Job(kind, entry.req_id, tuple(int(b) for b in gpu.block_ids), len(cpu.block_ids), entry.sync)


# --- the engine -----------------------------------------------------------------------------

Completion = bool | Callable[["Engine", set[int]], set[int]]


class Engine:
    """vLLM's real Scheduler with ``connector`` and a worker-role OffloadingConnector."""

    def __init__(
        self,
        connector: Connector,
        *,
        num_gpu_blocks: int = 64,
        async_scheduling: bool = False,
        kv_load_failure_policy: str = "fail",
        max_num_batched_tokens: int = 256,
    ):
        self.async_scheduling = async_scheduling
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.page_size_bytes * num_gpu_blocks,
                    layers=["layer"],
                    layer_stride=spec.page_size_bytes * num_gpu_blocks,
                    block_stride=spec.page_size_bytes,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        # CPUOffloadingSpec sizes its pool as cpu_bytes_to_use // (bytes per chunk, rounded up
        # to the page size).
        chunk_bytes = -(-spec.page_size_bytes * BLOCKS_PER_CHUNK // mmap.PAGESIZE) * mmap.PAGESIZE
        scheduler_extra = {
            "spec_name": "CPUOffloadingSpec",
            "cpu_bytes_to_use": CPU_CHUNKS * chunk_bytes,
            "block_size": CHUNK,
        }
        worker_extra = {
            "spec_name": "MockOffloadingSpec",
            "spec_module_path": MOCK_SPEC_MODULE,
            "block_size": CHUNK,
        }
        self.vllm_config = self._config(connector, scheduler_extra, kv_load_failure_policy, max_num_batched_tokens)
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        connector_cls = KVConnectorFactory.get_connector_class(self.vllm_config.kv_transfer_config)
        # The class the config names, from the module it names: not vLLM's by accident.
        assert connector_cls.__name__ == connector.name
        if connector.module_path is not None:
            assert connector_cls.__module__ == connector.module_path
        self.calls: list[tuple[str, tuple]] = []  # (method, argument types) the scheduler called
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        with _recording(connector_cls, self.calls):  # the constructor's calls too
            self.scheduler = scheduler_cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                log_stats=True,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=BLOCK_SIZE,
            )
        assert type(self.scheduler.connector) is connector_cls
        _record_instance(self.scheduler.connector, self.calls)

        # The connector's own worker role (kvrelay's: vLLM's worker behind kvrelay's guard).
        worker_config = self._config(connector, worker_extra, kv_load_failure_policy, max_num_batched_tokens)
        worker_cls = KVConnectorFactory.get_connector_class(worker_config.kv_transfer_config)
        self.worker = worker_cls(worker_config, KVConnectorRole.WORKER, self.kv_cache_config)
        kv_caches = {"layer": torch.zeros(num_gpu_blocks, 2, BLOCK_SIZE, 1, 1, dtype=torch.float32)}
        with set_current_vllm_config(worker_config):
            self.worker.register_kv_caches(kv_caches)
        self.mock = self.worker.connector_worker.spec.handler  # vLLM's MockOffloadingWorker

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._pending: tuple[Any, ModelRunnerOutput] | None = None  # async: last step's output
        self.jobs: dict[int, Job] = {}  # job id -> job, as the scheduler named them
        self.trace: list[StepTrace] = []
        self.stats: list[Any] = []  # SchedulerStats of every output
        self.finished: set[str] = set()

    @staticmethod
    def _config(connector, extra, policy, max_num_batched_tokens):
        config = create_vllm_config(block_size=BLOCK_SIZE, max_num_batched_tokens=max_num_batched_tokens)
        config.kv_transfer_config = KVTransferConfig(
            kv_connector=connector.name,
            kv_connector_module_path=connector.module_path,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=policy,
        )
        return config

    # requests

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        req = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(req)
        return req

    def block_ids(self, req_id: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    # steps

    def step(
        self,
        complete: Completion = True,
        invalid: Callable[[Engine, StepTrace], set[int]] | None = None,
    ) -> StepTrace:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata), type(meta)
        for job_id, entry in meta.store_jobs.items():
            self.jobs[job_id] = _job("store", entry)
        for job_id, entry in meta.load_jobs.items():
            self.jobs[job_id] = _job("load", entry)
        trace = StepTrace(
            scheduled=dict(out.num_scheduled_tokens),
            stores=[self.jobs[j] for j in meta.store_jobs],
            loads=[self.jobs[j] for j in meta.load_jobs],
            # A flush may name jobs a cache reset dropped: the worker knows them by id.
            flushed=[self.jobs[j] for j in sorted(meta.jobs_to_flush or ())],
        )
        self.trace.append(trace)

        # The worker, in the model runner's order.
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(self._ctx)
        waiting = set(self.mock.waiting_jobs)
        if complete is True:
            self.mock.complete_jobs(waiting)
        elif complete:
            self.mock.complete_jobs(complete(self, waiting))
        w.wait_for_save()
        _, recving = w.get_finished(out.finished_req_ids)
        w.get_block_ids_with_load_errors()
        w.get_kv_connector_stats()
        w.get_kv_connector_kv_cache_events()
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()

        req_ids, sampled = [], []
        for req_id in out.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            req_ids.append(req_id)
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving or None,
                invalid_block_ids=invalid(self, trace) if invalid else set(),
                kv_connector_worker_meta=worker_meta,
            ),
        )
        if self.async_scheduling:
            pending, self._pending = self._pending, (out, output)
            if pending is not None:
                self._update(*pending)
        else:
            self._update(out, output)
        return trace

    def _update(self, out, output) -> None:
        for engine_outputs in self.scheduler.update_from_output(out, output).values():
            if engine_outputs.scheduler_stats is not None:
                self.stats.append(engine_outputs.scheduler_stats)
            for o in engine_outputs.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)

    def flush_output(self) -> None:
        """Async scheduling: apply the last step's output."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._update(*pending)

    def run(self, complete: Completion = True, max_steps: int = 100, until=None) -> int:
        """Steps while the scheduler has work (or until ``until(self)``); the step count."""
        for n in range(max_steps):
            if until is not None and until(self):
                return n
            if until is None and not self.scheduler.has_requests() and self._pending is None:
                return n
            if not self.scheduler.has_requests():
                self.flush_output()
                continue
            self.step(complete)
        raise AssertionError(f"still busy after {max_steps} steps" if until is None else f"not reached in {max_steps} steps")

    # what happened

    def stores(self, req_id: str | None = None) -> list[Job]:
        return [j for t in self.trace for j in t.stores if req_id in (None, j.req_id)]

    def loads(self, req_id: str | None = None) -> list[Job]:
        return [j for t in self.trace for j in t.loads if req_id in (None, j.req_id)]

    def flushed(self) -> list[Job]:
        return [j for t in self.trace for j in t.flushed]

    def connector_hits(self) -> tuple[int, int]:
        """(queries, hits) of the scheduler's connector prefix-cache stats, summed."""
        stats = [s.connector_prefix_cache_stats for s in self.stats if s.connector_prefix_cache_stats]
        return sum(s.queries for s in stats), sum(s.hits for s in stats)

    def normalized_trace(self) -> list[tuple]:
        """The trace with job ids replaced by order of appearance (connectors may number jobs
        differently)."""
        return [
            (
                tuple(sorted(t.scheduled.items())),
                tuple(t.stores),
                tuple(t.loads),
                tuple(sorted(t.flushed, key=repr)),
            )
            for t in self.trace
        ]


def _scheduler_called(calls: list, name: str, args: tuple) -> None:
    if sys._getframe(2).f_globals.get("__name__", "").startswith("vllm.v1.core.sched"):
        calls.append((name, tuple(type(a).__name__ for a in args)))


def _methods(cls) -> Iterator[str]:
    for name in dir(cls):
        static = inspect.getattr_static(cls, name)
        if name.startswith("_") or isinstance(static, (classmethod, staticmethod, property, type)):
            continue
        if callable(static):
            yield name


@contextmanager
def _recording(cls, calls: list):
    """Records the calls vLLM's scheduler (modules vllm.v1.core.sched.*) makes on any
    instance of ``cls`` while the context lasts (the scheduler's constructor's)."""
    saved = {name: cls.__dict__.get(name) for name in _methods(cls)}
    for name in saved:
        method = getattr(cls, name)

        def wrapper(self, *args, _name=name, _method=method, **kwargs):
            _scheduler_called(calls, _name, args)
            return _method(self, *args, **kwargs)

        setattr(cls, name, wrapper)
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def _record_instance(connector, calls: list) -> None:
    """Records the calls vLLM's scheduler makes on ``connector`` from now on."""
    for name in _methods(type(connector)):
        bound = getattr(connector, name)

        def wrapper(*args, _name=name, _bound=bound, **kwargs):
            _scheduler_called(calls, _name, args)
            return _bound(*args, **kwargs)

        setattr(connector, name, wrapper)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1000 + i) % 50000 + 1 for i in range(n)]


# --- scenarios ------------------------------------------------------------------------------
# Each returns the engine after the run; the tests assert on it.


def scenario_stores(connector: Connector, async_scheduling: bool = False) -> Engine:
    e = Engine(connector, async_scheduling=async_scheduling)
    a = e.add("a", prompt(1, 2 * CHUNK + 3), max_tokens=3)  # 2 full chunks and a partial one
    e.step()  # the prompt is computed in one step
    e.blocks_a = e.block_ids("a")
    e.run()
    e.req = a
    return e


def scenario_hit_and_load(connector: Connector, async_scheduling: bool = False) -> Engine:
    e = Engine(connector, async_scheduling=async_scheduling)
    tokens = prompt(2, 2 * CHUNK + 3)
    e.add("a", tokens, max_tokens=2)
    e.run()  # a is computed, offloaded and finished
    assert e.scheduler.reset_prefix_cache()  # its GPU blocks no longer hit
    e.hits_before = e.connector_hits()
    e.trace_a = len(e.trace)
    e.req = e.add("b", tokens + [99], max_tokens=2)
    e.step(complete=False)  # b's lookup hits: a load job, b waits for it
    e.waiting_status = e.req.status
    e.blocks_b = e.block_ids("b")
    e.run()
    return e


def scenario_preemption(connector: Connector) -> Engine:
    # 8 usable GPU blocks (block 0 is the null block): two prompts of 4 blocks each fill them;
    # a's first decode token needs a fifth block, so b (the newest) is preempted while the
    # stores of its prompt are still in flight.
    e = Engine(connector, num_gpu_blocks=9)
    a = e.add("a", prompt(3, 4 * BLOCK_SIZE), max_tokens=4)
    b = e.add("b", prompt(4, 4 * BLOCK_SIZE), max_tokens=4)
    e.step(complete=False)  # both prompts; their stores go to the worker, which defers them
    e.in_flight = {j for j, job in e.jobs.items() if job.req_id == "b"}
    e.preemption = e.step(complete=False)  # a's decode needs b's blocks
    e.b_status = b.status
    e.b_blocks_after = e.block_ids("b")
    e.run()
    e.reqs = (a, b)
    return e


def scenario_load_failure(connector: Connector) -> Engine:
    e = Engine(connector, kv_load_failure_policy="recompute")
    tokens = prompt(5, 2 * CHUNK + 3)
    e.add("a", tokens, max_tokens=2)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    b = e.add("b", tokens + [99], max_tokens=3)
    load = e.step(complete=False)  # the load job, not completed
    e.load_step = load

    def second_chunk(engine: Engine, trace: StepTrace) -> set[int]:
        # The worker finishes b's load but the second chunk's blocks did not arrive.
        (job,) = engine.loads("b")
        return set(job.gpu_blocks[BLOCKS_PER_CHUNK:])

    e.failure_step = e.step(complete=True, invalid=second_chunk)
    e.computed_after_failure = b.num_computed_tokens
    e.status_after_failure = b.status
    e.recompute_step = e.step()
    e.run()
    e.req = b
    return e


def scenario_cache_reset(connector: Connector) -> Engine:
    e = Engine(connector)
    tokens = prompt(6, 2 * CHUNK + 3)
    a = e.add("a", tokens, max_tokens=1)
    # a finishes; the step after hands its stores to the worker, which never completes them.
    e.run(complete=False, until=lambda eng: "a" in eng.finished and eng.stores("a"))
    e.in_flight = {j for j, job in e.jobs.items() if job.req_id == "a"}
    e.jobs_before = dict(e.jobs)
    e.reset_ok = e.scheduler.reset_prefix_cache(reset_connector=True)
    e.busy_after_reset = e.scheduler.has_requests()
    e.trace_before = len(e.trace)
    e.steps_to_drain = e.run(complete=False)  # nothing completes but the flush
    e.req_a = a
    e.hits_before = e.connector_hits()
    e.req = e.add("c", tokens + [99], max_tokens=1)
    e.run()
    return e


# --- tests ----------------------------------------------------------------------------------


def _same_jobs_as_vllm(engine: Engine, connector: Connector, scenario, *args) -> None:
    if connector is VLLM:
        return
    reference = scenario(VLLM, *args)
    assert engine.normalized_trace() == reference.normalized_trace()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_stores(connector: Connector, async_scheduling: bool):
    """A computed prompt's full chunks are offloaded; the partial chunk is not."""
    e = scenario_stores(connector, async_scheduling)
    stores = e.stores("a")
    assert stores, "the prompt's chunks were never stored"
    assert sum(j.num_chunks for j in stores) == 2
    stored_blocks = [b for j in stores for b in j.gpu_blocks]
    assert sorted(stored_blocks) == sorted(e.blocks_a[: 2 * BLOCKS_PER_CHUNK])
    assert len(set(stored_blocks)) == len(stored_blocks)
    assert not e.loads() and not e.flushed()
    assert "a" in e.finished and e.req.is_finished()
    assert e.req.num_output_tokens == 3
    assert not e.scheduler.has_requests()
    assert not e.mock.waiting_jobs  # every store reached the worker and completed
    # The connector's stats (as the scheduler hands them on) carry the CPU pool's usage gauge,
    # as vLLM's do.
    payloads = [repr(s.kv_connector_stats) for s in e.stats if s.kv_connector_stats]
    assert payloads and all("vllm:kv_offload_cpu_cache_usage_perc" in p for p in payloads)
    _same_jobs_as_vllm(e, connector, scenario_stores, async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_hit_and_load(connector: Connector, async_scheduling: bool):
    """The same prefix, once its GPU blocks are gone, hits the CPU pool and is loaded."""
    e = scenario_hit_and_load(connector, async_scheduling)
    b = e.req
    (load,) = e.loads("b")
    assert load.num_chunks == 2 and not load.sync
    # The load fills b's first 4 blocks, which b then uses.
    assert list(load.gpu_blocks) == e.blocks_b[: 2 * BLOCKS_PER_CHUNK]
    assert e.waiting_status == RequestStatus.WAITING_FOR_REMOTE_KVS
    queries, hits = e.connector_hits()
    assert hits - e.hits_before[1] == 2 * CHUNK
    # After the load only the rest of the prompt was computed.
    after = [t.scheduled.get("b") for t in e.trace[e.trace_a :] if t.scheduled.get("b")]
    assert after[0] == len(b.prompt_token_ids) - 2 * CHUNK
    assert "b" in e.finished and b.num_output_tokens == 2
    # b's prompt holds no new full chunk: nothing more is stored.
    assert not e.stores("b")
    assert not e.scheduler.has_requests()
    _same_jobs_as_vllm(e, connector, scenario_hit_and_load, async_scheduling)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_preemption(connector: Connector):
    """A request preempted with stores in flight has them flushed, and completes later."""
    e = scenario_preemption(connector)
    a, b = e.reqs
    assert e.in_flight, "b had no store in flight before the preemption"
    assert e.in_flight <= e.mock.flushed_jobs  # the worker waited on them
    assert e.b_status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert e.b_blocks_after == []  # b's blocks went to a
    assert "b" not in e.preemption.scheduled and e.preemption.scheduled.get("a") == 1
    # The preemption step flushes b's stores, exactly those.
    flushed = e.preemption.flushed
    assert {j.req_id for j in flushed} == {"b"} and all(j.kind == "store" for j in flushed)
    assert sum(j.num_chunks for j in flushed) == 2  # both of b's prompt chunks
    assert e.flushed() == flushed  # and nothing else is ever flushed
    assert {"a", "b"} <= e.finished
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert not e.scheduler.has_requests() and not e.mock.waiting_jobs
    _same_jobs_as_vllm(e, connector, scenario_preemption)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_load_failure(connector: Connector):
    """A load whose second chunk fails: b keeps the first chunk and recomputes the rest."""
    e = scenario_load_failure(connector)
    b = e.req
    (load,) = e.loads("b")
    assert load.num_chunks == 2
    assert e.computed_after_failure == CHUNK  # truncated at the first invalid block
    assert e.recompute_step.scheduled.get("b") == len(b.prompt_token_ids) - CHUNK
    assert "b" in e.finished and b.num_output_tokens == 3
    assert not e.scheduler.has_requests()
    _same_jobs_as_vllm(e, connector, scenario_load_failure)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_cache_reset(connector: Connector):
    """reset_prefix_cache(reset_connector=True) with stores in flight: the engine keeps
    stepping until the flush has drained, and nothing stored before the reset hits after."""
    e = scenario_cache_reset(connector)
    assert e.in_flight, "no store was in flight at the reset"
    assert e.reset_ok
    assert e.busy_after_reset  # the flush must reach the worker
    assert e.steps_to_drain >= 1
    flushed = [j for t in e.trace[e.trace_before :] for j in t.flushed]
    assert sum(j.num_chunks for j in flushed) == 2 and {j.req_id for j in flushed} == {"a"}
    assert "c" in e.finished
    _, hits = e.connector_hits()
    assert hits == e.hits_before[1]  # c found nothing offloaded
    assert not e.loads()
    assert len(e.stores("c")) >= 1  # c's prompt is offloaded anew
    assert not e.scheduler.has_requests()
    _same_jobs_as_vllm(e, connector, scenario_cache_reset)


def test_a_worker_hook_out_of_order_stops_kvrelays_worker():
    """kvrelay's guard in front of vLLM's worker: a bind before handle_preemptions (vLLM PR
    #42676) is a StepProtocolViolation, and so is every hook after it."""
    from kvrelay.vllm import StepProtocolViolation

    e = Engine(KVRELAY)
    e.add("a", prompt(1, 3 * CHUNK), max_tokens=2)
    meta = e.scheduler.schedule().kv_connector_metadata
    with pytest.raises(StepProtocolViolation, match="bind is not legal"):
        e.worker.bind_connector_metadata(meta)
    with pytest.raises(StepProtocolViolation):
        e.worker.handle_preemptions(meta)
