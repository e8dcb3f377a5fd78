"""What the non-finite gradient check costs: each backend's own read-only pass over the
gradients (``check_finite``) alone, and the optimizer's step with ``check_finite=True`` against
the same step with ``check_finite=False``, fp32 and bf16.

    python -m benchmarks check [--device cpu|cuda] [--threads 1] [--repeats 20] [--numel 16777216]

How it is timed: benchmarks/README.md, ``check``.
"""
from __future__ import annotations

import statistics

import torch

from benchmarks import common, harness
from emcl_kernels import FusedEMCLOptimizer, available_backends
from emcl_kernels.backends import BackendUnavailableError, get_backend
from emcl_kernels.plan import new_counters


def _size_name(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}"


def _uneven(total: int, count: int) -> list:
    sizes = [(i * 104_729) % 600_000 + 30_000 for i in range(count)]
    scale = total / sum(sizes)
    sizes = [max(1, int(s * scale)) for s in sizes]
    sizes[-1] += total - sum(sizes)
    return sizes


def _params(sizes, dtype, device):
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in sizes:
        p = torch.nn.Parameter((0.1 * torch.randn(n, generator=gen)).to(device=device,
                                                                         dtype=dtype))
        p.grad = (1e-3 * torch.randn(n, generator=gen)).to(device=device, dtype=dtype)
        out.append(p)
    return out


def run(device: torch.device, backends: list, repeats: int, numel: int) -> list:
    """One record per layout, dtype and backend (each timed with ``repeats`` interleaved runs)."""
    rows = []
    layouts = {f"one tensor of {_size_name(numel)}": [numel],
               f"50 tensors, {_size_name(numel)} in all": _uneven(numel, 50)}
    for layout, sizes in layouts.items():
        for dtype in (torch.float32, torch.bfloat16):
            for backend in backends:
                mod = get_backend(backend, device)
                grads = [p.grad for p in _params(sizes, dtype, device)]
                counters = new_counters(device)
                opts = {}
                for call in ("inner_step", "step"):
                    for check in (True, False):
                        ps = _params(sizes, dtype, device)
                        opt = FusedEMCLOptimizer(ps, backend=backend, check_finite=check,
                                                 meta_every=1)
                        opts[(call, check)] = getattr(opt, call)
                fns = {"check alone": lambda: mod.check_finite(grads, counters)}
                fns.update({f"{call} {'check' if check else 'no check'}": fn
                            for (call, check), fn in opts.items()})
                t = {k: (min(v), statistics.median(v))
                     for k, v in harness.interleaved(fns, device, repeats).items()}
                check_s = t["check alone"][0]
                row = dict(device=str(device), backend=backend, layout=layout,
                           tensors=len(sizes), elements=numel, dtype=str(dtype)[6:],
                           repeats=repeats, check_ms=check_s * 1e3,
                           check_median_ms=t["check alone"][1] * 1e3,
                           check_read_gbps=numel * grads[0].element_size() / check_s / 1e9)
                for call in ("inner_step", "step"):
                    on, off = t[f"{call} check"][0], t[f"{call} no check"][0]
                    row[f"{call}_check_ms"] = on * 1e3
                    row[f"{call}_no_check_ms"] = off * 1e3
                    row[f"{call}_overhead_pct"] = 100.0 * (on - off) / off
                rows.append(row)
                print(f"{backend:7s} {row['dtype']:8s} {layout:24s} check {row['check_ms']:8.3f} ms "
                      f"({row['check_read_gbps']:5.1f} GB/s)  inner_step +{row['inner_step_overhead_pct']:5.1f} %  "
                      f"step +{row['step_overhead_pct']:5.1f} %", flush=True)
    return rows


def main(argv=None) -> dict:
    """Run the benchmark; return the results (also written to ``--out``)."""
    ap = harness.parser("check", __doc__, "device", "threads", "out", device="cpu", threads=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements per layout (>= 50)")
    ap.add_argument("--backends", default="", help="comma-separated; default: every available "
                    "backend for the device but the reference")
    args = ap.parse_args(argv)
    if args.numel < 50 or args.repeats < 1:
        ap.error("--numel must be at least 50 (the second layout's tensors) and --repeats >= 1")
    torch.set_num_threads(args.threads)
    device = harness.device_of(args.device)
    names = [b for b in args.backends.split(",") if b] or [
        b for b in available_backends() if b != "reference"]
    backends = []
    for b in names:
        try:
            get_backend(b, device)
            backends.append(b)
        except (BackendUnavailableError, ValueError) as exc:
            print(f"skipping {b}: {exc}")
    result = harness.head("check", argv, device)
    load_before = common.load_average()
    rows = run(device, backends, args.repeats, args.numel)
    result.update(threads=args.threads, load_average_before=load_before,
                  load_average_after=common.load_average(), records=rows,
                  headline={f"{r['backend']} {r['dtype']} {r['layout']}": {
                      "check_ms": round(r["check_ms"], 3),
                      "check_read_gbps": round(r["check_read_gbps"], 2),
                      "inner_step_overhead_pct": round(r["inner_step_overhead_pct"], 1),
                      "step_overhead_pct": round(r["step_overhead_pct"], 1)} for r in rows})
    return harness.finish(result, args.out, f"check_finite_{common.utc_stamp()}_{device.type}")
