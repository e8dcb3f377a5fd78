"""Capturable mode and CUDA graphs.

On the CPU (everywhere): hyper-parameters given as 0-d tensors give the float result in every
backend that runs here; ``capturable=True`` (tensor hyper-parameters, device step counts,
meta_every chosen on the device) gives the result of the default mode; tensor
hyper-parameters are validated. On a GPU (skipped without one): a whole training iteration
(forward, backward, ``opt.step()`` with meta_every) is captured in a CUDA graph and replayed
with new data and new hyper-parameter values, and equals eager training.
"""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from emcl_kernels import FusedEMCLOptimizer, available_backends
from emcl_kernels import functional as F
from emcl_kernels.interface import HYPER_FIELDS
from emcl_testing import MODES, OPS, apply, assert_case_close, clone_case, fresh_grads, make_case

CPU_BACKENDS = [b for b in available_backends() if b not in ("cuda", "triton")]
CUDA = torch.cuda.is_available()
NUMERIC = ("inner_lr", "meta_lr", "reg", "gamma", "decay", "lr_scale", "lr_min", "lr_max", "eps")


def _as_tensors(hyper):
    return {k: (torch.tensor(float(v)) if k in NUMERIC else v) for k, v in hyper.items()}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES[:6], ids=lambda m: m.id)
@pytest.mark.parametrize("op", OPS)
def test_tensor_hyperparameters_equal_floats(backend, op, mode):
    hyper = mode.hyper(op)
    case = make_case([1, 7, 301], torch.float32, seed=21)
    floats = clone_case(case)
    for step in range(3):
        apply(op, backend, case, _as_tensors(hyper))
        apply(op, backend, floats, hyper)
        assert_case_close(case, floats, torch.float32, f"{backend} {op} {mode.id} step {step}",
                          with_meta_lrs=mode.lr_mode == "recurrent" and op != "inner_step")
        case.grads = floats.grads = fresh_grads(case, seed=step)


@pytest.mark.parametrize("bad, error, match", [
    (torch.tensor(-0.1), ValueError, r"(inner_lr|lr \(β, the inner learning rate\)) must be in"),
    (torch.tensor(float("nan")), ValueError,
     r"(inner_lr|lr \(β, the inner learning rate\)) must be finite"),
    (torch.tensor([0.1, 0.2]), TypeError, "0-d floating-point tensor"),
    (torch.tensor([0.1]), TypeError, "0-d floating-point tensor"),  # one element, but 1-d
    (torch.tensor(1), TypeError, "0-d floating-point tensor"),
    (torch.tensor(0.1, requires_grad=True), ValueError, "must not require grad"),
])
def test_tensor_hyperparameters_are_checked(bad, error, match):
    case = make_case([5], torch.float32, seed=3)
    before = clone_case(case)
    with pytest.raises(error, match=match):
        F.inner_step_(case.params, case.grads, case.anchors, case.importances, inner_lr=bad,
                      reg=1.0, gamma=0.1, backend="foreach")
    assert torch.equal(case.params[0], before.params[0])
    with pytest.raises(error, match=match):
        FusedEMCLOptimizer([torch.nn.Parameter(torch.randn(3))], inner_lr=bad)


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 2)).to(device)


def _batches(n, device="cpu"):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, 6, generator=g)
    return x.to(device), torch.cos(x[..., :2]).to(device)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("lr_mode", ("recurrent", "inverse", "constant"))
def test_capturable_mode_equals_default_mode(backend, lr_mode):
    """capturable=True: tensor hyper-parameters, step counts on the device, and step() choosing
    the fused meta step on the device (both computed, one selected) == the default mode."""
    xs, ys = _batches(10)
    runs = []
    for capturable in (False, True):
        model = _model()
        opt = FusedEMCLOptimizer(model.parameters(), meta_lr=0.3, inner_lr=0.05, reg=2.0,
                                 lr_mode=lr_mode, lr_max=0.5, meta_every=3,
                                 capturable=capturable, backend=backend)
        for x, y in zip(xs, ys):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    (m0, o0), (m1, o1) = runs
    group = o1.param_groups[0]
    assert all(torch.is_tensor(group[k]) for k in ("lr", "meta_lr", "reg", "eps"))
    assert group["meta_lr_scale"] is None  # None stays None: 1 / reg is computed on the device
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7)
        for key, value in o0.state[p0].items():
            torch.testing.assert_close(o1.state[p1][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert o1.state_dict()["emcl"]["step_calls"] == 10


def test_capturable_state_dict_round_trip():
    model = _model()
    opt = FusedEMCLOptimizer(model.parameters(), meta_every=2, capturable=True,
                             lr_mode="recurrent", backend="foreach")
    xs, ys = _batches(5)
    for x, y in zip(xs[:3], ys[:3]):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model2 = copy.deepcopy(model)
    opt2 = FusedEMCLOptimizer(model2.parameters(), meta_every=2, capturable=True,
                              lr_mode="recurrent", backend="foreach")
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o in ((model, opt), (model2, opt2)):
        for x, y in zip(xs[3:], ys[3:]):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["step"], opt2.state[q]["step"])


class _HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host (``.item()``, ``bool(t)``,
    ``float(t)``) or makes a tensor from a host value (``t[i] = 0``, ``torch.tensor(x)``):
    on a GPU the first is a host sync and the second a copy from pageable memory, and a CUDA
    graph capture refuses both."""

    HOST = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
            torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.HOST:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "reference"])
@pytest.mark.parametrize("lr_mode", ("recurrent", "inverse", "constant"))
@pytest.mark.parametrize("prox", (True, False))
def test_a_capturable_step_reads_no_value_on_the_host(backend, lr_mode, prox, monkeypatch):
    """After its first step (which builds the plan), the backend's work in a step() of
    capturable=True, taken as if a CUDA graph were being captured, reads no tensor's value on
    the host and makes no tensor from a host value: the hyper-parameters, the cadence and the
    skip flag stay on the device (the reference backend, the oracle, reads them on the host and
    is not capturable). The optimizer's own bookkeeping on host tensors is not recorded."""
    from emcl_kernels.backends import _import, foreach
    monkeypatch.setattr(foreach, "capturing", lambda: True)   # the path a capture takes
    module = _import(backend)
    recorder = _HostReads()
    for name in ("step", "check_finite"):
        def recorded(*args, _fn=getattr(module, name), **kwargs):
            with recorder:
                return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, recorded)
    model = _model()
    opt = FusedEMCLOptimizer(model.parameters(), meta_lr=0.3, inner_lr=0.05, reg=2.0,
                             lr_mode=lr_mode, lr_max=0.5, meta_every=2, prox=prox,
                             capturable=True, backend=backend)
    xs, ys = _batches(4)
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    opt.step()
    for x, y in zip(xs[1:], ys[1:]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert recorder.reads == [], f"{backend}: the step read a value on the host: {recorder.reads}"


# ---------------------------------------------------------------------------------------------
# CUDA graphs (GPU only)
# ---------------------------------------------------------------------------------------------

def _iteration(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _schedule(opt, i):
    """New hyper-parameter values, written in place (a captured graph reads them at replay)."""
    opt.param_groups[0]["lr"].fill_(0.05 / (1 + 0.1 * i))
    opt.param_groups[0]["meta_lr"].fill_(0.3 + 0.01 * i)


GPU_BACKENDS = [b for b in ("cuda", "triton", "foreach") if b in available_backends()] if CUDA \
    else ["cuda"]


@pytest.mark.skipif(not CUDA, reason="host syncs are a GPU matter")
@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS if b != "foreach"])
def test_a_float_schedule_never_makes_a_step_wait_for_the_gpu(backend):
    """The default (eager) step with float hyper-parameters changed before every step, as an
    LR schedule does: the new values travel to the device without a host sync (torch's sync
    debug mode raises on one)."""
    model = _model("cuda")
    opt = FusedEMCLOptimizer(model.parameters(), meta_every=2, backend=backend)
    xs, ys = _batches(6, "cuda")
    for i, (x, y) in enumerate(zip(xs, ys)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.param_groups[0]["lr"] = 0.05 / (1 + i)
        opt.param_groups[0]["meta_lr"] = 0.3 + 0.01 * i
        if i < 2:
            opt.step()                                     # the plans are built here
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(torch.cat([p.detach().reshape(-1) for p in model.parameters()])).all()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("lr_mode", ("recurrent", "inverse"))
def test_cuda_graph_whole_iteration_replays_like_eager(backend, lr_mode):
    """The fused kernels read the hyper-parameters, the meta_every cadence and the skip flag on
    the device: a captured iteration replays like eager, step for step."""
    device = "cuda"
    xs, ys = _batches(12, device)
    kw = dict(meta_lr=0.3, inner_lr=0.05, reg=2.0, lr_mode=lr_mode, lr_max=0.5, meta_every=3,
              capturable=True, backend=backend)
    eager_model, graph_model = _model(device), _model(device)
    eager_opt = FusedEMCLOptimizer(eager_model.parameters(), **kw)
    graph_opt = FusedEMCLOptimizer(graph_model.parameters(), **kw)
    static_x, static_y = xs[0].clone(), ys[0].clone()

    warmup = 3  # on a side stream, as torch.cuda.graphs asks; it also creates the state
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            _schedule(graph_opt, i)
            static_x.copy_(xs[i])
            static_y.copy_(ys[i])
            graph_opt.zero_grad(set_to_none=True)
            _iteration(graph_model, graph_opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    graph_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _iteration(graph_model, graph_opt, static_x, static_y)
    # the capture ran nothing; replay the remaining iterations with new data and schedules
    for i in range(warmup, len(xs)):
        _schedule(graph_opt, i)
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        graph.replay()
    torch.cuda.synchronize()

    eager_losses = []
    for i in range(len(xs)):
        _schedule(eager_opt, i)
        eager_opt.zero_grad(set_to_none=True)
        eager_losses.append(_iteration(eager_model, eager_opt, xs[i], ys[i]).item())
    assert abs(static_loss.item() - eager_losses[-1]) <= 1e-4 * abs(eager_losses[-1]) + 1e-6
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
        for key, value in eager_opt.state[p].items():
            torch.testing.assert_close(graph_opt.state[q][key], value, rtol=1e-4, atol=1e-5,
                                       msg=key)
    assert graph_opt.state_dict()["emcl"]["step_calls"] == len(xs)
    assert graph_opt.state[next(graph_model.parameters())]["step"].item() == len(xs) // 3


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_inner_step_with_found_inf():
    """A captured inner_step() reads grad_scale and found_inf from device tensors at replay:
    found_inf=1 leaves everything untouched, found_inf=0 steps with the unscaled gradients."""
    case = make_case([3, 1025], torch.float32, seed=9, device="cuda")
    hyper = MODES[1].hyper("inner_step")
    expected = clone_case(case)
    tensors = {k: torch.tensor(float(v), device="cuda") if k in NUMERIC else v
               for k, v in hyper.items()}
    scale = torch.tensor(4.0, device="cuda")
    found_inf = torch.tensor(0.0, device="cuda")
    scaled = [g * 4.0 for g in case.grads]

    def step():
        F.inner_step_(case.params, scaled, case.anchors, case.importances, backend="foreach",
                      grad_scale=scale, found_inf=found_inf, **tensors)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    found_inf.fill_(1.0)
    with torch.cuda.stream(side):
        step()  # warm up: skipped, found_inf is set
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()  # found_inf = 1: nothing moves
    torch.cuda.synchronize()
    assert_case_close(case, expected, torch.float32, "skipped replay")
    found_inf.fill_(0.0)
    graph.replay()
    apply("inner_step", "reference", expected, hyper)
    assert_case_close(case, expected, torch.float32, "replay")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_functional_call_with_float_hyperparameters(backend):
    """A functional call with numbers for its hyper-parameters, captured: the numbers are
    constants of the graph, and every replay uses them, however much pinned host memory is
    allocated and freed between replays (a captured copy from a pinned buffer would read
    whatever the buffer holds by then)."""
    case = make_case([3, 1025], torch.float32, seed=5, device="cuda")
    hyper = MODES[1].hyper("inner_step")
    expected = clone_case(case)

    def step():
        F.inner_step_(case.params, case.grads, case.anchors, case.importances,
                      backend=backend, check_finite=False, **hyper)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                   # warm up (compiles, caches)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    apply("inner_step", "reference", expected, hyper)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        for _ in range(4):   # pinned buffers of the same size, filled with other numbers
            junk = torch.full((len(HYPER_FIELDS),), 1e30, dtype=torch.float64,
                              pin_memory=True)
            junk.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        graph.replay()
        apply("inner_step", "reference", expected, hyper)
    torch.cuda.synchronize()
    assert_case_close(case, expected, torch.float32, "replays")
