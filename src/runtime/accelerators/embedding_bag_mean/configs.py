"""Block sizes of the embedding-bag weight gradient's Triton kernels (triton.py, collection_triton.py), chosen on an
H100: docs/tuning/embedding_bag_mean.md."""

from __future__ import annotations

CHUNK = 16  # sorted entries per program of the first pass: more, smaller programs hide its latency
BLOCK_J = 128  # chunk partials summed per step of the second pass: a hot (Zipf) row spans hundreds of chunks
