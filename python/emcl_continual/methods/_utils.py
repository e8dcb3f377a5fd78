"""Small helpers shared by the baseline methods (sgd, ewc, gem, agem, er, mer, lamaml).

Nothing here is a method: flat-gradient packing for the projection methods, a mixed-task
loss for replay batches (multi-head streams mask logits per task), per-task ring memories
(GEM / A-GEM / EWC keep the most recent samples of each task, as in Lopez-Paz & Ranzato's
code), and config validation with clear errors.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "defaults_for",
    "check_config",
    "flat_grad",
    "set_flat_grad",
    "mixed_task_loss",
    "TaskRingMemory",
    "make_generator",
]


def defaults_for(method: str, table: dict, stream: str) -> dict:
    """Return a copy of ``table[stream]``; raise a clear error for an unknown stream name."""
    if stream not in table:
        raise ValueError(
            f"{method}: no hyper-parameters for stream {stream!r}; known streams: {sorted(table)}"
        )
    return dict(table[stream])


def check_config(
    method: str,
    config: dict,
    *,
    positive: Sequence[str] = (),
    nonnegative: Sequence[str] = (),
    positive_int: Sequence[str] = (),
    unit: Sequence[str] = (),
) -> None:
    """Validate the hyper-parameters a method reads; raise ``ValueError`` naming the bad key.

    ``unit`` keys must lie in (0, 1].
    """
    for key in (*positive, *nonnegative, *positive_int, *unit):
        if key not in config:
            raise ValueError(f"{method}: missing hyper-parameter {key!r} (config keys: {sorted(config)})")
    for key in positive:
        if not float(config[key]) > 0:
            raise ValueError(f"{method}: {key} must be > 0, got {config[key]!r}")
    for key in nonnegative:
        if not float(config[key]) >= 0:
            raise ValueError(f"{method}: {key} must be >= 0, got {config[key]!r}")
    for key in positive_int:
        v = config[key]
        if isinstance(v, bool) or int(v) != v or int(v) < 1:
            raise ValueError(f"{method}: {key} must be a positive integer, got {v!r}")
    for key in unit:
        if not 0 < float(config[key]) <= 1:
            raise ValueError(f"{method}: {key} must lie in (0, 1], got {config[key]!r}")


def make_generator(config: dict) -> torch.Generator:
    """A CPU generator seeded from ``config['seed']`` (0 when absent) for the method's own sampling."""
    g = torch.Generator()
    g.manual_seed(int(config.get("seed", 0)) * 1_000_003 + 17)
    return g


def flat_grad(params: Sequence[nn.Parameter]) -> Tensor:
    """Concatenate the ``.grad`` of ``params`` into one vector (zeros where a grad is None)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )


def set_flat_grad(params: Sequence[nn.Parameter], vec: Tensor) -> None:
    """Write the flat vector ``vec`` back into the ``.grad`` of ``params``."""
    offset = 0
    for p in params:
        n = p.numel()
        chunk = vec[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += n
    if offset != vec.numel():
        raise ValueError(f"flat vector has {vec.numel()} elements, parameters have {offset}")


def mixed_task_loss(forward, x: Tensor, y: Tensor, t: Tensor | int, *, multi_head: bool = True) -> Tensor:
    """Mean cross-entropy over a batch whose samples may come from different tasks.

    ``forward(x, task)`` returns logits for one task id (multi-head models mask the other
    tasks' classes), so the batch is split by task id and the per-sample losses averaged.
    ``multi_head=False`` (a single-head stream: the logits do not depend on the task) takes
    the same mean with one forward pass instead of one per task in the batch.
    """
    if isinstance(t, int):
        return F.cross_entropy(forward(x, t), y)
    if not multi_head:
        return F.cross_entropy(forward(x, 0), y)
    tasks = torch.unique(t)
    if tasks.numel() == 1:
        return F.cross_entropy(forward(x, int(tasks[0])), y)
    total = x.new_zeros(())
    for task in tasks.tolist():
        sel = t == task
        total = total + F.cross_entropy(forward(x[sel], task), y[sel], reduction="sum")
    return total / x.shape[0]


class TaskRingMemory:
    """Per-task episodic memory of ``per_task`` slots, filled as a ring (newest samples win).

    This is the memory of GEM (Lopez-Paz & Ranzato 2017, their code's ``memory_data``):
    while a task is seen, each incoming batch is written at the ring pointer, so the memory
    holds the last ``per_task`` samples of every task seen so far.
    """

    def __init__(self, per_task: int, input_shape: Iterable[int], device: torch.device):
        if per_task < 1:
            raise ValueError(f"per-task memory must hold at least one sample, got {per_task}")
        self.per_task = int(per_task)
        self.input_shape = tuple(input_shape)
        self.device = device
        self._x: dict[int, Tensor] = {}
        self._y: dict[int, Tensor] = {}
        self._count: dict[int, int] = {}
        self._ptr: dict[int, int] = {}

    def add(self, x: Tensor, y: Tensor, task: int) -> None:
        """Write the batch into task ``task``'s ring (oldest entries are overwritten)."""
        if task not in self._x:
            self._x[task] = torch.zeros((self.per_task, *self.input_shape), dtype=x.dtype, device=self.device)
            self._y[task] = torch.zeros(self.per_task, dtype=torch.long, device=self.device)
            self._count[task] = 0
            self._ptr[task] = 0
        for i in range(x.shape[0]):
            p = self._ptr[task]
            self._x[task][p] = x[i]
            self._y[task][p] = y[i]
            self._ptr[task] = (p + 1) % self.per_task
            self._count[task] = min(self._count[task] + 1, self.per_task)

    def tasks(self) -> list[int]:
        """Task ids with stored samples, in insertion order."""
        return list(self._x)

    def get(self, task: int) -> tuple[Tensor, Tensor]:
        """The stored ``(x, y)`` of one task."""
        n = self._count[task]
        return self._x[task][:n], self._y[task][:n]

    def __len__(self) -> int:
        return sum(self._count.values())
