#!/usr/bin/env bash
# kvrelay's shared tier against real Redis Clusters the tests start (tests/tier/test_tier.py),
# as .ci/run runs them: pytest in the Python package's CI venv.
#
# Usage: tests/tier/run.sh [pytest args]
# Env:   KVRELAY_BIN       the kvrelay binary (default: target/release/kvrelay)
#        KVRELAY_PY_CACHE  where the venv lives (default ~/.cache/kvrelay/python-ci)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null || { echo "tests/tier/run.sh: $tool not found (apt-get install redis-server redis-tools)" >&2; exit 1; }
done
if [ -n "${KVRELAY_BIN:-}" ]; then
  KVRELAY_BIN=$(cd "$(dirname "$KVRELAY_BIN")" && pwd)/$(basename "$KVRELAY_BIN")
  export KVRELAY_BIN
fi
cache=${KVRELAY_PY_CACHE:-$HOME/.cache/kvrelay/python-ci}
venv=$cache/venv
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$cache"
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "pytest>=8"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here" "$@"
