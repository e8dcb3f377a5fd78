"""Host time of one ``emcl_kernels.functional`` call, the backend's kernels taken out: the
validation of the call's lists (SPEC section 4), its plan and its hyper-parameters. Timed with
the C++ pass that accepts a plainly valid call (``_C.plainly_valid_call``) and with the Python
checks alone (as without the extension), alternating round by round in one process so that
both see the same load; one tensor of 1,024 and 1,000 tensors of 4,096, fp32, the combined
inner+meta step. On a GPU this host time is the whole call below ~2**22 elements (the H200
run of 2026-11-27: 0.13 ms per call with one tensor).

    PYTHONPATH=.:python python benchmarks/bench_functional_host.py \\
        --out benchmarks/results/functional_host_ab_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from emcl_kernels import functional as F  # noqa: E402
from emcl_kernels.backends import get_backend  # noqa: E402

LAYOUTS = {"one-1024": [1024], "many-1000x4096": [4096] * 1000}


def measure(args) -> dict:
    if F._plainly_valid_call is None:
        raise SystemExit("needs the compiled extension (emcl_kernels._C)")
    variants = {"native": F._plainly_valid_call, "python": None}
    torch.set_num_threads(1)
    device = torch.device(args.device)
    backend = get_backend(args.backend, device)
    hyper = common.hyperparameters("inner_meta_step", "inverse")
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    real = backend.step
    backend.step = lambda *a, **k: None
    try:
        for name, sizes in LAYOUTS.items():
            lists = [[torch.randn(n, generator=gen, device=device) for n in sizes]
                     for _ in range(4)]

            def call():
                F.inner_meta_step_(*lists, None, backend=args.backend, check_finite=False,
                                   **hyper)
            call()
            reps = args.calls if len(sizes) == 1 else max(5, args.calls // 50)
            times = {v: [] for v in variants}
            for r in range(2 * args.rounds):
                for label in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                    F._plainly_valid_call = variants[label]
                    t = time.perf_counter()
                    for _ in range(reps):
                        call()
                    times[label].append((time.perf_counter() - t) / reps * 1e6)
            out[name] = {v: {"min_us": min(x), "median_us": statistics.median(x),
                             "rounds_us": x} for v, x in times.items()}
            for v in variants:
                print(f"{name:15s} {v:6s} host time per call: {out[name][v]['min_us']:9.1f} us "
                      f"(fastest round), {out[name][v]['median_us']:9.1f} us (median)")
    finally:
        backend.step = real
        F._plainly_valid_call = variants["native"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", help="default: cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=500, help="calls per round (one tensor)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "backend": args.backend,
           "device": args.device, "threads": 1, "machine": platform.node(),
           "torch": torch.__version__, "note": args.note,
           "load_before": list(os.getloadavg())}
    res["layouts"] = measure(args)
    res["load_after"] = list(os.getloadavg())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
