#!/usr/bin/env bash
# vLLM 0.33.0's own unit tests as the judge of the Python package (not in .ci/run: it needs a
# 6 GB venv with torch). Builds the wheel, installs it into the venv of the vLLM test harness
# (shared/tools/vllm-tests: setup.sh makes it once, ~2.5 minutes), and runs each group of
# vLLM's tests twice, side by side: with vLLM's own class, then with kvrelay's substituted for
# it in every vLLM module that imported it. Each time all the group's tests, then only those
# that drive public API (tools/whitebox.py --black: the rest read vLLM's private state).
#
# Usage: runtime/python/scripts/judge.sh [group ...]   groups: aggregator manager (default both)
# Exit:  0 when every black-box test passes with kvrelay's class, 1 otherwise, 2 on setup errors
# Env:   VLLM_TESTS_TOOLS  the harness (default: ../shared/tools/vllm-tests beside the checkout)
#        VLLM_TESTS        its root (default ~/.cache/kvrelay/vllm-tests)
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tools=${VLLM_TESTS_TOOLS:-$(cd "$here/../.." && pwd)/../shared/tools/vllm-tests}
root=${VLLM_TESTS:-$HOME/.cache/kvrelay/vllm-tests}
[ -x "$tools/run.sh" ] || { echo "judge.sh: no vLLM test harness at $tools (set VLLM_TESTS_TOOLS)" >&2; exit 2; }
"$tools/setup.sh" > /dev/null || { echo "judge.sh: $tools/setup.sh failed" >&2; exit 2; }
py=$root/venv/bin/python
"$py" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2"
rm -rf "$root/kvrelay-wheel"
"$root/venv/bin/maturin" build --quiet --release -m "$here/Cargo.toml" -o "$root/kvrelay-wheel" || exit 2
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$root"/kvrelay-wheel/kvrelay-*.whl || exit 2

declare -A files=(
  [aggregator]="tests/v1/kv_connector/unit/test_output_aggregator.py"
  [manager]="tests/v1/kv_offload/cpu/test_manager.py"
)
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(aggregator manager)
# As the harness's run.sh runs pytest (its environment), with a -k expression it cannot pass.
cd "$root/vllm-0.33.0"
export VLLM_TARGET_DEVICE=cpu HF_HOME=$root/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$tools/plugins PYTHONDONTWRITEBYTECODE=1
judge() {  # judge SUBST FILE [-k EXPR]: pytest's summary line
  KVRELAY_SUBST=$1 KVRELAY_IMPL=kvrelay "$py" -m pytest -p no:cacheprovider -p kvrelay_subst -q \
    --timeout 300 "${@:2}" 2>&1 | grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" | tail -1 | tr -d '='
}
rc=0
for g in "${groups[@]}"; do
  file=${files[$g]}
  black=$("$py" "$tools/tools/whitebox.py" --black "$file")
  for scope in all black-box; do
    k=()
    [ "$scope" = black-box ] && k=(-k "$black")
    theirs=$(judge "" "$file" "${k[@]}")
    ours=$(judge "$g" "$file" "${k[@]}")
    printf '%-10s %-9s  vLLM own: %-32s kvrelay: %s\n' "$g" "$scope" "$theirs" "$ours"
    # The white-box tests read vLLM's private state: only the black-box ones must pass.
    [[ "$scope" == black-box && "$ours" == *failed* ]] && rc=1
  done
done
exit $rc
