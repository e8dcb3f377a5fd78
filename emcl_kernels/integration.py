"""What lets the same updates run under torch.distributed, torch.compile and CUDA graphs.

- **DTensor** parameters (FSDP2's ``fully_shard``): :func:`local` gives the local shard that the
  kernels update in place; state made with ``zeros_like`` / ``to`` on a DTensor is a DTensor
  sharded like its parameter, as in torch's own optimizers.
- :func:`capturing`: whether a host sync would break the current context (torch.compile
  tracing, CUDA graph capture): then nothing is read on the host (hyper-parameter values are
  not checked, skips are not polled, the foreach backend selects its results with
  ``torch.where``).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local", "capturing"]

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
