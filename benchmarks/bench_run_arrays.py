"""Run arrays' throughput: run-samples per second against the array width, per method, on one
CPU thread or on a GPU (the curves ``--array auto`` reads). The runs, the timer and the file
(written after every method): benchmarks/README.md, ``run-arrays``.

    python -m benchmarks run-arrays --methods mer lamaml --widths 1 2 4 8
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch
from threadpoolctl import threadpool_limits

from benchmarks import common, harness, timing

from emcl_continual import arrays
from emcl_continual.arrays.base import stack_weights
from emcl_continual.data.models import build_model
from emcl_continual.data.streams import make_stream
from emcl_continual.methods import get_method
from emcl_continual.training.config import build_config

SCHEMA = "emcl-kernels/bench_run_arrays/2"
STREAM, BS = "permuted-mnist", 10
#: batches timed per block and method (the slow methods take ~100 one-sample steps per incoming sample)
BATCHES = {"sgd": 40, "ewc": 40, "agem": 40, "er": 40, "gem": 20, "lamaml": 3, "mer": 3, "emcl": 40}
TIMERS = {"cpu": "process CPU time (time.process_time), one thread",
          "cuda": "wall clock, the device synchronised before and after each block "
                  "(benchmarks.timing.time_once)"}


def _data(width: int, warm: int, batches: int) -> tuple:
    """Seeds ``0 .. width-1``: each one's first ``warm`` batches of task 0 and first ``batches``
    of task 1, stacked (``[width, n, 784]``), and the stream's info with Permuted MNIST's 20 tasks
    (A-GEM's and GEM's memories are sized by it); an array of ``w`` runs takes the first ``w``."""
    streams = [make_stream(STREAM, s, n_tasks=2, samples_per_task=max(warm, batches) * BS)
               for s in range(width)]

    def stacked(task, n):
        return tuple(torch.stack([getattr(st.train[task], k)[:n] for st in streams]) for k in "xy")
    return stacked(0, warm * BS), stacked(1, batches * BS), dataclasses.replace(streams[0].info, n_tasks=20)


def _stepper(learner, warm_data, timed_data, warm: int):
    """Train ``learner`` ``warm`` batches of task 0, end it and begin task 1; return a step that
    trains the next batch of ``timed_data`` (a run's [n, 784], an array's [width, n, 784])."""
    (wx, wy), (x, y) = warm_data, timed_data
    learner.begin_task(0)
    for b in range(warm):
        learner.observe(wx.narrow(-2, b * BS, BS), wy.narrow(-1, b * BS, BS), 0)
    learner.end_task(0)
    learner.begin_task(1)
    pos = [0]

    def step():
        b = pos[0] % (y.shape[-1] // BS)
        learner.observe(x.narrow(-2, b * BS, BS), y.narrow(-1, b * BS, BS), 1)
        pos[0] += 1
    return step


def measure(method: str, widths: list, data: tuple, warm: int, batches: int, repeats: int,
            device: torch.device, log=print) -> dict:
    """The run alone and arrays of ``widths`` of ``method`` (``data``: :func:`_data` for the
    widest), trained ``warm`` batches on task 0, timed on task 1, each width's blocks
    alternating with the run alone's; a width out of memory is a row with its error, the wider
    ones are not tried."""
    warm_data, (x, y), info = data
    data = (warm_data, (x[:, :batches * repeats * BS], y[:, :batches * repeats * BS]), info)
    torch.manual_seed(0)
    learner = get_method(method)(build_model(info).to(device), info,
                                 build_config(method, STREAM, 0, {}), device)
    alone = _stepper(learner, *([t[0].to(device) for t in d] for d in data[:2]), warm)
    rows = []
    for w in widths:
        try:
            rows.append(_width(method, w, data, warm, batches, repeats, device, alone))
        except Exception as exc:  # noqa: BLE001 - only running out of memory is a result
            if not (isinstance(exc, (torch.OutOfMemoryError, MemoryError))
                    or "out of memory" in str(exc).lower()):
                raise
            rows.append({"width": w, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"})
            log(f"{method:7s} width {w:3d}: out of memory on {device}; the wider arrays are not tried")
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = rows[-1]
        log(f"{method:7s} width {w:3d} {r['run_samples_per_s']:9.1f} run-samples/s, "
            f"alone {r['alone_run_samples_per_s']:9.1f}: x{r['speedup']:.2f}")
    return {"method": method, "batches": batches, "warm": warm, "repeats": repeats, "rows": rows}


def _width(method, w, data, warm, batches, repeats, device, alone) -> dict:
    """One row of :func:`measure`: an array of ``w`` runs, timed against the step ``alone``."""
    warm_data, timed_data, info = data
    models = []
    for s in range(w):
        torch.manual_seed(s)
        models.append(build_model(info).to(device))
    arr = arrays.get_learner(method)(stack_weights(models), info,
                                     [build_config(method, STREAM, s, {}) for s in range(w)], device)
    steps = {"alone": alone, "array": _stepper(arr, *([t[:w].to(device) for t in d]
                                                      for d in (warm_data, timed_data)), warm)}
    clock = time.process_time if device.type == "cpu" else time.perf_counter    # TIMERS

    def block(k, _):
        def go():
            for _ in range(batches):
                steps[k]()
        return timing.time_once(go, device, clock)
    secs = harness.interleave(list(steps), repeats, block)
    t_alone, t_array = (min(t for _, _, k, t in secs if k == key) for key in steps)
    base, rate = BS * batches / t_alone, w * BS * batches / t_array
    return {"width": w, "alone_seconds": t_alone, "array_seconds": t_array,
            "alone_run_samples_per_s": base, "run_samples_per_s": rate, "speedup": rate / base}


def plot(result: dict, path: str) -> None:
    """Run-samples per second against width, per method (log-log), the run alone as a dashed
    line; and the speed-up over the run alone."""
    title = (f"Run arrays, Permuted MNIST MLP, {result['device']} ({result['device_name']}; "
             f"{result['timer']})")
    with harness.figure(path, title, ncols=2, size=(11, 4.2), title_size=8, dpi=120) as axes:
        rates, speedups = axes[0]
        for res in result["methods"]:
            arr = [r for r in res["rows"] if "error" not in r]
            widths = [r["width"] for r in arr]
            line, = rates.plot(widths, [r["run_samples_per_s"] for r in arr], "o-",
                               label=res["method"])
            rates.plot(widths, [r["alone_run_samples_per_s"] for r in arr], "--",
                       color=line.get_color(), lw=0.8)
            speedups.plot(widths, [r["speedup"] for r in arr], "o-", label=res["method"])
        for ax in axes[0]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("array width (runs trained together)")
            ax.grid(alpha=0.3)
        rates.set_yscale("log")
        rates.set_ylabel("run-samples per second (dashed: the run alone)")
        speedups.axhline(1.0, color="k", lw=0.8)
        speedups.set_ylabel("over the run alone")
        speedups.legend(fontsize=8)


def table(result: dict) -> str:
    rows = [(m["method"], r["width"], r.get("run_samples_per_s"), r.get("alone_run_samples_per_s"),
             r.get("speedup"), r.get("error"))
            for m in result["methods"] for r in m["rows"]]
    return harness.table(["method", "width", "run-samples/s", "alone", "speedup", "error"], rows,
                         title=f"run arrays on {result['device']} ({result['timer']})")


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results (also written to ``--out``)."""
    p = harness.parser("run-arrays", __doc__, "device", "threads", "out", "name", "note", "quick",
                       "plot", device="cpu", threads=1, out=os.path.join(common.REPO, "results", "arrays"),
                       quick="a quarter of the timed batches (at least 2) and one repeat")
    p.add_argument("--methods", nargs="+", default=list(arrays.ARRAY_LEARNERS),
                   choices=list(arrays.ARRAY_LEARNERS))
    p.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--warm", type=int, default=3, help="batches of the first task trained before timing")
    p.add_argument("--repeats", type=int, default=2, help="timed blocks of each, the fastest kept")
    args = p.parse_args(argv)
    device = harness.device_of(args.device)
    if any(w < 1 for w in args.widths):
        raise SystemExit(f"run-arrays: --widths must be positive, got {args.widths}")
    batches = {m: max(2, BATCHES[m] // 4) if args.quick else BATCHES[m] for m in args.methods}
    repeats = 1 if args.quick else args.repeats
    stem = args.name or f"throughput_{device.type}"
    threadpool_limits(limits=1)     # MER's NumPy stepper: BLAS on one thread too
    with harness.threads(args.threads):
        result = harness.head("run-arrays", argv, device, schema=SCHEMA, note=args.note)
        result.update(timer=TIMERS[device.type], threads=torch.get_num_threads(), stream=STREAM,
                      batch_size=BS, widths=args.widths, methods=[])
        data = _data(max(args.widths), args.warm, max(batches.values()) * repeats)
        for m in args.methods:
            result["methods"].append(measure(m, args.widths, data, args.warm, batches[m], repeats, device))
            result["load_average_after"] = common.load_average()
            harness.save(result, os.path.join(args.out, stem + ".json"))
    return harness.finish(result, args.out, stem, plot=plot, no_plot=args.no_plot, table=table)
