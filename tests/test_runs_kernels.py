"""Arrays of runs in the native backends ([note: runs] in emcl_kernels.interface): one
``step``/``check_finite`` call over ``runs`` runs computes, for every run, bit for bit what a
``runs=1`` call of the same backend computes over that run's slices alone with that run's row of
``hyper`` (tensors, meta-step counts, skip counts), and matches the reference backend within
SPEC section 4's tolerances.

Backends: ``cpu`` (the compiled extension), ``triton`` (through its interpreter on CPU
tensors here: ``TRITON_INTERPRET=1`` is set below before the kernels are imported; compiled on
CUDA tensors where torch sees a GPU and ``TRITON_INTERPRET`` is not 1), ``cuda`` (skipped without
a GPU). The interpreter costs tens of milliseconds per program, so the Triton grid is a subset.
"""
import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are first imported

from emcl_kernels.backends import backend_status, get_backend  # noqa: E402
from emcl_kernels.interface import (COUNTER, OP, RUN_FOUND, counters_size,  # noqa: E402
                                    run_skipped_at)
from emcl_testing import (MODES, Mode, assert_bitwise_unchanged, assert_close,  # noqa: E402
                          mode_codes, pack_hyper, reference_backend, step_hyper)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
STEP_OPS = ("inner", "meta", "inner_meta", "cadence")
SIZES = (0, 1, 33, 1031)  # elements per run of each tensor
_FOUND, _CALLS, _SKIPPED = COUNTER["found"], COUNTER["calls"], COUNTER["skipped"]


def triton_module():
    """The Triton backend module, interpreted on CPU-only machines even if another test module
    imported it compiled first (Triton picks compiled or interpreted when the kernels are
    defined); None where Triton is not installed."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return None
    tb = importlib.import_module("emcl_kernels.backends.triton")
    if not ON_GPU and not tb.INTERPRETED:
        importlib.reload(sys.modules["emcl_kernels.backends.triton_kernels"])
        tb = importlib.reload(tb)
    return tb


def _backends():
    out = []
    status = backend_status()
    if status["cpu"] == "available":
        out.append(("cpu", "cpu"))
    if status["triton"] == "available" or triton_module() is not None:
        out.append(("triton", "cuda" if ON_GPU else "cpu"))
    if status["cuda"] == "available" and torch.cuda.is_available():
        out.append(("cuda", "cuda"))
    return out


BACKENDS = _backends()


def _mod(name, device):
    if name == "triton":
        return triton_module()
    return get_backend(name, torch.device(device))


def _params(full_grid, triton_grid):
    """pytest params: the full grid for the compiled backends, a subset for Triton."""
    out = []
    for name, device in BACKENDS:
        grid = triton_grid if name == "triton" else full_grid
        for values in grid:
            out.append(pytest.param(name, device, *values,
                                    id="-".join([name] + [_id(v) for v in values])))
    return out


def _id(v):
    if isinstance(v, Mode):
        return v.id
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return str(v)


# ---------------------------------------------------------------------------------------------
# The inputs of an array call: tensors with a leading run dimension, a hyper row per run.
# ---------------------------------------------------------------------------------------------

def _shape(n: int):
    """The shape of one run's share of a tensor of n elements (some 2-d, like weights)."""
    if n >= 6 and n % 3 == 0:
        return (3, n // 3)
    return (n,)


def make_array(runs: int, sizes, dtype, *, seed: int, device) -> dict:
    """Random inputs of an array of ``runs`` runs: every tensor ``[runs, *shape]``."""
    from emcl_kernels.reference import compute_dtype
    gen = torch.Generator().manual_seed(seed)
    sdt = compute_dtype(dtype)
    lists = {k: [] for k in ("params", "grads", "anchors", "importances", "meta_lrs")}

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    for n in sizes:
        shape = (runs, *_shape(n))
        theta = randn(shape)
        lists["params"].append(theta.to(device=device, dtype=dtype))
        lists["grads"].append(randn(shape).to(device=device, dtype=dtype))
        lists["anchors"].append((theta + 0.3 * randn(shape)).to(device=device, dtype=sdt))
        lists["importances"].append((0.1 + torch.rand(shape, generator=gen, dtype=torch.float64))
                                    .to(device=device, dtype=sdt))
        lists["meta_lrs"].append((0.05 + 0.1 * torch.rand(shape, generator=gen,
                                                          dtype=torch.float64))
                                 .to(device=device, dtype=sdt))
    return lists


def run_hyper(mode: Mode, r: int) -> dict:
    """Run ``r``'s hyper-parameters: the mode's, each moved by a different amount per run (run
    2 takes the 1/reg sentinel for lr_scale), all within their domains."""
    hp = dict(step_hyper(mode))
    hp["inner_lr"] *= 1 + 0.15 * r
    hp["meta_lr"] *= 1 + 0.1 * r
    hp["reg"] *= 1 + 0.2 * r
    hp["gamma"] *= 1 - 0.1 * (r % 4)
    hp["decay"] = min(0.95, hp["decay"] + 0.03 * r)
    if r == 2:
        hp["lr_scale"] = None
    elif mode.lr_mode != "constant":
        hp["lr_scale"] *= 1 + 0.05 * r
    return hp


def hyper_table(mode: Mode, runs: int, device) -> torch.Tensor:
    """``hyper`` of an array: row ``r`` is :func:`run_hyper` (mode, r)."""
    return torch.stack([pack_hyper(run_hyper(mode, r), device) for r in range(runs)])


def _lists_of(arrays: dict, mode: Mode):
    meta_lrs = arrays["meta_lrs"] if mode.lr_mode == "recurrent" else []
    return [arrays["params"], arrays["grads"], arrays["anchors"], arrays["importances"], meta_lrs]


def call(mod, arrays: dict, mode: Mode, op: str, hyper, counters, steps, *, runs: int,
         meta_every: int = 2, check: bool = True, finalize: bool = True, grad_scale=None,
         found_inf=None) -> None:
    """``mod.step`` of the interface over ``arrays`` (list copies: the call keeps nothing)."""
    lists = [list(x) for x in _lists_of(arrays, mode)]
    mod.step(*lists, steps, hyper, counters, op=OP[op], meta_every=meta_every, check=check,
             finalize=finalize, grad_scale=grad_scale, found_inf=found_inf, runs=runs,
             **mode_codes(mode))


def run_of(arrays: dict, r: int) -> dict:
    """Copies of run ``r``'s slices of every tensor (a runs=1 call's own tensors)."""
    return {k: [t[r].clone() for t in lst] for k, lst in arrays.items()}


def _written(arrays: dict, mode: Mode, op: str):
    names = ["params", "anchors", "importances"]
    if mode.lr_mode == "recurrent" and op != "inner":
        names.append("meta_lrs")
    return names


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """The same bits (NaN payloads included); on failure, the first elements that differ."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if actual.numel() == 0 or torch.equal(_bits(actual), _bits(expected)):
        return
    a, e = actual.detach().double().reshape(-1), expected.detach().double().reshape(-1)
    idx = (a != e).nonzero().reshape(-1)[:5].tolist()
    worst = ", ".join(f"[{i}] got {a[i].item()!r} want {e[i].item()!r}" for i in idx)
    raise AssertionError(f"{what}: not bitwise equal; first: {worst}")


def _fresh_grads(arrays: dict, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(g.shape, generator=gen, dtype=torch.float64).to(g.device, g.dtype)
            for g in arrays["grads"]]


def _poison(grads: list, r: int, value: float) -> None:
    """One non-finite element in run ``r`` of the last non-empty gradient."""
    g = [g for g in grads if g.numel()][-1]
    flat = g[r].view(-1)
    flat[flat.numel() // 2] = value


# ---------------------------------------------------------------------------------------------
# The check every case runs: an array call against runs=1 calls (bitwise) and the reference.
# ---------------------------------------------------------------------------------------------

def check_runs(name, device, op, mode, dtype, runs, *, sizes=SIZES, calls=3, seed=0,
               bad_run=None, bad_call=1, grad_scale=None, found_inf=None, preset_found=False,
               check=True):
    """Chain ``calls`` array calls of backend ``name`` with fresh gradients. After each: run
    ``r``'s slices equal bitwise those of a runs=1 call of the same backend over run ``r``'s
    slices alone with hyper row ``r`` (and its own counters); the per-run steps and skip counts
    equal the solo calls'; tensors, steps and counters match the reference backend's array call
    (fp64 for fp32). ``bad_run``: a non-finite gradient in that run at call ``bad_call``;
    ``preset_found``: counters[FOUND] already set (another group's bad gradient)."""
    mod, ref = _mod(name, device), reference_backend()
    arrays = make_array(runs, sizes, dtype, seed=seed, device=device)
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = {k: [t.detach().to("cpu", ref_dtype if k in ("params", "grads") else
                                  (torch.float64 if dtype == torch.float32 else t.dtype),
                                  copy=True) for t in lst] for k, lst in arrays.items()}
    solos = [run_of(arrays, r) for r in range(runs)]
    hyper = hyper_table(mode, runs, device)
    rows = [pack_hyper(run_hyper(mode, r), device) for r in range(runs)]
    n = len(sizes)
    counters = torch.zeros(counters_size(runs), dtype=torch.int64, device=device)
    ref_counters = torch.zeros(counters_size(runs), dtype=torch.int64)
    solo_counters = [torch.zeros(counters_size(1), dtype=torch.int64, device=device)
                     for _ in range(runs)]
    steps = torch.zeros(n * runs, dtype=torch.float32, device=device)
    ref_steps = torch.zeros(n * runs, dtype=torch.float32)
    solo_steps = [torch.zeros(n, dtype=torch.float32, device=device) for _ in range(runs)]
    scale = None if grad_scale is None else torch.tensor([grad_scale], device=device)
    inf_flag = None if found_inf is None else torch.tensor([found_inf], device=device)
    ref_scale = None if scale is None else scale.cpu()
    ref_inf = None if inf_flag is None else inf_flag.cpu()
    for c in range(calls):
        if bad_run is not None and c == bad_call:
            _poison(arrays["grads"], bad_run, float("nan"))
            _poison(expected["grads"], bad_run, float("nan"))
            solos[bad_run]["grads"] = [g[bad_run].clone() for g in arrays["grads"]]
        if preset_found:
            counters[_FOUND] = 1
            ref_counters[_FOUND] = 1
            for sc in solo_counters:
                sc[_FOUND] = 1
        before = [t.clone() for t in arrays["grads"]]
        call(mod, arrays, mode, op, hyper, counters, steps, runs=runs, check=check,
             grad_scale=scale, found_inf=inf_flag)
        call(ref, expected, mode, op, hyper.cpu(), ref_counters, ref_steps, runs=runs,
             check=check, grad_scale=ref_scale, found_inf=ref_inf)
        for r in range(runs):
            call(mod, solos[r], mode, op, rows[r], solo_counters[r], solo_steps[r], runs=1,
                 check=check, grad_scale=scale, found_inf=inf_flag)
        what = f"{name} {op} {dtype} {mode.id} runs={runs} call {c + 1}"
        for i, g in enumerate(arrays["grads"]):
            assert_bitwise(g, before[i], f"{what}: grads[{i}] written")
        for key in _written(arrays, mode, op):
            for i, t in enumerate(arrays[key]):
                for r in range(runs):
                    assert_bitwise(t[r], solos[r][key][i],
                                   f"{what}: {key}[{i}] run {r} against the run alone")
                assert_close(t, expected[key][i], dtype, f"{what}: {key}[{i}] vs reference")
        per_param = steps.view(n, runs).cpu()
        for r in range(runs):
            assert torch.equal(per_param[:, r], solo_steps[r].cpu()), \
                f"{what}: steps of run {r} {per_param[:, r]} != alone {solo_steps[r]}"
        assert torch.equal(steps.cpu(), ref_steps), f"{what}: steps {steps} != {ref_steps}"
        assert counters.cpu().tolist() == ref_counters.tolist(), \
            f"{what}: counters {counters.tolist()} != reference {ref_counters.tolist()}"
        at = run_skipped_at(runs)
        for r in range(runs):
            own = int(solo_counters[r][_SKIPPED]) - int(counters[_SKIPPED])
            assert int(counters[at + r]) == own, f"{what}: skip count of run {r}"
            assert int(counters[_CALLS]) == int(solo_counters[r][_CALLS]), f"{what}: calls"
        new = _fresh_grads(arrays, seed=1000 * seed + c)
        arrays["grads"] = new
        expected["grads"] = [g.detach().to("cpu", ref_dtype, copy=True) for g in new]
        for r in range(runs):
            solos[r]["grads"] = [g[r].clone() for g in new]
    return counters


_MODE_SUBSET = (MODES[0], MODES[4], MODES[8], MODES[11])  # prox/grad x taylor/si x lr modes

FULL_MODES = [(op, mode, torch.float32, 3) for op in STEP_OPS for mode in MODES]
FULL_DTYPES = [(op, mode, dtype, runs) for dtype in DTYPES[1:] for op in STEP_OPS
               for mode in _MODE_SUBSET for runs in (2, 7)]
TRITON_GRID = ([(op, mode, dtype, 3) for op in STEP_OPS for mode in _MODE_SUBSET
                for dtype in (torch.float32, torch.bfloat16)]
               + [("cadence", MODES[0], dtype, runs) for dtype in (torch.float16, torch.float64)
                  for runs in (2, 7)]
               + [(op, MODES[7], torch.float32, 2) for op in ("inner", "meta", "inner_meta")]
               + [("inner_meta", MODES[5], torch.bfloat16, 7)])


@pytest.mark.parametrize("name, device, op, mode, dtype, runs",
                         _params(FULL_MODES + FULL_DTYPES, TRITON_GRID))
def test_array_call_is_each_run_alone(name, device, op, mode, dtype, runs):
    check_runs(name, device, op, mode, dtype, runs, seed=runs)


BAD_GRID = [(dtype, runs, bad) for dtype in DTYPES for runs in (2, 3, 7)
            for bad in sorted({0, runs - 1, runs // 2})]


@pytest.mark.parametrize("name, device, dtype, runs, bad_run",
                         _params(BAD_GRID,
                                 [(torch.float32, 3, 1), (torch.bfloat16, 2, 0),
                                  (torch.float16, 7, 6), (torch.float64, 2, 1)]))
def test_a_non_finite_gradient_skips_its_run_alone(name, device, dtype, runs, bad_run):
    counters = check_runs(name, device, "cadence", MODES[2], dtype, runs, bad_run=bad_run,
                          calls=3, bad_call=1, seed=7)
    at = run_skipped_at(runs)
    skipped = counters[at:at + runs].tolist()
    assert skipped == [1 if r == bad_run else 0 for r in range(runs)], skipped
    assert int(counters[_SKIPPED]) == 0


@pytest.mark.parametrize("name, device, dtype",
                         _params([(d,) for d in DTYPES], [(torch.float32,)]))
def test_grad_scale_divides_every_run(name, device, dtype):
    check_runs(name, device, "inner_meta", MODES[1], dtype, 3, grad_scale=64.0, calls=2,
               seed=3)


@pytest.mark.parametrize("name, device", _params([()], [()]))
def test_found_inf_skips_every_run_without_a_skip_count(name, device):
    counters = check_runs(name, device, "cadence", MODES[0], torch.float32, 3, found_inf=1.0,
                          calls=2)
    assert counters[_SKIPPED] == 0 and counters[run_skipped_at(3):].tolist() == [0, 0, 0]
    assert counters[_CALLS] == 2


@pytest.mark.parametrize("name, device", _params([()], [()]))
def test_found_set_by_another_group_skips_every_run(name, device):
    counters = check_runs(name, device, "inner_meta", MODES[3], torch.float32, 2,
                          preset_found=True, calls=2)
    assert counters[_SKIPPED] == 2 and counters[run_skipped_at(2):].tolist() == [0, 0]


@pytest.mark.parametrize("name, device", _params([()], [()]))
def test_without_check_a_run_flag_set_before_skips_that_run(name, device):
    """check_finite first (the multi-group protocol), then step(check=False): the flags the
    check set decide, and finalize counts and clears them."""
    runs = 3
    mod = _mod(name, device)
    arrays = make_array(runs, (5, 40), torch.float32, seed=2, device=device)
    _poison(arrays["grads"], 2, float("inf"))
    counters = torch.zeros(counters_size(runs), dtype=torch.int64, device=device)
    mod.check_finite(list(arrays["grads"]), counters, runs)
    assert counters.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    before = {k: [t.clone() for t in v] for k, v in arrays.items()}
    steps = torch.zeros(2 * runs, device=device)
    call(mod, arrays, MODES[0], "meta", hyper_table(MODES[0], runs, device), counters, steps,
         runs=runs, check=False)
    for key in ("params", "anchors", "importances", "meta_lrs"):
        for t, b in zip(arrays[key], before[key]):
            assert_bitwise(t[2], b[2], f"{key}: the flagged run was written")
            assert not torch.equal(t[0], b[0]) and not torch.equal(t[1], b[1])
    assert steps.view(2, runs).tolist() == [[1, 1, 0], [1, 1, 0]]
    assert counters.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("name, device", _params([()], [()]))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_check_finite_flags_each_run(name, device, dtype):
    """check_finite over an array: run r's flag is set exactly when run r's elements of some
    gradient hold an inf or a NaN, wherever it sits; FOUND is not touched; nothing else is
    written. Compared with the reference backend."""
    if name == "triton" and dtype != torch.float32:
        pytest.skip("the interpreter's cost: one dtype for Triton here")
    mod, ref = _mod(name, device), reference_backend()
    runs = 7
    arrays = make_array(runs, (0, 1, 33, 300), dtype, seed=4, device=device)
    grads = arrays["grads"]
    grads[1][3].view(-1)[0] = float("nan")
    grads[3][5].view(-1)[-1] = float("inf")
    grads[2][0].view(-1)[17] = -float("inf")
    before = [g.clone() for g in grads]
    counters = torch.zeros(counters_size(runs), dtype=torch.int64, device=device)
    ref_counters = torch.zeros(counters_size(runs), dtype=torch.int64)
    mod.check_finite(list(grads), counters, runs)
    ref.check_finite([g.cpu() for g in grads], ref_counters, runs)
    assert counters.cpu().tolist() == ref_counters.tolist()
    flags = counters[RUN_FOUND:RUN_FOUND + runs].tolist()
    assert flags == [1, 0, 0, 1, 0, 1, 0], flags
    assert counters[:RUN_FOUND].tolist() == [0, 0, 0, 0]
    assert_bitwise_unchanged(grads, before, "check_finite wrote a gradient")


def test_big_runs_cross_the_threads_pieces():
    """cpu: tensors past the one-thread grain, so pieces of the parallel pass start and end
    inside runs; bitwise equal to the runs alone at 1 and 2 threads."""
    if ("cpu", "cpu") not in BACKENDS:
        pytest.skip("the cpu backend is not built")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_runs("cpu", "cpu", "cadence", MODES[6], torch.float32, 3,
                       sizes=(40_003, 7, 70_001), calls=2, bad_run=1, bad_call=1)
            check_runs("cpu", "cpu", "inner_meta", MODES[1], torch.bfloat16, 2,
                       sizes=(50_000,), calls=1)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Bad input: refused before anything is written.
# ---------------------------------------------------------------------------------------------

def _valid_call(device, runs=3):
    mode = MODES[0]
    arrays = make_array(runs, (4, 6), torch.float32, seed=9, device=device)
    return dict(arrays=arrays, mode=mode, hyper=hyper_table(mode, runs, device),
                counters=torch.zeros(counters_size(runs), dtype=torch.int64, device=device),
                steps=torch.zeros(2 * runs, device=device), runs=runs)


def _bad_hyper_short(c):
    c["hyper"] = c["hyper"][:-1]


def _bad_hyper_single_row(c):
    c["hyper"] = c["hyper"][0].clone()


def _bad_hyper_rows(c):
    c["hyper"] = torch.cat([c["hyper"], c["hyper"][:1]])


def _bad_counters_plain(c):
    c["counters"] = torch.zeros(counters_size(1), dtype=torch.int64, device=c["steps"].device)


def _bad_counters_long(c):
    c["counters"] = torch.zeros(counters_size(c["runs"]) + 1, dtype=torch.int64,
                                device=c["steps"].device)


def _bad_steps(c):
    c["steps"] = c["steps"][:2]


def _bad_numel(c):
    c["runs"] = 4
    c["hyper"] = hyper_table(c["mode"], 4, c["steps"].device)
    c["counters"] = torch.zeros(counters_size(4), dtype=torch.int64, device=c["steps"].device)
    c["steps"] = torch.zeros(8, device=c["steps"].device)


def _bad_runs_zero(c):
    c["runs"] = 0


BAD_CALLS = [
    ("hyper-short", _bad_hyper_short, ValueError, "hyper"),
    ("hyper-one-row", _bad_hyper_single_row, ValueError, "hyper"),
    ("hyper-extra-row", _bad_hyper_rows, ValueError, "hyper"),
    ("counters-without-runs", _bad_counters_plain, ValueError, "counters"),
    ("counters-long", _bad_counters_long, ValueError, "counters"),
    ("steps-one-per-param", _bad_steps, ValueError, "steps"),
    ("numel-not-divisible", _bad_numel, ValueError, "multiple of runs"),
    ("runs-zero", _bad_runs_zero, ValueError, "runs"),
]


@pytest.mark.parametrize("name, device", _params([()], [()]))
@pytest.mark.parametrize("label, mutate, exc, pattern", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_array_calls_are_refused_before_any_write(name, device, label, mutate, exc, pattern):
    c = _valid_call(device)
    mutate(c)
    arrays = c["arrays"]
    tensors = [t for lst in arrays.values() for t in lst] + [c["hyper"], c["counters"],
                                                             c["steps"]]
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=pattern):
        call(_mod(name, device), arrays, c["mode"], "cadence", c["hyper"], c["counters"],
             c["steps"], runs=c["runs"], check=True)
    assert_bitwise_unchanged(tensors, before, f"{label}: a refused call wrote")


@pytest.mark.parametrize("name, device", _params([()], [()]))
def test_bad_check_finite_calls_are_refused(name, device):
    mod = _mod(name, device)
    arrays = make_array(3, (4,), torch.float32, seed=1, device=device)
    grads = arrays["grads"]
    with pytest.raises(ValueError, match="counters"):
        mod.check_finite(list(grads), torch.zeros(counters_size(1), dtype=torch.int64,
                                                  device=device), 3)
    with pytest.raises(ValueError, match="multiple of runs"):
        mod.check_finite(list(grads), torch.zeros(counters_size(5), dtype=torch.int64,
                                                  device=device), 5)


# ---------------------------------------------------------------------------------------------
# One launch per call whatever the number of runs; many tensors; CUDA graphs (GPU only).
# ---------------------------------------------------------------------------------------------

def _launch_counter(name):
    """A function returning how many kernels backend ``name`` has launched so far (None for
    the cpu backend, which launches nothing)."""
    if name == "cuda":
        from emcl_kernels.backends.extension import launch_count
        return launch_count
    if name == "triton":
        tb = triton_module()
        return lambda: sum(tb.launch_counts.values())
    return None


@pytest.mark.parametrize("name, device", [p for p in _params([()], [()])
                                          if p.values[0] != "cpu"])
@pytest.mark.parametrize("check", (True, False))
def test_an_array_call_is_as_many_launches_as_one_run(name, device, check):
    """The update of 7 runs is one launch, plus one finite-check launch when the call checks
    (as for one run); check_finite of an array is one launch."""
    counted = _launch_counter(name)
    mod = _mod(name, device)
    mode = MODES[0]
    for runs in (1, 7):
        arrays = make_array(runs, (5, 300, 33), torch.float32, seed=5, device=device)
        counters = torch.zeros(counters_size(runs), dtype=torch.int64, device=device)
        hyper = hyper_table(mode, runs, device) if runs > 1 else pack_hyper(
            run_hyper(mode, 0), device)
        steps = torch.zeros(3 * runs, device=device)
        before = counted()
        call(mod, arrays, mode, "cadence", hyper, counters, steps, runs=runs, check=check)
        assert counted() - before == (2 if check else 1), runs
        before = counted()
        mod.check_finite(list(arrays["grads"]), counters, runs)
        assert counted() - before == 1, runs


@pytest.mark.parametrize("name, device", [p for p in _params([()], [()])
                                          if p.values[0] != "triton"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_id)
def test_many_tensors_of_odd_sizes(name, device, dtype):
    """130 tensors (on a GPU, more than one launch's argument table holds), sizes around the
    vector widths and the chunk sizes, 3 runs, one of them with a non-finite gradient."""
    sizes = [(i * 37) % 301 + (i % 5) for i in range(130)] + [16385, 4099, 33]
    check_runs(name, device, "cadence", MODES[1], dtype, 3, sizes=sizes, calls=2, bad_run=2,
               bad_call=1, seed=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs)")
@pytest.mark.parametrize("name, device", [p for p in _params([()], [()])
                                          if p.values[1] == "cuda"])
def test_captured_array_step_replays_like_eager(name, device):
    """A CUDA graph of step(op=cadence, check=True, runs=3) replays like eager calls, bit for
    bit, with a hyper row changed in place between replays and one run's gradient made
    non-finite for one replay; nothing is read back while capturing."""
    mod = _mod(name, device)
    mode, runs = MODES[0], 3
    eager = make_array(runs, (7, 4097, 300, 0), torch.float32, seed=21, device=device)
    graphed = {k: [t.clone() for t in v] for k, v in eager.items()}
    h_e, h_g = hyper_table(mode, runs, device), hyper_table(mode, runs, device)
    c_e = torch.zeros(counters_size(runs), dtype=torch.int64, device=device)
    c_g = c_e.clone()
    s_e, s_g = torch.zeros(4 * runs, device=device), torch.zeros(4 * runs, device=device)
    # one eager call of the graphed tensors first (the Triton backend's tables; warm-up)
    call(mod, graphed, mode, "cadence", h_g, c_g, s_g, runs=runs)
    call(mod, eager, mode, "cadence", h_e, c_e, s_e, runs=runs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(mod, graphed, mode, "cadence", h_g, c_g, s_g, runs=runs)
    for i in range(5):
        grads = _fresh_grads(eager, seed=100 + i)
        if i == 2:
            _poison(grads, 1, float("inf"))
        for dst, src in ((eager["grads"], grads), (graphed["grads"], grads)):
            for d, s in zip(dst, src):
                d.copy_(s)
        for h in (h_e, h_g):
            h[2, 0] *= 1.1  # run 2's inner_lr
        call(mod, eager, mode, "cadence", h_e, c_e, s_e, runs=runs)
        graph.replay()
        torch.cuda.synchronize()
        for key in ("params", "anchors", "importances", "meta_lrs"):
            for a, b in zip(graphed[key], eager[key]):
                assert_bitwise(a, b, f"replay {i}: {key}")
        assert torch.equal(s_g, s_e) and torch.equal(c_g, c_e), f"replay {i}"
    assert c_e[run_skipped_at(runs) + 1] == 1
