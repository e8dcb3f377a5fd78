"""Host time per ``step()`` of FusedEMCLOptimizer on the CPU, and the part of it spent before
the backend call (the plan look-up and the per-step key check), on the MLP 784-100-100-10 and
on 1,000 x 4,096 fp32 tensors (one thread).

The key check is timed as ``step()`` minus the same backend calls made directly on the
optimizer's plans, so it runs against any version of the optimizer that keeps its plans in
``opt._plans`` or ``opt._runtime.plans``; where there is a ``Runtime``, ``gather_us`` also times
its ``gather()`` alone (the key check and the gradients' lists: host time only, so it is far
less noisy than the difference of two step timings on a loaded host).

The key check's share of a step (the budget: at most 10 %) is measured in one process:
``step()`` as it is against ``step()`` with ``Runtime.gather`` replaced by a gather that trusts
the cached plans (the gradients' lists only, no key), alternating block by block on the same
optimizer, so that both see the same load (``keyed_step_us``, ``unkeyed_step_us``,
``key_share``).

``--host-only`` times the host's part of a step alone, against any version of the optimizer:
the backend's ``step`` replaced by a function that does nothing, so the memory traffic of the
kernels leaves the number alone (the fastest round, ``*_fastest_us``, is the one least
disturbed by other jobs on a shared machine); once with the same
gradient tensors every step and once with gradients that change every step (a pool of three
sets, as autograd allocates them anew), for alternating runs of two versions:

    PYTHONPATH=.:python python benchmarks/bench_plan_key.py --out benchmarks/results/plan_key_ab_cpu.json
    PYTHONPATH=.:python python benchmarks/bench_plan_key.py --host-only --out host.json

``--key-passes`` times the host's part of a step with the key's C++ passes against the same
key in Python passes alone (as without the extension), alternating in one process:

    PYTHONPATH=.:python python benchmarks/bench_plan_key.py --key-passes \\
        --out benchmarks/results/plan_key_native_ab_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from emcl_kernels import FusedEMCLOptimizer
from emcl_kernels.interface import OP
from emcl_kernels.plan import new_counters

LAYOUTS = {"mlp": [(100, 784), (100,), (100, 100), (100,), (10, 100), (10,)],
           "many": [(4096,)] * 1000}


def _plans(opt):
    runtime = getattr(opt, "_runtime", None)
    return runtime.plans if runtime is not None else opt._plans


def _direct(opt, op):
    """The backend calls of one step, made directly on the cached plans."""
    plans = _plans(opt)
    grads = [[p.grad for p in plan.sources] for plan in plans]
    counters = {plan.device: new_counters(plan.device) for plan in plans}

    def call():
        for plan, g in zip(plans, grads):
            plan.backend.step(plan.params, g, plan.anchors, plan.importances, plan.meta_lrs,
                              plan.steps, plan.hyper, counters[plan.device], op=op,
                              prox=plan.prox, importance=plan.importance,
                              lr_mode=plan.lr_mode, meta_every=1, check=True, finalize=True,
                              grad_scale=None, found_inf=None)
    return call


def _unkeyed_gather(runtime):
    """``Runtime.gather`` without the key: the cached plans and this step's gradients."""
    def gather():
        plans = runtime.plans
        return plans, [[p.grad for p in plan.sources] for plan in plans]
    return gather


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
    gen = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    out = {}
    for name, shapes in LAYOUTS.items():
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.01).to(device))
                  for s in shapes]
        pool = [[(torch.randn(p.shape, generator=gen) * 1e-3).to(device) for p in params]
                for _ in range(3)]
        for p, g in zip(params, pool[0]):
            p.grad = g
        opt = FusedEMCLOptimizer(params, meta_every=1, backend=args.backend)
        opt.step()
        backend = _plans(opt)[0].backend
        real = backend.step
        backend.step = lambda *a, **k: None
        n = args.steps if name == "mlp" else max(40, args.steps // 10)
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

        try:
            same, changing, assign = [], [], []
            for _ in range(args.rounds):
                for p, g in zip(params, pool[0]):
                    p.grad = g
                same.append(_median_us(opt.step, n))
                changing.append(_median_us(fresh, n))
                assign.append(_median_us(swap_only, n))
        finally:
            backend.step = real
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


def key_passes(args) -> dict:
    """Host time of ``step()`` (the backend call a no-op) with the plan key's C++ passes
    (``_C.plan_grads``, ``_C.identical``, ``_C.items_are``) and with its Python passes alone,
    alternating round by round in one process on the same optimizer, so both see the same
    load; the same gradients every step and gradients that change every step (the time of
    assigning them subtracted)."""
    from emcl_kernels import plan as P
    if P._plan_grads is None:
        raise SystemExit("--key-passes needs the compiled extension (emcl_kernels._C)")
    variants = {"native": (P._plan_grads, P._identical, P._items_are),
                "python": (None, P._py_identical, P._py_items_are)}
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    out = {}
    try:
        for name, shapes in LAYOUTS.items():
            params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.01).to(device))
                      for s in shapes]
            pool = [[(torch.randn(p.shape, generator=gen) * 1e-3).to(device) for p in params]
                    for _ in range(3)]
            opt = FusedEMCLOptimizer(params, meta_every=1, backend=args.backend)
            n = args.steps if name == "mlp" else max(40, args.steps // 10)
            times = {v: {"same": [], "changing": []} for v in variants}

            def assign(i):
                for p, g in zip(params, pool[i % 3]):
                    p.grad = g

            for r in range(2 * args.rounds):
                order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                for label in order:
                    P._plan_grads, P._identical, P._items_are = variants[label]
                    assign(0)
                    opt._runtime.plans = None   # built again, with this variant's key
                    opt.step()
                    backend = opt._runtime.plans[0].backend
                    real, backend.step = backend.step, (lambda *a, **k: None)
                    try:
                        t = time.perf_counter()
                        for _ in range(n):
                            opt.step()
                        times[label]["same"].append((time.perf_counter() - t) / n * 1e6)
                        t = time.perf_counter()
                        for i in range(n):
                            assign(i)
                            opt.step()
                        stepped = time.perf_counter() - t
                        t = time.perf_counter()
                        for i in range(n):
                            assign(i)
                        times[label]["changing"].append(
                            (stepped - (time.perf_counter() - t)) / n * 1e6)
                    finally:
                        backend.step = real
            out[name] = {v: {m: {"min": min(x), "median": statistics.median(x), "rounds": x}
                             for m, x in d.items()} for v, d in times.items()}
            for v in variants:
                print(f"{name:5s} {v:6s} key passes: same grads "
                      f"{out[name][v]['same']['min']:7.1f} us (fastest round), "
                      f"{out[name][v]['same']['median']:7.1f} (median); changing grads "
                      f"{out[name][v]['changing']['min']:7.1f}, "
                      f"{out[name][v]['changing']['median']:7.1f}")
    finally:
        P._plan_grads, P._identical, P._items_are = variants["native"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="auto", help="default: auto (cpu on the CPU)")
    ap.add_argument("--device", default="cpu", help="cuda: only with --host-only")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="", help="recorded in the file")
    ap.add_argument("--host-only", action="store_true",
                    help="the host's part of a step alone (the backend call a no-op)")
    ap.add_argument("--key-passes", action="store_true",
                    help="the host's part of a step with the key's C++ passes against its "
                         "Python passes alone, alternating in one process")
    args = ap.parse_args()
    if args.key_passes:
        res = {"what": key_passes.__doc__.split("\n\n")[0].replace("\n    ", " "),
               "backend": args.backend, "device": args.device, "threads": 1,
               "machine": platform.node(),
               "torch": torch.__version__, "note": args.note,
               "load_before": list(os.getloadavg())}
        res["layouts"] = key_passes(args)
        res["load_after"] = list(os.getloadavg())
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    if torch.device(args.device).type != "cpu" and not (args.host_only or args.key_passes):
        ap.error("--device other than cpu times the host alone: add --host-only or "
                 "--key-passes")
    if args.host_only:
        res = {"backend": args.backend, "device": args.device, "threads": 1,
               "machine": platform.node(),
               "torch": torch.__version__, "note": args.note,
               "load_before": list(os.getloadavg()), "layouts": host_only(args)}
        res["load_after"] = list(os.getloadavg())
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    results = {"backend": args.backend, "threads": 1, "machine": platform.node(),
               "load_before": list(os.getloadavg()), "layouts": {}}
    for name, shapes in LAYOUTS.items():
        params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt = FusedEMCLOptimizer(params, meta_every=1, backend=args.backend)
        opt.step()
        direct = _direct(opt, OP["inner_meta"])  # the pass of a due cadence step
        n = args.steps if name == "mlp" else max(20, args.steps // 20)
        steps, calls = [], []
        for _ in range(args.rounds):     # interleaved, so both see the same load
            steps.append(_median_us(opt.step, n))
            calls.append(_median_us(direct, n))
        s, c = statistics.median(steps), statistics.median(calls)
        results["layouts"][name] = {"step_us": s, "backend_call_us": c, "overhead_us": s - c,
                                    "step_rounds_us": steps, "call_rounds_us": calls}
        runtime = getattr(opt, "_runtime", None)
        if runtime is not None:  # the key check and the gathering of the gradients alone: host
            keys = [_median_us(runtime.gather, n) for _ in range(args.rounds)]  # time only
            results["layouts"][name].update(gather_us=statistics.median(keys),
                                            gather_rounds_us=keys)
            keyed, unkeyed = [], []
            for _ in range(args.rounds * 2):   # alternating blocks, the same optimizer
                keyed.append(_median_us(opt.step, n))
                runtime.gather = _unkeyed_gather(runtime)
                try:
                    unkeyed.append(_median_us(opt.step, n))
                finally:
                    del runtime.gather         # the class's method again
            k, u = statistics.median(keyed), statistics.median(unkeyed)
            results["layouts"][name].update(
                keyed_step_us=k, unkeyed_step_us=u, key_share=(k - u) / k,
                keyed_rounds_us=keyed, unkeyed_rounds_us=unkeyed)
            print(f"{name:5s} step() with the key {k:9.1f} us, without {u:9.1f} us: "
                  f"the key is {100 * (k - u) / k:5.1f} % of a step")
        print(f"{name:5s} step() {s:9.1f} us   backend call {c:9.1f} us   "
              f"overhead {s - c:8.1f} us   gather() "
              f"{results['layouts'][name].get('gather_us', float('nan')):8.1f} us")
    results["load_after"] = list(os.getloadavg())
    results["torch"] = torch.__version__
    results["note"] = args.note
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
