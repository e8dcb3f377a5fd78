"""Kernel benchmark: every available backend on the same inputs, in one run, against the memory
roof measured in the same run.

    python -m benchmarks kernels            # full run (~10 min on a 2-core CPU)
    python -m benchmarks kernels --quick    # under a minute on a 2-core CPU
    python -m benchmarks kernels --table benchmarks/results/kernels_epyc-2core_1thread.json \
        --sizes 24                          # the tables of a results file (docs/performance.md)

The layouts, the input rotation, the byte model and the roof: benchmarks/README.md, ``kernels``
and "The memory roof". A record above the roof is a bug in the benchmark or the byte model,
never a result: the run says so.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from benchmarks import common, harness  # (puts the repository on sys.path)

import torch

from emcl_kernels import functional as F

SCHEMA = "emcl-kernels/bench_kernels/1"
LAYOUT_CHOICES = ("single", "mlp", "resnet18", "many")
LAYOUT_NAMES = {"mlp": "mlp-2x100", "resnet18": "resnet18-reduced", "many": "many-1000x4096"}
MANY_TENSORS, MANY_NUMEL = 1000, 4096


# ---------------------------------------------------------------------------------------------
# Settings of a run
# ---------------------------------------------------------------------------------------------

@dataclass
class Settings:
    """How hard to measure. ``full()`` and ``quick()`` are the two presets; every field can
    be overridden from the command line."""
    mode: str
    cpu_sizes: list            # log2 of the single-tensor sizes on CPU
    gpu_sizes: list            # ... on a GPU
    budget_s: float            # time spent on the repeats of one measurement (about)
    min_reps: int
    max_reps: int
    reference_cap: int         # the reference backend is timed only up to this many elements
    reference_budget_s: float
    reference_min_reps: int
    reference_max_reps: int
    roof_reps: int
    roof_numel: int            # 0: chosen from the cache size
    max_sets: int = 4096       # at most this many rotated input sets
    rotate_factor: float = 4.0  # rotated sets total at least this many last-level caches
    rotate_bytes: int = 0      # instead of rotate_factor x the cache: this many bytes (0: unset)

    @classmethod
    def full(cls) -> "Settings":
        return cls("full", list(range(10, 27)), list(range(10, 29)), budget_s=0.25, min_reps=3,
                   max_reps=50, reference_cap=2 ** 22, reference_budget_s=0.1,
                   reference_min_reps=2, reference_max_reps=10, roof_reps=10, roof_numel=0)

    @classmethod
    def quick(cls) -> "Settings":
        # 2**26 on a GPU: below ~2**22 a functional call's host work, not the kernel, sets
        # its time there (the H200 run of 2026-11-27)
        return cls("quick", [10, 14, 18], [10, 14, 18, 22, 26], budget_s=0.02, min_reps=2,
                   max_reps=10, reference_cap=2 ** 20, reference_budget_s=0.01,
                   reference_min_reps=1, reference_max_reps=3, roof_reps=5,
                   roof_numel=2 ** 24)

    def gpu_adjusted(self) -> "Settings":
        """On a GPU calls are cheap: many more repeats."""
        out = Settings(**self.__dict__)
        out.min_reps = max(self.min_reps, 10)
        out.max_reps = max(self.max_reps, 500 if self.mode == "full" else 50)
        out.reference_min_reps = max(self.reference_min_reps, 3)
        out.reference_max_reps = max(self.reference_max_reps, 50 if self.mode == "full" else 10)
        return out


# ---------------------------------------------------------------------------------------------
# Layouts and inputs
# ---------------------------------------------------------------------------------------------

@dataclass
class Layout:
    """A list of parameter shapes that is timed as one call."""
    name: str
    shapes: list

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)


def model_shapes(which: str) -> list:
    """Parameter shapes of the project's models (``emcl_continual.data.models``, the one source of
    truth): the 784-100-100-10 MLP, or the reduced ResNet-18 (nf=20) on 3x32x32 inputs with
    100 outputs (Split CIFAR-100)."""
    from emcl_continual.data.models import MLP, ReducedResNet18
    from emcl_continual.data.streams import StreamInfo

    if which == "mlp":
        model = MLP(StreamInfo("permuted-mnist", 1, (784,), 10, [(0, 10)], False))
    elif which == "resnet18":
        info = StreamInfo("split-cifar100", 20, (3, 32, 32), 100,
                          [(5 * t, 5 * t + 5) for t in range(20)], True)
        model = ReducedResNet18(info)
    else:
        raise ValueError(f"no model layout {which!r}")
    return [tuple(p.shape) for p in model.parameters()]


def build_layouts(choices, sizes) -> tuple[list, dict]:
    """The layouts to time, and the ones that could not be built with the reason."""
    layouts, skipped = [], {}
    for choice in choices:
        if choice == "single":
            layouts.extend(Layout("single", [(2 ** k,)]) for k in sizes)
        elif choice == "many":
            layouts.append(Layout(LAYOUT_NAMES["many"], [(MANY_NUMEL,)] * MANY_TENSORS))
        else:
            try:
                layouts.append(Layout(LAYOUT_NAMES[choice], model_shapes(choice)))
            except ImportError as exc:
                skipped[LAYOUT_NAMES[choice]] = (f"emcl_continual.data.models is not importable "
                                                 f"({exc}); layout skipped")
    return layouts, skipped


@dataclass
class InputSet:
    """One set of EMCL tensors for a layout: θ, g in the parameter dtype, θ₀, h, α in fp32."""
    params: list
    grads: list
    anchors: list
    importances: list
    meta_lrs: Optional[list] = None
    nbytes: int = 0

    def state(self):
        return self.params + self.anchors + self.importances + (self.meta_lrs or [])


def make_input_set(layout: Layout, dtype: torch.dtype, device: torch.device, gen, *,
                   with_meta_lrs: bool) -> InputSet:
    """Fresh random inputs (never zeros), every tensor with memory of its own: θ ~ N(0,1),
    g ~ N(0,1), θ₀ = θ + 0.3·N(0,1), h ~ 0.1 + U(0,1), α ~ 0.05 + 0.1·U(0,1). Raises if two
    of them share memory (a step on aliased inputs finds half of them in cache)."""
    s = InputSet([], [], [], [], [] if with_meta_lrs else None)
    f32 = torch.float32
    for shape in layout.shapes:
        theta = torch.randn(shape, generator=gen, device=device, dtype=f32)
        s.params.append(theta.to(dtype))  # for fp32 this is θ itself: never written below
        s.grads.append(torch.randn(shape, generator=gen, device=device, dtype=f32).to(dtype))
        noise = torch.randn(shape, generator=gen, device=device, dtype=f32)
        s.anchors.append(torch.add(theta, noise, alpha=0.3))
        s.importances.append(torch.rand(shape, generator=gen, device=device, dtype=f32).add_(0.1))
        if with_meta_lrs:
            s.meta_lrs.append(torch.rand(shape, generator=gen, device=device, dtype=f32)
                              .mul_(0.1).add_(0.05))
    tensors = s.params + s.grads + s.anchors + s.importances + (s.meta_lrs or [])
    shared = common.overlapping(tensors)
    if shared:
        raise RuntimeError(f"make_input_set: {len(shared)} pair(s) of input tensors share "
                           "memory; every θ, g, θ₀, h and α must be a tensor of its own")
    s.nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return s


def n_sets_for(set_bytes: int, llc_bytes: int, settings: Settings) -> int:
    """Enough input sets that cycling through them never finds the last one in cache."""
    target = settings.rotate_bytes or int(settings.rotate_factor * llc_bytes)
    need = -(-target // max(1, set_bytes))
    return int(max(1, min(settings.max_sets, need)))


class Rotation:
    """Which input set each call uses: always the least recently used one, counted over every
    call on the same sets (warm-up, estimate, repeats, every backend and op), so that between
    two uses of a set all the others were touched and no call finds its inputs in cache."""

    def __init__(self, n_sets: int):
        self.n_sets, self.position = n_sets, 0

    def upcoming(self, k: int) -> list:
        """The indices of the next ``k`` sets (call :meth:`advance` with how many were used)."""
        return [(self.position + i) % self.n_sets for i in range(k)]

    def advance(self, k: int) -> None:
        self.position = (self.position + k) % self.n_sets

    def take(self) -> int:
        """The next set's index, marked used."""
        i = self.position
        self.advance(1)
        return i


def step_fn(op: str, backend: str, s: InputSet, hyper: dict, check_finite: bool = False):
    """A no-argument callable doing one ``op`` through ``emcl_kernels.functional``; the
    non-finite gradient check (on by default in the library) only with ``check_finite``."""
    fn = getattr(F, op + "_")
    lists = [s.params, s.grads, s.anchors, s.importances]
    if op != "inner_step":
        lists.append(s.meta_lrs if hyper.get("lr_mode") == "recurrent" else None)
    return lambda: fn(*lists, backend=backend, check_finite=check_finite, **hyper)


def count_launches(fn, device: torch.device) -> Optional[int]:
    """GPU kernels launched by one call of ``fn`` (torch.profiler's CUDA kernel events;
    memcpy/memset activities are not kernels and are not counted). None on CPU."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    n = 0
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA and not evt.name.lower().startswith(("memcpy", "memset")):
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

@dataclass
class DeviceRun:
    device: torch.device
    settings: Settings
    backends: list
    skipped_backends: dict
    llc_bytes: int
    roof_runs: list = field(default_factory=list)
    loads: list = field(default_factory=list)   # (what, 1/5/15-minute load average)
    probes: list = field(default_factory=list)  # in-place streaming on the inputs, per layout
    records: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    largest_numel: int = 0     # elements of the largest layout timed

    @property
    def roof(self) -> dict:
        """The roof measurements of this run pooled (``common.pool_roofs``), raised to the
        fastest probe where one was faster (``roof_with_probes``)."""
        return roof_with_probes(common.pool_roofs(self.roof_runs), self.probes)


PROBE_BYTES = 12  # θ₀ += 1e-6·h: read θ₀ and h, write θ₀ (fp32, in place)
#: The step's own streams on CPU (the extension's ``stream_probe_``, no math): kind and bytes
#: per element by the parameters' dtype: reads θ, g, θ₀, h, writes θ, θ₀, h, as the combined
#: step does ([note: stream probes] in csrc/emcl_cpu_kernels.h).
STEP_STREAMS = {torch.float32: (5, 28), torch.bfloat16: (6, 22)}


def probe_calls(sets: list, device: torch.device, dtype: torch.dtype, n_tensors: int) -> dict:
    """The probes of one layout, name -> (one callable per rotated set, bytes per element):
    ``foreach_add`` (``torch._foreach_add_(θ₀, h, alpha=1e-6)``, 12 B, every device) and, on a
    CPU whose extension has the probes and for a single tensor, ``step_streams`` (the combined
    step's seven streams without its math). Per pass ``foreach_add`` moves θ₀ by 1e-6·h and
    ``step_streams`` moves θ and θ₀ by 1e-6·g (h is written back unchanged)."""
    out = {"foreach_add": ([lambda s=s: torch._foreach_add_(s.anchors, s.importances, alpha=1e-6)
                            for s in sets], PROBE_BYTES)}
    kind_bytes = STEP_STREAMS.get(dtype)
    if kind_bytes and n_tensors == 1 and common.stream_probes_available(device):
        kind, nbytes = kind_bytes
        probe = torch.ops.emcl.stream_probe_
        out["step_streams"] = ([lambda s=s: probe(s.params[0], s.grads[0], s.anchors[0],
                                                  s.importances[0], kind) for s in sets], nbytes)
    return out


def time_probes(probes: dict, rotation: "Rotation", device: torch.device, calls: int,
                into: dict) -> None:
    """``calls`` passes of every probe in ``probes`` (:func:`probe_calls`) in the rotation of
    the kernels, their seconds appended to ``into[name]``: timed between the kernels' own
    measurements, the memory's speed on the kernels' tensors at the kernels' time."""
    for name, (fns, _) in probes.items():
        secs = common.time_calls([fns[i] for i in rotation.upcoming(calls)], device)
        rotation.advance(len(secs))
        into.setdefault(name, []).extend(secs)


def roof_with_probes(roof: dict, probes: list) -> dict:
    """``roof`` with the probes attached (``probes``) and, where a probe's fastest pass beat
    it, raised to that (``roof_kernel`` "probe", ``roof_numel`` the probe's layout size): the
    roof is measured at the start and the end of the run, and on a shared machine a quieter
    moment in between can let memory run faster than it did then."""
    out = dict(roof, probes=probes, roof_source="streaming kernels")
    best = max(probes, key=lambda p: p["gbps_best"], default=None)
    if best is not None and best["gbps_best"] > roof["roof_gbps"]:
        out.update(roof_gbps=best["gbps_best"], roof_kernel="probe", roof_numel=best["numel"],
                   roof_source=f"probe {best.get('kernel', 'foreach_add')} on {best['layout']} "
                               f"{best['numel']} {best['dtype']}")
    return out


def measure_roof(run: DeviceRun) -> dict:
    """``common.device_roof`` with this run's backends, rotated like the EMCL inputs
    (``--rotate-mb``); called at the start and at the end of the device's run, pooled. The
    roof's largest size is at least the largest layout timed: a smaller one pays more of a
    call's fixed cost per byte than the kernels it bounds (on an H100 a copy of 2**24
    elements ran at 2334 GB/s, the EMCL kernels at 2**26 at up to 3031)."""
    numel = run.settings.roof_numel or None
    if run.device.type == "cuda" and run.settings.mode == "full":
        numel = max(numel or 0, 2 ** 28)
    if numel is not None:
        numel = max(numel, run.largest_numel)
    res = common.device_roof(
        run.device, run.settings.roof_reps, largest=numel, backends=run.backends,
        rotate_bytes=run.settings.rotate_bytes or int(run.settings.rotate_factor * run.llc_bytes))
    run.roof_runs.append(res)
    return res


def run_device(device: torch.device, args, settings: Settings, log) -> DeviceRun:
    backends, skipped = common.backends_for(device, include_cpu_triton=args.cpu_triton,
                                            only=args.backends)
    if device.type == "cuda":
        settings = settings.gpu_adjusted()
    run = DeviceRun(device, settings, backends, skipped, common.last_level_cache_bytes(device))
    if not backends:
        raise SystemExit(f"no backend to time on {device}: " +
                         "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    log(f"== {common.device_name(device)}: timing {', '.join(backends)}")
    busy = common.busy_warning(device)
    if busy:
        run.notes.append(busy)
        log(f"   warning: {busy}")
    for name, why in skipped.items():
        log(f"   not timed: {name}: {why}")

    sizes = args.sizes or (settings.gpu_sizes if device.type == "cuda" else settings.cpu_sizes)
    layouts, skipped_layouts = build_layouts(args.layouts, sizes)
    run.largest_numel = max((l.numel for l in layouts), default=0)

    run.loads.append(("start", common.load_average()))
    _log_roof(measure_roof(run), log)

    for name, why in skipped_layouts.items():
        run.notes.append(f"{name}: {why}")
        log(f"   {name}: {why}")
    dtypes = [common.DTYPE_NAMES[d] for d in args.dtypes]
    with_meta_lrs = args.lr_mode == "recurrent"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    warmed = set()
    if "triton" in backends and device.type == "cpu":
        run.notes.append("triton on CPU tensors runs through the Triton interpreter (--cpu-triton)")
    if "reference" in backends and any(l.numel > settings.reference_cap for l in layouts):
        run.notes.append(f"reference backend timed only up to {settings.reference_cap} elements "
                         f"(it is slow), with {settings.reference_min_reps}-"
                         f"{settings.reference_max_reps} repeats")

    for layout in layouts:
        for dtype in dtypes:
            dname = _dtype_name(dtype)
            first = make_input_set(layout, dtype, device, gen, with_meta_lrs=with_meta_lrs)
            n_sets = n_sets_for(first.nbytes, run.llc_bytes, settings)
            sets = [first] + [make_input_set(layout, dtype, device, gen, with_meta_lrs=with_meta_lrs)
                              for _ in range(n_sets - 1)]
            rotation = Rotation(n_sets)
            # probes only where the rotation reached its size (the smallest layouts are capped
            # at max_sets sets, and a probe there could run from cache); timed before the
            # kernels and after each kernel's measurement
            probes = {} if n_sets >= settings.max_sets else \
                probe_calls(sets, device, dtype, layout.n_tensors)
            probe_secs: dict = {}
            time_probes(probes, rotation, device, max(3, settings.min_reps), probe_secs)
            for op in args.ops:
                hyper = common.hyperparameters(op, args.lr_mode)
                bpe = common.bytes_per_element(op, dtype, args.lr_mode)
                nbytes = bpe * layout.numel
                for backend in backends:
                    is_ref = backend == "reference"
                    if is_ref and layout.numel > settings.reference_cap:
                        continue
                    calls = [step_fn(op, backend, s, hyper, args.check_finite) for s in sets]
                    key = (backend, op, dtype)
                    if key not in warmed:   # first use: compilation, lazy imports, autotuning
                        common.time_once(calls[rotation.take()], device)
                        warmed.add(key)
                    estimate = common.time_once(calls[rotation.take()], device)
                    budget = settings.reference_budget_s if is_ref else settings.budget_s
                    min_reps = settings.reference_min_reps if is_ref else settings.min_reps
                    reps = common.repeats_for(
                        estimate, budget, min_reps,
                        settings.reference_max_reps if is_ref else settings.max_reps)
                    secs = common.time_calls([calls[i] for i in rotation.upcoming(reps)], device,
                                             max_total_s=4 * budget, min_calls=min_reps)
                    rotation.advance(len(secs))
                    stats = common.Stats.of(secs)
                    launches = None
                    if device.type == "cuda":
                        try:
                            launches = count_launches(calls[rotation.take()], device)
                        except Exception as exc:  # noqa: BLE001 - the timing stands without it
                            log(f"   (could not count launches: {type(exc).__name__}: {exc})")
                    rec = {
                        "device": device.type, "device_name": common.device_name(device),
                        "backend": backend, "op": op, "dtype": dname, "layout": layout.name,
                        "numel": layout.numel, "n_tensors": layout.n_tensors,
                        "lr_mode": args.lr_mode, "check_finite": args.check_finite,
                        "bytes_per_element": bpe, "bytes": nbytes,
                        "time_ms": stats.median_ms, "time_ms_min": stats.min_ms,
                        "time_ms_q25": stats.q25_ms, "time_ms_q75": stats.q75_ms,
                        "repeats": stats.repeats, "timer": common.timer_name(device),
                        "gbps": common.gbps(nbytes, stats.median_ms / 1e3),
                        "copy_gbps": None, "ratio_to_copy": None,
                        "gbps_best": common.gbps(nbytes, stats.min_ms / 1e3),
                        "roof_gbps": None, "roof_kernel": None, "ratio_to_roof": None,
                        "ratio_to_roof_best": None,
                        "speedup_vs_reference": None, "speedup_vs_foreach": None,
                        "launches": launches, "rotation_sets": n_sets,
                        "rotation_bytes": n_sets * first.nbytes,
                    }
                    run.records.append(rec)
                    log(f"   {layout.name:>16} {layout.numel:>10} {dname} {op:<15} {backend:<9} "
                        f"{stats.median_ms:10.4f} ms {rec['gbps']:8.2f} GB/s  ({stats.repeats} reps)")
                    time_probes(probes, rotation, device, 2, probe_secs)
            for name, (_, nbytes) in probes.items():
                st = common.Stats.of(probe_secs[name])
                run.probes.append({
                    "kernel": name, "layout": layout.name, "numel": layout.numel, "dtype": dname,
                    "bytes_per_element": nbytes, "seconds": probe_secs[name],
                    "gbps": common.gbps(nbytes * layout.numel, st.median_ms / 1e3),
                    "gbps_best": common.gbps(nbytes * layout.numel, st.min_ms / 1e3)})
            finite = all(bool(torch.isfinite(t.float()).all()) for s in sets for t in s.state())
            for rec in run.records:
                if rec["layout"] == layout.name and rec["numel"] == layout.numel \
                        and rec["dtype"] == dname:
                    rec["finite"] = finite
            if not finite:
                run.notes.append(f"non-finite values after timing {layout.name} {layout.numel} "
                                 f"{dname}: its timings may be distorted")
            run.loads.append((f"after {layout.name} {layout.numel} {dname}", common.load_average()))
            del sets, first
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    measure_roof(run)
    run.loads.append(("end", common.load_average()))
    roof = run.roof
    log("   start and end pooled:")
    _log_roof(roof, log)
    if roof["roof_kernel"] == "probe":
        log(f"   a probe on the inputs was faster: the roof is {roof['roof_gbps']:.1f} GB/s "
            f"({roof['roof_source']})")
    _finish_records(run.records, roof)
    run.notes.extend(above_roof_notes(run.records, roof))
    return run


def above_roof_notes(records: list, roof: dict) -> list:
    """A note for every measurement whose fastest repeat beat the roof's fastest repeat: a
    kernel cannot move bytes faster than memory, so that is a bug in the benchmark (aliased or
    cached inputs) or in the byte model, to be found before the numbers are used."""
    notes = []
    above = [r for r in records if r["ratio_to_roof_best"] > 1.0]
    if above:
        worst = max(above, key=lambda r: r["ratio_to_roof_best"])
        notes.append(
            f"BUG: {len(above)} record(s) above the roof (worst: {worst['backend']} "
            f"{worst['op']} {worst['dtype']} {worst['layout']} {worst['numel']}, fastest repeat "
            f"at {worst['ratio_to_roof_best']:.2f}x); a kernel cannot beat memory: find the cause "
            "(aliased or cached inputs, a wrong byte count) before using these numbers")
    for k in roof["records"]:
        if k["kernel"] not in common.ROOF_KERNELS and k["ratio_to_roof_best"] > 1.0:
            notes.append(f"BUG: {k['kernel']} beside the roof, fastest repeat at "
                         f"{k['ratio_to_roof_best']:.2f}x the roof")
    return notes


def _log_roof(roof: dict, log) -> None:
    log(f"   roof ({roof['threads']} thread(s), write-allocate "
        f"{'counted' if roof['write_allocate'] else 'not counted'}): {roof['roof_gbps']:.1f} GB/s "
        f"by {roof['roof_kernel']} at {roof['roof_numel']:,} elements (fastest repeat)")
    for c in roof.get("gpu_probe_configs") or []:
        log(f"      GPU probe {c['kernel']} at {c['numel']:,}: BLOCK {c['block']}, "
            f"{c['warps']} warps (the fastest of benchmarks/gpu_probes.py's CONFIGS)")
    for k in roof["records"]:
        log(f"      {k['kernel']:<28} {k['numel']:>11,} {k['bytes_per_element']:>3} B/element "
            f"median {k['gbps']:7.2f} GB/s, fastest {k['gbps_best']:7.2f} "
            f"({100 * k['ratio_to_roof_best']:5.1f}% of the roof)")


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in common.DTYPE_NAMES.items()}[dtype]


def _finish_records(records: list, roof: dict) -> None:
    """Fill in the copy bandwidth and the roof (``common.pool_roofs``), the ratios to them and
    the speedups over reference and foreach."""
    by_key = {}
    for r in records:
        by_key[(r["layout"], r["numel"], r["dtype"], r["op"], r["backend"])] = r
    for r in records:
        r["copy_gbps"] = roof["copy_gbps"]
        r["ratio_to_copy"] = r["gbps"] / roof["copy_gbps"]
        r["roof_gbps"] = roof["roof_gbps"]
        r["roof_kernel"] = roof["roof_kernel"]
        r["ratio_to_roof"] = r["gbps"] / roof["roof_gbps"]
        r["ratio_to_roof_best"] = r["gbps_best"] / roof["roof_gbps"]
        for base in ("reference", "foreach"):
            other = by_key.get((r["layout"], r["numel"], r["dtype"], r["op"], base))
            r[f"speedup_vs_{base}"] = other["time_ms"] / r["time_ms"] if other else None


# ---------------------------------------------------------------------------------------------
# Output: the tables (the terminal's at the end of a run, docs/performance.md's from a file)
# ---------------------------------------------------------------------------------------------

OP_SHORT = {"inner_step": "inner", "meta_step": "meta", "inner_meta_step": "combined"}
LAYOUT_ORDER = {"single": 0, "mlp-2x100": 1, "resnet18-reduced": 2, "many-1000x4096": 3}


def _default_sizes(records: list, backends: list) -> set:
    """2**20 and the largest single-tensor size that every backend except the reference
    (which is capped) was timed at."""
    full = [b for b in backends if b != "reference"] or backends
    sizes = {}
    for r in records:
        if r["layout"] == "single":
            sizes.setdefault(r["numel"], set()).add(r["backend"])
    common_sizes = [n for n, bs in sizes.items() if set(full) <= bs]
    out = {n for n in common_sizes if n == 2 ** 20}
    if common_sizes:
        out.add(max(common_sizes))
    return out


def _roof_source(roof: dict) -> str:
    if roof.get("roof_kernel") == "probe":
        return f"an in-place pass over the inputs, {roof['roof_source'].replace('probe on ', '')}"
    return f"`{roof['roof_kernel']}`, the best streaming kernel"


def _time(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1000 else f"{ms:.3g} ms"


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    text = f"{r['gbps']:.2f} GB/s ({100 * r['ratio_to_roof']:.0f}%), {_time(r['time_ms'])}"
    if r.get("launches") is not None:
        text += f", {r['launches']} launch" + ("es" if r["launches"] != 1 else "")
    return text


def _best(rows: list) -> str:
    best = min(rows, key=lambda r: r["time_ms"])
    parts = [f"**{best['backend']}**"]
    for base in ("foreach", "reference"):
        s = best.get(f"speedup_vs_{base}")
        if s is not None and best["backend"] != base:
            parts.append(f"{s:.2f}x {base}")
    return ", ".join(parts)


def tables(result: dict, *, devices=None, layouts=None, ops=None, dtypes=None, sizes=None,
           source: str = "") -> str:
    """The markdown of a results file, per device (``devices``, default every one in it): a
    caption naming the machine, the roof, the run and ``source`` (the file), then one row per
    layout, size, dtype and step with every backend's GB/s, % of the roof, median time and
    launches, and the fastest with its speed-ups; the skipped backends and the notes below.
    ``layouts``: layout name prefixes; ``sizes``: the single-tensor sizes shown, as powers of
    two, ``"all"`` for every one (default: 2**20 and the largest)."""
    known = list(result["devices"])
    for device in devices or ():
        if device not in known:
            raise SystemExit(f"no {device!r} results in this file (it has {known})")
    return "\n\n".join(_device_table(result, device, layouts=layouts, ops=ops, dtypes=dtypes,
                                     sizes=sizes, source=source)
                       for device in (devices or known))


def _device_table(result: dict, device: str, *, layouts, ops, dtypes, sizes, source: str) -> str:
    info = result["devices"][device]
    records = [r for r in result["records"] if r["device"] == device]
    backends = list(dict.fromkeys(r["backend"] for r in records))
    if sizes is None:
        sizes = _default_sizes(records, backends)
    elif sizes != "all":
        sizes = {2 ** k for k in sizes}
    keep = []
    for r in records:
        if layouts and not any(r["layout"].startswith(l) for l in layouts):
            continue
        if ops and r["op"] not in ops:
            continue
        if dtypes and r["dtype"] not in dtypes:
            continue
        if r["layout"] == "single" and sizes != "all" and r["numel"] not in sizes:
            continue
        keep.append(r)
    if not keep and records:
        raise SystemExit(f"no {device} records match the selection")
    groups = {}
    for r in keep:
        groups.setdefault((r["layout"], r["numel"], r["dtype"], r["op"]), {})[r["backend"]] = r
    op_rank = {o: i for i, o in enumerate(OP_SHORT)}
    order = sorted(groups, key=lambda k: (LAYOUT_ORDER.get(k[0], 9), k[1], k[2] != "fp32",
                                          op_rank.get(k[3], 9)))
    machine = result.get("machine", {})
    settings = result.get("settings", {})
    roof = info["roof"]
    counting = ("bytes read + written + write-allocate reads" if roof["write_allocate"]
                else "bytes read + written")
    caption = (f"**{info['name']}**, torch {machine.get('torch', '?')} with "
               f"{machine.get('torch_threads', '?')} thread(s); roof {roof['roof_gbps']:.1f} GB/s "
               f"({_roof_source(roof)}; "
               f"copy {roof['copy_gbps']:.1f} GB/s; {counting}; percentages are of the roof); "
               f"{settings.get('mode', '?')} run of {result.get('created_utc', '?')}, "
               f"lr_mode `{settings.get('lr_mode', '?')}`"
               + (f", from `{source}`" if source else "") + ".")
    loads = [l for _, l in info.get("load_averages", []) if l]
    if loads:
        caption += (f" 1-minute load average during the run: {min(l[0] for l in loads):.1f} to "
                    f"{max(l[0] for l in loads):.1f} on {machine.get('cpu_count', '?')} cores.")
    header = ["layout", "elements (tensors)", "dtype", "step"] + backends + ["fastest"]
    lines = [caption, "", "| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] * 4 + ["--:"] * len(backends) + ["---"]) + "|"]
    if not keep:
        lines[1:] = ["", "Nothing was timed."]
    for key in order:
        layout, numel, dtype, op = key
        row = groups[key]
        first = next(iter(row.values()))
        elems = f"{numel:,} ({first['n_tensors']})"
        name = f"single 2^{numel.bit_length() - 1}" if layout == "single" else layout
        cells = [name, elems, dtype, OP_SHORT.get(op, op)]
        cells += [_cell(row.get(b)) for b in backends]
        cells.append(_best(list(row.values())))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"{k}: {v}" for k, v in info.get("skipped_backends", {}).items()
             if not v.startswith("not asked")] + list(info.get("notes", []))
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def print_tables(paths: list, args) -> str:
    """The tables of kernels results files (none: the newest in benchmarks/results/), with the
    selection of ``args`` (``--device``, ``--layouts``, ``--ops``, ``--dtypes``, ``--sizes``)."""
    devices = None if "auto" in args.device else args.device
    text = "\n\n".join(
        tables(result, devices=devices, layouts=args.layouts, ops=args.ops, dtypes=args.dtypes,
               sizes=args.sizes, source=source)
        for source, result in harness.load_results(paths, "kernels", SCHEMA))
    print(text)
    return text


def plot(result: dict, device: str, path: str) -> None:
    """GB/s against size for every (op, dtype): one line per backend over the single-tensor
    sizes, the multi-tensor layouts as markers, the roof dashed and the copy dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r["device"] == device]
    ops = [o for o in common.OPS if any(r["op"] == o for r in recs)]
    dtypes = [d for d in common.DTYPE_NAMES if any(r["dtype"] == d for r in recs)]
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    colors = {b: f"C{i}" for i, b in enumerate(backends)}
    markers = {LAYOUT_NAMES["mlp"]: "s", LAYOUT_NAMES["resnet18"]: "^", LAYOUT_NAMES["many"]: "D"}
    info = result["devices"][device]
    fig, axes = plt.subplots(len(ops), len(dtypes), figsize=(5.5 * len(dtypes), 3.6 * len(ops)),
                             squeeze=False, sharex=True)
    for i, op in enumerate(ops):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            cell = [r for r in recs if r["op"] == op and r["dtype"] == dt]
            for b in backends:
                line = sorted((r["numel"], r["gbps"]) for r in cell
                              if r["backend"] == b and r["layout"] == "single")
                if line:
                    ax.plot(*zip(*line), "o-", color=colors[b], label=b, ms=3)
                for lay, mk in markers.items():
                    pts = [(r["numel"], r["gbps"]) for r in cell
                           if r["backend"] == b and r["layout"] == lay]
                    if pts:
                        ax.plot(*zip(*pts), mk, color=colors[b], ms=7, mfc="none", mew=1.5)
            roof = info["roof"]
            ax.axhline(roof["roof_gbps"], color="k", ls="--", lw=1,
                       label=f"roof ({roof['roof_kernel']}) {roof['roof_gbps']:.1f} GB/s")
            ax.axhline(roof["copy_gbps"], color="gray", ls=":", lw=1,
                       label=f"copy {roof['copy_gbps']:.1f} GB/s")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{common.OP_TITLES[op]}, {dt}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(ops) - 1:
                ax.set_xlabel("elements per step")
            if j == 0:
                ax.set_ylabel("GB/s (bytes moved to/from memory)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    from matplotlib.lines import Line2D
    present = {r["layout"] for r in recs}
    for lay, mk in markers.items():
        if lay in present:
            handles.append(Line2D([], [], marker=mk, ls="", color="gray", mfc="none", mew=1.5))
            labels.append(lay)
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=9)
    fig.suptitle(f"EMCL kernels on {info['name']} ({result['settings']['mode']} run, "
                 f"lr_mode {result['settings']['lr_mode']}, {result['created_utc']})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = harness.parser("kernels", __doc__, "device", "threads", "out", "name", "note", "quick",
                       "plot", "quiet", devices=True,
                       quick="small sizes, few repeats (< 1 min on 2 cores)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="only these backends (default: every one available on the device)")
    p.add_argument("--ops", nargs="+", default=None, choices=common.OPS,
                   help="default: every one (--table: every one in the file)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(common.DTYPE_NAMES),
                   help="default: fp32 bf16 (--table: every one in the file)")
    p.add_argument("--layouts", nargs="+", default=None, choices=LAYOUT_CHOICES,
                   help="default: every one (--table: every one in the file)")
    p.add_argument("--sizes", nargs="+", type=int, default=None, metavar="LOG2",
                   help="single-tensor sizes as powers of two (default: 10..26 on CPU, 10..28 on "
                        "a GPU; quick: 10 14 18; --table: those shown, default 20 and the "
                        "largest every backend but the reference ran)")
    p.add_argument("--lr-mode", default="inverse", choices=common.LR_MODES,
                   help="lr_mode of the meta and combined steps (recurrent moves 8 B more)")
    p.add_argument("--reference-cap", type=int, default=None, metavar="LOG2",
                   help="time the reference backend only up to 2**LOG2 elements (default 22, quick 20)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of repeats per measurement (full 0.25, quick 0.02)")
    p.add_argument("--min-reps", type=int, default=None)
    p.add_argument("--max-reps", type=int, default=None)
    p.add_argument("--rotate-mb", type=float, default=None,
                   help="total MiB of the rotated input sets (default: 4 x the last-level cache)")
    p.add_argument("--roof-mb", type=float, default=None,
                   help="MiB of each tensor of the roof's streaming kernels (default: the larger "
                        "of 256 MiB and the last-level cache, 1 GiB on a GPU; quick: 64 MiB)")
    p.add_argument("--cpu-triton", action="store_true",
                   help="also time Triton on CPU tensors through its interpreter (very slow; "
                        "sets TRITON_INTERPRET=1, so not with --device cuda)")
    p.add_argument("--check-finite", action="store_true",
                   help="time the steps with the library's non-finite gradient check (its "
                        "default; off here so that the kernels are timed alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", nargs="*", metavar="RESULTS_JSON", default=None,
                   help="print the tables of these results files (none: the newest "
                        "benchmarks/results/kernels_*.json) and exit; --device (default: every "
                        "one in the file), --layouts, --ops, --dtypes and --sizes select")
    return p


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results dict (also written to ``--out-dir``)."""
    args = build_parser().parse_args(argv)
    if args.table is not None:
        return {"table": print_tables(args.table, args)}
    args.ops = args.ops or list(common.OPS)
    args.dtypes = args.dtypes or ["fp32", "bf16"]
    args.layouts = args.layouts or list(LAYOUT_CHOICES)
    if args.cpu_triton:
        if "cuda" in args.device:
            raise SystemExit("--cpu-triton runs Triton through its interpreter everywhere; "
                             "do not combine it with --device cuda")
        # Triton reads this when its backend module is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    settings = Settings.quick() if args.quick else Settings.full()
    if args.reference_cap is not None:
        settings.reference_cap = 2 ** args.reference_cap
    if args.budget is not None:
        settings.budget_s = args.budget
        settings.reference_budget_s = min(settings.reference_budget_s, args.budget)
    if args.min_reps is not None:
        settings.min_reps = settings.reference_min_reps = args.min_reps
    if args.max_reps is not None:
        settings.max_reps = args.max_reps
        settings.reference_max_reps = min(settings.reference_max_reps, args.max_reps)
        if args.min_reps is None:
            settings.min_reps = min(settings.min_reps, args.max_reps)
            settings.reference_min_reps = min(settings.reference_min_reps, args.max_reps)
    if settings.min_reps < 1 or settings.max_reps < settings.min_reps:
        raise SystemExit("need 1 <= --min-reps <= --max-reps")
    if args.rotate_mb is not None:
        settings.rotate_bytes = max(1, int(args.rotate_mb * 2 ** 20))
    if args.roof_mb is not None:
        settings.roof_numel = max(1, int(args.roof_mb * 2 ** 20) // 4)
    with harness.threads(args.threads):
        return _main(args, argv, settings)


def _main(args, argv, settings: Settings) -> dict:
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))

    started = time.perf_counter()
    result = harness.head("kernels", argv, schema=SCHEMA, note=args.note)
    result.update({
        "settings": {"mode": settings.mode, "lr_mode": args.lr_mode,
                     "hyperparameters": {op: common.hyperparameters(op, args.lr_mode) for op in args.ops},
                     **{k: v for k, v in settings.__dict__.items() if k != "mode"}},
        "byte_model": {f"{op}/{d}": common.bytes_per_element(op, common.DTYPE_NAMES[d], args.lr_mode)
                       for op in args.ops for d in args.dtypes},
        "devices": {},
        "records": [],
    })
    for device in dict.fromkeys(harness.device_of(d) for d in args.device):
        run = run_device(device, args, settings, log)
        roof = run.roof
        result["devices"][device.type] = {
            "name": common.device_name(device), "copy_gbps": roof["copy_gbps"],
            "roof_gbps": roof["roof_gbps"], "roof": roof, "roof_runs": run.roof_runs,
            "load_averages": run.loads,
            "last_level_cache_bytes": run.llc_bytes, "backends": run.backends,
            "skipped_backends": run.skipped_backends, "notes": run.notes,
            "settings": {"min_reps": run.settings.min_reps, "max_reps": run.settings.max_reps},
        }
        result["records"].extend(run.records)
    result["wall_time_s"] = time.perf_counter() - started
    base = args.name or f"kernels_{common.utc_stamp()}"

    def plots(result: dict, _png: str) -> dict:
        """One .png per device, ``<base>_<device>.png``."""
        out = {f"png_{dev}": os.path.join(args.out, f"{base}_{dev}.png") for dev in result["devices"]}
        for key, png in out.items():
            plot(result, key[4:], png)
        return out
    return harness.finish(result, args.out, args.name or f"{base}_{'-'.join(result['devices'])}",
                          plot=plots, no_plot=args.no_plot,
                          table=lambda res: tables(res, sizes="all", source=res["paths"]["json"]))
