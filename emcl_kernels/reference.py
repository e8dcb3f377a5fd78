"""The oracle: SPEC section 2, one tensor at a time, line by line against the paper.

Every other backend is tested against these functions. They are written for reading, not for
speed: each line is one equation of Zou & Lin, "Efficient Meta-Learning for Continual Learning
with Taylor Expansion Approximation" (equation numbers in the comments).

Arithmetic is done in fp32 whatever the storage dtype of the parameter (fp64 when the parameter
is fp64, so the oracle can be run at higher precision than the backend under test). State
tensors (anchor θ₀, importance h, meta learning rate α) are stored in that compute dtype.

Symbols (SPEC section 1):
    θ  param        g  grad          θ₀ anchor        h  importance     α  meta_lrs (state)
    β  inner_lr     λ  reg           γ  gamma         η  decay          α₀ meta_lr   r lr_scale

Each ``*_step_`` function updates its tensors in place. ``grad_scale`` (the gradients are divided
by it, as a ``torch.amp.GradScaler`` leaves them multiplied) and ``found_inf`` (when non-zero,
nothing is written) follow torch's fused optimizers.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "compute_dtype",
    "inner_update",
    "meta_update",
    "inner_step_",
    "meta_step_",
    "inner_meta_step_",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math is done in (and state is kept in) for parameters of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# The math, on compute-dtype tensors, returning new values.
# ---------------------------------------------------------------------------------------------

def inner_update(theta: Tensor, g: Tensor, theta0: Tensor, h: Tensor, *,
                 inner_lr: float, reg: float, gamma: float, prox: bool = True) -> Tensor:
    """One inner step on the regularized inner loss (eq. 6); returns the new fast weight θ."""
    if prox:
        theta_hat = theta - inner_lr * g                  # eq. 14: gradient step on the risk
        c = (gamma * reg * h).clamp(max=torch.finfo(h.dtype).max)  # γ·λ·h (an overflow: the max)
        # eq. 19, prox of (λ/2)·h·(θ − θ₀)²: (θ̂ + c·θ₀)/(1 + c), written as θ̂ − w·(θ̂ − θ₀) with
        # w = c/(1 + c) in [0, 1]: no intermediate grows past |θ̂| and |θ₀| (c·θ₀ overflows fp32
        # for |θ₀| > 1e19), and c = 0 leaves θ̂ exactly as it is
        w = c / (1 + c)
        return theta_hat - w * (theta_hat - theta0)
    # ablation: plain gradient step on eq. 6, risk plus importance-weighted pull to θ₀
    return theta - inner_lr * (g + reg * h * (theta - theta0))


def meta_update(theta: Tensor, g: Tensor, theta0: Tensor, h: Tensor, alpha: Optional[Tensor], *,
                meta_lr: float, reg: float, decay: float, lr_scale: float, lr_mode: str,
                lr_min: float, lr_max: float, eps: float, importance: str = "taylor",
                ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One meta step; returns the new (θ₀, h, α). The new parameter θ is the new θ₀.

    ``alpha`` is the stored per-element meta learning rate (``lr_mode="recurrent"`` only).
    """
    if importance == "taylor":
        omega = (g * theta0).abs()                        # eq. 13: |∂L/∂θ₀ · θ₀|
    elif importance == "si":
        omega = (g * (theta - theta0)).abs()              # EMCL-SI: gradient times the update
    else:
        raise ValueError(f"importance must be 'taylor' or 'si', got {importance!r}")
    h = decay * h + (1 - decay) * omega                   # eq. 7: moving average of Ω

    # the clip of α never lets it past the largest finite value, so α·h is 0, not NaN, for h = 0
    lr_max = min(lr_max, torch.finfo(h.dtype).max)
    if lr_mode == "recurrent":
        alpha = (alpha * lr_scale / (h + eps)).clamp(lr_min, lr_max)     # eq. 8 as written
        rate = alpha
    elif lr_mode == "inverse":
        rate = (meta_lr * lr_scale / (h + eps)).clamp(lr_min, lr_max)   # α ∝ 1 / h
    elif lr_mode == "constant":
        rate = meta_lr                                                   # no modulation
    else:
        raise ValueError(f"lr_mode must be 'recurrent', 'inverse' or 'constant', got {lr_mode!r}")

    # eq. 10, ∇θ₀ = λ·H²·(θ₀ − θ_k): θ₀ ← θ₀ − α·λ·h·(θ₀ − θ), with α·h formed first (it is at
    # most α₀·r in inverse mode, where α alone grows like 1/ε as h → 0)
    theta0 = theta0 - (rate * h) * reg * (theta0 - theta)
    return theta0, h, alpha


# ---------------------------------------------------------------------------------------------
# In-place steps on one tensor.
# ---------------------------------------------------------------------------------------------

def _skip(found_inf: Optional[Tensor]) -> bool:
    return found_inf is not None and bool(found_inf.item() != 0)


def _load(param: Tensor, grad: Tensor, grad_scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    cdt = compute_dtype(param.dtype)
    theta = param.detach().to(cdt)
    g = grad.detach().to(cdt)
    if grad_scale is not None:
        g = g / grad_scale.to(cdt)
    return theta, g


@torch.no_grad()
def inner_step_(param: Tensor, grad: Tensor, anchor: Tensor, importance: Tensor, *,
                inner_lr: float, reg: float, gamma: float, prox: bool = True,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """Inner step (eqs. 14, 15, 19) on one tensor, in place: writes ``param``."""
    if _skip(found_inf):
        return
    theta, g = _load(param, grad, grad_scale)
    theta = inner_update(theta, g, anchor, importance,
                         inner_lr=inner_lr, reg=reg, gamma=gamma, prox=prox)
    param.copy_(theta)


@torch.no_grad()
def meta_step_(param: Tensor, grad: Tensor, anchor: Tensor, importance: Tensor,
               meta_lrs: Optional[Tensor], *, meta_lr: float, reg: float, decay: float,
               lr_scale: float, lr_mode: str, lr_min: float = 0.0, lr_max: float = float("inf"),
               eps: float = 1e-8, importance_kind: str = "taylor",
               grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """Meta step (eqs. 7, 8, 10, 13) on one tensor, in place: writes ``importance``, ``meta_lrs``
    (recurrent mode), ``anchor`` and ``param`` (θ ← θ₀)."""
    if _skip(found_inf):
        return
    theta, g = _load(param, grad, grad_scale)
    _meta_write(param, theta, g, anchor, importance, meta_lrs, meta_lr=meta_lr, reg=reg,
                decay=decay, lr_scale=lr_scale, lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max,
                eps=eps, importance_kind=importance_kind)


@torch.no_grad()
def inner_meta_step_(param: Tensor, grad: Tensor, anchor: Tensor, importance: Tensor,
                     meta_lrs: Optional[Tensor], *, inner_lr: float, meta_lr: float, reg: float,
                     gamma: float, decay: float, lr_scale: float, lr_mode: str,
                     lr_min: float = 0.0, lr_max: float = float("inf"), eps: float = 1e-8,
                     importance_kind: str = "taylor", prox: bool = True,
                     grad_scale: Optional[Tensor] = None,
                     found_inf: Optional[Tensor] = None) -> None:
    """The inner step, then the meta step with the same gradient, on one tensor.

    The fast weight between the two stays in the compute dtype (it is not rounded to the
    parameter's storage dtype): this is what a fused single-pass kernel computes.
    """
    if _skip(found_inf):
        return
    theta, g = _load(param, grad, grad_scale)
    theta = inner_update(theta, g, anchor, importance,
                         inner_lr=inner_lr, reg=reg, gamma=gamma, prox=prox)
    _meta_write(param, theta, g, anchor, importance, meta_lrs, meta_lr=meta_lr, reg=reg,
                decay=decay, lr_scale=lr_scale, lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max,
                eps=eps, importance_kind=importance_kind)


def _meta_write(param, theta, g, anchor, importance, meta_lrs, *, importance_kind, **hyper):
    theta0, h, alpha = meta_update(theta, g, anchor, importance, meta_lrs,
                                   importance=importance_kind, **hyper)
    importance.copy_(h)
    if meta_lrs is not None and alpha is not None:
        meta_lrs.copy_(alpha)
    anchor.copy_(theta0)
    param.copy_(theta0)                                   # the next batch starts from θ₀
