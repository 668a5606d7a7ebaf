#!/usr/bin/env bash
# Benchmarks of the given operators (default: all) on the GPU machine, JSON per op into $OUT/bench.tar.
# Usage (GPU machine, repo root): TAAC_COMMIT=<hash> bash .device/gpu bash tools/gpu_benchmarks.sh [op ...]
# (the GPU machine gets the working tree without .git: pass the commit so the JSON records it)
set -uo pipefail
ops=("$@")
[ ${#ops[@]} -gt 0 ] || ops=(rms_norm layer_norm l2norm flash_attention bce_with_logits swiglu dropout_add embedding_bag_mean mhc gated_delta_rule)
dir=$(mktemp -d)
for op in "${ops[@]}"; do
  echo "== $op"
  timeout "${PER_OP_TIMEOUT:-300}" python -m runtime.benchmark --operator "$op" --backends torch,triton,tilelang \
    --json "$dir/$op.json" 2>&1 | grep -v "TileLang:tilelang"
  tar -cf "${OUT:-/tmp}/bench.tar" -C "$dir" .  # after every op: a call cut short keeps what finished
done 2>&1 | tee "${OUT:-/tmp}/bench.log"
