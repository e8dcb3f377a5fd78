"""Run arrays' throughput: run-samples per second against the array width, per method, on one
thread (the curve ``--array auto`` reads, and where the CPU's roof is).

    python -m benchmarks run-arrays                                         # every array method, widths 1..32
    python -m benchmarks run-arrays --methods mer lamaml --widths 1 2 4 8
    python -m benchmarks run-arrays --plot results/arrays/throughput_cpu.json   # the figure only
    python -m benchmarks run-arrays --methods lamaml mer --out /tmp/t.json --merge results/arrays/throughput_cpu.json
    python -m benchmarks run-arrays --roof --methods lamaml mer --widths 1 4 8 16     # the roof, profiled steps

For each method: the run alone (the method's own ``observe``, as ``train.run`` steps it; MER with
its NumPy stepper, EMCL with its fused glance) and arrays of each width (:mod:`emcl_continual.arrays`), each run of an array
with its own seed and the method's default configuration, on Permuted-MNIST batches (the
embedded digits). Each first trains ``--warm`` batches of the first task (the memories fill,
lazy work is done, the task is consolidated: EWC's penalty, A-GEM's reference gradient and GEM's
projection are in the timed steps), then batches of the second task are timed in process CPU
time (``time.process_time``: on a shared machine the time other processes take from this one is
not counted; their cache and memory-bandwidth pressure still is), the run alone's block and the
array's alternating ``--repeats`` times, the fastest of each kept. ``run_samples_per_s`` =
width x samples / time; ``speedup`` is that over the run alone timed beside it.

Writes ``results/arrays/throughput_cpu.json`` (``--out``) and its figure ``.png`` beside it.

``--roof`` measures instead where the arithmetic's roof is and where a method's array step stands
against it (``results/arrays/roof_cpu.json``): the single-precision GFLOP/s of the batched
products at the MLP's shapes, per width, on one thread; and, per method and width, one array step
profiled by ``torch.profiler``: its time in matrix products (with their FLOPs, hence the
achieved GFLOP/s), in elementwise passes over first-layer-sized tensors, in every other op, and
outside the ops (Python, dispatch), beside the step's time unprofiled.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from emcl_continual import arrays  # noqa: E402
from emcl_continual.training.config import build_config  # noqa: E402
from emcl_continual.methods import get_method  # noqa: E402
from emcl_continual.data.models import build_model  # noqa: E402
from emcl_continual.core.provenance import code_version, processor  # noqa: E402
from emcl_continual.data.streams import make_stream  # noqa: E402

STREAM = "permuted-mnist"
#: batches timed per method (the slow methods take ~100 one-sample steps per incoming sample)
BATCHES = {"sgd": 40, "ewc": 40, "agem": 40, "er": 40, "gem": 20, "lamaml": 3, "mer": 3, "emcl": 40}


def _data(seeds: list, warm: int, batches: int, bs: int = 10):
    """Each seed's first ``warm`` batches of task 0 and first ``batches`` batches of task 1, stacked
    (``[N, n, 784]``), and the stream's info with Permuted MNIST's 20 tasks (the per-task memories
    of A-GEM and GEM are sized by it)."""
    streams = [make_stream(STREAM, s, n_tasks=2, samples_per_task=max(warm, batches) * bs) for s in seeds]
    w, n = warm * bs, batches * bs
    info = dataclasses.replace(streams[0].info, n_tasks=20)
    return ((torch.stack([st.train[0].x[:w] for st in streams]), torch.stack([st.train[0].y[:w] for st in streams])),
            (torch.stack([st.train[1].x[:n] for st in streams]), torch.stack([st.train[1].y[:n] for st in streams])),
            info)


def _block(step, n_batches: int) -> float:
    t0 = time.process_time()
    for b in range(n_batches):
        step(b)
    return time.process_time() - t0


def measure(method: str, widths: list, warm: int, batches: int, repeats: int, bs: int = 10) -> dict:
    """The run alone and arrays of ``widths`` for ``method``, trained ``warm`` batches on task 0
    (then ``end_task(0)``), timed on task 1 (so that EWC's penalty, A-GEM's reference gradient
    and GEM's projection are in the step). For each width the run alone's block and the array's
    block alternate ``repeats`` times and the fastest of each is kept (on a shared machine the
    load changes between widths: each speedup is against the run alone timed beside it)."""
    cls = get_method(method)
    lcls = arrays.get_learner(method)
    (w0x, w0y), (t1x, t1y), info = _data([0], warm, batches * repeats, bs)
    torch.manual_seed(0)
    learner = cls(build_model(info), info, build_config(method, STREAM, 0, {}), "cpu")
    learner.begin_task(0)
    for b in range(warm):
        learner.observe(w0x[0, b * bs:(b + 1) * bs], w0y[0, b * bs:(b + 1) * bs], 0)
    learner.end_task(0)
    learner.begin_task(1)
    apos = [0]

    def alone_step(_):
        b = apos[0] % (batches * repeats)
        learner.observe(t1x[0, b * bs:(b + 1) * bs], t1y[0, b * bs:(b + 1) * bs], 1)
        apos[0] += 1
    rows = []
    for w in widths:
        (wx, wy), (xs, ys), _ = _data(list(range(w)), warm, batches * repeats, bs)
        models = []
        for s in range(w):
            torch.manual_seed(s)
            models.append(build_model(info))
        weights = [torch.stack([p.detach() for p in ps]).requires_grad_(True)
                   for ps in zip(*[list(m.parameters()) for m in models])]
        arr = lcls(weights, info, [build_config(method, STREAM, s, {}) for s in range(w)], "cpu")
        arr.begin_task(0)
        for b in range(warm):
            arr.observe(wx[:, b * bs:(b + 1) * bs], wy[:, b * bs:(b + 1) * bs], 0)
        arr.end_task(0)
        arr.begin_task(1)
        pos = [0]

        def array_step(_):
            b = pos[0]
            arr.observe(xs[:, b * bs:(b + 1) * bs], ys[:, b * bs:(b + 1) * bs], 1)
            pos[0] += 1
        t_alone, t_array = float("inf"), float("inf")
        for _ in range(repeats):
            t_alone = min(t_alone, _block(alone_step, batches))
            t_array = min(t_array, _block(array_step, batches))
        base = bs * batches / t_alone
        rate = w * bs * batches / t_array
        rows.append({"width": w, "alone_seconds": t_alone, "array_seconds": t_array,
                     "alone_run_samples_per_s": base, "run_samples_per_s": rate, "speedup": rate / base})
        print(f"{method:7s} width {w:3d} {rate:9.1f} run-samples/s, alone {base:9.1f}: x{rate / base:.2f}", flush=True)
    return {"method": method, "batches": batches, "warm": warm, "repeats": repeats, "rows": rows}


#: the batched products of the MLP's first layer (784 inputs, 100 units) in the array steps: per
#: run ``(rows, inner, cols)`` of ``[rows, inner] @ [inner, cols]``; La-MAML's are named by
#: arrays/lamaml.py's note, MER's by arrays/mer.py's
ROOF_SHAPES = {"meta forward, 20 rows (P; La-MAML per inner step before)": (20, 784, 100),
               "meta weight gradient, rank 20": (100, 20, 784),
               "all fast weights' products, 200 rows (Q)": (200, 784, 100),
               "learning-rate gradient, rank 200": (100, 200, 784),
               "one sample (MER, La-MAML's inner step before)": (1, 784, 100),
               "square 512": (512, 512, 512)}
MATMUL_OPS = {"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::addmv", "aten::mv", "aten::dot",
              "aten::addbmm", "aten::baddbmm_"}


def _gemm_rate(width: int, shape: tuple, seconds: float = 0.3) -> float:
    """GFLOP/s of ``bmm`` over ``width`` runs of ``shape`` (``[r, k] @ [k, c]`` per run), one
    thread, process CPU time, the best of three blocks of about ``seconds`` each."""
    r, k, c = shape
    a, b = torch.randn(width, r, k), torch.randn(width, k, c)
    out = torch.empty(width, r, c)
    torch.bmm(a, b, out=out)
    reps = max(1, int(seconds * 2e9 / (2 * width * r * k * c)))
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(reps):
            torch.bmm(a, b, out=out)
        best = min(best, time.process_time() - t0)
    return 2 * width * r * k * c * reps / best / 1e9


def _array(method: str, width: int, warm: int, bs: int = 10):
    """An array of ``width`` runs of ``method`` (seeds 0..), trained ``warm`` batches of task 0,
    and two batches of task 1 to step on."""
    (wx, wy), (xs, ys), info = _data(list(range(width)), warm, 2, bs)
    models = []
    for s in range(width):
        torch.manual_seed(s)
        models.append(build_model(info))
    weights = [torch.stack([p.detach() for p in ps]).requires_grad_(True)
               for ps in zip(*[list(m.parameters()) for m in models])]
    arr = arrays.get_learner(method)(weights, info, [build_config(method, STREAM, s, {}) for s in range(width)], "cpu")
    arr.begin_task(0)
    for b in range(warm):
        arr.observe(wx[:, b * bs:(b + 1) * bs], wy[:, b * bs:(b + 1) * bs], 0)
    arr.end_task(0)
    arr.begin_task(1)
    return arr, xs, ys


def profile_step(method: str, width: int, warm: int, bs: int = 10) -> dict:
    """One array step (one incoming batch of ``bs`` samples per run) of ``method`` at ``width``:
    its process CPU time unprofiled (the best of three), and under ``torch.profiler`` the
    microseconds in matrix products (``MATMUL_OPS``, with their FLOPs), in other ops one of whose
    inputs is first-layer sized (trailing dimensions ``(100, 784)``: passes over weights), in
    every other op, and outside the ops."""
    from torch.profiler import ProfilerActivity, profile
    arr, xs, ys = _array(method, width, warm, bs)
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        arr.observe(xs[:, :bs], ys[:, :bs], 1)
        best = min(best, time.process_time() - t0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        t0 = time.perf_counter()            # the profiler's times are wall-clock
        arr.observe(xs[:, bs:2 * bs], ys[:, bs:2 * bs], 1)
        profiled = time.perf_counter() - t0
    cat = {"matmul": 0.0, "weight_passes": 0.0, "other_ops": 0.0}
    flops, calls = 0, 0
    for e in prof.events():
        us = e.self_cpu_time_total
        calls += 1
        if e.name in MATMUL_OPS:
            cat["matmul"] += us
            flops += e.flops or 0
        elif any(len(sh) >= 2 and tuple(sh[-2:]) == (100, 784) for sh in (e.input_shapes or []) if isinstance(sh, list)):
            cat["weight_passes"] += us
        else:
            cat["other_ops"] += us
    total_us = max(profiled * 1e6, sum(cat.values()))
    share = {k: v / total_us for k, v in cat.items()}
    share["outside_ops"] = 1.0 - sum(share.values())
    out = {"method": method, "width": width, "step_seconds": best, "run_samples_per_s": width * bs / best,
           "profiled_wall_seconds": profiled, "ops_called": calls, "matmul_gflop": flops / 1e9,
           "matmul_gflop_per_run_sample": flops / 1e9 / (width * bs),
           # the products' FLOPs over the whole step's CPU time: the step's arithmetic rate
           "step_gflops": flops / 1e9 / best,
           # and over the products' share of it: their own rate (an estimate: the share is wall-clock)
           "matmul_gflops": flops / 1e9 / (best * share["matmul"]) if share["matmul"] else None,
           "share": share}
    print(f"{method:7s} width {width:3d}: {out['run_samples_per_s']:8.1f} run-samples/s, {out['step_gflops']:5.1f} GFLOP/s "
          f"over the step; profiled: products {share['matmul']:.0%} ({out['matmul_gflops'] or 0:.1f} GFLOP/s), "
          f"weight passes {share['weight_passes']:.0%}, other ops {share['other_ops']:.0%} ({calls} ops), "
          f"outside ops {share['outside_ops']:.0%}", flush=True)
    return out


def roof(methods: list, widths: list, warm: int) -> dict:
    """The products' GFLOP/s at :data:`ROOF_SHAPES` per width, and :func:`profile_step` per method
    and width."""
    gemm = []
    for name, shape in ROOF_SHAPES.items():
        for w in widths:
            if name.startswith("square") and w > 1:
                continue
            rate = _gemm_rate(w, shape)
            gemm.append({"product": name, "shape": list(shape), "width": w, "gflops": rate})
            print(f"bmm {name:55s} width {w:3d}: {rate:6.1f} GFLOP/s", flush=True)
    return {"gemm": gemm, "steps": [profile_step(m, w, warm) for m in methods for w in widths]}


def merge(src: str, dst: str) -> str:
    """Write the methods of results file ``src`` into results file ``dst`` (replacing rows of the
    same method, in ``dst``'s order; new methods at the end), each with ``src``'s provenance
    (``measured``: commit, times, load averages); ``dst``'s other methods are kept as they are."""
    new, old = json.load(open(src)), json.load(open(dst))
    prov = {k: new[k] for k in ("commit", "dirty", "started_utc", "finished_utc", "load_average_before",
                                "load_average_after")}
    by_name = {m["method"]: dict(m, measured=prov) for m in new["methods"]}
    old["methods"] = [by_name.pop(m["method"], m) for m in old["methods"]] + list(by_name.values())
    with open(dst, "w") as fh:
        json.dump(old, fh, indent=1)
        fh.write("\n")
    return dst


def plot(path: str) -> str:
    """The figure of a results file: run-samples per second against width, per method (log-log),
    the run alone as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in data["methods"]:
        arr = res["rows"]
        line, = axes[0].plot([r["width"] for r in arr], [r["run_samples_per_s"] for r in arr], "o-",
                             label=res["method"])
        axes[0].plot([r["width"] for r in arr], [r["alone_run_samples_per_s"] for r in arr], "--",
                     color=line.get_color(), lw=0.8)
        axes[1].plot([r["width"] for r in arr], [r["speedup"] for r in arr], "o-", label=res["method"])
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("array width (runs trained together)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("run-samples per second (dashed: the run alone)")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("over the run alone")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Run arrays on one thread, Permuted MNIST MLP ({data['machine']['cpu']}; shared machine)", fontsize=9)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks run-arrays",
                                description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(arrays.ARRAY_LEARNERS), choices=list(arrays.ARRAY_LEARNERS))
    p.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join("results", "arrays", "throughput_cpu.json"))
    p.add_argument("--plot", default=None, metavar="FILE", help="draw the figure of FILE and exit")
    p.add_argument("--merge", default=None, metavar="FILE",
                   help="also write the measured methods' rows into FILE (each with this run's provenance), "
                        "keeping FILE's other methods, and redraw its figure")
    p.add_argument("--roof", action="store_true",
                   help="measure the products' GFLOP/s and profile one array step per method and width instead "
                        "(default --out results/arrays/roof_cpu.json)")
    args = p.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=1)
    except ImportError:
        pass
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load0 = os.getloadavg()
    if args.roof:
        if args.out == p.get_default("out"):
            args.out = os.path.join("results", "arrays", "roof_cpu.json")
        out = {"what": "GFLOP/s of the batched products at the MLP's shapes, and one array step profiled, one thread",
               **roof(args.methods, args.widths, args.warm)}
    else:
        out = {"what": "run-samples per second of run arrays against their width, one thread, process CPU time",
               "methods": [measure(m, args.widths, args.warm, BATCHES[m], args.repeats) for m in args.methods]}
    out.update({"stream": STREAM, "batch_size": 10, "widths": args.widths,
                "started_utc": started, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "load_average_before": load0, "load_average_after": os.getloadavg(),
                "machine": {"cpu": processor().get("model_name"), "logical_cpus": os.cpu_count(),
                            "platform": platform.platform(), "torch": torch.__version__, "threads": 1,
                            "shared": "2-core VM shared with other engineers' jobs: process CPU time, upper bounds"},
                "commit": code_version().get("commit"), "dirty": code_version().get("dirty")})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(args.out, "" if args.roof else plot(args.out))
    if args.merge and not args.roof:
        print(merge(args.out, args.merge), plot(args.merge))
    return 0


if __name__ == "__main__":
    sys.exit(main())
