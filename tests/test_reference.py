"""The oracle against values worked out by hand (SPEC section 2), one case per mode.

Inputs for every case: fast weight θ = [1, -2], gradient g = [0.5, 1], anchor θ₀ = [0.8, -1.5],
importance h = [0.2, 0], λ = 2. The arithmetic is in each test's comments.
"""
import pytest
import torch

from emcl_kernels import reference as R

INF = float("inf")


def tensors(dtype=torch.float64):
    theta = torch.tensor([1.0, -2.0], dtype=dtype)
    g = torch.tensor([0.5, 1.0], dtype=dtype)
    theta0 = torch.tensor([0.8, -1.5], dtype=dtype)
    h = torch.tensor([0.2, 0.0], dtype=dtype)
    return theta, g, theta0, h


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype),
                               rtol=0, atol=tol)


def test_inner_prox():
    # c = γλh = 0.5·2·[0.2, 0] = [0.2, 0];  θ̂ = θ − βg = [0.95, −2.1]
    # θ = (θ̂ + c·θ₀)/(1 + c) = [(0.95 + 0.16)/1.2, −2.1] = [0.925, −2.1]
    theta, g, theta0, h = tensors()
    R.inner_step_(theta, g, theta0, h, inner_lr=0.1, reg=2.0, gamma=0.5, prox=True)
    close(theta, [0.925, -2.1])
    close(theta0, [0.8, -1.5])                     # the inner step writes only θ
    close(h, [0.2, 0.0])


def test_inner_gradient_step():
    # θ − β(g + λh(θ − θ₀)) = [1 − 0.1·(0.5 + 2·0.2·0.2), −2 − 0.1·1] = [0.942, −2.1]
    theta, g, theta0, h = tensors()
    R.inner_step_(theta, g, theta0, h, inner_lr=0.1, reg=2.0, gamma=0.5, prox=False)
    close(theta, [0.942, -2.1])


def test_meta_taylor_inverse():
    # Ω = |g·θ₀| = [0.4, 1.5];  h = 0.5·[0.2, 0] + 0.5·Ω = [0.3, 0.75]
    # α = α₀·r/(h + ε) = 0.1·0.5/[0.35, 0.8] = [1/7, 0.0625]
    # θ₀ − αλh(θ₀ − θ): [0.8 − (0.6/7)·(−0.2), −1.5 − 0.09375·0.5] = [0.8 + 0.12/7, −1.546875]
    theta, g, theta0, h = tensors()
    R.meta_step_(theta, g, theta0, h, None, meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=0.5,
                 lr_mode="inverse", eps=0.05)
    close(h, [0.3, 0.75])
    close(theta0, [0.8 + 0.12 / 7, -1.546875])
    close(theta, [0.8 + 0.12 / 7, -1.546875])      # θ ← θ₀


def test_meta_si_constant():
    # Ω = |g·(θ − θ₀)| = [|0.5·0.2|, |1·(−0.5)|] = [0.1, 0.5];  h = [0.15, 0.25]
    # α = α₀ = 0.1;  θ₀ − 0.1·2·h·(θ₀ − θ) = [0.8 + 0.2·0.15·0.2, −1.5 − 0.2·0.25·0.5]
    theta, g, theta0, h = tensors()
    R.meta_step_(theta, g, theta0, h, None, meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=123.0,
                 lr_mode="constant", importance_kind="si")
    close(h, [0.15, 0.25])
    close(theta0, [0.806, -1.525])
    close(theta, [0.806, -1.525])


def test_meta_taylor_recurrent_clips():
    # h = [0.3, 0.75] as above;  α ← α·r/(h + ε) = [0.2·0.5/0.35, 0.4·0.5/0.8] = [0.2857…, 0.25]
    # clipped to [0.01, 0.26]: [0.26, 0.25]
    # θ₀: [0.8 + 0.26·2·0.3·0.2, −1.5 − 0.25·2·0.75·0.5] = [0.8312, −1.6875]
    theta, g, theta0, h = tensors()
    alpha = torch.tensor([0.2, 0.4], dtype=torch.float64)
    R.meta_step_(theta, g, theta0, h, alpha, meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=0.5,
                 lr_mode="recurrent", lr_min=0.01, lr_max=0.26, eps=0.05)
    close(alpha, [0.26, 0.25])
    close(theta0, [0.8312, -1.6875])
    close(theta, [0.8312, -1.6875])


def test_meta_recurrent_clip_from_below():
    # α ← 0.2·0.01/(0.3 + 0.05) = 0.0057… < lr_min = 0.01
    theta, g, theta0, h = tensors()
    alpha = torch.tensor([0.2, 0.4], dtype=torch.float64)
    R.meta_step_(theta, g, theta0, h, alpha, meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=0.01,
                 lr_mode="recurrent", lr_min=0.01, lr_max=INF, eps=0.05)
    close(alpha, [0.01, 0.01])


def test_inner_meta_is_inner_then_meta_in_fp64():
    a = tensors()
    b = tensors()
    hp = dict(meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=0.5, lr_mode="inverse", eps=0.05)
    R.inner_step_(a[0], a[1], a[2], a[3], inner_lr=0.1, reg=2.0, gamma=0.5)
    R.meta_step_(a[0], a[1], a[2], a[3], None, **hp)
    R.inner_meta_step_(b[0], b[1], b[2], b[3], None, inner_lr=0.1, gamma=0.5, **hp)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_fp64_in_fp64_and_low_precision_in_fp32():
    # fp64 inputs are computed in fp64: 0.925 is not representable in fp32
    theta, g, theta0, h = tensors(torch.float64)
    R.inner_step_(theta, g, theta0, h, inner_lr=0.1, reg=2.0, gamma=0.5)
    assert theta.dtype == torch.float64 and abs(theta[0].item() - 0.925) < 1e-15
    assert R.compute_dtype(torch.float64) == torch.float64
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert R.compute_dtype(dt) == torch.float32
    # bf16 parameter, fp32 state: the result is the fp32 value rounded once to bf16
    theta = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    g = torch.tensor([0.5, 1.0], dtype=torch.bfloat16)
    theta0 = torch.tensor([0.8, -1.5])
    h = torch.tensor([0.2, 0.0])
    R.inner_step_(theta, g, theta0, h, inner_lr=0.1, reg=2.0, gamma=0.5)
    c = 0.5 * 2.0 * h
    want = ((torch.tensor([1.0, -2.0]) - 0.1 * torch.tensor([0.5, 1.0]) + c * theta0)
            / (1 + c)).to(torch.bfloat16)
    assert torch.equal(theta, want)


def test_grad_scale_and_found_inf():
    theta, g, theta0, h = tensors()
    R.inner_step_(theta, g * 4, theta0, h, inner_lr=0.1, reg=2.0, gamma=0.5,
                  grad_scale=torch.tensor(4.0))
    close(theta, [0.925, -2.1])
    theta, g, theta0, h = tensors()
    R.meta_step_(theta, g, theta0, h, None, meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=0.5,
                 lr_mode="inverse", found_inf=torch.tensor(1.0))
    close(theta, [1.0, -2.0])
    close(theta0, [0.8, -1.5])
    close(h, [0.2, 0.0])


@pytest.mark.parametrize("bad", [dict(lr_mode="cosine"), dict(importance_kind="fisher")])
def test_unknown_modes(bad):
    theta, g, theta0, h = tensors()
    kw = dict(meta_lr=0.1, reg=2.0, decay=0.5, lr_scale=0.5, lr_mode="inverse")
    kw.update(bad)
    with pytest.raises(ValueError):
        R.meta_step_(theta, g, theta0, h, None, **kw)
