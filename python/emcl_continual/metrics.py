"""Accuracy matrix and the continual-learning metrics computed from it.

``R[i][j]`` is the test accuracy (%) on task ``j`` after training on task ``i`` (0-based, ``T``
tasks). ``b[j]`` is the accuracy on task ``j`` of the model before any training (the random
initialisation): the evaluation row that :func:`emcl_continual.train.run` records as
``acc_before``. Every metric is in percentage points.

==================  ==========================================================================
``acc``             ACC = 1/T · Σ_t R[T-1][t] (the EMCL paper, section V; GEM eq. "ACC").
``bwt``             BWT = 1/(T-1) · Σ_{t<T-1} (R[T-1][t] − R[t][t]): the definition of the GEM
                    paper (Lopez-Paz & Ranzato 2017, eq. 3) and the EMCL paper; this project's
                    BWT everywhere it is not labelled otherwise.
``bwt_over_t``      the same sum divided by T: what the GEM and La-MAML code bases compute
                    (``metrics/metrics.py``: ``bwt = result[T-1] - result.diag()`` averaged over
                    all T tasks, the last term being 0), and so the BWT of the numbers Table III
                    quotes from them. ``bwt_over_t = bwt · (T-1)/T``.
``learning_acc``    learning accuracy LA = 1/T · Σ_t R[t][t], the accuracy on each task right
                    after learning it (Riemer et al. 2019, MER, section 5).
``forgetting``      average forgetting F = 1/(T-1) · Σ_{t<T-1} max_{l<T-1} R[l][t] − R[T-1][t]
                    (Chaudhry et al. 2018, "Riemannian Walk", eq. 7; used by A-GEM): the drop of
                    each earlier task from the best accuracy it had at the end of any earlier
                    task (``l`` ranges over every earlier row, as in that definition).
``fwt``             forward transfer FWT = 1/(T-1) · Σ_{t>0} (R[t-1][t] − b[t]) (GEM paper,
                    eq. 4): how much learning tasks ``< t`` helps task ``t`` before it is seen,
                    against the untrained model. Needs ``b``; the GEM / La-MAML code divides
                    the same sum by T (``fwt_over_t``).
==================  ==========================================================================

For a single task the transfer and forgetting metrics are 0 (nothing to transfer to or forget).
"""
from __future__ import annotations

import math

import torch

__all__ = ["acc", "bwt", "bwt_over_t", "learning_acc", "forgetting", "fwt", "fwt_over_t", "all_metrics",
           "METRIC_NAMES", "evaluate", "mean_std", "paired", "accuracy"]

# Every metric :func:`all_metrics` returns, in table order, with a short label.
METRIC_NAMES = {
    "acc": "ACC",
    "bwt": "BWT (÷(T−1))",
    "bwt_over_t": "BWT (÷T, GEM/La-MAML code)",
    "learning_acc": "LA",
    "forgetting": "forgetting",
    "fwt": "FWT",
}


def _check(matrix) -> list:
    m = [list(map(float, row)) for row in matrix]
    if not m or any(len(row) != len(m) for row in m):
        raise ValueError("the accuracy matrix must be square and non-empty (T rows of T accuracies)")
    return m


def _check_before(before, T: int) -> list:
    b = [float(v) for v in before]
    if len(b) != T:
        raise ValueError(f"the before-training row has {len(b)} accuracies, the matrix has {T} tasks")
    return b


def acc(matrix) -> float:
    """Average accuracy over all tasks after the last task."""
    m = _check(matrix)
    return sum(m[-1]) / len(m)


def _bwt_sum(m: list) -> float:
    T = len(m)
    return sum(m[-1][t] - m[t][t] for t in range(T - 1))


def bwt(matrix) -> float:
    """Backward transfer over the T-1 earlier tasks (GEM paper, EMCL paper); 0 for one task."""
    m = _check(matrix)
    T = len(m)
    return 0.0 if T == 1 else _bwt_sum(m) / (T - 1)


def bwt_over_t(matrix) -> float:
    """Backward transfer as the GEM / La-MAML code computes it: the same sum divided by T."""
    m = _check(matrix)
    return _bwt_sum(m) / len(m)


def learning_acc(matrix) -> float:
    """Learning accuracy: mean of the diagonal R[t][t]."""
    m = _check(matrix)
    return sum(m[t][t] for t in range(len(m))) / len(m)


def forgetting(matrix) -> float:
    """Average forgetting of the first T-1 tasks (Chaudhry et al. 2018); 0 for one task."""
    m = _check(matrix)
    T = len(m)
    if T == 1:
        return 0.0
    return sum(max(m[l][t] for l in range(T - 1)) - m[-1][t] for t in range(T - 1)) / (T - 1)


def _fwt_sum(m: list, b: list) -> float:
    return sum(m[t - 1][t] - b[t] for t in range(1, len(m)))


def fwt(matrix, before) -> float:
    """Forward transfer against the untrained model's accuracies ``before`` (GEM paper, eq. 4)."""
    m = _check(matrix)
    b = _check_before(before, len(m))
    return 0.0 if len(m) == 1 else _fwt_sum(m, b) / (len(m) - 1)


def fwt_over_t(matrix, before) -> float:
    """Forward transfer as the GEM / La-MAML code computes it: the same sum divided by T."""
    m = _check(matrix)
    b = _check_before(before, len(m))
    return _fwt_sum(m, b) / len(m)


def all_metrics(matrix, before=None) -> dict:
    """Every metric of the module for one run; ``fwt`` / ``fwt_over_t`` are None without ``before``."""
    out = {"acc": acc(matrix), "bwt": bwt(matrix), "bwt_over_t": bwt_over_t(matrix),
           "learning_acc": learning_acc(matrix), "forgetting": forgetting(matrix)}
    if before is None:
        out["fwt"] = out["fwt_over_t"] = None
    else:
        out["fwt"] = fwt(matrix, before)
        out["fwt_over_t"] = fwt_over_t(matrix, before)
    return out


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
    v = [float(x) for x in values]
    if not v:
        return float("nan"), float("nan")
    mu = sum(v) / len(v)
    if len(v) == 1:
        return mu, 0.0
    return mu, math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))


def paired(a: dict, b: dict) -> dict:
    """Paired differences ``a[s] − b[s]`` over the seeds ``s`` both hold.

    Returns n, mean, std (ddof=1), the number of seeds where ``a`` is larger, and the two-sided
    95 % confidence interval of the mean difference from Student's t (None for fewer than 2 seeds).
    """
    seeds = sorted(set(a) & set(b))
    d = [float(a[s]) - float(b[s]) for s in seeds]
    mu, sd = mean_std(d)
    out = {"seeds": seeds, "n": len(d), "mean": mu, "std": sd, "n_positive": sum(x > 0 for x in d),
           "ci95": None}
    if len(d) >= 2:
        from scipy.stats import t as student_t

        half = float(student_t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
        out["ci95"] = (mu - half, mu + half)
    return out


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, task: int,
             device: torch.device | str = "cpu", batch_size: int = 1000) -> float:
    """Test accuracy (%) of ``model`` on ``(x, y)`` from task ``task``."""
    correct = 0
    for s in range(0, len(y), batch_size):
        xb = x[s:s + batch_size].to(device, non_blocking=True)
        yb = y[s:s + batch_size].to(device, non_blocking=True)
        correct += int((model(xb, task).argmax(1) == yb).sum())
    return 100.0 * correct / max(1, len(y))


def evaluate(model: torch.nn.Module, tasks: list, device: torch.device | str = "cpu",
             batch_size: int = 1000) -> list:
    """Accuracy (%) on every task's test set, in eval mode (restores the previous mode)."""
    was_training = model.training
    model.eval()
    try:
        return [accuracy(model, td.x, td.y, td.task, device, batch_size) for td in tasks]
    finally:
        model.train(was_training)
