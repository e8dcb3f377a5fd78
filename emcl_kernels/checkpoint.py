"""What ``FusedEMCLOptimizer.load_state_dict`` accepts: a state saved by ``state_dict()`` for the
same parameters, with values a step can continue from. Everything is checked before the
optimizer changes (SPEC section 4); each refusal names the entry and says what is wrong."""
from __future__ import annotations

import math
import warnings
from numbers import Integral, Real

import torch

from emcl_kernels.runs import group_runs
from torch import Tensor

from emcl_kernels.validation import OPTIMIZER_WIDE, group_spelling

__all__ = ["check_state_dict"]

_STATE_KEYS = ("anchor", "importance", "meta_lr", "step")


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"the state's emcl[{name!r}] must be a whole number >= 0, got "
                         f"{type(value).__name__} {value!r}")
    return int(value)


def _extra(state_dict: dict) -> dict:
    extra = state_dict.get("emcl", {})
    if not isinstance(extra, dict):
        raise ValueError("the state's 'emcl' entry must be a dict (step_calls, skipped_steps, "
                         f"param_shapes), got {type(extra).__name__} {extra!r}")
    out = {"step_calls": _count("step_calls", extra.get("step_calls", 0)),
           "skipped_steps": _count("skipped_steps", extra.get("skipped_steps", 0))}
    runs = extra.get("skipped_runs")
    if runs is not None and (not isinstance(runs, (list, tuple))
                             or any(isinstance(v, bool) or not isinstance(v, Integral) or v < 0
                                    for v in runs)):
        raise ValueError("the state's emcl['skipped_runs'] must be a list of whole numbers "
                         f">= 0 (each run's skipped steps), got {runs!r}")
    out["skipped_runs"] = None if runs is None else [int(v) for v in runs]
    shapes = extra.get("param_shapes", [])
    if not isinstance(shapes, (list, tuple)) or not all(isinstance(s, (list, tuple))
                                                         for s in shapes):
        raise ValueError("the state's emcl['param_shapes'] must be a list of lists of shapes")
    out["param_shapes"] = shapes
    return out


def _step_value(pid, value, runs: int = 1) -> None:
    """A saved meta-step count: one number, or one per run for a parameter of an array group."""
    if isinstance(value, Tensor):
        if value.numel() != runs or value.is_complex() or (runs > 1 and value.dim() != 1):
            want = "one number (a 0-d tensor)" if runs == 1 else \
                f"one number per run (a tensor of {runs})"
            raise ValueError(f"state 'step' of parameter {pid} must be {want}, got shape "
                             f"{tuple(value.shape)}")
        if value.device.type == "meta":
            raise ValueError(f"state 'step' of parameter {pid} is a meta tensor without a value")
        values = [float(v) for v in value.reshape(-1).tolist()]
    elif isinstance(value, Real) and not isinstance(value, bool) and runs == 1:
        values = [float(value)]
    else:
        raise ValueError(f"state 'step' of parameter {pid} must be a number, got "
                         f"{type(value).__name__}")
    for v in values:
        if not (math.isfinite(v) and v >= 0 and v == int(v)):
            raise ValueError(f"state 'step' of parameter {pid} counts meta steps: a whole "
                             f"number >= 0, got {v}")


def _tensor_value(pid, key: str, t, p: Tensor) -> None:
    if not (isinstance(t, Tensor) and t.is_floating_point()):
        raise ValueError(f"state {key!r} of parameter {pid} must be a floating-point tensor, "
                         f"got {type(t).__name__}{'' if not isinstance(t, Tensor) else ' ' + str(t.dtype)}")
    if t.layout != torch.strided or t.device.type == "meta":
        raise ValueError(f"state {key!r} of parameter {pid} must be a dense tensor with data")
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"state {key!r} of parameter {pid} has shape {tuple(t.shape)} but the "
                         f"parameter has {tuple(p.shape)}: was it saved for another model or "
                         "another parameter order?")
    if t.numel() == 0:
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"state {key!r} of parameter {pid} holds an inf or a NaN: the "
                         "checkpoint is corrupt (or was saved after a diverged step)")
    if key != "anchor" and bool((t < 0).any()):
        raise ValueError(f"state {key!r} of parameter {pid} holds negative values; "
                         f"{'importances' if key == 'importance' else 'meta learning rates'} "
                         "are >= 0")


def _saved_group(saved: dict, where: str) -> dict:
    """A saved param group as a group of today's optimizer: β under ``lr``, r under
    ``meta_lr_scale`` (a state saved before had them under ``inner_lr`` and ``lr_scale``), and
    without the
    optimizer-wide options that a group was once allowed to hold and nothing read (dropped with
    a warning: the optimizer's own setting is the one that always applied)."""
    group = group_spelling(saved, where)
    if "lr_scale" in group and "meta_lr_scale" not in group:  # saved before groups said meta_lr_scale
        group = {("meta_lr_scale" if k == "lr_scale" else k): v for k, v in group.items()}
    wide = [k for k in OPTIMIZER_WIDE if k in group]
    if wide:
        warnings.warn(f"{where} holds {', '.join(wide)}: an option of the whole optimizer, "
                      "which a param group cannot set (it never applied per group); the "
                      "optimizer's own setting applies, as it did when the state was saved",
                      stacklevel=3)
        group = {k: v for k, v in group.items() if k not in wide}
    return group


def check_state_dict(opt, state_dict) -> tuple:
    """Check ``state_dict`` against ``opt`` and return ``(saved_state, extra, id_to_param,
    saved_groups)``: the per-parameter state by saved id, the checked ``"emcl"`` entry, which
    parameter of ``opt`` each saved id is, and the saved param groups with β under ``lr``
    (a state saved before groups spoke torch's ``lr`` has it under ``inner_lr``). An entry of
    the state whose key is not a parameter id (an int) is not a parameter's state: it is left
    out of ``saved_state`` and loaded as it is, as torch does."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
    extra = _extra(state_dict)
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), (list, tuple))
            for g in saved_groups):
        raise ValueError("the state's 'param_groups' must be a list of dicts with 'params'")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the state has {len(saved_groups)} param groups, "
                         f"this optimizer has {len(opt.param_groups)}")
    saved_groups = [_saved_group(saved, f"param group {i} of the state")
                    for i, saved in enumerate(saved_groups)]
    for i, saved in enumerate(saved_groups):
        opt._check_group(saved, f"param group {i} of the state")
    id_to_param, id_to_runs = {}, {}
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("a param group of the state has "
                             f"{len(saved['params'])} parameters, this optimizer's has "
                             f"{len(group['params'])}")
        runs = group_runs(saved, f"param group {gi} of the state")
        if runs != group_runs(group, f"param group {gi}"):
            raise ValueError(f"param group {gi} of the state has runs={saved.get('runs')!r} "
                             f"but this optimizer's has runs={group.get('runs')!r}")
        id_to_param.update(zip(saved["params"], group["params"]))
        id_to_runs.update((pid, runs) for pid in saved["params"])
    for gi, (shapes, group) in enumerate(zip(extra["param_shapes"], opt.param_groups)):
        for pi, (shape, p) in enumerate(zip(shapes, group["params"])):
            if tuple(shape) != tuple(p.shape):
                raise ValueError(f"parameter {pi} of param group {gi} has shape "
                                 f"{tuple(p.shape)} but had {tuple(shape)} when the state "
                                 "was saved: was it saved for another model or another "
                                 "parameter order?")
    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
        raise ValueError("the state's 'state' entry must be a dict of per-parameter states")
    saved_state = {pid: st for pid, st in saved_state.items()
                   if isinstance(pid, Integral) and not isinstance(pid, bool)}
    for pid, st in saved_state.items():
        p = id_to_param.get(pid)
        if p is None:
            raise ValueError(f"the state names parameter id {pid}, which no group holds")
        if not isinstance(st, dict):
            raise ValueError(f"the state of parameter {pid} must be a dict, got "
                             f"{type(st).__name__}")
        unknown = sorted(map(str, set(st) - set(_STATE_KEYS)))
        missing = [k for k in ("anchor", "importance", "step") if k not in st]
        if unknown or missing:
            raise ValueError(f"the state of parameter {pid} has keys {sorted(map(str, st))}; "
                             f"EMCL keeps {', '.join(_STATE_KEYS)} (all but meta_lr always): "
                             "was it saved by another optimizer?")
        _step_value(pid, st["step"], id_to_runs.get(pid, 1))
        for key in ("anchor", "importance", "meta_lr"):
            if key in st:
                _tensor_value(pid, key, st[key], p)
    return saved_state, extra, id_to_param, saved_groups
