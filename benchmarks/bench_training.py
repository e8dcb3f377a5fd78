"""End-to-end benchmark: wall time of continual-learning training per method, backend and device,
the shape of the paper's training-time figure (Figure 2), on the CPU and on a GPU.

    python -m benchmarks training                      # permuted MNIST, 5 tasks x 200, CPU
    python -m benchmarks training --quick              # 2 tasks x 50 samples
    python -m benchmarks training --device auto        # CPU, and the GPU when there is one
    python -m benchmarks training --device auto --streams permuted-mnist split-cifar100 split-miniimagenet
    python -m benchmarks training --table benchmarks/results/training_*.json   # the tables again
    python -m benchmarks training --heldout results/heldout --streams permuted-mnist rotated-mnist \
        many-permutations --out-dir results/efficiency --name controlled_cpu   # the results tables' times
    python -m benchmarks training --anytime --n-tasks 3 --name anytime_cost_cpu  # what --eval-every adds

Three modes on one run machinery (:func:`run_prefix`, ``train.run``, ``harness.interleave``):
every method and EMCL backend on each device (the default), the held-out report rows timed like
for like (``--heldout``) and what anytime evaluation costs (``--anytime``). The runs, the streams
and the outputs: benchmarks/README.md, ``training``.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Optional

from benchmarks import common, harness  # (puts the repository on sys.path)

import torch

IMAGE_STREAMS = ("split-cifar100", "split-miniimagenet")
# image streams: methods timed by default (La-MAML's 10 second-order glances and MER's ~2,600
# one-sample steps per batch take minutes per batch of the ResNet on a 2-core CPU)
IMAGE_METHODS = ("emcl", "sgd", "ewc", "agem", "gem", "er")
STEADY_SKIP = 4  # image streams: batches before the steady per-batch median (EMCL's graphs
                 # are captured at the 4th batch: 1 without replay, 2 warm-up, 1 capture)
# the rows timed by --heldout, in the tables' order: each method's headline row, then the rows
# that vary the visits per sample (emcl_continual.reports.tables: "headline" and "visits")
HELDOUT_ROWS = ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml/own-script", "lamaml", "emcl",
                "emcl/glances=2", "emcl/glances=5", "lamaml/glances=1")
HELDOUT_SAMPLES = 2000  # incoming samples timed per stream (2 tasks of 1,000; 10 of 200)
CPU = torch.device("cpu")


def _check_methods(names: list, option: str) -> list:
    from emcl_continual.methods import METHODS

    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown {option} {unknown}; registered: {', '.join(METHODS)}")
    return list(names)


def plan_runs(methods: list, emcl_backends: list) -> list:
    """(method, backend) pairs: EMCL once per backend, every other method once (backend None)."""
    return [(m, b) for m in methods for b in (emcl_backends if m == "emcl" else [None])]


def graph_modes(device: torch.device, choice: str) -> list:
    """EMCL's ``cuda_graph`` settings to time on ``device``: None (its default) on the CPU;
    on a GPU True (glances replayed from CUDA graphs) and/or False (eager), by ``choice``."""
    if choice not in ("on", "off", "both"):
        raise ValueError(f"--emcl-graph must be on, off or both, got {choice!r}")
    if device.type != "cuda":
        return [None]
    return {"on": [True], "off": [False], "both": [True, False]}[choice]


def label(method: str, backend: Optional[str], graph: Optional[bool] = None) -> str:
    tags = [t for t in (backend, None if graph is None else "graph" if graph else "eager") if t]
    return f"{method} ({', '.join(tags)})" if tags else method


def make_stream(name: str, seed: int, root: Optional[str], n_tasks: int, per_task: int):
    """``name``'s first tasks; an image stream without a data folder ``root``: one task of random
    pixels in the stream's shape (the time per batch does not depend on the pixels)."""
    from emcl_continual.data import streams

    if name not in IMAGE_STREAMS or root is not None:
        return streams.make_stream(name, seed, data_root=root, n_tasks=n_tasks,
                                   samples_per_task=per_task)
    features = 3 * 32 * 32 if name == "split-cifar100" else 3 * 84 * 84
    g = torch.Generator().manual_seed(seed)

    def task(n):  # five classes, as the stream's tasks have
        return torch.rand(n, features, generator=g), torch.arange(n) % 5
    return streams.stream_from_tasks(name, [task(per_task)], [task(10)], seed,
                                     source="random pixels in the stream's shape")


# --- The run machinery -------------------------------------------------------------------------

def run_prefix(method: str, overrides: dict, stream, seed: int, n_tasks: int, batch_size: int,
               device: torch.device = CPU, count: bool = False) -> dict:
    """Train ``method`` (its defaults for ``stream`` updated with ``overrides``) on the first
    ``n_tasks`` tasks of ``stream`` as ``emcl_continual.training.train.run`` does, without
    evaluating; the stream stays whole (GEM sizes its memory by the number of tasks).

    Returns ``train_time_s`` (the device synchronized around each call), ``cpu_time_s``
    (process CPU time over the same calls), ``batch_s`` (each ``observe``), ``incoming_samples``
    and, with ``count``, the ``CostCounter`` counts (a counted run is not a timed one)."""
    from emcl_continual.data.models import build_model
    from emcl_continual.methods import get_method
    from emcl_continual.training.config import RUN_DEFAULTS, build_config
    from emcl_continual.training.cost import CostCounter

    info = stream.info
    if not 1 <= n_tasks <= info.n_tasks:
        raise ValueError(f"n_tasks must be in [1, {info.n_tasks}] for {info.name}, got {n_tasks}")
    config = build_config(method, info.name, seed, overrides)
    torch.manual_seed(int(seed))
    model = build_model(info, init=config.get("init", RUN_DEFAULTS["init"])).to(device)
    learner = get_method(method)(model, info, config, device)
    counter = CostCounter().attach(learner) if count else None
    wall, cpu, batch_s, samples = [], [], [], 0

    def timed(call, *args) -> float:
        common.synchronize(device)
        start, cstart = time.perf_counter(), time.process_time()
        call(*args)
        common.synchronize(device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cstart)
        if counter is not None:
            counter.flush()  # an update the call made after its last forward
        return wall[-1]

    try:
        for t in range(n_tasks):
            timed(learner.begin_task, t)
            for x, y in stream.batches(t, batch_size, device=device):
                batch_s.append(timed(learner.observe, x, y, t))
                samples += x.shape[0]
            timed(learner.end_task, t)
    finally:
        if counter is not None:
            counter.detach()
    out = {"train_time_s": sum(wall), "cpu_time_s": sum(cpu), "batch_s": batch_s,
           "incoming_samples": samples}
    if counter is not None:
        out["counts"] = counter.counts(samples)
    return out


def _one_run(method, backend, graph, stream, warm, seed, device, batch_size, first) -> dict:
    """One timed run: ``train.run`` on a permutation stream (ACC and BWT too), each ``observe``
    of the first task on an image stream; the first seed after a warm-up run on ``warm``."""
    from emcl_continual.training import train

    overrides = {k: v for k, v in (("backend", backend), ("cuda_graph", graph)) if v is not None}
    kw = dict(overrides=overrides, batch_size=batch_size, device=device, progress=False)
    rec = {"method": method, "backend": backend, "graph": graph, "label": label(method, backend, graph),
           "seed": seed, "stream": stream.info.name, "device": device.type,
           "n_batches": stream.n_batches(batch_size)}
    if first:  # lazy imports, compilation, allocator and cuDNN warm-up
        train.run(method, warm, seed, **kw)
    t0 = time.perf_counter()
    if stream.info.name in IMAGE_STREAMS:
        secs = run_prefix(method, overrides, stream, seed, 1, batch_size, device)["batch_s"]
        steady = secs[STEADY_SKIP:] if len(secs) > STEADY_SKIP else secs[-1:]
        rec.update(train_time_s=sum(secs), eval_time_s=None, n_batches=len(secs),
                   ms_per_batch=1e3 * sum(secs) / len(secs),
                   ms_per_batch_steady=1e3 * statistics.median(steady),
                   batch_ms=[round(1e3 * s, 3) for s in secs], acc=None, bwt=None)
    else:
        r = train.run(method, stream, seed, **kw)
        rec.update(train_time_s=r["train_time_s"], eval_time_s=r["eval_time_s"],
                   ms_per_batch=1e3 * r["train_time_s"] / max(1, rec["n_batches"]),
                   ms_per_batch_steady=None, acc=r["acc"], bwt=r["bwt"])
    rec["wall_time_s"] = time.perf_counter() - t0
    return rec


# --- Devices: every method and backend on each device ------------------------------------------

def run_devices(args, argv) -> dict:
    from emcl_continual.methods import METHODS
    from emcl_kernels.backends import auto_backend

    if args.device == "auto":
        devices = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    else:
        devices = [harness.device_of(args.device)]
    note = None
    if args.device == "auto" and len(devices) == 1:
        note = "--device auto: no GPU here, timing the CPU only"
    methods = _check_methods(args.methods or list(METHODS), "--methods")
    image_methods = _check_methods(args.image_methods or [m for m in IMAGE_METHODS if m in methods],
                                   "--image-methods")
    n_tasks = args.n_tasks or (2 if args.quick else 5)
    per_task = args.samples_per_task or (50 if args.quick else 200)
    image_batches = args.image_batches or (3 if args.quick else 8)
    plans, skipped_backends = {}, {}
    for device in devices:
        only = args.backends and list(dict.fromkeys(auto_backend(device) if b == "auto" else b
                                                    for b in args.backends))
        backends, skipped = common.backends_for(device, include_cpu_triton=args.cpu_triton, only=only)
        if "emcl" in methods and not backends:
            raise SystemExit(f"no EMCL backend available on {device}: {skipped}")
        skipped_backends.update({f"{b} on {device.type}" if len(devices) > 1 else b: why
                                 for b, why in skipped.items()})
        plans[device.type] = backends
    if note:
        print(note, flush=True)
    # the head before the runs: its machine's load average is the one at the start
    result = harness.head("training", argv, schema="emcl-kernels/bench_training/2", note=args.note)
    started = time.perf_counter()
    records, per_stream = [], {}
    for name in args.streams:
        image = name in IMAGE_STREAMS
        shape = (1, image_batches * args.batch_size) if image else (n_tasks, per_task)
        for seed in args.seeds:
            stream = make_stream(name, seed, args.data_root, *shape)
            warm = make_stream(name, seed, args.data_root, 1, 2 * args.batch_size)
            per_stream[name] = {"n_tasks": shape[0], "samples_per_task": shape[1],
                                "timing": "per batch" if image else "train.run",
                                "data_source": stream.info.source}
            for device in devices:
                # the image streams: EMCL's default backend only, unless --backends names some
                backends = plans[device.type]
                if image and not args.backends:
                    backends = [auto_backend(device)]
                chosen = image_methods if image else methods
                runs = [(m, b, g) for m, b in plan_runs(chosen, backends)
                        for g in (graph_modes(device, args.emcl_graph) if m == "emcl" else [None])]
                for method, backend, graph in runs:
                    rec = _one_run(method, backend, graph, stream, warm, seed, device,
                                   args.batch_size, first=seed == args.seeds[0])
                    records.append(rec)
                    steady, acc = rec["ms_per_batch_steady"], rec["acc"]
                    print(f"{name:<18} {device.type:<4} {rec['label']:<26} seed {seed}: "
                          f"train {rec['train_time_s']:.2f} s ({rec['ms_per_batch']:.2f} ms/batch"
                          + (f", steady {steady:.2f}" if steady is not None else "")
                          + (f"), ACC {acc:.2f}" if acc is not None else ")"), flush=True)
    result["machine"]["load_average_at_end"] = common.load_average()
    result.update({
        "device_names": {d.type: common.device_name(d) for d in devices},
        "auto_backend": {d.type: auto_backend(d) for d in devices},
        "notes": [note] if note else [],
        "settings": {"streams": list(args.streams), "per_stream": per_stream,
                     "batch_size": args.batch_size, "seeds": args.seeds,
                     "device": devices[0].type if len(devices) == 1 else "auto",
                     "devices": [d.type for d in devices], "emcl_graph": args.emcl_graph,
                     "image_batches": image_batches, "steady_skip": STEADY_SKIP,
                     "threads": torch.get_num_threads(), "mode": "quick" if args.quick else "full"},
        "skipped_backends": skipped_backends,
        "records": records,
        "summary": summarize(records),
        "wall_time_s": time.perf_counter() - started,
    })
    stem = args.name or f"training_{common.utc_stamp()}_{'-'.join(d.type for d in devices)}"
    return harness.finish(result, args.out, stem, table=lambda res: tables([res]))


def summarize(records: list) -> list:
    """Mean and spread of the training time (and ACC / BWT) per (stream, device, method,
    backend, graph), in the order first seen."""
    groups = {}
    for r in records:
        groups.setdefault((r["stream"], r["device"], r["method"], r["backend"], r["graph"]), []).append(r)

    def mean(rs, key):
        values = [r[key] for r in rs]
        return None if None in values else statistics.mean(values)

    out = []
    for (stream, device, method, backend, graph), rs in groups.items():
        times = [r["train_time_s"] for r in rs]
        out.append({"stream": stream, "device": device, "method": method, "backend": backend,
                    "graph": graph, "label": label(method, backend, graph), "seeds": [r["seed"] for r in rs],
                    "train_time_s": statistics.mean(times),
                    "train_time_s_std": statistics.stdev(times) if len(times) > 1 else 0.0,
                    "ms_per_batch": mean(rs, "ms_per_batch"), "acc": mean(rs, "acc"), "bwt": mean(rs, "bwt"),
                    "ms_per_batch_steady": mean(rs, "ms_per_batch_steady")})
    return out


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def _num(v: float) -> str:
    """Three significant digits without exponents: 0.736, 19.8, 456, 3,280."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _headline(rows: list, method: str, device: str, auto: dict) -> Optional[dict]:
    """The row that stands for ``method`` on ``device``: for EMCL the backend ``auto`` picks
    there (what ``python -m emcl_continual`` runs), graphed on a GPU; for a baseline its row."""
    mine = [r for r in rows if r["method"] == method and r["device"] == device]
    if method != "emcl":
        return mine[0] if mine else None
    return next((r for r in mine if r["backend"] == auto.get(device) and r["graph"] in (None, True)), None)


def tables(results: list) -> str:
    """Markdown, per stream: every method's time on each device with the GPU's speed-up and ACC,
    then every row; then the source files, notes and EMCL backends not run. Several results
    files (a CPU run and a GPU run) merge."""
    rows, auto, sources, notes = [], {}, [], []
    for res in results:
        rows += [dict(r, _settings=res["settings"]) for r in res["summary"]]
        auto.update(res["auto_backend"])
        m = res["machine"]
        end = m.get("load_average_at_end")
        sources.append(f"`{res['paths']['json']}`: "
                       + ", ".join(f"{d}: {n}" for d, n in res["device_names"].items())
                       + f"; torch {m['torch']}, {m['torch_threads']} CPU thread(s), load average at start "
                       f"{m.get('load_average_at_start')}" + (f", at end {end}" if end else "")
                       + f", commit {m.get('git_commit')}, created {res.get('created_utc')}")
        notes += [f"Note: {n}" for n in res.get("notes", [])]
    out = []
    for stream in dict.fromkeys(r["stream"] for r in rows):
        srows = [r for r in rows if r["stream"] == stream]
        image = stream in IMAGE_STREAMS
        settings = srows[0]["_settings"]
        ss = settings["per_stream"][stream]
        names = {d: "CPU" if d == "cpu" else "GPU" for d in dict.fromkeys(r["device"] for r in srows)}
        both = set(names) == {"cpu", "cuda"}
        what = "training time, s"
        if image:
            what = "ms per batch (steady)"
            if "random pixels" in ss["data_source"]:
                what += " (random pixels; ACC not meaningful)"
        out += [f"**{stream}**, {ss['n_tasks']} task(s) x {ss['samples_per_task']} samples, batch "
                f"{settings['batch_size']}: {what}", ""]
        head = ["method", *names.values()] + (["GPU speed-up"] if both else []) \
            + ([] if image else [f"ACC {n}" for n in names.values()])
        by_method = []
        for method in dict.fromkeys(r["method"] for r in srows):
            cells, vals, accs = [method], dict.fromkeys(names), []
            for d in names:
                r = _headline(srows, method, d, auto)
                if r is not None:  # an image stream's steady ms per batch, else the training time
                    steady = r["ms_per_batch_steady"] or r["ms_per_batch"]
                    vals[d] = steady if image else r["train_time_s"]
                tag = f" ({r['backend']}{', graph' if r['graph'] else ''})" if r and method == "emcl" else ""
                cells.append("-" if r is None else _num(vals[d]) + tag)
                accs.append(_fmt(r and r["acc"]))
            if both:
                cells.append(f"{vals['cpu'] / vals['cuda']:.1f}x" if None not in vals.values() else "-")
            by_method.append(cells + ([] if image else accs))
        every = [[r["device"], r["label"], r["seeds"]]
                 + [_fmt(r[k]) for k in ("train_time_s", "train_time_s_std", "ms_per_batch",
                                         "ms_per_batch_steady", "acc", "bwt")] for r in srows]
        every_head = ["device", "method (backend)", "seeds", "train s", "±", "ms/batch", "steady ms/batch",
                      "ACC", "BWT"]
        out += [harness.table(head, by_method, markdown=True, align="<" + ">" * (len(head) - 1)), "",
                harness.table(every_head, every, markdown=True, align="<<<>>>>>>"), ""]
    out.append("From " + "; ".join(sources) + ".")
    out += list(dict.fromkeys(notes)) + [f"EMCL backend not run: {b}: {why}" for res in results
                                         for b, why in res.get("skipped_backends", {}).items()]
    return "\n".join(out)


# --- The held-out rows, timed like for like ----------------------------------------------------

def heldout_rows(folder: str, names=None) -> list:
    """The report rows ``names`` (default :data:`HELDOUT_ROWS`) of a held-out folder's
    ``plan.json``, each a dict of ``name``, ``method``, ``overrides`` and ``same_as``: the later
    rows whose whole configuration is the same (timed once, under every name)."""
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
    for name in [n for n in (names or HELDOUT_ROWS) if n in by_name]:
        row = by_name[name]
        key = json.dumps(build_config(row["method"], plan["stream"], 0, row["overrides"]), sort_keys=True)
        if key in seen:
            seen[key]["same_as"].append(name)
            continue
        seen[key] = {"name": name, "method": row["method"], "overrides": dict(row["overrides"]), "same_as": []}
        out.append(seen[key])
    return out


def run_heldout(args, argv) -> dict:
    """Every row of :func:`heldout_rows` on each stream's first ``--heldout-samples`` samples:
    one counted pass per row, then ``--rounds`` timed rounds (``harness.interleave``, odd
    rounds reversed)."""
    from emcl_continual.data.streams import make_stream as stream_of

    rounds = 3 if args.rounds is None else args.rounds
    if rounds < 1 or args.heldout_samples < 1:
        raise SystemExit("--rounds and --heldout-samples must be >= 1")
    result = harness.head("training", argv, schema="emcl-kernels/bench_training/heldout/1", note=args.note)
    result["machine"]["nice"] = os.nice(0)
    load_before = common.load_average()
    started = time.perf_counter()
    plan, streams, per_stream = [], {}, {}
    for name in args.streams:
        folder = os.path.join(args.heldout, name)
        rows = heldout_rows(folder, args.rows)
        with open(os.path.join(folder, "plan.json")) as f:
            p = json.load(f)
        seed = int(p["report_seeds"][0])
        stream = streams[name] = stream_of(name, seed, data_root=p.get("data_root"),
                                           n_tasks=p.get("n_tasks"),
                                           samples_per_task=p.get("samples_per_task"))
        per_task = len(stream.train[0])
        n_tasks, rest = divmod(args.heldout_samples, per_task)
        if rest:
            raise SystemExit(f"--heldout-samples {args.heldout_samples} is not a whole number of "
                             f"{name}'s tasks of {per_task} samples")
        if n_tasks > stream.info.n_tasks:
            raise SystemExit(f"--heldout-samples {args.heldout_samples}: {name} has only "
                             f"{stream.info.n_tasks * per_task} samples")
        per_stream[name] = {"seed": seed, "n_tasks_timed": n_tasks, "n_tasks_stream": stream.info.n_tasks,
                            "samples_per_task": per_task, "data_source": stream.info.source,
                            "folder": common.relative(folder)}
        plan += [(name, row) for row in rows]

    def run(item, rnd=None, count=False):
        name, row = item
        ps = per_stream[name]
        r = run_prefix(row["method"], row["overrides"], streams[name], ps["seed"],
                       ps["n_tasks_timed"], args.batch_size, count=count)
        if count:
            c = r["counts"]
            print(f"{name:<18} {row['name']:<18} counted: {c['forward_per_sample']:.1f} forward, "
                  f"{c['backward_per_sample']:.1f} backward, {c['updates_per_sample']:.2f} "
                  "updates per sample", flush=True)
            return c
        r["load_average"] = common.load_average()
        print(f"round {rnd + 1}/{rounds} {name:<18} {row['name']:<18} {r['train_time_s']:.2f} s, "
              f"cpu {r['cpu_time_s']:.2f} s (load {(r['load_average'] or ['?'])[0]})", flush=True)
        return r

    counts = {(name, row["name"]): run((name, row), count=True) for name, row in plan}
    records = [{"stream": name, "row": row["name"], "method": row["method"], "round": rnd, "position": pos,
                **{k: r[k] for k in ("train_time_s", "cpu_time_s", "incoming_samples", "load_average")}}
               for rnd, pos, (name, row), r in harness.interleave(plan, rounds, run, reverse=True)]
    summary = []
    for name, row in plan:
        mine = [r for r in records if r["stream"] == name and r["row"] == row["name"]]
        times, cpus = [r["train_time_s"] for r in mine], [r["cpu_time_s"] for r in mine]
        n = per_stream[name]["n_tasks_timed"] * per_stream[name]["samples_per_task"]
        med, cpu_med = statistics.median(times), statistics.median(cpus)
        summary.append({"stream": name, "row": row["name"], "same_as": row["same_as"], "method": row["method"],
                        "overrides": row["overrides"], "rounds": len(times),
                        "train_time_s_median": med, "train_time_s_min": min(times),
                        "train_time_s_max": max(times), "train_times_s": times,
                        "cpu_time_s_median": cpu_med, "cpu_times_s": cpus,
                        "ms_per_sample": 1e3 * med / n, "cpu_ms_per_sample": 1e3 * cpu_med / n,
                        "counts": counts[(name, row["name"])]})
    result["machine"].update(load_average_before=load_before, load_average_after=common.load_average())
    result.update({
        "settings": {"heldout": args.heldout, "streams": list(args.streams), "rounds": rounds,
                     "incoming_samples": args.heldout_samples, "batch_size": args.batch_size,
                     "threads": torch.get_num_threads(), "device": "cpu", "per_stream": per_stream,
                     "order": "every (stream, row) once per round; odd rounds reversed",
                     "counted": "one pass per row before the timed rounds (CostCounter), not timed"},
        "records": records,
        "summary": summary,
        "wall_time_s": time.perf_counter() - started,
    })
    return harness.finish(result, args.out, args.name or f"heldout_{common.utc_stamp()}_cpu")


# --- What anytime evaluation costs -------------------------------------------------------------

def run_anytime(args, argv) -> dict:
    """Per method, the run without anytime evaluation and with the stream's preset in rounds;
    then each ``--whole`` stream's evaluation time (benchmarks/README.md, ``training``)."""
    from emcl_continual.core import presets
    from emcl_continual.data.streams import make_stream as stream_of
    from emcl_continual.methods import METHODS
    from emcl_continual.training import train

    name = args.streams[0]
    if len(args.streams) != 1 or name not in presets.ANYTIME:
        raise SystemExit(f"--anytime times one stream with a preset: {', '.join(presets.ANYTIME)}")
    path = os.path.join(args.anytime, name, "selected.json")
    if not os.path.exists(path):
        raise SystemExit(f"--anytime: no {path} (a folder written by python -m emcl_continual.selection)")
    with open(path) as f:
        selected = {m: dict(d["overrides"]) for m, d in json.load(f)["methods"].items() if m in METHODS}
    selected["lamaml"] = {}
    methods = _check_methods(args.methods or list(METHODS), "--methods")
    n_tasks, seed = args.n_tasks or (2 if args.quick else 5), presets.REPORT_SEEDS[0]
    rounds = 1 if args.rounds is None else args.rounds
    if rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    preset = presets.anytime_preset(name)
    result = harness.head("training", argv, schema="emcl-kernels/bench_training/anytime/1", note=args.note)
    started = time.perf_counter()
    stream = stream_of(name, seed, n_tasks=n_tasks, samples_per_task=args.samples_per_task)

    def once(run, rnd):
        method, mode = run
        kw = dict(eval_every=preset["every"], eval_subset=preset["subset"]) if mode == "on" else {}
        return train.run(method, stream, seed, overrides=selected.get(method, {}), batch_size=args.batch_size,
                         progress=False, **kw)

    rows = []
    for m in methods:
        runs = harness.interleave([(m, "off"), (m, "on")], rounds, once, reverse=True)
        times = {mode: [r["train_time_s"] for _, _, (_, k), r in runs if k == mode] for mode in ("off", "on")}
        evals = [r["anytime_eval_time_s"] for _, _, (_, k), r in runs if k == "on"]
        same = all(r["acc_matrix"] == runs[0][3]["acc_matrix"] for *_, r in runs)
        med = {k: statistics.median_high(v) for k, v in times.items()}
        ev = statistics.median_high(evals)
        rows.append({"method": m, "overrides": selected.get(m, {}), "train_time_s_off": med["off"],
                     "train_time_s_on": med["on"], "anytime_eval_time_s": ev, "eval_over_train": ev / med["off"],
                     "same_accuracy_matrix": bool(same), "rounds": rounds, "all_train_time_s": times,
                     "all_anytime_eval_time_s": evals, "load_avg": common.load_average()})
        print(f"{m:7s} train {med['off']:.2f}s off / {med['on']:.2f}s on, anytime eval {ev:.2f}s "
              f"({100 * ev / med['off']:.0f} % of training), same matrix: {same}", flush=True)
    result.update({"stream": name, "n_tasks": n_tasks, "samples_per_task": len(stream.train[0]), "seed": seed,
                   "rounds": rounds, "anytime": preset, "per_method": rows, "whole_stream": []})
    for whole_name in (args.whole if args.whole is not None else [name]):
        whole_preset = presets.anytime_preset(whole_name)
        whole = stream_of(whole_name, seed, samples_per_task=args.samples_per_task)
        res = train.run("sgd", whole, seed, batch_size=args.batch_size, progress=False,
                        eval_every=whole_preset["every"], eval_subset=whole_preset["subset"])
        w = {"stream": whole_name, "samples": sum(len(td) for td in whole.train),
             "points": len(res["anytime"]["samples"]), "anytime_eval_time_s": res["anytime_eval_time_s"],
             "end_of_task_eval_time_s": res["eval_time_s"], "load_avg": common.load_average(), **whole_preset}
        w["overhead"] = anytime_overhead(w, result)
        result["whole_stream"].append(w)
        print(f"{whole_name}: whole stream ({w['samples']} samples, {w['points']} points): anytime eval "
              f"{w['anytime_eval_time_s']:.1f}s (the end-of-task evaluation: {w['end_of_task_eval_time_s']:.1f}s)",
              flush=True)
    result["wall_s"] = time.perf_counter() - started
    return harness.finish(result, args.out, args.name or f"anytime_{common.utc_stamp()}_cpu",
                          table=anytime_table)


def anytime_overhead(whole: dict, result: dict) -> dict:
    """method -> the whole stream's anytime evaluation time over the method's training time of
    the whole stream, extrapolated per sample from its run of ``result`` (same stream only)."""
    if whole["stream"] != result["stream"]:
        return {}
    prefix = result["n_tasks"] * result["samples_per_task"]
    return {r["method"]: whole["anytime_eval_time_s"] / (r["train_time_s_off"] / prefix * whole["samples"])
            for r in result["per_method"] if r["train_time_s_off"] > 0}


def anytime_table(result: dict) -> str:
    """Markdown: the per-method runs, then each whole stream with its overheads (recomputed)."""
    lines = [f"Per method, {result['n_tasks']} tasks of {result['stream']} (seed {result['seed']}), preset every "
             f"{result['anytime']['every']} samples on {result['anytime']['subset']} images per task; "
             f"median of {result['rounds']} rounds:", "",
             harness.table(["method", "train s (off)", "train s (on)", "anytime eval s", "eval / train", "same matrix"],
                           [[r["method"], _fmt(r["train_time_s_off"]), _fmt(r["train_time_s_on"]),
                             _fmt(r["anytime_eval_time_s"]), f"{100 * r['eval_over_train']:.0f} %",
                             "yes" if r["same_accuracy_matrix"] else "NO"] for r in result["per_method"]],
                           markdown=True, align="<" * 6)]
    for w in result["whole_stream"]:
        lines += ["", f"Whole {w['stream']} ({w['samples']} samples, {w['points']} points): anytime evaluation "
                      f"{w['anytime_eval_time_s']:.1f} s, any method (the end-of-task evaluation: "
                      f"{w['end_of_task_eval_time_s']:.1f} s)."]
        overhead = anytime_overhead(w, result)
        if overhead:
            lines.append("Over each method's whole-stream training time (extrapolated from its run above): "
                         + ", ".join(f"{k} {100 * v:.0f} %" for k, v in sorted(overhead.items())) + ".")
    return "\n".join(lines)


# --- The command line --------------------------------------------------------------------------

def build_parser():
    p = harness.parser("training", __doc__, "threads", "out", "name", "note", "quick",
                       threads=1, quick="2 tasks x 50 samples; 3 image batches")
    add = p.add_argument
    add("--device", default="cpu",
        help="cpu (default), cuda, or auto (the CPU, and the GPU if any)")
    add("--streams", "--stream", dest="streams", nargs="+", default=["permuted-mnist"],
        help="streams to time (default permuted-mnist)")
    add("--n-tasks", type=int, default=None, help="permutation streams: default 5 (quick 2)")
    add("--samples-per-task", type=int, default=None,
        help="permutation streams: default 200 (quick 50; --anytime: the stream's)")
    add("--image-batches", type=int, default=None,
        help="image streams: batches of one task, each timed alone (default 8, quick 3)")
    add("--image-methods", nargs="+", default=None,
        help=f"methods timed on the image streams (default {' '.join(IMAGE_METHODS)})")
    add("--batch-size", type=int, default=10)
    add("--seeds", nargs="+", type=int, default=[0])
    add("--methods", nargs="+", default=None, help="default: emcl and every baseline")
    add("--backends", nargs="+", default=None,
        help="EMCL backends (default: every one available on the device; 'auto': the one "
             "FusedEMCLOptimizer picks there, as python -m emcl_continual runs)")
    add("--emcl-graph", choices=("on", "off", "both"), default="both",
        help="on a GPU: EMCL's glances from CUDA graphs (on), eagerly (off) or both")
    add("--cpu-triton", action="store_true", help="also time interpreted Triton on CPU")
    add("--data-root", default=None,
        help="data sets on disk (see emcl_continual); without it the image streams are "
             "random pixels")
    add("--heldout", metavar="DIR", default=None,
        help="time the held-out report rows of DIR/STREAM/plan.json (e.g. results/heldout) like "
             "for like: a counted pass, then interleaved rounds")
    add("--rows", nargs="+", default=None,
        help=f"--heldout: the rows to time (default {' '.join(HELDOUT_ROWS)})")
    add("--heldout-samples", type=int, default=HELDOUT_SAMPLES,
        help=f"--heldout: incoming samples per stream, whole tasks (default {HELDOUT_SAMPLES})")
    add("--anytime", metavar="DIR", nargs="?", default=None,
        const=os.path.join(common.REPO, "results", "heldout"),
        help="what --eval-every at the stream's preset adds to each method's training, at the "
             "configurations of DIR/STREAM/selected.json (default results/heldout)")
    add("--whole", nargs="*", default=None, metavar="STREAM",
        help="--anytime: streams whose whole-stream evaluation time is measured (default: the "
             "stream; none when given empty)")
    add("--rounds", type=int, default=None,
        help="--heldout, --anytime: timed rounds (default 3 and 1)")
    add("--table", nargs="+", metavar="RESULTS_JSON", default=None,
        help="print the tables of these results files and exit")
    return p


def print_tables(paths: list) -> str:
    """The tables of results files: the training files' merged (:func:`tables`), then each
    anytime file's (:func:`anytime_table`)."""
    training, anytime = [], []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        res["paths"] = {"json": common.relative(path)}
        (anytime if "per_method" in res else training).append(res)
    text = "\n\n".join(([tables(training)] if training else []) + [anytime_table(r) for r in anytime])
    print(text)
    return text


def main(argv: Optional[list] = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.table:
        return {"table": print_tables(args.table)}
    if args.device not in ("cpu", "auto"):
        harness.device_of(args.device)  # the one-line error of a device that is not there
    if args.cpu_triton:
        if args.device != "cpu":
            raise SystemExit("--cpu-triton runs Triton through its interpreter; use it with --device cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton backend is imported
    try:
        from emcl_continual.data.streams import STREAMS
    except ImportError as exc:
        raise SystemExit(
            "bench_training.py needs the emcl_continual package (python/emcl_continual in this "
            f"repository), which could not be imported: {exc}. Run it from a full checkout "
            "(python -m benchmarks training) or install the repository with "
            "`pip install --no-build-isolation -e .`.") from exc
    for stream in args.streams:
        if stream not in STREAMS:
            raise SystemExit(f"unknown stream {stream!r}; choose one of {', '.join(STREAMS)}")
    if args.heldout and args.anytime:
        raise SystemExit("--heldout and --anytime are two modes: give one")
    if (args.heldout or args.anytime) and args.device != "cpu":
        raise SystemExit("--heldout and --anytime time the CPU (--device cpu): the held-out sweeps ran there")
    with harness.threads(args.threads or None):
        mode = run_heldout if args.heldout else run_anytime if args.anytime else run_devices
        return mode(args, argv)
