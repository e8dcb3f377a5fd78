"""The ``"foreach"`` backend: SPEC section 2 as torch ``_foreach_*`` ops over a tensor list.

Works on every device torch supports. Each line below launches one op over the whole list
(one kernel per op on CUDA), so a step is ~10 passes over memory instead of the single pass of
the fused backends. bf16/fp16 parameters are worked on through fp32 copies (fp64 parameters in
fp64) and rounded back once at the end. A ``found_inf`` flag costs one host sync here, except
under torch.compile or CUDA graph capture, where the update is computed and then undone with
``torch.where`` wherever ``found_inf`` is set (no sync, so it can be traced and captured).

Hyper-parameters may be 0-d tensors on the group's device (capturable mode,
:mod:`emcl_kernels.integration`) as well as numbers.
"""
from __future__ import annotations

import torch
from torch import Tensor

from emcl_kernels.integration import capturing
from emcl_kernels.reference import compute_dtype

TENSOR_HYPERPARAMETERS = True  # numbers or 0-d tensors on the group's device


def _skip(found_inf) -> bool:
    return found_inf is not None and not capturing() and bool(found_inf.item() != 0)


def _add_scaled_(xs, ys, a):
    """xs += a·ys, for a number or a 0-d tensor ``a``."""
    if isinstance(a, Tensor):
        torch._foreach_add_(xs, torch._foreach_mul(ys, a))
    else:
        torch._foreach_add_(xs, ys, alpha=a)


def _clamp_(xs, lo, hi):
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        for x in xs:
            torch.clamp_(x, min=lo, max=hi)
        return
    if lo > 0:
        torch._foreach_clamp_min_(xs, lo)
    if hi != float("inf"):
        torch._foreach_clamp_max_(xs, hi)


def _unless_found_inf(found_inf, written, update) -> None:
    """Run ``update()``; where ``found_inf`` is non-zero, put back what it wrote to the tensors
    of ``written``. Used instead of a host-side check when that cannot sync (see module doc)."""
    if found_inf is None or not capturing():
        update()
        return
    saved = [t.clone() for t in written]
    update()
    keep = found_inf != 0
    for t, old in zip(written, saved):
        t.copy_(torch.where(keep, old, t))


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
        _add_scaled_(theta, g, -inner_lr)                           # θ̂ = θ − β·g     (eq. 14)
        c = torch._foreach_mul(importances, gamma * reg)            # c = γ·λ·h
        torch._foreach_addcmul_(theta, c, anchors)                  # θ̂ + c·θ₀
        torch._foreach_add_(c, 1.0)
        torch._foreach_div_(theta, c)                               # / (1 + c)         (eq. 19)
    else:
        pull = torch._foreach_sub(theta, anchors)                   # θ − θ₀
        torch._foreach_mul_(pull, importances)                      # h·(θ − θ₀)
        _add_scaled_(theta, g, -inner_lr)                           # θ − β·g
        _add_scaled_(theta, pull, -inner_lr * reg)                  # − β·λ·h·(θ − θ₀)


def _meta(theta, g, anchors, importances, meta_lrs, *, meta_lr, reg, decay, lr_scale, lr_mode,
          lr_min, lr_max, eps, importance):
    if importance == "taylor":
        omega = torch._foreach_mul(g, anchors)                      # Ω = |g·θ₀|        (eq. 13)
    else:
        omega = torch._foreach_sub(theta, anchors)
        torch._foreach_mul_(omega, g)                               # Ω = |g·(θ − θ₀)|  (SI)
    torch._foreach_abs_(omega)
    torch._foreach_mul_(importances, decay)
    _add_scaled_(importances, omega, 1.0 - decay)                  # h ← η·h + (1−η)·Ω (eq. 7)

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
        _clamp_(rate, lr_min, lr_max)

    step = torch._foreach_sub(anchors, theta)                       # θ₀ − θ
    torch._foreach_mul_(step, importances)                          # h·(θ₀ − θ)
    if rate is None:                                                # constant: α = α₀
        _add_scaled_(anchors, step, -meta_lr * reg)
    else:
        torch._foreach_mul_(step, rate)
        _add_scaled_(anchors, step, -reg)                           # θ₀ ← θ₀ − α·λ·h·(θ₀ − θ) (eq. 10)


def inner_step(params, grads, anchors, importances, *, inner_lr, reg, gamma, prox,
               grad_scale=None, found_inf=None):
    if _skip(found_inf):
        return

    def update():
        theta, g = _working(params, grads, grad_scale)
        _inner(theta, g, anchors, importances, inner_lr=inner_lr, reg=reg, gamma=gamma,
               prox=prox)
        if theta[0] is not params[0]:
            torch._foreach_copy_(params, theta)
    _unless_found_inf(found_inf, params, update)


def meta_step(params, grads, anchors, importances, meta_lrs, *, grad_scale=None,
              found_inf=None, **hp):
    if _skip(found_inf):
        return

    def update():
        theta, g = _working(params, grads, grad_scale)
        _meta(theta, g, anchors, importances, meta_lrs, **hp)
        torch._foreach_copy_(params, anchors)                       # θ ← θ₀
    _unless_found_inf(found_inf, _written(params, anchors, importances, meta_lrs), update)


def inner_meta_step(params, grads, anchors, importances, meta_lrs, *, inner_lr, gamma, prox,
                    grad_scale=None, found_inf=None, **hp):
    if _skip(found_inf):
        return

    def update():
        theta, g = _working(params, grads, grad_scale)
        _inner(theta, g, anchors, importances, inner_lr=inner_lr, reg=hp["reg"], gamma=gamma,
               prox=prox)
        _meta(theta, g, anchors, importances, meta_lrs, **hp)
        torch._foreach_copy_(params, anchors)
    _unless_found_inf(found_inf, _written(params, anchors, importances, meta_lrs), update)


def _written(params, anchors, importances, meta_lrs):
    return [*params, *anchors, *importances, *(meta_lrs or [])]
