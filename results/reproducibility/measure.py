"""What a held-out run reproduces where: the same runs under other thread counts and other CPU
code paths, against the committed report rows.

    # one condition (the environment picks torch's and MKL's code paths before torch is imported)
    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$CLONE:$CLONE/python python results/reproducibility/measure.py run \\
        --condition aten=avx2 --threads 1 --methods sgd er agem ewc --seeds 10 11 12 13 14
    python results/reproducibility/measure.py summary     # -> results/reproducibility/summary.md

``run`` trains each (method, seed) of a stream exactly as the held-out report stage does
(``emcl_continual.selection._run_task``: the method's configuration selected on validation, the
test split) with the code on ``PYTHONPATH`` -- a clean clone of the sweep commit, so that the
only differences from the committed runs are the machine, the thread count and the environment
-- and appends one record per run to ``runs.jsonl``: the run record (accuracy matrix, metrics,
provenance) plus ``condition``, ``threads`` and ``processor`` (the CPU model, family / model /
stepping, its vector ISA flags, torch's dispatched CPU capability, torch's BLAS and the
environment variables that steer them). Finished (condition, method, seed) triples are skipped.

``summary`` compares every condition with the committed report runs (same method,
configuration and seed) and with the reference condition on this machine, and writes
``summary.md``: per method how many seeds give the identical accuracy matrix and the largest
difference in final ACC.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ENV_KEYS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile")


def processor() -> dict:
    """The CPU and the code paths torch takes on it (read from /proc/cpuinfo where it exists)."""
    import torch

    info: dict = {"machine": platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as fh:
            first = fh.read().split("\n\n", 1)[0]
        fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info.update(model_name=fields.get("model name"), vendor=fields.get("vendor_id"),
                    family=fields.get("cpu family"), model=fields.get("model"), stepping=fields.get("stepping"))
        flags = set(fields.get("flags", "").split())
        info["isa"] = [f for f in ISA_FLAGS if f in flags]
    except OSError:
        info["model_name"] = platform.processor() or None
    info["torch"] = torch.__version__
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["torch_threads"] = torch.get_num_threads()
    info["blas"] = "mkl" if torch.backends.mkl.is_available() else "other"
    info["env"] = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    return info


def _load(path: str) -> list:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def run(args) -> int:
    import torch

    try:  # the sweep commit
        from emcl_continual.selection import _run_task, run_key
    except ImportError:  # later code runs a task through its executors' run_task
        from emcl_continual.sweep.executors import run_task as _run_task
        from emcl_continual.sweep.selection import run_key

    torch.set_num_threads(args.threads)
    selected = json.load(open(os.path.join(ROOT, "results", "heldout", args.stream, "selected.json")))
    done = {(r["condition"], r["method"], r["seed"]) for r in _load(args.out)}
    proc = processor()
    if args.require_capability and proc["torch_cpu_capability"] != args.require_capability:
        raise SystemExit(f"error: torch dispatches {proc['torch_cpu_capability']}, not {args.require_capability} "
                         "(ATEN_CPU_CAPABILITY cannot raise it above what the CPU supports)")
    for method in args.methods:
        overrides = selected["methods"][method]["overrides"]
        for seed in args.seeds:
            if (args.condition, method, seed) in done:
                continue
            task = {"key": run_key(method, overrides, seed, "test"), "method": method, "overrides": overrides,
                    "seed": seed, "split": "test", "stream": args.stream, "data_root": None, "role": "report"}
            rec = _run_task(task)
            rec.update(condition=args.condition, threads=args.threads, processor=proc)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            print(f"{time.strftime('%H:%M:%S')} {args.condition:22s} {method:5s} seed {seed}: ACC {rec['acc']:.3f} "
                  f"(train {rec['train_time_s']:.1f}s)", flush=True)
    return 0


def _committed(stream: str) -> dict:
    runs = _load(os.path.join(ROOT, "results", "heldout", stream, "report.jsonl"))
    return {r["key"]: r for r in runs}


def summary(args) -> str:
    runs = _load(args.out)
    conditions = list(dict.fromkeys(r["condition"] for r in runs))
    streams = sorted({r["stream"] for r in runs})
    committed = {s: _committed(s) for s in streams}
    ref = {(r["stream"], r["method"], r["seed"]): r for r in runs if r["condition"] == args.reference}
    lines = ["# Reproducibility measurements, summarised", "",
             "Generated by `python results/reproducibility/measure.py summary` from `runs.jsonl`; do not edit.",
             "A cell: seeds whose accuracy matrix is identical to the compared run's / seeds compared; then the "
             "largest |Δ ACC| (percentage points) and the mean Δ ACC (this condition minus the other).", ""]
    procs = sorted({(r["processor"].get("model_name"), r["processor"].get("family"), r["processor"].get("model"),
                     r["processor"].get("stepping")) for r in runs})
    lines += ["Processors: " + "; ".join(f"{n} (family {f}, model {m}, stepping {s})" for n, f, m, s in procs), ""]
    lines += ["| condition | torch threads | torch CPU capability | env | method | seeds | ACC per seed | "
              "vs committed report runs | vs `" + args.reference + "` |", "|---|---|---|---|---|---|---|---|---|"]

    def compare(a: list, b: list) -> str:
        pairs = [(x, y) for x, y in zip(a, b) if y is not None]
        if not pairs:
            return "–"
        same = sum(x["acc_matrix"] == y["acc_matrix"] for x, y in pairs)
        diffs = [x["acc"] - y["acc"] for x, y in pairs]
        return (f"{same}/{len(pairs)} identical; max \\|Δ\\| {max(abs(d) for d in diffs):.2f}, "
                f"mean Δ {sum(diffs) / len(diffs):+.2f}")

    for cond in conditions:
        mine = [r for r in runs if r["condition"] == cond]
        for stream in streams:
            for method in dict.fromkeys(r["method"] for r in mine if r["stream"] == stream):
                rs = sorted((r for r in mine if r["stream"] == stream and r["method"] == method),
                            key=lambda r: r["seed"])
                p = rs[0]["processor"]
                env = ", ".join(f"{k}={v}" for k, v in p.get("env", {}).items()) or "–"
                com = [committed[stream].get(r["key"]) for r in rs]
                refs = [ref.get((stream, method, r["seed"])) for r in rs]
                vs_ref = "(reference)" if cond == args.reference else compare(rs, refs)
                lines.append(f"| {cond} | {rs[0]['threads']} | {p['torch_cpu_capability']} | {env} | {method} | "
                             f"{', '.join(str(r['seed']) for r in rs)} | "
                             f"{', '.join(format(r['acc'], '.3f') for r in rs)} | "
                             f"{compare(rs, com)} | {vs_ref} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(HERE, "summary.md"), "w") as fh:
        fh.write(text)
    return text


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train and record under the current environment")
    r.add_argument("--condition", required=True, help="a label for this environment, e.g. 'aten=avx2, 1 thread'")
    r.add_argument("--stream", default="permuted-mnist")
    r.add_argument("--methods", nargs="+", default=["sgd", "er", "agem", "ewc"])
    r.add_argument("--seeds", nargs="+", type=int, default=[10])
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--require-capability", default=None,
                   help="refuse to run unless torch dispatches this capability (AVX512, AVX2, DEFAULT)")
    s = sub.add_parser("summary", help="compare every condition with the committed runs -> summary.md")
    s.add_argument("--reference", default="1 thread", help="the condition the others are compared with (default: this "
                   "machine's own dispatch, one thread)")
    for q in (r, s):
        q.add_argument("--out", default=os.path.join(HERE, "runs.jsonl"))
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    print(summary(args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
