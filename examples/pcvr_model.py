"""A PCVR model written in plain PyTorch from runtime.nn modules, trained for a few steps on synthetic data.

    python examples/pcvr_model.py            (PYTHONPATH=src from a checkout)

Each module runs on the backend the accelerator config picks: "auto" takes the Triton or TileLang kernels on a GPU
and the torch reference on the CPU; `set_accelerators(AcceleratorConfig(default="triton"))` or a module's `backend=` chooses instead.
"""

import torch
from torch import nn

import runtime.nn as rnn
from runtime.accelerators import AcceleratorConfig, set_accelerators
from runtime.training.metrics import roc_auc
from runtime.training.synthetic import SyntheticPCVR


class TinyPCVR(nn.Module):
    """Sparse fields mean-pooled by an embedding bag, the behaviour history through one attention block, the target
    item attending over it, and an MLP head with fused Linear + activation."""

    def __init__(self, spec, d: int = 16) -> None:
        super().__init__()
        self.fields = rnn.EmbeddingBagMean(sum(spec.sparse_fields.values()) + len(spec.sparse_fields), d, padding_idx=0)
        offsets = torch.tensor([0, *list(spec.sparse_fields.values())[:-1]]).cumsum(0) + torch.arange(
            len(spec.sparse_fields)
        )
        self.register_buffer("field_offsets", offsets[:, None], persistent=False)
        self.items = nn.Embedding(spec.n_items + 1, d, padding_idx=0)
        self.dense = rnn.Linear(spec.n_dense, d, activation="silu")
        self.norm = rnn.RMSNorm(d)
        self.history = rnn.MultiHeadAttention(d, 2)
        self.target = rnn.CrossAttention(d, 2)
        width = (len(spec.sparse_fields) + 3) * d
        self.head = nn.Sequential(rnn.LayerNorm(width), rnn.Linear(width, 32, activation="gelu"), rnn.Linear(32, 1))

    def forward(self, batch) -> torch.Tensor:
        b, n_fields, hotness = batch.sparse.shape
        ids = torch.where(batch.sparse > 0, batch.sparse + self.field_offsets, 0)
        fields = self.fields(ids.view(b * n_fields, hotness)).view(b, -1)
        events = self.items(batch.seq_items)
        events = events + self.history(self.norm(events), batch.seq_lengths)
        target = self.items(batch.target_item)
        interest = self.target(target[:, None], self.norm(events), batch.seq_lengths)[:, 0]
        return self.head(torch.cat([fields, self.dense(batch.dense), target, interest], -1)).squeeze(-1)


def main() -> None:
    torch.manual_seed(0)
    set_accelerators(AcceleratorConfig(default="auto"))  # the default; e.g. ops={"linear": "triton"} overrides one op
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = SyntheticPCVR(seed=0, seq_len=16, n_items=200, n_categories=8, val_size=512)
    model = TinyPCVR(data.spec).to(device)
    loss_fn = rnn.BCEWithLogitsLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    val = data.val_set().to(device)
    with torch.no_grad():
        before = roc_auc(model(val), val.label)
    for step in range(60):
        batch = data.train_batch(step, 64).to(device)
        loss = loss_fn(model(batch), batch.label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        after = roc_auc(model(val), val.label)
    print(f"validation AUC {before:.3f} -> {after:.3f}")
    if not after > before:
        raise SystemExit("the model did not learn")


if __name__ == "__main__":
    main()
