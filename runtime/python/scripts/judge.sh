#!/usr/bin/env bash
# vLLM 0.33.0's own unit tests as the judge of the Python package (not in .ci/run: it needs a
# 6 GB venv with torch). Builds the wheel, installs it into the venv of the vLLM test harness
# (shared/tools/vllm-tests: setup.sh makes it once, ~2.5 minutes), and runs each group of
# vLLM's tests twice, side by side: with vLLM's own class, then with kvrelay's substituted for
# it in every vLLM module that imported it. Each time all the group's tests, then only those
# that drive public API (tools/whitebox.py --black: the rest read vLLM's private state).
#
# Usage: runtime/python/scripts/judge.sh [group ...]   groups: aggregator executor manager connector (default all)
# Exit:  0 when every black-box test passes with kvrelay's class, 1 otherwise, 2 on setup errors
# Env:   as harness.sh
set -uo pipefail
. "$(dirname "$0")/harness.sh"

declare -A files=(
  [aggregator]="tests/v1/kv_connector/unit/test_output_aggregator.py"
  [manager]="tests/v1/kv_offload/cpu/test_manager.py"
  # vLLM's tests that build the offloading connector by name through its factory; the rest of
  # its connector tests replace the manager inside vLLM's connector by a mock (white-box).
  [connector]="tests/v1/kv_connector/unit/test_hma_auto_config.py"
  # vLLM's executor handing the aggregator a failed step's outputs (fault tolerance): its
  # tests that take a KVOutputAggregator (the file's others need model weights).
  [executor]="tests/v1/executor/test_executor.py"
)
# The class a group substitutes (default: the group's name), and the tests it selects.
declare -A subst=([executor]=aggregator)
declare -A select=([executor]="merges_kv_output or ft_rpc_failure")
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(aggregator executor manager connector)
export PYTHONPATH=$PYTHONPATH:$here/tests/vllm  # kvrelay_connector_subst.py
# pytest as the harness's run.sh calls it, with a -k expression run.sh cannot pass on.
judge() {  # judge SUBST FILE [-k EXPR]: pytest's summary line
  local subst=$1 connector=
  [ "$subst" = connector ] && { subst=; connector=kvrelay; }
  KVRELAY_SUBST=$subst KVRELAY_IMPL=kvrelay KVRELAY_CONNECTOR=$connector "$py" -m pytest \
    -p no:cacheprovider -p kvrelay_subst -p kvrelay_connector_subst -q --timeout 300 "${@:2}" 2>&1 \
    | grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" | tail -1 | tr -d '='
}
# pytest's -k matches substrings: white-box tests whose names contain a black-box test's
# (test_cpu_manager_reports_..._on_allocation_failure beside test_cpu_manager) are named out.
shadowed() {  # shadowed FILE BLACK_EXPR: "not (a or b)", or nothing
  "$py" - "$1" "$2" <<'PY'
import ast, sys
path, black = sys.argv[1], set(sys.argv[2].split(" or "))
names = {n.name for n in ast.walk(ast.parse(open(path).read()))
         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}
hit = sorted(w for w in names - black if any(b in w for b in black))
print(f"not ({' or '.join(hit)})" if hit else "")
PY
}
rc=0
for g in "${groups[@]}"; do
  file=${files[$g]}
  black=$("$py" "$tools/tools/whitebox.py" --black "$file")
  shadow=$(shadowed "$file" "$black")
  black="($black)${shadow:+ and $shadow}"
  sel=${select[$g]:-}
  for scope in all black-box; do
    k=()
    [ -n "$sel" ] && k=(-k "$sel")
    [ "$scope" = black-box ] && k=(-k "${sel:+($sel) and }$black")
    theirs=$(judge "" "$file" "${k[@]}")
    ours=$(judge "${subst[$g]:-$g}" "$file" "${k[@]}")
    printf '%-10s %-9s  vLLM own: %-32s kvrelay: %s\n' "$g" "$scope" "$theirs" "$ours"
    # The white-box tests read vLLM's private state: only the black-box ones must pass.
    [[ "$scope" == black-box && "$ours" == *failed* ]] && rc=1
  done
done
exit $rc
