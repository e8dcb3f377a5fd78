"""The "cpu" backend (the extension's C++ kernel) equals the reference (SPEC section 4): every
op, mode and dtype, odd sizes, chained steps, many tensors, large tensors that span several
parallel pieces, grad_scale/found_inf, and bad inputs raising clear errors."""
import pytest
import torch

from emcl_kernels.backends import backend_status
from emcl_testing import (DTYPES, MODES, OPS, SIZES, apply, assert_case_close,
                          check_against_reference, clone_case, make_case)

pytestmark = pytest.mark.skipif(backend_status()["cpu"] != "available",
                                reason=f"cpu backend: {backend_status()['cpu']}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", OPS)
def test_cpu_matches_reference(op, mode, dtype):
    check_against_reference("cpu", op, SIZES, dtype, mode, steps=7, seed=3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cpu_many_tensors(op, dtype):
    sizes = [(i * 37) % 301 for i in range(123)]
    check_against_reference("cpu", op, sizes, dtype, MODES[0], steps=7, seed=5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.float64), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cpu_large_tensors_span_parallel_pieces(op, dtype):
    # 300_007 elements: several 32768-element pieces spread over the threads, odd tail.
    check_against_reference("cpu", op, [300_007, 65_537, 3], dtype, MODES[3], steps=2, seed=7)


@pytest.mark.parametrize("op", OPS)
def test_cpu_grad_scale_and_found_inf(op):
    mode = MODES[0]
    hyper = mode.hyper(op)
    case = make_case([5, 4097], torch.float32, seed=11)
    expected = clone_case(case, torch.float64)
    scale = torch.tensor(8.0)
    apply(op, "cpu", case, hyper, grad_scale=scale, found_inf=torch.tensor(0.0))
    apply(op, "reference", expected, hyper, grad_scale=scale)
    assert_case_close(case, expected, torch.float32, f"{op} grad_scale=8")
    before = clone_case(case)
    apply(op, "cpu", case, hyper, grad_scale=scale, found_inf=torch.tensor(1.0))
    for name, lst in case.tensors().items():
        for a, b in zip(lst, before.tensors()[name]):
            assert torch.equal(a, b), f"found_inf=1 but {name} was written"


def test_auto_picks_cpu_for_cpu_tensors():
    from emcl_kernels.backends import auto_backend
    assert auto_backend(torch.device("cpu")) == "cpu"


def _lists(n=10, dtype=torch.float32):
    case = make_case([n, 3], dtype, seed=1)
    return case.params, case.grads, case.anchors, case.importances, case.meta_lrs


def test_cpu_op_rejects_bad_lists_before_writing():
    """The operators check their lists themselves (torch.ops.emcl.* can be called directly)."""
    params, grads, anchors, imps, lrs = _lists()
    snapshot = [p.clone() for p in params]
    kw = dict(inner_lr=0.1, reg=1.0, gamma=0.1, prox=True)
    with pytest.raises(ValueError, match="one tensor each"):
        torch.ops.emcl.inner_step_(params, grads[:1], anchors, imps, **kw)
    with pytest.raises(ValueError, match="elements"):
        torch.ops.emcl.inner_step_(params, [grads[1], grads[0]], anchors, imps, **kw)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.emcl.inner_step_(params, grads, [a.double() for a in anchors], imps, **kw)
    with pytest.raises(RuntimeError, match="contiguous"):
        big = torch.randn(20)
        torch.ops.emcl.inner_step_([params[0]], [big[::2]], [anchors[0]], [imps[0]], **kw)
    meta = dict(meta_lr=0.1, reg=1.0, decay=0.9, lr_scale=1.0, lr_min=0.0, lr_max=1.0,
                eps=1e-8, importance="taylor")
    with pytest.raises(ValueError, match="recurrent"):
        torch.ops.emcl.meta_step_(params, grads, anchors, imps, [], lr_mode="recurrent", **meta)
    with pytest.raises(ValueError, match="lr_mode"):
        torch.ops.emcl.meta_step_(params, grads, anchors, imps, [], lr_mode="fast", **meta)
    with pytest.raises(ValueError, match="importance"):
        torch.ops.emcl.meta_step_(params, grads, anchors, imps, [], lr_mode="inverse",
                                  **{**meta, "importance": "fisher"})
    with pytest.raises(TypeError, match="grad_scale"):
        torch.ops.emcl.inner_step_(params, grads, anchors, imps, grad_scale=torch.ones(2), **kw)
    for p, s in zip(params, snapshot):
        assert torch.equal(p, s)


def test_cpu_backend_rejects_bad_input_through_functional():
    from emcl_kernels import functional as F
    params, grads, anchors, imps, _ = _lists()
    snapshot = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match="contiguous"):
        F.inner_step_(params, [grads[0], torch.randn(6)[::2]], anchors, imps, inner_lr=0.1,
                      reg=1.0, gamma=0.1, backend="cpu")
    with pytest.raises(ValueError, match="inner_lr"):
        F.inner_step_(params, grads, anchors, imps, inner_lr=float("nan"), reg=1.0, gamma=0.1,
                      backend="cpu")
    for p, s in zip(params, snapshot):
        assert torch.equal(p, s)


def test_cpu_op_traces_under_torch_compile():
    """The fake implementations let torch.compile trace a step as one graph (no breaks)."""
    params, grads, anchors, imps, lrs = _lists(33)
    eager = [[t.clone() for t in lst] for lst in (params, anchors, imps, lrs)]
    kw = dict(inner_lr=0.05, meta_lr=0.2, reg=1.5, gamma=0.3, decay=0.8, lr_scale=0.9,
              lr_mode="recurrent", lr_min=0.01, lr_max=0.3, eps=1e-8, importance="taylor",
              prox=True)

    def step(p, g, a, h, r):
        torch.ops.emcl.inner_meta_step_(p, g, a, h, r, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(params, grads, anchors, imps, lrs)
    step(eager[0], grads, eager[1], eager[2], eager[3])
    for name, got, want in zip(("params", "anchors", "importances", "meta_lrs"),
                               (params, anchors, imps, lrs), eager):
        for a, e in zip(got, want):
            assert torch.equal(a, e), f"compiled step differs from eager on {name}"


def test_portable_cpu_kernels_match_reference():
    """The portable copy of the CPU kernels (what a CPU without AVX2 runs; forced here with
    torch's ATEN_CPU_CAPABILITY=default) agrees with the reference too."""
    import os
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    code = textwrap.dedent("""
        import torch
        import emcl_kernels.backends.extension
        from emcl_testing import MODES, OPS, check_against_reference
        assert torch.ops.emcl.cpu_kernel() == "portable", torch.ops.emcl.cpu_kernel()
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for op in OPS:
                for mode in (MODES[0], MODES[4], MODES[8]):
                    check_against_reference("cpu", op, [0, 1, 7, 4097, 70001], dtype, mode,
                                            steps=3, seed=9)
        print("ok")
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default",
           "PYTHONPATH": os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]


def test_cpu_kernel_copy_is_reported():
    assert torch.ops.emcl.cpu_kernel() in ("avx2", "portable")
