"""Experience replay as an array (:mod:`..methods.er`): a reservoir memory per run, each drawn
from its run's generator; ``lr`` per run, ``memory`` and ``replay_batch`` shared."""
from __future__ import annotations

import torch

from ..methods.er import ER
from .base import ArrayLearner, ArrayReservoir, ce_per_run, mlp_forward, sgd_


class ERArray(ArrayLearner):
    """``N`` reservoir-replay runs."""

    method = ER
    PER_RUN = ("lr",)

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        c = self.configs[0]
        self.buffer = ArrayReservoir(int(c["memory"]), tuple(info.input_shape), self.generators, self.device)
        self.replay_batch = int(c["replay_batch"])
        self.per_run.append("buffer")

    def observe(self, x, y, task):
        if len(self.buffer) > 0:
            mx, my = self.buffer.sample(self.replay_batch)
            bx, by = torch.cat((x, mx), 1), torch.cat((y, my), 1)
        else:
            bx, by = x, y
        loss = ce_per_run(mlp_forward(self.weights, bx), by)
        grads = torch.autograd.grad(loss.sum(), self.weights)
        sgd_(self.weights, grads, self.hyper("lr"), self.floats("lr"))
        self.buffer.add(x.detach(), y.detach())
        return loss.detach()
