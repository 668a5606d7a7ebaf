#!/usr/bin/env bash
# session 26, device call A
export TAAC_COMMIT=496a4b5
cd "$(dirname "$0")/.."
export PYTHONPATH=scripts:$PYTHONPATH
timeout 270 python scripts/fa_order_sweep.py --backends triton > $OUT/order-triton.txt 2>&1
timeout 60 python scripts/autograd_overhead.py --bce-lean > $OUT/bce-lean.txt 2>&1
PER_FILE_TIMEOUT=150 timeout 200 bash scripts/gpu_tests.sh tests/gpu/test_flash_attention_variants.py tests/gpu/test_norms_triton.py > $OUT/gpu-tests.txt 2>&1
timeout 120 python -m runtime.benchmark --operator l2norm --shape 32768x4096 --backends triton,tilelang --mode both --json $OUT/l2norm-32768x4096.json > /dev/null 2>&1
echo "callA done"
