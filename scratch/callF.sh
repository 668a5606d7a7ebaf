#!/usr/bin/env bash
export TAAC_COMMIT=0ad2cc9
cd "$(dirname "$0")/.."
b() { timeout 110 python -m runtime.benchmark --mode both --backends triton,tilelang "$@" > /dev/null 2>&1; }
PER_FILE_TIMEOUT=150 bash scripts/gpu_tests.sh tests/gpu/test_swiglu.py > /dev/null 2>&1
b --operator swiglu --shape 8192x4096 --json $OUT/swiglu-8192x4096.json
b --operator swiglu --shape 131072x256 --json $OUT/swiglu-131072x256.json
b --operator bce_with_logits --shape 256 --json $OUT/bce-256.json
echo "callF done"
