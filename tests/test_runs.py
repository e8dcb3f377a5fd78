"""Arrays of runs (SPEC section 3): a param group with ``runs=N`` steps N runs at once, and run
``i`` of the array is, bit for bit, the optimizer over run ``i``'s slices alone with its scalar
hyper-parameters: every backend and dtype, every mode and step kind, chained steps, checkpoints
and a resume on another backend. A run with a non-finite gradient skips alone; bad input is
refused, naming the run, before anything is written."""
from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are first imported

from emcl_kernels import FusedEMCLOptimizer, functional  # noqa: E402
from emcl_kernels.runs import PerRun  # noqa: E402
from emcl_kernels.skips import NonFiniteGradientWarning  # noqa: E402

from emcl_testing import MODES  # noqa: E402
from reliability_support import BACKEND_DEVICES  # noqa: E402
from test_runs_kernels import triton_module  # noqa: E402

# every backend of the suite's reliability tests, and Triton through its interpreter here
BACKEND_DEVICES = list(BACKEND_DEVICES)
if not any(b == "triton" for b, _ in BACKEND_DEVICES) and triton_module() is not None:
    BACKEND_DEVICES.append(("triton", "cuda" if ON_GPU else "cpu"))
BACKEND_IDS = [f"{b}-{d}" for b, d in BACKEND_DEVICES]

RUNS = 3
# per run: an odd matrix, a bias, one element, and nothing at all
SHAPES = ((7, 5), (7,), (1,), (0,))
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def per_run_hyper(mode) -> dict:
    """Hyper-parameters that differ from run to run (the group's keys), in well-conditioned
    ranges for chained steps (alpha * reg * h well below 1)."""
    h = dict(lr=[0.05, 0.03, 0.07], meta_lr=[0.2, 0.1, 0.15], reg=[1.5, 1.0, 2.0],
             gamma=[0.3, 0.5, 0.2], decay=[0.8, 0.9, 0.7], eps=[1e-8, 1e-6, 1e-7],
             lr_mode=mode.lr_mode, importance=mode.importance, prox=mode.prox)
    if mode.lr_mode == "recurrent":
        h.update(meta_lr_scale=[0.9, 0.8, 0.95], lr_min=[0.01, 0.02, 0.0],
                 lr_max=[0.3, 0.25, 0.4])
    elif mode.lr_mode == "inverse":
        h.update(meta_lr_scale=[0.6, 0.5, 0.7], lr_max=[50.0, 40.0, 60.0])
    else:
        h.update(meta_lr_scale=1.0)
    return h


def run_values(hyper: dict, r: int) -> dict:
    return {k: (v[r] if isinstance(v, (list, PerRun)) else v) for k, v in hyper.items()}


def stacked(device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((RUNS, *s), generator=gen, dtype=torch.float64).to(device, dtype)
            .requires_grad_() for s in SHAPES]


def array_and_alone(backend, device, dtype, mode, *, meta_every=3, seed=0):
    """An optimizer over an array of RUNS runs, and one optimizer per run over its slices."""
    hyper = per_run_hyper(mode)
    params = stacked(device, dtype, seed)
    opt = FusedEMCLOptimizer([{"params": params, "runs": RUNS, **hyper}], backend=backend,
                             meta_every=meta_every)
    alone = []
    for r in range(RUNS):
        ps = [p.detach()[r].clone().requires_grad_() for p in params]
        alone.append((ps, FusedEMCLOptimizer([{"params": ps, **run_values(hyper, r)}],
                                             backend=backend, meta_every=meta_every)))
    return params, opt, alone


def give_grads(params, alone, gen, *, bad_run=None):
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype)
        if bad_run is not None and i == 0:
            g[bad_run].view(-1)[0] = float("nan")
        p.grad = g
        for r, (ps, _) in enumerate(alone):
            ps[i].grad = g[r].clone()


def assert_runs_equal(params, opt, alone, what, *, skip_runs=()):
    for r, (ps, single) in enumerate(alone):
        if r in skip_runs:
            continue
        for i, (p, q) in enumerate(zip(params, ps)):
            assert torch.equal(p.detach()[r], q.detach()), f"{what}: run {r}, parameter {i}"
            st, sq = opt.state[p], single.state[q]
            for key in ("anchor", "importance", "meta_lr"):
                if key in sq:
                    assert torch.equal(st[key][r], sq[key]), f"{what}: run {r} {key} of {i}"
            assert float(st["step"][r]) == float(sq["step"]), f"{what}: run {r} step of {i}"


STEP_KINDS = ("step", "inner_step", "meta_step", "inner_meta_step")


def step_both(params, opt, alone, gen, kind: str = "step"):
    """Fresh gradients, then the same step of the array and of every run alone."""
    give_grads(params, alone, gen)
    do_step(opt, kind)
    for _, single in alone:
        do_step(single, kind)


def do_step(opt, kind):
    getattr(opt, kind)()


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("mode", MODES, ids=[m.id for m in MODES])
def test_each_run_is_the_run_alone_in_every_mode(backend, device, mode):
    params, opt, alone = array_and_alone(backend, device, torch.float32, mode)
    gen = torch.Generator().manual_seed(1)
    kinds = ["step"] * 4 + ["inner_step", "meta_step", "inner_meta_step", "step", "step"]
    for n, kind in enumerate(kinds):
        give_grads(params, alone, gen)
        do_step(opt, kind)
        for _, single in alone:
            do_step(single, kind)
        assert_runs_equal(params, opt, alone, f"{kind} {n}")


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_run_is_the_run_alone_in_every_dtype(backend, device, dtype):
    mode = MODES[0]
    params, opt, alone = array_and_alone(backend, device, dtype, mode, meta_every=2)
    gen = torch.Generator().manual_seed(2)
    for n in range(7):
        step_both(params, opt, alone, gen)
        assert_runs_equal(params, opt, alone, f"step {n}")


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_a_run_with_a_non_finite_gradient_skips_alone(backend, device):
    params, opt, alone = array_and_alone(backend, device, torch.float32, MODES[0])
    gen = torch.Generator().manual_seed(3)
    step_both(params, opt, alone, gen)
    before = [p.detach().clone() for p in params]
    give_grads(params, alone, gen, bad_run=1)
    with pytest.warns(NonFiniteGradientWarning, match="run"):
        opt.step()
    for r, (_, single) in enumerate(alone):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteGradientWarning)
            single.step()          # run 1's single optimizer skips its step too
    for p, b in zip(params, before):
        assert torch.equal(p.detach()[1], b[1])
    assert_runs_equal(params, opt, alone, "the step with run 1's NaN")
    assert opt.skipped_runs == [0, 1, 0]
    assert opt.skipped_steps == 0
    step_both(params, opt, alone, gen)
    assert_runs_equal(params, opt, alone, "the step after")
    assert opt.state_dict()["emcl"]["skipped_runs"] == [0, 1, 0]


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_a_grad_scaler_found_inf_skips_every_run(backend, device):
    params, opt, alone = array_and_alone(backend, device, torch.float32, MODES[1])
    gen = torch.Generator().manual_seed(4)
    give_grads(params, alone, gen)
    before = [p.detach().clone() for p in params]
    opt.step(found_inf=torch.ones((), device=device))
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert [float(s) for s in opt.state[params[0]]["step"]] == [0.0] * RUNS


PAIRS = list(itertools.product(BACKEND_DEVICES, repeat=2))


@pytest.mark.parametrize("first, second", PAIRS,
                         ids=[f"{a[0]}-{a[1]}-to-{b[0]}-{b[1]}" for a, b in PAIRS])
def test_a_checkpoint_resumes_every_run_on_any_backend(first, second):
    (b1, d1), (b2, d2) = first, second
    mode = MODES[2]
    params, opt, alone = array_and_alone(b1, d1, torch.float32, mode)
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        step_both(params, opt, alone, gen)
    saved = opt.state_dict()
    saved_alone = [single.state_dict() for _, single in alone]
    # resume: new optimizers on the second backend and device over copies of the weights
    params2 = [p.detach().to(d2).clone().requires_grad_() for p in params]
    opt2 = FusedEMCLOptimizer([{"params": params2, "runs": RUNS, **per_run_hyper(mode)}],
                              backend=b2, meta_every=3)
    opt2.load_state_dict(saved)
    alone2 = []
    for r, ((ps, _), sd) in enumerate(zip(alone, saved_alone)):
        ps2 = [q.detach().to(d2).clone().requires_grad_() for q in ps]
        single = FusedEMCLOptimizer([{"params": ps2, **run_values(per_run_hyper(mode), r)}],
                                    backend=b2, meta_every=3)
        single.load_state_dict(sd)
        alone2.append((ps2, single))
    assert isinstance(opt2.param_groups[0]["lr"], PerRun)
    for _ in range(4):
        step_both(params2, opt2, alone2, gen)
    assert_runs_equal(params2, opt2, alone2, f"resumed on {b2}")


def test_a_checkpoint_loads_with_weights_only(tmp_path):
    params, opt, alone = array_and_alone("reference", "cpu", torch.float32, MODES[0])
    give_grads(params, alone, torch.Generator().manual_seed(6))
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sd["param_groups"][0]["lr"] == [0.05, 0.03, 0.07]
    assert sd["state"][0]["step"].shape == (RUNS,)


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_changing_one_runs_value_takes_effect_at_the_next_step(backend, device):
    params, opt, alone = array_and_alone(backend, device, torch.float32, MODES[3])
    gen = torch.Generator().manual_seed(7)
    step_both(params, opt, alone, gen)
    plans = opt._runtime.plans
    group = opt.param_groups[0]
    group["lr"] = group["lr"].replace(2, 0.011)
    group["reg"] = group["reg"].replace(0, 0.5)
    alone[2][1].param_groups[0]["lr"] = 0.011
    alone[0][1].param_groups[0]["reg"] = 0.5
    for _ in range(3):
        step_both(params, opt, alone, gen)
    assert opt._runtime.plans is plans, "a change of numbers must not rebuild the plans"
    assert_runs_equal(params, opt, alone, "after the change")


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_per_run_values_as_a_tensor_are_read_at_every_step(backend, device):
    mode = MODES[0]
    hyper = per_run_hyper(mode)
    lr = torch.tensor(hyper["lr"], dtype=torch.float64, device=device)
    params = stacked(device, torch.float32, 8)
    opt = FusedEMCLOptimizer([{"params": params, "runs": RUNS, **{**hyper, "lr": lr}}],
                             backend=backend)
    alone = [([p.detach()[r].clone().requires_grad_() for p in params], None)
             for r in range(RUNS)]
    alone = [(ps, FusedEMCLOptimizer([{"params": ps, **run_values(hyper, r)}], backend=backend))
             for r, (ps, _) in enumerate(alone)]
    gen = torch.Generator().manual_seed(9)
    for n in range(3):
        if n == 2:
            lr[1] = 0.002                      # in place: read at the next step
            alone[1][1].param_groups[0]["lr"] = 0.002
        step_both(params, opt, alone, gen)
        assert_runs_equal(params, opt, alone, f"step {n}")


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_the_functional_api_takes_per_run_values(backend, device):
    mode = MODES[0]
    h = mode.hyper("inner_meta_step")
    per_run = {"inner_lr": [0.05, 0.02, 0.04], "reg": [1.5, 1.0, 0.5], "meta_lr": [0.2, 0.1, 0.3]}
    gen = torch.Generator().manual_seed(10)
    ps = [torch.randn((RUNS, *s), generator=gen).to(device) for s in SHAPES]
    gs = [torch.randn_like(p) for p in ps]
    anchors = [p + 0.01 * torch.randn_like(p) for p in ps]
    imps = [torch.rand_like(p) for p in ps]
    alphas = [torch.full_like(p, 0.2) for p in ps]
    alone = [[[t[r].clone() for t in lst] for lst in (ps, gs, anchors, imps, alphas)]
             for r in range(RUNS)]
    gs[0][2].view(-1)[0] = float("inf")        # run 2 writes nothing
    flags = functional.inner_meta_step_(ps, gs, anchors, imps, alphas, backend=backend,
                                        runs=RUNS, **{**h, **per_run})
    assert flags.tolist() == [0.0, 0.0, 1.0]
    for r in range(RUNS):
        a_ps, a_gs, a_anchors, a_imps, a_alphas = alone[r]
        if r == 2:
            assert all(torch.equal(p[r], q) for p, q in zip(ps, a_ps))
            continue
        functional.inner_meta_step_(a_ps, a_gs, a_anchors, a_imps, a_alphas, backend=backend,
                                    **{**h, **{k: v[r] for k, v in per_run.items()}})
        for lst, a_lst in ((ps, a_ps), (anchors, a_anchors), (imps, a_imps), (alphas, a_alphas)):
            assert all(torch.equal(t[r], q) for t, q in zip(lst, a_lst))


# -- what is refused, before anything is written -------------------------------------------

def _refused(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_a_vector_of_the_wrong_length_is_refused():
    p = torch.randn(RUNS, 4, requires_grad=True)
    _refused(lambda: FusedEMCLOptimizer([{"params": [p], "runs": RUNS, "lr": [0.1, 0.2]}]),
             ValueError, r"runs=3 but lr has shape \(2,\)")


def test_per_run_values_without_runs_are_refused():
    p = torch.randn(RUNS, 4, requires_grad=True)
    _refused(lambda: FusedEMCLOptimizer([p], lr=[0.1, 0.2, 0.3]), TypeError, "runs=N")


def test_a_parameter_without_the_leading_runs_is_refused():
    p = torch.randn(4, RUNS, requires_grad=True)
    _refused(lambda: FusedEMCLOptimizer([{"params": [p], "runs": RUNS}]), ValueError,
             r"stacks its runs along its first dimension \(\[3, \.\.\.\]\)")


def test_runs_that_are_not_outermost_in_memory_are_refused():
    p = torch.randn(4, RUNS).t().requires_grad_()
    _refused(lambda: FusedEMCLOptimizer([{"params": [p], "runs": RUNS}]), ValueError,
             "outermost dimension in memory")


def test_two_numbers_of_runs_in_one_optimizer_are_refused():
    a = torch.randn(RUNS, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    _refused(lambda: FusedEMCLOptimizer([{"params": [a], "runs": RUNS},
                                         {"params": [b], "runs": 2}]),
             ValueError, "hold the same runs")


def test_a_value_out_of_its_domain_names_the_run():
    p = torch.randn(RUNS, 4, requires_grad=True)
    _refused(lambda: FusedEMCLOptimizer([{"params": [p], "runs": RUNS, "decay": [0.9, 1.5, 0.9]}]),
             ValueError, r"param group 0, run 1: decay must be in \[0, 1\]")


def test_a_bad_change_of_one_run_is_refused_before_anything_is_written():
    p = torch.randn(RUNS, 4, requires_grad=True)
    opt = FusedEMCLOptimizer([{"params": [p], "runs": RUNS, "lr": [0.1, 0.2, 0.3]}])
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].replace(2, -1.0)
    _refused(opt.step, ValueError, "run 2: lr")
    assert torch.equal(p.detach(), before)


def test_a_scalar_still_means_every_run():
    p = torch.randn(RUNS, 4, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    a = FusedEMCLOptimizer([{"params": [p], "runs": RUNS}], lr=0.07, backend="reference")
    b = FusedEMCLOptimizer([{"params": [q], "runs": RUNS, "lr": [0.07] * RUNS}],
                           backend="reference")
    g = torch.randn_like(p)
    p.grad, q.grad = g.clone(), g.clone()
    a.step()
    b.step()
    assert torch.equal(p, q)


# -- LR schedulers ---------------------------------------------------------------------------
from torch.optim import lr_scheduler as S  # noqa: E402

SCALING_SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: S.StepLR(o, 2, 0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, [1, 3], 0.5),
    "ConstantLR": lambda o: S.ConstantLR(o, 0.5, 2),
    "LinearLR": lambda o: S.LinearLR(o, 0.3, 1.0, 3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, 0.9),
    "PolynomialLR": lambda o: S.PolynomialLR(o, 4, 2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, 4, 0.001),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, 2),
    "SequentialLR": lambda o: S.SequentialLR(o, [S.ConstantLR(o, 0.5, 2),
                                                 S.ExponentialLR(o, 0.9)], [2]),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, 2),
                                                      S.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("name", sorted(SCALING_SCHEDULERS))
def test_a_scheduler_that_scales_lr_scales_every_runs_lr(name):
    make = SCALING_SCHEDULERS[name]
    mode = MODES[0]
    params, opt, alone = array_and_alone("reference", "cpu", torch.float32, mode)
    sched = make(opt)
    scheds = [make(single) for _, single in alone]
    gen = torch.Generator().manual_seed(11)
    for _ in range(6):
        step_both(params, opt, alone, gen)
        sched.step()
        for s in scheds:
            s.step()
        assert list(opt.param_groups[0]["lr"]) == [s.param_groups[0]["lr"] for _, s in alone]
    assert_runs_equal(params, opt, alone, name)


def test_reduce_lr_on_plateau_is_refused_over_an_array():
    params, opt, _ = array_and_alone("reference", "cpu", torch.float32, MODES[0])
    sched = S.ReduceLROnPlateau(opt, patience=0)
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        for _ in range(3):
            sched.step(1.0)


@pytest.mark.parametrize("make", [
    lambda o: S.CyclicLR(o, 0.01, 0.1, cycle_momentum=False),
    lambda o: S.OneCycleLR(o, 0.1, total_steps=10, cycle_momentum=False)],
    ids=["CyclicLR", "OneCycleLR"])
def test_a_scheduler_that_sets_one_rate_per_group_is_refused_over_an_array(make):
    params, opt, alone = array_and_alone("reference", "cpu", torch.float32, MODES[0])
    give_grads(params, alone, torch.Generator().manual_seed(12))
    opt.step()
    before = [p.detach().clone() for p in params]
    make(opt)
    with pytest.raises(ValueError, match="one rate"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_an_array_of_one_is_the_run_alone():
    gen = torch.Generator().manual_seed(13)
    p = torch.randn(1, 5, 3, generator=gen, requires_grad=True)
    q = p.detach()[0].clone().requires_grad_()
    a = FusedEMCLOptimizer([{"params": [p], "runs": 1, "lr": [0.05], "reg": [2.0]}],
                           meta_every=2)
    b = FusedEMCLOptimizer([q], lr=0.05, reg=2.0, meta_every=2)
    for _ in range(5):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g.clone(), g[0].clone()
        a.step()
        b.step()
    assert torch.equal(p[0], q)
    assert torch.equal(a.state[p]["anchor"][0], b.state[q]["anchor"])


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_a_capturable_array_reads_its_values_from_one_device_table(backend, device):
    mode = MODES[0]
    hyper = per_run_hyper(mode)
    params = stacked(device, torch.float32, 14)
    opt = FusedEMCLOptimizer([{"params": params, "runs": RUNS, **hyper}], backend=backend,
                             capturable=True)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.shape == (RUNS,) and lr.device.type == device
    alone = [([p.detach()[r].clone().requires_grad_() for p in params], r) for r in range(RUNS)]
    alone = [(ps, FusedEMCLOptimizer([{"params": ps, **run_values(hyper, r)}], backend=backend))
             for ps, r in alone]
    gen = torch.Generator().manual_seed(15)
    for n in range(3):
        if n == 1:
            opt.param_groups[0]["lr"][2] = 0.004       # in place, in the device table
            alone[2][1].param_groups[0]["lr"] = 0.004
        step_both(params, opt, alone, gen)
        assert_runs_equal(params, opt, alone, f"step {n}")
    assert opt.state_dict()["param_groups"][0]["lr"] == [0.05, 0.03, 0.004]
