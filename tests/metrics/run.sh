#!/usr/bin/env bash
# `kvrelay run --metrics`, judged by the official Python client's parsers, vLLM 0.33.0's
# sources and a real Prometheus server (tests/metrics/test_metrics.py), as .ci/run runs them:
# in the Python package's CI venv, with prometheus-client 0.26.0 installed there.
#
# Usage: tests/metrics/run.sh [pytest args]
# Env:   KVRELAY_BIN       the kvrelay binary (default: target/ci, release or debug)
#        KVRELAY_PY_CACHE  where the venv lives (default ~/.cache/kvrelay/python-ci)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVRELAY_PY_CACHE:-$HOME/.cache/kvrelay/python-ci}
venv=$cache/venv
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$cache"
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "prometheus-client==0.26.0" "pytest>=8"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here" "$@"
