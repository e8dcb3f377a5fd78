"""One continual-learning run: a method on a stream for one seed.

Per task the loop calls ``method.begin_task(t)``, ``method.observe`` per batch and
``method.end_task(t)``, and times them. Before the first batch it
evaluates the untrained model on every task (``acc_before``, the ``b`` of forward transfer), and
after each task every task's evaluation set, giving the accuracy matrix; both are timed apart
from training. The result records every metric of :mod:`.metrics`, the full configuration, the
data source and evaluation split, and the code version and command (:mod:`.provenance`).
"""
from __future__ import annotations

import platform
import sys
import time

import torch

from ..core import metrics
from ..core.presets import BATCH_SIZE
from ..core.provenance import code_version, command_line, processor
from ..data.models import build_model
from ..data.streams import Stream, make_stream
from ..methods import get_method
from .anytime import AnytimeEvaluator
from .config import RUN_DEFAULTS, build_config

__all__ = ["run", "make_record", "build_config", "RUN_DEFAULTS"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(method: str, stream: str | Stream, seed: int = 0, *, overrides: dict | None = None,
        data_root: str | None = None, task_file: str | None = None, n_tasks: int | None = None,
        samples_per_task: int | None = None, batch_size: int = BATCH_SIZE,
        device: str | torch.device = "cpu", progress: bool = True, log=None, eval_every: int | None = None,
        eval_subset: int | None = None, evaluator: AnytimeEvaluator | None = None) -> dict:
    """Train ``method`` on ``stream`` (a name or a built :class:`Stream`) for ``seed``.

    Returns a dict with method, stream, seed, acc, bwt, acc_matrix (``R[i][j]``: accuracy
    on task j after task i, %), acc_before (the untrained model's accuracy on every task),
    metrics (every metric of :mod:`.metrics`), avg_acc_curve (mean accuracy over the tasks
    seen so far, after each task), train_time_s (only ``observe``), eval_time_s (after each
    task), eval_before_time_s, losses per task, the config used, the data source, the
    evaluation split and its size, per-task diagnostics of methods that offer them, and
    provenance (git commit, code tree, dirty flag, extension hash, command line, and the processor:
    CPU model, torch's CPU capability and threads, :func:`.provenance.processor`).
    """
    device = torch.device(device)
    if isinstance(stream, str):
        stream = make_stream(stream, seed, data_root=data_root, task_file=task_file, n_tasks=n_tasks,
                             samples_per_task=samples_per_task)
    info = stream.info
    cls = get_method(method)
    config = build_config(method, info.name, seed, overrides)
    if evaluator is not None and eval_every is not None:
        raise ValueError("give eval_every or an evaluator, not both")
    if evaluator is None and eval_every is not None:
        from ..core.presets import ANYTIME_SUBSET
        evaluator = AnytimeEvaluator(stream.test, eval_every, ANYTIME_SUBSET if eval_subset is None else eval_subset,
                                     device)

    torch.manual_seed(int(seed))
    model = build_model(info, init=config.get("init", RUN_DEFAULTS["init"])).to(device)
    start = time.perf_counter()
    acc_before = metrics.evaluate(model, stream.test, device)
    _sync(device)
    eval_before_time = time.perf_counter() - start
    learner = cls(model, info, config, device)
    if evaluator is not None:
        evaluator.start(model)
    diagnose = getattr(learner, "diagnostics", None)
    diagnostics: list = []

    T = info.n_tasks
    matrix: list[list[float]] = []
    losses: list[float] = []
    train_time = eval_time = 0.0
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=stream.n_batches(batch_size), desc=f"{method} {info.name} seed {seed}",
                       unit="batch", leave=False, disable=not sys.stderr.isatty())
        except ImportError:  # pragma: no cover - tqdm is a requirement
            bar = None
    try:
        for t in range(T):
            task_loss, n = 0.0, 0
            start = time.perf_counter()
            learner.begin_task(t)
            train_time += time.perf_counter() - start
            for x, y in stream.batches(t, batch_size, device=device):  # one copy per task
                if evaluator is not None:
                    evaluator.before_batch(model, x, y, t)
                _sync(device)
                start = time.perf_counter()
                loss = learner.observe(x, y, t)
                _sync(device)
                train_time += time.perf_counter() - start
                if evaluator is not None:
                    evaluator.after_batch(model, int(y.shape[0]), t)
                task_loss += float(loss)
                n += 1
                if bar is not None:
                    bar.update(1)
            _sync(device)
            start = time.perf_counter()
            learner.end_task(t)
            _sync(device)
            train_time += time.perf_counter() - start
            if evaluator is not None:
                evaluator.end_task(model, t)
            losses.append(task_loss / max(1, n))
            start = time.perf_counter()
            row = metrics.evaluate(model, stream.test, device)
            _sync(device)
            eval_time += time.perf_counter() - start
            matrix.append(row)
            if diagnose is not None:
                diagnostics.append(diagnose())
            if bar is not None:
                bar.set_postfix(task=f"{t + 1}/{T}", avg_acc=f"{sum(row[:t + 1]) / (t + 1):.1f}")
            if log is not None:
                log(f"task {t + 1}/{T}: loss {losses[-1]:.3f}, mean acc so far {sum(row[:t + 1]) / (t + 1):.2f}")
    finally:
        if bar is not None:
            bar.close()
    result = make_record(method, stream, int(seed), config, matrix, acc_before, losses, train_time=train_time,
                         eval_time=eval_time, eval_before_time=eval_before_time, batch_size=batch_size, device=device)
    if diagnostics:
        result["diagnostics"] = diagnostics
    if evaluator is not None:
        result["anytime"] = evaluator.record()
        result["anytime_metrics"] = metrics.anytime_metrics(result["anytime"])
        result["anytime_eval_time_s"] = evaluator.time_s
    return result


def make_record(method: str, stream: Stream, seed: int, config: dict, matrix: list, acc_before: list,
                losses: list, *, train_time: float, eval_time: float, eval_before_time: float, batch_size: int,
                device) -> dict:
    """The record of one finished run (the schema :func:`run` returns; also written for each run
    of an array, :mod:`emcl_continual.arrays`)."""
    info = stream.info
    T = info.n_tasks
    return {
        "method": method,
        "stream": info.name,
        "seed": int(seed),
        "acc": metrics.acc(matrix),
        "bwt": metrics.bwt(matrix),
        "metrics": metrics.all_metrics(matrix, acc_before),
        "acc_matrix": matrix,
        "acc_before": acc_before,
        "avg_acc_curve": [sum(matrix[t][:t + 1]) / (t + 1) for t in range(T)],
        "train_time_s": train_time,
        "eval_time_s": eval_time,
        "eval_before_time_s": eval_before_time,
        "task_losses": losses,
        "config": {k: v for k, v in config.items()},
        "n_tasks": T,
        "samples_per_task": [len(td) for td in stream.train][:1][0] if stream.train else 0,
        "batch_size": batch_size,
        "data_source": info.source,
        "split": stream.meta.get("split", "test"),
        "eval_size": stream.meta.get("eval_size"),
        "stream_meta": {k: v for k, v in stream.meta.items() if k not in ("split", "eval_size")},
        "device": str(device),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.system()}, {torch.get_num_threads()} torch threads",
        "provenance": dict(code_version(), command=command_line(), processor=processor()),
    }
