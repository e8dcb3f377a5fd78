"""Property-based tests: random tensor lists, sizes, dtypes, modes and
hyper-parameters; every backend equals the reference, and what the math guarantees holds.

Reproducible: the examples are derandomized (the same ones on every run). The number per test
is ``EMCL_HYPOTHESIS_EXAMPLES`` (default 25, which keeps the file to seconds on 2 cores); set it
higher for a long search, e.g. ``EMCL_HYPOTHESIS_EXAMPLES=2000``.
"""
import math
import os
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from emcl_kernels import reference as R
from emcl_testing import OPS, Case, apply, clone_case, tolerance
from reliability_support import backends_for

BACKENDS = backends_for("cpu")
EXAMPLES = int(os.environ.get("EMCL_HYPOTHESIS_EXAMPLES", "25"))
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SIZE = st.one_of(st.integers(0, 70), st.sampled_from([127, 128, 129, 255, 1000, 1023, 4097]))
UNIT = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)


def _pow10(lo, hi):
    return st.integers(lo, hi).map(lambda k: 10.0 ** k)


@st.composite
def problems(draw, *, ops=OPS):
    """A random EMCL call: tensors, dtype, op, mode and hyper-parameters, in their domains and
    in the ranges where fp32 arithmetic stays well conditioned (|α·λ·h| of at most ~40)."""
    op = draw(st.sampled_from(ops))
    lr_mode = draw(st.sampled_from(("inverse", "constant", "recurrent")))
    hyper = dict(inner_lr=draw(UNIT), reg=draw(st.floats(0.0, 20.0)), gamma=draw(UNIT),
                 prox=draw(st.booleans()), meta_lr=draw(UNIT), decay=draw(UNIT),
                 lr_scale=draw(st.floats(0.0, 2.0)), lr_mode=lr_mode,
                 importance=draw(st.sampled_from(("taylor", "si"))),
                 eps=draw(st.sampled_from((1e-8, 1e-6, 1e-3, 0.1))),
                 lr_min=draw(st.sampled_from((0.0, 0.0, 1e-3))),
                 lr_max=draw(st.sampled_from((math.inf, 10.0, 0.5) if lr_mode != "recurrent"
                                             else (0.5, 2.0))))
    keys = {"inner_step": ("inner_lr", "reg", "gamma", "prox"),
            "meta_step": ("meta_lr", "reg", "decay", "lr_scale", "lr_mode", "importance",
                          "eps", "lr_min", "lr_max")}
    keys["inner_meta_step"] = keys["inner_step"] + keys["meta_step"]
    return dict(op=op, hyper={k: hyper[k] for k in keys[op]},
                sizes=draw(st.lists(SIZE, min_size=1, max_size=6)),
                dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2 ** 31 - 1)),
                scales=dict(theta=draw(_pow10(-2, 1)), drift=draw(_pow10(-3, 0)),
                            grad=draw(_pow10(-3, 2)), importance=draw(_pow10(-4, 1))),
                steps=draw(st.integers(1, 3)))


def make(problem) -> Case:
    """The tensors of ``problem``: random normal θ, θ₀ = θ + drift, g; h uniform >= 0 with
    some exact zeros; α in [0.05, 0.15]."""
    gen = torch.Generator().manual_seed(problem["seed"])
    dtype, sc = problem["dtype"], problem["scales"]
    sdt = R.compute_dtype(dtype)
    c = Case([], [], [], [], [], gen)
    for n in problem["sizes"]:
        theta = sc["theta"] * torch.randn(n, generator=gen, dtype=torch.float64)
        c.params.append(theta.to(dtype))
        c.anchors.append((theta + sc["drift"] * torch.randn(n, generator=gen,
                                                            dtype=torch.float64)).to(sdt))
        c.grads.append((sc["grad"] * torch.randn(n, generator=gen, dtype=torch.float64))
                       .to(dtype))
        h = sc["importance"] * torch.rand(n, generator=gen, dtype=torch.float64)
        h[torch.rand(n, generator=gen) < 0.1] = 0.0
        c.importances.append(h.to(sdt))
        c.meta_lrs.append((0.05 + 0.1 * torch.rand(n, generator=gen, dtype=torch.float64))
                          .to(sdt))
    return c


def _next_grads(case: Case, problem, step: int):
    gen = torch.Generator().manual_seed(problem["seed"] + 7919 * (step + 1))
    return [(problem["scales"]["grad"] * torch.randn(g.shape, generator=gen,
                                                      dtype=torch.float64)).to(g.dtype)
            for g in case.grads]


def _amplification(problem, before: Case, after: Case) -> float:
    """How much one step can magnify rounding, from the importances before and after it:
    1 + β·λ·h for the plain gradient inner step (the proximal one divides by 1 + γλh, which
    only shrinks), + |α·λ·h| for the meta step."""
    hp = problem["hyper"]
    h = max((float(t.abs().max()) for t in before.importances + after.importances
             if t.numel()), default=0.0)
    reg, amp = hp["reg"], 1.0
    if problem["op"] != "meta_step" and not hp["prox"]:
        amp += hp["inner_lr"] * reg * h
    if problem["op"] != "inner_step":
        if hp["lr_mode"] == "inverse":
            amp += hp["meta_lr"] * hp["lr_scale"] * reg + hp["lr_min"] * reg * h
        elif hp["lr_mode"] == "constant":
            amp += hp["meta_lr"] * reg * h
        else:
            amp += hp["lr_max"] * reg * h
    return amp


def _finite(case: Case) -> bool:
    return all(bool(torch.isfinite(t).all()) for lst in case.tensors().values() for t in lst)


def _si_allowance(problem, before: Case, allowed: dict, gain: float) -> list:
    """Per importance tensor, what its error may be after a meta step with importance="si",
    beyond SPEC section 4's tolerance. Ω = |g·(θ − θ₀)| subtracts two close numbers: the
    rounding of the fast weight θ and of the difference (one unit each in the compute dtype)
    and the errors θ and θ₀ carry from earlier steps (``allowed``: the allowances they were
    last checked against, times ``gain``, the step's :func:`_amplification`) reach Ω
    multiplied by |g|, however small |θ − θ₀| and Ω are; h = η·h + (1 − η)·Ω carries its own
    earlier allowance with weight η. An fp32 reference is as far from the fp64 one as the
    backends are (e.g. 4e-5 relative for |θ − θ₀| = 1e-3·|θ|). ``before``: the reference's
    tensors at the start of the step."""
    hp = problem["hyper"]
    eps = torch.finfo(R.compute_dtype(problem["dtype"])).eps
    out = []
    for i, (theta, g, theta0, h) in enumerate(zip(before.params, before.grads, before.anchors,
                                                   before.importances)):
        theta, g, theta0 = theta.double(), g.double(), theta0.double()
        if problem["op"] == "inner_meta_step":
            theta = R.inner_update(theta, g, theta0, h.double(), inner_lr=hp["inner_lr"],
                                   reg=hp["reg"], gamma=hp["gamma"], prox=hp["prox"])
        carried = gain * (allowed["params"][i] + allowed["anchors"][i])
        diff = eps * (theta.abs() + (theta - theta0).abs()) + carried
        out.append(hp["decay"] * allowed["importances"][i]
                   + (1 - hp["decay"]) * g.abs() * diff)
    return [x.reshape(-1) for x in out]


def _assert_close_scaled(actual: Case, expected: Case, dtype, amp: float, what: str,
                         with_meta_lrs: bool, extra: Optional[dict] = None) -> dict:
    """Every tensor of ``actual`` within SPEC section 4's tolerance of ``expected``, scaled by
    ``amp``, plus ``extra[name][i]`` (per element) where given; returns the allowances."""
    rtol, atol = tolerance(dtype)
    rtol, atol = rtol * amp, atol * amp
    allowances = {}
    for name, lst in actual.tensors().items():
        if name == "meta_lrs" and not with_meta_lrs:
            continue
        allowances[name] = []
        for i, (a, e) in enumerate(zip(lst, expected.tensors()[name])):
            a64, e64 = a.double().reshape(-1), e.double().reshape(-1)
            scale = float(e64.abs().max()) if a.numel() else 0.0
            allowed = atol * (1.0 + scale) + rtol * e64.abs()
            if a.dtype in (torch.bfloat16, torch.float16):
                allowed = allowed + e64.abs() * torch.finfo(a.dtype).eps
            if extra is not None and name in extra:
                allowed = allowed + extra[name][i]
            allowances[name].append(allowed)
            if not a.numel():
                continue
            err = (a64 - e64).abs()
            bad = ~(err <= allowed)
            if bool(bad.any()):
                j = int(bad.nonzero()[0])
                raise AssertionError(f"{what}: {name}[{i}] element {j} of {a.numel()}: got "
                                     f"{a64[j].item():.9g} want {e64[j].item():.9g} "
                                     f"(allowed {allowed[j].item():.3g}, amplification "
                                     f"{amp:.3g})")
    return allowances


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(problem=problems())
def test_backend_equals_reference(backend, problem):
    """Chained random calls on ``backend`` equal the reference (fp64 for fp32 inputs), within
    SPEC section 4's tolerances scaled by the conditioning of the step; with importance="si"
    the importance (and α, which divides by it) may also carry the rounding that Ω's
    subtraction θ − θ₀ magnifies (:func:`_si_allowance`)."""
    op, hyper, dtype = problem["op"], problem["hyper"], problem["dtype"]
    case = make(problem)
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype)
    amp = 1.0
    si = op != "inner_step" and hyper["importance"] == "si"
    # the inputs are the same values on both sides: nothing is carried into the first step
    allowed = {name: [torch.zeros(t.numel(), dtype=torch.float64) for t in lst]
               for name, lst in case.tensors().items()}
    for step in range(problem["steps"]):
        before = clone_case(expected)
        apply(op, backend, case, hyper)
        apply(op, "reference", expected, hyper)
        assume(_finite(expected))   # eq. 8 as written may overflow over chained steps
        gain = _amplification(problem, before, expected)
        amp *= gain                                 # errors carried from earlier steps
        extra = None
        if si:
            extra = {"importances": _si_allowance(problem, before, allowed, gain)}
            if hyper["lr_mode"] == "recurrent":    # α = α·r/(h + ε): h's relative error
                extra["meta_lrs"] = [a.double().abs().reshape(-1) * dh
                                     / (h.double().reshape(-1) + hyper["eps"])
                                     for a, h, dh in zip(expected.meta_lrs, expected.importances,
                                                         extra["importances"])]
        allowed = _assert_close_scaled(
            case, expected, dtype, amp, f"{backend} {op} {dtype} step {step + 1} {hyper}",
            with_meta_lrs=op != "inner_step" and hyper["lr_mode"] == "recurrent", extra=extra)
        case.grads = _next_grads(case, problem, step)
        expected.grads = [g.to(ref_dtype) for g in case.grads]


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(problem=problems(ops=("meta_step", "inner_meta_step")))
def test_importance_stays_non_negative(backend, problem):
    case = make(problem)
    for step in range(problem["steps"] + 2):
        apply(problem["op"], backend, case, problem["hyper"])
        for i, h in enumerate(case.importances):
            assert not bool((h < 0).any()), f"importance[{i}] went negative: {h.min().item()}"
        if not _finite(case):   # hyper-parameters that diverge (as SGD with a huge lr does)
            event("the run diverged")
            break
        case.grads = _next_grads(case, problem, step)


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(problem=problems(ops=("meta_step", "inner_meta_step")))
def test_anchor_moves_towards_the_fast_weight(backend, problem):
    """With 0 <= α·λ·h <= 1 the new anchor lies between the old anchor and the fast weight
    (θ for a meta step, the inner step's result for the fused inner+meta step)."""
    hyper = dict(problem["hyper"])
    case = make(problem)
    theta = [p.double() for p in case.params]
    anchors = [a.double() for a in case.anchors]
    if problem["op"] == "inner_meta_step":
        theta = [R.inner_update(t, g.double(), a, h.double(), inner_lr=hyper["inner_lr"],
                                reg=hyper["reg"], gamma=hyper["gamma"], prox=hyper["prox"])
                 for t, g, a, h in zip(theta, case.grads, anchors, case.importances)]
    # a bound on the new h, then hyper-parameters that keep α·λ·h within [0, 1]
    omega = [g.double().abs() * (a.abs() if hyper["importance"] == "taylor" else (t - a).abs())
             for g, a, t in zip(case.grads, anchors, theta)]
    h_max = max((float((hyper["decay"] * h.double() + (1 - hyper["decay"]) * o).max())
                 for h, o in zip(case.importances, omega) if h.numel()), default=0.0)
    bound = 1.0 / max(hyper["reg"] * h_max * 1.01, 1e-30)
    hyper["lr_min"] = 0.0
    if hyper["lr_mode"] == "inverse":
        hyper["lr_scale"] = min(hyper["lr_scale"], 1.0 / max(hyper["meta_lr"] * hyper["reg"],
                                                             1e-30))
    elif hyper["lr_mode"] == "constant":
        hyper["meta_lr"] = min(hyper["meta_lr"], bound)
    else:
        hyper["lr_max"] = min(hyper["lr_max"], bound)
    apply(problem["op"], backend, case, hyper)
    fp32 = 2 * torch.finfo(torch.float32).eps
    for i, (new, old, fast) in enumerate(zip(case.anchors, anchors, theta)):
        new = new.double()
        slack = fp32 * (old.abs() + fast.abs()) + 1e-30
        if problem["op"] == "inner_meta_step":   # the backend's fast weight is fp32
            slack = slack + 1e-5 * (1 + fast.abs())
        lo, hi = torch.minimum(old, fast) - slack, torch.maximum(old, fast) + slack
        outside = ~((new >= lo) & (new <= hi))
        assert not bool(outside.any()), (
            f"anchor[{i}] left [old anchor, fast weight] at {outside.nonzero()[0].item()}")


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(problem=problems())
def test_zero_gradient_and_zero_importance_move_nothing(backend, problem):
    """g = 0 and h = 0: the inner step leaves θ exactly as it was; the meta step leaves θ₀
    exactly as it was, h at 0, and sets θ to θ₀ (rounded to θ's dtype)."""
    case = make(problem)
    case.grads = [torch.zeros_like(g) for g in case.grads]
    case.importances = [torch.zeros_like(h) for h in case.importances]
    params, anchors = [p.clone() for p in case.params], [a.clone() for a in case.anchors]
    apply(problem["op"], backend, case, problem["hyper"])
    for i, (p, a) in enumerate(zip(params, anchors)):
        if problem["op"] == "inner_step":
            assert torch.equal(case.params[i], p), f"params[{i}] moved"
        else:
            assert torch.equal(case.anchors[i], a), f"anchors[{i}] moved"
            assert not bool(case.importances[i].any()), f"importances[{i}] left 0"
            assert torch.equal(case.params[i], a.to(p.dtype)), f"params[{i}] != anchor"
