"""Tune and check the Triton backend's step (the op interface of ``emcl_kernels.interface``).

    python -m benchmarks triton                             # on a GPU: everything below
    TRITON_INTERPRET=1 python -m benchmarks triton --smoke  # CPU, tiny: does it run?

On a GPU it prints one JSON object per line: ``copy``, ``bandwidth``, ``odd_tensor``,
``check`` and ``host`` (what each measures: benchmarks/README.md, ``triton``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch  # noqa: E402

from benchmarks import common, timing  # noqa: E402

from emcl_kernels.backends import triton as TB  # noqa: E402
from emcl_kernels.interface import (COUNTER_FIELDS, HYPER_FIELDS, IMPORTANCE,  # noqa: E402
                                    LR_MODE, OP)

HYPER = dict(inner_lr=0.05, meta_lr=0.2, reg=1.5, gamma=0.3, decay=0.8, lr_scale=0.6,
             lr_min=0.0, lr_max=50.0, eps=1e-8)
OPS = ("inner", "meta", "inner_meta")


class Group:
    """One group's tensors and the interface's device tensors, on ``device``."""

    def __init__(self, sizes, dtype, device, odd=()):
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rnd(n, dt, shift=False):
            t = torch.randn(n + shift, generator=gen).to(device=device, dtype=dt)
            return t[1:] if shift else t
        self.params = [rnd(n, dtype, i in odd) for i, n in enumerate(sizes)]
        self.grads = [rnd(n, dtype) for n in sizes]
        self.anchors = [p.float() + 0.1 * rnd(n, torch.float32) for p, n in zip(self.params, sizes)]
        self.importances = [rnd(n, torch.float32).abs() + 0.1 for n in sizes]
        self.hyper = torch.tensor([HYPER[k] for k in HYPER_FIELDS], dtype=torch.float64,
                                  device=device)
        self.counters = torch.zeros(len(COUNTER_FIELDS), dtype=torch.int64, device=device)
        self.steps = torch.zeros(len(sizes), device=device)

    def step(self, op, check=False, meta_every=1):
        TB.step(self.params, self.grads, self.anchors, self.importances, [], self.steps,
                self.hyper, self.counters, op=OP[op], prox=True,
                importance=IMPORTANCE["taylor"], lr_mode=LR_MODE["inverse"],
                meta_every=meta_every, check=check, finalize=True)


def median_seconds(fn, device, reps):
    """Median seconds of ``reps`` calls of ``fn`` (CUDA events on a GPU), after one untimed
    call that compiles the kernels and builds the tables."""
    fn()
    return statistics.median(timing.time_calls([fn] * reps, device))


def wall_per_call(fn, device, calls):
    """Wall time per call of ``calls`` back-to-back calls (host-bound when the kernels are
    short), synchronized once at the end."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks triton",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2 ** 24)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check it runs on CPU")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args(argv)
    sink = open(args.out, "w") if args.out else None

    def out(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if sink is not None:
            sink.write(line + "\n")
            sink.flush()

    try:
        _run(args, out)
    finally:
        if sink is not None:
            sink.close()


def _run(args, out):
    device = torch.device("cuda" if torch.cuda.is_available() and not TB.INTERPRETED else "cpu")
    if TB.unavailable_reason("triton", device.type):
        sys.exit(f"triton backend unavailable: {TB.unavailable_reason('triton', device.type)}")
    if args.smoke:
        args.numel, args.blocks, args.warps, args.reps = 5000, [4096], [8], 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    import triton
    out({"device": name, "torch": torch.__version__, "triton": triton.__version__})

    copy_numel = max(args.numel, 2 ** 26) if device.type == "cuda" else args.numel
    src = torch.randn(copy_numel, device=device)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, args.reps)
    copy_gbps = 2 * src.numel() * 4 / copy_s / 1e9
    del src, dst
    out({"copy_gbps": round(copy_gbps, 1)})

    default = (TB.BLOCK_SIZE, TB.NUM_WARPS)
    for dtype in (torch.float32, torch.bfloat16):
        group = Group([args.numel], dtype, device)
        for block in args.blocks:
            for warps in args.warps:
                TB.BLOCK_SIZE, TB.NUM_WARPS = block, warps
                for op in OPS:
                    s = median_seconds(lambda: group.step(op), device, args.reps)
                    gbps = common.bytes_per_element(f"{op}_step", dtype) * args.numel / s / 1e9
                    out({"bandwidth": op, "dtype": str(dtype)[6:], "numel": args.numel,
                         "block": block, "warps": warps, "us": round(s * 1e6, 1),
                         "gbps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)})
        del group
    TB.BLOCK_SIZE, TB.NUM_WARPS = default

    n = max(args.numel // 8, 8)
    times = {}
    for label, odd in (("aligned", ()), ("one_odd", (3,))):
        group = Group([n] * 8, torch.float32, device, odd=odd)
        times[label] = median_seconds(lambda: group.step("meta"), device, args.reps)
        del group
    out({"odd_tensor": "meta", "tensors": 8, "numel_each": n,
         **{k + "_us": round(v * 1e6, 1) for k, v in times.items()},
         "ratio": round(times["one_odd"] / times["aligned"], 3)})

    group = Group([args.numel], torch.float32, device)
    plain = median_seconds(lambda: group.step("inner_meta"), device, args.reps)
    checked = median_seconds(lambda: group.step("inner_meta", check=True), device, args.reps)
    out({"check": "inner_meta", "numel": args.numel, "us": round(plain * 1e6, 1),
         "with_check_us": round(checked * 1e6, 1),
         "check_gbps": (round(4 * args.numel / (checked - plain) / 1e9, 1)
                        if checked > plain else None)})
    del group

    if device.type != "cuda":
        return
    sizes = [4096] * 1000
    group = Group(sizes, torch.float32, device)
    calls = 200
    emcl = wall_per_call(lambda: group.step("cadence", check=True), device, calls)
    params = [torch.nn.Parameter(p.clone()) for p in group.params]
    for p, g in zip(params, group.grads):
        p.grad = g.clone()
    adam = torch.optim.Adam(params, lr=1e-3, fused=True)
    adam_s = wall_per_call(adam.step, device, calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.step("cadence", check=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group.step("cadence", check=True)
    replay = wall_per_call(graph.replay, device, calls)
    out({"host": "1000 x 4096 fp32", "emcl_cadence_check_us": round(emcl * 1e6, 1),
         "adam_fused_us": round(adam_s * 1e6, 1), "emcl_graph_replay_us": round(replay * 1e6, 1),
         "emcl_over_adam": round(emcl / adam_s, 2)})
