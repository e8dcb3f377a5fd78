"""The ``"reference"`` backend: the per-tensor oracle of :mod:`emcl_kernels.reference`, looped
over the list. Slow and obvious; every other backend is tested against it.

:func:`step` and :func:`check_finite` are [note: the step call] of
:mod:`emcl_kernels.interface` written out in plain Python: what every other backend's kernels
must do, counters included.
"""
from __future__ import annotations

import torch

from emcl_kernels import reference as _ref
from emcl_kernels.interface import (COUNTER, HYPER_FIELDS, IMPORTANCE_KINDS, LR_MODES, OP,
                                    RUN_FOUND, resolve_lr_scale, run_skipped_at)

_FOUND, _CALLS, _SKIPPED = COUNTER["found"], COUNTER["calls"], COUNTER["skipped"]


def hyper_dict(hyper: torch.Tensor) -> dict:
    """The ``hyper`` tensor as a dict of floats, with ``lr_scale`` resolved (the sentinel
    :data:`~emcl_kernels.interface.LR_SCALE_FROM_REG` means 1 / reg, or 1 when reg is 0)."""
    values = dict(zip(HYPER_FIELDS, hyper.tolist()))
    values["lr_scale"] = resolve_lr_scale(values["lr_scale"], values["reg"])
    return values


def run_slice(t: torch.Tensor, r: int, runs: int) -> torch.Tensor:
    """Run ``r``'s elements of a tensor of an array of ``runs`` runs ([note: runs] in
    :mod:`emcl_kernels.interface`): its ``r``-th slice along the leading dimension."""
    if runs == 1:
        return t
    if t.dim() == 0 or t.shape[0] != runs:
        raise ValueError(f"a tensor of an array of {runs} runs needs a leading dimension of "
                         f"{runs}, got shape {tuple(t.shape)}")
    return t[r]


def _nonfinite(grads) -> bool:
    return any(g.numel() and not bool(torch.isfinite(g).all()) for g in grads)


def check_finite(grads, counters: torch.Tensor, runs: int = 1) -> None:
    """``counters[FOUND] = 1`` when any gradient holds an inf or a NaN; in an array of runs,
    ``counters[RUN_FOUND + r] = 1`` when one of run ``r``'s does."""
    if runs == 1:
        if _nonfinite(grads):
            counters[_FOUND] = 1
        return
    for r in range(runs):
        if _nonfinite([run_slice(g, r, runs) for g in grads]):
            counters[RUN_FOUND + r] = 1


def step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op: int,
         prox: bool, importance: int, lr_mode: int, meta_every: int, check: bool,
         finalize: bool, grad_scale=None, found_inf=None, runs: int = 1) -> None:
    """One step of one group (see [note: the step call] in :mod:`emcl_kernels.interface`);
    an array of ``runs`` runs is stepped run by run ([note: runs] there)."""
    if check:
        check_finite(grads, counters, runs)
    found, calls = int(counters[_FOUND]), int(counters[_CALLS])
    skip = found != 0 or (found_inf is not None and float(found_inf.reshape(-1)[0]) != 0)
    which = op
    if op == OP["cadence"]:
        which = OP["inner_meta"] if (calls + 1) % meta_every == 0 else OP["inner"]
    rows = hyper.reshape(runs, -1)
    per_param = steps.view(-1, runs) if steps.numel() else None
    for r in range(runs):
        if skip or (runs > 1 and int(counters[RUN_FOUND + r]) != 0):
            continue
        _update(which, [run_slice(t, r, runs) for t in params],
                [run_slice(t, r, runs) for t in grads], [run_slice(t, r, runs) for t in anchors],
                [run_slice(t, r, runs) for t in importances],
                [run_slice(t, r, runs) for t in meta_lrs], rows[r], prox=prox,
                importance=importance, lr_mode=lr_mode, grad_scale=grad_scale)
        if which != OP["inner"] and per_param is not None:
            per_param[:, r].add_(1)
    if finalize:
        if op == OP["cadence"]:
            counters[_CALLS] += 1
        if found:
            counters[_SKIPPED] += 1
        counters[_FOUND] = 0
        if runs > 1:
            at = run_skipped_at(runs)
            counters[at:at + runs] += (counters[RUN_FOUND:RUN_FOUND + runs] != 0).long()
            counters[RUN_FOUND:RUN_FOUND + runs] = 0


def _update(which, params, grads, anchors, importances, meta_lrs, hyper, *, prox, importance,
            lr_mode, grad_scale) -> None:
    """The update of one run: SPEC section 2 per tensor, with this run's ``hyper`` row."""
    hp = hyper_dict(hyper)
    inner = dict(inner_lr=hp["inner_lr"], reg=hp["reg"], gamma=hp["gamma"], prox=prox)
    meta = dict(meta_lr=hp["meta_lr"], reg=hp["reg"], decay=hp["decay"],
                lr_scale=hp["lr_scale"], lr_mode=LR_MODES[lr_mode], lr_min=hp["lr_min"],
                lr_max=hp["lr_max"], eps=hp["eps"],
                importance_kind=IMPORTANCE_KINDS[importance])
    for i, (p, g, a, h) in enumerate(zip(params, grads, anchors, importances)):
        alpha = meta_lrs[i] if len(meta_lrs) else None
        if which == OP["inner"]:
            _ref.inner_step_(p, g, a, h, grad_scale=grad_scale, **inner)
        elif which == OP["meta"]:
            _ref.meta_step_(p, g, a, h, alpha, grad_scale=grad_scale, **meta)
        else:
            meta_only = {k: v for k, v in meta.items() if k != "reg"}
            _ref.inner_meta_step_(p, g, a, h, alpha, grad_scale=grad_scale, **inner,
                                  **meta_only)


__all__ = ["step", "check_finite", "hyper_dict", "run_slice"]
