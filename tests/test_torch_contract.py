"""FusedEMCLOptimizer keeps torch's optimizer contract (SPEC section 3):

* every param group holds ``lr`` (β, the inner learning rate), the rate torch's LR schedulers
  drive; every scheduler of ``torch.optim.lr_scheduler`` runs on it, gives the rates it gives
  SGD, and the update at each step is the reference's at that rate; the ``inner_lr`` keyword
  and checkpoints written with it still work;
* state_dict / load_state_dict hooks run as for torch's optimizers (the generic checks torch
  runs on its own optimizers, here beside ``torch.optim.SGD``);
* an option a param group may not set is refused, never kept and ignored; ``weight_decay`` is
  accepted at 0 and refused otherwise;
* the paper's two updates are ``step(update=...)`` calls (step hooks and wrappers see them);
* tensors that start all zero are named in a warning, and ``zero_aware_groups`` trains them.
"""
from __future__ import annotations

import inspect
import io
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as S

from emcl_kernels import (FusedEMCLOptimizer, ZeroParameterWarning, functional as F,
                          zero_aware_groups)
from reliability_support import BACKEND_DEVICES, BACKEND_IDS, same_bits

HP = dict(meta_lr=0.3, reg=2.0, gamma=0.4, decay=0.7, lr_scale=0.5, lr_mode="inverse")
LR = 0.05
STEPS = 9
META_EVERY = 3


def _params(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(device))
            for s in ((7, 5), (5,), (3,))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


# every scheduler of torch.optim.lr_scheduler, made the way a user makes it (the optimizers
# without momentum take CyclicLR and OneCycleLR with cycle_momentum=False, as SGD(momentum=0)
# users do when they have no betas either)
SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda s: 0.9 ** s),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda s: 0.8),
    "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=3),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.2, total_iters=4),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.8),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.1, total_iters=3), S.CosineAnnealingLR(o, T_max=6)],
        milestones=[3]),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=5),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.StepLR(o, 2, 0.5),
                                                      S.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2,
                                     cycle_momentum=False),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=STEPS,
                                         cycle_momentum=False),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=6, power=2.0),
}


def _all_schedulers() -> set:
    found, todo = set(), [S.LRScheduler]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__ == S.__name__ and not sub.__name__.startswith("_"):
                found.add(sub.__name__)
                todo.append(sub)
    return found | {"ReduceLROnPlateau"}


def test_every_torch_scheduler_is_covered():
    """A scheduler that a new torch adds fails here until it is in SCHEDULERS."""
    assert _all_schedulers() <= set(SCHEDULERS), _all_schedulers() - set(SCHEDULERS)


def _advance(sched, step):
    if isinstance(sched, S.ReduceLROnPlateau):
        sched.step(1.0)  # a metric that never improves: the rate halves every step
    else:
        sched.step()


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_drives_lr_as_for_sgd_and_the_update_is_the_references(name, backend, device):
    params = _params(device)
    opt = FusedEMCLOptimizer(params, lr=LR, meta_every=META_EVERY, backend=backend, **HP)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    sgd = torch.optim.SGD(twin, lr=LR)
    sched, sgd_sched = SCHEDULERS[name](opt), SCHEDULERS[name](sgd)
    # the reference, stepped by hand with the rate the scheduler gives SGD
    theta = [p.detach().double().clone() for p in params]
    anchors = [t.clone() for t in theta]
    imps = [torch.zeros_like(t) for t in theta]
    rates = []
    for step in range(STEPS):
        grads = _grads(step, params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        rate = sgd.param_groups[0]["lr"]
        assert opt.param_groups[0]["lr"] == pytest.approx(rate, rel=1e-12, abs=0.0)
        rates.append(rate)
        opt.step()
        sgd.step()
        kw = dict(inner_lr=rate, reg=HP["reg"], gamma=HP["gamma"], backend="reference")
        g64 = [g.double() for g in grads]
        if (step + 1) % META_EVERY == 0:
            F.inner_meta_step_(theta, g64, anchors, imps, None, meta_lr=HP["meta_lr"],
                               decay=HP["decay"], lr_scale=HP["lr_scale"],
                               lr_mode=HP["lr_mode"], **kw)
        else:
            F.inner_step_(theta, g64, anchors, imps, **kw)
        for p, t in zip(params, theta):
            torch.testing.assert_close(p.detach().double(), t, rtol=1e-5, atol=1e-6,
                                       msg=f"{name} step {step}")
        _advance(sched, step)
        _advance(sgd_sched, step)
    assert len(set(rates)) > 1, f"{name} never changed the rate: the test shows nothing"


def test_a_schedule_to_zero_stops_the_inner_steps():
    """The rate is not kept and ignored: LambdaLR to 0 and the inner steps write nothing."""
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = FusedEMCLOptimizer(params, lr=0.1, **HP)
    sched = S.LambdaLR(opt, lambda s: 0.0)
    for step in range(3):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
        sched.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("name", ["StepLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR"])
def test_scheduler_and_optimizer_resume_bit_identical(name):
    def train(opt, sched, params, steps):
        for step in steps:
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            opt.step()
            _advance(sched, step)

    params = _params()
    opt = FusedEMCLOptimizer(params, lr=LR, meta_every=META_EVERY, **HP)
    sched = SCHEDULERS[name](opt)
    train(opt, sched, params, range(STEPS))
    # the same run, saved after 4 steps and resumed in new objects
    params2 = _params()
    opt2 = FusedEMCLOptimizer(params2, lr=LR, meta_every=META_EVERY, **HP)
    sched2 = SCHEDULERS[name](opt2)
    train(opt2, sched2, params2, range(4))
    buf = io.BytesIO()
    torch.save({"opt": opt2.state_dict(), "sched": sched2.state_dict(),
                "params": [p.detach().clone() for p in params2]}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    params3 = _params(seed=9)
    with torch.no_grad():
        for p, q in zip(params3, ck["params"]):
            p.copy_(q)
    opt3 = FusedEMCLOptimizer(params3, lr=1.0, meta_every=META_EVERY, **HP)
    sched3 = SCHEDULERS[name](opt3)
    opt3.load_state_dict(ck["opt"])
    sched3.load_state_dict(ck["sched"])
    train(opt3, sched3, params3, range(4, STEPS))
    for a, b in zip(params, params3):
        assert same_bits(a.detach(), b.detach())
    for a, b in zip(params, params3):
        for key in opt.state[a]:
            assert same_bits(opt.state[a][key], opt3.state[b][key]), key
    assert opt.param_groups[0]["lr"] == opt3.param_groups[0]["lr"]


# -- lr, inner_lr and old checkpoints ------------------------------------------------------------

def test_lr_is_beta_and_inner_lr_is_the_same_keyword():
    a = FusedEMCLOptimizer(_params(), lr=0.02)
    b = FusedEMCLOptimizer(_params(), inner_lr=0.02)
    c = FusedEMCLOptimizer(_params(), 0.02)          # second positional, as in torch
    for opt in (a, b, c):
        assert opt.param_groups[0]["lr"] == 0.02 and "inner_lr" not in opt.param_groups[0]
    assert FusedEMCLOptimizer(_params()).param_groups[0]["lr"] == 0.075
    with pytest.raises(ValueError, match="both lr=0.02 and inner_lr=0.03"):
        FusedEMCLOptimizer(_params(), lr=0.02, inner_lr=0.03)
    with pytest.raises(TypeError):
        FusedEMCLOptimizer(_params(), 0.02, 0.1)     # the rest is keyword-only
    groups = FusedEMCLOptimizer([{"params": _params()[:1], "inner_lr": 0.5},
                                 {"params": _params()[1:], "lr": 0.25}], lr=0.1).param_groups
    assert [g["lr"] for g in groups] == [0.5, 0.25] and all("inner_lr" not in g for g in groups)


def test_inner_lr_set_on_a_group_later_is_refused_not_ignored():
    params = _params()
    opt = FusedEMCLOptimizer(params, lr=0.1, **HP)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()
    opt.param_groups[0]["inner_lr"] = 0.01
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"under 'lr'.*set group\['lr'\]"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_a_checkpoint_saved_with_inner_lr_loads():
    """State dicts written when param groups held β as ``inner_lr`` and r as ``lr_scale``
    (before ``lr`` and ``meta_lr_scale``) load."""
    params = _params()
    opt = FusedEMCLOptimizer(params, lr=0.04, meta_every=2, **HP)
    for step in range(3):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    renamed = {"lr": "inner_lr", "meta_lr_scale": "lr_scale"}
    old = {**sd, "param_groups": [{renamed.get(k, k): v for k, v in g.items()
                                   if k != "weight_decay"} for g in sd["param_groups"]]}
    fresh = FusedEMCLOptimizer(_params(), lr=0.9, meta_every=2, **HP)
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["lr"] == 0.04 and "inner_lr" not in fresh.param_groups[0]
    assert fresh.param_groups[0]["meta_lr_scale"] == HP["lr_scale"]
    assert "lr_scale" not in fresh.param_groups[0]
    for a, b in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        assert same_bits(opt.state[a]["anchor"], fresh.state[b]["anchor"])


# -- per-group options and weight decay ------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("meta_every", 5), ("check_finite", False),
                                       ("backend", "no-such-backend"), ("backend", "reference")])
def test_optimizer_wide_options_are_refused_in_a_group(key, value):
    p = _params()
    with pytest.raises(ValueError, match=f"{key}.*option of the whole optimizer"):
        FusedEMCLOptimizer([{"params": p[:1]}, {"params": p[1:], key: value}])
    opt = FusedEMCLOptimizer([{"params": p[:1]}])
    with pytest.raises(ValueError, match=f"{key}.*option of the whole optimizer"):
        opt.add_param_group({"params": p[1:], key: value})
    assert len(opt.param_groups) == 1
    # set later: refused at the next step, before anything is written
    for q, g in zip(p[:1], _grads(0, p[:1])):
        q.grad = g
    opt.param_groups[0][key] = value
    before = p[0].detach().clone()
    with pytest.raises(ValueError, match=key):
        opt.step()
    assert torch.equal(p[0].detach(), before)


def test_every_documented_hyper_parameter_is_honoured_per_group():
    """Each hyper-parameter a group may override changes that group's update and only its
    (β as ``lr`` and r as ``meta_lr_scale``: the constructor's ``lr_scale``)."""
    base = dict(lr=0.05, meta_lr=0.3, reg=2.0, gamma=0.4, decay=0.7, lr_scale=0.5,
                lr_mode="recurrent", lr_min=0.0, lr_max=10.0, eps=1e-8, importance="taylor",
                prox=True)
    other = dict(lr=0.01, meta_lr=0.1, reg=5.0, gamma=0.1, decay=0.2, meta_lr_scale=0.25,
                 lr_mode="inverse", lr_min=2.0, lr_max=0.05, eps=1e-3, importance="si",
                 prox=False)

    def run(group_options):
        params = _params()
        opt = FusedEMCLOptimizer([{"params": params[:2]}, {"params": params[2:], **group_options}],
                                 meta_every=2, backend="reference", **base)
        for step in range(4):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            opt.step()
        return [p.detach().clone() for p in params]

    plain = run({})
    for key, value in other.items():
        changed = run({key: value})
        assert all(torch.equal(a, b) for a, b in zip(changed[:2], plain[:2])), key
        assert not torch.equal(changed[2], plain[2]), f"group {key}={value!r} was ignored"


def test_a_groups_lr_scale_is_timms_and_said_so():
    """``lr_scale`` in a param group is timm's multiplier of ``lr`` (its schedulers apply it);
    EMCL's r is ``meta_lr_scale`` there, and a group that sets only ``lr_scale`` is warned."""
    p = _params()
    opt = FusedEMCLOptimizer(p[:1], lr_scale=0.5)
    assert opt.param_groups[0]["meta_lr_scale"] == 0.5 and "lr_scale" not in opt.param_groups[0]
    with pytest.warns(UserWarning, match="'lr_scale' = 0.25, which FusedEMCLOptimizer does not "
                                         "read.*'meta_lr_scale'"):
        opt.add_param_group({"params": p[1:], "lr_scale": 0.25})
    assert opt.param_groups[1]["meta_lr_scale"] == 0.5


def test_weight_decay_zero_is_accepted_and_nonzero_refused_with_the_reason():
    p = _params()
    opt = FusedEMCLOptimizer([{"params": p[:2], "weight_decay": 0.0},
                              {"params": p[2:], "weight_decay": 0}], weight_decay=0.0)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0]
    with pytest.raises(ValueError, match="weight_decay=0.01.*no weight decay.*anchor"):
        FusedEMCLOptimizer(p, weight_decay=0.01)
    with pytest.raises(ValueError, match="param group 1 has weight_decay=0.1"):
        FusedEMCLOptimizer([{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.1}])
    for q, g in zip(p, _grads(0, p)):
        q.grad = g
    opt.param_groups[1]["weight_decay"] = 1e-4
    with pytest.raises(ValueError, match="weight_decay"):
        opt.step()


# -- hooks (the generic checks torch runs on its optimizers) -----------------------------------------

def _pair():
    """An EMCL optimizer and an SGD beside it, each stepped once."""
    out = []
    for make in (lambda ps: FusedEMCLOptimizer(ps, lr=0.01, meta_every=2),
                 lambda ps: torch.optim.SGD(ps, lr=0.01)):
        params = _params()
        opt = make(params)
        for p, g in zip(params, _grads(0, params)):
            p.grad = g
        opt.step()
        out.append(opt)
    return out


@pytest.mark.parametrize("which", ["emcl", "sgd"])
def test_state_dict_pre_hook_may_add_a_non_parameter_entry(which):
    opt = dict(zip(("emcl", "sgd"), _pair()))[which]

    def pre_hook(optimizer):
        optimizer.state["test"] = 1

    opt.register_state_dict_pre_hook(pre_hook)
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1
    # and the optimizer still steps and saves with that entry in its state
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_dict()["state"]["test"] == 1


@pytest.mark.parametrize("which", ["emcl", "sgd"])
def test_state_dict_post_hook_sees_the_final_dict(which):
    opt = dict(zip(("emcl", "sgd"), _pair()))[which]
    seen = {}

    def post_hook(optimizer, state_dict):
        seen.update(state_dict)
        state_dict["ran_post_hook"] = True
        return state_dict

    opt.register_state_dict_post_hook(post_hook)
    sd = opt.state_dict()
    assert sd["ran_post_hook"]
    if which == "emcl":
        assert "emcl" in seen and seen["emcl"]["step_calls"] == 1
        assert all(st["step"].data_ptr() != opt.state[p]["step"].data_ptr()
                   for p, st in zip(opt.param_groups[0]["params"], sd["state"].values()))


@pytest.mark.parametrize("which", ["emcl", "sgd"])
def test_load_state_dict_pre_hook_may_replace_what_is_loaded(which):
    a, b = (_pair()[0 if which == "emcl" else 1] for _ in range(2))
    sd = a.state_dict()
    changed = {**sd, "param_groups": [dict(g, lr=0.002) for g in sd["param_groups"]],
               "state": {k: ({kk: (vv + 1 if kk in ("anchor", "momentum_buffer") else vv)
                              for kk, vv in st.items()} if isinstance(st, dict) else st)
                         for k, st in sd["state"].items()}}

    def pre_hook(optimizer, state_dict):
        return changed  # a new dict, not the one passed

    b.register_load_state_dict_pre_hook(pre_hook)
    b.load_state_dict(sd)
    assert b.param_groups[0]["lr"] == 0.002
    if which == "emcl":
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            torch.testing.assert_close(b.state[q]["anchor"], a.state[p]["anchor"] + 1)


@pytest.mark.parametrize("which", ["emcl", "sgd"])
def test_load_state_dict_pre_and_post_hooks_run_in_order(which):
    a, b = (_pair()[0 if which == "emcl" else 1] for _ in range(2))
    calls = []

    def pre1(optimizer, state_dict):
        calls.append("pre1")
        state_dict["param_groups"][0]["lr"] = 0.002

    def pre2(optimizer, state_dict):
        calls.append("pre2")
        state_dict["param_groups"][0]["lr"] = 0.003

    def post(optimizer):
        calls.append("post")
        optimizer.state["ran_post"] = optimizer.param_groups[0]["lr"] == 0.003

    b.register_load_state_dict_pre_hook(pre2)
    b.register_load_state_dict_pre_hook(pre1, prepend=True)
    b.register_load_state_dict_post_hook(post)
    b.load_state_dict(a.state_dict())
    assert calls == ["pre1", "pre2", "post"] and b.state["ran_post"] is True


def test_hooks_survive_copies_of_the_optimizer():
    """EMCL's own state_dict post-hook is back after a deepcopy/pickle (torch drops hooks)."""
    import copy
    opt = _pair()[0]
    clone = copy.deepcopy(opt)
    assert "emcl" in clone.state_dict()


# -- one step method ---------------------------------------------------------------------------------

def test_inner_and_meta_steps_go_through_step_and_its_hooks():
    params = _params()
    opt = FusedEMCLOptimizer(params, lr=0.05, **HP)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(kwargs.get("update")))
    twin = _params()
    ref = FusedEMCLOptimizer(twin, lr=0.05, **HP)
    for step, (mine, theirs) in enumerate([(opt.inner_step, lambda: ref.step(update="inner")),
                                           (opt.meta_step, lambda: ref.step(update="meta")),
                                           (opt.inner_meta_step,
                                            lambda: ref.step(update="inner_meta"))]):
        for ps in (params, twin):
            for p, g in zip(ps, _grads(step, ps)):
                p.grad = g
        mine()
        theirs()
    assert seen == ["inner", "meta", "inner_meta"]
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(params, twin))
    with pytest.raises(ValueError, match="update must be None"):
        opt.step(update="outer")


def test_a_scheduler_after_inner_steps_does_not_warn_about_the_call_order():
    params = _params()
    opt = FusedEMCLOptimizer(params, lr=0.05, **HP)
    sched = S.StepLR(opt, 1)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.inner_step()
        opt.meta_step()
        sched.step()


# -- zero-initialised parameters -----------------------------------------------------------------------

def _zero_bias_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias.zero_()
        model[2].bias.zero_()
    return model


def _train(model, opt, steps=12):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_zero_tensors_are_named_in_one_warning_and_stay_zero_under_taylor():
    model = _zero_bias_model()
    opt = FusedEMCLOptimizer(model.named_parameters(), lr=0.1, meta_every=1, meta_lr=0.5)
    with pytest.warns(ZeroParameterWarning, match=r"2 parameter tensor\(s\).*'0.bias' \(8,\), "
                                                   r"'2.bias' \(3,\).*zero_aware_groups") as rec:
        _train(model, opt)
    assert len([w for w in rec if issubclass(w.category, ZeroParameterWarning)]) == 1
    assert not model[0].bias.any() and not model[2].bias.any()   # the math, as the warning says
    unnamed = _zero_bias_model()
    with pytest.warns(ZeroParameterWarning, match="parameter 1 of param group 0"):
        _train(unnamed, FusedEMCLOptimizer(unnamed.parameters(), meta_every=1))


def test_zero_aware_groups_train_the_zero_tensors_without_a_warning():
    model = _zero_bias_model()
    groups = zero_aware_groups(model.named_parameters())
    assert [g.get("importance") for g in groups] == [None, "si"]
    assert groups[1]["params"] == [("0.bias", model[0].bias), ("2.bias", model[2].bias)]
    opt = FusedEMCLOptimizer(groups, lr=0.1, meta_every=1, meta_lr=0.5)
    assert opt.param_groups[1]["param_names"] == ["0.bias", "2.bias"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroParameterWarning)
        _train(model, opt)
    assert model[0].bias.abs().min() > 0 and model[2].bias.abs().min() > 0
    # param groups are split group by group, their options kept
    split = zero_aware_groups([{"params": [model[0].weight], "lr": 0.2},
                               {"params": [torch.zeros(3, requires_grad=True)], "lr": 0.3}],
                              lr=0.01)
    assert [(len(g["params"]), g["lr"], g.get("importance")) for g in split] == \
        [(1, 0.2, None), (1, 0.01, "si")]
    with pytest.raises(ValueError, match="no parameters"):
        zero_aware_groups([])


def test_the_signature_reads_like_torch():
    sig = inspect.signature(FusedEMCLOptimizer)
    names = list(sig.parameters)
    assert names[:2] == ["params", "lr"]
    assert all(sig.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names[2:])


def test_grad_scaler_runs_the_papers_steps_through_step_update():
    """``scaler.step(opt, update="meta")``: the paper's steps under a GradScaler equal the
    unscaled ones."""
    finals = []
    for scaled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = FusedEMCLOptimizer(model.parameters(), lr=0.1, meta_lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            for update in ("inner", "meta"):
                loss = model(torch.randn(5, 4, generator=g)).square().mean()
                if scaled:
                    scaler.scale(loss).backward()
                    scaler.step(opt, update=update)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step(update=update)
                opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
