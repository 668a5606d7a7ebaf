#!/usr/bin/env bash
export TAAC_COMMIT=f7e787c
cd "$(dirname "$0")/.."
export PYTHONPATH=scripts:$PYTHONPATH
timeout 120 python scripts/swiglu_launch_sweep.py > $OUT/swiglu-launch-sweep.txt 2>&1
timeout 120 python scripts/fa_order_sweep.py --only 128x8x1024x32 --sections 0/0/0,0/4/0,0/16/0,0/0/16,4/0/0,0/4/4,0/0/0 > $OUT/order-d32.txt 2>&1
PER_FILE_TIMEOUT=200 bash scripts/gpu_tests.sh tests/gpu/test_flash_attention_variants.py > /dev/null 2>&1
echo "callE done"
