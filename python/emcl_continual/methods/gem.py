r"""Gradient Episodic Memory (Lopez-Paz & Ranzato 2017), with its quadratic program solved exactly.

Per incoming batch of task :math:`t` (the GEM code the EMCL paper adopts, footnote 1):

1. write the batch into task :math:`t`'s ring memory (``memory // n_tasks`` slots per task);
2. for every past task :math:`k < t` compute :math:`g_k = \nabla \ell(\text{memory}_k)`;
3. compute the current gradient :math:`g = \nabla \ell(x, y)`;
4. if some :math:`g_k^\top g < 0`, replace :math:`g` by the solution of
   :math:`\min \tfrac12\|g - \tilde g\|^2` s.t. :math:`G\tilde g \ge 0`, through the dual QP
   (see :mod:`._qp`: exact NNLS on the Cholesky-transformed dual, margin = ``margin``,
   ridge ``eps`` = 1e-3 as in the GEM code);
5. one SGD step with :math:`\tilde g`.

Hyper-parameters: Table II gives lr 0.03 and 200 memories for CIFAR100/miniImageNet. For the
MNIST streams the memory is the paper's section V value (200 / 500 samples, i.e. 10 / 5 per
task), and the margin is the MER code's GEM setting for that memory (``mer_examples.sh``:
permutations with 200 memories ``--memory_strength 0.0``, many permutations with 500
memories ``--memory_strength 0.1``); lr 0.03 (those used batch size 1 with lr 0.01 / 0.003,
the paper uses batch size 10). Image streams: margin 0.5 (La-MAML's GEM runs).

The past tasks' gradients (step 2) are computed in one batched call,
``vmap(grad(loss))`` over the stacked task memories, when every past memory holds the same
number of samples and the model has no batch-norm layers (then a per-task loop would give the
same gradients, only ``t`` times slower on many-task streams); otherwise one backward pass per
task, as in the GEM code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..core.schema import BOOL, float_rule, int_rule
from ._qp import gem_project
from ._utils import TaskRingMemory, flat_grad, set_flat_grad
from .base import Method

_DEFAULTS = {
    "permuted-mnist": {"lr": 0.03, "memory": 200, "margin": 0.0, "eps": 1e-3},
    "rotated-mnist": {"lr": 0.03, "memory": 200, "margin": 0.0, "eps": 1e-3},
    "many-permutations": {"lr": 0.03, "memory": 500, "margin": 0.1, "eps": 1e-3},
    "split-cifar100": {"lr": 0.03, "memory": 200, "margin": 0.5, "eps": 1e-3},
    "split-miniimagenet": {"lr": 0.03, "memory": 200, "margin": 0.5, "eps": 1e-3},
}


class GEM(Method):
    """GEM with per-task ring memories and the exact dual QP projection."""

    name = "gem"
    DEFAULTS = _DEFAULTS
    TABLE_II = {"split-cifar100": {"lr": 0.03, "memory": 200}, "split-miniimagenet": {"lr": 0.03, "memory": 200}}
    OPTIONAL = {"batched_memory_grads": True}
    RULES = {"lr": float_rule(open_=True), "memory": int_rule(1), "margin": float_rule(), "eps": float_rule(),
             "batched_memory_grads": BOOL}

    def __init__(self, model: nn.Module, info, config: dict, device: torch.device):
        super().__init__(model, info, config, device)
        per_task = int(self.config["memory"]) // int(info.n_tasks)
        if per_task < 1:
            raise ValueError(f"gem: memory {self.config['memory']} is smaller than the number of tasks {info.n_tasks}")
        self.memory = TaskRingMemory(per_task, info.input_shape, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.margin = float(self.config["margin"])
        self.eps = float(self.config["eps"])
        self.n_projections = 0  # how many steps needed the QP (diagnostic)
        self.batched = bool(self.config.get("batched_memory_grads", True)) and not any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]

    def _grad(self, x: Tensor, y: Tensor, task: int) -> tuple[Tensor, Tensor]:
        self.model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x, task), y)
        loss.backward()
        return flat_grad(self.params), loss.detach()

    def memory_grads(self, past: list[int]) -> Tensor:
        """Rows ``g_k`` = gradient of the mean loss on task ``k``'s memory, for ``k`` in ``past``."""
        mems = [self.memory.get(k) for k in past]
        if self.batched and len({mx.shape[0] for mx, _ in mems}) == 1:
            try:
                return self._memory_grads_vmap(past, mems)
            except (RuntimeError, TypeError, NotImplementedError):
                self.batched = False  # the model does not run under vmap: per-task loop from now on
        return torch.stack([self._grad(mx, my, k)[0] for k, (mx, my) in zip(past, mems)])

    def _memory_grads_vmap(self, past: list[int], mems: list) -> Tensor:
        params = {n: p.detach() for n, p in zip(self._names, self.params)}
        xs = torch.stack([mx for mx, _ in mems])
        ys = torch.stack([my for _, my in mems])
        ts = torch.tensor(past, dtype=torch.long, device=xs.device)

        def loss_fn(prm, x, y, t):
            return F.cross_entropy(functional_call(self.model, prm, (x, t.expand(x.shape[0]))), y)

        grads = vmap(grad(loss_fn), in_dims=(None, 0, 0, 0))(params, xs, ys, ts)
        return torch.cat([grads[n].reshape(len(past), -1) for n in self._names], dim=1)

    def observe(self, x: Tensor, y: Tensor, task: int) -> float:
        self.model.train()
        self.memory.add(x.detach(), y.detach(), task)
        past = [k for k in self.memory.tasks() if k != task]
        G = self.memory_grads(past) if past else None
        g, loss = self._grad(x, y, task)
        if G is not None:
            if bool((G @ g < 0).any()):
                g = gem_project(g, G, self.margin, self.eps)
                self.n_projections += 1
                set_flat_grad(self.params, g)
        self.opt.step()
        return float(loss)
