r"""Averaged GEM (Chaudhry et al. 2019): one reference gradient, closed-form projection.

Per incoming batch of task :math:`t`: compute the current gradient :math:`g`; draw a batch of
up to ``ref_batch`` samples from the episodic memories of the past tasks and compute its
gradient :math:`g_{ref}`; if :math:`g^\top g_{ref} < 0` step with
:math:`g - \frac{g^\top g_{ref}}{g_{ref}^\top g_{ref}} g_{ref}` (eq. 11), else with :math:`g`.
The batch is then written into task :math:`t`'s ring memory (``memory // n_tasks`` slots).

Hyper-parameters: Table II gives lr 0.03 and 200 memories for CIFAR100/miniImageNet; for the
MNIST streams lr 0.03 (same SGD learning rate as the other baselines at batch size 10) and
the memory of section V (200 / 500); ``ref_batch`` 256 is A-GEM's published setting
(larger than every memory here, so the reference batch is the whole past memory).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.schema import float_rule, int_rule
from ._qp import agem_project
from ._utils import TaskRingMemory, flat_grad, mixed_task_loss, set_flat_grad
from .base import Method

_DEFAULTS = {
    "permuted-mnist": {"lr": 0.03, "memory": 200, "ref_batch": 256},
    "rotated-mnist": {"lr": 0.03, "memory": 200, "ref_batch": 256},
    "many-permutations": {"lr": 0.03, "memory": 500, "ref_batch": 256},
    "split-cifar100": {"lr": 0.03, "memory": 200, "ref_batch": 256},
    "split-miniimagenet": {"lr": 0.03, "memory": 200, "ref_batch": 256},
}


class AGEM(Method):
    """A-GEM with per-task ring memories."""

    name = "agem"
    DEFAULTS = _DEFAULTS
    TABLE_II = {"split-cifar100": {"lr": 0.03, "memory": 200}, "split-miniimagenet": {"lr": 0.03, "memory": 200}}
    RULES = {"lr": float_rule(open_=True), "memory": int_rule(1), "ref_batch": int_rule(1)}

    def __init__(self, model: nn.Module, info, config: dict, device: torch.device):
        super().__init__(model, info, config, device)
        per_task = int(self.config["memory"]) // int(info.n_tasks)
        if per_task < 1:
            raise ValueError(f"agem: memory {self.config['memory']} is smaller than the number of tasks {info.n_tasks}")
        self.memory = TaskRingMemory(per_task, info.input_shape, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ref_batch = int(self.config["ref_batch"])
        self.n_projections = 0

    def _reference(self, task: int) -> tuple[Tensor, Tensor, Tensor] | None:
        past = [k for k in self.memory.tasks() if k != task]
        if not past:
            return None
        xs, ys, ts = [], [], []
        for k in past:
            mx, my = self.memory.get(k)
            xs.append(mx)
            ys.append(my)
            ts.append(torch.full((mx.shape[0],), k, dtype=torch.long, device=mx.device))
        x, y, t = torch.cat(xs), torch.cat(ys), torch.cat(ts)
        if x.shape[0] > self.ref_batch:
            idx = torch.randperm(x.shape[0], generator=self.generator)[: self.ref_batch].to(x.device)
            x, y, t = x[idx], y[idx], t[idx]
        return x, y, t

    def observe(self, x: Tensor, y: Tensor, task: int) -> float:
        self.model.train()
        ref = self._reference(task)
        g_ref = None
        if ref is not None:
            self.model.zero_grad(set_to_none=True)
            mixed_task_loss(self.model, *ref, multi_head=self.info.multi_head).backward()
            g_ref = flat_grad(self.params)
        self.model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x, task), y)
        loss.backward()
        if g_ref is not None:
            g = flat_grad(self.params)
            if torch.dot(g, g_ref) < 0:
                set_flat_grad(self.params, agem_project(g, g_ref))
                self.n_projections += 1
        self.opt.step()
        self.memory.add(x.detach(), y.detach(), task)
        return float(loss.detach())
