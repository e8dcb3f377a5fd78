"""Misuse of the optimizer: each case either works as a torch user expects or
raises a clear error, and none corrupts state."""
import pytest
import torch

from emcl_kernels import FusedEMCLOptimizer
from emcl_kernels import functional as F
from emcl_kernels import reference as R
from emcl_testing import assert_close
from reliability_support import (BACKEND_DEVICES, BACKEND_IDS, TinyNet,
                                 assert_optimizer_unchanged, backward, optimizer_snapshot,
                                 same_bits)

HP = dict(meta_lr=0.2, inner_lr=0.05, reg=1.5, gamma=0.3, decay=0.8, lr_scale=0.6)


def _opt(params, backend, **kw):
    return FusedEMCLOptimizer(params, backend=backend, **{**HP, **kw})


def _refused(opt, fn, exc, match):
    before = optimizer_snapshot(opt)
    with pytest.raises(exc, match=match):
        fn()
    assert_optimizer_unchanged(before, opt)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_same_tensor_twice(backend, device):
    model = TinyNet(device=device)
    w, b = model.fc1.weight, model.fc1.bias
    with pytest.raises(ValueError, match="more than one parameter group"):
        _opt([{"params": [w]}, {"params": [w, b]}], backend)
    with pytest.raises(ValueError, match="parameter 0 of param group 0 and parameter 2 of "
                                         "param group 0 are the same memory"):
        _opt([w, b, w], backend)
    storage = torch.randn(10, device=device)
    a, c = torch.nn.Parameter(storage[:5]), torch.nn.Parameter(storage[:5].view(5, 1))
    with pytest.raises(ValueError, match="are the same memory"):
        _opt([{"params": [a]}, {"params": [c]}], backend)
    opt = _opt([w], backend)
    backward(model, 0)
    opt.step()
    _refused(opt, lambda: opt.add_param_group({"params": [b, w]}), ValueError, "appear")
    _refused(opt, lambda: opt.add_param_group({"params": [b], "reg": -2.0}), ValueError, "reg")
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("call", ("step", "meta_step", "inner_meta_step"))
def test_mixed_dtypes_in_one_group(backend, device, call):
    """fp32, bf16, fp16 and fp64 parameters in one group: each is updated as the reference
    updates it alone (one backend call per (device, dtype) inside)."""
    gen = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.float32)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device=device, dtype=dt))
              for n, dt in zip((7, 33, 5, 64, 1), dtypes)]
    ref = [p.detach().clone() for p in params]
    ref_state = [(R.compute_dtype(p.dtype), p.detach().to(R.compute_dtype(p.dtype), copy=True))
                 for p in params]
    ref_state = [(a, torch.zeros_like(a)) for _, a in ref_state]
    opt = _opt(params, backend)
    for s in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
                 for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        getattr(opt, call)()
        for i, (p, g) in enumerate(zip(ref, grads)):
            anchor, imp = ref_state[i]
            kw = dict(meta_lr=HP["meta_lr"], reg=HP["reg"], decay=HP["decay"],
                      lr_scale=HP["lr_scale"], lr_mode="inverse")
            if call == "step":
                R.inner_step_(p, g, anchor, imp, inner_lr=HP["inner_lr"], reg=HP["reg"],
                              gamma=HP["gamma"])
            elif call == "meta_step":
                R.meta_step_(p, g, anchor, imp, None, **kw)
            else:
                R.inner_meta_step_(p, g, anchor, imp, None, inner_lr=HP["inner_lr"],
                                   gamma=HP["gamma"], **kw)
        for i, (p, r) in enumerate(zip(params, ref)):
            assert p.dtype == dtypes[i]
            assert_close(p, r, p.dtype, f"{call} step {s} param {i} ({p.dtype})")
            assert_close(opt.state[p]["anchor"], ref_state[i][0], p.dtype, f"anchor {i}")
            assert_close(opt.state[p]["importance"], ref_state[i][1], p.dtype, f"importance {i}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mixed_devices_in_one_group():
    cpu = TinyNet(seed=1)
    gpu = TinyNet(seed=2, device="cuda")
    twin_cpu, twin_gpu = TinyNet(seed=1), TinyNet(seed=2, device="cuda")
    opt = _opt(list(cpu.parameters()) + list(gpu.parameters()), "auto", meta_every=2)
    twins = [_opt(twin_cpu.parameters(), "auto", meta_every=2),
             _opt(twin_gpu.parameters(), "auto", meta_every=2)]
    for s in range(6):
        for m in (cpu, gpu, twin_cpu, twin_gpu):
            backward(m, s)
        opt.step()
        for t in twins:
            t.step()
    for m, t in ((cpu, twin_cpu), (gpu, twin_gpu)):
        for p, q in zip(m.parameters(), t.parameters()):
            assert_close(p, q, torch.float32, "mixed devices")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_params_added_after_state_exists(backend, device):
    """A group added after some steps equals having had it from the start with no gradients
    until it was added: its parameters get state at their first step."""
    late, twin = TinyNet(seed=3, device=device), TinyNet(seed=3, device=device)
    first, second = list(late.parameters())[:2], list(late.parameters())[2:]
    opt = _opt(first, backend, meta_every=2)
    tfirst, tsecond = list(twin.parameters())[:2], list(twin.parameters())[2:]
    topt = _opt([{"params": tfirst}, {"params": tsecond, "inner_lr": 0.02}], backend,
                meta_every=2)
    for s in range(7):
        for m, ps in ((late, second), (twin, tsecond)):
            backward(m, s)
            if s < 3:
                for p in ps:
                    p.grad = None
        if s == 3:
            assert all(p not in opt.state for p in second)
            opt.add_param_group({"params": second, "inner_lr": 0.02})
        opt.step()
        topt.step()
    for p, q in zip(late.parameters(), twin.parameters()):
        assert same_bits(p, q)
        for k in topt.state[q]:
            assert same_bits(opt.state[p][k], topt.state[q][k]), k
    assert opt.state[second[0]]["step"].item() == 2 and opt.state[first[0]]["step"].item() == 3


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_frozen_parameters(backend, device):
    model = TinyNet(seed=4, device=device)
    model.fc1.weight.requires_grad_(False)
    opt = _opt(model.parameters(), backend, meta_every=2)
    frozen = model.fc1.weight.detach().clone()
    for s in range(4):
        backward(model, s)
        opt.step()
    assert same_bits(model.fc1.weight, frozen) and model.fc1.weight not in opt.state
    # freezing a parameter that has state keeps the state as it is, and unfreezing resumes
    bias = model.fc1.bias
    state = {k: v.clone() for k, v in opt.state[bias].items()}
    value = bias.detach().clone()
    bias.requires_grad_(False)
    for s in range(4, 8):
        backward(model, s)
        opt.step()
    assert same_bits(bias, value)
    assert all(same_bits(opt.state[bias][k], v) for k, v in state.items())
    bias.requires_grad_(True)
    backward(model, 9)
    opt.meta_step()
    assert opt.state[bias]["step"].item() == state["step"].item() + 1


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
@pytest.mark.parametrize("importance", ("taylor", "si"))
def test_meta_step_before_any_inner_step(backend, device, importance):
    """With no inner step the fast weight is the anchor: the meta step moves nothing, and the
    importance takes its first value, (1 - decay) * |g * θ| (Taylor) or 0 (SI)."""
    model = TinyNet(seed=5, device=device)
    opt = _opt(model.parameters(), backend, importance=importance)
    backward(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.meta_step()
    for p, b in zip(model.parameters(), before):
        st = opt.state[p]
        assert_close(p, b, torch.float32, "param")
        assert_close(st["anchor"], b, torch.float32, "anchor")
        want = (1 - HP["decay"]) * (p.grad * b).abs() if importance == "taylor" \
            else torch.zeros_like(b)
        assert_close(st["importance"], want, torch.float32, "importance")
        assert st["step"].item() == 1


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_hyperparameters_changed_through_param_groups(backend, device):
    model, twin = TinyNet(seed=6, device=device), TinyNet(seed=6, device=device)
    p = list(model.parameters())
    opt = _opt([{"params": p[:2]}, {"params": p[2:]}], backend)
    topt = _opt(twin.parameters(), backend)
    for m in (model, twin):
        backward(m, 0)
    opt.step()
    topt.step()
    # a valid change takes effect at the next step, as in torch
    for group in opt.param_groups + topt.param_groups:
        group["lr"] = 0.01
        group["lr_mode"] = "recurrent"       # meta_lr state appears, starting at meta_lr
    for m in (model, twin):
        backward(m, 1)
    opt.inner_meta_step()
    topt.inner_meta_step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert same_bits(a, b)
        assert same_bits(opt.state[a]["meta_lr"], topt.state[b]["meta_lr"])
    # an invalid change (in the second group) is refused before the first group is written
    backward(model, 2)
    for key, value, exc in (("reg", -1.0, ValueError), ("lr", float("nan"), ValueError),
                            ("decay", 1.5, ValueError), ("gamma", "0.1", TypeError),
                            ("lr_mode", "cosine", ValueError), ("prox", 1, TypeError),
                            ("meta_lr", torch.tensor([0.1, 0.2]), TypeError)):
        good = opt.param_groups[1][key]
        for call in (opt.step, opt.meta_step, opt.inner_meta_step):
            before = optimizer_snapshot(opt)
            opt.param_groups[1][key] = value
            with pytest.raises(exc, match=key):
                call()
            opt.param_groups[1][key] = good
            assert_optimizer_unchanged(before, opt)
    del opt.param_groups[1]["gamma"]
    _refused(opt, opt.step, ValueError, "lacks the hyper-parameter")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_bad_tensors_in_a_later_group_write_nothing(backend, device):
    """A gradient that functional refuses (another dtype, sparse, non-contiguous) in the second
    group stops the step before the first group is written."""
    model = TinyNet(seed=7, device=device)
    p = list(model.parameters())
    opt = _opt([{"params": p[:2]}, {"params": p[2:]}], backend)
    backward(model, 0)
    opt.step()
    w = model.fc2.weight
    cases = [(torch.float64, lambda: torch.randn(w.shape, dtype=torch.float64, device=device),
              TypeError, "dtype"),
             (None, lambda: torch.randn(w.shape[::-1], device=device).t(), RuntimeError,
              "strides"),
             (None, lambda: torch.randn(w.shape, device=device).to_sparse(), RuntimeError,
              "sparse")]
    for grad_dtype, make, exc, match in cases:
        backward(model, 1)
        w.grad = None
        w.grad_dtype = grad_dtype   # torch lets a gradient have another dtype only like this
        w.grad = make()
        for call in (opt.step, opt.meta_step):
            _refused(opt, call, exc, match)
        w.grad = None
        w.grad_dtype = None


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_no_gradients_and_closure(backend, device):
    model = TinyNet(seed=8, device=device)
    opt = _opt(model.parameters(), backend, meta_every=2)
    before = optimizer_snapshot(opt)
    opt.step()
    opt.meta_step()                              # nothing has a gradient: nothing happens
    before["counters"] = (1, 0)
    assert_optimizer_unchanged(before, opt)
    x = torch.randn(4, 5, device=device)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert opt.state[model.fc1.weight]["step"].item() == 3


def test_functional_misuse_raises_before_writing():
    """The functional API refuses the same tensor twice and a meta step without meta_lrs in
    recurrent mode, before writing anything."""
    p = torch.randn(5)
    a, h = p.clone(), torch.rand(5)
    g = torch.randn(5)
    before = [p.clone(), a.clone(), h.clone()]
    with pytest.raises(ValueError, match="are the same memory"):
        F.inner_step_([p, p], [g, g], [a, a.clone()], [h, h.clone()], inner_lr=0.1, reg=1.0,
                      gamma=0.1)
    with pytest.raises(ValueError, match="meta_lrs"):
        F.meta_step_([p], [g], [a], [h], None, meta_lr=0.1, reg=1.0, decay=0.9, lr_scale=1.0,
                     lr_mode="recurrent")
    for b, t in zip(before, (p, a, h)):
        assert same_bits(b, t)
