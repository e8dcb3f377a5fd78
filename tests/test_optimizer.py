"""FusedEMCLOptimizer (SPEC section 3) against a hand-written loop over the reference."""
import io

import pytest
import torch
from torch import nn

from emcl_kernels import FusedEMCLOptimizer
from emcl_kernels import reference as R
from reliability_support import BACKEND_DEVICES

HP = dict(meta_lr=0.3, inner_lr=0.05, reg=10.0, gamma=0.3, decay=0.9, lr_scale=0.1,
          lr_mode="inverse")
# every backend that runs here, each on its own device (a "cuda" backend gets CUDA tensors)
BACKENDS = [pytest.param(b, d, id=f"{b}-{d}") for b, d in BACKEND_DEVICES if b != "triton"]


def mlp(seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 4)).to(dtype=dtype,
                                                                         device=device)


def stream(n_batches, seed=1, batch=4, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_batches):
        yield (torch.randn(batch, 12, generator=gen).to(device),
               torch.randint(0, 4, (batch,), generator=gen).to(device))


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def algorithm1(model, opt, batches):
    """The paper's Algorithm 1: one inner step per sample, then the meta step on the batch."""
    for x, y in batches:
        for i in range(len(x)):
            loss_fn(model, x[i:i + 1], y[i:i + 1]).backward()
            opt.inner_step()
            opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.meta_step()
        opt.zero_grad()


def hand_written(model, batches, hp):
    """The same loop, written out over the per-tensor reference with explicit state."""
    params = list(model.parameters())
    anchor = [p.detach().clone() for p in params]
    imp = [torch.zeros_like(p) for p in params]
    alpha = [torch.full_like(p, hp["meta_lr"]) for p in params]
    meta = {k: hp[k] for k in ("meta_lr", "reg", "decay", "lr_scale", "lr_mode", "lr_max")
            if k in hp}
    for x, y in batches:
        for i in range(len(x)):
            grads = torch.autograd.grad(loss_fn(model, x[i:i + 1], y[i:i + 1]), params)
            for p, g, a, h in zip(params, grads, anchor, imp):
                R.inner_step_(p, g, a, h, inner_lr=hp["inner_lr"], reg=hp["reg"],
                              gamma=hp["gamma"])
        grads = torch.autograd.grad(loss_fn(model, x, y), params)
        for p, g, a, h, lr in zip(params, grads, anchor, imp, alpha):
            R.meta_step_(p, g, a, h, lr, **meta)
    return anchor, imp, alpha


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("lr_mode", ["inverse", "recurrent", "constant"])
def test_mlp_matches_hand_written_loop(backend, device, lr_mode):
    hp = dict(HP, lr_mode=lr_mode, lr_scale=0.5 if lr_mode == "recurrent" else 0.1)
    if lr_mode == "recurrent":
        hp.update(lr_max=0.5)
    ours, theirs = mlp(device=device), mlp(device=device)
    opt = FusedEMCLOptimizer(ours.parameters(), backend=backend, **hp)
    algorithm1(ours, opt, stream(6, device=device))
    anchor, imp, alpha = hand_written(theirs, stream(6, device=device), hp)
    for p, q, a, h, lr in zip(ours.parameters(), theirs.parameters(), anchor, imp, alpha):
        st = opt.state[p]
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st["anchor"], a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st["importance"], h, rtol=1e-5, atol=1e-7)
        assert st["step"].item() == 6.0 and st["step"].dtype == torch.float32
        assert st["step"].dim() == 0
        if lr_mode == "recurrent":
            torch.testing.assert_close(st["meta_lr"], lr, rtol=1e-5, atol=1e-7)
        else:
            assert "meta_lr" not in st
    assert float(sum(h.sum() for h in imp)) > 0   # the importance really moved


def test_state_is_lazy_fp32_and_starts_at_the_spec_values():
    model = mlp(dtype=torch.bfloat16)
    opt = FusedEMCLOptimizer(model.parameters(), lr_mode="recurrent", meta_lr=0.25)
    assert len(opt.state) == 0
    before = [p.detach().clone() for p in model.parameters()]
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    opt.inner_step()
    assert len(opt.state) == 1                     # only the parameter that has a gradient
    st = opt.state[model[0].weight]
    assert st["anchor"].dtype == torch.float32
    assert torch.equal(st["anchor"], before[0].float())
    assert torch.count_nonzero(st["importance"]) == 0
    assert torch.all(st["meta_lr"] == 0.25)
    for p, b in zip(list(model.parameters())[1:], before[1:]):
        assert torch.equal(p, b)                   # grad None: skipped


def test_param_groups_have_their_own_hyperparameters():
    model = mlp()
    ref = mlp()
    opt = FusedEMCLOptimizer([{"params": model[0].parameters(), "inner_lr": 0.2},
                              {"params": model[2].parameters()}], inner_lr=0.01, reg=0.0)
    x, y = next(stream(1))
    loss_fn(model, x, y).backward()
    opt.inner_step()
    grads = torch.autograd.grad(loss_fn(ref, x, y), list(ref.parameters()))
    for (p, q, g, lr) in zip(model.parameters(), ref.parameters(), grads,
                             [0.2, 0.2, 0.01, 0.01]):
        torch.testing.assert_close(p, q - lr * g)


def test_step_with_meta_every_fuses_inner_and_meta():
    a, b = mlp(), mlp()
    fused = FusedEMCLOptimizer(a.parameters(), meta_every=3, **HP)
    manual = FusedEMCLOptimizer(b.parameters(), **HP)
    calls = []
    for i, (x, y) in enumerate(stream(7)):
        loss = fused.step(lambda: (fused.zero_grad(), loss_fn(a, x, y).backward(),
                                   calls.append(1), loss_fn(a, x, y))[-1])
        assert loss is not None
        manual.zero_grad()
        loss_fn(b, x, y).backward()
        if (i + 1) % 3 == 0:
            manual.inner_meta_step()
        else:
            manual.inner_step()
    assert len(calls) == 7
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert fused.state[next(a.parameters())]["step"].item() == 2.0


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_resume_is_bit_identical(backend, device, dtype):
    """Save mid-training with torch.save, load into a fresh model and optimizer, go on: the
    parameters are bit-identical to a run that never stopped."""
    hp = dict(HP, lr_mode="recurrent", lr_scale=1.0, lr_max=1.0)
    batches = list(stream(8, device=device))

    def train(model, opt, part):
        for x, y in part:
            for i in range(len(x)):
                loss_fn(model, x[i:i + 1].to(dtype), y[i:i + 1]).backward()
                opt.step()
                opt.zero_grad()

    straight = mlp(dtype=dtype, device=device)
    opt = FusedEMCLOptimizer(straight.parameters(), meta_every=3, backend=backend, **hp)
    train(straight, opt, batches)

    first = mlp(dtype=dtype, device=device)
    opt1 = FusedEMCLOptimizer(first.parameters(), meta_every=3, backend=backend, **hp)
    train(first, opt1, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    second = mlp(seed=99, dtype=dtype, device=device)
    opt2 = FusedEMCLOptimizer(second.parameters(), meta_every=3, backend=backend, **hp)
    second.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.state[second[0].weight]["anchor"].dtype == torch.float32
    train(second, opt2, batches[3:])
    for p, q in zip(straight.parameters(), second.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(straight.parameters(), second.parameters()):
        for k in ("anchor", "importance", "meta_lr", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k])


def test_load_refuses_other_shapes_and_changes_nothing():
    a = mlp()
    opt = FusedEMCLOptimizer(a.parameters(), **HP)
    x, y = next(stream(1))
    loss_fn(a, x, y).backward()
    opt.meta_step()
    sd = opt.state_dict()
    other = nn.Sequential(nn.Linear(12, 4), nn.ReLU(), nn.Linear(4, 9))
    opt2 = FusedEMCLOptimizer(other.parameters(), **HP)
    with pytest.raises(ValueError, match="has shape"):
        opt2.load_state_dict(sd)
    assert len(opt2.state) == 0
    short = FusedEMCLOptimizer(list(a.parameters())[:2], **HP)
    with pytest.raises(ValueError, match="parameters"):
        short.load_state_dict(sd)


def test_lr_scale_none_means_one_over_reg():
    a, b = mlp(), mlp()
    hp = {k: v for k, v in HP.items() if k != "lr_scale"}
    o1 = FusedEMCLOptimizer(a.parameters(), lr_scale=None, **hp)
    o2 = FusedEMCLOptimizer(b.parameters(), lr_scale=1.0 / HP["reg"], **hp)
    algorithm1(a, o1, stream(2))
    algorithm1(b, o2, stream(2))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(meta_lr=-1.0), ValueError, "meta_lr must be in"),
    (dict(decay=2.0), ValueError, "decay must be in"),
    (dict(lr_mode="adam"), ValueError, "lr_mode must be one of"),
    (dict(meta_every=0), ValueError, "meta_every must be None or a positive int"),
    (dict(backend="gpu"), ValueError, "backend must be 'auto' or one of"),
])
def test_constructor_rejects_bad_hyperparameters(kw, exc, match):
    with pytest.raises(exc, match=match):
        FusedEMCLOptimizer(mlp().parameters(), **kw)


def test_add_param_group_is_checked():
    opt = FusedEMCLOptimizer(mlp().parameters())
    with pytest.raises(ValueError, match="reg must be in"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "reg": -1.0})
    assert len(opt.param_groups) == 1
