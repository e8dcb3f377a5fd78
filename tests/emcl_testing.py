"""What every backend test shares: random EMCL inputs, the modes of SPEC section 2, and the
comparison against the reference with SPEC section 4's tolerances.

    case = make_case([0, 1, 7, 4097], torch.float32, seed=0)
    check_against_reference("foreach", "meta_step", [7, 4097], torch.bfloat16, MODES[3])
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from emcl_kernels import functional as F
from emcl_kernels.reference import compute_dtype

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
    device = case.params[0].device if case.params else "cpu"
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
