#!/usr/bin/env bash
# The GPU tier on the GPU machine, one pytest process per test file (or per line of a list), each under a time limit,
# with the whole log kept in $OUT (so a call cut short still brings back what ran). PARALLEL=N runs up to N processes
# side by side (TileLang compiles are CPU-bound: about 8 per 16 cores; more pushed the load average to 300 and every
# file past its limit); GPUS=N spreads them over N GPUs, in turn (for a machine of two H200s and 32 cores:
# GPUS=2 PARALLEL=18 LIST=tools/gpu_tier.txt). Each process gets OMP_NUM_THREADS=2.
# Arguments are files or test node ids (file::test); LIST=FILE takes one pytest argument string per line instead
# (a slow file split with -k). Tests are listed as they finish (-v), so a process cut at its limit shows how far it got.
# Usage (GPU machine, repo root): bash .device/gpu bash tools/gpu_tests.sh [tests/gpu/test_x.py ...]
set -uo pipefail
out=${OUT:-/tmp}
gpus=${GPUS:-1}
lines=()
if [ -n "${LIST:-}" ]; then
  while IFS= read -r line; do
    case "$line" in "" | \#*) continue ;; esac
    lines+=("$line")
  done < "$LIST"
else
  lines=("$@")
  [ ${#lines[@]} -gt 0 ] || lines=(tests/gpu/test_*.py)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

run_line() {  # run_line GPU ARGS
  echo "== $2"
  CUDA_VISIBLE_DEVICES=$1 timeout "${PER_FILE_TIMEOUT:-240}" bash -c "python -m pytest $2 -v -rfE -p no:cacheprovider" 2>&1 \
    | grep -v "TileLang:tilelang" | grep -E "PASSED|FAILED|ERROR|SKIPPED|XFAIL|^E |^=|Error" | tail -${TAIL_LINES:-40}
}

log_name() { echo "$1" | tr -c 'A-Za-z0-9_.\n' _; }

job() {  # job GPU ARGS LOG: one process, its log appended to $out/gpu_tests.log as soon as it ends
  run_line "$1" "$2" > "$3" 2>&1
  cat "$3" >> "$out/gpu_tests.log"
}

# test_large_tensors.py holds about 45 GB of GPU memory, and test_autotune.py compares timings: each runs alone on
# its GPU, after the others
alone=()
logs=$(mktemp -d)
: > "$out/gpu_tests.log"
i=0
for line in "${lines[@]}"; do
  case "$line" in *test_large_tensors* | *test_autotune*) alone+=("$line"); continue ;; esac
  while [ "$(jobs -rp | wc -l)" -ge "${PARALLEL:-1}" ]; do wait -n; done
  job $((i % gpus)) "$line" "$logs/$(printf %03d $i)_$(log_name "$line").log" &
  i=$((i + 1))
done
wait
j=0
for line in "${alone[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$gpus" ]; do wait -n; done
  job $((j % gpus)) "$line" "$logs/alone_$(log_name "$line").log" &
  j=$((j + 1))
done
wait
cat "$out/gpu_tests.log"
