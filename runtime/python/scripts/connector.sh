#!/usr/bin/env bash
# vLLM 0.33.0's real Scheduler running an offloading KV connector, side by side for vLLM's own
# OffloadingConnector and kvrelay's (kvrelay.vllm.KvrelayOffloadingConnector): the scenarios of
# runtime/python/tests/vllm/test_real_scheduler.py (stores, hits and loads, preemption, a load
# failure, a cache reset). Builds the wheel and installs it into the vLLM test harness's venv
# (harness.sh), runs pytest from vLLM's source root (so `tests.v1...` imports work), and prints
# one line per scenario: vLLM's connector, kvrelay's connector (skipped, with the reason, while
# kvrelay.vllm cannot be imported).
#
# Usage: runtime/python/scripts/connector.sh [pytest args]   (e.g. -k preemption, -x)
# Exit:  0 when nothing failed, 1 otherwise, 2 on setup errors
# Env:   as harness.sh
set -uo pipefail
. "$(dirname "$0")/harness.sh"

log=$root/results/connector.log
mkdir -p "$root/results"
# --confcutdir: runtime/python/tests/conftest.py (the CI's, which stubs torch) must not load.
"$py" -m pytest -p no:cacheprovider -v -rs --timeout 300 --confcutdir "$here/tests/vllm" \
  "$here/tests/vllm/test_real_scheduler.py" "$@" > "$log" 2>&1
rc=$?
"$py" - "$log" <<'EOF'
import re, sys

results, reasons = {}, {}
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"::test_(\w+)\[([^\]]+)\] (PASSED|FAILED|SKIPPED|ERROR)", line)
    if m:
        name, ids, outcome = m.groups()
        parts = ids.split("-")
        who = next(p for p in parts if p in ("vllm", "kvrelay"))
        variant = "-".join(p for p in parts if p != who)
        results.setdefault(f"{name}[{variant}]" if variant else name, {})[who] = outcome.lower()
    m = re.match(r"SKIPPED \[\d+\] \S+: (.*)", line)
    if m:
        reasons[m.group(1)] = None
print(f"{'scenario':<22} {'vLLM OffloadingConnector':<26} kvrelay KvrelayOffloadingConnector")
for scenario, by in results.items():
    print(f"{scenario:<22} {by.get('vllm', '-'):<26} {by.get('kvrelay', '-')}")
for reason in reasons:
    print(f"skipped: {reason}")
EOF
tail -1 "$log"
echo "log: $log"
case $rc in 0) exit 0 ;; 1) exit 1 ;; *) exit 2 ;; esac  # pytest: 1 tests failed, 2-5 no run
