# Sourced by judge.sh and bench.sh: the vLLM test harness's venv (shared/tools/vllm-tests:
# setup.sh makes it once, ~2.5 minutes, 6 GB) with the kvrelay wheel built from this checkout
# installed into it, and the environment its pytest runs in. Sets `here`, `tools`, `root`, `py`
# and changes into vLLM's source root. Exits 2 when the harness is missing or a step fails.
#
# Env: VLLM_TESTS_TOOLS  the harness (default: ../shared/tools/vllm-tests beside the checkout)
#      VLLM_TESTS        its root (default ~/.cache/kvrelay/vllm-tests)
me=$(basename "$0")
here=$(cd "$(dirname "$0")/.." && pwd)
tools=${VLLM_TESTS_TOOLS:-$(cd "$here/../.." && pwd)/../shared/tools/vllm-tests}
root=${VLLM_TESTS:-$HOME/.cache/kvrelay/vllm-tests}
[ -x "$tools/run.sh" ] || { echo "$me: no vLLM test harness at $tools (set VLLM_TESTS_TOOLS)" >&2; exit 2; }
"$tools/setup.sh" > /dev/null || { echo "$me: $tools/setup.sh failed" >&2; exit 2; }
py=$root/venv/bin/python
"$py" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2" || exit 2
rm -rf "$root/kvrelay-wheel"
"$root/venv/bin/maturin" build --quiet --release -m "$here/Cargo.toml" -o "$root/kvrelay-wheel" || exit 2
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$root"/kvrelay-wheel/kvrelay-*.whl || exit 2
# As the harness's run.sh runs pytest: vLLM from its source root, on the CPU platform, offline.
cd "$root/vllm-0.33.0" || exit 2
export VLLM_TARGET_DEVICE=cpu HF_HOME=$root/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$tools/plugins:$root/vllm-0.33.0 PYTHONDONTWRITEBYTECODE=1
