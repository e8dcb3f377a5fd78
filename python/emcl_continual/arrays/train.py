"""Training an array of runs: :func:`run_array`, the array counterpart of
:func:`emcl_continual.training.train.run`.

Per run, as alone: the stream of its seed, its model built after ``torch.manual_seed(seed)``,
the untrained model's accuracy, then per task ``begin_task``, one ``observe`` per batch of its
stream's order, ``end_task``, and the evaluation of every task. The runs' weights are stacked
(:mod:`.base`) and each batch is the runs' batches stacked; evaluation copies a run's slice into
its own model and runs :func:`emcl_continual.core.metrics.evaluate` on it, the code of the run alone.

A run whose loss or weights stop being finite is dropped from the array (every per-run state,
:meth:`~.base.ArrayLearner.keep`) and returned as failed with the task and batch; the others go
on. Each finished run gives the record of the run alone (:func:`emcl_continual.training.train.make_record`)
(with the learner's per-task ``diagnostics`` where it has them, as the run alone's)
plus ``array``: the array's ``id``, its ``width`` when it started, the run's ``index`` in it, and
the array's whole ``train_time_s`` (the record's own ``train_time_s`` is that divided by the
runs it trained, its share).
"""
from __future__ import annotations

import math
import time

import torch

from . import array_signature, get_learner, supports_stream
from ..core import metrics
from ..core.presets import BATCH_SIZE
from ..data.models import build_model
from ..data.streams import make_stream
from ..training.config import RUN_DEFAULTS, build_config
from ..training.train import make_record
from .base import stack_weights

__all__ = ["run_array"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_array(method: str, stream_name: str, runs: list, *, split: str = "test", data_root: str | None = None,
              n_tasks: int | None = None, samples_per_task: int | None = None, batch_size: int = BATCH_SIZE,
              device: str | torch.device = "cpu", array_id: str = "array", streams: dict | None = None,
              log=None) -> tuple[list, list]:
    """Train ``runs`` (each ``{"seed": int, "overrides": dict}``) of ``method`` on ``stream_name``
    as one array. Returns ``(records, failures)``: a record per finished run in the order of
    ``runs`` (each with ``array``), and ``(index, reason)`` per run that diverged.

    ``streams``: built streams by seed, to share (else each seed's stream is built here with
    ``split``, ``data_root``, ``n_tasks`` and ``samples_per_task``). Raises ValueError before
    anything trains when the method has no array learner, the stream is not an MLP stream, or
    the runs' configurations differ in more than their per-run keys."""
    if not runs:
        raise ValueError("run_array: no runs")
    device = torch.device(device)
    cls = get_learner(method)
    streams = dict(streams or {})
    for r in runs:
        s = int(r["seed"])
        if s not in streams:
            streams[s] = make_stream(stream_name, s, data_root=data_root, split=split, n_tasks=n_tasks,
                                     samples_per_task=samples_per_task)
    info = streams[int(runs[0]["seed"])].info
    why = supports_stream(info)
    if why:
        raise ValueError(why)
    configs = [build_config(method, info.name, int(r["seed"]), r.get("overrides") or {}) for r in runs]
    sigs = {array_signature(method, c) for c in configs}
    if len(sigs) != 1:
        raise ValueError(f"run_array: the runs of one array may differ only in seed and "
                         f"{', '.join(cls.PER_RUN)}; these differ in more")
    lengths = {tuple(len(td) for td in streams[int(r["seed"])].train) for r in runs}
    if len(lengths) != 1:
        raise ValueError("run_array: the runs' streams have tasks of different sizes")

    models, before, before_time = [], [], []
    for r, c in zip(runs, configs):
        torch.manual_seed(int(r["seed"]))
        model = build_model(info, init=c.get("init", RUN_DEFAULTS["init"])).to(device)
        start = time.perf_counter()
        before.append(metrics.evaluate(model, streams[int(r["seed"])].test, device))
        _sync(device)
        before_time.append(time.perf_counter() - start)
        models.append(model)
    learner = cls(stack_weights(models), info, configs, device)

    width = len(runs)
    alive = list(range(width))              # the runs still in the array, by index in ``runs``
    matrices = {i: [] for i in alive}
    diagnose = getattr(learner, "diagnostics", None)      # per run, after every task, as train.run records it
    diagnostics = {i: [] for i in alive}
    losses = {i: [] for i in alive}
    eval_time = {i: 0.0 for i in alive}
    failures = []
    train_time = 0.0

    def drop(dead: list, reason: dict) -> None:
        nonlocal alive
        for i in dead:
            failures.append((i, reason[i]))
            if log is not None:
                log(f"array {array_id}: run {i} (seed {runs[i]['seed']}) dropped: {reason[i]}")
        keep = [k for k, i in enumerate(alive) if i not in dead]
        alive = [alive[k] for k in keep]
        if alive:
            learner.keep(keep)

    for t in range(info.n_tasks):
        if not alive:
            break
        start = time.perf_counter()
        learner.begin_task(t)
        train_time += time.perf_counter() - start
        xs = torch.stack([streams[int(runs[i]["seed"])].train[t].x for i in alive]).to(device)
        ys = torch.stack([streams[int(runs[i]["seed"])].train[t].y for i in alive]).to(device)
        sums = [0.0] * len(alive)
        n = 0
        for b0 in range(0, ys.shape[1], batch_size):
            _sync(device)
            start = time.perf_counter()
            loss = learner.observe(xs[:, b0:b0 + batch_size], ys[:, b0:b0 + batch_size], t)
            _sync(device)
            train_time += time.perf_counter() - start
            values = loss.tolist()
            bad = [k for k, v in enumerate(values) if not math.isfinite(v)]
            for k, v in enumerate(values):
                sums[k] += float(v)
            n += 1
            if bad:
                dead = [alive[k] for k in bad]
                drop(dead, {i: f"diverged: non-finite loss at task {t}, batch {n - 1}" for i in dead})
                sums = [s for k, s in enumerate(sums) if k not in bad]
                if not alive:
                    break
                sel = torch.tensor([k for k in range(xs.shape[0]) if k not in bad], device=device)
                xs, ys = xs[sel], ys[sel]
        if not alive:
            break
        _sync(device)
        start = time.perf_counter()
        learner.end_task(t)
        _sync(device)
        train_time += time.perf_counter() - start
        with torch.no_grad():
            finite = torch.stack([torch.isfinite(w.reshape(w.shape[0], -1)).all(1) for w in learner.weights]).all(0)
        bad = [k for k, ok in enumerate(finite.tolist()) if not ok]
        if bad:
            dead = [alive[k] for k in bad]
            drop(dead, {i: f"diverged: non-finite weights after task {t}" for i in dead})
            sums = [s for k, s in enumerate(sums) if k not in bad]
        found = diagnose() if diagnose is not None and alive else None
        for k, i in enumerate(alive):
            losses[i].append(sums[k] / max(1, n))
            if found is not None:
                diagnostics[i].append(found[k])
            with torch.no_grad():
                for p, w in zip(models[i].parameters(), learner.weights):
                    p.copy_(w[k])
            start = time.perf_counter()
            matrices[i].append(metrics.evaluate(models[i], streams[int(runs[i]["seed"])].test, device))
            _sync(device)
            eval_time[i] += time.perf_counter() - start
        if log is not None and alive:
            log(f"array {array_id}: task {t + 1}/{info.n_tasks} done, {len(alive)} run(s)")

    records = []
    for i in alive:
        rec = make_record(method, streams[int(runs[i]["seed"])], int(runs[i]["seed"]), configs[i], matrices[i],
                          before[i], losses[i], train_time=train_time / width, eval_time=eval_time[i],
                          eval_before_time=before_time[i], batch_size=batch_size, device=device)
        if diagnostics[i]:
            rec["diagnostics"] = diagnostics[i]
        rec["array"] = {"id": array_id, "width": width, "index": i, "train_time_s": train_time}
        records.append(rec)
    return records, failures
