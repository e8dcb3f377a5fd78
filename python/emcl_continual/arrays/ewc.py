"""EWC as an array (:mod:`..methods.ewc`): each run's memory (the first ``n_memories`` samples
of the task), Fisher sum and anchor stacked; ``lr`` and ``reg`` per run."""
from __future__ import annotations

import torch

from ..methods.ewc import EWC
from .base import ArrayLearner, ce_per_run, mlp_forward, per_run_sum, sgd_


class EWCArray(ArrayLearner):
    """``N`` EWC runs with one summed quadratic each."""

    method = EWC
    PER_RUN = ("lr", "reg")

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        self.n_memories = int(self.configs[0]["n_memories"])
        self.mem_x = self.mem_y = None
        self.n_consolidated = 0
        self.fisher_sum = [torch.zeros_like(w) for w in self.weights]
        self.weighted_anchor = [torch.zeros_like(w) for w in self.weights]
        self.anchor = [torch.zeros_like(w) for w in self.weights]
        self.per_run += ["mem_x", "mem_y", "fisher_sum", "weighted_anchor", "anchor"]

    def begin_task(self, task):
        self.mem_x = self.mem_y = None

    def end_task(self, task):
        if self.mem_x is not None:
            loss = ce_per_run(mlp_forward(self.weights, self.mem_x), self.mem_y)
            grads = torch.autograd.grad(loss.sum(), self.weights)
            with torch.no_grad():
                for w, g, fs, wa, a in zip(self.weights, grads, self.fisher_sum, self.weighted_anchor, self.anchor):
                    f = g.pow(2)
                    fs.add_(f)
                    wa.add_(f * w)
                    torch.where(fs > 0, wa / fs.clamp_min(torch.finfo(fs.dtype).tiny), w, out=a)
            self.n_consolidated += 1
        self.mem_x = self.mem_y = None

    def penalty(self):
        """Each run's EWC penalty without lambda ``[N]``."""
        total = self.weights[0].new_zeros((self.width,))
        for w, fs, a in zip(self.weights, self.fisher_sum, self.anchor):
            total = total + per_run_sum(fs * (w - a).pow(2))
        return total

    def observe(self, x, y, task):
        if self.mem_x is None:
            self.mem_x, self.mem_y = x.detach()[:, : self.n_memories].clone(), y.detach()[:, : self.n_memories].clone()
        elif self.mem_x.shape[1] < self.n_memories:
            self.mem_x = torch.cat((self.mem_x, x.detach()), 1)[:, : self.n_memories]
            self.mem_y = torch.cat((self.mem_y, y.detach()), 1)[:, : self.n_memories]
        loss = ce_per_run(mlp_forward(self.weights, x), y)
        if self.n_consolidated:
            reg = self.floats("reg")[0] if self.width == 1 else self.hyper("reg")
            total = loss + reg * self.penalty()
        else:
            total = loss
        grads = torch.autograd.grad(total.sum(), self.weights)
        sgd_(self.weights, grads, self.hyper("lr"), self.floats("lr"))
        return loss.detach()


__all__ = ["EWCArray"]
