"""End-to-end benchmark: wall time of continual-learning training per method, backend and device
(the shape of the paper's Figure 2) on the CPU and on a GPU, and the held-out report rows of the
results tables timed like for like (``--heldout``).

    python -m benchmarks training --device auto        # CPU, and the GPU when there is one
    python -m benchmarks training --table benchmarks/results/training_*.json   # the tables again

Every run trains as ``emcl_continual.training.train.run`` does: through ``train.run`` itself
(ACC, BWT) or :func:`run_prefix` (a stream's first tasks, each call timed, CPU time, counts).
The modes, the streams, the fields and the outputs: benchmarks/README.md, ``training``.
"""
from __future__ import annotations

import json
import os
import statistics
import time

from benchmarks import common, harness  # (puts the repository on sys.path)

import torch

SCHEMA = "emcl-kernels/bench_training/2"
IMAGE_STREAMS = ("split-cifar100", "split-miniimagenet")
# image streams: methods timed by default (La-MAML's 10 second-order glances and MER's ~2,600
# one-sample steps per batch take minutes per batch of the ResNet on a 2-core CPU)
IMAGE_METHODS = ("emcl", "sgd", "ewc", "agem", "gem", "er")
STEADY_SKIP = 4  # image streams: batches before the steady per-batch median (EMCL's graphs
                 # are captured at the 4th batch: 1 without replay, 2 warm-up, 1 capture)
GRAPH_MODES = {"on": [True], "off": [False], "both": [True, False]}  # --emcl-graph, on a GPU
# the rows timed by --heldout, in the tables' order: each method's headline row, then the rows
# that vary the visits per sample (emcl_continual.reports.tables: "headline" and "visits")
HELDOUT_ROWS = ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml/own-script", "lamaml", "emcl",
                "emcl/glances=2", "emcl/glances=5", "lamaml/glances=1")


def label(method: str, backend: str | None, graph: bool | None = None) -> str:
    tags = [t for t in (backend, None if graph is None else "graph" if graph else "eager") if t]
    return f"{method} ({', '.join(tags)})" if tags else method


def make_stream(name: str, seed: int, root: str | None, n_tasks: int, per_task: int):
    """``name``'s first tasks; an image stream without a data folder ``root``: one task of random
    pixels in its shape, five classes, 10 test images (the time per batch ignores the pixels)."""
    from emcl_continual.data import streams

    if name not in IMAGE_STREAMS or root is not None:
        return streams.make_stream(name, seed, data_root=root, n_tasks=n_tasks, samples_per_task=per_task)
    features, g = 3 * (32 * 32 if name == "split-cifar100" else 84 * 84), torch.Generator().manual_seed(seed)
    train, test = [(torch.rand(n, features, generator=g), torch.arange(n) % 5) for n in (per_task, 10)]
    return streams.stream_from_tasks(name, [train], [test], seed,
                                     source="random pixels in the stream's shape")


# --- The run machinery -------------------------------------------------------------------------

def run_prefix(method: str, overrides: dict, stream, seed: int, n_tasks: int, batch_size: int,
               device: torch.device = torch.device("cpu"), count: bool = False) -> dict:
    """Train ``method`` (its defaults for ``stream`` updated with ``overrides``) on the first
    ``n_tasks`` tasks of the whole ``stream`` (GEM sizes its memory by the number of tasks) as
    ``train.run`` does, without evaluating. Returns ``train_time_s`` (the device synchronized
    around each call), ``cpu_time_s`` (process CPU time of the same calls), ``batch_s`` (each
    ``observe``), ``incoming_samples`` and, with ``count``, the ``CostCounter`` counts (a
    counted run is not a timed one)."""
    from emcl_continual.data.models import build_model
    from emcl_continual.methods import get_method
    from emcl_continual.training.config import RUN_DEFAULTS, build_config
    from emcl_continual.training.cost import CostCounter

    config = build_config(method, stream.info.name, seed, overrides)
    torch.manual_seed(int(seed))
    model = build_model(stream.info, init=config.get("init", RUN_DEFAULTS["init"])).to(device)
    learner = get_method(method)(model, stream.info, config, device)
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

    for t in range(n_tasks):
        timed(learner.begin_task, t)
        for x, y in stream.batches(t, batch_size, device=device):
            batch_s.append(timed(learner.observe, x, y, t))
            samples += x.shape[0]
        timed(learner.end_task, t)
    out = {"train_time_s": sum(wall), "cpu_time_s": sum(cpu), "batch_s": batch_s, "incoming_samples": samples}
    return out if counter is None else dict(out, counts=counter.counts(samples))


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
    if stream.info.name in IMAGE_STREAMS:
        secs = run_prefix(method, overrides, stream, seed, 1, batch_size, device)["batch_s"]
        steady = secs[STEADY_SKIP:] if len(secs) > STEADY_SKIP else secs[-1:]
        rec.update(train_time_s=sum(secs), eval_time_s=None, n_batches=len(secs), acc=None, bwt=None,
                   ms_per_batch=1e3 * statistics.mean(secs), batch_ms=[round(1e3 * s, 3) for s in secs],
                   ms_per_batch_steady=1e3 * statistics.median(steady))
    else:
        r = train.run(method, stream, seed, **kw)
        rec.update(train_time_s=r["train_time_s"], eval_time_s=r["eval_time_s"],
                   ms_per_batch=1e3 * r["train_time_s"] / max(1, rec["n_batches"]),
                   ms_per_batch_steady=None, acc=r["acc"], bwt=r["bwt"])
    print(f"{rec['stream']:<18} {device.type:<4} {rec['label']:<26} seed {seed}: " + ", ".join(
        f"{k} {rec[k]:.2f}" for k in ("train_time_s", "ms_per_batch", "ms_per_batch_steady", "acc")
        if rec[k] is not None), flush=True)
    return rec


# --- Devices: every method and backend on each device ------------------------------------------

def run_devices(args, argv) -> dict:
    from emcl_continual.methods import METHODS
    from emcl_kernels.backends import auto_backend

    devices = [harness.device_of(args.device)] if args.device != "auto" else [torch.device("cpu")] + (
        [torch.device("cuda")] if torch.cuda.is_available() else [])
    notes = [] if args.device != "auto" or len(devices) > 1 else \
        ["--device auto: no GPU here, timing the CPU only"]
    methods = args.methods or list(METHODS)
    n_tasks = args.n_tasks or (2 if args.quick else 5)
    per_task = args.samples_per_task or (50 if args.quick else 200)
    image_batches = args.image_batches or (3 if args.quick else 8)
    plans, skipped_backends = {}, {}
    for device in devices:
        only = [auto_backend(device) if b == "auto" else b for b in args.backends or ()]
        backends, skipped = common.backends_for(device, only=only)
        if "emcl" in methods and not backends:
            raise SystemExit(f"no EMCL backend available on {device}: {skipped}")
        skipped_backends.update({f"{b} on {device.type}" if len(devices) > 1 else b: why
                                 for b, why in skipped.items()})
        plans[device.type] = backends
    # the head before the runs: its machine's load average is the one at the start
    result = harness.head("training", argv, schema=SCHEMA, note=args.note)
    started = time.perf_counter()
    records, per_stream = [], {}
    for name in args.streams:
        image = name in IMAGE_STREAMS
        shape = (1, image_batches * args.batch_size) if image else (n_tasks, per_task)
        for seed in args.seeds:
            stream = make_stream(name, seed, args.data_root, *shape)
            warm = make_stream(name, seed, args.data_root, 1, 2 * args.batch_size)
            per_stream[name] = {"n_tasks": shape[0], "samples_per_task": shape[1],
                                "data_source": stream.info.source}
            for device in devices:
                # the image streams: EMCL's default backend only, unless --backends names some
                backends = [auto_backend(device)] if image and not args.backends else plans[device.type]
                graphs = GRAPH_MODES[args.emcl_graph] if device.type == "cuda" else [None]
                # EMCL once per backend (and graph mode), every other method once
                records += [_one_run(method, backend, graph, stream, warm, seed, device,
                                     args.batch_size, first=seed == args.seeds[0])
                            for method in (IMAGE_METHODS if image and not args.methods else methods)
                            for backend in (backends if method == "emcl" else [None])
                            for graph in (graphs if method == "emcl" else [None])]
    result["machine"]["load_average_at_end"] = common.load_average()
    result.update({
        "device_names": {d.type: common.device_name(d) for d in devices},
        "auto_backend": {d.type: auto_backend(d) for d in devices},
        "notes": notes,
        "settings": {"streams": list(args.streams), "per_stream": per_stream, "batch_size": args.batch_size,
                     "seeds": args.seeds, "device": devices[0].type if len(devices) == 1 else "auto",
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
        groups.setdefault((r["stream"], r["device"], r["label"]), []).append(r)
    out = []
    for rs in groups.values():
        times = [r["train_time_s"] for r in rs]
        out.append({**{k: rs[0][k] for k in ("stream", "device", "method", "backend", "graph", "label")},
                    "seeds": [r["seed"] for r in rs], "train_time_s": statistics.mean(times),
                    "train_time_s_std": statistics.stdev(times) if len(times) > 1 else 0.0,
                    **{k: None if any(r[k] is None for r in rs) else statistics.mean(r[k] for r in rs)
                       for k in ("ms_per_batch", "acc", "bwt", "ms_per_batch_steady")}})
    return out


def _fmt(v):
    return "-" if v is None else f"{v:.2f}"


def _num(v: float) -> str:
    """Three significant digits without exponents: 0.736, 19.8, 456, 3,280."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _headline(rows: list, method: str, device: str, auto: dict) -> dict | None:
    """The row that stands for ``method`` on ``device``: for EMCL the backend ``auto`` picks
    there (what ``python -m emcl_continual`` runs), graphed on a GPU; a baseline's own row."""
    mine = [r for r in rows if r["method"] == method and r["device"] == device]
    if method == "emcl":
        mine = [r for r in mine if r["backend"] == auto.get(device) and r["graph"] in (None, True)]
    return mine[0] if mine else None


# the table of every row: header -> the summary's key (numbers from "train s" on)
EVERY = {"device": "device", "method (backend)": "label", "seeds": "seeds", "train s": "train_time_s",
         "±": "train_time_s_std", "ms/batch": "ms_per_batch", "steady ms/batch": "ms_per_batch_steady",
         "ACC": "acc", "BWT": "bwt"}


def tables(results: list) -> str:
    """Markdown, per stream: every method's time on each device with the GPU's speed-up and ACC,
    then every row; then the source files, notes and EMCL backends not run. Several results
    files (a CPU run and a GPU run) merge."""
    rows, auto, sources, notes = [], {}, [], []
    for res in results:
        rows += [dict(r, _settings=res["settings"]) for r in res["summary"]]
        auto.update(res["auto_backend"])
        m, end = res["machine"], res["machine"].get("load_average_at_end")
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
        what = "training time, s" if not image else "ms per batch (steady)" + (
            " (random pixels; ACC not meaningful)" if "random pixels" in ss["data_source"] else "")
        out += [f"**{stream}**, {ss['n_tasks']} task(s) x {ss['samples_per_task']} samples, batch "
                f"{settings['batch_size']}: {what}", ""]
        head = ["method", *names.values()] + (["GPU speed-up"] if both else []) \
            + ([] if image else [f"ACC {n}" for n in names.values()])
        by_method = []
        for method in dict.fromkeys(r["method"] for r in srows):
            picks = {d: _headline(srows, method, d, auto) for d in names}
            # an image stream's steady ms per batch, else the training time
            vals = {d: r and ((r["ms_per_batch_steady"] or r["ms_per_batch"]) if image else r["train_time_s"])
                    for d, r in picks.items()}
            cells = [method] + ["-" if r is None else _num(vals[d]) + (
                f" ({r['backend']}{', graph' if r['graph'] else ''})" if method == "emcl" else "")
                for d, r in picks.items()]
            if both:
                cells.append(f"{vals['cpu'] / vals['cuda']:.1f}x" if None not in vals.values() else "-")
            by_method.append(cells + ([] if image else [_fmt(r and r["acc"]) for r in picks.values()]))
        every = [[r[k] if i < 3 else _fmt(r[k]) for i, k in enumerate(EVERY.values())] for r in srows]
        out += [harness.table(head, by_method, markdown=True, align="<" + ">" * (len(head) - 1)), "",
                harness.table(list(EVERY), every, markdown=True, align="<<<>>>>>>"), ""]
    out.append("From " + "; ".join(sources) + ".")
    out += list(dict.fromkeys(notes)) + [f"EMCL backend not run: {b}: {why}" for res in results
                                         for b, why in res.get("skipped_backends", {}).items()]
    return "\n".join(out)


# --- The held-out rows, timed like for like ----------------------------------------------------

def heldout_rows(folder: str, names=None) -> tuple:
    """A held-out folder's ``plan.json`` and its report rows ``names`` (default
    :data:`HELDOUT_ROWS`), each a dict of ``name``, ``method``, ``overrides`` and ``same_as``: the
    later rows whose whole configuration is the same (timed once, under every name)."""
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
    seen = {}
    for name in [n for n in (names or HELDOUT_ROWS) if n in by_name]:
        row = by_name[name]
        key = json.dumps(build_config(row["method"], plan["stream"], 0, row["overrides"]), sort_keys=True)
        if key in seen:
            seen[key]["same_as"].append(name)
        else:
            seen[key] = {"name": name, "method": row["method"], "overrides": row["overrides"], "same_as": []}
    return plan, list(seen.values())


def run_heldout(args, argv) -> dict:
    """Every row of :func:`heldout_rows` on each stream's first ``--heldout-samples`` samples:
    one counted pass per row, then ``--rounds`` timed rounds (``harness.interleave``, odd
    rounds reversed)."""
    from emcl_continual.data.streams import make_stream as stream_of

    if args.rounds < 1 or args.heldout_samples < 1:
        raise SystemExit("--rounds and --heldout-samples must be >= 1")
    result = harness.head("training", argv, schema="emcl-kernels/bench_training/heldout/1", note=args.note)
    result["machine"].update(nice=os.nice(0), load_average_before=common.load_average())
    started = time.perf_counter()
    items, streams, per_stream = [], {}, {}
    for name in args.streams:
        folder = os.path.join(args.heldout, name)
        plan, rows = heldout_rows(folder, args.rows)
        seed = int(plan["report_seeds"][0])
        stream = streams[name] = stream_of(name, seed, **{k: plan.get(k) for k in (
            "data_root", "n_tasks", "samples_per_task")})
        per_task = len(stream.train[0])
        n_tasks, rest = divmod(args.heldout_samples, per_task)
        if rest or n_tasks > stream.info.n_tasks:
            raise SystemExit(f"--heldout-samples {args.heldout_samples}: not a whole number of {name}'s "
                             f"tasks of {per_task} samples, at most {stream.info.n_tasks} tasks")
        per_stream[name] = {"seed": seed, "n_tasks_timed": n_tasks, "n_tasks_stream": stream.info.n_tasks,
                            "samples_per_task": per_task, "data_source": stream.info.source,
                            "folder": common.relative(folder)}
        items += [(name, row) for row in rows]

    def run(item, rnd=None):  # rnd None: the counted pass
        name, row = item
        ps = per_stream[name]
        r = run_prefix(row["method"], row["overrides"], streams[name], ps["seed"],
                       ps["n_tasks_timed"], args.batch_size, count=rnd is None)
        if rnd is None:
            print(f"{name:<18} {row['name']:<18} counted, per sample: " + ", ".join(
                f"{r['counts'][k + '_per_sample']:.2f} {k}" for k in ("forward", "backward", "updates")),
                flush=True)
            return r["counts"]
        r["load_average"] = common.load_average()
        print(f"round {rnd + 1}/{args.rounds} {name:<18} {row['name']:<18} {r['train_time_s']:.2f} s, "
              f"cpu {r['cpu_time_s']:.2f} s (load {(r['load_average'] or ['?'])[0]})", flush=True)
        return r

    counts = [run(item) for item in items]
    records = [{"stream": name, "row": row["name"], "method": row["method"], "round": rnd, "position": pos,
                **{k: r[k] for k in ("train_time_s", "cpu_time_s", "incoming_samples", "load_average")}}
               for rnd, pos, (name, row), r in harness.interleave(items, args.rounds, run, reverse=True)]
    summary = []
    for (name, row), c in zip(items, counts):
        mine = [r for r in records if r["stream"] == name and r["row"] == row["name"]]
        times, cpus = [r["train_time_s"] for r in mine], [r["cpu_time_s"] for r in mine]
        med, cpu_med, n = statistics.median(times), statistics.median(cpus), c["incoming_samples"]
        summary.append({"stream": name, "row": row["name"], "same_as": row["same_as"],
                        "method": row["method"], "overrides": row["overrides"], "rounds": len(times),
                        "train_time_s_median": med, "train_time_s_min": min(times),
                        "train_time_s_max": max(times), "cpu_time_s_median": cpu_med, "counts": c,
                        "ms_per_sample": 1e3 * med / n, "cpu_ms_per_sample": 1e3 * cpu_med / n})
    result["machine"]["load_average_after"] = common.load_average()
    result.update({
        "settings": {"heldout": args.heldout, "streams": list(args.streams), "rounds": args.rounds,
                     "incoming_samples": args.heldout_samples, "batch_size": args.batch_size,
                     "threads": torch.get_num_threads(), "device": "cpu", "per_stream": per_stream},
        "records": records,
        "summary": summary,
        "wall_time_s": time.perf_counter() - started,
    })
    return harness.finish(result, args.out, args.name or f"heldout_{common.utc_stamp()}_cpu")


# --- The command line --------------------------------------------------------------------------

def build_parser():
    from emcl_continual.data.streams import STREAMS
    from emcl_continual.methods import METHODS

    p = harness.parser("training", __doc__, "threads", "out", "name", "note", "quick",
                       threads=1, quick="2 tasks x 50 samples; 3 image batches")
    add = p.add_argument
    add("--device", default="cpu", help="cpu (default), cuda, or auto (the CPU, and the GPU if any)")
    add("--streams", nargs="+", choices=list(STREAMS), metavar="STREAM", default=["permuted-mnist"],
        help="of %(choices)s (default permuted-mnist)")
    add("--n-tasks", type=int, help="permutation streams: default 5 (quick 2)")
    add("--samples-per-task", type=int, help="permutation streams: default 200 (quick 50)")
    add("--image-batches", type=int, help="image streams: one task's batches, timed (default 8, quick 3)")
    add("--batch-size", type=int, default=10)
    add("--seeds", nargs="+", type=int, default=[0])
    add("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
        help=f"of %(choices)s; default: emcl and every baseline (image streams: {' '.join(IMAGE_METHODS)})")
    add("--backends", nargs="+", help="EMCL backends (default: every one available on the device; 'auto': "
        "the one FusedEMCLOptimizer picks there, as python -m emcl_continual runs)")
    add("--emcl-graph", choices=list(GRAPH_MODES), default="both",
        help="on a GPU: EMCL's glances from CUDA graphs (on), eagerly (off) or both")
    add("--data-root", default=None, help="data sets on disk; without it image streams are random pixels")
    add("--heldout", metavar="DIR", help="time the held-out report rows of DIR/STREAM/plan.json (e.g. "
        "results/heldout) like for like: a counted pass, then interleaved rounds")
    add("--rows", nargs="+", help=f"--heldout: the rows to time (default {' '.join(HELDOUT_ROWS)})")
    add("--heldout-samples", type=int, default=2000,
        help="--heldout: incoming samples per stream, whole tasks (default %(default)s)")
    add("--rounds", type=int, default=3, help="--heldout: timed rounds (default 3)")
    add("--table", nargs="+", metavar="RESULTS_JSON", help="print these files' tables, merged, and exit")
    return p


def main(argv: list | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.table:  # the tables of results files, merged
        text = tables([dict(res, paths={"json": source})
                       for source, res in harness.load_results(args.table, "training", SCHEMA)])
        print(text)
        return {"table": text}
    if args.heldout and args.device != "cpu":
        raise SystemExit("--heldout times the CPU (--device cpu): the held-out sweeps ran there")
    with harness.threads(args.threads or None):
        return (run_heldout if args.heldout else run_devices)(args, argv)
