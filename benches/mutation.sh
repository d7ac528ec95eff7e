#!/usr/bin/env bash
# Mutation testing with mutmut 3.3.1 (pip install -e '.[mutation]'), one module group at a time,
# each against the test files that cover it. Slow (minutes to an hour per group): not in CI.
#
#   benches/mutation.sh                        # every group below
#   benches/mutation.sh schedule selectors     # only these groups
#   KEEP=1 benches/mutation.sh metrics         # keep the work copy ($OUT/metrics-work) to resume
#   KEEP=1 ONLY="qtransform.core.metrics.x__ratio*" benches/mutation.sh metrics
#                                              # (re-)run only these mutants (fnmatch patterns);
#                                              # the other mutants keep their earlier results
#
# Each group runs in a copy of the tracked files (mutmut reads its targets from pyproject.toml's
# [tool.mutmut] and writes a mutants/ folder that shadows the editable install), with one test
# process at a time (the CI machines have 2 cores) and QTRANSFORM_FASTPATH=0, so the Python
# reference path is what runs (the C kernel, formats/qfast.c, is outside mutmut's reach; tests
# that compare the two paths ask for the fast path themselves). The summary lines ("group:
# killed/total ...") and every surviving mutant's diff are written to $OUT (default:
# mutation-results/). Mutants in code no selected test reaches are listed as "no tests" and
# count as not killed; "timeout" means the mutant made the tests run 15x longer than usual
# (an endless loop, mostly): detected, and counted apart from "killed".
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
MUTMUT=${MUTMUT:-$ROOT/.venv/bin/mutmut}  # the console script: `python -m mutmut` breaks its trampolines
OUT=${OUT:-$ROOT/mutation-results}

# group|files to mutate, as installed (space separated)|test files (space separated)
GROUPS_ALL=(
  "schedule|qtransform/core/schedule.py qtransform/core/streams.py|tests/core/test_noise_schedule.py tests/passes/test_noise.py tests/rl/test_rl_core.py"
  "selectors|qtransform/schemas/selectors.py|tests/schemas/test_selectors.py tests/schemas/test_policy.py"
  "metrics|qtransform/core/metrics.py|tests/core/test_metrics.py"
  "fake_quant|qtransform/passes/fake_quant.py|tests/pipeline/test_transform.py tests/formats/test_formats_api.py tests/core/test_moe.py"
  "pipeline|qtransform/pipeline/base.py qtransform/pipeline/manager.py qtransform/pipeline/selection.py qtransform/pipeline/transform.py|tests/pipeline/test_transform.py tests/core/test_site_identity.py tests/core/test_capture.py tests/pipeline/test_pipeline_contract.py"
  "formats|qtransform/formats/elements.py qtransform/formats/mx.py qtransform/formats/nvfp4.py qtransform/formats/intgroup.py qtransform/formats/blocking.py qtransform/formats/options.py|tests/formats/test_formats_rules.py tests/formats/test_formats_vectors.py tests/formats/test_formats_nvfp4_order.py tests/formats/test_formats_api.py tests/formats/test_formats_properties.py tests/formats/test_formats_mutants.py tests/formats/test_formats_options.py"
)

toml_list() { printf '['; local first=1; for x in "$@"; do [ $first = 1 ] || printf ', '; printf '"%s"' "$x"; first=0; done; printf ']'; }

mkdir -p "$OUT"
wanted=("$@")
for entry in "${GROUPS_ALL[@]}"; do
  IFS='|' read -r name targets tests <<<"$entry"
  if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " =~ " $name " ]]; then continue; fi
  work="$OUT/$name-work"
  if [ -d "$work/mutants" ]; then
    # resume: mutants with a result keep it; the tests are refreshed (new tests -> new stats)
    rm -rf "$work/tests" "$work/mutants/tests" && cp -r "$ROOT/tests" "$work/tests" && cp -r "$ROOT/tests" "$work/mutants/tests"
  else
  rm -rf "$work" && mkdir -p "$work"
  (cd "$ROOT" && git ls-files -z | xargs -0 cp --parents -t "$work")
  # the installed layout (passes/ and schemas/ are qtransform.passes and qtransform.schemas), so
  # that mutmut's mutants/qtransform is the whole package and shadows the editable install
  cp -r "$work/passes" "$work/qtransform/passes" && cp -r "$work/schemas" "$work/qtransform/schemas"
  fi
  # mutmut's settings, written on resume too: a test file added to the group since the work copy
  # was made is then run (mutmut collects the stats of new tests only).
  # Only the reference path is mutated: the C fast path would hide Python mutants in formats/
  read -ra t_arr <<<"$targets"; read -ra s_arr <<<"$tests"
  "$PY" - "$work/pyproject.toml" "$(toml_list "${t_arr[@]}")" "$(toml_list "${s_arr[@]}")" <<'EOF'
import json, pathlib, re, sys
path, targets, tests = sys.argv[1:]
root = pathlib.Path(path).parent
keep = set(json.loads(targets))
skip = sorted(str(p.relative_to(root)) for p in (root / "qtransform").rglob("*.py")
              if str(p.relative_to(root)) not in keep)
# (a resumed work copy has the section already: drop it, up to the next table or the end)
text = re.sub(r"\n\[tool\.mutmut\]\n(?:(?!\[).*(?:\n|$))*", "\n", open(path).read())
# tests read files next to the package (schemas/examples, docs, README): copy them into mutants/
also = sorted(p.name for p in root.iterdir()
              if p.name not in {"qtransform", "tests", "mutants", "meta-prev"})
open(path, "w").write(text + f'\n[tool.mutmut]\npaths_to_mutate = ["qtransform/"]\n'
                      f"do_not_mutate = {json.dumps(skip)}\ntests_dir = {tests}\n"
                      f"also_copy = {json.dumps(also)}\n")
EOF
  # mutmut 3.3.1 regenerates every mutant file on each run and forgets earlier results: keep
  # them, and after the run take each mutant's newest result (ONLY=... re-runs just those)
  rm -rf "$work/meta-prev" && mkdir -p "$work/meta-prev"
  if [ -d "$work/mutants" ]; then
    (cd "$work/mutants" && find . -name '*.meta' -exec cp --parents -t "$work/meta-prev" {} +)
  fi
  start=$(date +%s)
  (cd "$work" && QTRANSFORM_FASTPATH=0 OMP_NUM_THREADS=1 "$MUTMUT" run --max-children 1 ${ONLY:-} >"$OUT/$name.log" 2>&1 || true)
  "$PY" - "$work" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
for prev in (work / "meta-prev").rglob("*.meta"):
    now = work / "mutants" / prev.relative_to(work / "meta-prev")
    if not now.exists():
        continue
    old, new = json.loads(prev.read_text()), json.loads(now.read_text())
    codes = new["exit_code_by_key"]
    for key, code in old["exit_code_by_key"].items():
        if key in codes and codes[key] is None:
            codes[key] = code
    now.write_text(json.dumps(new))
EOF
  (cd "$work" && "$MUTMUT" results --all true) >"$OUT/$name.txt" 2>&1 || true
  : >"$OUT/$name-survivors.diff"
  for m in $(awk '$NF == "survived" {sub(":$", "", $1); print $1}' "$OUT/$name.txt"); do
    (cd "$work" && "$MUTMUT" show "$m") >>"$OUT/$name-survivors.diff" 2>&1 || true
  done
  total=$(grep -c ': ' "$OUT/$name.txt" || true)
  killed=$(grep -c ': killed$' "$OUT/$name.txt" || true)
  survived=$(grep -c ': survived$' "$OUT/$name.txt" || true)
  notests=$(grep -c ': no tests$' "$OUT/$name.txt" || true)
  timeout=$(grep -c ': timeout$' "$OUT/$name.txt" || true)
  unchecked=$(grep -c ': not checked$' "$OUT/$name.txt" || true)
  echo "$name: killed $killed/$total, timeout $timeout, survived $survived, no tests $notests," \
    "not checked $unchecked, $(( $(date +%s) - start )) s" \
    | tee -a "$OUT/summary.txt"
  [ -n "${KEEP:-}" ] || rm -rf "$work"
done
