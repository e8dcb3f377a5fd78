"""What the non-finite gradient check costs (issue 8): each backend's step with
``check_finite=True`` against the same step with ``check_finite=False``, and the flag alone
(:func:`emcl_kernels.functional.found_non_finite`) against the other ways to compute it.

    PYTHONPATH=. python benchmarks/check_finite_overhead.py [--device cpu] [--threads 1]
        [--repeats 30] [--out benchmarks/results/check_finite_overhead.json]

Each timing is the minimum (the median is kept too) over ``--repeats`` runs (a quarter of
that for the 16M workload), the two variants interleaved so that a busy machine slows both
alike. On CUDA each timing is bracketed by synchronizations.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import emcl_kernels
from emcl_kernels import functional as F
from emcl_kernels.backends import BackendUnavailableError, get_backend

# (name, tensor sizes): the paper's MNIST MLP (784-100-100-10), a 1M-parameter and a
# 16M-parameter model made of tensors of realistic, uneven sizes.
WORKLOADS = {
    "mlp-89k": [784 * 100, 100, 100 * 100, 100, 100 * 10, 10],
    "1M": [(i * 7919) % 100_000 + 1_000 for i in range(20)],
    "16M": [(i * 104_729) % 600_000 + 30_000 for i in range(50)],
}
OPS = {
    "inner_step": dict(inner_lr=0.05, reg=1.5, gamma=0.3),
    "meta_step": dict(meta_lr=0.2, reg=1.5, decay=0.9, lr_scale=0.6, lr_mode="inverse"),
    "inner_meta_step": dict(inner_lr=0.05, meta_lr=0.2, reg=1.5, gamma=0.3, decay=0.9,
                            lr_scale=0.6, lr_mode="inverse"),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _pair(a, b, device, repeats):
    """(min, median) seconds of ``a`` and of ``b``, run interleaved. The minimum is the
    estimate used on a shared machine: other jobs only ever add time."""
    for _ in range(2):
        a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(_time(a, device))
        tb.append(_time(b, device))
    return (min(ta), statistics.median(ta)), (min(tb), statistics.median(tb))


def _tensors(sizes, device, dtype):
    gen = torch.Generator().manual_seed(0)
    mk = lambda n, s=1.0: (s * torch.randn(n, generator=gen)).to(device)  # noqa: E731
    params = [mk(n).to(dtype) for n in sizes]
    grads = [mk(n).to(dtype) for n in sizes]
    anchors = [p.float() + 0.01 * mk(n) for p, n in zip(params, sizes)]
    imps = [mk(n).abs() for n in sizes]
    return params, grads, anchors, imps


def bench_steps(device, backends, dtypes, repeats):
    rows = []
    for backend in backends:
        for dtype in dtypes:
            for wname, sizes in WORKLOADS.items():
                params, grads, anchors, imps = _tensors(sizes, device, dtype)
                for op, hp in OPS.items():
                    fn = getattr(F, op + "_")
                    extra = () if op == "inner_step" else (None,)

                    def call(check):
                        return lambda: fn(params, grads, anchors, imps, *extra, backend=backend,
                                          check_finite=check, **hp)
                    reps = repeats if sum(sizes) < 4_000_000 else max(5, repeats // 4)
                    (t_on, m_on), (t_off, m_off) = _pair(call(True), call(False), device, reps)
                    rows.append(dict(backend=backend, dtype=str(dtype).replace("torch.", ""),
                                     workload=wname, elements=sum(sizes), tensors=len(sizes),
                                     op=op, repeats=reps, ms_check=t_on * 1e3,
                                     ms_no_check=t_off * 1e3, median_ms_check=m_on * 1e3,
                                     median_ms_no_check=m_off * 1e3,
                                     overhead_pct=100.0 * (t_on - t_off) / t_off))
                    print(f"{backend:8s} {rows[-1]['dtype']:8s} {wname:8s} {op:16s} "
                          f"check {t_on * 1e3:9.3f} ms  no check {t_off * 1e3:9.3f} ms  "
                          f"overhead {rows[-1]['overhead_pct']:6.1f} % (min of {reps}; "
                          f"medians {m_on * 1e3:.3f} / {m_off * 1e3:.3f} ms)", flush=True)
    return rows


def bench_flag(device, repeats):
    """The flag alone, by the op used (GradScaler's check-and-unscale with a unit scale) and
    by the read-only alternatives considered."""
    rows = []
    nonempty = lambda gs: [g for g in gs if g.numel()]  # noqa: E731
    ways = {
        "amp_check_and_unscale (used)": lambda gs: F.found_non_finite(gs),
        "foreach_norm(inf)": lambda gs: (~torch.isfinite(torch.stack(
            torch._foreach_norm(nonempty(gs), float("inf"))))).any(),
        "isfinite per tensor": lambda gs: torch.stack(
            [~torch.isfinite(g).all() for g in gs]).any(),
    }
    for wname, sizes in WORKLOADS.items():
        _, grads, _, _ = _tensors(sizes, device, torch.float32)
        for name, way in ways.items():
            (t, med), _ = _pair(lambda: way(grads), lambda: None, device, repeats)
            gbs = 4 * sum(sizes) / t / 1e9
            rows.append(dict(workload=wname, way=name, ms=t * 1e3, median_ms=med * 1e3,
                             grad_read_GBps=gbs))
            print(f"flag {wname:8s} {name:30s} {t * 1e3:9.3f} ms  ({gbs:6.2f} GB/s of fp32 "
                  f"gradient read)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--backends", default="",
                    help="comma-separated; default: every available backend but the reference")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backends = [b for b in args.backends.split(",") if b] or [
        b for b in emcl_kernels.available_backends() if b != "reference"]
    usable = []
    for b in backends:
        try:
            get_backend(b, device)
            usable.append(b)
        except (BackendUnavailableError, ValueError) as exc:
            print(f"skipping {b}: {exc}")
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    result = dict(machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                  device=str(device), threads=args.threads, repeats=args.repeats,
                  torch=torch.__version__, steps=bench_steps(device, usable, dtypes,
                                                              args.repeats),
                  flag=bench_flag(device, args.repeats))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
