"""kvrelay's shared tier against a real Redis Cluster that each test starts (tests/tier/cluster.sh).

Every run below is `kvrelay run --json` on a slice of the Mooncake conversation trace with every
load and every read checked (content words derive from the prefix, so a wrong value cannot pass);
a run that served wrong KV stops with an error, which these tests would see as a failed exit.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "tests" / "tier" / "cluster.sh"
TRACE = ROOT / "tests" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
BIN = os.environ.get("KVRELAY_BIN", str(ROOT / "target" / "release" / "kvrelay"))
REQUESTS = os.environ.get("KVRELAY_TIER_REQUESTS", "60")
# The first port of the tests' clusters (BASE, BASE+1, ...; the failover test's at BASE+50, the
# eviction test's at BASE+100): another range lets two checkouts run these tests at once.
BASE = int(os.environ.get("KVRELAY_TIER_PORT", "7200"))
# The run's default pools: a fresh engine's CPU pool is empty, so what it reuses beyond its own
# GPU prefix cache comes from the tier.
POOLS = []


def cluster(*args, base=BASE, **kw):
    out = subprocess.run(
        [str(CLUSTER), *args, "--port", str(base), "--dir", f"/tmp/kvrelay-tier-test-{base}"],
        check=True, capture_output=True, text=True, **kw)
    return out.stdout.strip()


@pytest.fixture
def tier():
    spec = cluster("start")
    yield spec
    cluster("stop")


def run(tier_spec, *extra, requests=REQUESTS, timeout=600):
    cmd = [BIN, "run", "--trace", str(TRACE), "--requests", requests, "--json", *POOLS]
    if tier_spec:
        cmd += ["--tier", tier_spec]
    p = subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=timeout)
    report = json.loads(p.stdout) if p.returncode == 0 else None
    return p, report


def redis(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), *args], check=True,
                          capture_output=True, text=True).stdout


def masters():
    return [BASE, BASE + 1, BASE + 2]


def kvrelay_keys(port):
    return [k for k in redis(port, "--scan", "--pattern", "kvrelay:*").split() if k]


def finished_all(report):
    return report["finished"] == report["requests"] == int(REQUESTS)


# Protects the point of the tier (issue 36 item 3): a second engine process gets prefix hits
# from what the first stored, each verified byte for byte, and computes fewer tokens.
def test_a_second_engine_hits_what_the_first_stored(tier):
    p1, first = run(tier)
    assert p1.returncode == 0, p1.stderr
    assert first["tier_blocks_stored"] > 0 and first["tier_store_failures"] == 0
    stored = sum(len(kvrelay_keys(m)) for m in masters())
    assert stored > 0, "the first engine's chunks are in the cluster"
    p2, second = run(tier)
    assert p2.returncode == 0, p2.stderr
    assert finished_all(first) and finished_all(second)
    assert second["tier_hits"] > 0 and second["tier_blocks_loaded"] > 0
    assert second["tier_load_failures"] == 0 and second["tier_values_refused"] == 0
    assert second["loaded_blocks_verified"] >= second["blocks_loaded"] > 0
    assert second["tokens_computed"] < first["tokens_computed"]
    # Without the tier, the same second run computes what the first did.
    p3, alone = run(None)
    assert p3.returncode == 0, p3.stderr
    assert alone["tokens_computed"] == first["tokens_computed"]


# Protects `--tier --workers process`: the second engine's ranks are worker processes, whose CPU
# pools are memory files the engine's tier writes promoted chunks into; every block they load
# from those chunks is checked in the worker (a promotion that missed the worker's pool stops
# the run with wrong KV). The first engine's ranks are worker processes too: its cascades read
# their pools.
def test_worker_processes_share_the_tier(tier):
    p1, first = run(tier, "--workers", "process")
    assert p1.returncode == 0, p1.stderr
    assert first["tier_blocks_stored"] > 0 and first["tier_store_failures"] == 0
    p2, second = run(tier, "--workers", "process")
    assert p2.returncode == 0, p2.stderr
    assert finished_all(first) and finished_all(second)
    assert second["tier_blocks_loaded"] > 0 and second["tier_load_failures"] == 0
    assert second["loaded_blocks_verified"] >= second["blocks_loaded"] > 0
    assert second["tokens_computed"] < first["tokens_computed"]


# Protects "a failed load is never served" (LMCache #4991, Dynamo #15079): values truncated or
# replaced by foreign bytes under kvrelay's keys are refused by the header check; the requests
# recompute and every one finishes with verified KV.
def test_truncated_and_foreign_values_are_refused_not_served(tier):
    p1, _ = run(tier)
    assert p1.returncode == 0, p1.stderr
    spoiled = 0
    for m in masters():
        lines = []
        for i, k in enumerate(kvrelay_keys(m)):
            # Half truncated (kvrelay's magic, then nothing), half foreign bytes.
            lines.append(f"SET {k} KVRT" if i % 2 else f"SET {k} not-a-kvrelay-value")
            spoiled += 1
        subprocess.run(["redis-cli", "-p", str(m)], input="\n".join(lines) + "\n",
                       check=True, capture_output=True, text=True)
    assert spoiled > 0
    p2, second = run(tier)
    assert p2.returncode == 0, p2.stderr
    assert finished_all(second)
    assert second["tier_values_refused"] > 0
    assert second["tier_blocks_loaded"] == 0, "nothing refused reaches a CPU pool"
    assert second["tier_load_failures"] > 0


# Protects "the cluster down at start is a clear error", never a silent CPU-only run.
def test_an_unreachable_cluster_is_a_clear_error_at_start():
    p, _ = run(f"redis://127.0.0.1:{BASE + 99}", "--tier-timeout-ms", "500", requests="5")
    assert p.returncode != 0
    assert "cannot connect to the tier" in p.stderr, p.stderr


def during_run(tier_spec, timeout_ms, fault, requests=REQUESTS):
    """Runs the workload against the tier, with `fault()` injected 0.3 s into the run; returns
    the report of a run that finished every request."""
    cmd = [BIN, "run", "--trace", str(TRACE), "--requests", requests, "--json", *POOLS,
           "--tier", tier_spec, "--tier-timeout-ms", str(timeout_ms)]
    running = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    assert running.poll() is None, "the run is still going when the fault lands"
    fault()
    out, err = running.communicate(timeout=600)
    assert running.returncode == 0, err
    report = json.loads(out)
    assert report["finished"] == report["requests"] == int(requests)
    return report


# Protects liveness under a dead master (no replicas: its slots, and the keys in them, are
# gone): every request finishes, failed tier IO is counted, nothing wrong is served, and the
# report says what the store answered first.
def test_a_master_killed_mid_run_loses_keys_not_requests(tier):
    p1, first = run(tier)
    assert p1.returncode == 0, p1.stderr
    assert first["tier_first_error"] is None
    pid = int(Path(f"/tmp/kvrelay-tier-test-{BASE}/{BASE + 1}/redis.pid").read_text().strip())
    report = during_run(tier, 300, lambda: os.kill(pid, 9))
    assert report["tier_io_errors"] + report["tier_timeouts"] > 0
    if report["tier_io_errors"]:
        assert report["tier_first_error"], report


def info(port, section):
    """`INFO section` of a node as a dict."""
    lines = redis(port, "info", section).splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


# Protects failover (issue 36 item 4): with a replica per master, a master SIGKILLed mid-run is
# replaced by its replica (cluster-node-timeout 1 s), the running engine finds the new master
# (its connection fails, the slot map is refreshed, the promoted replica gets connections),
# every request finishes, nothing wrong is served (the run's content checks pass, no value is
# refused), and the report says what happened: failed commands, then new connections. The
# replica held what the first engine had stored under the dead master (`cluster.sh synced`).
def test_a_master_killed_with_replicas_fails_over_and_the_run_goes_on():
    base = BASE + 50
    spec = cluster("start", "--replicas", "1", "--node-timeout", "1000", base=base)
    try:
        p1, first = run(spec)
        assert p1.returncode == 0, p1.stderr
        assert first["tier_blocks_stored"] > 0 and first["tier_store_failures"] == 0
        cluster("synced", base=base)
        victim = base + 1
        replica = int(info(victim, "replication")["slave0"].split("port=")[1].split(",")[0])
        redis(replica, "config", "resetstat")
        pid = int(Path(f"/tmp/kvrelay-tier-test-{base}/{victim}/redis.pid").read_text().strip())
        # Long enough (about 8 s or more) to outlast the failover (about 2 to 3 s).
        second = during_run(spec, 300, lambda: os.kill(pid, 9), requests="300")
        assert second["tier_io_errors"] + second["tier_timeouts"] > 0, "the failover was seen"
        assert second["tier_reconnects"] >= 1
        assert second["tier_values_refused"] == 0
        assert second["tier_hits"] > 0 and second["tier_blocks_stored"] > 0
        assert info(replica, "replication")["role"] == "master", "the replica was promoted"
        assert "cluster_state:ok" in redis(base, "cluster", "info")
        # Since the kill, the promoted replica answered the engine's own commands: probes,
        # and cascades or promotions (a replica is sent no EXISTS nor MGET by replication).
        calls = info(replica, "commandstats")
        assert "calls=" in calls.get("cmdstat_exists", ""), calls
        assert int(calls["cmdstat_exists"].split("calls=")[1].split(",")[0]) > 0
    finally:
        cluster("stop", base=base)


# Protects keys evicted by Redis (maxmemory, allkeys-lru) under a running engine: probes that
# found a chunk may meet it gone at load; every request still finishes with verified KV.
def test_keys_evicted_by_redis_are_recomputed():
    spec = cluster("start", "--maxmemory", str(2 * 1024 * 1024), base=BASE + 100)
    try:
        tier_spec = spec
        p1, first = run(tier_spec)
        assert p1.returncode == 0, p1.stderr
        p2, second = run(tier_spec)
        assert p2.returncode == 0, p2.stderr
        assert finished_all(second)
        evicted = sum(int(redis(BASE + 100 + i, "info", "stats").split("evicted_keys:")[1].split()[0])
                      for i in range(3))
        assert evicted > 0, "maxmemory evicted kvrelay's values"
    finally:
        cluster("stop", base=BASE + 100)


# Protects deadlines on a slow store: a node that does not answer for seconds turns commands
# into timeouts (failed probes and jobs), and the run goes on.
def test_a_slow_node_times_out_and_the_run_goes_on(tier):
    p1, _ = run(tier)
    assert p1.returncode == 0, p1.stderr
    pause = ["redis-cli", "-p", str(BASE), "CLIENT", "PAUSE", "3000", "ALL"]
    report = during_run(tier, 200, lambda: subprocess.run(pause, check=True, capture_output=True))
    assert report["tier_timeouts"] + report["tier_io_errors"] > 0


# Protects `kvrelay bench tier` (docs/TIERING.md, "Against redis-benchmark"): both sides
# measured on the cluster the test starts, every loaded byte compared with what was stored (a
# mismatch is exit 1), the figures in --json; and a cluster that is not there is a clear error.
def test_bench_tier_measures_both_sides(tier):
    if subprocess.run(["which", "redis-benchmark"], capture_output=True).returncode != 0:
        pytest.skip("redis-benchmark is not installed (Debian: redis-tools)")
    first = tier.split(",")[0]
    cmd = [BIN, "bench", "tier", "--tier", first, "--shard-bytes", "8192", "--mib", "4",
           "--redis-mib", "4", "--repeat", "1", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["masters"] == 3
    [size] = out["sizes"]
    for k in ("tier_store", "tier_load", "redis_set", "redis_get"):
        assert size[k] > 0, (k, size)
    assert size["value_bytes"] > size["shard_bytes"] == 8192
    gone = subprocess.run([BIN, "bench", "tier", "--tier", "redis://127.0.0.1:1",
                           "--timeout-ms", "500"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "cannot connect" in gone.stderr, gone.stderr


def test_pd_engines_share_the_tier(tier):
    # kvrelay pd --tier: both engines' CPU pools cascade into the cluster; a second pair of
    # engines prefills from what the first stored (promoted, every value checked), while the
    # prompt KV still moves from the prefill engine to the decode engine, verified.
    cmd = [BIN, "pd", "--trace", str(TRACE), "--requests", REQUESTS, "--tier", tier, "--json"]
    reports = []
    for _ in range(2):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        reports.append(json.loads(p.stdout))
    first, second = reports
    for r in reports:
        assert r["finished"] == r["requests"]
        assert r["prefill"]["leaks"] == [] and r["decode"]["leaks"] == []
        assert r["decode"]["remote_blocks_loaded"] == r["prefill"]["served_blocks"] > 0
        assert r["decode"]["failed_loads"] == 0
    assert first["prefill"]["tier"]["blocks_stored"] > 0
    assert second["prefill"]["tier"]["blocks_loaded"] > 0
    # The second prefill engine computes a small fraction of what the first did.
    assert second["prefill"]["tokens_computed"] * 10 < first["prefill"]["tokens_computed"]


# Protects a P/D pair against the tier losing its keys (issue 37 item 4): a master SIGKILLed
# (no replica: its keys are gone) while both engines promote and cascade; the tier's failures
# cost the offloading children misses and failed loads, every request still finishes, the
# handoff's blocks are still read and checked, nothing is left behind.
def test_pd_engines_lose_the_tier_keys_mid_run_not_requests(tier):
    cmd = [BIN, "pd", "--trace", str(TRACE), "--tier", tier, "--tier-timeout-ms", "300", "--json"]
    first = subprocess.run(cmd + ["--requests", REQUESTS], capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr
    pid = int(Path(f"/tmp/kvrelay-tier-test-{BASE}/{BASE + 1}/redis.pid").read_text().strip())
    running = subprocess.Popen(cmd + ["--requests", "300"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert running.poll() is None, "the run is still going when the master dies"
    os.kill(pid, 9)
    out, err = running.communicate(timeout=600)
    assert running.returncode == 0, err
    r = json.loads(out)
    assert r["finished"] == r["requests"] == 300
    assert r["prefill"]["leaks"] == [] and r["decode"]["leaks"] == []
    assert r["decode"]["remote_blocks_loaded"] == r["prefill"]["served_blocks"] > 0
    lost = [e["tier"]["io_errors"] + e["tier"]["timeouts"] for e in (r["prefill"], r["decode"])]
    assert sum(lost) > 0, "the dead master was seen"
