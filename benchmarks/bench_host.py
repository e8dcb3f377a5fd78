"""Host time of a step: what ``FusedEMCLOptimizer.step()`` spends outside the kernels, on the
paper's MLP 784-100-100-10 (6 tensors) and on 1,000 x 4,096 fp32 tensors, one thread.

    python -m benchmarks host [--device cpu|cuda] [--out FILE]

What it times: benchmarks/README.md, ``host``.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import time

import torch

from benchmarks import common, harness
from emcl_kernels import FusedEMCLOptimizer

LAYOUTS = {"mlp": common.mlp_shapes(), "many": [(4096,)] * 1000}


def _layouts(args):
    """Per layout: its name, its parameters, three gradient sets to swap in (as autograd
    allocates them anew), and the steps per round (fewer on the 1,000 tensors)."""
    gen = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    for name, shapes in LAYOUTS.items():
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.01).to(device))
                  for s in shapes]
        pool = [[(torch.randn(p.shape, generator=gen) * 1e-3).to(device) for p in params]
                for _ in range(3)]
        yield name, params, pool, (args.steps if name == "mlp" else max(40, args.steps // 10))


@contextlib.contextmanager
def _backend_noop(opt):
    """``opt``'s backend ``step`` replaced by a function that does nothing, put back after."""
    backend = opt._runtime.plans[0].backend
    real, backend.step = backend.step, (lambda *a, **k: None)
    try:
        yield
    finally:
        backend.step = real


def _median_us(fn, n, clock=time.perf_counter):
    out = []
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return statistics.median(out) * 1e6


def host_only(args) -> dict:
    """Host time of ``step()`` with the backend call replaced by a no-op, per layout, with
    the same gradients every step and with gradients that change every step."""
    torch.set_num_threads(1)
    out = {}
    for name, params, pool, n in _layouts(args):
        for p, g in zip(params, pool[0]):
            p.grad = g
        opt = FusedEMCLOptimizer(params, meta_every=1, backend=args.backend)
        opt.step()
        i = [0]

        def fresh():
            i[0] += 1
            for p, g in zip(params, pool[i[0] % 3]):
                p.grad = g
            opt.step()

        def swap_only():  # the same assignments without the step, subtracted
            i[0] += 1
            for p, g in zip(params, pool[i[0] % 3]):
                p.grad = g

        with _backend_noop(opt):
            same, changing, assign = [], [], []
            for _ in range(args.rounds):
                for p, g in zip(params, pool[0]):
                    p.grad = g
                same.append(_median_us(opt.step, n))
                changing.append(_median_us(fresh, n))
                assign.append(_median_us(swap_only, n))
        a = statistics.median(assign)
        out[name] = {"same_grads_us": statistics.median(same),
                     "changing_grads_us": statistics.median(changing) - a,
                     "same_grads_fastest_us": min(same),
                     "changing_grads_fastest_us": min(changing) - min(assign),
                     "same_rounds_us": same, "changing_rounds_us": changing,
                     "assign_rounds_us": assign}
        print(f"{name:5s} host time of step(), backend call a no-op: same grads "
              f"{out[name]['same_grads_us']:8.1f} us, changing grads "
              f"{out[name]['changing_grads_us']:8.1f} us")
    return out


def main(argv=None) -> dict:
    """Run the benchmark; return the record (also written to ``--out FILE``)."""
    ap = harness.parser("host", __doc__)
    ap.add_argument("--backend", default="auto", help="default: auto (cpu on the CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=400, help="calls per round (MLP; fewer on many)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the record to this JSON file")
    ap.add_argument("--note", default="", help="recorded in the file")
    ap.add_argument("--host-only", action="store_true",
                    help="the host's part of a step alone, the backend call a no-op (what "
                         "is always timed; the flag names it in a command)")
    ap.add_argument("--json", action="store_true", help="print the record as JSON on stdout")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be at least 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU here")
    res = {"what": " ".join(host_only.__doc__.split()),
           "backend": args.backend, "device": args.device, "threads": 1,
           "load_before": common.load_average(), "layouts": host_only(args),
           "load_after": common.load_average()}
    res.update(harness.head("host", argv, note=args.note))
    if args.out:
        harness.save(res, args.out)
    if args.json:
        print(json.dumps(res))
    return res
