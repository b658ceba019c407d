#!/bin/bash
# Alternates benchmarks.host_overhead between two checkouts, run by run (the machine drifts):
#   git worktree add /tmp/base f3e39ff
#   BASE=/tmp/base NEW=$PWD bash benchmarks/results/host_overhead/ab.sh 3
# Each checkout runs on its own sources (PYTHONPATH) with this venv's packages.
set -euo pipefail
BASE=${BASE:?a checkout of the old code}
NEW=${NEW:-$PWD}
PY=${PY:-$NEW/.venv/bin/python}
for i in $(seq 1 "${1:-3}"); do
  for d in "$BASE" "$NEW"; do
    (cd "$d" && PYTHONPATH=$d "$PY" -m benchmarks.host_overhead --batch-sizes "${B:-64,256}" --steps 100 --repeats 3 2>&1 \
        | tail -2 | sed "s|^|$(basename "$d") |")
  done
done
