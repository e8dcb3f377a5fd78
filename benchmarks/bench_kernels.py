"""Kernel benchmark: every available backend on the same inputs, in one run, against the memory
roof measured in the same run.

The layouts, the input rotation, the byte model, the roof, the options and every field of the
results file: benchmarks/README.md, ``kernels`` and "The memory roof". A record above the roof
is a bug in the benchmark or the byte model, never a result: the run says so.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import math
import os
import time
from typing import Callable, NamedTuple, Optional

from benchmarks import common, harness  # (puts the repository on sys.path)

import torch

SCHEMA = "emcl-kernels/bench_kernels/1"
LAYOUT_NAMES = {"single": "single", "mlp": "mlp-2x100", "resnet18": "resnet18-reduced",
                "many": "many-1000x4096"}
# Per mode: the single-tensor sizes (log2) on CPU and on a GPU, seconds of repeats per
# measurement and their bounds (more on a GPU), the slow reference backend's largest size,
# the roof's repeats and largest tensor (0: from the cache).
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


class Layout(NamedTuple):
    """A list of parameter shapes that is timed as one call, and their elements."""
    name: str
    shapes: list
    numel: int


def resnet18_shapes() -> list:
    """The parameter shapes of the project's reduced ResNet-18 (``emcl_continual.data.models``,
    nf=20) on 3x32x32 inputs with 100 outputs (Split CIFAR-100)."""
    from emcl_continual.data.models import ReducedResNet18
    from emcl_continual.data.streams import StreamInfo

    info = StreamInfo("split-cifar100", 20, (3, 32, 32), 100,
                      [(5 * t, 5 * t + 5) for t in range(20)], True)
    return [tuple(p.shape) for p in ReducedResNet18(info).parameters()]


def build_layouts(choices, sizes) -> list:
    """The layouts of ``--layouts`` in order, ``single`` once per size of ``sizes`` (log2)."""
    shapes = {"single": lambda: [[(2 ** k,)] for k in sizes], "mlp": lambda: [common.mlp_shapes()],
              "resnet18": lambda: [resnet18_shapes()], "many": lambda: [[(4096,)] * 1000]}
    return [Layout(LAYOUT_NAMES[c], shape_list, sum(math.prod(s) for s in shape_list))
            for c in choices for shape_list in shapes[c]()]


def triton_config(text: str) -> str:
    """``--triton-configs``' ``BLOCKxWARPS`` (e.g. ``4096x8``), checked: BLOCK a power of two
    >= 16, WARPS a power of two (an ArgumentTypeError: argparse prints its message)."""
    block, warps = (int(x) if x.isdigit() else 0 for x in (text.lower().partition("x")[::2]))
    if block < 16 or block & (block - 1) or warps < 1 or warps & (warps - 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a Triton config is BLOCKxWARPS, BLOCK a "
                                         "power of two >= 16 and WARPS a power of two, e.g. 4096x8")
    return f"{block}x{warps}"


@contextlib.contextmanager
def triton_tunables(config: Optional[str]):
    """The Triton backend's ``BLOCK_SIZE`` and ``NUM_WARPS`` (module attributes read at every
    call) set to ``config`` for the block, restored after; nothing with None."""
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


def run_device(device: torch.device, args, s: dict, log, timed: Callable) -> tuple[dict, list]:
    """Time every backend (every ``--triton-configs`` of Triton), step, dtype and layout on
    ``device`` against the roof measured at the start and the end, pooled: the device's entry
    of the results file and its records, handed to ``timed`` after every layout and dtype."""
    backends, skipped = common.backends_for(device, only=args.backends)
    if not backends:
        raise SystemExit(f"no backend to time on {device}: " +
                         "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    if args.triton_configs and "triton" not in backends:
        raise SystemExit(f"--triton-configs: the triton backend is not timed on {device}: "
                         f"{skipped.get('triton')}")
    variants = [(b, c) for b in backends
                for c in (args.triton_configs if b == "triton" and args.triton_configs else [None])]
    gpu = device.type == "cuda"
    llc = common.last_level_cache_bytes(device)
    rotate = s["rotate_bytes"] or int(s["rotate_factor"] * llc)
    layouts = build_layouts(args.layouts, args.sizes or s["gpu_sizes" if gpu else "cpu_sizes"])
    info = {"name": common.device_name(device), "load_averages": [("start", common.load_average())],
            "last_level_cache_bytes": llc, "backends": backends, "skipped_backends": skipped,
            "notes": [], "roof_runs": []}
    log(f"== {info['name']}: timing {', '.join(backends)}")

    def roof() -> None:
        # the roof's largest size (default: device_roof's) is at least the largest layout
        # timed: a smaller one pays more of a call's fixed cost per byte than the kernels
        largest = s["roof_numel"] and max([s["roof_numel"]] + [l.numel for l in layouts])
        info["roof_runs"].append(common.device_roof(device, s["roof_reps"], largest=largest or None,
                                                    backends=backends, rotate_bytes=rotate))
        _log_roof(info["roof_runs"][-1], log)
    roof()
    if "triton" in backends and not gpu:
        info["notes"].append("triton on CPU tensors runs through the Triton interpreter")
    if "reference" in backends and any(l.numel > s["reference_cap"] for l in layouts):
        info["notes"].append(f"reference backend timed only up to {s['reference_cap']} elements "
                             "(it is slow)")
    gen = torch.Generator(device=device).manual_seed(0)
    records = []
    for layout, dname in itertools.product(layouts, args.dtypes):
        dtype, first = common.DTYPE_NAMES[dname], len(records)
        new_set = functools.partial(common.make_input_set, layout.shapes, dtype, device, gen,
                                    with_meta_lrs=args.lr_mode == "recurrent")
        sets = [new_set()]   # and more, to total ``rotate`` bytes (at most ``max_sets`` sets)
        sets += [new_set() for _ in range(min(s["max_sets"], -(-rotate // sets[0].nbytes)) - 1)]
        for op, (backend, config) in itertools.product(args.ops, variants):
            if backend == "reference" and layout.numel > s["reference_cap"]:
                continue
            hyper = common.hyperparameters(op, args.lr_mode)
            # every call on these sets (warm-up, estimate, repeats, of every backend and step)
            # takes the least recently used one, the first of ``sets``: between two uses of a
            # set all the others were touched, so no call finds its inputs in cache
            ring = itertools.cycle([common.step_fn(op, backend, x, hyper) for x in sets])
            with triton_tunables(config):
                common.time_once(next(ring), device)   # warm-up (compilation, tuning)
                estimate = common.time_once(next(ring), device)
                reps = common.repeats_for(estimate, s["budget_s"], s["min_reps"], s["max_reps"])
                secs = common.time_calls([next(ring) for _ in range(reps)], device,
                                         max_total_s=4 * s["budget_s"], min_calls=s["min_reps"])
            used = (2 + len(secs)) % len(sets)
            sets = sets[used:] + sets[:used]   # the least recently used first again
            st, bpe = common.Stats.of(secs), common.bytes_per_element(op, dtype, args.lr_mode)
            records.append({
                "device": device.type, "device_name": info["name"], "backend": backend,
                "config": config, "op": op, "dtype": dname, "layout": layout.name,
                "numel": layout.numel, "n_tensors": len(layout.shapes), "lr_mode": args.lr_mode,
                "bytes_per_element": bpe, "bytes": bpe * layout.numel,
                "time_ms": st.median_ms, "time_ms_min": st.min_ms,
                "time_ms_q25": st.q25_ms, "time_ms_q75": st.q75_ms,
                "repeats": st.repeats, "timer": common.timer_name(device),
                "gbps": common.gbps(bpe * layout.numel, st.median_ms / 1e3),
                "gbps_best": common.gbps(bpe * layout.numel, st.min_ms / 1e3),
                "rotation_sets": len(sets), "rotation_bytes": len(sets) * sets[0].nbytes})
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
        sets = ring = None   # freed before the next layout's sets are made
        timed(info, records)
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()

    roof()
    info["load_averages"].append(("end", common.load_average()))
    pooled = info["roof"] = common.pool_roofs(info["roof_runs"])
    info.update(roof_gbps=pooled["roof_gbps"], copy_gbps=pooled["copy_gbps"])
    _log_roof(pooled, log, "roof, start and end pooled")
    by_key = {(r["layout"], r["numel"], r["dtype"], r["op"], _label(r)): r for r in records}
    for r in records:   # the copy and the roof, the ratios to them, the speed-ups over the bases
        r.update(copy_gbps=pooled["copy_gbps"], ratio_to_copy=r["gbps"] / pooled["copy_gbps"],
                 roof_gbps=pooled["roof_gbps"], roof_kernel=pooled["roof_kernel"],
                 ratio_to_roof=r["gbps"] / pooled["roof_gbps"],
                 ratio_to_roof_best=r["gbps_best"] / pooled["roof_gbps"])
        for base in ("reference", "foreach"):
            other = by_key.get((r["layout"], r["numel"], r["dtype"], r["op"], base))
            r[f"speedup_vs_{base}"] = other["time_ms"] / r["time_ms"] if other else None
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


def _log_roof(roof: dict, log, what: str = "roof") -> None:
    """The roof's line of the log, with the GPU probes' configurations (every kernel at every
    size: the roof's records in the results file)."""
    log(f"   {what} ({roof['threads']} thread(s), write-allocate "
        f"{'counted' if roof['write_allocate'] else 'not counted'}): {roof['roof_gbps']:.1f} GB/s "
        f"by {roof['roof_kernel']} at {roof['roof_numel']:,} elements (fastest repeat)")
    for c in roof.get("gpu_probe_configs") or []:
        log(f"      GPU probe {c['kernel']} at {c['numel']:,}: BLOCK {c['block']}, "
            f"{c['warps']} warps (the fastest of benchmarks/gpu_probes.py's CONFIGS)")


def _label(r: dict) -> str:
    """A record's backend, with its Triton config where it has one: a column of the tables."""
    return r["backend"] + (f" {r['config']}" if r.get("config") else "")


# The tables (the terminal's at the end of a run, docs/performance.md's from a file), the plot

OP_SHORT = {"inner_step": "inner", "meta_step": "meta", "inner_meta_step": "combined"}


def tables(result: dict, sizes=None, source: str = "") -> str:
    """The markdown table of a results file (its device's), the single tensor at the ``sizes``
    given as powers of two (``"all"``; default 2**20 and the largest)."""
    (device, info), = result["devices"].items()
    machine, settings, roof = result.get("machine", {}), result.get("settings", {}), info["roof"]
    records = result["records"]
    backends = list(dict.fromkeys(_label(r) for r in records))
    single = {r["numel"] for r in records if r["layout"] == "single"}
    shown = single if sizes == "all" else (
        {2 ** k for k in sizes} if sizes else {n for n in single if n in (2 ** 20, max(single))})
    rank = list(LAYOUT_NAMES.values()), list(OP_SHORT)
    groups = {}
    for r in sorted(records, key=lambda r: (rank[0].index(r["layout"]), r["numel"],
                                            r["dtype"] != "fp32", rank[1].index(r["op"]))):
        if r["layout"] != "single" or r["numel"] in shown:
            groups.setdefault((r["layout"], r["numel"], r["dtype"], r["op"]), {})[_label(r)] = r
    if records and not groups:
        raise SystemExit(f"no {device} records at the sizes asked for")
    source_of_roof = (f"an in-place pass over the inputs, "
                      f"{roof['roof_source'].replace('probe on ', '')}"
                      if roof.get("roof_kernel") == "probe"    # a file whose roof a probe raised
                      else f"`{roof['roof_kernel']}`, the best streaming kernel")
    counting = "bytes read + written" + (" + write-allocate reads" if roof["write_allocate"]
                                         else "")
    caption = (f"**{info['name']}**, torch {machine.get('torch', '?')} with "
               f"{machine.get('torch_threads', '?')} thread(s); roof {roof['roof_gbps']:.1f} GB/s "
               f"({source_of_roof}; copy {roof['copy_gbps']:.1f} GB/s; {counting}; percentages "
               f"are of the roof); {settings.get('mode', '?')} run of "
               f"{result.get('created_utc', '?')}, lr_mode `{settings.get('lr_mode', '?')}`"
               + (f", from `{source}`" if source else "") + ".")
    loads = [l[0] for _, l in info.get("load_averages", []) if l]
    if loads:
        caption += (f" 1-minute load average during the run: {min(loads):.1f} to "
                    f"{max(loads):.1f} on {machine.get('cpu_count', '?')} cores.")
    rows = [[f"single 2^{numel.bit_length() - 1}" if layout == "single" else layout,
             f"{numel:,} ({next(iter(row.values()))['n_tensors']})", dtype, OP_SHORT[op]]
            + [_cell(row.get(b)) for b in backends] + [_best(list(row.values()))]
            for (layout, numel, dtype, op), row in groups.items()]
    header = ["layout", "elements (tensors)", "dtype", "step"] + backends + ["fastest"]
    notes = [f"{k}: {v}" for k, v in info.get("skipped_backends", {}).items()
             if not v.startswith("not asked")] + info.get("notes", []) + (result.get("notes") or [])
    return "\n".join([caption, "", harness.table(header, rows, markdown=True,
                                                 align="<<<<" + ">" * len(backends) + "<")
                      if rows else "Nothing was timed."]
                     + ([""] + [f"- {n}" for n in notes] if notes else []))


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
    return ", ".join([f"**{_label(best)}**"] + [
        f"{best[f'speedup_vs_{base}']:.2f}x {base}" for base in ("foreach", "reference")
        if best.get(f"speedup_vs_{base}") is not None and _label(best) != base])


def plot(result: dict, path: str) -> None:
    """GB/s against size for every (op, dtype): one line per backend over the single-tensor
    sizes, the roof dashed and the copy dotted."""
    info, recs = next(iter(result["devices"].values())), result["records"]
    ops = [o for o in common.OPS if any(r["op"] == o for r in recs)]
    dtypes = [d for d in common.DTYPE_NAMES if any(r["dtype"] == d for r in recs)]
    colors = {b: f"C{i}" for i, b in enumerate(dict.fromkeys(_label(r) for r in recs))}
    roof = info["roof"]
    title = (f"EMCL kernels on {info['name']} ({result['settings']['mode']} run, lr_mode "
             f"{result['settings']['lr_mode']}, {result['created_utc']})")
    with harness.figure(path, title, nrows=len(ops), ncols=len(dtypes), sharex=True,
                        size=(5.5 * len(dtypes), 3.6 * len(ops)), legend=6, legend_size=9,
                        rect=(0, 0.06, 1, 0.97)) as axes:
        for (i, op), (j, dt) in itertools.product(enumerate(ops), enumerate(dtypes)):
            ax = axes[i][j]
            for b, color in colors.items():
                line = sorted((r["numel"], r["gbps"]) for r in recs if r["layout"] == "single"
                              and r["op"] == op and r["dtype"] == dt and _label(r) == b)
                if line:
                    ax.plot(*zip(*line), "o-", color=color, label=b, ms=3)
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


def build_parser():
    p = harness.parser("kernels", __doc__, "device", "threads", "out", "name", "note", "quick",
                       "plot", "quiet", quick="small sizes, few repeats (< 1 min on 2 cores)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="only these backends (default: every one available on the device)")
    p.add_argument("--ops", nargs="+", default=list(common.OPS), choices=common.OPS)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(common.DTYPE_NAMES))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=list(LAYOUT_NAMES))
    p.add_argument("--sizes", nargs="+", type=int, default=None, metavar="LOG2",
                   help="single-tensor sizes as powers of two (default: 10..26 on CPU, 10..28 on "
                        "a GPU; quick: 10 14 18; --table: 20 and the largest)")
    p.add_argument("--lr-mode", default="inverse", choices=common.LR_MODES,
                   help="lr_mode of the meta and combined steps (recurrent moves 8 B more)")
    p.add_argument("--rotate-mb", type=float, default=None,
                   help="total MiB of the rotated input sets (default: 4 x the last-level cache)")
    p.add_argument("--roof-mb", type=float, default=None, help="MiB of each tensor of the "
                   "roof's kernels (default 256 MiB, more for a large cache, 1 GiB on a GPU; "
                   "quick: 64 MiB)")
    p.add_argument("--triton-configs", nargs="+", type=triton_config, default=None,
                   metavar="BLOCKxWARPS", help="time the triton backend once per BLOCK_SIZE x "
                   "NUM_WARPS (e.g. 2048x4 4096x8), each its own column")
    p.add_argument("--table", nargs="*", metavar="RESULTS_JSON", default=None,
                   help="print the tables of these results files (none: the newest "
                        "benchmarks/results/kernels_*.json) and exit")
    return p


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark; return the results dict (also written to ``--out-dir``)."""
    args = build_parser().parse_args(argv)
    if args.table is not None:
        text = "\n\n".join(tables(result, args.sizes, source) for source, result
                           in harness.load_results(args.table, "kernels", SCHEMA))
        print(text)
        return {"table": text}
    device, started = harness.device_of(args.device), time.perf_counter()
    mode = "quick" if args.quick else "full"
    settings = {"mode": mode, **PRESETS[mode], "max_sets": MAX_SETS, "rotate_factor": ROTATE_FACTOR,
                "rotate_bytes": max(1, int(args.rotate_mb * 2 ** 20)) if args.rotate_mb else 0}
    if args.roof_mb:
        settings["roof_numel"] = max(1, int(args.roof_mb * 2 ** 20) // 4)
    if device.type == "cuda":   # calls are cheap there
        settings.update(min_reps=max(settings["min_reps"], 10), max_reps=settings["gpu_max_reps"])
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))
    stem = args.name or f"kernels_{common.utc_stamp()}_{device.type}"
    with harness.threads(args.threads):
        result = harness.head("kernels", argv, device, schema=SCHEMA, note=args.note)
        result.update(settings={"lr_mode": args.lr_mode, "triton_configs": args.triton_configs,
                                **settings}, devices={}, records=[], complete=False)
        info, records = run_device(  # saved after every layout: a run cut short keeps what it timed
            device, args, settings, log, lambda info, records: harness.save(
                {**result, "devices": {device.type: info}, "records": records},
                os.path.join(args.out, stem + ".json")))
    result.update(devices={device.type: info}, records=records, complete=True,
                  wall_time_s=time.perf_counter() - started)
    return harness.finish(result, args.out, stem, plot=plot, no_plot=args.no_plot,
                          table=lambda res: tables(res, "all", res["paths"]["json"]))
