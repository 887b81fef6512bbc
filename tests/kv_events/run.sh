#!/usr/bin/env bash
# `kvrelay run --kv-events`, judged by vLLM 0.33.0's own event classes, hashing functions and
# test-suite subscriber (tests/kv_events/test_kv_events.py), as .ci/run runs it: in the Python
# package's CI venv, with pyzmq and msgspec from the package index and vLLM's files taken from
# its source distribution (the one runtime/python/scripts/test.sh fetches and checks).
#
# Usage: tests/kv_events/run.sh [pytest args]
# Env:   KVRELAY_BIN       the kvrelay binary (default: target/ci, release or debug)
#        KVRELAY_PY_CACHE  where the venv and the sdist live (default ~/.cache/kvrelay/python-ci)
#        VLLM_SRC          an unpacked vllm-0.33.0 tree with tests/ to use instead
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${KVRELAY_PY_CACHE:-$HOME/.cache/kvrelay/python-ci}
venv=$cache/venv
mkdir -p "$cache"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "pyzmq==27.3.0" "msgspec==0.22.0" "pytest>=8"

if [ -z "${VLLM_SRC:-}" ]; then
  VLLM_SRC=$cache/vllm-0.33.0
  need=(vllm/distributed/kv_events.py vllm/v1/core/kv_cache_utils.py vllm/utils/hashing.py tests/distributed/conftest.py)
  missing=0
  for f in "${need[@]}"; do [ -f "$VLLM_SRC/$f" ] || missing=1; done
  if [ "$missing" = 1 ]; then
    "$root/runtime/python/scripts/vllm-src.sh" "$cache" "$venv/bin/python" "${need[@]}"
  fi
fi
export VLLM_SRC
# A relative KVRELAY_BIN is made absolute, whatever directory pytest runs the tests from.
if [ -n "${KVRELAY_BIN:-}" ]; then
  KVRELAY_BIN=$(realpath "$KVRELAY_BIN")
  export KVRELAY_BIN
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here" "$@"
