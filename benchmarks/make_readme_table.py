"""Turn a kernel-benchmark results file into the README's markdown table, so the numbers in
the README come from a committed file and nowhere else.

    python benchmarks/make_readme_table.py                          # newest results file
    python benchmarks/make_readme_table.py benchmarks/results/kernels_<stamp>_cpu.json \\
        --ops inner_meta_step --dtypes fp32 bf16

By default the table covers the model layouts (MLP, reduced ResNet-18), the 1,000 x 4K
tensors, and the single tensor at 2**20 and at the largest size every backend was timed at.
Each cell is the achieved GB/s (SPEC section 5 bytes), the fraction of the copy bandwidth
and the median time; the last column names the fastest backend and its speedups.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "results")
OP_SHORT = {"inner_step": "inner", "meta_step": "meta", "inner_meta_step": "combined"}
LAYOUT_ORDER = {"single": 0, "mlp-2x100": 1, "resnet18-reduced": 2, "many-1000x4096": 3}


def newest_results(directory: str = DEFAULT_DIR) -> str:
    """The most recent ``kernels_*.json`` in ``directory``."""
    files = sorted(glob.glob(os.path.join(directory, "kernels_*.json")))
    if not files:
        raise SystemExit(f"no kernels_*.json in {directory}; run benchmarks/bench_kernels.py first")
    return files[-1]


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


def _time(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1000 else f"{ms:.3g} ms"


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    text = f"{r['gbps']:.2f} GB/s ({100 * r['ratio_to_copy']:.0f}%), {_time(r['time_ms'])}"
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
    caption = (f"**{info['name']}**, torch {machine.get('torch', '?')} with "
               f"{machine.get('torch_threads', '?')} thread(s); copy bandwidth "
               f"{info['copy_gbps']:.1f} GB/s (`dst.copy_(src)`, bytes read + written); "
               f"{settings.get('mode', '?')} run of {result.get('created_utc', '?')}, "
               f"lr_mode `{settings.get('lr_mode', '?')}`"
               + (f", from `{source}`" if source else "") + ".")
    if result.get("note"):
        caption += f" Note: {result['note']}."
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/make_readme_table.py",
                                description="Markdown table from a bench_kernels.py results file.")
    p.add_argument("results", nargs="?", default=None,
                   help="results JSON (default: the newest benchmarks/results/kernels_*.json)")
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
    path = args.results or newest_results()
    with open(path) as f:
        result = json.load(f)
    try:
        source = os.path.relpath(path, os.path.dirname(HERE))
    except ValueError:
        source = path
    if source.startswith(".."):
        source = os.path.basename(path)
    text = make_table(result, device=args.device, layouts=args.layouts, ops=args.ops,
                      dtypes=args.dtypes, sizes=args.sizes, source=source)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
