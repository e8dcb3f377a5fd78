"""Turn a benchmark results file into the README's markdown table, so the numbers in the
README come from a committed file and nowhere else.

    python -m benchmarks tables                          # newest kernels_*.json
    python -m benchmarks tables benchmarks/results/kernels_<stamp>_cpu.json \
        --ops inner_meta_step --dtypes fp32 bf16
    python -m benchmarks tables --step                   # newest step_*.json
    python -m benchmarks tables benchmarks/results/step_<stamp>_cpu.json --backends cpu

What each table holds: benchmarks/README.md, ``tables``.
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import os
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "results")
OP_SHORT = {"inner_step": "inner", "meta_step": "meta", "inner_meta_step": "combined"}
LAYOUT_ORDER = {"single": 0, "mlp-2x100": 1, "resnet18-reduced": 2, "many-1000x4096": 3}


def newest_results(directory: str = DEFAULT_DIR, kind: str = "kernels") -> str:
    """The most recent ``<kind>_*.json`` in ``directory`` (by the UTC stamp in its name)."""
    files = glob.glob(os.path.join(directory, f"{kind}_*.json"))
    if not files:
        raise SystemExit(f"no {kind}_*.json in {directory}; run python -m benchmarks {kind} first")
    stamp = re.compile(r"(\d{8}T\d{6}Z)")
    return max(files, key=lambda f: (stamp.search(f).group(1) if stamp.search(f) else "", f))


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


def make_table(result: dict, *, device: Optional[str] = None, layouts=None, ops=None,
               dtypes=None, sizes=None, source: str = "") -> str:
    """The markdown: a caption line naming the machine and the file, then the table."""
    devices = list(result["devices"])
    if device is None:
        device = devices[0]
    if device not in result["devices"]:
        raise SystemExit(f"no {device!r} results in this file (it has {devices})")
    info = result["devices"][device]
    records = [r for r in result["records"] if r["device"] == device]
    backends = list(dict.fromkeys(r["backend"] for r in records))
    if sizes is None:
        sizes = _default_sizes(records, backends)
    else:
        sizes = {2 ** k for k in sizes}
    keep = []
    for r in records:
        if layouts and not any(r["layout"].startswith(l) for l in layouts):
            continue
        if ops and r["op"] not in ops:
            continue
        if dtypes and r["dtype"] not in dtypes:
            continue
        if r["layout"] == "single" and r["numel"] not in sizes:
            continue
        keep.append(r)
    if not keep:
        raise SystemExit("no records match the selection")
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


# ---------------------------------------------------------------------------------------------
# Step results (bench_step.py)
# ---------------------------------------------------------------------------------------------

STEP_BASELINES = ("adam_fused", "adam_fused_checked", "adam_fused_scaler", "adam_foreach",
                  "sgd_foreach")
STEP_TITLES = {"adam_fused": "Adam fused", "adam_fused_checked": "Adam fused, checked",
               "adam_fused_scaler": "Adam fused + GradScaler", "adam_foreach": "Adam foreach",
               "sgd_foreach": "SGD foreach"}
# SPEC section 7's rows, in the table's order: (EMCL call, check_finite, under a GradScaler),
# the column title. The peer and the goal come from each record (bench_step.PEERS).
STEP_PAIRS = ((("step()", False, False), "`step()`, check off / Adam fused"),
              (("step()", True, False), "`step()` / Adam fused, checked"),
              (("step()", True, True), "`step()` + GradScaler / Adam fused + GradScaler"),
              (("inner_step()", False, False), "`inner_step()`, check off / Adam fused"))
VERDICT_MARK = {"met": "", "tie": " (tie)", "missed": " **(missed)**", None: ""}


def _step_title(name: str) -> str:
    if name in STEP_TITLES:
        return STEP_TITLES[name]
    return (name.replace("emcl[", "EMCL ").replace("]", "")
            .replace(" nocheck", ", check off").replace(" scaler", " + GradScaler"))


def _load(load) -> str:
    return "?" if not load else f"{load[0]:.1f}"


def _pair_key(r: dict) -> tuple:
    return (r.get("call"), r.get("check_finite"), bool(r.get("grad_scaler")))


def step_goals(records: list) -> list:
    """Lines saying, per EMCL backend and SPEC section 7 row, in how many cells the EMCL call
    met its goal against its like-for-like peer (``verdict`` of bench_step.add_ratios), tied
    with it within the interquartile ranges, or missed it, and the worst cell."""
    lines = []
    emcl = [r for r in records if r.get("family") == "emcl" and r.get("ratio_to_peer")]
    for key, title in STEP_PAIRS:
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
    """A contender that has no time: "n/a" where torch cannot run it (bench_step's "not
    timed: ..."), "error" where it failed; the reason is listed under the table."""
    return "n/a" if r["error"].startswith("not timed") else "error"


def make_step_table(result: dict, *, backends=None, layouts=None, dtypes=None,
                    source: str = "") -> str:
    """The README's step table: per thread count (CPU) or for the GPU, one row per layout and
    dtype; the three fused-Adam peers' median wall times, and per EMCL backend the median wall
    time of each SPEC section 7 row over its peer's (in parentheses the same of the fastest
    steps; "(tie)" where the goal lies within the interquartile ranges, "(missed)" where not).
    On a GPU a second table gives wall, host and device time and GPU activities per step."""
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
        head = ["layout", "dtype"] + [f"{STEP_TITLES[b]} (ms)" for b in STEP_BASELINES[:3]]
        for backend in emcl_backends:
            prefix = f"EMCL `{backend}` " if len(emcl_backends) > 1 else "EMCL "
            head += [prefix + title for _, title in STEP_PAIRS]
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
                for b in STEP_BASELINES[:3]:
                    r = next((r for r in here if r["family"] == b), None)
                    cells.append("-" if r is None else _error_cell(r) if r.get("error") else
                                 f"{r['wall_ms']:.3g} [{r['wall_ms_q25']:.3g}-"
                                 f"{r['wall_ms_q75']:.3g}]")
                for backend in emcl_backends:
                    for key, _ in STEP_PAIRS:
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
    gpu = [r for r in recs if r.get("device_ms") is not None]
    if gpu:
        lines += ["", "| layout | dtype | contender | wall ms | host ms | device ms | "
                  "GPU activities / step | x Adam fused | x peer |",
                  "|---|---|---|--:|--:|--:|--:|--:|--:|"]
        for r in gpu:
            peer = "-" if r.get("ratio_to_peer") is None else f"{r['ratio_to_peer']:.2f}x"
            lines.append(f"| {r['layout']} | {r['dtype']} | {_step_title(r['contender'])} | "
                         f"{r['wall_ms']:.3g} | {r['host_ms']:.3g} | {r['device_ms']:.3g} | "
                         f"{r['gpu_activities_per_step']:.3g} | "
                         f"{r['ratio_to_adam_fused']:.2f}x | {peer} |")
    errors = {(r["contender"], r["error"]) for r in recs if r.get("error")}
    goals = step_goals(recs)
    if goals or errors:
        lines.append("")
    lines += goals
    lines += [f"- {_step_title(n)}: {e}" for n, e in sorted(errors)]
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks tables",
                                description="Markdown table from a bench_kernels.py or "
                                            "bench_step.py results file.")
    p.add_argument("results", nargs="?", default=None,
                   help="results JSON (default: the newest benchmarks/results/kernels_*.json, "
                        "with --step the newest step_*.json)")
    p.add_argument("--step", action="store_true",
                   help="without a file: the newest step_*.json (bench_step.py)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="step results: only these EMCL backends (default: all in the file)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the first in the file)")
    p.add_argument("--layouts", nargs="+", default=None,
                   help="layout name prefixes: single mlp resnet18 many (default: all)")
    p.add_argument("--ops", nargs="+", default=None, choices=list(OP_SHORT))
    p.add_argument("--dtypes", nargs="+", default=None)
    p.add_argument("--sizes", nargs="+", type=int, default=None, metavar="LOG2",
                   help="single-tensor sizes to show (default: 2**20 and the largest)")
    p.add_argument("--out", default=None, help="write the markdown here instead of stdout")
    return p


def main(argv: Optional[list] = None) -> str:
    args = build_parser().parse_args(argv)
    path = args.results or newest_results(kind="step" if args.step else "kernels")
    with open(path) as f:
        result = json.load(f)
    is_step = str(result.get("schema", "")).startswith("emcl-kernels/bench_step")
    try:
        source = os.path.relpath(path, os.path.dirname(HERE))
    except ValueError:
        source = path
    if source.startswith(".."):
        source = os.path.basename(path)
    if is_step:
        text = make_step_table(result, backends=args.backends, layouts=args.layouts,
                               dtypes=args.dtypes, source=source)
    else:
        text = make_table(result, device=args.device, layouts=args.layouts, ops=args.ops,
                          dtypes=args.dtypes, sizes=args.sizes, source=source)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return text
