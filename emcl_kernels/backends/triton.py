"""The ``"triton"`` backend: SPEC section 2 as one multi-tensor Triton kernel per step.

Each call is one launch of :func:`emcl_kernels.backends.triton_kernels.emcl_kernel` over the
whole (device, dtype) group, whatever the number and sizes of its tensors. The launch reads
three int64 tables of tensor addresses and chunk offsets (see ``triton_kernels``). They are
built once per set of tensors and cached while the parameters and state stay where they are
(the cache is keyed by their addresses and sizes); the gradient table has its own key and is
rebuilt alone when the gradients are reallocated (``zero_grad(set_to_none=True)``).

Where it runs:

- compiled, on CUDA tensors (a GPU that torch and Triton support);
- interpreted, on CPU tensors, when ``TRITON_INTERPRET=1`` was set in the environment before
  this module was first imported (Triton decides at import which of the two its kernels are).
  The interpreter is slow (about 20 ms per chunk of this kernel): it is for tests and CI.
  It cannot run CUDA tensors here: the kernel follows raw addresses from its tables, and the
  interpreter only copies the tensors passed as arguments to the host.

Tunables (module attributes, read at every call): :data:`BLOCK_SIZE` elements per chunk (a
power of two >= 8) and :data:`NUM_WARPS` per program on the GPU. The kernel is never
autotuned: it updates its tensors in place, so an autotuner's trial runs would apply the step
more than once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

try:
    import triton  # noqa: F401
    from emcl_kernels.backends import triton_kernels as _kernels
except ImportError as exc:  # Triton is an optional dependency
    _kernels = None
    _IMPORT_ERROR: Optional[str] = f"Triton could not be imported ({exc}); pip install triton"
else:
    _IMPORT_ERROR = None

__all__ = ["inner_step", "meta_step", "inner_meta_step", "unavailable_reason", "INTERPRETED",
           "BLOCK_SIZE", "NUM_WARPS", "clear_cache"]

#: True when the kernels were created under Triton's interpreter (``TRITON_INTERPRET=1`` at
#: import): they then run on CPU tensors only.
INTERPRETED: bool = (_kernels is not None
                     and type(_kernels.emcl_kernel).__name__ == "InterpretedFunction")

#: Elements per chunk, i.e. per Triton program. A power of two, at least 8 (so that every chunk
#: of a 16-byte aligned tensor starts 16-byte aligned).
BLOCK_SIZE: int = 4096
#: Warps per program on the GPU (ignored by the interpreter).
NUM_WARPS: int = 8

_MAX_PLANS = 16    # cached table sets (one per distinct set of tensors in use)
_MAX_HYPERS = 64   # cached hyper-parameter tensors

_CPU_HINT = ("Triton runs CPU tensors only through its interpreter: set TRITON_INTERPRET=1 in "
             "the environment before emcl_kernels.backends.triton is first imported (slow, "
             "meant for tests)")


def unavailable_reason(name: str, device_type: Optional[str]) -> Optional[str]:
    """None when the Triton backend can run on ``device_type`` tensors here (on some device
    when ``device_type`` is None), else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if INTERPRETED:
        if device_type in (None, "cpu"):
            return None
        return (f"the Triton kernels were loaded under Triton's interpreter (TRITON_INTERPRET=1), "
                f"which runs CPU tensors only, not {device_type!r} tensors: unset "
                "TRITON_INTERPRET before importing emcl_kernels to run compiled on the GPU")
    gpu = torch.cuda.is_available()
    if device_type == "cuda" or (device_type is None and gpu):
        return None if gpu else "no GPU is visible to torch (torch.cuda.is_available() is False)"
    if device_type is None:
        return "no GPU is visible to torch, and " + _CPU_HINT
    return _CPU_HINT


# ---------------------------------------------------------------------------------------------
# Tables: built once per set of tensors, cached while they do not move.
# ---------------------------------------------------------------------------------------------

class _Plan:
    """The device tables of one group of tensors (see ``triton_kernels``)."""

    __slots__ = ("chunks", "tensors", "n_chunks", "state_aligned", "grad_key", "grads",
                 "grads_aligned")

    def __init__(self, device, block, numels, rows, aligned):
        counts = torch.tensor([(n + block - 1) // block for n in numels], dtype=torch.int64)
        n_chunks = int(counts.sum())
        first = torch.cumsum(counts, 0) - counts
        index = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
        start = (torch.arange(n_chunks, dtype=torch.int64)
                 - torch.repeat_interleave(first, counts)) * block
        self.chunks = torch.stack([index, start], 1).contiguous().to(device)
        self.tensors = torch.tensor(rows, dtype=torch.int64).to(device)
        self.n_chunks = n_chunks
        self.state_aligned = aligned
        self.grad_key = None
        self.grads = None
        self.grads_aligned = False

    def set_grads(self, grad_key, device):
        self.grads = torch.tensor(grad_key, dtype=torch.int64).to(device)
        self.grad_key = grad_key
        self.grads_aligned = all(a % 16 == 0 for a in grad_key)


_plans: "OrderedDict[tuple, _Plan]" = OrderedDict()
_hypers: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
#: How many times tables were built (``"state"``) or the gradient table rebuilt (``"grads"``).
build_counts = {"state": 0, "grads": 0}


def clear_cache() -> None:
    """Forget every cached table (they are rebuilt on the next call)."""
    _plans.clear()
    _hypers.clear()


_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel


def _plan(params, grads, anchors, importances, meta_lrs, block):
    """The tables for these tensors (only the non-empty ones get rows), from the cache when the
    tensors have not moved; None when every tensor is empty.

    The cache key is every address and size (``map`` over the unbound methods: about a
    microsecond per tensor, so a step over 1,000 tensors spends ~1 ms here)."""
    numels = tuple(map(_numel, params))
    if 0 in numels:                                    # empty tensors get no rows
        live = [i for i, n in enumerate(numels) if n]
        if not live:
            return None
        pick = lambda lst: [lst[i] for i in live]  # noqa: E731
        params, grads, anchors, importances = map(pick, (params, grads, anchors, importances))
        meta_lrs = None if meta_lrs is None else pick(meta_lrs)
        numels = tuple(numels[i] for i in live)
    device = params[0].device
    columns = (tuple(map(_data_ptr, params)), tuple(map(_data_ptr, anchors)),
               tuple(map(_data_ptr, importances)),
               (0,) * len(params) if meta_lrs is None else tuple(map(_data_ptr, meta_lrs)))
    key = (device, params[0].dtype, block, numels) + columns
    plan = _plans.get(key)
    if plan is None:
        rows = list(zip(*columns, numels))
        aligned = all(a % 16 == 0 for col in columns for a in col)
        plan = _Plan(device, block, numels, rows, aligned)
        build_counts["state"] += 1
        _plans[key] = plan
        while len(_plans) > _MAX_PLANS:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    grad_key = tuple(map(_data_ptr, grads))
    if plan.grad_key != grad_key:
        plan.set_grads(grad_key, device)
        build_counts["grads"] += 1
    return plan


def _hyper(device, values):
    """The hyper-parameters as a cached fp64 tensor on ``device`` (see ``HYPER_FIELDS``)."""
    key = (device, values)
    t = _hypers.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.float64).to(device)
        _hypers[key] = t
        while len(_hypers) > _MAX_HYPERS:
            _hypers.popitem(last=False)
    return t


def _hyper_values(max_finite, *, inner_lr=0.0, reg=0.0, gamma=0.0, meta_lr=0.0, decay=0.0,
                  lr_scale=0.0, lr_min=0.0, lr_max=float("inf"), eps=1e-8):
    # the upper clip of α is at most the compute dtype's largest finite value (as in reference)
    return (inner_lr, reg, gamma * reg, decay, 1.0 - decay, lr_scale, meta_lr * lr_scale,
            meta_lr, lr_min, min(lr_max, max_finite), eps, max_finite)


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------

def _launch(params, grads, anchors, importances, meta_lrs, *, do_inner, do_meta, prox, si,
            lr_mode, hyper, grad_scale, found_inf):
    block = BLOCK_SIZE
    if block < 8 or block & (block - 1):
        raise ValueError(f"BLOCK_SIZE must be a power of two >= 8, got {block}")
    plan = _plan(params, grads, anchors, importances, meta_lrs, block)
    if plan is None:
        return
    device = params[0].device
    max_finite = torch.finfo(anchors[0].dtype).max
    hyper_t = _hyper(device, _hyper_values(max_finite, **hyper))
    code = _kernels.PARAM_CODES[str(params[0].dtype).replace("torch.", "")]
    args = (plan.chunks, plan.tensors, plan.grads, hyper_t,
            hyper_t if grad_scale is None else grad_scale,   # placeholders are never read
            hyper_t if found_inf is None else found_inf)
    meta = dict(PARAM=code, DO_INNER=do_inner, DO_META=do_meta, PROX=prox, SI=si,
                LR_MODE=_kernels.LR_MODE_CODES[lr_mode], HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None,
                ALIGNED=plan.state_aligned and plan.grads_aligned, BLOCK=block)
    grid = (plan.n_chunks,)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _kernels.emcl_kernel[grid](*args, **meta, num_warps=NUM_WARPS)
    else:
        _kernels.emcl_kernel[grid](*args, **meta)


def inner_step(params, grads, anchors, importances, *, inner_lr, reg, gamma, prox,
               grad_scale=None, found_inf=None):
    """The inner step (eqs. 14, 15, 19) over the group: one launch."""
    _launch(params, grads, anchors, importances, None, do_inner=True, do_meta=False,
            prox=prox, si=False, lr_mode="constant",
            hyper=dict(inner_lr=inner_lr, reg=reg, gamma=gamma),
            grad_scale=grad_scale, found_inf=found_inf)


def meta_step(params, grads, anchors, importances, meta_lrs, *, meta_lr, reg, decay, lr_scale,
              lr_mode, lr_min, lr_max, eps, importance, grad_scale=None, found_inf=None):
    """The meta step (eqs. 7, 8, 10, 13) over the group: one launch."""
    _launch(params, grads, anchors, importances, meta_lrs if lr_mode == "recurrent" else None,
            do_inner=False, do_meta=True, prox=True, si=importance == "si", lr_mode=lr_mode,
            hyper=dict(meta_lr=meta_lr, reg=reg, decay=decay, lr_scale=lr_scale,
                       lr_min=lr_min, lr_max=lr_max, eps=eps),
            grad_scale=grad_scale, found_inf=found_inf)


def inner_meta_step(params, grads, anchors, importances, meta_lrs, *, inner_lr, meta_lr, reg,
                    gamma, decay, lr_scale, lr_mode, lr_min, lr_max, eps, importance, prox,
                    grad_scale=None, found_inf=None):
    """The inner step then the meta step with the same gradient, in one pass: one launch.
    The fast weight between the two stays in the compute dtype."""
    _launch(params, grads, anchors, importances, meta_lrs if lr_mode == "recurrent" else None,
            do_inner=True, do_meta=True, prox=prox, si=importance == "si", lr_mode=lr_mode,
            hyper=dict(inner_lr=inner_lr, meta_lr=meta_lr, reg=reg, gamma=gamma, decay=decay,
                       lr_scale=lr_scale, lr_min=lr_min, lr_max=lr_max, eps=eps),
            grad_scale=grad_scale, found_inf=found_inf)
