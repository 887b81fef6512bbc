"""The native half of ``kvrelay.vllm.KvrelayOffloadingConnector`` (``_OffloadScheduler``), driven
the way the Python half drives it from vLLM's scheduler, with stand-ins for vLLM's ``Request``
and ``SchedulerOutput`` (the real ones need torch: the real-``Scheduler`` test is
``tests/vllm``, run by ``scripts/connector.sh``).

Protects, for the connector: a prompt's full chunks are stored once scheduled; a store is
loadable only once every worker acknowledged it; a hit becomes one load job onto the new blocks
from the stored chunks; a request whose keys are being loaded waits (pending); a preempted
request's stores are flushed; vLLM's assertions are typed errors that stick; bad input is a
typed error; the hash table stays bounded however many requests pass. For the worker's guard
(``_StepGuard``): vLLM's step order passes step after step; a hook out of order is a violation
that sticks.
"""

import hashlib
from types import SimpleNamespace

import pytest

from kvrelay._kvrelay import StepProtocolViolation, UnsupportedConfig, _OffloadScheduler, _StepGuard

WAITING, RUNNING, FINISHED_STOPPED = 1, 5, 7  # vLLM 0.33's RequestStatus values
BLOCK = 4


def scheduler(**kw):
    args = dict(
        block_size=BLOCK, groups=[None], blocks_per_chunk=1, num_workers=2, num_chunks=64,
        policy="lru", store_threshold=0, max_tracker_size=64_000, offload_prompt_only=True,
        sync_load_budget_tokens=0, enable_prefix_caching=True, num_gpu_blocks=256,
        max_model_len=4096,
    )
    args.update(kw)
    return _OffloadScheduler(**args)


def request(rid, tokens):
    """A stand-in for vLLM's Request: chained sha256 block hashes as vLLM computes them."""
    hashes, parent = [], b""
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + bytes(tokens[i * BLOCK:(i + 1) * BLOCK])).digest()
        hashes.append(parent)
    return SimpleNamespace(
        request_id=rid, all_token_ids=list(tokens), num_prompt_tokens=len(tokens),
        block_hashes=hashes, status=WAITING, num_computed_tokens=0, num_preemptions=0,
        kv_transfer_params=None,
    )


def output(new=(), cached=(), finished=(), preempted=None):
    """A stand-in SchedulerOutput: ``new`` of (request, blocks, tokens), ``cached`` of
    (request, new blocks or None, tokens)."""
    sched = {r.request_id: n for r, _, n in [*new, *cached]}
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(b,), num_computed_tokens=r.num_computed_tokens)
            for r, b, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            num_computed_tokens=[r.num_computed_tokens for r, _, _ in cached],
        ),
        num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
        finished_req_ids=set(finished), preempted_req_ids=preempted,
    )


def admit(s, r, blocks, local_hit=0):
    """on_new_request, the lookup, the allocation: the external tokens."""
    s.on_new_request(r)
    ext, load_async = s.lookup(r, local_hit)
    s.after_alloc(r, (blocks,), ext or 0)
    return ext, load_async


def run_prompt(s, r, blocks):
    """Admits and schedules ``r``'s whole prompt; the step's (loads, stores, flush)."""
    admit(s, r, blocks)
    meta = s.build_meta(output(new=[(r, blocks, len(r.all_token_ids))]), [r])
    r.status, r.num_computed_tokens = RUNNING, len(r.all_token_ids)
    return meta


def finish(s, r, blocks):
    r.status = FINISHED_STOPPED
    assert s.request_finished(r, (blocks,)) is False  # never delays the free
    s.build_meta(output(finished=[r.request_id]), [])


def test_a_prompt_is_stored_and_loadable_only_once_every_worker_acknowledged():
    s = scheduler()
    r1, blocks = request("r1", range(16)), [1, 2, 3, 4]
    loads, stores, flush = run_prompt(s, r1, blocks)
    assert loads == [] and flush == []
    [(job, rid, gpu, first, chunks, sync)] = stores
    assert (rid, gpu, first, sync) == ("r1", [blocks], [0], False)
    assert len(memoryview(chunks).cast("i")) == 4
    finish(s, r1, blocks)
    s.update_output({job: 1})  # one of two workers
    r2 = request("r2", range(16))
    s.on_new_request(r2)
    assert s.lookup(r2, 0) == (None, False), "a store half acknowledged is pending, not a hit"
    s.update_output({job: 1})
    assert s.lookup(r2, 0) == (16, True), "every chunk of the prompt"


def test_a_hit_is_one_load_onto_the_new_blocks_and_its_keys_wait_for_it():
    s = scheduler(num_workers=1)
    r1, b1 = request("r1", range(16)), [1, 2, 3, 4]
    [(job, *_rest, chunks, _)] = run_prompt(s, r1, b1)[1]
    s.update_output({job: 1})
    finish(s, r1, b1)
    r2, b2 = request("r2", range(20)), [5, 6, 7, 8, 9]
    assert admit(s, r2, b2) == (16, True)
    loads, stores, _ = s.build_meta(output(), [])
    [(load, rid, gpu, first, src, sync)] = loads
    assert (rid, gpu, first, sync) == ("r2", [[5, 6, 7, 8]], [0], False)
    assert bytes(src) == bytes(chunks), "loaded from the chunks the store wrote"
    r3 = request("r3", range(16))
    s.on_new_request(r3)
    assert s.lookup(r3, 0) == (None, False), "keys being loaded: pending"
    s.update_output({load: 1})
    assert s.lookup(r3, 0) == (16, True)


def test_a_preempted_requests_stores_are_flushed():
    s = scheduler()
    r1, b1 = request("r1", range(16)), [1, 2, 3, 4]
    [(job, *_)] = run_prompt(s, r1, b1)[1]
    r1.status, r1.num_computed_tokens, r1.num_preemptions = WAITING, 0, 1
    _, _, flush = s.build_meta(output(preempted={"r1"}), [r1])
    assert flush == [job]


def test_an_acknowledgement_of_an_unknown_job_is_an_assertion_that_sticks():
    s = scheduler()
    with pytest.raises(AssertionError, match="kvrelay connector"):
        s.update_output({7: 1})
    with pytest.raises(AssertionError):
        s.update_output({})


def test_bad_input_is_a_typed_error():
    with pytest.raises(UnsupportedConfig, match="eviction policy"):
        scheduler(policy="fifo")
    with pytest.raises(UnsupportedConfig):
        scheduler(blocks_per_chunk=0)
    s = scheduler()
    r = request("r", range(8))
    r.block_hashes[0] = "not bytes"
    with pytest.raises(TypeError, match="bytes"):
        s.on_new_request(r)
    r = request("q", range(8))
    r.status = 99
    with pytest.raises(TypeError, match="RequestStatus"):
        s.on_new_request(r)


def test_the_hash_table_stays_bounded():
    s = scheduler(num_workers=1, num_chunks=8)
    s._set_hash_sweep_slack(64)
    for i in range(1500):
        r, blocks = request(f"r{i}", [i % 251, i // 251, 7, 7] * 4), [1, 2, 3, 4]
        loads, stores, _ = run_prompt(s, r, blocks)
        finish(s, r, blocks)
        s.update_output({j[0]: 1 for j in [*loads, *stores]})
    assert s.interned_hashes < 400, s.interned_hashes


# The step-protocol guard in front of vLLM's worker (``src/guard.rs``).

# The hooks of one step as vLLM 0.33's model runner calls them (async loads, no deferral).
STEP = [
    "handle_preemptions", "bind", "wait_for_layer_load", "save_kv_layer", "start_load_kv",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "get_stats",
    "get_events", "build_worker_meta", "clear",
]


def test_the_guard_admits_vllms_step_order_step_after_step():
    g = _StepGuard()
    for n in range(3):
        assert g.begin_step(False, True, False) == n  # steps count from 0
        for hook in STEP:
            g.handle(hook)
        assert not g.in_step


def test_a_hook_out_of_order_is_a_violation_that_sticks():
    g = _StepGuard()
    g.begin_step(False, True, False)
    with pytest.raises(StepProtocolViolation, match="bind is not legal"):
        g.handle("bind")  # before handle_preemptions (vLLM PR #42676)
    with pytest.raises(StepProtocolViolation):
        g.handle("handle_preemptions")
    g = _StepGuard()
    g.begin_step(False, True, False)
    for hook in STEP[:-1]:
        g.handle(hook)
    with pytest.raises(StepProtocolViolation, match="begin_step"):
        g.begin_step(False, True, False)  # the previous step never cleared
    with pytest.raises(ValueError, match="no worker hook"):
        _StepGuard().handle("forward")
