"""The backends, by name, and what is available on this machine (SPEC section 3).

Every backend is one module that implements the op interface of :mod:`emcl_kernels.interface`
([note: the step call]) over lists of tensors that all live on one device and share one
parameter dtype (the optimizer's plans or ``functional`` have validated and grouped them):

    step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op, prox,
         importance, lr_mode, meta_every, check, finalize, grad_scale=None, found_inf=None)
    check_finite(grads, counters)

A module that checks each call's gradients itself (the compiled backends) sets
``CHECKS_GRADS = True``; the optimizer checks them for the others. A module may also define
``unavailable_reason(name: str, device_type: str | None) -> str | None``: None when backend
``name`` works here on tensors of ``device_type`` (on some device, when None), else the reason.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

__all__ = ["BACKENDS", "BackendUnavailableError", "available_backends", "backend_status",
           "get_backend", "auto_backend"]


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here; the message says why."""


@dataclass(frozen=True)
class _Spec:
    module: str
    device_types: Optional[frozenset]  # None: any device


BACKENDS: dict[str, _Spec] = {
    "reference": _Spec("emcl_kernels.backends.reference", None),
    "foreach": _Spec("emcl_kernels.backends.foreach", None),
    "triton": _Spec("emcl_kernels.backends.triton", frozenset({"cuda", "cpu"})),
    "cuda": _Spec("emcl_kernels.backends.extension", frozenset({"cuda"})),
    "cpu": _Spec("emcl_kernels.backends.extension", frozenset({"cpu"})),
}

# "auto" takes the first available of these for the tensors' device type.
_AUTO_ORDER = {
    "cuda": ("cuda", "triton", "foreach"),
    "cpu": ("cpu", "foreach"),
}
_AUTO_DEFAULT = ("foreach",)

_modules: dict[str, ModuleType] = {}
_import_errors: dict[str, str] = {}


def _import(name: str) -> Optional[ModuleType]:
    spec = BACKENDS[name]
    if spec.module in _modules:
        return _modules[spec.module]
    if spec.module in _import_errors:
        return None
    try:
        mod = importlib.import_module(spec.module)
    except Exception as exc:  # an optional dependency or the compiled extension is missing
        _import_errors[spec.module] = f"{type(exc).__name__}: {exc}"
        return None
    _modules[spec.module] = mod
    return mod


def _reason(name: str, device_type: Optional[str]) -> Optional[str]:
    """Why backend ``name`` cannot run on ``device_type`` (None: on any device here)."""
    if name not in BACKENDS:
        return f"unknown backend {name!r}; the backends are {sorted(BACKENDS)}"
    spec = BACKENDS[name]
    if device_type is not None and spec.device_types is not None \
            and device_type not in spec.device_types:
        return (f"backend {name!r} runs on {sorted(spec.device_types)} tensors, "
                f"not on {device_type!r} tensors")
    mod = _import(name)
    if mod is None:
        return f"backend {name!r} could not be loaded ({_import_errors[spec.module]})"
    check = getattr(mod, "unavailable_reason", None)
    if check is None:
        return None
    return check(name, device_type)


def backend_status() -> dict[str, str]:
    """Every backend name with ``"available"`` or the reason it is not available here."""
    return {name: (_reason(name, None) or "available") for name in BACKENDS}


def available_backends() -> list[str]:
    """The backends that work on this machine, in the order of :data:`BACKENDS`."""
    return [name for name in BACKENDS if _reason(name, None) is None]


def auto_backend(device: torch.device) -> str:
    """The fastest available backend for tensors on ``device``."""
    for name in _AUTO_ORDER.get(device.type, _AUTO_DEFAULT):
        if _reason(name, device.type) is None:
            return name
    return "reference"


def get_backend(name: str, device: torch.device) -> ModuleType:
    """The module of backend ``name`` (or ``"auto"``) for tensors on ``device``.

    Raises :class:`BackendUnavailableError` naming the backend and why it cannot run.
    """
    if name == "auto":
        name = auto_backend(device)
    reason = _reason(name, device.type)
    if reason is not None:
        if name not in BACKENDS:
            raise ValueError(reason)
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    return _import(name)
