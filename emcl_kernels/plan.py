"""Plans: the validated tensors of one backend call, and the protocol that runs a step over them.

A :class:`Plan` holds everything about one (param group, device, dtype) that does not change
from step to step: the backend, the parameters and their state, the meta-step counts, the
packed hyper-parameters and the mode codes. ``FusedEMCLOptimizer`` builds its plans when its
configuration changes and reuses them every step; ``functional`` builds them for one call.

:func:`run` is [note: the step call] of :mod:`emcl_kernels.interface` over several plans: one
native call per plan, with the finite check of every plan first when there are several (so one
non-finite gradient anywhere skips the whole step), the flags of several devices (or of the
ranks of a DTensor mesh) combined before any update, and the counters of each device finalized
by its last call.
"""
from __future__ import annotations

import operator
from bisect import bisect_right
from itertools import repeat
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from emcl_kernels.backends.extension import entry_point
from emcl_kernels.integration import capturing, is_dtensor, local
from emcl_kernels.interface import (COUNTER, HYPER, HYPER_DEFAULTS, HYPER_FIELDS, IMPORTANCE,
                                    LR_MODE, OP, RUN_FOUND, counters_size)
from emcl_kernels.runs import (PerRun, declared_runs, group_runs, is_per_run, per_run_values, run_value,
                               values_table)
from emcl_kernels.skips import SkipLog
from emcl_kernels.validation import (GROUP_NAMES, IMPORTANCE_KINDS, INNER_KEYS, LR_MODES,
                                     META_KEYS, NUMERIC_KEYS, OPTIMIZER_WIDE, PLAIN_TENSORS,
                                     check_group_options, check_hyperparameters, check_like,
                                     check_numbers,
                                     check_no_overlap, check_param, same_layout, state_dtype)
from emcl_kernels.zeros import warn_zero_parameters

__all__ = ["Plan", "Runtime", "run", "new_counters", "hyper_values", "pack_hyper",
           "agree_on_found", "resolve_backend", "check_group", "HYPER_KEYS", "GROUP_KEYS",
           "group_values"]

_FOUND, _CALLS = COUNTER["found"], COUNTER["calls"]


def new_counters(device, runs: int = 1) -> Tensor:
    """A device's step counters (emcl_kernels.interface, ``COUNTER_FIELDS``, and for arrays of
    ``runs`` runs the per-run flags and skip counts), all 0."""
    return torch.zeros(counters_size(runs), dtype=torch.int64, device=device)


def _hyper_entry(hp: dict, name: str):
    """One entry of ``hyper`` from a dict of hyper-parameters (a number or a 0-d tensor): a
    missing or None value is :data:`~emcl_kernels.interface.HYPER_DEFAULTS`' (0 otherwise).
    The one encoder of ``hyper``: :func:`hyper_values`, :func:`pack_hyper` and the traced
    hyper of a compiled step all build it from here."""
    v = hp.get(name)
    return HYPER_DEFAULTS.get(name, 0.0) if v is None else v


def hyper_values(hp: dict, runs: int = 1):
    """The numbers of ``hyper`` in :data:`~emcl_kernels.interface.HYPER_FIELDS` order from a
    dict of checked float hyper-parameters (``lr_scale=None`` is the 1/reg sentinel); for an
    array of runs, a [runs, fields] NumPy array (row ``r`` is run ``r``'s)."""
    if runs > 1 or any(map(is_per_run, hp.values())):
        table = values_table([_hyper_entry(hp, name) for name in HYPER_FIELDS], runs)
        return (table if runs > 1 else table.reshape(-1)).numpy()
    return tuple(float(_hyper_entry(hp, name)) for name in HYPER_FIELDS)


def _capturing_on(device: torch.device) -> bool:
    """A CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pack_hyper(hp: dict, device, runs: int = 1) -> Tensor:
    """``hyper`` for one call on ``device``: numbers are packed on the host and copied once;
    0-d tensors are stacked on the device (no host sync, so it can be captured).

    The numbers travel from pinned memory with a non-blocking copy: from pageable memory,
    ``.to(cuda)`` waits for the copy, and a float learning-rate schedule would then stall the
    host at every step. The pinned buffer is the caching host allocator's, which reuses it
    only after the copy has run. While a CUDA graph is being captured (a functional call in a
    captured region) the numbers are written on the device instead, one fill each: a captured
    copy would read the pinned buffer again at every replay, after the allocator reused it."""
    device = torch.device(device)
    if runs > 1 or any(map(is_per_run, hp.values())):
        # an array's table: [runs, fields] (per-run tensors read once here; 1-d for one run)
        table = values_table([_hyper_entry(hp, name) for name in HYPER_FIELDS], runs)
        table = table if runs > 1 else table.reshape(-1)
        return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
            else table.to(device)
    if not any(isinstance(v, Tensor) for v in hp.values()) and not _capturing_on(device):
        if device.type == "cuda":
            host = torch.tensor(hyper_values(hp), dtype=torch.float64, pin_memory=True)
            return host.to(device, non_blocking=True)
        return torch.tensor(hyper_values(hp), dtype=torch.float64, device=device)
    parts = []
    for name in HYPER_FIELDS:
        v = _hyper_entry(hp, name)
        if isinstance(v, Tensor):
            parts.append(v.detach().reshape(()).to(device=device, dtype=torch.float64))
        else:
            parts.append(torch.full((), float(v), dtype=torch.float64, device=device))
    return torch.stack(parts)


class Plan:
    """The tensors and settings of one backend call (see the module docstring).

    ``params`` are the tensors the kernels update (a DTensor's local shard), ``sources`` the
    objects whose ``.grad`` is read each step (the parameters themselves). ``key`` is what the
    plan was built for ([note: plan keys]); None for a plan made for one call."""

    __slots__ = ("backend", "device", "dtype", "sources", "params", "anchors", "importances",
                 "meta_lrs", "steps", "hyper", "prox", "importance", "lr_mode", "group",
                 "sharded", "checks_grads", "key", "native_key", "runs")

    def __init__(self, backend, device: torch.device, dtype: torch.dtype, sources: list,
                 params: list, anchors: list, importances: list, meta_lrs: list, steps: Tensor,
                 hyper: Tensor, *, prox: bool, importance: str, lr_mode: str,
                 group: Optional[int] = None, sharded: bool = False, runs: int = 1):
        self.backend, self.device, self.dtype = backend, device, dtype
        self.sources, self.params = sources, params
        self.anchors, self.importances, self.meta_lrs = anchors, importances, meta_lrs
        self.steps, self.hyper = steps, hyper
        self.prox = bool(prox)
        self.importance = IMPORTANCE[importance]
        self.lr_mode = LR_MODE[lr_mode]
        self.group, self.sharded = group, sharded
        self.runs = runs  # an array of runs ([note: runs] in emcl_kernels.interface)
        # the compiled backends check each call's tensors themselves (in C++ / the launcher)
        self.checks_grads = bool(getattr(backend, "CHECKS_GRADS", False))
        self.key = None
        self.native_key = None

    def call(self, grads: list, counters: Tensor, *, op: int, meta_every: int, check: bool,
             finalize: bool, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        if self.runs > 1:
            self.backend.step(self.params, grads, self.anchors, self.importances, self.meta_lrs,
                              self.steps, self.hyper, counters, op=op, prox=self.prox,
                              importance=self.importance, lr_mode=self.lr_mode,
                              meta_every=meta_every, check=check, finalize=finalize,
                              grad_scale=_on(grad_scale, self.device),
                              found_inf=_on(found_inf, self.device), runs=self.runs)
            return
        self.backend.step(self.params, grads, self.anchors, self.importances, self.meta_lrs,
                          self.steps, self.hyper, counters, op=op,
                          prox=self.prox, importance=self.importance, lr_mode=self.lr_mode,
                          meta_every=meta_every, check=check, finalize=finalize,
                          grad_scale=_on(grad_scale, self.device),
                          found_inf=_on(found_inf, self.device))


def _on(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    if t is None or (t.device == device and t.dtype == torch.float32):
        return t
    return t.detach().reshape(-1)[:1].to(device=device, dtype=torch.float32)


def run(plans: Sequence[Plan], grads: Sequence[list], counters: dict, *, op: int,
        meta_every: int, check: bool, grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None, mesh=None) -> None:
    """One step over ``plans`` with this step's ``grads`` (one list per plan). ``counters``
    maps each plan's device to its counters tensor. ``check``: run the finite check.
    ``mesh``: the DTensor device mesh whose ranks must skip the same steps."""
    if len(plans) == 1 and mesh is None:
        plans[0].call(grads[0], counters[plans[0].device], op=op, meta_every=meta_every,
                      check=check, finalize=True, grad_scale=grad_scale, found_inf=found_inf)
        return
    if check:
        for plan, g in zip(plans, grads):
            if plan.runs > 1:
                plan.backend.check_finite(g, counters[plan.device], plan.runs)
            else:
                plan.backend.check_finite(g, counters[plan.device])
        agree_on_found([counters[d] for d in dict.fromkeys(p.device for p in plans)], mesh)
    last = {plan.device: i for i, plan in enumerate(plans)}
    for i, (plan, g) in enumerate(zip(plans, grads)):
        plan.call(g, counters[plan.device], op=op, meta_every=meta_every, check=False,
                  finalize=last[plan.device] == i, grad_scale=grad_scale, found_inf=found_inf)


def agree_on_found(device_counters: list, mesh) -> None:
    """Make every device's (and every rank's) FOUND flag, and in an array of runs every run's
    flag, the maximum of all of them, on the devices, without a host sync."""
    runs = (device_counters[0].numel() - RUN_FOUND) // 2 if device_counters else 0
    flags = [slice(_FOUND, _FOUND + 1)] + ([slice(RUN_FOUND, RUN_FOUND + runs)] if runs else [])
    if len(device_counters) > 1:
        first = device_counters[0]
        for sl in flags:
            found = first[sl]
            for c in device_counters[1:]:
                found = torch.maximum(found, c[sl].to(first.device))
            for c in device_counters:
                c[sl].copy_(found)
    if mesh is not None:
        import torch.distributed as dist
        for c in device_counters:
            for sl in flags:
                flag = c[sl]
                for dim in range(mesh.ndim):
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


# ---------------------------------------------------------------------------------------------
# The optimizer's runtime
# ---------------------------------------------------------------------------------------------

_RESOLVED: dict = {}  # (name, device) -> backend module


def resolve_backend(name: str, device: torch.device):
    """:func:`emcl_kernels.backends.get_backend`, remembered per (name, device): what is
    available does not change within a process, and a step traced by torch.compile must not
    re-run the availability checks (some query the dispatcher, which cannot be traced)."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    mod = _RESOLVED.get((name, device))
    if mod is None:
        from emcl_kernels.backends import get_backend
        mod = _RESOLVED[(name, device)] = get_backend(name, device)
    return mod


HYPER_KEYS = tuple(dict.fromkeys(INNER_KEYS + META_KEYS))
#: The same, as a param group spells them (β is ``lr``: validation.GROUP_NAMES).
GROUP_KEYS = tuple(GROUP_NAMES.get(k, k) for k in HYPER_KEYS)
_NUMERIC_GROUP_KEYS = tuple(GROUP_NAMES.get(k, k) for k in NUMERIC_KEYS)
# what the per-step key compares by identity: the hyper-parameters and the other keys a group
# may hold that check_group_options rules on
_WATCHED = GROUP_KEYS + ("weight_decay", "inner_lr") + OPTIMIZER_WIDE
# index in _WATCHED -> group key, for the numbers ([note: a schedule's step])
_NUMBER_AT = {i: k for i, k in enumerate(_WATCHED) if k in _NUMERIC_GROUP_KEYS}
_PLAIN_NUMBER = (float, int, PerRun)
_MODE_KEYS = ("prox", "importance", "lr_mode")
_MODE_INDEX = tuple(HYPER_KEYS.index(k) for k in _MODE_KEYS)
_STATE_TENSORS = ("anchor", "importance", "meta_lr")


def check_group(group: dict, where: str = "param group") -> dict:
    """A param group's hyper-parameters, checked ([note: domains] in validation.py) and keyed by
    their own names (``inner_lr`` for the group's ``lr``); its other options too."""
    missing = [k for k in GROUP_KEYS if k not in group]
    if missing:
        raise ValueError(f"{where} lacks the hyper-parameter(s) {', '.join(missing)}; "
                         "was it made for another optimizer?")
    check_group_options(group, where)
    values = {k: group[k] for k in GROUP_KEYS}
    runs = group_runs(group, where)
    if runs == 1 and not any(map(is_per_run, values.values())):
        return _by_name(check_hyperparameters(**values))
    return _by_name(check_runs(values, runs, where, declared_runs(group, where) is not None))


def check_runs(values: dict, runs: int, where: str, declared: bool = True) -> dict:
    """An array group's hyper-parameters ([note: domains] in validation.py, run by run): each
    run's values checked as a group of its own would be, an error naming the run. Returns the
    values with per-run ones as they are (a :class:`~emcl_kernels.runs.PerRun` or a 1-d
    tensor) and the scalars checked."""
    values = {k: per_run_values(k, v, runs, where, declared) for k, v in values.items()}
    per_run = [k for k, v in values.items() if is_per_run(v)]
    # a 1-d tensor is read once (one host read per value, not per run)
    read = {k: PerRun(values[k].detach().cpu().tolist()) if isinstance(values[k], Tensor)
            else values[k] for k in per_run}
    first = None
    for r in range(runs):
        row = {k: (read[k][r] if k in read else v) for k, v in values.items()}
        try:
            checked = check_hyperparameters(**row)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}, run {r}: {exc}") from None
        if first is None:
            first = checked
    out = dict(first)
    for k in per_run:
        out[k] = values[k]
    return out


def _by_name(checked: dict) -> dict:
    """Checked hyper-parameters as a group spells them, keyed by their own names."""
    return {name: checked[k] for name, k in zip(HYPER_KEYS, GROUP_KEYS)}


def _by_group_key(hp: dict) -> dict:
    """The inverse of :func:`_by_name`."""
    return {k: hp[name] for name, k in zip(HYPER_KEYS, GROUP_KEYS)}


def group_values(group: dict) -> dict:
    """A param group's hyper-parameter objects keyed by their own names (unchecked)."""
    return {name: group.get(k) for name, k in zip(HYPER_KEYS, GROUP_KEYS)}


def group_key(group: dict) -> tuple:
    """What a plan depends on in a group's hyper-parameters: values, and tensors by
    identity."""
    return tuple(("tensor", id(v)) if isinstance(v, Tensor) else v
                 for v in map(group.get, GROUP_KEYS))


def _no_silent_collapse(gi: int, group: dict, now: tuple, then: tuple) -> None:
    """An array group's per-run value that became one number is refused: that is what the LR
    schedulers that take their rates from their own arguments, one per group (CyclicLR,
    OneCycleLR), do to ``lr``, driving every run at one rate."""
    if group.get("runs") is None:
        return
    for k, a, b in zip(GROUP_KEYS, now, then):
        if type(b) is PerRun and type(a) in (float, int):
            raise ValueError(
                f"param group {gi} had {k} per run and now has one number ({a!r}) for every "
                "run: an LR scheduler that sets its own rate per group (CyclicLR, OneCycleLR) "
                "would drive every run at one rate, so this is refused. To give every run the "
                f"same value on purpose, write group[{k!r}] = [value] * runs")


def _kind(v) -> str:
    return "tensor" if isinstance(v, tuple) else type(v).__name__


_is = operator.is_
_grad_of = operator.attrgetter("grad")
_data_ptr = Tensor.data_ptr
_nbytes = Tensor.nbytes.__get__
_shape = Tensor.shape.__get__
_stride = Tensor.stride
_dtype = Tensor.dtype.__get__
_device = Tensor.device.__get__
_layout = Tensor.layout.__get__


def _py_identical(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(_is, a, b))


def _py_items_are(dicts: list, key, values: list) -> bool:
    return len(dicts) == len(values) and all(map(_is, map(dict.get, dicts, repeat(key)), values))


# the key's C++ passes where the extension is built, else the same in Python
_plan_grads = entry_point("plan_grads")
_identical = entry_point("identical") or _py_identical
_items_are = entry_point("items_are") or _py_items_are


def native_key(plan: Plan) -> Optional[tuple]:
    """The arguments of ``_C.plan_grads`` after ``sources`` for a plan just built: its
    parameters' addresses, sizes and strides as one int64 tensor, and a tensor of its dtype and
    device; None where the C++ pass cannot stand in for the Python one (no extension, sharded
    or subclassed parameters, whose ``.grad`` Python may compute differently)."""
    if _plan_grads is None or plan.sharded or \
            not all(type(p) in PLAIN_TENSORS for p in plan.sources):
        return None
    _, _, ptrs, shapes, strides, _ = plan.key
    flat = []
    for ptr, shape, stride in zip(ptrs, shapes, strides):
        flat += (ptr, len(shape), *shape, *stride)
    return (torch.tensor(flat, dtype=torch.int64),
            torch.empty(0, dtype=plan.dtype, device=plan.device))


# [note: plan keys] A plan caches what was validated when it was built; every step compares,
# before anything is written, what the user can change since then with what the plan was built
# for, and rebuilds the plans (validating everything again, refusing in the user's terms) on
# any difference:
#
# - the optimizer's ``param_groups`` (the list and each group by identity), each group's
#   ``params`` (the list's members, in order, by identity: torch's optimizers re-read the list
#   every step) and its hyper-parameters (numbers by value, tensors by identity; a tensor's
#   value is read at the step: :func:`pack_hyper`);
# - ``opt.state`` (the dict by identity, its size, and its keys and entries in order by
#   identity; each planned parameter's ``anchor`` by identity: a state reset makes new state at
#   the next step);
# - each parameter's memory (``data_ptr``: a ``.data`` swap, ``model.half()``, a memory
#   format change, weights tied after construction) and, where the backend does not check its
#   call's tensors itself or a step has several plans, its shape, strides and dtype;
# - each gradient's dtype, layout, device, shape and strides (the compiled backends check
#   these themselves, in C++ or in the Triton launcher), and its memory: when a gradient's
#   address is not the one checked at the last step, every gradient is checked against every
#   parameter and state tensor for overlap (``p.grad = p.data`` is refused).
#
# The comparisons are C-level passes over lists (``map`` of an attribute, list equality) and,
# for the gradients' memory, a sort and a binary search (``spans_apart``). Where the extension
# is built, the parameters' and gradients' half is one C++ pass per plan (``_C.plan_grads``),
# which accepts only an exact match and otherwise leaves the decision to the Python passes,
# and the identity comparisons are C++ loops (``_C.identical``, ``_C.items_are``). What is not
# in the key: a state tensor other than the anchor replaced by hand (replace state through
# ``load_state_dict``), and a value written into a parameter or state tensor (the step reads
# the values anyway).
#
# [note: a schedule's step] An LR scheduler or a trainer moves ``lr`` (or another number) at
# every step. A change of numbers alone, from plain numbers to plain numbers, does not rebuild
# the plans nor check the group whole: each new number is checked against its domain and the
# products with the others again (``validation.check_numbers``, the same rules and messages as
# the whole check), then written into the plans' ``hyper`` (in place on the CPU). Any other
# change (a mode, a number becoming a tensor or back, another key of the group) takes the path
# above (benchmarks/results/step_host_schedule_cpu.json: ``inner_step()`` and a LambdaLR's
# step on the paper's MLP, ``cpu`` backend, 79 -> 51 us of host time; 30 without the
# scheduler, fused Adam's step with one 68-70).


class Spans:
    """The memory of the planned tensors of one device: (start, end) pairs sorted by start,
    apart from each other (validated when the plans were built), as lists and as arrays."""

    __slots__ = ("starts", "ends", "np_starts", "np_ends")

    def __init__(self, starts: list, ends: list):
        live = sorted((a, b) for a, b in zip(starts, ends) if b > a)
        self.starts, self.ends = [a for a, _ in live], [b for _, b in live]
        self.np_starts = np.array(self.starts, dtype=np.int64)
        self.np_ends = np.array(self.ends, dtype=np.int64)


#: From this many gradients on, the overlap check runs on arrays (one pass of numpy calls of
#: a few microseconds each) instead of a Python loop (a fraction of a microsecond per tensor).
_ARRAY_CHECK_FROM = 48


def spans_apart(starts: list, sizes, planned: Optional[Spans]) -> bool:
    """The memory ``[start, start + size)`` of each tensor overlaps no other's, nor any of
    ``planned`` (empty tensors hold no memory). Sorted by start, a tensor that overlaps an
    earlier one overlaps the one just before it; a planned span is found by binary search.
    ``sizes``: a list, or an int64 array (a step's gradients have their parameters' sizes,
    so the caller keeps the array from step to step)."""
    n_grads = len(starts)
    if n_grads >= _ARRAY_CHECK_FROM:
        s = np.fromiter(starts, dtype=np.int64, count=n_grads)
        e = s + (sizes if isinstance(sizes, np.ndarray)
                 else np.fromiter(sizes, dtype=np.int64, count=n_grads))
        live = e > s
        if not live.all():
            s, e = s[live], e[live]
        order = np.argsort(s)
        s, e = s[order], e[order]
        if s.size > 1 and bool((s[1:] < e[:-1]).any()):
            return False
        if planned is None or not planned.starts or not s.size:
            return True
        st, en, n = planned.np_starts, planned.np_ends, len(planned.starts)
        i = np.searchsorted(st, s, side="right")
        before = en[np.maximum(i - 1, 0)]
        after = st[np.minimum(i, n - 1)]
        return not bool((((i > 0) & (before > s)) | ((i < n) & (after < e))).any())
    pairs = sorted(zip(starts, map(operator.add, starts, sizes)))
    if 0 in sizes:
        pairs = [(a, b) for a, b in pairs if b > a]
    end = 0
    for start, stop in pairs:
        if start < end:
            return False
        end = stop
    if planned is None or not planned.starts:
        return True
    st, en, n = planned.starts, planned.ends, len(planned.starts)
    for start, end in pairs:
        i = bisect_right(st, start)
        if (i and en[i - 1] > start) or (i < n and st[i] < end):
            return False
    return True


class Runtime:
    """The plans of a :class:`~emcl_kernels.optimizer.FusedEMCLOptimizer` and the per-step
    check that they still fit ([note: plan keys]), its device counters and skip log.

    ``gather()`` gives this step's plans and gradients (rebuilding the plans first when the
    world changed), ``step()`` runs one step over them."""

    def __init__(self, opt, calls: int = 0, skips: int = 0):
        self.opt = opt
        self.plans: Optional[list] = None
        self.keys: list = []           # group_key of each group when the plans were built
        self.seen: list = []           # each group's hyper-parameter objects last found equal
        self.checked: list = []        # each group's hyper-parameters as last checked (by name)
        self.tensor_hyper: list = []   # groups whose tensor hyper-parameters are read per step
        self.counters: dict = {}       # device -> counters (emcl_kernels.interface)
        self.calls_base = int(calls)   # step() calls before the first counters existed
        self.skips = SkipLog(skips)
        self.mesh = None
        self.storage: dict = {}        # group index -> capturable hyper tensor (views in group)
        self.runs = 1                  # the runs of the array groups (1: none)
        self.tracing = False           # gather() runs for a step that Dynamo traces
        self.unadopted: set = set()    # capturable groups whose values are not views yet
        # the world the plans were built for ([note: plan keys])
        self.groups: list = []
        self.lists: list = []
        self.state = None
        self.state_len = 0
        self.state_keys: list = []     # opt.state's keys and entries, in order
        self.state_entries: list = []
        self.without_grad: list = []   # parameters without a gradient when the plans were built
        self.grad_ptrs: Optional[list] = None
        self.spans: dict = {}          # device -> Spans of the planned tensors
        self.grad_sizes: dict = {}     # device -> the bytes of its gradients, in plan order

    # -- hyper-parameters ---------------------------------------------------------------------
    def adopt_capturable(self, gi: int) -> None:
        """Make the numeric hyper-parameters of group ``gi`` 0-d views of one fp64 tensor on
        the group's device: the ``hyper`` every plan of the group hands its kernels. While
        Dynamo traces a step the group keeps its values and only the storage takes them
        ([note: compiled hyper-parameters]); the next eager step makes the views."""
        group = self.opt.param_groups[gi]
        first = next((p for p in group["params"] if p.device.type != "meta"), None)
        device = local(first).device if first is not None else torch.device("cpu")
        runs = group_runs(group, f"param group {gi}")
        shape = (runs, len(HYPER)) if runs > 1 else (len(HYPER),)
        storage = self.storage.get(gi)
        if storage is None or storage.device != device or tuple(storage.shape) != shape:
            storage = torch.zeros(shape, dtype=torch.float64, device=device)
            self.storage[gi] = storage
        hp = check_group(group, f"param group {gi}")
        storage.copy_(pack_hyper(hp, device, runs))
        if self.tracing:
            self.unadopted.add(gi)
            return
        self.unadopted.discard(gi)
        for name, i in HYPER.items():
            key = GROUP_NAMES.get(name, name)
            if group[key] is not None:  # an array's value: run r's is storage[r, i]
                group[key] = storage[:, i] if runs > 1 else storage[i]

    def refresh_hyper(self, gi: int, group: dict) -> None:
        """A group's numbers changed (a schedule), or its tensor hyper-parameters are read per
        step: check them and write them into its plans' ``hyper`` (capturable groups: into the
        storage their views share)."""
        if group.get("capturable"):
            self.adopt_capturable(gi)
        hp = check_group(group, f"param group {gi}")
        self._write_hyper(gi, hp)

    def _write_hyper(self, gi: int, hp: dict) -> None:
        """Checked values ``hp`` of group ``gi`` into its plans' ``hyper``."""
        if gi < len(self.checked):
            self.checked[gi] = hp
        plain = not any(isinstance(v, Tensor) for v in hp.values())
        for plan in self.plans:
            if plan.group != gi or plan.hyper is self.storage.get(gi):
                continue
            kind = plan.device.type
            if plain and kind == "cpu":
                # host memory, read by the next call: written in place, no tensor made
                plan.hyper.numpy()[:] = hyper_values(hp, plan.runs)
            elif plain and kind == "cuda" and not _capturing_on(plan.device):
                # one copy from pinned memory, not waited for (as in pack_hyper)
                plan.hyper.copy_(torch.as_tensor(hyper_values(hp, plan.runs),
                                                 dtype=torch.float64).pin_memory(),
                                 non_blocking=True)
            else:
                plan.hyper.copy_(pack_hyper(hp, plan.device, plan.runs))

    def _numbers_moved(self, gi: int, group: dict, objects: list, seen: list) -> bool:
        """[note: a schedule's step]: only numbers of group ``gi`` changed, from plain numbers
        to plain numbers: check just those (and the products) and write them into its plans'
        ``hyper``. False, doing nothing, for any other change (the full check decides)."""
        hp = self.checked[gi] if gi < len(self.checked) else None
        if hp is None or group.get("capturable"):
            return False
        changed = {}
        for i, (now, then) in enumerate(zip(objects, seen)):
            if now is not then:
                key = _NUMBER_AT.get(i)
                if key is None or type(now) not in _PLAIN_NUMBER \
                        or type(then) not in _PLAIN_NUMBER:
                    return False
                changed[key] = now
        if group.get("runs") is not None or any(map(is_per_run, hp.values())):
            # an array: every run's values checked again (a PBT change, a schedule's step)
            hp = check_group(group, f"param group {gi}")
        else:
            hp = _by_name(check_numbers(_by_group_key(hp), changed))
        self._write_hyper(gi, hp)
        key = list(self.keys[gi])
        for k, v in changed.items():
            key[GROUP_KEYS.index(k)] = v
        self.keys[gi] = tuple(key)
        self.seen[gi] = objects
        return True

    # -- counters -------------------------------------------------------------------------------
    def counters_for(self, device: torch.device) -> Tensor:
        c = self.counters.get(device)
        if c is None:
            calls = self.step_calls
            c = new_counters(device, self.runs)
            c[_CALLS] = calls
            if not self.counters:
                self.skips.watch(c)
            self.counters[device] = c
        return c

    @property
    def step_calls(self) -> int:
        """The count of ``step()`` calls that ``meta_every`` runs on (waits for the device)."""
        if not self.counters:
            return self.calls_base
        return int(next(iter(self.counters.values()))[_CALLS])

    @step_calls.setter
    def step_calls(self, value: int) -> None:
        self.calls_base = int(value)
        for c in self.counters.values():
            c[_CALLS] = int(value)

    def home_device(self) -> torch.device:
        if self.counters:
            return next(iter(self.counters))
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.device.type != "meta":
                    return local(p).device
        return torch.device("cpu")

    # -- plans ----------------------------------------------------------------------------------
    def retire(self) -> None:
        """The old plans' ``state["step"]`` views become tensors of their own."""
        state = self.opt.state
        for plan in self.plans or ():
            rows = plan.steps.view(-1, plan.runs).unbind(0) if plan.steps.numel() else ()
            for p, s in zip(plan.sources, rows):
                st = state.get(p)
                if st is not None and "step" in st:
                    st["step"] = s.clone() if plan.runs > 1 else s.reshape(()).clone()
        self.plans = None

    def _array_runs(self) -> int:
        """The runs of the optimizer's array groups (1 when none): one number for all of them,
        since run ``i`` of one group is run ``i`` of every other (it skips in all of them)."""
        runs, first = 1, None
        for gi, group in enumerate(self.opt.param_groups):
            r = group_runs(group, f"param group {gi}")
            if r == 1:
                continue
            if first is not None and r != runs:
                raise ValueError(
                    f"param group {first} has runs={runs} but param group {gi} has runs={r}: "
                    "the array groups of one optimizer hold the same runs (run i of one group "
                    "is run i of every other, and a non-finite gradient skips it in all)")
            runs, first = r, gi
        return runs

    def _resize_counters(self, runs: int) -> None:
        """Counters with room for ``runs`` runs' flags (the counts carried over)."""
        for device, c in list(self.counters.items()):
            if c.numel() != counters_size(runs):
                new = new_counters(device, runs)
                new[:RUN_FOUND].copy_(c[:RUN_FOUND])
                self.counters[device] = new
                if self.skips.watching(c):
                    self.skips.watch(new, carry=True)

    def build(self) -> list:
        """Validate every group and every parameter that has a gradient, make the missing
        state, and group everything into plans. Nothing is written unless all of it passes
        (a capturable group's hyper storage takes its checked values first)."""
        opt = self.opt
        self.retire()
        runs_all = self._array_runs()
        checked = []
        for gi, group in enumerate(opt.param_groups):
            if group.get("capturable"):
                self.adopt_capturable(gi)
            hp = check_group(group, f"param group {gi}")
            runs = group_runs(group, f"param group {gi}")
            ready = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                check_parameter(opt.state, f"parameter {pi} of param group {gi}", p,
                                declared_runs(group, f"param group {gi}"))
                ready.append((pi, p))
            checked.append((gi, group, hp, ready))
        named = []
        for gi, _, _, ready in checked:
            for pi, p in ready:
                where = f"parameter {pi} of param group {gi}"
                named.append((where, p))
                named.append((f"the gradient of {where}", p.grad))
                st = opt.state.get(p, {})
                for key in _STATE_TENSORS:
                    if key in st:
                        named.append((f"the {key} state of {where}", st[key]))
        check_no_overlap(named)
        fresh = []
        for gi, group, _, ready in checked:       # every check passed: now relay and make state
            recurrent = group["lr_mode"] == "recurrent"
            names = group.get("param_names")
            for pi, p in ready:
                follow_layout(opt.state, p)
                if init_state(opt.state, p, group, recurrent, hp):
                    fresh.append((repr(names[pi]) if names else
                                  f"parameter {pi} of param group {gi}", p, group))
        if fresh and not capturing():
            warn_zero_parameters(fresh)
        plans, keys, tensor_hyper = [], [], []
        mesh = None
        for gi, group, hp, ready in checked:
            keys.append(group_key(group))
            if any(isinstance(group[k], Tensor) for k in _NUMERIC_GROUP_KEYS) \
                    and not group.get("capturable"):
                tensor_hyper.append(gi)
            by_key: dict = {}
            for _, p in ready:
                by_key.setdefault((local(p).device, p.dtype), []).append(p)
            runs = group_runs(group, f"param group {gi}")
            for (device, dtype), ps in by_key.items():
                recurrent = group["lr_mode"] == "recurrent"
                if any(is_dtensor(p) for p in ps):
                    mesh = next(p.device_mesh for p in ps if is_dtensor(p))
                sts = [opt.state[p] for p in ps]
                # every parameter's meta-step count(s), one tensor; the state holds views of it
                steps = torch.cat([st["step"].detach().reshape(-1)
                                   .to(device=device, dtype=torch.float32) for st in sts])
                for i, st in enumerate(sts):
                    st["step"] = steps[i * runs:(i + 1) * runs] if runs > 1 else steps[i]
                storage = self.storage.get(gi)
                hyper = storage if storage is not None and storage.device == device \
                    else pack_hyper(hp, device, runs)
                params = [local(p) for p in ps]
                plan = Plan(
                    resolve_backend(opt.backend, device), device, dtype, ps, params,
                    [local(st["anchor"]) for st in sts], [local(st["importance"]) for st in sts],
                    [local(st["meta_lr"]) for st in sts] if recurrent else [],
                    steps, hyper, prox=hp["prox"], importance=hp["importance"],
                    lr_mode=hp["lr_mode"], group=gi, sharded=any(is_dtensor(p) for p in ps),
                    runs=runs)
                plan.key = (sts, [st["anchor"] for st in sts], list(map(_data_ptr, params)),
                            list(map(_shape, params)), list(map(_stride, params)),
                            list(map(_nbytes, params)))
                plan.native_key = native_key(plan)
                plans.append(plan)
        self.runs = runs_all
        self._resize_counters(runs_all)
        for plan in plans:
            self.counters_for(plan.device)
        self.plans, self.keys, self.tensor_hyper, self.mesh = plans, keys, tensor_hyper, mesh
        self.seen = [None] * len(keys)
        self.checked = [hp for _, _, hp, _ in checked]
        groups = opt.param_groups
        self.groups = list(groups)
        self.lists = [list(group["params"]) for group in groups]
        self.state, self.state_len = opt.state, len(opt.state)
        self.state_keys, self.state_entries = list(opt.state), list(opt.state.values())
        self.without_grad = [p for group in groups for p in group["params"] if p.grad is None]
        spans: dict = {}
        for plan in plans:
            starts, ends = spans.setdefault(plan.device, ([], []))
            for lst in (plan.params, plan.anchors, plan.importances, plan.meta_lrs):
                starts.extend(map(_data_ptr, lst))
                ends.extend(map(operator.add, map(_data_ptr, lst), map(_nbytes, lst)))
        self.spans = {device: Spans(starts, ends) for device, (starts, ends) in spans.items()}
        sizes: dict = {}
        for plan in plans:  # each device's gradients in _grads_apart's order
            sizes.setdefault(plan.device, []).extend(plan.key[5])
        self.grad_sizes = {device: np.array(v, dtype=np.int64) if len(v) >= _ARRAY_CHECK_FROM
                           else v for device, v in sizes.items()}
        self.grad_ptrs = [list(map(_data_ptr, [local(p.grad) for p in plan.sources]))
                          for plan in plans]
        return plans

    def _same_world(self) -> bool:
        """The groups, their parameter lists and ``opt.state`` are what the plans were built
        for ([note: plan keys])."""
        opt = self.opt
        groups, state = opt.param_groups, opt.state
        if (state is not self.state or len(state) != self.state_len
                or len(groups) != len(self.groups) or not all(map(_is, groups, self.groups))):
            return False
        for group, lst in zip(groups, self.lists):
            ps = group["params"]
            if not _identical(ps if type(ps) is list else list(ps), lst):
                return False
        for p in self.without_grad:
            if p.grad is not None:
                return False
        # every key and entry of opt.state, in order, as built: no entry was replaced, deleted
        # or moved (one pass over the dict's own arrays, no hashing of the parameters)
        if not _identical(list(state), self.state_keys) or \
                not _identical(list(state.values()), self.state_entries):
            return False
        for plan in self.plans:
            if not _items_are(plan.key[0], "anchor", plan.key[1]):
                return False
        return True

    def _hyper_now(self) -> list:
        """The plans, with fresh ``hyper`` where only hyper-parameter values changed; rebuilt
        when a mode changed or a number became a tensor (or back)."""
        groups = self.opt.param_groups
        for gi, (group, key) in enumerate(zip(groups, self.keys)):
            objects = list(map(group.get, _WATCHED))
            seen = self.seen[gi]
            if seen is not None and all(map(_is, objects, seen)):
                continue  # the very objects found equal before (numbers are immutable)
            if seen is not None and self._numbers_moved(gi, group, objects, seen):
                continue  # a schedule moved a number: checked and written
            check_group_options(group, f"param group {gi}")
            now = group_key(group)
            if now != key:
                _no_silent_collapse(gi, group, now, key)
                if any(_kind(a) != _kind(b) for a, b in zip(now, key)) \
                        or any(now[i] != key[i] for i in _MODE_INDEX):
                    return self.build()
                self.refresh_hyper(gi, group)
                self.keys[gi] = group_key(group)
                objects = list(map(group.get, _WATCHED))
            self.seen[gi] = objects
        for gi in self.tensor_hyper:
            self.refresh_hyper(gi, groups[gi])
        if self.unadopted and not self.tracing:
            for gi in sorted(self.unadopted):
                self.refresh_hyper(gi, groups[gi])
                self.keys[gi] = group_key(groups[gi])
                self.seen[gi] = None
        return self.plans

    def _fits(self, plan: Plan, grads: list, several: bool) -> bool:
        """The plan's parameters and this step's gradients are what the plan was built for
        ([note: plan keys])."""
        params = [local(p) for p in plan.sources] if plan.sharded else plan.params
        _, _, ptrs, shapes, strides, _ = plan.key
        if list(map(_data_ptr, params)) != ptrs:
            return False
        if plan.checks_grads and not several:
            return True  # the backend checks every tensor of its call before it writes
        n, dtype = len(params), plan.dtype
        return (list(map(_shape, params)) == shapes and list(map(_stride, params)) == strides
                and list(map(_dtype, params)).count(dtype) == n
                and list(map(_layout, grads)).count(torch.strided) == n
                and list(map(_dtype, grads)).count(dtype) == n
                and list(map(_device, grads)).count(plan.device) == n
                and list(map(_shape, grads)) == shapes
                and (list(map(_stride, grads)) == strides
                     or all(map(same_layout, grads, params))))

    def _grads_apart(self, plans: list, ptrs: list) -> bool:
        """No gradient shares memory with another or with a planned tensor (checked again only
        when a gradient's address is not the one checked last, which on the CPU is most steps:
        autograd allocates the gradients anew). A gradient's extent is taken to be its
        parameter's bytes: :meth:`_fits` has compared its shape, dtype and layout with the
        parameter's, or the backend does before it writes (``checks_grads``) and refuses a
        gradient of any other size."""
        if ptrs == self.grad_ptrs:
            return True
        by_device: dict = {}
        for plan, pt in zip(plans, ptrs):
            by_device.setdefault(plan.device, []).extend(pt)
        for device, starts in by_device.items():
            if not spans_apart(starts, self.grad_sizes[device], self.spans.get(device)):
                return False
        self.grad_ptrs = ptrs
        return True

    def _grads(self, plans: list) -> Optional[list]:
        """This step's gradients, one list per plan; None when they or the parameters no
        longer fit the plans. A plan with a ``native_key`` is checked in one C++ pass first;
        where that pass does not accept, the Python comparisons decide."""
        several = len(plans) > 1
        out, ptrs = [], []
        for plan in plans:
            if plan.native_key is not None:
                got = _plan_grads(plan.sources, *plan.native_key)
                if got is not None:
                    out.append(got[0])
                    ptrs.append(got[1])
                    continue
            g = list(map(_grad_of, plan.sources))
            if any(map(_is, g, repeat(None))):
                return None
            if plan.sharded:
                g = [local(x) for x in g]
            if not self._fits(plan, g, several):
                return None
            out.append(g)
            ptrs.append(list(map(_data_ptr, g)))
        if not self._grads_apart(plans, ptrs):
            return None
        return out

    def gather(self) -> tuple:
        """This step's plans and gradients. When anything changed since the plans were built
        ([note: plan keys]) they are built again first, which refuses, naming the parameter and
        what is wrong, before anything is written."""
        plans = self.plans
        if plans is None or not self._same_world():
            plans = self.build()
        else:
            plans = self._hyper_now()
        grads = self._grads(plans)
        if grads is None:
            plans = self.build()
            grads = self._grads(plans)
            if grads is None:  # build() validated what _grads compares: they cannot disagree
                raise RuntimeError("emcl_kernels: freshly built plans do not fit their "
                                   "tensors; please report this as a bug")
        return plans, grads

    # -- steps ----------------------------------------------------------------------------------
    def step(self, op: int, meta_every: int, *, check: bool, grad_scale, found_inf) -> None:
        """One eager step over every plan."""
        plans, grads = self.gather()
        if not plans:
            if op == OP["cadence"]:
                self.counters_for(self.home_device())[_CALLS] += 1
            return
        try:
            run(plans, grads, self.counters, op=op, meta_every=meta_every, check=check,
                grad_scale=grad_scale, found_inf=found_inf, mesh=self.mesh)
        except (RuntimeError, TypeError, ValueError):
            self.plans = None
            self.build()  # says what is wrong in the user's terms, if it can
            raise
        if op == OP["cadence"] and len(self.counters) > len({p.device for p in plans}):
            for device, c in self.counters.items():  # a device without gradients this step
                if all(p.device != device for p in plans):
                    c[_CALLS] += 1
        self.skips.after_step()

    def traced_plans(self) -> tuple:
        """The plans of a step that torch.compile traces: built (or checked) by the
        optimizer's ``_init_group``, which Dynamo runs eagerly ([note: torch.compile] in
        optimizer.py). Every plan's ``hyper`` is made in the graph from its group's values
        ([note: compiled hyper-parameters])."""
        opt = self.opt
        plans, grads, counters = [], [], {}
        for group in opt.param_groups:
            params, gs, anchors, importances, meta_lrs, extras = [], [], [], [], [], []
            specs = opt._init_group(group, params, gs, anchors, importances, meta_lrs, extras)
            start = mstart = 0
            for k, (n, m, prox, importance, lr_mode, device) in enumerate(specs):
                device = torch.device(device)
                steps, c = extras[3 * k], extras[3 * k + 2]
                hyper = _traced_hyper(group_values(group), device)
                plans.append(Plan(resolve_backend(opt.backend, device), device, None, [],
                                  params[start:start + n], anchors[start:start + n],
                                  importances[start:start + n], meta_lrs[mstart:mstart + m],
                                  steps, hyper, prox=prox, importance=IMPORTANCE_KINDS[importance],
                                  lr_mode=LR_MODES[lr_mode]))
                grads.append(gs[start:start + n])
                counters[device] = c
                start, mstart = start + n, mstart + m
        return plans, grads, counters


# [note: compiled hyper-parameters] A compiled step runs ``_init_group`` (and with it the
# per-step key and ``refresh_hyper``) only when Dynamo traces; a call of the compiled graph
# runs neither. So the graph must not read a plan's ``hyper`` tensor, whose values are written
# by that eager code: it makes ``hyper`` from the group's values, which Dynamo then tracks. A
# 0-d tensor (a capturable group's views of its storage, or any tensor given by the user) is
# an input of the graph, read at every call, changed in place or rebound; a number is a
# constant guarded by value (or a symbolic input once Dynamo makes floats dynamic), so a new
# number recompiles or is read at the call. The group must be read here, not asked whether it
# is capturable: Dynamo's view of every param group says ``capturable=True``
# (torch/_dynamo/variables/optimizer.py, ``_set_capturable``), whatever the group holds.
# Values changed between compiled calls are not validated (as for an in-place change).
# ``_init_group`` must not rebind a group's values either (a capturable group's number made a
# view of its storage): Dynamo has read the group before ``_init_group`` runs, and a trace that
# restarts would then read other values than its first attempt (SpeculationLogDivergence);
# ``Runtime.tracing`` keeps the group as the user left it while Dynamo traces.
def _traced_hyper(values: dict, device: torch.device) -> Tensor:
    """``hyper`` made in a traced graph from a group's values (:func:`group_values`,
    [note: compiled hyper-parameters])."""
    parts = []
    for name in HYPER_FIELDS:
        v = _hyper_entry(values, name)
        if isinstance(v, Tensor):
            parts.append(v.detach().reshape(()).to(device=device, dtype=torch.float64))
        else:
            parts.append(torch.ones((), dtype=torch.float64, device=device) * v)
    return torch.stack(parts)


def check_run_layout(where: str, p: Tensor, runs: Optional[int]) -> None:
    """A parameter of an array group (``runs`` declared, None for a plain group): its runs
    stacked along its first dimension, which is the outermost in memory ([note: runs] in
    emcl_kernels.interface)."""
    if runs is None:
        return
    if p.dim() == 0 or p.shape[0] != runs:
        raise ValueError(f"{where} has shape {tuple(p.shape)}, but its group has runs={runs}: "
                         f"every parameter of an array group stacks its runs along its first "
                         f"dimension ([{runs}, ...])")
    per_run = p.numel() // runs
    if per_run > 1 and p.stride(0) != per_run:
        raise ValueError(f"{where} has strides {p.stride()}: the runs of an array group must "
                         f"be the outermost dimension in memory (stride {per_run} along the "
                         "first dimension); make it contiguous")


def check_parameter(state, where: str, p: Tensor, runs: Optional[int] = None) -> None:
    """A parameter with a gradient, and its state if it has one, as a step needs them."""
    check_param(where, p)
    check_run_layout(where, p, runs)
    runs = runs or 1
    check_like(f"the gradient of {where}", where, p.grad, p, p.dtype, state=False)
    st = state.get(p)
    if not st:
        return
    want = state_dtype(p.dtype)
    for key in _STATE_TENSORS:
        t = st.get(key)
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"the {key} state of {where} is a {type(t).__name__}, not a tensor")
        if t.dtype != want:
            raise RuntimeError(
                f"{where} is {p.dtype} but its {key} state is {t.dtype}: the parameter "
                f"changed dtype after its state was made (model.double()/.half()?); "
                "convert the model before the first step, or save the optimizer's state, "
                "make a new optimizer for the converted model and load the state into it")
        if t.device != p.device:
            raise RuntimeError(
                f"{where} is on {p.device} but its {key} state is on {t.device}: the "
                "model moved after its state was made (model.to(...)?); move the model "
                "before the first step, or save the optimizer's state and load it into a "
                "new optimizer (load_state_dict puts the state where the parameters are)")
        if t.shape != p.shape:
            raise RuntimeError(
                f"{where} has shape {tuple(p.shape)} but its {key} state has "
                f"{tuple(t.shape)}: the parameter was replaced or resized after its state "
                "was made (param.data = ...?); a parameter keeps its shape for the life of "
                "its state (reset it with del opt.state[param])")
    step = st.get("step")
    if isinstance(step, Tensor) and step.numel() != runs:
        raise RuntimeError(
            f"{where} has {step.numel()} meta-step count(s) in its state but its group has "
            f"{'runs=' + str(runs) if runs > 1 else 'no runs'}: the state was made for another "
            "group (reset it with del opt.state[param])")


def follow_layout(state, p: Tensor) -> None:
    """A parameter whose memory format changed after its state was made (channels_last):
    its state tensors follow it (checked by :func:`check_parameter`)."""
    st = state.get(p)
    if not st:
        return
    for key in _STATE_TENSORS:
        t = st.get(key)
        if t is not None and not same_layout(local(t), local(p)):
            st[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)


def init_state(state, p: Tensor, group: dict, recurrent: bool, hp: Optional[dict] = None):
    """A parameter's state at its first step: θ₀ = θ, h = 0, step 0 (one per run in an array),
    and α = α₀ (each run's) when ``recurrent``. Returns whether the state was made here (not
    loaded or made before)."""
    st = state[p]
    made = not st
    runs = group_runs(group, "param group")
    if made:
        st["anchor"] = torch.empty_like(p, dtype=state_dtype(p.dtype)).copy_(p.detach())
        st["importance"] = torch.zeros_like(st["anchor"])
        st["step"] = torch.zeros((runs,) if runs > 1 else (), dtype=torch.float32,
                                 device=local(p).device)
    if recurrent and "meta_lr" not in st:
        meta_lr = group["meta_lr"]
        st["meta_lr"] = torch.empty_like(st["anchor"])
        if is_per_run(meta_lr):
            for r in range(runs):
                v = run_value(meta_lr, r)
                st["meta_lr"][r].copy_(v) if isinstance(v, Tensor) else st["meta_lr"][r].fill_(v)
        elif isinstance(meta_lr, Tensor):
            st["meta_lr"].copy_(meta_lr)
        else:
            st["meta_lr"].fill_(float(meta_lr))
    return made
