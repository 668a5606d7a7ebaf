#!/usr/bin/env bash
# The GPU tier on the GPU machine, one test file at a time, each under a time limit, with the whole
# log kept in $OUT (so a call cut short still brings back what ran).
# Usage (GPU machine, repo root): bash .device/gpu bash scripts/gpu_tests.sh [tests/gpu/test_x.py ...]
set -uo pipefail
out=${OUT:-/tmp}
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_*.py)
for f in "${files[@]}"; do
  echo "== $f"
  timeout "${PER_FILE_TIMEOUT:-240}" python -m pytest "$f" -q -rfE -p no:cacheprovider 2>&1 | grep -v "TileLang:tilelang" | tail -15
done 2>&1 | tee "$out/gpu_tests.log"
