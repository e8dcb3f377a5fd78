"""Accuracy matrix, ACC and BWT (paper section V, "Metrics").

``R[i][j]`` is the test accuracy (%) on task ``j`` after training on task ``i``.

    ACC = 1/T * sum_t R[T-1][t]
    BWT = 1/(T-1) * sum_{t < T-1} (R[T-1][t] - R[t][t])
"""
from __future__ import annotations

import math

import torch

__all__ = ["acc", "bwt", "evaluate", "mean_std", "accuracy"]


def _check(matrix) -> list:
    m = [list(map(float, row)) for row in matrix]
    if not m or any(len(row) != len(m) for row in m):
        raise ValueError("the accuracy matrix must be square and non-empty (T rows of T accuracies)")
    return m


def acc(matrix) -> float:
    """Average accuracy over all tasks after the last task."""
    m = _check(matrix)
    return sum(m[-1]) / len(m)


def bwt(matrix) -> float:
    """Backward transfer; 0 for a single task."""
    m = _check(matrix)
    T = len(m)
    if T == 1:
        return 0.0
    return sum(m[-1][t] - m[t][t] for t in range(T - 1)) / (T - 1)


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
    v = [float(x) for x in values]
    if not v:
        return float("nan"), float("nan")
    mu = sum(v) / len(v)
    if len(v) == 1:
        return mu, 0.0
    return mu, math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))


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
