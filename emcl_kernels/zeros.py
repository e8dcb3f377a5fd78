"""Parameters that EMCL's meta step holds at zero: found, named, warned about, and the remedy.

[note: zero parameters] The Taylor importance is Ω = |g·θ₀| (eq. 13). Where the anchor θ₀ is 0
it is 0, so h stays 0 there, and the closed-form meta update θ₀ ← θ₀ − α·λ·h·(θ₀ − θ) (eq. 10)
leaves θ₀ at 0 and then sets θ ← θ₀: whatever the inner steps learnt is undone at every meta
step. A tensor that starts all zero (the biases and LayerNorm biases of most transformers, a
zeroed ``nn.Linear`` bias, zero-initialised residual projections) therefore never trains. This
is the paper's math on every backend, the reference included, not a kernel bug.

The remedy is the importance of EMCL-SI for those tensors only: Ω = |g·(θ − θ₀)|, the gradient
times what the inner steps moved, is not 0 once an inner step has moved the weight, so h grows
and the meta step keeps a share of the progress as it does for every other weight (in the
default ``lr_mode="inverse"`` that share is about ``meta_lr`` wherever h ≫ ε, whatever the
importance's scale). :func:`zero_aware_groups` puts them in a param group of their own with
``importance="si"``; docs/integration.md shows what it changes on a small transformer
(results/dropin/).
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch import Tensor

from emcl_kernels.integration import local

__all__ = ["ZeroParameterWarning", "zero_aware_groups", "warn_zero_parameters"]


class ZeroParameterWarning(UserWarning):
    """Parameters that are all zero where their EMCL state starts: with the Taylor importance
    the meta step holds them at zero ([note: zero parameters] in :mod:`emcl_kernels.zeros`)."""


def _all_zero(tensors: list) -> list:
    """For each tensor, whether every element is 0 (one host read per device)."""
    out = [False] * len(tensors)
    by_device: dict = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        flags = torch.stack([tensors[i].detach().count_nonzero() == 0 for i in idx]).tolist()
        for i, flag in zip(idx, flags):
            out[i] = flag
    return out


def warn_zero_parameters(fresh: list) -> None:
    """Warn once about the tensors of ``fresh`` that are all zero: ``fresh`` holds
    ``(where, param, group)`` for every parameter whose state was just made (the anchor equals
    the parameter then). Groups with ``importance="si"`` are not affected and not checked."""
    fresh = [(where, p, group) for where, p, group in fresh if group["importance"] == "taylor"]
    if not fresh:
        return
    zero = [(where, p) for (where, p, _), z in zip(fresh, _all_zero([local(p) for _, p, _ in fresh]))
            if z]
    if not zero:
        return
    names = [f"{where} {tuple(p.shape)}" for where, p in zero]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    warnings.warn(
        f"FusedEMCLOptimizer: {len(zero)} parameter tensor(s) are all zero where their state "
        f"starts: {shown}. EMCL's Taylor importance |g·θ₀| is 0 wherever the anchor θ₀ is 0, so "
        "every meta step puts these weights back to 0 and they never train. Remedy: give them "
        "importance='si' in a param group of their own, e.g. "
        "FusedEMCLOptimizer(emcl_kernels.zero_aware_groups(model.named_parameters()), ...) "
        "(docs/integration.md, 'Zero-initialised parameters'); pass named parameters to see "
        "their names here.", ZeroParameterWarning, stacklevel=_stacklevel())


def _stacklevel() -> int:
    from emcl_kernels.skips import _caller_stacklevel
    return _caller_stacklevel() - 1


def zero_aware_groups(params: Iterable, **zero_group_options) -> list:
    """Param groups for :class:`~emcl_kernels.FusedEMCLOptimizer` in which the tensors that are
    all zero now get a group of their own with ``importance="si"`` ([note: zero parameters]).

    ``params``: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``: the
    groups then carry torch's ``param_names``), or param groups (dicts: each is split in two,
    its own options kept). ``zero_group_options`` are added to every zero group (for example
    ``lr=...``); ``importance`` defaults to ``"si"``. Empty groups are left out. Call it before
    training, when the zeros are the initialisation's.
    """
    params = list(params)
    if not params:
        raise ValueError("zero_aware_groups() got no parameters")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    extra = {"importance": "si", **zero_group_options}
    out = []
    for gi, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"zero_aware_groups: item {gi} is a {type(group).__name__}; give "
                            "parameters, (name, parameter) pairs or param groups (dicts with "
                            "'params'), not a mixture")
        items = list(group["params"]) if not isinstance(group["params"], Tensor) \
            else [group["params"]]
        named = [isinstance(x, tuple) for x in items]
        if any(named) and not all(named):
            raise TypeError("zero_aware_groups: give all parameters with names or none")
        tensors = [x[1] if isinstance(x, tuple) else x for x in items]
        if not all(isinstance(t, Tensor) for t in tensors):
            raise TypeError("zero_aware_groups: every parameter must be a tensor")
        flags = _all_zero([local(t) if t.device.type != "meta" else t.new_ones(1)
                           for t in tensors])
        options = {k: v for k, v in group.items() if k != "params"}
        rest = [x for x, z in zip(items, flags) if not z]
        zero = [x for x, z in zip(items, flags) if z]
        if rest:
            out.append({**options, "params": rest})
        if zero:
            out.append({**options, **extra, "params": zero})
    return out
