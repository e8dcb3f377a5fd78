"""PNG plots of a set of runs: the average accuracy as tasks are learned, and ACC / BWT per method;
for runs with anytime evaluation, the anytime accuracy along the stream and the stability gap."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from ..core.fileio import write_atomic  # noqa: E402

__all__ = ["plot_avg_accuracy", "plot_acc_bwt", "plot_anytime_accuracy", "plot_stability_gap", "write_plots",
           "save_figure", "ANYTIME_PLOTS"]

# The plots of runs with anytime evaluation, by file name.
ANYTIME_PLOTS = ("anytime_accuracy.png", "stability_gap.png")


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Save ``fig`` as a PNG at ``path`` atomically (temporary file, then rename) and close it."""
    try:
        write_atomic(path, lambda fh: fig.savefig(fh, dpi=dpi, format="png"), binary=True)
    finally:
        plt.close(fig)
    return path


def _groups(runs: list) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault((r["method"], r["stream"]), []).append(r)
    return out


def plot_avg_accuracy(runs: list, path: str) -> str:
    """Mean accuracy over the tasks seen so far, after each task (mean +- std over seeds)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for (method, stream), rs in sorted(_groups(runs).items()):
        curves = np.array([r["avg_acc_curve"] for r in rs], dtype=float)
        mu = curves.mean(0)
        tasks = np.arange(1, len(mu) + 1)
        ax.plot(tasks, mu, marker="o", ms=3, label=f"{method} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
        if len(rs) > 1:
            sd = curves.std(0, ddof=1)
            ax.fill_between(tasks, mu - sd, mu + sd, alpha=0.2)
    streams = sorted({r["stream"] for r in runs})
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("average accuracy over learned tasks (%)")
    ax.set_title(", ".join(streams))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def plot_acc_bwt(runs: list, path: str) -> str:
    """Bars of ACC and BWT per method (mean, with the std over seeds as error bars)."""
    groups = sorted(_groups(runs).items())
    labels = [m if len({s for (_, s), _ in groups}) == 1 else f"{m}\n{s}" for (m, s), _ in groups]
    many = len(groups) > 4
    fig, axes = plt.subplots(1, 2, figsize=(max(6, (0.9 if many else 1.6) * len(groups) + 2), 4 + (1.5 if many else 0)))
    for ax, key, title in zip(axes, ("acc", "bwt"), ("ACC (%)", "BWT (%)")):
        vals = [np.array([r[key] for r in rs], dtype=float) for _, rs in groups]
        mu = [v.mean() for v in vals]
        sd = [v.std(ddof=1) if len(v) > 1 else 0.0 for v in vals]
        ax.bar(range(len(vals)), mu, yerr=sd, capsize=4, color=f"C{0 if key == 'acc' else 3}")
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(labels, rotation=60 if many else 0, ha="right" if many else "center", fontsize=8 if many else 10)
        ax.set_title(title)
        ax.axhline(0, color="k", lw=0.5)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def _anytime_groups(runs: list) -> list:
    """``[(label, [records])]`` of the runs with an anytime record, per (method, stream), all of a
    group on the same points (else ``ValueError``)."""
    out = []
    for (method, stream), rs in sorted(_groups([r for r in runs if r.get("anytime")]).items()):
        recs = [r["anytime"] for r in rs]
        if any(rec["samples"] != recs[0]["samples"] or rec["task"] != recs[0]["task"] for rec in recs):
            raise ValueError(f"{method} on {stream}: the runs' anytime records have different points "
                             f"(another --eval-every or stream length)")
        out.append((f"{method} ({len(rs)} seed{'s' if len(rs) > 1 else ''})", recs))
    if not out:
        raise ValueError("no run has an anytime record (--eval-every)")
    return out


def _switches(ax, rec: dict) -> None:
    for start in rec.get("task_starts", [])[1:]:
        ax.axvline(start, color="0.8", lw=0.5, zorder=0)


def plot_anytime_accuracy(runs: list, path: str) -> str:
    """The mean accuracy over the tasks seen so far at every anytime point, against the samples
    seen (mean over seeds, a band of ± one std), one line per method; grey lines at the switches."""
    fig, ax = plt.subplots(figsize=(8, 4))
    rec0 = None
    for i, (label, recs) in enumerate(_anytime_groups(runs)):
        rec0 = rec0 or recs[0]
        x = np.array(recs[0]["samples"])
        y = np.array([[sum(row) / len(row) for row in rec["acc"]] for rec in recs])
        mu = y.mean(0)
        ax.plot(x, mu, lw=1, color=f"C{i}", label=label)
        if len(recs) > 1:
            sd = y.std(0, ddof=1)
            ax.fill_between(x, mu - sd, mu + sd, color=f"C{i}", alpha=0.15, lw=0)
    _switches(ax, rec0)
    ax.set_xlabel("incoming samples seen")
    ax.set_ylabel("mean accuracy over seen tasks (%)")
    ax.set_title("anytime accuracy, " + ", ".join(sorted({r["stream"] for r in runs if r.get("anytime")})))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def _earlier_mean(rec: dict) -> tuple:
    """(samples, mean accuracy over the tasks before the one being trained) at the points of tasks
    ≥ 1, with the boundary point before each switch; NaN between tasks so a plot breaks there."""
    xs, ys = [], []
    s, k, a = rec["samples"], rec["task"], rec["acc"]
    for task in range(1, k[-1] + 1):
        prior = [e for e in range(len(k)) if k[e] == task - 1]
        during = [e for e in range(len(k)) if k[e] == task]
        if not prior or not during:
            continue
        for e in [prior[-1]] + during:
            xs.append(s[e])
            ys.append(sum(a[e][:task]) / task)
        xs.append(np.nan)
        ys.append(np.nan)
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def _aligned(rec: dict) -> tuple:
    """(samples since the switch, mean over switches of the earlier tasks' mean accuracy minus its
    value at the switch): the switches' offsets in common only."""
    s, k, a = rec["samples"], rec["task"], rec["acc"]
    per_offset: dict = {}
    n_switch = 0
    for task in range(1, k[-1] + 1):
        prior = [e for e in range(len(k)) if k[e] == task - 1]
        during = [e for e in range(len(k)) if k[e] == task]
        if not prior or not during:
            continue
        n_switch += 1
        b = prior[-1]
        before = sum(a[b][:task]) / task
        for e in [b] + during:
            per_offset.setdefault(s[e] - s[b], []).append(sum(a[e][:task]) / task - before)
    keep = sorted(o for o, v in per_offset.items() if len(v) == n_switch)
    return np.array(keep, dtype=float), np.array([np.mean(per_offset[o]) for o in keep])


def plot_stability_gap(runs: list, path: str) -> str:
    """Three panels, one line per method (mean over seeds): the accuracy on task 1 against the
    samples seen; the mean accuracy over the tasks before the one being trained, against the samples
    seen (each task's stretch starts at the point before its switch); and that mean minus its value
    at the switch, against the samples since the switch, averaged over every switch (the stability
    gap's dip and recovery)."""
    groups = _anytime_groups(runs)
    fig, axes = plt.subplots(3, 1, figsize=(9, 10))
    for i, (label, recs) in enumerate(groups):
        c = f"C{i}"
        x = np.array(recs[0]["samples"])
        t1 = np.array([[row[0] for row in rec["acc"]] for rec in recs]).mean(0)
        axes[0].plot(x, t1, lw=1, color=c, label=label)
        ex = _earlier_mean(recs[0])[0]
        ey = np.array([_earlier_mean(rec)[1] for rec in recs]).mean(0)
        axes[1].plot(ex, ey, lw=1, color=c, label=label)
        ax_ = np.array([_aligned(rec)[1] for rec in recs])
        axes[2].plot(_aligned(recs[0])[0], ax_.mean(0), lw=1.2, marker=".", ms=3, color=c, label=label)
    _switches(axes[0], groups[0][1][0])
    _switches(axes[1], groups[0][1][0])
    stream = ", ".join(sorted({r["stream"] for r in runs if r.get("anytime")}))
    axes[0].set_ylabel("accuracy on task 1 (%)")
    axes[0].set_title(f"stability gap, {stream}")
    axes[1].set_ylabel("mean accuracy on earlier tasks (%)")
    for ax in axes[:2]:
        ax.set_xlabel("incoming samples seen")
    axes[2].axhline(0, color="k", lw=0.5)
    axes[2].set_xlabel("incoming samples since the switch")
    axes[2].set_ylabel("earlier tasks' mean accuracy\nminus its value at the switch (pp)")
    axes[2].set_title("around a switch: mean over every switch")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def write_plots(runs: list, out_dir: str) -> tuple[list, dict]:
    """Both plots into ``out_dir`` (and :data:`ANYTIME_PLOTS` when a run has an anytime record). Returns the paths written and, for each plot that could not
    be drawn or written, ``{file name: "ErrorType: message"}`` (the other plot is still written;
    the failed one keeps its old file, if any)."""
    os.makedirs(out_dir, exist_ok=True)
    written, errors = [], {}
    plots = [("avg_accuracy.png", plot_avg_accuracy), ("acc_bwt.png", plot_acc_bwt)]
    if any(r.get("anytime") for r in runs):
        plots += [("anytime_accuracy.png", plot_anytime_accuracy), ("stability_gap.png", plot_stability_gap)]
    for name, plot in plots:
        try:
            written.append(plot(runs, os.path.join(out_dir, name)))
        except Exception as exc:  # one bad plot must not lose the others or the results
            plt.close("all")
            errors[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return written, errors
