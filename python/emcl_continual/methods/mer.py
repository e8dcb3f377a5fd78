r"""Meta-Experience Replay, Algorithm 1 of Riemer et al. (ICLR 2019).

For every incoming example :math:`(x, y)` (the incoming batch is taken one example at a time):

.. math::
    \theta_{A_0} &\leftarrow \theta \\
    \text{for } i = 1..s:&\quad \theta_{W_{i,0}} \leftarrow \theta;\;
        B_i \leftarrow \{(x, y)\} \cup \text{sample}(M, k) \\
    &\quad \text{for } (x_j, y_j) \in B_i:\ \theta \leftarrow \theta - \alpha \nabla \ell(\theta; x_j, y_j)
        \quad\text{(one SGD step per sample)} \\
    &\quad \theta \leftarrow \theta_{W_{i,0}} + \beta (\theta - \theta_{W_{i,0}})
        \quad\text{(within-batch Reptile)} \\
    \theta &\leftarrow \theta_{A_0} + \gamma (\theta - \theta_{A_0})
        \quad\text{(across-batch Reptile)}

and then :math:`(x, y)` enters the reservoir memory :math:`M`.

Hyper-parameters (the EMCL paper quotes MER's published numbers, so MER's own settings are
used; ``mer_examples.sh`` of the MER code, "MER (Algorithm 1)"): MNIST permutations with 200
memories: ``lr`` (alpha) 0.03, ``beta`` 0.03, ``gamma`` 1.0, replay batch ``k`` 10,
``batches_per_example`` (s) 10; many permutations with 500 memories: lr 0.03, beta 0.03,
gamma 1.0, k 5, s 10. MER is not run on the image streams in the paper; the La-MAML code's
CIFAR settings (lr 0.1, beta 0.1, gamma 1, k 25, s 10, grad clip 10) are the defaults there.

The per-sample SGD steps dominate the cost (about :math:`n \cdot s (k+1)` steps for
:math:`n` examples). For a plain ReLU MLP (the MNIST model) the step is computed with
hand-written forward/backward matrix-vector products instead of autograd, which gives the same
update (checked against autograd on a probe at construction time and in the tests) several
times faster (BLAS ``gemv`` / ``ger`` on NumPy views of the weights); any other model, or a GPU,
takes the autograd path.
"""
from __future__ import annotations

import contextlib

import numpy as np
import scipy.linalg.blas
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.schema import BOOL, float_rule, int_rule
from .base import Method
from .replay import ReservoirBuffer

_DEFAULTS = {
    "permuted-mnist": {"lr": 0.03, "beta": 0.03, "gamma": 1.0, "memory": 200, "replay_batch": 10,
                       "batches_per_example": 10, "grad_clip": 0.0},
    "rotated-mnist": {"lr": 0.03, "beta": 0.03, "gamma": 1.0, "memory": 200, "replay_batch": 10,
                      "batches_per_example": 10, "grad_clip": 0.0},
    "many-permutations": {"lr": 0.03, "beta": 0.03, "gamma": 1.0, "memory": 500, "replay_batch": 5,
                          "batches_per_example": 10, "grad_clip": 0.0},
    "split-cifar100": {"lr": 0.1, "beta": 0.1, "gamma": 1.0, "memory": 200, "replay_batch": 25,
                       "batches_per_example": 10, "grad_clip": 10.0},
    "split-miniimagenet": {"lr": 0.1, "beta": 0.1, "gamma": 1.0, "memory": 200, "replay_batch": 25,
                           "batches_per_example": 10, "grad_clip": 10.0},
}


def _one_blas_thread():
    """Context limiting NumPy's BLAS to one thread (a no-op context without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn (mlxtend)
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


class _ReluMLPStepper:
    """Per-sample SGD on a model that computes ``Linear -> ReLU -> ... -> Linear`` on flattened input.

    Works on NumPy views of the model's own (CPU, float32) weight tensors and calls BLAS
    ``gemv`` / ``ger`` directly (in place), which avoids the per-operation dispatch cost that
    dominates for one sample at a time. Built only after :meth:`build` confirmed on random
    probes that the model's forward equals this computation.
    """

    def __init__(self, linears: list[nn.Linear]):
        # W^T as (in, out) Fortran-ordered views of the (out, in) C-ordered weights: no copies.
        self.WT = [m.weight.data.numpy().T for m in linears]
        self.b = [m.bias.data.numpy() for m in linears]
        self._gemv, self._ger = scipy.linalg.blas.get_blas_funcs(("gemv", "ger"), (self.WT[0],))

    @staticmethod
    def build(model: nn.Module, info, device: torch.device) -> "_ReluMLPStepper | None":
        if getattr(info, "multi_head", False) or torch.device(device).type != "cpu":
            return None
        params = list(model.parameters())
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not linears or any(m.bias is None for m in linears):
            return None
        if any(p.dtype != torch.float32 or not p.is_contiguous() for p in params):
            return None
        if sum(m.weight.numel() + m.bias.numel() for m in linears) != sum(p.numel() for p in params):
            return None  # the model has parameters outside its Linear layers
        stepper = _ReluMLPStepper(linears)
        gen = torch.Generator().manual_seed(1234)
        probe = torch.randn((7, *tuple(info.input_shape)), generator=gen)
        with torch.no_grad():
            try:
                ref = model(probe, 0)
            except Exception:
                return None
            out = torch.from_numpy(np.stack([stepper.forward(r) for r in probe.reshape(7, -1).numpy()]))
        if ref.shape != out.shape or not torch.allclose(ref, out, rtol=1e-4, atol=1e-5):
            return None
        return stepper

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Logits of one flattened example."""
        h = np.ascontiguousarray(x, dtype=np.float32)
        for i, (WT, b) in enumerate(zip(self.WT, self.b)):
            h = self._gemv(1.0, WT, h, beta=1.0, y=b, trans=1)
            if i < len(self.WT) - 1:
                np.maximum(h, 0.0, out=h)
        return h

    def sgd_step(self, x: np.ndarray, y: int, lr: float, grad_clip: float) -> float:
        """One SGD step on the cross-entropy of one flattened example; returns its loss."""
        acts = [x]
        h = x
        last = len(self.WT) - 1
        for i, (WT, b) in enumerate(zip(self.WT, self.b)):
            h = self._gemv(1.0, WT, h, beta=1.0, y=b, trans=1)  # W h + b (a new array)
            if i < last:
                np.maximum(h, 0.0, out=h)
            acts.append(h)
        z = acts[-1] - acts[-1].max()
        e = np.exp(z)
        total = e.sum()
        loss = float(np.log(total) - z[y])
        delta = e / total
        delta[y] -= 1.0
        deltas = [None] * len(self.WT)
        deltas[last] = delta
        for i in range(last, 0, -1):
            delta = self._gemv(1.0, self.WT[i], delta) * (acts[i] > 0)
            deltas[i - 1] = delta
        scale = lr
        if grad_clip > 0:
            sq = sum(float(d @ d) * (1.0 + float(a @ a)) for d, a in zip(deltas, acts[:-1]))
            norm = sq ** 0.5
            if norm > grad_clip:
                scale = lr * grad_clip / (norm + 1e-6)
        for WT, b, d, a in zip(self.WT, self.b, deltas, acts[:-1]):
            self._ger(-scale, a, d, a=WT, overwrite_a=1)  # W^T += -scale a d^T, in place
            b -= scale * d
        return loss


class MER(Method):
    """MER Algorithm 1 (per-example Reptile over replay batches) with a reservoir memory."""

    name = "mer"
    DEFAULTS = _DEFAULTS
    OPTIONAL = {"fast_mlp": True}
    RULES = {"lr": float_rule(open_=True), "beta": float_rule(open_=True), "gamma": float_rule(open_=True),
             "memory": int_rule(1), "replay_batch": int_rule(1), "batches_per_example": int_rule(1),
             "grad_clip": float_rule(note="0: no clipping"), "fast_mlp": BOOL}

    def __init__(self, model: nn.Module, info, config: dict, device: torch.device):
        super().__init__(model, info, config, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr = float(self.config["lr"])
        self.beta = float(self.config["beta"])
        self.gamma = float(self.config["gamma"])
        self.grad_clip = float(self.config["grad_clip"])
        self.steps = int(self.config["batches_per_example"])
        self.replay_batch = int(self.config["replay_batch"])
        self.buffer = ReservoirBuffer(int(self.config["memory"]), tuple(info.input_shape), self.generator,
                                      device=device)  # on the model's device: no host round trips
        self._snap = [torch.empty_like(p) for p in self.params]   # theta_{W_i,0}
        self._start = [torch.empty_like(p) for p in self.params]  # theta_{A_0}
        use_fast = bool(self.config.get("fast_mlp", True))
        self._stepper = _ReluMLPStepper.build(model, info, device) if use_fast else None

    def make_optimizer(self):
        """None: MER steps the weights itself (per-sample SGD with ``lr``, then the Reptile
        interpolations with ``beta`` and ``gamma``)."""
        return None

    @property
    def uses_fast_path(self) -> bool:
        """Whether the hand-written ReLU-MLP per-sample step is in use."""
        return self._stepper is not None

    def _sgd_step_autograd(self, x: Tensor, y: Tensor, task: Tensor | int) -> float:
        self.model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x, task), y)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)
        return float(loss.detach())

    def _batch(self, x: Tensor, y: Tensor, task: int) -> tuple[Tensor, Tensor, Tensor]:
        """The current example followed by ``replay_batch`` memories (as in the MER code), and
        their task ids (a tensor on the buffer's device: no read on the host)."""
        tx = torch.full((x.shape[0],), task, dtype=torch.long, device=x.device)
        if len(self.buffer) == 0:
            return x, y, tx
        mx, my, mt = self.buffer.sample(self.replay_batch)
        return torch.cat((x, mx)), torch.cat((y, my)), torch.cat((tx, mt))

    def observe(self, x: Tensor, y: Tensor, task: int) -> float:
        if self._stepper is not None:
            # one BLAS thread: a multi-threaded rank-1 update of a 784 x 100 matrix is ~30x slower
            with _one_blas_thread():
                return self._observe(x, y, task)
        return self._observe(x, y, task)

    def _observe(self, x: Tensor, y: Tensor, task: int) -> float:
        self.model.train()
        total, count = 0.0, 0
        with torch.no_grad():
            for n in range(x.shape[0]):
                xi, yi = x[n : n + 1], y[n : n + 1]
                if self.gamma != 1.0:
                    for a0, p in zip(self._start, self.params):
                        a0.copy_(p)
                for _ in range(self.steps):
                    for w0, p in zip(self._snap, self.params):
                        w0.copy_(p)
                    bx, by, bt = self._batch(xi, yi, task)
                    if self._stepper is not None:
                        flat = bx.reshape(bx.shape[0], -1).to(torch.float32).contiguous().numpy()
                        labels = by.tolist()
                        for j in range(flat.shape[0]):
                            total += self._stepper.sgd_step(flat[j], labels[j], self.lr, self.grad_clip)
                    else:
                        with torch.enable_grad():
                            for j in range(bx.shape[0]):
                                total += self._sgd_step_autograd(bx[j : j + 1], by[j : j + 1], bt[j : j + 1])
                    count += bx.shape[0]
                    for p, w0 in zip(self.params, self._snap):  # within-batch Reptile
                        p.sub_(w0).mul_(self.beta).add_(w0)
                if self.gamma != 1.0:
                    for p, a0 in zip(self.params, self._start):  # across-batch Reptile
                        p.sub_(a0).mul_(self.gamma).add_(a0)
                self.buffer.add(xi.detach(), yi.detach(), task)
        return total / max(count, 1)
