#!/usr/bin/env bash
# session 26, device call B
export TAAC_COMMIT=$1
cd "$(dirname "$0")/.."
export PYTHONPATH=scripts:$PYTHONPATH
timeout 300 python scripts/fa_order_sweep.py --backends tilelang --only 4x16x4096x128 > $OUT/order-tilelang.txt 2>&1
timeout 100 python scripts/l2norm_forward_variants.py > $OUT/l2norm-fwd-variants.txt 2>&1
for n in 256 4096; do
  timeout 60 python -m runtime.benchmark --operator bce_with_logits --shape $n --backends triton,tilelang --mode both --json $OUT/bce-$n.json > /dev/null 2>&1
done
PER_FILE_TIMEOUT=100 bash scripts/gpu_tests.sh tests/gpu/test_norms_triton.py tests/gpu/test_bce.py > /dev/null 2>&1
echo "callB done"
