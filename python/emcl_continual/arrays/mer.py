"""MER as an array (:mod:`..methods.mer`), in torch: the one-sample SGD steps of every run at
once, written by hand (forward, softmax cross-entropy, backward, rank-one updates: the
computation of the run alone's NumPy stepper) as batched matrix products over the array.
``lr`` and ``beta`` per run; ``gamma``, the memory, ``replay_batch``, ``batches_per_example``
and ``grad_clip`` shared (``gamma`` decides whether the across-batch step is taken at all: an
interpolation with 1 does not give the weights back bit for bit).

The run alone steps with NumPy's BLAS (``gemv``/``ger``), this with torch's ``baddbmm``: the
same arithmetic in another order, so an array's MER runs agree with the runs alone to rounding,
not bit for bit; their draws are the same (the tests record them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..methods.mer import MER
from .base import ArrayLearner, ArrayReservoir, run_view


class MERArray(ArrayLearner):
    """``N`` MER runs (Algorithm 1: per-example Reptile over replay batches)."""

    method = MER
    PER_RUN = ("lr", "beta")

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        c = self.configs[0]
        self.steps = int(c["batches_per_example"])
        self.replay_batch = int(c["replay_batch"])
        self.grad_clip = float(c["grad_clip"])
        self.buffer = ArrayReservoir(int(c["memory"]), tuple(info.input_shape), self.generators, self.device)
        self.n_classes = int(info.n_classes)
        self.per_run.append("buffer")

    def _sgd_step(self, x, onehot, neg_lr, lr, losses):
        """One SGD step of every run on its one sample ``x[N, D, 1]`` (a column; labels
        ``onehot[N, C, 1]``); adds each run's loss into ``losses[N, 1, 1]``. Column vectors make
        every product a batched ``gemv`` on the weights as stored (``[N, out, in]``) and every
        update an in-place outer product."""
        W = self.weights
        layers = len(W) // 2
        acts = [x]
        h = x
        for i in range(layers):
            h = torch.baddbmm(W[2 * i + 1].unsqueeze(2), W[2 * i], h)
            if i < layers - 1:
                h = h.relu_()
            acts.append(h)
        logp = torch.log_softmax(h, dim=1)
        losses.sub_((logp * onehot).sum(1, keepdim=True))
        delta = logp.exp_().sub_(onehot)
        deltas = [None] * layers
        deltas[-1] = delta
        for i in range(layers - 1, 0, -1):
            delta = torch.ops.aten.threshold_backward(torch.bmm(W[2 * i].transpose(1, 2), delta), acts[i], 0)
            deltas[i - 1] = delta
        scale = neg_lr
        if self.grad_clip > 0:
            sq = sum((d * d).sum(1) * (1.0 + (a * a).sum(1)) for d, a in zip(deltas, acts[:-1]))
            norm = sq.sqrt().unsqueeze(2)
            scale = torch.where(norm > self.grad_clip, -lr * self.grad_clip / (norm + 1e-6), neg_lr)
        for i in range(layers):
            s = deltas[i] * scale
            W[2 * i].addcmul_(s, acts[i].transpose(1, 2))
            W[2 * i + 1].add_(s.squeeze(2))

    def observe(self, x, y, task):
        n = self.width
        lr = run_view(self.hyper("lr"), 3)
        neg_lr = -lr
        beta = self.hyper("beta")
        gamma = float(self.configs[0]["gamma"])
        use_gamma = gamma != 1.0
        W = self.weights
        snap = [torch.empty_like(w) for w in W]
        start = [torch.empty_like(w) for w in W] if use_gamma else None
        losses = x.new_zeros((n, 1, 1))
        count = 0
        with torch.no_grad():
            for e in range(x.shape[1]):
                xi, yi = x[:, e:e + 1], y[:, e:e + 1]
                if use_gamma:
                    for a0, w in zip(start, W):
                        a0.copy_(w)
                for _ in range(self.steps):
                    for w0, w in zip(snap, W):
                        w0.copy_(w)
                    if len(self.buffer) > 0:
                        mx, my = self.buffer.sample(self.replay_batch)
                        bx = torch.cat((xi.reshape(n, 1, -1), mx.reshape(n, mx.shape[1], -1)), 1)
                        by = torch.cat((yi, my), 1)
                    else:
                        bx, by = xi.reshape(n, 1, -1), yi
                    onehot = F.one_hot(by, self.n_classes).to(bx.dtype).unsqueeze(3)   # [N, S, C, 1]
                    cols = bx.unsqueeze(3)                                               # [N, S, D, 1]
                    for j in range(bx.shape[1]):
                        self._sgd_step(cols[:, j], onehot[:, j], neg_lr, lr, losses)
                    count += bx.shape[1]
                    for w, w0 in zip(W, snap):        # within-batch Reptile
                        w.sub_(w0).mul_(run_view(beta, w.dim())).add_(w0)
                if use_gamma:
                    for w, a0 in zip(W, start):       # across-batch Reptile
                        w.sub_(a0).mul_(gamma).add_(a0)
                self.buffer.add(xi, yi)
        return losses.reshape(n) / max(count, 1)
