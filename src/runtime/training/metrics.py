"""Validation metrics, computed on the tensors' device in one pass (no per-user Python loop):

- AUC: the probability that a random positive scores above a random negative (Mann-Whitney U, ties count half:
  average ranks);
- log-loss, and normalized entropy: log-loss over the entropy of the base rate (1.0: no better than predicting the
  mean label; lower is better);
- calibration: mean predicted probability over mean label (1.0 is calibrated);
- GAUC: the impression-weighted mean of per-user AUCs over the users with both classes (users with one class have
  no AUC and are skipped; NaN when no user has both).

A NaN score makes AUC and GAUC NaN (a diverged model is not given a number that looks valid).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().flatten()
    return t.double() if t.device.type != "mps" else t.float()  # MPS has no float64


def grouped_auc(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(AUC per group, examples per group) for the distinct group ids in ascending order; NaN for a group without
    both classes. Labels in [0, 1] (1 positive). One sort by (group, score), then segment sums: each example's
    rank within its group, ties given their average rank."""
    scores, labels = _float64(scores), _float64(labels)
    groups = groups.detach().flatten().to(scores.device)
    n = scores.numel()
    if n == 0:
        empty = scores.new_empty(0)
        return empty, empty
    by_score = torch.sort(scores, stable=True).indices
    order = by_score[torch.sort(groups[by_score], stable=True).indices]  # by group, then score
    s, y, g = scores[order], labels[order], groups[order]
    index = torch.arange(n, device=s.device)
    new_group = torch.ones(n, dtype=torch.bool, device=s.device)
    new_group[1:] = g[1:] != g[:-1]
    new_run = new_group.clone()
    new_run[1:] |= s[1:] != s[:-1]  # a run: equal (group, score)
    group_id = new_group.cumsum(0) - 1
    run_id = new_run.cumsum(0) - 1
    n_groups, n_runs = int(group_id[-1]) + 1, int(run_id[-1]) + 1
    group_start = index[new_group]  # first sorted position of each group
    run_start, run_size = index[new_run], torch.bincount(run_id, minlength=n_runs)
    # 1-based rank within the group of a run's first element; the run's members share the mean of its ranks
    first_rank = (run_start - group_start[group_id[new_run]] + 1).to(s.dtype)
    rank = (first_rank + (run_size.to(s.dtype) - 1) / 2)[run_id]
    count = torch.bincount(group_id, minlength=n_groups).to(s.dtype)
    n_pos = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, group_id, y)
    rank_sum = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, group_id, rank * y)
    n_neg = count - n_pos
    auc = (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    # a NaN score has no rank (the sort puts it last, as if the highest): its group's AUC is NaN
    n_nan = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, group_id, s.isnan().to(s.dtype))
    return torch.where((n_pos > 0) & (n_neg > 0) & (n_nan == 0), auc, torch.nan), count


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (Mann-Whitney U); NaN if a class is missing."""
    if scores.numel() == 0:
        return float("nan")
    auc, _ = grouped_auc(scores, labels, torch.zeros(scores.numel(), dtype=torch.long, device=scores.device))
    return float(auc[0])


def gauc(scores: torch.Tensor, labels: torch.Tensor, users: torch.Tensor) -> float:
    """Impression-weighted mean of per-user AUC over the users with both classes; NaN when there is none, or when a
    score is NaN."""
    if bool(scores.isnan().any()):
        return float("nan")
    auc, count = grouped_auc(scores, labels, users)
    valid = ~torch.isnan(auc)
    total = count[valid].sum()
    return float((auc[valid] * count[valid]).sum() / total) if total > 0 else float("nan")


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(F.binary_cross_entropy_with_logits(_float64(logits), _float64(labels)))


def _entropy(p: float) -> float:
    if not 0.0 < p < 1.0:
        return float("nan")
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def validation_metrics(
    logits: torch.Tensor, labels: torch.Tensor, users: torch.Tensor | None = None
) -> dict[str, float]:
    """val_auc, val_logloss, val_ne (normalized entropy), val_calibration, and val_gauc when user ids are given."""
    logits, labels = _float64(logits), _float64(labels.to(logits.device))
    loss = log_loss(logits, labels)
    base_rate = float(labels.mean()) if labels.numel() else float("nan")
    mean_prediction = float(torch.sigmoid(logits).mean()) if logits.numel() else float("nan")
    out = {
        "val_auc": roc_auc(logits, labels),
        "val_logloss": loss,
        "val_ne": loss / _entropy(base_rate),
        "val_calibration": mean_prediction / base_rate if base_rate > 0 else float("nan"),
    }
    if users is not None:
        out["val_gauc"] = gauc(logits, labels, users.to(logits.device))
    return out
