"""A plain training loop around a runtime model, without taac-train: data, model, optimizer, validation metrics.

    python examples/training_loop.py         (PYTHONPATH=src from a checkout)

taac-train adds configs, checkpoints, resume, DDP and logging on top of the same pieces.
"""

import contextlib

import torch

from runtime.accelerators import AcceleratorConfig, set_accelerators
from runtime.models import BaselinePCVR
from runtime.nn import BCEWithLogitsLoss
from runtime.training.metrics import log_loss, roc_auc
from runtime.training.synthetic import SyntheticPCVR


def main() -> None:
    torch.manual_seed(0)
    set_accelerators(AcceleratorConfig(default="auto", fallback="torch"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    data = SyntheticPCVR(seed=0, seq_len=16, n_items=200, n_categories=8, val_size=512)
    model = BaselinePCVR(data.spec, d_model=16, n_heads=2, n_layers=1, ffn_mult=2, dropout=0.0, head_hidden=32).to(
        device
    )
    criterion = BCEWithLogitsLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps = 60
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    val = data.val_set().to(device)

    def validate() -> dict:
        model.eval()
        with torch.no_grad(), autocast:
            logits = model(val).float()
        model.train()
        return {"auc": roc_auc(logits, val.label), "logloss": log_loss(logits, val.label)}

    before = validate()
    for step in range(steps):
        batch = data.train_batch(step, 64).to(device)  # a pure function of (seed, index): no loader state
        with autocast:
            logits = model(batch)
        loss = criterion(logits, batch.label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
    after = validate()
    print(
        f"validation AUC {before['auc']:.3f} -> {after['auc']:.3f}, log-loss {before['logloss']:.3f} -> {after['logloss']:.3f}"
    )
    if not after["logloss"] < before["logloss"]:
        raise SystemExit("the model did not learn")


if __name__ == "__main__":
    main()
