"""The ``triton`` backend's host path on a machine without a GPU (``python -m benchmarks host
--triton``): each kernel launch taken out (:class:`JitWithoutLaunch`, :class:`NoLaunchKernel`),
everything else as on the GPU. What is left out and what is timed: benchmarks/README.md,
``host --triton``. The kernels must be imported compiled (no ``TRITON_INTERPRET``).
"""
from __future__ import annotations

import os
import statistics
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
    Python of Triton's ``JITFunction.run`` up to the launcher (benchmarks/README.md, ``host
    --triton``) and returns a :class:`NoLaunchKernel`, one per Triton cache key."""

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
    """Every number of ``host --triton`` (benchmarks/README.md), for the ``emcl_kernels`` this
    process imports."""
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
    from benchmarks.common import relative
    import emcl_kernels
    out = {"emcl_kernels": relative(os.path.dirname(emcl_kernels.__file__)),
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
