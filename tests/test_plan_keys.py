"""The world changing under the optimizer's plans between steps: every change is either
taken at the next step (the plans are rebuilt, and each backend then matches the reference step
by step) or refused, naming the parameter, before anything is written. Cases that once crashed
the process run in a child process."""
import os
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest
import torch

_SET = "TRITON_INTERPRET" not in os.environ
if _SET and not torch.cuda.is_available():  # the Triton kernels interpreted on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"
try:
    from reliability_support import (BACKEND_DEVICES, assert_optimizer_unchanged,  # noqa: E402
                                     optimizer_snapshot)
    try:
        import emcl_kernels.backends.triton  # noqa: F401,E402  (decides interpreted or not)
    except Exception:  # noqa: BLE001 - no Triton: the other backends are still tested
        pass
    from emcl_kernels.backends import BackendUnavailableError, get_backend  # noqa: E402
    BACKENDS = [b for b, d in BACKEND_DEVICES if d == "cpu"]
    try:
        get_backend("triton", torch.device("cpu"))
        BACKENDS = list(dict.fromkeys(BACKENDS + ["triton"]))
    except (BackendUnavailableError, ValueError):
        pass
finally:
    if _SET:  # the other test files decide for themselves
        os.environ.pop("TRITON_INTERPRET", None)

from emcl_kernels import FusedEMCLOptimizer  # noqa: E402
from emcl_kernels import functional as F  # noqa: E402
from emcl_kernels import validation  # noqa: E402
from emcl_testing import child_env  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_triton(monkeypatch):
    """Triton's interpreter reads TRITON_INTERPRET at every launch (see the imports above)."""
    if _SET and "triton" in BACKENDS:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, params=["native", "python"])
def key_path(request, monkeypatch):
    """Every case with the key's C++ passes (``_C.plan_grads``, ``identical``, ``items_are``)
    and with the Python passes alone, as without the extension: both must decide alike."""
    from emcl_kernels import plan
    if request.param == "python":
        monkeypatch.setattr(plan, "_plan_grads", None)
        monkeypatch.setattr(plan, "_identical", plan._py_identical)
        monkeypatch.setattr(plan, "_items_are", plan._py_items_are)
    elif plan._plan_grads is None:
        pytest.skip("the extension is not built: the Python passes are the only ones")
    return request.param


HP = dict(meta_lr=0.3, inner_lr=0.05, reg=2.0, gamma=0.4, decay=0.7, lr_scale=0.5,
          lr_mode="recurrent", lr_max=0.8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.5).to(p.dtype)
        if p.is_contiguous(memory_format=torch.channels_last) and p.dim() == 4 \
                and not p.is_contiguous():
            p.grad = p.grad.contiguous(memory_format=torch.channels_last)


def _pair(shapes, backend, **kw):
    """Two optimizers on equal parameters: ``backend`` and the reference."""
    a, b = _params(shapes), _params(shapes)
    return (a, FusedEMCLOptimizer(a, backend=backend, meta_every=2, **{**HP, **kw}),
            b, FusedEMCLOptimizer(b, backend="reference", meta_every=2, **{**HP, **kw}))


def _both(a, oa, b, ob, seed):
    _grads(a, seed)
    _grads(b, seed)
    oa.step()
    ob.step()


def _assert_match(a, oa, b, ob, tol=1e-5):
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), rtol=tol, atol=tol,
                                   msg=lambda m: f"param {i}: {m}")
        sx, sy = oa.state.get(x, {}), ob.state.get(y, {})
        assert set(sx) == set(sy), f"state keys of param {i}"
        for k in sx:
            torch.testing.assert_close(sx[k].float(), sy[k].float(), rtol=tol, atol=tol,
                                       msg=lambda m: f"state {k} of param {i}: {m}")


def _refused(opt, fn, exc, match):
    before = optimizer_snapshot(opt)
    with pytest.raises(exc, match=match):
        fn()
    assert_optimizer_unchanged(before, opt)


def _child(code: str, backend: str) -> subprocess.CompletedProcess:
    env = child_env(os.path.join(ROOT, "tests"))
    if backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    prog = "import torch\nfrom emcl_kernels import FusedEMCLOptimizer\n" \
        + f"BACKEND = {backend!r}\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                          text=True, timeout=600)


# 1, 8: a parameter's memory replaced by a bigger, smaller or reshaped tensor after its state
@pytest.mark.parametrize("backend", BACKENDS)
def test_param_data_resized_after_state_is_refused_in_a_child(backend):
    r = _child("""
        from reliability_support import optimizer_snapshot, assert_optimizer_unchanged
        for new in ((64, 4), (2, 4), (16,), (2, 8)):
            a = torch.nn.Parameter(torch.randn(4, 4))
            opt = FusedEMCLOptimizer([a], backend=BACKEND, meta_every=1)
            a.grad = torch.randn(4, 4)
            opt.step()
            a.data = torch.randn(new) if new != (16,) and new != (2, 8) else a.data.reshape(new)
            a.grad = torch.randn(new)
            before = optimizer_snapshot(opt)
            try:
                opt.step()
            except RuntimeError as exc:
                assert "parameter 0 of param group 0 has shape" in str(exc), str(exc)
            else:
                raise AssertionError(f"{new}: accepted")
            assert_optimizer_unchanged(before, opt)
        print("OK")
    """, backend)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


# 2, 10, 11: memory format changed after the state exists, in one group of two
@pytest.mark.parametrize("backend", BACKENDS)
def test_channels_last_after_state_matches_reference(backend):
    shapes = [(4, 3, 3, 3), (5,)]
    a, b = _params(shapes), _params(shapes)
    oa = FusedEMCLOptimizer([{"params": [a[1]]}, {"params": [a[0]]}], backend=backend,
                            meta_every=2, **HP)
    ob = FusedEMCLOptimizer([{"params": [b[1]]}, {"params": [b[0]]}], backend="reference",
                            meta_every=2, **HP)
    for s in range(3):
        _both(a, oa, b, ob, s)
    a[0].data = a[0].data.contiguous(memory_format=torch.channels_last)
    for s in range(3, 8):
        _both(a, oa, b, ob, s)
        assert a[0].grad.is_contiguous(memory_format=torch.channels_last)
        _assert_match(a, oa, b, ob)
    assert oa.state[a[0]]["anchor"].is_contiguous(memory_format=torch.channels_last)


# 3: hyper-parameters changed between compiled calls
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("foreach", "cpu")])
@pytest.mark.parametrize("how", ("tensor_in_place", "tensor_rebound", "float_rebound",
                                 "capturable_in_place", "capturable_rebound"))
def test_hyperparameter_changed_under_compile_equals_eager(backend, how):
    """A schedule on ``inner_lr`` (and ``meta_lr``) between calls of a compiled step gives the
    eager result at every step: the graph reads the group's values, not a ``hyper`` tensor
    that only the eager code refreshes. Eager steps that follow take in-place changes too."""
    results = []
    capturable = how.startswith("capturable")
    for compiled in (False, True):
        shapes = [(6, 5), (6,)]
        ps = _params(shapes)
        lr = torch.tensor(0.05, dtype=torch.float64) if how.startswith("tensor") else 0.05
        opt = FusedEMCLOptimizer(ps, backend=backend, meta_every=3, capturable=capturable,
                                 **{**HP, "inner_lr": lr})
        step = opt.step
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
        trace = []
        for s in range(10):
            group = opt.param_groups[0]
            inner, meta = 0.05 / (1 + s), 0.3 + 0.05 * s
            if s >= 7:  # eager steps after compiled ones, values changed in place where they
                step = opt.step  # are tensors (a capturable group's are views again)
                for k, v in (("lr", inner), ("meta_lr", meta)):
                    if isinstance(group[k], torch.Tensor):
                        group[k].fill_(v)
                    else:
                        group[k] = v
            elif how in ("tensor_in_place", "capturable_in_place"):
                group["lr"].fill_(inner)
            elif how == "tensor_rebound":
                group["lr"] = torch.tensor(inner, dtype=torch.float64)
            else:
                group["lr"] = inner
            if how == "capturable_in_place":
                group["meta_lr"].fill_(meta)
            elif how == "capturable_rebound":
                group["meta_lr"] = torch.tensor(meta, dtype=torch.float64)
            _grads(ps, s)
            step()
            trace.append([p.detach().clone() for p in ps]
                         + [opt.state[p][k].clone() for p in ps for k in ("anchor", "meta_lr")])
        results.append(trace)
    for s, (eager, comp) in enumerate(zip(*results)):
        for i, (x, y) in enumerate(zip(eager, comp)):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"step {s}, tensor {i}: {m}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("foreach", "cpu")])
def test_capturable_value_rebound_before_a_trace_is_read_by_later_eager_steps(backend):
    """A capturable group's value rebound to a tensor of the user's, then traced: Dynamo's
    trace leaves the group as it is, and the next eager step makes it a view of the storage
    again, so an in-place change after that trace is taken."""
    a, oa, b, ob = _pair([(6, 5), (6,)], backend, capturable=True)
    _both(a, oa, b, ob, 0)
    mine = torch.tensor(0.02, dtype=torch.float64)
    oa.param_groups[0]["lr"] = mine
    ob.param_groups[0]["lr"] = 0.02
    torch._dynamo.reset()
    _grads(a, 1)
    _grads(b, 1)
    torch.compile(oa.step, backend="aot_eager", fullgraph=True)()
    ob.step()
    _assert_match(a, oa, b, ob)
    mine.fill_(0.01)
    ob.param_groups[0]["lr"] = 0.01
    for s in range(2, 5):
        _both(a, oa, b, ob, s)
        _assert_match(a, oa, b, ob)
    assert float(oa.param_groups[0]["lr"]) == 0.01


# 4: capturable=True, a hyper-parameter rebound to a number after steps
@pytest.mark.parametrize("backend", BACKENDS)
def test_capturable_hyperparameter_rebound_to_a_number_is_taken(backend):
    a, oa, b, ob = _pair([(7,), (3, 2)], backend, capturable=True)
    for s in range(3):
        _both(a, oa, b, ob, s)
    oa.param_groups[0]["lr"] = 0.01
    ob.param_groups[0]["lr"] = 0.01
    oa.param_groups[0]["meta_lr"] = torch.tensor(0.2, dtype=torch.float64)
    ob.param_groups[0]["meta_lr"] = torch.tensor(0.2, dtype=torch.float64)
    for s in range(3, 7):
        _both(a, oa, b, ob, s)
        _assert_match(a, oa, b, ob)
    assert float(oa.param_groups[0]["lr"]) == 0.01


# 5: the group's parameter list edited by hand
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit", ("append", "remove", "rebind"))
def test_param_list_edited_between_steps_is_followed(backend, edit):
    shapes = [(5,), (2, 3), (4,)]
    a, b = _params(shapes), _params(shapes)
    oa = FusedEMCLOptimizer(a[:2], backend=backend, meta_every=2, **HP)
    ob = FusedEMCLOptimizer(b[:2], backend="reference", meta_every=2, **HP)
    for s in range(3):
        _both(a, oa, b, ob, s)
    for params, opt in ((a, oa), (b, ob)):
        group = opt.param_groups[0]
        if edit == "append":
            group["params"].append(params[2])
        elif edit == "remove":
            group["params"].remove(params[0])
        else:
            group["params"] = [params[2], params[1]]
    before = [p.detach().clone() for p in a]
    for s in range(3, 7):
        _both(a, oa, b, ob, s)
        _assert_match(a, oa, b, ob)
    listed = {id(p) for p in oa.param_groups[0]["params"]}
    for p, was in zip(a, before):
        assert (id(p) in listed) == (not torch.equal(p.detach(), was)), "stepped iff listed"


# 6: the state reset by hand (a task boundary)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reset", ("clear", "rebind", "del"))
def test_state_reset_makes_new_state_and_is_saved(backend, reset):
    a = _params([(5,), (3, 2)])
    opt = FusedEMCLOptimizer(a, backend=backend, **HP)
    for s in range(3):
        _grads(a, s)
        opt.inner_step()
        opt.meta_step()
    if reset == "clear":
        opt.state.clear()
    elif reset == "rebind":
        opt.state = defaultdict(dict)
    else:
        del opt.state[a[0]]
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fresh = FusedEMCLOptimizer(fresh_params, backend="reference", **HP)
    reset_all = reset != "del"
    for s in range(3, 5):
        _grads(a, s)
        _grads(fresh_params, s)
        opt.inner_step()
        opt.meta_step()
        fresh.inner_step()
        fresh.meta_step()
    for i in (range(2) if reset_all else range(1)):
        torch.testing.assert_close(a[i].detach(), fresh_params[i].detach(), rtol=1e-5, atol=1e-6)
        st = opt.state[a[i]]
        torch.testing.assert_close(st["anchor"], fresh.state[fresh_params[i]]["anchor"],
                                   rtol=1e-5, atol=1e-6)
        assert float(st["step"]) == 2.0
    saved = opt.state_dict()["state"]
    assert set(saved) == {0, 1} and float(saved[0]["step"]) == 2.0


# 7: model.half() / .float() after the state exists
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_changed_after_state_keeps_every_meta_step(backend):
    a, oa, b, ob = _pair([(6,), (2, 5)], backend)
    for s in range(4):
        _both(a, oa, b, ob, s)
    for p in a + b:
        p.data = p.data.half()
    for s in range(4, 6):
        _both(a, oa, b, ob, s)
        _assert_match(a, oa, b, ob, tol=5e-3)
    for p in a + b:
        p.data = p.data.float()
    for s in range(6, 8):
        _both(a, oa, b, ob, s)
        _assert_match(a, oa, b, ob, tol=5e-3)
    assert [float(oa.state[p]["step"]) for p in a] == [4.0, 4.0]


# 9: aliasing made after the first step
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alias", ("tied_weights", "grad_is_param", "grad_is_anchor"))
def test_aliasing_made_after_the_first_step_is_refused(backend, alias):
    a = _params([(4, 3), (4, 3)])
    opt = FusedEMCLOptimizer(a, backend=backend, meta_every=1, **HP)
    _grads(a, 0)
    opt.step()
    _grads(a, 1)
    if alias == "tied_weights":
        a[1].data = a[0].data
    elif alias == "grad_is_param":
        a[1].grad = a[1].data
    else:
        a[0].grad = opt.state[a[1]]["anchor"]
    _refused(opt, opt.step, ValueError, "same memory|overlap")


# a schedule: numbers of a group moved between steps, as LR schedulers and trainers do
@pytest.mark.parametrize("backend", BACKENDS)
def test_numbers_moved_between_steps_are_checked_and_taken_without_a_rebuild(backend,
                                                                             monkeypatch):
    """[note: a schedule's step] in plan.py: plain numbers that change between steps are each
    checked (domain and products) and written into the plans' ``hyper``; the plans are not
    rebuilt and the group is not checked whole. The steps match the reference's, and a bad
    number is refused, naming it, before anything is written."""
    from emcl_kernels import plan as P
    shapes = [(5,), (4, 3)]
    a, oa, b, ob = _pair(shapes, backend)
    _both(a, oa, b, ob, 0)
    _both(a, oa, b, ob, 1)
    plans = oa._runtime.plans
    whole = []
    real = P.check_group
    monkeypatch.setattr(P, "check_group", lambda *x, **k: whole.append(1) or real(*x, **k))
    moves = [{"lr": 0.04}, {"lr": 0.03, "meta_lr": 0.25}, {"gamma": 0.5, "decay": 0.6},
             {"reg": 3, "meta_lr_scale": 0.4}, {"lr_max": 0.7, "eps": 1e-7, "lr": 0.02}]
    for seed, move in enumerate(moves, start=2):
        for opt in (oa, ob):
            opt.param_groups[0].update(move)
        _both(a, oa, b, ob, seed)
        _assert_match(a, oa, b, ob)
        assert oa._runtime.plans is plans                    # not rebuilt
    assert whole == []                                       # nor the group checked whole
    group = oa.param_groups[0]
    for key, value, match in (("lr", -0.1, "lr"), ("decay", 1.5, "decay"),
                              ("lr", float("nan"), "lr"), ("gamma", 2e38, "past the largest")):
        good = group[key]
        group[key] = value
        _grads(a, 9)
        _refused(oa, oa.step, ValueError, match)
        group[key] = good
    _both(a, oa, b, ob, 10)                                  # taken again once it is good
    _assert_match(a, oa, b, ob)
    for opt in (oa, ob):                                     # a mode with a number: rebuilt
        opt.param_groups[0].update(lr=0.05, lr_mode="inverse")
    _both(a, oa, b, ob, 11)
    _assert_match(a, oa, b, ob)
    assert oa._runtime.plans is not plans


# 10: a shape change in the second group refuses before the first group is written
@pytest.mark.parametrize("backend", BACKENDS)
def test_refusal_in_one_group_writes_no_other_group(backend):
    a = _params([(5,), (4, 4)])
    opt = FusedEMCLOptimizer([{"params": [a[0]]}, {"params": [a[1]]}], backend=backend, **HP)
    _grads(a, 0)
    opt.step()
    a[1].data = torch.randn(3, 4)
    _grads(a, 1)
    _refused(opt, opt.step, RuntimeError, "parameter 0 of param group 1 has shape")


# the Triton launcher checks its call's tensors itself: with the extension's check_step_call
# where it is built, else in Python ([note: launcher checks])
@pytest.mark.parametrize("backend, checker", [(b, c) for b in BACKENDS if b in ("triton", "cpu")
                                              for c in (("native", "python") if b == "triton"
                                                        else ("native",))])
@pytest.mark.parametrize("bad", ("grad_numel", "anchor_strides", "importance_dtype",
                                 "anchor_overlaps_itself"))
def test_native_backend_refuses_a_call_that_does_not_fit(backend, checker, bad, monkeypatch):
    from emcl_kernels.interface import OP
    from emcl_kernels.plan import new_counters, pack_hyper
    mod = get_backend(backend, torch.device("cpu"))
    if backend == "triton":
        if checker == "native" and mod._NATIVE_CHECK is None:
            pytest.skip("the extension (its check_step_call) is not built")
        if checker == "python":
            monkeypatch.setattr(mod, "_NATIVE_CHECK", None)
    p = torch.randn(4, 4)
    g, anchor, imp = torch.randn(4, 4), p.clone(), torch.rand(4, 4)
    if bad == "grad_numel":
        g = torch.randn(64, 4)
    elif bad == "anchor_strides":
        anchor = anchor.t().contiguous().t()
    elif bad == "anchor_overlaps_itself":  # p's strides and numel, 12 elements of memory
        anchor = p.flatten()[:12].clone().as_strided((2, 8), (4, 1))
    else:
        imp = imp.double()
    before = [t.clone() for t in (p, g, anchor, imp)]
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        mod.step([p], [g], [anchor], [imp], [], torch.zeros(1), pack_hyper(
            validation.check_hyperparameters(**{k: v for k, v in HP.items()
                                                if k != "lr_mode"}), "cpu"),
            new_counters("cpu"), op=OP["inner_meta"], prox=True, importance=0, lr_mode=1,
            meta_every=1, check=True, finalize=True)
    for x, y in zip(before, (p, g, anchor, imp)):
        assert torch.equal(x, y)


# 12: one functional call with the same plain arguments validates once
def test_functional_validates_the_same_hyperparameters_once(monkeypatch):
    calls = []
    real = validation._number
    monkeypatch.setattr(validation, "_number", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(validation, "_CHECKED", {})   # as in a fresh process
    p, g = [torch.randn(3)], [torch.randn(3)]
    anchors, imps = [p[0].clone()], [torch.zeros(3)]
    kw = dict(inner_lr=0.0123, reg=1.25, gamma=0.375, backend="reference")
    F.inner_step_(p, g, anchors, imps, **kw)
    first = len(calls)
    F.inner_step_(p, g, anchors, imps, **kw)
    assert first > 0 and len(calls) == first


@pytest.mark.parametrize("n", (3, 200), ids=("python-loop", "arrays"))
def test_the_overlap_check_agrees_with_comparing_every_pair(n):
    """plan.spans_apart (a step's gradients against each other and the planned tensors' memory)
    against the definition, on random layouts that overlap sometimes, empty tensors included."""
    import random

    from emcl_kernels.plan import Spans, spans_apart
    rng = random.Random(n)

    def overlap(a, b):
        return a[1] > a[0] and b[1] > b[0] and a[0] < b[1] and b[0] < a[1]

    verdicts = set()
    for trial in range(300):
        planned, at = [], 0
        for _ in range(rng.randrange(0, 6)):            # apart from each other, as validated
            at += rng.randrange(0, 64)
            size = rng.randrange(0, 64)
            planned.append((at, at + size))
            at += size
        rng.shuffle(planned)
        spread = rng.choice((4 * n * 16, 100 * n * n * 40)) + at  # crowded or sparse
        starts = [rng.randrange(0, spread) for _ in range(n)]
        sizes = [rng.choice((0, 1, 8, 16, 40)) for _ in range(n)]
        grads = [(s, s + z) for s, z in zip(starts, sizes)]
        expected = not any(overlap(grads[i], grads[j]) for i in range(n) for j in range(i))
        expected = expected and not any(overlap(g, p) for g in grads for p in planned)
        spans = Spans([a for a, _ in planned], [b for _, b in planned]) if planned else None
        got = spans_apart(starts, sizes, spans)
        assert got == expected, (trial, grads, planned)
        verdicts.add(got)
    assert verdicts == {True, False}                     # both answers were exercised
    # gradients apart from each other, one of them over a planned tensor's first, middle or
    # last byte, or just outside it
    starts, sizes = [1000 * k for k in range(n)], [16] * n
    planned = Spans([500, 100_000_000], [600, 100_000_100])
    assert spans_apart(starts, sizes, planned)
    for at, apart in ((500 - 16, True), (500 - 15, False), (550, False), (599, False), (600, True)):
        assert spans_apart(starts + [at], sizes + [16], planned) is apart, at


# ---------------------------------------------------------------------------------------------
# The key's C++ passes on their own
# ---------------------------------------------------------------------------------------------

def _native_or_skip(key_path):
    from emcl_kernels import plan
    if key_path != "native":
        pytest.skip("the C++ passes themselves")
    return plan


def test_plan_grads_accepts_only_an_exact_match(key_path):
    """``_C.plan_grads`` returns the very gradient objects and their addresses when every
    parameter and gradient is what the key records, and None (the Python passes decide) on any
    difference: memory, a reshaped view of the same memory, the plan's dtype, a missing
    gradient, or a gradient of other strides or layout."""
    plan = _native_or_skip(key_path)
    params = _params([(3, 5), (7,), ()])
    _grads(params, 0)
    opt = FusedEMCLOptimizer(params, backend="reference", meta_every=2, **HP)
    opt.step()
    built = opt._runtime.plans[0]
    key, like = plan.native_key(built)
    got = plan._plan_grads(built.sources, key, like)
    assert got is not None and all(g is p.grad for g, p in zip(got[0], params))
    assert got[1] == [p.grad.data_ptr() for p in params]

    def refused(change):
        saved = [(p.data, p.grad) for p in params]
        change()
        try:
            return plan._plan_grads(built.sources, key, like) is None
        finally:
            for p, (d, g) in zip(params, saved):
                p.data, p.grad = d, g

    a = params[0]
    assert refused(lambda: setattr(a, "data", a.data.clone()))
    assert refused(lambda: setattr(a, "data", a.data.view(5, 3)))
    assert refused(lambda: setattr(a, "grad", None))
    assert refused(lambda: setattr(a, "grad", torch.randn(5, 3).t()))        # strides
    assert refused(lambda: setattr(a, "grad", torch.randn(3, 5).to_sparse()))
    assert plan._plan_grads(built.sources[:2], key, like) is None          # key longer
    assert plan._plan_grads(built.sources, key[:-1].clone(), like) is None
    assert plan._plan_grads(built.sources, key, like.double()) is None
    with pytest.raises(TypeError, match="sources must be a list"):
        plan._plan_grads(tuple(built.sources), key, like)
    with pytest.raises(ValueError, match="int64 CPU tensor"):
        plan._plan_grads(built.sources, key.int(), like)


def test_identity_passes(key_path):
    plan = _native_or_skip(key_path)
    a, b = object(), object()
    from emcl_kernels.backends.extension import entry_point
    for identical in (entry_point("identical"), plan._py_identical):
        assert identical([a, b], [a, b]) and identical([], [])
        assert not identical([a, b], [b, a]) and not identical([a], [a, b])
        assert not identical([[1]], [[1]])          # equal is not identical
    for items_are in (entry_point("items_are"), plan._py_items_are):
        assert items_are([{"anchor": a}, {"anchor": b}], "anchor", [a, b])
        assert not items_are([{"anchor": a}, {}], "anchor", [a, b])
        assert not items_are([{"anchor": a}], "anchor", [a, b])
        assert items_are([{}], "anchor", [None])    # dict.get's None, as in Python
