"""What lets the same updates run under torch.distributed, torch.compile and CUDA graphs.

- **DTensor** parameters (FSDP2's ``fully_shard``): :func:`local` gives the local shard that the
  kernels update in place; state made with ``zeros_like`` / ``to`` on a DTensor is a DTensor
  sharded like its parameter, as in torch's own optimizers.
- **Tensor hyper-parameters** (capturable mode): a hyper-parameter may be a one-element floating
  tensor instead of a number, so that a captured CUDA graph (or a compiled step) reads its
  current value at replay time; change it in place (``t.fill_(v)``), never by rebinding.
  :func:`number_or_tensor` checks what can be checked without a host sync.
- :func:`capturing`: whether a host sync would break the current context (torch.compile
  tracing, CUDA graph capture), so that ``found_inf`` must be handled without reading it.
"""
from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local", "capturing", "tensor_hyperparameter", "number_or_tensor"]

try:  # torch.distributed is optional (some builds have none)
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - builds without distributed
    _DTensor = None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor a kernel updates in place: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def capturing() -> bool:
    """True while torch.compile traces or a CUDA graph is being captured: no host syncs then."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tensor_hyperparameter(value) -> bool:
    """Whether a (checked) hyper-parameter value is a tensor rather than a number."""
    return isinstance(value, Tensor)


def _range_error(name: str, value, low, high, low_open):
    lo = "(" if low_open else "["
    return ValueError(f"{name} must be in {lo}{low}, {high}], got {value}")


def number_or_tensor(name: str, value, *, low: float = 0.0, high: float = math.inf,
                     low_open: bool = False, allow_inf: bool = False):
    """Check a hyper-parameter that is a tensor, or a number seen while torch.compile traces.

    A tensor must hold one floating-point element (it is returned as is, so in-place changes
    keep reaching the kernels); its value is checked like a number's unless that would need a
    host sync inside a compiled region or a CUDA graph capture (then it was checked when the
    optimizer was built). A traced number is type-checked and range-checked (the comparisons
    become guards, so a value outside the domain still raises) and returned unchanged, so that
    torch.compile can treat it as a symbol instead of recompiling for each new value.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} given as a tensor must hold one floating-point element, "
                            f"got shape {tuple(value.shape)} dtype {value.dtype}")
        if value.requires_grad:
            raise ValueError(f"{name} must not require grad")
        if is_dtensor(value):
            raise TypeError(f"{name} must be a plain tensor, not a DTensor")
        if not capturing():
            v = float(value.item())
            if math.isnan(v) or (math.isinf(v) and not allow_inf):
                raise ValueError(f"{name} must be finite, got {v}")
            if v < low or (low_open and v == low) or v > high:
                raise _range_error(name, v, low, high, low_open)
        return value
    if isinstance(value, bool) or not isinstance(value, (Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value  # a comparison would specialize it (recompile per value): checked eagerly
    if value < low or (low_open and value == low) or value > high:
        raise _range_error(name, value, low, high, low_open)
    return value
