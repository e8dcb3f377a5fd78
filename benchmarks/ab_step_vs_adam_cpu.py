"""Quick interleaved wall-clock check of the CPU step against fused Adam (indicative only on a
shared machine; benchmarks/bench_step.py is the full benchmark).

    python benchmarks/ab_step_vs_adam_cpu.py THREADS [REPO]

Builds three 2**22-element fp32 parameters with gradients, steps ``Adam(fused=True)``, EMCL's
``step()`` (``backend="cpu"``, ``meta_every=1``, no check) and its ``inner_step()`` in turn for 60
rounds on THREADS intra-op threads, and prints one JSON line: the copy of the CPU kernels that
ran, torch's CPU capability, each contender's median and fastest step over Adam's, the load.
REPO (default: this checkout) is the emcl-kernels tree whose build is imported, so the same
script times another worktree's build.
"""
import json
import os
import statistics
import sys
import time

REPO = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "python")]

import torch  # noqa: E402

from emcl_kernels import FusedEMCLOptimizer  # noqa: E402
import emcl_kernels.backends.extension  # noqa: E402,F401  (loads torch.ops.emcl)


def main() -> None:
    """Time the three contenders and print the JSON line."""
    if len(sys.argv) < 2 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
        raise SystemExit("usage: ab_step_vs_adam_cpu.py THREADS [REPO]")
    threads = int(sys.argv[1])
    torch.set_num_threads(threads)
    n = 1 << 22
    ps = []
    for _ in range(3):
        p = torch.nn.Parameter(0.1 * torch.randn(n))
        p.grad = 1e-3 * torch.randn(n)
        ps.append(p)
    adam = torch.optim.Adam([ps[0]], lr=1e-3, fused=True)
    emcl = FusedEMCLOptimizer([ps[1]], lr=1e-3, meta_every=1, backend="cpu", check_finite=False)
    inner = FusedEMCLOptimizer([ps[2]], lr=1e-3, meta_every=1, backend="cpu", check_finite=False)
    fs = {"adam": adam.step, "emcl_step": emcl.step, "emcl_inner": inner.inner_step}
    for f in fs.values():
        f()
    t = {k: [] for k in fs}
    for _ in range(60):
        for k, f in fs.items():
            s = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - s)
    a = statistics.median(t["adam"])
    print(json.dumps({
        "threads": threads, "repo": REPO, "kernel": torch.ops.emcl.cpu_kernel(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "median_ratio_to_adam": {k: round(statistics.median(v) / a, 3) for k, v in t.items()},
        "adam_median_ms": round(a * 1e3, 3),
        "min_ratio_to_adam": {k: round(min(v) / min(t["adam"]), 3) for k, v in t.items()},
        "load1": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
