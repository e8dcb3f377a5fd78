"""The ``"cpu"`` and ``"cuda"`` backends: the compiled kernels of ``emcl_kernels._C`` (``csrc/``).

The extension registers three torch operators, ``torch.ops.emcl.inner_step_``,
``meta_step_`` and ``inner_meta_step_``, with a CPU implementation (one vectorized, parallel
pass per element, ``csrc/emcl_cpu.cpp``) and, when it was built with nvcc, a CUDA
implementation (one multi-tensor launch per call, ``csrc/emcl_cuda.cu``). Both take every mode
as a compile-time parameter and read ``grad_scale``/``found_inf`` themselves (on the GPU inside
the kernel, without a host sync).

This module imports whether or not the extension is built; :func:`unavailable_reason` then
says why a backend is missing. The fake (meta) implementations registered here let
``torch.compile`` trace a step as one graph: the operators only mutate their inputs.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["inner_step", "meta_step", "inner_meta_step", "unavailable_reason", "LOAD_ERROR",
           "launch_count"]

LOAD_ERROR: Optional[str] = None
try:
    from emcl_kernels import _C  # noqa: F401  (loading it registers torch.ops.emcl.*)
except Exception as exc:  # ImportError, or an undefined symbol from a torch ABI mismatch
    LOAD_ERROR = (f"the compiled extension emcl_kernels._C is not built: "
                  f"{type(exc).__name__}: {exc}. Build it with "
                  "`pip install --no-build-isolation -e .` (needs a C++ compiler; nvcc for "
                  "'cuda')")

_OPS = ("inner_step_", "meta_step_", "inner_meta_step_")


def _has_kernel(dispatch_key: str) -> bool:
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"emcl::{op}", dispatch_key)
               for op in _OPS)


def unavailable_reason(name: str, device_type: Optional[str]) -> Optional[str]:
    """None when backend ``name`` ("cpu" or "cuda") can run here, else why not."""
    if LOAD_ERROR is not None:
        return LOAD_ERROR
    if name == "cpu":
        return None if _has_kernel("CPU") else "emcl_kernels._C has no CPU kernels"
    if name == "cuda":
        if not _has_kernel("CUDA"):
            return ("emcl_kernels._C was built without its CUDA kernels (no nvcc/CUDA_HOME at "
                    "build time, or EMCL_NO_CUDA was set); rebuild on a machine with the "
                    "CUDA toolkit")
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False: no usable GPU"
        return None
    return f"the extension serves the backends 'cpu' and 'cuda', not {name!r}"


def launch_count() -> int:
    """CUDA kernel launches done by the extension since it was loaded."""
    return int(torch.ops.emcl.launch_count())


if LOAD_ERROR is None:
    # The steps mutate their inputs in place and return nothing, so tracing them only needs
    # to know that they exist (the schemas carry which lists are written).
    @torch.library.register_fake("emcl::inner_step_")
    def _inner_step_fake(params, grads, anchors, importances, *, inner_lr, reg, gamma, prox,
                         grad_scale=None, found_inf=None):
        return None

    @torch.library.register_fake("emcl::meta_step_")
    def _meta_step_fake(params, grads, anchors, importances, meta_lrs, *, meta_lr, reg, decay,
                        lr_scale, lr_mode, lr_min, lr_max, eps, importance, grad_scale=None,
                        found_inf=None):
        return None

    @torch.library.register_fake("emcl::inner_meta_step_")
    def _inner_meta_step_fake(params, grads, anchors, importances, meta_lrs, *, inner_lr,
                              meta_lr, reg, gamma, decay, lr_scale, lr_mode, lr_min, lr_max,
                              eps, importance, prox, grad_scale=None, found_inf=None):
        return None


# ---------------------------------------------------------------------------------------------
# The backend interface (emcl_kernels/backends/__init__.py): one operator call per group.
# ---------------------------------------------------------------------------------------------

def inner_step(params, grads, anchors, importances, *, inner_lr, reg, gamma, prox,
               grad_scale=None, found_inf=None):
    torch.ops.emcl.inner_step_(params, grads, anchors, importances, inner_lr=inner_lr, reg=reg,
                               gamma=gamma, prox=prox, grad_scale=grad_scale,
                               found_inf=found_inf)


def meta_step(params, grads, anchors, importances, meta_lrs, *, meta_lr, reg, decay, lr_scale,
              lr_mode, lr_min, lr_max, eps, importance, grad_scale=None, found_inf=None):
    torch.ops.emcl.meta_step_(params, grads, anchors, importances,
                              meta_lrs if meta_lrs is not None else [], meta_lr=meta_lr,
                              reg=reg, decay=decay, lr_scale=lr_scale, lr_mode=lr_mode,
                              lr_min=lr_min, lr_max=lr_max, eps=eps, importance=importance,
                              grad_scale=grad_scale, found_inf=found_inf)


def inner_meta_step(params, grads, anchors, importances, meta_lrs, *, inner_lr, meta_lr, reg,
                    gamma, decay, lr_scale, lr_mode, lr_min, lr_max, eps, importance, prox,
                    grad_scale=None, found_inf=None):
    torch.ops.emcl.inner_meta_step_(params, grads, anchors, importances,
                                    meta_lrs if meta_lrs is not None else [],
                                    inner_lr=inner_lr, meta_lr=meta_lr, reg=reg, gamma=gamma,
                                    decay=decay, lr_scale=lr_scale, lr_mode=lr_mode,
                                    lr_min=lr_min, lr_max=lr_max, eps=eps,
                                    importance=importance, prox=prox, grad_scale=grad_scale,
                                    found_inf=found_inf)
