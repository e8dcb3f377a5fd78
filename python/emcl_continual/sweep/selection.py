"""Held-out selection and the reported sweeps: every choice on validation data, every reported
number from seeds and images no choice ever saw.

    python -m emcl_continual.selection --stream permuted-mnist --jobs 2            # everything, resumable
    python -m emcl_continual.selection --stream permuted-mnist --until select-a    # stop after a stage
    python -m emcl_continual.selection --stream permuted-mnist --plan              # print the plan and what is done
    python -m emcl_continual.selection --stream permuted-mnist --jobs 2 --array auto   # a method's runs as run arrays

The protocol (numbers from :mod:`emcl_continual.core.presets`):

1. ``validate-a``: every method × each of its 4 grid configurations (:data:`presets.GRIDS`, the
   same budget for every method, over the learning-rate hyper-parameters) on the validation
   seeds (:data:`presets.VALIDATION_SEEDS`) with the validation split (images held out of the
   training images, :mod:`emcl_continual.data.streams`); also the 4 (r, lr_max) cells of EMCL's
   "Algorithm 1 as written" (:data:`presets.ALGORITHM_1_GRID`).
2. ``select-a``: per method the configuration with the highest mean validation ACC (ties: the
   first in grid order) -> ``selected.json``.
3. ``validate-b``: on the selected EMCL, the importance-off variant and the 6 normalised-pull
   candidates of :data:`presets.IMPORTANCE_SEARCH`, same validation seeds and split.
4. ``select-b``: the candidate with the highest mean validation ACC, and whether it beats
   importance-off there -> ``selected.json``.
5. ``report``: on the report seeds (:data:`presets.REPORT_SEEDS`) with the test split: every
   method at its selected configuration, La-MAML at its own script's values (its headline),
   EMCL's variants (:data:`presets.EMCL_VARIANTS`: controls, ablations, equal-visit rows), the
   chosen importance candidate and the same pull with h held constant, La-MAML at EMCL's
   visits per batch. Rows are run in order of importance, whole rows at a time.

Runs are stored one JSON object per line in ``OUT/validation.jsonl`` / ``OUT/report.jsonl``
(``OUT`` = ``results/heldout/STREAM``), each with the full run record of
:func:`emcl_continual.training.train.run` (config, data source, split, git commit, code tree, command)
and its ``role``. A run is identified by (method, overrides, seed, split, data root): two rows
with the same configuration share their runs, and a finished run is never run again, so the
command resumes where it stopped. ``OUT/plan.json`` holds every row as run, so that
:mod:`emcl_continual.reports.tables` rebuilds every table from the committed files alone.

One code version: a stage refuses to start on a working tree that differs from its commit
(``dirty``), or when the file already holds runs of another code tree (the hash of the code
directories at the commit, :mod:`emcl_continual.core.provenance`), unless told otherwise; a finished
run whose record names another code tree than this command's is not kept.

Where runs train and what executes them (:mod:`emcl_continual.sweep.executors`): ``--device`` (``cpu``,
``cuda``, ``cuda:N``, ``auto``; per method as ``METHOD=DEVICE``), ``--jobs N`` runs at a time
placed on the host and the GPUs by their free memory (``--gpu-memory-mib`` per run), or
``--executor ray`` (``--ray-address``) with each run a Ray task. Whatever executes the runs, this
process writes the files; a run that fails is reported, appended to ``failed.jsonl`` and run
again when the command is started again (the exit status is then 1). ``--array auto|N|off`` trains a method's runs
together as run arrays (:mod:`emcl_continual.arrays`), an array one task of the executor.

    python -m emcl_continual.selection --stream permuted-mnist --device auto --jobs 16      # one GPU machine
    python -m emcl_continual.selection --stream permuted-mnist --executor ray --ray-address HEAD:6379 --device auto
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..core import presets
from ..core.metrics import mean_std
from ..methods import METHODS

__all__ = ["STAGES", "RUN_STAGES", "Row", "run_key", "load_runs", "validation_rows_a", "validation_rows_b", "select_a",
           "select_b", "report_rows", "run_rows", "RunsFailed", "main"]

STAGES = ("validate-a", "select-a", "validate-b", "select-b", "report")
RUN_STAGES = ("validate-a", "validate-b", "report")
ALL_METHODS = tuple(METHODS)  # the one list of methods, in its order
DEFAULT_OUT = os.path.join("results", "heldout")
# The importance-off row of stage validate-b (the report stage has its own "emcl/importance-off").
VALIDATION_OFF = "emcl/importance-off (validation)"
# Beside the results: one line per run that failed (the command runs it again when started again).
FAILED_FILE = "failed.jsonl"
# One line per run_rows call that ran something: how long it took and on what (its wall clock is the
# sweep's cost on that machine; a run's own train_time_s is not, since runs overlap).
TIMINGS_FILE = "timings.jsonl"


class Row(dict):
    """One row of a table: ``name``, ``method``, ``overrides`` (the full change of the method's
    defaults that was run), ``role`` ("validation" or "report"), ``what`` (one line), ``seeds``."""

    def __init__(self, name: str, method: str, overrides: dict, role: str, what: str, seeds, **extra):
        super().__init__(name=name, method=method, overrides=_canonical(overrides), role=role, what=what,
                         seeds=[int(s) for s in seeds], **extra)


def _canonical(overrides: dict) -> dict:
    return json.loads(json.dumps(overrides, sort_keys=True))


def run_key(method: str, overrides: dict, seed: int, split: str, data_root: str | None = None) -> str:
    """The identity of one run: two rows with the same configuration share it."""
    return "|".join([method, json.dumps(_canonical(overrides), sort_keys=True), str(int(seed)), split,
                     data_root or "embedded"])


def load_runs(path: str) -> list:
    """The run records of a JSON-lines file (empty when it does not exist; a torn last line from
    an interrupted write is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _resolve(method: str, stream: str, base: dict, extra: dict) -> dict:
    """``base`` updated by ``extra``; the pseudo-key ``lr_scale_times_inv_reg`` becomes lr_scale."""
    from ..training.train import build_config

    ov = dict(base)
    ov.update({k: v for k, v in extra.items() if k != "lr_scale_times_inv_reg"})
    if "lr_scale_times_inv_reg" in extra:
        reg = float(build_config(method, stream, 0, ov)["reg"])
        ov["lr_scale"] = float(extra["lr_scale_times_inv_reg"]) / reg
    return ov


# --------------------------------------------------------------------------- the plan
def validation_rows_a(stream: str, methods=ALL_METHODS) -> list:
    """Stage validate-a: each method's grid, and EMCL's Algorithm-1 cells, on the validation seeds."""
    seeds = presets.VALIDATION_SEEDS
    rows = []
    for m in methods:
        for i, cfg in enumerate(presets.grid(m, stream)):
            rows.append(Row(f"{m}/grid{i}", m, cfg, "validation", f"{m} grid point {i}: {json.dumps(cfg)}", seeds,
                            group=f"grid:{m}", index=i))
    if "emcl" in methods:
        alg1 = presets.EMCL_VARIANTS["algorithm-1"]["overrides"]
        for i, cell in enumerate(presets.ALGORITHM_1_GRID):
            rows.append(Row(f"emcl/algorithm-1/grid{i}", "emcl", dict(alg1, **cell), "validation",
                            f"Algorithm 1 as written, {json.dumps(cell)}", seeds, group="grid:algorithm-1", index=i))
    return rows


def validation_rows_b(stream: str, selected: dict) -> list:
    """Stage validate-b: importance-off and the normalised-pull candidates on the selected EMCL."""
    seeds = presets.VALIDATION_SEEDS
    base = selected["methods"]["emcl"]["overrides"]
    rows = [Row(VALIDATION_OFF, "emcl", _resolve("emcl", stream, base,
                                                        presets.EMCL_VARIANTS["importance-off"]["overrides"]),
                "validation", presets.EMCL_VARIANTS["importance-off"]["what"], seeds, group="importance", index=-1)]
    for i, cand in enumerate(presets.IMPORTANCE_SEARCH):
        rows.append(Row(f"emcl/importance/{cand['importance_norm']}-gamma{cand['gamma']:g}", "emcl",
                        _resolve("emcl", stream, base, cand), "validation",
                        f"pull c = gamma*reg*h/mean(h), mean over {'all parameters' if cand['importance_norm'] == 'global' else 'each tensor'}, gamma = {cand['gamma']:g}",
                        seeds, group="importance", index=i))
    return rows


def _by_key(runs: list) -> dict:
    return {r["key"]: r for r in runs}


def _row_runs(row: dict, runs_by_key: dict, split: str, data_root: str | None) -> list:
    out = []
    for s in row["seeds"]:
        r = runs_by_key.get(run_key(row["method"], row["overrides"], s, split, data_root))
        if r is not None:
            out.append(r)
    return out


def _choose(rows: list, runs_by_key: dict, split: str, data_root) -> dict:
    """The row with the highest mean ACC over all its seeds (ties: the first); every row's score."""
    scores = []
    for row in rows:
        rs = _row_runs(row, runs_by_key, split, data_root)
        if len(rs) != len(row["seeds"]):
            raise RuntimeError(f"row {row['name']} has {len(rs)} of its {len(row['seeds'])} validation runs; "
                               "run the validation stage to the end first")
        mu, sd = mean_std([r["acc"] for r in rs])
        scores.append({"row": row["name"], "overrides": row["overrides"], "acc_mean": mu, "acc_std": sd,
                       "accs": {str(r["seed"]): r["acc"] for r in rs}})
    best = max(range(len(scores)), key=lambda i: (scores[i]["acc_mean"], -i))
    return {"chosen": scores[best], "scores": scores}


def select_a(stream: str, rows: list, runs: list, data_root=None, previous: dict | None = None) -> dict:
    """Per method (and for Algorithm 1) the grid configuration with the best mean validation ACC.

    Groups whose validation runs are not all done are left out (a partial sweep selects what it
    can); decisions in ``previous`` for groups not in ``rows`` are kept.
    """
    by_key = _by_key(runs)
    groups: dict = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    previous = previous or {}
    out = {"stream": stream, "rule": "highest mean ACC over the validation seeds (validation split); ties: first "
                                     "in grid order", "validation_seeds": list(presets.VALIDATION_SEEDS),
           "methods": dict(previous.get("methods", {})), "algorithm-1": previous.get("algorithm-1"),
           "pending": []}
    for group, members in groups.items():
        try:
            decision = _choose(members, by_key, "validation", data_root)
        except RuntimeError:
            out["pending"].append(group)
            continue
        decision["overrides"] = decision["chosen"]["overrides"]
        if group == "grid:algorithm-1":
            out["algorithm-1"] = decision
        else:
            out["methods"][group.split(":", 1)[1]] = decision
    if previous.get("importance") and previous.get("methods", {}).get("emcl") == out["methods"].get("emcl"):
        out["importance"] = previous["importance"]
    return out


def select_b(selected: dict, rows: list, runs: list, data_root=None) -> dict:
    """The importance candidate with the best mean validation ACC, and its paired difference to
    importance-off on the validation seeds."""
    by_key = _by_key(runs)
    off = [r for r in rows if r["name"] == VALIDATION_OFF]
    cands = [r for r in rows if r["name"] != VALIDATION_OFF]
    decision = _choose(cands, by_key, "validation", data_root)
    off_score = _choose(off, by_key, "validation", data_root)["chosen"]
    diffs = [decision["chosen"]["accs"][s] - off_score["accs"][s] for s in decision["chosen"]["accs"]]
    decision["importance_off"] = off_score
    decision["minus_importance_off"] = {"mean": mean_std(diffs)[0], "per_seed": diffs}
    decision["beats_importance_off"] = decision["chosen"]["acc_mean"] > off_score["acc_mean"]
    decision["overrides"] = decision["chosen"]["overrides"]
    out = dict(selected)
    out["importance"] = decision
    return out


def report_rows(stream: str, selected: dict, methods=ALL_METHODS) -> list:
    """The reported rows on the report seeds, most important first."""
    seeds = presets.REPORT_SEEDS
    sel = {m: d["overrides"] for m, d in selected["methods"].items()}
    rows = []

    def add(name, method, overrides, what, **extra):
        rows.append(Row(name, method, overrides, "report", what, seeds, **extra))

    emcl = sel.get("emcl")
    if emcl is not None and "emcl" in methods:
        add("emcl", "emcl", emcl, "EMCL, selected on validation", kind="method")
        for v in ("importance-off", "no-replay"):
            spec = presets.EMCL_VARIANTS.get(v)
            if spec is None:
                continue
            add(f"emcl/{v}", "emcl", _resolve("emcl", stream, emcl, spec["overrides"]), spec["what"], kind="control")
        if selected.get("algorithm-1") and "algorithm-1" in presets.EMCL_VARIANTS:
            spec = presets.EMCL_VARIANTS["algorithm-1"]
            add("emcl/algorithm-1", "emcl", selected["algorithm-1"]["overrides"], spec["what"]
                + f" (r, lr_max chosen on validation: {json.dumps({k: selected['algorithm-1']['overrides'][k] for k in ('lr_scale', 'lr_max')})})",
                kind="control")
    if "lamaml" in methods:
        add("lamaml/own-script", "lamaml", {}, "La-MAML at its own run_experiments.sh values (headline)", kind="method")
    if emcl is not None and "emcl" in methods:
        for v in ("table-ii-beta", "no-inner-replay", "decay=0.5", "lr_scale=0.5/reg"):
            spec = presets.EMCL_VARIANTS.get(v)
            if spec is None:
                continue
            add(f"emcl/{v}", "emcl", _resolve("emcl", stream, emcl, spec["overrides"]), spec["what"], kind="ablation")
        if selected.get("algorithm-1"):
            clip = {k: selected["algorithm-1"]["overrides"][k] for k in ("lr_scale", "lr_max")}
            add("emcl/recurrent", "emcl", dict(emcl, lr_mode="recurrent", **clip),
                "eq. 8's recurrent meta learning rate alone, with Algorithm 1's (r, lr_max) chosen on validation: "
                + json.dumps(clip), kind="ablation")
        imp = selected.get("importance")
        if imp is not None:
            cand = imp["overrides"]
            add("emcl/importance-best", "emcl", cand, "the normalised-pull candidate chosen on validation: "
                + json.dumps({k: cand[k] for k in ("importance_norm", "gamma")}), kind="importance")
            add("emcl/uniform-pull", "emcl", dict(cand, fixed_importance=1e-4, decay=1.0),
                "the same pull with h held constant (c = gamma*reg everywhere): the pull without the importance",
                kind="importance")
    for m in ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml"):
        if m in methods and m in sel:
            if m == "lamaml" and _same_config(m, stream, sel[m], {}):
                continue  # La-MAML's selection is its own script's values: the row above has its runs
            add(m, m, sel[m], f"{m}, selected on validation", kind="method")
    if emcl is not None and "emcl" in methods:
        for v in ("glances=2", "glances=5", "init=xavier"):
            spec = presets.EMCL_VARIANTS.get(v)
            if spec is None:
                continue
            add(f"emcl/{v}", "emcl", _resolve("emcl", stream, emcl, spec["overrides"]), spec["what"], kind="visits"
                if v.startswith("glances") else "ablation")
    if "lamaml" in methods:
        add("lamaml/glances=1", "lamaml", {"glances": 1}, "La-MAML (own script) visiting each batch once, as EMCL",
            kind="visits")
    return rows


def _same_config(method: str, stream: str, a: dict, b: dict) -> bool:
    """Whether two override sets give ``method`` the same configuration on ``stream``."""
    from ..training.train import build_config

    return build_config(method, stream, 0, a) == build_config(method, stream, 0, b)


# --------------------------------------------------------------------------- running
def _check_version(path: str, allow_dirty: bool, allow_mixed: bool) -> dict:
    from ..core.provenance import code_version

    cv = code_version()
    if cv.get("dirty") and not allow_dirty:
        raise SystemExit("error: the working tree differs from its commit outside results/ "
                         f"({', '.join(cv['dirty_paths'][:5])}): commit first, so that every run records the "
                         "code it ran, or pass --allow-dirty for a screen")
    trees = {r.get("provenance", {}).get("code_tree") for r in load_runs(path)} - {None}
    if trees - {cv.get("code_tree")} and not allow_mixed:
        raise SystemExit(f"error: {path} holds runs of code tree(s) {sorted(trees)}, this checkout is "
                         f"{cv.get('code_tree')}: one sweep, one code version. Move the file away to start "
                         "over, or pass --allow-mixed-versions")
    return cv


def _log(msg: str) -> None:
    print(msg, flush=True)


class RunsFailed(Exception):
    """Runs of a stage failed (each reported and in ``failed.jsonl``); the others were kept."""


def _duration(seconds: float) -> str:
    """``seconds`` for a reader: ``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def run_rows(rows: list, path: str, stream: str, split: str, *, jobs: int | None = 1, threads: int = 1,
             data_root: str | None = None, n_tasks: int | None = None, samples_per_task: int | None = None,
             devices: dict | None = None, executor: str = "local", ray_address: str | None = None,
             gpu_memory_mib: float = 1024, runs_per_gpu: int | None = None, eval_every: int | None = None,
             eval_subset: int | None = None, trackers=None, array="off", log=_log) -> list:
    """Run every (row, seed) not in ``path`` yet through the executor (:mod:`emcl_continual.sweep.executors`:
    ``local``, ``jobs`` at a time, or ``ray``), each on the device its method's ``devices`` word
    gives (default cpu), under ``array`` (``off``, ``auto`` or a width: runs of one method trained
    together as one task, :func:`emcl_continual.sweep.executors.make_arrays`), appending each record to
    ``path`` as it finishes (flushed and synced).
    A failed run is logged and appended to ``failed.jsonl`` beside ``path``; the others go on,
    then :class:`RunsFailed` is raised. SIGINT or SIGTERM (a ``timeout`` around the command) stops
    the runs in flight, still writes the stage's timing line (``interrupted``, ``done``) and raises
    :class:`~emcl_continual.core.errors.CommandInterrupted`; the records written are kept and the same
    command runs the rest. ``eval_every`` / ``eval_subset``: each run with anytime evaluation
    (:class:`~emcl_continual.training.anytime.AnytimeEvaluator`; the run key is the same, since the training
    is). ``trackers``: a :class:`~emcl_continual.output.trackers.Trackers` that logs each new record.
    Returns every record of ``path``."""
    from . import executors as sweep
    from ..core.errors import CommandInterrupted, Interrupted
    from ..core.provenance import code_version, command_line
    from ..output.rundir import deferred_interrupts, interrupts

    done = {r["key"] for r in load_runs(path)}
    devices = devices or {}
    command = command_line()
    tasks, seen = [], set()
    for row in rows:
        for seed in row["seeds"]:
            key = run_key(row["method"], row["overrides"], seed, split, data_root)
            if key in done or key in seen:
                continue
            seen.add(key)
            tasks.append({"key": key, "method": row["method"], "overrides": row["overrides"], "seed": seed,
                          "split": split, "stream": stream, "data_root": data_root, "role": row["role"],
                          "row": row["name"], "n_tasks": n_tasks, "samples_per_task": samples_per_task,
                          "command": command, "eval_every": eval_every, "eval_subset": eval_subset})
    if not tasks:
        return load_runs(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    local_gpus = _cuda_count() if executor == "local" and set(devices.values()) - {"cpu"} else 0
    runner = sweep.make_executor(executor, jobs=jobs, threads=threads, address=ray_address,
                                 gpu_need=int(gpu_memory_mib * sweep.MIB), runs_per_gpu=runs_per_gpu,
                                 cuda_count=local_gpus)
    runner.start()  # a Ray cluster says here how many GPUs it has
    try:
        notes = sweep.check_devices({m: devices[m] for m in {t["method"] for t in tasks} if m in devices},
                                    runner.gpu_count(), executor=executor)
        if executor == "ray":  # the local executor's notes came before the first stage
            for note in notes:
                log(f"note: {note}")
        for t in tasks:
            t["want"] = sweep.want_device(t["method"], t["overrides"], stream, devices.get(t["method"], "cpu"),
                                          runner.gpu_count())
    except BaseException:
        runner.close(cancel=True)
        raise
    if eval_every is not None and array not in ("off", None):
        log("note: --eval-every trains every run alone: run arrays do not evaluate during the "
            "stream yet")
        array = "off"
    try:
        units = sweep.make_arrays(tasks, array, stream, log=log)
    except BaseException:
        runner.close(cancel=True)
        raise
    arrays_made = [u for u in units if u.get("runs")]
    on_gpu = sum(t["want"] != "cpu" for t in tasks)
    log(f"{len(tasks)} run(s) to do into {path} ({executor} executor, {runner.slots} at a time"
        + (f"; {on_gpu} on a GPU" if on_gpu else "")
        + (f"; {sum(len(u['runs']) for u in arrays_made)} of them in {len(arrays_made)} array(s)" if arrays_made else "")
        + ")")

    def append(file, rec):
        with deferred_interrupts(), open(file, "a") as fh:     # a line is written whole
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    kept, lost = [], []

    def progress() -> str:
        """``[k/N, ~M min left]``: the runs finished (kept or failed) of this stage's, and
        the time left if the others take what the finished ones took on average."""
        n = len(kept) + len(lost)
        left = (time.perf_counter() - t0) / n * (len(tasks) - n) if n < len(tasks) else 0.0
        return f"[{n}/{len(tasks)}" + (f", ~{_duration(left)} left]" if left else "]")

    def write(rec):
        with deferred_interrupts():        # the line and its count together, or neither
            append(path, rec)
            kept.append(rec["key"])
            log(f"  {time.strftime('%H:%M:%S')} {progress()} {rec['method']:7s} seed {rec['seed']:3d} "
                f"{json.dumps(rec['overrides'], sort_keys=True)[:90]}: ACC {rec['acc']:.2f} "
                f"(train {rec['train_time_s']:.0f}s, wall {rec['wall_time_s']:.0f}s, {rec['device']})")
        if trackers:
            try:
                trackers.log_run(rec)
            except Exception as exc:  # the record is kept; the tracker's failure is said, not fatal
                log(f"  note: the trackers could not log {rec['method']} seed {rec['seed']}: "
                    f"{type(exc).__name__}: {' '.join(str(exc).split())}")

    failed_path = os.path.join(os.path.dirname(os.path.abspath(path)), FAILED_FILE)

    def failed(task, reason, detail):
        with deferred_interrupts():
            append(failed_path, sweep.failure_record(task, reason, detail))
            lost.append(task["key"])
            log(f"  {time.strftime('%H:%M:%S')} {progress()} FAILED {task['method']} seed {task['seed']} "
                f"{json.dumps(task['overrides'], sort_keys=True)[:90]}: {reason}")

    gpus, slots = runner.gpu_count(), runner.slots
    started, load_before, t0 = _utc_now(), _load_average(), time.perf_counter()
    stopped = None
    try:
        with interrupts():
            sweep.execute(units, runner, code_tree=code_version().get("code_tree"),
                          on_record=write, on_failure=failed, log=log)
    except Interrupted as exc:       # the executor has stopped its runs (sweep.execute)
        stopped = exc.name
    wall = time.perf_counter() - t0
    append(os.path.join(os.path.dirname(os.path.abspath(path)), TIMINGS_FILE), {
        "file": os.path.basename(path), "split": split, "rows": sorted({t["row"] for t in tasks}),
        "runs": len(tasks), "done": len(kept), "failed": len(lost), "interrupted": stopped,
        "on_gpu": on_gpu, "wall_s": round(wall, 3),
        "started_utc": started, "finished_utc": _utc_now(), "executor": executor, "slots": slots,
        "threads": threads, "devices": dict(devices), "gpus": gpus, "array": array,
        "arrays": [{"id": u["array_id"], "method": u["method"], "width": len(u["runs"])} for u in arrays_made],
        "load_average_before": load_before, "load_average_after": _load_average(),
        "host": _host(), "commit": code_version().get("commit"), "code_tree": code_version().get("code_tree"),
        "command": command})
    if stopped:
        raise CommandInterrupted(
            f"{stopped} after {wall:.0f} s: {len(kept)} of {len(tasks)} run(s) done and kept in {path} "
            f"(timed in {TIMINGS_FILE}); the same command runs the other {len(tasks) - len(kept)}")
    log(f"{len(kept)} of {len(tasks)} run(s) done in {wall:.0f} s "
        f"({slots} at a time; {TIMINGS_FILE})")
    if lost:
        raise RunsFailed(f"{len(lost)} of {len(tasks)} run(s) failed (each in {failed_path}); the "
                         f"others are in {path}. The same command runs the failed ones again")
    return load_runs(path)


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _load_average() -> list | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _host() -> dict:
    """The machine the sweep ran on: CPU model and count, GPUs by name."""
    from ..core.provenance import processor

    cpu = processor()
    gpus = []
    if _cuda_count():
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu.get("model_name"), "logical_cpus": cpu.get("logical_cpus"), "gpus": gpus}


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --------------------------------------------------------------------------- the command
def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def _download(parser: argparse.ArgumentParser, args) -> None:
    """``--download``: refuse what cannot be done (a usage error, exit 2), then fetch the stream's
    data set into ``--data-root`` once, here, before any worker starts (a failure: exit 1)."""
    from ..core.errors import DownloadError, UsageError
    from ..data.download import check_request, download_for_stream

    try:
        if not args.download:
            raise UsageError("--download-mirror is used only with --download")
        check_request(args.stream, args.data_root, mirror=args.download_mirror)
    except UsageError as exc:
        parser.error(str(exc))
    if args.plan:
        return
    try:
        download_for_stream(args.stream, args.data_root, args.download_mirror, log=_log)
    except DownloadError as exc:
        raise SystemExit(f"error: {' '.join(str(exc).split())}") from None


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emcl_continual.selection", description=__doc__.split("\n\n")[0])
    p.add_argument("--stream", default="permuted-mnist", choices=sorted(presets.GRIDS))
    p.add_argument("--out", default=None, help=f"folder of this stream's files (default {DEFAULT_OUT}/STREAM)")
    p.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=list(ALL_METHODS))
    p.add_argument("--until", default="report", choices=STAGES, help="stop after this stage")
    p.add_argument("--stages", nargs="+", default=list(RUN_STAGES), choices=list(RUN_STAGES),
                   help="the stages that run training (default all); the selections are made whenever their "
                        "runs are all done, so e.g. '--stages validate-a report' skips the importance search")
    p.add_argument("--rows", nargs="+", default=None, help="report stage: run only these rows (names as in --plan), "
                                                           "in this order")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time (local executor: training processes, default 1; ray: runs in flight, "
                        "default the cluster's CPUs over --threads)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads per run: torch's, and the BLAS and OpenMP pools of NumPy and SciPy (a Ray "
                        "task's num_cpus)")
    p.add_argument("--device", nargs="+", default=["cpu"], metavar="[METHOD=]DEVICE",
                   help="where runs train: cpu (default), cuda, cuda:N or auto, for every method or per method "
                        "(e.g. 'cpu emcl=cuda'); auto takes a GPU only for runs measured faster there (EMCL with "
                        "its glances in CUDA graphs) and keeps the rest on host cores")
    p.add_argument("--gpu-memory-mib", type=float, default=1024,
                   help="GPU memory one run is given (MiB); a run starts on a GPU only where this much is free")
    p.add_argument("--runs-per-gpu", type=int, default=None,
                   help="runs sharing one GPU at most (local: default no cap but memory; ray: each GPU run asks "
                        "for 1/K of a GPU, default K=8)")
    p.add_argument("--array", default="off", metavar="auto|N|off",
                   help="train the runs of one method together as arrays of up to N runs (one task of the "
                        "executor each): auto takes the width measured fastest per method and device; off (default) "
                        "trains every run alone. Methods, or configurations (EMCL's variants off its fused path), without an "
                        "array train alone, named when the stage starts")
    p.add_argument("--executor", default="local", choices=["local", "ray"],
                   help="local processes (default) or Ray tasks (pip install -r requirements-ray.txt)")
    p.add_argument("--ray-address", default=None,
                   help="with --executor ray: the cluster to connect to (e.g. 10.0.0.1:6379); default: start a "
                        "local one")
    p.add_argument("--data-root", default=None, help="folder with the data sets (torchvision's layout)")
    p.add_argument("--download", action="store_true",
                   help="fetch the stream's data set (MNIST or CIFAR-100) into --data-root through torchvision "
                        "before the first run, unless it is there")
    p.add_argument("--download-mirror", default=None, metavar="URL",
                   help="with --download: a server with the same files (and checksums) as torchvision's URLs")
    p.add_argument("--n-tasks", type=int, default=None, help="shrink the stream (tests and screens only)")
    p.add_argument("--samples-per-task", type=int, default=None)
    p.add_argument("--eval-every", default=None, metavar="K|preset",
                   help="anytime evaluation in every run (python -m emcl_continual --help): every K incoming "
                        "samples, or the stream's preset; off by default")
    p.add_argument("--eval-subset", type=int, default=None, metavar="N",
                   help="with --eval-every: images per task of the anytime evaluation")
    p.add_argument("--log", default=None, metavar="TRACKERS",
                   help="experiment trackers, any of tensorboard,wandb,csv: one tracker run per new run, in the "
                        "stream's folder (python -m emcl_continual --help)")
    p.add_argument("--plan", action="store_true", help="print every row and how many of its runs are done, then exit")
    p.add_argument("--allow-dirty", action="store_true", help="run on a working tree that differs from its commit")
    p.add_argument("--allow-mixed-versions", action="store_true",
                   help="append to files that hold runs of another code version")
    args = p.parse_args(argv)
    from . import executors as sweep

    if args.ray_address and args.executor != "ray":
        p.error("--ray-address goes with --executor ray")
    try:
        devices = sweep.parse_devices(args.device, args.methods)
        if not args.plan and args.executor == "local":  # a Ray cluster's GPUs are counted when it is reached
            for note in sweep.check_devices(devices, _cuda_count() if set(devices.values()) - {"cpu"} else 0):
                print(f"note: {note}", flush=True)
        elif args.executor == "ray":
            sweep.check_devices({m: w for m, w in devices.items() if w.startswith("cuda:")}, 1 << 30, executor="ray")
    except ValueError as exc:
        p.error(str(exc))
    from ..arrays import parse_array

    try:
        args.array = parse_array(args.array)
    except ValueError as exc:
        p.error(str(exc))
    for name, value in (("--jobs", args.jobs), ("--threads", args.threads), ("--runs-per-gpu", args.runs_per_gpu)):
        if value is not None and value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if not args.gpu_memory_mib > 0:
        p.error(f"--gpu-memory-mib must be positive, got {args.gpu_memory_mib:g}")
    if args.download or args.download_mirror is not None:
        _download(p, args)
    from ..output.trackers import parse_log
    from ..training.anytime import settings
    try:
        args.anytime = settings(args.stream, args.eval_every, args.eval_subset)
        args.log_names = parse_log(args.log)
    except ValueError as exc:
        p.error(str(exc))
    from ..core.errors import CommandInterrupted

    try:
        return _main(args)
    except CommandInterrupted as exc:
        print(f"interrupted: {exc}", file=sys.stderr, flush=True)
        return 130
    except RunsFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except sweep.SweepError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


def _main(args) -> int:
    from . import executors as sweep

    out = args.out or os.path.join(DEFAULT_OUT, args.stream)
    os.makedirs(out, exist_ok=True)
    vpath, rpath = os.path.join(out, "validation.jsonl"), os.path.join(out, "report.jsonl")
    spath, ppath = os.path.join(out, "selected.json"), os.path.join(out, "plan.json")
    common = dict(jobs=args.jobs if args.executor == "ray" else (args.jobs or 1), threads=args.threads,
                  data_root=args.data_root, n_tasks=args.n_tasks, samples_per_task=args.samples_per_task,
                  devices=sweep.parse_devices(args.device, args.methods), executor=args.executor,
                  ray_address=args.ray_address, gpu_memory_mib=args.gpu_memory_mib, runs_per_gpu=args.runs_per_gpu,
                  eval_every=(args.anytime or {}).get("every"), eval_subset=(args.anytime or {}).get("subset"),
                  array=args.array)
    if getattr(args, "log_names", None):
        from ..output.trackers import Trackers
        common["trackers"] = Trackers(args.log_names, out, with_config=True)
    plan = {"stream": args.stream, "data_root": args.data_root, "n_tasks": args.n_tasks,
            "samples_per_task": args.samples_per_task, "validation_seeds": list(presets.VALIDATION_SEEDS),
            "report_seeds": list(presets.REPORT_SEEDS), "rows": []}
    if os.path.exists(ppath):
        old = json.load(open(ppath))
        plan["rows"] = old.get("rows", [])

    def remember(rows):
        names = {r["name"]: i for i, r in enumerate(plan["rows"])}
        for row in rows:
            if row["name"] in names:
                plan["rows"][names[row["name"]]] = dict(row)
            else:
                plan["rows"].append(dict(row))
        _write_json(ppath, plan)

    def show(rows, path, split):
        done = {r["key"] for r in load_runs(path)}
        for row in rows:
            n = sum(run_key(row["method"], row["overrides"], s, split, args.data_root) in done for s in row["seeds"])
            print(f"{row['role']:10s} {row['name']:34s} {n}/{len(row['seeds'])}  {json.dumps(row['overrides'], sort_keys=True)}")

    rows_a = validation_rows_a(args.stream, args.methods)
    if args.plan:
        show(rows_a, vpath, "validation")
    elif "validate-a" in args.stages:
        _check_version(vpath, args.allow_dirty, args.allow_mixed_versions)
        remember(rows_a)
        runs = run_rows(rows_a, vpath, args.stream, "validation", **common)
    if args.until == "validate-a":
        return 0
    runs = load_runs(vpath)
    old_sel = json.load(open(spath)) if os.path.exists(spath) else {}
    selected = select_a(args.stream, rows_a, runs, args.data_root, previous=old_sel)
    if selected["pending"]:
        print(f"selection pending for {', '.join(selected['pending'])}: their validation runs are not all done")
    if not args.plan:
        _write_json(spath, selected)
    if args.until == "select-a":
        return 0
    if "emcl" not in selected["methods"] or "emcl" not in args.methods:
        rows_b = []
    else:
        rows_b = validation_rows_b(args.stream, selected)
        if args.plan:
            show(rows_b, vpath, "validation")
        elif "validate-b" in args.stages:
            _check_version(vpath, args.allow_dirty, args.allow_mixed_versions)
            remember(rows_b)
            run_rows(rows_b, vpath, args.stream, "validation", **common)
    if args.until == "validate-b":
        return 0
    if rows_b:
        try:
            selected = select_b(selected, rows_b, load_runs(vpath), args.data_root)
        except RuntimeError as exc:
            print(f"(importance selection not possible yet: {exc})")
        else:
            if not args.plan:
                _write_json(spath, selected)
    if args.until == "select-b":
        return 0
    rows_r = report_rows(args.stream, selected, args.methods)
    if args.rows:
        by_name = {r["name"]: r for r in rows_r}
        missing = [n for n in args.rows if n not in by_name]
        if missing:
            print(f"rows not available (unknown, or waiting for a selection): {', '.join(missing)}")
        rows_r = [by_name[n] for n in args.rows if n in by_name]
    if args.plan:
        show(rows_r, rpath, "test")
        return 0
    if "report" not in args.stages:
        return 0
    _check_version(rpath, args.allow_dirty, args.allow_mixed_versions)
    remember(rows_r)
    run_rows(rows_r, rpath, args.stream, "test", **common)
    print("done; tables: python -m emcl_continual.tables")
    return 0
