#!/usr/bin/env bash
export TAAC_COMMIT=f55343b
cd "$(dirname "$0")/.."
b() { timeout 110 python -m runtime.benchmark --mode both --backends triton,tilelang "$@" > /dev/null 2>&1; }
b --operator bce_with_logits --shape 16M --dtype float32 --json $OUT/bce-16M-fp32.json
b --operator bce_with_logits --shape 256 --json $OUT/bce-256.json
b --operator bce_with_logits --shape 4096 --json $OUT/bce-4096.json
b --operator swiglu --shape 8192x4096 --json $OUT/swiglu-8192x4096.json
b --operator swiglu --shape 131072x256 --json $OUT/swiglu-131072x256.json
b --operator dropout_add --shape 8192x4096 --json $OUT/dropout_add-8192x4096.json
echo "callD done"
