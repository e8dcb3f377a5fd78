"""Many runs, one launch: the optimizer's step over an array of N runs of the paper's MLP,
against N separate optimizers, HFTA's way and the bytes' floor (the contenders and the goals:
benchmarks/README.md, ``arrays``).

    python -m benchmarks arrays --runs 1 16 64 --threads 1 --ops inner --name arrays_<machine>
"""
from __future__ import annotations

from typing import Optional

from benchmarks import common, harness

import torch

from emcl_kernels import FusedEMCLOptimizer

SCHEMA = "emcl-kernels/bench_arrays/1"
CONTENDERS = ("array", "separate", "hfta", "floor")
# --ops choice -> (the optimizer's call, the CPU floor's stream_probe_ kind, the op it moves the
# bytes of in SPEC section 5's byte model)
OPS = {"inner": ("inner_step", 3, "inner_step"), "step": ("step", 2, "inner_meta_step")}
GOAL_TO_FLOOR, GOAL_FROM_RUNS = 1.15, 16          # CPU: the streams' floor, from N = 16 up
GOAL_TO_COPY, GOAL_COPY_RUNS = 1.3, 256           # GPU: a copy of the same bytes, at N = 256
HYPER = dict(meta_lr=0.1, gamma=0.1, decay=0.9, lr_mode="inverse")


def per_run_values(n: int) -> dict:
    """Each run's own learning rate and reg (a sweep's grid, spread out)."""
    return {"lr": [0.01 + 0.09 * i / max(1, n - 1) for i in range(n)],
            "reg": [1.0 + 9.0 * ((7 * i) % n) / max(1, n - 1) for i in range(n)]}


def make_array(n: Optional[int], device, gen) -> list:
    """The MLP's weights with gradients, stacked ``[n, ...]`` (one run: ``n`` None)."""
    params = []
    for s in common.mlp_shapes():
        shape = s if n is None else (n, *s)
        p = (0.1 * torch.randn(shape, generator=gen)).to(device).requires_grad_()
        p.grad = 1e-3 * torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def contenders(n: int, device, gen, call: str) -> dict:
    """Name -> one step of ``n`` runs: ``array`` (one optimizer, ``runs=n``), ``separate`` (n
    optimizers one after another) and ``hfta`` (:func:`hfta_step`)."""
    values, meta_every = per_run_values(n), 1 if call == "step" else None
    group = {"params": make_array(n, device, gen), "runs": n, **values}
    steps = [getattr(FusedEMCLOptimizer(make_array(None, device, gen), lr=values["lr"][r],
                                        reg=values["reg"][r], **HYPER, meta_every=meta_every), call)
             for r in range(n)]
    array = getattr(FusedEMCLOptimizer([group], **HYPER, meta_every=meta_every), call)

    def separate() -> None:
        for s in steps:
            s()
    return {"array": array, "separate": separate, "hfta": hfta_step(n, device, gen, call)}


def hfta_step(n: int, device, gen, call: str):
    """EMCL's update as HFTA writes its fused optimizers: per-parameter torch ops, the per-run
    hyper-parameters as [N, 1, ...] tensors broadcast against the stacked weights."""
    params = make_array(n, device, gen)
    anchors = [p.detach().clone() for p in params]
    imps = [torch.zeros_like(p) for p in params]
    values = per_run_values(n)

    def column(v, p):
        return torch.tensor(v, dtype=torch.float32, device=device).view(-1, *[1] * (p.dim() - 1))
    lrs = [column(values["lr"], p) for p in params]
    regs = [column(values["reg"], p) for p in params]
    gamma_regs = [HYPER["gamma"] * r for r in regs]
    decay, meta_lr = HYPER["decay"], HYPER["meta_lr"]

    @torch.no_grad()
    def run() -> None:
        for p, a, h, lr, reg, gr in zip(params, anchors, imps, lrs, regs, gamma_regs):
            theta = p.detach()
            theta.sub_(lr * p.grad)                                  # θ̂ = θ − β·g
            c = h * gr
            theta.sub_((c / (1 + c)) * (theta - a))                  # the proximal pull
            if call == "step":
                h.mul_(decay).add_((p.grad * a).abs_(), alpha=1 - decay)
                rate = (meta_lr / reg) / (h + 1e-8)                  # inverse mode, r = 1/λ
                a.sub_(rate * h * reg * (a - theta))
                theta.copy_(a)
    return run


def measure(n: int, op: str, device, threads: int, rounds: int, log) -> list:
    """The records of every contender at ``n`` runs: times, GB/s and ratios."""
    call, kind, byte_op = OPS[op]
    nbytes = common.bytes_per_element(byte_op, torch.float32)
    numel = n * sum(torch.Size(s).numel() for s in common.mlp_shapes())
    fns = contenders(n, device, torch.Generator().manual_seed(n), call)
    if device.type == "cpu" and common.stream_probes_available(device):
        tensors = [torch.rand(numel, device=device) for _ in range(4)]
        fns["floor"] = lambda: torch.ops.emcl.stream_probe_(*tensors, kind)
    elif device.type == "cuda":   # a copy reads and writes 8 B per fp32 element
        src, dst = (torch.rand(numel * nbytes // 8, device=device) for _ in range(2))
        fns["floor"] = lambda: dst.copy_(src)
    # about 20 ms of work per contender and round
    calls = max(1, min(50, int(2e-2 / max(numel * nbytes / 10e9, 2e-5 * n))))
    stats = {k: harness.summary(t) for k, t in harness.interleaved(fns, device, rounds, calls=calls).items()}
    log(f"  N={n:4d} {op:5s} {threads}T  "
        + "  ".join(f"{k} {v['median_ms']:8.3f}" for k, v in stats.items()) + " ms")
    floor = stats.get("floor", {}).get("median_ms")
    return [{"runs": n, "op": op, "threads": threads, "contender": name, **s,
             "elements": numel, "bytes_per_element": nbytes,
             "gbps": common.gbps(numel * nbytes, s["median_ms"] / 1e3),
             "ratio_to_separate": s["median_ms"] / stats["separate"]["median_ms"],
             "ratio_to_floor": s["median_ms"] / floor if floor else None}
            for name, s in stats.items()]


def verdicts(records: list, device) -> dict:
    """The goals, read off the records (met / missed per (op, threads, runs))."""
    out = {}
    for r in (r for r in records if r["contender"] == "array"):
        v = out[f"{r['op']} {r['threads']}T N={r['runs']}"] = {
            "not_slower_than_separate": r["ratio_to_separate"] <= 1.0}
        if device.type == "cpu" and r["runs"] >= GOAL_FROM_RUNS and r["ratio_to_floor"]:
            v["within_1.15x_of_floor"] = r["ratio_to_floor"] <= GOAL_TO_FLOOR
        if device.type == "cuda" and r["runs"] == 64:
            v["at_most_1/20_of_separate"] = r["ratio_to_separate"] <= 1 / 20
        if device.type == "cuda" and r["runs"] == GOAL_COPY_RUNS and r["ratio_to_floor"]:
            v["within_1.3x_of_copy"] = r["ratio_to_floor"] <= GOAL_TO_COPY
    return out


def plot(result: dict, path: str) -> None:
    """Per op and thread count: µs per run-step against N, one line per contender."""
    combos = sorted({(r["op"], r["threads"]) for r in result["records"]})
    with harness.figure(path, f"MLP 784-100-100-10, fp32: {result['machine']['summary']}",
                        ncols=len(combos), size=(5 * len(combos), 4), title_size=8) as axes:
        for ax, (op, threads) in zip(axes[0], combos):
            for name in CONTENDERS:
                rs = sorted((r for r in result["records"] if (r["op"], r["threads"]) == (op, threads)
                             and r["contender"] == name), key=lambda r: r["runs"])
                if rs:
                    ax.plot([r["runs"] for r in rs],
                            [r["median_ms"] / r["runs"] * 1e3 for r in rs], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(xlabel="runs N", ylabel="µs per run-step",
                   title=f"{op}, {threads} thread(s)" if result["device"] == "cpu" else op)
            ax.legend()


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results (also written to ``--out``)."""
    p = harness.parser("arrays", __doc__, "device", "threads", "out", "name", "quick", "plot",
                       threads=[1, 2], many_threads=True,
                       quick="3 rounds; on the CPU also N = 1 and 4 at one thread")
    p.add_argument("--runs", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="array widths N")
    p.add_argument("--ops", nargs="+", choices=sorted(OPS), default=sorted(OPS))
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per cell")
    args = p.parse_args(argv)
    device = harness.device_of(args.device)
    if any(n < 1 for n in args.runs):
        raise SystemExit(f"bench_arrays: --runs must be positive, got {args.runs}")
    if args.quick:
        args.rounds = 3
        if device.type == "cpu":
            args.runs, args.threads = [n for n in args.runs if n <= 4] or [1, 4], [1]
    result = harness.head("arrays", argv, device, schema=SCHEMA)
    print(f"bench_arrays on {result['machine']['summary']} ({device})")
    records = []
    for t in args.threads if device.type == "cpu" else [None]:
        with harness.threads(t):
            for op in args.ops:
                for n in args.runs:
                    records += measure(n, op, device, torch.get_num_threads(), args.rounds, print)
    result.update(records=records, verdicts=verdicts(records, device))
    stem = args.name or f"arrays_{device.type}" + ("_quick" if args.quick else "")
    return harness.finish(result, args.out, stem, plot=plot, no_plot=args.no_plot)
