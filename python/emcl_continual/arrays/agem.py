"""A-GEM as an array (:mod:`..methods.agem`): per-run ring memories (no draws while the
reference batch is the whole past memory, as on every MNIST stream; beyond it each run draws
its own ``randperm``), per-run reference gradients and projections; ``lr`` per run."""
from __future__ import annotations

import torch

from ..methods._qp import agem_project
from ..methods.agem import AGEM
from .base import ArrayLearner, ArrayRing, ce_per_run, mlp_forward, sgd_


class AGEMArray(ArrayLearner):
    """``N`` A-GEM runs."""

    method = AGEM
    PER_RUN = ("lr",)

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        per_task = int(self.configs[0]["memory"]) // int(info.n_tasks)
        if per_task < 1:
            raise ValueError(f"agem: memory {self.configs[0]['memory']} is smaller than the number of tasks "
                             f"{info.n_tasks}")
        self.memory = ArrayRing(per_task, tuple(info.input_shape), self.width, self.device)
        self.ref_batch = int(self.configs[0]["ref_batch"])
        self.n_projections = [0] * self.width
        self.per_run += ["memory", "n_projections"]

    def _reference(self, task):
        past = [k for k in self.memory.tasks() if k != task]
        if not past:
            return None
        mems = [self.memory.get(k) for k in past]
        x = torch.cat([m[0] for m in mems], 1)
        y = torch.cat([m[1] for m in mems], 1)
        if x.shape[1] > self.ref_batch:
            idx = torch.stack([torch.randperm(x.shape[1], generator=g)[: self.ref_batch] for g in self.generators])
            idx = idx.to(x.device)
            rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
            x, y = x[rows, idx], y[rows, idx]
        return x, y

    def observe(self, x, y, task):
        ref = self._reference(task)
        g_ref = None
        n = self.width
        if ref is not None:
            ref_loss = ce_per_run(mlp_forward(self.weights, ref[0]), ref[1])
            g_ref = torch.cat([g.reshape(n, -1) for g in torch.autograd.grad(ref_loss.sum(), self.weights)], 1)
        loss, grads = self.loss_grads(x, y)
        if g_ref is not None:
            g = torch.cat([t.reshape(n, -1) for t in grads], 1)
            if n == 1:
                if torch.dot(g[0], g_ref[0]) < 0:
                    g = agem_project(g[0], g_ref[0]).unsqueeze(0)
                    self.n_projections[0] += 1
            else:
                dot = (g * g_ref).sum(1)
                denom = (g_ref * g_ref).sum(1)
                conflict = (dot < 0) & (denom > 0)
                coef = torch.where(conflict, dot / torch.where(conflict, denom, torch.ones_like(denom)),
                                   torch.zeros_like(dot))
                g = g - coef.unsqueeze(1) * g_ref
                for r in torch.nonzero(dot < 0).flatten().tolist():
                    self.n_projections[r] += 1
            grads, off = [], 0
            for w in self.weights:
                k = w[0].numel()
                grads.append(g[:, off:off + k].reshape(w.shape))
                off += k
        sgd_(self.weights, grads, self.hyper("lr"), self.floats("lr"))
        self.memory.add(x.detach(), y.detach(), task)
        return loss
