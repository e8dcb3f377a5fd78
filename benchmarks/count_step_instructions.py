"""Driver for instruction counts of one optimizer step (callgrind, perf stat): load-independent.

    valgrind --tool=callgrind python benchmarks/count_step_instructions.py emcl_step --steps 4

Builds ``--numel`` fp32 elements (one tensor, default 2**20) with gradients, makes the optimizer,
takes one warm-up step, then ``--steps`` more, on one intra-op thread (``--threads``). Contenders:
``emcl_step`` (``FusedEMCLOptimizer(backend="cpu", meta_every=1, check_finite=False).step()``: the
fused inner+meta step), ``emcl_inner`` (its ``inner_step()``), ``adam`` (``torch.optim.Adam(
fused=True)``). Run it twice with different ``--steps`` and subtract the two totals to get the
instructions of ``steps`` steps without the start-up (importing torch), or use callgrind's
``--toggle-collect`` on the kernels (benchmarks/results/step_instructions_cpu.json says how).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CONTENDERS = ("emcl_step", "emcl_inner", "adam")


def main(argv=None) -> None:
    """Parse the arguments, build the contender and run its steps."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("contender", choices=CONTENDERS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.steps < 0 or args.numel < 1 or args.threads < 1:
        ap.error("--steps must be >= 0, --numel and --threads >= 1")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(0.1 * torch.randn(args.numel, generator=gen))
    p.grad = 1e-3 * torch.randn(args.numel, generator=gen)
    if args.contender == "adam":
        opt = torch.optim.Adam([p], lr=1e-3, fused=True)
        step = opt.step
    else:
        from emcl_kernels import FusedEMCLOptimizer
        opt = FusedEMCLOptimizer([p], lr=1e-3, meta_every=1, backend="cpu", check_finite=False)
        step = opt.step if args.contender == "emcl_step" else opt.inner_step
    step()  # warm-up: state allocated, plans built
    for _ in range(args.steps):
        step()
    print(f"{args.contender}: {args.steps} steps of {args.numel} elements, "
          f"{args.threads} thread(s), sum {float(p.detach().sum()):.6e}")


if __name__ == "__main__":
    main()
