"""Misuse a hostile new user tries (the reliability issue), class by class: each is refused with a
clear error before anything is written, or works; numbers cannot blow up; copies keep
everything. On every backend that runs here (reliability_support.BACKEND_DEVICES)."""
import copy
import io
import pickle

import pytest
import torch

from emcl_kernels import FusedEMCLOptimizer
from emcl_kernels import functional as F
from emcl_kernels.validation import GROUP_NAMES
from reliability_support import (BACKEND_DEVICES, BACKEND_IDS, TinyNet, assert_optimizer_unchanged,
                                 backward, optimizer_snapshot, same_bits)

INNER = dict(inner_lr=0.1, reg=1.0, gamma=0.3)
META = dict(meta_lr=0.1, reg=1.0, decay=0.9, lr_scale=0.5, lr_mode="recurrent")
pytestmark = pytest.mark.parametrize("backend, device", BACKEND_DEVICES, ids=BACKEND_IDS)


def _lists(device, n=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(device)
    return dict(p=p, g=torch.randn(n, generator=gen).to(device), a=p + 0.1,
                h=torch.rand(n, generator=gen).to(device) + 0.1,
                lr=torch.full((n,), 0.05, device=device))


def _step(which, backend, params, grads, anchors, importances, meta_lrs):
    if which == "inner":
        return F.inner_step_(params, grads, anchors, importances, backend=backend, **INNER)
    return F.inner_meta_step_(params, grads, anchors, importances, meta_lrs, backend=backend,
                              **INNER, **{k: v for k, v in META.items() if k != "reg"})


# ---------------------------------------------------------------------------------------------
# Aliasing: a tensor in two roles, shared state, overlapping views
# ---------------------------------------------------------------------------------------------

def _alias_cases(t):
    p, g, a, h, lr = t["p"], t["g"], t["a"], t["h"], t["lr"]
    q, g2, a2, h2, lr2 = p + 1, g + 1, a + 1, h + 1, lr + 0.01
    big = torch.randn(20, device=p.device)
    return {
        "param as its anchor": ([p], [g], [p], [h], [lr], r"params\[0\] and anchors\[0\]"),
        "grad as the param": ([p], [p], [a], [h], [lr], r"params\[0\] and grads\[0\]"),
        "importance as the anchor": ([p], [g], [a], [a], [lr], r"anchors\[0\] and importances\[0\]"),
        "meta_lr as the importance": ([p], [g], [a], [h], [h], r"importances\[0\] and meta_lrs\[0\]"),
        "anchor a view of the param": ([p], [g], [p.view(2, 5).view(-1)], [h], [lr],
                                       r"params\[0\] and anchors\[0\]"),
        "one anchor for two params": ([p, q], [g, g2], [a, a], [h, h2], [lr, lr2],
                                      r"anchors\[0\] and anchors\[1\]"),
        "overlapping params": ([big[:10], big[5:15]], [g, g2], [a, a2], [h, h2], [lr, lr2],
                               r"params\[0\] and params\[1\] overlap"),
        "overlapping anchors": ([p, q], [g, g2], [big[:10], big[8:18]], [h, h2], [lr, lr2],
                                r"anchors\[0\] and anchors\[1\] overlap"),
    }


@pytest.mark.parametrize("which", ("inner", "inner_meta"))
@pytest.mark.parametrize("case", list(_alias_cases(_lists("cpu"))))
def test_a_tensor_in_two_roles_is_refused_before_writing(backend, device, which, case):
    t = _lists(device)
    params, grads, anchors, importances, meta_lrs, match = _alias_cases(t)[case]
    if which == "inner" and "meta_lr" in case:
        pytest.skip("the inner step has no meta_lrs")
    everything = [x for lst in (params, grads, anchors, importances, meta_lrs) for x in lst]
    before = [x.clone() for x in everything]
    with pytest.raises(ValueError, match=match):
        _step(which, backend, params, grads, anchors, importances, meta_lrs)
    for b, x in zip(before, everything):
        assert torch.equal(b, x), "a tensor was written although the call was refused"


def test_overlapping_parameters_are_refused_by_the_optimizer(backend, device):
    w = torch.nn.Parameter(torch.randn(10, device=device))
    v = torch.nn.Parameter(w.data[2:8])
    with pytest.raises(ValueError, match="parameter 0 of param group 0 and parameter 1 of "
                                         "param group 0 overlap in memory"):
        FusedEMCLOptimizer([w, v], backend=backend)
    with pytest.raises(ValueError, match="overlap in memory"):
        FusedEMCLOptimizer([{"params": [w]}, {"params": [v]}], backend=backend)


# ---------------------------------------------------------------------------------------------
# Hyper-parameters: one domain, every form, every backend; nothing written in any group
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over, match", [
    (dict(meta_lr=1e38), r"meta_lr \* .* past the largest float32"),
    (dict(lr_scale=1e38), r"meta_lr \* lr_scale .* past the largest float32"),
    (dict(reg=1e38, gamma=1e3), r"gamma \* reg = .* past the largest float32"),
    (dict(eps=1e-40), "eps must be in"),
    (dict(lr_max=1e300), "lr_max must be in"),
    (dict(reg=1e300), "reg must be in"),
    (dict(lr_min=torch.tensor(0.5), lr_max=torch.tensor(0.1)), r"lr_max \(0.1\) must be >= lr_min"),
    (dict(reg=torch.tensor([2.0])), "0-d floating-point tensor"),
])
def test_out_of_domain_values_in_a_later_group_write_nothing(backend, device, over, match):
    model = TinyNet(device=device)
    opt = FusedEMCLOptimizer([{"params": model.fc1.parameters()},
                              {"params": model.fc2.parameters()}], backend=backend,
                             meta_every=1, lr_mode="recurrent", lr_max=1.0)
    backward(model, 0)
    opt.step()
    backward(model, 1)
    for k, v in over.items():  # a param group spells β and r as lr and meta_lr_scale
        opt.param_groups[1][GROUP_NAMES.get(k, k)] = v
    before = optimizer_snapshot(opt)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step()
    assert_optimizer_unchanged(before, opt)
    with pytest.raises((ValueError, TypeError), match=match):
        F.inner_meta_step_(*_group_lists(opt), **{**INNER, **META, "lr_max": 1.0, **over},
                           backend=backend)


def _group_lists(opt):
    ps = [p for g in opt.param_groups for p in g["params"]]
    return (ps, [p.grad for p in ps], [opt.state[p]["anchor"] for p in ps],
            [opt.state[p]["importance"] for p in ps], [opt.state[p]["meta_lr"] for p in ps])


def test_huge_parameters_and_dead_units_stay_finite(backend, device):
    """|θ| ~ 1e30 under a strong pull, and units with g = 0, h = 0 at the smallest eps: every
    tensor stays finite through the optimizer, in every lr_mode."""
    for lr_mode in ("recurrent", "inverse", "constant"):
        model = TinyNet(device=device)
        with torch.no_grad():
            model.fc1.weight.mul_(1e30)
        opt = FusedEMCLOptimizer(model.parameters(), backend=backend, meta_every=2,
                                 lr_mode=lr_mode, eps=torch.finfo(torch.float32).tiny,
                                 reg=1e3, gamma=1.0)
        for seed in range(4):
            backward(model, seed)
            model.fc2.bias.grad.zero_()  # a dead unit
            opt.step()
        for p in model.parameters():
            st = opt.state[p]
            for t in (p, st["anchor"], st["importance"]):
                assert torch.isfinite(t).all(), f"{lr_mode}: a non-finite value"


# ---------------------------------------------------------------------------------------------
# Checkpoints: what load_state_dict refuses, with the optimizer unchanged
# ---------------------------------------------------------------------------------------------

def _trained(backend, device, **kw):
    model = TinyNet(device=device)
    opt = FusedEMCLOptimizer(model.parameters(), backend=backend, meta_every=2,
                             lr_mode="recurrent", lr_max=1.0, **kw)
    for seed in range(3):
        backward(model, seed)
        opt.step()
    return model, opt


def _bad_state(sd, edit):
    sd = copy.deepcopy(sd)
    edit(sd)
    return sd


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd["state"][0]["anchor"].view(-1).__setitem__(3, float("nan")), "inf or a NaN"),
    (lambda sd: sd["state"][0]["importance"].view(-1).__setitem__(0, -1.0), "negative values"),
    (lambda sd: sd["state"][1].__setitem__("step", torch.tensor([1.0, 2.0])), "one number"),
    (lambda sd: sd["state"][1].__setitem__("step", torch.tensor(1.5)), "whole number"),
    (lambda sd: sd["state"][1].pop("step"), "has keys"),
    (lambda sd: sd["emcl"].__setitem__("step_calls", -5), r"emcl\['step_calls'\] must be a whole"),
    (lambda sd: sd["emcl"].__setitem__("step_calls", "x"), r"emcl\['step_calls'\] must be a whole"),
    (lambda sd: sd["emcl"].__setitem__("skipped_steps", 1.7), r"emcl\['skipped_steps'\] must be"),
    (lambda sd: sd.__setitem__("emcl", None), "'emcl' entry must be a dict"),
    (lambda sd: sd["state"][0].__setitem__("meta_lr", torch.zeros(3)), "has shape"),
])
def test_bad_checkpoints_are_refused_with_the_optimizer_unchanged(backend, device, edit, match):
    _, opt = _trained(backend, device)
    model2, opt2 = _trained(backend, device)
    before = optimizer_snapshot(opt2)
    with pytest.raises(ValueError, match=match):
        opt2.load_state_dict(_bad_state(opt.state_dict(), edit))
    assert_optimizer_unchanged(before, opt2)


def test_a_non_contiguous_saved_anchor_is_loaded_in_the_parameter_layout(backend, device):
    model, opt = _trained(backend, device)
    sd = opt.state_dict()
    a = sd["state"][0]["anchor"]
    sd["state"][0]["anchor"] = a.t().contiguous().t()  # same values, transposed memory
    model2, opt2 = _trained(backend, device)
    opt2.load_state_dict(sd)
    w = model2.fc1.weight
    assert opt2.state[w]["anchor"].stride() == w.stride()
    assert torch.equal(opt2.state[w]["anchor"], a)
    backward(model2, 5)
    opt2.step()  # and it keeps stepping


# ---------------------------------------------------------------------------------------------
# Copies keep everything
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ("deepcopy", "pickle", "torch.save"))
def test_copies_keep_settings_and_counters(backend, device, how):
    model, opt = _trained(backend, device, check_finite=False)
    if how == "deepcopy":
        pair = copy.deepcopy((model, opt))
    elif how == "pickle":
        pair = pickle.loads(pickle.dumps((model, opt)))
    else:
        buf = io.BytesIO()
        torch.save((model, opt), buf)
        buf.seek(0)
        pair = torch.load(buf, weights_only=False)
    model2, opt2 = pair
    assert (opt2.meta_every, opt2.backend, opt2.check_finite) == (2, backend, False)
    assert (opt2._step_calls, opt2.skipped_steps) == (3, 0)
    for m, o in ((model, opt), (model2, opt2)):
        backward(m, 7)
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert same_bits(p, q)
        assert same_bits(opt.state[p]["step"], opt2.state[q]["step"])


# ---------------------------------------------------------------------------------------------
# Messages a model user can act on
# ---------------------------------------------------------------------------------------------

def test_meta_device_parameters_say_so(backend, device):
    model = torch.nn.Linear(3, 2, device="meta")
    opt = FusedEMCLOptimizer(model.parameters(), backend=backend)  # building is fine
    model.weight.grad = torch.zeros(2, 3, device="meta")
    with pytest.raises(RuntimeError, match="meta device, so it holds no data: materialize"):
        opt.step()


def test_numpy_bools_and_missing_keys(backend, device):
    np = pytest.importorskip("numpy")
    model = TinyNet(device=device)
    opt = FusedEMCLOptimizer(model.parameters(), backend=backend, prox=np.bool_(False))
    backward(model, 0)
    opt.step()
    with pytest.raises(ValueError, match=r"lacks the hyper-parameter\(s\) reg; "):
        opt.load_state_dict(_bad_state(opt.state_dict(),
                                       lambda sd: sd["param_groups"][0].pop("reg")))


def test_a_model_converted_after_its_state_was_made(backend, device):
    model, opt = _trained(backend, device)
    model.double()
    backward(model, 4)
    before = optimizer_snapshot(opt)
    with pytest.raises(RuntimeError, match=r"changed dtype after its state was made"):
        opt.step()
    assert_optimizer_unchanged(before, opt)


def test_channels_last_convolutions_train(backend, device):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(device).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv).to(memory_format=torch.contiguous_format)
    x = torch.randn(2, 3, 6, 6, device=device)
    outs = []
    for c in (conv, ref):
        opt = FusedEMCLOptimizer(c.parameters(), backend=backend, meta_every=2)
        for _ in range(3):
            c(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        outs.append(c.weight)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)


def test_sparse_embeddings_and_integer_parameters_are_refused_clearly(backend, device):
    emb = torch.nn.Embedding(10, 3, sparse=True).to(device)
    opt = FusedEMCLOptimizer(emb.parameters(), backend=backend)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients are not supported.*sparse=False"):
        opt.step()
    assert not opt.state, "state was made for a refused step"
    with pytest.raises(TypeError, match="updates floating-point parameters"):
        FusedEMCLOptimizer([torch.nn.Parameter(torch.ones(3, dtype=torch.long),
                                               requires_grad=False)], backend=backend)
