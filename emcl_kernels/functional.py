"""EMCL's two updates as functions over lists of tensors (SPEC section 3).

``inner_step_``, ``meta_step_`` and ``inner_meta_step_`` update their tensors in place. Each
validates everything once (SPEC section 4: any bad argument raises a clear ``ValueError`` /
``TypeError`` / ``RuntimeError`` before a single tensor is written), groups the tensors by
(device, dtype) and hands every group to one call of the chosen backend.

[note: non-finite gradients] With ``check_finite=True`` (the default) a call whose gradients hold
an inf or a NaN writes nothing at all. :func:`found_non_finite` computes one 0-d fp32 flag per
call on the device, in one fused pass over the gradients per (device, dtype) group
(``torch._amp_foreach_non_finite_check_and_unscale_`` with a unit scale, the op GradScaler uses;
it rewrites every gradient with its own value: finite values and infs bit for bit, a NaN stays a
NaN though a bf16 NaN's payload bits may change), combines it with a
``found_inf`` the caller passes (GradScaler) and hands it to every backend as ``found_inf``; the
backends skip on it without a host sync in the fused kernels. This is the only place the flag
is made, so every backend skips the same steps.
"""
from __future__ import annotations

import math
from collections import defaultdict
from numbers import Real
from typing import Optional, Sequence

import torch
from torch import Tensor

from emcl_kernels.backends import get_backend
from emcl_kernels.integration import (_range_error, capturing, is_dtensor, local,
                                      number_or_tensor, tensor_hyperparameter)
from emcl_kernels.reference import compute_dtype

__all__ = ["inner_step_", "meta_step_", "inner_meta_step_", "check_hyperparameters",
           "found_non_finite", "resolve_backend", "PARAM_DTYPES", "LR_MODES",
           "IMPORTANCE_KINDS"]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LR_MODES = ("recurrent", "inverse", "constant")
IMPORTANCE_KINDS = ("taylor", "si")

_INF = float("inf")
try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except Exception:  # pragma: no cover - builds without torch.distributed
    _DTENSOR = None


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _number(name: str, value, *, low: float = 0.0, high: float = _INF, low_open: bool = False,
            allow_inf: bool = False) -> float:
    if isinstance(value, Tensor) or torch.compiler.is_compiling():
        # a 0-d tensor (capturable mode) or a number traced by torch.compile: see
        # emcl_kernels.integration.number_or_tensor for what can be checked without a sync
        return number_or_tensor(name, value, low=low, high=high, low_open=low_open,
                                allow_inf=allow_inf)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < low or (low_open and value == low) or value > high:
        raise _range_error(name, value, low, high, low_open)
    return value


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


# Sets of plain hyper-parameter values already checked (an optimizer passes the same ones every
# step): key -> the normalized dict. The key holds each value's type, because 1 == 1.0 == True.
_CHECKED_HYPER: dict = {}
_PLAIN_HYPER_TYPES = (float, int, str, bool, type(None))


def check_hyperparameters(**hp) -> dict:
    """Check the hyper-parameters that are given against their domains and return them
    normalized (floats, validated strings). Raises ``TypeError``/``ValueError`` naming the bad one.

    A set of plain numbers, strings and bools that passed once is remembered, so the check
    costs one dictionary lookup on every later step (tensor values are checked every time).
    """
    key = None
    if all(type(v) in _PLAIN_HYPER_TYPES for v in hp.values()):
        key = tuple((k, type(v), v) for k, v in hp.items())
        done = _CHECKED_HYPER.get(key)
        if done is not None:
            return dict(done)
    out = _check_hyperparameters(hp)
    if key is not None and not torch.compiler.is_compiling():
        if len(_CHECKED_HYPER) >= 1024:  # hyper-parameters swept every step: keep it bounded
            _CHECKED_HYPER.clear()
        _CHECKED_HYPER[key] = dict(out)
    return out


def _check_hyperparameters(hp: dict) -> dict:
    out = {}
    for name, value in hp.items():
        if name in ("inner_lr", "meta_lr", "reg", "gamma", "lr_scale", "lr_min"):
            out[name] = _number(name, value)                  # rates and strengths: >= 0
        elif name == "decay":
            out[name] = _number(name, value, high=1.0)
        elif name == "eps":
            out[name] = _number(name, value, low_open=True)
        elif name == "lr_max":
            out[name] = _number(name, value, allow_inf=True)
        elif name == "lr_mode":
            out[name] = _choice(name, value, LR_MODES)
        elif name == "importance":
            out[name] = _choice(name, value, IMPORTANCE_KINDS)
        elif name == "prox":
            if not isinstance(value, bool):
                raise TypeError(f"prox must be a bool, got {type(value).__name__} {value!r}")
            out[name] = value
        else:
            raise TypeError(f"unknown hyper-parameter {name!r}")
    if "lr_min" in out and "lr_max" in out and not tensor_hyperparameter(out["lr_min"]) \
            and not tensor_hyperparameter(out["lr_max"]) and out["lr_max"] < out["lr_min"]:
        raise ValueError(f"lr_max ({out['lr_max']}) must be >= lr_min ({out['lr_min']})")
    return out


def _as_list(name: str, tensors) -> list:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, "
                        f"got {type(tensors).__name__}")
    return list(tensors)


_STRIDED = torch.strided


def _check_tensor(role: str, i: int, t, param: Tensor, dtype: torch.dtype) -> None:
    # The common case in one expression (this runs for every tensor of every step); the
    # checks below only run to say what is wrong.
    if (type(t) is Tensor or type(t) is torch.nn.Parameter) and type(param) is not _DTENSOR \
            and t.dtype == dtype and t.layout == _STRIDED and t.shape == param.shape \
            and t.device == param.device and t.is_contiguous():
        return
    where = f"{role}[{i}]"
    if not isinstance(t, Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    if is_dtensor(t) != is_dtensor(param):
        raise TypeError(f"{where} is {'a' if is_dtensor(t) else 'not a'} DTensor but params[{i}] "
                        f"is {'a' if is_dtensor(param) else 'not a'} DTensor; a sharded "
                        "parameter needs its gradient and state sharded like it")
    if is_dtensor(t) and t.placements != param.placements:
        raise ValueError(f"{where} has placements {t.placements} but params[{i}] has "
                         f"{param.placements}")
    if t.layout != torch.strided:
        raise RuntimeError(f"{where} is {t.layout}; EMCL needs dense (strided) tensors, "
                           "sparse gradients are not supported")
    if t.dtype != dtype:
        raise TypeError(f"{where} has dtype {t.dtype}, expected {dtype}")
    if t.device != param.device:
        raise RuntimeError(f"{where} is on {t.device} but params[{i}] is on {param.device}")
    if t.shape != param.shape:
        raise ValueError(f"{where} has shape {tuple(t.shape)} but params[{i}] has shape "
                         f"{tuple(param.shape)}")
    if not local(t).is_contiguous():
        raise RuntimeError(f"{where} is not contiguous; call .contiguous() on it first")


_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)
_STATE_DTYPE = {dt: compute_dtype(dt) for dt in PARAM_DTYPES}


def _all_plain_and_matching(params: list, grads: list, states: list) -> bool:
    """The common case, decided fast: every tensor a plain dense contiguous tensor (no
    DTensor, no subclass), each gradient like its parameter, each state tensor shaped like it
    in the state dtype, no parameter twice. False sends the caller to the checks that say
    what is wrong (this one never raises)."""
    plain, strided = _PLAIN_TENSOR_TYPES, _STRIDED
    compiling = torch.compiler.is_compiling()
    seen = set()
    for i, p in enumerate(params):
        if type(p) not in plain:
            return False
        dtype = p.dtype
        sdt = _STATE_DTYPE.get(dtype)
        if sdt is None or p.layout != strided or not p.is_contiguous():
            return False
        shape, device = p.shape, p.device
        g = grads[i]
        if type(g) not in plain or g.dtype != dtype or g.shape != shape or g.device != device \
                or g.layout != strided or not g.is_contiguous():
            return False
        for lst in states:
            t = lst[i]
            if type(t) not in plain or t.dtype != sdt or t.shape != shape or t.device != device \
                    or t.layout != strided or not t.is_contiguous():
                return False
        if not compiling and p.numel():
            key = (device, p.data_ptr())
            if key in seen:
                return False
            seen.add(key)
    return True


def _check_lists(params, grads, anchors, importances, meta_lrs, *, need_meta_lrs: bool):
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
    states = [lst for name, lst in lists.items() if name != "grads"]
    if _all_plain_and_matching(params, lists["grads"], states):
        return params, lists["grads"], lists["anchors"], lists["importances"], lists.get("meta_lrs")
    seen = {}
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{i}] must be a tensor, got {type(p).__name__}")
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"params[{i}] has dtype {p.dtype}; EMCL supports "
                            f"{', '.join(map(str, PARAM_DTYPES))}")
        _check_tensor("params", i, p, p, p.dtype)
        _check_tensor("grads", i, lists["grads"][i], p, p.dtype)
        state_dtype = compute_dtype(p.dtype)
        for name in ("anchors", "importances", "meta_lrs"):
            if name in lists:
                _check_tensor(name, i, lists[name][i], p, state_dtype)
        if p.numel() and not torch.compiler.is_compiling():  # data_ptr cannot be traced
            key = (p.device, local(p).data_ptr())
            if key in seen:
                raise ValueError(f"params[{i}] and params[{seen[key]}] share storage; "
                                 "each parameter may appear only once")
            seen[key] = i
    return params, lists["grads"], lists["anchors"], lists["importances"], lists.get("meta_lrs")


def _check_flag(name: str, t) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.numel() != 1 or not t.is_floating_point():
        raise TypeError(f"{name} must be None or a one-element floating-point tensor")
    if is_dtensor(t):
        raise TypeError(f"{name} must be a plain tensor, not a DTensor")


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

def _groups(params):
    """Indices of the tensors by (device, dtype), in first-seen order."""
    groups = defaultdict(list)
    for i, p in enumerate(params):
        groups[(p.device if type(p) in _PLAIN_TENSOR_TYPES else local(p).device, p.dtype)].append(i)
    return groups


def _run(op: str, backend: str, params, grads, anchors, importances, meta_lrs, grad_scale,
         found_inf, hp, check_finite: bool = False) -> Optional[Tensor]:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
    _check_flag("grad_scale", grad_scale)
    _check_flag("found_inf", found_inf)
    groups = _groups(params)
    # Resolve every group's backend before any tensor is written.
    tensor_hp = any(tensor_hyperparameter(v) for v in hp.values())
    plan = [(_backend_for(backend, device, tensor_hp), device, dtype, idx)
            for (device, dtype), idx in groups.items()]
    if check_finite:
        found_inf = found_non_finite(grads, found_inf)
    sharded = any(type(p) not in _PLAIN_TENSOR_TYPES and is_dtensor(p) for p in params)
    for mod, device, dtype, idx in plan:
        if sharded:  # DTensor: the kernels update the local shards
            pick = lambda lst: [local(lst[i]) for i in idx]  # noqa: E731
        elif len(idx) == len(params):  # one group: the lists as they are
            pick = list  # noqa: E731
        else:
            pick = lambda lst: [lst[i] for i in idx]  # noqa: E731
        args = [pick(params), pick(grads), pick(anchors), pick(importances)]
        if op != "inner_step":
            args.append(None if meta_lrs is None else pick(meta_lrs))
        flags = {"grad_scale": _on(grad_scale, device), "found_inf": _on(found_inf, device)}
        getattr(mod, op)(*args, **_hyper_for(mod, hp, device, dtype), **flags)
    return found_inf


def _backend_for(backend: str, device: torch.device, tensor_hp: bool):
    """The backend module for one group. Tensor hyper-parameters inside torch.compile or a CUDA
    graph capture need a backend that reads them on the device (``TENSOR_HYPERPARAMETERS``):
    ``"auto"`` then takes ``"foreach"``; a backend named explicitly that cannot is an error."""
    mod = resolve_backend(backend, device)
    if tensor_hp and not getattr(mod, "TENSOR_HYPERPARAMETERS", False) and capturing():
        if backend != "auto":
            raise RuntimeError(
                f"backend {backend!r} takes hyper-parameters as floats only, and reading the "
                "tensor hyper-parameters (capturable mode) would need a host sync inside "
                "torch.compile / CUDA graph capture; use backend='foreach' or 'auto', or float "
                "hyper-parameters")
        mod = resolve_backend("foreach", device)
    return mod


_RESOLVED: dict = {}  # (name, device) -> backend module


def resolve_backend(name: str, device: torch.device):
    """:func:`emcl_kernels.backends.get_backend`, remembered per (name, device): what is
    available does not change within a process, and a step traced by torch.compile must not
    re-run the availability checks (some query the dispatcher, which cannot be traced).
    The optimizer resolves its backend when it is built, so its compiled steps hit this cache."""
    mod = _RESOLVED.get((name, device))
    if mod is None:
        mod = _RESOLVED[(name, device)] = get_backend(name, device)
    return mod


def _hyper_for(mod, hp: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The hyper-parameters as backend ``mod`` takes them: 0-d tensors are moved to the group's
    device for a backend that declares ``TENSOR_HYPERPARAMETERS = True`` and read back as floats
    (one host sync, never inside a capture: see :func:`_backend_for`) for the others."""
    if not any(tensor_hyperparameter(v) for v in hp.values()):
        return hp
    if getattr(mod, "TENSOR_HYPERPARAMETERS", False):
        cdt = compute_dtype(dtype)
        return {k: (v.to(device=device, dtype=cdt) if tensor_hyperparameter(v) else v)
                for k, v in hp.items()}
    return {k: (float(v.item()) if tensor_hyperparameter(v) else v) for k, v in hp.items()}


_UNIT_SCALE: dict = {}  # device -> the 0-d fp32 1.0 that found_non_finite "unscales" by


def _unit_scale(device: torch.device) -> Tensor:
    """The 0-d fp32 1.0 of ``device``, made once per device: one launch less per step on a GPU."""
    unit = _UNIT_SCALE.get(device)
    if unit is None:
        unit = _UNIT_SCALE[device] = torch.ones((), dtype=torch.float32, device=device)
    return unit


def found_non_finite(grads: Sequence[Tensor],
                     found_inf: Optional[Tensor] = None) -> Optional[Tensor]:
    """A 0-d fp32 flag on ``grads[0]``'s device: 1 when any gradient holds an inf or a NaN or
    ``found_inf`` is non-zero, else 0 (None when ``grads`` is empty and ``found_inf`` is None).

    One fused pass over the gradients of each (device, dtype) group, no host sync (unless the
    gradients live on several devices: the flags of the other devices are then copied to the
    first one). The gradients keep their values: GradScaler's check-and-unscale op runs with a
    unit scale (a NaN stays a NaN, though its payload bits may change). See
    [note: non-finite gradients].
    """
    grads = _as_list("grads", grads)
    _check_flag("found_inf", found_inf)
    if grads and found_inf is None:
        # the common case: plain non-empty gradients of one device and dtype, one fused pass
        g0 = grads[0]
        plain, device, dtype = _PLAIN_TENSOR_TYPES, getattr(g0, "device", None), getattr(g0, "dtype", None)
        if all(type(g) in plain and g.device == device and g.dtype == dtype and g.numel() for g in grads):
            flag = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, _unit_scale(device))
            return flag
    by_device = defaultdict(lambda: defaultdict(list))
    mesh = None
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise TypeError(f"grads[{i}] must be a tensor, got {type(g).__name__}")
        if is_dtensor(g):  # FSDP2: check the local shard; the ranks then agree (below)
            mesh = g.device_mesh if mesh is None else mesh
            g = local(g)
        if g.numel():
            by_device[g.device][g.dtype].append(g)
    if not by_device and mesh is None:
        return None if found_inf is None else (found_inf.reshape(()) != 0).to(torch.float32)
    flag = None
    for device, by_dtype in by_device.items():
        here = torch.zeros((), dtype=torch.float32, device=device)
        for lst in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(lst, here, _unit_scale(device))
        flag = here if flag is None else torch.maximum(flag, here.to(flag.device))
    if flag is None:  # sharded gradients with no local elements on this rank
        flag = torch.zeros((), dtype=torch.float32, device=mesh.device_type)
    if mesh is not None:
        # an inf in a shard is seen by its rank only; every rank must skip the same steps
        import torch.distributed as dist
        for dim in range(mesh.ndim):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if found_inf is not None:
        flag = torch.maximum(flag, (found_inf.reshape(()) != 0).to(flag.device, torch.float32))
    return flag


def _on(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    if t is None:
        return None
    return t.reshape(()).to(device=device, dtype=torch.float32)


@torch.no_grad()
def inner_step_(params: Sequence[Tensor], grads: Sequence[Tensor], anchors: Sequence[Tensor],
                importances: Sequence[Tensor], *, inner_lr: float, reg: float, gamma: float,
                prox: bool = True, backend: str = "auto", grad_scale: Optional[Tensor] = None,
                found_inf: Optional[Tensor] = None,
                check_finite: bool = True) -> Optional[Tensor]:
    """EMCL's inner step (paper eqs. 14, 15, 19) on every tensor, in place.

    ``prox=True``:  θ ← (θ − β·g + γλh·θ₀) / (1 + γλh);  ``prox=False``: θ ← θ − β·(g + λh·(θ − θ₀)).

    Args:
        params, grads: θ and g (fp32, bf16, fp16 or fp64; g like θ), contiguous.
        anchors, importances: θ₀ and h, fp32 (fp64 for fp64 params), shaped like θ.
        inner_lr, reg, gamma: β, λ, γ (finite, >= 0).
        prox: the proximal update of eq. 19 (default) or the plain gradient step.
        backend: a name of :func:`emcl_kernels.available_backends` or ``"auto"``.
        grad_scale: gradients are divided by it (for ``torch.amp.GradScaler``).
        found_inf: when non-zero, nothing is written.
        check_finite: when True (default), a call whose gradients hold an inf or a NaN writes
            nothing (the flag is computed on the device, combined with ``found_inf``; see
            [note: non-finite gradients]). False skips the check, for speed.

    Returns:
        The skip flag the backends were given (a 0-d fp32 tensor, non-zero when nothing was
        written), or None when there was none (no check and no ``found_inf``, or no tensors).
    """
    hp = check_hyperparameters(inner_lr=inner_lr, reg=reg, gamma=gamma, prox=prox)
    params, grads, anchors, importances, _ = _check_lists(
        params, grads, anchors, importances, None, need_meta_lrs=False)
    if params:
        return _run("inner_step", backend, params, grads, anchors, importances, None, grad_scale,
                    found_inf, hp, check_finite)
    return None


@torch.no_grad()
def meta_step_(params: Sequence[Tensor], grads: Sequence[Tensor], anchors: Sequence[Tensor],
               importances: Sequence[Tensor], meta_lrs: Optional[Sequence[Tensor]], *,
               meta_lr: float, reg: float, decay: float, lr_scale: float, lr_mode: str,
               lr_min: float = 0.0, lr_max: float = _INF, eps: float = 1e-8,
               importance: str = "taylor", backend: str = "auto",
               grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
               check_finite: bool = True) -> Optional[Tensor]:
    """EMCL's meta step (paper eqs. 7, 8, 10, 13) on every tensor, in place.

    h ← η·h + (1−η)·Ω with Ω = |g·θ₀| (``importance="taylor"``) or |g·(θ − θ₀)| (``"si"``);
    α from ``lr_mode`` (``"recurrent"``: α ← clip(α·r/(h+ε)), stored in ``meta_lrs``;
    ``"inverse"``: α = clip(α₀·r/(h+ε)); ``"constant"``: α = α₀);
    θ₀ ← θ₀ − α·λ·h·(θ₀ − θ); θ ← θ₀.

    ``meta_lrs`` may be None unless ``lr_mode="recurrent"``. The other arguments are as in
    :func:`inner_step_` (as are ``check_finite`` and the returned flag); ``decay`` is in
    [0, 1], ``eps`` > 0, ``0 <= lr_min <= lr_max``.
    """
    hp = check_hyperparameters(meta_lr=meta_lr, reg=reg, decay=decay, lr_scale=lr_scale,
                               lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max, eps=eps,
                               importance=importance)
    return _meta_call("meta_step", backend, params, grads, anchors, importances, meta_lrs,
                      grad_scale, found_inf, hp, check_finite)


@torch.no_grad()
def inner_meta_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                     anchors: Sequence[Tensor], importances: Sequence[Tensor],
                     meta_lrs: Optional[Sequence[Tensor]], *, inner_lr: float, meta_lr: float,
                     reg: float, gamma: float, decay: float, lr_scale: float, lr_mode: str,
                     lr_min: float = 0.0, lr_max: float = _INF, eps: float = 1e-8,
                     importance: str = "taylor", prox: bool = True, backend: str = "auto",
                     grad_scale: Optional[Tensor] = None,
                     found_inf: Optional[Tensor] = None,
                     check_finite: bool = True) -> Optional[Tensor]:
    """The inner step, then the meta step with the same gradient, as one pass.

    Equal to :func:`inner_step_` followed by :func:`meta_step_`, except that the fast weight
    between the two is kept in fp32 rather than rounded to a bf16/fp16 parameter's dtype.
    ``check_finite`` and the returned flag are as in :func:`inner_step_`.
    """
    hp = check_hyperparameters(inner_lr=inner_lr, meta_lr=meta_lr, reg=reg, gamma=gamma,
                               decay=decay, lr_scale=lr_scale, lr_mode=lr_mode, lr_min=lr_min,
                               lr_max=lr_max, eps=eps, importance=importance, prox=prox)
    return _meta_call("inner_meta_step", backend, params, grads, anchors, importances, meta_lrs,
                      grad_scale, found_inf, hp, check_finite)


def _meta_call(op, backend, params, grads, anchors, importances, meta_lrs, grad_scale,
               found_inf, hp, check_finite) -> Optional[Tensor]:
    """The part of meta_step_ / inner_meta_step_ after their hyper-parameters are checked:
    meta_lrs are needed (and passed on) only in recurrent mode."""
    need = hp["lr_mode"] == "recurrent"
    params, grads, anchors, importances, meta_lrs = _check_lists(
        params, grads, anchors, importances, meta_lrs, need_meta_lrs=need)
    if not params:
        return None
    return _run(op, backend, params, grads, anchors, importances, meta_lrs if need else None,
                grad_scale, found_inf, hp, check_finite)
