"""The Triton backend does [note: the step call] of emcl_kernels.interface like the reference
backend: tensors, counters and meta-step counts (SPEC section 4), in one launch per group for
the update and one for the finite check.

Without a GPU these tests run the kernels through Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1`` is set below, before the kernels are imported). When torch sees a GPU
and ``TRITON_INTERPRET`` is not set to 1 in the environment, the same tests run compiled on
CUDA tensors, plus the GPU-only ones (CUDA graph capture, 2**31 elements, the fast launch
against the JIT). The interpreter costs tens of milliseconds per program (one program per
chunk of ``BLOCK_SIZE`` elements), so the sizes and the mode grid here are chosen to keep the
program count small.

The checks every backend passes are those of ``tests/test_step_interface.py``: they are called
from here with the Triton backend and this file's device.
"""
import importlib
import inspect
import itertools
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is first imported

triton = pytest.importorskip("triton")

import emcl_kernels  # noqa: E402
from emcl_kernels.backends import get_backend  # noqa: E402
from emcl_kernels.interface import OP  # noqa: E402
from emcl_testing import (DTYPES, MODES, SIZES, assert_case_close, assert_close,  # noqa: E402
                          call_step, check_step_matches_reference, clone_case, counters_dict,
                          fresh_grads, make_case, mode_codes, new_counters, pack_hyper,
                          reference_backend, step_hyper)
import test_step_interface as shared  # noqa: E402  (the checks every backend passes)


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
STEP_OPS = ("inner", "meta", "inner_meta", "cadence")


class _Counter:
    """The grids of one kernel's launches, in order."""

    def __init__(self):
        self.grids = []

    @property
    def launches(self):
        return len(self.grids)


class _Launches:
    """Counts every launch of the update and the check kernel at the backend's launcher, the
    JIT's path and the fast one alike (on a GPU a launch the launcher has seen before skips
    the JIT: counting at the kernel object would miss it)."""

    def __init__(self, monkeypatch):
        self.update, self.check = _Counter(), _Counter()
        counters = {TB._STEP.name: self.update, TB._CHECK.name: self.check}
        launch = TB._Launcher.__call__

        def counted(launcher, grid, *args, **kwargs):
            counters[launcher.name].grids.append((grid,))
            return launch(launcher, grid, *args, **kwargs)

        monkeypatch.setattr(TB._Launcher, "__call__", counted)


@pytest.fixture
def launches(monkeypatch):
    return _Launches(monkeypatch)


def _chunks(sizes, block=None):
    block = block or TB.BLOCK_SIZE
    return sum((n + block - 1) // block for n in sizes)


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
    assert not isinstance(TB._kernels.emcl_step_kernel, Autotuner)
    assert not isinstance(TB._kernels.emcl_check_kernel, Autotuner)


# ---------------------------------------------------------------------------------------------
# Against the reference backend
# ---------------------------------------------------------------------------------------------

def _modes_for(op, dtype):
    """Every mode for fp32; for the other dtypes three modes per op, so that each dtype meets
    every mode once over the four ops (the math is the same code, the dtype only changes the
    loads and stores)."""
    if dtype == torch.float32:
        return MODES
    k = STEP_OPS.index(op)
    return MODES[3 * k:3 * k + 3]


_GRID = [pytest.param(op, mode, dtype, id=f"{op}-{mode.id}-{str(dtype)[6:]}")
         for dtype in DTYPES for op in STEP_OPS for mode in _modes_for(op, dtype)]


@pytest.mark.parametrize("op, mode, dtype", _GRID)
def test_step_matches_reference(op, mode, dtype):
    """Sizes 0, 1, 7, 4097 (an empty tensor, tails, a full chunk and a one-element tail):
    tensors, counters and steps after each call; the cadence (meta_every 2) does an inner
    step, an inner+meta step, an inner step."""
    check_step_matches_reference(TB, op, SIZES, dtype, mode, device=DEVICE,
                                 calls=3 if op == "cadence" else 2, meta_every=2, seed=3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_many_tensors_of_odd_sizes_in_one_launch(dtype, launches):
    """133 tensors, sizes around the vector width and the chunk size: one launch, one
    program per chunk."""
    sizes = [(i * 37) % 301 + (i % 5) for i in range(130)] + [16385, 4099, 33]
    check_step_matches_reference(TB, "inner_meta", sizes, dtype, MODES[1], device=DEVICE,
                                 calls=1, seed=5)
    assert launches.update.grids == [(_chunks(sizes),)] and launches.check.launches == 0


def _at_odd_address(t):
    """``t``'s values in a new tensor that starts one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("op", ("inner", "cadence"))
def test_chunks_and_odd_addresses(op, dtype, monkeypatch):
    """Small chunks (BLOCK_SIZE 64: the scalar path loops over 16-element pieces) around the
    chunk boundaries, with one tensor's param and another's gradient at odd addresses among
    aligned tensors: every chunk right, whichever path it takes."""
    monkeypatch.setattr(TB, "BLOCK_SIZE", 64)
    mode = MODES[0]
    hyper = step_hyper(mode)
    sizes = [0, 1, 15, 16, 17, 64, 65, 130, 7, 256]
    case = make_case(sizes, dtype, seed=2, device=DEVICE)
    case.params[5] = _at_odd_address(case.params[5])
    case.grads[7] = _at_odd_address(case.grads[7])
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    counters, ref_counters = new_counters(DEVICE), new_counters()
    for call in range(3):
        call_step(TB, op, case, mode, hyper, counters, meta_every=2)
        call_step(reference_backend(), op, expected, mode, hyper, ref_counters, meta_every=2)
        assert_case_close(case, expected, dtype, f"{op} {dtype} call {call + 1}")
        for g, new in zip(case.grads, fresh_grads(case, seed=call)):
            g.copy_(new)                                  # the odd gradient stays odd
        expected.grads = [g.detach().to("cpu", ref_dtype, copy=True) for g in case.grads]
    assert counters_dict(counters.cpu()) == counters_dict(ref_counters)
    assert case.params[5].data_ptr() % 16 != 0 and case.grads[7].data_ptr() % 16 != 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_check_of_full_chunks_at_odd_addresses(dtype, monkeypatch):
    """The finite check and a checked step over gradients that start one element past a
    16-byte boundary, with several full chunks each (BLOCK_SIZE 64): a NaN or inf anywhere in
    them is found, a clean set is not flagged, and a checked step at odd addresses matches the
    reference. Compiled, the full chunks of an odd gradient must take the scalar path: the
    16-byte loads of the vector path fault on such an address."""
    monkeypatch.setattr(TB, "BLOCK_SIZE", 64)
    sizes = [200, 64, 3 * 64, 129]                        # full chunks, and tails
    case = make_case(sizes, dtype, seed=5, device=DEVICE)
    case.grads = [_at_odd_address(g) for g in case.grads]
    assert all(g.data_ptr() % 16 != 0 for g in case.grads)
    counters = new_counters(DEVICE)
    TB.check_finite(list(case.grads), counters)
    assert counters_dict(counters.cpu())["found"] == 0, "clean gradients flagged"
    for t, where, bad in ((0, 70, float("nan")), (2, 130, float("inf")), (3, 128, -float("inf"))):
        g = case.grads[t]
        keep = g.view(-1)[where].item()
        g.view(-1)[where] = bad
        counters = new_counters(DEVICE)
        TB.check_finite(list(case.grads), counters)
        assert counters_dict(counters.cpu())["found"] == 1, f"{bad} at {where} of grads[{t}] missed"
        g.view(-1)[where] = keep
    mode = MODES[0]
    hyper = step_hyper(mode)
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    counters, ref_counters = new_counters(DEVICE), new_counters()
    call_step(TB, "cadence", case, mode, hyper, counters, meta_every=2, check=True)
    call_step(reference_backend(), "cadence", expected, mode, hyper, ref_counters, meta_every=2,
              check=True)
    assert_case_close(case, expected, dtype, f"checked step at odd addresses, {dtype}")
    assert counters_dict(counters.cpu()) == counters_dict(ref_counters)


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
def test_unchecked_non_finite_gradients_propagate_like_the_reference(mode):
    """With check=False, NaN/inf gradients give the reference's NaN/inf (the clamp of the
    meta learning rate keeps NaN as torch.clamp does), never silently finite values."""
    hyper = step_hyper(mode)
    case = make_case([37, 5], torch.float32, seed=8, device=DEVICE)
    for g in case.grads:
        flat = g.view(-1)
        flat[1], flat[3], flat[4] = float("nan"), float("inf"), -float("inf")
    expected = clone_case(case, torch.float64, device="cpu")
    call_step(TB, "inner_meta", case, mode, hyper, new_counters(DEVICE))
    call_step(reference_backend(), "inner_meta", expected, mode, hyper, new_counters())
    for name, lst in case.tensors().items():
        if name == "meta_lrs" and mode.lr_mode != "recurrent":
            continue
        for i, (a, e) in enumerate(zip(lst, expected.tensors()[name])):
            _assert_same_values(a, e, torch.float32, f"{mode.id} {name}[{i}]")


# ---------------------------------------------------------------------------------------------
# The checks of tests/test_step_interface.py, on this backend
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", (float("nan"), float("inf"), -float("inf")))
@pytest.mark.parametrize("op", ("inner", "meta", "cadence"))
def test_check_skips_the_whole_call(dtype, value, op):
    shared.test_check_skips_the_whole_call("triton", DEVICE, dtype, value, op)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_finite_sets_found_and_writes_nothing(dtype):
    shared.test_check_finite_sets_found_and_writes_nothing("triton", DEVICE, dtype)


def test_found_inf_skips_without_counting_a_skip():
    shared.test_found_inf_skips_without_counting_a_skip("triton", DEVICE)


@pytest.mark.parametrize("op", ("inner", "inner_meta"))
def test_grad_scale_divides_the_gradients(op):
    shared.test_grad_scale_divides_the_gradients("triton", DEVICE, op)


def test_cadence_is_every_meta_every_th_call():
    shared.test_cadence_is_every_meta_every_th_call("triton", DEVICE)


def test_one_bad_group_skips_every_group():
    shared.test_one_bad_group_skips_every_group("triton", DEVICE)


@pytest.mark.parametrize("op", ("meta", "inner_meta"))
def test_lr_scale_sentinel_means_one_over_reg(op):
    shared.test_lr_scale_sentinel_means_one_over_reg("triton", DEVICE, op)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_prox_update_of_huge_parameters(dtype):
    shared.test_prox_update_of_huge_parameters("triton", DEVICE, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy: α overflows
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
def test_dead_units_stay_put(mode):
    shared.test_dead_units_stay_put("triton", DEVICE, mode)


def test_dense_non_contiguous_layouts():
    shared.test_dense_non_contiguous_layouts("triton", DEVICE)


# ---------------------------------------------------------------------------------------------
# Launches, counters without tensors, cached tables
# ---------------------------------------------------------------------------------------------

def test_one_launch_for_the_update_and_one_for_the_check(launches):
    """step(check=True) is two launches over the same chunks; check_finite is one per dtype;
    the multi-group protocol is one check and one update per group."""
    mode = MODES[1]
    hyper = step_hyper(mode)
    a = make_case([5, 4097, 0], torch.float32, seed=1, device=DEVICE)
    b = make_case([9, 1], torch.bfloat16, seed=2, device=DEVICE)
    counters = new_counters(DEVICE)
    call_step(TB, "cadence", a, mode, hyper, counters, check=True)
    assert launches.check.grids == [(3,)] and launches.update.grids == [(3,)]
    TB.check_finite(a.grads + b.grads, counters)                # two dtypes: two launches
    assert sorted(launches.check.grids[1:]) == [(2,), (3,)]
    assert launches.update.launches == 1
    TB.check_finite(a.grads, counters)
    TB.check_finite(b.grads, counters)
    call_step(TB, "cadence", a, mode, hyper, counters, finalize=False)
    call_step(TB, "cadence", b, mode, hyper, counters, finalize=True)
    assert launches.check.launches == 5 and launches.update.grids[1:] == [(3,), (2,)]
    assert counters_dict(counters.cpu()) == dict(found=0, calls=2, skipped=0, done=0)


def test_a_group_of_empty_tensors_still_counts(launches):
    """No element to update: no check launch, one single-program update launch that counts
    the meta step of every param (the empty ones too) and finalizes; nothing at all when
    there is nothing to count."""
    mode = MODES[2]
    case = make_case([0, 0], torch.float32, seed=1, device=DEVICE)
    counters = new_counters(DEVICE, found=1, calls=4)
    steps = torch.zeros(2, device=DEVICE)
    call_step(TB, "cadence", case, mode, step_hyper(mode), counters, steps=steps,
              meta_every=5, check=True)
    assert launches.check.launches == 0 and launches.update.grids == [(1,)]
    assert counters_dict(counters.cpu()) == dict(found=0, calls=5, skipped=1, done=0)
    assert not steps.any()                                   # skipped (found was 1)
    call_step(TB, "meta", case, mode, step_hyper(mode), counters, steps=steps)
    assert steps.tolist() == [1.0, 1.0]
    call_step(TB, "inner", case, mode, step_hyper(mode), counters, finalize=False)
    assert launches.update.launches == 2                     # nothing to do: no launch
    empty = make_case([], torch.float32, seed=1, device=DEVICE)
    call_step(TB, "cadence", empty, mode, step_hyper(mode), counters,
              steps=torch.zeros(0, device=DEVICE))
    assert counters_dict(counters.cpu())["calls"] == 6


def test_tables_cached_and_gradient_table_refreshed():
    """Nothing moved: no table made. New gradients: only the gradient table. Moved state: a new
    state table (the chunk table of the same sizes is kept). check_finite shares the tables."""
    TB.clear_cache()
    mode = MODES[0]
    hyper = step_hyper(mode)
    case = make_case([7, 300], torch.float32, seed=6, device=DEVICE)
    expected = clone_case(case, torch.float64, device="cpu")
    counters, ref_counters = new_counters(DEVICE), new_counters()
    start = dict(TB.build_counts)

    def made():
        return {k: TB.build_counts[k] - start[k] for k in ("state", "grads", "chunks")}

    def step(new_grads):
        if new_grads:                                    # reallocated, as set_to_none does
            case.grads = fresh_grads(case, seed=len(case.grads) + TB.build_counts["grads"])
        else:                                            # same storage, new values
            for g, n in zip(case.grads, fresh_grads(case, seed=77)):
                g.copy_(n)
        expected.grads = [g.to("cpu", torch.float64) for g in case.grads]
        call_step(TB, "inner_meta", case, mode, hyper, counters, check=True)
        call_step(reference_backend(), "inner_meta", expected, mode, hyper, ref_counters)
        assert_case_close(case, expected, torch.float32, "cached tables")

    step(new_grads=False)
    assert made() == dict(state=1, grads=1, chunks=1)
    step(new_grads=False)
    assert made() == dict(state=1, grads=1, chunks=1)        # nothing moved: nothing made
    TB.check_finite(case.grads, counters)
    assert made() == dict(state=1, grads=1, chunks=1)        # the step's tables
    step(new_grads=True)
    assert made() == dict(state=1, grads=2, chunks=1)        # only the gradient table
    for name in ("params", "anchors", "importances", "meta_lrs"):
        setattr(case, name, [t.clone() for t in getattr(case, name)])
    step(new_grads=False)                                    # e.g. load_state_dict into new tensors
    assert made() == dict(state=2, grads=2, chunks=1)


def test_two_state_sets_over_the_same_parameters_keep_their_own_tables():
    """[note: cache keys]: two optimizers over the same parameters, each with its own state
    (checked and unchecked, a comparison), stepped in turn: after each one's first step no
    table is made again, and each one's tensors follow the reference as if it ran alone."""
    TB.clear_cache()
    mode = MODES[0]
    hyper = step_hyper(mode)
    first = make_case([7, 300], torch.float32, seed=21, device=DEVICE)
    second = clone_case(first)
    second.params, second.grads = first.params, first.grads          # the same parameters
    second.anchors = [a + 0.1 for a in first.anchors]                # their own state
    second.importances = [h * 2 for h in first.importances]
    expected = [clone_case(c, torch.float64, device="cpu") for c in (first, second)]
    counters = [new_counters(DEVICE), new_counters(DEVICE)]
    ref_counters = [new_counters(), new_counters()]
    built = None
    for r in range(4):
        if r == 1:                              # each one has made its tables in round 0
            built = dict(TB.build_counts)
        for i, case in enumerate((first, second)):
            for _ in range(2):
                expected[i].params = [p.detach().to("cpu", torch.float64) for p in case.params]
                call_step(TB, "inner_meta", case, mode, hyper, counters[i], check=i == 0)
                call_step(reference_backend(), "inner_meta", expected[i], mode, hyper,
                          ref_counters[i])
                assert_case_close(case, expected[i], torch.float32, f"round {r}, set {i}")
    assert {k: TB.build_counts[k] - built[k] for k in ("state", "grads", "chunks")} == \
        dict(state=0, grads=0, chunks=0)


@pytest.mark.skipif(TB._PLAN_GRADS is None, reason="needs the compiled extension (_C)")
def test_cached_tables_confirmed_by_the_cpp_passes():
    """Gradients that are the parameters' ``.grad``: a cached plan is confirmed by the C++
    passes ([note: native confirmation]). Gradients passed that are not the ``.grad``, a
    parameter or a state tensor moved, a parameter resized in place: the Python comparisons
    decide, and the kernels read what was passed (equal to the reference every time)."""
    TB.clear_cache()
    mode = MODES[1]
    hyper = step_hyper(mode)
    case = make_case([7, 301], torch.float32, seed=12, device=DEVICE)
    expected = clone_case(case, torch.float64, device="cpu")
    counters, ref_counters = new_counters(DEVICE), new_counters()
    start = dict(TB.lookups)

    def step(grads=None, seed=0):
        new = fresh_grads(case, seed=seed)
        for p, g in zip(case.params, new):
            p.grad = g
        case.grads = list(new) if grads is None else grads
        expected.grads = [g.to("cpu", torch.float64) for g in case.grads]
        call_step(TB, "inner_meta", case, mode, hyper, counters, check=True)
        call_step(reference_backend(), "inner_meta", expected, mode, hyper, ref_counters)
        assert_case_close(case, expected, torch.float32, f"seed {seed}")
        # (each call_step packs a new hyper tensor: never a checked plan, [note: checked plans])
        return {k: TB.lookups[k] - start[k] for k in ("confirmed", "compared")}

    assert step(seed=1) == dict(confirmed=0, compared=0)            # built
    assert step(seed=2) == dict(confirmed=1, compared=0)
    assert step(fresh_grads(case, seed=3), seed=4) == dict(confirmed=1, compared=1)
    case.anchors = [a.clone() for a in case.anchors]                 # moved state
    built = TB.build_counts["state"]
    assert step(seed=5) == dict(confirmed=1, compared=1)
    assert TB.build_counts["state"] == built + 1
    assert step(seed=6) == dict(confirmed=2, compared=1)
    with torch.no_grad():                                            # same address, one
        case.params[1].resize_(300)                                  # element fewer
    for c in (case, expected):
        for name in ("grads", "anchors", "importances", "meta_lrs") + (
                ("params",) if c is expected else ()):
            getattr(c, name)[1] = getattr(c, name)[1][:300].clone()
    built = TB.build_counts["state"]
    assert step(seed=7) == dict(confirmed=2, compared=1)
    assert TB.build_counts["state"] == built + 1


@pytest.mark.skipif(TB._LAYOUTS_ARE is None, reason="the extension's layout passes are not built")
def test_a_checked_plan_skips_only_calls_the_checks_would_pass():
    """[note: checked plans]: once a confirmed plan's call passed the checks, the same call
    skips them; a call that differs in any tensor the checks look at (here: the counters, a
    state tensor's dtype, hyper's size) or in an option is checked again, and a bad one is
    refused before anything is written, as on the first call. Each set of options keeps its
    own record, so calls that alternate between two skip the checks too."""
    TB.clear_cache()
    mode = MODES[1]
    case = make_case([7, 301], torch.float32, seed=14, device=DEVICE)
    for p, g in zip(case.params, case.grads):
        p.grad = g
    h = pack_hyper(step_hyper(mode), DEVICE)
    counters = new_counters(DEVICE)
    steps = torch.zeros(0, device=DEVICE)
    codes = dict(mode_codes(mode), meta_every=1, check=True, finalize=True)

    def call(anchors=None, hyper=None, counters_=None, meta_every=1):
        TB.step(case.params, case.grads, case.anchors if anchors is None else anchors,
                case.importances, [], steps, h if hyper is None else hyper,
                counters if counters_ is None else counters_, op=OP["inner_meta"],
                **{**codes, "meta_every": meta_every})

    case.grads = [p.grad for p in case.params]
    call()
    call()                                              # recorded
    before = TB.lookups["checked"]
    call()
    assert TB.lookups["checked"] == before + 1          # skipped
    snapshot = [t.clone() for t in case.params + case.anchors + case.importances]
    bad = {"counters_": torch.zeros(3, dtype=torch.float32, device=DEVICE),
           "hyper": h[:-1].clone(),
           "anchors": [case.anchors[0].double()] + case.anchors[1:]}
    for name, value in bad.items():
        before = TB.lookups["checked"]
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            call(**{name: value})
        assert TB.lookups["checked"] == before, name     # checked, not skipped
    for now, then in zip(case.params + case.anchors + case.importances, snapshot):
        assert torch.equal(now, then)                   # refused before anything was written
    before = TB.lookups["checked"]
    call(meta_every=2)                                  # another option: checked, then recorded
    assert TB.lookups["checked"] == before
    call(meta_every=2)
    assert TB.lookups["checked"] == before + 1
    before = TB.lookups["checked"]                      # each option keeps its own record:
    for _ in range(3):                                  # calls that alternate (inner steps,
        call()                                          # then a meta step) are skipped too
        call(meta_every=2)
    assert TB.lookups["checked"] == before + 6
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        call(meta_every=2, hyper=h[:-1].clone())          # and a bad one is still refused


def test_hyper_is_read_at_every_call():
    """The kernels read ``hyper`` from the tensor each call: changed in place, it acts."""
    mode = MODES[4]
    hyper = step_hyper(mode)
    a = make_case([7, 300], torch.float32, seed=3, device=DEVICE)
    b = clone_case(a)
    h = pack_hyper(hyper, DEVICE)
    counters = new_counters(DEVICE)
    steps = torch.zeros(0, device=DEVICE)
    codes = dict(mode_codes(mode), meta_every=1, check=False, finalize=True)
    TB.step(a.params, a.grads, a.anchors, a.importances, [], steps, h, counters,
            op=OP["inner_meta"], **codes)
    h.copy_(pack_hyper({**hyper, "inner_lr": 0.01, "decay": 0.5}, DEVICE))
    TB.step(a.params, a.grads, a.anchors, a.importances, [], steps, h, counters,
            op=OP["inner_meta"], **codes)
    for hp in (hyper, {**hyper, "inner_lr": 0.01, "decay": 0.5}):
        call_step(reference_backend(), "inner_meta", b, mode, hp, new_counters())
    assert_case_close(a, b, torch.float32, "hyper changed in place")


# ---------------------------------------------------------------------------------------------
# Fast launch ([note: fast launch] in emcl_kernels/backends/triton.py)
# ---------------------------------------------------------------------------------------------
# The interpreter has no compiled kernel, so on CPU these tests give the launcher a stand-in
# for one: the JIT path runs the interpreted kernel, and the "compiled kernel" it returns runs
# the interpreted kernel again from the launcher's arguments, taken as a compiled launcher takes
# them (the constexprs by position after the other arguments). A fast launch whose arguments
# were packed wrong computes a wrong step here. What only a GPU shows: Triton's own launcher
# accepting them, and the JIT choosing the same compiled kernel for a key
# (test_fast_launch_uses_the_kernel_the_jit_picks).


def _jit_twin(kernel):
    """A compiled-mode ``JITFunction`` of the same Python function as ``kernel`` (interpreted
    or compiled), with the same decorator options."""
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


def _triton_binder(kernel):
    """Triton's own argument binder of ``kernel`` for a CUDA target (sm_90): what
    ``JITFunction.run`` specializes on, computed without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    jit = _jit_twin(kernel)
    return create_function_from_signature(jit.signature, jit.params,
                                          make_backend(GPUTarget("cuda", 90, 32)))


class _InterpretedCompiled:
    """Stands for a compiled kernel: ``run`` takes a compiled launcher's arguments and runs
    the interpreted kernel on them, every argument by position."""

    def __init__(self, interpreted, n_params):
        self.interpreted = interpreted
        self.function = 1
        self.packed_metadata = ()
        self.src = type("Src", (), {"signature": dict.fromkeys(range(n_params))})()
        self.runs = []

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook,
            *args):
        assert (gy, gz, function, packed) == (1, 1, self.function, self.packed_metadata)
        assert launch_metadata is None and enter_hook is None and exit_hook is None
        self.runs.append(gx)
        self.interpreted[(gx,)](*args)


class _JitStandIn:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](...)`` runs the interpreted kernel
    (the JIT path) and returns an :class:`_InterpretedCompiled`, one per Triton cache key
    (Triton's own binder for a CUDA target computes the key)."""

    def __init__(self, interpreted):
        self.interpreted = interpreted
        self.binder = _triton_binder(interpreted)
        self.n_params = len(inspect.signature(interpreted.fn).parameters)
        self.compiled = {}
        self.pre_run_hooks = []
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
            kwargs.pop("num_warps", None)
            _, spec, _ = self.binder(*args, **kwargs)
            self.interpreted[grid](*args, **kwargs)
            return self.compiled.setdefault(repr(spec), _InterpretedCompiled(
                self.interpreted, self.n_params))
        return launch


@pytest.fixture
def fast_launch(monkeypatch):
    """The launcher's fast path switched on over stand-ins for compiled kernels."""
    step_k = _JitStandIn(TB._kernels.emcl_step_kernel)
    check_k = _JitStandIn(TB._kernels.emcl_check_kernel)
    monkeypatch.setattr(TB._kernels, "emcl_step_kernel", step_k)
    monkeypatch.setattr(TB._kernels, "emcl_check_kernel", check_k)
    monkeypatch.setattr(TB, "FAST_LAUNCH", True)
    return step_k, check_k


def _runs(kernel):
    return sum(len(c.runs) for c in kernel.compiled.values())


@pytest.mark.skipif(ON_GPU, reason="the stand-ins run the interpreter")
def test_fast_launch_steps_like_the_reference(fast_launch):
    """After the JIT's first launch of a key, every launch is a direct call of the kept
    kernel, with the arguments in the kernel's order: the cadence steps (check, inner and
    inner+meta updates, a finalize) equal the reference's; a new key (steps at an address
    that is not 16-byte aligned, a grad_scale) goes through the JIT once."""
    step_k, check_k = fast_launch
    mode = MODES[0]
    hyper = step_hyper(mode)
    case = make_case([7, 300, 4097], torch.float32, seed=8, device=DEVICE)
    expected = clone_case(case, torch.float64, device="cpu")
    counters, ref_counters = new_counters(DEVICE), new_counters()
    steps_a = torch.zeros(3, device=DEVICE)                     # 16-byte aligned
    steps_b = torch.zeros(4, device=DEVICE)[1:]                 # 4 bytes past it
    ref_steps = torch.zeros(3, dtype=torch.float32)
    scale = torch.full((1,), 2.0, device=DEVICE)
    for i in range(5):
        case.grads = fresh_grads(case, seed=40 + i)
        expected.grads = [g.to("cpu", torch.float64) for g in case.grads]
        steps = steps_b if i == 3 else steps_a
        kw = dict(meta_every=2, check=True, grad_scale=scale if i == 4 else None)
        if i == 3:
            steps.copy_(steps_a)
        call_step(TB, "cadence", case, mode, hyper, counters, steps=steps, **kw)
        call_step(reference_backend(), "cadence", expected, mode, hyper, ref_counters,
                  steps=ref_steps, **kw)
        assert_case_close(case, expected, torch.float32, f"call {i}")
        assert torch.equal(steps.cpu(), ref_steps), f"call {i}"
        if i == 3:
            steps_a.copy_(steps)
    assert counters_dict(counters.cpu()) == counters_dict(ref_counters)
    # JIT: the check once; the update for calls 0 (inner), 1 (inner+meta is the same key: the
    # cadence is read on the device), 3 (unaligned steps), 4 (grad_scale)
    assert check_k.calls == 1 and _runs(check_k) == 4
    assert step_k.calls == 3 and _runs(step_k) == 2
    assert len(TB._STEP.entries) == 3 and len(TB._CHECK.entries) == 1


@pytest.mark.skipif(ON_GPU, reason="the stand-ins run the interpreter")
def test_fast_launch_steps_back_for_hooks_and_when_off(fast_launch, monkeypatch):
    """A launch hook (a profiler), a pre-run hook or FAST_LAUNCH off: every launch goes
    through the JIT. A replaced kernel object forgets the kept kernels."""
    from triton import knobs
    step_k, _ = fast_launch
    mode = MODES[1]
    case = make_case([5, 70], torch.float32, seed=9, device=DEVICE)
    counters = new_counters(DEVICE)

    def call():
        call_step(TB, "inner", case, mode, step_hyper(mode), counters)

    call()
    call()
    assert (step_k.calls, _runs(step_k)) == (1, 1)
    hook = knobs.runtime.launch_enter_hook
    if isinstance(hook, knobs.HookChain):
        seen = []
        hook.add(seen.append)
        try:
            call()
        finally:
            hook.remove(seen.append)
        assert (step_k.calls, _runs(step_k)) == (2, 1)
    step_k.pre_run_hooks.append(lambda *a, **k: None)
    call()
    step_k.pre_run_hooks.clear()
    monkeypatch.setattr(TB, "FAST_LAUNCH", False)
    call()
    calls = step_k.calls
    assert _runs(step_k) == 1 and calls >= 3
    monkeypatch.setattr(TB, "FAST_LAUNCH", True)
    call()
    assert (step_k.calls, _runs(step_k)) == (calls, 2)
    other = _JitStandIn(step_k.interpreted)
    monkeypatch.setattr(TB._kernels, "emcl_step_kernel", other)
    call()
    assert other.calls == 1 and _runs(step_k) == 2


# The optimizer's steps on CPU tensors with the kernels imported compiled: each @triton.jit
# kernel is replaced by a stand-in that runs the Python of Triton's ``JITFunction.run`` up to
# the launcher (Triton's own binder for sm_90, its cache key, the check of the kernel's
# globals, the knobs it reads at every call) and returns a kernel whose launcher does nothing.
# Prints the backend's launch counts, the stand-ins' calls and the launches made.
_FAST_LAUNCH_SCRIPT = r"""
import json
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature
from emcl_kernels import FusedEMCLOptimizer, plan
from emcl_kernels.backends import triton as TB
MISSING = object()


class NoLaunchKernel:
    def __init__(self, n_params):
        self.function, self.packed_metadata, self.launches = 1, (), 0
        self.src = type("Src", (), {"signature": dict.fromkeys(range(n_params))})()

    def run(self, *args):
        self.launches += 1


class JitWithoutLaunch:
    def __init__(self, jit):
        self.jit, self.kernels, self.key_cache, self.pre_run_hooks, self.calls = jit, {}, {}, [], 0
        self.binder = create_function_from_signature(jit.signature, jit.params,
                                                     make_backend(GPUTarget("cuda", 90, 32)))
        jit.cache_key                     # computes the globals the JIT checks at every call

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, *args, **kwargs)

    def run(self, grid, *args, **kwargs):
        self.calls += 1
        kwargs["debug"] = kwargs.get("debug", self.jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, spec, options = self.binder(*args, **kwargs)
        key = compute_cache_key(self.key_cache, spec, options)
        kernel = self.kernels.setdefault(key, NoLaunchKernel(len(spec)))
        for (name, _), (val, globals_dict) in self.jit.used_global_vals.items():
            assert globals_dict.get(name, MISSING) == val, f"global {name} changed"
        kernel.run(grid[0], 1, 1, 0, kernel.function, kernel.packed_metadata, None, None, None,
                   *bound.values())
        return kernel


stand_ins = [JitWithoutLaunch(TB._kernels.emcl_step_kernel),
             JitWithoutLaunch(TB._kernels.emcl_check_kernel)]
TB._kernels.emcl_step_kernel, TB._kernels.emcl_check_kernel = stand_ins
plan._RESOLVED[("triton", torch.device("cpu"))] = TB      # compiled kernels, never launched
gen = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in
          [(100, 784), (100,), (100, 100), (100,), (10, 100), (10,)]]
for p in params:
    p.grad = torch.randn(p.shape, generator=gen) * 1e-3
for check in (True, False):
    opt = FusedEMCLOptimizer(params, meta_every=1, backend="triton", check_finite=check)
    for _ in range(10):
        opt.step()
for _ in range(10):
    opt.inner_step()
    opt.meta_step()
print(json.dumps({"counts": TB.launch_counts, "stand_in_calls": [k.calls for k in stand_ins],
                  "launches": sum(c.launches for k in stand_ins for c in k.kernels.values())}))
"""


def test_fast_launch_is_on_for_compiled_kernels_here():
    """Imported compiled (no TRITON_INTERPRET), with this Triton, the fast launch is on, and
    the optimizer's steps take it (launches taken out after Triton's own argument binding):
    each key through the JIT once (the check, and the update as step(), inner_step() and
    meta_step()), every other launch direct, with Triton's real knobs read at every call."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "python"),
                                         env.get("PYTHONPATH", "")])
    script = ("import json, triton; from emcl_kernels.backends import triton as TB; "
              "print(json.dumps([triton.__version__, TB.FAST_LAUNCH, TB.FAST_LAUNCH_REASON]))")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, on, reason = json.loads(proc.stdout.strip().splitlines()[-1])
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    assert on == ((3, 4) <= major_minor < (4, 0)) and (reason is None) == on, (version, reason)
    if not on:
        pytest.skip(f"fast launch off here: {reason}")
    proc = subprocess.run([sys.executable, "-c", _FAST_LAUNCH_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(rec["stand_in_calls"]) == rec["counts"]["jit"] == 4, rec
    assert rec["counts"]["fast"] == rec["launches"] - 4 and rec["launches"] >= 40, rec


def test_fast_launch_entry_reads_the_launcher_signature():
    """A kept kernel's launcher takes every argument (Triton >= 3.3: the constexprs too) or
    the non-constexpr ones (older); anything else, or no compiled kernel, is not kept."""
    def compiled(n, **attrs):
        k = _InterpretedCompiled(None, n)
        for name, value in attrs.items():
            setattr(k, name, value)
        return k

    assert TB._entry(compiled(12), 10, 2).all_args is True
    assert TB._entry(compiled(10), 10, 2).all_args is False
    assert TB._entry(compiled(11), 10, 2) is None
    assert TB._entry(compiled(12, function=None), 10, 2) is None
    assert TB._entry(object(), 10, 2) is None
    assert TB._entry(None, 10, 2) is None


def test_launcher_arguments_follow_the_kernel_signature():
    """The launchers' constexpr names are the kernels' constexpr parameters, in order, after
    every other parameter (the fast path passes them by position)."""
    for launcher, n_args in ((TB._STEP, 11), (TB._CHECK, 4)):
        kernel = getattr(TB._kernels, launcher.name)
        params = list(inspect.signature(kernel.fn).parameters.values())
        consts = [p.name for p in params if "constexpr" in str(p.annotation)]
        assert tuple(consts) == launcher.consts
        assert [p.name for p in params[n_args:]] == consts


def test_fast_launch_key_refines_tritons_specialization():
    """Two launches with the same fast-path key get the same compiled kernel from the JIT:
    over arguments that differ in alignment (tensors one element off a 16-byte boundary),
    dtype and int range, Triton's own binder (CUDA target) never specializes two of them
    differently when their keys are equal, with and without the dtypes in the key (the
    C++ checks fix them; without those checks the key holds them)."""
    from emcl_kernels.interface import COUNTER_FIELDS, HYPER_FIELDS
    binder = _triton_binder(TB._kernels.emcl_step_kernel)

    def off(dtype, n, shift):
        return torch.zeros(n + 1, dtype=dtype)[shift:shift + n]

    table = [off(torch.int64, 6, s) for s in (0, 1)]
    hyper = [off(torch.float64, len(HYPER_FIELDS), s) for s in (0, 1)]
    counters = [off(torch.int64, len(COUNTER_FIELDS), s) for s in (0, 1)]
    steps = [off(torch.float32, 3, s) for s in (0, 1, 2, 4)]
    flags = [None, off(torch.float32, 1, 0), off(torch.float32, 1, 1)]
    ints = [0, 1, 3, 16, 17, 2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 1, 2 ** 62, 2 ** 63]
    consts = (0, OP["cadence"], True, 0, 1, False, False, True, 4096, 1024, False)
    seen = {True: {}, False: {}}
    for tb, h, c, s, gs, fi, n, m in itertools.product(
            table, hyper, counters, steps, flags, flags, ints[:6], ints):
        if (n, m) != (3, 1) and (tb is not table[0] or h is not hyper[0]):
            continue                        # the int range against one set of tensors
        g = hyper[0] if gs is None else gs
        f = hyper[0] if fi is None else fi
        tensors = (table[0], tb, table[1], h, c, s, g, f)
        kc = consts[:5] + (gs is not None, fi is not None) + consts[7:]
        _, spec, _ = binder(table[0], tb, table[1], h, c, s, n, m, 1, g, f,
                            **dict(zip(TB._STEP.consts, kc)))
        for dtypes in (True, False):
            key = (kc, TB._tensor_kinds(tensors, dtypes), TB._int_kind(n), TB._int_kind(m),
                   TB._int_kind(1))
            got = seen[dtypes].setdefault(key, spec)
            assert got == spec, (dtypes, key, got, spec)
    assert len(set(map(repr, seen[True].values()))) > 20       # the grid meets many kernels
    # fp16 steps would be another kernel: the key holds the dtype where no C++ check fixes it
    s16 = off(torch.float16, 3, 0)
    assert TB._tensor_kinds((s16,), True) != TB._tensor_kinds((steps[0],), True)


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU or not TB.FAST_LAUNCH,
                    reason="needs a GPU and the fast launch (FAST_LAUNCH_REASON)")
def test_fast_launch_uses_the_kernel_the_jit_picks(monkeypatch):
    """Every fast launch calls the compiled kernel that Triton's JIT picks for the same
    arguments (``warmup`` returns it without launching), with steps aligned and not and with
    a grad_scale; the steps equal the reference's."""
    used = []
    real = TB._Launcher._run

    def spy(entry, grid, stream, args, consts):
        used.append((entry, grid, args, consts))
        real(entry, grid, stream, args, consts)

    monkeypatch.setattr(TB._Launcher, "_run", staticmethod(spy))
    mode = MODES[0]
    hyper = step_hyper(mode)
    case = make_case([7, 300, 4097], torch.float32, seed=8, device=DEVICE)
    expected = clone_case(case, torch.float64, device="cpu")
    counters, ref_counters = new_counters(DEVICE), new_counters()
    ref_steps = torch.zeros(3, dtype=torch.float32)
    scale = torch.full((1,), 2.0, device=DEVICE)
    for i in range(8):
        steps = torch.zeros(4, device=DEVICE)[i % 2:][:3]    # aligned, then 4 bytes past
        steps.copy_(ref_steps)
        case.grads = fresh_grads(case, seed=60 + i)
        expected.grads = [g.to("cpu", torch.float64) for g in case.grads]
        scaled = i >= 4
        call_step(TB, "cadence", case, mode, hyper, counters, steps=steps, meta_every=2,
                  check=True, grad_scale=scale if scaled else None)
        call_step(reference_backend(), "cadence", expected, mode, hyper, ref_counters,
                  steps=ref_steps, meta_every=2, check=True,
                  grad_scale=scale.cpu() if scaled else None)
        assert_case_close(case, expected, torch.float32, f"call {i}")
        assert torch.equal(steps.cpu(), ref_steps), f"call {i}"
    assert len(used) >= 8
    for entry, grid, args, consts in used:
        launcher = TB._STEP if any(e is entry for e in TB._STEP.entries.values()) else TB._CHECK
        jit = getattr(TB._kernels, launcher.name)
        picked = jit.warmup(*args, grid=(grid,), num_warps=TB.NUM_WARPS,
                            **dict(zip(launcher.consts, consts)))
        assert picked.function == entry.function, (launcher.name, consts)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (CUDA graphs)")
@pytest.mark.parametrize("new_grads_in_capture", (False, True), ids=("static-grads", "graph-grads"))
def test_captured_cadence_step_replays_like_eager(new_grads_in_capture):
    """A CUDA graph of step(op=cadence, check=True) replays like eager calls, bit for bit,
    with the hyper-parameters changed in place between replays, one replay skipped on a NaN,
    and (graph-grads) a gradient table made during the capture."""
    mode = MODES[0]
    hyper = step_hyper(mode)
    eager = make_case([7, 4097, 300, 0], torch.float32, seed=21, device="cuda")
    graphed = clone_case(eager)
    h_e, h_g = pack_hyper(hyper, "cuda"), pack_hyper(hyper, "cuda")
    c_e, c_g = new_counters("cuda"), new_counters("cuda")
    s_e, s_g = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    static_grads = [g.clone() for g in graphed.grads]
    codes = dict(mode_codes(mode), op=OP["cadence"], meta_every=3, check=True, finalize=True)

    def graphed_step(grads):
        TB.step(graphed.params, grads, graphed.anchors, graphed.importances, graphed.meta_lrs,
                s_g, h_g, c_g, **codes)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                             # warm-up: one eager step each
        graphed_step(static_grads)
    torch.cuda.current_stream().wait_stream(side)
    TB.step(eager.params, eager.grads, eager.anchors, eager.importances, eager.meta_lrs, s_e,
            h_e, c_e, **codes)
    graph = torch.cuda.CUDAGraph()
    captured_before = TB.build_counts["captured"]
    fast_before = TB.launch_counts["fast"]
    with torch.cuda.graph(graph):
        grads = [g * 1.0 for g in static_grads] if new_grads_in_capture else static_grads
        graphed_step(grads)
    assert (TB.build_counts["captured"] > captured_before) == new_grads_in_capture
    # the warm-up launched both kernels through the JIT: the capture records fast launches
    assert TB.launch_counts["fast"] - fast_before == (2 if TB.FAST_LAUNCH else 0)
    for i in range(7):
        new = fresh_grads(eager, seed=100 + i)
        if i == 4:
            new[1].view(-1)[17] = float("nan")
        for dst, src in zip(static_grads, new):
            dst.copy_(src)
        eager.grads = [g.clone() for g in new]
        for h in (h_e, h_g):
            h.copy_(pack_hyper({**hyper, "inner_lr": 0.05 + 0.01 * i, "decay": 0.7 + 0.02 * i},
                               "cuda"))
        graph.replay()
        TB.step(eager.params, eager.grads, eager.anchors, eager.importances, eager.meta_lrs,
                s_e, h_e, c_e, **codes)
        torch.cuda.synchronize()
        for name, lst in graphed.tensors().items():
            for a, b in zip(lst, eager.tensors()[name]):
                assert torch.equal(a, b), f"replay {i + 1}: {name} differs from eager"
        assert torch.equal(c_g, c_e) and torch.equal(s_g, s_e), f"replay {i + 1}"
    assert counters_dict(c_g.cpu()) == dict(found=0, calls=8, skipped=1, done=0)


@pytest.mark.skipif(not ON_GPU, reason="CUDA streams need a GPU")
def test_tables_read_on_a_side_stream_are_recorded_on_it():
    """A step on the user's side stream marks the address tables it reads with that stream
    ([note: table streams]), so that the LRU dropping them cannot hand their memory to a new
    table while the side stream's kernels still read them; the step equals the reference."""
    mode = MODES[0]
    hyper = step_hyper(mode)
    case = make_case([4097, 33, 70_001], torch.float32, seed=11, device="cuda")
    expected = clone_case(case, torch.float64, device="cpu")
    counters, ref_counters = new_counters("cuda"), new_counters()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call_step(TB, "cadence", case, mode, hyper, counters, meta_every=2, check=True)
        here = torch.cuda.current_stream().cuda_stream
    torch.cuda.current_stream().wait_stream(side)
    call_step(reference_backend(), "cadence", expected, mode, hyper, ref_counters, meta_every=2,
              check=True)
    assert_case_close(case, expected, torch.float32, "step on a side stream")
    plans = [hit[2] for hit in TB._plans.values() if hit[0] == (4097, 33, 70_001)]
    assert plans, "the step's tables are not in the cache"
    for t in (plans[-1].chunks, plans[-1].tensors, plans[-1].grads):
        assert here in t._emcl_streams


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 40 GB (2**31 + 5 elements)")
def test_past_2_31_elements(gpu_memory_to_myself):
    free, _ = torch.cuda.mem_get_info()
    n = 2 ** 31 + 5
    if free < 40 * 2 ** 30:
        pytest.skip("needs 40 GB of free GPU memory")
    mode = MODES[1]
    hyper = step_hyper(mode)
    p = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(n, device="cuda")
    h = torch.rand(n, device="cuda") + 0.1
    tail = slice(n - 4101, n)
    want_p = p[tail].clone()
    emcl_kernels.reference.inner_step_(want_p, g[tail], a[tail], h[tail], inner_lr=0.05,
                                       reg=1.5, gamma=0.3, prox=True)
    TB.step([p], [g], [a], [h], [], torch.zeros(0, device="cuda"), pack_hyper(hyper, "cuda"),
            new_counters("cuda"), op=OP["inner"], prox=True, importance=0, lr_mode=1,
            meta_every=1, check=True, finalize=True)
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
assert type(K.emcl_step_kernel).__name__ == "JITFunction", type(K.emcl_step_kernel)
# integers that change with the model or the cadence compile no new variant (1, multiples of 16)
loose = {p.name: p.do_not_specialize for p in K.emcl_step_kernel.params}
assert loose["n_steps"] and loose["meta_every"] and loose["runs"], loose
assert {p.name: p.do_not_specialize for p in K.emcl_check_kernel.params}["runs"]
names = ["PARAM", "OP", "PROX", "IMPORTANCE_KIND", "LR_MODE", "HAS_GRAD_SCALE",
         "HAS_FOUND_INF", "FINALIZE", "BLOCK", "SUB", "ARRAY"]
step_sig = {"chunks": "*i64", "tensors": "*i64", "grads": "*i64", "hyper": "*fp64",
            "counters": "*i64", "steps": "*fp32", "n_steps": "i64", "meta_every": "i64",
            "runs": "i64", "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
step_sig.update({n: "constexpr" for n in names})
check_sig = {"chunks": "*i64", "grads": "*i64", "counters": "*i64", "runs": "i64",
             "PARAM": "constexpr", "BLOCK": "constexpr", "ARRAY": "constexpr"}
target = GPUTarget("cuda", 90, 32)
out = []
for kind, consts in json.loads(sys.argv[1]):
    if kind == "step":
        src = ASTSource(fn=K.emcl_step_kernel, signature=step_sig,
                        constexprs=dict(zip(names, consts)))
    else:
        src = ASTSource(fn=K.emcl_check_kernel, signature=check_sig,
                        constexprs=dict(PARAM=consts[0], BLOCK=consts[1], ARRAY=consts[2]))
    ptx = triton.compile(src, target=target, options={"num_warps": 8}).asm["ptx"]
    ops = re.findall(r"((?:ld|st|atom)\.global[.\w]*)|(bar\.sync)", ptx)
    # the run-time alignment test of the vector path: `addr & 15`
    ops = [a or b for a, b in ops] + re.findall(r"and\.b(?:32|64)\s+%\w+, %\w+, 15;", ptx)[:1]
    out.append(ops)
print(json.dumps(out))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests run compiled")
def test_compiles_for_the_gpu_with_vector_access():
    """Both kernels compile for sm_90 (front end to PTX, no GPU needed) for every dtype and
    several ops and flags, each with its vector path (16-byte loads and stores of the aligned
    full chunks), chosen at run time by an alignment test that the compiler kept (bf16/fp16
    also show the 16-bit accesses of their scalar path); n_steps, meta_every and runs are not
    specialized (no new compile when they change); a finalizing
    update has one acq_rel atomic add on counters[DONE], right after a block barrier. The
    kernels of arrays of runs (ARRAY) too."""
    import json
    import subprocess
    # PARAM, OP, PROX, IMPORTANCE_KIND, LR_MODE, HAS_GRAD_SCALE, HAS_FOUND_INF, FINALIZE,
    # BLOCK, SUB (as the backend passes them: fp64 chunks are half as long), ARRAY
    steps = [[p, OP["cadence"], True, 0, 0, True, True, True, 4096 // (2 if p == 3 else 1),
              1024 // (2 if p == 3 else 1), False] for p in range(4)]
    steps += [[1, OP["inner"], False, 1, 1, False, False, False, 4096, 1024, False],
              [0, OP["meta"], True, 1, 2, False, True, True, 4096, 1024, False]]
    steps += [[p, OP["cadence"], True, 0, 0, True, True, True, 4096 // (2 if p == 3 else 1),
               1024 // (2 if p == 3 else 1), True] for p in (0, 1, 3)]
    steps += [[0, OP["inner"], False, 1, 1, False, False, False, 4096, 1024, True]]
    checks = [[p, 4096 // (2 if p == 3 else 1), False] for p in range(4)]
    checks += [[p, 4096 // (2 if p == 3 else 1), True] for p in (0, 2)]
    combos = [["step", c] for c in steps] + [["check", c] for c in checks]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(combos)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is missing here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (kind, consts), ops in zip(combos, results):
        wide = ("ld.global.v2.b64", "st.global.v2.b64") if consts[0] == 3 else \
            ("ld.global.v4.b32", "st.global.v4.b32")
        assert wide[0] in ops, (kind, consts, sorted(set(ops)))
        # the vector path is still chosen at run time: a full chunk at an odd address runs the
        # scalar path (the test is gone when both paths compile to the same 16-byte loads)
        assert any(op.startswith("and.b") for op in ops), (kind, consts, "no `& 15` test")
        if consts[0] in (1, 2):   # bf16/fp16: 16-bit loads come from the scalar path only
            assert "ld.global.b16" in ops, (kind, consts, sorted(set(ops)))
        if kind == "check":
            continue
        assert wide[1] in ops, (kind, consts, sorted(set(ops)))
        atomics = [i for i, op in enumerate(ops) if op.startswith("atom")]
        if consts[7]:                                        # FINALIZE
            assert [ops[i] for i in atomics] == ["atom.global.gpu.acq_rel.add.u64"], ops
            assert ops[atomics[0] - 1] == "bar.sync", ops[atomics[0] - 5:atomics[0] + 1]
        else:
            assert atomics == [], (kind, consts)

