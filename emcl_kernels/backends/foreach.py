"""The ``"foreach"`` backend: SPEC section 2 as torch ``_foreach_*`` ops over a tensor list.

Works on every device torch supports. Each line below launches one op over the whole list
(one kernel per op on CUDA), so a step is ~10 passes over memory instead of the single pass of
the fused backends. bf16/fp16 parameters are worked on through fp32 copies (fp64 parameters in
fp64) and rounded back once at the end. Eagerly, :func:`step` reads the counters and the
hyper-parameters on the host (one sync on a GPU); under torch.compile or a CUDA graph capture
it reads them as 0-d tensors, computes every branch and selects with ``torch.where``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from emcl_kernels.integration import capturing
from emcl_kernels.interface import (COUNTER, HYPER, IMPORTANCE_KINDS, LR_MODES,
                                    LR_SCALE_FROM_REG, OP, RUN_FOUND, run_skipped_at)
# the one decoder of `hyper` on the host, and the run slices of an array ([note: runs])
from emcl_kernels.backends.reference import hyper_dict, run_slice
from emcl_kernels.reference import compute_dtype

__all__ = ["step", "check_finite"]

def _add_scaled_(xs, ys, a):
    """xs += a·ys, for a number or a 0-d tensor ``a``."""
    if isinstance(a, Tensor):
        torch._foreach_add_(xs, torch._foreach_mul(ys, a))
    else:
        torch._foreach_add_(xs, ys, alpha=a)


def _plus(xs, a):
    """[x + a for x in xs], for a number or a 0-d tensor ``a``. With a tensor, ``alpha`` is
    what binds the call to the Tensor overload: without it a 0-d tensor is taken as a Scalar,
    read with ``.item()`` (a host sync, which a CUDA graph capture refuses)."""
    if isinstance(a, Tensor):
        return torch._foreach_add(xs, a, alpha=1.0)
    return torch._foreach_add(xs, a)


def _clamp_(xs, lo, hi):
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        for x in xs:
            torch.clamp_(x, min=lo, max=hi)
        return
    if lo > 0:
        torch._foreach_clamp_min_(xs, lo)
    if hi != float("inf"):
        torch._foreach_clamp_max_(xs, hi)


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
        torch._foreach_clamp_max_(c, torch.finfo(anchors[0].dtype).max)
        w = torch._foreach_div(c, torch._foreach_add(c, 1.0))       # w = c / (1 + c)
        step = torch._foreach_sub(theta, anchors)                   # θ̂ − θ₀
        torch._foreach_mul_(step, w)
        torch._foreach_sub_(theta, step)                            # θ̂ − w·(θ̂ − θ₀)    (eq. 19)
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
        denom = _plus(importances, eps)
        torch._foreach_mul_(meta_lrs, lr_scale)
        torch._foreach_div_(meta_lrs, denom)                        # α ← α·r / (h + ε) (eq. 8)
        rate = meta_lrs
    elif lr_mode == "inverse":
        rate = _plus(importances, eps)
        torch._foreach_reciprocal_(rate)
        torch._foreach_mul_(rate, meta_lr * lr_scale)               # α = α₀·r / (h + ε)
    if rate is not None:  # the upper clip is at most the largest finite value (see reference)
        max_finite = torch.finfo(anchors[0].dtype).max
        _clamp_(rate, lr_min, torch.clamp(lr_max, max=max_finite) if isinstance(lr_max, Tensor)
                else min(lr_max, max_finite))
        rate_h = torch._foreach_mul(rate, importances)              # α·h
    else:                                                           # constant: α = α₀
        rate_h = torch._foreach_mul(importances, meta_lr)
    torch._foreach_mul_(rate_h, reg)                                # α·h·λ
    step = torch._foreach_sub(anchors, theta)                       # θ₀ − θ
    torch._foreach_mul_(step, rate_h)
    torch._foreach_sub_(anchors, step)                              # θ₀ ← θ₀ − α·λ·h·(θ₀ − θ) (eq. 10)


# ---------------------------------------------------------------------------------------------
# The step interface ([note: the step call] in emcl_kernels.interface)
# ---------------------------------------------------------------------------------------------
_FOUND, _CALLS, _SKIPPED = COUNTER["found"], COUNTER["calls"], COUNTER["skipped"]


def check_finite(grads, counters: Tensor, runs: int = 1) -> None:
    """``counters[FOUND] = 1`` when a gradient holds an inf or a NaN: one read-only pass per
    dtype (the inf-norm of each tensor is inf or NaN exactly then), no host sync. In an array of
    runs, the inf-norm of each run's slice sets that run's flag ``counters[RUN_FOUND + r]``."""
    by_dtype: dict = {}
    for g in grads:
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(g)
    for lst in by_dtype.values():
        if runs == 1:
            norms = torch._foreach_norm(lst, float("inf"))
            bad = ~torch.isfinite(torch.stack(norms)).all()
            counters[_FOUND].copy_(torch.maximum(counters[_FOUND], bad.to(counters.dtype)))
            continue
        # one inf-norm per (tensor, run): the per-run maxima of |g| over each tensor's runs
        per_run = torch.stack([g.detach().reshape(runs, -1).abs().amax(dim=1) for g in lst])
        bad = (~torch.isfinite(per_run)).any(dim=0).to(counters.dtype)
        flags = counters[RUN_FOUND:RUN_FOUND + runs]
        flags.copy_(torch.maximum(flags, bad))


def _hyper_tensors(hyper: Tensor) -> dict:
    """The hyper-parameters as 0-d views of ``hyper`` (read at run time: no host sync)."""
    values = {name: hyper[i] for name, i in HYPER.items()}
    reg, scale = values["reg"], values["lr_scale"]
    from_reg = torch.where(reg > 0, 1.0 / torch.where(reg > 0, reg, torch.ones_like(reg)),
                           torch.ones_like(reg))
    values["lr_scale"] = torch.where(scale == LR_SCALE_FROM_REG, from_reg, scale)
    return values


def _update(which: int, params, grads, anchors, importances, meta_lrs, hp: dict, prox: bool,
            importance: str, lr_mode: str, grad_scale) -> None:
    theta, g = _working(params, grads, grad_scale)
    if which != OP["meta"]:
        _inner(theta, g, anchors, importances, inner_lr=hp["inner_lr"], reg=hp["reg"],
               gamma=hp["gamma"], prox=prox)
    if which != OP["inner"]:
        _meta(theta, g, anchors, importances, meta_lrs or None, meta_lr=hp["meta_lr"],
              reg=hp["reg"], decay=hp["decay"], lr_scale=hp["lr_scale"], lr_mode=lr_mode,
              lr_min=hp["lr_min"], lr_max=hp["lr_max"], eps=hp["eps"], importance=importance)
        torch._foreach_copy_(params, anchors)                       # θ ← θ₀
    elif theta[0] is not params[0]:
        torch._foreach_copy_(params, theta)


def step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op: int,
         prox: bool, importance: int, lr_mode: int, meta_every: int, check: bool,
         finalize: bool, grad_scale=None, found_inf=None, runs: int = 1) -> None:
    """One step of one group (emcl_kernels.interface, [note: the step call]). Eagerly it reads
    the counters and the hyper-parameters on the host (one sync on a GPU); under torch.compile
    or a CUDA graph capture it computes every branch and selects with ``torch.where``.

    An array of runs ([note: runs]) is stepped run by run, each run's slices with the ops and
    the scalars of a group of its own: its bits are those of the run alone, and the launches
    grow with the number of runs (the fused backends make one launch whatever the number)."""
    if runs > 1:
        return _step_runs(params, grads, anchors, importances, meta_lrs, steps, hyper,
                          counters, op=op, prox=prox, importance=importance, lr_mode=lr_mode,
                          meta_every=meta_every, check=check, finalize=finalize,
                          grad_scale=grad_scale, found_inf=found_inf, runs=runs)
    if check:
        check_finite(grads, counters)
    kinds = dict(prox=prox, importance=IMPORTANCE_KINDS[importance], lr_mode=LR_MODES[lr_mode])
    if params and not capturing():
        found, calls = counters[_FOUND].item(), counters[_CALLS].item()
        skip = found != 0 or (found_inf is not None and found_inf.item() != 0)
        which = op
        if op == OP["cadence"]:
            which = OP["inner_meta"] if (calls + 1) % meta_every == 0 else OP["inner"]
        if not skip:
            _update(which, params, grads, anchors, importances, meta_lrs,
                    hyper_dict(hyper), grad_scale=grad_scale, **kinds)
            if which != OP["inner"] and steps.numel():
                steps.add_(1)
    elif params:
        _step_without_sync(op, params, grads, anchors, importances, meta_lrs, steps, hyper,
                           counters, meta_every, grad_scale, found_inf, kinds)
    if finalize:   # in place on views: `counters[i] = 0` copies a CPU scalar (no capture)
        if op == OP["cadence"]:
            counters[_CALLS].add_(1)
        counters[_SKIPPED].add_((counters[_FOUND] != 0).to(counters.dtype))
        counters[_FOUND].zero_()


def _step_without_sync(op, params, grads, anchors, importances, meta_lrs, steps, hyper,
                       counters, meta_every, grad_scale, found_inf, kinds) -> None:
    skip = counters[_FOUND] != 0
    if found_inf is not None:
        skip = skip | (found_inf.reshape(()) != 0)
    hp = _hyper_tensors(hyper)
    state = [*anchors, *importances, *meta_lrs]
    saved_params = [p.clone() for p in params]
    saved_state = [t.clone() for t in state]
    if op == OP["cadence"]:
        is_meta = (counters[_CALLS] + 1) % meta_every == 0
        _update(OP["inner"], params, grads, anchors, importances, meta_lrs, hp,
                grad_scale=grad_scale, **kinds)
        inner_params = [p.clone() for p in params]
        torch._foreach_copy_(params, saved_params)
        _update(OP["inner_meta"], params, grads, anchors, importances, meta_lrs, hp,
                grad_scale=grad_scale, **kinds)
        for p, inner in zip(params, inner_params):
            p.copy_(torch.where(is_meta, p, inner))
        for t, old in zip(state, saved_state):
            t.copy_(torch.where(is_meta, t, old))
    else:
        is_meta = torch.full((), op != OP["inner"], dtype=torch.bool, device=counters.device)
        _update(op, params, grads, anchors, importances, meta_lrs, hp, grad_scale=grad_scale,
                **kinds)
    for t, old in zip([*params, *state], [*saved_params, *saved_state]):
        t.copy_(torch.where(skip, old, t))
    if steps.numel():
        steps.add_((is_meta & ~skip).to(steps.dtype))


def _step_runs(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op,
               prox, importance, lr_mode, meta_every, check, finalize, grad_scale, found_inf,
               runs) -> None:
    """An array's step: the finite check per run, then each run's step as a group of its own
    with a scratch counter that carries the array's flags for that run."""
    if check:
        check_finite(grads, counters, runs)
    rows = hyper.reshape(runs, -1)
    per_param = steps.view(-1, runs) if steps.numel() else None
    for r in range(runs):
        own = counters[:RUN_FOUND].clone()          # FOUND and CALLS as the array's
        own[_FOUND] = torch.maximum(own[_FOUND], counters[RUN_FOUND + r])
        run_steps = per_param[:, r].clone() if per_param is not None else steps
        step([run_slice(t, r, runs) for t in params], [run_slice(t, r, runs) for t in grads],
             [run_slice(t, r, runs) for t in anchors],
             [run_slice(t, r, runs) for t in importances],
             [run_slice(t, r, runs) for t in meta_lrs], run_steps, rows[r], own, op=op,
             prox=prox, importance=importance, lr_mode=lr_mode, meta_every=meta_every,
             check=False, finalize=False, grad_scale=grad_scale, found_inf=found_inf)
        if per_param is not None:
            per_param[:, r].copy_(run_steps)
    if finalize:
        if op == OP["cadence"]:
            counters[_CALLS].add_(1)
        counters[_SKIPPED].add_((counters[_FOUND] != 0).to(counters.dtype))
        counters[_FOUND].zero_()
        at = run_skipped_at(runs)
        flags = counters[RUN_FOUND:RUN_FOUND + runs]
        counters[at:at + runs].add_((flags != 0).to(counters.dtype))
        flags.zero_()
