"""EMCL's one-sample inner step on the MLP: autograd, the fused glance, and what the bytes allow;
and the main job's training time and results with each inner loop.

    python -m benchmarks glance                              # CPU, one thread, everything
    python -m benchmarks glance --quick                      # a smoke run (seconds)
    python -m benchmarks glance --paired-seeds               # no paired full runs
    python -m benchmarks glance --name glance_xeon-2core     # the current file of a machine

The contenders, the floor and the main job's runs: benchmarks/README.md, ``glance``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional

from benchmarks import common, harness, timing

import torch
import torch.nn.functional as F

WIDTHS = (784, 100, 100, 10)
HYPER = dict(lr=0.03, reg=10.0, gamma=0.3, meta_lr=0.3, prox=True)
STEPS = 20                # one-sample steps per glance: 10 incoming + 10 replayed samples
FLOOR_BYTES_PER_PARAM = 16  # θ read and written, θ₀ and h read


def _mlp(seed: int = 0):
    from emcl_continual.data import models, streams
    info = streams.StreamInfo("permuted-mnist", 1, (WIDTHS[0],), WIDTHS[-1],
                              [(0, WIDTHS[-1])], False)
    torch.manual_seed(seed)
    return models.build_model(info)


def _contenders(device: torch.device):
    """name -> (run one glance of STEPS steps, steps per call)."""
    from emcl_kernels import FusedEMCLOptimizer
    g = torch.Generator().manual_seed(1)
    x = torch.rand(STEPS, WIDTHS[0], generator=g).to(device)
    y = torch.randint(0, WIDTHS[-1], (STEPS,), generator=g).to(device)

    model = _mlp().to(device)
    weights = list(model.parameters())
    opt = FusedEMCLOptimizer(weights, backend="auto", **HYPER)

    def autograd_glance():
        for k in range(STEPS):
            F.cross_entropy(model(x[k:k + 1]), y[k:k + 1]).backward()
            opt.inner_step()
            for p in weights:
                p.grad = None

    fused_model = _mlp().to(device)
    fweights = list(fused_model.parameters())
    fopt = FusedEMCLOptimizer(fweights, backend="auto", **HYPER)
    for p in fweights:                      # the state, as the method makes it
        p.grad = torch.zeros_like(p)
    fopt.inner_step()
    for p in fweights:
        p.grad = None
        fopt.state[p]["importance"].uniform_(0.0, 1e-3)
    params = [p.detach().unsqueeze(0) for p in fweights]
    anchors = [fopt.state[p]["anchor"].unsqueeze(0) for p in fweights]
    imps = [fopt.state[p]["importance"].unsqueeze(0) for p in fweights]
    hyper = torch.tensor([[HYPER["lr"], HYPER["reg"], HYPER["gamma"]]], dtype=torch.float64,
                         device=device)
    op = torch.ops.emcl.mlp_glance_
    x3, y2 = x.unsqueeze(0).contiguous(), y.unsqueeze(0).contiguous()
    losses = torch.empty(1, STEPS, device=device)
    skipped = torch.empty(1, dtype=torch.int64, device=device)
    xs = [x3[:, k:k + 1].contiguous() for k in range(STEPS)]
    ys = [y2[:, k:k + 1].contiguous() for k in range(STEPS)]
    loss1 = torch.empty(1, 1, device=device)

    def fused_glance():
        op(params, anchors, imps, x3, y2, None, hyper, True, True, losses, skipped)

    def fused_one_step():
        for k in range(STEPS):
            op(params, anchors, imps, xs[k], ys[k], None, hyper, True, True, loss1, skipped)

    return {"autograd": autograd_glance, "fused_glance": fused_glance,
            "fused_one_step": fused_one_step}


def _floor(device: torch.device, repeats: int) -> dict:
    """The step's bytes at the best measured rate of the streaming probe on the MLP's size."""
    numel = sum(o * i + o for i, o in zip(WIDTHS, WIDTHS[1:]))
    a = torch.rand(numel, device=device)
    b = torch.rand(numel, device=device)
    c = torch.rand(numel, device=device)
    d = torch.rand(numel, device=device)
    probe = torch.ops.emcl.stream_probe_
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(50):
            probe(a, b, c, d, 1)
        timing.synchronize(device)
        best = min(best, (time.perf_counter() - start) / 50)
    rate = 12 * numel / best
    step_bytes = FLOOR_BYTES_PER_PARAM * numel
    return {"parameters": numel, "step_bytes": step_bytes, "probe": "stream_probe_ kind 1",
            "probe_bytes_per_element": 12, "probe_gbps": rate / 1e9,
            "us_per_step": step_bytes / rate * 1e6}


def time_inner_step(device: torch.device, rounds: int, block_s: float) -> dict:
    fns = _contenders(device)
    for fn in fns.values():               # warm-up: lazy imports, plans, allocator
        fn()
    per = {name: {"wall_us": [], "cpu_us": []} for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fn = fns[name]
            calls, w0, c0 = 0, time.perf_counter(), time.process_time()
            while True:
                fn()
                calls += 1
                if time.perf_counter() - w0 > block_s:
                    break
            timing.synchronize(device)
            steps = calls * STEPS
            per[name]["wall_us"].append((time.perf_counter() - w0) / steps * 1e6)
            per[name]["cpu_us"].append((time.process_time() - c0) / steps * 1e6)
    out = {}
    for name, d in per.items():
        out[name] = {"wall_us_median": statistics.median(d["wall_us"]),
                     "wall_us_min": min(d["wall_us"]),
                     "cpu_us_median": statistics.median(d["cpu_us"]),
                     "cpu_us_min": min(d["cpu_us"]), "blocks": d}
    return out


def time_main_job(tasks: int, rounds: int, samples: Optional[int]) -> dict:
    from emcl_continual.training import train
    runs = {True: [], False: []}
    for r in range(rounds):
        for fused in ((True, False) if r % 2 == 0 else (False, True)):
            c0 = time.process_time()
            res = train.run("emcl", "permuted-mnist", 0, overrides={"fused_glance": fused},
                            n_tasks=tasks, samples_per_task=samples, progress=False)
            runs[fused].append({"train_time_s": res["train_time_s"],
                                "process_cpu_s": time.process_time() - c0,
                                "acc": res["acc"], "bwt": res["bwt"],
                                "load_average": list(os.getloadavg())})
    med = {k: statistics.median(x["train_time_s"] for x in v) for k, v in runs.items()}
    return {"tasks": tasks, "samples_per_task": samples or 1000, "seed": 0,
            "fused": runs[True], "autograd": runs[False],
            "train_time_s_median": {"fused": med[True], "autograd": med[False]},
            "speedup": med[False] / med[True]}


def paired_runs(seeds) -> dict:
    from emcl_continual.training import train
    rows = []
    for seed in seeds:
        row = {"seed": seed}
        for fused in (True, False):
            res = train.run("emcl", "permuted-mnist", seed, overrides={"fused_glance": fused},
                            progress=False)
            key = "fused" if fused else "autograd"
            row[key] = {"acc": res["acc"], "bwt": res["bwt"],
                        "train_time_s": res["train_time_s"]}
        row["acc_diff"] = row["fused"]["acc"] - row["autograd"]["acc"]
        row["bwt_diff"] = row["fused"]["bwt"] - row["autograd"]["bwt"]
        rows.append(row)
    return {"stream": "permuted-mnist", "tasks": 20, "rows": rows,
            "max_abs_acc_diff": max((abs(r["acc_diff"]) for r in rows), default=None),
            "floor_note": "docs/results.md, 'What reproduces where': EMCL's per-seed ACC moves "
                          "by ~0.4 (up to 1.14) with the arithmetic path alone"}


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser("glance", __doc__, "threads", "out", "quick", threads=1,
                       quick="2 rounds of short blocks, 1 main-job round of 1 task x 100, no "
                             "paired runs")
    p.add_argument("--device", default="cpu", choices=("cpu",),
                   help="the CPU (the GPU measurement is the GPU check's)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block-s", type=float, default=0.5, help="seconds per timed block")
    p.add_argument("--main-job-tasks", type=int, default=5)
    p.add_argument("--main-job-rounds", type=int, default=3)
    p.add_argument("--paired-seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--name", default="glance_cpu", help="file stem of the results")
    return p


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results (also written to ``--out``)."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    with harness.threads(args.threads):
        samples = None
        if args.quick:
            args.rounds, args.block_s, args.main_job_rounds = 2, 0.05, 1
            args.main_job_tasks, samples, args.paired_seeds = 1, 100, []
        result = harness.head("glance", argv, device)
        result.update({"benchmark": "glance", "started": result["created_utc"],
                       "threads": args.threads, "mlp": list(WIDTHS), "steps_per_glance": STEPS,
                       "hyper": HYPER,
                       "glance_cpu_kernel": str(torch.ops.emcl.glance_cpu_kernel())})
        result["inner_step"] = time_inner_step(device, args.rounds, args.block_s)
        result["floor"] = _floor(device, 20 if not args.quick else 3)
        result["main_job"] = time_main_job(args.main_job_tasks, args.main_job_rounds, samples)
        if args.paired_seeds:
            result["paired"] = paired_runs(args.paired_seeds)
        result["load_average_at_end"] = common.load_average()
        result["finished"] = common.utc_now()
        return harness.finish(result, args.out, args.name, table=table)


def table(result: dict) -> str:
    """The performance page's table of the inner step, and the main job's line."""
    s = result["inner_step"]
    fl = result["floor"]
    lines = ["| one-sample inner step, MLP 784-100-100-10 | µs per step (CPU time) | µs (wall) |",
             "|---|---|---|"]
    for name, title in (("autograd", "autograd + `inner_step()` (before)"),
                        ("fused_one_step", "fused, one call per step"),
                        ("fused_glance", "fused glance, one call per 20 steps")):
        lines.append(f"| {title} | {s[name]['cpu_us_median']:.1f} | {s[name]['wall_us_median']:.1f} |")
    lines.append(f"| floor: {fl['step_bytes'] / 1e6:.2f} MB at {fl['probe_gbps']:.0f} GB/s | "
                 f"{fl['us_per_step']:.1f} | |")
    mj = result["main_job"]
    lines.append("")
    lines.append(f"main job, {mj['tasks']} tasks: training {mj['train_time_s_median']['autograd']:.2f} s "
                 f"(autograd) -> {mj['train_time_s_median']['fused']:.2f} s (fused): "
                 f"{mj['speedup']:.1f}x")
    if "paired" in result:
        for row in result["paired"]["rows"]:
            lines.append(f"seed {row['seed']}: ACC fused {row['fused']['acc']:.2f}, autograd "
                         f"{row['autograd']['acc']:.2f} (diff {row['acc_diff']:+.2f})")
    return "\n".join(lines)
