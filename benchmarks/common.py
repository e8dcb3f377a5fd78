"""What the benchmarks share: SPEC section 5's byte model, the backends to time on a device, the
memory roof, inputs that share no memory and the machine record of a results file
(benchmarks/README.md, "The harness"). The timers are ``benchmarks.timing``'s, re-exported."""
from __future__ import annotations

import datetime
import glob
import os
import platform
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
# emcl_kernels and emcl_continual importable from a plain checkout, also where a benchmark's
# module is imported without the suite's entry (the tests)
for _path in (os.path.join(REPO, "python"), REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from emcl_continual.core import provenance  # noqa: E402
from emcl_kernels import functional as F  # noqa: E402
from emcl_kernels.backends import (BACKENDS, BackendUnavailableError, backend_status,  # noqa: E402
                                   get_backend)

from benchmarks.timing import (Stats, gbps, repeats_for, synchronize, time_calls,  # noqa: E402,F401
                               time_once, timer_name)

OPS = ("inner_step", "meta_step", "inner_meta_step")
OP_TITLES = {"inner_step": "inner step", "meta_step": "meta step",
             "inner_meta_step": "combined step (inner_meta_step)"}
LR_MODES = ("inverse", "recurrent", "constant")
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_BYTES = 4  # θ₀, h and α are always fp32 (SPEC section 1)


def bytes_per_element(op: str, param_dtype: torch.dtype, lr_mode: str = "inverse") -> int:
    """Bytes read plus written per element by one step (SPEC section 5): θ and g in the
    parameter's dtype, θ₀, h (and α, stored only with ``lr_mode="recurrent"``) in fp32."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if lr_mode not in LR_MODES:
        raise ValueError(f"lr_mode must be one of {LR_MODES}, got {lr_mode!r}")
    p = torch.empty((), dtype=param_dtype).element_size()
    if op == "inner_step":
        return 3 * p + 2 * STATE_BYTES                 # θ, g, θ₀, h in; θ out
    meta_lr = 2 * STATE_BYTES if lr_mode == "recurrent" else 0
    return 3 * p + 4 * STATE_BYTES + meta_lr           # θ, g, θ₀, h (α) in; h, θ₀, θ (α) out


def hyperparameters(op: str, lr_mode: str) -> dict:
    """The hyper-parameters every backend is timed with: the library defaults where they exist,
    and values that keep many chained steps on the same inputs finite and away from denormals
    (α·λ·h stays below ~0.2; the recurrent α is clipped to [0.01, 0.3])."""
    inner = dict(inner_lr=0.05, reg=1.5, gamma=0.3, prox=True)
    meta = dict(meta_lr=0.2, reg=1.5, decay=0.8, lr_mode=lr_mode, importance="taylor",
                eps=1e-8, lr_min=0.0, lr_max=float("inf"), lr_scale=0.6)
    if lr_mode == "recurrent":
        meta.update(lr_scale=0.9, lr_min=0.01, lr_max=0.3)
    elif lr_mode == "constant":
        meta.update(lr_scale=1.0)
    return {"inner_step": inner, "meta_step": meta}.get(op, {**inner, **meta})


def backends_for(device: torch.device, *,
                 only: Optional[Sequence[str]] = None) -> tuple[list, dict]:
    """The backends available for ``device``'s tensors at run time (those of ``only``), and
    for every other one why it is left out (``get_backend``'s reason); Triton on CPU tensors
    (the interpreter) only when ``only`` names it."""
    device = torch.device(device)
    unknown = [b for b in only or () if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; the backends are {list(BACKENDS)}")
    chosen, skipped = [], {}
    for name in BACKENDS:
        if only and name not in only:
            skipped[name] = "not asked for (--backends)"
        elif name == "triton" and device.type == "cpu" and not only:
            skipped[name] = "excluded on CPU unless --backends names it (the Triton interpreter)"
        else:
            try:
                get_backend(name, device)
                chosen.append(name)
            except BackendUnavailableError as exc:
                skipped[name] = str(exc)
    return chosen, skipped


# ---------------------------------------------------------------------------------------------
# The memory roof (benchmarks/README.md, "The memory roof")
# ---------------------------------------------------------------------------------------------

# name -> (bytes read, bytes written, whether the written tensor was read first) per fp32
# element, the written tensor ``a`` of ``roof_kernels``
ROOF_KERNELS = {
    "copy": (4, 4, False),
    "foreach_copy": (4, 4, False),
    "triad": (8, 4, False),
    "axpy_inplace": (8, 4, True),
    "scale_inplace": (4, 4, True),
    "fill": (0, 4, False),
    "addcmul_inplace": (12, 4, True),
    "sum": (4, 0, False),
    "scale_inplace_prefetch": (4, 4, True),
    "axpy_inplace_prefetch": (8, 4, True),
    "update_pattern_prefetch": (16, 12, True),
    "step_pattern": (16, 12, True),
    "inner_pattern": (16, 4, True),
    "read_pattern": (16, 0, True),
}
# The stream probes, ``probe(a, b, c, d, kind)``: the extension's ``stream_probe_`` on CPU
# ([note: stream probes] in csrc/emcl_cpu_kernels.h), and the two GPU ones of
# benchmarks/gpu_probes.py (the kinds in its ``KINDS``): the one way to add a kernel with the
# steps' own streams to the roof.
PROBE_KINDS = {"scale_inplace_prefetch": 0, "axpy_inplace_prefetch": 1,
               "update_pattern_prefetch": 2, "inner_pattern": 3, "read_pattern": 4,
               "step_pattern": 5}
FOREACH_CHUNKS = 64


def stream_probes_available(device: torch.device) -> bool:
    """Whether the extension's prefetching memory probes run on ``device``: on CPU tensors
    wherever the cpu backend does (csrc/emcl_cpu.cpp registers them with its kernels)."""
    return torch.device(device).type == "cpu" and backend_status()["cpu"] == "available"


def _stream_probes(device: torch.device) -> tuple:
    """(probe, its kinds) on ``device``; (None, ()) where none runs."""
    if stream_probes_available(device):
        return torch.ops.emcl.stream_probe_, tuple(PROBE_KINDS.values())
    if device.type == "cuda":
        from benchmarks import gpu_probes   # imports Triton: only for a GPU roof
        if gpu_probes.available(device):
            return gpu_probes.stream_probe, tuple(gpu_probes.KINDS.values())
    return None, ()


def roof_bytes_per_element(kernel: str, write_allocate: bool) -> int:
    """Bytes one element of ``kernel`` moves: reads plus writes, plus, when the caches
    write-allocate, one read of every written line the kernel did not read itself."""
    read, written, in_place = ROOF_KERNELS[kernel]
    return read + written + (written if write_allocate and not in_place else 0)


def counted_exactly(kernel: str, write_allocate: bool) -> bool:
    """Whether :func:`roof_bytes_per_element` is ``kernel``'s real traffic: not for a store to
    lines it did not read under the write-allocate count (a CPU may skip that read), so such a
    kernel sets no roof."""
    _, written, in_place = ROOF_KERNELS[kernel]
    return not write_allocate or in_place or written == 0


def roof_kernels(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> dict:
    """The roof's streaming kernels, name -> callable, on three distinct 1-d fp32 tensors of one
    size: only ``a`` is written, except that ``update_pattern_prefetch`` and ``step_pattern``
    also move ``c`` by 1e-6·b."""
    a_chunks, b_chunks = a.chunk(FOREACH_CHUNKS), b.chunk(FOREACH_CHUNKS)
    kernels = {
        "copy": lambda: a.copy_(b),
        "foreach_copy": lambda: torch._foreach_copy_(a_chunks, b_chunks),
        "triad": lambda: torch.add(b, c, alpha=0.5, out=a),
        "axpy_inplace": lambda: a.add_(b, alpha=1e-6),
        "scale_inplace": lambda: a.mul_(1.0),
        "fill": lambda: a.fill_(0.5),
        "addcmul_inplace": lambda: a.addcmul_(b, c, value=1e-6),
        "sum": lambda: b.sum(),
    }
    probe, kinds = _stream_probes(a.device)
    if probe is not None:
        # a fourth tensor: the rotated sets are a third larger than counted (only colder)
        d = torch.rand_like(a)
        for name, kind in PROBE_KINDS.items():
            if kind in kinds:
                kernels[name] = lambda kind=kind: probe(a, b, c, d, kind)
    return kernels


def roof_sizes(device: torch.device, llc_bytes: int, largest: int) -> list:
    """The sizes (fp32 elements per tensor) the roof is measured at: from 1/128 of the
    last-level cache to ``largest``, every factor 4 (short streams can be faster per byte)."""
    sizes, n = [], 1 << max(10, (llc_bytes // 128).bit_length() - 1)
    while n < largest:
        sizes.append(n)
        n *= 4
    return sizes + [largest]


def measure_roof(device: torch.device, numels: Sequence[int], repeats: int, *,
                 rotate_bytes: int, extra: Optional[dict] = None,
                 extra_numel: Optional[int] = None) -> dict:
    """The roof of the :data:`ROOF_KERNELS` at the sizes ``numels`` (benchmarks/README.md, "The
    memory roof"): a warm-up call of each, then ``max(repeats, 2 x sets)`` rounds of one call
    of each, every call on the least recently used set; ``extra`` (name -> (callable, bytes per
    element) on tensors of ``extra_numel`` elements) runs in the largest size's rounds, beside
    the roof. The count is write-allocate on CPU (x86 caches), not on a GPU (its L2)."""
    device = torch.device(device)
    write_allocate = device.type == "cpu"
    numels = sorted(numels)
    samples = {}   # (kernel, numel) -> ([seconds], bytes per element, sets)
    for numel in numels:
        n_sets = max(1, -(-rotate_bytes // (3 * 4 * numel)))
        sets = [roof_kernels(*(torch.rand(numel, device=device) for _ in range(3)))
                for _ in range(n_sets)]
        fns = {k: ([s[k] for s in sets], roof_bytes_per_element(k, write_allocate), numel)
               for k in ROOF_KERNELS if k in sets[0]}
        if numel == numels[-1]:
            fns.update({k: ([fn], b, extra_numel or numel) for k, (fn, b) in (extra or {}).items()})
        position = 0  # every call, warm-up included, takes the least recently used set
        for name, (calls, bpe, n) in fns.items():
            samples[(name, n)] = ([], bpe, len(calls))
            time_once(calls[position % len(calls)], device)
            position += 1
        for _ in range(max(repeats, 2 * n_sets)):
            for name, (calls, _, n) in fns.items():
                samples[(name, n)][0].extend(time_calls([calls[position % len(calls)]], device))
                position += 1
        del sets, fns
    return _roof_summary({"threads": torch.get_num_threads(), "write_allocate": write_allocate,
                          "rotate_bytes": rotate_bytes}, samples)


def _roof_summary(head: dict, samples: dict) -> dict:
    """``head`` with the records of ``samples`` and the roof: the fastest repeat of the kernels
    counted exactly (other jobs only take bandwidth away), and the fastest copy."""
    records = []
    for (name, numel), (secs, bpe, n_sets) in samples.items():
        st = Stats.of(secs)
        records.append({"kernel": name, "numel": numel, "sets": n_sets,
                        "bytes_per_element": bpe, "seconds": list(secs),
                        "gbps": gbps(bpe * numel, st.median_ms / 1e3),
                        "gbps_best": gbps(bpe * numel, st.min_ms / 1e3),
                        "in_roof": name in ROOF_KERNELS
                        and counted_exactly(name, head["write_allocate"])})
    streaming = [r for r in records if r["kernel"] in ROOF_KERNELS]
    top = max((r for r in streaming if r["in_roof"]), key=lambda r: r["gbps_best"])
    for r in records:
        r["ratio_to_roof"] = r["gbps"] / top["gbps_best"]
        r["ratio_to_roof_best"] = r["gbps_best"] / top["gbps_best"]
    return {**head, "records": records, "roof_gbps": top["gbps_best"],
            "roof_kernel": top["kernel"], "roof_numel": top["numel"],
            "copy_gbps": max((r["gbps_best"] for r in streaming if r["kernel"] == "copy"),
                             default=None)}


def device_roof(device: torch.device, repeats: int, *, largest: Optional[int] = None,
                rotate_bytes: Optional[int] = None, backends: Sequence[str] = ()) -> dict:
    """:func:`measure_roof` on ``device`` at the sizes of :func:`roof_sizes` up to ``largest``
    (default on CPU: 2**26, or 2 x the last-level cache if more; on a GPU 2**28), rotated over
    ``rotate_bytes`` (default 4 x the last-level cache), with the inner and combined steps of
    the compiled ones of ``backends`` timed beside it on the largest size."""
    device = torch.device(device)
    llc = last_level_cache_bytes(device)
    if largest is None:
        largest = 2 ** 28 if device.type == "cuda" else max(2 ** 26, 2 * llc)
    compiled = [b for b in backends if b in ("cpu", "cuda", "triton")]
    extra = emcl_kernel_calls(device, largest, compiled)
    res = measure_roof(device, roof_sizes(device, llc, largest), repeats,
                       rotate_bytes=rotate_bytes or 4 * llc, extra=extra, extra_numel=largest)
    if device.type == "cuda" and _stream_probes(device)[0] is not None:
        from benchmarks import gpu_probes
        res["gpu_probe_configs"] = gpu_probes.chosen_configs()
    return res


def pool_roofs(runs: Sequence[dict]) -> dict:
    """One roof from several :func:`measure_roof` results of the same setting (taken at the
    start and at the end of a run): every kernel's samples at every size pooled."""
    if not runs:
        raise ValueError("no roof measurements to pool")
    samples = {}
    for run in runs:
        for r in run["records"]:
            secs, _, _ = samples.setdefault((r["kernel"], r["numel"]),
                                            ([], r["bytes_per_element"], r["sets"]))
            secs.extend(r["seconds"])
    head = {k: runs[0][k] for k in ("threads", "write_allocate", "rotate_bytes")}
    return _roof_summary(head, samples)


def emcl_kernel_calls(device: torch.device, numel: int, backends: Sequence[str]) -> dict:
    """``emcl_<backend>_<op>`` -> (callable, SPEC section 5 bytes per element): the inner and
    the combined step of each of ``backends`` on one fp32 input set of ``numel`` elements."""
    s = make_input_set([(numel,)], torch.float32, device, None, with_meta_lrs=False)
    return {f"emcl_{b}_{op}": (step_fn(op, b, s, hyperparameters(op, "inverse")),
                               bytes_per_element(op, torch.float32))
            for b in backends for op in ("inner_step", "inner_meta_step")}


def mlp_shapes() -> list:
    """The paper's MNIST MLP, 784-100-100-10 (weights and biases): 89,610 elements."""
    dims = (784, 100, 100, 10)
    return [shape for fan_in, fan_out in zip(dims, dims[1:])
            for shape in ((fan_out, fan_in), (fan_out,))]


# ---------------------------------------------------------------------------------------------
# Inputs that share no memory, and a step on them
# ---------------------------------------------------------------------------------------------

@dataclass
class InputSet:
    """One set of EMCL tensors for a layout: θ, g in the parameter dtype, θ₀, h, α in fp32."""
    params: list
    grads: list
    anchors: list
    importances: list
    meta_lrs: Optional[list]
    nbytes: int = 0


def make_input_set(shapes: Sequence[tuple], dtype: torch.dtype, device: torch.device, gen, *,
                   with_meta_lrs: bool) -> InputSet:
    """Fresh random inputs of ``shapes`` (never zeros), every tensor a new allocation of its own
    (a step on aliased inputs would find half of them in cache): θ ~ N(0,1), g ~ N(0,1),
    θ₀ = θ + 0.3·N(0,1), h ~ 0.1 + U(0,1), α ~ 0.05 + 0.1·U(0,1)."""
    s = InputSet([], [], [], [], [] if with_meta_lrs else None)

    def draw(shape, fn=torch.randn):
        return fn(shape, generator=gen, device=device, dtype=torch.float32)
    for shape in shapes:
        theta = draw(shape)
        s.params.append(theta.to(dtype))  # for fp32 this is θ itself: never written below
        s.grads.append(draw(shape).to(dtype))
        s.anchors.append(torch.add(theta, draw(shape), alpha=0.3))
        s.importances.append(draw(shape, torch.rand).add_(0.1))
        if with_meta_lrs:
            s.meta_lrs.append(draw(shape, torch.rand).mul_(0.1).add_(0.05))
    tensors = s.params + s.grads + s.anchors + s.importances + (s.meta_lrs or [])
    s.nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return s


def step_fn(op: str, backend: str, s: InputSet, hyper: dict, check_finite: bool = False):
    """A no-argument callable doing one ``op`` through ``emcl_kernels.functional``; the
    non-finite gradient check (on by default in the library) only with ``check_finite``."""
    fn = getattr(F, op + "_")
    lists = [s.params, s.grads, s.anchors, s.importances]
    if op != "inner_step":
        lists.append(s.meta_lrs if hyper.get("lr_mode") == "recurrent" else None)
    return lambda: fn(*lists, backend=backend, check_finite=check_finite, **hyper)


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------

def load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def last_level_cache_bytes(device: torch.device) -> int:
    """The last-level cache of ``device`` (the GPU's L2, the CPU's largest cache); 64 MiB (GPU)
    or 32 MiB (CPU) when the system does not say."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 64 << 20
    best = 0
    try:
        for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
            text = open(path).read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        best = 0
    return best or 32 << 20


def _cpu_model() -> str:
    return provenance.processor().get("model_name") or platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({_cpu_model()})"


def machine_info() -> dict:
    """What the results came from (SPEC section 7: the processor, its family and model, and what
    torch and EMCL dispatch on it), from ``emcl_continual.core.provenance``; ``git_commit`` the
    short commit, ``-dirty`` when code differs from it (None outside git)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        triton_version = None
    # the copy of the cpu backend's kernels that runs here (AVX-512, AVX2 or portable)
    cpu_kernel = str(torch.ops.emcl.cpu_kernel()) if backend_status()["cpu"] == "available" else None
    version = provenance.code_version()
    commit = version["commit"] and version["commit"][:7] + ("-dirty" if version["dirty"] else "")
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    cpu = provenance.processor()
    ids = (f"{cpu.get('vendor') or '?'} family {cpu['family']} model {cpu.get('model') or '?'} "
           f"stepping {cpu.get('stepping') or '?'}") if cpu.get("family") else None
    return {"summary": device_name(torch.device("cpu")) + ", " + ", ".join(gpus or ["no GPU"]),
            "cpu": _cpu_model(), "cpu_ids": ids, "cpu_capability": cpu["torch_cpu_capability"],
            "emcl_cpu_kernel": cpu_kernel, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "memory_gib": memory_gib, "gpus": gpus,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "git_commit": commit, "load_average_at_start": load_average()}


def busy_warning(device: torch.device) -> Optional[str]:
    """A warning when other jobs load the CPU (load average above the free cores), since then
    every multi-threaded op waits for its slowest thread; None when the CPU is free."""
    load, cores, threads = (load_average() or [0])[0], os.cpu_count() or 1, torch.get_num_threads()
    if load <= cores - 0.5:
        return None
    advice = " (consider --threads 1)" if threads > 1 and device.type == "cpu" else ""
    return (f"the machine is busy: load average {load:.1f} on {cores} cores while timing with "
            f"{threads} torch thread(s); timings are slower and noisier than on a quiet "
            f"machine{advice}")


def relative(path: str) -> str:
    """``path`` relative to the repository when it lies inside it, else as given."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else path


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
