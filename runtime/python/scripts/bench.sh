#!/usr/bin/env bash
# The Python package's benchmarks against vLLM 0.33.0's own classes, each side by side in one
# run, in the vLLM test harness's venv (harness.sh): the aggregator's W = 8 step
# (bench/aggregator.py) and the manager on the shared LRU and ARC replays (bench/manager.py).
# Every benchmark compares the two sides' results and stops if they differ.
#
# Usage: runtime/python/scripts/bench.sh [--json]
set -uo pipefail
. "$(dirname "$0")/harness.sh"
"$py" "$here/bench/aggregator.py" "$@" || exit 1
"$py" "$here/bench/manager.py" "$@" || exit 1
