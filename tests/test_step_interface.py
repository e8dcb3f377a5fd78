"""[note: the step call] of emcl_kernels.interface, backend by backend: every backend's ``step``
and ``check_finite`` do what the reference backend's plain Python does, tensors and counters.

The Triton backend runs the same checks (``emcl_testing.check_step_matches_reference`` and the
functions below) from ``tests/test_triton_backend.py``, where its interpreter is set up.
"""
import pytest
import torch

from emcl_kernels.backends import backend_status, get_backend
from emcl_kernels.interface import COUNTER, HYPER_FIELDS, OPS
from emcl_testing import (DTYPES, MODES, SIZES, assert_case_close, assert_unchanged,
                          call_step, check_step_matches_reference, clone_case, counters_dict,
                          fresh_grads, make_case, new_counters, pack_hyper, reference_backend,
                          snapshot, step_hyper)

_CANDIDATES = (("foreach", "cpu"), ("cpu", "cpu"), ("cuda", "cuda"))
BACKENDS = [pytest.param(name, device, id=name) for name, device in _CANDIDATES
            if backend_status()[name] == "available"
            and (device == "cpu" or torch.cuda.is_available())]
STEP_OPS = OPS  # inner, meta, inner_meta, cadence


def _mod(name, device):
    return get_backend(name, torch.device(device))


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", STEP_OPS)
def test_step_matches_reference(name, device, op, mode, dtype):
    check_step_matches_reference(_mod(name, device), op, SIZES, dtype, mode, device=device,
                                 calls=7, meta_every=3, seed=3)


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_many_tensors_of_odd_sizes(name, device, dtype):
    """130 tensors (more than one CUDA launch's argument struct holds), sizes around the
    vector width and the chunk sizes."""
    sizes = [(i * 37) % 301 + (i % 5) for i in range(130)] + [16385, 4099, 33]
    check_step_matches_reference(_mod(name, device), "inner_meta", sizes, dtype, MODES[1],
                                 device=device, calls=2, seed=5)


def _poisoned(device, dtype, where: int, value: float):
    case = make_case([5, 4097, 300], dtype, seed=11, device=device)
    flat = case.grads[1].view(-1)
    flat[where] = value
    return case


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", (float("nan"), float("inf"), -float("inf")))
@pytest.mark.parametrize("op", ("inner", "meta", "cadence"))
def test_check_skips_the_whole_call(name, device, dtype, value, op):
    """check=True and one non-finite gradient element anywhere: nothing is written (grads
    included, bit for bit), the skip is counted, the cadence still advances."""
    mode = MODES[0]  # recurrent: meta_lrs are passed and must not move either
    case = _poisoned(device, dtype, 4096, value)
    before = snapshot(case)
    counters = new_counters(device, calls=2)
    steps = torch.zeros(3, device=device)
    call_step(_mod(name, device), op, case, mode, step_hyper(mode), counters, steps=steps,
              meta_every=3, check=True)
    assert_unchanged(case, before, f"{name} {op} {dtype} {value}")
    c = counters_dict(counters.cpu())
    assert c == dict(found=0, calls=3 if op == "cadence" else 2, skipped=1, done=0), c
    assert not steps.any()


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_finite_sets_found_and_writes_nothing(name, device, dtype):
    mod = _mod(name, device)
    case = make_case([0, 1, 7, 4097], dtype, seed=2, device=device)
    counters = new_counters(device)
    before = snapshot(case)
    mod.check_finite(list(case.grads), counters)
    assert counters_dict(counters.cpu())["found"] == 0
    case.grads[3].view(-1)[-1] = float("nan")
    before = snapshot(case)
    mod.check_finite(list(case.grads), counters)
    assert counters_dict(counters.cpu()) == dict(found=1, calls=0, skipped=0, done=0)
    assert_unchanged(case, before, "check_finite")


@pytest.mark.parametrize("name, device", BACKENDS)
def test_found_inf_skips_without_counting_a_skip(name, device):
    """GradScaler's found_inf: nothing written, not counted as our skip, cadence advances."""
    mode = MODES[1]
    case = make_case([7, 4097], torch.float32, seed=4, device=device)
    before = snapshot(case)
    counters = new_counters(device)
    steps = torch.zeros(2, device=device)
    call_step(_mod(name, device), "cadence", case, mode, step_hyper(mode), counters,
              steps=steps, meta_every=1, check=True,
              found_inf=torch.ones((), device=device))
    assert_unchanged(case, before, "found_inf=1")
    assert counters_dict(counters.cpu()) == dict(found=0, calls=1, skipped=0, done=0)
    assert not steps.any()


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("op", ("inner", "inner_meta"))
def test_grad_scale_divides_the_gradients(name, device, op):
    mode = MODES[4]
    case = make_case([7, 4097], torch.float32, seed=6, device=device)
    expected = clone_case(case)
    scaled = clone_case(case)
    scaled.grads = [g * 8.0 for g in case.grads]
    mod = _mod(name, device)
    call_step(mod, op, scaled, mode, step_hyper(mode), new_counters(device),
              grad_scale=torch.full((), 8.0, device=device), found_inf=torch.zeros((), device=device))
    call_step(mod, op, expected, mode, step_hyper(mode), new_counters(device))
    scaled.grads = expected.grads
    assert_case_close(scaled, expected, torch.float32, f"{name} grad_scale")


@pytest.mark.parametrize("name, device", BACKENDS)
def test_cadence_is_every_meta_every_th_call(name, device):
    """op=cadence with meta_every=3 over 7 calls == inner, inner, inner_meta, inner, inner,
    inner_meta, inner; two meta steps counted; calls ends at 7."""
    mode = MODES[2]
    hyper = step_hyper(mode)
    mod = _mod(name, device)
    a = make_case([7, 300], torch.float32, seed=8, device=device)
    b = clone_case(a)
    ca, cb = new_counters(device), new_counters(device)
    sa, sb = torch.zeros(2, device=device), torch.zeros(2, device=device)
    for call in range(7):
        call_step(mod, "cadence", a, mode, hyper, ca, steps=sa, meta_every=3)
        explicit = "inner_meta" if call % 3 == 2 else "inner"
        call_step(mod, explicit, b, mode, hyper, cb, steps=sb)
        assert_case_close(a, b, torch.float32, f"call {call + 1}")
        a.grads = b.grads = fresh_grads(a, seed=call)
    assert counters_dict(ca.cpu())["calls"] == 7 and counters_dict(cb.cpu())["calls"] == 0
    assert sa.tolist() == [2.0, 2.0] and sb.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("name, device", BACKENDS)
def test_one_bad_group_skips_every_group(name, device):
    """The multi-group protocol: check_finite on every group, then step with check=False; the
    last call finalizes. A NaN in group 2 leaves group 1 untouched too."""
    mode = MODES[1]
    mod = _mod(name, device)
    g1 = make_case([7, 300], torch.float32, seed=9, device=device)
    g2 = make_case([5, 4097], torch.bfloat16, seed=10, device=device)
    g2.grads[0].view(-1)[3] = float("inf")
    before1, before2 = snapshot(g1), snapshot(g2)
    counters = new_counters(device)
    mod.check_finite(list(g1.grads), counters)
    mod.check_finite(list(g2.grads), counters)
    call_step(mod, "cadence", g1, mode, step_hyper(mode), counters, finalize=False)
    assert counters_dict(counters.cpu())["found"] == 1  # not finalized yet
    call_step(mod, "cadence", g2, mode, step_hyper(mode), counters, finalize=True)
    assert_unchanged(g1, before1, "group 1")
    assert_unchanged(g2, before2, "group 2")
    assert counters_dict(counters.cpu()) == dict(found=0, calls=1, skipped=1, done=0)


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("op", ("meta", "inner_meta"))
def test_lr_scale_sentinel_means_one_over_reg(name, device, op):
    mode = MODES[4]  # inverse
    hyper = step_hyper(mode)
    mod = _mod(name, device)
    a = make_case([7, 300], torch.float32, seed=12, device=device)
    b = clone_case(a)
    call_step(mod, op, a, mode, {**hyper, "lr_scale": None}, new_counters(device))
    call_step(mod, op, b, mode, {**hyper, "lr_scale": 1.0 / hyper["reg"]}, new_counters(device))
    assert_case_close(a, b, torch.float32, "lr_scale sentinel")


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_prox_update_of_huge_parameters(name, device, dtype):
    """|θ|, |θ₀| ~ 1e30 with a strong pull (c = γλh ~ 1e20): (θ̂ + c·θ₀)/(1 + c) would
    overflow at c·θ₀; the backends must give the fp64 reference's finite answer."""
    mode = MODES[1]  # prox
    mod = _mod(name, device)
    hyper = step_hyper(mode)
    case = make_case([9, 301], dtype, seed=13, device=device)
    for i in range(2):
        case.params[i] = (case.params[i].float() * 1e30).to(dtype)
        case.anchors[i].mul_(1e30)
        case.importances[i].mul_(1e20)
    expected = clone_case(case, torch.float64, device="cpu")
    call_step(mod, "inner", case, mode, hyper, new_counters(device))
    call_step(reference_backend(), "inner", expected, mode, hyper, new_counters())
    assert all(bool(torch.isfinite(p).all()) for p in case.params)
    assert_case_close(case, expected, dtype, f"{name} huge prox", with_meta_lrs=False)


@pytest.mark.parametrize("name, device", BACKENDS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
def test_dead_units_stay_put(name, device, mode):
    """g = 0 and h = 0 (a dead unit) with the smallest normal eps, in every mode: α may be
    huge but α·h is 0, so h stays 0 and θ₀ stays exactly where it was (no inf·0 = NaN)."""
    mod = _mod(name, device)
    hyper = {**step_hyper(mode), "eps": torch.finfo(torch.float32).tiny, "lr_max": float("inf")}
    case = make_case([9, 301], torch.float32, seed=14, device=device)
    for g, h in zip(case.grads, case.importances):
        g.zero_()
        h.zero_()
    anchors = [a.clone() for a in case.anchors]
    for op in ("meta", "inner_meta", "meta", "inner_meta"):  # recurrent α overflows by call 2
        call_step(mod, op, case, mode, hyper, new_counters(device))
        for a, before, h, p in zip(case.anchors, anchors, case.importances, case.params):
            assert torch.equal(a, before), f"{op}: a dead unit's anchor moved"
            assert not h.any(), f"{op}: a dead unit's importance left 0"
            assert torch.equal(p, a), f"{op}: θ != θ₀ after the meta step"
        if mode.lr_mode == "recurrent":
            assert all(bool(torch.isfinite(m).all()) for m in case.meta_lrs)


@pytest.mark.parametrize("name, device", BACKENDS)
def test_dense_non_contiguous_layouts(name, device):
    """A channels_last weight, its grad and its state in the same layout: the kernels update
    memory in place element for element, exactly as for the contiguous copy."""
    mode = MODES[1]
    mod = _mod(name, device)
    a = make_case([2 * 3 * 5 * 7], torch.float32, seed=14, device=device)
    for lst in (a.params, a.grads, a.anchors, a.importances, a.meta_lrs):
        lst[0] = lst[0].reshape(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)
    b = clone_case(a)
    for lst in (b.params, b.grads, b.anchors, b.importances, b.meta_lrs):
        lst[0] = lst[0].contiguous()
    call_step(mod, "inner_meta", a, mode, step_hyper(mode), new_counters(device))
    call_step(mod, "inner_meta", b, mode, step_hyper(mode), new_counters(device))
    assert a.params[0].is_contiguous(memory_format=torch.channels_last)
    assert_case_close(a, b, torch.float32, "channels_last")


def test_hyper_layout_is_the_interface():
    t = pack_hyper(dict(inner_lr=1, meta_lr=2, reg=3, gamma=4, decay=0.5, lr_scale=None,
                        lr_min=6, lr_max=7, eps=8))
    assert dict(zip(HYPER_FIELDS, t.tolist()))["lr_scale"] == -1.0
    assert t.dtype == torch.float64 and len(t) == len(HYPER_FIELDS)
    assert COUNTER["found"] == 0


def test_hyper_of_numbers_is_made_on_the_device_while_a_graph_is_captured(monkeypatch):
    """In a captured region the numbers are filled on the device (a captured copy from the
    pinned buffer would be read again at every replay, after the buffer was reused): the same
    values, and no host tensor made for them."""
    from emcl_kernels import plan
    hp = dict(inner_lr=0.1, meta_lr=0.2, reg=1.5, gamma=0.3, decay=0.8, lr_scale=None,
              lr_min=0.0, lr_max=float("inf"), eps=1e-8)
    eager = plan.pack_hyper(hp, "cpu")
    monkeypatch.setattr(plan, "_capturing_on", lambda device: True)
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("a tensor was made from "
                                                                     "host numbers"))
    captured = plan.pack_hyper(hp, "cpu")
    assert captured.dtype == torch.float64 and torch.equal(captured, eager)


@pytest.mark.parametrize("lr_scale", (None, 0.25), ids=("from-reg", "given"))
def test_hyper_is_encoded_one_way_from_numbers_tensors_and_a_traced_group(lr_scale):
    """The numbers, the 0-d tensors and a compiled step's group give the same ``hyper``
    (missing fields take interface.HYPER_DEFAULTS), and the host decoder resolves the
    sentinel as interface.resolve_lr_scale says."""
    from emcl_kernels import plan
    from emcl_kernels.backends.reference import hyper_dict
    from emcl_kernels.interface import HYPER_DEFAULTS, resolve_lr_scale
    numbers = dict(inner_lr=0.05, meta_lr=0.2, reg=2.0, gamma=0.3, decay=0.9, lr_scale=lr_scale,
                   lr_min=0.01)                                      # no lr_max, no eps
    tensors = {k: (torch.tensor(v, dtype=torch.float64) if v is not None else None)
               for k, v in numbers.items()}
    group = {**numbers, "lr_max": HYPER_DEFAULTS["lr_max"], "eps": HYPER_DEFAULTS["eps"]}
    packed = [plan.pack_hyper(numbers, "cpu"), plan.pack_hyper(tensors, "cpu"),
              plan._traced_hyper(group, torch.device("cpu")),
              torch.tensor(plan.hyper_values(numbers), dtype=torch.float64)]
    for t in packed[1:]:
        assert torch.equal(t, packed[0])
    decoded = hyper_dict(packed[0])
    assert decoded["lr_scale"] == (0.25 if lr_scale else 0.5) == resolve_lr_scale(lr_scale, 2.0)
    assert decoded["lr_max"] == float("inf") and decoded["eps"] == 1e-8
    assert resolve_lr_scale(None, 0.0) == 1.0


def _launch_shape():
    import emcl_kernels.backends.extension  # noqa: F401  (loads the library when it is built)
    if not hasattr(torch.ops.emcl, "cuda_launch_shape"):
        pytest.skip("the extension was built without its CUDA kernels")
    return torch.ops.emcl.cuda_launch_shape


@pytest.mark.parametrize("sms", (108, 132))           # A100, H100/H200
@pytest.mark.parametrize("numels", ([1 << 20], [1 << 18] * 4, [4097, 33, 70_001],
                                    [300_000, 7]))
def test_cuda_launch_covers_every_sm_of_a_mid_size_step(numels, sms):
    """The cuda backend's launch of a step of 2**16..2**21 elements has at least one chunk per
    SM (with 8 blocks resident per SM), by smaller chunks where 16,384-element ones would leave
    SMs idle ([note: chunk size] in csrc/multi_tensor.cuh); large steps keep 16,384."""
    shape = _launch_shape()
    chunk, chunks = shape(numels, sms * 8)
    total = sum(numels)
    assert chunk in (2048, 4096, 8192, 16384) and chunks == sum(-(-n // chunk) for n in numels)
    assert chunks >= min(sms, -(-total // 2048)), (chunk, chunks)
    assert shape([1 << 26], sms * 8) == [16384, (1 << 26) // 16384]
