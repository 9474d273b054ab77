#!/usr/bin/env bash
# Run a list of benchmark steps in one device call, within a time budget; each step's log and the results it writes
# under $RES come back in $OUT/all.tgz, and a table of exit codes and seconds is printed last.
#
#   bash bench/run_steps.sh BUDGET_S < steps.txt
#
# Each line of steps.txt: NAME TIMEOUT_S COMMAND... ('#' lines skipped). A step gets at most its timeout and what is
# left of the budget. Wheels in .whl/ (fetched elsewhere) are installed into .site first, bench/ and the repository
# are put on PYTHONPATH, and $RES names the folder a step writes its JSON to, e.g.
#   spec 90 python3 bench/speculative.py --ks 0 1 3 --concurrency 1 16 --out $RES/speculative.json
set -u
budget=$1
start=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
work=$(mktemp -d)
mkdir -p "$work/logs" "$work/results"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    > "$work/logs/pip.log" 2>&1
fi
export PYTHONPATH=$PWD/.site:$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
export RES=$work/results
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$work/logs/gpu.txt" 2>&1
table=""
while read -r name limit cmd; do
  case "$name" in ""|\#*) continue ;; esac
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 20 ]; then table+="$name skipped (budget)\n"; continue; fi
  t=$(( limit < left ? limit : left ))
  s=$(date +%s)
  timeout -k 5 "$t" bash -c "$cmd" > "$work/logs/$name.log" 2>&1 < /dev/null
  rc=$?
  table+="$name rc=$rc $(( $(date +%s) - s ))s\n"
  echo "== $name rc=$rc"
  tail -n 6 "$work/logs/$name.log"
  (cd "$work" && tar czf "$OUT/all.tgz" logs results)  # after every step: a cut call keeps what ran
done
(cd "$work" && tar czf "$OUT/all.tgz" logs results)
printf "\n%b" "$table"
