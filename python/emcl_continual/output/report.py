"""Aggregate runs over seeds and write results.json, results.csv and the plots.

Every file is written atomically (a temporary file in the same folder, flushed to disk, then
renamed over the old one), so a reader, or a run cut off mid-write, sees either the old file
or the new one, never half of one. A plot that cannot be drawn does not stop the others or the
JSON/CSV: it is listed in ``"stale_plots"`` (file names) with the reason in ``"plot_errors"``.
"""
from __future__ import annotations

import csv
import io
import json
import os

from ..core.fileio import write_atomic
from ..core.metrics import mean_std

__all__ = ["summarize", "write_results", "format_table", "write_atomic", "PLOT_FILES"]

# The plots write_results draws, by file name (those of runs with anytime evaluation included).
PLOT_FILES = ("avg_accuracy.png", "acc_bwt.png", "anytime_accuracy.png", "stability_gap.png")


# The anytime metrics summarised over seeds, when every run of a group has them (--eval-every).
ANYTIME_COLUMNS = ("aaa", "wc_acc", "min_acc", "online_acc", "gap_mean", "end_drop_mean")


def summarize(runs: list) -> list:
    """One row per (method, stream): mean and std (ddof=1) over seeds of ACC, BWT and times, and
    of :data:`ANYTIME_COLUMNS` and the anytime evaluation's time when every run has them."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["method"], r["stream"]), []).append(r)
    rows = []
    for (method, stream), rs in groups.items():
        row = {"method": method, "stream": stream, "seeds": [r["seed"] for r in rs], "n_seeds": len(rs)}
        for key in ("acc", "bwt", "train_time_s", "eval_time_s"):
            mu, sd = mean_std([r[key] for r in rs])
            row[f"{key}_mean"], row[f"{key}_std"] = mu, sd
        if all(r.get("anytime_metrics") for r in rs):
            for key in ANYTIME_COLUMNS:
                values = [r["anytime_metrics"].get(key) for r in rs]
                if all(v is not None for v in values):
                    row[f"{key}_mean"], row[f"{key}_std"] = mean_std(values)
            row["anytime_eval_time_s_mean"] = mean_std([r["anytime_eval_time_s"] for r in rs])[0]
        rows.append(row)
    return rows


def format_table(summary: list) -> str:
    """A markdown table of ACC +- std, BWT +- std and training time per method and stream, with
    AAA, WC-Acc and online accuracy (+- std) when a row has them."""
    anytime = any("aaa_mean" in s for s in summary)
    extra = " AAA (%) | WC-Acc (%) | online acc (%) |" if anytime else ""
    lines = ["| method | stream | seeds | ACC (%) | BWT (%) |" + extra + " train time (s) | eval time (s) |",
             "|---|---|---|---|---|" + ("---|" * 3 if anytime else "") + "---|---|"]
    for s in summary:
        cells = ""
        if anytime:
            cells = "".join(f" {s[k + '_mean']:.2f} ± {s[k + '_std']:.2f} |" if k + "_mean" in s else " – |"
                            for k in ("aaa", "wc_acc", "online_acc"))
        lines.append(f"| {s['method']} | {s['stream']} | {s['n_seeds']} | {s['acc_mean']:.2f} ± {s['acc_std']:.2f} "
                     f"| {s['bwt_mean']:.2f} ± {s['bwt_std']:.2f} |{cells} {s['train_time_s_mean']:.1f} ± "
                     f"{s['train_time_s_std']:.1f} | {s['eval_time_s_mean']:.1f} |")
    return "\n".join(lines)


def _csv_text(runs: list) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    anytime = any(r.get("anytime_metrics") for r in runs)
    w.writerow(["method", "stream", "seed", "acc", "bwt", "train_time_s", "eval_time_s", "final_accuracies"]
               + (list(ANYTIME_COLUMNS) + ["anytime_eval_time_s"] if anytime else []))
    for r in runs:
        m = r.get("anytime_metrics") or {}
        w.writerow([r["method"], r["stream"], r["seed"], f"{r['acc']:.4f}", f"{r['bwt']:.4f}",
                    f"{r['train_time_s']:.3f}", f"{r['eval_time_s']:.3f}",
                    " ".join(f"{a:.2f}" for a in r["acc_matrix"][-1])]
                   + ([("" if m.get(k) is None else f"{m[k]:.4f}") for k in ANYTIME_COLUMNS]
                      + [f"{r['anytime_eval_time_s']:.3f}" if m else ""] if anytime else []))
    return buf.getvalue()


def write_results(runs: list, out_dir: str, extra: dict | None = None, plots: bool = True,
                  stale: dict | None = None) -> dict:
    """Write ``results.csv`` (one row per run), the PNG plots and ``results.json`` (runs,
    summary, ``extra``) into ``out_dir``, each atomically. ``results.json`` lists the plots that
    could not be drawn in ``"stale_plots"`` (file names; with ``"plot_errors"``: file -> reason),
    those of ``stale`` (other figures the caller failed to write) included. Returns the JSON
    object."""
    os.makedirs(out_dir, exist_ok=True)
    obj = dict(extra or {})
    obj["summary"] = summarize(runs)
    errors = dict(stale or {})
    write_atomic(os.path.join(out_dir, "results.csv"), lambda fh: fh.write(_csv_text(runs)))
    if plots and runs:
        from .plots import write_plots

        written, plot_errors = write_plots(runs, out_dir)
        obj["plots"] = written
        errors.update(plot_errors)
    obj["stale_plots"], obj["plot_errors"] = sorted(errors), errors
    obj["runs"] = runs
    text = json.dumps(obj, indent=1)
    write_atomic(os.path.join(out_dir, "results.json"), lambda fh: fh.write(text))
    return obj
