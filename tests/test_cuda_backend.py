"""The "cuda" backend (the extension's multi-tensor kernels) equals the reference (SPEC
section 4), launches once per (device, dtype) group and step, reads grad_scale/found_inf on the
device, handles unaligned tensors and tensors past 2**31 elements. Runs only where a GPU and the
CUDA kernels exist."""
import pytest
import torch

from emcl_kernels import functional as F
from emcl_kernels.backends import backend_status
from emcl_testing import (DTYPES, MODES, OPS, SIZES, apply, assert_case_close, assert_close,
                          check_against_reference, clone_case, make_case)

pytestmark = pytest.mark.skipif(backend_status()["cuda"] != "available",
                                reason=f"cuda backend: {backend_status()['cuda']}")


def _launches():
    return int(torch.ops.emcl.launch_count())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", OPS)
def test_cuda_matches_reference(op, mode, dtype):
    check_against_reference("cuda", op, SIZES, dtype, mode, steps=7, seed=3, device="cuda")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cuda_many_tensors(op, dtype):
    # 300 tensors: more than one kernel-argument struct holds, so the launcher splits.
    sizes = [(i * 37) % 301 + (70_000 if i % 50 == 0 else 0) for i in range(300)]
    check_against_reference("cuda", op, sizes, dtype, MODES[0], steps=3, seed=5, device="cuda")


@pytest.mark.parametrize("op", OPS)
def test_cuda_one_launch_per_group(op):
    """40 tensors of two dtypes, up to 5M elements: one launch per (device, dtype) group."""
    mode = MODES[0]
    hyper = mode.hyper(op)
    sizes = [5_000_001, 7, 0, 1, 4097] + [1000 + 13 * i for i in range(15)]
    cases = [make_case(sizes, dt, seed=2, device="cuda") for dt in (torch.float32,
                                                                       torch.bfloat16)]
    lists = [sum((getattr(c, n) for c in cases), []) for n in
             ("params", "grads", "anchors", "importances", "meta_lrs")]
    fn = getattr(F, op + "_")
    args = lists[:4] + ([lists[4]] if op != "inner_step" else [])
    torch.cuda.synchronize()
    before = _launches()
    fn(*args, backend="cuda", **hyper)
    assert _launches() - before == 2


@pytest.mark.parametrize("op", OPS)
def test_cuda_grad_scale_and_found_inf_on_device(op):
    hyper = MODES[0].hyper(op)
    case = make_case([5, 4097, 100_003], torch.float32, seed=11, device="cuda")
    expected = clone_case(case, torch.float64, device="cpu")
    scale = torch.tensor(8.0, device="cuda")
    apply(op, "cuda", case, hyper, grad_scale=scale, found_inf=torch.zeros((), device="cuda"))
    apply(op, "reference", expected, hyper, grad_scale=scale.cpu())
    assert_case_close(case, expected, torch.float32, f"{op} grad_scale=8")
    before = clone_case(case)
    apply(op, "cuda", case, hyper, grad_scale=scale, found_inf=torch.ones((), device="cuda"))
    for name, lst in case.tensors().items():
        for a, b in zip(lst, before.tensors()[name]):
            assert torch.equal(a, b), f"found_inf=1 but {name} was written"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cuda_unaligned_tensors(op, dtype):
    """Contiguous views at an odd element offset take the scalar path and agree too."""
    hyper = MODES[6].hyper(op)
    case = make_case([4099, 33], dtype, seed=4, device="cuda")

    def shift(lst):
        out = []
        for t in lst:
            buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
            view = buf[1:].view(t.shape)
            view.copy_(t)
            out.append(view)
        return out

    for name in ("params", "grads", "anchors", "importances", "meta_lrs"):
        setattr(case, name, shift(getattr(case, name)))
    assert case.params[0].data_ptr() % 16 != 0
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    apply(op, "cuda", case, hyper)
    apply(op, "reference", expected, hyper)
    assert_case_close(case, expected, dtype, f"unaligned {op} {dtype}")


def test_cuda_tensor_past_2_31_elements():
    """One tensor of 2**31 + 5 elements is updated whole (64-bit indexing)."""
    n = 2**31 + 5
    need = n * (2 + 2 + 4 + 4 + 4 + 4) + (2 << 30)  # p, g, a, h, r and a temporary
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} free")
    hyper = MODES[0].hyper("inner_meta_step")
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    a = p.float() + 0.3
    h = torch.rand(n, device="cuda", generator=gen) + 0.1
    r = torch.full((n,), 0.1, device="cuda")
    # Keep copies of a few windows (start, middle, around 2**31, end) to check against.
    windows = [slice(0, 1000), slice(2**30, 2**30 + 1000), slice(2**31 - 500, 2**31 + 500),
               slice(n - 1000, n)]
    saved = [[t[w].cpu().clone() for t in (p, g, a, h, r)] for w in windows]
    F.inner_meta_step_([p], [g], [a], [h], [r], backend="cuda", **hyper)
    for w, (sp, sg, sa, sh, sr) in zip(windows, saved):
        F.inner_meta_step_([sp], [sg], [sa], [sh], [sr], backend="reference", **hyper)
        for got, want, name in ((p, sp, "params"), (a, sa, "anchors"), (h, sh, "importances"),
                                (r, sr, "meta_lrs")):
            assert_close(got[w], want, torch.bfloat16, f"{name}[{w.start}:{w.stop}]")
