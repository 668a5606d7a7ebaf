#!/usr/bin/env bash
export TAAC_COMMIT=549d9ab
cd "$(dirname "$0")/.."
export PYTHONPATH=scripts:$PYTHONPATH
timeout 150 python scripts/fa_order_sweep.py --only 4x16x4096x128 --sections 4/4/4,4/2/4,4/8/4,4/4/2,4/4/8,4/2/2,4/8/8,4/4/0,2/2/2 > $OUT/order-split.txt 2>&1
for s in large-4x16x4096x128-causal pcvr-128x8x1024x32-causal pcvr-64x4x2048x48-causal; do
  timeout 100 python -m runtime.benchmark --operator flash_attention --shape $s --backends triton --mode both --json $OUT/fa-$s.json > /dev/null 2>&1
done
PER_FILE_TIMEOUT=200 bash scripts/gpu_tests.sh tests/gpu/test_flash_attention_variants.py tests/gpu/test_flash_attention_triton.py > /dev/null 2>&1
echo "callC done"
