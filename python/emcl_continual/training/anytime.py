"""Evaluation during the stream: the anytime accuracy record and the online accuracy.

:func:`emcl_continual.training.train.run` takes an :class:`AnytimeEvaluator` (``--eval-every K``) and calls
it at three points, and nowhere else:

* :meth:`AnytimeEvaluator.start` once, before the first batch (the untrained model: the record's
  point at 0 samples);
* :meth:`AnytimeEvaluator.before_batch` with each incoming batch *before* the method trains on it:
  the batch's accuracy, for the online accuracy (Cai et al. 2021);
* :meth:`AnytimeEvaluator.after_batch` after the method has trained on it: every time the number of
  samples seen reaches a multiple of ``every``, every task seen so far (the current one included) is
  evaluated on its fixed evaluation subset;
* :meth:`AnytimeEvaluator.end_task` after the method's ``end_task``: a point at every task boundary
  (unless the last batch already made one), so that the accuracy just before each switch is in the
  record whatever ``every`` is.

What it evaluates on (``subset`` images per task, :func:`subset_indices`): the same images of each
task's evaluation set (test or validation split, as the run's) for every seed and method, drawn once
by a generator of their own (:data:`SUBSET_SEED`), so that paired comparisons of two methods see the
same images and the accuracy record costs ``subset`` forward passes per seen task per point, not the
whole evaluation set. With 200 of the 1,000 images of an MNIST task, an accuracy has a binomial
standard error of at most 3.5 points per task and point; the means over tasks and points that the
metrics take are far tighter.

Why the training is untouched: the evaluator runs the model in eval mode under ``torch.no_grad``
(restoring its mode afterwards), draws no random number from torch's global generator nor from the
method's, and changes no parameter, gradient, buffer or optimizer state; a run with and without it
trains the same bits (``tests/test_anytime.py`` holds it to that for every method). Its time is
recorded apart (``anytime_eval_time_s``), never in ``train_time_s``.

The evaluator is a hook on the model's forward pass, not on a method: anything that calls the three
methods with a model that maps ``(x, task)`` to logits can use it.

The record it returns (:meth:`AnytimeEvaluator.record`) is plain data; :mod:`emcl_continual.core.metrics`
computes AAA, min-ACC, WC-Acc, the stability gap and the online accuracy from it.
"""
from __future__ import annotations

import time

import torch

__all__ = ["AnytimeEvaluator", "subset_indices", "SUBSET_SEED", "check_every", "settings"]

#: the seed of the generator that picks each task's evaluation subset (independent of the run's seed)
SUBSET_SEED = 20231


def check_every(every, subset) -> tuple[int, int | None]:
    """``(every, subset)`` checked: ``every`` a positive int, ``subset`` None (the whole evaluation
    set) or a positive int. Raises ``ValueError`` naming the bad value."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"eval_every must be a positive number of incoming samples, got {every!r}")
    if subset is not None and (isinstance(subset, bool) or not isinstance(subset, int) or subset < 1):
        raise ValueError(f"eval_subset must be a positive number of images per task (or None: all), got {subset!r}")
    return every, subset


def settings(stream: str, every, subset=None) -> dict | None:
    """``{"every", "subset"}`` of a command's ``--eval-every`` / ``--eval-subset`` (None when
    ``every`` is None): ``every`` a positive number of incoming samples or ``"preset"`` (the
    stream's :data:`~emcl_continual.core.presets.ANYTIME`); ``subset`` images per task (default: the
    stream's preset, else :data:`~emcl_continual.core.presets.ANYTIME_SUBSET`). Raises ``ValueError``
    naming the option and the bad value."""
    from ..core.presets import ANYTIME, ANYTIME_SUBSET, anytime_preset
    if every is None:
        if subset is not None:
            raise ValueError("--eval-subset is used only with --eval-every")
        return None
    if str(every) == "preset":
        try:
            out = anytime_preset(stream)
        except ValueError as exc:
            raise ValueError(f"--eval-every preset: {exc}") from None
    else:
        try:
            k = int(str(every))
        except ValueError:
            raise ValueError(f"--eval-every {every}: give a number of incoming samples (>= 1) or 'preset'") from None
        if k < 1:
            raise ValueError(f"--eval-every {every}: must be >= 1 incoming samples")
        out = {"every": k, "subset": ANYTIME.get(stream, {}).get("subset", ANYTIME_SUBSET)}
    if subset is not None:
        if isinstance(subset, bool) or int(subset) != subset or subset < 1:
            raise ValueError(f"--eval-subset {subset}: must be >= 1 images per task")
        out["subset"] = int(subset)
    return out


def subset_indices(n: int, size: int | None) -> torch.Tensor:
    """The indices (sorted) of ``size`` of ``n`` evaluation images, the same for every task, run and
    seed: the first ``size`` of a permutation drawn by a generator seeded with :data:`SUBSET_SEED`.
    ``size`` None or ``>= n``: all ``n``."""
    if size is None or size >= n:
        return torch.arange(n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SUBSET_SEED))
    return perm[:size].sort().values


def _correct(logits: torch.Tensor, y: torch.Tensor) -> int:
    return int((logits.argmax(-1) == y).sum())


class AnytimeEvaluator:
    """Evaluates a model every ``every`` incoming samples on every task seen so far.

    ``tasks``: the run's evaluation sets (``stream.test``: :class:`~emcl_continual.data.streams.TaskData`
    per task); ``subset``: images per task (None: all); ``device``: where the model is;
    ``batch_size``: images per forward pass of the evaluation.
    """

    def __init__(self, tasks: list, every: int, subset: int | None = 200, device: torch.device | str = "cpu",
                 batch_size: int = 1000):
        self.every, self.subset = check_every(every, subset)
        if not tasks:
            raise ValueError("the stream has no evaluation sets")
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self._sets = []
        for td in tasks:
            idx = subset_indices(len(td), subset)
            self._sets.append((td.x[idx].to(self.device), td.y[idx].to(self.device), td.task))
        self.sizes = [int(s[1].shape[0]) for s in self._sets]
        self.samples = 0
        self.points: list[int] = []  # samples seen at each point
        self.point_task: list[int] = []  # the task being trained at each point
        self.acc: list[list[float]] = []  # accuracy (%) on tasks 0..point_task at each point
        self.online_correct: list[int] = []  # per task: incoming samples predicted right before training
        self.online_seen: list[int] = []  # per task: incoming samples
        self.task_starts: list[int] = []  # samples seen when each task began
        self.time_s = 0.0

    # -- the hooks ----------------------------------------------------------------------------
    def start(self, model: torch.nn.Module) -> None:
        """Before the first batch: the point at 0 samples (task 0, the untrained model)."""
        self._evaluate(model, 0)

    def before_batch(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, task: int) -> None:
        """The incoming batch ``(x, y)`` of ``task``, before the method trains on it: counted for the
        online accuracy."""
        t0 = time.perf_counter()
        while len(self.online_seen) <= task:
            self.online_seen.append(0)
            self.online_correct.append(0)
            self.task_starts.append(self.samples)
        with _eval_mode(model):
            self.online_correct[task] += _correct(model(x, task), y)
        self.online_seen[task] += int(y.shape[0])
        self.time_s += time.perf_counter() - t0

    def after_batch(self, model: torch.nn.Module, n: int, task: int) -> None:
        """The method has trained on ``n`` more samples of ``task``: evaluate whenever the count of
        samples seen reaches a multiple of ``every``."""
        before = self.samples
        self.samples += int(n)
        if self.samples // self.every > before // self.every:
            self._evaluate(model, task)

    def end_task(self, model: torch.nn.Module, task: int) -> None:
        """Task ``task`` ended: a point at this boundary unless there is one already."""
        if not self.points or self.points[-1] != self.samples:
            self._evaluate(model, task)

    # -- the record ---------------------------------------------------------------------------
    def _evaluate(self, model: torch.nn.Module, task: int) -> None:
        t0 = time.perf_counter()
        row = []
        with _eval_mode(model):
            for x, y, t in self._sets[:task + 1]:
                correct = sum(_correct(model(x[s:s + self.batch_size], t), y[s:s + self.batch_size])
                              for s in range(0, len(y), self.batch_size))
                row.append(100.0 * correct / max(1, len(y)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.points.append(self.samples)
        self.point_task.append(int(task))
        self.acc.append(row)
        self.time_s += time.perf_counter() - t0

    def record(self) -> dict:
        """The run's anytime record: ``every``, ``subset`` (images per task; None: all),
        ``subset_sizes``, ``samples`` (samples seen at each point), ``task`` (the task being
        trained at each point), ``acc`` (per point: accuracy % on tasks 0..task), ``task_starts``
        (samples seen when each task began), ``online_correct`` / ``online_seen`` per task."""
        return {"every": self.every, "subset": self.subset, "subset_seed": SUBSET_SEED,
                "subset_sizes": self.sizes, "samples": list(self.points), "task": list(self.point_task),
                "acc": [list(r) for r in self.acc], "task_starts": list(self.task_starts),
                "online_correct": list(self.online_correct), "online_seen": list(self.online_seen)}


class _eval_mode:
    """``model.eval()`` under ``torch.no_grad()``, the previous mode restored on exit."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.grad = torch.no_grad()
        self.grad.__enter__()
        self.model.eval()
        return self.model

    def __exit__(self, *exc):
        self.model.train(self.was_training)
        self.grad.__exit__(*exc)
        return False
