"""Data and model overrides small enough for a few CPU training steps (the CPU training tests and tools' tests)."""

TINY_SIZES = [
    "data.batch_size=32",
    "data.seq_len=16",
    "data.n_items=200",
    "data.n_categories=8",
    "data.val_size=256",
    "data.prefetch=1",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.ffn_mult=2",
    "model.head_hidden=32",
]
