"""Kernel benchmark: every available backend on the same inputs, in one run, against the memory
roof measured in the same run.

    python -m benchmarks kernels            # full run (~10 min on a 2-core CPU)
    python -m benchmarks kernels --quick    # under a minute on a 2-core CPU
    python -m benchmarks kernels --table benchmarks/results/kernels_epyc-2core_1thread.json \
        --sizes 24                          # the tables of a results file (docs/performance.md)
    python -m benchmarks kernels --device cuda --backends triton --layouts single --sizes 26 \
        --triton-configs 2048x4 4096x8      # the Triton step per BLOCK_SIZE x NUM_WARPS

The layouts, the input rotation, the byte model, the roof and every field of the results file:
benchmarks/README.md, ``kernels`` and "The memory roof". A record above the roof is a bug in the
benchmark or the byte model, never a result: the run says so.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from benchmarks import common, harness  # (puts the repository on sys.path)

import torch

SCHEMA = "emcl-kernels/bench_kernels/1"
LAYOUT_CHOICES = ("single", "mlp", "resnet18", "many")
LAYOUT_NAMES = {"mlp": "mlp-2x100", "resnet18": "resnet18-reduced", "many": "many-1000x4096"}
MANY_TENSORS, MANY_NUMEL = 1000, 4096
# How hard each mode measures: single-tensor sizes (log2) on CPU and on a GPU, seconds of
# repeats per measurement and the repeats' bounds (raised on a GPU, where calls are cheap),
# the elements the slow reference backend is timed up to, the roof's repeats and largest
# tensor (0: from the cache).
PRESETS = {
    "full": dict(cpu_sizes=list(range(10, 27)), gpu_sizes=list(range(10, 29)), budget_s=0.25,
                 min_reps=3, max_reps=50, gpu_max_reps=500, reference_cap=2 ** 22,
                 roof_reps=10, roof_numel=0),
    # 2**26 on a GPU: below ~2**22 a functional call's host work, not the kernel, sets its time
    "quick": dict(cpu_sizes=[10, 14, 18], gpu_sizes=[10, 14, 18, 22, 26], budget_s=0.02,
                  min_reps=2, max_reps=10, gpu_max_reps=50, reference_cap=2 ** 20,
                  roof_reps=5, roof_numel=2 ** 24),
}
MAX_SETS = 4096        # at most this many rotated input sets
ROTATE_FACTOR = 4.0    # the rotated sets total at least this many last-level caches


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


def resnet18_shapes() -> list:
    """The parameter shapes of the project's reduced ResNet-18 (``emcl_continual.data.models``,
    nf=20) on 3x32x32 inputs with 100 outputs (Split CIFAR-100)."""
    from emcl_continual.data.models import ReducedResNet18
    from emcl_continual.data.streams import StreamInfo

    info = StreamInfo("split-cifar100", 20, (3, 32, 32), 100,
                      [(5 * t, 5 * t + 5) for t in range(20)], True)
    return [tuple(p.shape) for p in ReducedResNet18(info).parameters()]


def build_layouts(choices, sizes) -> tuple[list, dict]:
    """The layouts to time, and the ones that could not be built with the reason."""
    layouts, skipped = [], {}
    for choice in choices:
        if choice == "single":
            layouts.extend(Layout("single", [(2 ** k,)]) for k in sizes)
        elif choice == "many":
            layouts.append(Layout(LAYOUT_NAMES["many"], [(MANY_NUMEL,)] * MANY_TENSORS))
        elif choice == "mlp":
            layouts.append(Layout(LAYOUT_NAMES["mlp"], common.mlp_shapes()))
        else:
            try:
                layouts.append(Layout(LAYOUT_NAMES[choice], resnet18_shapes()))
            except ImportError as exc:
                skipped[LAYOUT_NAMES[choice]] = (f"emcl_continual.data.models is not importable "
                                                 f"({exc}); layout skipped")
    return layouts, skipped


def n_sets_for(set_bytes: int, rotate_bytes: int, max_sets: int = MAX_SETS) -> int:
    """Enough input sets of ``set_bytes`` to total ``rotate_bytes`` (at most ``max_sets``)."""
    return int(max(1, min(max_sets, -(-rotate_bytes // max(1, set_bytes)))))


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


def triton_config(text: str) -> str:
    """``--triton-configs``' ``BLOCKxWARPS`` (e.g. ``4096x8``), checked: BLOCK a power of two
    >= 16, WARPS a power of two."""
    try:
        block, warps = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a Triton config is BLOCKxWARPS, e.g. 4096x8, not {text!r}") from None
    if block < 16 or block & (block - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"{text!r}: BLOCK must be a power of two >= 16, WARPS a power of two")
    return f"{block}x{warps}"


@contextlib.contextmanager
def triton_tunables(config: Optional[str]):
    """The Triton backend's ``BLOCK_SIZE`` and ``NUM_WARPS`` (read at every call) set to
    ``config`` for the block, restored after; nothing with None."""
    if config is None:
        yield
        return
    from emcl_kernels.backends import triton as TB
    before = TB.BLOCK_SIZE, TB.NUM_WARPS
    TB.BLOCK_SIZE, TB.NUM_WARPS = (int(x) for x in config.split("x"))
    try:
        yield
    finally:
        TB.BLOCK_SIZE, TB.NUM_WARPS = before


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def run_device(device: torch.device, args, settings: dict, log,
               timed: Optional[Callable] = None) -> tuple[dict, list]:
    """Time every backend (every ``--triton-configs`` of Triton), step, dtype and layout on
    ``device`` against the roof measured at the start and the end, pooled: the device's entry
    of the results file and its records. ``timed(info, records)`` is called after every
    layout and dtype with what is measured so far."""
    backends, skipped = common.backends_for(device, include_cpu_triton=args.cpu_triton,
                                            only=args.backends)
    if not backends:
        raise SystemExit(f"no backend to time on {device}: " +
                         "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    if args.triton_configs and "triton" not in backends:
        raise SystemExit(f"--triton-configs: the triton backend is not timed on {device}: "
                         f"{skipped.get('triton')}")
    variants = [(b, c) for b in backends
                for c in (args.triton_configs if b == "triton" and args.triton_configs else [None])]
    s = dict(settings)
    if device.type == "cuda":
        s.update(min_reps=max(s["min_reps"], 10), max_reps=max(s["max_reps"], s["gpu_max_reps"]))
    llc = common.last_level_cache_bytes(device)
    rotate = s["rotate_bytes"] or int(s["rotate_factor"] * llc)
    info = {"name": common.device_name(device), "load_averages": [("start", common.load_average())],
            "last_level_cache_bytes": llc, "backends": backends, "skipped_backends": skipped,
            "notes": [], "roof_runs": [],
            "settings": {"min_reps": s["min_reps"], "max_reps": s["max_reps"]}}
    log(f"== {info['name']}: timing {', '.join(backends)}")
    busy = common.busy_warning(device)
    if busy:
        info["notes"].append(busy)
        log(f"   warning: {busy}")
    for name, why in skipped.items():
        log(f"   not timed: {name}: {why}")

    sizes = args.sizes or (s["gpu_sizes"] if device.type == "cuda" else s["cpu_sizes"])
    layouts, skipped_layouts = build_layouts(args.layouts, sizes)

    def roof() -> None:
        # the roof's largest size (default: device_roof's) is at least the largest layout
        # timed: a smaller one pays more of a call's fixed cost per byte than the kernels
        largest = s["roof_numel"] and max([s["roof_numel"]] + [l.numel for l in layouts])
        info["roof_runs"].append(common.device_roof(device, s["roof_reps"], largest=largest or None,
                                                    backends=backends, rotate_bytes=rotate))
        _log_roof(info["roof_runs"][-1], log)
    roof()

    for name, why in skipped_layouts.items():
        info["notes"].append(f"{name}: {why}")
        log(f"   {name}: {why}")
    if "triton" in backends and device.type == "cpu":
        info["notes"].append("triton on CPU tensors runs through the Triton interpreter "
                             "(--cpu-triton)")
    if "reference" in backends and any(l.numel > s["reference_cap"] for l in layouts):
        info["notes"].append(f"reference backend timed only up to {s['reference_cap']} elements "
                             "(it is slow)")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    records, warmed = [], set()
    for layout in layouts:
        for dname in args.dtypes:
            dtype, first = common.DTYPE_NAMES[dname], len(records)
            new_set = functools.partial(common.make_input_set, layout.shapes, dtype, device, gen,
                                        with_meta_lrs=args.lr_mode == "recurrent")
            sets = [new_set()]
            sets += [new_set()
                     for _ in range(n_sets_for(sets[0].nbytes, rotate, s["max_sets"]) - 1)]
            rotation = Rotation(len(sets))
            for op in args.ops:
                hyper = common.hyperparameters(op, args.lr_mode)
                bpe = common.bytes_per_element(op, dtype, args.lr_mode)
                for backend, config in variants:
                    if backend == "reference" and layout.numel > s["reference_cap"]:
                        continue
                    calls = [common.step_fn(op, backend, x, hyper, args.check_finite) for x in sets]
                    with triton_tunables(config):
                        if (backend, config, op, dname) not in warmed:  # compilation, autotuning
                            common.time_once(calls[rotation.take()], device)
                            warmed.add((backend, config, op, dname))
                        estimate = common.time_once(calls[rotation.take()], device)
                        reps = common.repeats_for(estimate, s["budget_s"], s["min_reps"],
                                                  s["max_reps"])
                        secs = common.time_calls([calls[i] for i in rotation.upcoming(reps)],
                                                 device, max_total_s=4 * s["budget_s"],
                                                 min_calls=s["min_reps"])
                        rotation.advance(len(secs))
                    st = common.Stats.of(secs)
                    nbytes = bpe * layout.numel
                    records.append({
                        "device": device.type, "device_name": info["name"], "backend": backend,
                        "config": config, "op": op, "dtype": dname, "layout": layout.name,
                        "numel": layout.numel, "n_tensors": layout.n_tensors,
                        "lr_mode": args.lr_mode, "check_finite": args.check_finite,
                        "bytes_per_element": bpe, "bytes": nbytes,
                        "time_ms": st.median_ms, "time_ms_min": st.min_ms,
                        "time_ms_q25": st.q25_ms, "time_ms_q75": st.q75_ms,
                        "repeats": st.repeats, "timer": common.timer_name(device),
                        "gbps": common.gbps(nbytes, st.median_ms / 1e3),
                        "gbps_best": common.gbps(nbytes, st.min_ms / 1e3),
                        "rotation_sets": len(sets),
                        "rotation_bytes": len(sets) * sets[0].nbytes})
                    log(f"   {layout.name:>16} {layout.numel:>10} {dname} {op:<15} "
                        f"{_label(records[-1]):<9} {st.median_ms:10.4f} ms "
                        f"{records[-1]['gbps']:8.2f} GB/s  ({st.repeats} reps)")
            finite = all(bool(torch.isfinite(t.float()).all()) for x in sets
                         for t in x.params + x.anchors + x.importances + (x.meta_lrs or []))
            for rec in records[first:]:
                rec["finite"] = finite
            if not finite:
                info["notes"].append(f"non-finite values after timing {layout.name} "
                                     f"{layout.numel} {dname}: its timings may be distorted")
            info["load_averages"].append((f"after {layout.name} {layout.numel} {dname}",
                                          common.load_average()))
            del sets
            if timed is not None:
                timed(info, records)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    roof()
    info["load_averages"].append(("end", common.load_average()))
    pooled = info["roof"] = common.pool_roofs(info["roof_runs"])
    info.update(roof_gbps=pooled["roof_gbps"], copy_gbps=pooled["copy_gbps"])
    log("   start and end pooled:")
    _log_roof(pooled, log)
    _finish_records(records, pooled)
    info["notes"].extend(above_roof_notes(records, pooled))
    return info, records


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


def _label(r: dict) -> str:
    """A record's backend, with its Triton config where it has one: a column of the tables."""
    return r["backend"] + (f" {r['config']}" if r.get("config") else "")


def _finish_records(records: list, roof: dict) -> None:
    """Fill in the copy bandwidth and the roof, the ratios to them and the speed-ups over
    reference and foreach."""
    by_key = {(r["layout"], r["numel"], r["dtype"], r["op"], _label(r)): r for r in records}
    for r in records:
        r.update(copy_gbps=roof["copy_gbps"], ratio_to_copy=r["gbps"] / roof["copy_gbps"],
                 roof_gbps=roof["roof_gbps"], roof_kernel=roof["roof_kernel"],
                 ratio_to_roof=r["gbps"] / roof["roof_gbps"],
                 ratio_to_roof_best=r["gbps_best"] / roof["roof_gbps"])
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
    full = set(b for b in backends if b != "reference") or set(backends)
    sizes = {}
    for r in records:
        if r["layout"] == "single":
            sizes.setdefault(r["numel"], set()).add(_label(r))
    common_sizes = [n for n, bs in sizes.items() if full <= bs]
    return {n for n in common_sizes if n == 2 ** 20 or n == max(common_sizes)}


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    ms = r["time_ms"]
    text = (f"{r['gbps']:.2f} GB/s ({100 * r['ratio_to_roof']:.0f}%), "
            + (f"{ms / 1e3:.3g} s" if ms >= 1000 else f"{ms:.3g} ms"))
    if r.get("launches") is not None:   # a GPU file that counted them
        text += f", {r['launches']} launch" + ("es" if r["launches"] != 1 else "")
    return text


def _best(rows: list) -> str:
    best = min(rows, key=lambda r: r["time_ms"])
    parts = [f"**{_label(best)}**"]
    for base in ("foreach", "reference"):
        s = best.get(f"speedup_vs_{base}")
        if s is not None and _label(best) != base:
            parts.append(f"{s:.2f}x {base}")
    return ", ".join(parts)


def tables(result: dict, *, devices=None, layouts=None, ops=None, dtypes=None, sizes=None,
           source: str = "") -> str:
    """The markdown of a results file, per device (``devices``, default every one in it); the
    rows: ``layouts`` (name prefixes), ``ops``, ``dtypes`` and the single-tensor ``sizes`` as
    powers of two (``"all"``; default 2**20 and the largest every backend ran)."""
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
    backends = list(dict.fromkeys(_label(r) for r in records))
    if sizes is None:
        sizes = _default_sizes(records, backends)
    elif sizes != "all":
        sizes = {2 ** k for k in sizes}
    keep = [r for r in records
            if (not layouts or any(r["layout"].startswith(l) for l in layouts))
            and (not ops or r["op"] in ops) and (not dtypes or r["dtype"] in dtypes)
            and (r["layout"] != "single" or sizes == "all" or r["numel"] in sizes)]
    if not keep and records:
        raise SystemExit(f"no {device} records match the selection")
    groups = {}
    for r in keep:
        groups.setdefault((r["layout"], r["numel"], r["dtype"], r["op"]), {})[_label(r)] = r
    op_rank = {o: i for i, o in enumerate(OP_SHORT)}
    order = sorted(groups, key=lambda k: (LAYOUT_ORDER.get(k[0], 9), k[1], k[2] != "fp32",
                                          op_rank.get(k[3], 9)))
    machine, settings, roof = result.get("machine", {}), result.get("settings", {}), info["roof"]
    counting = ("bytes read + written + write-allocate reads" if roof["write_allocate"]
                else "bytes read + written")
    source_of_roof = (f"an in-place pass over the inputs, "
                      f"{roof['roof_source'].replace('probe on ', '')}"
                      if roof.get("roof_kernel") == "probe"    # a file whose roof a probe raised
                      else f"`{roof['roof_kernel']}`, the best streaming kernel")
    caption = (f"**{info['name']}**, torch {machine.get('torch', '?')} with "
               f"{machine.get('torch_threads', '?')} thread(s); roof {roof['roof_gbps']:.1f} GB/s "
               f"({source_of_roof}; copy {roof['copy_gbps']:.1f} GB/s; {counting}; percentages "
               f"are of the roof); {settings.get('mode', '?')} run of "
               f"{result.get('created_utc', '?')}, lr_mode `{settings.get('lr_mode', '?')}`"
               + (f", from `{source}`" if source else "") + ".")
    loads = [l for _, l in info.get("load_averages", []) if l]
    if loads:
        caption += (f" 1-minute load average during the run: {min(l[0] for l in loads):.1f} to "
                    f"{max(l[0] for l in loads):.1f} on {machine.get('cpu_count', '?')} cores.")
    rows = []
    for layout, numel, dtype, op in order:
        row = groups[(layout, numel, dtype, op)]
        name = f"single 2^{numel.bit_length() - 1}" if layout == "single" else layout
        rows.append([name, f"{numel:,} ({next(iter(row.values()))['n_tensors']})", dtype,
                     OP_SHORT.get(op, op)] + [_cell(row.get(b)) for b in backends]
                    + [_best(list(row.values()))])
    header = ["layout", "elements (tensors)", "dtype", "step"] + backends + ["fastest"]
    align = "<<<<" + ">" * len(backends) + "<"
    lines = [caption, "", harness.table(header, rows, markdown=True, align=align)
             if keep else "Nothing was timed."]
    notes = [f"{k}: {v}" for k, v in info.get("skipped_backends", {}).items()
             if not v.startswith("not asked")] + list(info.get("notes", []))
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def plot(result: dict, device: str, path: str) -> None:
    """GB/s against size for every (op, dtype): one line per backend over the single-tensor
    sizes, the multi-tensor layouts as markers, the roof dashed and the copy dotted."""
    recs = [r for r in result["records"] if r["device"] == device]
    ops = [o for o in common.OPS if any(r["op"] == o for r in recs)]
    dtypes = [d for d in common.DTYPE_NAMES if any(r["dtype"] == d for r in recs)]
    colors = {b: f"C{i}" for i, b in enumerate(dict.fromkeys(_label(r) for r in recs))}
    markers = {LAYOUT_NAMES["mlp"]: "s", LAYOUT_NAMES["resnet18"]: "^", LAYOUT_NAMES["many"]: "D"}
    roof = result["devices"][device]["roof"]
    title = (f"EMCL kernels on {result['devices'][device]['name']} "
             f"({result['settings']['mode']} run, lr_mode {result['settings']['lr_mode']}, "
             f"{result['created_utc']})")
    with harness.figure(path, title, nrows=len(ops), ncols=len(dtypes), sharex=True,
                        size=(5.5 * len(dtypes), 3.6 * len(ops)), legend=6, legend_size=9,
                        rect=(0, 0.06, 1, 0.97)) as axes:
        for (i, op), (j, dt) in itertools.product(enumerate(ops), enumerate(dtypes)):
            ax = axes[i][j]
            for b, color in colors.items():
                points = sorted((r["layout"], r["numel"], r["gbps"]) for r in recs
                                if r["op"] == op and r["dtype"] == dt and _label(r) == b)
                line = [(n, g) for layout, n, g in points if layout == "single"]
                if line:
                    ax.plot(*zip(*line), "o-", color=color, label=b, ms=3)
                for layout, n, g in points:
                    if layout in markers:
                        ax.plot(n, g, markers[layout], color=color, ms=7, mfc="none", mew=1.5)
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
        for layout in [l for l in markers if any(r["layout"] == l for r in recs)]:
            # the layouts' markers in the legend: entries of the first axes that draw nothing
            axes[0][0].plot([], [], markers[layout], color="gray", mfc="none", mew=1.5,
                            label=layout)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def build_parser():
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
                   help="time the reference backend only up to 2**LOG2 elements (default 22, "
                        "quick 20)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of repeats per measurement (full 0.25, quick 0.02)")
    p.add_argument("--min-reps", type=int, default=None)
    p.add_argument("--max-reps", type=int, default=None)
    p.add_argument("--rotate-mb", type=float, default=None,
                   help="total MiB of the rotated input sets (default: 4 x the last-level cache)")
    p.add_argument("--roof-mb", type=float, default=None,
                   help="MiB of each tensor of the roof's streaming kernels (default: the larger "
                        "of 256 MiB and the last-level cache, 1 GiB on a GPU; quick: 64 MiB)")
    p.add_argument("--triton-configs", nargs="+", type=triton_config, default=None,
                   metavar="BLOCKxWARPS",
                   help="time the triton backend once per BLOCK_SIZE x NUM_WARPS (e.g. 2048x4 "
                        "4096x8), each its own column")
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


def _settings(args) -> dict:
    """The preset of ``--quick`` or a full run, with the command line's overrides."""
    s = {"mode": "quick" if args.quick else "full", **PRESETS["quick" if args.quick else "full"],
         "max_sets": MAX_SETS, "rotate_factor": ROTATE_FACTOR, "rotate_bytes": 0}
    if args.reference_cap is not None:
        s["reference_cap"] = 2 ** args.reference_cap
    if args.budget is not None:
        s["budget_s"] = args.budget
    if args.min_reps is not None:
        s["min_reps"] = args.min_reps
    if args.max_reps is not None:
        s.update(max_reps=args.max_reps, gpu_max_reps=args.max_reps)
        if args.min_reps is None:
            s["min_reps"] = min(s["min_reps"], args.max_reps)
    if s["min_reps"] < 1 or s["max_reps"] < s["min_reps"]:
        raise SystemExit("need 1 <= --min-reps <= --max-reps")
    if args.rotate_mb is not None:
        s["rotate_bytes"] = max(1, int(args.rotate_mb * 2 ** 20))
    if args.roof_mb is not None:
        s["roof_numel"] = max(1, int(args.roof_mb * 2 ** 20) // 4)
    return s


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results dict (also written to ``--out-dir``)."""
    args = build_parser().parse_args(argv)
    if args.table is not None:
        devices = None if "auto" in args.device else args.device
        text = "\n\n".join(
            tables(result, devices=devices, layouts=args.layouts, ops=args.ops,
                   dtypes=args.dtypes, sizes=args.sizes, source=source)
            for source, result in harness.load_results(args.table, "kernels", SCHEMA))
        print(text)
        return {"table": text}
    args.ops = args.ops or list(common.OPS)
    args.dtypes = args.dtypes or ["fp32", "bf16"]
    args.layouts = args.layouts or list(LAYOUT_CHOICES)
    if args.cpu_triton:
        if "cuda" in args.device:
            raise SystemExit("--cpu-triton runs Triton through its interpreter everywhere; "
                             "do not combine it with --device cuda")
        # Triton reads this when its backend module is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    settings = _settings(args)
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))
    started = time.perf_counter()
    with harness.threads(args.threads):
        result = harness.head("kernels", argv, schema=SCHEMA, note=args.note)
        result.update({
            "settings": {"lr_mode": args.lr_mode, "triton_configs": args.triton_configs,
                         "hyperparameters": {op: common.hyperparameters(op, args.lr_mode)
                                             for op in args.ops}, **settings},
            "byte_model": {f"{op}/{d}": common.bytes_per_element(op, common.DTYPE_NAMES[d],
                                                                 args.lr_mode)
                           for op in args.ops for d in args.dtypes},
            "devices": {}, "records": []})
        devices = list(dict.fromkeys(harness.device_of(d) for d in args.device))
        base = args.name or f"kernels_{common.utc_stamp()}"
        stem = args.name or f"{base}_{'-'.join(d.type for d in devices)}"
        result["complete"] = False
        for device in devices:
            def timed(info, records, device=device):   # a run cut short keeps what it timed
                harness.save({**result, "devices": {**result["devices"], device.type: info},
                              "records": result["records"] + records},
                             os.path.join(args.out, stem + ".json"))
            result["devices"][device.type], records = run_device(device, args, settings, log,
                                                                 timed)
            result["records"].extend(records)
    result["wall_time_s"] = time.perf_counter() - started
    result["complete"] = True

    def plots(result: dict, _png: str) -> dict:
        """One .png per device, ``<base>_<device>.png``."""
        out = {f"png_{dev}": os.path.join(args.out, f"{base}_{dev}.png")
               for dev in result["devices"]}
        for key, png in out.items():
            plot(result, key[4:], png)
        return out
    return harness.finish(result, args.out, stem,
                          plot=plots, no_plot=args.no_plot,
                          table=lambda res: tables(res, sizes="all", source=res["paths"]["json"]))
