"""Everything EMCL refuses, in one place (SPEC section 4): hyper-parameter domains, tensor lists,
layouts and aliasing. Each check raises a ``TypeError``/``ValueError``/``RuntimeError`` that says
what is wrong in the user's terms, before any tensor is written.

``functional`` runs these checks on every call; the optimizer runs them when its configuration
changes (a new group, a first gradient, a loaded state) and then trusts its plan.

[note: domains] Every numeric hyper-parameter is a real number (or a 0-d floating tensor) that
fp32 can hold: finite, in [0, FLT_MAX] (``lr_max`` may also be +inf), ``decay`` <= 1, ``eps`` at
least the smallest normal fp32 number (a subnormal ε flushes to 0 on some hardware and then
α₀·r/(h + ε) is inf for a dead unit), ``lr_min <= lr_max``. The scalars the kernels form from
them must stay finite in fp32 too: γ·λ, β·λ, α₀·λ, α₀·r, α₀·r·λ and α₀·r/ε (the largest
inverse-mode rate), with r = 1/λ when ``lr_scale`` is None. Within these bounds no scalar a
kernel computes overflows; the per-element math keeps its intermediates in range as well (see
``emcl_kernels.reference``: the prox update never forms c·θ₀, α·h is formed before λ, and the
clip of α stops at the largest finite value).
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Optional

import torch
from torch import Tensor

from emcl_kernels.integration import capturing, is_dtensor, local
from emcl_kernels.interface import resolve_lr_scale

__all__ = ["FLT_MAX", "FLT_TINY", "PARAM_DTYPES", "LR_MODES", "IMPORTANCE_KINDS",
           "INNER_KEYS", "META_KEYS", "NUMERIC_KEYS", "GROUP_NAMES", "OPTIMIZER_WIDE",
           "check_hyperparameters", "check_group_options", "group_spelling", "check_flag",
           "check_param", "check_tensor", "check_like", "check_no_overlap", "plainly_valid", "same_layout", "is_dense",
           "state_dtype"]

FLT_MAX = float(torch.finfo(torch.float32).max)
FLT_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal fp32 number
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LR_MODES = ("recurrent", "inverse", "constant")
IMPORTANCE_KINDS = ("taylor", "si")
INNER_KEYS = ("inner_lr", "reg", "gamma", "prox")
META_KEYS = ("meta_lr", "reg", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max", "eps",
             "importance")
NUMERIC_KEYS = ("inner_lr", "meta_lr", "reg", "gamma", "decay", "lr_scale", "lr_min", "lr_max",
                "eps")

#: The key a param group of the optimizer holds a hyper-parameter under, where it is not the
#: hyper-parameter's own name ([note: group keys] in optimizer.py): β is ``lr``, the key torch's
#: LR schedulers and the training frameworks read and drive; r is ``meta_lr_scale``, because
#: ``lr_scale`` in a param group is timm's per-group multiplier of ``lr``, which its schedulers
#: apply.
GROUP_NAMES = {"inner_lr": "lr", "lr_scale": "meta_lr_scale"}
#: Options of the whole optimizer; a param group that sets one is refused (nothing would read it).
OPTIMIZER_WIDE = ("meta_every", "check_finite", "backend")

# name -> (low, high, low_open, allow_inf); "lr" is how a param group spells inner_lr
_DOMAINS = {
    "inner_lr": (0.0, FLT_MAX, False, False),
    "lr": (0.0, FLT_MAX, False, False),
    "meta_lr_scale": (0.0, FLT_MAX, False, False),
    "meta_lr": (0.0, FLT_MAX, False, False),
    "reg": (0.0, FLT_MAX, False, False),
    "gamma": (0.0, FLT_MAX, False, False),
    "lr_scale": (0.0, FLT_MAX, False, False),
    "lr_min": (0.0, FLT_MAX, False, False),
    "lr_max": (0.0, FLT_MAX, False, True),
    "decay": (0.0, 1.0, False, False),
    "eps": (FLT_TINY, FLT_MAX, False, False),
}


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math is done in and the state is kept in, for parameters of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Hyper-parameters
# ---------------------------------------------------------------------------------------------

# how a message names a hyper-parameter whose key alone would not say which rate it is
_SHOWN = {"lr": "lr (β, the inner learning rate)",
          "meta_lr_scale": "meta_lr_scale (r, the constructor's lr_scale)"}


def _range_error(name: str, value, low, high) -> ValueError:
    what = {"eps": " (at least the smallest normal float32 number)",
            "decay": ""}.get(name, " (and at most the largest float32 number)")
    return ValueError(f"{name} must be in [{low:g}, {high:g}]{what}, got {value}")


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _number(name: str, value):
    """One numeric hyper-parameter: a float, or the 0-d tensor itself (checked by value unless
    reading it would need a host sync inside torch.compile or a CUDA graph capture)."""
    low, high, _, allow_inf = _DOMAINS[name]
    name = _SHOWN.get(name, name)
    if isinstance(value, Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise TypeError(f"{name} given as a tensor must be a 0-d floating-point tensor (a "
                            f"scalar), got shape {tuple(value.shape)} dtype {value.dtype}")
        if value.requires_grad:
            raise ValueError(f"{name} must not require grad")
        if is_dtensor(value):
            raise TypeError(f"{name} must be a plain tensor, not a DTensor")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a meta-device tensor: it holds no value")
        if capturing():
            return value
        v = float(value.item())
    elif torch.compiler.is_compiling() and isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value  # a comparison would specialize it (recompile per value): checked eagerly
    elif isinstance(value, bool) or _is_numpy_bool(value) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    else:
        v = float(value)
    if math.isnan(v) or (math.isinf(v) and not (allow_inf and v > 0)):
        raise ValueError(f"{name} must be finite{' or +inf' if allow_inf else ''}, got {v}")
    if v < low or (v > high and not math.isinf(v)):
        raise _range_error(name, v, low, high)
    return value if isinstance(value, Tensor) else v


def _choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _flag_value(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")


def _value(v) -> Optional[float]:
    """A checked numeric value as a float, or None when it cannot be read here."""
    if isinstance(v, Tensor):
        return None if capturing() else float(v.item())
    if isinstance(v, (float, int)):
        return float(v)
    return None  # a symbol under torch.compile


def _check_products(out: dict) -> None:
    """[note: domains]: the scalars the kernels form stay finite in fp32."""
    v = {k: _value(out[k]) for k in _DOMAINS if k in out and out[k] is not None}
    if any(x is None for x in v.values()):
        return
    if "lr_min" in v and "lr_max" in v and v["lr_max"] < v["lr_min"]:
        raise ValueError(f"lr_max ({v['lr_max']:g}) must be >= lr_min ({v['lr_min']:g})")
    reg = v.get("reg")
    scale_key = "meta_lr_scale" if "meta_lr_scale" in out else "lr_scale"
    scale = v.get(scale_key)
    if reg is not None and scale_key in out and scale is None:
        scale = resolve_lr_scale(None, reg)
    products = []
    if reg is not None:
        if "gamma" in v:
            products.append(("gamma * reg", v["gamma"] * reg))
        for beta in ("inner_lr", "lr"):
            if beta in v:
                products.append((f"{beta} * reg", v[beta] * reg))
        if "meta_lr" in v:
            products.append(("meta_lr * reg", v["meta_lr"] * reg))
    if "meta_lr" in v and scale is not None:
        base = v["meta_lr"] * scale
        products.append(("meta_lr * lr_scale", base))
        if reg is not None:
            products.append(("meta_lr * lr_scale * reg", base * reg))
        if "eps" in v:
            products.append(("meta_lr * lr_scale / eps (the largest inverse-mode rate)",
                             base / v["eps"]))
    for what, x in products:
        if not x <= FLT_MAX:
            raise ValueError(f"{what} = {x:g} is past the largest float32 number, so the "
                             "update would overflow; use smaller hyper-parameters")


# Sets of plain hyper-parameter values already checked (an optimizer passes the same ones every
# step): key -> the normalized dict. The key holds each value's type, because 1 == 1.0 == True.
_CHECKED: dict = {}
_PLAIN = (float, int, str, bool, type(None))


def check_hyperparameters(**hp) -> dict:
    """Check the given hyper-parameters against their domains ([note: domains]) and return them
    normalized (floats, validated strings and bools; 0-d tensors as they are). Raises
    ``TypeError``/``ValueError`` naming the bad one. A set of plain values that passed once is
    remembered (one dict lookup on later calls)."""
    key = None
    if all(type(v) in _PLAIN for v in hp.values()):
        key = tuple((k, type(v), v) for k, v in hp.items())
        done = _CHECKED.get(key)
        if done is not None:
            return dict(done)
    out = {}
    for name, value in hp.items():
        if name in _DOMAINS:
            if name in ("lr_scale", "meta_lr_scale") and value is None:
                out[name] = None  # the default: 1 / reg
            else:
                out[name] = _number(name, value)
        elif name == "lr_mode":
            out[name] = _choice(name, value, LR_MODES)
        elif name == "importance":
            out[name] = _choice(name, value, IMPORTANCE_KINDS)
        elif name == "prox":
            out[name] = _flag_value(name, value)
        else:
            raise TypeError(f"unknown hyper-parameter {name!r}")
    _check_products(out)
    if key is not None and not torch.compiler.is_compiling():
        if len(_CHECKED) >= 1024:  # hyper-parameters swept every step: keep it bounded
            _CHECKED.clear()
        _CHECKED[key] = dict(out)
    return out


def check_numbers(hp: dict, changed: dict) -> dict:
    """``hp`` (what :func:`check_hyperparameters` returned) with the numbers in ``changed``
    (the same keys; floats or ints) replaced: each new one checked against its domain and,
    with the others, the products ([note: domains]). Raises as :func:`check_hyperparameters`
    does, naming the bad one; what an LR schedule's step costs to check."""
    out = dict(hp)
    for name, value in changed.items():
        out[name] = _number(name, value)
    _check_products(out)
    return out


def group_spelling(group: dict, where: str) -> dict:
    """A param group as the user gave it, with β under ``lr``: ``inner_lr`` (the paper's name,
    and this package's keyword before param groups spoke torch's ``lr``) is taken as ``lr``; both
    with different values is refused. The group itself is not changed."""
    if "inner_lr" not in group:
        return group
    out = {k: v for k, v in group.items() if k != "inner_lr"}
    beta = group["inner_lr"]
    if "lr" in group and group["lr"] is not beta and not (
            not isinstance(beta, Tensor) and not isinstance(group["lr"], Tensor)
            and group["lr"] == beta):
        raise ValueError(f"{where} gives both lr={group['lr']!r} and inner_lr={beta!r}: they "
                         "are the same rate (β, the inner learning rate); give one of them")
    out["lr"] = beta
    return out


def check_group_options(group: dict, where: str) -> None:
    """The keys of a param group that are not hyper-parameters: the optimizer-wide options
    (refused in a group), ``inner_lr`` once the group exists (its rate is ``lr``), and
    ``weight_decay`` (accepted when 0, refused otherwise, with the reason)."""
    for name in OPTIMIZER_WIDE:
        if name in group:
            raise ValueError(
                f"{where} sets {name}={group[name]!r}, but {name} is an option of the whole "
                f"optimizer, not of a param group (one step serves every group): pass it to "
                f"FusedEMCLOptimizer(..., {name}=...) and remove it from the group")
    if "inner_lr" in group:
        raise ValueError(
            f"{where} holds 'inner_lr' = {group['inner_lr']!r}: a param group holds β, the inner "
            "learning rate, under 'lr' (the key LR schedulers drive), so this value would be "
            "ignored; set group['lr'] and delete group['inner_lr']")
    wd = group.get("weight_decay", 0.0)
    if isinstance(wd, Tensor):
        wd = None if capturing() or wd.numel() != 1 else float(wd.item())
    if wd is not None and (isinstance(wd, bool) or not isinstance(wd, Real) or float(wd) != 0.0):
        raise ValueError(
            f"{where} has weight_decay={group['weight_decay']!r}: FusedEMCLOptimizer applies no "
            "weight decay. EMCL's regulariser is the importance-weighted pull of every weight "
            "towards its anchor θ₀ (reg, gamma), and the meta step moves the anchor by what the "
            "inner steps learnt; a decoupled decay would be a third force that the paper does not "
            "have and no measurement here supports, so it is refused rather than silently "
            "ignored. Pass weight_decay=0 (HF TrainingArguments and timm's factory default to 0) "
            "or regularise through reg (docs/integration.md)")


def check_flag(name: str, t) -> None:
    """``grad_scale`` / ``found_inf``: None or a one-element floating-point tensor."""
    if t is None:
        return
    if not isinstance(t, Tensor) or t.numel() != 1 or not t.is_floating_point():
        raise TypeError(f"{name} must be None or a one-element floating-point tensor")
    if is_dtensor(t):
        raise TypeError(f"{name} must be a plain tensor, not a DTensor")


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------

def is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` consecutive elements of memory in some order
    (contiguous, channels_last, any permutation of a contiguous tensor): what an elementwise
    kernel that walks the memory needs."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one shape put their elements in the same memory order (strides
    equal wherever a dimension has more than one element)."""
    sa, sb = a.stride(), b.stride()
    return sa == sb or all(x == y for x, y, n in zip(sa, sb, a.shape) if n > 1)


def check_param(where: str, p) -> None:
    """A parameter EMCL can update: a floating-point, dense tensor with data."""
    if not isinstance(p, Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(p).__name__}")
    if p.dtype not in PARAM_DTYPES:
        raise TypeError(f"{where} has dtype {p.dtype}; EMCL updates floating-point parameters "
                        f"({', '.join(str(d).replace('torch.', '') for d in PARAM_DTYPES)})")
    if p.layout != torch.strided:
        raise RuntimeError(f"{where} is a {p.layout} tensor; EMCL updates dense parameters")
    if p.device.type == "meta":
        raise RuntimeError(f"{where} is on the meta device, so it holds no data: materialize "
                           "the model first (e.g. model.to_empty(device=...) and initialize it)")
    if not is_dense(local(p)):
        raise RuntimeError(f"{where} is a strided view with gaps or overlaps (e.g. a slice); "
                           "EMCL updates tensors that cover their memory densely (contiguous "
                           "or channels_last): pass .contiguous() copies")


#: the tensor types whose attributes are torch's own (no subclass that may compute them)
PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def plainly_valid(p, grad, states) -> bool:
    """A quick sufficient test of ``check_param(p)``, ``check_tensor`` of ``grad`` (the
    parameter's dtype) and of each of ``states`` (the state dtype), for the common case: plain
    contiguous tensors with data. False means "run the full checks" (they raise, with a
    message, or pass)."""
    if (type(p) not in PLAIN_TENSORS or p.dtype not in PARAM_DTYPES or p.layout != torch.strided
            or not p.is_contiguous() or p.device.type == "meta"):
        return False
    device, shape, stride, sdt = p.device, p.shape, p.stride(), state_dtype(p.dtype)
    for t, dtype in ((grad, p.dtype), *((t, sdt) for t in states)):
        if (type(t) not in PLAIN_TENSORS or t.dtype != dtype or t.layout != torch.strided
                or t.device != device or t.shape != shape or t.stride() != stride):
            return False
    return True


def check_tensor(role: str, i: int, t, p: Tensor, dtype: torch.dtype) -> None:
    """Tensor ``role[i]`` belongs to ``params[i]``: same shape, strides and device, ``dtype``."""
    check_like(f"{role}[{i}]", f"params[{i}]", t, p, dtype, state=role != "grads")


def check_like(where: str, owner: str, t, p: Tensor, dtype: torch.dtype, *,
               state: bool) -> None:
    """``t`` (named ``where``) goes with the parameter ``p`` (named ``owner``): a dense tensor of
    ``dtype`` with the parameter's shape, device and memory layout. ``state``: ``t`` is
    optimizer state (else a gradient), for the messages."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    if is_dtensor(t) != is_dtensor(p):
        raise TypeError(f"{where} is {'a' if is_dtensor(t) else 'not a'} DTensor but {owner} "
                        f"is {'a' if is_dtensor(p) else 'not a'} DTensor; a sharded "
                        "parameter needs its gradient and state sharded like it")
    if is_dtensor(t) and t.placements != p.placements:
        raise ValueError(f"{where} has placements {t.placements} but {owner} has "
                         f"{p.placements}")
    if t.layout != torch.strided:
        raise RuntimeError(f"{where} is a {t.layout} tensor; EMCL needs dense (strided) "
                           "tensors: sparse gradients are not supported (for nn.Embedding, "
                           "use sparse=False)")
    if t.dtype != dtype:
        why = f" (the state of a {p.dtype} parameter is {dtype})" if state else ""
        raise TypeError(f"{where} has dtype {t.dtype}, expected {dtype}{why}")
    if t.device != p.device:
        raise RuntimeError(f"{where} is on {t.device} but {owner} is on {p.device}")
    if t.shape != p.shape:
        raise ValueError(f"{where} has shape {tuple(t.shape)} but {owner} has shape "
                         f"{tuple(p.shape)}")
    lt, lp = local(t), local(p)
    if not same_layout(lt, lp):
        raise RuntimeError(f"{where} has strides {lt.stride()} but {owner} has "
                           f"{lp.stride()}: it must have the parameter's memory layout ("
                           + ("e.g. torch.empty_like(param))" if state else
                              "autograd makes gradients so; a gradient set by hand must "
                              "follow the parameter's memory format)"))


def check_no_overlap(named) -> None:
    """``named``: (name, tensor) pairs; a name may be a (role, index) pair, formatted
    ``role[index]`` only for the message. Raises a ``ValueError`` naming two tensors whose memory
    overlaps: one tensor in two roles (a param passed as its anchor), the same tensor twice, or
    overlapping views of one storage. Empty tensors hold no memory and are skipped."""
    spans = []
    for order, (name, t) in enumerate(named):
        if t is None:
            continue
        lt = local(t)
        numel, device = lt.numel(), lt.device
        if numel == 0 or device.type == "meta":
            continue
        start = lt.data_ptr()
        spans.append(((device.type, device.index), start, start + numel * lt.element_size(),
                      order, name))
    spans.sort()
    last = None
    for span in spans:
        if last is not None and span[0] == last[0] and span[1] < last[2]:
            same = span[1] == last[1] and span[2] == last[2]
            first, second = sorted((last, span), key=lambda x: x[3])  # in the order given
            raise ValueError(
                f"{_name(first[4])} and {_name(second[4])} "
                f"{'are the same memory' if same else 'overlap in memory'}; every tensor of a "
                "step must be its own memory (a tensor may not play two roles, or appear "
                "twice, and views of one storage may not overlap)")
        if last is None or span[0] != last[0] or span[2] > last[2]:
            last = span


def _name(name) -> str:
    return name if isinstance(name, str) else f"{name[0]}[{name[1]}]"

