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

import sys

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local", "capturing"]

# [note: DTensor looked up lazily]
# Importing torch.distributed.tensor costs about 0.6 s (more than the rest of this package), so
# it is never imported here. A tensor can only be a DTensor once that module has been imported
# (by the user, FSDP2 or torch.distributed's own code), and importing any submodule imports it,
# so is_dtensor reads the class from sys.modules: None (no DTensor can exist yet) until then.
# tests/test_import_cost.py fails if `import emcl_kernels` imports the module.
_DTENSOR_MODULE = "torch.distributed.tensor"
_DTensor = None


def _dtensor_class():
    """``torch.distributed.tensor.DTensor`` when that module has been imported, else None."""
    global _DTensor
    if _DTensor is None:
        module = sys.modules.get(_DTENSOR_MODULE)
        if module is not None:
            _DTensor = getattr(module, "DTensor", None)
    return _DTensor


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    cls = _DTensor if _DTensor is not None else _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """The tensor a kernel updates in place: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def capturing() -> bool:
    """True while torch.compile traces or a CUDA graph is being captured: no host syncs then."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
