"""La-MAML as an array (:mod:`..methods.lamaml`): fast weights and learnable learning rates
``alpha`` stacked over the runs, each run's glance order and replay batch drawn from its own
generator, the meta-gradients clipped per run. ``alpha_init`` and ``eta`` per run; the memory,
``replay_batch``, ``glances``, ``second_order``, ``learn_lr`` and ``grad_clip`` shared.

[note: first-order meta-gradients] With ``second_order=False`` (the MNIST streams) the inner
gradients ``g_i`` are constants, so ``fast_k = w - relu(alpha) * G_k`` with ``G_k = sum_{i<=k} g_i``,
and the meta loss ``L = mean_k l(fast_k; b)`` has

    dL/dw = mean_k m_k,    dL/d relu(alpha) = -mean_k m_k * G_k,    m_k = grad l(fast_k; b),

so an array of two or more runs sums these as it goes, by hand (forward, softmax cross-entropy
and backward as batched products over the array, no autograd graph), instead of keeping the
graph of the whole inner loop for one backward pass through it: the same gradients, summed in
another order (to rounding). The inner step ``k + 1`` runs on ``fast_k``'s weights and its sample
is a row of the meta batch, so its pass is a row of meta loss ``k``'s pass: one pass over the
meta batch per inner step serves both. An array of one runs the run alone's autograd code, bit
for bit.

[note: the first layer, implicit] The first weight ``W1`` (784 x 100, nearly all of the bytes
and of the arithmetic) is never materialised as fast weights. Its inner gradients are rank one,
``g_l = d_l x_l^T`` (``d_l`` the inner step's delta at the first layer), so for any input ``t``

    (W1 - A1 * sum_{l<=k} d_l x_l^T) t = W1 t - sum_{l<=k} d_l * (A1 (x_l * t)),    A1 = relu(alpha_W1),

and every product a glance needs is in two batched products made once per glance: ``P = W1 b_j``
and ``Q[l, j] = A1 (x_l * b_j)`` for the ``n`` incoming samples ``x_l`` and the ``m`` rows ``b_j`` of
the meta batch (the incoming samples are its last rows). A step adds ``d_k * Q[k]`` to a running
``[m, 100]`` sum instead of writing ``W1``'s fast copy. Backward, with ``e_kj`` meta loss ``k``'s delta
at the first layer for row ``j``:

    sum_k m_k = (sum_k E_k)^T B,    sum_k m_k * G_k = sum_{l,j} (d_l * F_lj)(x_l * b_j)^T,    F_lj = sum_{k>=l} e_kj,

two more products (ranks ``m`` and ``n * m``). The arithmetic is that of the run alone (the same
``n * m`` first-layer products each way), now in four products over the whole array per glance
instead of some forty small ones per inner step, with ``W1`` and ``alpha_W1`` read once each and no
pass over weight-sized tensors per inner step."""
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
        ([note: first-order meta-gradients]), computed by hand over the array
        ([note: the first layer, implicit]); ``bx`` ends with ``x`` (the meta batch is the
        replay batch followed by the incoming samples, or the incoming samples alone)."""
        N, n = y.shape
        m = by.shape[1]
        W = [w.detach() for w in self.weights]
        A = [torch.relu(a.detach()) for a in self.alpha]
        L = len(W) // 2
        B = bx.reshape(N, m, -1)
        X = x.reshape(N, n, -1)
        t0 = m - n                                   # x_k is row t0 + k of the meta batch
        W1, b1, A1, a1 = W[0], W[1], A[0], A[1]
        H1, D = W1.shape[1], W1.shape[2]
        # layer 1, for every fast weight of the glance at once: P = B W1^T + b1, Q[l, j] = A1 (x_l * b_j)
        P = torch.baddbmm(b1.unsqueeze(1), B, W1.transpose(1, 2))                     # [N, m, H1]
        XB = (X.unsqueeze(2) * B.unsqueeze(1)).reshape(N, n * m, D)                     # [N, n*m, D]
        Q = torch.bmm(XB, A1.transpose(1, 2)).view(N, n, m, H1)                         # [N, n, m, H1]
        R = torch.zeros_like(P)                      # sum_{l<=k} delta_l * Q[l]: the W1 part of the fast weights
        Sb1 = torch.zeros_like(b1)                   # sum_{l<=k} delta_l: the accumulated gradient of b1
        E = P.new_empty((N, n, m, H1))               # the meta deltas at layer 1 of every inner step
        D1 = P.new_empty((N, n, H1))                 # the inner deltas at layer 1
        # the layers above the first (weights 2 .. 2L-1) with materialised fast weights, as the run alone
        fast = [w.clone() for w in W[2:]]
        G = [torch.zeros_like(w) for w in W[2:]]
        dW = [torch.zeros_like(w) for w in W[1:]]   # b1 and the layers above: sum_k m_k
        dR = [torch.zeros_like(w) for w in W[1:]] if self.learn_lr else None     # sum_k m_k * G_k
        onehot = torch.nn.functional.one_hot(by, W[-1].shape[1]).to(B.dtype)           # [N, m, C]
        total = B.new_zeros(N)

        def through(pre1, rows):
            """Forward from layer 1's pre-activations ``[N, r, H1]`` (labels ``rows`` of the meta
            batch) through the fast upper layers, and back: each run's summed loss, the deltas of
            every layer (unscaled: softmax minus one-hot per row) and each layer's inputs."""
            z = [torch.relu(pre1)]
            h = z[0]
            for i in range(L - 1):
                h = torch.baddbmm(fast[2 * i + 1].unsqueeze(1), h, fast[2 * i].transpose(1, 2))
                if i < L - 2:
                    h = torch.relu(h)
                    z.append(h)
            logp = torch.log_softmax(h, dim=2)
            oh = onehot[:, rows]
            loss = -(logp * oh).sum((1, 2))
            delta = logp.exp_().sub_(oh)
            deltas = [None] * L
            deltas[L - 1] = delta
            for i in range(L - 2, -1, -1):
                delta = torch.ops.aten.threshold_backward(torch.bmm(delta, fast[2 * i]), z[i], 0)
                deltas[i] = delta
            return loss, deltas, z

        _, d_in, z_in = through(P[:, t0:t0 + 1], slice(t0, t0 + 1))
        every = slice(0, m)
        for k in range(n):
            # inner step k: its gradients (from the pass at fast_{k-1}; at w for k = 0), then fast_k
            D1[:, k] = d_in[0][:, 0]
            R.addcmul_(Q[:, k], d_in[0])
            Sb1.add_(d_in[0][:, 0])
            for i in range(L - 1):
                g_w = torch.bmm(d_in[i + 1].transpose(1, 2), z_in[i])
                g_b = d_in[i + 1][:, 0]
                fast[2 * i].addcmul_(g_w, A[2 * i + 2], value=-1.0)
                fast[2 * i + 1].addcmul_(g_b, A[2 * i + 3], value=-1.0)
                G[2 * i].add_(g_w)
                G[2 * i + 1].add_(g_b)
            # meta loss k, at fast_k, on the whole meta batch: its row t0 + k + 1 is inner step k + 1's pass
            pre1 = P.sub(R).sub_((a1 * Sb1).unsqueeze(1))
            loss, deltas, z = through(pre1, every)
            total.add_(loss)
            E[:, k] = deltas[0]
            m_b1 = deltas[0].sum(1)
            dW[0].add_(m_b1)
            if dR is not None:
                dR[0].addcmul_(m_b1, Sb1)
            for i in range(L - 1):
                m_w = torch.bmm(deltas[i + 1].transpose(1, 2), z[i])
                m_b = deltas[i + 1].sum(1)
                dW[2 * i + 1].add_(m_w)
                dW[2 * i + 2].add_(m_b)
                if dR is not None:
                    dR[2 * i + 1].addcmul_(m_w, G[2 * i])
                    dR[2 * i + 2].addcmul_(m_b, G[2 * i + 1])
            if k + 1 < n:
                r = t0 + k + 1
                d_in = [d[:, r:r + 1] for d in deltas]
                z_in = [v[:, r:r + 1] for v in z]
        # layer 1: sum_k m_k = (sum_k E_k)^T B; sum_k m_k * G_k = sum_{l, j} (d_l * F[l, j]) (x_l * b_j)^T,
        # F[l] = sum_{k >= l} E_k
        wg = [torch.bmm(E.sum(1).transpose(1, 2), B)] + dW
        ag = None
        if dR is not None:
            F_ = E.flip(1).cumsum(1).flip(1).mul_(D1.unsqueeze(2)).reshape(N, n * m, H1)
            dR = [torch.bmm(F_.transpose(1, 2), XB)] + dR
            ag = [torch.ops.aten.threshold_backward(d, a.detach(), 0) for d, a in zip(dR, self.alpha)]
        return total / (m * n), wg, ag, 1.0 / (m * n)

    def _clip_coef(self, grads, scale):
        """Each run's ``scale`` times ``clip_grad_norm_``'s coefficient for its gradients
        ``scale * grads``: ``[N]``."""
        n = grads[0].shape[0]
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), 2, dim=1) for g in grads], dim=1)
        total = torch.linalg.vector_norm(norms, 2, dim=1).mul_(scale)
        return torch.clamp(self.grad_clip / (total + 1e-6), max=1.0).mul_(scale)

    def _step_first_order(self, wg, ag, scale):
        """The update of :meth:`observe` from :meth:`_meta_grads_first_order`'s sums (the
        weights' ``wg`` and the masked ``-ag`` of the learning rates', both to be multiplied by
        ``scale``): each run's gradients clipped to ``grad_clip``, ``alpha -= eta * grad``, then
        ``w -= relu(alpha) * grad``, the scale and the clipping folded into one coefficient per
        run (no pass over the gradients to scale them)."""
        with torch.no_grad():
            if ag is not None:
                coef = self._clip_coef(ag, scale).mul_(self.hyper("eta"))     # ag is -grad / scale
                for a, g in zip(self.alpha, ag):
                    a.addcmul_(g, run_view(coef, a.dim()))
            coef = self._clip_coef(wg, scale).neg_()
            for w, g, a in zip(self.weights, wg, self.alpha):
                w.addcmul_(g.mul_(run_view(coef, g.dim())), torch.relu(a))

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
                meta, wg, ag, scale = self._meta_grads_first_order(x, y, bx, by)
                self._step_first_order(wg, ag, scale)
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
