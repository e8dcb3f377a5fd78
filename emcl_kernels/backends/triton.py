"""The ``"triton"`` backend: [note: the step call] of :mod:`emcl_kernels.interface` as two
multi-tensor Triton kernels (:mod:`emcl_kernels.backends.triton_kernels`).

A :func:`step` call is one launch of the update kernel over the whole (device, dtype) group,
whatever the number and sizes of its tensors, preceded by one launch of the read-only finite
check when ``check=True``; :func:`check_finite` is one launch of the check. Nothing is read
back to the host and nothing but the tables below is allocated: the hyper-parameters, the
counters, ``found_inf`` and ``grad_scale`` are read by the kernels on the device.

[note: tables] The kernels find the tensors through int64 tables of addresses (see
``triton_kernels``), built on the host and kept:

- the chunk table, keyed by the tensors' sizes (shared by every list of those sizes);
- the state table (params, anchors, importances, meta_lrs), keyed by their addresses and sizes;
- the gradient table, keyed by the gradients' addresses: when the gradients are reallocated
  (``zero_grad(set_to_none=True)``) only this small table is made again.

A call where nothing moved costs a few C-level passes over the lists (``map`` of ``data_ptr``
and ``numel``), one look-up by a short signature, two tuple comparisons and the launch: no
Python loop over the tensors ([note: cache keys]). A
table is made on the host, pinned, and sent with a non-blocking copy (no host sync); a table
is never written again once made (a new one replaces it), so a kernel that is still queued,
or a CUDA graph that captured it, keeps reading what it was given.

[note: CUDA graphs] A :func:`step` (and :func:`check_finite`) can be captured, e.g.
``op=CADENCE`` with ``check=True`` in a whole training iteration, and replays like eager: the
kernels read ``hyper`` (change it in place between replays), ``counters``, ``found_inf``,
``grad_scale`` and ``steps`` at replay time. Under capture nothing syncs and nothing
host-visible is allocated:

- tables already made by an eager call are reused, and kept alive for the process (a graph
  holds their addresses), whatever the cache evicts later;
- a table that has to be made during the capture (typically the gradient table: the backward
  pass of a capture allocates the gradients in the graph's pool) is written into a pinned
  reserve allocated by an earlier eager call, and copied to a new device table by a copy that
  the graph captures (and replays); that part of the reserve is never reused.

So a user must (1) run one eager step of the same tensors before capturing (torch asks for
warm-up iterations anyway: it builds the state tables and the reserve, and compiles the
kernels), and (2) keep stable what the graph reads: the parameters and the optimizer state
(the same tensors: capture again after anything that replaces them, such as a
``load_state_dict`` that makes new state tensors), the
gradients (stable when they are allocated by the captured backward, in the graph's pool, or
kept with ``zero_grad(set_to_none=False)``), and ``hyper``, ``counters``, ``steps``,
``found_inf``, ``grad_scale``.

Where it runs:

- compiled, on CUDA tensors (a GPU that torch and Triton support);
- interpreted, on CPU tensors, when ``TRITON_INTERPRET=1`` was set in the environment before
  this module was first imported (Triton decides at import which of the two its kernels are).
  The interpreter is slow (tens of milliseconds per chunk): it is for tests and CI. It cannot run CUDA
  tensors here: the kernels follow raw addresses from the tables, and the interpreter only
  copies the tensors passed as arguments to the host.

Tunables (module attributes, read at every call): :data:`BLOCK_SIZE` elements per chunk (a
power of two >= 16) and :data:`NUM_WARPS` per program on the GPU. The kernels are never
autotuned: the update is in place, so an autotuner's trial runs would apply the step more than
once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from emcl_kernels.backends.extension import entry_point
from emcl_kernels.interface import LR_MODE, OP

try:
    import triton  # noqa: F401
    from emcl_kernels.backends import triton_kernels as _kernels
except ImportError as exc:  # Triton is an optional dependency
    _kernels = None
    _IMPORT_ERROR: Optional[str] = f"Triton could not be imported ({exc}); pip install triton"
else:
    _IMPORT_ERROR = None

__all__ = ["step", "check_finite", "unavailable_reason", "INTERPRETED", "BLOCK_SIZE",
           "NUM_WARPS", "clear_cache", "build_counts", "CHECKS_GRADS"]

#: :func:`step` checks every tensor of its call against its parameter before the launch
#: ([note: launcher checks]).
CHECKS_GRADS = True

#: True when the kernels were created under Triton's interpreter (``TRITON_INTERPRET=1`` at
#: import): they then run on CPU tensors only.
INTERPRETED: bool = (_kernels is not None
                     and type(_kernels.emcl_step_kernel).__name__ == "InterpretedFunction")

#: Elements per chunk, i.e. per Triton program (half as many for fp64 parameters). A power of
#: two, at least 16 (so that every chunk of a 16-byte aligned tensor starts 16-byte aligned).
BLOCK_SIZE: int = 4096
#: Warps per program on the GPU (ignored by the interpreter).
NUM_WARPS: int = 8

_MAX_PLANS = 16           # cached state tables (one per set of tensors in use)
_MAX_GRAD_TABLES = 16     # cached gradient tables
_MAX_CHUNK_TABLES = 16    # cached chunk tables
_RESERVE_MIN = 1 << 16    # int64 elements of pinned reserve for tables made under capture

_CPU_HINT = ("Triton runs CPU tensors only through its interpreter: set TRITON_INTERPRET=1 in "
             "the environment before emcl_kernels.backends.triton is first imported (slow, "
             "meant for tests)")

_OP_INNER, _OP_CADENCE = OP["inner"], OP["cadence"]
_RECURRENT = LR_MODE["recurrent"]


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
# Tables ([note: tables])
# ---------------------------------------------------------------------------------------------

class _Plan:
    """The device tables of one set of tensors: chunks, state, and the current gradients."""

    __slots__ = ("chunks", "n_chunks", "tensors", "grad_key", "grads", "need")

    def __init__(self, chunks, n_chunks, tensors, need):
        self.chunks, self.n_chunks, self.tensors = chunks, n_chunks, tensors
        self.grad_key = None
        self.grads = None
        self.need = need          # int64 entries to make all its tables again (the reserve)


class _Reserve:
    """Pinned host memory for the tables made during a CUDA graph capture (never reused)."""

    __slots__ = ("buffer", "used")

    def __init__(self, n):
        self.buffer = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self.used = 0


# [note: cache keys] A key of 1,000 tensors is a tuple of thousands of ints, and Python hashes
# a tuple again at every dict operation (~0.1 us per int here): the state tables and the check
# tables are therefore found by a short signature (device, chunk size, count, first address)
# and then compared in full with the stored sizes and addresses (an equality test, no hash).
_plans: "OrderedDict[tuple, tuple]" = OrderedDict()          # sig -> (numels, columns, plan)
_checks: "OrderedDict[tuple, tuple]" = OrderedDict()         # sig -> (numels, grad_key, tables)
_grad_tables: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_chunk_tables: "OrderedDict[tuple, tuple]" = OrderedDict()
_reserves: dict = {}          # device -> _Reserve
_graph_keep: dict = {}        # id -> table (or reserve) a captured graph reads: never freed
#: How many tables were made: ``"state"`` (state tables), ``"grads"`` (gradient tables),
#: ``"chunks"`` (chunk tables), ``"captured"`` (tables made during a CUDA graph capture).
build_counts = {"state": 0, "grads": 0, "chunks": 0, "captured": 0}

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_dtype = torch.Tensor.dtype.__get__
_device = torch.Tensor.device.__get__
_layout = torch.Tensor.layout.__get__
_stride = torch.Tensor.stride
_shape = torch.Tensor.shape.__get__
_contiguous = torch.Tensor.is_contiguous


# [note: launcher checks] The kernels follow raw addresses for ``numel`` elements of each
# parameter, so before any launch every tensor of the call is compared with its parameter, as
# the C++ operators do: one tensor per parameter, dense (strided) tensors on the call's device,
# gradients of the parameters' dtype and state of the compute dtype, each with its parameter's
# shape and strides, every parameter dense. A call that fails is refused before anything is
# launched, naming the first tensor that does not fit. Where the extension is built, its
# ``check_step_call`` (the checks of ``torch.ops.emcl.step_`` alone) does this in one C++ pass;
# else ``_check_call`` does it in Python, one C-level ``map`` per list and property: one
# Python-to-C call per tensor and property (~3-9 ms for 1,000 parameters' five lists on a
# loaded 2-core host).
_NATIVE_CHECK = entry_point("check_step_call")


def _check_call(params, grads, anchors, importances, meta_lrs, device) -> None:
    n = len(params)
    lists = [("grads", grads), ("anchors", anchors), ("importances", importances)]
    if meta_lrs is not None:
        lists.append(("meta_lrs", meta_lrs))
    for name, lst in lists:
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors but params has {n}")
    if not n:
        return
    dtype = params[0].dtype
    sdt = torch.float64 if dtype is torch.float64 else torch.float32
    strided = torch.strided
    if (list(map(_layout, params)).count(strided) != n
            or list(map(_dtype, params)).count(dtype) != n
            or list(map(_device, params)).count(device) != n
            or not (all(map(_contiguous, params)) or all(map(_dense, params)))):
        _refuse("params", params, dtype, params, device)
    # shapes, not numels: equal strides and numels still let a (2, 8) view with strides (4, 1)
    # overlap itself and end before its 16th element
    shapes, strides = list(map(_shape, params)), list(map(_stride, params))
    for name, lst in lists:
        want = dtype if name == "grads" else sdt
        if (list(map(_layout, lst)).count(strided) != n
                or list(map(_dtype, lst)).count(want) != n
                or list(map(_device, lst)).count(device) != n
                or list(map(_shape, lst)) != shapes
                or list(map(_stride, lst)) != strides):
            _refuse(name, lst, want, params, device)


def _dense(t) -> bool:
    from emcl_kernels.validation import is_dense
    return is_dense(t)


def _refuse(name, lst, want, params, device) -> None:
    """Raise for the first tensor of ``lst`` that does not fit its parameter (strides that
    differ only on dimensions of one element are accepted)."""
    from emcl_kernels.validation import same_layout
    for i, (t, p) in enumerate(zip(lst, params)):
        where = f"{name}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise RuntimeError(f"{where} is a {t.layout} tensor; the kernels take dense "
                               "(strided) tensors only")
        if t.device != device:
            raise RuntimeError(f"{where} is on {t.device} but the call's tensors are on "
                               f"{device}")
        if t.dtype != want:
            raise TypeError(f"{where} has dtype {t.dtype}, expected {want}")
        if t is p:
            if not _dense(t):
                raise RuntimeError(f"{where} is not dense (strides {t.stride()} for shape "
                                   f"{tuple(t.shape)}): the kernels walk each tensor's memory")
            continue
        if t.shape != p.shape or not same_layout(t, p):
            raise ValueError(f"{where} has shape {tuple(t.shape)} and strides {t.stride()} "
                             f"but params[{i}] has shape {tuple(p.shape)} and strides "
                             f"{p.stride()}")


def clear_cache() -> None:
    """Forget every cached table (they are made again on the next call). Tables that captured
    CUDA graphs read are kept."""
    _plans.clear()
    _checks.clear()
    _grad_tables.clear()
    _chunk_tables.clear()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream(device: torch.device) -> int:
    """The current stream of a CUDA ``device`` (a raw handle: cheap to get and compare)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def _used_here(device: torch.device, tables) -> None:
    """[note: table streams] A table's memory belongs to the stream it was allocated on: once
    the LRU drops it, the caching allocator gives it to the next allocation on that stream,
    ordered after that stream's kernels only. A table read by a kernel on another stream (the
    user's side stream) is therefore marked with ``record_stream``, once per stream, so that
    its memory waits for that stream's work too."""
    here = _stream(device)
    for t in tables:
        if here not in t._emcl_streams:
            t.record_stream(torch.cuda.current_stream(device))
            t._emcl_streams.add(here)


def _upload(host: torch.Tensor, device: torch.device, capturing: bool) -> torch.Tensor:
    """An int64 host table on ``device``, without a host sync ([note: tables])."""
    if device.type != "cuda":
        return host if host.device == device else host.to(device)
    if not capturing:
        table = host.pin_memory().to(device, non_blocking=True)
        table._emcl_streams = {_stream(device)}      # [note: table streams]
        return table
    reserve = _reserves.get(device)
    n = host.numel()
    if reserve is None or reserve.buffer.numel() - reserve.used < n:
        raise RuntimeError(
            "the Triton backend has to make an address table of "
            f"{n} entries during a CUDA graph capture, and no pinned reserve is left for it: "
            "run one eager step (check_finite) of the same tensors before capturing, and one "
            "eager step between two captures (see [note: CUDA graphs] in "
            "emcl_kernels.backends.triton)")
    staging = reserve.buffer[reserve.used:reserve.used + n]
    reserve.used += n
    staging.copy_(host.reshape(-1))
    table = torch.empty(host.shape, dtype=torch.int64, device=device)
    table.copy_(staging.view(host.shape), non_blocking=True)   # captured: replayed every time
    _keep_for_graph(reserve, table)
    build_counts["captured"] += 1
    return table


def _ensure_reserve(device: torch.device, need: int) -> None:
    """Before a capture can need it: pinned room for ``need`` more table entries (eager)."""
    reserve = _reserves.get(device)
    if reserve is None or reserve.buffer.numel() - reserve.used < 2 * need:
        _reserves[device] = _Reserve(max(_RESERVE_MIN, 4 * need))


def _chunk_table(device, block, numels, capturing):
    """(table, count): rows (tensor index, first element, elements) of every chunk."""
    key = (device, block, numels)
    hit = _chunk_tables.get(key)
    if hit is not None:
        _chunk_tables.move_to_end(key)
        return hit
    n = torch.tensor(numels, dtype=torch.int64)
    counts = (n + block - 1) // block
    n_chunks = int(counts.sum())
    first = torch.cumsum(counts, 0) - counts
    index = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    start = (torch.arange(n_chunks, dtype=torch.int64)
             - torch.repeat_interleave(first, counts)) * block
    size = torch.clamp(n[index] - start, max=block)
    table = _upload(torch.stack([index, start, size], 1).contiguous(), device, capturing)
    if capturing:
        return table, n_chunks
    build_counts["chunks"] += 1
    _chunk_tables[key] = (table, n_chunks)
    while len(_chunk_tables) > _MAX_CHUNK_TABLES:
        _chunk_tables.popitem(last=False)
    return table, n_chunks


def _grad_table(device, grad_key, capturing):
    key = (device, grad_key)
    if not capturing:
        table = _grad_tables.get(key)
        if table is not None:
            _grad_tables.move_to_end(key)
            return table
    table = _upload(torch.tensor(grad_key, dtype=torch.int64), device, capturing)
    if capturing:
        return table
    build_counts["grads"] += 1
    _grad_tables[key] = table
    while len(_grad_tables) > _MAX_GRAD_TABLES:
        _grad_tables.popitem(last=False)
    return table


def _keep_for_graph(*tables) -> None:
    """Tables a graph being captured reads: never freed (the cache may evict them later)."""
    for t in tables:
        _graph_keep[id(t)] = t


def _live(numels, *lists):
    """The lists without their empty tensors (which get no rows)."""
    idx = [i for i, n in enumerate(numels) if n]
    return (tuple(numels[i] for i in idx),) + tuple([lst[i] for i in idx] if lst else lst
                                                     for lst in lists)


_EMPTY: dict = {}  # device -> plan with one chunk of 0 elements (for the counters and steps)


def _empty_plan(device, capturing):
    """One chunk of 0 elements: a launch that only counts ``steps`` and the counters."""
    plan = _EMPTY.get(device)
    if plan is None:
        zeros = torch.zeros
        plan = _Plan(_upload(zeros(1, 3, dtype=torch.int64), device, capturing), 1,
                     _upload(zeros(1, 4, dtype=torch.int64), device, capturing), 0)
        plan.grads = _upload(zeros(1, dtype=torch.int64), device, capturing)
        if not capturing:                   # made during a capture: for that graph only
            _EMPTY[device] = plan           # (never evicted: safe in any graph)
    return plan


def _plan(device, block, params, grads, anchors, importances, meta_lrs, capturing):
    """The tables for these tensors (only the non-empty ones get rows), from the cache when
    the tensors have not moved; None when every tensor is empty."""
    numels = tuple(map(_numel, params))
    if 0 in numels:
        numels, params, grads, anchors, importances, meta_lrs = _live(
            numels, params, grads, anchors, importances, meta_lrs)
        if not numels:
            return None
    columns = (tuple(map(_data_ptr, params)), tuple(map(_data_ptr, anchors)),
               tuple(map(_data_ptr, importances)),
               tuple(map(_data_ptr, meta_lrs)) if meta_lrs else (0,) * len(numels))
    sig = (device, block, len(numels), columns[0][0])          # [note: cache keys]
    hit = _plans.get(sig)
    if hit is not None and hit[0] == numels and hit[1] == columns:
        plan = hit[2]
        _plans.move_to_end(sig)
    else:
        chunks, n_chunks = _chunk_table(device, block, numels, capturing)
        tensors = _upload(torch.tensor(columns, dtype=torch.int64).t().contiguous(), device,
                          capturing)
        plan = _Plan(chunks, n_chunks, tensors, 3 * n_chunks + 5 * len(numels))
        if not capturing:                   # made during a capture: for that graph only
            build_counts["state"] += 1
            _plans[sig] = (numels, columns, plan)
            _plans.move_to_end(sig)
            while len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
    grad_key = tuple(map(_data_ptr, grads))
    if capturing:
        _keep_for_graph(plan.chunks, plan.tensors)
        if plan.grad_key != grad_key:
            # a table made now is filled when the graph replays: for this graph only
            return _CapturedPlan(plan, _grad_table(device, grad_key, True))
        _keep_for_graph(plan.grads)
        return plan
    if plan.grad_key != grad_key:
        plan.grads = _grad_table(device, grad_key, False)
        plan.grad_key = grad_key
    return plan


class _CapturedPlan:
    """A plan's chunk and state tables with a gradient table made during a capture."""

    __slots__ = ("chunks", "n_chunks", "tensors", "grads")

    def __init__(self, plan, grads):
        self.chunks, self.n_chunks, self.tensors, self.grads = (plan.chunks, plan.n_chunks,
                                                                plan.tensors, grads)


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------

def _block(dtype: torch.dtype) -> int:
    """Elements per chunk for ``dtype``: :data:`BLOCK_SIZE`, halved for fp64 (the same bytes
    per chunk; [note: vector path] in ``triton_kernels``)."""
    block = BLOCK_SIZE
    if block < 16 or block & (block - 1):
        raise ValueError(f"BLOCK_SIZE must be a power of two >= 16, got {block}")
    return block // 2 if dtype is torch.float64 else block


def _launch(kernel, grid, device, args, meta):
    if device.type == "cuda":
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                kernel[grid](*args, **meta, num_warps=NUM_WARPS)
        else:
            kernel[grid](*args, **meta, num_warps=NUM_WARPS)
    else:
        kernel[grid](*args, **meta)


def _param_code(dtype: torch.dtype) -> int:
    try:
        return _kernels.PARAM_CODES[str(dtype)[6:]]   # "torch.float32" -> "float32"
    except KeyError:
        raise TypeError(f"the Triton backend updates float32, bfloat16, float16 and float64 "
                        f"parameters, not {dtype}") from None


def _check(chunks, n_chunks, grads_table, counters, dtype, device, block):
    _launch(_kernels.emcl_check_kernel, (n_chunks,), device, (chunks, grads_table, counters),
            dict(PARAM=_param_code(dtype), BLOCK=block))


def check_finite(grads, counters: torch.Tensor) -> None:
    """``counters[FOUND] = 1`` when a gradient holds an inf or a NaN: one read-only launch
    per dtype over every non-empty gradient (``grads`` writes nothing, no host sync)."""
    grads = list(grads)
    if not grads:
        return
    dtypes = set(map(_dtype, grads))
    if len(dtypes) > 1:                    # one launch per dtype
        for dt in dtypes:
            check_finite([g for g in grads if g.dtype == dt], counters)
        return
    block = _block(grads[0].dtype)
    device = grads[0].device
    capturing = _capturing(device)
    numels = tuple(map(_numel, grads))
    if 0 in numels:
        numels, grads = _live(numels, grads)
        if not numels:
            return
    grad_key = tuple(map(_data_ptr, grads))
    sig = (device, block, len(numels), grad_key[0])            # [note: cache keys]
    hit = _checks.get(sig)
    if hit is not None and hit[0] == numels and hit[1] == grad_key and not capturing:
        chunks, n_chunks, table = hit[2]
        _checks.move_to_end(sig)
    else:
        chunks, n_chunks = _chunk_table(device, block, numels, capturing)
        table = _grad_table(device, grad_key, capturing)
        if not capturing:
            _checks[sig] = (numels, grad_key, (chunks, n_chunks, table))
            _checks.move_to_end(sig)
            while len(_checks) > _MAX_PLANS:
                _checks.popitem(last=False)
    if capturing:
        _keep_for_graph(chunks, table)
    elif device.type == "cuda":
        _ensure_reserve(device, 3 * n_chunks + len(numels))
        _used_here(device, (chunks, table))
    _check(chunks, n_chunks, table, counters, grads[0].dtype, device, block)


def step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op: int,
         prox: bool, importance: int, lr_mode: int, meta_every: int, check: bool,
         finalize: bool, grad_scale=None, found_inf=None) -> None:
    """One step of one group ([note: the step call] in :mod:`emcl_kernels.interface`): with
    ``check``, one launch of the finite check; then one launch of the update, which also
    counts ``steps`` and, with ``finalize``, advances ``counters``."""
    dtype = params[0].dtype if params else torch.float32
    block = _block(dtype)
    device = counters.device
    capturing = _capturing(device)
    if lr_mode == _RECURRENT and len(meta_lrs) != len(params):
        raise ValueError(f"lr_mode 'recurrent' needs one meta_lrs tensor per param: got "
                         f"{len(meta_lrs)} for {len(params)} params")
    if _NATIVE_CHECK is not None:                          # [note: launcher checks]
        _NATIVE_CHECK(params, grads, anchors, importances,
                      meta_lrs if lr_mode == _RECURRENT else [], steps, hyper, counters, op,
                      bool(prox), importance, lr_mode, meta_every, bool(check),
                      bool(finalize), grad_scale, found_inf)
    else:
        _check_call(params, grads, anchors, importances,
                    meta_lrs if lr_mode == _RECURRENT else None, device)
    plan = None
    if params:
        plan = _plan(device, block, params, grads, anchors, importances,
                     meta_lrs if lr_mode == _RECURRENT else None, capturing)
    if plan is not None:
        if device.type == "cuda" and not capturing:
            _ensure_reserve(device, plan.need)
            _used_here(device, (plan.chunks, plan.tensors, plan.grads))
        if check:
            _check(plan.chunks, plan.n_chunks, plan.grads, counters, dtype, device, block)
    else:
        n_steps = steps.numel()
        if not finalize and not (n_steps and op != _OP_INNER):
            return                          # no tensor, nothing to count
        plan = _empty_plan(device, capturing)
    args = (plan.chunks, plan.tensors, plan.grads, hyper, counters, steps, steps.numel(),
            meta_every, hyper if grad_scale is None else grad_scale,
            hyper if found_inf is None else found_inf)
    meta = dict(PARAM=_param_code(dtype), OP=op, PROX=bool(prox), IMPORTANCE_KIND=importance,
                LR_MODE=lr_mode, HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None, FINALIZE=bool(finalize), BLOCK=block,
                SUB=block // 4)
    _launch(_kernels.emcl_step_kernel, (plan.n_chunks,), device, args, meta)
