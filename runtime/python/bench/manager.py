"""kvrelay's CPUOffloadingManager against vLLM 0.33.0's own, method by method, in one run.

Replays shared/workloads/manager-{lru,arc}.json (400 rounds of 16-key stores on a 1024-chunk
pool, with lookups, loads, request ends and event drains) through the manager's public methods
as vLLM's offloading scheduler calls them: one ReqContext per request (on_new_request first),
keys as vLLM's bytes keys (built before timing). Each call's result is compared with the
other manager's, so a fast wrong answer fails. The times are per method, summed over the run;
the same loop over a manager that answers at once gives the loop's own cost (printed, and
taken off both sides for the second ratio).

Run in an environment with vLLM 0.33.0 and the kvrelay wheel:
    python runtime/python/bench/manager.py [WORKLOAD.json ...] [--repeat 5] [--json]
"""

import argparse
import collections
import json
import operator
import pathlib
import sys
import time

from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

from kvrelay.manager import CPUOffloadingManager as KvManager

# The shared folder beside the repository (its workloads are not in the repository).
WORKLOADS = pathlib.Path(__file__).resolve().parents[4] / "shared/workloads"


def prepare(case):
    """The calls as (method, args builder): keys become bytes once, contexts per request."""
    keys: dict[str, bytes] = {}

    def key(name):
        return keys.setdefault(name, make_offload_key(name.encode(), 0))

    calls = []
    for c in case["calls"]:
        a = c.get("args", {})
        ks = [key(k) for k in a.get("keys", [])]
        calls.append((c["call"], key(a["key"]) if "key" in a else ks, a.get("request")))
    return calls


def result(out):
    """A comparable view of a method's result."""
    if out is None or isinstance(out, (bool, int, str)):
        return out
    if hasattr(out, "keys_to_store"):
        return (out.keys_to_store, [int(x) for x in out.store_spec.block_ids], out.evicted_keys)
    if hasattr(out, "block_ids"):
        return [int(x) for x in out.block_ids]
    if hasattr(out, "name"):
        return out.name
    return [(e.keys, e.removed, e.metadata_only) for e in out]


def replay(manager, calls):
    """Runs the calls; returns (per-method seconds, results)."""
    times: collections.Counter = collections.Counter()
    results = []
    contexts: dict[str, ReqContext] = {}
    clock = time.perf_counter
    for method, arg, req in calls:
        ctx = contexts.get(req) if req is not None else None
        if req is not None and ctx is None:
            ctx = contexts[req] = ReqContext(req_id=req)
            t0 = clock()
            manager.on_new_request(ctx)
            times["on_new_request"] += clock() - t0
        ctx = ctx or ReqContext(req_id="")
        t0 = clock()
        try:
            out = call(manager, method, arg, ctx, contexts, req)
        except AssertionError:  # a refusal the workload expects (vLLM asserts)
            out = "AssertionError"
        times[method] += clock() - t0
        results.append(result(out))
    return times, results


def call(manager, method, arg, ctx, contexts, req):
    """One workload call on the manager."""
    if method == "lookup":
        return manager.lookup(arg, ctx)
    if method in ("prepare_store", "prepare_load", "touch", "complete_load", "complete_store"):
        return getattr(manager, method)(arg, ctx)
    if method == "request_finished":
        return manager.on_request_finished(contexts.pop(req))
    if method == "take_events":
        return list(manager.take_events())
    if method == "reset":
        return manager.reset_cache()
    raise ValueError(f"unknown call {method}")


class NullManager:
    """Answers every call at once, each method a C-level no-op (a builtin function, which a class
    does not bind, or a type): what the replay loop itself costs (the harness). A Python no-op
    method would count its own frame as the loop's and flatter a native manager."""

    def __init__(self, *args, **kwargs):
        pass

    lookup = prepare_store = prepare_load = touch = complete_load = complete_store = operator.is_
    on_new_request = on_request_finished = id
    take_events = reset_cache = tuple


def run(path, repeat):
    case = json.loads(pathlib.Path(path).read_text())
    calls = prepare(case)
    cfg = case["config"]
    kw = dict(cache_policy=cfg.get("policy", "lru"), enable_events=True)
    best = {}
    for name, cls in (("harness", NullManager), ("vllm", VllmManager), ("kvrelay", KvManager)):
        runs = [replay(cls(cfg["capacity_chunks"], **kw), calls) for _ in range(repeat)]
        best[name] = min(runs, key=lambda r: sum(r[0].values()))
    if best["vllm"][1] != best["kvrelay"][1]:
        sys.exit(f"{path}: kvrelay's results differ from vLLM's")
    v, k = best["vllm"][0], best["kvrelay"][0]
    h = sum(best["harness"][0].values())
    return {
        "workload": pathlib.Path(path).name,
        "calls": len(calls),
        "vllm_s": sum(v.values()),
        "kvrelay_s": sum(k.values()),
        "harness_s": h,
        "speedup": sum(v.values()) / sum(k.values()),
        "speedup_net": (sum(v.values()) - h) / (sum(k.values()) - h),
        "per_method": {
            m: {
                "vllm_us": v[m] * 1e6,
                "kvrelay_us": k[m] * 1e6,
                "harness_us": best["harness"][0][m] * 1e6,
            }
            for m in v
        },
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object per workload")
    args = ap.parse_args()
    paths = args.workloads or sorted(WORKLOADS.glob("manager-*.json"))
    if not paths:
        sys.exit(f"no manager-*.json in {WORKLOADS}: name the workloads")
    for path in paths:
        r = run(path, args.repeat)
        if args.json:
            print(json.dumps(r))
            continue
        print(
            f"{r['workload']}: {r['calls']} calls, vLLM {r['vllm_s'] * 1e3:.2f} ms, "
            f"kvrelay {r['kvrelay_s'] * 1e3:.2f} ms, {r['speedup']:.1f}x; the replay loop alone "
            f"{r['harness_s'] * 1e3:.2f} ms, without it {r['speedup_net']:.1f}x"
        )
        for m, t in sorted(r["per_method"].items()):
            ratio = t["vllm_us"] / t["kvrelay_us"] if t["kvrelay_us"] else float("inf")
            print(
                f"  {m:16} vLLM {t['vllm_us']:9.0f} us  kvrelay {t['kvrelay_us']:9.0f} us  "
                f"{ratio:5.1f}x  (loop {t['harness_us']:6.0f} us)"
            )


if __name__ == "__main__":
    main()
