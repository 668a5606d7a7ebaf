#!/usr/bin/env bash
# The GPU tier on the GPU machine, one test file at a time, each under a time limit, with the whole
# log kept in $OUT (so a call cut short still brings back what ran). PARALLEL=N runs up to N files side by
# side (TileLang compiles are CPU-bound; the GPU machine has 16 cores: more than about 8 processes that
# compile at once pushed its load average to 300 and every file past its limit). Each process gets
# OMP_NUM_THREADS=2. Arguments may be test node ids (file::test) to split one slow file. Tests are listed
# one per line as they finish (-v), so a file cut at its limit still shows how far it got.
# Usage (GPU machine, repo root): bash .device/gpu bash tools/gpu_tests.sh [tests/gpu/test_x.py ...]
set -uo pipefail
out=${OUT:-/tmp}
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_*.py)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

run_file() {
  echo "== $1"
  timeout "${PER_FILE_TIMEOUT:-240}" python -m pytest "$1" -v -rfE -p no:cacheprovider 2>&1 \
    | grep -v "TileLang:tilelang" | grep -E "PASSED|FAILED|ERROR|SKIPPED|XFAIL|^E |^=|Error" | tail -${TAIL_LINES:-40}
}

log_name() { echo "$1" | tr -c 'A-Za-z0-9_.\n' _; }

if [ "${PARALLEL:-1}" -gt 1 ]; then
  # test_large_tensors.py holds about 45 GB of GPU memory, and test_autotune.py compares timings: they run alone,
  # after the others
  logs=$(mktemp -d)
  alone=()
  for f in "${files[@]}"; do
    case "$f" in *test_large_tensors* | *test_autotune*) alone+=("$f"); continue ;; esac
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    run_file "$f" > "$logs/$(log_name "$f").log" 2>&1 &
  done
  wait
  for f in "${alone[@]}"; do run_file "$f" > "$logs/~alone_$(log_name "$f").log" 2>&1; done
  cat "$logs"/*.log | tee "$out/gpu_tests.log"
else
  for f in "${files[@]}"; do run_file "$f"; done 2>&1 | tee "$out/gpu_tests.log"
fi
