"""A step whose gradients hold an inf or a NaN writes nothing, on every
backend: the functional API skips on the fused device flag, the optimizer also counts the skip,
warns, and ends exactly where a run without the bad steps ends."""
import warnings

import pytest
import torch

from emcl_kernels import FusedEMCLOptimizer
from emcl_kernels import functional as F
from emcl_kernels.optimizer import NonFiniteGradientWarning
from emcl_testing import MODES, OPS, apply, assert_case_close, clone_case, fresh_grads, make_case
from reliability_support import (BACKEND_DEVICES, BACKEND_IDS, INF, NAN, TinyNet,
                                 assert_optimizer_unchanged, assert_same_values,
                                 assert_unchanged, backward,
                                 optimizer_snapshot, same_bits, snapshot)

SIZES = (0, 1, 7, 300, 4097)
BAD = {"nan": NAN, "inf": INF, "-inf": -INF}


def _all(case):
    return case.params + case.anchors + case.importances + case.meta_lrs


# --- functional -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64),
                         ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("where,bad", [("first", "nan"), ("middle", "inf"), ("last", "-inf"),
                                       ("middle", "nan")])
def test_bad_gradient_writes_nothing(backend, device, dtype, op, where, bad):
    mode = MODES[0] if op == "inner_step" else MODES[(len(where) + len(bad)) % len(MODES)]
    hyper = mode.hyper(op)
    case = make_case(SIZES, dtype, seed=len(where), device=device)
    tensor = {"first": 1, "middle": 3, "last": 4}[where]
    element = {"first": 0, "middle": 150, "last": SIZES[tensor] - 1}[where]
    case.grads[tensor].view(-1)[element] = BAD[bad]
    grads_before, before = snapshot(case.grads), snapshot(_all(case))
    fn = getattr(F, op + "_")
    lists = [case.params, case.grads, case.anchors, case.importances]
    if op != "inner_step":
        lists.append(case.meta_lrs if mode.lr_mode == "recurrent" else None)
    flag = fn(*lists, backend=backend, **hyper)
    assert flag is not None and flag.shape == () and flag.dtype == torch.float32
    assert flag.device.type == device and flag.item() == 1.0
    assert_unchanged(before, _all(case), f"{backend} {op} with a {bad} gradient: a tensor")
    assert_same_values(grads_before, case.grads, "grads")  # the check keeps their values


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("op", OPS)
def test_state_is_intact_after_a_skip(backend, device, op):
    """Skipped steps among good ones: the run equals the reference run of the good steps."""
    mode = MODES[1]
    hyper = mode.hyper(op)
    case = make_case(SIZES, torch.float32, seed=7, device=device)
    expected = clone_case(case, torch.float64, device="cpu")
    for step in range(6):
        good = fresh_grads(case, seed=50 + step)
        if step % 2 == 1:
            case.grads = [g.clone() for g in good]
            case.grads[2].view(-1)[step] = NAN if step % 4 == 1 else -INF
            assert apply_flag(op, backend, case, hyper) == 1.0
        case.grads = good
        expected.grads = [g.detach().to("cpu", torch.float64, copy=True) for g in good]
        assert apply_flag(op, backend, case, hyper) == 0.0
        apply(op, "reference", expected, hyper)
        assert_case_close(case, expected, torch.float32, f"{backend} {op} step {step}",
                          with_meta_lrs=op != "inner_step" and mode.lr_mode == "recurrent")


def apply_flag(op, backend, case, hyper):
    fn = getattr(F, op + "_")
    lists = [case.params, case.grads, case.anchors, case.importances]
    if op != "inner_step":
        lists.append(case.meta_lrs if hyper.get("lr_mode") == "recurrent" else None)
    return fn(*lists, backend=backend, **hyper).item()


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_check_finite_false_opts_out(backend, device):
    case = make_case((7, 34), torch.float32, seed=1, device=device)
    case.grads[1][5] = NAN
    hyper = MODES[0].hyper("inner_step")
    flag = F.inner_step_(case.params, case.grads, case.anchors, case.importances,
                         backend=backend, check_finite=False, **hyper)
    assert flag is None
    assert torch.isnan(case.params[1][5]) and bool(torch.isfinite(case.params[0]).all())
    assert int(torch.isnan(case.params[1]).sum()) == 1


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("user,bad,skips", [(1.0, False, True), (0.0, True, True),
                                            (0.0, False, False), (3.0, True, True)])
def test_combined_with_callers_found_inf(backend, device, user, bad, skips):
    """A GradScaler's found_inf and the check are combined: either one skips the step."""
    case = make_case((7, 33), torch.float32, seed=2, device=device)
    if bad:
        case.grads[0][3] = INF
    before = snapshot(_all(case))
    found = torch.tensor(user, device=device)
    flag = F.meta_step_(case.params, case.grads, case.anchors, case.importances, None,
                        backend=backend, found_inf=found, **MODES[1].hyper("meta_step"))
    assert flag.item() == float(skips)
    assert found.item() == user  # the caller's flag is not written
    changed = not all(same_bits(b, a) for b, a in zip(before, _all(case)))
    assert changed != skips


def test_found_non_finite():
    big = [torch.full((5,), 3.0e38), torch.full((3,), 65504.0, dtype=torch.float16),
           torch.full((2,), 3.0e38, dtype=torch.bfloat16), torch.full((4,), 1e308,
                                                                      dtype=torch.float64)]
    assert F.found_non_finite(big).item() == 0.0  # large finite values are not overflow
    assert F.found_non_finite([]) is None
    assert F.found_non_finite([torch.empty(0)]) is None
    assert F.found_non_finite([], torch.tensor(2.0)).item() == 1.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for value in (NAN, INF, -INF):
            grads = [torch.randn(9, dtype=dtype), torch.empty(0, dtype=dtype),
                     torch.randn(4, 4, dtype=dtype).t()]   # non-contiguous too
            grads[2][1, 3] = value
            copies = snapshot(grads)
            flag = F.found_non_finite(grads + big)
            assert flag.item() == 1.0, (dtype, value)
            assert_same_values(copies, grads, "grads")
    with pytest.raises(TypeError, match="grads"):
        F.found_non_finite(torch.randn(3))
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        F.found_non_finite([torch.randn(3), 1.0])
    with pytest.raises(TypeError, match="check_finite"):
        F.inner_step_([torch.randn(2)], [torch.randn(2)], [torch.randn(2)], [torch.rand(2)],
                      inner_lr=0.1, reg=1.0, gamma=0.1, check_finite=1)


# --- the optimizer --------------------------------------------------------------------------

def _optimizer(model, backend, **kw):
    p = list(model.parameters())
    groups = [{"params": p[:2]}, {"params": p[2:], "inner_lr": 0.02, "lr_mode": "recurrent"}]
    return FusedEMCLOptimizer(groups, meta_lr=0.2, inner_lr=0.05, reg=2.0, gamma=0.3,
                              backend=backend, **kw)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("call", ("inner_step", "meta_step", "inner_meta_step", "step"))
def test_optimizer_skips_counts_and_warns(backend, device, call):
    model = TinyNet(seed=1, device=device)
    opt = _optimizer(model, backend, meta_every=2)
    for s in range(3):                                   # build some state first
        backward(model, s)
        opt.step()
    backward(model, 5, bad=NAN)
    before = optimizer_snapshot(opt)
    with pytest.warns(NonFiniteGradientWarning, match="inf or a NaN"):
        getattr(opt, call)()
        # on CPU the warning comes with the step; on a GPU when the flag is read back, at the
        # latest when skipped_steps (or state_dict) is read
        assert opt.skipped_steps == 1
    expected = dict(before)
    expected["counters"] = (before["counters"][0] + (call == "step"), 1)
    assert_optimizer_unchanged(expected, opt)
    assert opt.state_dict()["emcl"]["skipped_steps"] == 1
    # the bad gradient is still there, untouched; the next good step goes through
    assert torch.isnan(model.fc1.weight.grad).any()
    backward(model, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteGradientWarning)
        getattr(opt, call)()
    assert opt.skipped_steps == 1


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_optimizer_check_finite_false(backend, device):
    model = TinyNet(seed=2, device=device)
    opt = _optimizer(model, backend, check_finite=False)
    backward(model, 1, bad=INF)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteGradientWarning)
        opt.inner_step()
    assert not bool(torch.isfinite(model.fc1.weight).all())
    assert opt.skipped_steps == 0
    with pytest.raises(TypeError, match="check_finite"):
        FusedEMCLOptimizer(model.parameters(), check_finite="yes")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_long_run_with_bad_steps_equals_run_without_them(backend, device):
    """120 calls with every 7th gradient poisoned end bit for bit where the 103 good calls end,
    with the skips counted: a skipped step is a step that never happened."""
    calls = []
    for i in range(120):
        op = "meta_step" if i % 5 == 4 else ("inner_meta_step" if i % 11 == 10 else "inner_step")
        calls.append((op, i, (NAN, INF, -INF)[i % 3] if i % 7 == 3 else None))
    runs = {}
    for name, plan in (("with", calls), ("without", [c for c in calls if c[2] is None])):
        model = TinyNet(seed=3, device=device)
        opt = _optimizer(model, backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteGradientWarning)
            for op, seed, bad in plan:
                backward(model, seed, bad=bad)
                getattr(opt, op)()
        runs[name] = (model, opt)
    (m1, o1), (m2, o2) = runs["with"], runs["without"]
    assert o1.skipped_steps == sum(c[2] is not None for c in calls) == 17
    assert o2.skipped_steps == 0
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert same_bits(p1, p2)
        assert o1.state[p1].keys() == o2.state[p2].keys()
        for k in o1.state[p1]:
            assert same_bits(o1.state[p1][k], o2.state[p2][k]), k
