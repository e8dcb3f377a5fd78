"""Tune and check the Triton backend on a GPU: the numbers issue 4 asks for.

    python benchmarks/sweep_triton.py                 # on a GPU
    TRITON_INTERPRET=1 python benchmarks/sweep_triton.py --smoke   # CPU, tiny: does it run?

For every (BLOCK_SIZE, NUM_WARPS) of the sweep it times each op on one tensor of 2**24
elements (fp32 and bf16; ``--numel`` to change) and reports GB/s under SPEC section 5's byte
model and the ratio to the copy bandwidth measured in the same run (``dst.copy_(src)``, bytes
read + written). Then, at the default configuration, it times a list of 1,000 tensors of 4,096
elements against the ``reference`` backend, and against the ``cuda`` backend when that is
available. Times are medians of CUDA-event timings (``time.perf_counter`` on CPU), through
``emcl_kernels.functional`` as a user calls it. Prints one JSON object per line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from emcl_kernels import available_backends, functional as F  # noqa: E402
from emcl_kernels.backends import triton as TB  # noqa: E402

OPS = ("inner_step", "meta_step", "inner_meta_step")
HYPER = dict(inner_lr=0.05, meta_lr=0.2, reg=1.5, gamma=0.3, decay=0.8, lr_scale=0.6,
             lr_mode="inverse", lr_min=0.0, lr_max=50.0, eps=1e-8, importance="taylor",
             prox=True)
KEYS = {"inner_step": ("inner_lr", "reg", "gamma", "prox"),
        "meta_step": ("meta_lr", "reg", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max",
                      "eps", "importance"),
        "inner_meta_step": tuple(HYPER)}


def bytes_per_element(op, dtype):
    """SPEC section 5 (lr_mode "inverse": no stored α)."""
    p = torch.empty((), dtype=dtype).element_size()
    return 3 * p + (2 if op == "inner_step" else 4) * 4


def make(sizes, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    def rnd(n, dt):
        return torch.randn(n, generator=g).to(device=device, dtype=dt)
    params = [rnd(n, dtype) for n in sizes]
    grads = [rnd(n, dtype) for n in sizes]
    anchors = [p.float() + 0.1 * rnd(n, torch.float32) for p, n in zip(params, sizes)]
    imps = [rnd(n, torch.float32).abs() + 0.1 for n in sizes]
    return params, grads, anchors, imps


def step(op, backend, tensors):
    params, grads, anchors, imps = tensors
    hp = {k: HYPER[k] for k in KEYS[op]}
    if op == "inner_step":
        return lambda: F.inner_step_(params, grads, anchors, imps, backend=backend, **hp)
    fn = getattr(F, op + "_")
    return lambda: fn(params, grads, anchors, imps, None, backend=backend, **hp)


def median_seconds(fn, device, reps):
    fn()                                                  # compile / build the tables
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2 ** 24)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check it runs on CPU")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not TB.INTERPRETED else "cpu")
    if TB.unavailable_reason("triton", device.type):
        sys.exit(f"triton backend unavailable: {TB.unavailable_reason('triton', device.type)}")
    if args.smoke:
        args.numel, args.blocks, args.warps, args.reps = 5000, [4096], [8], 2
    many = (10, 257) if args.smoke else (1000, 4096)
    out = lambda rec: print(json.dumps(rec), flush=True)  # noqa: E731
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"

    copy_numel = max(args.numel, 2 ** 26) if device.type == "cuda" else args.numel
    src = torch.randn(copy_numel, device=device)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, args.reps)
    copy_gbps = 2 * src.numel() * 4 / copy_s / 1e9
    del src, dst
    out({"device": name, "copy_gbps": round(copy_gbps, 1)})

    default = (TB.BLOCK_SIZE, TB.NUM_WARPS)
    for dtype in (torch.float32, torch.bfloat16):
        tensors = make([args.numel], dtype, device)
        for block in args.blocks:
            for warps in args.warps:
                TB.BLOCK_SIZE, TB.NUM_WARPS = block, warps
                for op in OPS:
                    s = median_seconds(step(op, "triton", tensors), device, args.reps)
                    gbps = bytes_per_element(op, dtype) * args.numel / s / 1e9
                    out({"op": op, "dtype": str(dtype), "numel": args.numel, "block": block,
                         "warps": warps, "us": round(s * 1e6, 1), "gbps": round(gbps, 1),
                         "of_copy": round(gbps / copy_gbps, 3)})
        del tensors
    TB.BLOCK_SIZE, TB.NUM_WARPS = default

    others = [b for b in ("cuda", "foreach") if b in available_backends()
              and (b != "cuda" or device.type == "cuda")]
    for dtype in (torch.float32,):
        tensors = make([args.numel], dtype, device)
        for op in OPS:
            rec = {"op": op, "numel": args.numel, "dtype": str(dtype)}
            for b in ["triton"] + others:
                rec[b + "_us"] = round(median_seconds(step(op, b, tensors), device,
                                                      args.reps) * 1e6, 1)
            out(rec)
        del tensors
        tensors = make([many[1]] * many[0], dtype, device)
        for op in OPS:
            rec = {"op": op, "tensors": many[0], "numel_each": many[1], "dtype": str(dtype)}
            for b in ["triton", "reference"] + others:
                reps = max(3, args.reps // 10) if b == "reference" else args.reps
                rec[b + "_us"] = round(median_seconds(step(op, b, tensors), device, reps) * 1e6, 1)
            rec["triton_speedup_vs_reference"] = round(rec["reference_us"] / rec["triton_us"], 1)
            out(rec)


if __name__ == "__main__":
    main()
