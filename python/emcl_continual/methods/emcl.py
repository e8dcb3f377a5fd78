"""EMCL (paper Algorithm 1) driven by :class:`emcl_kernels.FusedEMCLOptimizer`.

Per incoming batch ``b`` of task ``t``:

1. draw ``replay`` samples from the reservoir buffer (when ``memory`` > 0);
2. **inner loop**, one sample at a time over the batch (and the replayed samples when
   ``inner_replay``): ``loss(x_k).backward(); opt.inner_step()`` -- the proximal step of
   eqs. 14-15/19 (or the plain gradient step on eq. 6 with ``prox=False``);
3. **meta step**: the meta-loss on the batch (plus the replayed samples when
   ``meta_replay``) at the adapted weights θ_k, ``backward``, ``opt.meta_step()`` -- the
   importance update (eq. 7, Taylor or SI), the meta learning rates (eq. 8, ``lr_mode``)
   and the closed-form meta-update (eq. 10), after which θ = θ₀;
4. offer the batch to the reservoir buffer.

``glances`` > 1 repeats steps 1-3 on the same incoming batch (a fresh replay draw each time),
as La-MAML's code base lets its methods do (``--glances``; La-MAML itself runs 5 on MNIST
Permutations and 10 on Many Permutations): still a single pass over the stream, with more
meta steps per batch. The MNIST streams default to 2 (measured on Permuted MNIST, 5 paired
seeds, ``results/ablation_permuted_mnist``); the image streams keep 1 (not measured). ``shuffle_inner`` visits
the incoming and replayed samples of the inner loop in a random order instead of the incoming
ones first.

Ablation (paper Table IV, third column) ``inner_lr_modulation=True``: no regularization in
the inner loop; each inner step is θ ← θ − α ⊙ g with α the per-element meta learning
rates the optimizer holds (La-MAML style), clipped to ``[0, modulation_lr_max]``.

On a GPU (``cuda_graph="auto"``, the default) each glance is captured in a CUDA graph and
replayed (:mod:`emcl_continual.graphed`: static input buffers, one graph per shape, the
optimizer built with ``capturable=True``); ``cuda_graph=False`` keeps the eager loop below,
``cuda_graph=True`` also runs the static-buffer routine on the CPU (eagerly, bit for bit the
eager loop).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import presets
from ..graphed import GlanceRoutine, graph_plan
from ..replay import ReservoirBuffer
from ..streams import StreamInfo
from .base import Method

__all__ = ["EMCL", "OPTIMIZER_KEYS"]

# Config keys handed to FusedEMCLOptimizer as per-group hyper-parameters.
OPTIMIZER_KEYS = ("meta_lr", "inner_lr", "reg", "gamma", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max",
                  "eps", "importance", "prox")

# The open choices of SPEC section 2, settled by the ablation on Permuted MNIST
# (results/ablation_permuted_mnist.md); lr_scale=None means 1/reg.
ABLATION_DEFAULTS = {"lr_mode": "inverse", "lr_scale": None, "decay": 0.9}


class EMCL(Method):
    """Efficient Meta-learning for Continual Learning with the fused optimizer."""

    name = "emcl"

    @classmethod
    def defaults(cls, stream: str) -> dict:
        cfg = presets.paper_values("emcl", stream)  # Table II: meta_lr, inner_lr, reg, gamma; memory
        if stream == "permuted-mnist":
            # Table II's β = 0.15 diverges from single-sample inner steps here (SPEC section 6:
            # ACC 21.6 without replay, 62.0 at β = 0.1 with replay); the ablation measures it.
            cfg["inner_lr"] = 0.03
        # two visits of each incoming batch on the MNIST streams (see the module docstring)
        glances = 2 if stream in ("permuted-mnist", "many-permutations") else 1
        cfg.update(ABLATION_DEFAULTS)
        cfg.update({
            "importance": "taylor",
            "prox": True,
            "replay": presets.BATCH_SIZE,  # replayed samples per incoming batch
            "inner_replay": True,          # the inner loop also visits the replayed samples
            "meta_replay": True,           # the meta-loss also covers them
            "shuffle_inner": False,        # inner loop in random order (else: incoming samples first)
            "glances": glances,            # inner loop + meta step repeated on each incoming batch
            "inner_lr_modulation": False,  # Table IV ablation: α as inner lr, no inner regularization
            "modulation_lr_max": None,     # clip of α in that ablation (None: meta_lr)
            "backend": "auto",
            "cuda_graph": "auto",          # glances replayed from CUDA graphs on a GPU (graphed.py)
        })
        return cfg

    def __init__(self, model: nn.Module, info: StreamInfo, config: dict, device: torch.device):
        super().__init__(model, info, config, device)
        from emcl_kernels import FusedEMCLOptimizer

        cfg = self.config
        hyper = {k: cfg[k] for k in OPTIMIZER_KEYS if k in cfg and cfg[k] is not None}
        if "lr_scale" not in hyper:
            hyper["lr_scale"] = 1.0 / float(cfg["reg"]) if float(cfg.get("reg", 0.0)) > 0 else 1.0
        self.hyper = hyper
        use_routine, capture, why_not = graph_plan(cfg, self.device)
        self.opt = FusedEMCLOptimizer(model.parameters(), backend=cfg.get("backend", "auto"),
                                      capturable=capture, **hyper)
        self.memory = int(cfg.get("memory", 0) or 0)
        self.n_replay = int(cfg.get("replay", 0) or 0)
        self.inner_replay = bool(cfg.get("inner_replay", True))
        self.meta_replay = bool(cfg.get("meta_replay", True))
        self.shuffle_inner = bool(cfg.get("shuffle_inner", False))
        self.glances = cfg.get("glances", 1)
        if isinstance(self.glances, bool) or not isinstance(self.glances, int) or self.glances < 1:
            raise ValueError(f"emcl: glances must be an integer >= 1, got {self.glances!r}")
        self.modulation = bool(cfg.get("inner_lr_modulation", False))
        mod_max = cfg.get("modulation_lr_max")
        self.modulation_lr_max = float(hyper["meta_lr"] if mod_max is None else mod_max)
        self.gen = self._generator(1)
        self.buffer = ReservoirBuffer(self.memory, info.input_shape, self.gen, device=self.device) \
            if self.memory > 0 else None
        self.routine = GlanceRoutine(self, capture=capture) if use_routine else None
        if why_not is not None:
            warnings.warn(f"emcl: no CUDA graphs on {self.device}: {why_not}; the glances run eagerly",
                          RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------------
    def _loss(self, x: torch.Tensor, y: torch.Tensor, t) -> torch.Tensor:
        return F.cross_entropy(self.model(x, t), y)

    @torch.no_grad()
    def _modulated_inner_step(self) -> None:
        """θ ← θ − α ⊙ g with the optimizer's current meta learning rates α (Table IV ablation)."""
        group = self.opt.param_groups[0]
        mode, a0 = group["lr_mode"], float(group["meta_lr"])
        for p in (q for g in self.opt.param_groups for q in g["params"]):
            if p.grad is None:
                continue
            state = self.opt.state.get(p, {})
            if mode == "recurrent" and "meta_lr" in state:
                alpha = state["meta_lr"]
            elif mode == "inverse" and "importance" in state:
                alpha = a0 * float(group["lr_scale"]) / (state["importance"] + float(group["eps"]))
                alpha = alpha.clamp(float(group["lr_min"]), float(group["lr_max"]))
            else:
                alpha = torch.full_like(p, a0, dtype=torch.float32)
            alpha = alpha.clamp(0.0, self.modulation_lr_max)
            p.sub_((alpha * p.grad.float()).to(p.dtype))

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: int) -> float:
        self.model.train()
        tb = torch.full((x.shape[0],), int(task), dtype=torch.long, device=x.device)
        for _ in range(self.glances):
            loss = self._glance(x, y, tb)
        if self.buffer is not None:
            self.buffer.add(x, y, task)
        return float(loss)  # the routine's loss is a device tensor: one read per batch

    def _glance(self, x: torch.Tensor, y: torch.Tensor, tb: torch.Tensor) -> float | torch.Tensor:
        """One inner loop over the batch (and replayed samples) and one meta step; the meta-loss
        (a device tensor from the static-buffer routine)."""
        if self.routine is not None:
            return self.routine.glance(x, y, tb)
        opt = self.opt
        if self.buffer is not None and len(self.buffer) > 0 and self.n_replay > 0:
            xr, yr, tr = self.buffer.sample(self.n_replay)
        else:
            xr = yr = tr = None

        # inner loop: one sample at a time
        if xr is not None and self.inner_replay:
            xi, yi, ti = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([tb, tr])
        else:
            xi, yi, ti = x, y, tb
        if self.shuffle_inner:
            order = torch.randperm(xi.shape[0], generator=self.gen).to(xi.device)
            xi, yi, ti = xi[order], yi[order], ti[order]
        self.model.zero_grad(set_to_none=True)
        for k in range(xi.shape[0]):
            self._loss(xi[k:k + 1], yi[k:k + 1], ti[k:k + 1]).backward()
            if self.modulation:
                self._modulated_inner_step()
            else:
                opt.inner_step()
            self.model.zero_grad(set_to_none=True)

        # meta step on the batch (and the replayed samples)
        if xr is not None and self.meta_replay:
            xm, ym, tm = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([tb, tr])
        else:
            xm, ym, tm = x, y, tb
        loss = self._loss(xm, ym, tm)
        loss.backward()
        opt.meta_step()
        self.model.zero_grad(set_to_none=True)
        return float(loss.detach())
