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

    def _batch(self, bx, by, neg_lr, lr, beta, losses):
        """MER's inner loop over one batch ``bx[N, S, D]`` (labels ``by[N, S]``): one SGD step per
        sample, in order, for every run; then the first layer's within-batch Reptile step.

        [note: the first layer, deferred] The first weight ``W1`` (the largest: 784 x 100) is
        not written at every step. Its change after ``j`` steps is ``sum_{k<j} s_k x_k^T`` (``s_k``
        the step's scaled first-layer delta, ``x_k`` its input), so the step's product
        ``W1_j x_j = W1 x_j + sum_{k<j} s_k (x_k . x_j)`` is read from one product of ``W1`` with
        the whole batch (``P``) and the batch's Gram matrix ``G``; the Reptile step
        ``W1 <- W1 + beta (W1_S - W1)`` is then one rank-``S`` update. The same arithmetic as a
        write per step, in another order (to rounding), with ``W1`` read once and written once per
        batch instead of twice per sample: ``W1`` of every run of a wide array no longer fits a
        core's cache, and these passes were most of a step. The first bias is deferred the same
        way (``b1_j = b1 + sum_{k<j} s_k``: ``P`` carries ``b1`` and ``G`` holds ``x_k . x_j + 1``,
        so one product gives the step's first layer; its Reptile step is ``b1 <- b1 + beta
        sum_k s_k``). Returns nothing; every layer after the first is stepped as it goes (the
        caller interpolates them)."""
        W = self.weights
        layers = len(W) // 2
        n, S, _ = bx.shape
        # row vectors ([N, 1, features]) times transposed weights: torch's CPU bmm runs these
        # shapes 2-3x faster than weights times column vectors
        P = torch.baddbmm(W[1].unsqueeze(1), bx, W[0].transpose(1, 2))    # [N, S, H]: W1 x_j + b1
        G = torch.baddbmm(bx.new_ones(()).expand(n, S, S), bx, bx.transpose(1, 2))  # x_j . x_k + 1
        steps = bx.new_zeros((n, S, W[0].shape[1]))                  # s_k, one row per step
        onehot = F.one_hot(by, self.n_classes).to(bx.dtype)         # [N, S, C]
        logps = onehot.new_empty(onehot.shape)                       # each step's log-probabilities
        # every per-step view made once per batch (views are a dispatch each)
        rows = zip(P.split(1, 1), G.split(1, 1), steps.split(1, 1), onehot.split(1, 1), logps.split(1, 1))
        bias = [None] + [W[2 * i + 1].unsqueeze(1) for i in range(1, layers)]
        weight_t = [None] + [W[2 * i].transpose(1, 2) for i in range(1, layers)]
        for j, (p_j, g_j, s_j, oh, lp_j) in enumerate(rows):
            h = torch.baddbmm(p_j, g_j, steps).relu_()
            acts = [None, h]
            for i in range(1, layers):
                h = torch.baddbmm(bias[i], h, weight_t[i])
                if i < layers - 1:
                    h = h.relu_()
                acts.append(h)
            logp = torch.log_softmax(h, dim=2)
            lp_j.copy_(logp)
            delta = logp.exp_().sub_(oh)
            deltas = [None] * layers
            deltas[-1] = delta
            for i in range(layers - 1, 0, -1):
                delta = torch.ops.aten.threshold_backward(torch.bmm(delta, W[2 * i]), acts[i], 0)
                deltas[i - 1] = delta
            scale = neg_lr
            if self.grad_clip > 0:
                sq = (deltas[0] * deltas[0]).sum(2) * G[:, j, j].unsqueeze(1)
                for d, a in zip(deltas[1:], acts[1:-1]):
                    sq = sq + (d * d).sum(2) * (1.0 + (a * a).sum(2))
                norm = sq.sqrt().unsqueeze(2)
                scale = torch.where(norm > self.grad_clip, -lr * self.grad_clip / (norm + 1e-6), neg_lr)
            torch.mul(deltas[0], scale, out=s_j)
            for i in range(1, layers):
                si = deltas[i] * scale
                W[2 * i].baddbmm_(si.transpose(1, 2), acts[i])
                bias[i].add_(si)
        losses.sub_((logps * onehot).sum((1, 2), keepdim=True))
        steps.mul_(run_view(beta, 3))                                # W1's and b1's within-batch Reptile
        W[0].baddbmm_(steps.transpose(1, 2), bx)
        W[1].add_(steps.sum(1))

    def observe(self, x, y, task):
        n = self.width
        lr = run_view(self.hyper("lr"), 3)
        neg_lr = -lr
        beta = self.hyper("beta")
        gamma = float(self.configs[0]["gamma"])
        use_gamma = gamma != 1.0
        W = self.weights
        upper = W[2:]                                   # the first layer's Reptile is _batch's own
        snap = [torch.empty_like(w) for w in upper]
        betas = [run_view(beta, w.dim()) for w in upper]
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
                    torch._foreach_copy_(snap, upper)
                    if len(self.buffer) > 0:
                        mx, my = self.buffer.sample(self.replay_batch)
                        bx = torch.cat((xi.reshape(n, 1, -1), mx.reshape(n, mx.shape[1], -1)), 1)
                        by = torch.cat((yi, my), 1)
                    else:
                        bx, by = xi.reshape(n, 1, -1), yi
                    self._batch(bx.contiguous(), by, neg_lr, lr, beta, losses)
                    count += bx.shape[1]
                    torch._foreach_sub_(upper, snap)        # within-batch Reptile
                    torch._foreach_mul_(upper, betas)
                    torch._foreach_add_(upper, snap)
                if use_gamma:
                    for w, a0 in zip(W, start):       # across-batch Reptile
                        w.sub_(a0).mul_(gamma).add_(a0)
                self.buffer.add(xi, yi)
        return losses.reshape(n) / max(count, 1)
