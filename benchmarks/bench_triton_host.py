"""Host time of the ``triton`` backend's step on a machine without a GPU: the launches taken
out, everything else as on the GPU.

    PYTHONPATH=.:python python benchmarks/bench_triton_host.py --out host.json
    PYTHONPATH=.:python python benchmarks/bench_triton_host.py --compare BEFORE_TREE \\
        --processes 3 --out benchmarks/results/triton_host_ab_cpu.json

Each kernel (``triton_kernels.emcl_step_kernel``, ``emcl_check_kernel``) is replaced by
:class:`JitWithoutLaunch`: called as ``kernel[grid](*args, **constexprs)``, it runs the part of
Triton's ``JITFunction.run`` that is Python and needs no GPU, with Triton's own code for a CUDA
target (sm_90): the argument binder and its specialization of every argument, the cache key,
the cache look-up and the check of the kernel's globals; then, instead of the launcher, it
returns a compiled kernel whose launcher does nothing (:class:`NoLaunchKernel`). A backend that
keeps compiled kernels and calls their launchers itself ([note: fast launch] in
``emcl_kernels/backends/triton.py``) calls that no-op launcher after its first launch of each
key. Left out of both: the launcher itself (``CompiledKernel.run``: the same call either way,
Python in Triton's ``CudaLauncher`` and the C launch), and, of the JIT's path only, its queries
of the current device and stream and the launch metadata it builds: the JIT path measured here
is cheaper than the real one, so the difference is a lower bound of what the fast path saves.
The backend runs on CPU tensors with its kernels imported compiled (no ``TRITON_INTERPRET``),
so its CUDA-only calls (the stream query, ``record_stream`` bookkeeping) are not timed.

Timed, per layout (the paper's MLP 784-100-100-10: 6 tensors; 1,000 x 4,096 fp32), one thread:

- ``backend_step``: ``step(op=cadence)`` of the backend on one group's tensors, with and without
  ``check`` (two launches and one);
- ``optimizer_step``: ``FusedEMCLOptimizer(backend="triton").step()`` with its default
  ``check_finite=True``, and with ``check_finite=False``: the optimizer's own path above the
  backend (``step`` -> ``Runtime.step`` -> ``run`` -> ``backend.step``), same gradients every step;
  ``optimizer_step_new_grads``: gradients that change every step (a pool of three sets, as
  autograd allocates them anew; the time of assigning them subtracted);
- ``plan_layer``: ``optimizer_step`` with the backend's ``step`` a no-op (what the plan layer
  costs, whatever the backend); of it, ``optimizer_step_unwrapped``: the optimizer's ``_step``
  (the step without torch's ``Optimizer.step`` wrapper: profiler record, hooks, no-grad), and
  ``runtime_gather``: ``Runtime.gather`` alone (the plan key and the gradients' lists);
  ``plan_layer_new_grads``: the plan layer with gradients that change every step;
- ``optimizer_step_alternating``: two optimizers over the same parameters (``check_finite``
  on and off), stepped in turn in blocks of ``--block`` steps, per step: what
  ``bench_step.py`` does with its contenders, and what a comparison or a method that keeps an
  optimizer per task does; ``state_tables_per_switch``: state tables the backend made each
  time the other optimizer took over (0 when each keeps its own);
- ``optimizer_inner_then_meta``: EMCL's own loop on one optimizer, ``inner_step()``
  ``INNER_PER_META`` times then ``meta_step()``, per update; ``checks_per_update``: how many of
  those calls ran the launcher checks ([note: checked plans]: 0 once each update is recorded).

Per number: the median and the fastest of ``--rounds`` rounds of ``--steps`` calls, in wall
time (``perf_counter``) and in the process's CPU time (less inflated by other jobs on a shared
machine). ``--compare BEFORE_TREE`` runs this script in alternating fresh processes against
``BEFORE_TREE``'s ``emcl_kernels`` and this tree's (``--processes`` of each, the order swapped
every other pair), so that both see the same load, and writes both sets with the load average.

``--interleave BEFORE_FILE`` compares two versions of the backend module in one process:
``BEFORE_FILE`` (a ``triton.py`` of another checkout, loaded as a module of its own, with its
own caches, over this tree's other modules) against this tree's, block by block on the same
tensors and the same optimizer (its plans handed one backend, then the other), the order
swapped every round; it reports each version's median per block and the median of the
per-round ratios (after / before), which a load that changes from round to round disturbs
least. Only for versions whose other ``emcl_kernels`` files are the same.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

LAYOUTS = {"mlp": [(100, 784), (100,), (100, 100), (100,), (10, 100), (10,)],
           "many": [(4096,)] * 1000}
_MISSING = object()
INNER_PER_META = 5        # optimizer_inner_then_meta: inner steps before each meta step


class NoLaunchKernel:
    """A compiled kernel whose launcher does nothing (the launch taken out). It has what the
    backend's fast launch reads of a ``CompiledKernel``: ``function``, ``packed_metadata``,
    ``src.signature`` (every parameter, as Triton >= 3.3 has it) and ``run``."""

    class _Src:
        def __init__(self, n):
            self.signature = {i: None for i in range(n)}

    def __init__(self, n_params):
        self.function = 1
        self.packed_metadata = ()
        self.src = self._Src(n_params)
        self.launches = 0

    def run(self, *args):
        self.launches += 1


class JitWithoutLaunch:
    """Stands for the ``@triton.jit`` kernel ``jit``: ``kernel[grid](*args, **kwargs)`` runs the
    Python of Triton's ``JITFunction.run`` up to the launcher (see the module docstring) and
    returns a :class:`NoLaunchKernel`, one per Triton cache key."""

    def __init__(self, jit):
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import compute_cache_key, create_function_from_signature
        self.jit, self.knobs, self.compute_cache_key = jit, knobs, compute_cache_key
        self.binder = create_function_from_signature(
            jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
        self.kernel_cache, self.key_cache = {}, {}
        self.pre_run_hooks = []
        jit.cache_key                     # computes the globals the JIT checks at every call
        self.calls = 0

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def run(self, *args, grid, **kwargs):
        self.calls += 1
        kwargs["debug"] = kwargs.get("debug", self.jit.debug) or self.knobs.runtime.debug
        kwargs["instrumentation_mode"] = self.knobs.compilation.instrumentation_mode
        bound, specialization, options = self.binder(*args, **kwargs)
        key = self.compute_cache_key(self.key_cache, specialization, options)
        kernel = self.kernel_cache.get(key)
        if kernel is None:
            kernel = self.kernel_cache[key] = NoLaunchKernel(len(specialization))
        for (name, _), (val, globals_dict) in self.jit.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != val:
                raise RuntimeError(f"global {name} changed")
        kernel.run(grid[0], 1, 1, 0, kernel.function, kernel.packed_metadata, None, None, None,
                   *bound.values())
        return kernel


def _rounds(fn, steps, rounds, subtract=None):
    """(wall, cpu) microseconds per call of each round; ``subtract``: a function whose time per
    call (measured right after, the same number of calls) is taken off."""
    wall, cpu = [], []
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            fn()
        w, c = time.perf_counter() - w, time.process_time() - c
        if subtract is not None:
            w2, c2 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                subtract()
            w -= time.perf_counter() - w2
            c -= time.process_time() - c2
        wall.append(w / steps * 1e6)
        cpu.append(c / steps * 1e6)
    return {"median_us": statistics.median(wall), "fastest_us": min(wall),
            "cpu_median_us": statistics.median(cpu), "cpu_fastest_us": min(cpu),
            "rounds_us": [round(x, 2) for x in wall]}


def _per(times: dict, n: int) -> dict:
    """:func:`_rounds`' record of a call that makes ``n`` steps, per step."""
    return {k: ([round(x / n, 2) for x in v] if isinstance(v, list) else v / n)
            for k, v in times.items()}


class _Layout:
    """One layout's tensors for both harnesses: parameters with three gradient sets to swap in
    (``assign``), and one group's state and arguments for a backend call on the first set."""

    def __init__(self, shapes, gen):
        from emcl_kernels.interface import COUNTER_FIELDS, HYPER_FIELDS
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01) for s in shapes]
        self.pool = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(3)]
        self.i = 0
        self.assign(0)
        self.anchors = [p.detach().clone() for p in self.params]
        self.importances = [torch.rand(s, generator=gen) + 0.1 for s in shapes]
        self.hyper = torch.tensor([{"lr_scale": 1.0}.get(k, 0.1) for k in HYPER_FIELDS],
                                  dtype=torch.float64)
        self.counters = torch.zeros(len(COUNTER_FIELDS), dtype=torch.int64)
        self.steps = torch.zeros(len(shapes))
        self.grads = [p.grad for p in self.params]
        self.plist = [p.detach() for p in self.params]

    def assign(self, i: int) -> None:
        for p, g in zip(self.params, self.pool[i % 3]):
            p.grad = g

    def backend_step(self, mod, check: bool) -> None:
        """One call of backend module ``mod`` on the group's tensors."""
        from emcl_kernels.interface import IMPORTANCE, LR_MODE, OP
        mod.step(self.plist, self.grads, self.anchors, self.importances, [], self.steps,
                 self.hyper, self.counters, op=OP["cadence"], prox=True,
                 importance=IMPORTANCE["taylor"], lr_mode=LR_MODE["inverse"], meta_every=1,
                 check=check, finalize=True)

    def swap(self) -> None:
        """The next gradient set (what a new backward pass hands the step)."""
        self.i += 1
        self.assign(self.i)

    def new_grads_step(self, opt):
        """A step of ``opt`` after new gradients (time it with ``swap`` subtracted)."""
        def fresh():
            self.swap()
            opt.step()
        return fresh


def measure(args) -> dict:
    """Every number of the module docstring, for the ``emcl_kernels`` this process imports."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the kernels must be imported compiled")
    torch.set_num_threads(1)
    from emcl_kernels import FusedEMCLOptimizer
    from emcl_kernels import plan as P
    from emcl_kernels.backends import triton as TB
    from emcl_kernels.interface import OP
    if TB._kernels is None:
        raise SystemExit(f"triton backend unavailable: {TB._IMPORT_ERROR}")
    K = TB._kernels
    K.emcl_step_kernel = JitWithoutLaunch(K.emcl_step_kernel)
    K.emcl_check_kernel = JitWithoutLaunch(K.emcl_check_kernel)
    cpu = torch.device("cpu")
    # the backend on CPU tensors with compiled kernels (never launched): resolved by hand
    P._RESOLVED[("triton", cpu)] = TB
    import emcl_kernels
    out = {"emcl_kernels": os.path.dirname(emcl_kernels.__file__),
           "fast_launch": getattr(TB, "FAST_LAUNCH", None), "layouts": {}}
    gen = torch.Generator().manual_seed(0)
    for name, shapes in LAYOUTS.items():
        steps = args.steps if name == "mlp" else max(20, args.steps // 20)
        res = out["layouts"][name] = {}
        lay = _Layout(shapes, gen)
        # the backend alone, on one group's tensors
        for check in (True, False):
            def call(check=check):
                lay.backend_step(TB, check)
            call()
            res[f"backend_step{'' if check else '_unchecked'}"] = _rounds(call, steps, args.rounds)
        # the optimizer's path
        for check in (True, False):
            opt = FusedEMCLOptimizer(lay.params, meta_every=1, backend="triton",
                                     check_finite=check)
            opt.step()
            suffix = "" if check else "_unchecked"
            res["optimizer_step" + suffix] = _rounds(opt.step, steps, args.rounds)
            if check:
                fresh = lay.new_grads_step(opt)
                res["optimizer_step_new_grads"] = _rounds(fresh, steps, args.rounds, lay.swap)
                lay.assign(0)
                opt.step()
                # where the optimizer's own time goes (private names: skipped where absent)
                if hasattr(opt, "_step"):        # step() without torch's Optimizer wrapper
                    res["optimizer_step_unwrapped"] = _rounds(
                        lambda: opt._step(OP["cadence"], 1, None, None), steps, args.rounds)
                if hasattr(opt._runtime, "gather"):  # the plan key and the gradients' lists
                    res["runtime_gather"] = _rounds(opt._runtime.gather, steps, args.rounds)
                backend = opt._runtime.plans[0].backend
                real, backend.step = backend.step, (lambda *a, **k: None)
                try:
                    res["plan_layer"] = _rounds(opt.step, steps, args.rounds)
                    res["plan_layer_new_grads"] = _rounds(fresh, steps, args.rounds, lay.swap)
                finally:
                    backend.step = real
        # two optimizers over the same parameters, in turn, a block each
        pair = [FusedEMCLOptimizer(lay.params, meta_every=1, backend="triton",
                                   check_finite=check) for check in (True, False)]
        lay.assign(0)
        for opt in pair:
            opt.step()
        block = args.block

        def alternate():
            for opt in pair:
                for _ in range(block):
                    opt.step()

        built = TB.build_counts["state"]
        calls = max(1, steps // (2 * block))
        res["optimizer_step_alternating"] = _per(_rounds(alternate, calls, args.rounds),
                                                 2 * block)
        res["state_tables_per_switch"] = ((TB.build_counts["state"] - built)
                                          / (2 * calls * args.rounds))
        # EMCL's loop: inner steps, then a meta step, on one optimizer
        opt = FusedEMCLOptimizer(lay.params, backend="triton")
        lay.assign(0)

        def cycle():
            for _ in range(INNER_PER_META):
                opt.inner_step()
            opt.meta_step()

        cycle()
        cycle()
        skipped = TB.lookups["checked"]
        calls = max(1, steps // (INNER_PER_META + 1))
        res["optimizer_inner_then_meta"] = _per(_rounds(cycle, calls, args.rounds),
                                                INNER_PER_META + 1)
        updates = calls * args.rounds * (INNER_PER_META + 1)
        res["checks_per_update"] = 1 - (TB.lookups["checked"] - skipped) / updates
        res["launches"] = {"jit_stand_in_calls": K.emcl_step_kernel.calls
                           + K.emcl_check_kernel.calls,
                           "fast": dict(getattr(TB, "launch_counts", {}))}
        print(f"{name:5s} " + "  ".join(f"{k} {v['median_us']:.1f}" for k, v in res.items()
                                        if isinstance(v, dict) and "median_us" in v),
              file=sys.stderr)
    return out


def _load_module(path: str, name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def interleave(args) -> dict:
    """``--interleave``: both backend modules in this process, alternating block by block."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the kernels must be imported compiled")
    torch.set_num_threads(1)
    from emcl_kernels import FusedEMCLOptimizer
    from emcl_kernels import plan as P
    from emcl_kernels.backends import triton as after
    before = _load_module(os.path.abspath(args.interleave), "emcl_triton_before")
    K = after._kernels
    if before._kernels is not K:
        raise SystemExit("the two modules do not share the kernels module")
    K.emcl_step_kernel = JitWithoutLaunch(K.emcl_step_kernel)
    K.emcl_check_kernel = JitWithoutLaunch(K.emcl_check_kernel)
    cpu = torch.device("cpu")
    P._RESOLVED[("triton", cpu)] = after
    versions = {"before": before, "after": after}
    out = {"before_file": os.path.abspath(args.interleave), "after_file": after.__file__,
           "fast_launch": after.FAST_LAUNCH, "layouts": {}}
    gen = torch.Generator().manual_seed(0)
    for name, shapes in LAYOUTS.items():
        steps = args.steps if name == "mlp" else max(20, args.steps // 20)
        lay = _Layout(shapes, gen)
        opt = FusedEMCLOptimizer(lay.params, meta_every=1, backend="triton")
        opt.step()

        def calls(mod):
            return {"backend_step": (lambda: lay.backend_step(mod, True), None),
                    "optimizer_step": (opt.step, None),
                    "optimizer_step_new_grads": (lay.new_grads_step(opt), lay.swap)}

        table = {label: calls(mod) for label, mod in versions.items()}
        times = {label: {what: [] for what in table[label]} for label in versions}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for label in order:
                for plan in opt._runtime.plans:
                    plan.backend = versions[label]
                lay.assign(0)
                for what, (fn, sub) in table[label].items():
                    fn()                                  # this version's tables, warm
                    times[label][what].append(_rounds(fn, steps, 1, sub))
            lay.assign(0)
        res = out["layouts"][name] = {}
        for what in table["after"]:
            b = [x["median_us"] for x in times["before"][what]]
            a = [x["median_us"] for x in times["after"][what]]
            bc = [x["cpu_median_us"] for x in times["before"][what]]
            ac = [x["cpu_median_us"] for x in times["after"][what]]
            res[what] = {"before_median_us": statistics.median(b),
                         "after_median_us": statistics.median(a),
                         "before_cpu_median_us": statistics.median(bc),
                         "after_cpu_median_us": statistics.median(ac),
                         "ratio_median": statistics.median(y / x for x, y in zip(b, a)),
                         "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(
                             [y / x for x, y in zip(b, a)], n=4)],
                         "cpu_ratio_median": statistics.median(y / x for x, y in zip(bc, ac)),
                         "before_blocks_us": [round(x, 2) for x in b],
                         "after_blocks_us": [round(x, 2) for x in a]}
            print(f"{name:5s} {what:26s} before {res[what]['before_median_us']:9.1f} us  "
                  f"after {res[what]['after_median_us']:9.1f} us  ratio "
                  f"{res[what]['ratio_median']:.3f} (cpu {res[what]['cpu_ratio_median']:.3f})",
                  file=sys.stderr)
    return out


def compare(args) -> dict:
    """Alternating fresh processes of ``--compare``'s tree (before) and this one (after)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": os.path.abspath(args.compare), "after": here}
    runs = {"before": [], "after": []}
    load = []
    for i in range(args.processes):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for label in order:
            tree = trees[label]
            env = dict(os.environ, PYTHONPATH=f"{tree}:{os.path.join(tree, 'python')}")
            env.pop("TRITON_INTERPRET", None)
            load.append(os.getloadavg()[0])
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--steps",
                                   str(args.steps), "--rounds", str(args.rounds), "--block",
                                   str(args.block), "--json"],
                                  env=env, cwd=tree, capture_output=True, text=True, check=True)
            rec = json.loads(proc.stdout)
            if not rec["emcl_kernels"].startswith(tree):
                raise SystemExit(f"the {label} process imported {rec['emcl_kernels']}, not "
                                 f"{tree}")
            runs[label].append(rec)
            print(f"{label}: " + proc.stderr.strip().replace("\n", f"\n{label}: "),
                  file=sys.stderr)
    summary = {}
    for layout in LAYOUTS:
        summary[layout] = {}
        for what, value in runs["after"][0]["layouts"][layout].items():
            if what == "launches":
                continue
            if not isinstance(value, dict):          # a count, not a time
                summary[layout][what] = {label: [r["layouts"][layout][what] for r in runs[label]]
                                         for label in ("before", "after")}
                continue
            row = {}
            for label in ("before", "after"):
                med = [r["layouts"][layout][what]["median_us"] for r in runs[label]]
                fast = [r["layouts"][layout][what]["fastest_us"] for r in runs[label]]
                cpu = [r["layouts"][layout][what]["cpu_median_us"] for r in runs[label]]
                row[label] = {"median_us": round(statistics.median(med), 2),
                              "fastest_us": round(min(fast), 2),
                              "cpu_median_us": round(statistics.median(cpu), 2),
                              "process_medians_us": [round(x, 2) for x in med]}
            row["after_over_before"] = round(row["after"]["median_us"]
                                             / row["before"]["median_us"], 3)
            summary[layout][what] = row
    return {"summary": summary, "load_average_at_each_process": load, "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="calls per round (MLP; /20 many)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block", type=int, default=10,
                    help="steps of one optimizer before the other's (optimizer_step_alternating;"
                         " bench_step's block on a GPU is 10-20)")
    ap.add_argument("--compare", metavar="BEFORE_TREE", default=None,
                    help="a checkout whose emcl_kernels is the 'before' (its _C built or copied)")
    ap.add_argument("--processes", type=int, default=3, help="with --compare: of each version")
    ap.add_argument("--interleave", metavar="BEFORE_FILE", default=None,
                    help="a triton.py to compare with this tree's in one process, block by "
                         "block")
    ap.add_argument("--json", action="store_true", help="print the record as JSON on stdout")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="", help="recorded in the file")
    args = ap.parse_args()
    head = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "machine": platform.node(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": 1, "torch": torch.__version__, "note": args.note,
            "steps": args.steps, "rounds": args.rounds, "load_before": list(os.getloadavg())}
    try:
        import triton
        head["triton"] = triton.__version__
    except ImportError:
        pass
    if args.interleave:
        body = interleave(args)
    else:
        body = compare(args) if args.compare else measure(args)
    res = dict(head, **body)
    res["load_after"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
