"""What anytime evaluation (``--eval-every``) costs, per method, at the presets' K and subset.

    python -m benchmarks anytime                                  # every method, Permuted MNIST prefix
    python -m benchmarks anytime --methods sgd emcl --n-tasks 2 --samples-per-task 200 --out /tmp/x.json

Two measurements, on the CPU with one torch thread:

1. **Per method** (``--methods``, default every method at its selected configuration on
   ``--stream``, from ``results/heldout/STREAM/selected.json``; La-MAML at its own script's values,
   the headline row), on the first ``--n-tasks`` tasks of the stream (default 5 of 20, each
   whole): the run without anytime evaluation and the same run with the stream's preset, in
   alternating order over ``--rounds`` rounds. Reported: the training time of each (``observe``
   only: the two must agree up to noise), the anytime evaluation's own time
   (``anytime_eval_time_s``, timed apart by the evaluator), its ratio to the training time, and
   whether both runs ended with the same accuracy matrix (they must: the evaluation does not
   touch training).
2. **The whole stream** (every task): the anytime evaluation's time, which does not depend on
   the method (the same forward passes of the same model on the same images), from one run of
   plain fine-tuning (``sgd``, the cheapest to train); divided by each method's training time
   of the whole stream, extrapolated from its per-method run above (the same machine in the same
   state), it is the overhead ``--eval-every preset`` adds to that method's run. (The controlled
   times of ``results/efficiency/`` come from a quiet machine and are not mixed with these.)

Writes ``--out`` (default ``benchmarks/results/anytime_cost_cpu.json``) and prints a markdown table.
The tables' efficiency numbers are runs without anytime evaluation and stay so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import torch

from emcl_continual.core import presets
from emcl_continual.training import train
from emcl_continual.methods import METHODS
from emcl_continual.core.provenance import code_version, processor
from emcl_continual.data.streams import make_stream

SEED = presets.REPORT_SEEDS[0]


def selected_overrides(stream: str, results: str) -> dict:
    """method -> the overrides of its headline row (results/heldout/STREAM/selected.json; La-MAML:
    its own script's values)."""
    sel = json.load(open(os.path.join(results, "heldout", stream, "selected.json")))
    out = {m: dict(d["overrides"]) for m, d in sel["methods"].items() if m in METHODS}
    out["lamaml"] = {}
    return out


def per_method(methods, stream_name, overrides, n_tasks, rounds, log) -> list:
    anytime = presets.anytime_preset(stream_name)
    stream = make_stream(stream_name, SEED, n_tasks=n_tasks)
    rows = []
    for m in methods:
        times = {"off": [], "on": []}
        evals, same = [], True
        matrices = {}
        for r in range(rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                kw = dict(eval_every=anytime["every"], eval_subset=anytime["subset"]) if mode == "on" else {}
                res = train.run(m, stream, SEED, overrides=overrides.get(m, {}), progress=False, **kw)
                times[mode].append(res["train_time_s"])
                if mode == "on":
                    evals.append(res["anytime_eval_time_s"])
                if mode in matrices:
                    same &= matrices[mode] == res["acc_matrix"]
                matrices[mode] = res["acc_matrix"]
        same &= matrices["off"] == matrices["on"]
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        ev = sorted(evals)[len(evals) // 2]
        row = {"method": m, "overrides": overrides.get(m, {}), "train_time_s_off": med["off"],
               "train_time_s_on": med["on"], "anytime_eval_time_s": ev, "eval_over_train": ev / med["off"],
               "same_accuracy_matrix": bool(same), "rounds": rounds, "all_train_time_s": times,
               "all_anytime_eval_time_s": evals, "load_avg": os.getloadavg()}
        rows.append(row)
        log(f"{m:7s} train {med['off']:.2f}s off / {med['on']:.2f}s on, anytime eval {ev:.2f}s "
            f"({100 * ev / med['off']:.0f} % of training), same matrix: {same}")
    return rows


def whole_stream(stream_name, log) -> dict:
    anytime = presets.anytime_preset(stream_name)
    stream = make_stream(stream_name, SEED)
    res = train.run("sgd", stream, SEED, progress=False, eval_every=anytime["every"], eval_subset=anytime["subset"])
    n = sum(len(td) for td in stream.train)
    out = {"stream": stream_name, "samples": n, "points": len(res["anytime"]["samples"]),
           "anytime_eval_time_s": res["anytime_eval_time_s"], "end_of_task_eval_time_s": res["eval_time_s"],
           "load_avg": os.getloadavg(), **anytime}
    log(f"{stream_name}: whole stream ({n} samples, {out['points']} points): anytime eval "
        f"{out['anytime_eval_time_s']:.1f}s (the end-of-task evaluation: {out['end_of_task_eval_time_s']:.1f}s)")
    return out


def overhead(whole: dict, result: dict) -> dict:
    """method -> the anytime evaluation's whole-stream time over the method's training time of the
    whole stream, the latter extrapolated from its per-method prefix run of the same benchmark
    (training time per incoming sample times the stream's samples), so that both come from one
    machine in one state; only for the stream the per-method runs were on."""
    if whole["stream"] != result["stream"]:
        return {}
    prefix = result["n_tasks"] * result["samples_per_task"]
    return {r["method"]: whole["anytime_eval_time_s"] / (r["train_time_s_off"] / prefix * whole["samples"])
            for r in result["per_method"] if r["train_time_s_off"] > 0}


def table(result: dict) -> str:
    lines = [f"Per method, {result['n_tasks']} tasks of {result['stream']} (seed {SEED}), preset every "
             f"{result['anytime']['every']} samples on {result['anytime']['subset']} images per task; "
             f"median of {result['rounds']} rounds:", "",
             "| method | train s (off) | train s (on) | anytime eval s | eval / train | same matrix |",
             "|---|---|---|---|---|---|"]
    for r in result["per_method"]:
        lines.append(f"| {r['method']} | {r['train_time_s_off']:.2f} | {r['train_time_s_on']:.2f} | "
                     f"{r['anytime_eval_time_s']:.2f} | {100 * r['eval_over_train']:.0f} % | "
                     f"{'yes' if r['same_accuracy_matrix'] else 'NO'} |")
    for w in result["whole_stream"]:
        lines += ["", f"Whole {w['stream']} ({w['samples']} samples, {w['points']} points): anytime evaluation "
                      f"{w['anytime_eval_time_s']:.1f} s, any method (the end-of-task evaluation: "
                      f"{w['end_of_task_eval_time_s']:.1f} s)."]
        if w.get("overhead"):
            lines.append("Over each method's whole-stream training time (extrapolated from its run above): "
                         + ", ".join(f"{k} {100 * v:.0f} %" for k, v in sorted(w["overhead"].items())) + ".")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks anytime", description=__doc__.split("\n\n")[0])
    p.add_argument("--stream", default="permuted-mnist", choices=sorted(presets.ANYTIME))
    p.add_argument("--whole", nargs="*", default=None, help="streams to time whole (default: --stream)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--n-tasks", type=int, default=5)
    p.add_argument("--samples-per-task", type=int, default=None, help="(tests) shrink each task")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--results", default=os.path.join(ROOT, "results"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "anytime_cost_cpu.json"))
    p.add_argument("--table", default=None, metavar="FILE", help="print the table of a results file (the "
                                                                 "overheads recomputed) and exit")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.table:
        result = json.load(open(args.table))
        for w in result["whole_stream"]:
            w["overhead"] = overhead(w, result)
        print(table(result))
        return 0
    ov = selected_overrides(args.stream, args.results)
    if args.samples_per_task:
        global make_stream
        real = make_stream
        make_stream = lambda name, seed, **kw: real(name, seed, **dict(kw, samples_per_task=args.samples_per_task))  # noqa: E731
    started = time.time()
    rows = per_method(args.methods, args.stream, ov, args.n_tasks, args.rounds, log)
    result = {"stream": args.stream, "n_tasks": args.n_tasks, "seed": SEED, "rounds": args.rounds,
              "samples_per_task": len(make_stream(args.stream, SEED, n_tasks=1).train[0]),
              "anytime": presets.anytime_preset(args.stream), "per_method": rows, "whole_stream": [],
              "machine": f"{platform.machine()} {platform.system()}, 1 torch thread", "processor": processor(),
              "code": code_version(), "wall_s": time.time() - started,
              "note": "the 2-core machine was shared with other engineers' jobs: times are upper bounds"}
    for name in (args.whole if args.whole is not None else [args.stream]):
        w = whole_stream(name, log)
        w["overhead"] = overhead(w, result)
        result["whole_stream"].append(w)
    result["wall_s"] = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(result))
    print(f"wrote {args.out}")
    return 0
