#!/usr/bin/env bash
# The training-step benchmark on the GPU machine: every model under every preset (and torch.compile of the
# torch model, and the CUDA-graphed step of every preset), with a profile of 10 steps per run (host vs kernel time), JSON and log into $OUT.
# Usage (GPU machine, repo root): bash .device/gpu bash scripts/gpu_training.sh [extra benchmark overrides ...]
set -uo pipefail
out=${OUT:-/tmp}
graphed=("graphed=[torch,triton,tilelang]")  # the CUDA-graphed step too, unless the arguments say otherwise
for arg in "$@"; do [[ $arg == graphed=* ]] && graphed=(); done
python -m runtime.training.benchmark steps=200 warmup=20 profile_steps=10 time_budget_s="${TIME_BUDGET_S:-420}" \
  output="$out/training.json" "${graphed[@]}" "$@" 2>&1 | grep -v "TileLang:tilelang" | tee "$out/training.log"
