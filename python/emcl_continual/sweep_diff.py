"""Two sweeps of the same runs side by side: do they give the same results, and how long did each take?

    python -m emcl_continual.sweep_diff A B --out results/scale/permuted-mnist/cpu-vs-gpu

``A`` and ``B`` are folders written by :mod:`emcl_continual.selection` (``validation.jsonl``, and
``report.jsonl`` where there is one), e.g. the validation stage on the 2-core CPU with ``--jobs 2``
and the same stage on a GPU machine with ``--device auto --jobs 16``. Runs are matched by their key
(method, configuration, seed, split, data); for each method the table gives how many runs both
folders hold, how many computed the same accuracy matrix bit for bit, the largest and the mean
difference of ACC (B − A), and whether the selection of the validation stage (each method's best
grid configuration, :func:`emcl_continual.selection.select_a`) is the same. Training on two
machines (or two code paths of one: AVX2 against AVX-512, a GPU against a CPU) is not bitwise the
same and SGD on a stream amplifies the first difference, so "the same results" means the same
selection and differences of the size the reproducibility study measured
(``results/reproducibility/``), not identical numbers.

The time of each folder is the wall clock of the commands that ran its runs, from its
``timings.jsonl`` (one line per stage a command ran, written by the selection); the ratio A / B is
the speed-up of B. Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import selection

__all__ = ["diff", "markdown", "main"]

FILES = ("validation.jsonl", "report.jsonl")


def _runs(folder: str) -> dict:
    out = {}
    for name in FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            out.update({r["key"]: r for r in selection.load_runs(path)})
    if not out:
        raise SystemExit(f"error: {folder} holds no runs ({' or '.join(FILES)})")
    return out


def _shown(path: str) -> str:
    """``path`` as a results file names it: relative to the working directory (the repository,
    when the command runs there), absolute only when it lies outside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _timing(folder: str) -> dict | None:
    path = os.path.join(folder, selection.TIMINGS_FILE)
    if not os.path.exists(path):
        return None
    lines = selection.load_runs(path)
    if not lines:
        return None
    return {"wall_s": round(sum(t["wall_s"] for t in lines), 3), "runs": sum(t["runs"] for t in lines),
            "failed": sum(t["failed"] for t in lines), "commands": len(lines),
            "slots": sorted({t["slots"] for t in lines}), "devices": lines[-1].get("devices"),
            "host": lines[-1].get("host"), "commit": lines[-1].get("commit"),
            "source": sorted({t.get("source", "selection") for t in lines}),
            "done": sum(t.get("done", t["runs"] - t["failed"]) for t in lines),
            "interrupted": sorted({t["interrupted"] for t in lines if t.get("interrupted")})}


def _selection(stream: str, runs: dict) -> dict:
    """method -> the chosen grid configuration of the validation stage (where all its runs are here)."""
    present = {r["method"] for r in runs.values()}
    rows = selection.validation_rows_a(stream, [m for m in selection.ALL_METHODS if m in present])
    chosen = selection.select_a(stream, rows, list(runs.values()))
    out = {m: d["overrides"] for m, d in chosen["methods"].items()}
    if chosen.get("algorithm-1"):
        out["emcl/algorithm-1"] = chosen["algorithm-1"]["overrides"]
    return out


def diff(a: str, b: str) -> dict:
    """The comparison of folders ``a`` and ``b`` (see the module's docstring) as a dict."""
    ra, rb = _runs(a), _runs(b)
    both = sorted(set(ra) & set(rb))
    streams = {ra[k]["stream"] for k in both}
    if not both:
        raise SystemExit(f"error: {a} and {b} have no run in common")
    if len(streams) != 1:
        raise SystemExit(f"error: the common runs come from several streams: {sorted(streams)}")
    stream = streams.pop()
    methods = {}
    for k in both:
        x, y = ra[k], rb[k]
        m = methods.setdefault(x["method"], {"runs": 0, "identical": 0, "diffs": [], "acc_a": [], "acc_b": []})
        m["runs"] += 1
        m["identical"] += x["acc_matrix"] == y["acc_matrix"]
        m["diffs"].append(y["acc"] - x["acc"])
        m["acc_a"].append(x["acc"])
        m["acc_b"].append(y["acc"])
    table = {}
    for name, m in methods.items():
        n = m["runs"]
        table[name] = {"runs": n, "identical": m["identical"],
                       "max_abs_diff": max(abs(d) for d in m["diffs"]), "mean_diff": sum(m["diffs"]) / n,
                       "mean_acc_a": sum(m["acc_a"]) / n, "mean_acc_b": sum(m["acc_b"]) / n}
    sel_a = _selection(stream, {k: ra[k] for k in both})
    sel_b = _selection(stream, {k: rb[k] for k in both})
    ta, tb = _timing(a), _timing(b)
    return {"a": _shown(a), "b": _shown(b), "stream": stream, "runs_in_both": len(both),
            "only_a": len(set(ra) - set(rb)), "only_b": len(set(rb) - set(ra)),
            "devices_a": sorted({ra[k]["device"] for k in both}), "devices_b": sorted({rb[k]["device"] for k in both}),
            "methods": table,
            "selection": {g: {"a": sel_a.get(g), "b": sel_b.get(g), "same": sel_a.get(g) == sel_b.get(g)}
                          for g in sorted(set(sel_a) | set(sel_b))},
            "timing_a": ta, "timing_b": tb,
            # a stage cut short has no time to compare
            "time_ratio_a_over_b": (ta["wall_s"] / tb["wall_s"])
            if ta and tb and tb["wall_s"] and not ta["interrupted"] and not tb["interrupted"] else None}


def _where(t: dict | None) -> str:
    if not t:
        return "not timed (no timings.jsonl)"
    host = t.get("host") or {}
    gpus = ", ".join(host.get("gpus") or []) or "no GPU"
    cut = (f" (interrupted by {'/'.join(t['interrupted'])} after {t['done']} of them: no time ratio)"
           if t.get("interrupted") else "")
    return (f"{t['wall_s']:.0f} s for {t['runs']} runs{cut} ({t['failed']} failed) on {host.get('cpu') or '?'} "
            f"x{host.get('logical_cpus') or '?'}, {gpus}; {'/'.join(map(str, t['slots']))} at a time; "
            f"devices {json.dumps(t.get('devices') or {})}; commit {(t.get('commit') or '?')[:7]}")


def markdown(d: dict, label_a: str = "A", label_b: str = "B") -> str:
    lines = [f"# {label_a} against {label_b}: {d['stream']}", "",
             f"- {label_a}: `{d['a']}` ({', '.join(d['devices_a'])}): {_where(d['timing_a'])}",
             f"- {label_b}: `{d['b']}` ({', '.join(d['devices_b'])}): {_where(d['timing_b'])}",
             f"- runs in both: {d['runs_in_both']} (only in {label_a}: {d['only_a']}, only in {label_b}: {d['only_b']})"]
    if d["time_ratio_a_over_b"]:
        lines.append(f"- wall clock {label_a} / {label_b}: **{d['time_ratio_a_over_b']:.2f}x**")
    lines += ["", f"| method | runs | same bits | max abs ΔACC | mean ΔACC ({label_b} − {label_a}) | "
                  f"mean ACC {label_a} | mean ACC {label_b} |", "|---|--:|--:|--:|--:|--:|--:|"]
    for name, m in d["methods"].items():
        lines.append(f"| {name} | {m['runs']} | {m['identical']} | {m['max_abs_diff']:.2f} | {m['mean_diff']:+.2f} | "
                     f"{m['mean_acc_a']:.2f} | {m['mean_acc_b']:.2f} |")
    same = [g for g, s in d["selection"].items() if s["same"]]
    lines += ["", f"Selection of the validation stage (best mean validation ACC per method): the same for "
                  f"{len(same)} of {len(d['selection'])} groups."]
    for g, s in d["selection"].items():
        if not s["same"]:
            lines.append(f"- {g}: {label_a} {json.dumps(s['a'], sort_keys=True)}, "
                         f"{label_b} {json.dumps(s['b'], sort_keys=True)}")
    return "\n".join(lines) + "\n"


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emcl_continual.sweep_diff", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="folder of the first sweep (the baseline)")
    p.add_argument("b", help="folder of the second sweep")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (default: print the table)")
    args = p.parse_args(argv)
    for folder in (args.a, args.b):
        if not os.path.isdir(folder):
            p.error(f"{folder} is not a folder")
    d = diff(args.a, args.b)
    text = markdown(d, args.label_a, args.label_b)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as fh:
            json.dump(d, fh, indent=1, sort_keys=True)
            fh.write("\n")
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
        print(f"wrote {args.out}.json and {args.out}.md")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
