"""Optimizer-step benchmark: ``FusedEMCLOptimizer.step()`` against torch's own optimizers, host
time included, on the MLP, ResNet-18, 1,000 x 4,096 and GPT-2-124M layouts.

    python -m benchmarks step             # the GPU if there is one, else the CPU (1, 2 threads)
    python -m benchmarks step --quick              # fewer rounds (a few minutes on 2 cores)
    python -m benchmarks step --device cuda --out benchmarks/results
    python -m benchmarks step --layouts mlp resnet18 --dtypes fp32 --threads 1
    python -m benchmarks step --table benchmarks/results/step_epyc-2core.json --backends cpu

The contenders, their SPEC section 7 peers and goals (:data:`PEERS`), how each is timed and every
field of a record: benchmarks/README.md, ``step``.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from benchmarks import common, harness  # (puts the repository on sys.path)

import torch

from emcl_kernels import FusedEMCLOptimizer

SCHEMA = "emcl-kernels/bench_step/1"
LAYOUT_CHOICES = ("mlp", "resnet18", "many", "gpt2")
LAYOUT_NAMES = {"mlp": "mlp-784-100-100-10", "resnet18": "resnet18", "many": "many-1000x4096",
                "gpt2": "gpt2-124m"}
BASELINES = ("adam_fused", "adam_fused_checked", "adam_fused_scaler", "adam_foreach",
             "sgd_foreach")
# SPEC section 7: each EMCL call and setting, its like-for-like torch peer and the goal of the
# ratio of their wall times (keys: call, check_finite, under a GradScaler).
PEERS = {("step()", False, False): ("adam_fused", 1.0),
         ("step()", True, False): ("adam_fused_checked", 1.0),
         ("step()", True, True): ("adam_fused_scaler", 1.0),
         ("inner_step()", False, False): ("adam_fused", 0.8)}
PARAM_SCALE, GRAD_SCALE = 0.1, 1e-3   # θ ~ 0.1·N(0,1), g ~ 1e-3·N(0,1): finite over many steps


# ---------------------------------------------------------------------------------------------
# Layouts: parameter shapes, nothing downloaded
# ---------------------------------------------------------------------------------------------

def resnet18_shapes_by_hand() -> list:
    """torchvision's ``resnet18()`` parameter shapes in its parameter order, written out from
    the architecture (for machines without torchvision): 62 tensors, 11,689,512 elements."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]                      # conv1, bn1
    inplanes = 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):                                    # two BasicBlocks per stage
            shapes += [(planes, inplanes, 3, 3), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,)]
            if block == 0 and (stride != 1 or inplanes != planes):
                shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]  # downsample
            inplanes = planes
    return shapes + [(1000, 512), (1000,)]                        # fc


def resnet18_shapes() -> tuple:
    """(shapes, source): torchvision's ``resnet18()`` (no weights) when torchvision imports,
    else :func:`resnet18_shapes_by_hand`."""
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return resnet18_shapes_by_hand(), "written out by hand (torchvision not importable)"
    model = torchvision.models.resnet18(weights=None)
    return [tuple(p.shape) for p in model.parameters()], \
        f"torchvision {torchvision.__version__} resnet18()"


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list:
    """GPT-2-124M's parameter shapes (Hugging Face's layout, the LM head tied to wte): wte,
    wpe, per block ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weights and
    biases), ln_f. 148 tensors, 124,439,808 elements."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,),                       # ln_1
                   (d, 3 * d), (3 * d,),             # attn.c_attn
                   (d, d), (d,),                     # attn.c_proj
                   (d,), (d,),                       # ln_2
                   (d, 4 * d), (4 * d,),             # mlp.c_fc
                   (4 * d, d), (d,)]                 # mlp.c_proj
    return shapes + [(d,), (d,)]                     # ln_f


def layout_shapes(choice: str) -> tuple:
    """(name, shapes, where the shapes come from) of a ``--layouts`` choice."""
    if choice == "mlp":
        return LAYOUT_NAMES[choice], common.mlp_shapes(), "784-100-100-10"
    if choice == "resnet18":
        shapes, source = resnet18_shapes()
        return LAYOUT_NAMES[choice], shapes, source
    if choice == "many":
        return LAYOUT_NAMES[choice], [(4096,)] * 1000, "1,000 tensors of 4,096"
    if choice == "gpt2":
        return LAYOUT_NAMES[choice], gpt2_shapes(), "GPT-2-124M shapes, written out"
    raise ValueError(f"unknown layout {choice!r}; the layouts are {LAYOUT_CHOICES}")


def numel_of(shapes) -> int:
    return sum(torch.Size(shape).numel() for shape in shapes)


def make_params(shapes, dtype: torch.dtype, device: torch.device, gen) -> list:
    """One leaf parameter per shape, θ ~ 0.1·N(0,1), each with its own gradient
    g ~ 1e-3·N(0,1) (never zeros) that stays for the whole run (no backward in the timed
    loop). Raises if any two of these tensors share memory."""
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device)
                               .mul_(PARAM_SCALE).to(dtype))
        p.grad = torch.randn(shape, generator=gen, device=device).mul_(GRAD_SCALE).to(dtype)
        params.append(p)
    shared = common.overlapping([t for p in params for t in (p, p.grad)])
    if shared:
        raise RuntimeError(f"make_params: {len(shared)} pair(s) of parameters/gradients share "
                           "memory")
    return params


# ---------------------------------------------------------------------------------------------
# Contenders
# ---------------------------------------------------------------------------------------------

def bytes_per_element(kind: str, dtype: torch.dtype) -> int:
    """Bytes read + written per parameter element by one step, the least any implementation
    of the update must move (a multi-pass foreach step moves more; its GB/s is then an
    effective rate). p = the parameter dtype's size:

    * EMCL inner+meta (``step()`` with ``meta_every=1``): SPEC section 5's combined step, θ, g
      in p and θ₀, h in fp32: 3p + 16 (fp32 28 B, bf16 22 B);
    * EMCL inner (``inner_step()``): 3p + 8 (20 B, 14 B);
    * Adam: θ read+write, g, exp_avg and exp_avg_sq read+write, the state in the parameter's
      dtype (as torch keeps it): 7p (28 B, 14 B);
    * SGD with momentum: θ read+write, g, the buffer read+write: 5p (20 B, 10 B);
    * the inner step's reads alone (a floor, :func:`floor_contenders`): 2p + 8 (16 B).

    The non-finite check of EMCL's default setting reads g once more (+p), not counted here.
    """
    p = torch.empty((), dtype=dtype).element_size()
    if kind == "emcl_step":
        return common.bytes_per_element("inner_meta_step", dtype)
    if kind == "emcl_inner":
        return common.bytes_per_element("inner_step", dtype)
    if kind == "adam":
        return 7 * p
    if kind == "sgd":
        return 5 * p
    if kind == "inner_reads":
        return common.bytes_per_element("inner_step", dtype) - p
    raise ValueError(f"no byte model for {kind!r}")


@dataclass
class Contender:
    """One timed call: an optimizer and the method called on it."""
    name: str                      # e.g. "emcl[cpu] step() nocheck"
    family: str                    # adam_fused | adam_foreach | sgd_foreach | emcl
    optimizer: object
    call: str                      # "step()" or "inner_step()"
    bytes_kind: str
    backend: Optional[str] = None
    check_finite: Optional[bool] = None
    settings: dict = field(default_factory=dict)
    wall: list = field(default_factory=list)     # seconds per step (CPU: every step; GPU: per block)
    host: list = field(default_factory=list)     # seconds per step() call (GPU; CPU: = wall)
    blocks: int = 0                              # blocks timed (one per round)
    steps: int = 0
    estimate_s: float = 0.0                      # the last warm-up step's wall time
    block: int = 1
    error: Optional[str] = None
    runner: Optional[Callable[[], object]] = None   # what one step is, when not optimizer.call
    scaler: bool = False                            # stepped through a torch.amp.GradScaler

    @property
    def fn(self) -> Callable[[], object]:
        if self.runner is not None:
            return self.runner
        return getattr(self.optimizer, self.call.rstrip("()"))


def checked_step(optimizer) -> Callable[[], object]:
    """``optimizer.step()`` (a torch optimizer with ``_step_supports_amp_scaling``, e.g.
    ``Adam(fused=True)``) skipping non-finite steps the way torch does, without a scale: what
    ``torch.amp.GradScaler.step`` does for such an optimizer (``_check_inf_per_device`` then
    ``step``, in torch/amp/grad_scaler.py): every step, the gradients grouped by device and
    dtype, one ``torch._amp_foreach_non_finite_check_and_unscale_`` per group with an inverse
    scale of 1.0 into a fresh ``found_inf``, the flags summed onto one device, handed to the
    step as ``optimizer.found_inf`` with ``optimizer.grad_scale = None`` (the fused kernel then
    skips the update, and the step counters, where ``found_inf`` is non-zero)."""
    from collections import defaultdict

    def step():
        by_device = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        by_device[p.grad.device][p.grad.dtype].append(p.grad)
            found = []
            for device, per_dtype in by_device.items():
                found_inf = torch.full((), 0.0, dtype=torch.float32, device=device)
                inv_scale = torch.full((), 1.0, dtype=torch.float32, device=device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
                found.append(found_inf)
        first = found[0].device if found else torch.device("cpu")
        optimizer.grad_scale = None
        optimizer.found_inf = sum(t.to(first, non_blocking=True) for t in found)
        try:
            return optimizer.step()
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
    return step


def scaler_step(optimizer, device: torch.device) -> Callable[[], object]:
    """``scaler.step(optimizer); scaler.update()`` with a ``torch.amp.GradScaler`` of its own
    (default settings; its scale made once by ``scaler.scale``, as the first backward of a
    training loop would): torch's finite check of every gradient, then the optimizer's step with
    the scale and ``found_inf`` (fused Adam and EMCL divide the gradients by the scale in their
    own pass), then the scale's update."""
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))

    def step():
        scaler.step(optimizer)
        scaler.update()
    return step


def torch_check_missing(params: list) -> Optional[str]:
    """Why torch's finite check (``torch._amp_foreach_non_finite_check_and_unscale_``, what a
    ``GradScaler`` runs) cannot check these gradients, or None where it can: on CUDA torch 2.11
    has no bf16 kernel for it, so neither ``adam_fused_checked`` nor any ``... scaler``
    contender exists there (a bf16 model is trained without a scaler)."""
    if not params:
        return None
    probe = torch.ones(1, dtype=params[0].dtype, device=params[0].device)
    found = torch.zeros((), dtype=torch.float32, device=probe.device)
    inv = torch.ones((), dtype=torch.float32, device=probe.device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([probe], found, inv)
    except (NotImplementedError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (f"not timed: torch's finite check has no kernel for {probe.dtype} gradients "
                f"on {probe.device.type} ({first})")
    return None


def make_contenders(params: list, emcl_backends: list, log) -> tuple:
    """(contenders, errors): torch's baselines (fused Adam plain, checked and under a
    GradScaler, on one ``Adam(fused=True)``; foreach Adam; foreach SGD) and, per EMCL backend,
    one optimizer with its defaults (timed through ``step()``, ``inner_step()`` and ``step()``
    under a GradScaler) and one with ``check_finite=False`` (``step()``, ``inner_step()``).
    Contenders that share an optimizer share its state: they step the same tensors anyway.
    A constructor that raises is recorded, not fatal; so are the checked and GradScaler
    contenders where torch cannot check the gradients' dtype (:func:`torch_check_missing`)."""
    out, errors = [], {}
    device = params[0].device if params else torch.device("cpu")
    no_check = torch_check_missing(params)
    if no_check:
        log(f"      adam_fused_checked and every GradScaler contender: {no_check}")
        errors["adam_fused_checked"] = errors["adam_fused_scaler"] = no_check
    specs = [
        ("adam_fused", lambda: torch.optim.Adam(params, lr=1e-3, fused=True),
         {"lr": 1e-3, "fused": True}),
        ("adam_foreach", lambda: torch.optim.Adam(params, lr=1e-3, foreach=True),
         {"lr": 1e-3, "foreach": True}),
        ("sgd_foreach", lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
         {"lr": 1e-3, "momentum": 0.9, "foreach": True}),
    ]
    for name, build, settings in specs:
        try:
            opt = build()
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"      {name}: cannot be built: {errors[name]}")
            continue
        kind = "adam" if name.startswith("adam") else "sgd"
        out.append(Contender(name, name, opt, "step()", kind, settings=settings))
        if name == "adam_fused" and not no_check:
            out.append(Contender("adam_fused_checked", "adam_fused_checked", opt, "step()",
                                 "adam", settings={**settings, "finite_check":
                                                   "_amp_foreach_non_finite_check_and_unscale_"},
                                 runner=checked_step(opt)))
            out.append(Contender("adam_fused_scaler", "adam_fused_scaler", opt, "step()",
                                 "adam", settings={**settings, "grad_scaler": "default"},
                                 runner=scaler_step(opt, device), scaler=True))
    for backend in emcl_backends:
        for check in (True, False):
            suffix = "" if check else " nocheck"
            try:
                opt = FusedEMCLOptimizer(params, meta_every=1, backend=backend,
                                         check_finite=check)
            except Exception as exc:  # noqa: BLE001
                errors[f"emcl[{backend}]{suffix}"] = f"{type(exc).__name__}: {exc}"
                continue
            settings = {"meta_every": 1, "backend": backend, "check_finite": check}
            out.append(Contender(f"emcl[{backend}] step(){suffix}", "emcl", opt, "step()",
                                 "emcl_step", backend, check, settings))
            out.append(Contender(f"emcl[{backend}] inner_step(){suffix}", "emcl", opt,
                                 "inner_step()", "emcl_inner", backend, check, settings))
            if check and no_check:
                errors[f"emcl[{backend}] step() scaler"] = no_check
            elif check:
                out.append(Contender(f"emcl[{backend}] step() scaler", "emcl", opt, "step()",
                                     "emcl_step", backend, check,
                                     {**settings, "grad_scaler": "default"},
                                     runner=scaler_step(opt, device), scaler=True))
    return out, errors


# The floors: the extension's probes ([note: stream probes] in csrc/emcl_cpu_kernels.h) with the
# fp32 steps' streams, timed in the same rounds as the optimizers, on four flat tensors of the
# layout's size: name -> (stream_probe_ kind, byte model, the EMCL step it bounds).
FLOORS = {"floor: step streams": (5, "emcl_step", "inner+meta"),  # reads θ, g, θ₀, h; writes
                                                                  # θ, θ₀, h (28 B, as Adam's)
          "floor: inner streams": (3, "emcl_inner", "inner"),     # writes θ alone (20 B)
          "floor: inner reads": (4, "inner_reads", "inner")}      # writes nothing (16 B)
#: The same floors for bf16 layouts: θ and g bf16, θ₀ and h fp32, as the bf16 steps read them
#: (kinds 6 and 7: 22 B and 14 B per element).
BF16_FLOORS = {"floor: step streams": (6, "emcl_step", "inner+meta"),
               "floor: inner streams": (7, "emcl_inner", "inner")}
#: The EMCL step each floor bounds (the same name bounds the same step in either dtype).
FLOOR_STEP = {name: step for floors in (FLOORS, BF16_FLOORS)
              for name, (_, _, step) in floors.items()}
#: The floor a step's ``ratio_to_floor`` is taken against: the one with all its streams.
STREAMS_FLOOR = {"inner+meta": "floor: step streams", "inner": "floor: inner streams"}


def floor_contenders(numel: int, dtype: torch.dtype, device: torch.device) -> list:
    """The :data:`FLOORS` as contenders (family ``floor``) for an fp32 layout, the
    :data:`BF16_FLOORS` for a bf16 one, on a CPU whose extension has the probes, else none. No
    kernel that reads θ, g, θ₀ and h and writes θ moves them faster than ``floor: inner
    streams`` does on the same machine in the same rounds, give or take how well a loop is
    written, and none that also writes θ₀ and h (or, fused Adam, reads θ, g, m, v and writes θ,
    m, v) faster than ``floor: step streams``: a step's ``ratio_to_floor`` says how close it
    is, and ``floor_ratio_to_peer`` what ratio to fused Adam that speed gives."""
    floors = {torch.float32: FLOORS, torch.bfloat16: BF16_FLOORS}.get(dtype)
    if floors is None or not common.stream_probes_available(device):
        return []
    tensors = [torch.rand(numel, device=device).to(dtype if i < 2 else torch.float32)
               for i in range(4)]
    out = []
    for name, (kind, bytes_kind, _) in floors.items():
        run = (lambda kind=kind: torch.ops.emcl.stream_probe_(*tensors, kind))
        out.append(Contender(name, "floor", None, "stream_probe_", bytes_kind,
                             settings={"stream_probe_kind": kind}, runner=run))
    return out


def state_tensors(optimizer) -> list:
    if optimizer is None:
        return []
    return [v for st in optimizer.state.values() for v in st.values()
            if torch.is_tensor(v) and v.is_floating_point()]


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

@dataclass
class Settings:
    """How hard to measure; ``full()`` and ``quick()`` are the presets."""
    mode: str
    warmup: int            # steps of every contender before timing (state, plans, caches)
    min_rounds: int
    max_rounds: int
    budget_s: float        # time for the rounds of one (layout, dtype, threads) group, about
    block_s: float         # time of one contender's block of consecutive steps, about
    max_block: int
    gpu_min_block: int
    profile_steps: int     # GPU steps under torch.profiler per contender
    reference_cap: int     # EMCL's reference backend only up to this many elements
    roof_reps: int

    @classmethod
    def full(cls) -> "Settings":
        return cls("full", warmup=2, min_rounds=5, max_rounds=60, budget_s=20.0, block_s=0.002,
                   max_block=50, gpu_min_block=20, profile_steps=10, reference_cap=2 ** 20,
                   roof_reps=10)

    @classmethod
    def quick(cls) -> "Settings":
        return cls("quick", warmup=2, min_rounds=3, max_rounds=15, budget_s=3.0, block_s=0.001,
                   max_block=20, gpu_min_block=10, profile_steps=3, reference_cap=2 ** 20,
                   roof_reps=4)


def run_block(c: Contender, device: torch.device, steps: int) -> None:
    """``steps`` consecutive calls of ``c``. CPU: each call timed (wall = host). GPU: host
    time of each call without synchronizing, wall time of the whole block between two
    synchronizations (the steps pipelined, as in training), per step."""
    fn = c.fn
    common.synchronize(device)
    start = time.perf_counter()
    secs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    common.synchronize(device)
    if device.type == "cuda":
        c.wall.append((time.perf_counter() - start) / steps)
    else:
        c.wall.extend(secs)
    c.host.extend(secs)
    c.blocks += 1
    c.steps += steps


def warm_up(contenders: list, device: torch.device, steps: int, log) -> list:
    """``steps`` (at least one) untimed steps of every contender, the last one's wall time kept
    as the estimate that sizes its blocks; returns the contenders that worked (one whose step
    raises keeps the error and is dropped)."""
    alive = []
    for c in contenders:
        if c.error:
            continue
        try:
            for _ in range(max(1, steps)):
                c.estimate_s = common.time_once(c.fn, device)
                c.steps += 1
            alive.append(c)
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            c.error = f"{type(exc).__name__}: {exc}".strip()[:500]
            log(f"      {c.name}: step failed: {c.error}")
    return alive


def time_group(contenders: list, device: torch.device, settings: Settings, log) -> int:
    """Interleaved rounds: each round runs one block of every contender, starting one
    contender later than the round before, so that load on a shared machine (and any drift)
    falls on every contender alike. A contender whose step raises keeps the error and sits
    out the remaining rounds. Returns the number of rounds."""
    lo = settings.gpu_min_block if device.type == "cuda" else 1
    for c in contenders:
        c.block = int(max(lo, min(settings.max_block,
                                  -(-settings.block_s // max(c.estimate_s, 1e-7)))))
    round_s = sum(c.block * c.estimate_s for c in contenders)
    rounds = common.repeats_for(round_s, settings.budget_s, settings.min_rounds,
                                settings.max_rounds)
    n = len(contenders)
    for r in range(rounds):
        for i in range(n):
            c = contenders[(r + i) % n]
            if c.error:
                continue
            try:
                run_block(c, device, c.block)
            except Exception as exc:  # noqa: BLE001 - recorded in the results
                c.error = f"{type(exc).__name__}: {exc}".strip()[:500]
                log(f"      {c.name}: step failed in round {r}: {c.error}")
    return rounds


def gpu_activities(c: Contender, device: torch.device, steps: int) -> dict:
    """Per step of ``c`` under ``torch.profiler``: GPU activities (kernels, memcpy, memset;
    user annotations left out), their summed durations (the device time), where every memcpy
    was issued from, and the extension's own launch counter where it has one."""
    from torch.profiler import ProfilerActivity, profile

    counter = None
    try:
        from emcl_kernels.backends import extension
        counter = getattr(extension, "launch_count", None)
        if counter is not None:
            counter()
    except Exception:  # noqa: BLE001 - the counter is optional (it may move in a rewrite)
        counter = None
    torch.cuda.synchronize(device)
    before = counter() if counter else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            c.fn()
        torch.cuda.synchronize(device)
    after = counter() if counter else None
    c.steps += steps
    return {**summarize_gpu_events(prof.events(), steps),
            "extension_launches_per_step":
                (after - before) / steps if before is not None and c.family == "emcl" else None}


def summarize_gpu_events(events, steps: int) -> dict:
    """Per step, from ``torch.profiler`` events: the CUDA activities (kernels, memcpy, memset)
    counted and their durations summed (``device_ms``). CPU events are left out, and so are
    user annotations: record_function ranges (torch's "Optimizer.step#Adam.step") are mirrored
    on the GPU timeline around the kernels they contain and are not activities of their own."""
    from torch.autograd import DeviceType

    kinds = {"kernel": 0, "memcpy": 0, "memset": 0}
    device_us = 0.0
    for evt in events:
        if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False) \
                or evt.name.startswith("Optimizer."):
            continue
        name = evt.name.lower()
        kind = "memcpy" if name.startswith("memcpy") else \
            "memset" if name.startswith("memset") else "kernel"
        kinds[kind] += 1
        device_us += evt.time_range.elapsed_us()
    return {"device_ms": device_us / 1e3 / steps,
            "gpu_activities_per_step": sum(kinds.values()) / steps,
            **{f"gpu_{k}s_per_step": v / steps for k, v in kinds.items()},
            "gpu_memcpy_sources": {k: v / steps for k, v in memcpy_sources(events).items()}}


def memcpy_sources(events) -> dict:
    """Where the profiled memcpys came from: "op @ frame" -> count, the op being the CPU event
    that launched the copy and the frame the innermost Python frame of this project (the
    package or the benchmarks) on its stack or its parents' (``with_stack`` profiles; else the
    op alone). A step that should be one launch and shows a copy is host work to find."""
    from torch.autograd import DeviceType

    found: dict = {}
    for evt in events:
        if evt.device_type != DeviceType.CPU:
            continue
        copies = sum(1 for k in getattr(evt, "kernels", ()) or ()
                     if k.name.lower().startswith("memcpy"))
        if not copies:
            continue
        where, node = "", evt
        while node is not None and not where:
            where = next((f for f in getattr(node, "stack", ()) or ()
                          if "emcl_kernels" in f or "benchmarks" in f), "")
            node = getattr(node, "cpu_parent", None)
        key = f"{evt.name} @ {where}" if where else evt.name
        found[key] = found.get(key, 0) + copies
    return found


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------

def record_of(c: Contender, group: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The JSON record of one contender in one group (ratios filled in later)."""
    rec = {"device": device.type, "device_name": common.device_name(device), **group,
           "contender": c.name, "family": c.family, "call": c.call, "backend": c.backend,
           "check_finite": c.check_finite, "grad_scaler": c.scaler, "settings": c.settings,
           "emcl_step": ({"emcl_step": "inner+meta", "emcl_inner": "inner"}.get(c.bytes_kind)
                         if c.family == "emcl" else None),
           "bytes_per_element": bytes_per_element(c.bytes_kind, dtype),
           "error": c.error, "steps_taken": c.steps}
    if c.error or not c.wall:
        return rec
    wall, host = common.Stats.of(c.wall), common.Stats.of(c.host)
    rec.update({
        "wall_ms": wall.median_ms, "wall_ms_min": wall.min_ms, "wall_ms_q25": wall.q25_ms,
        "wall_ms_q75": wall.q75_ms, "samples": wall.repeats, "rounds": c.blocks,
        "steps_per_block": c.block,
        "host_ms": host.median_ms, "host_ms_q25": host.q25_ms, "host_ms_q75": host.q75_ms,
        # on a GPU wall is a block's mean and host a call's median: a wall above the host time
        # of a step that keeps the GPU idle is the host calls' tail, which these show
        "host_ms_mean": 1e3 * statistics.fmean(c.host),
        "host_ms_p99": 1e3 * sorted(c.host)[min(len(c.host) - 1, int(0.99 * len(c.host)))],
        "wall_timer": "perf_counter per step" if device.type == "cpu"
        else "perf_counter per block of steps between two cuda synchronizations",
        "gbps": common.gbps(rec["bytes_per_element"] * group["numel"], wall.median_ms / 1e3),
    })
    if group.get("roof_gbps"):
        rec["ratio_to_roof"] = rec["gbps"] / group["roof_gbps"]
    return rec


def add_ratios(records: list) -> None:
    """``ratio_to_<baseline>``: each record's median wall time over the baseline's in the same
    group (device, threads, layout, dtype); ``ratio_to_<baseline>_min``: the same of the
    fastest steps (on a shared machine other jobs only ever add time). None where either is
    missing. EMCL records with a SPEC section 7 peer (``PEERS``) also get ``peer``, ``goal``,
    ``ratio_to_peer`` (and ``_min``) and ``verdict``: "met" (median ratio <= goal), "tie"
    (above it, but the interquartile ranges reach it: EMCL's lower quartile over the peer's
    upper quartile <= goal) or "missed"."""
    groups = {}
    for r in records:
        groups.setdefault((r["device"], r["threads"], r["layout"], r["dtype"]), []).append(r)
    for recs in groups.values():
        base = {r["family"]: r for r in recs if r["family"] in BASELINES and r.get("wall_ms")}
        floors = {r["contender"]: r for r in recs if r["family"] == "floor" and r.get("wall_ms")}
        for r in recs:
            for b in BASELINES:
                ok = bool(r.get("wall_ms")) and b in base
                r[f"ratio_to_{b}"] = r["wall_ms"] / base[b]["wall_ms"] if ok else None
                r[f"ratio_to_{b}_min"] = (r["wall_ms_min"] / base[b]["wall_ms_min"]
                                          if ok else None)
            if r.get("family") != "emcl":
                continue
            peer = PEERS.get((r.get("call"), r.get("check_finite"), bool(r.get("grad_scaler"))))
            if peer is None:
                continue
            name, goal = peer
            ratio = r.get(f"ratio_to_{name}")
            r.update({"peer": name, "goal": goal, "ratio_to_peer": ratio,
                      "ratio_to_peer_min": r.get(f"ratio_to_{name}_min"), "verdict": None})
            if ratio is None:
                continue
            p = base[name]
            spread = (r["wall_ms_q25"] / p["wall_ms_q75"]
                      if r.get("wall_ms_q25") and p.get("wall_ms_q75") else None)
            r["ratio_to_peer_spread"] = spread
            r["verdict"] = ("met" if ratio <= goal else
                            "tie" if spread is not None and spread <= goal else "missed")
            if floors and not r.get("check_finite") and not r.get("grad_scaler"):
                add_floor_ratios(r, p, floors)


def add_floor_ratios(r: dict, peer: dict, floors: dict) -> None:
    """For an EMCL record without the check whose group timed its step's floors
    (:func:`floor_contenders`): ``floor_ratio_to_peer`` (floor -> the floor's median time over
    the peer's: the ratio the step would have at that floor's speed), ``ratio_to_floor`` (the
    step's median time over its :data:`STREAMS_FLOOR`'s), ``floor`` (that floor's name) and
    ``ratio_to_floor_spread`` (the step's lower quartile over that floor's upper one). A goal
    below ``floor_ratio_to_peer[r["floor"]]`` is one that moving the same bytes faster does not
    reach on this machine."""
    step = r.get("emcl_step")
    mine = {n: f for n, f in floors.items() if FLOOR_STEP.get(n) == step}
    if not mine:
        return
    r["floor_ratio_to_peer"] = {n: f["wall_ms"] / peer["wall_ms"] for n, f in mine.items()}
    streams = mine.get(STREAMS_FLOOR.get(step))
    if streams:
        r["floor"] = streams["contender"]
        r["ratio_to_floor"] = r["wall_ms"] / streams["wall_ms"]
        r["ratio_to_floor_spread"] = r["wall_ms_q25"] / streams["wall_ms_q75"]


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def measure_roof(device: torch.device, args, emcl_backends: list, settings: Settings,
                 log) -> dict:
    """``common.device_roof`` at the current thread count (``--roof-mb``, ``--rotate-mb``)."""
    roof = common.device_roof(
        device, settings.roof_reps, backends=emcl_backends,
        largest=max(1, int(args.roof_mb * 2 ** 20) // 4) if args.roof_mb else None,
        rotate_bytes=int(args.rotate_mb * 2 ** 20) if args.rotate_mb else None)
    log(f"   roof at {roof['threads']} thread(s): {roof['roof_gbps']:.1f} GB/s "
        f"({roof['roof_kernel']} at {roof['roof_numel']:,} elements, fastest repeat; "
        f"write-allocate {'counted' if roof['write_allocate'] else 'not counted'}); "
        f"copy {roof['copy_gbps']:.1f} GB/s")
    return roof


def run_layout(device, choice, dtype, thread_counts, emcl_backends, args, settings, roofs, log):
    """Every contender on one layout and dtype, at every thread count; returns the records."""
    name, shapes, source = layout_shapes(choice)
    numel = numel_of(shapes)
    dname = {v: k for k, v in common.DTYPE_NAMES.items()}[dtype]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    params = make_params(shapes, dtype, device, gen)
    backends = [b for b in emcl_backends
                if b != "reference" or numel <= settings.reference_cap]
    log(f"   {name} ({len(shapes)} tensors, {numel:,} elements, {source}) {dname}")
    contenders, errors = make_contenders(params, backends, log)
    contenders += floor_contenders(numel, dtype, device)
    records = []
    for threads in thread_counts:
        if threads is not None:
            torch.set_num_threads(threads)
        load_before = common.load_average()
        alive = warm_up(contenders, device, settings.warmup, log)
        rounds = time_group(alive, device, settings, log) if alive else 0
        profile = {}
        if device.type == "cuda":
            for c in (c for c in alive if not c.error):
                try:
                    profile[c.name] = gpu_activities(c, device, settings.profile_steps)
                except Exception as exc:  # noqa: BLE001 - the timings stand without it
                    log(f"      (profiler failed for {c.name}: {type(exc).__name__}: {exc})")
        load_after = common.load_average()
        params_finite = all_finite(params)
        roof = roofs.get(torch.get_num_threads())
        group = {"threads": torch.get_num_threads(), "layout": name, "layout_source": source,
                 "n_tensors": len(shapes), "numel": numel, "dtype": dname,
                 "load_average_before": load_before, "load_average_after": load_after,
                 "group_rounds": rounds,
                 "roof_gbps": roof["roof_gbps"] if roof else None,
                 "copy_gbps": roof["copy_gbps"] if roof else None}
        for c in contenders:
            rec = record_of(c, group, device, dtype)
            rec.update(profile.get(c.name, {"device_ms": None, "gpu_activities_per_step": None,
                                            "extension_launches_per_step": None}))
            rec["finite"] = params_finite and all_finite(state_tensors(c.optimizer))
            records.append(rec)
            # wall/host samples restart for the next thread count
            c.wall, c.host, c.blocks = [], [], 0
        for key, err in errors.items():
            records.append({"device": device.type, **group, "contender": key,
                            "family": "emcl" if key.startswith("emcl") else key,
                            "error": err})
        _log_group(records[-len(contenders) - len(errors):], log)
    del contenders, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def _log_group(records: list, log) -> None:
    add_ratios(records)
    for r in records:
        if r.get("error"):
            log(f"      {r['contender']:<34} error: {r['error']}")
            continue
        extra = ""
        if r.get("device_ms") is not None:
            extra = (f" host {r['host_ms']:.3f} device {r['device_ms']:.3f} ms, "
                     f"{r['gpu_activities_per_step']:.1f} GPU activities/step")
        ratio = r.get("ratio_to_adam_fused")
        log(f"      {r['threads']}t {r['contender']:<34} {r['wall_ms']:10.4f} ms "
            f"[{r['wall_ms_q25']:.4f}, {r['wall_ms_q75']:.4f}] "
            f"{'-' if ratio is None else f'{ratio:.2f}'}x Adam-fused, {r['gbps']:.2f} GB/s"
            f"{_peer_text(r)}{extra}{'' if r['finite'] else '  NOT FINITE'}")


def _peer_text(r: dict) -> str:
    """", 0.93x adam_fused_checked (goal 1.0: met)" for a record with a peer, else "" (and for
    a step with floors: "; at its streams' speed 0.81x (1.04x their time)")."""
    if r.get("ratio_to_peer") is None:
        return ""
    floor = (r.get("floor_ratio_to_peer") or {}).get(r.get("floor"))
    extra = (f"; at its streams' speed {floor:.2f}x ({r['ratio_to_floor']:.2f}x their time)"
             if floor is not None else "")
    return f", {r['ratio_to_peer']:.2f}x {r['peer']} (goal {r['goal']}: {r['verdict']}{extra})"


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser("step", __doc__, "device", "threads", "out", "name", "note", "quick",
                       "plot", "quiet", many_threads=True,
                       threads_default="on CPU: 1 2; on a GPU: torch's",
                       quick="fewer rounds and warm-up steps")
    p.add_argument("--layouts", nargs="+", default=None, choices=LAYOUT_CHOICES,
                   help="default: every one (--table: every one in the file)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=["fp32", "bf16"],
                   help="default: both (--table: every one in the file)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="EMCL backends (default: every one available on the device; --table: "
                        "every one in the file)")
    p.add_argument("--reference-cap", type=int, default=None, metavar="LOG2",
                   help="EMCL's reference backend only up to 2**LOG2 elements (default 20)")
    p.add_argument("--rounds", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="rounds per group (full 5 60, quick 3 15)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of rounds per group, about (full 20, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender")
    p.add_argument("--roof-mb", type=float, default=None,
                   help="MiB per tensor of the roof's largest size (default: 256 on CPU, 1 GiB on "
                        "a GPU)")
    p.add_argument("--rotate-mb", type=float, default=None,
                   help="MiB of the roof's rotated tensor sets per size (default: 4 x the "
                        "last-level cache)")
    p.add_argument("--no-roof", action="store_true", help="skip the roof measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", nargs="*", metavar="RESULTS_JSON", default=None,
                   help="print the tables of these results files (none: the newest "
                        "benchmarks/results/step_*.json) and exit; --backends, --layouts and "
                        "--dtypes select")
    return p


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results dict (also written to ``--out``)."""
    args = build_parser().parse_args(argv)
    if args.table is not None:
        return {"table": print_tables(args.table, args)}
    args.layouts = args.layouts or list(LAYOUT_CHOICES)
    args.dtypes = args.dtypes or ["fp32", "bf16"]
    settings = Settings.quick() if args.quick else Settings.full()
    if args.rounds:
        settings.min_rounds, settings.max_rounds = args.rounds
        if not 1 <= settings.min_rounds <= settings.max_rounds:
            raise SystemExit("--rounds: need 1 <= MIN <= MAX")
    if args.budget is not None:
        settings.budget_s = args.budget
    if args.warmup is not None:
        settings.warmup = args.warmup
    if args.reference_cap is not None:
        settings.reference_cap = 2 ** args.reference_cap
    with harness.threads(None):
        return _main(args, argv, settings, harness.device_of(args.device))


def _main(args, argv, settings: Settings, device: torch.device) -> dict:
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))
    started = time.perf_counter()
    if device.type == "cuda":
        thread_counts = [None] if args.threads is None else args.threads[:1]
    else:
        thread_counts = args.threads or [1, 2]
    emcl_backends, skipped = common.backends_for(device, only=args.backends)
    if not emcl_backends:
        raise SystemExit(f"no EMCL backend to time on {device}: " +
                         "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    result = harness.head("step", argv, device, schema=SCHEMA, note=args.note)
    result.update({
        "settings": {**settings.__dict__, "param_scale": PARAM_SCALE, "grad_scale": GRAD_SCALE,
                     "thread_counts": [t or torch.get_num_threads() for t in thread_counts]},
        "emcl_backends": emcl_backends, "skipped_backends": skipped,
        "byte_model": {f"{k}/{d}": bytes_per_element(k, common.DTYPE_NAMES[d])
                       for k in ("emcl_step", "emcl_inner", "adam", "sgd", "inner_reads")
                       for d in args.dtypes},
        "roofs": [], "records": []})
    log(f"== {result['device_name']}: EMCL backends {', '.join(emcl_backends)}; "
        f"{settings.mode} run; load average {common.load_average()}")
    for name, why in skipped.items():
        log(f"   not timed: emcl[{name}]: {why}")
    for note in result["notes"]:
        log(f"   warning: {note}")
    roofs = {}
    if not args.no_roof:
        for threads in thread_counts:
            if threads is not None:
                torch.set_num_threads(threads)
            roof = measure_roof(device, args, emcl_backends, settings, log)
            roofs[roof["threads"]] = roof
            result["roofs"].append(roof)
    stem = args.name or f"step_{common.utc_stamp()}_{device.type}"
    path = os.path.join(args.out, stem + ".json")
    result["complete"] = False
    for choice in args.layouts:
        for dname in args.dtypes:
            result["records"] += run_layout(device, choice, common.DTYPE_NAMES[dname],
                                            thread_counts, emcl_backends, args, settings,
                                            roofs, log)
            add_ratios(result["records"])
            harness.save(result, path)   # after every group: a run cut short keeps its groups
    bad = [r for r in result["records"] if r.get("finite") is False]
    if bad:
        result["notes"].append(f"{len(bad)} record(s) ended with non-finite parameters or "
                               "state: their timings may be distorted")
    # A step whose bytes fit in the last-level cache may beat the memory roof; one that
    # streams several caches' worth cannot.
    llc = common.last_level_cache_bytes(device)
    above = [r for r in result["records"] if r.get("ratio_to_roof") and r["ratio_to_roof"] > 1.0
             and r["bytes_per_element"] * r["numel"] >= 4 * llc]
    if above:
        result["notes"].append(f"BUG: {len(above)} step(s) that stream more than 4 x the "
                               "last-level cache ran above the memory roof: find why")
    result["wall_time_s"] = time.perf_counter() - started
    result["complete"] = True
    return harness.finish(result, args.out, stem, plot=plot, no_plot=args.no_plot,
                          table=lambda res: tables(res, source=res["paths"]["json"]))


# ---------------------------------------------------------------------------------------------
# Output: the tables (the terminal's at the end of a run, docs/performance.md's from a file)
# ---------------------------------------------------------------------------------------------

def contender_order(records: list) -> list:
    """The contenders in a stable order: the baselines, then EMCL per backend."""
    names = list(dict.fromkeys(r["contender"] for r in records))
    return sorted(names, key=lambda n: (0, BASELINES.index(n)) if n in BASELINES else
                  (1, n.split("]")[0], "inner_step()" in n, "nocheck" in n, "scaler" in n, n))


BASELINE_TITLES = {"adam_fused": "Adam fused", "adam_fused_checked": "Adam fused, checked",
                   "adam_fused_scaler": "Adam fused + GradScaler", "adam_foreach": "Adam foreach",
                   "sgd_foreach": "SGD foreach"}
# the column title of each SPEC section 7 row (:data:`PEERS`), in the table's order
PEER_TITLES = {("step()", False, False): "`step()`, check off / Adam fused",
               ("step()", True, False): "`step()` / Adam fused, checked",
               ("step()", True, True): "`step()` + GradScaler / Adam fused + GradScaler",
               ("inner_step()", False, False): "`inner_step()`, check off / Adam fused"}
VERDICT_MARK = {"met": "", "tie": " (tie)", "missed": " **(missed)**", None: ""}


def _title(name: str) -> str:
    if name in BASELINE_TITLES:
        return BASELINE_TITLES[name]
    return (name.replace("emcl[", "EMCL ").replace("]", "")
            .replace(" nocheck", ", check off").replace(" scaler", " + GradScaler"))


def _pair_key(r: dict) -> tuple:
    return (r.get("call"), r.get("check_finite"), bool(r.get("grad_scaler")))


def step_goals(records: list) -> list:
    """Lines saying, per EMCL backend and SPEC section 7 row, in how many cells the EMCL call
    met its goal against its like-for-like peer (``verdict`` of :func:`add_ratios`), tied
    with it within the interquartile ranges, or missed it, and the worst cell."""
    lines = []
    emcl = [r for r in records if r.get("family") == "emcl" and r.get("ratio_to_peer")]
    for key, title in PEER_TITLES.items():
        rs = [r for r in emcl if _pair_key(r) == key]
        for backend in dict.fromkeys(r["backend"] for r in rs):
            mine = [r for r in rs if r["backend"] == backend]
            count = {v: sum(r.get("verdict") == v for r in mine) for v in ("met", "tie", "missed")}
            worst = max(mine, key=lambda r: r["ratio_to_peer"])
            lines.append(
                f"- EMCL `{backend}` {title} (goal <= {worst['goal']}x): met in {count['met']} of "
                f"{len(mine)} cells, a tie within the quartiles in {count['tie']}, missed in "
                f"{count['missed']}; highest {worst['ratio_to_peer']:.2f}x ({worst['layout']} "
                f"{worst['dtype']}, {worst['threads']} thread(s))")
    return lines


def _error_cell(r: dict) -> str:
    """A contender that has no time: "n/a" where torch cannot run it (a "not timed: ..."
    error), "error" where it failed; the reason is listed under the table."""
    return "n/a" if r["error"].startswith("not timed") else "error"


def tables(result: dict, *, backends=None, layouts=None, dtypes=None, source: str = "") -> str:
    """The markdown of a results file: per thread count (CPU) or for the GPU, one row per
    layout and dtype; the three fused-Adam peers' median wall times, and per EMCL backend
    (``backends``, default all) the median wall time of each SPEC section 7 row over its
    peer's (in parentheses the same of the fastest steps; "(tie)" where the goal lies within
    the interquartile ranges, "(missed)" where not); the goals met per row and the errors;
    then every contender's wall time (on a GPU also host and device time and GPU activities
    per step) and its ratios to Adam fused and to its peer."""
    recs = [r for r in result["records"]
            if (not layouts or any(r["layout"].startswith(l) for l in layouts))
            and (not dtypes or r["dtype"] in dtypes)
            and (r["family"] != "emcl" or not backends or r.get("backend") in backends)]
    if not recs:
        raise SystemExit("no records match the selection")
    machine = result.get("machine", {})
    loads = [l for r in recs for l in (r.get("load_average_before"), r.get("load_average_after"))
             if l]
    roofs = "; ".join(f"{r['threads']} thread(s) {r['roof_gbps']:.1f} GB/s ({r['roof_kernel']})"
                      for r in result.get("roofs", []))
    caption = (f"**{result['device_name']}**, torch {machine.get('torch', '?')}; "
               f"{result['settings']['mode']} run of {result['created_utc']}"
               + (f", from `{source}`" if source else "") + ". The three Adam peers: median "
               "wall time of one step in ms [quartiles] (checked: torch's finite check "
               "`_amp_foreach_non_finite_check_and_unscale_` feeding `found_inf` to the fused "
               "step; + GradScaler: `scaler.step(opt); scaler.update()`). EMCL: median wall time "
               "over its like-for-like peer's (SPEC section 7), in parentheses the same of the "
               "fastest steps; every contender on the same tensors, interleaved round by round."
               + (f" 1-minute load average during the run: {min(l[0] for l in loads):.1f} to "
                  f"{max(l[0] for l in loads):.1f} on {machine.get('cpu_count', '?')} cores."
                  if loads else "")
               + (f" Memory roof: {roofs}." if roofs else ""))
    lines = [caption]
    emcl_backends = list(dict.fromkeys(r["backend"] for r in recs if r["family"] == "emcl"))
    floors = any(r["family"] == "floor" for r in recs)
    if floors:
        lines[0] += (" Floors over Adam fused (`torch.ops.emcl.stream_probe_` on four flat "
                     "tensors of the layout's size, fp32, in bf16 rows θ and g bf16, timed in "
                     "the same rounds): step, "
                     "`floor: step streams` (θ, g, θ₀, h read, θ, θ₀, h written: the "
                     "inner+meta step's streams, as many as fused Adam's); inner, `floor: inner "
                     "streams` (θ, g, θ₀, h read, θ written: the inner step's), in parentheses "
                     "its reads alone (`floor: inner reads`).")
    for threads in dict.fromkeys(r["threads"] for r in recs):
        sub = [r for r in recs if r["threads"] == threads]
        head = ["layout", "dtype"] + [f"{BASELINE_TITLES[b]} (ms)" for b in BASELINES[:3]]
        for backend in emcl_backends:
            prefix = f"EMCL `{backend}` " if len(emcl_backends) > 1 else "EMCL "
            head += [prefix + title for title in PEER_TITLES.values()]
        if floors:
            head.append("floor / Adam fused")
        title = f"{threads} thread(s)" if result["device"] == "cpu" else result["device_name"]
        lines += ["", f"*{title}*", "", "| " + " | ".join(head) + " |",
                  "|" + "|".join(["---", "---"] + ["--:"] * (len(head) - 2)) + "|"]
        for layout in dict.fromkeys(r["layout"] for r in sub):
            for dtype in dict.fromkeys(r["dtype"] for r in sub):
                here = [r for r in sub if r["layout"] == layout and r["dtype"] == dtype]
                if not here:
                    continue
                cells = [layout, dtype]
                for b in BASELINES[:3]:
                    r = next((r for r in here if r["family"] == b), None)
                    cells.append("-" if r is None else _error_cell(r) if r.get("error") else
                                 f"{r['wall_ms']:.3g} [{r['wall_ms_q25']:.3g}-"
                                 f"{r['wall_ms_q75']:.3g}]")
                for backend in emcl_backends:
                    for key in PEER_TITLES:
                        r = next((r for r in here if r["family"] == "emcl"
                                  and r["backend"] == backend and _pair_key(r) == key), None)
                        if r is None:
                            cells.append("-")
                        elif r.get("error"):
                            cells.append(_error_cell(r))
                        elif r.get("ratio_to_peer") is None:
                            cells.append(f"{r['wall_ms']:.3g} ms (no peer)")
                        else:
                            cells.append(f"{r['ratio_to_peer']:.2f}x "
                                         f"({r['ratio_to_peer_min']:.2f}x)"
                                         + VERDICT_MARK.get(r.get("verdict"), "")
                                         + ("" if r.get("finite", True) else " (not finite)"))
                if floors:
                    cells.append(_floor_cell(here))
                lines.append("| " + " | ".join(cells) + " |")
    errors = {(r["contender"], r["error"]) for r in recs if r.get("error")}
    goals = step_goals(recs)
    if goals or errors:
        lines.append("")
    lines += goals
    lines += [f"- {_title(n)}: {e}" for n, e in sorted(errors)]
    lines += ["", _contender_table(recs, gpu=result["device"] != "cpu")]
    return "\n".join(lines)


def _contender_table(recs: list, gpu: bool) -> str:
    """Every timed contender, one row each: its wall time (on a GPU also the host's and the
    device's, and GPU activities per step), over Adam fused's and over its peer's."""
    head = ["layout", "dtype"] + ([] if gpu else ["threads"]) + ["contender", "wall ms"]
    head += ["host ms", "device ms", "GPU activities / step"] if gpu else []
    head += ["x Adam fused", "x peer"]
    align = ["---" if h in ("layout", "dtype", "contender") else "--:" for h in head]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in recs:
        if r.get("error") or (gpu and r.get("device_ms") is None):
            continue
        base = r.get("ratio_to_adam_fused")
        cells = [r["layout"], r["dtype"]] + ([] if gpu else [str(r["threads"])])
        cells += [_title(r["contender"]), f"{r['wall_ms']:.3g}"]
        if gpu:
            cells += [f"{r['host_ms']:.3g}", f"{r['device_ms']:.3g}",
                      f"{r['gpu_activities_per_step']:.3g}"]
        cells += ["-" if base is None else f"{base:.2f}x",
                  "-" if r.get("ratio_to_peer") is None else f"{r['ratio_to_peer']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _floor_cell(here: list) -> str:
    """"step 1.01x, inner 0.86x (0.74x)": the floors' median times over Adam fused's in one
    group ("-" without; a file from before the step's floor has only the inner ones)."""
    ratio = {r["contender"]: r.get("ratio_to_adam_fused") for r in here if r["family"] == "floor"}
    step, streams = ratio.get("floor: step streams"), ratio.get("floor: inner streams")
    reads = ratio.get("floor: inner reads")
    parts = [] if step is None else [f"step {step:.2f}x"]
    if streams is not None:
        parts.append(f"inner {streams:.2f}x" + (f" ({reads:.2f}x)" if reads is not None else ""))
    return ", ".join(parts) or "-"


def print_tables(paths: list, args) -> str:
    """The tables of step results files (none: the newest in benchmarks/results/), with the
    selection of ``args`` (``--backends``, ``--layouts``, ``--dtypes``)."""
    text = "\n\n".join(
        tables(result, backends=args.backends, layouts=args.layouts, dtypes=args.dtypes,
               source=source)
        for source, result in harness.load_results(paths, "step", SCHEMA))
    print(text)
    return text


def plot(result: dict, path: str) -> None:
    """One panel per (thread count, dtype): per layout, every contender's wall time over its
    like-for-like peer's (EMCL rows with a SPEC section 7 peer: that peer; every other row:
    Adam-fused's), log scale, the lines at 1.0 (the goal of the step rows) and 0.8 (the goal
    of ``inner_step()`` without the check)."""

    def ratio(r):
        return r["ratio_to_peer"] if r.get("ratio_to_peer") is not None \
            else r["ratio_to_adam_fused"]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r.get("ratio_to_adam_fused")]
    if not recs:
        return
    threads = list(dict.fromkeys(r["threads"] for r in recs))
    dtypes = list(dict.fromkeys(r["dtype"] for r in recs))
    layouts = list(dict.fromkeys(r["layout"] for r in recs))
    names = [n for n in contender_order(recs) if n != "adam_fused"]
    legend_rows = -(-len(names) // 4)
    legend_in = 0.35 + 0.22 * legend_rows
    height = 4.0 * len(threads) + legend_in + 0.4
    fig, axes = plt.subplots(len(threads), len(dtypes), squeeze=False,
                             figsize=(max(7.0, 2.2 * len(layouts)) * len(dtypes), height))
    width = 0.8 / max(1, len(names))
    # one colour per optimizer and call, the variant without the non-finite check hatched
    keys = list(dict.fromkeys(n.replace(" nocheck", "") for n in names))
    cmap = plt.get_cmap("tab20" if len(keys) > 10 else "tab10")
    colour = {k: cmap(i % cmap.N) for i, k in enumerate(keys)}
    for i, t in enumerate(threads):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            for k, n in enumerate(names):
                xs, ys = [], []
                for x, lay in enumerate(layouts):
                    r = next((r for r in recs if r["threads"] == t and r["dtype"] == dt
                              and r["layout"] == lay and r["contender"] == n), None)
                    if r is not None:
                        xs.append(x - 0.4 + width * (k + 0.5))
                        ys.append(ratio(r))
                peer = next((r.get("peer") for r in recs if r["contender"] == n
                             and r.get("peer")), None)
                ax.bar(xs, ys, width, label=n + (f" / {peer}" if peer else ""),
                       color=colour[n.replace(" nocheck", "")],
                       hatch="//" if "nocheck" in n else None, edgecolor="white", lw=0)
            ax.axhline(1.0, color="k", lw=1)
            ax.axhline(0.8, color="k", lw=1, ls=":")
            ax.set_yscale("log")
            labels = []
            for lay in layouts:
                base = next((r for r in recs if r["threads"] == t and r["dtype"] == dt
                             and r["layout"] == lay and r["contender"] == "adam_fused"), None)
                labels.append(lay + (f"\nAdam-fused {base['wall_ms']:.3g} ms" if base else ""))
            ax.set_xticks(range(len(layouts)))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_ylabel("wall time / peer's (else Adam-fused's)")
            where = result["device"] if result["device"] == "cuda" else f"{t} thread(s)"
            ax.set_title(f"{where}, {dt}", fontsize=10)
            ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(f"optimizer step on {result['device_name']} ({result['settings']['mode']} run, "
                 f"{result['created_utc']}); lines: 1.0 and 0.8 of the peer", fontsize=10)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1 - 0.4 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
