"""End-to-end benchmark: wall time of continual-learning training per method and backend, the
shape of the paper's training-time figure (Figure 2).

    python benchmarks/bench_training.py                 # permuted MNIST, 5 tasks x 200 samples
    python benchmarks/bench_training.py --quick         # 2 tasks x 50 samples
    python benchmarks/bench_training.py --n-tasks 20 --samples-per-task 1000 --seeds 0 1 2

EMCL (``emcl_continual.methods.emcl``, driven by ``FusedEMCLOptimizer``) is trained once per
backend available for the device (Triton on CPU tensors runs only through its interpreter and
is left out unless ``--cpu-triton``), and every baseline method whose module is present
(``emcl_continual.methods.METHODS``) once, all on the same stream built from the same seed.
The time is ``emcl_continual.train.run``'s ``train_time_s``: the method's ``observe`` on every
incoming batch, evaluation excluded (its time is recorded apart). Each (method, backend) is
warmed up on a one-task stream first, so lazy imports and compilation are not timed.

Writes ``benchmarks/results/training_<stamp>_<device>.json`` and a PNG bar chart (training
time per method / backend), and prints a table. Needs the ``emcl_continual`` package
(``python/`` in this repository); without it the script stops and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402


def _import_continual():
    """``emcl_continual``'s train loop, streams and method registry, or a clear stop."""
    try:
        from emcl_continual import train
        from emcl_continual.methods import METHODS, get_method
        from emcl_continual.streams import STREAMS, make_stream
    except ImportError as exc:
        raise SystemExit(
            "bench_training.py needs the emcl_continual package (python/emcl_continual in this "
            f"repository), which could not be imported: {exc}. Run it from a full checkout "
            "(python benchmarks/bench_training.py) or install the repository with "
            "`pip install --no-build-isolation -e .`.") from exc
    return train, METHODS, get_method, STREAMS, make_stream


def available_methods(methods: dict, get_method) -> tuple[list, dict]:
    """The registered methods whose modules are present, and why the others are not."""
    ok, missing = [], {}
    for name in methods:
        try:
            get_method(name)
        except (ValueError, ImportError) as exc:
            missing[name] = str(exc)
            continue
        ok.append(name)
    return ok, missing


def plan_runs(methods: list, emcl_backends: list) -> list:
    """(method, backend) pairs: EMCL once per backend, every other method once (backend None)."""
    out = []
    for m in methods:
        if m == "emcl":
            out.extend(("emcl", b) for b in emcl_backends)
        else:
            out.append((m, None))
    return out


def label(method: str, backend: Optional[str]) -> str:
    return method if backend is None else f"{method} ({backend})"


def summarize(records: list) -> list:
    """Mean and spread of the training time (and ACC / BWT) per (method, backend)."""
    groups = {}
    for r in records:
        groups.setdefault((r["method"], r["backend"]), []).append(r)
    out = []
    for (method, backend), rs in groups.items():
        times = [r["train_time_s"] for r in rs]
        out.append({
            "method": method, "backend": backend, "label": label(method, backend),
            "seeds": [r["seed"] for r in rs],
            "train_time_s": statistics.mean(times),
            "train_time_s_std": statistics.stdev(times) if len(times) > 1 else 0.0,
            "ms_per_batch": statistics.mean(r["ms_per_batch"] for r in rs),
            "acc": statistics.mean(r["acc"] for r in rs),
            "bwt": statistics.mean(r["bwt"] for r in rs),
        })
    return out


def format_table(result: dict) -> str:
    s = result["settings"]
    lines = [f"\n{result['device_name']}, {s['stream']}: {s['n_tasks']} tasks x "
             f"{s['samples_per_task']} samples, batch {s['batch_size']}, seeds {s['seeds']}, "
             f"{result['machine']['torch_threads']} torch thread(s)"]
    head = f"{'method (backend)':<22} {'train s':>9} {'+-':>6} {'ms/batch':>9} {'ACC':>6} {'BWT':>7}"
    lines += [head, "-" * len(head)]
    for r in result["summary"]:
        lines.append(f"{r['label']:<22} {r['train_time_s']:>9.2f} {r['train_time_s_std']:>6.2f} "
                     f"{r['ms_per_batch']:>9.2f} {r['acc']:>6.2f} {r['bwt']:>7.2f}")
    for name, why in result["skipped_methods"].items():
        lines.append(f"not run: {name}: {why}")
    for name, why in result["skipped_backends"].items():
        lines.append(f"emcl backend not run: {name}: {why}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Training time per method / backend as horizontal bars (the paper's Figure 2 shape)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.6))
    ys = range(len(rows))
    colors = ["C0" if r["method"] == "emcl" else "C7" for r in rows]
    ax.barh(list(ys), [r["train_time_s"] for r in rows], xerr=[r["train_time_s_std"] for r in rows],
            color=colors)
    for y, r in zip(ys, rows):
        ax.text(r["train_time_s"], y, f"  {r['train_time_s']:.3g} s", va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["label"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("training time, s (evaluation excluded)")
    s = result["settings"]
    ax.set_title(f"{s['stream']}, {s['n_tasks']} tasks x {s['samples_per_task']} samples, "
                 f"{result['device_name']}", fontsize=9)
    ax.margins(x=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_training.py",
                                description="Training time of EMCL per backend and of the baselines.")
    p.add_argument("--quick", action="store_true", help="2 tasks x 50 samples")
    p.add_argument("--stream", default="permuted-mnist")
    p.add_argument("--n-tasks", type=int, default=None, help="default 5 (quick 2)")
    p.add_argument("--samples-per-task", type=int, default=None, help="default 200 (quick 50)")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--methods", nargs="+", default=None,
                   help="default: emcl and every baseline whose module is present")
    p.add_argument("--backends", nargs="+", default=None,
                   help="EMCL backends (default: every one available on the device)")
    p.add_argument("--cpu-triton", action="store_true", help="also time interpreted Triton on CPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1, as training runs on a shared machine)")
    p.add_argument("--data-root", default=None, help="data sets on disk (see emcl_continual)")
    p.add_argument("--out-dir", default=common.RESULTS_DIR)
    p.add_argument("--name", default=None, help="file stem (default training_<UTC stamp>_<device>)")
    p.add_argument("--note", default=None, help="free text stored with the results")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: Optional[list] = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.cpu_triton:
        if args.device != "cpu":
            raise SystemExit("--cpu-triton runs Triton through its interpreter; use it with --device cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton backend is imported
    train, METHODS, get_method, STREAMS, make_stream = _import_continual()
    if args.stream not in STREAMS:
        raise SystemExit(f"unknown stream {args.stream!r}; choose one of {', '.join(STREAMS)}")
    n_tasks = args.n_tasks or (2 if args.quick else 5)
    per_task = args.samples_per_task or (50 if args.quick else 200)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args, argv, train, METHODS, get_method, make_stream, n_tasks, per_task, device)
    finally:
        torch.set_num_threads(threads_before)


def _main(args, argv, train, METHODS, get_method, make_stream, n_tasks, per_task, device) -> dict:
    present, skipped_methods = available_methods(METHODS, get_method)
    if args.methods:
        unknown = [m for m in args.methods if m not in METHODS]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}; registered: {', '.join(METHODS)}")
        missing = [m for m in args.methods if m not in present]
        if missing:
            raise SystemExit("method(s) not present: " +
                             "; ".join(f"{m}: {skipped_methods[m]}" for m in missing))
        methods = list(args.methods)
        skipped_methods = {m: "not asked for (--methods)" for m in present if m not in methods}
    else:
        methods = present
    backends, skipped_backends = common.backends_for(device, include_cpu_triton=args.cpu_triton,
                                                     only=args.backends)
    if "emcl" in methods and not backends:
        raise SystemExit(f"no EMCL backend available on {device}: {skipped_backends}")
    runs = plan_runs(methods, backends)

    started = time.perf_counter()
    records = []
    for seed in args.seeds:
        stream = make_stream(args.stream, seed, data_root=args.data_root, n_tasks=n_tasks,
                             samples_per_task=per_task)
        warm = make_stream(args.stream, seed, data_root=args.data_root, n_tasks=1,
                           samples_per_task=2 * args.batch_size)
        n_batches = stream.n_batches(args.batch_size)
        for method, backend in runs:
            overrides = {"backend": backend} if backend is not None else {}
            if seed == args.seeds[0]:       # lazy imports, compilation, allocator warm-up
                train.run(method, warm, seed, overrides=overrides, batch_size=args.batch_size,
                          device=device, progress=False)
            t0 = time.perf_counter()
            r = train.run(method, stream, seed, overrides=overrides, batch_size=args.batch_size,
                          device=device, progress=False)
            wall = time.perf_counter() - t0
            rec = {"method": method, "backend": backend, "label": label(method, backend),
                   "seed": seed, "stream": r["stream"], "n_tasks": r["n_tasks"],
                   "samples_per_task": per_task, "batch_size": args.batch_size,
                   "n_batches": n_batches, "train_time_s": r["train_time_s"],
                   "eval_time_s": r["eval_time_s"], "wall_time_s": wall,
                   "ms_per_batch": 1e3 * r["train_time_s"] / max(1, n_batches),
                   "acc": r["acc"], "bwt": r["bwt"], "device": device.type,
                   "data_source": r.get("data_source")}
            records.append(rec)
            print(f"{rec['label']:<22} seed {seed}: train {rec['train_time_s']:.2f} s "
                  f"({rec['ms_per_batch']:.2f} ms/batch), ACC {rec['acc']:.2f}", flush=True)

    result = {
        "schema": "emcl-kernels/bench_training/1",
        "created_utc": common.utc_now(),
        "command": "python benchmarks/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": common.machine_info(),
        "device_name": common.device_name(device),
        "note": args.note,
        "settings": {"stream": args.stream, "n_tasks": n_tasks, "samples_per_task": per_task,
                     "batch_size": args.batch_size, "seeds": args.seeds, "device": device.type,
                     "threads": torch.get_num_threads(), "mode": "quick" if args.quick else "full"},
        "skipped_methods": skipped_methods,
        "skipped_backends": skipped_backends,
        "records": records,
        "summary": summarize(records),
        "wall_time_s": time.perf_counter() - started,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = args.name or f"training_{common.utc_stamp()}_{device.type}"
    path = os.path.join(args.out_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    result["paths"] = {"json": path}
    if not args.no_plot:
        png = os.path.join(args.out_dir, stem + ".png")
        plot(result, png)
        result["paths"]["png"] = png
    print(format_table(result))
    print(f"\nwall time {result['wall_time_s']:.1f} s; wrote " + ", ".join(result["paths"].values()))
    return result


if __name__ == "__main__":
    main()
