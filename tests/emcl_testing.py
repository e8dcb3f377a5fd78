"""What every backend test shares: random EMCL inputs, the modes of SPEC section 2, and the
comparison against the reference with SPEC section 4's tolerances.

    case = make_case([0, 1, 7, 4097], torch.float32, seed=0)
    check_against_reference("foreach", "meta_step", [7, 4097], torch.bfloat16, MODES[3])
"""
from __future__ import annotations

import copy
import itertools
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from emcl_kernels import functional as F
from emcl_kernels.reference import compute_dtype


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(*folders: str, **extra: str) -> dict:
    """The environment of a child Python process: the repository, ``python/`` and ``folders``
    first on ``PYTHONPATH``, the caller's own ``PYTHONPATH`` after them (the GPU check puts the
    ``mlxtend`` it installs there), and ``extra`` variables."""
    path = [REPO, os.path.join(REPO, "python"), *folders]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}

OPS = ("inner_step", "meta_step", "inner_meta_step")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, 4097)


@dataclass(frozen=True)
class Mode:
    """One point of the mode grid: proximal or not, Taylor or SI importance, an lr_mode."""
    prox: bool
    importance: str
    lr_mode: str

    @property
    def id(self) -> str:
        return f"{'prox' if self.prox else 'grad'}-{self.importance}-{self.lr_mode}"

    def hyper(self, op: str) -> dict:
        """Hyper-parameters for ``op`` under this mode, chosen so that chained steps stay
        well conditioned (alpha * reg * h <= ~0.5) while every term acts."""
        inner = dict(inner_lr=0.05, reg=1.5, gamma=0.3, prox=self.prox)
        meta = dict(meta_lr=0.2, reg=1.5, decay=0.8, lr_mode=self.lr_mode,
                    importance=self.importance, eps=1e-8, lr_min=0.0, lr_max=float("inf"))
        if self.lr_mode == "recurrent":
            meta.update(lr_scale=0.9, lr_min=0.01, lr_max=0.3)
        elif self.lr_mode == "inverse":
            meta.update(lr_scale=0.6, lr_max=50.0)
        else:
            meta.update(lr_scale=1.0)
        if op == "inner_step":
            return inner
        if op == "meta_step":
            return meta
        merged = {**inner, **meta}
        return merged


MODES = tuple(Mode(p, i, m) for p, i, m in itertools.product(
    (True, False), ("taylor", "si"), ("recurrent", "inverse", "constant")))


@dataclass
class Case:
    params: list
    grads: list
    anchors: list
    importances: list
    meta_lrs: list
    generator: torch.Generator = field(repr=False, default=None)

    def tensors(self):
        return {"params": self.params, "anchors": self.anchors,
                "importances": self.importances, "meta_lrs": self.meta_lrs}


def _randn(n, gen, dtype, device):
    return torch.randn(n, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _shape(n: int):
    """A shape with ``n`` elements; some tensors are 2-d like real weights."""
    if n >= 6 and n % 3 == 0:
        return (3, n // 3)
    return (n,)


def make_case(sizes, dtype: torch.dtype, *, seed: int, device="cpu") -> Case:
    """Fresh random EMCL inputs (never zeros) for tensors of the given sizes."""
    gen = torch.Generator().manual_seed(seed)
    sdt = compute_dtype(dtype)
    params, grads, anchors, imps, lrs = [], [], [], [], []
    for n in sizes:
        shape = _shape(n)
        theta = _randn(n, gen, torch.float64, "cpu")
        params.append(theta.to(device=device, dtype=dtype).reshape(shape))
        grads.append(_randn(n, gen, dtype, device).reshape(shape))
        anchors.append((theta + 0.3 * _randn(n, gen, torch.float64, "cpu"))
                       .to(device=device, dtype=sdt).reshape(shape))
        imps.append((0.1 + torch.rand(n, generator=gen, dtype=torch.float64))
                    .to(device=device, dtype=sdt).reshape(shape))
        lrs.append((0.05 + 0.1 * torch.rand(n, generator=gen, dtype=torch.float64))
                   .to(device=device, dtype=sdt).reshape(shape))
    return Case(params, grads, anchors, imps, lrs, gen)


def fresh_grads(case: Case, seed: int) -> list:
    """New random gradients like ``case.grads`` (for the next chained step)."""
    gen = torch.Generator().manual_seed(seed)
    return [_randn(g.numel(), gen, g.dtype, g.device).reshape(g.shape) for g in case.grads]


def clone_case(case: Case, dtype: Optional[torch.dtype] = None, device=None) -> Case:
    """A deep copy; with ``dtype``, params/grads are cast to it and state to its compute dtype."""
    out = copy.copy(case)

    def cast(lst, dt):
        return [t.detach().to(device=device or t.device, dtype=dt or t.dtype, copy=True)
                for t in lst]

    sdt = compute_dtype(dtype) if dtype is not None else None
    out.params = cast(case.params, dtype)
    out.grads = cast(case.grads, dtype)
    out.anchors = cast(case.anchors, sdt)
    out.importances = cast(case.importances, sdt)
    out.meta_lrs = cast(case.meta_lrs, sdt)
    return out


def apply(op: str, backend: str, case: Case, hyper: dict, **flags) -> None:
    """Run ``op`` through ``emcl_kernels.functional`` on ``case``, in place."""
    fn = getattr(F, op + "_")
    lists = [case.params, case.grads, case.anchors, case.importances]
    if op != "inner_step":
        lists.append(case.meta_lrs if hyper.get("lr_mode") == "recurrent" else None)
    fn(*lists, backend=backend, **hyper, **flags)


def tolerance(dtype: torch.dtype):
    """SPEC section 4: fp64 reference vs fp32 (fp64) backend within rtol 1e-5 / atol 1e-6;
    bf16/fp16 parameters within 5e-3 (plus one unit in the last place of the stored value)."""
    if dtype in (torch.float32, torch.float64):
        return 1e-5, 1e-6
    return 5e-3, 5e-3


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    """Compare, and on failure say where: the worst elements with both values."""
    rtol, atol = tolerance(dtype)
    a = actual.detach().double().cpu().reshape(-1)
    e = expected.detach().double().cpu().reshape(-1)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    allowed = atol + rtol * e.abs()
    if actual.dtype in (torch.bfloat16, torch.float16):
        allowed = allowed + e.abs() * torch.finfo(actual.dtype).eps
    err = (a - e).abs()
    bad = ~(err <= allowed)
    if bool(bad.any()):
        idx = bad.nonzero().reshape(-1)[:5].tolist()
        worst = ", ".join(f"[{i}] got {a[i].item():.8g} want {e[i].item():.8g}" for i in idx)
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} elements differ "
                             f"(rtol {rtol}, atol {atol}); first: {worst}")


def assert_case_close(actual: Case, expected: Case, dtype: torch.dtype, what: str,
                      with_meta_lrs: bool = True):
    for name, lst in actual.tensors().items():
        if name == "meta_lrs" and not with_meta_lrs:
            continue
        for i, (a, e) in enumerate(zip(lst, expected.tensors()[name])):
            assert_close(a, e, dtype, f"{what}: {name}[{i}] (numel {a.numel()})")


def check_against_reference(backend: str, op: str, sizes, dtype: torch.dtype, mode: Mode, *,
                            steps: int = 7, seed: int = 0, device="cpu") -> None:
    """Chain ``steps`` calls of ``op`` with fresh gradients on ``backend`` and on the reference,
    comparing every tensor after every step.

    fp32 backends are compared against the reference run in fp64 (SPEC section 4); fp64 and
    bf16/fp16 backends against the reference on the same dtype (bf16/fp16 parameters are
    rounded to their storage dtype on both sides, so that is the like-for-like comparison).
    """
    hyper = mode.hyper(op)
    case = make_case(sizes, dtype, seed=seed, device=device)
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    for step in range(steps):
        apply(op, backend, case, hyper)
        apply(op, "reference", expected, hyper)
        assert_case_close(case, expected, dtype,
                          f"{backend} {op} {dtype} {mode.id} step {step + 1}",
                          with_meta_lrs=mode.lr_mode == "recurrent" and op != "inner_step")
        new = fresh_grads(case, seed=1000 * seed + step)
        case.grads = new
        expected.grads = [g.detach().to("cpu", ref_dtype, copy=True) for g in new]


# ---------------------------------------------------------------------------------------------
# The step interface (emcl_kernels.interface, [note: the step call]): one call per group.
# ---------------------------------------------------------------------------------------------

def pack_hyper(hyper: dict, device="cpu"):
    """``hyper`` (a :meth:`Mode.hyper` dict) as the interface's fp64 ``hyper`` tensor; missing
    values are the defaults, ``lr_scale=None`` the 1/reg sentinel."""
    from emcl_kernels.interface import HYPER_FIELDS, LR_SCALE_FROM_REG
    defaults = dict(inner_lr=0.0, meta_lr=0.0, reg=0.0, gamma=0.0, decay=0.0, lr_scale=1.0,
                    lr_min=0.0, lr_max=float("inf"), eps=1e-8)
    values = {**defaults, **{k: v for k, v in hyper.items() if k in defaults}}
    if "lr_scale" in hyper and hyper["lr_scale"] is None:
        values["lr_scale"] = LR_SCALE_FROM_REG
    return torch.tensor([float(values[k]) for k in HYPER_FIELDS], dtype=torch.float64,
                        device=device)


def new_counters(device="cpu", **values):
    """A fresh ``counters`` tensor (int64), with the given slots set."""
    from emcl_kernels.interface import COUNTER, COUNTER_FIELDS
    c = torch.zeros(len(COUNTER_FIELDS), dtype=torch.int64)
    for name, v in values.items():
        c[COUNTER[name]] = int(v)
    return c.to(device)


def counters_dict(counters) -> dict:
    from emcl_kernels.interface import COUNTER_FIELDS
    return dict(zip(COUNTER_FIELDS, counters.tolist()))


def mode_codes(mode: Mode) -> dict:
    from emcl_kernels.interface import IMPORTANCE, LR_MODE
    return dict(prox=mode.prox, importance=IMPORTANCE[mode.importance],
                lr_mode=LR_MODE[mode.lr_mode])


def call_step(mod, op: str, case: Case, mode: Mode, hyper: dict, counters, *, steps=None,
              meta_every: int = 1, check: bool = False, finalize: bool = True,
              grad_scale=None, found_inf=None) -> None:
    """``mod.step(...)`` of the step interface on ``case`` (op: "inner", "meta", "inner_meta"
    or "cadence"); ``meta_lrs`` are passed exactly when the mode is recurrent."""
    from emcl_kernels.interface import OP
    device = case.params[0].device if case.params else counters.device
    if steps is None:
        steps = torch.zeros(0, dtype=torch.float32, device=device)
    meta_lrs = list(case.meta_lrs) if mode.lr_mode == "recurrent" else []
    mod.step(list(case.params), list(case.grads), list(case.anchors), list(case.importances),
             meta_lrs, steps, pack_hyper(hyper, device), counters, op=OP[op],
             meta_every=meta_every, check=check, finalize=finalize, grad_scale=grad_scale,
             found_inf=found_inf, **mode_codes(mode))


def step_hyper(mode: Mode) -> dict:
    """Hyper-parameters for every op of the interface (inner and meta ones together)."""
    return mode.hyper("inner_meta_step")


def reference_backend():
    from emcl_kernels.backends import reference
    return reference


def check_step_matches_reference(mod, op: str, sizes, dtype: torch.dtype, mode: Mode, *,
                                 device="cpu", calls: int = 7, meta_every: int = 3,
                                 seed: int = 0) -> None:
    """Chain ``calls`` calls of ``mod.step`` (op ``op``) with fresh gradients, against the
    reference backend's ``step`` (in fp64 for fp32 tensors), comparing every tensor, the
    counters and the meta-step counts after every call."""
    hyper = step_hyper(mode)
    case = make_case(sizes, dtype, seed=seed, device=device)
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    n = len(sizes)
    counters, ref_counters = new_counters(device), new_counters("cpu")
    steps = torch.zeros(n, dtype=torch.float32, device=device)
    ref_steps = torch.zeros(n, dtype=torch.float32)
    ref = reference_backend()
    for call in range(calls):
        call_step(mod, op, case, mode, hyper, counters, steps=steps, meta_every=meta_every)
        call_step(ref, op, expected, mode, hyper, ref_counters, steps=ref_steps,
                  meta_every=meta_every)
        what = f"{getattr(mod, '__name__', mod)} {op} {dtype} {mode.id} call {call + 1}"
        assert_case_close(case, expected, dtype, what,
                          with_meta_lrs=mode.lr_mode == "recurrent" and op != "inner")
        assert counters_dict(counters.cpu()) == counters_dict(ref_counters), what
        assert torch.equal(steps.cpu(), ref_steps), f"{what}: steps {steps} != {ref_steps}"
        new = fresh_grads(case, seed=1000 * seed + call)
        case.grads = new
        expected.grads = [g.detach().to("cpu", ref_dtype, copy=True) for g in new]


def snapshot(case: Case) -> list:
    """Bitwise copies of every tensor a step may write (and of the grads)."""
    return [t.clone() for lst in (case.params, case.grads, case.anchors, case.importances,
                                  case.meta_lrs) for t in lst]


def assert_unchanged(case: Case, before: list, what: str) -> None:
    after = [t for lst in (case.params, case.grads, case.anchors, case.importances,
                           case.meta_lrs) for t in lst]
    for i, (a, b) in enumerate(zip(after, before)):
        # bitwise, NaN payloads included
        same = a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                  b.view(-1).view(torch.uint8) if b.numel() else b)
        assert same, f"{what}: tensor {i} changed"


# ---------------------------------------------------------------------------------------------
# Direct calls of the compiled operators (torch.ops.emcl.step_ / check_finite_): a valid call
# as a dict of every argument, and the calls the operators must refuse before writing anything.
# ---------------------------------------------------------------------------------------------

STEP_ARG_NAMES = ("params", "grads", "anchors", "importances", "meta_lrs", "steps", "hyper",
                  "counters")


def step_op_call(device="cpu", dtype=torch.float32, mode: Mode = MODES[0], *, op: str = "cadence",
                 sizes=(12, 3), seed: int = 1, check: bool = True) -> dict:
    """Every argument of a valid ``torch.ops.emcl.step_`` call, by name (see
    :func:`call_step_op`): ``mode``'s codes, ``meta_lrs`` exactly when it is recurrent, a
    ``steps`` tensor, ``op`` by name, finalize on (a refused call that wrongly ran would move
    the counters)."""
    from emcl_kernels.interface import OP
    case = make_case(list(sizes), dtype, seed=seed, device=device)
    n = len(case.params)
    return dict(params=case.params, grads=case.grads, anchors=case.anchors,
                importances=case.importances,
                meta_lrs=case.meta_lrs if mode.lr_mode == "recurrent" else [],
                steps=torch.zeros(n, dtype=torch.float32, device=device),
                hyper=pack_hyper(step_hyper(mode), device), counters=new_counters(device),
                op=OP[op], meta_every=1, check=check, finalize=True, grad_scale=None,
                found_inf=None, **mode_codes(mode))


def call_step_op(call: dict, entry: str = "torch.ops") -> None:
    """The compiled step with the arguments of ``call``: through ``torch.ops.emcl.step_``
    (``entry="torch.ops"``) or through the backend's ``step`` (``entry="backend"``, the direct
    entry point of ``emcl_kernels._C`` outside torch.compile)."""
    if entry == "backend":
        from emcl_kernels.backends import extension
        extension.step(**call)
        return
    positional = [call[k] for k in STEP_ARG_NAMES]
    keywords = {k: v for k, v in call.items() if k not in STEP_ARG_NAMES}
    torch.ops.emcl.step_(*positional, **keywords)


def call_tensors(call: dict) -> list:
    """Every tensor of a call (the lists' tensors, then the single ones), in a fixed order."""
    out = []
    for k, v in call.items():
        if isinstance(v, (list, tuple)):
            out.extend(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's elements in index order (NaN payloads included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def bitwise_snapshot(tensors: list) -> list:
    return [t.detach().clone() for t in tensors]


def assert_bitwise_unchanged(tensors: list, before: list, what: str) -> None:
    assert len(tensors) == len(before), what
    for i, (a, b) in enumerate(zip(tensors, before)):
        if a.layout != torch.strided:
            assert torch.equal(a.to_dense(), b.to_dense()), f"{what}: tensor {i} changed"
            continue
        same = a.dtype == b.dtype and a.shape == b.shape and (
            a.numel() == 0 or torch.equal(element_bytes(a), element_bytes(b)))
        assert same, f"{what}: tensor {i} ({tuple(a.shape)} {a.dtype}) changed"


def _set(key, value_of):
    def mutate(call):
        call[key] = value_of(call)
    return mutate


def _set_item(key, i, value_of):
    def mutate(call):
        lst = list(call[key])
        lst[i] = value_of(call, lst[i])
        call[key] = lst
    return mutate


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor with t's shape and values whose memory is not dense (every other element)."""
    buf = torch.zeros(t.numel() * 2, dtype=t.dtype, device=t.device)
    out = torch.as_strided(buf, t.shape, [2 * s for s in t.contiguous().stride()])
    out.copy_(t)
    return out


def _not_dense_param(call):
    """params[0] and every tensor laid out like it: strided every other element."""
    for key in ("params", "grads", "anchors", "importances", "meta_lrs"):
        lst = list(call[key])
        if lst:
            lst[0] = _strided_like(lst[0])
        call[key] = lst


def _transposed_like(t: torch.Tensor) -> torch.Tensor:
    """t's shape (2-d) and values, dense, but with the other strides (column major)."""
    return t.t().contiguous().t()


# (id, mutate(call), exception type, message pattern): each makes a valid step_op_call
# (fp32, recurrent, sizes (12, 3): params[0] is 2-d, (3, 4)) invalid in one way. They are in the
# order of SPEC section 4's list: counts, shapes, dtypes, devices/layouts, values.
BAD_STEP_CALLS = [
    ("grads-short", _set("grads", lambda c: c["grads"][:1]), ValueError, "one tensor each"),
    ("anchors-long", _set("anchors", lambda c: c["anchors"] + c["anchors"][:1]), ValueError,
     "one tensor each"),
    ("importances-empty", _set("importances", lambda c: []), ValueError, "one tensor each"),
    ("meta_lrs-missing", _set("meta_lrs", lambda c: []), ValueError, "recurrent"),
    ("meta_lrs-not-recurrent", _set("lr_mode", lambda c: 1), ValueError,
     "meta_lrs must be empty"),
    ("grads-swapped", _set("grads", lambda c: c["grads"][::-1]), ValueError,
     "laid out like its parameter"),
    ("grad-reshaped", _set_item("grads", 0, lambda c, t: t.reshape(4, 3)), ValueError,
     "laid out like its parameter"),
    ("anchor-other-strides", _set_item("anchors", 0, lambda c, t: _transposed_like(t)),
     ValueError, "strides"),
    ("grad-not-dense", _set_item("grads", 0, lambda c, t: _strided_like(t)), ValueError,
     "laid out like its parameter"),
    ("param-not-dense", _not_dense_param, RuntimeError, "not dense"),
    ("anchor-float64", _set_item("anchors", 1, lambda c, t: t.double()), TypeError, "dtype"),
    ("grad-float64", _set_item("grads", 1, lambda c, t: t.double()), TypeError, "dtype"),
    ("meta_lr-bfloat16", _set_item("meta_lrs", 0, lambda c, t: t.bfloat16()), TypeError,
     "dtype"),
    ("params-int", lambda c: c.update({k: [t.to(torch.int32) for t in c[k]]
                                       for k in ("params", "grads")}), TypeError, "float32"),
    ("steps-short", _set("steps", lambda c: c["steps"][:1]), ValueError, "steps"),
    ("steps-2d", _set("steps", lambda c: c["steps"].reshape(1, -1)), ValueError, "steps"),
    ("steps-float64", _set("steps", lambda c: c["steps"].double()), TypeError, "steps"),
    ("steps-strided", _set("steps", lambda c: torch.zeros(2 * len(c["params"]),
                                                          device=c["steps"].device)[::2]),
     RuntimeError, "steps"),
    ("hyper-float32", _set("hyper", lambda c: c["hyper"].float()), TypeError, "hyper"),
    ("hyper-short", _set("hyper", lambda c: c["hyper"][:-1]), ValueError, "hyper"),
    ("hyper-strided", _set("hyper", lambda c: c["hyper"].repeat_interleave(2)[::2]),
     RuntimeError, "hyper"),
    ("hyper-2d", _set("hyper", lambda c: c["hyper"].reshape(1, -1)), ValueError, "hyper"),
    ("counters-int32", _set("counters", lambda c: c["counters"].int()), TypeError, "counters"),
    ("counters-long", _set("counters", lambda c: torch.zeros(
        c["counters"].numel() + 1, dtype=torch.int64, device=c["counters"].device)),
     ValueError, "counters"),
    ("grad_scale-two", _set("grad_scale", lambda c: torch.ones(2, device=c["hyper"].device)),
     ValueError, "grad_scale"),
    ("grad_scale-float64", _set("grad_scale", lambda c: torch.ones(
        (), dtype=torch.float64, device=c["hyper"].device)), TypeError, "grad_scale"),
    ("found_inf-empty", _set("found_inf", lambda c: torch.ones(0, device=c["hyper"].device)),
     ValueError, "found_inf"),
    ("found_inf-int", _set("found_inf", lambda c: torch.zeros(
        (), dtype=torch.int32, device=c["hyper"].device)), TypeError, "found_inf"),
    ("op-4", _set("op", lambda c: 4), ValueError, "op"),
    ("op-negative", _set("op", lambda c: -1), ValueError, "op"),
    ("importance-2", _set("importance", lambda c: 2), ValueError, "importance"),
    ("lr_mode-3", _set("lr_mode", lambda c: 3), ValueError, "lr_mode"),
    ("meta_every-0", _set("meta_every", lambda c: 0), ValueError, "meta_every"),
]
