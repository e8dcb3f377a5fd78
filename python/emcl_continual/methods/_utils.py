"""Small helpers shared by the baseline methods (sgd, ewc, gem, agem, er, mer, lamaml).

Nothing here is a method: flat-gradient packing for the projection methods, a mixed-task
loss for replay batches (multi-head streams mask logits per task), per-task ring memories
(GEM / A-GEM keep the most recent samples of each task, as in Lopez-Paz & Ranzato's
code).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "flat_grad",
    "set_flat_grad",
    "mixed_task_loss",
    "TaskRingMemory",
]


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
