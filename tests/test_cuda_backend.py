"""The "cuda" backend (the extension's multi-tensor kernels) on the op interface: it equals the
reference for every op, mode and dtype; a call is one update launch plus one finite-check launch
when it checks (more only past the kernel-argument limit, and then the counters are still
finalized once); aligned and unaligned tensors mix in one call; a tensor past 2**31 elements is
updated and checked whole; a step captured in a CUDA graph with op=cadence replays like eager
calls, reading the hyper-parameters, counters and flags as they are at each replay; a
non-finite gradient skips a replay; nothing synchronizes with the host; bad calls are refused
before anything is written. Runs only where a GPU and the CUDA kernels exist."""
import pytest
import torch

from emcl_kernels.backends import backend_status, get_backend
from emcl_kernels.interface import HYPER, OP
from emcl_testing import (BAD_STEP_CALLS, DTYPES, MODES, assert_bitwise_unchanged,
                          assert_case_close, assert_close, assert_unchanged, bitwise_snapshot,
                          call_step, call_step_op, call_tensors, check_step_matches_reference,
                          clone_case, counters_dict, make_case, mode_codes, new_counters,
                          pack_hyper, reference_backend, snapshot, step_hyper, step_op_call)

pytestmark = pytest.mark.skipif(backend_status()["cuda"] != "available",
                                reason=f"cuda backend: {backend_status()['cuda']}")

# Around the vector width, a chunk (16,384 elements) and two chunks plus a tail.
SIZES = (0, 1, 7, 33, 4097, 2 * 16384 + 3)


def _cuda():
    return get_backend("cuda", torch.device("cuda"))


def _launches() -> int:
    from emcl_kernels.backends.extension import launch_count
    return launch_count()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", ("inner", "meta", "inner_meta", "cadence"))
def test_step_matches_reference(op, mode, dtype):
    check_step_matches_reference(_cuda(), op, SIZES, dtype, mode, device="cuda", calls=7,
                                 meta_every=3, seed=3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_many_tensors_take_several_launches_and_finalize_once(dtype):
    """300 tensors (recurrent mode: five lists) fill several kernel-argument tables: several
    check and update launches per call, results as the reference's, the counters finalized
    once per call (CALLS advances by one, DONE is back to 0) and every meta step counted."""
    sizes = [0 if i % 7 == 3 else (i * 37) % 301 + 1 + (70_000 if i % 50 == 0 else 0)
             for i in range(300)]
    torch.cuda.synchronize()
    before = _launches()
    check_step_matches_reference(_cuda(), "cadence", sizes, dtype, MODES[0], device="cuda",
                                 calls=3, meta_every=2, seed=5)
    per_call = (_launches() - before) / 3
    assert per_call > 2, f"{per_call} launches per call: expected the tables to split"


@pytest.mark.parametrize("check", (True, False))
def test_one_check_and_one_update_launch_per_call(check):
    """40 tensors of up to 5M elements: one update launch, and one check launch when the call
    checks its gradients; check_finite is one launch."""
    mode = MODES[0]
    sizes = [5_000_001, 7, 0, 1, 4097] + [1000 + 13 * i for i in range(35)]
    case = make_case(sizes, torch.float32, seed=2, device="cuda")
    mod = _cuda()
    torch.cuda.synchronize()
    before = _launches()
    call_step(mod, "cadence", case, mode, step_hyper(mode), new_counters("cuda"), check=check)
    assert _launches() - before == (2 if check else 1)
    before = _launches()
    mod.check_finite(case.grads, new_counters("cuda"))
    assert _launches() - before == 1


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64), ids=str)
@pytest.mark.parametrize("op", ("inner", "inner_meta"))
def test_aligned_and_unaligned_tensors_in_one_call(op, dtype):
    """Tensor 0 is aligned everywhere; tensor 1's param and tensor 2's anchor start one
    element past a 16-byte boundary (their whole tensor takes the scalar path); tensor 3 is
    aligned again. Every tensor agrees with the reference."""
    mode = MODES[0]
    case = make_case([4099, 4099, 33 * 3, 70_001], dtype, seed=4, device="cuda")

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    case.params[1] = shifted(case.params[1])
    case.anchors[2] = shifted(case.anchors[2])
    assert case.params[1].data_ptr() % 16 != 0 and case.anchors[2].data_ptr() % 16 != 0
    assert case.params[0].data_ptr() % 16 == 0 and case.params[3].data_ptr() % 16 == 0
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    expected = clone_case(case, ref_dtype, device="cpu")
    hyper = step_hyper(mode)
    call_step(_cuda(), op, case, mode, hyper, new_counters("cuda"), check=True)
    call_step(reference_backend(), op, expected, mode, hyper, new_counters(), check=True)
    assert_case_close(case, expected, dtype, f"mixed alignment {op} {dtype}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64), ids=str)
@pytest.mark.parametrize("value", (float("nan"), float("inf"), -float("inf")))
def test_check_finds_every_non_finite_value_aligned_or_not(dtype, value):
    """The check's integer test (all exponent bits set) on both paths: the vector body and the
    tail of an aligned tensor, and an unaligned tensor; the largest finite values pass."""
    big = torch.finfo(dtype).max
    base = torch.full((4103,), big, dtype=dtype, device="cuda")
    base[::2] = -big
    base[1::3] = torch.finfo(dtype).tiny / 2  # subnormal where it exists
    counters = new_counters("cuda")
    _cuda().check_finite([base, base[1:]], counters)
    assert counters_dict(counters.cpu())["found"] == 0
    for where, offset in ((5, 0), (4102, 0), (17, 1)):
        g = base.clone()
        g[where] = value
        grads = [g[offset:]]
        counters = new_counters("cuda")
        _cuda().check_finite(grads, counters)
        assert counters_dict(counters.cpu())["found"] == 1, (where, offset)


def test_empty_lists_still_do_the_bookkeeping():
    counters = new_counters("cuda", found=1, calls=4)
    hyper = pack_hyper(step_hyper(MODES[4]), "cuda")
    _cuda().step([], [], [], [], [], torch.zeros(0, device="cuda"), hyper, counters,
                 op=OP["cadence"], prox=True, importance=0, lr_mode=1, meta_every=2,
                 check=True, finalize=True)
    assert counters_dict(counters.cpu()) == dict(found=0, calls=5, skipped=1, done=0)


@pytest.mark.parametrize("entry", ("torch.ops", "backend"))
def test_a_step_never_waits_for_the_gpu(entry):
    """With a check, grad_scale and found_inf, a call reads every device value on the device:
    torch's sync debug mode finds no synchronization in the call (every tensor is made
    before it: a copy from pageable host memory would synchronize)."""
    call = step_op_call("cuda", torch.bfloat16, MODES[0], sizes=(4097, 70_001), seed=6)
    call.update(grad_scale=torch.full((), 4.0, device="cuda"),
                found_inf=torch.zeros((), device="cuda"), meta_every=2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call_step_op(call, entry)
        _cuda().check_finite(call["grads"], call["counters"])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert counters_dict(call["counters"].cpu())["calls"] == 1


class _Captured:
    """One (device, dtype) group's step with every argument held in a fixed tensor, so a
    captured call and an eager call can run on twins of the same state."""

    def __init__(self, case, mode, *, check: bool, meta_every: int):
        self.case, self.mode = case, mode
        self.hyper = pack_hyper(step_hyper(mode), "cuda")
        self.counters = new_counters("cuda")
        self.steps = torch.zeros(len(case.params), device="cuda")
        self.found_inf = torch.zeros((), device="cuda")
        self.grad_scale = torch.ones((), device="cuda")
        self.check, self.meta_every = check, meta_every

    def step(self):
        c = self.case
        _cuda().step(c.params, c.grads, c.anchors, c.importances,
                     c.meta_lrs if self.mode.lr_mode == "recurrent" else [], self.steps,
                     self.hyper, self.counters, op=OP["cadence"], meta_every=self.meta_every,
                     check=self.check, finalize=True, grad_scale=self.grad_scale,
                     found_inf=self.found_inf, **mode_codes(self.mode))

    def tensors(self):
        return [*snapshot(self.case), self.hyper, self.counters, self.steps]


def _twins(mode, *, check, meta_every=3):
    case = make_case([4097, 33, 70_001, 1], torch.bfloat16, seed=7, device="cuda")
    return (_Captured(case, mode, check=check, meta_every=meta_every),
            _Captured(clone_case(case), mode, check=check, meta_every=meta_every))


def _capture(group):
    # One eager call on a scratch copy first (the launcher caches its grid size), then the
    # capture on a side stream, as torch.cuda.graph does.
    scratch = _Captured(clone_case(group.case), group.mode, check=group.check,
                        meta_every=group.meta_every)
    scratch.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group.step()
    return graph


def _set_inputs(group, k):
    """The k-th step's gradients, hyper-parameters and scale, written in place."""
    gen = torch.Generator().manual_seed(100 + k)
    for g in group.case.grads:
        g.copy_(torch.randn(g.shape, generator=gen).to(g.dtype))
    group.hyper[HYPER["inner_lr"]] = 0.05 * (1 + k / 10)
    group.hyper[HYPER["decay"]] = 0.8 + 0.01 * k
    group.grad_scale.fill_(2.0 ** (k % 3))
    for g in group.case.grads:
        g.mul_(2.0 ** (k % 3))


@pytest.mark.parametrize("mode", (MODES[0], MODES[4]), ids=lambda m: m.id)
def test_captured_cadence_step_replays_like_eager_calls(mode):
    """A step_ with op=cadence captured once and replayed 7 times, the gradients, the
    hyper-parameters (in place in `hyper`) and grad_scale changed before each replay: bit for
    bit what 7 eager calls on a twin give, tensors, counters (meta step on every 3rd call)
    and steps; a found_inf set before one replay skips it in both."""
    captured, eager = _twins(mode, check=True)
    graph = _capture(captured)
    for k in range(7):
        skip = k == 4
        for group in (captured, eager):
            _set_inputs(group, k)
            group.found_inf.fill_(1.0 if skip else 0.0)
        graph.replay()
        eager.step()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(captured.tensors(), eager.tensors())):
            assert torch.equal(a, b), f"replay {k + 1}: tensor {i} differs from eager"
    c = counters_dict(captured.counters.cpu())
    assert c == dict(found=0, calls=7, skipped=0, done=0), c
    # calls 3 and 6 are meta steps (meta_every=3); none was skipped by found_inf (call 5)
    assert captured.steps.tolist() == [2.0] * len(captured.case.params)


def test_captured_step_skips_a_replay_with_a_non_finite_gradient():
    mode = MODES[1]
    captured, _ = _twins(mode, check=True, meta_every=1)
    graph = _capture(captured)
    _set_inputs(captured, 0)
    graph.replay()
    torch.cuda.synchronize()
    assert captured.steps.tolist() == [1.0] * 4
    _set_inputs(captured, 1)
    captured.case.grads[2].view(-1)[12_345] = float("nan")
    before = snapshot(captured.case)
    graph.replay()
    torch.cuda.synchronize()
    assert_unchanged(captured.case, before, "replay with a NaN gradient")
    assert counters_dict(captured.counters.cpu()) == dict(found=0, calls=2, skipped=1, done=0)
    assert captured.steps.tolist() == [1.0] * 4
    _set_inputs(captured, 2)
    graph.replay()
    torch.cuda.synchronize()
    assert captured.steps.tolist() == [2.0] * 4


def test_tensor_past_2_31_elements(gpu_memory_to_myself):
    """One bf16 tensor of 2**31 + 5 elements is updated whole (64-bit indexing) and its finite
    check reads all of it."""
    n = 2**31 + 5
    need = n * (2 + 2 + 4 + 4 + 4) + (4 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} free")
    mode = MODES[0]
    hyper = step_hyper(mode)
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    a = p.float().add_(0.3)
    h = torch.rand(n, device="cuda", generator=gen).add_(0.1)
    r = torch.full((n,), 0.1, device="cuda")
    windows = [slice(0, 1000), slice(2**30, 2**30 + 1000), slice(2**31 - 500, 2**31 + 500),
               slice(n - 1000, n)]
    saved = [[t[w].cpu().clone() for t in (p, g, a, h, r)] for w in windows]
    big = make_case([1], torch.bfloat16, seed=0, device="cuda")
    big.params, big.grads, big.anchors, big.importances, big.meta_lrs = [p], [g], [a], [h], [r]
    counters = new_counters("cuda")
    call_step(_cuda(), "inner_meta", big, mode, hyper, counters, check=True)
    assert counters_dict(counters.cpu())["skipped"] == 0
    for w, (sp, sg, sa, sh, sr) in zip(windows, saved):
        window = make_case([1], torch.bfloat16, seed=0)
        window.params, window.grads, window.anchors = [sp], [sg], [sa]
        window.importances, window.meta_lrs = [sh], [sr]
        call_step(reference_backend(), "inner_meta", window, mode, hyper, new_counters())
        for got, want, name in ((p, sp, "params"), (a, sa, "anchors"), (h, sh, "importances"),
                                (r, sr, "meta_lrs")):
            assert_close(got[w], want, torch.bfloat16, f"{name}[{w.start}:{w.stop}]")
    for where in (2**31 + 3, 2**31 - 8):  # the scalar tail past 2**31; a vector just below
        counters = new_counters("cuda")
        old = g[where].item()
        g[where] = float("inf")
        _cuda().check_finite([g], counters)
        g[where] = old
        assert counters_dict(counters.cpu())["found"] == 1, where


# ---------------------------------------------------------------------------------------------
# Bad calls
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ("torch.ops", "backend"))
@pytest.mark.parametrize("name, mutate, exc, match", BAD_STEP_CALLS,
                         ids=[b[0] for b in BAD_STEP_CALLS])
def test_step_op_refuses_a_bad_call_before_writing(name, mutate, exc, match, entry):
    call = step_op_call("cuda")
    mutate(call)
    tensors = call_tensors(call)
    before = bitwise_snapshot(tensors)
    with pytest.raises(exc, match=match):
        call_step_op(call, entry)
    torch.cuda.synchronize()
    assert_bitwise_unchanged(tensors, before, name)


@pytest.mark.parametrize("what", ("grads", "anchors", "meta_lrs", "hyper", "counters", "steps",
                                  "found_inf"))
def test_a_tensor_on_another_device_is_refused(what):
    call = step_op_call("cuda")
    call["found_inf"] = torch.zeros((), device="cuda")
    if isinstance(call[what], list):
        call[what] = [call[what][0], call[what][1].cpu()]
    else:
        call[what] = call[what].cpu()
    tensors = call_tensors(call)
    before = bitwise_snapshot(tensors)
    with pytest.raises(RuntimeError, match="is on"):
        call_step_op(call)
    torch.cuda.synchronize()
    assert_bitwise_unchanged(tensors, before, what)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_two_gpus_are_refused():
    call = step_op_call("cuda")
    call["anchors"] = [call["anchors"][0], call["anchors"][1].to("cuda:1")]
    with pytest.raises(RuntimeError, match="is on"):
        call_step_op(call)


def test_a_call_on_the_second_gpu_runs_there():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    check_step_matches_reference(get_backend("cuda", torch.device("cuda:1")), "inner_meta",
                                 [4097, 33], torch.float32, MODES[1], device="cuda:1", calls=2)
