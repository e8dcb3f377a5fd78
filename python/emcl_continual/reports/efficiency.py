"""Efficiency like for like: each held-out row's ACC against its controlled training time and cost.

Inputs: ``results/efficiency/controlled_cpu.json``, written by
``python -m benchmarks training --heldout results/heldout ...`` (every report row of each
stream trained on the stream's first tasks at its reported configuration, in interleaved rounds
with one torch thread, plus one counted pass: forward passes, backward passes and weight updates
per incoming sample), and the held-out files of each stream (the ACC of the report rows, and the
sweeps' own wall-clock times for comparison).

Outputs, rebuilt by ``python -m emcl_continual.tables``: per stream a Pareto figure
``results/efficiency/STREAM.png`` (ACC against time per 1,000 samples, and against the forward
and backward passes per sample) and the table beside it in ``results/efficiency/README.md``; the
block ``STREAM/efficiency`` for the pages with generated blocks (:func:`stream_blocks`); and :func:`controlled_time`,
which the tables' time columns read.
"""
from __future__ import annotations

import json
import os

__all__ = ["CONTROLLED_FILE", "WHOLE_STREAM_FILE", "load_controlled", "controlled_time", "pareto_front",
           "efficiency_table", "whole_stream_note", "plot_pareto", "efficiency_page", "stream_blocks",
           "write_outputs"]

CONTROLLED_FILE = os.path.join("efficiency", "controlled_cpu.json")  # under the results folder
# optional: rows whose cost grows with the tasks seen (GEM) run over the whole stream, same format
WHOLE_STREAM_FILE = os.path.join("efficiency", "whole_stream_cpu.json")


def load_controlled(results_dir: str, name: str = CONTROLLED_FILE) -> dict | None:
    """The controlled benchmark's results file ``name`` under ``results_dir``, or None when there
    is none."""
    path = os.path.join(results_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        data = json.load(fh)
    if data.get("schema") != "emcl-kernels/bench_training/heldout/1":
        raise ValueError(f"{path}: not a `bench_training.py --heldout` results file (schema {data.get('schema')!r})")
    return data


def _summary_row(controlled: dict | None, stream: str, name: str) -> dict | None:
    """The summary of row ``name`` on ``stream`` (also when it was timed under another name with
    the same configuration, ``same_as``), or None."""
    if not controlled:
        return None
    for s in controlled["summary"]:
        if s["stream"] == stream and (s["row"] == name or name in s.get("same_as", [])):
            return s
    return None


def controlled_time(controlled: dict | None, stream: str, name: str) -> float | None:
    """Seconds per 1,000 incoming samples of row ``name`` (median over the rounds), or None."""
    s = _summary_row(controlled, stream, name)
    return None if s is None else s["ms_per_sample"]


def pareto_front(points: list) -> set:
    """Indices of the points (cost, acc) that no other point beats: none is at most as costly
    and at least as accurate while strictly better in one of the two."""
    out = set()
    for i, (c, a) in enumerate(points):
        if not any((c2 <= c and a2 >= a) and (c2 < c or a2 > a) for j, (c2, a2) in enumerate(points) if j != i):
            out.add(i)
    return out


def _rows(sr, controlled: dict) -> list:
    """Each timed row of stream ``sr`` with its report ACC (mean, std over seeds), its
    controlled time and counts, and the sweeps' wall-clock mean."""
    out = []
    for s in controlled["summary"]:
        if s["stream"] != sr.stream:
            continue
        names = [s["row"]] + list(s.get("same_as", []))
        runs = sr.runs(s["row"])
        if not runs:
            continue
        st = sr.stats_of(runs)
        out.append({"row": s["row"], "names": names, "visits": sr.visits_of(runs[0]), "seeds": len(runs),
                    "acc": st["acc"], "sweep_time": st["train_time_s"], "summary": s})
    emcl = next((r for r in out if r["row"] == "emcl"), None)
    for r in out:
        r["vs_emcl"] = r["summary"]["ms_per_sample"] / emcl["summary"]["ms_per_sample"] if emcl else None
    front = pareto_front([(r["summary"]["ms_per_sample"], r["acc"][0]) for r in out])
    for i, r in enumerate(out):
        r["pareto"] = i in front
    return out


def efficiency_table(sr, controlled: dict) -> str:
    """The markdown table of one stream: ACC, controlled time, its ratio to EMCL's, the counted
    cost per incoming sample, whether the row is on the Pareto front, and the sweeps' time."""
    rows = _rows(sr, controlled)
    if not rows:
        return ""
    lines = ["| row | visits per sample | ACC (report seeds) | s per 1,000 samples (median; min–max) | "
             "× EMCL | CPU s per 1,000 | forward / backward passes per sample | weight updates per sample | "
             "on the time's Pareto front | sweep wall-clock, full stream (s, uncontrolled) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, c = r["summary"], r["summary"]["counts"]
        n = c["incoming_samples"]
        lo, hi = 1e3 * s["train_time_s_min"] / n, 1e3 * s["train_time_s_max"] / n
        name = " = ".join(f"`{x}`" for x in r["names"])
        bold = "**" if r["row"] == "emcl" else ""
        mu, sd = r["acc"]
        lines.append(f"| {bold}{name}{bold} | {r['visits']} | {mu:.2f} ± {sd:.2f} | {s['ms_per_sample']:.2f} "
                     f"({lo:.2f}–{hi:.2f}) | {r['vs_emcl']:.2f} | {s['cpu_ms_per_sample']:.2f} | "
                     f"{c['forward_per_sample']:.1f} / {c['backward_per_sample']:.1f} | "
                     f"{c['updates_per_sample']:.2f} | {'yes' if r['pareto'] else ''} | "
                     f"{r['sweep_time'][0]:.0f} ± {r['sweep_time'][1]:.0f} |")
    return "\n".join(lines)


def whole_stream_note(whole: dict | None, stream: str) -> str:
    """One sentence per row of the whole-stream file on ``stream``: its time and counts over
    every task (GEM's cost grows with the tasks seen, so the first tasks understate it)."""
    if not whole:
        return ""
    out = []
    for s in whole["summary"]:
        if s["stream"] != stream:
            continue
        c, ps = s["counts"], whole["settings"]["per_stream"][stream]
        out.append(f"`{s['row']}` over the whole stream ({ps['n_tasks_timed']} tasks, {c['incoming_samples']:,} "
                   f"samples; `results/{WHOLE_STREAM_FILE}`, {s['rounds']} timed round(s), not interleaved with the rows "
                   f"above): {s['ms_per_sample']:.2f} s per 1,000 samples (CPU {s['cpu_ms_per_sample']:.2f}), "
                   f"{c['forward_per_sample']:.1f} forward / {c['backward_per_sample']:.1f} backward passes per sample.")
    return " ".join(out)


def plot_pareto(sr, controlled: dict, path: str) -> str | None:
    """Two panels: report ACC (mean ± std over seeds) against the controlled seconds per 1,000
    samples and against the forward + backward passes per sample (log axes), the Pareto front
    of the first drawn as a step line; EMCL's rows in red. Returns the path, or None."""
    from ..output.plots import plt, save_figure

    rows = _rows(sr, controlled)
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    xs_sets = [[r["summary"]["ms_per_sample"] for r in rows],
               [r["summary"]["counts"]["forward_per_sample"] + r["summary"]["counts"]["backward_per_sample"]
                for r in rows]]
    labels = ["training time, s per 1,000 incoming samples (CPU, 1 thread)",
              "forward + backward passes per incoming sample (counted)"]
    for ax, xs, xlabel in zip(axes, xs_sets, labels):
        front = sorted((xs[i], rows[i]["acc"][0]) for i in pareto_front([(x, r["acc"][0]) for x, r in zip(xs, rows)]))
        if front:
            fx = [front[0][0]] + [p[0] for p in front[1:] for _ in (0, 1)]
            fy = [p[1] for p in front[:-1] for _ in (0, 1)] + [front[-1][1]]
            ax.plot(fx, fy, color="0.6", lw=1, ls="--", zorder=1, label="Pareto front")
        for x, r in zip(xs, rows):
            color = "C3" if r["row"].startswith("emcl") else "C0"
            ax.errorbar(x, r["acc"][0], yerr=r["acc"][1], fmt="o", color=color, ms=5, capsize=2, zorder=2)
            ax.annotate(" = ".join(r["names"]), (x, r["acc"][0]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.margins(x=0.15)
    axes[0].set_ylabel("ACC, report seeds (%)")
    axes[0].legend(fontsize=8, loc="lower right")
    ps = controlled["settings"]["per_stream"][sr.stream]
    fig.suptitle(f"{sr.stream}: held-out ACC against controlled training time and counted cost "
                 f"({ps['n_tasks_timed']} of {ps['n_tasks_stream']} tasks timed, "
                 f"{controlled['settings']['rounds']} interleaved rounds)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def _machine_lines(controlled: dict) -> list:
    m, st = controlled["machine"], controlled["settings"]
    loads = [r["load_average"][0] for r in controlled["records"] if r.get("load_average")]
    per = "; ".join(f"{k}: first {v['n_tasks_timed']} of {v['n_tasks_stream']} tasks "
                    f"({v['n_tasks_timed'] * v['samples_per_task']:,} samples), seed {v['seed']}"
                    for k, v in st["per_stream"].items())
    return [f"- Command: `{controlled['command']}` ({controlled['created_utc']}, commit "
            f"{(m.get('git_commit') or '?')[:10]}, {controlled['wall_time_s'] / 60:.0f} min).",
            f"- Machine: {m['summary']}; torch {m['torch']}, CPU capability `{m.get('cpu_capability')}`; "
            f"{st['threads']} torch thread; this benchmark at nice {m.get('nice')}"
            + (f" ({controlled['note']})." if controlled.get("note") else "."),
            f"- Load average (1, 5, 15 min): {m.get('load_average_before')} before, "
            f"{m.get('load_average_after')} after; 1-min load during the timed rounds "
            f"{min(loads):.1f}–{max(loads):.1f}." if loads else "- Load average: not recorded.",
            f"- Runs: {per}; batch {st['batch_size']}; {st['rounds']} timed rounds, every row once per "
            "round, odd rounds in reverse order; the time is the median over the rounds of the "
            "training calls (`begin_task`, `observe`, `end_task`; no evaluation), as `train.run` times them; "
            "the counts come from one more pass with the counting hooks (`CostCounter`, not timed)."]


def efficiency_page(results_dir: str, controlled: dict, streams: dict, whole: dict | None = None) -> str:
    """``results/efficiency/README.md``: the machine, then per stream the figure and the table."""
    parts = ["# Efficiency like for like: held-out ACC against controlled training time and cost", "",
             "Generated by `python -m emcl_continual.tables` from `controlled_cpu.json` (this folder) and "
             "`results/heldout/STREAM/`; do not edit. These files live beside the held-out results "
             "rather than under `benchmarks/results/` because they are read by the results tables (the "
             "time columns of `results/heldout/*/tables.md`, README.md and docs/results.md) and joined "
             "with the held-out ACC.", "",
             "Each row is trained at the configuration of its report row (the one whose ACC the table "
             "gives) on the first tasks of the stream, timed on one CPU core in interleaved rounds; the "
             "ratios between rows are what carries to another machine. The counts are machine-independent: "
             "samples through the network's forward and backward per incoming sample (a batch of 20 counts "
             "20), and how many times the weights the network computes with change (an optimizer step, "
             "an inner step, MER's per-sample step, a new set of La-MAML's fast weights). "
             "`python/emcl_continual/training/cost.py` (`CostCounter`) says how each is counted.", "",
             "The ACC of the EMCL rows comes from the sweeps at commit d664e6e; the time from the current kernels, "
             "which compute the same update (docs/results.md, \"One code version\"). GEM's cost grows with the "
             "number of tasks seen (one memory gradient per earlier task): over the first tasks it is "
             "below its full-stream cost.", "", "## Machine and protocol", ""] + _machine_lines(controlled) + [""]
    for stream, sr in streams.items():
        table = efficiency_table(sr, controlled)
        if not table:
            continue
        parts += [f"## {stream}", "", f"![ACC against training time and cost]({stream}.png)", "", table, ""]
        note = whole_stream_note(whole, stream)
        if note:
            parts += [note, ""]
    return "\n".join(parts)


def results_dir_of(folder: str) -> str:
    """The results folder of a stream's held-out folder (``RESULTS/heldout/STREAM``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(folder)))


def stream_blocks(sr) -> dict:
    """``STREAM/efficiency`` of one stream (:class:`emcl_continual.reports.tables.StreamResults`): its
    table and the whole-stream sentence (:func:`whole_stream_note`); empty without the
    controlled file."""
    if not sr.controlled:
        return {}
    note = whole_stream_note(load_controlled(results_dir_of(sr.folder), WHOLE_STREAM_FILE), sr.stream)
    table = efficiency_table(sr, sr.controlled)
    return {f"{sr.stream}/efficiency": table + (f"\n\n{note}" if note and table else "")}


def write_outputs(results_dir: str, controlled: dict | None, streams: dict, figures: bool = True) -> dict:
    """The page (path -> text) to write, after drawing the figures when ``figures``; the page adds
    the whole-stream file's rows (:data:`WHOLE_STREAM_FILE`) where there is one."""
    if not controlled:
        return {}
    folder = os.path.join(results_dir, "efficiency")
    timed = {s: streams[s] for s in controlled["settings"]["streams"] if s in streams}
    if figures:
        for s, sr in timed.items():
            plot_pareto(sr, controlled, os.path.join(folder, f"{s}.png"))
    whole = load_controlled(results_dir, WHOLE_STREAM_FILE)
    return {os.path.join(folder, "README.md"): efficiency_page(results_dir, controlled, timed, whole)}
