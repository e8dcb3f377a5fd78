"""Accuracy matrix and the continual-learning metrics computed from it.

``R[i][j]`` is the test accuracy (%) on task ``j`` after training on task ``i`` (0-based, ``T``
tasks). ``b[j]`` is the accuracy on task ``j`` of the model before any training (the random
initialisation): the evaluation row that :func:`emcl_continual.training.train.run` records as
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

**Anytime metrics** (:func:`anytime_metrics`), from the record of
:class:`emcl_continual.training.anytime.AnytimeEvaluator`: points ``e`` at ``s_e`` samples seen, while task
``k_e`` was being trained, with ``a_e[j]`` the accuracy on task ``j ≤ k_e`` (on the fixed
evaluation subset); the last point is the end of the stream, and there is a point at every task
boundary (labelled with the task that just ended).

==================  ==========================================================================
``aaa``             average anytime accuracy AAA = 1/|E| · Σ_{e∈E} (1/(k_e+1) · Σ_{j≤k_e} a_e[j]),
                    E the points after the first sample (Caccia et al., ICLR 2022, "New insights on
                    reducing abrupt representation change in online continual learning", eq. of
                    AAA; the mean accuracy over the tasks seen so far, averaged over the stream).
``min_acc``         min-ACC = 1/(T−1) · Σ_{j<T−1} min_{e: k_e>j} a_e[j]: each earlier task's lowest
                    accuracy at any point after its training ended (De Lange et al., ICLR 2023,
                    "Continual evaluation for lifelong learning: identifying the stability gap",
                    section 3), taken at the end of the stream.
``wc_acc``          WC-Acc = 1/T · a_last[T−1] + (1 − 1/T) · min-ACC (De Lange et al. 2023): the
                    final accuracy on the last task and the worst case of every earlier one.
``gap``             the stability gap per switch into task k ≥ 1 (De Lange et al. 2023, section
                    5: the drop of earlier tasks' accuracy right after a switch, and its recovery):
                    with m_e = mean_{j<k} a_e[j], ``before`` = m at the boundary point, ``min`` =
                    min of m over the points in the first quarter of task k (rounded up; at least
                    the first point after the switch), ``gap`` = before − min, ``at`` = samples
                    after the switch where that minimum was, ``recover`` = samples after the
                    switch until m first regains half the drop (m ≥ min + gap/2 at a later point
                    of task k; 0 when there is no drop; None when it does not within the task),
                    ``end_drop`` = before − m at the end of task k (what the task cost the earlier
                    ones; a gap larger than it is a drop that was recovered). ``gap_mean``,
                    ``gap_min_mean`` (mean of ``min``), ``end_drop_mean``, ``recover_mean`` (over
                    the switches that recovered) and ``not_recovered`` sum it up.
``online_acc``      online accuracy: the share (%) of incoming samples predicted right by the
                    model before it trains on them (Cai et al., ICCV 2021, CLOC, section 3); it
                    rewards fitting the near past and can be gamed by label correlation between
                    consecutive batches (Hammoud et al., ICCV 2023, "Rapid adaptation in online
                    continual learning: are we evaluating it right?"); here batches are drawn
                    i.i.d. within a task, which leaves little correlation to exploit.
==================  ==========================================================================
"""
from __future__ import annotations

import math

import torch

__all__ = ["acc", "bwt", "bwt_over_t", "learning_acc", "forgetting", "fwt", "fwt_over_t", "all_metrics",
           "METRIC_NAMES", "ANYTIME_NAMES", "anytime_metrics", "aaa", "min_acc", "wc_acc", "stability_gap",
           "online_acc", "evaluate", "mean_std", "paired", "accuracy"]

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


# Every summary :func:`anytime_metrics` returns that a table shows, with a short label.
ANYTIME_NAMES = {
    "aaa": "AAA",
    "wc_acc": "WC-Acc",
    "min_acc": "min-ACC",
    "online_acc": "online acc",
    "gap_mean": "stability gap",
}


def _check_record(record: dict) -> tuple:
    s, k, a = record.get("samples"), record.get("task"), record.get("acc")
    if not s or s is None or k is None or a is None or not (len(s) == len(k) == len(a)):
        raise ValueError("an anytime record needs samples, task and acc of the same non-zero length")
    for e, (kk, row) in enumerate(zip(k, a)):
        if len(row) != kk + 1:
            raise ValueError(f"anytime record point {e}: task {kk} needs {kk + 1} accuracies, has {len(row)}")
    if any(b < a_ for a_, b in zip(s, s[1:])):
        raise ValueError("anytime record: samples must not decrease")
    return [int(v) for v in s], [int(v) for v in k], [[float(v) for v in row] for row in a]


def aaa(record: dict) -> float:
    """Average anytime accuracy (Caccia et al. 2022) over the points after the first sample."""
    s, k, a = _check_record(record)
    means = [sum(row) / len(row) for se, row in zip(s, a) if se > 0]
    if not means:
        raise ValueError("anytime record: no point after the first sample")
    return sum(means) / len(means)


def min_acc(record: dict) -> float | None:
    """min-ACC (De Lange et al. 2023) at the end of the stream; None for a single task, or when
    an earlier task has no point after its end."""
    s, k, a = _check_record(record)
    T = k[-1] + 1
    if T == 1:
        return None
    lows = []
    for j in range(T - 1):
        after = [a[e][j] for e in range(len(k)) if k[e] > j]
        if not after:
            return None
        lows.append(min(after))
    return sum(lows) / len(lows)


def wc_acc(record: dict) -> float | None:
    """WC-Acc (De Lange et al. 2023) at the end of the stream: 1/T · the last task's final
    accuracy + (1 − 1/T) · min-ACC (the last task's accuracy alone for one task)."""
    s, k, a = _check_record(record)
    T = k[-1] + 1
    last = a[-1][T - 1]
    if T == 1:
        return last
    low = min_acc(record)
    return None if low is None else last / T + (1 - 1 / T) * low


def stability_gap(record: dict, window: int | None = None) -> list:
    """Per switch into task k ≥ 1: ``{"task", "before", "min", "gap", "at", "recover", "end",
    "end_drop"}`` (module docstring). ``window``: the samples after the switch the minimum is
    looked for in (default: a quarter of the task, rounded up; the first point after the switch
    always counts). A switch with no point during its task is left out."""
    s, k, a = _check_record(record)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of samples, got {window!r}")
    out = []
    for task in range(1, k[-1] + 1):
        prior = [e for e in range(len(k)) if k[e] == task - 1]
        during = [e for e in range(len(k)) if k[e] == task]
        if not prior or not during:
            continue
        b = prior[-1]
        start = s[b]
        w = window if window is not None else -(-(s[during[-1]] - start) // 4)
        before = sum(a[b][:task]) / task
        curve = [sum(a[e][:task]) / task for e in during]
        n_win = max(1, sum(s[e] - start <= w for e in during))
        i_min = min(range(n_win), key=lambda i: curve[i])  # the first point of the minimum
        low = curve[i_min]
        gap = before - low
        recover = None
        if gap <= 0:
            recover = 0
        else:
            for i in range(i_min + 1, len(curve)):
                if curve[i] >= low + gap / 2:
                    recover = s[during[i]] - start
                    break
        out.append({"task": task, "before": before, "min": low, "gap": gap, "at": s[during[i_min]] - start,
                    "recover": recover, "end": curve[-1], "end_drop": before - curve[-1]})
    return out


def online_acc(record: dict) -> float | None:
    """Online accuracy (Cai et al. 2021): % of incoming samples predicted right before training on
    them; None when the record counted none."""
    seen = sum(int(v) for v in record.get("online_seen", []))
    if seen == 0:
        return None
    return 100.0 * sum(int(v) for v in record["online_correct"]) / seen


def anytime_metrics(record: dict) -> dict:
    """Every anytime metric of one run's record: ``aaa``, ``min_acc``, ``wc_acc``, ``online_acc``,
    ``online_acc_per_task``, ``gap`` (per switch, :func:`stability_gap`), ``gap_mean``,
    ``gap_min_mean``, ``end_drop_mean``, ``recover_mean`` and ``not_recovered`` (None where there is no switch)."""
    gaps = stability_gap(record)
    recovered = [g["recover"] for g in gaps if g["recover"] is not None]
    seen = record.get("online_seen", [])
    return {
        "aaa": aaa(record),
        "min_acc": min_acc(record),
        "wc_acc": wc_acc(record),
        "online_acc": online_acc(record),
        "online_acc_per_task": [100.0 * int(c) / int(n) if int(n) else None
                                for c, n in zip(record.get("online_correct", []), seen)],
        "gap": gaps,
        "gap_mean": sum(g["gap"] for g in gaps) / len(gaps) if gaps else None,
        "gap_min_mean": sum(g["min"] for g in gaps) / len(gaps) if gaps else None,
        "end_drop_mean": sum(g["end_drop"] for g in gaps) / len(gaps) if gaps else None,
        "recover_mean": sum(recovered) / len(recovered) if recovered else None,
        "not_recovered": len(gaps) - len(recovered) if gaps else None,
    }


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
