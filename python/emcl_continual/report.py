"""Aggregate runs over seeds and write results.json, results.csv and the plots."""
from __future__ import annotations

import csv
import json
import os

from .metrics import mean_std

__all__ = ["summarize", "write_results", "format_table"]


def summarize(runs: list) -> list:
    """One row per (method, stream): mean and std (ddof=1) over seeds of ACC, BWT and times."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["method"], r["stream"]), []).append(r)
    rows = []
    for (method, stream), rs in groups.items():
        row = {"method": method, "stream": stream, "seeds": [r["seed"] for r in rs], "n_seeds": len(rs)}
        for key in ("acc", "bwt", "train_time_s", "eval_time_s"):
            mu, sd = mean_std([r[key] for r in rs])
            row[f"{key}_mean"], row[f"{key}_std"] = mu, sd
        rows.append(row)
    return rows


def format_table(summary: list) -> str:
    """A markdown table of ACC +- std, BWT +- std and training time per method and stream."""
    lines = ["| method | stream | seeds | ACC (%) | BWT (%) | train time (s) | eval time (s) |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['method']} | {s['stream']} | {s['n_seeds']} | {s['acc_mean']:.2f} ± {s['acc_std']:.2f} "
                     f"| {s['bwt_mean']:.2f} ± {s['bwt_std']:.2f} | {s['train_time_s_mean']:.1f} ± "
                     f"{s['train_time_s_std']:.1f} | {s['eval_time_s_mean']:.1f} |")
    return "\n".join(lines)


def write_results(runs: list, out_dir: str, extra: dict | None = None, plots: bool = True) -> dict:
    """Write ``results.json`` (runs and summary), ``results.csv`` (one row per run) and the PNG
    plots into ``out_dir``. Returns the JSON object."""
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(runs)
    obj = {"summary": summary, "runs": runs}
    if extra:
        obj.update(extra)
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(obj, fh, indent=1)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "stream", "seed", "acc", "bwt", "train_time_s", "eval_time_s", "final_accuracies"])
        for r in runs:
            w.writerow([r["method"], r["stream"], r["seed"], f"{r['acc']:.4f}", f"{r['bwt']:.4f}",
                        f"{r['train_time_s']:.3f}", f"{r['eval_time_s']:.3f}",
                        " ".join(f"{a:.2f}" for a in r["acc_matrix"][-1])])
    if plots and runs:
        from .plots import write_plots
        obj["plots"] = write_plots(runs, out_dir)
    return obj
