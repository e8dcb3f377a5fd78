"""What every benchmark of the suite does the same way: its common options, the head of its
results file, writing that file (JSON, and a PNG beside it), the interleaving of rounds and the
timing loop on it, their summary, the tables and the figures' setup (benchmarks/README.md,
"The harness")."""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import sys
from typing import Callable, Iterable, Optional, Sequence

import torch

from benchmarks import common, timing

_OPTIONS = ("device", "threads", "out", "name", "note", "quick", "plot", "quiet")


def parser(name: str, doc: str, *options: str, device: str = "auto",
           devices: bool = False, threads=None, many_threads: bool = False,
           threads_default: Optional[str] = None, quick: str = "a short run",
           out: Optional[str] = common.RESULTS_DIR) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks NAME`` (its description the first paragraph of
    ``doc``) with the common ``options`` asked for (benchmarks/README.md, "The harness")."""
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown common option(s) {sorted(unknown)}; known: {_OPTIONS}")
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}",
                                description=(doc or "").strip().split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    shown = " ".join(map(str, threads)) if isinstance(threads, (list, tuple)) else threads
    shown = threads_default or ("torch's" if threads is None else shown)
    specs = {
        "device": (["--device"], dict(nargs="+" if devices else None,
                                      default=[device] if devices else device,
                                      help="cpu, cuda, or auto (the GPU when there is one)")),
        "threads": (["--threads"], dict(type=int, nargs="+" if many_threads else None,
                                        default=threads, help="torch CPU threads" + (
                                            ", each timed in turn" if many_threads else "")
                                        + f" (default {shown})")),
        "out": (["--out", "--out-dir"], dict(dest="out", default=out,
                                             help="folder of the results file")),
        "name": (["--name"], dict(default=None, help="file stem of the results")),
        "note": (["--note"], dict(default=None, help="free text stored with the results")),
        "quick": (["--quick"], dict(action="store_true", help=quick)),
        "plot": (["--no-plot"], dict(action="store_true", help="no .png")),
        "quiet": (["--quiet"], dict(action="store_true", help="no progress lines"))}
    for option in _OPTIONS:
        if option in options:
            flags, kwargs = specs[option]
            p.add_argument(*flags, **kwargs)
    return p


def device_of(name: str) -> torch.device:
    """``auto`` -> the GPU when torch sees one, else the CPU; ``cuda`` without one: an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise SystemExit(f"--device: cpu, cuda or auto, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    return torch.device(name)


@contextlib.contextmanager
def threads(count: Optional[int]):
    """Run the block with ``count`` torch CPU threads (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def head(name: str, argv: Optional[Sequence[str]], device: Optional[torch.device] = None, *,
         schema: Optional[str] = None, note: Optional[str] = None) -> dict:
    """The head of a results file (benchmarks/README.md, "The harness"); ``argv``: the
    benchmark's own arguments (None: ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    result = {"schema": schema, "created_utc": common.utc_now(),
              "command": " ".join([f"python -m benchmarks {name}",
                                   *(common.relative(a) if os.path.isabs(a) else a for a in argv)]),
              "machine": common.machine_info(), "note": note, "notes": []}
    if device is not None:
        busy = common.busy_warning(device)
        result.update(device=device.type, device_name=common.device_name(device),
                      busy_warning=busy)
        result["notes"] += [busy] if busy else []
    return result


def save(result: dict, path: str) -> None:
    """Write ``result`` as JSON to ``path`` through a temporary file, so that the file is
    always whole (a benchmark that saves after every group keeps what it measured when cut)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".part", path)


def finish(result: dict, out: str, stem: str, *, plot: Optional[Callable] = None,
           no_plot: bool = False, table: Optional[Callable] = None,
           log: Callable = print) -> dict:
    """Write ``OUT/STEM.json`` and ``OUT/STEM.png`` (``plot(result, png_path)``, which may
    return other paths written, key -> path), print ``table(result)``, the notes and the paths;
    ``result`` with its ``paths`` (benchmarks/README.md, "The harness")."""
    path = os.path.join(out, stem + ".json")
    save(result, path)
    result["paths"] = {"json": common.relative(path)}
    if plot is not None and not no_plot:
        try:
            import matplotlib  # noqa: F401  (the plots are optional)
        except Exception as exc:  # noqa: BLE001 - any failure means: no plot here
            log(f"no plot: matplotlib is not importable ({type(exc).__name__}: {exc})")
        else:
            png = os.path.join(out, stem + ".png")
            written = plot(result, png) or {"png": png}
            result["paths"].update({k: common.relative(v) for k, v in written.items()})
    if table is not None:
        log(table(result))
    for note in result.get("notes") or ():
        log(f"note: {note}")
    log("wrote " + ", ".join(result["paths"].values()))
    return result


def load_results(paths: Sequence[str], name: str, schema: str) -> list:
    """``(source, result)`` of each results file of benchmark ``name`` (none given: the newest
    ``results/NAME_*.json`` by the UTC stamp in its name), ``source`` its path relative to the
    repository (its file name when outside it); a file of another ``schema`` is an error."""
    if not paths:
        files = glob.glob(os.path.join(common.RESULTS_DIR, f"{name}_*.json"))
        if not files:
            raise SystemExit(f"no {name}_*.json in {common.relative(common.RESULTS_DIR)}; "
                             f"run python -m benchmarks {name} first")
        stamp = re.compile(r"(\d{8}T\d{6}Z)")
        paths = [max(files, key=lambda f: (stamp.search(f).group(1) if stamp.search(f) else "", f))]
    out = []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        if result.get("schema") != schema:
            raise SystemExit(f"{path} is not a {name} results file (its schema: "
                             f"{result.get('schema')!r}, not {schema!r})")
        source = common.relative(os.path.abspath(path))
        out.append((os.path.basename(path) if os.path.isabs(source) else source, result))
    return out


def interleave(items: Sequence, rounds: int, run: Callable, *, reverse: bool = False,
               errors: Optional[dict] = None, log: Callable = print) -> list:
    """``(round, position, item, run(item, round))`` for every item of every round, in the order
    run (benchmarks/README.md, "The harness"); with ``errors``, an item that raises gets its
    error there and sits out the rest, as do those already in it."""
    items, out = list(items), []
    for rnd in range(rounds):
        start = rnd % len(items) if items else 0
        order = (items[::-1] if rnd % 2 else items) if reverse else items[start:] + items[:start]
        for pos, item in enumerate(order):
            if errors is not None and item in errors:
                continue
            try:
                out.append((rnd, pos, item, run(item, rnd)))
            except Exception as exc:  # noqa: BLE001 - recorded by the caller
                if errors is None:
                    raise
                errors[item] = f"{type(exc).__name__}: {exc}".strip()[:500]
                log(f"{item}: failed in round {rnd}: {errors[item]}")
    return out


def interleaved(fns: dict, device: torch.device, rounds: int, *, calls: int = 1,
                warmup: int = 1) -> dict:
    """Name -> seconds per call of each function of ``fns``, one per round: ``warmup`` untimed
    rounds of :func:`interleave`, then ``rounds`` timed ones of ``calls`` calls of every
    function (:func:`benchmarks.timing.time_calls`: CUDA events on a GPU)."""
    interleave(list(fns), warmup, lambda name, _: fns[name]())
    out = {name: [] for name in fns}
    for _, _, name, secs in interleave(
            list(fns), rounds, lambda name, _: timing.time_calls([fns[name]] * calls, device)):
        out[name].append(sum(secs) / calls)
    return out


def summary(seconds: Sequence[float]) -> dict:
    """``median_ms``, ``q25_ms``, ``q75_ms``, ``min_ms`` and ``rounds`` of the samples."""
    st = timing.Stats.of(seconds)
    return {"median_ms": st.median_ms, "q25_ms": st.q25_ms, "q75_ms": st.q75_ms,
            "min_ms": st.min_ms, "rounds": st.repeats}


def table(headers: Sequence[str], rows: Iterable[Sequence], title: Optional[str] = None, *,
          align: Optional[str] = None, markdown: bool = False) -> str:
    """A plain-text (or ``markdown``) table of ``rows`` under ``headers``; ``align`` one ``<``
    or ``>`` per column (benchmarks/README.md, "The harness")."""
    body = [["-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row]
            for row in rows]
    if align is None:
        align = "".join(">" if body and all(_is_number(r[i]) for r in body) else "<"
                        for i in range(len(headers)))
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("--:" if a == ">" else "---" for a in align) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]

        def line(cells):
            return "  ".join(c.rjust(w) if a == ">" else c.ljust(w)
                             for c, w, a in zip(cells, widths, align)).rstrip()
        lines = [line(headers), line(["-" * w for w in widths])] + [line(r) for r in body]
    return "\n".join(([title] if title else []) + lines)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
        return True
    except ValueError:
        return text == "-"


@contextlib.contextmanager
def figure(path: str, title: str, *, nrows: int = 1, ncols: int = 1, size: tuple,
           title_size: int = 10, legend: int = 0, legend_size: int = 8, rect=None,
           dpi: int = 110, **subplots):
    """``nrows`` x ``ncols`` matplotlib axes (Agg) the block draws on, then titled, laid out in
    ``rect``, saved to ``path`` and closed (benchmarks/README.md, "The harness")."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False, **subplots)
    try:
        yield axes
        if legend:
            handles, labels = axes[0][0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=min(legend, len(labels)),
                       fontsize=legend_size)
        fig.suptitle(title, fontsize=title_size)
        fig.tight_layout(rect=rect)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
