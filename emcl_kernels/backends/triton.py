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

A call where nothing moved costs the call's checks (one C++ pass where the extension is built,
[note: launcher checks]), a few C-level passes over the lists (``map`` of ``data_ptr`` and
``numel``; for the optimizer's calls one C++ pass confirms the parameters and their
gradients, [note: native confirmation]), one look-up by a short signature, two tuple
comparisons and the launches: no Python loop over the tensors ([note: cache keys]). Once
Triton's JIT has launched a kernel for a key, the next launches of that key call the compiled
kernel's launcher directly, without the JIT's per-call binding ([note: fast launch]). A
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
power of two >= 16), :data:`NUM_WARPS` per program on the GPU, and :data:`FAST_LAUNCH`
([note: fast launch]; ``EMCL_TRITON_FAST_LAUNCH=0`` at import turns it off). The kernels are
never autotuned: the update is in place, so an autotuner's trial runs would apply the step
more than once.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

import torch

from emcl_kernels.backends.extension import entry_point
from emcl_kernels.interface import LR_MODE, OP, counters_size

try:
    import triton  # noqa: F401
    from emcl_kernels.backends import triton_kernels as _kernels
except ImportError as exc:  # Triton is an optional dependency
    _kernels = None
    _IMPORT_ERROR: Optional[str] = f"Triton could not be imported ({exc}); pip install triton"
else:
    _IMPORT_ERROR = None

__all__ = ["step", "check_finite", "unavailable_reason", "INTERPRETED", "BLOCK_SIZE",
           "NUM_WARPS", "FAST_LAUNCH", "FAST_LAUNCH_REASON", "clear_cache", "build_counts",
           "launch_counts", "lookups", "CHECKS_GRADS"]

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
_MAX_CHECKED = 8          # option sets whose checked call a plan keeps ([note: checked plans])
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
# tables are therefore found by a short signature (device, chunk size, count, first address;
# for a state table also its first anchor's address) and then compared in full with the stored
# sizes and addresses (an equality test, no hash). The anchor is in the signature because two
# optimizers over the same parameters (checked and unchecked, a comparison, a method that keeps
# one per task) have state tensors of their own: with the parameters' signature alone they
# would share one slot, and each one's step after the other's would make and upload its state
# table again.
# sig -> (numels, columns, plan, native key, {options: layout key of its last checked call})
_plans: "OrderedDict[tuple, tuple]" = OrderedDict()
_checks: "OrderedDict[tuple, tuple]" = OrderedDict()         # sig -> (numels, grad_key, tables)
_grad_tables: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_chunk_tables: "OrderedDict[tuple, tuple]" = OrderedDict()
_reserves: dict = {}          # device -> _Reserve
_graph_keep: dict = {}        # id -> table (or reserve) a captured graph reads: never freed
#: How cached plans were found: ``"confirmed"`` by the C++ passes ([note: native
#: confirmation]), ``"compared"`` by the Python comparisons; ``"checked"``: confirmed calls whose
#: checks were known to pass ([note: checked plans]).
lookups = {"confirmed": 0, "compared": 0, "checked": 0}
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


def _used_here(device: torch.device, here: int, tables) -> None:
    """[note: table streams] A table's memory belongs to the stream it was allocated on: once
    the LRU drops it, the caching allocator gives it to the next allocation on that stream,
    ordered after that stream's kernels only. A table read by a kernel on another stream (the
    user's side stream) is therefore marked with ``record_stream``, once per stream, so that
    its memory waits for that stream's work too. ``here``: :func:`_stream` of ``device``."""
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


def _chunk_table(device, block, numels, capturing, runs=1):
    """(table, count): rows (tensor index, first element, elements) of every chunk. For an
    array of ``runs`` runs ([note: runs in Triton] in ``triton_kernels``) each run's elements
    of each tensor are chunked on their own (no chunk crosses a run boundary) and the first
    column is ``tensor * runs + run``."""
    key = (device, block, numels, runs)
    hit = _chunk_tables.get(key)
    if hit is not None:
        _chunk_tables.move_to_end(key)
        return hit
    # (for an array: one part per (tensor, run), tensor-major, of numel / runs elements)
    n = torch.tensor(numels, dtype=torch.int64)
    per = torch.repeat_interleave(n // runs, runs) if runs > 1 else n
    counts = (per + block - 1) // block
    n_chunks = int(counts.sum())
    first = torch.cumsum(counts, 0) - counts
    index = torch.repeat_interleave(torch.arange(per.numel(), dtype=torch.int64), counts)
    offset = (torch.arange(n_chunks, dtype=torch.int64)
              - torch.repeat_interleave(first, counts)) * block   # within the part
    size = torch.clamp(per[index] - offset, max=block)
    start = offset + (index % runs) * per[index] if runs > 1 else offset
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


# [note: native confirmation] Where the extension is built, a plan with no empty tensor also
# keeps its parameters' exact layout (address, sizes, strides) in the int64 key format of
# ``_C.plan_grads``. A call whose gradients are its parameters' ``.grad`` (the optimizer's
# calls) is then confirmed by that C++ pass (every parameter where and as it was, and its
# gradient's address) and ``_C.identical(grads, their .grad)``, instead of three Python-to-C
# calls per parameter (its numel, its address, its gradient's address). Any difference, or
# gradients that are not the ``.grad``: the general path below, which decides.
#
# [note: checked plans] The launcher checks ([note: launcher checks]) look only at each
# tensor's dtype, device, sizes and strides (with its parameter's) and at the call's options.
# A confirmed plan therefore also keeps, per set of options (the update, the modes, whether a
# scale or a flag was passed), from the last call with those options whose checks passed,
# every other tensor of that call (state, steps, hyper, counters, grad_scale, found_inf) as
# ``_C.layout_key`` records it (address, dtype, device, sizes, strides): a later call with the
# same options and the same in all of these (``_C.layouts_are``, one C++ pass) would pass the
# same checks, and skips them (for 1,000 parameters ~0.3 ms of host time a step). Per set of
# options, because EMCL's loop alternates updates on one optimizer (``inner_step()`` k times,
# then ``meta_step()``): one record for the last call would run the checks at every switch.
# Any difference runs the checks, which raise naming the tensor, or record the call anew. At
# most ``_MAX_CHECKED`` option sets per plan. Not during a CUDA graph capture (the checks
# always run there).
_PLAN_GRADS = entry_point("plan_grads")
_IDENTICAL = entry_point("identical")
_LAYOUT_KEY = entry_point("layout_key")
_LAYOUTS_ARE = entry_point("layouts_are")


def _native_key(params) -> Optional[torch.Tensor]:
    """``params``' layout in ``_C.plan_grads``' key format (data_ptr, ndim, sizes, strides per
    parameter), or None where that pass is not built."""
    if _PLAN_GRADS is None or _IDENTICAL is None:
        return None
    key = []
    for p in params:
        key += [p.data_ptr(), p.dim(), *p.shape, *p.stride()]
    return torch.tensor(key, dtype=torch.int64)


def _confirmed(device, block, params, grads, anchors):
    """(plan, grad_key, columns, checked) when the C++ passes confirm a cached plan's
    parameters and gradients ([note: native confirmation]), else None; ``columns`` are the
    addresses its tables hold, ``checked`` its records of checked calls, ``{options: layout
    key}`` ([note: checked plans])."""
    if type(params) is not list or type(grads) is not list or \
            type(anchors) not in (list, tuple) or not anchors or \
            not isinstance(params[0], torch.Tensor) or not isinstance(anchors[0], torch.Tensor):
        return None           # (a call the checks will refuse, or the general path's to plan)
    sig = (device, block, len(params), _data_ptr(params[0]),
           _data_ptr(anchors[0]))                                 # [note: cache keys]
    hit = _plans.get(sig)
    if hit is None or hit[3] is None:
        return None
    got = _PLAN_GRADS(params, hit[3], params[0])
    if got is None or not _IDENTICAL(got[0], grads):
        return None
    _plans.move_to_end(sig)
    return hit[2], tuple(got[1]), hit[1], hit[4]


def _as_list(x) -> list:
    return x if type(x) is list else list(x)


def _state_at(plan_columns, anchors, importances, meta_lrs) -> bool:
    """The state tensors are at the addresses the plan's state table holds."""
    return (tuple(map(_data_ptr, anchors)) == plan_columns[1]
            and tuple(map(_data_ptr, importances)) == plan_columns[2]
            and (tuple(map(_data_ptr, meta_lrs)) if meta_lrs else (0,) * len(anchors))
            == plan_columns[3])


_UNASKED = object()


def _plan(device, block, params, grads, anchors, importances, meta_lrs, capturing,
          found=_UNASKED, known=False):
    """The tables for these tensors (only the non-empty ones get rows), from the cache when
    the tensors have not moved; None when every tensor is empty. ``found``: what
    :func:`_confirmed` returned for this call, where the caller asked already; ``known``: its
    state tensors are the ones of the plan's checked call ([note: checked plans]), so at the
    plan's addresses."""
    if found is _UNASKED:
        found = (_confirmed(device, block, params, grads, anchors)
                 if _PLAN_GRADS is not None and not capturing else None)
    if found is not None and not known and not _state_at(found[2], anchors, importances,
                                                         meta_lrs):
        found = None
    if found is not None:
        plan, grad_key = found[0], found[1]
        lookups["confirmed"] += 1
    else:
        plan, grad_key = _general_plan(device, block, params, grads, anchors, importances,
                                       meta_lrs, capturing)
        if plan is None:
            return None
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


def _general_plan(device, block, params, grads, anchors, importances, meta_lrs, capturing):
    """(plan, grad_key) of :func:`_plan` by comparing every address and size in Python (one
    C-level ``map`` per list); (None, None) when every tensor is empty."""
    numels = tuple(map(_numel, params))
    live = 0 not in numels
    if not live:
        numels, params, grads, anchors, importances, meta_lrs = _live(
            numels, params, grads, anchors, importances, meta_lrs)
        if not numels:
            return None, None
    columns = (tuple(map(_data_ptr, params)), tuple(map(_data_ptr, anchors)),
               tuple(map(_data_ptr, importances)),
               tuple(map(_data_ptr, meta_lrs)) if meta_lrs else (0,) * len(numels))
    sig = (device, block, len(numels), columns[0][0],
           columns[1][0] if columns[1] else 0)                          # [note: cache keys]
    hit = _plans.get(sig)
    if hit is not None and hit[0] == numels and hit[1] == columns:
        plan = hit[2]
        _plans.move_to_end(sig)
        lookups["compared"] += 1
    else:
        chunks, n_chunks = _chunk_table(device, block, numels, capturing)
        tensors = _upload(torch.tensor(columns, dtype=torch.int64).t().contiguous(), device,
                          capturing)
        plan = _Plan(chunks, n_chunks, tensors, 3 * n_chunks + 5 * len(numels))
        if not capturing:                   # made during a capture: for that graph only
            build_counts["state"] += 1
            _plans[sig] = (numels, columns, plan, _native_key(params) if live else None,
                           {})
            _plans.move_to_end(sig)
            while len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
    return plan, tuple(map(_data_ptr, grads))


class _CapturedPlan:
    """A plan's chunk and state tables with a gradient table made during a capture."""

    __slots__ = ("chunks", "n_chunks", "tensors", "grads")

    def __init__(self, plan, grads):
        self.chunks, self.n_chunks, self.tensors, self.grads = (plan.chunks, plan.n_chunks,
                                                                plan.tensors, grads)


# ---------------------------------------------------------------------------------------------
# Launch ([note: fast launch])
# ---------------------------------------------------------------------------------------------

# [note: fast launch] ``kernel[grid](*args, **constexprs)`` (Triton's JIT) does, on every call,
# in Python: bind the arguments to the signature, specialize each one (dtype and 16-byte
# alignment of a tensor, int32/int64 range of an int), turn the specialization and the options
# into a cache key, look the compiled kernel up, re-check the kernel's globals, build the launch
# metadata for the launch hooks, and only then call the compiled kernel's launcher. A step
# launches twice (check and update) on tensors whose specialization hardly ever changes, so a
# :class:`_Launcher` keeps, per key of its own, the compiled kernel that the JIT launched and
# calls its launcher directly, with the arguments in the order the JIT passes them:
#
# - the key is a refinement of Triton's: the device, ``NUM_WARPS``, the options the JIT reads
#   from Triton's knobs (``debug``, ``instrumentation_mode``), every constexpr value, and for
#   every other argument what Triton specializes on (whether a tensor's address is a multiple
#   of 16, its dtype unless the call's C++ checks fixed it, an int's type and range: see
#   :func:`_tensor_kinds`, :func:`_int_kind`). Two calls with the same key get the same
#   compiled kernel from the JIT too (``tests/test_triton_backend.py`` checks this against
#   Triton's own argument binder), so a kernel specialized for a 16-byte aligned ``steps`` is
#   never launched on an unaligned one;
# - a key seen for the first time, a launch hook or pre-run hook installed (a profiler), or
#   ``FAST_LAUNCH`` off: the call goes through the JIT, exactly as before, and the compiled
#   kernel it returns is kept for that key;
# - the launch is the same call of the same launcher on the same stream (the current one, read
#   by the caller): CUDA graph capture records it as it records the JIT's, and nothing is
#   allocated or synchronized by the fast path;
# - what the JIT does and the fast path does not: re-check that the kernels' globals did not
#   change (they are the interface's constexprs, fixed at import) and build launch metadata for
#   the launch hooks (there are none on the fast path: with a hook, the JIT path is taken).
#
# Enabled for Triton 3.4 up to 4.0 (``triton.knobs``; from 3.3 on, the JIT hands the launcher
# every argument, constexprs included, which is what :func:`_entry` checks on each compiled
# kernel), compiled kernels only, unless ``EMCL_TRITON_FAST_LAUNCH=0`` is in the environment
# at import. ``FAST_LAUNCH_REASON`` says why it is off. Written against Triton 3.8's JIT; the
# GPU tests compare every fast launch with the JIT's choice on the GPU machine's Triton.

try:
    from triton import knobs as _knobs
except ImportError:          # Triton < 3.4, or no Triton
    _knobs = None

_HookChain = getattr(_knobs, "HookChain", None)


def _fast_launch_reason() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if INTERPRETED:
        return "the kernels run under Triton's interpreter: there is no compiled kernel"
    if os.environ.get("EMCL_TRITON_FAST_LAUNCH", "1") == "0":
        return "EMCL_TRITON_FAST_LAUNCH=0 in the environment"
    import triton
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        version = None
    if version is None or not (3, 4) <= version < (4, 0):
        return f"Triton {triton.__version__}: the fast launch is for Triton 3.4 up to 4.0"
    if _knobs is None or not hasattr(_knobs, "runtime") or not hasattr(_knobs, "compilation"):
        return "triton.knobs is missing"
    return None


#: Why the fast launch ([note: fast launch]) is off, or None when it is on.
FAST_LAUNCH_REASON: Optional[str] = _fast_launch_reason()
#: Launch compiled kernels directly once the JIT has launched them for a key ([note: fast
#: launch]); read at every call. False where ``FAST_LAUNCH_REASON`` is set.
FAST_LAUNCH: bool = FAST_LAUNCH_REASON is None
#: How many launches went through Triton's JIT (``"jit"``) and directly (``"fast"``).
launch_counts = {"jit": 0, "fast": 0}

_INT32, _INT64 = (-(1 << 31), (1 << 31) - 1), (-(1 << 63), (1 << 63) - 1)


def _int_kind(v) -> int:
    """An int argument's part of the key: Triton passes it as i1 (bool), i32, i64 or u64 by
    its type and range."""
    if type(v) is bool:
        return 3
    if _INT32[0] <= v <= _INT32[1]:
        return 0
    return 1 if _INT64[0] <= v <= _INT64[1] else 2


_AND15, _IS0 = (15).__and__, (0).__eq__
_MAX_ENTRIES = 256        # kept kernels per launcher (a launcher forgets them all past this)


def _tensor_kinds(tensors, dtypes: bool) -> tuple:
    """The tensors' part of the key: whether each one's address is a multiple of 16 (what
    Triton specializes a pointer argument on) and, with ``dtypes``, each one's dtype (left out
    where the call's checks have fixed every dtype). C-level passes, no Python per tensor."""
    kinds = tuple(map(_IS0, map(_AND15, map(_data_ptr, tensors))))
    return kinds + tuple(map(_dtype, tensors)) if dtypes else kinds


def _idle(hook) -> bool:
    return hook is None or (_HookChain is not None and type(hook) is _HookChain
                            and not hook.calls)


def _options() -> Optional[tuple]:
    """The fast path's options for the launches of one call: the options Triton's JIT adds from
    its knobs at every call (``debug``, ``instrumentation_mode``); None when the fast path is
    off, or while a launch or stage hook is installed (the JIT path then runs them)."""
    if not FAST_LAUNCH:
        return None
    rt = _knobs.runtime
    if not (_idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)
            and getattr(rt, "add_stages_inspection_hook", None) is None):
        return None
    return (rt.debug, getattr(_knobs.compilation, "instrumentation_mode", None))


class _Entry:
    """A compiled kernel's launcher, function handle and packed metadata; ``all_args``: the
    launcher takes the constexprs too (Triton >= 3.3) or only the other arguments."""

    __slots__ = ("run", "function", "packed", "all_args")

    def __init__(self, run, function, packed, all_args):
        self.run, self.function, self.packed, self.all_args = run, function, packed, all_args


def _entry(compiled, n_args: int, n_consts: int) -> Optional[_Entry]:
    """The launcher of what the JIT returned, when it is a compiled kernel whose launcher
    signature this module knows; None otherwise (the JIT path is then kept for the key)."""
    try:
        function, packed = compiled.function, compiled.packed_metadata
        n = len(compiled.src.signature)
        run = compiled.run
    except AttributeError:
        return None
    if function is None or not callable(run) or n not in (n_args, n_args + n_consts):
        return None
    return _Entry(run, function, packed, n == n_args + n_consts)


class _Launcher:
    """Launches the kernel ``triton_kernels.<name>`` ([note: fast launch]). ``consts``: the
    names of its constexpr parameters, which follow its other parameters."""

    __slots__ = ("name", "consts", "jit", "entries")

    def __init__(self, name: str, consts: tuple):
        self.name, self.consts = name, consts
        self.jit = None
        self.entries: dict = {}

    def __call__(self, grid: int, device: torch.device, stream: int, args: tuple,
                 kinds: tuple, consts: tuple, options: Optional[tuple]) -> None:
        """Launch ``grid`` programs with ``args`` (the non-constexpr arguments, in order;
        ``kinds`` their part of the key) and the constexpr values ``consts`` on ``stream`` (the
        current stream of ``device``); ``options``: :func:`_options`, None for the JIT path."""
        jit = getattr(_kernels, self.name)
        if jit is not self.jit:              # the kernel object was replaced: forget its kernels
            self.jit = jit
            self.entries.clear()
        key = entry = None
        if options is not None and not getattr(jit, "pre_run_hooks", None):
            key = (device, NUM_WARPS, options, consts, kinds)
            entry = self.entries.get(key)
        switch = (device.type == "cuda" and device.index is not None
                  and device.index != _current_device())
        if entry is not None:
            launch_counts["fast"] += 1
            if switch:
                with torch.cuda.device(device):
                    self._run(entry, grid, stream, args, consts)
            else:
                self._run(entry, grid, stream, args, consts)
            return
        launch_counts["jit"] += 1
        meta = dict(zip(self.consts, consts))
        if device.type == "cuda":
            meta["num_warps"] = NUM_WARPS
        if switch:
            with torch.cuda.device(device):
                compiled = jit[(grid,)](*args, **meta)
        else:
            compiled = jit[(grid,)](*args, **meta)
        if key is not None and compiled is not None:
            entry = _entry(compiled, len(args), len(consts))
            if entry is not None:
                if len(self.entries) >= _MAX_ENTRIES:
                    self.entries.clear()
                self.entries[key] = entry

    @staticmethod
    def _run(entry: _Entry, grid: int, stream: int, args: tuple, consts: tuple) -> None:
        if entry.all_args:
            entry.run(grid, 1, 1, stream, entry.function, entry.packed, None, None, None,
                      *args, *consts)
        else:
            entry.run(grid, 1, 1, stream, entry.function, entry.packed, None, None, None,
                      *args)


# torch.cuda.current_device() without its lazy-init check (a CUDA tensor is at hand)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

_STEP = _Launcher("emcl_step_kernel", ("PARAM", "OP", "PROX", "IMPORTANCE_KIND", "LR_MODE",
                                       "HAS_GRAD_SCALE", "HAS_FOUND_INF", "FINALIZE", "BLOCK",
                                       "SUB", "ARRAY"))
_CHECK = _Launcher("emcl_check_kernel", ("PARAM", "BLOCK", "ARRAY"))


def _block(dtype: torch.dtype) -> int:
    """Elements per chunk for ``dtype``: :data:`BLOCK_SIZE`, halved for fp64 (the same bytes
    per chunk; [note: vector path] in ``triton_kernels``)."""
    block = BLOCK_SIZE
    if block < 16 or block & (block - 1):
        raise ValueError(f"BLOCK_SIZE must be a power of two >= 16, got {block}")
    return block // 2 if dtype is torch.float64 else block


_PARAM_CODES = ({getattr(torch, name): code for name, code in _kernels.PARAM_CODES.items()}
                if _kernels is not None else {})


def _param_code(dtype: torch.dtype) -> int:
    code = _PARAM_CODES.get(dtype)
    if code is None:
        raise TypeError(f"the Triton backend updates float32, bfloat16, float16 and float64 "
                        f"parameters, not {dtype}")
    return code


def _check(chunks, n_chunks, grads_table, counters, code, device, stream, block, options,
           runs=1):
    args = (chunks, grads_table, counters, runs)
    _CHECK(n_chunks, device, stream, args, _tensor_kinds(args[:3], True) + (_int_kind(runs),),
           (code, block, runs > 1), options)


_PLAIN_COUNTERS = counters_size(1)


def _check_finite_call(grads, counters: torch.Tensor, runs: int) -> None:
    """The checks of ``torch.ops.emcl.check_finite_`` that concern arrays of runs, before
    anything is launched: ``runs`` >= 1, ``counters`` with the per-run slots, every gradient's
    numel a multiple of ``runs``."""
    if type(runs) is not int:
        raise TypeError(f"runs must be an int, got {type(runs).__name__}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1 (the runs of an array; 1: no array), got {runs}")
    want = counters_size(runs)
    if counters.dim() != 1 or counters.numel() != want:
        raise ValueError(f"counters must be one-dimensional with {want} elements "
                         f"(emcl_kernels.interface.counters_size({runs})), got shape "
                         f"{tuple(counters.shape)}")
    if runs > 1:
        for i, g in enumerate(grads):
            if g.numel() % runs:
                raise ValueError(f"grads[{i}] has {g.numel()} elements, not a multiple of "
                                 f"runs={runs}; every tensor of an array of runs holds the "
                                 "same number of elements of each run")


def check_finite(grads, counters: torch.Tensor, runs: int = 1) -> None:
    """``counters[FOUND] = 1`` when a gradient holds an inf or a NaN; for an array of ``runs``
    runs, ``counters[RUN_FOUND + r] = 1`` when run ``r``'s elements do: one read-only launch
    per dtype over every non-empty gradient (``grads`` writes nothing, no host sync)."""
    grads = list(grads)
    if runs != 1 or counters.numel() != _PLAIN_COUNTERS:
        _check_finite_call(grads, counters, runs)
    if not grads:
        return
    dtypes = set(map(_dtype, grads))
    if len(dtypes) > 1:                    # one launch per dtype
        for dt in dtypes:
            check_finite([g for g in grads if g.dtype == dt], counters, runs)
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
    sig = (device, block, len(numels), grad_key[0], runs)      # [note: cache keys]
    hit = _checks.get(sig)
    if hit is not None and hit[0] == numels and hit[1] == grad_key and not capturing:
        chunks, n_chunks, table = hit[2]
        _checks.move_to_end(sig)
    else:
        chunks, n_chunks = _chunk_table(device, block, numels, capturing, runs)
        table = _grad_table(device, grad_key, capturing)
        if not capturing:
            _checks[sig] = (numels, grad_key, (chunks, n_chunks, table))
            _checks.move_to_end(sig)
            while len(_checks) > _MAX_PLANS:
                _checks.popitem(last=False)
    stream = 0
    if capturing:
        _keep_for_graph(chunks, table)
        stream = _stream(device)
    elif device.type == "cuda":
        stream = _stream(device)
        _ensure_reserve(device, 3 * n_chunks + len(numels))
        _used_here(device, stream, (chunks, table))
    _check(chunks, n_chunks, table, counters, _param_code(grads[0].dtype), device, stream,
           block, _options(), runs)


def step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *, op: int,
         prox: bool, importance: int, lr_mode: int, meta_every: int, check: bool,
         finalize: bool, grad_scale=None, found_inf=None, runs: int = 1) -> None:
    """One step of one group ([note: the step call] in :mod:`emcl_kernels.interface`): with
    ``check``, one launch of the finite check; then one launch of the update, which also
    counts ``steps`` and, with ``finalize``, advances ``counters``. An array of ``runs`` runs
    takes the same two launches ([note: runs in Triton] in ``triton_kernels``)."""
    dtype = params[0].dtype if params else torch.float32
    block = _block(dtype)
    device = counters.device
    cuda = device.type == "cuda"
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    recurrent = lr_mode == _RECURRENT
    if recurrent and len(meta_lrs) != len(params):
        raise ValueError(f"lr_mode 'recurrent' needs one meta_lrs tensor per param: got "
                         f"{len(meta_lrs)} for {len(params)} params")
    found, known = _UNASKED, False
    if _LAYOUTS_ARE is not None and params and not capturing:       # [note: checked plans]
        found = _confirmed(device, block, params, grads, anchors)
        if found is not None:
            call = (op, bool(prox), importance, lr_mode, meta_every, grad_scale is not None,
                    found_inf is not None, runs)
            others = [_as_list(anchors), _as_list(importances),
                      _as_list(meta_lrs) if recurrent else [],
                      [steps, hyper, counters] + [t for t in (grad_scale, found_inf)
                                                  if t is not None]]
            layout = found[3].get(call)
            known = layout is not None and _LAYOUTS_ARE(others, layout)
    if known:
        lookups["checked"] += 1
    elif _NATIVE_CHECK is not None:                          # [note: launcher checks]
        _NATIVE_CHECK(params, grads, anchors, importances, meta_lrs if recurrent else [],
                      steps, hyper, counters, op, bool(prox), importance, lr_mode, meta_every,
                      bool(check), bool(finalize), grad_scale, found_inf, runs)
    else:
        _check_call(params, grads, anchors, importances, meta_lrs if recurrent else None,
                    device)
        if runs != 1:
            _check_runs_call(params, steps, hyper, counters, runs)
    code = _param_code(dtype)
    options = _options()
    stream = _stream(device) if cuda else 0
    plan = None
    if params:
        plan = _plan(device, block, params, grads, anchors, importances,
                     meta_lrs if recurrent else None, capturing, found, known)
        if type(found) is tuple and not known and plan is found[0]:
            # checked just now, on the confirmed plan's own tensors: kept for the next calls
            records = found[3]
            if len(records) >= _MAX_CHECKED and call not in records:
                records.clear()
            records[call] = _LAYOUT_KEY(others)
    chunks = None
    if plan is not None:
        chunks, n_chunks = plan.chunks, plan.n_chunks
        if runs > 1:             # the array's chunks: none crosses a run boundary
            chunks, n_chunks = _chunk_table(
                device, block, tuple(n for n in map(_numel, params) if n), capturing, runs)
            if capturing:        # a captured graph reads it at every replay: never freed
                _keep_for_graph(chunks)
        if cuda and not capturing:
            _ensure_reserve(device, plan.need + 3 * n_chunks)
            _used_here(device, stream, (chunks, plan.tensors, plan.grads))
        if check:
            _check(chunks, n_chunks, plan.grads, counters, code, device, stream, block,
                   options, runs)
    else:
        if not finalize and not (steps.numel() and op != _OP_INNER):
            return                          # no tensor, nothing to count
        plan = _empty_plan(device, capturing)
        chunks, n_chunks = plan.chunks, plan.n_chunks
    n_steps = steps.numel()
    gs = hyper if grad_scale is None else grad_scale
    fi = hyper if found_inf is None else found_inf
    # [note: fast launch] with the C++ checks, every dtype here is fixed by the call's checks
    kinds = _tensor_kinds((chunks, plan.tensors, plan.grads, hyper, counters, steps, gs, fi),
                          _NATIVE_CHECK is None)
    _STEP(n_chunks, device, stream,
          (chunks, plan.tensors, plan.grads, hyper, counters, steps, n_steps, meta_every, runs,
           gs, fi), kinds + (_int_kind(n_steps), _int_kind(meta_every), _int_kind(runs)),
          (code, op, bool(prox), importance, lr_mode, grad_scale is not None,
           found_inf is not None, bool(finalize), block, block // 4, runs > 1), options)


def _check_runs_call(params, steps, hyper, counters, runs) -> None:
    """Where the extension is not built: the checks of ``torch.ops.emcl.step_`` that concern
    an array of ``runs`` runs (``hyper`` rows, ``counters`` and ``steps`` lengths, every
    tensor's numel a multiple of ``runs``), before anything is launched."""
    from emcl_kernels.interface import HYPER_FIELDS
    _check_finite_call([], counters, runs)
    fields = len(HYPER_FIELDS)
    if hyper.numel() != runs * fields or hyper.dim() not in (1, 2) or (
            hyper.dim() == 2 and hyper.shape[0] != runs) or not hyper.is_contiguous():
        raise ValueError(f"hyper must hold one row of {fields} raw hyper-parameters per run: "
                         f"shape [{runs}, {fields}] for runs={runs}, got shape "
                         f"{tuple(hyper.shape)}")
    if steps.numel() not in (0, len(params) * runs):
        raise ValueError(f"steps must be empty or one-dimensional with runs elements per "
                         f"parameter ({len(params) * runs}), got shape {tuple(steps.shape)}")
    for i, p in enumerate(params):
        if p.numel() % runs:
            raise ValueError(f"params[{i}] has {p.numel()} elements, not a multiple of "
                             f"runs={runs}")
