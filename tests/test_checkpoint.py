"""Checkpoints: a state saved with one backend loads into any other and the
run continues within tolerance; map_location works; a state for other parameters is refused
with a clear error and changes nothing."""
import io
import itertools

import pytest
import torch

from emcl_kernels import FusedEMCLOptimizer
from emcl_testing import assert_close
from reliability_support import (BACKEND_DEVICES, BACKEND_IDS, TinyNet,
                                 assert_optimizer_unchanged, backward, optimizer_snapshot,
                                 same_bits)

PAIRS = list(itertools.product(BACKEND_DEVICES, repeat=2))
PAIR_IDS = [f"{a[0]}-{a[1]}-to-{b[0]}-{b[1]}" for a, b in PAIRS]


def _groups(model):
    p = list(model.parameters())
    return [{"params": p[:2], "lr_mode": "recurrent", "lr_min": 0.01, "lr_max": 0.3},
            {"params": p[2:], "importance": "si", "prox": False, "inner_lr": 0.03}]


def _optimizer(model, backend, **kw):
    return FusedEMCLOptimizer(_groups(model), meta_lr=0.2, inner_lr=0.05, reg=1.5, gamma=0.3,
                              decay=0.8, lr_scale=0.6, meta_every=3, backend=backend, **kw)


def _train(model, opt, seeds):
    for s in seeds:
        backward(model, s)
        opt.step()
        if s % 4 == 3:
            backward(model, 100 + s)
            opt.meta_step()


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes, map_location):
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_resume_on_another_backend(src, dst, dtype):
    """Train 9 steps on src, save model + optimizer to bytes, load them (through the CPU) into
    a fresh model and optimizer on dst, train 9 more: equal to 18 steps on src uninterrupted."""
    (src_backend, src_device), (dst_backend, dst_device) = src, dst
    model = TinyNet(seed=4, dtype=dtype, device=src_device)
    opt = _optimizer(model, src_backend)
    _train(model, opt, range(9))
    data = _save({"model": model.state_dict(), "opt": opt.state_dict()})

    _train(model, opt, range(9, 18))                       # the uninterrupted run

    ckpt = _load(data, "cpu")
    assert all(t.device.type == "cpu" for t in ckpt["opt"]["state"][0].values())
    resumed = TinyNet(seed=99, dtype=dtype, device=dst_device)
    resumed.load_state_dict(ckpt["model"])
    opt2 = _optimizer(resumed, dst_backend)
    opt2.load_state_dict(ckpt["opt"])
    for p in resumed.parameters():
        st = opt2.state[p]
        assert st["anchor"].dtype == torch.float32 and st["anchor"].device == p.device
        assert st["step"].device == p.device and st["step"].dtype == torch.float32  # [note: plans]
    assert opt2._step_calls == 9 and opt2.skipped_steps == 0
    _train(resumed, opt2, range(9, 18))

    for (name, p1), p2 in zip(model.named_parameters(), resumed.parameters()):
        assert_close(p2, p1, dtype, f"{src}->{dst} {name}")
        for key in opt.state[p1]:
            assert_close(opt2.state[p2][key], opt.state[p1][key], dtype,
                         f"{src}->{dst} {name} state {key}")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_bf16_master_anchor_survives_bit_for_bit(backend, device):
    model = TinyNet(seed=5, dtype=torch.bfloat16, device=device)
    opt = _optimizer(model, backend)
    _train(model, opt, range(8))
    sd = _load(_save(opt.state_dict()), "cpu")
    opt2 = _optimizer(model, backend)
    opt2.load_state_dict(sd)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert same_bits(opt2.state[p][key], value), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_map_location_cpu_and_back_to_gpu():
    model = TinyNet(seed=6, device="cuda")
    opt = _optimizer(model, "auto")
    _train(model, opt, range(6))
    on_cpu = _load(_save(opt.state_dict()), "cpu")
    back = _optimizer(model, "auto")
    back.load_state_dict(on_cpu)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            got = back.state[p][key]
            assert got.device == value.device and same_bits(got, value), key


def _refused(opt, state_dict, match):
    before = optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state_dict)
    assert_optimizer_unchanged(before, opt)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES, ids=BACKEND_IDS)
def test_refused_loads_change_nothing(backend, device):
    model = TinyNet(seed=7, device=device)
    opt = _optimizer(model, backend)
    _train(model, opt, range(5))
    good = opt.state_dict()
    target = TinyNet(seed=8, device=device)
    topt = _optimizer(target, backend)
    _train(target, topt, range(3))

    # another model: other layer sizes
    other = TinyNet(seed=7, device=device, sizes=(5, 6, 3))
    oopt = _optimizer(other, backend)
    _train(other, oopt, range(2))
    _refused(topt, oopt.state_dict(), "shape")
    # the same parameters in another order (one group, reversed), with and without state:
    # a state saved before the first step holds no tensor, only the saved shapes tell
    rev = FusedEMCLOptimizer(list(target.parameters())[::-1], backend=backend)
    in_order = FusedEMCLOptimizer(list(model.parameters()), backend=backend)
    _refused(rev, in_order.state_dict(), "shape")
    _train(model, in_order, range(1))
    _refused(rev, in_order.state_dict(), "shape")
    # another number of groups or of parameters in a group
    one_group = FusedEMCLOptimizer(target.parameters(), backend=backend)
    _refused(one_group, good, "param groups")
    fewer = dict(good, param_groups=[dict(good["param_groups"][0], params=[0]),
                                     good["param_groups"][1]])
    _refused(topt, fewer, "parameters")
    # a state saved by another optimizer
    adam = torch.optim.Adam(_groups(model), lr=1e-3)
    _train(model, adam, range(1))
    _refused(topt, adam.state_dict(), "lacks the hyper-parameter|gives both lr")
    # state tensors of other shapes, unknown keys, missing keys, a bad hyper-parameter
    bad_state = {k: dict(v) for k, v in good["state"].items()}
    bad_state[1]["anchor"] = torch.zeros(3)
    _refused(topt, dict(good, state=bad_state), "anchor")
    bad_state = {k: dict(v) for k, v in good["state"].items()}
    bad_state[2]["exp_avg"] = torch.zeros_like(bad_state[2]["anchor"])
    _refused(topt, dict(good, state=bad_state), "another optimizer")
    bad_state = {k: dict(v) for k, v in good["state"].items()}
    del bad_state[0]["importance"]
    _refused(topt, dict(good, state=bad_state), "another optimizer")
    bad_state = {k: dict(v) for k, v in good["state"].items()}
    bad_state[0]["importance"] = bad_state[0]["importance"].long()
    _refused(topt, dict(good, state=bad_state), "floating-point")
    bad_groups = [dict(g) for g in good["param_groups"]]
    bad_groups[1]["reg"] = -1.0
    _refused(topt, dict(good, param_groups=bad_groups), "reg")
    _refused(topt, {"param_groups": []}, "not an optimizer state dict")

    # and after all that, the good state still loads and the two runs agree
    topt.load_state_dict(good)
    target.load_state_dict(model.state_dict())
    _train(model, opt, range(5, 8))
    _train(target, topt, range(5, 8))
    for p1, p2 in zip(model.parameters(), target.parameters()):
        assert same_bits(p1, p2)
