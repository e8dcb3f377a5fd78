"""PNG plots of a set of runs: the average accuracy as tasks are learned, and ACC / BWT per method."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from .fileio import write_atomic  # noqa: E402

__all__ = ["plot_avg_accuracy", "plot_acc_bwt", "write_plots", "save_figure"]


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


def write_plots(runs: list, out_dir: str) -> tuple[list, dict]:
    """Both plots into ``out_dir``. Returns the paths written and, for each plot that could not
    be drawn or written, ``{file name: "ErrorType: message"}`` (the other plot is still written;
    the failed one keeps its old file, if any)."""
    os.makedirs(out_dir, exist_ok=True)
    written, errors = [], {}
    for name, plot in (("avg_accuracy.png", plot_avg_accuracy), ("acc_bwt.png", plot_acc_bwt)):
        try:
            written.append(plot(runs, os.path.join(out_dir, name)))
        except Exception as exc:  # one bad plot must not lose the others or the results
            plt.close("all")
            errors[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return written, errors
