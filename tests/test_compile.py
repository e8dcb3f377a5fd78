"""torch.compile: the optimizer's step compiles with ``fullgraph=True`` (no graph
break), gives the eager result, and changing hyper-parameters between steps does not recompile.

The recipe is torch's own for compiled optimizers: the model (forward and backward) is compiled
on its own and the optimizer step is compiled with ``fullgraph=True``
(``torch._dynamo`` does not put ``loss.backward()`` and an optimizer over the same parameters
in one graph, for any optimizer). Hyper-parameters that change between steps are given as 0-d
tensors (``capturable=True`` does that for every one) and changed in place: the compiled graph
reads them as inputs. Float hyper-parameters are constants of the graph, so a new value
recompiles, as with torch's optimizers' float ``lr``.
"""
import os

import pytest
import torch
from torch._dynamo.utils import counters

from emcl_kernels import FusedEMCLOptimizer, available_backends

# inductor is the real thing (it generates C++ for the step, ~30-90 s on a busy 2-core CPU, so
# it runs when EMCL_SLOW_TESTS=1); aot_eager checks the traced, functionalized graph quickly.
SLOW = os.environ.get("EMCL_SLOW_TESTS") == "1"
COMPILERS = ("aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not SLOW, reason="inductor compiles C++ for a minute; set EMCL_SLOW_TESTS=1")))
STEPS = 7


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 4, 5, generator=g), torch.randn(STEPS, 4, 3, generator=g)


def _run(compiler, *, backend="foreach", lr_mode="recurrent", meta_every=3, capturable=True,
         amp=False, change_hyper=True):
    """Train STEPS steps; with ``compiler`` the step is compiled with fullgraph=True.
    Returns (model, optimizer, number of graphs compiled)."""
    model = _model()
    opt = FusedEMCLOptimizer(model.parameters(), meta_lr=0.3, inner_lr=0.05, reg=2.0,
                             lr_mode=lr_mode, lr_max=0.5, meta_every=meta_every,
                             capturable=capturable, backend=backend)

    def opt_step(grad_scale, found_inf):
        opt.step(grad_scale=grad_scale, found_inf=found_inf)

    if compiler is not None:
        torch._dynamo.reset()
        counters.clear()
        opt_step = torch.compile(opt_step, backend=compiler, fullgraph=True)
    xs, ys = _batches()
    for i in range(STEPS):
        if change_hyper:  # a schedule: new values every step, changed in place
            opt.param_groups[0]["lr"].fill_(0.05 / (1 + i))
            opt.param_groups[0]["meta_lr"].fill_(0.3 + 0.05 * i)
        loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
        scale = found_inf = None
        if amp:
            scale = torch.tensor(256.0)
            found_inf = torch.tensor(1.0 if i == 4 else 0.0)  # step 5 is skipped
            loss = loss * scale
        loss.backward()
        opt_step(scale, found_inf)
        opt.zero_grad()
    graphs = counters["stats"]["unique_graphs"] if compiler is not None else 0
    return model, opt, graphs


def _assert_same(eager, compiled):
    (m1, o1, _), (m2, o2, _) = eager, compiled
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p2, p1, rtol=1e-5, atol=1e-6)
        for key in o1.state[p1]:
            torch.testing.assert_close(o2.state[p2][key], o1.state[p1][key], rtol=1e-5,
                                       atol=1e-6, msg=key)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_step_equals_eager_without_recompiling(compiler):
    """Inner and fused inner+meta steps (meta_every=3, chosen on the device), recurrent rates,
    hyper-parameters changed every step: one graph, the eager result."""
    eager = _run(None)
    compiled = _run(compiler)
    _assert_same(eager, compiled)
    assert compiled[2] == 1, f"{compiled[2]} graphs compiled for {STEPS} steps"
    assert compiled[1].state[next(compiled[0].parameters())]["step"].item() == STEPS // 3


@pytest.mark.parametrize("compiler", ("aot_eager",))
def test_compiled_step_with_grad_scaler_flags(compiler):
    """grad_scale and found_inf as graph inputs: the step with found_inf set is skipped inside
    the graph (no host sync, no graph break), exactly as in eager."""
    eager = _run(None, amp=True, lr_mode="inverse")
    compiled = _run(compiler, amp=True, lr_mode="inverse")
    _assert_same(eager, compiled)
    assert compiled[2] == 1


def test_compiled_step_with_float_hyperparameters():
    """Without capturable, float hyper-parameters are graph constants: the step still compiles
    in one graph and matches eager while they stay fixed; paper-style inner/meta calls too."""
    eager = _run(None, capturable=False, change_hyper=False, lr_mode="inverse")
    compiled = _run("aot_eager", capturable=False, change_hyper=False, lr_mode="inverse")
    _assert_same(eager, compiled)
    assert compiled[2] == 1


@pytest.mark.skipif("cpu" not in available_backends(), reason="the 'cpu' extension backend "
                    "is not built here")
def test_compiled_step_with_the_cpu_extension():
    """The extension's operators have fake implementations: a step through them traces as
    one graph (float hyper-parameters: the operators take floats)."""
    eager = _run(None, backend="cpu", capturable=False, change_hyper=False)
    compiled = _run("aot_eager", backend="cpu", capturable=False, change_hyper=False)
    _assert_same(eager, compiled)
    assert compiled[2] == 1


def test_compiled_capturable_step_with_auto_backend():
    """backend="auto" with tensor hyper-parameters compiles whatever "auto" picks here: a
    backend that takes only floats (the extension's) is swapped for "foreach" inside the
    graph, where reading the tensors back would need a host sync."""
    eager = _run(None, backend="auto")
    compiled = _run("aot_eager", backend="auto")
    _assert_same(eager, compiled)
    assert compiled[2] == 1


def test_recompile_counter_sees_float_changes():
    """The counter the tests above rely on does count recompiles: a float hyper-parameter that
    changes every step (no capturable) gives more than one graph."""
    model = _model()
    opt = FusedEMCLOptimizer(model.parameters(), backend="foreach")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(opt.inner_step, backend="eager", fullgraph=True)
    xs, ys = _batches()
    for i in range(3):
        opt.param_groups[0]["lr"] = 0.01 * (i + 1)
        torch.nn.functional.mse_loss(model(xs[i]), ys[i]).backward()
        step()
        opt.zero_grad()
    assert counters["stats"]["unique_graphs"] > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_step_on_cuda_with_inductor():
    """On the GPU: inductor generates Triton code for the step (foreach backend, capturable
    tensor hyper-parameters on the device); one graph, the eager result."""
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 33).cuda()
        opt = FusedEMCLOptimizer(model.parameters(), meta_every=3, lr_mode="recurrent",
                                 lr_max=0.5, capturable=True, backend="foreach")
        step = opt.step
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            step = torch.compile(opt.step, fullgraph=True)
        g = torch.Generator().manual_seed(2)
        for i in range(STEPS):
            opt.param_groups[0]["lr"].fill_(0.05 / (1 + i))
            x = torch.randn(8, 64, generator=g).cuda()
            model(x).square().mean().backward()
            step()
            opt.zero_grad()
        return model, opt, counters["stats"]["unique_graphs"] if compiled else 0

    _assert_same(run(False), run(True))
    assert counters["stats"]["unique_graphs"] == 1
