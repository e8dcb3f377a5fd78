"""GEM as an array (:mod:`..methods.gem`): per-run ring memories, each run's past-task gradients
from one ``vmap`` over the tasks of the array's stacked forward, and GEM's quadratic programme
per run (:func:`~..methods._qp.gem_project`, the run alone's: the dual's ``G G^T`` and ``G g`` in
torch, the ``t x t`` non-negative least squares in SciPy), only for the runs whose gradient
conflicts with a past task. ``lr`` per run; the memory, ``margin`` and ``eps`` shared."""
from __future__ import annotations

import torch
from torch.func import grad, vmap

from ..methods._qp import gem_project
from ..methods.gem import GEM
from .base import ArrayLearner, ArrayRing, ce_per_run, mlp_forward, sgd_


def _memory_loss(weights, x, y):
    return ce_per_run(mlp_forward(weights, x), y).sum()


class GEMArray(ArrayLearner):
    """``N`` GEM runs."""

    method = GEM
    PER_RUN = ("lr",)

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        c = self.configs[0]
        per_task = int(c["memory"]) // int(info.n_tasks)
        if per_task < 1:
            raise ValueError(f"gem: memory {c['memory']} is smaller than the number of tasks {info.n_tasks}")
        self.memory = ArrayRing(per_task, tuple(info.input_shape), self.width, self.device)
        self.margin = float(c["margin"])
        self.eps = float(c["eps"])
        self.n_projections = [0] * self.width
        self.per_run += ["memory", "n_projections"]

    def memory_grads(self, past):
        """``G[N, t, P]``: each run's gradient of the mean loss on each past task's memory."""
        n = self.width
        mems = [self.memory.get(k) for k in past]
        detached = [w.detach() for w in self.weights]
        if len({mx.shape[1] for mx, _ in mems}) == 1:
            xs = torch.stack([mx for mx, _ in mems])           # [t, N, m, D]
            ys = torch.stack([my for _, my in mems])
            grads = vmap(grad(_memory_loss), in_dims=(None, 0, 0))(detached, xs, ys)   # each [t, N, ...]
            return torch.cat([g.reshape(len(past), n, -1) for g in grads], 2).transpose(0, 1)
        rows = []
        for mx, my in mems:
            leaves = [w.requires_grad_(True) for w in [d.clone() for d in detached]]
            gs = torch.autograd.grad(_memory_loss(leaves, mx, my), leaves)
            rows.append(torch.cat([g.reshape(n, -1) for g in gs], 1))
        return torch.stack(rows, 1)

    def observe(self, x, y, task):
        self.memory.add(x.detach(), y.detach(), task)
        past = [k for k in self.memory.tasks() if k != task]
        G = self.memory_grads(past) if past else None
        loss, grads = self.loss_grads(x, y)
        if G is not None:
            n = self.width
            g = torch.cat([t.reshape(n, -1) for t in grads], 1)
            if n == 1:
                conflict = [bool((G[0] @ g[0] < 0).any())]
            else:
                conflict = (torch.bmm(G, g.unsqueeze(2)) < 0).any(2).any(1).tolist()
            if any(conflict):
                g = g.clone()
                for r, c in enumerate(conflict):
                    if c:
                        g[r] = gem_project(g[r], G[r], self.margin, self.eps)
                        self.n_projections[r] += 1
                grads, off = [], 0
                for w in self.weights:
                    k = w[0].numel()
                    grads.append(g[:, off:off + k].reshape(w.shape))
                    off += k
        sgd_(self.weights, grads, self.hyper("lr"), self.floats("lr"))
        return loss
