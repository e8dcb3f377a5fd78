"""The "cpu" backend (the extension's C++ kernels) on the op interface: the operators refuse every
bad call before writing anything, the portable and the AVX2 copies of the kernels compute the
same bits, the result does not depend on the number of threads, tensors that span several
parallel pieces agree with the reference, and torch.compile traces a step.

(The behaviour every backend shares, [note: the step call] against the reference backend, is in
tests/test_step_interface.py, which runs it for "cpu" too.)"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from emcl_kernels.backends import backend_status, get_backend
from emcl_kernels.interface import OP
from emcl_testing import (BAD_STEP_CALLS, MODES, assert_bitwise_unchanged, assert_unchanged,
                          bitwise_snapshot, call_step, call_step_op, call_tensors,
                          check_step_matches_reference, clone_case, counters_dict,
                          element_bytes, make_case, new_counters, snapshot, step_hyper,
                          step_op_call)

pytestmark = pytest.mark.skipif(backend_status()["cpu"] != "available",
                                reason=f"cpu backend: {backend_status()['cpu']}")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _cpu():
    return get_backend("cpu", torch.device("cpu"))


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for one test and puts it back afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_auto_picks_cpu_for_cpu_tensors():
    from emcl_kernels.backends import auto_backend
    assert auto_backend(torch.device("cpu")) == "cpu"


def test_the_build_reports_its_interface_and_kernel_copy():
    from emcl_kernels import interface
    assert torch.ops.emcl.interface() == interface.layout_string()
    assert torch.ops.emcl.cpu_kernel() in ("avx512", "avx2", "portable")


def test_a_stale_build_is_refused_with_the_rebuild_command(monkeypatch):
    from emcl_kernels import interface
    from emcl_kernels.backends import extension
    monkeypatch.setattr(interface, "layout_string", lambda: "v0;another layout")
    reason = extension._stale_reason()
    assert reason is not None and "another version of the op interface" in reason
    assert "rebuild with pip install --no-build-isolation -e ." in reason
    monkeypatch.undo()
    assert extension._stale_reason() is None


# ---------------------------------------------------------------------------------------------
# Bad calls: refused before anything is written.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ("torch.ops", "backend"))
@pytest.mark.parametrize("name, mutate, exc, match", BAD_STEP_CALLS,
                         ids=[b[0] for b in BAD_STEP_CALLS])
def test_step_op_refuses_a_bad_call_before_writing(name, mutate, exc, match, entry):
    call = step_op_call("cpu")
    mutate(call)
    tensors = call_tensors(call)
    before = bitwise_snapshot(tensors)
    with pytest.raises(exc, match=match):
        call_step_op(call, entry)
    assert_bitwise_unchanged(tensors, before, name)


def test_the_unmodified_call_of_the_bad_call_matrix_runs():
    """The matrix above starts from a call that works (so each refusal is for its one change):
    it updates the parameters, counts a meta step (cadence, meta_every=1) and advances CALLS."""
    call = step_op_call("cpu")
    before = [p.clone() for p in call["params"]]
    call_step_op(call)
    assert not any(torch.equal(p, b) for p, b in zip(call["params"], before))
    assert call["steps"].tolist() == [1.0, 1.0]
    assert counters_dict(call["counters"]) == dict(found=0, calls=1, skipped=0, done=0)


def test_step_op_refuses_a_sparse_gradient():
    call = step_op_call("cpu")
    call["grads"] = [call["grads"][0].to_sparse(), call["grads"][1]]
    tensors = call_tensors(call)
    before = bitwise_snapshot(tensors)
    with pytest.raises(RuntimeError):
        call_step_op(call)
    assert_bitwise_unchanged(tensors, before, "sparse grad")


def test_check_finite_op_refuses_bad_calls():
    grads = make_case([10, 3], torch.float32, seed=1).grads
    counters = new_counters()
    with pytest.raises(TypeError, match="counters"):
        torch.ops.emcl.check_finite_(grads, counters.int())
    with pytest.raises(ValueError, match="counters"):
        torch.ops.emcl.check_finite_(grads, counters[:2])
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        torch.ops.emcl.check_finite_([grads[0].to(torch.int64)], counters)
    with pytest.raises(RuntimeError, match="not dense"):
        torch.ops.emcl.check_finite_([torch.randn(20)[::2]], counters)
    assert not counters.any()


def test_gradient_may_differ_in_the_stride_of_a_size_one_dimension():
    """Autograd's layout contract ignores the strides of size-1 dimensions: a gradient of shape
    (1, 6) with strides (1, 1) pairs element for element with a param of strides (6, 1)."""
    mode = MODES[1]
    a = make_case([6], torch.float32, seed=3)
    for lst in (a.params, a.grads, a.anchors, a.importances, a.meta_lrs):
        lst[0] = lst[0].reshape(1, 6)
    b_grad = torch.as_strided(a.grads[0].clone(), (1, 6), (1, 1))
    assert b_grad.stride() != a.params[0].stride()
    b = make_case([6], torch.float32, seed=3)
    for lst in (b.params, b.anchors, b.importances, b.meta_lrs):
        lst[0] = lst[0].reshape(1, 6)
    b.grads[0] = b_grad
    mod = _cpu()
    call_step(mod, "inner_meta", a, mode, step_hyper(mode), new_counters())
    call_step(mod, "inner_meta", b, mode, step_hyper(mode), new_counters())
    assert torch.equal(a.params[0], b.params[0]) and torch.equal(a.anchors[0], b.anchors[0])


def test_empty_lists_still_do_the_bookkeeping():
    counters = new_counters(found=1, calls=4)
    torch.ops.emcl.step_([], [], [], [], [], torch.zeros(0), step_op_call()["hyper"], counters,
                         op=OP["cadence"], prox=True, importance=0, lr_mode=1, meta_every=2,
                         check=True, finalize=True)
    assert counters_dict(counters) == dict(found=0, calls=5, skipped=1, done=0)


def test_check_finite_sees_every_dtype_of_one_call():
    grads = [torch.randn(5), torch.randn(300, dtype=torch.bfloat16),
             torch.randn(7, dtype=torch.float16), torch.randn(40_000, dtype=torch.float64)]
    counters = new_counters()
    _cpu().check_finite(grads, counters)
    assert counters_dict(counters)["found"] == 0
    for i, where in ((1, 299), (2, 0), (3, 39_999), (0, 4)):
        bad = [g.clone() for g in grads]
        bad[i][where] = float("inf") if i % 2 else float("nan")
        counters = new_counters()
        _cpu().check_finite(bad, counters)
        assert counters_dict(counters)["found"] == 1, (i, where)


def test_cpu_calls_launch_no_cuda_kernel():
    from emcl_kernels.backends.extension import launch_count
    before = launch_count()
    call_step_op(step_op_call("cpu"))
    assert launch_count() == before


# ---------------------------------------------------------------------------------------------
# Big calls: pieces, threads, the two copies of the kernels.
# ---------------------------------------------------------------------------------------------

# 300,007 + 65,537 + 3 elements: past the size below which a call runs on one thread; at 2
# threads 9 pieces of at most 45,632 elements ([note: pieces] in csrc/emcl_cpu_kernels.h), pieces that
# span two tensors, odd tails.
BIG = [300_007, 65_537, 3]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.float64), ids=str)
@pytest.mark.parametrize("op", ("inner", "meta", "inner_meta"))
def test_large_tensors_span_parallel_pieces(op, dtype, threads):
    threads(2)
    check_step_matches_reference(_cpu(), op, BIG, dtype, MODES[3], calls=2, seed=7)


def _run_scenarios(cases):
    """Runs each (case, mode, op) once through the cpu backend (cadence over three calls for
    op='cadence'), returning every tensor, the counters and the steps afterwards."""
    out = []
    mod = _cpu()
    for case, mode, op in cases:
        counters = new_counters()
        steps = torch.zeros(len(case.params))
        calls = 3 if op == "cadence" else 1
        for _ in range(calls):
            call_step(mod, op, case, mode, step_hyper(mode), counters, steps=steps,
                      meta_every=2, check=True)
        out.append([*snapshot(case), counters.clone(), steps.clone()])
    return out


def _scenario_cases():
    cases = []
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float64)):
        for j, (mode, op) in enumerate(((MODES[0], "cadence"), (MODES[4], "meta"),
                                        (MODES[8], "inner_meta"), (MODES[7], "inner"))):
            cases.append((make_case(BIG, dtype, seed=10 * i + j), mode, op))
    # a non-finite gradient in a late piece: found by the check, nothing written
    poisoned = make_case(BIG, torch.bfloat16, seed=99)
    poisoned.grads[0].view(-1)[290_001] = float("nan")
    cases.append((poisoned, MODES[1], "inner_meta"))
    return cases


def _assert_same_bits(got, want, what):
    for k, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: case {k} tensor {i}"
            assert a.numel() == 0 or torch.equal(element_bytes(a), element_bytes(b)), \
                f"{what}: case {k} tensor {i} ({a.dtype}) differs"


def test_one_and_two_threads_give_the_same_bits(threads):
    cases = _scenario_cases()
    copies = [[(clone_case(c), m, o) for c, m, o in cases] for _ in range(2)]
    threads(1)
    one = _run_scenarios(copies[0])
    threads(2)
    two = _run_scenarios(copies[1])
    _assert_same_bits(two, one, "2 threads vs 1")
    assert counters_dict(one[-1][-2])["skipped"] == 1  # the poisoned case was skipped


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_big_passes_run_on_every_thread(threads, dtype):
    """A pass over more than a grain of elements is spread over torch's intra-op threads, and a
    small one stays on the calling thread: the extension shares torch's OpenMP threads
    (built with -fopenmp, [note: OpenMP] in setup.py; without it at::parallel_for silently
    runs everything on one thread)."""
    from emcl_kernels.backends import extension
    used = torch.ops.emcl.cpu_threads_used
    for n_threads in (2, 1):
        threads(n_threads)
        for sizes, expected in (((1 << 20, 33), n_threads), ((1000, 7), 1)):
            call = step_op_call("cpu", dtype, sizes=sizes, seed=3, check=False)
            extension.step(**call)
            assert used() == expected, ("update", n_threads, sizes, used())
            extension.check_finite(call["grads"], new_counters())
            assert used() == expected, ("check", n_threads, sizes, used())


@pytest.mark.parametrize("n_threads", (1, 2))
@pytest.mark.parametrize("n", (0, 1003, (1 << 20) + 5))
def test_stream_probes_compute_what_they_say(threads, n_threads, n):
    """torch.ops.emcl.stream_probe_, the benchmarks' memory probes ([note: stream probes]):
    kind 0 keeps a, kind 1 adds 1e-6·b to a, kind 2 (the update's pattern) adds 1e-6·b to a and
    c and keeps d, kind 5 (the same pattern without the software prefetch) too, kind 3 (the inner
    step's pattern) adds 1e-6·(b + c·d) to a alone, kind 4 (its reads alone) writes nothing; b is
    never written; kinds 6 and 7 the step's and the inner step's with bf16 a and b; sizes with a
    tail, empty, one and two threads; bad calls are refused."""
    threads(n_threads)
    gen = torch.Generator().manual_seed(n + 1)
    a, b, c, d = (torch.randn(n, generator=gen) for _ in range(4))
    a0, b0, c0, d0 = (t.clone() for t in (a, b, c, d))
    probe = torch.ops.emcl.stream_probe_
    probe(a, b, c, d, 0)
    assert torch.equal(a, a0)
    probe(a, b, c, d, 1)
    assert torch.allclose(a, a0 + 1e-6 * b0, rtol=1e-7, atol=0)
    assert torch.equal(c, c0) and torch.equal(d, d0)
    for kind in (2, 5):  # the update's pattern, with and without the software prefetch
        a1, c1 = a.clone(), c.clone()
        probe(a, b, c, d, kind)
        assert torch.allclose(a, a1 + 1e-6 * b0, rtol=1e-7, atol=0)
        assert torch.allclose(c, c1 + 1e-6 * b0, rtol=1e-7, atol=0)
        assert torch.equal(d, d0) and torch.equal(b, b0)
        if n:
            assert not torch.equal(a, a1) and not torch.equal(c, c1)
    a2, c2 = a.clone(), c.clone()
    probe(a, b, c, d, 4)
    assert torch.equal(a, a2) and torch.equal(c, c2) and torch.equal(d, d0)
    if n > (1 << 20):
        assert torch.ops.emcl.cpu_threads_used() == n_threads
    probe(a, b, c, d, 3)
    assert torch.allclose(a, a2 + 1e-6 * (b0 + c2 * d0), rtol=1e-7, atol=0)
    assert torch.equal(c, c2) and torch.equal(d, d0) and torch.equal(b, b0)
    if n:
        assert not torch.equal(a, a2)
    for kind in (-1, 8):
        with pytest.raises(RuntimeError, match="kind"):
            probe(a, b, c, d, kind)
    with pytest.raises(RuntimeError, match="fp32"):
        probe(a.double(), b.double(), c.double(), d.double(), 0)
    with pytest.raises(RuntimeError, match="bf16"):
        probe(a, b, c, d, 6)                        # kinds 6 and 7 want bf16 a and b
    # kinds 6 and 7: the bf16 steps' streams (θ, g bf16; θ₀, h fp32); a rounded to bf16 once
    ab, bb = a.bfloat16(), b.bfloat16()
    ab0, bb0, c3, d3 = ab.clone(), bb.clone(), c.clone(), d.clone()
    probe(ab, bb, c, d, 6)
    assert torch.allclose(ab.float(), (ab0.float() + 1e-6 * bb0.float()).bfloat16().float(),
                          rtol=2 ** -8, atol=0)
    assert torch.allclose(c, c3 + 1e-6 * bb0.float(), rtol=1e-7, atol=0)
    assert torch.equal(d, d3) and torch.equal(bb, bb0)
    if n:
        assert not torch.equal(c, c3)
    ab1, c4 = ab.clone(), c.clone()
    probe(ab, bb, c, d, 7)
    expected = (ab1.float() + 1e-6 * (bb0.float() + c4 * d3)).bfloat16().float()
    assert torch.allclose(ab.float(), expected, rtol=2 ** -8, atol=0)
    assert torch.equal(c, c4) and torch.equal(d, d3) and torch.equal(bb, bb0)
    with pytest.raises(RuntimeError, match="bf16"):
        probe(a, bb, c, d, 7)
    if n:
        with pytest.raises(RuntimeError, match="as many"):
            probe(a, b[:-1].contiguous(), c, d, 1)
        with pytest.raises(RuntimeError, match="different"):
            probe(a, b, c, a, 2)


def test_prefetch_knobs_change_no_bit(tmp_path, threads):
    """EMCL_CPU_PREFETCH_BYTES / EMCL_CPU_PREFETCH_WRITE ([note: prefetch knobs] in
    csrc/emcl_cpu_kernels.h) change only how far ahead and how memory is read: a subprocess
    prefetching 1 KiB ahead, and one prefetching 64 bytes ahead for writing, at 2 threads,
    compute the same bits as this process (the default: no software prefetch; 1 thread)."""
    cases = _scenario_cases()
    torch.save([(c.params, c.grads, c.anchors, c.importances, c.meta_lrs, m, o)
                for c, m, o in cases], tmp_path / "inputs.pt")
    code = textwrap.dedent("""
        import sys
        import torch
        import emcl_kernels.backends.extension
        from emcl_testing import Case
        import test_cpu_backend as t
        torch.set_num_threads(2)
        raw = torch.load(sys.argv[1], weights_only=False)
        cases = [(Case(*lists), m, o) for (*lists, m, o) in raw]
        torch.save(t._run_scenarios(cases), sys.argv[2])
        print("ok")
    """)
    threads(1)
    want = _run_scenarios(cases)
    for knobs in ({"EMCL_CPU_PREFETCH_BYTES": "1024"},
                  {"EMCL_CPU_PREFETCH_BYTES": "64", "EMCL_CPU_PREFETCH_WRITE": "1"}):
        env = {**os.environ, **knobs,
               "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "inputs.pt"),
                              str(tmp_path / "knobs.pt")], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]
        _assert_same_bits(torch.load(tmp_path / "knobs.pt", weights_only=False), want,
                          f"prefetch knobs {knobs} vs the default")


# The narrower copies of the CPU kernels than the one this CPU runs, each with the
# ATEN_CPU_CAPABILITY value that forces it in a subprocess.
_NARROWER = {"avx512": (("avx2", "avx2"), ("portable", "default")),
             "avx2": (("portable", "default"),), "portable": ()}
_NARROWER_CASES = [pytest.param(name, env, id=name)
                   for name, env in (("avx2", "avx2"), ("portable", "default"))]


def _skip_unless_narrower(name):
    mine = torch.ops.emcl.cpu_kernel()
    if name not in dict(_NARROWER[mine]):
        pytest.skip(f"this CPU runs the {mine} kernels: no {name} copy narrower than them")


@pytest.mark.parametrize("name,capability", _NARROWER_CASES)
def test_narrower_kernel_copies_give_the_same_bits(tmp_path, name, capability):
    """Each narrower copy of the CPU kernels (the portable one: what a CPU without AVX2 runs;
    the AVX2 one on an AVX-512 CPU; forced in a subprocess with torch's ATEN_CPU_CAPABILITY)
    computes the same bits as the copy this CPU runs, on the same inputs (made here and passed
    in a file: torch's own random kernels differ between the capabilities)."""
    _skip_unless_narrower(name)
    cases = _scenario_cases()
    torch.save([(c.params, c.grads, c.anchors, c.importances, c.meta_lrs, m, o)
                for c, m, o in cases], tmp_path / "inputs.pt")
    code = textwrap.dedent("""
        import sys
        import torch
        import emcl_kernels.backends.extension
        from emcl_testing import Case
        import test_cpu_backend as t
        assert torch.ops.emcl.cpu_kernel() == sys.argv[3], torch.ops.emcl.cpu_kernel()
        torch.set_num_threads(1)
        raw = torch.load(sys.argv[1], weights_only=False)
        cases = [(Case(*lists), m, o) for (*lists, m, o) in raw]
        torch.save(t._run_scenarios(cases), sys.argv[2])
        print("ok")
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability,
           "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "inputs.pt"),
                          str(tmp_path / "narrow.pt"), name], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]
    narrow = torch.load(tmp_path / "narrow.pt", weights_only=False)
    mine = _run_scenarios(cases)
    _assert_same_bits(mine, narrow, f"{torch.ops.emcl.cpu_kernel()} vs {name}")


# ---------------------------------------------------------------------------------------------
# The finite check finds one bad element wherever it is
# ---------------------------------------------------------------------------------------------

_CHECK_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _nonfinite_bit_patterns(dtype):
    """Every inf and NaN of a 16-bit float type, as raw int16 bits (exponent all ones)."""
    exponent_bits, mantissa_bits = {torch.bfloat16: (8, 7), torch.float16: (5, 10)}[dtype]
    exponent = ((1 << exponent_bits) - 1) << mantissa_bits
    words = [sign | exponent | m for sign in (0, 0x8000) for m in range(1 << mantissa_bits)]
    return [w - 0x10000 if w >= 0x8000 else w for w in words]


def _check_probe_results(threads):
    """(what, expected, found) of the CPU finite check on a tensor of 2**20 + 2**18 + 37
    elements (two check blocks and a tail) with one bad value at each multiple of 4096 and the
    element before it, counted from 0 and from where a second thread's share may start (the
    kernel reads a block as 8 interleaved streams, whose starts are such multiples), at the
    ends, and for bf16/fp16 every inf/NaN bit pattern; and on tensors of finite extremes."""
    torch.set_num_threads(threads)
    check = get_backend("cpu", torch.device("cpu")).check_finite
    n = (1 << 20) + (1 << 18) + 37
    starts = {0, n // 2 // 64 * 64, (n // 2 + 63) // 64 * 64, (n + 1) // 2}
    positions = {0, 1, n - 1, n - 2, n - 37, n - 38}
    for b in starts:
        positions |= {b + k + d for k in range(0, n, 4096) for d in (0, -1)}
    positions = sorted(p for p in positions if 0 <= p < n)
    results = []

    def found(grads):
        counters = new_counters()
        check(grads, counters)
        return counters_dict(counters)["found"]

    gen = torch.Generator().manual_seed(11)
    for dtype in _CHECK_DTYPES:
        g = torch.randn(n, generator=gen).to(dtype)
        results.append((f"{dtype} random finite", 0, found([g])))
        info = torch.finfo(dtype)
        extremes = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, info.smallest_normal
                                 / 4, -0.0, 0.0, 1.0], dtype=dtype).repeat(4099)
        results.append((f"{dtype} finite extremes", 0, found([extremes])))
        missed = []
        for i, p in enumerate(positions):
            g[p] = (float("nan"), float("inf"), -float("inf"))[i % 3]
            if found([g]) != 1:
                missed.append(p)
            g[p] = 0.5
        results.append((f"{dtype} one bad value at each of {len(positions)} positions, missed",
                        [], missed))
        # the same tensor second in a call, after a small finite one
        g[n - 1] = float("nan")
        results.append((f"{dtype} bad value in the second tensor", 1,
                        found([torch.ones(5, dtype=dtype), g])))
        g[n - 1] = 0.5
        if dtype in (torch.bfloat16, torch.float16):
            words = torch.ones(4096 + 3, dtype=dtype).view(torch.int16)
            missed = []
            for w in _nonfinite_bit_patterns(dtype):
                words[2048 + 5] = w
                if found([words.view(dtype)]) != 1:
                    missed.append(hex(w & 0xFFFF))
            results.append((f"{dtype} inf/NaN bit patterns missed", [], missed))
    return results


def _assert_check_probes(results, label):
    wrong = [(what, expected, got) for what, expected, got in results if got != expected]
    assert not wrong, f"{label}: {wrong[:6]}"


@pytest.mark.parametrize("n_threads", (1, 2))
def test_check_finite_finds_one_bad_value_anywhere(threads, n_threads):
    threads(n_threads)  # the fixture puts the count back
    _assert_check_probes(_check_probe_results(n_threads), f"{n_threads} thread(s)")


@pytest.mark.parametrize("name,capability", _NARROWER_CASES)
def test_narrower_check_finite_finds_one_bad_value_anywhere(name, capability):
    """The same probes on each narrower copy of the kernels (forced with
    ATEN_CPU_CAPABILITY)."""
    _skip_unless_narrower(name)
    code = textwrap.dedent("""
        import sys
        import torch
        import emcl_kernels.backends.extension
        import test_cpu_backend as t
        assert torch.ops.emcl.cpu_kernel() == sys.argv[1], torch.ops.emcl.cpu_kernel()
        wrong = [r for r in t._check_probe_results(1) if r[1] != r[2]]
        print("wrong:", wrong[:6])
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability,
           "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "wrong: []" in out.stdout, (out.stdout + out.stderr)[-4000:]


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

def test_step_traces_under_torch_compile():
    """The fake implementations let torch.compile trace the backend's step as one graph (no
    breaks: it calls torch.ops.emcl.step_ while compiling), and the compiled step writes what
    the eager one writes: tensors, counters, steps."""
    from emcl_kernels.backends import extension
    eager = step_op_call("cpu", sizes=(33, 7), seed=4)
    compiled = step_op_call("cpu", sizes=(33, 7), seed=4)

    def step(call):
        extension.step(**call)

    torch._dynamo.reset()
    run = torch.compile(step, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        run(compiled)
        step(eager)
    for i, (a, e) in enumerate(zip(call_tensors(compiled), call_tensors(eager))):
        assert torch.equal(a, e), f"compiled step differs from eager on tensor {i}"
    assert counters_dict(compiled["counters"])["calls"] == 3


def test_direct_entry_points_refuse_malformed_arguments():
    """emcl_kernels._C.step/check_finite take the schema's arguments by position (the last,
    runs, may be left out); anything else is a TypeError naming the argument, before the
    operator runs."""
    from emcl_kernels import _C
    call = step_op_call("cpu")
    args = [call[k] for k in ("params", "grads", "anchors", "importances", "meta_lrs", "steps",
                              "hyper", "counters", "op", "prox", "importance", "lr_mode",
                              "meta_every", "check", "finalize", "grad_scale", "found_inf")]
    args.append(1)  # runs
    tensors = call_tensors(call)
    before = bitwise_snapshot(tensors)
    with pytest.raises(TypeError, match="18 arguments"):
        _C.step(*args[:-2])
    with pytest.raises(TypeError, match="18 arguments"):
        _C.step(*args, 1)
    for i, bad, match in ((0, call["params"][0], "params must be a list"),
                          (1, [call["grads"][0], 3.0], r"grads\[1\] must be a tensor"),
                          (6, [call["hyper"]], "hyper must be a tensor"),
                          (8, 3.0, "op must be an int"), (8, True, "op must be an int"),
                          (9, 1, "prox must be a bool"), (15, 8.0, "grad_scale must be a tensor"),
                          (17, 1.0, "runs must be an int")):
        with pytest.raises(TypeError, match=match):
            _C.step(*args[:i], bad, *args[i + 1:])
    with pytest.raises(TypeError, match="grads, counters"):
        _C.check_finite(call["grads"])
    with pytest.raises(TypeError, match="runs must be an int"):
        _C.check_finite(call["grads"], call["counters"], "1")
    assert_bitwise_unchanged(tensors, before, "malformed direct calls")
    _C.step(*args)
    assert counters_dict(call["counters"])["calls"] == 1
    _C.step(*args[:-1])  # runs left out: 1
    assert counters_dict(call["counters"])["calls"] == 2


def test_check_skip_in_one_call_writes_nothing_but_the_counters():
    mode = MODES[0]
    case = make_case(BIG, torch.float32, seed=21)
    case.grads[1].view(-1)[-1] = float("-inf")
    before = snapshot(case)
    counters, steps = new_counters(calls=1), torch.zeros(3)
    call_step(_cpu(), "cadence", case, mode, step_hyper(mode), counters, steps=steps,
              meta_every=2, check=True)
    assert_unchanged(case, before, "skipped call")
    assert counters_dict(counters) == dict(found=0, calls=2, skipped=1, done=0)
    assert not steps.any()
