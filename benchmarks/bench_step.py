"""Optimizer-step benchmark: ``FusedEMCLOptimizer.step()`` against torch's own optimizers, host
time included, on the MLP, ResNet-18, 1,000 x 4,096 and GPT-2-124M layouts.

Its commands, the contenders, their SPEC section 7 peers and goals (:data:`PEERS`), how each is
timed and every field of a record: benchmarks/README.md, ``step``.
"""
from __future__ import annotations

import gc
import itertools
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from benchmarks import common, harness, timing  # (puts the repository on sys.path)

import torch

from emcl_kernels import FusedEMCLOptimizer

SCHEMA = "emcl-kernels/bench_step/1"
# torch's contenders (their families) and their titles; the first three are the peers
BASELINES = {"adam_fused": "Adam fused", "adam_fused_checked": "Adam fused, checked",
             "adam_fused_scaler": "Adam fused + GradScaler", "adam_foreach": "Adam foreach",
             "sgd_foreach": "SGD foreach"}
# SPEC section 7: each EMCL call and setting (call, check_finite, under a GradScaler), its
# like-for-like torch peer, the goal of the ratio of their wall times, its title in the tables
PEERS = {("step()", False, False): ("adam_fused", 1.0, "`step()`, check off / Adam fused"),
         ("step()", True, False): ("adam_fused_checked", 1.0, "`step()` / Adam fused, checked"),
         ("step()", True, True): ("adam_fused_scaler", 1.0,
                                  "`step()` + GradScaler / Adam fused + GradScaler"),
         ("inner_step()", False, False): ("adam_fused", 0.8,
                                          "`inner_step()`, check off / Adam fused")}
PARAM_SCALE, GRAD_SCALE = 0.1, 1e-3   # θ ~ 0.1·N(0,1), g ~ 1e-3·N(0,1): finite over many steps
REFERENCE_CAP = 2 ** 20               # EMCL's reference backend only up to this many elements


# --- Layouts: parameter shapes, nothing downloaded ---------------------------------------------
def resnet18_shapes() -> list:
    """torchvision's ``resnet18()`` parameter shapes in its order, from the architecture."""
    def conv_bn(cout: int, cin: int, k: int) -> list:
        return [(cout, cin, k, k), (cout,), (cout,)]
    shapes = conv_bn(64, 3, 7)                                    # conv1, bn1
    for stage, planes in enumerate((64, 128, 256, 512)):          # two BasicBlocks per stage
        inplanes = planes // 2 if stage else planes
        shapes += conv_bn(planes, inplanes, 3) + conv_bn(planes, planes, 3)
        shapes += conv_bn(planes, inplanes, 1) if stage else []   # the first block's downsample
        shapes += conv_bn(planes, planes, 3) * 2                  # the second block
    return shapes + [(1000, 512), (1000,)]                        # fc


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list:
    """GPT-2-124M's parameter shapes in Hugging Face's order (the LM head tied to wte)."""
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),    # ln_1, attn.c_attn, attn.c_proj
             (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, mlp.c_fc, mlp.c_proj
    return [(vocab, d), (ctx, d)] + block * n_layer + [(d,), (d,)]


# a --layouts choice -> (its name in the records, its shapes, where they come from)
LAYOUTS = {"mlp": ("mlp-784-100-100-10", common.mlp_shapes, "784-100-100-10"),
           "resnet18": ("resnet18", resnet18_shapes, "torchvision's resnet18(), written out"),
           "many": ("many-1000x4096", lambda: [(4096,)] * 1000, "1,000 tensors of 4,096"),
           "gpt2": ("gpt2-124m", gpt2_shapes, "GPT-2-124M shapes, written out")}


def make_params(shapes, dtype: torch.dtype, device: torch.device, gen) -> list:
    """One leaf parameter per shape, θ ~ 0.1·N(0,1), each with its own gradient
    g ~ 1e-3·N(0,1) (never zeros) that stays for the whole run (no backward in the timed
    loop); each tensor fresh from ``torch.randn``, so none shares memory with another."""
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device)
                               .mul_(PARAM_SCALE).to(dtype))
        p.grad = torch.randn(shape, generator=gen, device=device).mul_(GRAD_SCALE).to(dtype)
        params.append(p)
    return params


# --- Contenders --------------------------------------------------------------------------------
def bytes_per_element(kind: str, dtype: torch.dtype) -> int:
    """Bytes read + written per parameter element by one step of ``kind``, the least any
    implementation of the update must move (benchmarks/README.md, ``bytes_per_element``)."""
    p = torch.empty((), dtype=dtype).element_size()
    inner = common.bytes_per_element("inner_step", dtype)
    return {"emcl_step": common.bytes_per_element("inner_meta_step", dtype),
            "emcl_inner": inner, "adam": 7 * p, "sgd": 5 * p, "inner_reads": inner - p}[kind]


@dataclass(eq=False)
class Contender:
    """One timed call (hashed by identity): its step ``fn``, what its record says of it, its samples."""
    name: str                      # e.g. "emcl[cpu] step() nocheck"
    family: str                    # a BASELINES name | emcl | floor
    fn: Callable[[], object]       # one step
    bytes_kind: str                # bytes_per_element's kind
    optimizer: object = None       # whose state is checked finite at the end
    call: str = "step()"           # step() | inner_step() | stream_probe_
    backend: Optional[str] = None
    check_finite: Optional[bool] = None
    scaler: bool = False           # stepped through a torch.amp.GradScaler
    settings: dict = field(default_factory=dict)
    wall: list = field(default_factory=list)     # s per step (CPU: every step; GPU: per block)
    host: list = field(default_factory=list)     # s per timed step() call (CPU: = wall)
    steps: int = 0
    estimate_s: float = 0.0                      # wall time per step of its last steps run
    block: int = 1
    error: Optional[str] = None

    def __str__(self) -> str:
        return self.name


def checked_step(optimizer) -> Callable[[], object]:
    """``optimizer.step()`` (e.g. ``Adam(fused=True)``) skipping non-finite steps the way
    ``torch.amp.GradScaler.step`` does for it (``_check_inf_per_device``, then ``found_inf``
    handed to the step), without a scale: benchmarks/README.md, ``adam_fused_checked``."""
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
        optimizer.grad_scale = None
        optimizer.found_inf = sum(t.to(found[0].device, non_blocking=True) for t in found)
        try:
            return optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    return step


def scaler_step(optimizer, device: torch.device) -> Callable[[], object]:
    """``scaler.step(optimizer); scaler.update()`` with a ``torch.amp.GradScaler`` of its own
    (default settings; its scale made once by ``scaler.scale``, as a first backward would)."""
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))

    def step():
        scaler.step(optimizer)
        scaler.update()
    return step


# torch's optimizers (name, class, settings); Adam fused also as the checked and GradScaler peers
TORCH_OPTIMIZERS = (("adam_fused", torch.optim.Adam, {"lr": 1e-3, "fused": True}),
                    ("adam_foreach", torch.optim.Adam, {"lr": 1e-3, "foreach": True}),
                    ("sgd_foreach", torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9, "foreach": True}))
SCALER = {"grad_scaler": "default"}


def make_contenders(params: list, emcl_backends: list, log) -> list:
    """torch's optimizers and, per EMCL backend, its contenders (benchmarks/README.md,
    ``step``); a constructor that raises is a contender with its error, not timed."""
    out, device = [], params[0].device

    def build(key: str, family: str, kind: str, cls, settings: dict, **what):
        try:
            return cls(params, **settings)
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            out.append(Contender(key, family, None, kind, error=f"{type(exc).__name__}: {exc}",
                                 **what))
            log(f"      {key}: cannot be built: {out[-1].error}")
            return None

    for name, cls, settings in TORCH_OPTIMIZERS:
        kind = "adam" if name.startswith("adam") else "sgd"
        opt = build(name, name, kind, cls, settings)
        if opt is not None:
            out.append(Contender(name, name, opt.step, kind, opt, settings=settings))
        if opt is not None and name == "adam_fused":
            check = {"finite_check": "_amp_foreach_non_finite_check_and_unscale_"}
            out += [Contender("adam_fused_checked", "adam_fused_checked", checked_step(opt),
                              kind, opt, settings={**settings, **check}),
                    Contender("adam_fused_scaler", "adam_fused_scaler", scaler_step(opt, device),
                              kind, opt, settings={**settings, **SCALER}, scaler=True)]
    for backend, check in itertools.product(emcl_backends, (True, False)):
        suffix = "" if check else " nocheck"
        settings = {"meta_every": 1, "backend": backend, "check_finite": check}
        opt = build(f"emcl[{backend}]{suffix}", "emcl", "emcl_step", FusedEMCLOptimizer,
                    settings, backend=backend)
        if opt is None:
            continue
        mine = dict(optimizer=opt, backend=backend, check_finite=check)
        out += [Contender(f"emcl[{backend}] step(){suffix}", "emcl", opt.step, "emcl_step",
                          settings=settings, **mine),
                Contender(f"emcl[{backend}] inner_step(){suffix}", "emcl", opt.inner_step,
                          "emcl_inner", call="inner_step()", settings=settings, **mine)]
        if check:
            out.append(Contender(f"emcl[{backend}] step() scaler", "emcl",
                                 scaler_step(opt, device), "emcl_step", scaler=True,
                                 settings={**settings, **SCALER}, **mine))
    return out


# The floors ([note: stream probes] in csrc/emcl_cpu_kernels.h; benchmarks/README.md, "The
# memory roof"), per dtype: name -> (stream_probe_ kind, byte model).
FLOORS = {torch.float32: {"floor: step streams": (5, "emcl_step"),
                          "floor: inner streams": (3, "emcl_inner"),
                          "floor: inner reads": (4, "inner_reads")},
          torch.bfloat16: {"floor: step streams": (6, "emcl_step"),
                           "floor: inner streams": (7, "emcl_inner")}}
# the EMCL step each byte model belongs to, and the floor a step's ratio_to_floor is taken against
EMCL_STEP = {"emcl_step": "inner+meta", "emcl_inner": "inner", "inner_reads": "inner"}
STREAMS_FLOOR = {"inner+meta": "floor: step streams", "inner": "floor: inner streams"}


def floor_contenders(numel: int, dtype: torch.dtype, device: torch.device) -> list:
    """The :data:`FLOORS` of ``dtype`` as contenders (family ``floor``) on four flat tensors of
    ``numel`` elements, where the extension has the probes on ``device``, else none."""
    floors = FLOORS.get(dtype)
    if floors is None or not common.stream_probes_available(device):
        return []
    tensors = [torch.rand(numel, device=device).to(dtype if i < 2 else torch.float32)
               for i in range(4)]
    return [Contender(name, "floor", lambda kind=kind: torch.ops.emcl.stream_probe_(*tensors, kind),
                      bytes_kind, call="stream_probe_", settings={"stream_probe_kind": kind})
            for name, (kind, bytes_kind) in floors.items()]


def finite_state(params: list, optimizer) -> bool:
    """The parameters and ``optimizer``'s floating-point state all finite."""
    state = [v for st in getattr(optimizer, "state", {}).values() for v in st.values()
             if torch.is_tensor(v) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in params + state)


# --- Timing ------------------------------------------------------------------------------------
@dataclass
class Settings:
    """How hard to measure: the full run's defaults, :data:`QUICK` for ``--quick``."""
    mode: str = "full"
    warmup: int = 2            # untimed rounds of one step of each contender (state, plans)
    min_rounds: int = 5
    max_rounds: int = 60
    budget_s: float = 20.0     # time for the rounds of one (layout, dtype, threads) group, about
    block_s: float = 0.002     # time of one contender's block of consecutive steps, about
    max_block: int = 50
    gpu_min_block: int = 20
    profile_steps: int = 10    # GPU steps under torch.profiler per contender
    roof_reps: int = 10


QUICK = dict(mode="quick", min_rounds=3, max_rounds=15, budget_s=3.0, block_s=0.001,
             max_block=20, gpu_min_block=10, profile_steps=3, roof_reps=4)


def time_group(contenders: list, device: torch.device, settings: Settings, log) -> int:
    """Warm-up rounds of one step of every contender (the last one's time sizes its blocks), then
    rounds of one block of each (:func:`harness.interleave`; benchmarks/README.md, ``step``); a
    contender whose step raises keeps its error and sits out the rest. Returns the timed rounds."""
    errors = {c: c.error for c in contenders if c.error}
    for c in contenders:    # the samples of this group only (the thread counts share contenders)
        c.wall, c.host = [], []

    def run(c: Contender, steps: int, timed: bool) -> None:
        """``steps`` steps of ``c`` back to back between two synchronizations."""
        timing.synchronize(device)
        start = time.perf_counter()
        host = timing.time_calls([c.fn] * steps, torch.device("cpu"))   # each call, no sync
        timing.synchronize(device)
        c.estimate_s = (time.perf_counter() - start) / steps
        c.steps += steps
        if timed:   # wall: on CPU every step, on a GPU the block's (the steps pipelined)
            c.wall += host if device.type == "cpu" else [c.estimate_s]
            c.host += host

    def interleave(rounds: int, steps: Optional[int]) -> int:
        harness.interleave(contenders, rounds, lambda c, _: run(c, steps or c.block, not steps),
                           errors=errors, log=lambda msg: log("      " + msg))
        for c, error in errors.items():
            c.error = error
        return rounds
    interleave(settings.warmup, 1)
    alive = [c for c in contenders if not c.error]
    if not alive:
        return 0
    lo = settings.gpu_min_block if device.type == "cuda" else 1
    for c in alive:
        c.block = int(max(lo, min(settings.max_block,
                                  -(-settings.block_s // max(c.estimate_s, 1e-7)))))
    return interleave(timing.repeats_for(sum(c.block * c.estimate_s for c in alive),
                                         settings.budget_s, settings.min_rounds,
                                         settings.max_rounds), None)


def gpu_activities(c: Contender, device: torch.device, steps: int, log) -> dict:
    """:func:`summarize_gpu_events` of ``steps`` steps of ``c`` under ``torch.profiler`` (none
    where the profiler fails: the timings stand without it)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                c.fn()
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - recorded as no activities
        log(f"      (profiler failed for {c.name}: {type(exc).__name__}: {exc})")
        return {}
    c.steps += steps
    return summarize_gpu_events(prof.events(), steps)


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
        kinds[next((k for k in ("memcpy", "memset") if name.startswith(k)), "kernel")] += 1
        device_us += evt.time_range.elapsed_us()
    return {"device_ms": device_us / 1e3 / steps,
            "gpu_activities_per_step": sum(kinds.values()) / steps,
            **{f"gpu_{k}s_per_step": v / steps for k, v in kinds.items()}}


# --- Records -----------------------------------------------------------------------------------
def record_of(c: Contender, group: dict, device: torch.device, dtype: torch.dtype,
              params_finite: bool = True, gpu: Optional[dict] = None) -> dict:
    """The JSON record of one contender in one group (ratios filled in later); ``gpu``: its
    :func:`summarize_gpu_events`."""
    rec = {"device": device.type, "device_name": common.device_name(device), **group,
           "contender": c.name, "family": c.family, "call": c.call, "backend": c.backend,
           "check_finite": c.check_finite, "grad_scaler": c.scaler, "settings": c.settings,
           "emcl_step": EMCL_STEP.get(c.bytes_kind),
           "bytes_per_element": bytes_per_element(c.bytes_kind, dtype),
           "error": c.error, "steps_taken": c.steps, "device_ms": None,
           "gpu_activities_per_step": None, **(gpu or {}),
           "finite": params_finite and finite_state([], c.optimizer)}
    if c.error or not c.wall:
        return rec
    wall = timing.Stats.of(c.wall)
    rec.update({
        "wall_ms": wall.median_ms, "wall_ms_min": wall.min_ms, "wall_ms_q25": wall.q25_ms,
        "wall_ms_q75": wall.q75_ms, "samples": wall.repeats, "rounds": len(c.host) // c.block,
        "steps_per_block": c.block, "host_ms": timing.Stats.of(c.host).median_ms,
        "gbps": timing.gbps(rec["bytes_per_element"] * group["numel"], wall.median_ms / 1e3),
    })
    if group.get("roof_gbps"):
        rec["ratio_to_roof"] = rec["gbps"] / group["roof_gbps"]
    return rec


def add_ratios(records: list) -> None:
    """Within each group (device, threads, layout, dtype): every record's ``ratio_to_*``, an
    EMCL record's ``peer``, ``goal``, ``verdict`` (SPEC section 7, :data:`PEERS`) and, without
    the check or a GradScaler, ``ratio_to_floor``; what each means: benchmarks/README.md."""
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
                r[f"ratio_to_{b}_min"] = r["wall_ms_min"] / base[b]["wall_ms_min"] if ok else None
            if r.get("family") != "emcl" or _pair_key(r) not in PEERS:
                continue
            name, goal, _ = PEERS[_pair_key(r)]
            ratio = r.get(f"ratio_to_{name}")
            r.update({"peer": name, "goal": goal, "ratio_to_peer": ratio,
                      "ratio_to_peer_min": r.get(f"ratio_to_{name}_min"), "verdict": None})
            if ratio is None:
                continue
            spread = r["ratio_to_peer_spread"] = r["wall_ms_q25"] / base[name]["wall_ms_q75"]
            r["verdict"] = "met" if ratio <= goal else "tie" if spread <= goal else "missed"
            floor = floors.get(STREAMS_FLOOR.get(r.get("emcl_step")))
            if floor and not r.get("check_finite") and not r.get("grad_scaler"):
                r.update(floor=floor["contender"], ratio_to_floor=r["wall_ms"] / floor["wall_ms"],
                         ratio_to_floor_spread=r["wall_ms_q25"] / floor["wall_ms_q75"])


def run_notes(records: list, llc_bytes: int) -> list:
    """The notes a run's records call for: steps that ended non-finite, and steps above the
    memory roof that stream more than 4 x the last-level cache of ``llc_bytes`` (one whose bytes
    fit in the cache may beat the roof; one that streams several caches' worth cannot: a bug)."""
    bad = sum(r.get("finite") is False for r in records)
    above = sum((r.get("ratio_to_roof") or 0) > 1 and r["bytes_per_element"] * r["numel"]
                > 4 * llc_bytes for r in records)
    return ([f"{bad} record(s) ended with non-finite parameters or state: their timings may be "
             "distorted"] if bad else []) + \
        ([f"BUG: {above} step(s) that stream more than 4 x the last-level cache ran above the "
          "memory roof: find why"] if above else [])


# --- The run -----------------------------------------------------------------------------------
def run_layout(device, choice, dname, thread_counts, emcl_backends, settings, roofs, log):
    """Every contender on one layout and dtype, at every thread count; returns the records."""
    name, shapes_of, source = LAYOUTS[choice]
    shapes = shapes_of()
    numel, dtype = sum(torch.Size(s).numel() for s in shapes), common.DTYPE_NAMES[dname]
    params = make_params(shapes, dtype, device, torch.Generator(device=device).manual_seed(0))
    backends = [b for b in emcl_backends if b != "reference" or numel <= REFERENCE_CAP]
    log(f"   {name} ({len(shapes)} tensors, {numel:,} elements, {source}) {dname}")
    contenders = make_contenders(params, backends, log) + floor_contenders(numel, dtype, device)
    records = []
    for threads in thread_counts:
        with harness.threads(threads):
            load_before, count = common.load_average(), torch.get_num_threads()
            rounds = time_group(contenders, device, settings, log)
            profile = {c.name: gpu_activities(c, device, settings.profile_steps, log)
                       for c in contenders if device.type == "cuda" and not c.error}
        roof = roofs.get(count) or {}
        group = {"threads": count, "layout": name, "layout_source": source,
                 "n_tensors": len(shapes), "numel": numel, "dtype": dname,
                 "load_average_before": load_before, "load_average_after": common.load_average(),
                 "group_rounds": rounds, "roof_gbps": roof.get("roof_gbps"),
                 "copy_gbps": roof.get("copy_gbps")}
        finite = finite_state(params, None)
        new = [record_of(c, group, device, dtype, finite, profile.get(c.name)) for c in contenders]
        add_ratios(new)
        log("\n".join(summary_tables(new).values()))
        records += new
    return records


def run(args, argv, settings: Settings, device: torch.device, log) -> dict:
    """The benchmark: the roof at every thread count, then every layout and dtype; the
    results file saved after every group, so that a run cut short keeps its groups."""
    started = time.perf_counter()
    # on a GPU one thread count (torch's by default), on CPU each in turn
    thread_counts = (args.threads or [None])[:1] if device.type == "cuda" else args.threads or [1, 2]
    emcl_backends, skipped = common.backends_for(device, only=args.backends)
    if not emcl_backends:
        raise SystemExit(f"no EMCL backend to time on {device}: " +
                         "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    result = harness.head("step", argv, device, schema=SCHEMA, note=args.note)
    result.update({
        "settings": {**settings.__dict__, "reference_cap": REFERENCE_CAP,
                     "param_scale": PARAM_SCALE, "grad_scale": GRAD_SCALE,
                     "thread_counts": [t or torch.get_num_threads() for t in thread_counts]},
        "emcl_backends": emcl_backends, "skipped_backends": skipped, "roofs": [],
        "records": [], "complete": False})
    log(f"== {result['device_name']}: EMCL backends {', '.join(emcl_backends)}; "
        f"{settings.mode} run; load average {common.load_average()}")
    for line in [f"not timed: emcl[{k}]: {v}" for k, v in skipped.items()] + \
            [f"warning: {note}" for note in result["notes"]]:
        log("   " + line)
    for threads in () if args.no_roof else thread_counts:
        with harness.threads(threads):
            roof = common.device_roof(
                device, settings.roof_reps, backends=emcl_backends,
                largest=max(1, int(args.roof_mb * 2 ** 20) // 4) if args.roof_mb else None)
        log(f"   roof at {roof['threads']} thread(s): {roof['roof_gbps']:.1f} GB/s "
            f"({roof['roof_kernel']}); copy {roof['copy_gbps']:.1f} GB/s")
        result["roofs"].append(roof)
    roofs = {roof["threads"]: roof for roof in result["roofs"]}
    stem = args.name or f"step_{common.utc_stamp()}_{device.type}"
    for choice, dname in itertools.product(args.layouts or LAYOUTS,
                                           args.dtypes or ("fp32", "bf16")):
        result["records"] += run_layout(device, choice, dname, thread_counts, emcl_backends,
                                        settings, roofs, log)
        harness.save(result, os.path.join(args.out, stem + ".json"))
        gc.collect()     # the layout's tensors and optimizers, before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["notes"] += run_notes(result["records"], common.last_level_cache_bytes(device))
    result["wall_time_s"] = time.perf_counter() - started
    result["complete"] = True
    return harness.finish(result, args.out, stem,
                          table=lambda res: tables(res, source=res["paths"]["json"]))


# --- Output: the tables (the terminal's at the end of a run, docs/performance.md's from a file) ---
VERDICT_MARK = {"tie": " (tie)", "missed": " **(missed)**"}
CAPTION = (" The three Adam peers: median wall time of one step in ms [quartiles] (checked: "
           "torch's finite check `_amp_foreach_non_finite_check_and_unscale_` feeding "
           "`found_inf` to the fused step; + GradScaler: `scaler.step(opt); scaler.update()`). "
           "EMCL: median wall time over its like-for-like peer's (SPEC section 7), in "
           "parentheses the same of the fastest steps; every contender on the same tensors, "
           "interleaved round by round.")
FLOOR_CAPTION = (" Floors over Adam fused (`torch.ops.emcl.stream_probe_` on four flat tensors "
                 "of the layout's size, fp32, in bf16 rows θ and g bf16, timed in the same "
                 "rounds): step, `floor: step streams` (θ, g, θ₀, h read, θ, θ₀, h written: "
                 "the inner+meta step's streams, as many as fused Adam's); inner, `floor: inner "
                 "streams` (θ, g, θ₀, h read, θ written: the inner step's), in parentheses its "
                 "reads alone (`floor: inner reads`).")


def _title(name: str) -> str:
    return BASELINES.get(name) or (name.replace("emcl[", "EMCL ").replace("]", "")
                                   .replace(" nocheck", ", check off").replace(" scaler", " + GradScaler"))


def _pair_key(r: dict) -> tuple:
    return (r.get("call"), r.get("check_finite"), bool(r.get("grad_scaler")))


def step_goals(records: list) -> list:
    """Lines saying, per EMCL backend and SPEC section 7 row, in how many cells the call met
    its goal, tied with it or missed it (``verdict``), and the worst cell."""
    lines = []
    emcl = [r for r in records if r.get("family") == "emcl" and r.get("ratio_to_peer")]
    for key, (_, _, title) in PEERS.items():
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


def _summary_cell(r: Optional[dict], baseline: bool) -> str:
    """A baseline's "ms [quartiles]", or an EMCL row's ratio to its peer and verdict; "n/a"
    where torch has no kernel for the contender, "error" where it failed, "-" where absent."""
    if r is None:
        return "-"
    if r.get("error"):
        return "n/a" if r["error"].startswith(("not timed", "NotImplementedError")) else "error"
    if baseline:
        return f"{r['wall_ms']:.3g} [{r['wall_ms_q25']:.3g}-{r['wall_ms_q75']:.3g}]"
    if r.get("ratio_to_peer") is None:
        return f"{r['wall_ms']:.3g} ms (no peer)"
    return (f"{r['ratio_to_peer']:.2f}x ({r['ratio_to_peer_min']:.2f}x)"
            + VERDICT_MARK.get(r.get("verdict"), "")
            + ("" if r.get("finite", True) else " (not finite)"))


def _floor_cell(here: list) -> str:
    """"step 1.01x, inner 0.86x (0.74x)": the floors' median times over Adam fused's in one
    group ("-" without)."""
    ratio = {r["contender"][len("floor: "):]: f"{r['ratio_to_adam_fused']:.2f}x" for r in here
             if r["family"] == "floor" and r.get("ratio_to_adam_fused") is not None}
    reads = f" ({ratio['inner reads']})" if "inner reads" in ratio else ""
    parts = [f"step {ratio['step streams']}"] if "step streams" in ratio else []
    parts += [f"inner {ratio['inner streams']}{reads}"] if "inner streams" in ratio else []
    return ", ".join(parts) or "-"


def tables(result: dict, *, backends=None, source: str = "") -> str:
    """The markdown of a results file, its EMCL records those of ``backends`` (None: every one;
    what it shows: benchmarks/README.md, ``step``)."""
    recs = [r for r in result["records"]
            if r["family"] != "emcl" or not backends or r.get("backend") in backends]
    machine = result.get("machine", {})
    loads = [l for r in recs for l in (r.get("load_average_before"), r.get("load_average_after"))
             if l]
    roofs = "; ".join(f"{r['threads']} thread(s) {r['roof_gbps']:.1f} GB/s ({r['roof_kernel']})"
                      for r in result.get("roofs", []))
    lines = [f"**{result['device_name']}**, torch {machine.get('torch', '?')}; "
             f"{result['settings']['mode']} run of {result['created_utc']}"
             + (f", from `{source}`" if source else "") + "." + CAPTION
             + (f" 1-minute load average during the run: {min(l[0] for l in loads):.1f} to "
                f"{max(l[0] for l in loads):.1f} on {machine.get('cpu_count', '?')} cores."
                if loads else "")
             + (f" Memory roof: {roofs}." if roofs else "")
             + (FLOOR_CAPTION if any(r["family"] == "floor" for r in recs) else "")]
    for threads, table in summary_tables(recs).items():
        title = f"{threads} thread(s)" if result["device"] == "cpu" else result["device_name"]
        lines += ["", f"*{title}*", "", table]
    errors = {(r["contender"], r["error"]) for r in recs if r.get("error")}
    goals = step_goals(recs)
    lines += ([""] if goals or errors else []) + goals
    return "\n".join(lines + [f"- {_title(n)}: {e}" for n, e in sorted(errors)])


def summary_tables(recs: list) -> dict:
    """Per thread count, the table of ``recs``: per layout and dtype the three Adam peers'
    times, each EMCL backend's SPEC section 7 rows over their peers, and the floors."""
    emcl_backends = [b for b in dict.fromkeys(r.get("backend") for r in recs
                                              if r["family"] == "emcl") if b]
    floors = any(r["family"] == "floor" for r in recs)
    peers = list(BASELINES)[:3]
    head = ["layout", "dtype"] + [f"{BASELINES[b]} (ms)" for b in peers]
    for backend in emcl_backends:
        prefix = f"EMCL `{backend}` " if len(emcl_backends) > 1 else "EMCL "
        head += [prefix + title for _, _, title in PEERS.values()]
    head += ["floor / Adam fused"] if floors else []
    out = {}
    for threads in dict.fromkeys(r["threads"] for r in recs):
        sub = [r for r in recs if r["threads"] == threads]
        rows = []
        for layout, dtype in dict.fromkeys((r["layout"], r["dtype"]) for r in sub):
            here = [r for r in sub if r["layout"] == layout and r["dtype"] == dtype]
            cells = [layout, dtype] + [
                _summary_cell(next((r for r in here if r["family"] == b), None), True)
                for b in peers]
            cells += [_summary_cell(next((r for r in here if r["family"] == "emcl"
                                          and r.get("backend") == backend
                                          and _pair_key(r) == key), None), False)
                      for backend in emcl_backends for key in PEERS]
            rows.append(cells + ([_floor_cell(here)] if floors else []))
        out[threads] = harness.table(head, rows, markdown=True, align="<<" + ">" * (len(head) - 2))
    return out


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results dict (also written to ``--out``)."""
    p = harness.parser("step", __doc__, "device", "threads", "out", "name", "note", "quick",
                       "quiet", many_threads=True, threads_default="on CPU: 1 2; on a GPU: torch's",
                       quick="fewer rounds and warm-up steps")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), help="default: every one")
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], help="default: both")
    p.add_argument("--backends", nargs="+",
                   help="EMCL backends (default: every one available on the device)")
    p.add_argument("--budget", type=float,
                   help="seconds of rounds per group, about (full 20, quick 3; rounds >= 5, 3)")
    p.add_argument("--roof-mb", type=float,
                   help="MiB per tensor of the roof's largest size (CPU 256, GPU 1024)")
    p.add_argument("--no-roof", action="store_true", help="skip the roof measurement")
    p.add_argument("--table", nargs="*", metavar="RESULTS_JSON", default=None,
                   help="print the tables of these results files (none: the newest "
                        "benchmarks/results/step_*.json), --backends' alone if given, and exit")
    args = p.parse_args(argv)
    if args.table is not None:
        text = "\n\n".join(tables(result, backends=args.backends, source=source)
                            for source, result in harness.load_results(args.table, "step", SCHEMA))
        print(text)
        return {"table": text}
    settings = Settings(**(QUICK if args.quick else {}))
    if args.budget is not None:
        settings.budget_s = args.budget
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))
    with harness.threads(None):
        return run(args, argv, settings, harness.device_of(args.device), log)
