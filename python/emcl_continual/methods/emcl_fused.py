"""EMCL's inner loop on the MLP through the fused glance (:mod:`emcl_kernels.glance`).

The eager inner loop of :class:`~emcl_continual.methods.emcl.EMCL` runs, per sample,
``F.cross_entropy(model(x), y).backward(); opt.inner_step()``: about 25 torch ops and an
optimizer step per one-sample step. On the MLP streams the whole inner loop of a glance is one
call of ``torch.ops.emcl.mlp_glance_`` instead: the same steps in the same order (forward,
cross-entropy backward, the inner update of every layer, with the optimizer's own θ₀, h, β, λ,
γ and ``prox``), the gradient formed inside the update. The meta step stays as it is (a batch
forward/backward and ``opt.meta_step()``).

**When it runs** (``fused_glance``, default ``"auto"``): the model is the MLP
(:class:`emcl_continual.data.models.MLP`) with fp32 parameters, the glance runs on the eager path
(on the CPU by default; on a GPU only with ``cuda_graph=False``, where the extension's CUDA
kernel or Triton runs it), and the inner step is EMCL's own. Otherwise the inner loop stays on
autograd, and :func:`fused_plan` says why:

* ``inner_lr_modulation`` (the Table IV ablation): its inner step is θ ← θ − α ⊙ g with the
  per-element meta learning rates, not EMCL's proximal step;
* ``importance_norm="tensor"``: one γ per tensor (the glance takes one γ per run);
* the ResNet streams: the glance is an MLP kernel;
* the CUDA-graph routine (a GPU's default): it captures the autograd inner loop;
* an optimizer ``backend`` other than ``auto`` or the device's compiled one (``foreach``,
  ``reference``, ``triton``): the run asked for that backend's inner steps.

``fused_glance=True`` asks for it and refuses a configuration it does not cover; ``False``
keeps autograd. A step whose gradient is not finite is skipped as the optimizer's
``check_finite`` skips it (``FusedGlance.skipped`` counts them).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from emcl_kernels.glance import glance_unavailable_reason

__all__ = ["fused_plan", "FusedGlance", "FUSED_CHOICES"]

FUSED_CHOICES = ("auto", True, False)


def fused_plan(config: dict, model, device, *, eager: bool) -> tuple[bool, Optional[str]]:
    """``(use, why_not)``: whether EMCL with ``config`` runs its inner loops through the fused
    glance on ``device`` (``eager``: the glance runs on the eager path, not the CUDA-graph
    routine); ``why_not`` says why not (None when it runs, or when ``fused_glance=False``).
    Raises when ``fused_glance=True`` and it cannot run."""
    from ..data.models import MLP

    choice = config.get("fused_glance", "auto")
    if not (choice is True or choice is False or choice == "auto"):
        raise ValueError(f"emcl: fused_glance must be 'auto', True or False, got {choice!r}")
    if choice is False:
        return False, None
    device = torch.device(device)
    why = None
    if config.get("inner_lr_modulation", False):
        why = "the inner_lr_modulation ablation's inner step is not EMCL's"
    elif config.get("importance_norm") == "tensor":
        why = "importance_norm='tensor' gives every tensor its own gamma"
    elif config.get("backend", "auto") not in ("auto", "cpu", "cuda"):
        why = (f"backend={config.get('backend')!r} asks for that optimizer backend's inner "
               "steps")
    elif not isinstance(model, MLP):
        why = f"the model is a {type(model).__name__}, not the MLP"
    elif any(p.dtype != torch.float32 for p in model.parameters()):
        why = "the MLP's parameters are not fp32"
    elif not eager:
        why = "the glances are captured in CUDA graphs (cuda_graph), which replay autograd's loop"
    else:
        backend = "cpu" if device.type == "cpu" else "cuda"
        why = glance_unavailable_reason(backend, device.type)
        if why is not None and device.type == "cuda":
            why = glance_unavailable_reason("triton", "cuda")
    if why is not None and choice is True:
        raise ValueError(f"emcl: fused_glance=True but the fused glance cannot run: {why}")
    return why is None, why


class FusedGlance:
    """Runs the inner loop of :class:`~emcl_continual.methods.emcl.EMCL`'s glance in one call.

    ``method``: the EMCL learner (its model and optimizer are read at every call)."""

    def __init__(self, method):
        self.method = method
        self.model = method.model
        self.opt = method.opt
        self.params = list(self.model.parameters())
        self.multi_head = bool(getattr(self.model, "multi_head", False))
        self.skipped = 0
        self._warned = False
        self._state = None       # (anchors, importances) as last checked
        self._outs = {}          # n -> (losses [1, n], skipped [1])
        device = self.params[0].device
        if device.type == "cpu" or glance_unavailable_reason("cuda", "cuda") is None:
            self._op = torch.ops.emcl.mlp_glance_
        else:
            from emcl_kernels.backends import glance_triton
            self._op = glance_triton.mlp_glance

    @torch.no_grad()
    def _ensure_state(self) -> None:
        """The optimizer's state of every parameter, made (as its first inner step would) by an
        inner step on zero gradients: θ₀ = θ, h = 0, and θ unchanged (g = 0, θ = θ₀)."""
        if all(p in self.opt.state and "anchor" in self.opt.state[p] for p in self.params):
            return
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt.inner_step()
        for p in self.params:
            p.grad = None

    def _tensors(self):
        """The per-layer lists with a run dimension of 1, checked when the state changed."""
        from emcl_kernels.glance import _check_layers
        state = self.opt.state
        anchors = [state[p]["anchor"] for p in self.params]
        imps = [state[p]["importance"] for p in self.params]
        key = [t.data_ptr() for t in anchors + imps + self.params]
        if self._state is None or self._state[0] != key:
            _check_layers(self.params, anchors, imps, None)   # clear errors, once per state
            self._state = (key, [p.unsqueeze(0) for p in self.params],
                           [a.unsqueeze(0) for a in anchors], [h.unsqueeze(0) for h in imps])
        return self._state[1:]

    @torch.no_grad()
    def inner_loop(self, xi: torch.Tensor, yi: torch.Tensor, ti: torch.Tensor) -> None:
        """The inner steps of one glance, sample by sample in order, in place on the model."""
        n = int(xi.shape[0])
        if n == 0:
            return
        self._ensure_state()
        params, anchors, imps = self._tensors()
        group = self.opt.param_groups[0]
        hyper = torch.tensor([[float(group["lr"]), float(group["reg"]), float(group["gamma"])]],
                             dtype=torch.float64).to(xi.device)
        x = xi.reshape(1, n, -1)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        y = yi.reshape(1, n).to(torch.int64).contiguous()
        mask = None
        if self.multi_head:
            mask = self.model.task_mask[ti.to(self.model.task_mask.device).long()].unsqueeze(0)
        outs = self._outs.get(n)
        if outs is None:
            outs = self._outs[n] = (torch.empty((1, n), dtype=torch.float32, device=x.device),
                                    torch.empty((1,), dtype=torch.int64, device=x.device))
        self._op(params, anchors, imps, x, y, mask, hyper, bool(group["prox"]),
                 bool(self.opt.check_finite), outs[0], outs[1])
        if self.opt.check_finite:
            skipped = int(outs[1][0])
            if skipped:
                self.skipped += skipped
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"emcl: the fused glance skipped {skipped} inner step(s) "
                                  "with a non-finite gradient (counted in "
                                  "FusedGlance.skipped)", RuntimeWarning, stacklevel=3)
