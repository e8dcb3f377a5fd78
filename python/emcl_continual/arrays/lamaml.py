"""La-MAML as an array (:mod:`..methods.lamaml`): fast weights and learnable learning rates
``alpha`` stacked over the runs, each run's glance order and replay batch drawn from its own
generator, the meta-gradients clipped per run. ``alpha_init`` and ``eta`` per run; the memory,
``replay_batch``, ``glances``, ``second_order``, ``learn_lr`` and ``grad_clip`` shared.

[note: first-order meta-gradients] With ``second_order=False`` (the MNIST streams) the inner
gradients ``g_i`` are constants, so ``fast_k = w - relu(alpha) * G_k`` with ``G_k = sum_{i<k} g_i``,
and the meta loss ``L = mean_k l(fast_k; b)`` has

    dL/dw = mean_k m_k,    dL/d relu(alpha) = -mean_k m_k * G_k,    m_k = grad l(fast_k; b),

so an array of two or more runs sums these as it goes (each ``m_k`` from a small graph of its
own) instead of keeping the graph of the whole inner loop for one backward pass through it: the
same gradients, summed in another order (to rounding), with a few passes over the weights per
step where autograd's backward made some twenty (the elementwise ops on weight-sized tensors
were most of an array's time). An array of one runs the run alone's autograd code, bit for bit."""
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

    def _meta_grads_first_order(self, x, y, bx, by):
        """The meta loss ``[N]`` and its gradients with respect to the weights and ``alpha``
        ([note: first-order meta-gradients])."""
        n = y.shape[1]
        ra = [torch.relu(a.detach()) for a in self.alpha]
        dw = [torch.zeros_like(w) for w in self.weights]
        dra = [torch.zeros_like(w) for w in self.weights]
        G = [torch.zeros_like(w) for w in self.weights]
        fast = [w.detach() for w in self.weights]
        total = None
        for i in range(n):
            leaves = [f.requires_grad_(True) for f in fast]
            inner = ce_per_run(mlp_forward(leaves, x[:, i:i + 1]), y[:, i:i + 1])
            grads = torch.autograd.grad(inner.sum(), leaves)
            with torch.no_grad():
                fast = [f - g * r for f, g, r in zip(fast, grads, ra)]
                for acc, g in zip(G, grads):
                    acc.add_(g)
            leaves = [f.requires_grad_(True) for f in fast]
            meta_i = ce_per_run(mlp_forward(leaves, bx), by)
            m = torch.autograd.grad(meta_i.sum(), leaves)
            with torch.no_grad():
                for a_w, a_r, mk, gk in zip(dw, dra, m, G):
                    a_w.add_(mk)
                    a_r.addcmul_(mk, gk)
                fast = [f.detach() for f in fast]
            total = meta_i.detach() if total is None else total + meta_i.detach()
        with torch.no_grad():
            wg = [d.div_(n) for d in dw]
            ag = [torch.ops.aten.threshold_backward(d.div_(-n), a.detach(), 0) for d, a in zip(dra, self.alpha)]
        return total / n, wg, ag

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
            if n_runs > 1 and not self.second_order:
                meta, wg, ag = self._meta_grads_first_order(x, y, bx, by)
            else:
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
