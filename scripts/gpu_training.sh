#!/usr/bin/env bash
# The training-step benchmark on the GPU machine: every model under every preset (and torch.compile of the
# torch model), with a profile of 10 steps per run (host vs kernel time), JSON and log into $OUT.
# Usage (GPU machine, repo root): bash .device/gpu bash scripts/gpu_training.sh [extra benchmark overrides ...]
set -uo pipefail
out=${OUT:-/tmp}
python -m runtime.training.benchmark steps=200 warmup=20 profile_steps=10 time_budget_s="${TIME_BUDGET_S:-420}" \
  output="$out/training.json" "$@" 2>&1 | grep -v "TileLang:tilelang" | tee "$out/training.log"
