"""The ``"foreach"`` backend: SPEC section 2 as torch ``_foreach_*`` ops over a tensor list.

Works on every device torch supports. Each line below launches one op over the whole list
(one kernel per op on CUDA), so a step is ~10 passes over memory instead of the single pass of
the fused backends. bf16/fp16 parameters are worked on through fp32 copies (fp64 parameters in
fp64) and rounded back once at the end. A ``found_inf`` flag costs one host sync here.
"""
from __future__ import annotations

import torch

from emcl_kernels.reference import compute_dtype


def _skip(found_inf) -> bool:
    return found_inf is not None and bool(found_inf.item() != 0)


def _working(params, grads, grad_scale):
    """fp32 (or fp64) views of θ and g. θ aliases the parameters when they are already in the
    compute dtype, so in-place ops on it update them directly."""
    cdt = compute_dtype(params[0].dtype)
    if params[0].dtype == cdt:
        theta, g = list(params), list(grads)
    else:
        theta = [p.to(cdt) for p in params]
        g = [x.to(cdt) for x in grads]
    if grad_scale is not None:
        g = torch._foreach_div(g, grad_scale.to(cdt))
    return theta, g


def _inner(theta, g, anchors, importances, *, inner_lr, reg, gamma, prox):
    if prox:
        torch._foreach_add_(theta, g, alpha=-inner_lr)              # θ̂ = θ − β·g     (eq. 14)
        c = torch._foreach_mul(importances, gamma * reg)            # c = γ·λ·h
        torch._foreach_addcmul_(theta, c, anchors)                  # θ̂ + c·θ₀
        torch._foreach_add_(c, 1.0)
        torch._foreach_div_(theta, c)                               # / (1 + c)         (eq. 19)
    else:
        pull = torch._foreach_sub(theta, anchors)                   # θ − θ₀
        torch._foreach_mul_(pull, importances)                      # h·(θ − θ₀)
        torch._foreach_add_(theta, g, alpha=-inner_lr)              # θ − β·g
        torch._foreach_add_(theta, pull, alpha=-inner_lr * reg)     # − β·λ·h·(θ − θ₀)


def _meta(theta, g, anchors, importances, meta_lrs, *, meta_lr, reg, decay, lr_scale, lr_mode,
          lr_min, lr_max, eps, importance):
    if importance == "taylor":
        omega = torch._foreach_mul(g, anchors)                      # Ω = |g·θ₀|        (eq. 13)
    else:
        omega = torch._foreach_sub(theta, anchors)
        torch._foreach_mul_(omega, g)                               # Ω = |g·(θ − θ₀)|  (SI)
    torch._foreach_abs_(omega)
    torch._foreach_mul_(importances, decay)
    torch._foreach_add_(importances, omega, alpha=1.0 - decay)     # h ← η·h + (1−η)·Ω (eq. 7)

    rate = None
    if lr_mode == "recurrent":
        denom = torch._foreach_add(importances, eps)
        torch._foreach_mul_(meta_lrs, lr_scale)
        torch._foreach_div_(meta_lrs, denom)                        # α ← α·r / (h + ε) (eq. 8)
        rate = meta_lrs
    elif lr_mode == "inverse":
        rate = torch._foreach_add(importances, eps)
        torch._foreach_reciprocal_(rate)
        torch._foreach_mul_(rate, meta_lr * lr_scale)               # α = α₀·r / (h + ε)
    if rate is not None:
        if lr_min > 0:
            torch._foreach_clamp_min_(rate, lr_min)
        if lr_max != float("inf"):
            torch._foreach_clamp_max_(rate, lr_max)

    step = torch._foreach_sub(anchors, theta)                       # θ₀ − θ
    torch._foreach_mul_(step, importances)                          # h·(θ₀ − θ)
    if rate is None:                                                # constant: α = α₀
        torch._foreach_add_(anchors, step, alpha=-meta_lr * reg)
    else:
        torch._foreach_mul_(step, rate)
        torch._foreach_add_(anchors, step, alpha=-reg)              # θ₀ ← θ₀ − α·λ·h·(θ₀ − θ) (eq. 10)


def inner_step(params, grads, anchors, importances, *, inner_lr, reg, gamma, prox,
               grad_scale=None, found_inf=None):
    if _skip(found_inf):
        return
    theta, g = _working(params, grads, grad_scale)
    _inner(theta, g, anchors, importances, inner_lr=inner_lr, reg=reg, gamma=gamma, prox=prox)
    if theta[0] is not params[0]:
        torch._foreach_copy_(params, theta)


def meta_step(params, grads, anchors, importances, meta_lrs, *, grad_scale=None,
              found_inf=None, **hp):
    if _skip(found_inf):
        return
    theta, g = _working(params, grads, grad_scale)
    _meta(theta, g, anchors, importances, meta_lrs, **hp)
    torch._foreach_copy_(params, anchors)                           # θ ← θ₀


def inner_meta_step(params, grads, anchors, importances, meta_lrs, *, inner_lr, gamma, prox,
                    grad_scale=None, found_inf=None, **hp):
    if _skip(found_inf):
        return
    theta, g = _working(params, grads, grad_scale)
    _inner(theta, g, anchors, importances, inner_lr=inner_lr, reg=hp["reg"], gamma=gamma,
           prox=prox)
    _meta(theta, g, anchors, importances, meta_lrs, **hp)
    torch._foreach_copy_(params, anchors)
