"""Arrays of runs in the ``cpu`` backend's kernels: what one native call over N runs costs
against N calls of one run each, and whether a single run's call got slower.

    OMP_NUM_THREADS=1 python -m benchmarks array-kernels array --out FILE.json
    OMP_NUM_THREADS=1 python -m benchmarks array-kernels single --trees OLD NEW --out FILE.json

``array``: per model (``tiny``: 2 tensors, 2,080 elements per run; ``mlp``: the 784-100-100-10
MLP, 89,610 elements per run) and number of runs N, the fp32 ``step`` (op inner_meta, inverse
lr_mode, check on, finalize on) as one ``runs=N`` call over ``[N, ...]`` tensors, and as N
``runs=1`` calls over each run's slices (what N separate optimizers do), in alternating blocks
of calls in one process; medians per step of all N runs.

``single``: a ``runs=1`` call on the MLP through ``emcl_kernels._C.step`` (``--entry direct``,
the backend's path outside torch.compile: its 17 arguments by position, no ``runs``, the same
call for a build before arrays of runs) or ``torch.ops.emcl.step_`` (``--entry ops``: torch.ops
parses the schema, which gained ``runs``), timed in child processes that alternate between the
source trees given (each tree's own ``emcl_kernels._C``), several rounds; medians of each tree.

Where the machine is shared with other jobs, timings are upper bounds, and only the ratios
inside one process (``array``) or across alternating processes (``single``) mean something; the
file records the load average. (``python -m benchmarks arrays`` times the same question through
the optimizer, against HFTA's way and the bytes' floor.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

MODELS = {"tiny": (2048, 32),
          "mlp": (784 * 100, 100, 100 * 100, 100, 100 * 10, 10)}
HYPER = (0.05, 0.2, 1.5, 0.3, 0.8, 0.6, 0.0, 50.0, 1e-8)  # HYPER_FIELDS' order
OP_INNER_META, LR_INVERSE, IMP_TAYLOR = 2, 1, 0


def _tensors(torch, sizes, runs, seed):
    gen = torch.Generator().manual_seed(seed)
    lead = (runs,) if runs > 1 else ()
    out = {k: [] for k in ("params", "grads", "anchors", "importances")}
    for n in sizes:
        for k in out:
            t = torch.rand(lead + (n,), generator=gen) + (0.1 if k == "importances" else 0.0)
            out[k].append(t)
    return out


def _step(torch, lists, steps, hyper, counters, runs):
    args = (lists["params"], lists["grads"], lists["anchors"], lists["importances"], [], steps,
            hyper, counters)
    kwargs = dict(op=OP_INNER_META, prox=True, importance=IMP_TAYLOR, lr_mode=LR_INVERSE,
                  meta_every=1, check=True, finalize=True)
    if runs > 1:
        kwargs["runs"] = runs
    torch.ops.emcl.step_(*args, **kwargs)


def measure_array(model: str, runs: int, blocks: int, per_block: int) -> dict:
    import torch
    from emcl_kernels import _C  # noqa: F401  (registers torch.ops.emcl)
    from emcl_kernels.interface import counters_size
    sizes = MODELS[model]
    whole = _tensors(torch, sizes, runs, seed=1)
    hyper = torch.tensor([HYPER] * runs, dtype=torch.float64)
    counters = torch.zeros(counters_size(runs), dtype=torch.int64)
    steps = torch.zeros(len(sizes) * runs)
    # the runs alone: run r's slices (contiguous views of the same memory), its own counters
    solo = [{k: [t[r] for t in v] for k, v in whole.items()} for r in range(runs)]
    solo_hyper = [hyper[r] for r in range(runs)]
    solo_counters = [torch.zeros(counters_size(1), dtype=torch.int64) for _ in range(runs)]
    solo_steps = [torch.zeros(len(sizes)) for _ in range(runs)]

    def array():
        _step(torch, whole, steps, hyper, counters, runs)

    def separate():
        for r in range(runs):
            _step(torch, solo[r], solo_steps[r], solo_hyper[r], solo_counters[r], 1)

    times = {"array": [], "separate": []}
    for fn in (array, separate):  # warm-up
        fn()
    for b in range(blocks):
        order = (("array", array), ("separate", separate))
        for name, fn in (order if b % 2 == 0 else order[::-1]):
            for _ in range(per_block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {"model": model, "runs": runs, "elements_per_run": sum(sizes),
            "array_us": round(med["array"], 1), "separate_us": round(med["separate"], 1),
            "separate_over_array": round(med["separate"] / med["array"], 3),
            "calls_each": len(times["array"])}


def measure_single(blocks: int, per_block: int, entry: str) -> dict:
    """Child process: runs=1 calls on the MLP, medians (us) of each block."""
    import torch
    from emcl_kernels import _C  # noqa: F401
    sizes = MODELS["mlp"]
    lists = _tensors(torch, sizes, 1, seed=2)
    hyper = torch.tensor(HYPER, dtype=torch.float64)
    counters = torch.zeros(4, dtype=torch.int64)
    steps = torch.zeros(len(sizes))
    direct = (lists["params"], lists["grads"], lists["anchors"], lists["importances"], [], steps,
              hyper, counters, OP_INNER_META, True, IMP_TAYLOR, LR_INVERSE, 1, True, True, None,
              None)

    def call():
        if entry == "direct":
            _C.step(*direct)
        else:
            _step(torch, lists, steps, hyper, counters, 1)

    for _ in range(20):
        call()
    out = []
    for _ in range(blocks):
        ts = []
        for _ in range(per_block):
            start = time.perf_counter()
            call()
            ts.append(time.perf_counter() - start)
        out.append(statistics.median(ts) * 1e6)
    return {"block_medians_us": [round(x, 2) for x in out], "so": _C.__file__}


def _machine(argv) -> dict:
    from benchmarks import common
    import torch
    return {"command": common.command_line(argv), "machine": common.machine_info(),
            "load_average": common.load_average(), "torch_threads": torch.get_num_threads(),
            "note": "compare only within this file: on a machine shared with other jobs the "
                    "times are upper bounds"}


def _unavailable() -> Optional[str]:
    """Why the cpu backend cannot run here, or None."""
    from emcl_kernels.backends import backend_status
    status = backend_status()["cpu"]
    return None if status == "available" else status


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks array-kernels",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("array")
    a.add_argument("--runs", type=int, nargs="+", default=[2, 8, 32])
    a.add_argument("--models", nargs="+", default=["tiny", "mlp"])
    a.add_argument("--blocks", type=int, default=6)
    a.add_argument("--per-block", type=int, default=30)
    a.add_argument("--out")
    s = sub.add_parser("single")
    s.add_argument("--trees", nargs="+", required=True)
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--blocks", type=int, default=5)
    s.add_argument("--per-block", type=int, default=200)
    s.add_argument("--entry", choices=("direct", "ops"), default="direct")
    s.add_argument("--out")
    c = sub.add_parser("child")
    c.add_argument("--blocks", type=int, required=True)
    c.add_argument("--per-block", type=int, required=True)
    c.add_argument("--entry", choices=("direct", "ops"), required=True)
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.mode == "child":
        out = measure_single(args.blocks, args.per_block, args.entry)
        print(json.dumps(out))
        return out
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from benchmarks import common
    command = [sys.argv[0]] + argv
    why = _unavailable() if args.mode == "array" else None
    if why is not None:
        print(f"array-kernels: the cpu backend is not available: {why}")
        result = {"kind": "runs_array_vs_separate_cpu", **_machine(command), "rows": [],
                  "skipped": why}
    elif args.mode == "array":
        rows = []
        for model in args.models:
            for runs in args.runs:
                row = measure_array(model, runs, args.blocks, args.per_block)
                print(json.dumps(row), flush=True)
                rows.append(row)
        result = {"kind": "runs_array_vs_separate_cpu", **_machine(command), "rows": rows}
    else:
        per_tree = {t: [] for t in args.trees}
        so = {}
        for rnd in range(args.rounds):
            for tree in (args.trees if rnd % 2 == 0 else args.trees[::-1]):
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.path.join(tree,
                                                                                      "python")])}
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "child",
                                       "--blocks", str(args.blocks), "--per-block",
                                       str(args.per_block), "--entry", args.entry], env=env,
                                      cwd=tree,
                                      capture_output=True, text=True, check=True)
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                per_tree[tree] += got["block_medians_us"]
                so[tree] = got["so"]
        def name(path):  # inside this repository: relative; else the folder's name
            rel = common.relative(path)
            return os.path.basename(os.path.normpath(path)) if os.path.isabs(rel) else rel

        def commit(tree):
            got = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True)
            return got.stdout.strip() or None

        rows = [{"tree": name(t), "tree_commit": commit(t),
                 "extension": os.path.join(name(t), os.path.relpath(so[t], t)),
                 "median_us": round(statistics.median(v), 2), "min_block_us": round(min(v), 2),
                 "blocks": len(v)} for t, v in per_tree.items()]
        for row in rows:
            print(json.dumps(row), flush=True)
        result = {"kind": "runs1_step_cpu_trees", **_machine(command), "model": "mlp",
                  "entry": args.entry, "rounds": args.rounds,
                  "call": "inner_meta fp32 inverse prox check finalize, runs=1",
                  "rows": rows}
    result["load_average_end"] = common.load_average()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
