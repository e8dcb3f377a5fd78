"""The fused glance of an MLP (emcl_kernels/glance.py): the CPU kernel against its reference bit
for bit, both against autograd + the optimizer's inner step within fp32 tolerance and against
an fp64 oracle, the array form against single runs, the finite check, the argument checks, and
the Triton kernel through the interpreter (in a subprocess: Triton decides at import)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from emcl_kernels import FusedEMCLOptimizer, glance
from emcl_kernels.glance import glance_unavailable_reason, mlp_glance_, mlp_glance_array_

HAS_CPU = glance_unavailable_reason("cpu", "cpu") is None
needs_cpu = pytest.mark.skipif(not HAS_CPU, reason=str(glance_unavailable_reason("cpu", "cpu")))

# (widths, samples): the paper's MLP, odd widths, one layer, four layers
SIZES = [((784, 100, 100, 10), 3), ((13, 7, 5), 6), ((33, 1), 4), ((5, 17, 9, 3, 4), 5),
         ((40, 31, 10), 4)]


def _net(widths, runs=None, seed=0, dtype=torch.float32):
    """Weights, anchors near them and importances of varied size (the pull acts)."""
    g = torch.Generator().manual_seed(seed)
    lead = () if runs is None else (runs,)
    params, anchors, imps = [], [], []
    for fan_in, fan_out in zip(widths, widths[1:]):
        for shape in ((fan_out, fan_in), (fan_out,)):
            p = (torch.rand(lead + shape, generator=g, dtype=torch.float64) * 2 - 1) / fan_in ** 0.5
            a = p + 0.05 * torch.randn(lead + shape, generator=g, dtype=torch.float64)
            h = torch.rand(lead + shape, generator=g, dtype=torch.float64) ** 3 * 0.5
            params.append(p.to(dtype))
            anchors.append(a.to(dtype))
            imps.append(h.to(dtype))
    return params, anchors, imps


def _samples(widths, n, runs=None, seed=1, masked=False):
    g = torch.Generator().manual_seed(seed)
    lead = () if runs is None else (runs,)
    x = torch.rand(lead + (n, widths[0]), generator=g)
    classes = widths[-1]
    y = torch.randint(0, classes, lead + (n,), generator=g)
    mask = None
    if masked and classes > 1:
        mask = torch.rand(lead + (n, classes), generator=g) < 0.4
        mask.scatter_(-1, y.unsqueeze(-1), False)  # the label's class is live
    return x, y, mask


HYPER = dict(inner_lr=0.03, reg=10.0, gamma=0.3)


def _clone(ts):
    return [t.clone() for t in ts]


@needs_cpu
@pytest.mark.parametrize("widths,n", SIZES)
@pytest.mark.parametrize("prox", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_kernel_matches_reference_bit_for_bit(widths, n, prox, masked):
    params, anchors, imps = _net(widths)
    x, y, mask = _samples(widths, n, masked=masked)
    mine, ref = _clone(params), _clone(params)
    out = mlp_glance_(mine, anchors, imps, x, y, mask=mask, prox=prox, backend="cpu", **HYPER)
    exp = mlp_glance_(ref, anchors, imps, x, y, mask=mask, prox=prox, backend="reference",
                      **HYPER)
    for a, b in zip(mine, ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(out.losses.view(torch.int32), exp.losses.view(torch.int32))
    assert int(out.skipped) == int(exp.skipped) == 0
    assert not any(torch.equal(a, p) for a, p in zip(mine, params))  # every tensor moved


@needs_cpu
@pytest.mark.parametrize("prox", [True, False])
def test_array_form_is_each_run_alone(prox):
    widths, runs, n = (29, 11, 6), 4, 5
    params, anchors, imps = _net(widths, runs=runs)
    x, y, mask = _samples(widths, n, runs=runs, masked=True)
    lr = torch.tensor([0.01, 0.03, 0.1, 0.0])
    gamma = torch.tensor([0.3, 0.0, 1.0, 0.3])
    stacked = _clone(params)
    res = mlp_glance_array_(stacked, anchors, imps, x, y, mask=mask, inner_lr=lr, reg=10.0,
                            gamma=gamma, prox=prox, backend="cpu")
    for r in range(runs):
        alone = [p[r].clone() for p in params]
        one = mlp_glance_(alone, [a[r] for a in anchors], [h[r] for h in imps], x[r], y[r],
                          mask=mask[r], inner_lr=float(lr[r]), reg=10.0, gamma=float(gamma[r]),
                          prox=prox, backend="cpu")
        for a, p in zip(alone, stacked):
            assert torch.equal(a, p[r])
        assert torch.equal(one.losses, res.losses[r])
    # β = 0 and the pull's γ > 0 (run 3, prox): θ̂ = θ, the pull alone moves θ toward θ₀
    assert res.skipped.tolist() == [0] * runs


def _autograd_glance(widths, params, anchors, imps, x, y, mask, prox, backend, dtype):
    """The method's path: F.cross_entropy(...).backward(); opt.inner_step() per sample.
    Returns the parameters after every step and the losses."""
    layers = [torch.nn.Parameter(p.clone().to(dtype)) for p in params]
    opt = FusedEMCLOptimizer(layers, lr=HYPER["inner_lr"], reg=HYPER["reg"],
                             gamma=HYPER["gamma"], meta_lr=0.1, prox=prox, backend=backend)
    for p in layers:                  # create the state (an exact no-op step), then set it
        p.grad = torch.zeros_like(p)
    opt.inner_step()
    for p, a, h in zip(layers, anchors, imps):
        opt.state[p]["anchor"].copy_(a.to(dtype))
        opt.state[p]["importance"].copy_(h.to(dtype))
    losses, after = [], []
    for k in range(x.shape[0]):
        hcur = x[k:k + 1].to(dtype)
        for l in range(len(layers) // 2):
            hcur = F.linear(hcur, layers[2 * l], layers[2 * l + 1])
            if 2 * l + 2 < len(layers):
                hcur = F.relu(hcur)
        if mask is not None:
            hcur = hcur.masked_fill(mask[k:k + 1], -1e9)
        loss = F.cross_entropy(hcur, y[k:k + 1])
        for p in layers:
            p.grad = None
        loss.backward()
        opt.inner_step()
        losses.append(float(loss.detach()))
        after.append([p.detach().clone() for p in layers])
    return after, losses


# The tolerance against autograd and the fp64 oracle, in fp32 eps times the tensor's largest
# magnitude: the fused step's sums run in another order than BLAS's and torch's softmax, so
# each step's gradient differs in its last bits. Measured on these cases (3-6 steps): at most
# 0.67 eps·max|θ| from autograd + inner_step(), 1.8 from the fp64 oracle (autograd's own
# distance from the oracle is the same 1.8).
AUTOGRAD_ULPS = 4


@needs_cpu
@pytest.mark.parametrize("widths,n", SIZES)
@pytest.mark.parametrize("prox", [True, False])
def test_against_autograd_and_fp64_step_by_step(widths, n, prox):
    params, anchors, imps = _net(widths)
    x, y, mask = _samples(widths, n, masked=True)
    auto, _ = _autograd_glance(widths, params, anchors, imps, x, y, mask, prox, "reference",
                               torch.float32)
    oracle, oracle_losses = _autograd_glance(widths, params, anchors, imps, x, y, mask, prox,
                                             "reference", torch.float64)
    fused = _clone(params)
    eps = torch.finfo(torch.float32).eps
    for k in range(n):                # one step per call, compared after every step
        res = mlp_glance_(fused, anchors, imps, x[k:k + 1], y[k:k + 1],
                          mask=None if mask is None else mask[k:k + 1],
                          prox=prox, backend="cpu", **HYPER)
        for f, a, o in zip(fused, auto[k], oracle[k]):
            scale = float(o.abs().max()) + 1e-30
            assert float((f - a).abs().max()) <= AUTOGRAD_ULPS * eps * scale, k
            assert float((f.double() - o).abs().max()) <= AUTOGRAD_ULPS * eps * scale, k
        assert abs(float(res.losses[0]) - oracle_losses[k]) <= 1e-5 * max(1.0, oracle_losses[k])
    # the whole glance in one call is the same as its steps one by one
    whole = _clone(params)
    mlp_glance_(whole, anchors, imps, x, y, mask=mask, prox=prox, backend="cpu", **HYPER)
    for a, b in zip(whole, fused):
        assert torch.equal(a, b)


@needs_cpu
def test_non_finite_gradient_skips_the_step_only():
    widths = (6, 5, 3)
    params, anchors, imps = _net(widths)
    x, y, _ = _samples(widths, 3)
    x[1, 2] = float("inf")
    for backend in ("cpu", "reference"):
        mine = _clone(params)
        res = mlp_glance_(mine, anchors, imps, x, y, backend=backend, **HYPER)
        assert int(res.skipped) == 1
        expect = _clone(params)   # steps 0 and 2 only
        mlp_glance_(expect, anchors, imps, x[[0, 2]], y[[0, 2]], backend=backend, **HYPER)
        for a, b in zip(mine, expect):
            assert torch.equal(a, b)
    # an overflowing product of finite factors is caught too
    big = _clone(params)
    xb = torch.full((1, widths[0]), 3e38)
    res = mlp_glance_(big, anchors, imps, xb, y[:1], backend="cpu", **HYPER)
    assert int(res.skipped) == 1 and all(torch.equal(a, b) for a, b in zip(big, params))
    res = mlp_glance_(big, anchors, imps, xb, y[:1], backend="cpu", check_finite=False, **HYPER)
    assert int(res.skipped) == 0


@pytest.mark.parametrize("backend", ["reference"] + (["cpu"] if HAS_CPU else []))
def test_bad_calls_are_refused_before_anything_is_written(backend):
    widths = (6, 5, 3)
    params, anchors, imps = _net(widths)
    x, y, mask = _samples(widths, 2, masked=True)
    before = _clone(params)

    def call(**kw):
        args = dict(params=params, anchors=anchors, importances=imps, x=x, y=y, mask=mask)
        args.update(kw)
        mlp_glance_(args.pop("params"), args.pop("anchors"), args.pop("importances"),
                    args.pop("x"), args.pop("y"), backend=backend, **args, **HYPER)

    with pytest.raises(ValueError, match="outside"):
        call(y=torch.tensor([0, 3]))
    bad_mask = mask.clone()
    bad_mask[0, int(y[0])] = True
    with pytest.raises(ValueError, match="masked class"):
        call(mask=bad_mask)
    with pytest.raises(ValueError, match="x must be"):
        call(x=x[:, :5])
    with pytest.raises(TypeError, match="float32"):
        call(anchors=[a.double() for a in anchors])
    with pytest.raises(ValueError, match="share memory"):
        call(anchors=[params[0]] + anchors[1:])
    with pytest.raises(ValueError, match="layer 1"):
        call(params=params[:2] + [params[2][:, :4].contiguous(), params[3]])
    with pytest.raises(ValueError, match="even"):
        call(params=params[:3], anchors=anchors[:3], importances=imps[:3])
    with pytest.raises(ValueError, match="inner_lr"):
        mlp_glance_(params, anchors, imps, x, y, inner_lr=-1.0, reg=1.0, gamma=1.0)
    for a, b in zip(params, before):
        assert torch.equal(a, b)


@needs_cpu
def test_op_checks_its_arguments_in_cpp():
    widths = (6, 5, 3)
    params, anchors, imps = [[t.unsqueeze(0) for t in ts] for ts in _net(widths)]
    x, y, _ = _samples(widths, 2, runs=1)
    losses, skipped = torch.zeros(1, 2), torch.zeros(1, dtype=torch.int64)
    hyper = torch.tensor([[0.1, 1.0, 1.0]], dtype=torch.float64)
    before = _clone(params)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.emcl.mlp_glance_(params, anchors, imps, x, torch.full_like(y, 7), None, hyper,
                                   True, True, losses, skipped)
    with pytest.raises(RuntimeError, match="hyper"):
        torch.ops.emcl.mlp_glance_(params, anchors, imps, x, y, None, hyper.float(), True,
                                   True, losses, skipped)
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.emcl.mlp_glance_(params, params, imps, x, y, None, hyper, True, True, losses,
                                   skipped)
    for a, b in zip(params, before):
        assert torch.equal(a, b)


_TRITON_SCRIPT = textwrap.dedent("""
    import torch, sys
    sys.path[:0] = {path!r}
    from emcl_kernels.backends import glance_triton
    assert glance_triton.INTERPRETED, "not interpreted"
    from test_glance import _net, _samples, _clone, HYPER  # tests/ is on the path: an installed
    # package named `tests` (some wheels ship one) would shadow tests/ as a namespace package
    from emcl_kernels.glance import mlp_glance_array_
    for widths, runs, n, prox, masked in [((13, 7, 5), 2, 3, True, True),
                                          ((150, 9, 3), 1, 2, False, False),
                                          ((5, 40, 6, 4), 2, 2, True, False)]:
        params, anchors, imps = _net(widths, runs=runs)
        x, y, mask = _samples(widths, n, runs=runs, masked=masked)
        tri, ref = _clone(params), _clone(params)
        a = mlp_glance_array_(tri, anchors, imps, x, y, mask=mask, prox=prox,
                              backend="triton", **HYPER)
        b = mlp_glance_array_(ref, anchors, imps, x, y, mask=mask, prox=prox,
                              backend="reference", **HYPER)
        for p, q in zip(tri, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.losses, b.losses, rtol=1e-5, atol=1e-6)
        assert a.skipped.tolist() == b.skipped.tolist() == [0] * runs
    # a non-finite input skips its step
    params, anchors, imps = _net((6, 5, 3), runs=1)
    x, y, _ = _samples((6, 5, 3), 2, runs=1)
    x[0, 1, 0] = float("nan")
    tri = _clone(params)
    a = mlp_glance_array_(tri, anchors, imps, x, y, backend="triton", **HYPER)
    assert a.skipped.tolist() == [1]
    print("TRITON GLANCE OK")
""")


def test_triton_kernel_through_the_interpreter():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    path = [root, os.path.join(root, "python"), os.path.join(root, "tests")]
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT.format(path=path)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "TRITON GLANCE OK" in proc.stdout, proc.stderr[-4000:]


def _gpu_reason(backend: str) -> Optional[str]:
    return glance_unavailable_reason(backend, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("prox", [True, False])
def test_gpu_kernels_against_the_reference(backend, prox):
    """On a GPU (skipped without one): the CUDA and the compiled Triton glance, R runs with
    per-run β and γ, masks, odd widths, against the CPU reference within fp32 tolerance; a
    non-finite sample skips its step."""
    why = _gpu_reason(backend)
    if why is not None:
        pytest.skip(why)
    for widths, runs, n in (((784, 100, 100, 10), 3, 20), ((13, 7, 5), 2, 6),
                            ((5, 17, 9, 3, 4), 4, 5), ((33, 1), 1, 3)):
        params, anchors, imps = _net(widths, runs=runs)
        x, y, mask = _samples(widths, n, runs=runs, masked=True)
        x[0, n // 2, 0] = float("inf")
        lr = torch.linspace(0.01, 0.05, runs)
        ref = _clone(params)
        b = mlp_glance_array_(ref, anchors, imps, x, y, mask=mask, inner_lr=lr, reg=10.0,
                              gamma=0.3, prox=prox, backend="reference")
        cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
        dev = cuda(params)
        a = mlp_glance_array_(dev, cuda(anchors), cuda(imps), x.cuda(), y.cuda(),
                              mask=None if mask is None else mask.cuda(), inner_lr=lr.cuda(),
                              reg=10.0, gamma=0.3, prox=prox, backend=backend)
        torch.cuda.synchronize()
        for p, q in zip(dev, ref):
            torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
        finite = torch.isfinite(b.losses)
        torch.testing.assert_close(a.losses.cpu()[finite], b.losses[finite], rtol=1e-5,
                                   atol=1e-6)
        assert a.skipped.cpu().tolist() == b.skipped.tolist()
        assert b.skipped.tolist()[0] == 1


@pytest.mark.parametrize("backend", ["reference"] + (["cpu"] if HAS_CPU else []))
def test_module_parameters_are_updated_in_place(backend):
    """An nn.Module's parameters (leaves that require grad) are written in place, with grad
    mode on, as the optimizer's step writes them."""
    widths = (7, 6, 3)
    params, anchors, imps = _net(widths)
    expect = _clone(params)
    mlp_glance_(expect, anchors, imps, *_samples(widths, 2)[:2], backend=backend, **HYPER)
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    x, y, _ = _samples(widths, 2)
    mlp_glance_(leaves, anchors, imps, x, y, backend=backend, **HYPER)
    for p, e in zip(leaves, expect):
        assert p.requires_grad and p.grad_fn is None and torch.equal(p.detach(), e)
