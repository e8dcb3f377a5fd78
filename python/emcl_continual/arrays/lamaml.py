"""La-MAML as an array (:mod:`..methods.lamaml`): fast weights and learnable learning rates
``alpha`` stacked over the runs, each run's glance order and replay batch drawn from its own
generator, the meta-gradients clipped per run. ``alpha_init`` and ``eta`` per run; the memory,
``replay_batch``, ``glances``, ``second_order``, ``learn_lr`` and ``grad_clip`` shared."""
from __future__ import annotations

import torch

from ..methods.lamaml import LaMAML
from .base import ArrayLearner, ArrayReservoir, ce_per_run, clip_per_run_, mlp_forward, run_view, sgd_


class LaMAMLArray(ArrayLearner):
    """``N`` La-MAML runs."""

    method = LaMAML
    PER_RUN = ("alpha_init", "eta")

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        c = self.configs[0]
        self.glances = int(c["glances"])
        self.replay_batch = int(c["replay_batch"])
        self.second_order = bool(c["second_order"])
        self.learn_lr = bool(c["learn_lr"])
        self.grad_clip = float(c["grad_clip"])
        a0 = self.hyper("alpha_init")
        self.alpha = [(torch.ones_like(w) * run_view(a0, w.dim())).requires_grad_(True) for w in self.weights]
        self.buffer = ArrayReservoir(int(c["memory"]), tuple(info.input_shape), self.generators, self.device)
        self.per_run += ["alpha", "buffer"]

    def learning_rates(self):
        """Each run's effective learning rates ``relu(alpha)`` (stacked, detached)."""
        return [torch.relu(a.detach()) for a in self.alpha]

    def observe(self, x, y, task):
        n_runs, n = y.shape
        rows = torch.arange(n_runs, device=x.device).unsqueeze(1)
        clip = torch.full((n_runs,), self.grad_clip, device=x.device)
        meta = None
        for glance in range(self.glances):
            perm = torch.stack([torch.randperm(n, generator=g) for g in self.generators]).to(x.device)
            x, y = x[rows, perm], y[rows, perm]
            if len(self.buffer) > 0:
                mx, my = self.buffer.sample(self.replay_batch)
                bx, by = torch.cat((mx.reshape(n_runs, mx.shape[1], -1), x.reshape(n_runs, n, -1)), 1), \
                    torch.cat((my, y), 1)
            else:
                bx, by = x, y
            fast = list(self.weights)
            meta_losses = []
            for i in range(n):
                inner = ce_per_run(mlp_forward(fast, x[:, i:i + 1]), y[:, i:i + 1])
                grads = torch.autograd.grad(inner.sum(), fast, create_graph=self.second_order,
                                            retain_graph=self.second_order)
                fast = [w - g * torch.relu(a) for w, g, a in zip(fast, grads, self.alpha)]
                meta_losses.append(ce_per_run(mlp_forward(fast, bx), by))
            if n_runs == 1:       # the run alone's mean over a vector of scalars
                meta = torch.stack([m[0] for m in meta_losses]).mean().reshape(1)
            else:
                meta = torch.stack(meta_losses, 1).mean(1)
            grads = torch.autograd.grad(meta.sum(), self.weights + self.alpha)
            wg, ag = list(grads[:len(self.weights)]), list(grads[len(self.weights):])
            clip_per_run_(wg, clip, [self.grad_clip] * n_runs)
            clip_per_run_(ag, clip, [self.grad_clip] * n_runs)
            if self.learn_lr:
                sgd_(self.alpha, ag, self.hyper("eta"), self.floats("eta"))
            with torch.no_grad():
                for w, g, a in zip(self.weights, wg, self.alpha):
                    w.sub_(g * torch.relu(a))
            if glance == 0:
                self.buffer.add(x.detach(), y.detach())
        return meta.detach()
