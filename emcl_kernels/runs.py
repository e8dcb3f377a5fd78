"""Arrays of runs: one param group that holds N runs of one model (SPEC section 3).

A param group with ``runs=N`` holds parameters whose leading dimension is N, run-major in memory
(slice ``i`` of every parameter is run ``i``'s), and may give any numeric hyper-parameter per
run. One kernel launch per (device, dtype) still serves the whole group: the kernels read run
``i``'s row of the group's hyper-parameter table for run ``i``'s elements ([note: runs] in
:mod:`emcl_kernels.interface`).

A per-run value is given as a sequence (list, tuple, NumPy array) of N numbers, which the group
keeps as a :class:`PerRun`, or as a 1-d floating tensor of N values (read at every step, like
a 0-d tensor hyper-parameter; a capturable group's values are views of one device table). A
scalar still means every run.

:class:`PerRun` is an immutable tuple of floats with elementwise arithmetic with numbers, so
that torch's LR schedulers, which compute ``base_lr * factor`` or ``group["lr"] * gamma``,
scale every run's rate (docs/integration.md lists which schedulers work). Changing one run's
value (population-based training) is ``group["lr"] = group["lr"].replace(i, value)``: the next
step checks the new numbers and writes them into the table, without rebuilding anything.
"""
from __future__ import annotations

import operator
from numbers import Real
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["PerRun", "group_runs", "per_run_values", "run_value", "is_per_run",
           "normalize_runs", "declared_runs", "NUMERIC_GROUP_KEYS"]

#: The numeric hyper-parameters of a param group, as the group spells them: each may be per run.
NUMERIC_GROUP_KEYS = ("lr", "meta_lr", "reg", "gamma", "decay", "meta_lr_scale", "lr_min",
                      "lr_max", "eps")


class PerRun(tuple):
    """One hyper-parameter's values for the N runs of an array group: an immutable tuple of
    floats. Arithmetic with a number (``*``, ``/``, ``+``, ``-``, ``**``) applies to every run and
    gives a new :class:`PerRun`; ``replace(i, v)`` gives a copy with run ``i``'s value ``v``."""

    __slots__ = ()

    def __new__(cls, values: Sequence):
        out = []
        for v in values:
            if isinstance(v, Tensor):
                if v.numel() != 1:
                    raise TypeError("a per-run value must be a number, got a tensor of "
                                    f"shape {tuple(v.shape)}")
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, Real):
                raise TypeError(f"a per-run value must be a real number, got "
                                f"{type(v).__name__} {v!r}")
            out.append(float(v))
        return super().__new__(cls, out)

    def replace(self, index: int, value) -> "PerRun":
        """A copy with run ``index``'s value set to ``value``."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"run {index} is out of range for {len(self)} runs")
        values = list(self)
        values[index] = value
        return PerRun(values)

    def _map(self, other, op, reflected: bool = False):
        if isinstance(other, PerRun):
            if len(other) != len(self):
                raise ValueError(f"per-run values of {len(self)} and {len(other)} runs")
            pairs = zip(other, self) if reflected else zip(self, other)
            return PerRun([op(a, b) for a, b in pairs])
        if isinstance(other, bool) or not isinstance(other, Real):
            return NotImplemented
        return PerRun([op(other, a) if reflected else op(a, other) for a in self])

    def __mul__(self, other):
        return self._map(other, operator.mul)

    def __rmul__(self, other):
        return self._map(other, operator.mul, True)

    def __truediv__(self, other):
        return self._map(other, operator.truediv)

    def __rtruediv__(self, other):
        return self._map(other, operator.truediv, True)

    def __add__(self, other):
        return self._map(other, operator.add)

    def __radd__(self, other):
        return self._map(other, operator.add, True)

    def __sub__(self, other):
        return self._map(other, operator.sub)

    def __rsub__(self, other):
        return self._map(other, operator.sub, True)

    def __pow__(self, other):
        return self._map(other, operator.pow)

    def __neg__(self):
        return PerRun([-a for a in self])

    def __lt__(self, other):
        raise TypeError("per-run values have no order: compare one run's value (values[i]); "
                        "a scheduler that compares learning rates (ReduceLROnPlateau, "
                        "CyclicLR, OneCycleLR) cannot drive an array group")

    __le__ = __gt__ = __ge__ = __lt__

    def __float__(self):
        raise TypeError("per-run values are not one number: read one run's (values[i]); "
                        "ReduceLROnPlateau, which reads a group's lr as one float, cannot drive "
                        "an array group (schedulers that scale lr, e.g. LambdaLR, StepLR, "
                        "CosineAnnealingLR, scale every run's: docs/integration.md)")

    def __repr__(self) -> str:
        return f"PerRun({list(self)!r})"

    def __reduce__(self):
        return (PerRun, (list(self),))

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


def is_per_run(value) -> bool:
    """Whether a group value is given per run (a :class:`PerRun` or a 1-d tensor)."""
    return isinstance(value, PerRun) or (isinstance(value, Tensor) and value.dim() == 1)


def group_runs(group: dict, where: str) -> int:
    """The number of runs a param group declares (``runs``; 1 when absent or None)."""
    runs = group.get("runs")
    if runs is None:
        return 1
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"{where} has runs={runs!r}: runs must be a positive int (the number "
                         "of runs whose parameters the group stacks along their first dimension)")
    return runs


def declared_runs(group: dict, where: str):
    """The ``runs`` a param group declares, or None (a group of one run, not an array)."""
    return None if group.get("runs") is None else group_runs(group, where)


def per_run_values(name: str, value, runs: int, where: str, declared: bool = None):
    """A group's value of ``name`` as the group keeps it: a number or 0-d tensor as it is, a
    sequence of ``runs`` numbers as a :class:`PerRun`, a 1-d tensor of ``runs`` values as it is.
    Refused: a sequence or tensor of another length, or any per-run value in a group without
    runs (``declared``: the group says ``runs``, which may be 1: an array of one run)."""
    declared = runs > 1 if declared is None else declared
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return value
        if value.dim() != 1 or value.numel() != runs or not declared:
            raise _length_error(name, tuple(value.shape), runs if declared else None, where)
        if not value.is_floating_point():
            raise TypeError(f"{where}: {name} given per run must be a floating-point tensor, "
                            f"got {value.dtype}")
        return value
    if isinstance(value, (str, bytes)) or value is None or isinstance(value, Real):
        return value
    if hasattr(value, "__len__") and hasattr(value, "__iter__"):
        if not declared or len(value) != runs:
            raise _length_error(name, (len(value),), runs if declared else None, where)
        return value if isinstance(value, PerRun) else PerRun(list(value))
    return value


def _length_error(name: str, shape: tuple, runs: int, where: str) -> Exception:
    if runs is None:  # not a number where a number belongs
        return TypeError(f"{where}: {name} must be a number or a 0-d floating-point tensor (a "
                         f"scalar), got shape {shape}; several values need runs=N in the group "
                         "(every parameter stacked as [N, ...]) and N values")
    return ValueError(f"{where} has runs={runs} but {name} has shape {shape}: give one value "
                      f"per run ({runs}) or a scalar for every run")


def normalize_runs(group: dict, where: str, runs=None) -> dict:
    """A copy of a param group with its per-run values as the group keeps them
    (:func:`per_run_values`: sequences become :class:`PerRun`); ``runs``: the group's number of
    runs when the group itself may not say it (the optimizer's default)."""
    runs = group_runs(group, where) if runs is None else runs
    declared = runs > 1 or group.get("runs") is not None
    out = dict(group)
    for k in NUMERIC_GROUP_KEYS:
        if k in out:
            out[k] = per_run_values(k, out[k], runs, where, declared)
    return out


def run_value(value, r: int):
    """Run ``r``'s value of a checked group value (a number, a 0-d tensor, a :class:`PerRun` or
    a 1-d tensor)."""
    if isinstance(value, PerRun):
        return value[r]
    if isinstance(value, Tensor) and value.dim() == 1:
        return value[r]
    return value


def values_table(values: Sequence, runs: int) -> Tensor:
    """A [runs, len(values)] fp64 tensor of per-run or scalar values (numbers or tensors)."""
    cols = []
    for v in values:
        if isinstance(v, Tensor):
            cols.append(v.detach().to(dtype=torch.float64, device="cpu").reshape(-1)
                        .expand(runs))
        elif isinstance(v, PerRun):
            cols.append(torch.tensor(list(v), dtype=torch.float64))
        else:
            cols.append(torch.full((runs,), float(v), dtype=torch.float64))
    return torch.stack(cols, dim=1)
