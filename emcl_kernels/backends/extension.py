"""The ``"cpu"`` and ``"cuda"`` backends: the compiled kernels of ``emcl_kernels._C`` (``csrc/``).

The extension registers [note: the step call] of :mod:`emcl_kernels.interface` as two torch
operators, ``torch.ops.emcl.step_`` and ``torch.ops.emcl.check_finite_``, with a CPU
implementation (vectorized, parallel passes over the elements, ``csrc/emcl_cpu.cpp``) and, when
it was built with nvcc, a CUDA implementation (``csrc/emcl_cuda.cu``: one update launch per call,
plus one finite-check launch when ``check`` is set, more only past the kernel-argument limit; the
counters, flags and hyper-parameters are read on the device, so a call never waits for the GPU
and can be captured in a CUDA graph). Both check their arguments in C++ on every call, so
:func:`step` and :func:`check_finite` are direct calls of the operators: through
``emcl_kernels._C.step``/``check_finite`` (the same operators through the dispatcher, without
torch.ops' argument parsing, about 10 us less per call; [note: direct entry points] in
``csrc/emcl_ops.cpp``), and through ``torch.ops.emcl.*`` while torch.compile traces.

This module imports whether or not the extension is built; :func:`unavailable_reason` then says
why a backend is missing (not built, built without CUDA, or built from another version of the
op interface). The fake implementations registered here let ``torch.compile`` trace a step: the
operators only mutate their inputs.
"""
from __future__ import annotations

from typing import Optional

import torch

from emcl_kernels import interface as _interface

__all__ = ["step", "check_finite", "unavailable_reason", "launch_count", "LOAD_ERROR",
           "CHECKS_GRADS"]

#: The operators check every gradient's dtype, device and layout themselves on every call.
CHECKS_GRADS = True

_REBUILD = "rebuild with pip install --no-build-isolation -e ."

LOAD_ERROR: Optional[str] = None
try:
    from emcl_kernels import _C  # noqa: F401  (loading it registers torch.ops.emcl.*)
except Exception as exc:  # ImportError, or an undefined symbol from a torch ABI mismatch
    LOAD_ERROR = (f"the compiled extension emcl_kernels._C is not built: "
                  f"{type(exc).__name__}: {exc}. Build it with "
                  "`pip install --no-build-isolation -e .` (needs a C++ compiler; nvcc for "
                  "'cuda')")


def _stale_reason() -> Optional[str]:
    """None when the loaded library was built from this version of the op interface."""
    try:
        built = str(torch.ops.emcl.interface())
    except (AttributeError, RuntimeError):
        built = "an older interface without emcl::interface()"
    wanted = _interface.layout_string()
    if built == wanted:
        return None
    return (f"emcl_kernels._C was built from another version of the op interface ({built!r}; "
            f"this source is {wanted!r}): {_REBUILD}")


if LOAD_ERROR is None:
    LOAD_ERROR = _stale_reason()

_OPS = ("step_", "check_finite_")


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


def entry_point(name: str):
    """The direct entry point ``emcl_kernels._C.<name>`` (``step``, ``check_step_call``,
    ``plan_grads``, ...) where the extension is loaded and built from this source, else None:
    the caller then does the same work in Python."""
    if LOAD_ERROR is not None:
        return None
    return getattr(_C, name, None)


def launch_count() -> int:
    """CUDA kernel launches (finite checks and updates) done by the extension since it was
    loaded."""
    return int(torch.ops.emcl.launch_count())


if LOAD_ERROR is None:
    _step_op = torch.ops.emcl.step_.default
    _check_finite_op = torch.ops.emcl.check_finite_.default
    _direct_step = _C.step
    _direct_check_finite = _C.check_finite

    # The operators mutate their inputs in place and return nothing, so tracing them only
    # needs to know that they exist (the schemas carry which arguments are written).
    @torch.library.register_fake("emcl::step_")
    def _step_fake(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *,
                   op, prox, importance, lr_mode, meta_every, check, finalize,
                   grad_scale=None, found_inf=None, runs=1):
        return None

    @torch.library.register_fake("emcl::check_finite_")
    def _check_finite_fake(grads, counters, runs=1):
        return None
else:
    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"the 'cpu'/'cuda' backends are not available: {LOAD_ERROR}")

    _step_op = _check_finite_op = _direct_step = _direct_check_finite = _unavailable

_compiling = torch.compiler.is_compiling


def step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op: int,
         prox: bool, importance: int, lr_mode: int, meta_every: int, check: bool,
         finalize: bool, grad_scale=None, found_inf=None, runs: int = 1) -> None:
    """One step of one group ([note: the step call] in :mod:`emcl_kernels.interface`): one
    call of the ``emcl::step_`` operator, whatever ``runs`` ([note: runs] there)."""
    if _compiling():
        _step_op(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, op=op,
                 prox=prox, importance=importance, lr_mode=lr_mode, meta_every=meta_every,
                 check=check, finalize=finalize, grad_scale=grad_scale, found_inf=found_inf,
                 runs=runs)
    else:
        _direct_step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, op,
                     prox, importance, lr_mode, meta_every, check, finalize, grad_scale,
                     found_inf, runs)


def check_finite(grads, counters, runs: int = 1) -> None:
    """``counters[FOUND] = 1`` when a gradient holds an inf or a NaN; for an array of ``runs``
    runs, ``counters[RUN_FOUND + r] = 1`` when run ``r``'s elements do (a read-only pass; one
    launch on a GPU): one call of the ``emcl::check_finite_`` operator."""
    if _compiling():
        _check_finite_op(grads, counters, runs)
    else:
        _direct_check_finite(grads, counters, runs)
