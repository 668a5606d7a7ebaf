"""Validation metrics: ROC AUC (ties get their average rank) and log-loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (Mann-Whitney U); NaN if a class is missing."""
    scores, labels = scores.detach().double().flatten().cpu(), labels.detach().double().flatten().cpu()
    n_pos = labels.sum()
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_scores, order = scores.sort()
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    last_rank = counts.cumsum(0).double()
    average_rank = last_rank - (counts.double() - 1) / 2  # ranks are 1-based
    ranks = torch.empty_like(scores)
    ranks[order] = average_rank[inverse]
    return float(((ranks * labels).sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(F.binary_cross_entropy_with_logits(logits.detach().double().flatten(), labels.detach().double().flatten()))
