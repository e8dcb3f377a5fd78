"""The Triton backend equals the reference (SPEC section 4), in one launch per group and step.

Without a GPU these tests run the kernels through Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1`` is set below, before the kernels are imported). When torch sees a GPU
and ``TRITON_INTERPRET`` is not set to 1 in the environment, the same tests run compiled on
CUDA tensors. The interpreter costs milliseconds per program (one program per chunk of
``BLOCK_SIZE`` elements), so the sizes here are chosen to keep the program count small.
"""
import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is first imported

triton = pytest.importorskip("triton")

import emcl_kernels  # noqa: E402
from emcl_kernels import functional as F  # noqa: E402
from emcl_kernels.backends import get_backend  # noqa: E402
from emcl_testing import (DTYPES, MODES, OPS, SIZES, apply, assert_case_close,  # noqa: E402
                          assert_close, check_against_reference, clone_case, fresh_grads, make_case)


def _load_backend():
    """The backend module, interpreted on CPU-only machines even if another test imported it
    compiled first (Triton picks compiled or interpreted when the kernels are defined)."""
    tb = importlib.import_module("emcl_kernels.backends.triton")
    if not ON_GPU and not tb.INTERPRETED:
        importlib.reload(sys.modules["emcl_kernels.backends.triton_kernels"])
        tb = importlib.reload(tb)
    return tb


TB = _load_backend()
DEVICE = "cuda" if ON_GPU else "cpu"


def _check(op, sizes, dtype, mode, **kw):
    check_against_reference("triton", op, sizes, dtype, mode, device=DEVICE, **kw)


class _CountingKernel:
    """Wraps the kernel and counts launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        self.launches += 1
        self.grids.append(grid)
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


@pytest.fixture
def count_launches(monkeypatch):
    counter = _CountingKernel(TB._kernels.emcl_kernel)
    monkeypatch.setattr(TB._kernels, "emcl_kernel", counter)
    return counter


# ---------------------------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------------------------

def test_triton_is_available_here():
    assert "triton" in emcl_kernels.available_backends()
    assert TB.unavailable_reason("triton", DEVICE) is None
    assert get_backend("triton", torch.device(DEVICE)) is TB


@pytest.mark.skipif(ON_GPU, reason="the interpreter is only used without a GPU")
def test_interpreter_refuses_cuda_tensors_with_a_reason():
    reason = TB.unavailable_reason("triton", "cuda")
    assert reason is not None and "TRITON_INTERPRET" in reason


def test_no_autotuner_reapplies_the_in_place_update():
    # An autotuner benchmarks several runs of the kernel: each would apply the step again.
    from triton.runtime.autotuner import Autotuner
    assert not isinstance(TB._kernels.emcl_kernel, Autotuner)


# ---------------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_reference(op, mode, dtype):
    """Every op, mode and dtype on sizes 0, 1, 7, 4097 (a full chunk and a 1-element tail)."""
    _check(op, SIZES, dtype, mode, steps=2, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_triton_chained_steps(op, dtype):
    """Nine chained steps with fresh gradients; each (op, dtype) under a different mode so that
    every mode is chained somewhere."""
    mode = MODES[(OPS.index(op) * len(DTYPES) + DTYPES.index(dtype)) % len(MODES)]
    _check(op, [1, 7, 300, 33], dtype, mode, steps=9, seed=11)


@pytest.mark.parametrize("op,dtype", [("inner_meta_step", torch.float32),
                                      ("inner_meta_step", torch.bfloat16),
                                      ("meta_step", torch.float16),
                                      ("inner_step", torch.float64)], ids=str)
def test_triton_many_tensors(op, dtype, count_launches):
    """123 tensors of odd sizes (some empty) in one launch per step."""
    sizes = [(i * 37) % 101 for i in range(123)]
    _check(op, sizes, dtype, MODES[1], steps=2, seed=5)
    assert count_launches.launches == 2
    assert count_launches.grids[0] == (sum(1 for n in sizes if n),)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_small_blocks_many_chunks(dtype, monkeypatch):
    """Chunk boundaries: sizes around multiples of a small block, several chunks per tensor."""
    monkeypatch.setattr(TB, "BLOCK_SIZE", 64)
    _check("inner_meta_step", [0, 1, 63, 64, 65, 130, 7, 256], dtype, MODES[0], steps=3, seed=2)


def test_unaligned_tensors(count_launches):
    """Contiguous views at odd element offsets: addresses not 16-byte aligned."""
    hyper = MODES[4].hyper("inner_meta_step")
    case = make_case([33, 70, 5], torch.float32, seed=9, device=DEVICE)
    buf = [torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE) for t in case.params]
    for b, t in zip(buf, case.params):
        b[1:].copy_(t.reshape(-1))
    case.params = [b[1:].view(t.shape) for b, t in zip(buf, case.params)]
    expected = clone_case(case, torch.float64, device="cpu")
    apply("inner_meta_step", "triton", case, hyper)
    apply("inner_meta_step", "reference", expected, hyper)
    assert_case_close(case, expected, torch.float32, "unaligned")
    key = next(reversed(TB._plans))
    assert not TB._plans[key].state_aligned


# ---------------------------------------------------------------------------------------------
# grad_scale and found_inf: read inside the kernel
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_grad_scale_and_found_inf(op, dtype):
    mode = MODES[0]
    hyper = mode.hyper(op)
    case = make_case([7, 300], dtype, seed=4, device=DEVICE)
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    scale = torch.tensor(8.0)
    case.grads = [g * 8 for g in case.grads]               # exact in every dtype
    expected.grads = [g.to("cpu", ref_dtype) for g in case.grads]
    apply(op, "triton", case, hyper, grad_scale=scale.to(DEVICE),
          found_inf=torch.tensor(0.0, device=DEVICE))
    apply(op, "reference", expected, hyper, grad_scale=scale)
    assert_case_close(case, expected, dtype, f"{op} grad_scale", with_meta_lrs=op != "inner_step")

    before = clone_case(case)
    apply(op, "triton", case, hyper, grad_scale=scale.to(DEVICE),
          found_inf=torch.tensor(1.0, device=DEVICE))
    for name, lst in case.tensors().items():
        for a, b in zip(lst, before.tensors()[name]):
            assert torch.equal(a, b), f"found_inf=1 but {name} was written"


def _assert_same_values(actual, expected, dtype, what):
    """NaN where the reference has NaN, the same infinities, the finite values close."""
    a, e = actual.detach().double().cpu().reshape(-1), expected.detach().double().cpu().reshape(-1)
    assert torch.equal(a.isnan(), e.isnan()), f"{what}: NaN at different places"
    inf = e.isinf()
    assert torch.equal(a[inf], e[inf]), f"{what}: different infinities"
    fin = e.isfinite()
    assert_close(a[fin], e[fin], dtype, what)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, inf*0
@pytest.mark.parametrize("mode", [m for m in MODES if m.prox and m.lr_mode != "constant"],
                         ids=lambda m: m.id)
@pytest.mark.parametrize("op", ("meta_step", "inner_meta_step"))
def test_non_finite_gradients_propagate_like_the_reference(op, mode):
    """Without found_inf, NaN/inf gradients give the reference's NaN/inf (the clamp of the
    meta learning rate keeps NaN as torch.clamp does), never silently finite values."""
    hyper = mode.hyper(op)
    case = make_case([37, 5], torch.float32, seed=8, device=DEVICE)
    for g in case.grads:
        flat = g.view(-1)
        flat[1], flat[3] = float("nan"), float("inf")
        flat[4] = -float("inf")
    expected = clone_case(case, torch.float64, device="cpu")
    apply(op, "triton", case, hyper)
    apply(op, "reference", expected, hyper)
    for name, lst in case.tensors().items():
        if name == "meta_lrs" and mode.lr_mode != "recurrent":
            continue
        for i, (a, e) in enumerate(zip(lst, expected.tensors()[name])):
            _assert_same_values(a, e, torch.float32, f"{op} {mode.id} {name}[{i}]")


# ---------------------------------------------------------------------------------------------
# One launch per group and step; the tables are cached while the tensors do not move
# ---------------------------------------------------------------------------------------------

def test_one_launch_per_group(count_launches):
    """Two dtypes in one call: two groups, two launches."""
    a = make_case([5, 4097, 0], torch.float32, seed=1, device=DEVICE)
    b = make_case([9, 1], torch.bfloat16, seed=2, device=DEVICE)
    hyper = MODES[2].hyper("meta_step")
    F.meta_step_(a.params + b.params, a.grads + b.grads, a.anchors + b.anchors,
                 a.importances + b.importances, None, backend="triton", **hyper)
    assert count_launches.launches == 2
    assert sorted(count_launches.grids) == [(2,), (3,)]


def test_all_empty_launches_nothing(count_launches):
    case = make_case([0, 0], torch.float32, seed=1, device=DEVICE)
    apply("inner_step", "triton", case, MODES[0].hyper("inner_step"))
    assert count_launches.launches == 0


def test_tables_cached_and_gradient_table_refreshed():
    TB.clear_cache()
    hyper = MODES[0].hyper("inner_meta_step")
    case = make_case([7, 300], torch.float32, seed=6, device=DEVICE)
    expected = clone_case(case, torch.float64, device="cpu")
    start = dict(TB.build_counts)

    def step(new_grads):
        if new_grads:                                    # reallocated, as set_to_none does
            case.grads = fresh_grads(case, seed=len(case.grads) + TB.build_counts["grads"])
        else:                                            # same storage, new values
            for g, n in zip(case.grads, fresh_grads(case, seed=77)):
                g.copy_(n)
        expected.grads = [g.to("cpu", torch.float64) for g in case.grads]
        apply("inner_meta_step", "triton", case, hyper)
        apply("inner_meta_step", "reference", expected, hyper)
        assert_case_close(case, expected, torch.float32, "cached tables")

    step(new_grads=False)
    assert TB.build_counts["state"] - start["state"] == 1
    assert TB.build_counts["grads"] - start["grads"] == 1
    step(new_grads=False)
    assert TB.build_counts["state"] - start["state"] == 1     # nothing moved: no rebuild
    assert TB.build_counts["grads"] - start["grads"] == 1
    step(new_grads=True)
    assert TB.build_counts["state"] - start["state"] == 1     # only the gradient table
    assert TB.build_counts["grads"] - start["grads"] == 2
    # Parameters and state moved (e.g. load_state_dict into new tensors): new tables.
    for name in ("params", "anchors", "importances"):
        setattr(case, name, [t.clone() for t in getattr(case, name)])
    step(new_grads=False)
    assert TB.build_counts["state"] - start["state"] == 2


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 40 GB (2**31 + 5 elements)")
def test_past_2_31_elements():
    free, _ = torch.cuda.mem_get_info()
    n = 2 ** 31 + 5
    if free < 40 * 2 ** 30:
        pytest.skip("needs 40 GB of free GPU memory")
    hyper = MODES[1].hyper("inner_step")
    p = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(n, device="cuda")
    h = torch.rand(n, device="cuda") + 0.1
    tail = slice(n - 4101, n)
    want_p = p[tail].clone()
    emcl_kernels.reference.inner_step_(want_p, g[tail], a[tail], h[tail], **hyper)
    F.inner_step_([p], [g], [a], [h], backend="triton", **hyper)
    assert_close(p[tail], want_p, torch.bfloat16, "the last 4101 of 2**31 + 5 elements")


# ---------------------------------------------------------------------------------------------
# The compiled path, checked without a GPU: compile for sm_90 and read the PTX
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from emcl_kernels.backends import triton_kernels as K
assert type(K.emcl_kernel).__name__ == "JITFunction", type(K.emcl_kernel)
names = ["PARAM", "DO_INNER", "DO_META", "PROX", "SI", "LR_MODE", "HAS_GRAD_SCALE",
         "HAS_FOUND_INF", "ALIGNED", "BLOCK"]
signature = {"chunks": "*i64", "tensors": "*i64", "grads": "*i64", "hyper": "*fp64",
             "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
signature.update({n: "constexpr" for n in names})
out = []
for combo in json.loads(sys.argv[1]):
    src = ASTSource(fn=K.emcl_kernel, signature=signature, constexprs=dict(zip(names, combo)))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    out.append(sorted(set(re.findall(r"(?:ld|st)\.global\.v\d\.b\d+", ptx))))
print(json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests run compiled")
def test_compiles_for_the_gpu_with_vector_access():
    """The GPU source compiles (front end to PTX, no GPU needed) for every dtype and the
    combined step, and aligned full chunks use 16-byte vector loads and stores."""
    import json
    import subprocess
    combos = [[p, True, True, True, False, 0, True, True, True, 4096] for p in range(4)]
    combos.append([1, True, True, False, True, 1, False, False, False, 4096])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(combos)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is missing here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    vectors = json.loads(proc.stdout.strip().splitlines()[-1])
    for combo, v in zip(combos, vectors):
        if combo[8]:                          # aligned: loads and stores of 16 bytes
            assert any(x.startswith("ld") and x.endswith(("v4.b32", "v2.b64")) for x in v), (combo, v)
            assert any(x.startswith("st") and x.endswith(("v4.b32", "v2.b64")) for x in v), (combo, v)
        else:                                 # unaligned addresses: no vector access promised
            assert v == [], (combo, v)
