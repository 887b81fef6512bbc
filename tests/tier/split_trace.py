#!/usr/bin/env python3
"""The Mooncake conversation trace on one engine, and on two engines splitting its requests, with
and without a shared tier, side by side (issue 36, performance requirement 2; docs/TIERING.md).

One command: starts a local Redis Cluster (tests/tier/cluster.sh), runs

  one            one engine, the first N requests, no tier
  two            two engine processes at once, each its half (--trace-split K/2: a round robin
                 over arrivals, as a router that knows nothing of prefixes deals them out)
  two + tier     the same two halves at once, sharing the tier (emptied first)
  one + tier     one engine and the tier (emptied first): the tier's capacity without sharing

prints prefix reuse, tokens computed, tier hits and wall time for each, and stops the cluster.
Two engines' figures are their sums (reuse: reused over prompt tokens of both); wall time is
the slower process's. Counts of runs without the tier are the same on every run; with it, they
depend on how the two processes' steps interleave (what one stored before the other looked).

Usage: tests/tier/split_trace.py [--requests N] [--port P] [--maxmemory BYTES] [--json]
                                [-- kvrelay run flags...]
--maxmemory bounds each of the three masters (allkeys-lru): a tier smaller than what the runs
store, evicting as Redis does.
Env:   KVRELAY_BIN  the kvrelay binary (default: target/release/kvrelay)
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "tests" / "tier" / "cluster.sh"
TRACE = ROOT / "tests" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
BIN = os.environ.get("KVRELAY_BIN", str(ROOT / "target" / "release" / "kvrelay"))
ENGINES = 2
SUMMED = ["requests", "finished", "prompt_tokens", "reused_tokens", "gpu_prefix_hit_tokens",
          "cpu_loaded_tokens", "tokens_computed", "tier_probes", "tier_hits",
          "tier_blocks_loaded", "tier_blocks_stored", "tier_load_failures",
          "tier_store_failures", "tier_values_refused"]


def cluster(args, *cmd):
    out = subprocess.run([str(CLUSTER), *cmd, "--port", str(args.port), "--dir",
                          f"/tmp/kvrelay-split-{args.port}"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def empty_tier(args):
    """FLUSHALL on every master (replicas follow), so a run starts with nothing shared."""
    for line in cluster(args, "nodes").splitlines():
        port, role = line.split()[:2]
        if role == "master":
            subprocess.run(["redis-cli", "-p", port, "flushall"], check=True,
                           capture_output=True)


def engines(args, splits, tier):
    """Runs one `kvrelay run --json` per split at once; returns the reports and the wall time
    of the slowest process."""
    base = [BIN, "run", "--trace", str(TRACE), "--requests", str(args.requests), "--json",
            *args.extra]
    if tier:
        base += ["--tier", tier]
    started = time.monotonic()
    procs = [subprocess.Popen(base + (["--trace-split", s] if s else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in splits]
    reports = []
    for s, p in zip(splits, procs):
        out, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"split_trace: kvrelay run {s or ''} failed ({p.returncode}):\n{err}")
        reports.append(json.loads(out))
    return reports, time.monotonic() - started


def combine(reports, wall_s):
    row = {k: sum(r.get(k, 0) for r in reports) for k in SUMMED}
    row["engines"] = len(reports)
    row["reuse_pct"] = 100.0 * row["reused_tokens"] / max(row["prompt_tokens"], 1)
    row["wall_s"] = wall_s
    row["reuse_bound_pct"] = reports[0]["reuse_bound_pct"] if len(reports) == 1 else None
    row["per_engine"] = reports
    return row


def table(rows, requests, maxmemory):
    names = list(rows)
    fmt = lambda v: f"{v:,}" if isinstance(v, int) else f"{v:.1f}"
    lines = [
        ("prompt tokens", lambda r: fmt(r["prompt_tokens"])),
        ("reused tokens", lambda r: fmt(r["reused_tokens"])),
        ("prefix reuse %", lambda r: fmt(r["reuse_pct"])),
        ("  GPU prefix hits", lambda r: fmt(r["gpu_prefix_hit_tokens"])),
        ("  loaded from CPU", lambda r: fmt(r["cpu_loaded_tokens"])),
        ("tokens computed", lambda r: fmt(r["tokens_computed"])),
        ("tier hits / probes", lambda r: f"{r['tier_hits']:,} / {r['tier_probes']:,}"
         if r["tier_probes"] else "-"),
        ("tier blocks loaded", lambda r: fmt(r["tier_blocks_loaded"])
         if r["tier_probes"] else "-"),
        ("tier failures", lambda r: fmt(r["tier_load_failures"] + r["tier_store_failures"])
         if r["tier_probes"] else "-"),
        ("wall s", lambda r: fmt(r["wall_s"])),
    ]
    width = max(len(n) for n, _ in lines)
    cells = [[f(rows[n]) for n in names] for _, f in lines]
    cols = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    head = f"{'':{width}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, cols))
    bounded = (f"; the tier bounded at {maxmemory:,} bytes a master (allkeys-lru)"
               if maxmemory else "; the tier unbounded")
    out = [f"first {requests:,} requests of the Mooncake conversation trace{bounded}", head]
    for (label, _), row in zip(lines, cells):
        out.append(f"{label:{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(row, cols)))
    bound = rows[names[0]]["reuse_bound_pct"]
    out.append(f"an unbounded cache of the trace's hash blocks would reuse {bound:.1f} %")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=600,
                    help="the first N requests of the trace (default 600)")
    ap.add_argument("--port", type=int, default=7500,
                    help="the cluster's first port (default 7500)")
    ap.add_argument("--maxmemory", type=int, default=0,
                    help="bytes per master, allkeys-lru (default 0: unbounded)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("extra", nargs="*", help="more `kvrelay run` flags, after --")
    args = ap.parse_args()
    halves = [f"{k}/{ENGINES}" for k in range(ENGINES)]
    tier = cluster(args, "start", "--maxmemory", str(args.maxmemory))
    try:
        rows = {"one": combine(*engines(args, [None], None)),
                "two": combine(*engines(args, halves, None))}
        empty_tier(args)
        rows["two + tier"] = combine(*engines(args, halves, tier))
        empty_tier(args)
        rows["one + tier"] = combine(*engines(args, [None], tier))
    finally:
        cluster(args, "stop")
    if args.json:
        print(json.dumps({"requests": args.requests, "engines": ENGINES,
                          "maxmemory": args.maxmemory, "runs": rows}, indent=2))
    else:
        print(table(rows, args.requests, args.maxmemory))


if __name__ == "__main__":
    main()
