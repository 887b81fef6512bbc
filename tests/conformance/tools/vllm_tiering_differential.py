#!/usr/bin/env python3
"""Differential oracle for kvrelay's `tiering_manager` conformance machine (FORMAT.md), run on
vLLM 0.33.0's own tiered-offloading code.

What runs for real (imported unchanged from vLLM 0.33.0's source tree):
  - vllm/v1/kv_offload/tiering/manager.py: TieringOffloadingManager (lookup, promotions, cascades,
    job polling, request finalisation, has_pending_work, take_events) over its
    CPUPrimaryTierOffloadingManager (the CPU manager with LRU/ARC, events enabled);
  - vllm/v1/kv_offload/tiering/async_lookup.py: AsyncLookupManager's scheduler-thread code
    (lookup, flush, drain_results, mark_miss, cleanup), untouched.

What is the harness (this file):
  - HarnessTier, a SecondaryTierManager written line by line after vLLM's object-store tier
    (tiering/obj/manager.py) with the NIXL transport taken out: lookup() through an
    AsyncLookupManager subclass, submit_store()/submit_load() record the job (the case later
    finishes it with `tier_finish`), get_finished_jobs() returns the queued results and calls
    mark_miss() for the failed keys of a failed load, on_request_finished -> cleanup(),
    on_schedule_end -> flush(), on_new_request -> a default RequestOffloadingContext (chunk-level),
    drain_jobs a no-op, no KV events, no back-pressure detector;
  - HarnessLookup, the AsyncLookupManager subclass: its worker thread returns at once (nothing runs
    on its own), and `tier_answer_probes` does what AsyncLookupManager._worker does for every
    batch flush() has queued: takes it off _lookup_queue, groups it by request, answers each key
    from the tier's store (a Python set of keys the case maintains with tier_put / tier_remove /
    successful store jobs) and puts one result list per batch on _pending_results;
  - the case vocabulary: keys are strings (make_offload_key(key.encode(), 0)), one ReqContext per
    request (created by new_request, reused by every call naming it), tier_submitted reports the
    probe batches flush() posted and the jobs submitted since the last call.
  The manager is built with tier_poll_interval_s=0 (no tier-poll thread).

Error kinds are checked before vLLM is called, so a rejected call changes nothing:
unknown_request (a request without new_request, or whose state vLLM already dropped at
finalisation: vLLM would raise KeyError part-way), not_loadable / not_pinned (vLLM's asserts in
prepare_load / complete_load, as refcheck.py maps them for offload_manager), unknown_job. Any other
exception raised by vLLM is reported as BAD with its text. store_threshold >= 2 is set on the primary
tier directly (vLLM 0.33.0's TieringOffloadingSpec refuses it; CPUPrimaryTierOffloadingManager
takes no store_threshold argument); such cases get a NOTE. `strict` cases run in vLLM's (compat)
behaviour, with a NOTE: strict is kvrelay's extension.

Commands (run with the vLLM test venv's python; the script re-executes itself under it, with
PYTHONPATH set to the vLLM source tree, when started with another interpreter):
  replay CASE.json...        OK / BAD per tiering_manager case (other machines are skipped): each
                             call's `expect` / `expect_error` against vLLM's answer; calls with
                             neither only have to succeed. Exit status 1 on any BAD.
  fill CASE.json...          write vLLM's answers into the cases' expectations (a case where vLLM
                             raises is reported BAD and left unchanged).
  generate N DIR [--seed S]  write N random cases whose expectations vLLM produced into DIR. Cases
                             are generated under PYTHONHASHSEED=0 and replayed in subprocesses
                             under PYTHONHASHSEED=1 and 2; a case whose answers differ is dropped
                             and replaced by the next index. Same --seed => same cases.

  ~/.cache/kvrelay/vllm-tests/venv/bin/python tests/conformance/tools/vllm_tiering_differential.py \\
      replay tests/conformance/cases/kvrelay/tiering-*.json

Environment: VLLM_SDIST (default ~/.cache/kvrelay/vllm-tests/vllm-0.33.0), VLLM_TESTS_PY (default
~/.cache/kvrelay/vllm-tests/venv/bin/python).
"""
import argparse, json, os, random, subprocess, sys

HOME = os.path.expanduser("~")
VLLM_SDIST = os.environ.get("VLLM_SDIST", os.path.join(HOME, ".cache", "kvrelay", "vllm-tests", "vllm-0.33.0"))
VENV_PY = os.environ.get("VLLM_TESTS_PY", os.path.join(HOME, ".cache", "kvrelay", "vllm-tests", "venv", "bin", "python"))
GEN_HASHSEED = "0"
CHECK_HASHSEEDS = ["1", "2"]


def _ensure_interpreter():
    """Re-execute under the vLLM test venv (torch, numpy, msgspec) with the source tree importable."""
    if os.environ.get("_VLLM_TIERING_REEXEC") == "1":
        return
    env = dict(os.environ, _VLLM_TIERING_REEXEC="1")
    pp = env.get("PYTHONPATH", "")
    if VLLM_SDIST not in pp.split(os.pathsep):
        env["PYTHONPATH"] = VLLM_SDIST + (os.pathsep + pp if pp else "")
    py = VENV_PY if os.path.exists(VENV_PY) else sys.executable
    os.execve(py, [py] + sys.argv, env)


# =============================================================================================
# vLLM side (imported lazily: importing vLLM takes tens of seconds)

V = None  # namespace of the vLLM objects and the harness classes built on them


def vllm():
    global V
    if V is not None:
        return V
    if VLLM_SDIST not in sys.path:
        sys.path.insert(0, VLLM_SDIST)
    import io, contextlib, logging, types, collections, queue
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        import numpy as np
        from vllm.v1.kv_offload.base import (LookupResult, Medium, ReqContext, RequestOffloadingContext,
                                             ScheduleEndContext, make_offload_key)
        from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
        from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
        from vllm.v1.kv_offload.tiering.manager import (CPUPrimaryTierOffloadingManager,
                                                        TieringOffloadingManager)
    logging.disable(logging.CRITICAL)

    class Region:
        """Stands in for SharedOffloadRegion, as vLLM's tests' _mock_mmap_region does."""

        def __init__(self, num_chunks, row_bytes=16):
            self._arr = np.zeros((num_chunks, row_bytes), dtype=np.int8)

        def create_kv_memoryview(self):
            return memoryview(self._arr)

        def cleanup(self):
            pass

    class RecordingQueue:
        """_lookup_queue: FIFO with SimpleQueue's put/get_nowait; every batch put is recorded (the
        probes `tier_submitted` reports)."""

        def __init__(self, on_put):
            self._q = collections.deque()
            self._on_put = on_put

        def put(self, item, block=True, timeout=None):
            if item is not None:
                self._on_put(item)
            self._q.append(item)

        put_nowait = put

        def get_nowait(self):
            if not self._q:
                raise queue.Empty
            return self._q.popleft()

        def get(self, block=True, timeout=None):
            return self.get_nowait()

        def empty(self):
            return not self._q

    class HarnessLookup(AsyncLookupManager):
        """vLLM's AsyncLookupManager with the worker thread idle; batches are answered on demand."""

        def __init__(self, tier, tier_type):
            super().__init__(tier_type=tier_type)
            self._tier = tier
            self._lookup_queue = RecordingQueue(tier._record_probes)

        def _worker(self):  # the background thread does nothing on its own
            return

        def batch_lookup(self, keys, req_context):
            return [k in self._tier.store for k in keys]

        def answer_all(self):
            """AsyncLookupManager._worker's loop body, for every queued batch."""
            while True:
                try:
                    pending = self._lookup_queue.get_nowait()
                except queue.Empty:
                    break
                if pending is None:
                    continue
                batches = {}
                for key, req_context, generation in pending:
                    req_id = req_context.req_id
                    if req_id not in batches:
                        batches[req_id] = (req_context, [])
                    batches[req_id][1].append((key, generation))
                if not batches:
                    continue
                results = []
                for req_context, entries in batches.values():
                    keys = [key for key, _ in entries]
                    hits = list(self.batch_lookup(keys, req_context))
                    for (key, generation), hit in zip(entries, hits):
                        results.append((key, generation, hit))
                if results:
                    self._pending_results.put(results)

    class HarnessTier(SecondaryTierManager):
        """vLLM's ObjectStoreSecondaryTierManager (tiering/obj/manager.py) without NIXL."""

        medium = Medium.STORAGE

        def __init__(self, primary_kv_view, tier_type):
            super().__init__(None, primary_kv_view, tier_type, None)
            self.locality = None
            self.events = None  # enable_kv_events off: the obj tier emits none
            self._store_job_keys = {}
            self._load_job_keys = {}
            self._pending_results = []
            # the harness: the store behind the tier, jobs in flight, what was asked since
            # the last tier_submitted
            self.store = set()
            self.in_flight = {}  # job id -> ("store" | "load", [keys])
            self.sub_probes = []
            self.sub_stores = []
            self.sub_loads = []
            self.n_loads = 0
            self._lookup_manager = HarnessLookup(self, tier_type)

        def _record_probes(self, batch):
            self.sub_probes.extend(key for key, _ctx, _gen in batch)

        def lookup(self, key, req_context):
            result = self._lookup_manager.lookup(key, req_context)
            if result is None:
                return LookupResult.RETRY
            return LookupResult.HIT if result else LookupResult.MISS

        def submit_store(self, job_metadata):
            if self.events is not None:
                self._store_job_keys[job_metadata.job_id] = list(job_metadata.keys)
            keys = list(job_metadata.keys)
            self.in_flight[job_metadata.job_id] = ("store", keys)
            self.sub_stores.append((job_metadata.job_id, keys))

        def submit_load(self, job_metadata):
            self._load_job_keys[job_metadata.job_id] = list(job_metadata.keys)
            keys = list(job_metadata.keys)
            self.in_flight[job_metadata.job_id] = ("load", keys)
            self.sub_loads.append((job_metadata.job_id, keys))
            self.n_loads += 1

        def on_request_finished(self, req_context):
            self._lookup_manager.cleanup(req_context.req_id)

        def on_schedule_end(self, context):
            self._lookup_manager.flush()

        def on_new_request(self, req_context):
            return RequestOffloadingContext()

        def finish(self, job_id, success, successful_keys):
            """The case's tier_finish: the transfer ends (obj tier: _poll_active_transfers)."""
            kind, keys = self.in_flight.pop(job_id)
            if kind == "store" and success:
                self.store.update(keys)
            self._pending_results.append(JobResult(job_id=job_id, success=success,
                                                   successful_keys=successful_keys))

        def get_finished_jobs(self):
            results = self._pending_results
            self._pending_results = []
            for result in results:
                if self.events is not None:
                    keys = self._store_job_keys.pop(result.job_id, None)
                load_keys = self._load_job_keys.pop(result.job_id, None)
                if load_keys is not None and not result.success:
                    successful = set(result.successful_keys or ())
                    failed = [k for k in load_keys if k not in successful]
                    self._lookup_manager.mark_miss(failed)
            return results

        def drain_jobs(self):
            return

    V = types.SimpleNamespace(**locals())
    return V


# =============================================================================================
# One case against vLLM

class CaseError(Exception):
    """A typed error of the machine (expect_error)."""


class BadInput(Exception):
    """A case the machine rejects as malformed (not a vLLM answer)."""


CONFIG_KEYS = {"capacity_chunks", "policy", "store_threshold", "tiers", "mode", "deadline_steps"}
CALL_ARGS = {
    "new_request": ({"request"}, set()),
    "lookup": ({"key", "request"}, set()),
    "prepare_store": ({"keys", "request"}, set()),
    "complete_store": ({"keys", "request"}, {"success"}),
    "prepare_load": ({"keys", "request"}, set()),
    "complete_load": ({"keys", "request"}, set()),
    "touch": ({"keys", "request"}, set()),
    "request_finished": ({"request"}, set()),
    "schedule_end": (set(), set()),
    "has_pending_work": (set(), set()),
    "take_events": (set(), set()),
    "tier_put": ({"keys"}, {"tier"}),
    "tier_remove": ({"keys"}, {"tier"}),
    "tier_submitted": (set(), {"tier"}),
    "tier_answer_probes": (set(), {"tier"}),
    "tier_finish": ({"job"}, {"tier", "success", "successful_keys"}),
}


class Oracle:
    def __init__(self, config):
        v = vllm()
        cfg = dict(config or {})
        unknown = set(cfg) - CONFIG_KEYS
        if unknown:
            raise BadInput("unknown config keys %s" % sorted(unknown))
        if not isinstance(cfg.get("capacity_chunks"), int) or cfg["capacity_chunks"] < 1:
            raise BadInput("capacity_chunks: integer >= 1 required")
        policy = cfg.get("policy", "lru")
        if policy not in ("lru", "arc"):
            raise BadInput("policy: lru or arc")
        ntiers = cfg.get("tiers", 1)
        if not isinstance(ntiers, int) or not 1 <= ntiers <= 4:
            raise BadInput("tiers: integer 1 to 4")
        threshold = cfg.get("store_threshold", 1)
        if not isinstance(threshold, int):
            raise BadInput("store_threshold: integer")
        if cfg.get("mode", "compat") not in ("compat", "strict"):
            raise BadInput("mode: compat or strict")
        cap = cfg["capacity_chunks"]
        self.v = v
        self.primary = v.CPUPrimaryTierOffloadingManager(num_chunks=cap, mmap_region=v.Region(cap),
                                                         cache_policy=policy, enable_events=True)
        if threshold >= 2:
            # what CPUOffloadingManager(store_threshold=...) sets up; the primary tier's
            # constructor does not take it (and TieringOffloadingSpec refuses it)
            import collections
            self.primary.store_threshold = threshold
            self.primary.counts = collections.OrderedDict()
        view = self.primary.get_kv_memoryview()
        self.tiers = [v.HarnessTier(view, "case_tier_%d" % i) for i in range(ntiers)]
        self.m = v.TieringOffloadingManager(self.primary, self.tiers, tier_poll_interval_s=0)
        self.ctx = {}
        self._keys = {}
        self._names = {}
        self.lookup_names = {v.LookupResult.MISS: "miss", v.LookupResult.HIT: "hit",
                             v.LookupResult.HIT_PENDING: "hit_pending", v.LookupResult.RETRY: "retry"}

    # --- vocabulary ---
    def K(self, s):
        if not isinstance(s, str):
            raise BadInput("a key must be a string: %r" % (s,))
        k = self._keys.get(s)
        if k is None:
            k = self.v.make_offload_key(s.encode(), 0)
            self._keys[s] = k
            self._names[k] = s
        return k

    def Ks(self, a):
        keys = a["keys"]
        if not isinstance(keys, list):
            raise BadInput("keys must be an array")
        return [self.K(s) for s in keys]

    def U(self, k):
        return self._names[k]

    def req(self, a):
        r = a["request"]
        if not isinstance(r, str):
            raise BadInput("request must be a string")
        ctx = self.ctx.get(r)
        if ctx is None or r not in self.m._req_state:
            raise CaseError("unknown_request")
        return ctx

    def tier(self, a):
        t = a.get("tier", 0)
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < len(self.tiers):
            raise BadInput("tier out of range: %r" % (t,))
        return self.tiers[t]

    # --- one call: ("value", result) | ("error", kind); raises BadInput / vLLM exceptions ---
    def call(self, c):
        call = c.get("call")
        a = c.get("args", {}) or {}
        if call not in CALL_ARGS:
            raise BadInput("unknown call %r" % (call,))
        need, opt = CALL_ARGS[call]
        if set(a) - need - opt or need - set(a):
            raise BadInput("%s takes %s (optional %s), got %s" % (call, sorted(need), sorted(opt), sorted(a)))
        try:
            return ("value", getattr(self, "c_" + call)(a))
        except CaseError as e:
            return ("error", e.args[0])

    def c_new_request(self, a):
        r = a["request"]
        if not isinstance(r, str):
            raise BadInput("request must be a string")
        ctx = self.v.ReqContext(req_id=r)
        self.ctx[r] = ctx
        return self.m.on_new_request(ctx).policy.value

    def c_lookup(self, a):
        ctx = self.req(a)
        return self.lookup_names[self.m.lookup(self.K(a["key"]), ctx)]

    def c_prepare_store(self, a):
        ctx = self.req(a)
        r = self.m.prepare_store(self.Ks(a), ctx)
        if r is None:
            return None
        return {"keys_to_store": [self.U(k) for k in r.keys_to_store],
                "evicted_keys": sorted(set(self.U(k) for k in r.evicted_keys))}

    def c_complete_store(self, a):
        ctx = self.req(a)
        success = a.get("success", True)
        if not isinstance(success, bool):
            raise BadInput("success must be a bool")
        self.m.complete_store(self.Ks(a), ctx, success)
        return "ok"

    def c_prepare_load(self, a):
        ctx = self.req(a)
        keys = self.Ks(a)
        for k in keys:
            ch = self.primary._policy.get(k)
            if ch is None or not ch.is_ready:
                raise CaseError("not_loadable")
        self.m.prepare_load(keys, ctx)
        return "ok"

    def c_complete_load(self, a):
        ctx = self.req(a)
        keys = self.Ks(a)
        for k in set(keys):
            ch = self.primary._policy.get(k)
            if ch is None or ch.ref_cnt < keys.count(k):
                raise CaseError("not_pinned")
        self.m.complete_load(keys, ctx)
        return "ok"

    def c_touch(self, a):
        ctx = self.req(a)
        self.m.touch(self.Ks(a), ctx)
        return "ok"

    def c_request_finished(self, a):
        ctx = self.req(a)
        self.m.on_request_finished(ctx)
        return "ok"

    def c_schedule_end(self, a):
        self.m.on_schedule_end(self.v.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        return "ok"

    def c_has_pending_work(self, a):
        return bool(self.m.has_pending_work())

    def c_take_events(self, a):
        return [{"keys": sorted(set(self.U(k) for k in e.keys)), "removed": bool(e.removed)}
                for e in self.m.take_events()]

    def c_tier_put(self, a):
        self.tier(a).store.update(self.Ks(a))
        return "ok"

    def c_tier_remove(self, a):
        self.tier(a).store.difference_update(self.Ks(a))
        return "ok"

    def c_tier_submitted(self, a):
        t = self.tier(a)
        out = {"probes": sorted(set(self.U(k) for k in t.sub_probes)),
               "stores": [{"job": j, "keys": [self.U(k) for k in ks]} for j, ks in t.sub_stores],
               "loads": [{"job": j, "keys": [self.U(k) for k in ks]} for j, ks in t.sub_loads]}
        t.sub_probes, t.sub_stores, t.sub_loads = [], [], []
        return out

    def c_tier_answer_probes(self, a):
        self.tier(a)._lookup_manager.answer_all()
        return "ok"

    def c_tier_finish(self, a):
        t = self.tier(a)
        job = a["job"]
        success = a.get("success", True)
        sk = a.get("successful_keys")
        if not isinstance(job, int) or isinstance(job, bool):
            raise BadInput("job must be an integer")
        if not isinstance(success, bool):
            raise BadInput("success must be a bool")
        if sk is not None and not isinstance(sk, list):
            raise BadInput("successful_keys must be an array or null")
        if job not in t.in_flight:
            raise CaseError("unknown_job")
        t.finish(job, success, None if sk is None else [self.K(s) for s in sk])
        return "ok"


def norm_expect(call, v):
    """FORMAT normalisation of the set-valued parts of a result."""
    if call == "prepare_store" and isinstance(v, dict) and isinstance(v.get("evicted_keys"), list):
        v = dict(v, evicted_keys=sorted(set(v["evicted_keys"])))
    elif call == "take_events" and isinstance(v, list):
        v = [dict(e, keys=sorted(set(e["keys"]))) if isinstance(e, dict) and isinstance(e.get("keys"), list) else e
             for e in v]
    elif call == "tier_submitted" and isinstance(v, dict) and isinstance(v.get("probes"), list):
        v = dict(v, probes=sorted(set(v["probes"])))
    return v


def run_case(case):
    """vLLM's answer per call: list of ("value", v) | ("error", kind); stops with ("bad", text) at a
    malformed call or an exception raised by vLLM."""
    out = []
    try:
        o = Oracle(case.get("config"))
    except BadInput as e:
        return [("bad", "config: %s" % e)]
    for c in case.get("calls", []):
        try:
            out.append(o.call(c))
        except BadInput as e:
            out.append(("bad", "bad input: %s" % e))
            break
        except Exception as e:  # vLLM raised: report its text
            out.append(("bad", "vLLM raised %s: %s" % (type(e).__name__, e)))
            break
    return out


def compare(case, res):
    """None when vLLM agrees with the case, else the BAD message."""
    calls = case.get("calls", [])
    for i, c in enumerate(calls):
        if i >= len(res):
            break
        got = res[i]
        call = c.get("call")
        if got[0] == "bad":
            return "call %d (%s): %s" % (i, call, got[1])
        if "expect_error" in c:
            exp = ("error", c["expect_error"])
        elif "expect" in c:
            exp = ("value", norm_expect(call, c["expect"]))
        else:
            if got[0] == "error":
                return "call %d (%s): expected success, got error %s" % (i, call, got[1])
            continue
        if exp != got:
            fmt = lambda x: ("error " + json.dumps(x[1])) if x[0] == "error" else json.dumps(x[1])
            return "call %d (%s): expected %s, got %s" % (i, call, fmt(exp), fmt(got))
    if res and res[-1][0] == "bad" and len(res) <= len(calls):
        i = len(res) - 1
        return "call %d (%s): %s" % (i, calls[i].get("call"), res[-1][1])
    return None


def notes(case):
    cfg = case.get("config") or {}
    n = []
    if cfg.get("mode") == "strict":
        n.append("strict mode is kvrelay's extension; vLLM's (compat) behaviour is checked")
    if isinstance(cfg.get("store_threshold"), int) and cfg["store_threshold"] >= 2:
        n.append("store_threshold >= 2: vLLM 0.33.0's TieringOffloadingSpec refuses it; the oracle sets it "
                 "on the primary tier directly")
    return n


def dump_case(case, path):
    """One call per line."""
    head = {k: v for k, v in case.items() if k != "calls"}
    lines = ["{"]
    for k, v in head.items():
        lines.append("  %s: %s," % (json.dumps(k), json.dumps(v)))
    lines.append('  "calls": [')
    calls = case.get("calls", [])
    for i, c in enumerate(calls):
        lines.append("    " + json.dumps(c) + ("," if i + 1 < len(calls) else ""))
    lines.append("  ]")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def load(path):
    with open(path) as f:
        return json.load(f)


# =============================================================================================
# Commands

def cmd_replay(paths, quiet=False):
    vllm()
    bad, ok, skipped = [], 0, 0
    for path in paths:
        try:
            case = load(path)
        except Exception as e:
            bad.append(path)
            print("BAD %s: cannot parse: %s" % (path, e))
            continue
        if case.get("machine") != "tiering_manager":
            skipped += 1
            if not quiet:
                print("SKIP %s (machine %s)" % (path, case.get("machine")))
            continue
        name = case.get("name", path)
        d = compare(case, run_case(case))
        if d is None:
            ok += 1
            if not quiet:
                print("OK %s" % name)
                for n in notes(case):
                    print("  NOTE %s: %s" % (name, n))
        else:
            bad.append(path)
            print("BAD %s: %s" % (name, d))
    if not quiet:
        print("%d OK, %d BAD%s" % (ok, len(bad), ", %d skipped" % skipped if skipped else ""))
    return bad


def cmd_fill(paths):
    vllm()
    rc = 0
    for path in paths:
        case = load(path)
        if case.get("machine") != "tiering_manager":
            print("SKIP %s" % path)
            continue
        res = run_case(case)
        if any(r[0] == "bad" for r in res):
            rc = 1
            print("BAD %s: %s (not written)" % (case.get("name", path), compare(case, res)))
            continue
        changed = 0
        for c, r in zip(case["calls"], res):
            before = dict(c)
            c.pop("expect", None)
            c.pop("expect_error", None)
            if r[0] == "error":
                c["expect_error"] = r[1]
            else:
                c["expect"] = r[1]
            changed += before != c
        dump_case(case, path)
        print("filled %s: %d of %d calls changed" % (path, changed, len(case["calls"])))
        for n in notes(case):
            print("  NOTE %s: %s" % (case.get("name", path), n))
    return rc


# --- generator ---

class Gen:
    """One random case, built call by call against a live oracle so that every call is one vLLM
    accepts (requests named only between new_request and request_finished, complete_store of a
    batch prepare_store returned, prepare_load of ready keys, complete_load of pins, tier_finish of
    jobs in flight)."""

    def __init__(self, rng, name):
        self.rng = rng
        cap = rng.randint(2, 6)
        cfg = {"capacity_chunks": cap}
        if rng.random() < 0.4:
            cfg["policy"] = "arc"
        elif rng.random() < 0.3:
            cfg["policy"] = "lru"
        if rng.random() < 0.15:
            cfg["store_threshold"] = 2
        elif rng.random() < 0.1:
            cfg["store_threshold"] = 1
        ntiers = 2 if rng.random() < 0.3 else 1
        if ntiers != 1 or rng.random() < 0.3:
            cfg["tiers"] = ntiers
        self.ntiers = ntiers
        self.keys = list("abcdefgh"[: min(8, cap + rng.randint(1, 3))])
        self.o = Oracle(cfg)
        self.case = {"name": name, "machine": "tiering_manager", "config": cfg, "calls": []}
        self.next_req = 1
        self.live = []          # requests between new_request and request_finished
        self.batches = {}       # request -> [keys_to_store lists not yet completed]
        self.pins = {}          # request -> [key lists prepared for load]
        self.hits = {}          # request -> keys whose lookup said hit
        self.looked = {}        # request -> keys looked up

    def emit(self, call, args=None):
        c = {"call": call}
        if args:
            c["args"] = args
        r = self.o.call(c)
        if r[0] == "error":
            c["expect_error"] = r[1]
        else:
            c["expect"] = r[1]
        self.case["calls"].append(c)
        return r

    def some_keys(self, lo=1, hi=3):
        n = self.rng.randint(lo, min(hi, len(self.keys)))
        return self.rng.sample(self.keys, n)

    def tier_arg(self, args):
        if self.ntiers > 1 or self.rng.random() < 0.2:
            args["tier"] = self.rng.randrange(self.ntiers)
        return args

    def ready(self, k):
        ch = self.o.primary._policy.get(self.o.K(k))
        return ch is not None and ch.is_ready

    def step(self):
        rng, o = self.rng, self.o
        acts = []
        w = lambda name, weight: acts.append((name, weight))
        if len(self.live) < 3:
            w("new_request", 3 if not self.live else 1)
        if self.live:
            w("lookup", 10)
            w("prepare_store", 4)
            w("touch", 1)
            w("prepare_load", 3)
            w("request_finished", 1.5)
        if any(self.batches.values()):
            w("complete_store", 5)
        if any(self.pins.values()):
            w("complete_load", 3)
        w("schedule_end", 2)
        w("round", 6)
        w("has_pending_work", 1.5)
        w("take_events", 1.5)
        w("tier_put", 3)
        w("tier_remove", 1)
        w("tier_submitted", 2)
        w("tier_answer_probes", 1.5)
        if any(t.in_flight for t in o.tiers):
            w("tier_finish", 8)
        total = sum(x for _, x in acts)
        pick = rng.random() * total
        for act, x in acts:
            pick -= x
            if pick < 0:
                break
        getattr(self, "g_" + act)()

    def g_new_request(self):
        r = "r%d" % self.next_req
        self.next_req += 1
        self.emit("new_request", {"request": r})
        self.live.append(r)

    def g_lookup(self):
        r = self.rng.choice(self.live)
        seen = self.looked.setdefault(r, [])
        stored = sorted(set(self.o.U(k) for t in self.o.tiers for k in t.store))
        x = self.rng.random()
        if seen and x < 0.45:
            k = self.rng.choice(seen)
        elif stored and x < 0.75:
            k = self.rng.choice(stored)
        else:
            k = self.rng.choice(self.keys)
        res = self.emit("lookup", {"key": k, "request": r})
        if k not in seen:
            seen.append(k)
        if res == ("value", "hit"):
            self.hits.setdefault(r, set()).add(k)

    def g_prepare_store(self):
        r = self.rng.choice(self.live)
        keys = self.some_keys()
        res = self.emit("prepare_store", {"keys": keys, "request": r})
        if res[0] == "value" and res[1] and res[1]["keys_to_store"]:
            self.batches.setdefault(r, []).append(res[1]["keys_to_store"])

    def g_complete_store(self):
        r = self.rng.choice([r for r, b in self.batches.items() if b])
        b = self.batches[r]
        keys = b.pop(self.rng.randrange(len(b)))
        args = {"keys": keys, "request": r}
        if self.rng.random() < 0.15:
            args["success"] = False
        elif self.rng.random() < 0.1:
            args["success"] = True
        self.emit("complete_store", args)

    def g_touch(self):
        self.emit("touch", {"keys": self.some_keys(), "request": self.rng.choice(self.live)})

    def g_prepare_load(self):
        r = self.rng.choice(self.live)
        cands = [k for k in sorted(self.hits.get(r, ())) if self.ready(k)]
        if not cands or self.rng.random() < 0.2:
            cands = [k for k in self.keys if self.ready(k)]
        if not cands and self.rng.random() < 0.8:
            return self.g_lookup()
        if not cands or self.rng.random() < 0.05:
            keys = self.some_keys(1, 2)  # may well be not_loadable
        else:
            keys = self.rng.sample(cands, self.rng.randint(1, min(2, len(cands))))
        res = self.emit("prepare_load", {"keys": keys, "request": r})
        if res == ("value", "ok"):
            self.pins.setdefault(r, []).append(keys)

    def g_complete_load(self):
        r = self.rng.choice([r for r, p in self.pins.items() if p])
        p = self.pins[r]
        keys = p.pop(self.rng.randrange(len(p)))
        self.emit("complete_load", {"keys": keys, "request": r})

    def g_request_finished(self):
        cands = [r for r in self.live if not self.pins.get(r)]
        if not cands:
            return self.g_complete_load()
        r = self.rng.choice(cands)
        self.emit("request_finished", {"request": r})
        self.live.remove(r)

    def g_schedule_end(self):
        self.emit("schedule_end")

    def g_round(self):
        """The end of a step and the tiers answering the probes it flushed."""
        self.emit("schedule_end")
        for i in range(self.ntiers):
            if self.rng.random() < 0.8:
                self.emit("tier_answer_probes", {"tier": i} if i or self.rng.random() < 0.2 else None)

    def g_has_pending_work(self):
        self.emit("has_pending_work")

    def g_take_events(self):
        self.emit("take_events")

    def g_tier_put(self):
        self.emit("tier_put", self.tier_arg({"keys": self.some_keys(1, 2)}))

    def g_tier_remove(self):
        args = self.tier_arg({})
        store = sorted(self.o.U(k) for k in self.o.tiers[args.get("tier", 0)].store)
        if store and self.rng.random() < 0.9:
            keys = self.rng.sample(store, self.rng.randint(1, min(2, len(store))))
        else:
            keys = self.some_keys(1, 1)
        args["keys"] = keys
        self.emit("tier_remove", args)

    def g_tier_submitted(self):
        self.emit("tier_submitted", self.tier_arg({}))

    def g_tier_answer_probes(self):
        self.emit("tier_answer_probes", self.tier_arg({}))

    def g_tier_finish(self):
        rng = self.rng
        tiers = [i for i, t in enumerate(self.o.tiers) if t.in_flight]
        i = rng.choice(tiers)
        t = self.o.tiers[i]
        job = rng.choice(sorted(t.in_flight))
        kind, keys = t.in_flight[job]
        args = {"job": job}
        if i or rng.random() < 0.2:
            args["tier"] = i
        x = rng.random()
        if x < 0.25:
            args["success"] = False
            if kind == "load" and len(keys) > 0 and rng.random() < 0.5:
                names = [self.o.U(k) for k in keys]
                args["successful_keys"] = rng.sample(names, rng.randint(0, max(0, len(names) - 1)))
        elif x < 0.3:
            args["success"] = True
        self.emit("tier_finish", args)


def gen_case(seed, index):
    rng = random.Random("tiering:%d:%d" % (seed, index))
    g = Gen(rng, "tiering fuzz: seed %d case %d" % (seed, index))
    n = rng.randint(20, 80)
    try:
        while len(g.case["calls"]) < n:
            g.step()
    except Exception as e:  # vLLM raised: the case is dropped
        if os.environ.get("VLLM_TIERING_DEBUG"):
            import traceback; traceback.print_exc()
        g.case["_dropped"] = "%s: %s" % (type(e).__name__, e)  # emit appended nothing for it
    g.case["_loads"] = sum(t.n_loads for t in g.o.tiers)
    return g.case


def cmd_generate(n, outdir, seed):
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    vllm()
    os.makedirs(outdir, exist_ok=True)
    kept, index, dropped, raised, loads = [], 0, 0, 0, {}
    while len(kept) < n:
        batch = []
        while len(kept) + len(batch) < n:
            case = gen_case(seed, index)
            index += 1
            if "_dropped" in case:
                raised += 1
                continue
            path = os.path.join(outdir, "tiering-fuzz-%d-%05d.json" % (seed, index - 1))
            loads[path] = case.pop("_loads")
            dump_case(case, path)
            batch.append(path)
        bad = set()
        for hs in CHECK_HASHSEEDS:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "_check"] + batch,
                               env=dict(os.environ, PYTHONHASHSEED=hs), stdout=subprocess.PIPE, text=True)
            if p.returncode not in (0, 1):
                sys.exit("the hash-seed check failed (exit %d)" % p.returncode)
            bad.update(json.loads(p.stdout.strip().splitlines()[-1]))
        for path in batch:
            if path in bad:
                os.remove(path)
                dropped += 1
            else:
                kept.append(path)
    print("wrote %d cases to %s (seed %d; %d dropped as hash-seed dependent, %d cut short by a vLLM "
          "exception and dropped); %d promotion jobs submitted, %d cases with at least one"
          % (len(kept), outdir, seed, dropped, raised, sum(loads[p] for p in kept),
             sum(1 for p in kept if loads[p])))
    return 0


def main():
    _ensure_interpreter()
    if len(sys.argv) > 1 and sys.argv[1] == "_check":
        import io, contextlib
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            bad = cmd_replay(sys.argv[2:], quiet=True)
        sys.stderr.write(buf.getvalue())
        print(json.dumps(bad))
        return 1 if bad else 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="OK / BAD per case against vLLM's answers")
    r.add_argument("cases", nargs="+")
    f = sub.add_parser("fill", help="write vLLM's answers into the cases' expectations")
    f.add_argument("cases", nargs="+")
    g = sub.add_parser("generate", help="write N random cases with vLLM's answers into DIR")
    g.add_argument("n", type=int)
    g.add_argument("dir")
    g.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.cmd == "replay":
        return 1 if cmd_replay(a.cases) else 0
    if a.cmd == "fill":
        return cmd_fill(a.cases)
    return cmd_generate(a.n, a.dir, a.seed)


if __name__ == "__main__":
    sys.exit(main())
