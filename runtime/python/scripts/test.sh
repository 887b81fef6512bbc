#!/usr/bin/env bash
# The Python package's own tests, as .ci/run runs them: builds the wheel with maturin, installs
# it into a small venv (pytest, maturin; no torch, no vLLM install), fetches vLLM 0.33.0's
# sources when VLLM_SRC does not name a tree (its sdist, sha256-checked, only vllm/*.py kept),
# and runs runtime/python/tests against vLLM's own classes loaded from those sources.
#
# Usage: runtime/python/scripts/test.sh [pytest args]
# Env:   KVRELAY_PY_CACHE  where the venv, the wheel and vLLM's sources live
#                          (default ~/.cache/kvrelay/python-ci)
#        VLLM_SRC          an unpacked vllm-0.33.0 source tree to use instead of fetching one
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVRELAY_PY_CACHE:-$HOME/.cache/kvrelay/python-ci}
venv=$cache/venv
mkdir -p "$cache"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2" "pytest>=8"

if [ -z "${VLLM_SRC:-}" ]; then
  VLLM_SRC=$cache/vllm-0.33.0
  if [ ! -f "$VLLM_SRC/vllm/v1/kv_offload/cpu/manager.py" ]; then
    "$here/scripts/vllm-src.sh" "$cache" "$venv/bin/python" 'vllm/*.py'
  fi
fi
export VLLM_SRC

rm -rf "$cache/wheels"
"$venv/bin/maturin" build --quiet --release -m "$here/Cargo.toml" -o "$cache/wheels"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$cache"/wheels/kvrelay-*.whl
cd "$here/tests"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
