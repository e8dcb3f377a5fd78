"""End-to-end benchmark: wall time of continual-learning training per method, backend and device,
the shape of the paper's training-time figure (Figure 2), on the CPU and on a GPU.

    python -m benchmarks training                      # permuted MNIST, 5 tasks x 200, CPU
    python -m benchmarks training --quick              # 2 tasks x 50 samples
    python -m benchmarks training --device auto        # CPU, and the GPU when there is one
    python -m benchmarks training --device auto --streams permuted-mnist split-cifar100 split-miniimagenet
    python -m benchmarks training --table benchmarks/results/training_*.json   # README tables
    python -m benchmarks training --heldout results/heldout --streams permuted-mnist rotated-mnist \
        many-permutations --out-dir results/efficiency --name controlled_cpu   # the results tables' times

The runs, the image streams, the held-out rows (:data:`HELDOUT_ROWS`, counted by
``emcl_continual.training.cost.CostCounter``) and the outputs: benchmarks/README.md,
``training``. Every run here is without anytime evaluation; what ``--eval-every`` adds to a run,
per method at the presets' K, is ``python -m benchmarks anytime``.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from typing import Optional

from benchmarks import common, harness  # (puts the repository on sys.path)

import numpy as np
import torch

DEVICE_CHOICES = ("cpu", "cuda", "auto")
IMAGE_STREAMS = ("split-cifar100", "split-miniimagenet")
# image streams: methods timed by default (La-MAML's 10 second-order glances and MER's ~2,600
# one-sample steps per batch take minutes per batch of the ResNet on a 2-core CPU)
IMAGE_METHODS = ("emcl", "sgd", "ewc", "agem", "gem", "er")
STEADY_SKIP = 4  # image streams: batches before the steady per-batch median (EMCL's graphs
                 # are captured at the 4th batch: 1 without replay, 2 warm-up, 1 capture)


def _import_continual():
    """``emcl_continual``'s train loop, streams and method registry, or a clear stop."""
    try:
        from emcl_continual.training import train
        from emcl_continual.methods import METHODS, get_method
        from emcl_continual.data.streams import STREAMS, make_stream
    except ImportError as exc:
        raise SystemExit(
            "bench_training.py needs the emcl_continual package (python/emcl_continual in this "
            f"repository), which could not be imported: {exc}. Run it from a full checkout "
            "(python -m benchmarks training) or install the repository with "
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


def graph_modes(device: torch.device, choice: str) -> list:
    """EMCL's ``cuda_graph`` settings to time on ``device``: None (its default) on the CPU;
    on a GPU True (glances replayed from CUDA graphs) and/or False (eager), by ``choice``."""
    if choice not in ("on", "off", "both"):
        raise ValueError(f"--emcl-graph must be on, off or both, got {choice!r}")
    if device.type != "cuda":
        return [None]
    return {"on": [True], "off": [False], "both": [True, False]}[choice]


def label(method: str, backend: Optional[str], graph: Optional[bool] = None) -> str:
    if backend is None:
        return method
    if graph is None:
        return f"{method} ({backend})"
    return f"{method} ({backend}, {'graph' if graph else 'eager'})"


def devices_for(choice: str) -> tuple[list, Optional[str]]:
    """The devices ``--device`` asks for, and a note when ``auto`` found no GPU. ``cuda``
    without a GPU stops with one line."""
    if choice not in DEVICE_CHOICES:
        raise SystemExit(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    has_gpu = torch.cuda.is_available()
    if choice == "cuda" and not has_gpu:
        raise SystemExit("--device cuda: torch sees no CUDA device here "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                         "use --device cpu, or --device auto to time the GPU only where there is one")
    if choice == "cpu":
        return [torch.device("cpu")], None
    if choice == "cuda":
        return [torch.device("cuda")], None
    if has_gpu:
        return [torch.device("cpu"), torch.device("cuda")], None
    return [torch.device("cpu")], "--device auto: no GPU here, timing the CPU only"


# ---------------------------------------------------------------------------------------------
# Image data files in their real formats
# ---------------------------------------------------------------------------------------------

def write_image_files(root: str, stream: str, samples_per_task: int, seed: int = 0) -> str:
    """Write ``stream``'s data files under ``root`` in the formats ``emcl_continual.data.sources``
    reads, with random pixels and enough images per class for ``samples_per_task`` samples in
    each task: ``cifar-100-python/{train,test}`` (pickled dicts with ``data`` uint8 (n, 3072)
    and ``fine_labels``) or ``miniimagenet/mini-imagenet-cache-{train,val,test}.pkl`` (dicts
    with ``image_data`` uint8 (n, 84, 84, 3) and ``class_dict``). Returns a description."""
    rng = np.random.default_rng(seed)
    per_class = -(-samples_per_task // 5)  # 5 classes per task
    if stream == "split-cifar100":
        folder = os.path.join(root, "cifar-100-python")
        os.makedirs(folder, exist_ok=True)
        for split, k in (("train", per_class), ("test", 2)):
            labels = np.repeat(np.arange(100), k)
            rng.shuffle(labels)
            entry = {"batch_label": split, "filenames": [f"img{i}.png" for i in range(len(labels))],
                     "fine_labels": labels.tolist(), "coarse_labels": (labels // 5).tolist(),
                     "data": rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)}
            with open(os.path.join(folder, split), "wb") as fh:
                pickle.dump(entry, fh)
        return (f"CIFAR-100 python pickles with random pixels ({per_class} training images per "
                "class), written by bench_training.py")
    if stream == "split-miniimagenet":
        folder = os.path.join(root, "miniimagenet")
        os.makedirs(folder, exist_ok=True)
        n_img = -(-per_class * 6 // 5) + 1  # the stream keeps 5/6 of each class for training
        for split, n_cls in (("train", 64), ("val", 16), ("test", 20)):
            images = rng.integers(0, 256, size=(n_cls * n_img, 84, 84, 3), dtype=np.uint8)
            classes = {f"n{split}{c:04d}": list(range(c * n_img, (c + 1) * n_img)) for c in range(n_cls)}
            with open(os.path.join(folder, f"mini-imagenet-cache-{split}.pkl"), "wb") as fh:
                pickle.dump({"image_data": images, "class_dict": classes}, fh)
        return (f"miniImageNet cache pickles with random pixels ({n_img} images per class), "
                "written by bench_training.py")
    raise ValueError(f"no image files to write for stream {stream!r}")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def run_prefix(train, get_method, method: str, overrides: dict, stream, seed: int, n_tasks: int,
               batch_size: int, device: torch.device = torch.device("cpu"), count: bool = False) -> dict:
    """Train ``method`` (its configuration: its defaults for ``stream`` updated with
    ``overrides``) on the first ``n_tasks`` tasks of ``stream`` as ``emcl_continual.training.train.run``
    does (``begin_task``, one ``observe`` per batch, ``end_task``; the model built and
    initialised alike), without evaluating. The stream stays whole, so that a method that sizes
    itself by the number of tasks (GEM's memory per task) is the configuration of the full run.

    Returns ``train_time_s`` (the sum of those calls, timed as ``train.run`` times them),
    ``cpu_time_s`` (the process's CPU time over the same calls, which a loaded machine
    stretches less than the wall clock), ``incoming_samples`` and, with ``count``, the ``CostCounter`` counts (the counting
    hooks cost time: a counted run is not a timed one)."""
    from emcl_continual.data.models import build_model
    from emcl_continual.training.cost import CostCounter

    info = stream.info
    if not 1 <= n_tasks <= info.n_tasks:
        raise ValueError(f"n_tasks must be in [1, {info.n_tasks}] for {info.name}, got {n_tasks}")
    config = train.build_config(method, info.name, seed, overrides)
    torch.manual_seed(int(seed))
    model = build_model(info, init=config.get("init", train.RUN_DEFAULTS["init"])).to(device)
    learner = get_method(method)(model, info, config, device)
    counter = CostCounter().attach(learner) if count else None
    elapsed, cpu, samples = 0.0, 0.0, 0
    try:
        for t in range(n_tasks):
            start, cstart = time.perf_counter(), time.process_time()
            learner.begin_task(t)
            elapsed += time.perf_counter() - start
            cpu += time.process_time() - cstart
            for x, y in stream.batches(t, batch_size, device=device):
                common.synchronize(device)
                start, cstart = time.perf_counter(), time.process_time()
                learner.observe(x, y, t)
                common.synchronize(device)
                elapsed += time.perf_counter() - start
                cpu += time.process_time() - cstart
                samples += x.shape[0]
                if counter is not None:
                    counter.flush()
            start, cstart = time.perf_counter(), time.process_time()
            learner.end_task(t)
            common.synchronize(device)
            elapsed += time.perf_counter() - start
            cpu += time.process_time() - cstart
            if counter is not None:
                counter.flush()
    finally:
        if counter is not None:
            counter.detach()
    out = {"train_time_s": elapsed, "cpu_time_s": cpu, "incoming_samples": samples}
    if counter is not None:
        out["counts"] = counter.counts(samples)
    return out


def time_batches(train, get_method, method: str, stream, seed: int, overrides: dict,
                 device: torch.device, batch_size: int) -> list:
    """Seconds of each ``observe`` of ``method`` over ``stream``'s first task (device
    synchronized around each), set up and bracketed by ``begin_task``/``end_task`` as
    ``emcl_continual.training.train.run`` does (the boundaries themselves are not timed)."""
    from emcl_continual.data.models import build_model

    info = stream.info
    config = train.build_config(method, info.name, seed, overrides)
    torch.manual_seed(int(seed))
    model = build_model(info).to(device)
    learner = get_method(method)(model, info, config, device)
    out = []
    learner.begin_task(0)
    for x, y in stream.batches(0, batch_size, device=device):
        common.synchronize(device)
        start = time.perf_counter()
        learner.observe(x, y, 0)
        common.synchronize(device)
        out.append(time.perf_counter() - start)
    learner.end_task(0)
    return out


def summarize(records: list) -> list:
    """Mean and spread of the training time (and ACC / BWT) per (stream, device, method,
    backend, graph), in the order first seen."""
    groups = {}
    for r in records:
        key = (r.get("stream"), r.get("device"), r["method"], r["backend"], r.get("graph"))
        groups.setdefault(key, []).append(r)
    out = []
    for (stream, device, method, backend, graph), rs in groups.items():
        times = [r["train_time_s"] for r in rs]
        row = {
            "stream": stream, "device": device, "method": method, "backend": backend,
            "graph": graph, "label": label(method, backend, graph),
            "seeds": [r["seed"] for r in rs],
            "train_time_s": statistics.mean(times),
            "train_time_s_std": statistics.stdev(times) if len(times) > 1 else 0.0,
            "ms_per_batch": statistics.mean(r["ms_per_batch"] for r in rs),
            "acc": statistics.mean(r["acc"] for r in rs) if all(r.get("acc") is not None for r in rs) else None,
            "bwt": statistics.mean(r["bwt"] for r in rs) if all(r.get("bwt") is not None for r in rs) else None,
        }
        steady = [r["ms_per_batch_steady"] for r in rs if r.get("ms_per_batch_steady") is not None]
        row["ms_per_batch_steady"] = statistics.mean(steady) if steady else None
        out.append(row)
    return out


def _fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def _num(v: float) -> str:
    """Three significant digits without exponents: 0.736, 19.8, 456, 3,280."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def format_table(result: dict) -> str:
    """The run's summary as a plain-text table per stream and device."""
    s = result["settings"]
    lines = []
    names = result.get("device_names", {})
    for stream in s.get("streams", [s["stream"]]):
        ss = s.get("per_stream", {}).get(stream, {"n_tasks": s["n_tasks"],
                                                  "samples_per_task": s["samples_per_task"]})
        for dev in s.get("devices", [s["device"]]):
            rows = [r for r in result["summary"] if r.get("stream", stream) == stream
                    and r.get("device", dev) == dev]
            if not rows:
                continue
            lines.append(f"\n{names.get(dev, result.get('device_name', dev))}, {stream}: "
                         f"{ss['n_tasks']} tasks x {ss['samples_per_task']} samples, batch "
                         f"{s['batch_size']}, seeds {s['seeds']}, "
                         f"{result['machine']['torch_threads']} torch thread(s)")
            lines.append(harness.table(
                ("method (backend)", "train s", "+-", "ms/batch", "steady", "ACC", "BWT"),
                [(r["label"], r["train_time_s"], r["train_time_s_std"], r["ms_per_batch"],
                  r.get("ms_per_batch_steady"), r["acc"], r["bwt"]) for r in rows]))
    for name, why in result["skipped_methods"].items():
        lines.append(f"not run: {name}: {why}")
    for name, why in result["skipped_backends"].items():
        lines.append(f"emcl backend not run: {name}: {why}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# README tables (Figure 2 on both devices) from one or more results files
# ---------------------------------------------------------------------------------------------

def _headline(rows: list, method: str, device: str, auto: dict) -> Optional[dict]:
    """The row that stands for ``method`` on ``device``: for EMCL the backend ``auto`` picks
    there (what ``python -m emcl_continual`` runs), graphed on a GPU; for a baseline its row."""
    mine = [r for r in rows if r["method"] == method and r.get("device") == device]
    if method != "emcl" or not mine:
        return mine[0] if mine else None
    want_backend = auto.get(device)
    for r in mine:
        if r["backend"] == want_backend and r.get("graph") in (None, True):
            return r
    return None


def readme_tables(results: list) -> str:
    """Markdown: per stream, the training time of every method on each device (the paper's
    Figure 2) with the GPU's speed-up, then every row with its backend; captions name the
    machines and the files the numbers come from."""
    rows, auto, notes, sources = [], {}, [], []
    for res in results:
        for r in res["summary"]:
            rows.append(dict(r, stream=r.get("stream", res["settings"]["stream"]),
                             device=r.get("device", res["settings"]["device"]),
                             _file=res.get("_path", "?"), _res=res))
        auto.update(res.get("auto_backend", {}))
        names = res.get("device_names", {res["settings"]["device"]: res.get("device_name", "?")})
        load = res["machine"].get("load_average_at_start")
        end = res["machine"].get("load_average_at_end")
        sources.append(f"`{res.get('_path', '?')}`: {', '.join(f'{d}: {n}' for d, n in names.items())}; "
                       f"torch {res['machine']['torch']}, {res['machine']['torch_threads']} CPU thread(s), "
                       f"load average at start {load}" + (f", at end {end}" if end else "") +
                       f", commit {res['machine'].get('git_commit')}, "
                       f"created {res.get('created_utc')}")
        notes += res.get("notes", [])
    out = []
    streams = list(dict.fromkeys(r["stream"] for r in rows))
    for stream in streams:
        srows = [r for r in rows if r["stream"] == stream]
        image = stream in IMAGE_STREAMS
        res0 = srows[0]["_res"]
        ss = res0["settings"].get("per_stream", {}).get(stream, {"n_tasks": res0["settings"]["n_tasks"],
                                                                 "samples_per_task": res0["settings"]["samples_per_task"]})
        devices = list(dict.fromkeys(r["device"] for r in srows))
        methods = list(dict.fromkeys(r["method"] for r in srows))
        unit = "ms per batch (steady)" if image else "training time, s"
        out.append(f"**{stream}**, {ss['n_tasks']} task(s) x {ss['samples_per_task']} samples, batch "
                   f"{res0['settings']['batch_size']}: {unit}" + (" (random-pixel files; ACC not meaningful)" if image else ""))
        out.append("")
        head = ["method"] + [f"{d.upper() if d == 'cpu' else 'GPU'}" for d in devices]
        if "cpu" in devices and "cuda" in devices:
            head.append("GPU speed-up")
        if not image:
            head += [f"ACC {d.upper() if d == 'cpu' else 'GPU'}" for d in devices]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" + "--:|" * (len(head) - 1))
        for m in methods:
            cells, vals, accs = [m], {}, []
            for d in devices:
                r = _headline(srows, m, d, auto)
                if r is None:
                    cells.append("-")
                    accs.append("-")
                    continue
                v = (r.get("ms_per_batch_steady") or r["ms_per_batch"]) if image else r["train_time_s"]
                vals[d] = v
                tag = "" if m != "emcl" else f" ({r['backend']}{', graph' if r.get('graph') else ''})"
                cells.append(f"{_num(v)}{tag}")
                accs.append(_fmt(r.get("acc")))
            if "cpu" in devices and "cuda" in devices:
                cells.append(f"{vals['cpu'] / vals['cuda']:.1f}x" if "cpu" in vals and "cuda" in vals else "-")
            if not image:
                cells += accs
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out.append("<details><summary>every row</summary>\n")
        out.append("| device | method (backend) | train s | ms/batch | steady ms/batch | ACC | BWT |")
        out.append("|---|---|--:|--:|--:|--:|--:|")
        for r in srows:
            out.append(f"| {r['device']} | {r['label']} | {r['train_time_s']:.2f} | {r['ms_per_batch']:.2f} | "
                       f"{_fmt(r.get('ms_per_batch_steady'))} | {'-' if image else _fmt(r.get('acc'))} | "
                       f"{'-' if image else _fmt(r.get('bwt'))} |")
        out.append("\n</details>\n")
    out.append("From " + "; ".join(sources) + ".")
    for n in dict.fromkeys(notes):
        out.append(f"Note: {n}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------------------------

def plot(result: dict, path: str) -> None:
    """Training time (image streams: steady ms per batch) per method / backend and device as
    horizontal bars on a log scale, one panel per stream (the paper's Figure 2 shape)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    streams = list(dict.fromkeys(r.get("stream", result["settings"]["stream"]) for r in summary))
    heights = [sum(1 for r in summary if r.get("stream", streams[0]) == s) for s in streams]
    fig, axes = plt.subplots(len(streams), 1, figsize=(7.5, 0.42 * sum(heights) + 1.6 * len(streams)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    colors = {"cpu": "C7", "cuda": "C2"}
    for ax, stream in zip(axes[:, 0], streams):
        rows = [r for r in summary if r.get("stream", stream) == stream]
        image = stream in IMAGE_STREAMS
        vals = [(r.get("ms_per_batch_steady") or r["ms_per_batch"]) if image else r["train_time_s"] for r in rows]
        ys = list(range(len(rows)))
        ax.barh(ys, vals, color=[colors.get(r.get("device", "cpu"), "C0") for r in rows],
                edgecolor=["C0" if r["method"] == "emcl" else "none" for r in rows], linewidth=1.5)
        for y, v in zip(ys, vals):
            ax.text(v, y, f"  {_num(v)}", va="center", fontsize=8)
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{r['label']} [{r.get('device', 'cpu')}]" for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per batch (steady)" if image else "training time, s (evaluation excluded)")
        ss = result["settings"].get("per_stream", {}).get(stream, {})
        ax.set_title(f"{stream}, {ss.get('n_tasks', '?')} task(s) x {ss.get('samples_per_task', '?')} samples "
                     f"(grey: CPU, green: GPU)", fontsize=9)
        ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The held-out rows, timed like for like
# ---------------------------------------------------------------------------------------------

# the rows timed by --heldout, in the tables' order: each method's headline row, then the rows
# that vary the visits per sample (emcl_continual.reports.tables: "headline" and "visits")
HELDOUT_ROWS = ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml/own-script", "lamaml", "emcl",
                "emcl/glances=2", "emcl/glances=5", "lamaml/glances=1")
HELDOUT_SAMPLES = 2000  # incoming samples timed per stream (2 tasks of 1,000; 10 of 200)


def heldout_rows(folder: str, names=None) -> list:
    """The report rows of one stream's held-out folder (``plan.json``) to time: ``names``
    (default :data:`HELDOUT_ROWS`) that the plan holds, each as a dict with ``name``, ``method``
    and ``overrides`` exactly as the sweep ran them. A row whose full configuration equals an
    earlier one's (La-MAML selected at its own script's values) is timed once: it is listed
    in that row's ``same_as``."""
    from emcl_continual.training.config import build_config

    path = os.path.join(folder, "plan.json")
    if not os.path.exists(path):
        raise SystemExit(f"--heldout: no {path} (a folder written by python -m emcl_continual.selection)")
    with open(path) as f:
        plan = json.load(f)
    by_name = {r["name"]: r for r in plan["rows"] if r["role"] == "report"}
    unknown = [n for n in (names or ()) if n not in by_name]
    if unknown:
        raise SystemExit(f"--rows: {unknown} are not report rows of {path}")
    out, seen = [], {}
    for name in (names or HELDOUT_ROWS):
        row = by_name.get(name)
        if row is None:
            continue
        key = json.dumps(build_config(row["method"], plan["stream"], 0, row["overrides"]), sort_keys=True)
        if key in seen:
            seen[key]["same_as"].append(name)
            continue
        entry = {"name": name, "method": row["method"], "overrides": dict(row["overrides"]), "same_as": []}
        seen[key] = entry
        out.append(entry)
    return out


def run_heldout(args, argv, train, get_method, make_stream) -> dict:
    """Every row of :func:`heldout_rows` on each stream's first tasks (``--heldout-samples``
    incoming samples, whole tasks), seed = the stream's first report seed, on the CPU:

    1. one counted pass per row (``CostCounter``; it also warms the row up);
    2. ``--rounds`` timed rounds, each running every (stream, row) once, in the same order on
       even rounds and reversed on odd ones, so that a change of the machine's load falls on
       every row alike.

    Writes the records (each with the load average when it ended), the counts, a summary
    (median, min and max over the rounds) and the machine to ``--out-dir/--name.json``."""
    if args.device != "cpu":
        raise SystemExit("--heldout times the CPU (--device cpu): the held-out sweeps ran there")
    device = torch.device("cpu")
    result = harness.head("training", argv, schema="emcl-kernels/bench_training/heldout/1",
                          note=args.note)
    result["machine"]["nice"] = os.nice(0)
    load_before = common.load_average()
    started = time.perf_counter()
    plan, streams, per_stream = [], {}, {}
    for name in args.streams:
        folder = os.path.join(args.heldout, name)
        with open(os.path.join(folder, "plan.json")) as f:
            p = json.load(f)
        seed = int(p["report_seeds"][0])
        stream = make_stream(name, seed, data_root=p.get("data_root"), n_tasks=p.get("n_tasks"),
                             samples_per_task=p.get("samples_per_task"))
        per_task = len(stream.train[0])
        if args.heldout_samples % per_task:
            raise SystemExit(f"--heldout-samples {args.heldout_samples} is not a whole number of "
                             f"{name}'s tasks of {per_task} samples")
        n_tasks = args.heldout_samples // per_task
        if n_tasks > stream.info.n_tasks:
            raise SystemExit(f"--heldout-samples {args.heldout_samples}: {name} has only "
                             f"{stream.info.n_tasks * per_task} samples")
        streams[name] = stream
        per_stream[name] = {"seed": seed, "n_tasks_timed": n_tasks, "n_tasks_stream": stream.info.n_tasks,
                            "samples_per_task": per_task, "data_source": stream.info.source,
                            "folder": os.path.relpath(folder, common.REPO) if os.path.isabs(folder) else folder}
        plan += [(name, row) for row in heldout_rows(folder, args.rows)]

    counts = {}
    for name, row in plan:
        ps = per_stream[name]
        r = run_prefix(train, get_method, row["method"], row["overrides"], streams[name], ps["seed"],
                       ps["n_tasks_timed"], args.batch_size, device, count=True)
        counts[(name, row["name"])] = r["counts"]
        c = r["counts"]
        print(f"{name:<18} {row['name']:<18} counted: {c['forward_per_sample']:.1f} forward, "
              f"{c['backward_per_sample']:.1f} backward, {c['updates_per_sample']:.2f} updates per sample",
              flush=True)

    records = []
    for rnd in range(args.rounds):
        order = plan if rnd % 2 == 0 else plan[::-1]
        for pos, (name, row) in enumerate(order):
            ps = per_stream[name]
            r = run_prefix(train, get_method, row["method"], row["overrides"], streams[name], ps["seed"],
                           ps["n_tasks_timed"], args.batch_size, device)
            rec = {"stream": name, "row": row["name"], "method": row["method"], "round": rnd, "position": pos,
                   "train_time_s": r["train_time_s"], "cpu_time_s": r["cpu_time_s"],
                   "incoming_samples": r["incoming_samples"],
                   "load_average": common.load_average()}
            records.append(rec)
            print(f"round {rnd + 1}/{args.rounds} {name:<18} {row['name']:<18} "
                  f"{r['train_time_s']:.2f} s, cpu {r['cpu_time_s']:.2f} s (load {rec['load_average'][0] if rec['load_average'] else '?'})",
                  flush=True)

    summary = []
    for name, row in plan:
        mine = [r for r in records if r["stream"] == name and r["row"] == row["name"]]
        times = [r["train_time_s"] for r in mine]
        cpus = [r["cpu_time_s"] for r in mine]
        n = per_stream[name]["n_tasks_timed"] * per_stream[name]["samples_per_task"]
        med = statistics.median(times)
        summary.append({"stream": name, "row": row["name"], "same_as": row["same_as"], "method": row["method"],
                        "overrides": row["overrides"], "rounds": len(times),
                        "train_time_s_median": med, "train_time_s_min": min(times),
                        "train_time_s_max": max(times), "train_times_s": times,
                        "cpu_time_s_median": statistics.median(cpus), "cpu_times_s": cpus,
                        "ms_per_sample": 1e3 * med / n, "cpu_ms_per_sample": 1e3 * statistics.median(cpus) / n,
                        "counts": counts[(name, row["name"])]})
    result["machine"].update(load_average_before=load_before,
                             load_average_after=common.load_average())
    result.update({
        "settings": {"heldout": args.heldout, "streams": list(args.streams), "rounds": args.rounds,
                     "incoming_samples": args.heldout_samples, "batch_size": args.batch_size,
                     "threads": torch.get_num_threads(), "device": "cpu", "per_stream": per_stream,
                     "order": "every (stream, row) once per round; odd rounds reversed",
                     "counted": "one pass per row before the timed rounds (CostCounter), not timed"},
        "records": records,
        "summary": summary,
        "wall_time_s": time.perf_counter() - started,
    })
    harness.finish(result, args.out, args.name or f"heldout_{common.utc_stamp()}_cpu")
    print(f"wall time {result['wall_time_s']:.1f} s; load {load_before} -> "
          f"{result['machine']['load_average_after']}")
    return result


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = harness.parser("training", __doc__, "threads", "out", "name", "note", "quick", "plot",
                       threads=1, quick="2 tasks x 50 samples; 3 image batches")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (the CPU, and the GPU if any)")
    p.add_argument("--streams", "--stream", dest="streams", nargs="+", default=["permuted-mnist"],
                   help="streams to time (default permuted-mnist)")
    p.add_argument("--n-tasks", type=int, default=None, help="permutation streams: default 5 (quick 2)")
    p.add_argument("--samples-per-task", type=int, default=None,
                   help="permutation streams: default 200 (quick 50)")
    p.add_argument("--image-batches", type=int, default=None,
                   help="image streams: batches of one task, each timed alone (default 8, quick 3)")
    p.add_argument("--image-methods", nargs="+", default=None,
                   help=f"methods timed on the image streams (default {' '.join(IMAGE_METHODS)})")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--methods", nargs="+", default=None,
                   help="default: emcl and every baseline whose module is present")
    p.add_argument("--backends", nargs="+", default=None,
                   help="EMCL backends (default: every one available on the device; 'auto': the one "
                        "FusedEMCLOptimizer picks there, as python -m emcl_continual runs)")
    p.add_argument("--emcl-graph", choices=("on", "off", "both"), default="both",
                   help="on a GPU: EMCL's glances from CUDA graphs (on), eagerly (off) or both")
    p.add_argument("--cpu-triton", action="store_true", help="also time interpreted Triton on CPU")
    p.add_argument("--data-root", default=None,
                   help="data sets on disk (see emcl_continual); without it the image streams' "
                        "files are generated (random pixels)")
    p.add_argument("--heldout", metavar="DIR", default=None,
                   help="time the held-out report rows of DIR/STREAM/plan.json (e.g. results/heldout) "
                        "like for like: counted pass, then interleaved rounds (see run_heldout)")
    p.add_argument("--rows", nargs="+", default=None,
                   help=f"--heldout: the rows to time (default {' '.join(HELDOUT_ROWS)})")
    p.add_argument("--rounds", type=int, default=3, help="--heldout: timed rounds (default 3)")
    p.add_argument("--heldout-samples", type=int, default=HELDOUT_SAMPLES,
                   help=f"--heldout: incoming samples per stream, whole tasks (default {HELDOUT_SAMPLES})")
    p.add_argument("--table", nargs="+", metavar="RESULTS_JSON", default=None,
                   help="print the README tables from these results files and exit")
    return p


def main(argv: Optional[list] = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.table:
        results = []
        for path in args.table:
            with open(path) as f:
                res = json.load(f)
            res["_path"] = common.relative(path)
            results.append(res)
        text = readme_tables(results)
        print(text)
        return {"table": text}
    devices, device_note = devices_for(args.device)
    if args.cpu_triton:
        if any(d.type != "cpu" for d in devices):
            raise SystemExit("--cpu-triton runs Triton through its interpreter; use it with --device cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton backend is imported
    train, METHODS, get_method, STREAMS, make_stream = _import_continual()
    for stream in args.streams:
        if stream not in STREAMS:
            raise SystemExit(f"unknown stream {stream!r}; choose one of {', '.join(STREAMS)}")
    if args.heldout:
        if args.rounds < 1 or args.heldout_samples < 1:
            raise SystemExit("--rounds and --heldout-samples must be >= 1")
        with harness.threads(args.threads):
            return run_heldout(args, argv, train, get_method, make_stream)
    if device_note:
        print(device_note, flush=True)
    with harness.threads(args.threads or None):
        return _main(args, argv, train, METHODS, get_method, make_stream, devices, device_note)


def _methods(args, METHODS, get_method) -> tuple[list, dict]:
    present, skipped_methods = available_methods(METHODS, get_method)
    if args.methods:
        unknown = [m for m in args.methods if m not in METHODS]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}; registered: {', '.join(METHODS)}")
        missing = [m for m in args.methods if m not in present]
        if missing:
            raise SystemExit("method(s) not present: " +
                             "; ".join(f"{m}: {skipped_methods[m]}" for m in missing))
        skipped_methods = {m: "not asked for (--methods)" for m in present if m not in args.methods}
        return list(args.methods), skipped_methods
    return present, skipped_methods


def _main(args, argv, train, METHODS, get_method, make_stream, devices, device_note) -> dict:
    from emcl_kernels.backends import auto_backend

    methods, skipped_methods = _methods(args, METHODS, get_method)
    image_methods = list(args.image_methods or [m for m in IMAGE_METHODS if m in methods])
    bad = [m for m in image_methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown --image-methods {bad}; registered: {', '.join(METHODS)}")
    n_tasks = args.n_tasks or (2 if args.quick else 5)
    per_task = args.samples_per_task or (50 if args.quick else 200)
    image_batches = args.image_batches or (3 if args.quick else 8)
    notes = [device_note] if device_note else []

    plans, skipped_backends = {}, {}
    for device in devices:
        only = None if not args.backends else \
            list(dict.fromkeys(auto_backend(device) if b == "auto" else b for b in args.backends))
        backends, skipped = common.backends_for(device, include_cpu_triton=args.cpu_triton, only=only)
        if "emcl" in methods and not backends:
            raise SystemExit(f"no EMCL backend available on {device}: {skipped}")
        for name, why in skipped.items():
            skipped_backends[f"{name} on {device.type}" if len(devices) > 1 else name] = why
        plans[device.type] = backends

    tmp = None
    # the head before the runs: its machine's load average is the one at the start
    result = harness.head("training", argv, schema="emcl-kernels/bench_training/2", note=args.note)
    started = time.perf_counter()
    records, per_stream = [], {}
    try:
        for stream_name in args.streams:
            image = stream_name in IMAGE_STREAMS
            root = args.data_root
            source_note = None
            if image and root is None:
                tmp = tmp or tempfile.TemporaryDirectory(prefix="emcl_bench_images_")
                root = tmp.name
                source_note = write_image_files(root, stream_name, image_batches * args.batch_size)
            st_tasks = 1 if image else n_tasks
            st_per_task = image_batches * args.batch_size if image else per_task
            per_stream[stream_name] = {"n_tasks": st_tasks, "samples_per_task": st_per_task,
                                       "timing": "per batch" if image else "train.run",
                                       "data_source": source_note}
            stream_methods = image_methods if image else methods
            for seed in args.seeds:
                stream = make_stream(stream_name, seed, data_root=root, n_tasks=st_tasks,
                                     samples_per_task=st_per_task)
                per_stream[stream_name]["data_source"] = source_note or stream.info.source
                warm = make_stream(stream_name, seed, data_root=root, n_tasks=1,
                                   samples_per_task=2 * args.batch_size)
                n_batches = stream.n_batches(args.batch_size)
                for device in devices:
                    backends = plans[device.type]
                    if image and not args.backends:  # the image streams: EMCL's default backend only
                        backends = [auto_backend(device)]
                    for method, backend in plan_runs(stream_methods, backends):
                        graphs = graph_modes(device, args.emcl_graph) if method == "emcl" else [None]
                        for graph in graphs:
                            rec = _one_run(train, get_method, method, backend, graph, stream, warm, seed,
                                           device, args, n_batches, image, first=seed == args.seeds[0])
                            rec["samples_per_task"] = st_per_task
                            records.append(rec)
                            steady = rec.get("ms_per_batch_steady")
                            print(f"{stream_name:<18} {device.type:<4} {rec['label']:<26} seed {seed}: "
                                  f"train {rec['train_time_s']:.2f} s ({rec['ms_per_batch']:.2f} ms/batch"
                                  + (f", steady {steady:.2f}" if steady is not None else "")
                                  + (f"), ACC {rec['acc']:.2f}" if rec["acc"] is not None else ")"), flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()

    first = args.streams[0]
    device_names = {d.type: common.device_name(d) for d in devices}
    result["machine"]["load_average_at_end"] = common.load_average()
    result.update({
        "device_name": device_names[devices[0].type],
        "device_names": device_names,
        "auto_backend": {d.type: auto_backend(d) for d in devices},
        "notes": notes,
        "settings": {"stream": first, "streams": list(args.streams),
                     "n_tasks": per_stream[first]["n_tasks"],
                     "samples_per_task": per_stream[first]["samples_per_task"], "per_stream": per_stream,
                     "batch_size": args.batch_size, "seeds": args.seeds,
                     "device": devices[0].type if len(devices) == 1 else "auto",
                     "devices": [d.type for d in devices], "emcl_graph": args.emcl_graph,
                     "image_batches": image_batches, "steady_skip": STEADY_SKIP,
                     "threads": torch.get_num_threads(), "mode": "quick" if args.quick else "full"},
        "skipped_methods": skipped_methods,
        "skipped_backends": skipped_backends,
        "records": records,
        "summary": summarize(records),
        "wall_time_s": time.perf_counter() - started,
    })
    stem = args.name or f"training_{common.utc_stamp()}_{'-'.join(d.type for d in devices)}"
    return harness.finish(result, args.out, stem, plot=plot, no_plot=args.no_plot,
                          table=format_table)


def _one_run(train, get_method, method, backend, graph, stream, warm, seed, device, args, n_batches,
             image, first) -> dict:
    overrides = {}
    if backend is not None:
        overrides["backend"] = backend
    if graph is not None:
        overrides["cuda_graph"] = graph
    rec = {"method": method, "backend": backend, "graph": graph, "label": label(method, backend, graph),
           "seed": seed, "stream": stream.info.name, "n_tasks": stream.info.n_tasks,
           "batch_size": args.batch_size, "n_batches": n_batches, "device": device.type,
           "data_source": stream.info.source}
    if first:  # lazy imports, compilation, allocator and cuDNN warm-up
        train.run(method, warm, seed, overrides=overrides, batch_size=args.batch_size, device=device,
                  progress=False)
    t0 = time.perf_counter()
    if image:
        secs = time_batches(train, get_method, method, stream, seed, overrides, device, args.batch_size)
        steady = secs[STEADY_SKIP:] if len(secs) > STEADY_SKIP else secs[-1:]
        rec.update(train_time_s=sum(secs), eval_time_s=None, n_batches=len(secs),
                   ms_per_batch=1e3 * sum(secs) / len(secs),
                   ms_per_batch_steady=1e3 * statistics.median(steady),
                   batch_ms=[round(1e3 * s, 3) for s in secs], acc=None, bwt=None)
    else:
        r = train.run(method, stream, seed, overrides=overrides, batch_size=args.batch_size, device=device,
                      progress=False)
        rec.update(train_time_s=r["train_time_s"], eval_time_s=r["eval_time_s"],
                   ms_per_batch=1e3 * r["train_time_s"] / max(1, n_batches), ms_per_batch_steady=None,
                   acc=r["acc"], bwt=r["bwt"])
    rec["wall_time_s"] = time.perf_counter() - t0
    return rec
