"""Mixed precision: grad_scale / found_inf in every backend, torch.amp.GradScaler
driving FusedEMCLOptimizer, bf16/fp16 models with fp32 master anchors under torch.autocast, and a
bf16 run that tracks the fp32 run. CPU tests run everywhere; the CUDA ones when a GPU is there."""
import copy

import pytest
import torch

from emcl_kernels import FusedEMCLOptimizer, available_backends
from emcl_testing import MODES, OPS, apply, assert_case_close, clone_case, make_case

CPU_BACKENDS = [b for b in available_backends() if b not in ("cuda", "triton")]
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_grad_scale_divides_the_gradients(backend, op, dtype):
    """Gradients multiplied by S and ``grad_scale=S`` give the unscaled result."""
    mode = MODES[3]
    hyper = mode.hyper(op)
    case = make_case([1, 7, 4097], dtype, seed=11)
    plain = clone_case(case)
    scale = torch.tensor(1024.0)  # a power of two: scaling is exact in every dtype
    case.grads = [g * 1024.0 for g in case.grads]
    for _ in range(3):
        apply(op, backend, case, hyper, grad_scale=scale)
        apply(op, backend, plain, hyper)
        assert_case_close(case, plain, dtype, f"{backend} {op} grad_scale",
                          with_meta_lrs=mode.lr_mode == "recurrent" and op != "inner_step")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_found_inf_writes_nothing(backend, op):
    mode = MODES[0]  # recurrent: meta_lrs are written too
    case = make_case([1, 7, 300], torch.float32, seed=12)
    case.grads[1][0] = float("inf")
    before = clone_case(case)
    apply(op, backend, case, mode.hyper(op), grad_scale=torch.tensor(8.0),
          found_inf=torch.tensor(1.0))
    for name, lst in case.tensors().items():
        for a, b in zip(lst, before.tensors()[name]):
            assert torch.equal(a, b), f"{backend} {op}: {name} changed although found_inf was set"
    # check_finite=False: only the caller's flag decides (by default the inf in the grads
    # would skip this step too; tests/test_nonfinite.py checks that combination)
    apply(op, backend, case, mode.hyper(op), found_inf=torch.tensor(0.0), check_finite=False)
    assert not torch.equal(case.params[0], before.params[0]), "found_inf=0 must step"


def _mlp(seed, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(),
                               torch.nn.Linear(17, 3)).to(device=device, dtype=dtype)


def _data(n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, 9, generator=g)
    w = torch.randn(9, 3, generator=g)
    return x.to(device), (x @ w + 0.1 * torch.randn(n, 8, 3, generator=g)).to(device)


def test_grad_scaler_drives_the_optimizer_like_unscaled_training():
    """``scaler.step(opt)`` hands the scale and found_inf to the kernels (no unscale pass of
    its own): the run equals plain training, and the scaler's own unscale_ path does too."""
    xs, ys = _data(12, 0)
    runs = {}
    for how in ("plain", "scaler", "scaler_unscale_first"):
        model = _mlp(0)
        opt = FusedEMCLOptimizer(model.parameters(), meta_lr=0.3, inner_lr=0.05, reg=2.0,
                                 meta_every=3, backend="foreach")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        assert opt._step_supports_amp_scaling
        for x, y in zip(xs, ys):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if how == "plain":
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if how == "scaler_unscale_first":
                    scaler.unscale_(opt)  # e.g. for clipping; the step then gets no grad_scale
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        runs[how] = (model, opt)
    ref = runs["plain"][0]
    for how in ("scaler", "scaler_unscale_first"):
        for a, b in zip(runs[how][0].parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=how)
    steps = [s["step"].item() for s in runs["scaler"][1].state.values()]
    assert steps == [4.0] * 4


def test_grad_scaler_skips_a_step_with_an_inf_and_backs_off():
    model = _mlp(1)
    opt = FusedEMCLOptimizer(model.parameters(), meta_every=1, backend="foreach")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = _data(2, 1)
    scaler.scale(torch.nn.functional.mse_loss(model(x[0]), y[0])).backward()
    scaler.step(opt)  # a first good step creates the state
    scaler.update()
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    scaler.scale(torch.nn.functional.mse_loss(model(x[1]), y[1])).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 7, "the scaler must see the inf and back off"
    for a, b in zip(model.parameters(), params):
        assert torch.equal(a.detach(), b)
    for pid, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            assert torch.equal(value, state[pid][key]), f"state {key} moved on a skipped step"


STEPS = 40


def _train(dtype, device, *, autocast, scaler, steps=STEPS):
    model = _mlp(3, dtype=dtype, device=device)
    opt = FusedEMCLOptimizer(model.parameters(), meta_lr=0.9, inner_lr=0.1, reg=2.0,
                             meta_every=4, backend="foreach")
    xs, ys = _data(steps, 3, device)
    gs = torch.amp.GradScaler(device, init_scale=2.0 ** 12) if scaler else None
    losses = []
    for x, y in zip(xs, ys):
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        losses.append(loss.item())
        if gs is None:
            loss.backward()
            opt.step()
        else:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        opt.zero_grad()
    return model, opt, losses


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("dtype, autocast, scaler", [
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, False),
    (torch.float16, torch.float16, True),
], ids=["bf16-model", "fp32-model-bf16-autocast", "fp16-model-gradscaler"])
def test_low_precision_training_tracks_fp32(device, dtype, autocast, scaler):
    """A bf16/fp16 model (or bf16 autocast) trained with fp32 master anchors stays close to
    the fp32 run: anchors are fp32, the model equals its anchors after each meta step, and the
    losses and anchors track the fp32 ones."""
    ref_model, ref_opt, ref_losses = _train(torch.float32, device, autocast=None, scaler=False)
    model, opt, losses = _train(dtype, device, autocast=autocast, scaler=scaler)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    ref_last = sum(ref_losses[-8:]) / 8
    assert last < 0.25 * first, f"training did not progress: {losses}"
    assert abs(last - ref_last) <= 0.05 * ref_last, (last, ref_last)
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        anchor = opt.state[p]["anchor"]
        assert anchor.dtype == torch.float32 and opt.state[p]["importance"].dtype == torch.float32
        # 40 steps, meta_every=4: the last step was a meta step, so θ = θ₀ rounded to the model
        assert torch.equal(p.detach(), anchor.to(dtype))
        ref_anchor = ref_opt.state[rp]["anchor"]
        err = (anchor - ref_anchor).abs().max().item()
        # Each of the STEPS steps computes the gradient from weights rounded to the low
        # precision and stores θ rounded once more: at most one unit roundoff u of the largest
        # weight per step (the meta steps' moves are fractions of the way to θ, which does not
        # amplify it). bf16: u = 2**-8, so 40 steps allow 0.16 of the largest weight.
        u = torch.finfo(autocast if dtype == torch.float32 else dtype).eps / 2
        tol = STEPS * u * ref_anchor.abs().max().item() + 1e-3
        assert err < tol, f"anchor drifted by {err} (allowed {tol:.4g})"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.1 * b + 0.02, (losses, ref_losses)
