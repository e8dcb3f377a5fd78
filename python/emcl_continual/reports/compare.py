"""``--method all``: every method on one stream, a results table beside the paper's Table III,
and the training-time plot of the paper's Figure 2.

Usage::

    python -m emcl_continual.compare --stream permuted-mnist --seeds 0 1 2 3 4 --out results/permuted-mnist
    python -m emcl_continual.compare --out results/permuted-mnist --table-only   # rebuild table / plot

The folder follows the protocol of :mod:`.rundir` (the main CLI's): runs are appended one
per line to ``OUT/runs.jsonl`` as they finish and the summaries are rewritten after every seed,
so an interrupted sweep resumes where it stopped (finished (method, seed) pairs are skipped;
unlike the main CLI, resuming is the default here: ``--force`` starts over). A folder written
with another configuration is refused. The folder holds ``results.json`` / ``results.csv`` /
the core's plots (via :mod:`.report`), ``comparison.md`` (ours beside Table III) and
``training_time.png`` (Figure 2: every method, same machine, same stream). The CLI's
``--method all`` writes the same two files through :func:`write_comparison`.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time

import torch

from ..core.command import guarded, make_parser
from ..core.errors import CommandInterrupted, Interrupted, OutputError, PlotError
from ..core.fileio import write_atomic
from ..core.metrics import mean_std
from ..core.presets import BATCH_SIZE
from ..data.streams import STREAMS, make_stream
from ..methods import METHODS
from ..output.report import write_results
from ..output.rundir import RunDir, execute, interrupts, load_runs
from ..training.config import build_config, check_seeds
from ..training.train import run

__all__ = ["ALL_METHODS", "PAPER_TABLE_III", "PAPER_NAMES", "comparison_table", "plot_training_time",
           "write_comparison", "run_all", "load_runs", "main"]

# Every method, in the order of :data:`emcl_continual.methods.METHODS` (cheapest first).
ALL_METHODS = list(METHODS)

PAPER_NAMES = {"sgd": "Fine-tune (SGD)", "ewc": "EWC", "gem": "GEM", "agem": "A-GEM", "er": "ER",
               "mer": "MER", "lamaml": "La-MAML", "emcl": "EMCL"}

# The paper's Table III: (ACC, ACC std, BWT, BWT std, reported by La-MAML (the dagger)), in %.
# Fine-tuning and ER are not rows of Table III.
PAPER_TABLE_III = {
    "permuted-mnist": {
        "ewc": (62.32, 1.34, -13.32, 2.24, True),
        "gem": (55.42, 1.10, -24.42, 1.10, True),
        "agem": (56.04, 2.36, -24.05, 2.47, False),
        "mer": (73.46, 0.45, -9.96, 0.45, True),
        "lamaml": (73.92, 1.05, -7.91, 0.87, False),
        "emcl": (73.61, 1.12, -10.25, 0.73, False),
    },
    "many-permutations": {
        "ewc": (33.46, 0.46, -17.84, 1.15, True),
        "gem": (32.14, 0.50, -23.52, 0.87, True),
        "agem": (29.98, 1.84, -27.23, 1.79, False),
        "mer": (47.40, 0.35, -17.78, 0.39, True),
        "lamaml": (47.69, 0.41, -13.24, 0.95, False),
        "emcl": (48.12, 1.48, -14.09, 0.74, False),
    },
    "split-cifar100": {
        "ewc": (39.60, 1.11, -23.53, 1.19, False),
        "gem": (43.41, 2.09, -20.76, 1.31, False),
        "agem": (43.87, 2.61, -23.38, 1.52, False),
        "lamaml": (61.23, 0.94, -19.84, 2.20, False),
        "emcl": (61.95, 1.20, -16.48, 1.96, False),
    },
    "split-miniimagenet": {
        "ewc": (34.34, 2.06, -28.17, 1.49, False),
        "gem": (37.02, 1.91, -25.29, 2.10, False),
        "agem": (36.37, 1.56, -25.11, 2.92, False),
        "lamaml": (45.29, 1.76, -18.57, 2.94, False),
        "emcl": (46.52, 0.83, -17.45, 2.38, False),
    },
}


def _group(runs: list) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault(r["method"], []).append(r)
    return out


def _ordered(methods) -> list:
    known = [m for m in ALL_METHODS if m in methods]
    return known + sorted(m for m in methods if m not in ALL_METHODS)


def comparison_table(runs: list, stream: str) -> str:
    """Markdown: per method, our ACC / BWT (mean +- std over seeds) beside Table III, and the time."""
    paper = PAPER_TABLE_III.get(stream, {})
    groups = _group([r for r in runs if r["stream"] == stream])
    lines = [f"Stream `{stream}`; ours: mean ± std (ddof=1) over seeds; paper: Table III "
             "(† = the paper quotes La-MAML's paper).", "",
             "| method | seeds | ACC ours | ACC paper | ΔACC | BWT ours | BWT paper | train time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for m in _ordered(groups):
        rs = groups[m]
        acc, acc_sd = mean_std([r["acc"] for r in rs])
        bwt, bwt_sd = mean_std([r["bwt"] for r in rs])
        tt, tt_sd = mean_std([r["train_time_s"] for r in rs])
        if m in paper:
            pa, pa_sd, pb, pb_sd, dag = paper[m]
            mark = " †" if dag else ""
            p_acc, p_bwt, delta = f"{pa:.2f} ± {pa_sd:.2f}{mark}", f"{pb:.2f} ± {pb_sd:.2f}{mark}", f"{acc - pa:+.2f}"
        else:
            p_acc = p_bwt = delta = "-"
        lines.append(f"| {PAPER_NAMES.get(m, m)} | {len(rs)} | {acc:.2f} ± {acc_sd:.2f} | {p_acc} | {delta} "
                     f"| {bwt:.2f} ± {bwt_sd:.2f} | {p_bwt} | {tt:.1f} ± {tt_sd:.1f} |")
    machine = {r.get("machine", "") for r in runs if r["stream"] == stream}
    if machine:
        lines += ["", f"Training time: `observe` only, evaluation excluded; machine: {', '.join(sorted(machine))}."]
    return "\n".join(lines)


def plot_training_time(runs: list, stream: str, path: str) -> str:
    """The paper's Figure 2 for one stream: training time per method (mean, std over seeds as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = _group([r for r in runs if r["stream"] == stream])
    methods = _ordered(groups)
    vals = [np.array([r["train_time_s"] for r in groups[m]], dtype=float) for m in methods]
    mu = [v.mean() for v in vals]
    sd = [v.std(ddof=1) if len(v) > 1 else 0.0 for v in vals]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(methods) + 1.6))
    colors = ["C3" if m == "emcl" else "C0" for m in methods]
    ax.barh(range(len(methods)), mu, xerr=sd, capsize=3, color=colors)
    ax.set_yticks(range(len(methods)))
    ax.set_yticklabels([f"{PAPER_NAMES.get(m, m)} ({len(groups[m])})" for m in methods])
    ax.invert_yaxis()
    for i, v in enumerate(mu):
        ax.text(v, i, f" {v:.1f}s", va="center", fontsize=8)
    ax.set_xlabel("training time for the whole stream (s), evaluation excluded")
    machine = sorted({r.get("machine", "") for r in groups.get(methods[0], [])}) if methods else []
    ax.set_title(f"Training time on {stream} ({', '.join(machine)})", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, max(mu) * 1.18 if mu else 1)
    fig.tight_layout()
    from ..output.plots import save_figure

    return save_figure(fig, path)


def write_comparison(runs: list, out_dir: str, stream: str | None = None) -> dict:
    """Write ``comparison.md`` and ``training_time.png`` for ``stream`` (default: the runs' only stream)."""
    streams = sorted({r["stream"] for r in runs})
    if stream is None:
        if len(streams) != 1:
            raise ValueError(f"runs cover streams {streams}; name one")
        stream = streams[0]
    os.makedirs(out_dir, exist_ok=True)
    table = comparison_table(runs, stream)
    write_atomic(os.path.join(out_dir, "comparison.md"), lambda fh: fh.write(table + "\n"))
    fig = plot_training_time(runs, stream, os.path.join(out_dir, "training_time.png"))
    return {"table": table, "figure": fig}


def _identity(stream: str, methods: list, overrides: dict, batch_size: int) -> dict:
    configs = {}
    for m in methods:
        config = build_config(m, stream, 0, (overrides or {}).get(m))
        config.pop("seed")
        configs[m] = config
    return {"stream": stream, "configs": configs,
            "data": {"data_root": None, "task_file": None, "n_tasks": None, "samples_per_task": None,
                     "batch_size": batch_size}}


def run_all(stream: str, seeds: list, out_dir: str, methods: list | None = None, *, overrides: dict | None = None,
            log=print, force: bool = False, command: str | None = None, **run_kwargs) -> list:
    """Run every method (default :data:`ALL_METHODS`) for every seed on ``stream``, resumably.

    Seeds are the outer loop so that a cut-off sweep leaves complete seeds. ``overrides`` maps a
    method name to its hyper-parameter overrides. ``out_dir`` follows :mod:`.rundir`: finished
    (method, seed) pairs in it are skipped (``force``: deleted first), a folder of another
    configuration is refused (:class:`~.rundir.OutputError`). Returns every run in the folder.
    """
    methods = list(methods or ALL_METHODS)
    seeds = check_seeds(list(seeds))
    identity = _identity(stream, methods, overrides, run_kwargs.get("batch_size", BATCH_SIZE))
    command = command or f"python -m emcl_continual.compare --stream {stream} --seeds {' '.join(map(str, seeds))} " \
                         f"--methods {' '.join(methods)} --out {out_dir}"
    out = RunDir(out_dir, identity=identity, plan=[(m, s) for s in seeds for m in methods], command=command,
                 force=force, resume=not force, resume_command=command,
                 extra_summary=("training_time.png", lambda runs, folder: write_comparison(runs, folder, stream)))

    def on_run(r):
        if log is not None:
            log(f"{stream} {r['method']} seed {r['seed']}: ACC {r['acc']:.2f} BWT {r['bwt']:.2f} "
                f"train {r['train_time_s']:.1f}s eval {r['eval_time_s']:.1f}s")

    with out:
        out.open()
        execute(seeds, methods, lambda seed: make_stream(stream, seed),
                lambda m, built, seed: run(m, built, seed, overrides=(overrides or {}).get(m), progress=False,
                                           **run_kwargs),
                out, on_run)
    if out.stale and log is not None:
        log(f"could not write {', '.join(sorted(out.stale))}: {'; '.join(out.stale.values())}")
    return list(out.runs)


def main(argv: list | None = None) -> int:
    """``python -m emcl_continual.compare``; errors are one line on stderr (see :mod:`.cli`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return guarded(lambda: _main(argv), "--debug" in argv)


def _main(argv: list) -> int:
    p = make_parser(prog="python -m emcl_continual.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--stream", default="permuted-mnist", choices=list(STREAMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--methods", nargs="+", default=None, choices=ALL_METHODS, metavar="METHOD",
                   help=f"default: {' '.join(ALL_METHODS)}")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--force", action="store_true", help="delete the earlier results in --out instead of resuming")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--table-only", action="store_true", help="only rebuild the outputs from OUT/runs.jsonl")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error("argument --threads: must be >= 0 (0: torch's choice)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.table_only:
        runs = load_runs(args.out)
        if not runs:
            raise OutputError(f"no runs in {args.out}/runs.jsonl")
        try:
            with open(os.path.join(args.out, "results.json"), encoding="utf-8") as fh:
                earlier = json.load(fh)
        except (OSError, ValueError):
            earlier = {}
        keep = {k: earlier[k] for k in ("status", "command", "identity", "seeds_done", "seeds_pending", "runs_done",
                                        "runs_pending", "resume_command") if k in earlier}
        streams = sorted({r["stream"] for r in runs})
        stale = {}
        for s in streams:
            try:
                print(write_comparison(runs, args.out, s)["table"])
            except Exception as exc:
                stale["training_time.png"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        obj = write_results(runs, args.out, extra=keep, stale=stale)
        return _stale_exit(obj["plot_errors"], args.out)
    started = time.perf_counter()
    command = shlex.join(["python", "-m", "emcl_continual.compare"] + [a for a in argv if a != "--force"])
    try:
        with interrupts():
            runs = run_all(args.stream, args.seeds, args.out, args.methods, force=args.force, command=command)
    except Interrupted as exc:
        n = len(load_runs(args.out)) if os.path.isdir(args.out) else 0
        raise CommandInterrupted(f"{exc.name}: {n} run(s) are saved in {args.out} (results.json status 'partial'); "
                           f"run the same command again to resume: {command}") from None
    print(comparison_table(runs, args.stream))
    print(f"wall time {time.perf_counter() - started:.0f}s on {platform.machine()}")
    with open(os.path.join(args.out, "results.json"), encoding="utf-8") as fh:
        return _stale_exit(json.load(fh).get("plot_errors", {}), args.out)


def _stale_exit(errors: dict, out: str) -> int:
    """0, or 1 after one line on stderr naming the figures that could not be written."""
    if not errors:
        return 0
    raise PlotError(f"could not write {', '.join(sorted(errors))} in {out} ({'; '.join(errors.values())}); "
                    f"results.json and results.csv are up to date and list them under stale_plots")
