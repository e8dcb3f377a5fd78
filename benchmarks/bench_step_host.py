"""The host cost of one optimizer call, source tree against source tree.

On a model as small as the paper's MLP (784-100-100-10, 6 tensors) a CPU step is mostly host
work (Python, the plan's per-step key, torch's ``Optimizer.step`` wrapper), so a change of the
optimizer's Python shows here first. Each tree runs in fresh processes that alternate (A, B,
A, B, ...), each process timing ``--steps`` calls of every method after a warm-up, in process
CPU time (what other jobs on a shared machine disturb least) and wall time; torch's
``Adam(fused=True)`` on the same tensors is timed in the same processes as the yardstick. Last, ``inner_step()``
and the fused Adam step each followed by an LR scheduler's ``step()`` (a ``LambdaLR``: the rate
moves at every call, as in a training loop with a schedule).

    python benchmarks/bench_step_host.py --trees /path/to/old /path/to/new --rounds 5 \\
        --out benchmarks/results/step_host_cpu.json

A tree is a checkout of this repository with its extension built (``emcl_kernels/_C*.so``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from emcl_kernels import FusedEMCLOptimizer
backend, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 100), torch.nn.ReLU(), torch.nn.Linear(100, 100),
                            torch.nn.ReLU(), torch.nn.Linear(100, 10))
for p in model.parameters():
    p.grad = torch.randn_like(p) * 1e-3
opt = FusedEMCLOptimizer(model.parameters(), meta_every=1, check_finite=False, backend=backend,
                         meta_lr=1e-3)
adam = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in model.parameters()],
                        fused=True)
for q, p in zip(adam.param_groups[0]["params"], model.parameters()):
    q.grad = p.grad.clone()
calls = {"step": opt.step, "inner_step": opt.inner_step, "meta_step": opt.meta_step,
         "adam_fused": adam.step}
# the same with an LR scheduler stepped after every call (lr moves at every step); last, so
# that the calls above run at a fixed lr
from torch.optim.lr_scheduler import LambdaLR
schedules = {name: LambdaLR(o, lambda s: 1.0 / (1.0 + 1e-6 * s)) for name, o in
             (("inner_step", opt), ("adam_fused", adam))}
calls["inner_step + scheduler"] = lambda: (opt.inner_step(), schedules["inner_step"].step())
calls["adam_fused + scheduler"] = lambda: (adam.step(), schedules["adam_fused"].step())
out = {}
for name, fn in calls.items():
    for _ in range(200):
        fn()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        fn()
    out[name] = {"cpu_us": (time.process_time() - c0) / steps * 1e6,
                 "wall_us": (time.perf_counter() - w0) / steps * 1e6}
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", required=True)
    ap.add_argument("--backends", nargs="+", default=["cpu", "foreach"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    runs = []
    load_before = os.getloadavg()
    for r in range(a.rounds):
        for backend in a.backends:
            order = a.trees if r % 2 == 0 else list(reversed(a.trees))
            for tree in order:
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.path.join(tree, "python")]),
                       "OMP_NUM_THREADS": "1"}
                res = subprocess.run([sys.executable, "-c", CHILD, backend, str(a.steps)], cwd="/",
                                     env=env, capture_output=True, text=True, check=True)
                runs.append({"round": r, "tree": tree, "backend": backend,
                             "times": json.loads(res.stdout.strip().splitlines()[-1])})
                print(f"round {r} {backend} {tree}: "
                      + ", ".join(f"{k} {v['cpu_us']:.1f}" for k, v in runs[-1]["times"].items()),
                      flush=True)
    summary = {}
    for backend in a.backends:
        for tree in a.trees:
            rs = [x["times"] for x in runs if x["tree"] == tree and x["backend"] == backend]
            summary[f"{backend} {tree}"] = {
                k: {"cpu_us_median": statistics.median(r[k]["cpu_us"] for r in rs),
                    "cpu_us_min": min(r[k]["cpu_us"] for r in rs),
                    "cpu_us_max": max(r[k]["cpu_us"] for r in rs)} for k in rs[0]}
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch
    doc = {"what": "host cost per call on the paper's MLP, process CPU time, 1 thread",
           "machine": {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "torch": torch.__version__, "load_before": load_before,
                       "load_after": os.getloadavg()},
           "trees": a.trees, "steps": a.steps, "rounds": a.rounds, "summary": summary,
           "runs": runs, "command": " ".join(sys.argv)}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for k, v in summary.items():
        print(k, {m: round(x["cpu_us_median"], 1) for m, x in v.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
