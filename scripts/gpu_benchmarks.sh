#!/usr/bin/env bash
# Benchmarks of the given operators (default: all) on the GPU machine, JSON per op into $OUT/bench.tar.
# Usage (GPU machine, repo root): bash .device/gpu bash scripts/gpu_benchmarks.sh [op ...]
set -uo pipefail
ops=("$@")
[ ${#ops[@]} -gt 0 ] || ops=(rms_norm layer_norm l2norm flash_attention bce_with_logits swiglu dropout_add embedding_bag_mean mhc)
dir=$(mktemp -d)
for op in "${ops[@]}"; do
  echo "== $op"
  python -m runtime.benchmark --operator "$op" --backends torch,triton,tilelang --json "$dir/$op.json" 2>&1 | grep -v INFO
done
tar -cf "${OUT:-/tmp}/bench.tar" -C "$dir" .
