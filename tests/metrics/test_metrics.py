"""`kvrelay run --metrics`, judged by code kvrelay did not write: the official Python client's
parsers (prometheus-client 0.26.0, text format 0.0.4 and OpenMetrics), vLLM 0.33.0's sources
(the names and buckets), and a real Prometheus server that scrapes the run and answers queries
over its HTTP API.

Env: KVRELAY_BIN  the kvrelay binary (default: target/ci, release or debug, whichever exists)
     VLLM_SRC     an unpacked vllm-0.33.0 source tree (default ~/.cache/kvrelay/python-ci/...)
     CI           "true": a missing prometheus or vLLM tree fails instead of skipping
"""

import ast
import json
import os
import pathlib
import queue
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Every wait of these tests ends by then, seconds.
DEADLINE = 120
ENGINE = {"model_name": "kvrelay", "engine": "0"}
IN_CI = os.environ.get("CI") == "true"


def kvrelay_bin():
    if os.environ.get("KVRELAY_BIN"):
        return os.environ["KVRELAY_BIN"]
    for profile in ["ci", "release", "debug"]:
        p = ROOT / "target" / profile / "kvrelay"
        if p.exists():
            return str(p)
    pytest.fail("no kvrelay binary: build it or set KVRELAY_BIN")


def missing(what):
    (pytest.fail if IN_CI else pytest.skip)(what)


class Run:
    """`kvrelay run --json --metrics ADDR` on a slice of the embedded workload."""

    def __init__(self, addr, linger):
        args = [kvrelay_bin(), "run", "--requests", "40", "--check", "--json"]
        args += ["--metrics", addr, "--metrics-linger", str(linger)]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        lines = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(l) for l in self.proc.stderr], daemon=True
        ).start()
        prefix = "kvrelay run: metrics on "
        while True:
            line = lines.get(timeout=DEADLINE)
            if line.startswith(prefix):
                self.url = line[len(prefix) :].strip()
                return

    def report(self):
        out, _ = self.proc.communicate(timeout=DEADLINE)
        assert self.proc.returncode == 0, out
        return json.loads(out)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE)


def get(url, accept="text/plain"):
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def samples(families):
    """(sample name, own labels) -> value, the engine labels checked on every sample."""
    out = {}
    for f in families:
        for s in f.samples:
            labels = dict(s.labels)
            assert {k: labels.pop(k, None) for k in ENGINE} == ENGINE, s
            labels.pop("le", None) if s.name.endswith("_bucket") else None
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


# What the report's fields are, as series.
TOTALS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generated_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prompt_tokens_cached_total": "reused_tokens",
    "vllm:kv_offload_store_bytes_total": "bytes_stored",
    "vllm:kv_offload_load_bytes_total": "bytes_loaded",
    "kvrelay:engine_steps_total": "steps",
    "kvrelay:tokens_computed_total": "tokens_computed",
    "kvrelay:blocks_stored_total": "blocks_offloaded",
    "kvrelay:blocks_loaded_total": "blocks_loaded",
    "kvrelay:loaded_blocks_verified_total": "loaded_blocks_verified",
    "kvrelay:written_slots_verified_total": "written_slots_verified",
    "kvrelay:read_blocks_checked_total": "read_blocks_checked",
}


def vllm_src():
    src = os.environ.get("VLLM_SRC") or str(
        pathlib.Path.home() / ".cache/kvrelay/python-ci/vllm-0.33.0"
    )
    p = pathlib.Path(src) / "vllm"
    if not (p / "v1/metrics/buckets.py").exists():
        missing(f"no vLLM 0.33.0 sources at {src}")
    return p


def vllm_buckets(src, name):
    tree = ast.parse((src / "v1/metrics/buckets.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == name:
            return [float(x) for x in ast.literal_eval(node.value)]
    raise AssertionError(f"{name} not in vLLM's buckets.py")


def final_scrape(run):
    """The text-format families and the OpenMetrics exposition of the last scrape before the
    linger ended (the ranks' figures grow during the run: only the end gives the totals)."""
    start = time.monotonic()
    last = None
    while True:
        try:
            ctype, text = get(run.url)
            om = get(run.url, "application/openmetrics-text; version=1.0.0")
        except OSError:
            assert last is not None, "nothing served"
            return last
        fams = list(parse_text(text))
        last = ctype, text, fams, samples(fams), om
        assert time.monotonic() - start < DEADLINE, text
        time.sleep(0.1)


def test_parsed_by_prometheus_client():
    run = Run("127.0.0.1:0", linger=3)
    try:
        ctype, text, fams, got, (om_type, om_text) = final_scrape(run)
        report = run.report()
    finally:
        run.kill()
    assert ctype.startswith("text/plain; version=0.0.4"), ctype
    assert om_type.startswith("application/openmetrics-text"), om_type
    by_name = {f.name: f for f in fams}
    # vLLM's own names, types and help texts (vllm/v1/metrics/loggers.py).
    for name, typ, doc in [
        ("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
        ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
        ("vllm:request_success", "counter", "Count of successfully processed requests."),
        ("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step."),
        ("vllm:kv_offload_store_bytes", "counter", "Total bytes stored from GPU to offload storage."),
    ]:
        assert by_name[name].type == typ, name
        assert by_name[name].documentation == doc, name
    for metric, field in TOTALS.items():
        assert got[(metric, ())] == report[field], (metric, field)
    finished = sum(v for (n, _), v in got.items() if n == "vllm:request_success_total")
    assert finished == report["finished"]
    reasons = {l for (n, l), _ in got.items() if n == "vllm:request_success_total"}
    assert {dict(l)["finished_reason"] for l in reasons} == {
        "stop", "length", "abort", "error", "repetition"}
    # The OpenMetrics parser is strict (# EOF, histogram consistency): the same totals.
    om = samples(parse_openmetrics(om_text))
    for metric in TOTALS:
        assert om[(metric, ())] == got[(metric, ())], metric
    # The names are vLLM's: each vllm: family is named in vLLM's sources, with its buckets.
    src = vllm_src()
    sources = "".join(p.read_text() for p in src.rglob("*.py") if "metrics" in p.name or "loggers" in p.name or "common.py" == p.name)
    for f in fams:
        if f.name.startswith("vllm:"):
            assert f'"{f.name}"' in sources, f.name
    les = [float(s.labels["le"]) for s in by_name["vllm:iteration_tokens_total"].samples if s.name.endswith("_bucket")]
    assert les == vllm_buckets(src, "ITERATION_TOKENS_BUCKETS") + [float("inf")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(tmp, kvrelay_port):
    exe = shutil.which("prometheus")
    if exe is None:
        missing("no prometheus (Debian's package: apt-get install prometheus)")
    port = free_port()
    (tmp / "prom.yml").write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kvrelay\n    static_configs: [{{targets: ['127.0.0.1:{kvrelay_port}']}}]\n"
    )
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [exe, f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    while True:
        try:
            if scraping(base):
                return proc, base
        except OSError:
            pass
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        assert time.monotonic() - start < DEADLINE, "prometheus never ready"
        time.sleep(0.2)


def scraping(base):
    """Whether Prometheus is ready and scrapes its target already (its target discovery runs
    a few seconds after it is ready; until then a short run would not be scraped)."""
    with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=2) as r:
        targets = json.load(r)["data"]["activeTargets"]
    return any(not t["lastScrape"].startswith("0001") for t in targets)


def query(base, promql):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return {r["metric"]["__name__"]: float(r["value"][1]) for r in body["data"]["result"]}


def test_scraped_by_prometheus(tmp_path):
    kp = free_port()
    prom, base = start_prometheus(tmp_path, kp)
    run = None
    try:
        run = Run(f"127.0.0.1:{kp}", linger=3)
        report = run.report()
        # The series went stale when kvrelay stopped answering: the last value scraped.
        names = "|".join(TOTALS)
        promql = f'last_over_time({{__name__=~"{names}",job="kvrelay"}}[10m])'
        want = {m: float(report[f]) for m, f in TOTALS.items()}
        start = time.monotonic()
        while True:
            got = query(base, promql)
            if got == want:
                break
            if time.monotonic() - start > 30:
                with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10) as r:
                    targets = r.read().decode()
                raise AssertionError(f"{got} != {want}; targets: {targets}")
            time.sleep(0.5)
        assert want["kvrelay:loaded_blocks_verified_total"] > 0
    finally:
        if run is not None:
            run.kill()
        prom.kill()
        prom.wait(timeout=DEADLINE)
