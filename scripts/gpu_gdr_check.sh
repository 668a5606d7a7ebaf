#!/usr/bin/env bash
# One GPU call for the gated delta rule: its GPU tier (split over processes), the benchmark cases
# against fla, and the per-kernel profile; everything into $OUT. About 8 minutes on an H100.
# Usage (GPU machine, repo root): TAAC_COMMIT=<hash> bash .device/gpu bash scripts/gpu_gdr_check.sh
set -uo pipefail
out=${OUT:-/tmp}
G=tests/gpu/test_gated_delta_rule.py
tests=(test_triton_forward_matches_the_float64_recurrence test_triton_chunked_forward_and_every_gradient
       test_triton_half_backward_forward_and_every_gradient
       test_triton_split_of_long_sequences_matches_the_recurrence_and_the_whole_walk
       test_strong_decay_in_a_partial_chunk_keeps_gradients_finite test_tilelang_forward_matches_the_float64_recurrence
       test_tilelang_chunked_forward_and_every_gradient)
PARALLEL=1 PER_FILE_TIMEOUT=${PER_TEST_TIMEOUT:-240} TAIL_LINES=25 bash scripts/gpu_tests.sh "${tests[@]/#/$G::}"
for shape in chunk-B4-T4096-H16-D128 chunk-B256-T256-H4-D16 chunk-packed32768-H16-HV32-D128; do
  timeout 120 python -m runtime.benchmark --operator gated_delta_rule --backends triton --shape "$shape" \
    --json "$out/gdr_$shape.json" 2>&1 | grep "│" | grep -v " shape "
done | tee "$out/gdr_bench.log"
timeout 150 python scripts/gdr_profile.py 2>&1 | grep -v Warning | tee "$out/gdr_profile.log"
