"""Validation metrics against direct float64 definitions: pairwise AUC (O(n^2)), per-user AUC for GAUC with users of
one class skipped, ties, normalized entropy and calibration."""

import math

import pytest
import torch

from runtime.training.metrics import gauc, grouped_auc, log_loss, roc_auc, validation_metrics


def pairwise_auc(scores, labels) -> float:
    """Over every (positive, negative) pair: 1 if the positive scores higher, 1/2 on a tie."""
    pos = [float(s) for s, y in zip(scores, labels) if y == 1]
    neg = [float(s) for s, y in zip(scores, labels) if y == 0]
    if not pos or not neg:
        return float("nan")
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


def reference_gauc(scores, labels, users) -> float:
    total = weighted = 0.0
    for user in sorted(set(users.tolist())):
        mine = users == user
        auc = pairwise_auc(scores[mine], labels[mine])
        if not math.isnan(auc):
            weighted += auc * int(mine.sum())
            total += int(mine.sum())
    return weighted / total if total else float("nan")


def _data(n=300, n_users=23, levels=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (n,), generator=gen).float() / levels  # few levels: many ties, within users too
    labels = torch.bernoulli(torch.sigmoid(3 * scores - 1.5), generator=gen)
    users = torch.randint(0, n_users, (n,), generator=gen) * 7 + 100  # sparse, unordered ids
    return scores, labels, users


@pytest.mark.parametrize("levels", [3, 50, 100000], ids=["heavy-ties", "some-ties", "few-ties"])
def test_auc_matches_pairwise_counting(levels):
    scores, labels, _ = _data(levels=levels)
    assert roc_auc(scores, labels) == pytest.approx(pairwise_auc(scores, labels), abs=1e-12)
    assert roc_auc(-scores, labels) == pytest.approx(1 - pairwise_auc(scores, labels), abs=1e-12)


def test_auc_edge_cases():
    assert math.isnan(roc_auc(torch.rand(5), torch.ones(5)))  # one class
    assert math.isnan(roc_auc(torch.empty(0), torch.empty(0)))
    assert roc_auc(torch.ones(4), torch.tensor([0.0, 1, 0, 1])) == 0.5  # all tied
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0


@pytest.mark.parametrize("levels", [3, 100000], ids=["ties", "few-ties"])
def test_gauc_matches_per_user_pairwise_auc(levels):
    scores, labels, users = _data(levels=levels)
    one_class = users == users[0]
    labels[one_class] = 1.0  # this user has positives only: skipped
    expected = reference_gauc(scores, labels, users)
    assert gauc(scores, labels, users) == pytest.approx(expected, abs=1e-12)
    per_user, count = grouped_auc(scores, labels, users)
    ids = sorted(set(users.tolist()))
    assert count.tolist() == [int((users == u).sum()) for u in ids]
    for u, auc in zip(ids, per_user.tolist()):
        ref = pairwise_auc(scores[users == u], labels[users == u])
        assert (math.isnan(auc) and math.isnan(ref)) or auc == pytest.approx(ref, abs=1e-12), u


def test_gauc_weights_users_by_impressions_and_skips_one_class_users():
    scores = torch.tensor([0.9, 0.1, 0.5, 0.2, 0.3, 0.8, 0.7, 0.6, 0.4])
    labels = torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 1, 1])
    users = torch.tensor([5, 5, 2, 2, 2, 2, 9, 9, 9])  # user 9: positives only
    # user 5: AUC 1 over 2 impressions; user 2: positives 0.2, 0.3 vs negatives 0.5, 0.8: AUC 0 over 4
    assert gauc(scores, labels, users) == pytest.approx((1 * 2 + 0 * 4) / 6)
    assert math.isnan(gauc(scores, torch.ones(9), users))


def test_normalized_entropy_and_calibration():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(500, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(torch.full((500,), 0.3, dtype=torch.float64), generator=gen)
    p = labels.mean().item()
    probs = torch.sigmoid(logits)
    loss = -(labels * probs.log() + (1 - labels) * (1 - probs).log()).mean().item()
    metrics = validation_metrics(logits.float(), labels)
    assert metrics["val_logloss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["val_ne"] == pytest.approx(loss / -(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-6)
    assert metrics["val_calibration"] == pytest.approx(probs.mean().item() / p, rel=1e-6)
    assert "val_gauc" not in metrics
    base_rate_logit = torch.full((500,), math.log(p / (1 - p)))
    constant = validation_metrics(base_rate_logit, labels)
    assert constant["val_ne"] == pytest.approx(1.0, rel=1e-6) and constant["val_calibration"] == pytest.approx(
        1.0, rel=1e-6
    )
    assert math.isnan(validation_metrics(logits, torch.zeros(500))["val_ne"])


def test_validation_metrics_with_users():
    scores, labels, users = _data()
    logits = torch.logit(scores.clamp(0.01, 0.99))
    metrics = validation_metrics(logits, labels, users)
    assert set(metrics) == {"val_auc", "val_logloss", "val_ne", "val_calibration", "val_gauc"}
    assert metrics["val_gauc"] == pytest.approx(reference_gauc(logits, labels, users), abs=1e-12)
    assert metrics["val_logloss"] == pytest.approx(log_loss(logits, labels))


def test_a_nan_score_gives_nan_auc_and_gauc_not_a_number_that_looks_valid():
    scores = torch.tensor([0.2, float("nan"), 0.7, 0.1, 0.9, 0.4])
    labels = torch.tensor([0.0, 1, 1, 0, 1, 0])
    users = torch.tensor([1, 1, 1, 2, 2, 2])  # user 1 holds the NaN; user 2 is clean
    assert math.isnan(roc_auc(scores, labels))
    per_user, _ = grouped_auc(scores, labels, users)
    assert math.isnan(per_user[0]) and per_user[1] == 1.0
    assert math.isnan(gauc(scores, labels, users))  # not user 2's AUC alone, as if user 1 had one class
    assert math.isnan(validation_metrics(scores, labels, users)["val_auc"])
