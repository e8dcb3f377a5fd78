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

from typing import Optional, Sequence

import torch
from torch import Tensor

from emcl_kernels.interface import (COUNTER, COUNTER_FIELDS, HYPER_FIELDS, IMPORTANCE,
                                    LR_MODE, LR_SCALE_FROM_REG)

__all__ = ["Plan", "run", "new_counters", "hyper_values", "pack_hyper", "agree_on_found"]

_FOUND, _CALLS = COUNTER["found"], COUNTER["calls"]


def new_counters(device) -> Tensor:
    """A device's step counters (emcl_kernels.interface, ``COUNTER_FIELDS``), all 0."""
    return torch.zeros(len(COUNTER_FIELDS), dtype=torch.int64, device=device)


def hyper_values(hp: dict) -> tuple:
    """The numbers of ``hyper`` in :data:`~emcl_kernels.interface.HYPER_FIELDS` order from a
    dict of checked float hyper-parameters (missing ones are 0, ``lr_max`` +inf, ``eps`` 1e-8;
    ``lr_scale=None`` is the 1/reg sentinel)."""
    defaults = {"lr_max": float("inf"), "eps": 1e-8}
    out = []
    for name in HYPER_FIELDS:
        v = hp.get(name, defaults.get(name, 0.0))
        if name == "lr_scale" and v is None:
            v = LR_SCALE_FROM_REG
        out.append(float(v))
    return tuple(out)


def pack_hyper(hp: dict, device) -> Tensor:
    """``hyper`` for one call on ``device``: numbers are packed on the host and copied once;
    0-d tensors are stacked on the device (no host sync, so it can be captured).

    The numbers travel from pinned memory with a non-blocking copy: from pageable memory,
    ``.to(cuda)`` waits for the copy, and a float learning-rate schedule would then stall the
    host at every step. The pinned buffer is the caching host allocator's, which reuses it
    only after the copy has run."""
    if not any(isinstance(v, Tensor) for v in hp.values()):
        device = torch.device(device)
        if device.type == "cuda":
            host = torch.tensor(hyper_values(hp), dtype=torch.float64, pin_memory=True)
            return host.to(device, non_blocking=True)
        return torch.tensor(hyper_values(hp), dtype=torch.float64, device=device)
    defaults = {"lr_max": float("inf"), "eps": 1e-8, "lr_scale": LR_SCALE_FROM_REG}
    parts = []
    for name in HYPER_FIELDS:
        v = hp.get(name)
        if v is None:
            v = defaults.get(name, 0.0)
        if isinstance(v, Tensor):
            parts.append(v.detach().reshape(()).to(device=device, dtype=torch.float64))
        else:
            parts.append(torch.full((), float(v), dtype=torch.float64, device=device))
    return torch.stack(parts)


class Plan:
    """The tensors and settings of one backend call (see the module docstring).

    ``params`` are the tensors the kernels update (a DTensor's local shard), ``sources`` the
    objects whose ``.grad`` is read each step (the parameters themselves)."""

    __slots__ = ("backend", "device", "dtype", "sources", "params", "anchors", "importances",
                 "meta_lrs", "steps", "hyper", "prox", "importance", "lr_mode", "group",
                 "sharded", "checks_grads")

    def __init__(self, backend, device: torch.device, dtype: torch.dtype, sources: list,
                 params: list, anchors: list, importances: list, meta_lrs: list, steps: Tensor,
                 hyper: Tensor, *, prox: bool, importance: str, lr_mode: str,
                 group: Optional[int] = None, sharded: bool = False):
        self.backend, self.device, self.dtype = backend, device, dtype
        self.sources, self.params = sources, params
        self.anchors, self.importances, self.meta_lrs = anchors, importances, meta_lrs
        self.steps, self.hyper = steps, hyper
        self.prox = bool(prox)
        self.importance = IMPORTANCE[importance]
        self.lr_mode = LR_MODE[lr_mode]
        self.group, self.sharded = group, sharded
        # the compiled backends check each call's gradients themselves (in C++ / the launcher)
        self.checks_grads = bool(getattr(backend, "CHECKS_GRADS", False))

    def call(self, grads: list, counters: Tensor, *, op: int, meta_every: int, check: bool,
             finalize: bool, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        self.backend.step(self.params, grads, self.anchors, self.importances, self.meta_lrs,
                          self.steps, self.hyper, counters, op=op, prox=self.prox,
                          importance=self.importance, lr_mode=self.lr_mode,
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
            plan.backend.check_finite(g, counters[plan.device])
        agree_on_found([counters[d] for d in dict.fromkeys(p.device for p in plans)], mesh)
    last = {plan.device: i for i, plan in enumerate(plans)}
    for i, (plan, g) in enumerate(zip(plans, grads)):
        plan.call(g, counters[plan.device], op=op, meta_every=meta_every, check=False,
                  finalize=last[plan.device] == i, grad_scale=grad_scale, found_inf=found_inf)


def agree_on_found(device_counters: list, mesh) -> None:
    """Make every device's (and every rank's) FOUND flag the maximum of all of them, on the
    devices, without a host sync."""
    if len(device_counters) > 1:
        first = device_counters[0]
        found = first[_FOUND]
        for c in device_counters[1:]:
            found = torch.maximum(found, c[_FOUND].to(first.device))
        for c in device_counters:
            c[_FOUND].copy_(found)
    if mesh is not None:
        import torch.distributed as dist
        for c in device_counters:
            flag = c[_FOUND:_FOUND + 1]
            for dim in range(mesh.ndim):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
