"""kvrelay's KVOutputAggregator against vLLM 0.33.0's own, through vLLM's call site, in one run.

Replays core/benches/workloads/aggregator-w8.json (W = 8 ranks; per rank and step 256
finished sends, 128 finished receives and an OffloadingWorkerMetadata of 256 completed jobs):
for every step, vLLM's own objects are built (ModelRunnerOutput with a KVConnectorOutput per
rank, as the workers send them), then `aggregate(outputs, 0)` is timed — the conversion into
Rust and back to vLLM's objects included for kvrelay, the object building excluded for both.
Each side's result is compared with the other's, so a fast wrong answer fails.

Beside them, a floor: CPython's own C code reading the step once — one set union of every
rank's id sets, one dict update with every rank's completed jobs — which any aggregator must at
least do. vLLM's time over the floor is the most any implementation called from Python can gain.

Run in an environment with vLLM 0.33.0 and the kvrelay wheel:
    python runtime/python/bench/aggregator.py [--repeat 200] [--json]
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator as VllmAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.outputs import KVConnectorOutput

import kvrelay

WORKLOAD = pathlib.Path(__file__).resolve().parents[3] / "core/benches/workloads/aggregator-w8.json"


class RankOutput:
    """What vLLM's executor hands the aggregator per rank (a ModelRunnerOutput's one field read)."""

    def __init__(self, kv):
        self.kv_connector_output = kv


def rank_output(o):
    meta = None
    if o.get("worker_meta"):
        jobs = o["worker_meta"]["offload"]["completed_jobs"]
        meta = OffloadingWorkerMetadata(completed_jobs={int(k): v for k, v in jobs.items()})
    return RankOutput(
        KVConnectorOutput(
            finished_sending=set(o["finished_sending"]) if o.get("finished_sending") is not None else None,
            finished_recving=set(o["finished_recving"]) if o.get("finished_recving") is not None else None,
            invalid_block_ids=set(o.get("invalid_block_ids", [])),
            failed_recving=set(o.get("failed_recving", [])),
            expected_finished_count=o.get("expected_finished_count", 0),
            kv_connector_worker_meta=meta,
        )
    )


def replay(make, steps):
    """Times each step's aggregate; returns (per-step seconds, the results' comparable form)."""
    agg = make()
    times, seen = [], []
    for step in steps:
        outputs = [rank_output(o) for o in step]
        t0 = time.perf_counter()
        out = agg.aggregate(outputs, 0)
        times.append(time.perf_counter() - t0)
        kv = out.kv_connector_output
        meta = kv.kv_connector_worker_meta
        seen.append((kv.finished_sending, kv.finished_recving, kv.failed_recving, kv.invalid_block_ids,
                     kv.expected_finished_count, meta.completed_jobs if meta else None))
    return times, seen


def floor(steps):
    """Times, per step, the least reading of its inputs (see the module docs)."""
    times = []
    for step in steps:
        kvs = [rank_output(o).kv_connector_output for o in step]
        sets = [s for kv in kvs for s in (kv.finished_sending, kv.finished_recving) if s]
        jobs = [kv.kv_connector_worker_meta.completed_jobs for kv in kvs if kv.kv_connector_worker_meta]
        t0 = time.perf_counter()
        set().union(*sets)
        merged = {}
        for j in jobs:
            merged.update(j)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200, help="replays of the workload per side")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    case = json.loads(WORKLOAD.read_text())
    quorum = case["config"]["quorum"]
    steps = [c["args"]["outputs"] for c in case["calls"] if c["call"] == "aggregate"]
    sides = {"vllm": lambda: VllmAggregator(quorum), "kvrelay": lambda: kvrelay.KVOutputAggregator(quorum)}
    per_step = {name: [] for name in sides}
    per_step["floor"] = []
    results = {}
    for i in range(args.repeat):
        per_step["floor"] += floor(steps)
        for name, make in sides.items():
            times, seen = replay(make, steps)
            per_step[name] += times
            results[name] = seen
        if results["vllm"] != results["kvrelay"]:
            sys.exit("kvrelay's aggregate differs from vLLM's on the workload")
    med = {name: statistics.median(t) for name, t in per_step.items()}
    report = {
        "workload": case["name"],
        "steps_timed": len(per_step["vllm"]),
        "vllm_us_median": med["vllm"] * 1e6,
        "kvrelay_us_median": med["kvrelay"] * 1e6,
        "speedup": med["vllm"] / med["kvrelay"],
        "floor_us_median": med["floor"] * 1e6,
        "speedup_at_floor": med["vllm"] / med["floor"],
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{case['name']}")
        print(f"  vLLM 0.33.0 KVOutputAggregator.aggregate: {report['vllm_us_median']:9.1f} us per step (median of {report['steps_timed']})")
        print(f"  kvrelay.KVOutputAggregator.aggregate:     {report['kvrelay_us_median']:9.1f} us per step")
        print(f"  ratio: {report['speedup']:.1f}x; results equal on every step")
        print(f"  floor (C set union of the ids, dict update with the jobs): {report['floor_us_median']:.1f} us per step,")
        print(f"    so no aggregator called from Python passes {report['speedup_at_floor']:.1f}x here")


if __name__ == "__main__":
    main()
