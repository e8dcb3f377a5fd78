"""EMCL's two updates as functions over lists of tensors (SPEC section 3).

``inner_step_``, ``meta_step_`` and ``inner_meta_step_`` update their tensors in place. Each call
validates everything (:mod:`emcl_kernels.validation`: any bad argument raises a clear
``ValueError`` / ``TypeError`` / ``RuntimeError`` before a single tensor is written), groups the
tensors by (device, dtype) into :class:`~emcl_kernels.plan.Plan` objects and runs one backend call
per group (:func:`emcl_kernels.plan.run`).

[note: non-finite gradients] With ``check_finite=True`` (the default) a call whose gradients hold
an inf or a NaN writes nothing at all: every backend first makes one read-only pass over the
gradients (its own kernel: every parameter dtype, no ``torch._amp_*`` op, the gradients are not
written) that sets a flag on the device, and the update reads that flag on the device; a
``found_inf`` the caller passes (GradScaler) is honoured as well.

``FusedEMCLOptimizer`` does not come through here: it validates when its configuration changes
and keeps its plans (as torch's optimizers call ``torch._fused_adam_``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch
from torch import Tensor

from emcl_kernels.backends.extension import entry_point
from emcl_kernels.integration import is_dtensor, local
from emcl_kernels.interface import COUNTER, OP
from emcl_kernels.interface import run_skipped_at
from emcl_kernels.plan import (Plan, agree_on_found, check_run_layout, check_runs, new_counters,
                               pack_hyper, resolve_backend, run)
from emcl_kernels.runs import group_runs
from emcl_kernels.validation import (IMPORTANCE_KINDS, LR_MODES, PARAM_DTYPES, PLAIN_TENSORS,
                                     check_flag, check_hyperparameters, check_no_overlap,
                                     check_param, check_tensor, plainly_valid, state_dtype)

__all__ = ["inner_step_", "meta_step_", "inner_meta_step_", "check_hyperparameters",
           "found_non_finite", "resolve_backend", "PARAM_DTYPES", "LR_MODES",
           "IMPORTANCE_KINDS"]

_INF = float("inf")
_SKIPPED = COUNTER["skipped"]
# ---------------------------------------------------------------------------------------------
# Validation of one call's lists
# ---------------------------------------------------------------------------------------------

def _as_list(name: str, tensors) -> list:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, "
                        f"got {type(tensors).__name__}")
    return list(tensors)


_plainly_valid_call = entry_point("plainly_valid_call")
_device = Tensor.device.__get__
_dtype = Tensor.dtype.__get__


def check_lists(params, grads, anchors, importances, meta_lrs, *, need_meta_lrs: bool):
    """The five lists of a call, checked against each other (SPEC section 4): one tensor each per
    parameter, each like its parameter, the state in the compute dtype, and no two tensors
    sharing memory. Returns them as lists (``meta_lrs`` None unless needed).

    Where the extension is built, one C++ pass accepts the common case (plain contiguous
    tensors, nothing shared: ``_C.plainly_valid_call``); anything else gets the Python checks,
    which name what is wrong."""
    params = _as_list("params", params)
    lists = {"grads": _as_list("grads", grads), "anchors": _as_list("anchors", anchors),
             "importances": _as_list("importances", importances)}
    if need_meta_lrs:
        if meta_lrs is None:
            raise ValueError("lr_mode='recurrent' needs meta_lrs, the per-element meta learning "
                             "rates; got None")
        lists["meta_lrs"] = _as_list("meta_lrs", meta_lrs)
    for name, lst in lists.items():
        if len(lst) != len(params):
            raise ValueError(f"{name} has {len(lst)} tensors but params has {len(params)}")
    if _plainly_valid_call is not None and not torch.compiler.is_compiling() and \
            _plainly_valid_call(PLAIN_TENSORS, params, lists["grads"], lists["anchors"],
                                lists["importances"], lists.get("meta_lrs", [])):
        return params, lists["grads"], lists["anchors"], lists["importances"], \
            lists.get("meta_lrs")
    state_roles = [name for name in ("anchors", "importances", "meta_lrs") if name in lists]
    named = []
    for i, p in enumerate(params):
        g = lists["grads"][i]
        states = [lists[name][i] for name in state_roles]
        if not plainly_valid(p, g, states):
            check_param(f"params[{i}]", p)
            check_tensor("grads", i, g, p, p.dtype)
            sdt = state_dtype(p.dtype)
            for name, t in zip(state_roles, states):
                check_tensor(name, i, t, p, sdt)
        named.append((("params", i), p))
        named.append((("grads", i), g))
        named.extend(((name, i), t) for name, t in zip(state_roles, states))
    if not torch.compiler.is_compiling():  # addresses cannot be traced
        check_no_overlap(named)
    return params, lists["grads"], lists["anchors"], lists["importances"], lists.get("meta_lrs")


# ---------------------------------------------------------------------------------------------
# The calls
# ---------------------------------------------------------------------------------------------

def _plans(backend: str, hp: dict, params, grads, anchors, importances, meta_lrs, plain: bool,
           runs: int = 1):
    """One plan per (device, dtype) group, every backend resolved before anything runs.
    ``plain``: every parameter is a plain tensor (no DTensor: ``local(t)`` is ``t``)."""
    devices = list(map(_device, params)) if plain else [local(p).device for p in params]
    dtypes = list(map(_dtype, params))
    n = len(params)
    if devices.count(devices[0]) == n and dtypes.count(dtypes[0]) == n:
        groups = {(devices[0], dtypes[0]): range(n)}          # the common case: one group
    else:
        groups = defaultdict(list)
        for i, key in enumerate(zip(devices, dtypes)):
            groups[key].append(i)
    plans, plan_grads = [], []
    hypers = {}
    for (device, dtype), idx in groups.items():
        mod = resolve_backend(backend, device)
        if device not in hypers:
            hypers[device] = pack_hyper(hp, device, runs)
        if plain and len(idx) == n:
            pick = list
        else:
            pick = (lambda lst: [local(lst[i]) for i in idx])
        plans.append(Plan(mod, device, dtype, [params[i] for i in idx], pick(params),
                          pick(anchors), pick(importances),
                          pick(meta_lrs) if meta_lrs is not None else [],
                          torch.zeros(0, dtype=torch.float32, device=device), hypers[device],
                          prox=hp.get("prox", True), importance=hp.get("importance", "taylor"),
                          lr_mode=hp.get("lr_mode", "constant"), runs=runs))
        plan_grads.append(pick(grads))
    return plans, plan_grads


def _mesh(params):
    for p in params:
        if is_dtensor(p):
            return p.device_mesh
    return None


def _hyper(runs, **values) -> tuple:
    """The checked hyper-parameters of a call and its number of runs: scalars, or in an array
    of runs (``runs=N``) a scalar or N values (a sequence or a 1-d tensor) each."""
    if runs is None:
        return check_hyperparameters(**values), None
    runs = group_runs({"runs": runs}, "the call")
    return check_runs(values, runs, "the call"), runs



def _call(op: int, hp: dict, backend, params, grads, anchors, importances, meta_lrs,
          grad_scale, found_inf, check_finite, declared: Optional[int] = None,
          ) -> Optional[Tensor]:
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
    check_flag("grad_scale", grad_scale)
    check_flag("found_inf", found_inf)
    need = op != OP["inner"] and hp["lr_mode"] == "recurrent"
    params, grads, anchors, importances, meta_lrs = check_lists(
        params, grads, anchors, importances, meta_lrs, need_meta_lrs=need)
    if not params:
        return None
    runs = declared or 1
    if declared is not None:
        for i, p in enumerate(params):
            check_run_layout(f"params[{i}]", local(p), declared)
    plain = all(type(p) in PLAIN_TENSORS for p in params)
    plans, plan_grads = _plans(backend, hp, params, grads, anchors, importances,
                               meta_lrs if need else None, plain, runs)
    counters = {plan.device: None for plan in plans}
    counters = {device: new_counters(device, runs) for device in counters}
    run(plans, plan_grads, counters, op=op, meta_every=1, check=check_finite,
        grad_scale=grad_scale, found_inf=found_inf, mesh=None if plain else _mesh(params))
    if not check_finite and found_inf is None:
        return None
    first = counters[plans[0].device]
    flag = (first[_SKIPPED] > 0).to(torch.float32)
    if runs > 1:  # one flag per run: its own non-finite gradient, or every run's skip
        at = run_skipped_at(runs)
        flag = torch.maximum(flag, (first[at:at + runs] > 0).to(torch.float32))
    if found_inf is not None:
        flag = torch.maximum(flag, (found_inf.detach().reshape(-1)[0] != 0)
                             .to(device=flag.device, dtype=torch.float32))
    return flag


@torch.no_grad()
def inner_step_(params: Sequence[Tensor], grads: Sequence[Tensor], anchors: Sequence[Tensor],
                importances: Sequence[Tensor], *, inner_lr: float, reg: float, gamma: float,
                prox: bool = True, backend: str = "auto", grad_scale: Optional[Tensor] = None,
                found_inf: Optional[Tensor] = None, check_finite: bool = True,
                runs: Optional[int] = None) -> Optional[Tensor]:
    """EMCL's inner step (paper eqs. 14, 15, 19) on every tensor, in place.

    ``prox=True``:  θ ← (θ − β·g + γλh·θ₀) / (1 + γλh);  ``prox=False``: θ ← θ − β·(g + λh·(θ − θ₀)).

    Args:
        params, grads: θ and g (fp32, bf16, fp16 or fp64; g like θ), dense (contiguous or any
            other layout without gaps, e.g. channels_last), each in its own memory.
        anchors, importances: θ₀ and h, fp32 (fp64 for fp64 params), shaped and laid out like θ.
        inner_lr, reg, gamma: β, λ, γ (see ``emcl_kernels.validation``, [note: domains]).
        prox: the proximal update of eq. 19 (default) or the plain gradient step.
        backend: a name of :func:`emcl_kernels.available_backends` or ``"auto"``.
        grad_scale: gradients are divided by it (for ``torch.amp.GradScaler``).
        found_inf: when non-zero, nothing is written.
        check_finite: when True (default), a call whose gradients hold an inf or a NaN writes
            nothing (see [note: non-finite gradients]). False skips the check, for speed.
        runs: an array of N runs (see :mod:`emcl_kernels.runs`): every tensor is [N, ...],
            run-major, and every numeric hyper-parameter may be N values (a sequence or a 1-d
            tensor) or a scalar for every run; a run whose gradient holds an inf or a NaN
            writes nothing of its own, the others step.

    Returns:
        A 0-d fp32 flag, non-zero when nothing was written (with ``runs``: one flag per run);
        None when there was no check and no ``found_inf`` (or no tensors).
    """
    hp, runs = _hyper(runs, inner_lr=inner_lr, reg=reg, gamma=gamma, prox=prox)
    return _call(OP["inner"], hp, backend, params, grads, anchors, importances, None,
                 grad_scale, found_inf, check_finite, runs)


@torch.no_grad()
def meta_step_(params: Sequence[Tensor], grads: Sequence[Tensor], anchors: Sequence[Tensor],
               importances: Sequence[Tensor], meta_lrs: Optional[Sequence[Tensor]], *,
               meta_lr: float, reg: float, decay: float, lr_scale: Optional[float],
               lr_mode: str, lr_min: float = 0.0, lr_max: float = _INF, eps: float = 1e-8,
               importance: str = "taylor", backend: str = "auto",
               grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
               check_finite: bool = True, runs: Optional[int] = None) -> Optional[Tensor]:
    """EMCL's meta step (paper eqs. 7, 8, 10, 13) on every tensor, in place.

    h ← η·h + (1−η)·Ω with Ω = |g·θ₀| (``importance="taylor"``) or |g·(θ − θ₀)| (``"si"``);
    α from ``lr_mode`` (``"recurrent"``: α ← clip(α·r/(h+ε)), stored in ``meta_lrs``;
    ``"inverse"``: α = clip(α₀·r/(h+ε)); ``"constant"``: α = α₀);
    θ₀ ← θ₀ − α·λ·h·(θ₀ − θ); θ ← θ₀.

    ``meta_lrs`` may be None unless ``lr_mode="recurrent"``; ``lr_scale=None`` means 1/reg. The
    other arguments, ``check_finite``, ``runs`` and the returned flag are as in
    :func:`inner_step_`.
    """
    hp, runs = _hyper(runs, meta_lr=meta_lr, reg=reg, decay=decay, lr_scale=lr_scale,
                      lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max, eps=eps,
                      importance=importance)
    return _call(OP["meta"], hp, backend, params, grads, anchors, importances, meta_lrs,
                 grad_scale, found_inf, check_finite, runs)


@torch.no_grad()
def inner_meta_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                     anchors: Sequence[Tensor], importances: Sequence[Tensor],
                     meta_lrs: Optional[Sequence[Tensor]], *, inner_lr: float, meta_lr: float,
                     reg: float, gamma: float, decay: float, lr_scale: Optional[float],
                     lr_mode: str, lr_min: float = 0.0, lr_max: float = _INF,
                     eps: float = 1e-8, importance: str = "taylor", prox: bool = True,
                     backend: str = "auto", grad_scale: Optional[Tensor] = None,
                     found_inf: Optional[Tensor] = None, check_finite: bool = True,
                     runs: Optional[int] = None) -> Optional[Tensor]:
    """The inner step, then the meta step with the same gradient, as one pass.

    Equal to :func:`inner_step_` followed by :func:`meta_step_`, except that the fast weight
    between the two is kept in fp32 rather than rounded to a bf16/fp16 parameter's dtype.
    ``check_finite``, ``runs`` and the returned flag are as in :func:`inner_step_`.
    """
    hp, runs = _hyper(runs, inner_lr=inner_lr, meta_lr=meta_lr, reg=reg, gamma=gamma,
                      decay=decay, lr_scale=lr_scale, lr_mode=lr_mode, lr_min=lr_min,
                      lr_max=lr_max, eps=eps, importance=importance, prox=prox)
    return _call(OP["inner_meta"], hp, backend, params, grads, anchors, importances, meta_lrs,
                 grad_scale, found_inf, check_finite, runs)


@torch.no_grad()
def found_non_finite(grads: Sequence[Tensor],
                     found_inf: Optional[Tensor] = None) -> Optional[Tensor]:
    """A 0-d fp32 flag on ``grads[0]``'s device: 1 when any gradient holds an inf or a NaN or
    ``found_inf`` is non-zero, else 0 (None when ``grads`` is empty and ``found_inf`` is None).

    One read-only pass over the gradients of each (device, dtype) group by the fastest backend
    for the device, no host sync; the ranks of a DTensor mesh agree on the answer."""
    grads = _as_list("grads", grads)
    check_flag("found_inf", found_inf)
    by_device = defaultdict(list)
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise TypeError(f"grads[{i}] must be a tensor, got {type(g).__name__}")
        if g.layout != torch.strided:
            raise RuntimeError(f"grads[{i}] is a {g.layout} tensor; EMCL needs dense tensors")
        if local(g).numel():
            by_device[local(g).device].append(local(g))
    if not by_device:
        if found_inf is None:
            return None
        return (found_inf.detach().reshape(-1)[0] != 0).to(torch.float32)
    counters = {device: new_counters(device) for device in by_device}
    for device, lst in by_device.items():
        resolve_backend("auto", device).check_finite(lst, counters[device])
    agree_on_found(list(counters.values()), _mesh(grads))
    first = next(iter(counters.values()))
    flag = (first[COUNTER["found"]] != 0).to(torch.float32)
    if found_inf is not None:
        flag = torch.maximum(flag, (found_inf.detach().reshape(-1)[0] != 0)
                             .to(device=flag.device, dtype=torch.float32))
    return flag
