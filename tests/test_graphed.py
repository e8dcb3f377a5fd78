"""EMCL's glance as a static-buffer routine (emcl_continual.methods.emcl_graphed).

On the CPU (everywhere): the routine, run eagerly, is the eager ``observe`` bit for bit
(parameters, optimizer state, replay buffer, generator, losses) in every configuration, builds
one static shape per (batch, replayed rows), and the ``cuda_graph`` switch and the device
residency of the data behave as documented. On a GPU (skipped without one): glances replayed
from CUDA graphs equal the same routine run eagerly and the eager loop, graphs are rebuilt
when the state they read is replaced, a failed capture falls back to eager once, and every
method of the harness runs with device-resident data.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from emcl_continual.data import models, streams
from emcl_continual.methods import replay
from emcl_continual.training import train
from emcl_continual.methods import emcl_graphed as graphed
from emcl_continual.methods import METHODS, get_method

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _flat_stream(n_tasks=2, per_task=55, seed=0, multi=False):
    """Learnable 784-feature tasks (class = which pixel block is bright); ``multi``: a
    two-classes-per-task multi-head stream of the same inputs (the MLP, task masks)."""
    g = torch.Generator().manual_seed(seed)

    def make(n, t):
        y = torch.randint(0, 10, (n,), generator=g)
        x = torch.rand(n, 784, generator=g) * 0.1
        for i in range(n):
            x[i, y[i] * 78:(y[i] + 1) * 78] += 0.9
        return (x, 2 * t + y % 2) if multi else (x, y)

    if multi:
        info = streams.StreamInfo("split-cifar100", n_tasks, (784,), 2 * n_tasks,
                                  [(2 * t, 2 * t + 2) for t in range(n_tasks)], True)
        tr = [streams.TaskData(*make(per_task, t), t) for t in range(n_tasks)]
        te = [streams.TaskData(*make(30, t), t) for t in range(n_tasks)]
        return streams.Stream(info, tr, te, seed)
    tr = [make(per_task, t) for t in range(n_tasks)]
    te = [make(30, t) for t in range(n_tasks)]
    return streams.stream_from_tasks("permuted-mnist", tr, te, seed)


def _image_stream(n_tasks=2, per_task=25, hw=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    info = streams.StreamInfo("split-cifar100", n_tasks, (3, hw, hw), 5 * n_tasks,
                              [(5 * t, 5 * t + 5) for t in range(n_tasks)], True)
    tr = [streams.TaskData(torch.rand(per_task, 3, hw, hw, generator=g),
                           5 * t + torch.randint(0, 5, (per_task,), generator=g), t) for t in range(n_tasks)]
    te = [streams.TaskData(torch.rand(10, 3, hw, hw, generator=g), 5 * t + torch.arange(10) % 5, t)
          for t in range(n_tasks)]
    return streams.Stream(info, tr, te, seed)


def _learner(stream, overrides, device="cpu", seed=0):
    # two glances unless a test says otherwise (the MNIST default these tests were written for;
    # EMCL's default is now Algorithm 1's one visit); the eager loop with autograd's inner steps,
    # which the routine replays (the fused glance is tests/test_emcl_fused.py's)
    cfg = train.build_config("emcl", stream.info.name, seed,
                             {"glances": 2, "fused_glance": False, **overrides})
    torch.manual_seed(seed)
    model = models.build_model(stream.info).to(device)
    return get_method("emcl")(model, stream.info, cfg, torch.device(device))


def _assert_same_learners(a, b, where):
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), f"{where}: parameter {name} differs"
        sa, sb = a.opt.state[p], b.opt.state[q]
        assert sorted(sa) == sorted(sb), where
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{where}: state {key!r} of {name} differs"
    for (name, u), v in zip(a.model.named_buffers(), b.model.buffers()):
        assert torch.equal(u, v), f"{where}: buffer {name} differs"
    if a.buffer is not None:
        assert len(a.buffer) == len(b.buffer) and a.buffer.n_seen == b.buffer.n_seen
        for key in ("x", "y", "t"):
            assert torch.equal(getattr(a.buffer, key), getattr(b.buffer, key)), f"{where}: replay {key}"
    assert torch.equal(a.generator.get_state(), b.generator.get_state()), f"{where}: generator state"


VARIANTS = [
    {},
    {"shuffle_inner": True},
    {"inner_replay": False},
    {"meta_replay": False},
    {"inner_replay": False, "meta_replay": False},
    {"memory": 0},
    {"replay": 25},                  # more than the buffer holds early on: growing shapes
    {"glances": 1},
    {"glances": 3, "shuffle_inner": True},
    {"lr_mode": "recurrent", "lr_scale": 1e-3, "lr_max": 1.0},
    {"lr_mode": "constant"},
    {"importance": "si"},
    {"prox": False},
    {"inner_lr_modulation": True},
    {"backend": "reference"},
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_static_routine_on_cpu_is_the_eager_loop_bit_for_bit(overrides):
    """Same seed, same stream (55 samples per task: a short last batch), one learner on the
    eager loop and one on the static-buffer routine: after every batch the losses, parameters,
    optimizer state, replay buffer and generator are identical."""
    s = _flat_stream()
    eager = _learner(s, {**overrides, "cuda_graph": False})
    static = _learner(s, {**overrides, "cuda_graph": True})
    assert eager.routine is None and static.routine is not None and not static.routine.capture
    for t in range(s.info.n_tasks):
        for b, (x, y) in enumerate(s.batches(t, 10)):
            la, lb = eager.observe(x, y, t), static.observe(x, y, t)
            assert isinstance(lb, float)
            assert la == lb or (math.isnan(la) and math.isnan(lb)), (t, b, la, lb)
            _assert_same_learners(eager, static, f"task {t} batch {b}")


def test_static_routine_on_cpu_multi_head_with_mixed_replayed_tasks():
    """Task masks per sample: replayed rows of earlier tasks keep their own heads."""
    s = _flat_stream(n_tasks=3, per_task=30, multi=True)
    eager = _learner(s, {"cuda_graph": False, "inner_lr": 0.05})
    static = _learner(s, {"cuda_graph": True, "inner_lr": 0.05})
    for t in range(3):
        for b, (x, y) in enumerate(s.batches(t, 10)):
            assert eager.observe(x, y, t) == static.observe(x, y, t)
            _assert_same_learners(eager, static, f"task {t} batch {b}")
    assert set(static.buffer.t[:len(static.buffer)].tolist()) == {0, 1, 2}


def test_static_routine_on_cpu_reduced_resnet_with_batch_norm():
    """The image streams' model: batch-norm running statistics follow the eager loop too."""
    s = _image_stream(n_tasks=1, per_task=15, hw=32)
    eager = _learner(s, {"cuda_graph": False})
    static = _learner(s, {"cuda_graph": True})
    for b, (x, y) in enumerate(s.batches(0, 10)):
        assert eager.observe(x, y, 0) == static.observe(x, y, 0)
        _assert_same_learners(eager, static, f"batch {b}")


def test_train_run_with_the_routine_gives_the_same_results_on_cpu():
    s = _flat_stream()
    a = train.run("emcl", s, 0, overrides={"cuda_graph": False, "glances": 2, "fused_glance": False},
                  progress=False)
    b = train.run("emcl", s, 0, overrides={"cuda_graph": True, "glances": 2}, progress=False)
    assert a["acc_matrix"] == b["acc_matrix"] and a["task_losses"] == b["task_losses"]
    assert b["config"]["cuda_graph"] is True and a["acc_matrix"][0][0] > 30.0


def test_one_static_shape_per_batch_and_replayed_rows():
    """(batch, replayed rows): the first batch replays nothing, the short last batch of a task
    has 5 samples, and a buffer smaller than ``replay`` gives fewer rows until it fills."""
    s = _flat_stream(n_tasks=2, per_task=55)
    ten = _learner(s, {"cuda_graph": True})
    big = _learner(s, {"cuda_graph": True, "replay": 25, "glances": 1})
    for t in range(2):
        for x, y in s.batches(t, 10):
            ten.observe(x, y, t)
            big.observe(x, y, t)
    assert sorted(ten.routine.shapes) == [(5, 10), (10, 0), (10, 10)]
    assert sorted(big.routine.shapes) == [(5, 25), (10, 0), (10, 10), (10, 20), (10, 25)]
    assert ten.routine.shapes[(10, 0)].eager_runs == 2  # the first batch, both glances
    assert ten.routine.shapes[(5, 10)].n_inner == 15 and ten.routine.shapes[(5, 10)].n_meta == 15
    assert ten.routine.captures == 0 and "eager on cpu" in ten.routine.status
    off = _learner(s, {"cuda_graph": True, "inner_replay": False, "meta_replay": False})
    for x, y in s.batches(0, 10):
        off.observe(x, y, 0)
    assert sorted(off.routine.shapes) == [(5, 0), (10, 0)]  # replay drawn (same RNG) but unused


@pytest.mark.parametrize("choice, device, expected", [
    ("auto", "cpu", (False, False, None)),
    (False, "cpu", (False, False, None)),
    (True, "cpu", (True, False, None)),
    ("auto", "cuda", (True, True, None)),
    (True, "cuda", (True, True, None)),
    (False, "cuda", (False, False, None)),
])
def test_graph_plan(choice, device, expected):
    assert graphed.graph_plan({"cuda_graph": choice}, torch.device(device)) == expected


def test_graph_plan_keeps_the_modulation_ablation_eager_on_a_gpu_and_says_why():
    use, capture, why = graphed.graph_plan({"inner_lr_modulation": True}, torch.device("cuda"))
    assert use and not capture and "inner_lr_modulation" in why
    assert graphed.graph_plan({"inner_lr_modulation": True}, torch.device("cpu")) == (False, False, None)


@pytest.mark.parametrize("bad", ["yes", 1, None, "cuda"])
def test_bad_cuda_graph_value_is_clear(bad):
    with pytest.raises(ValueError, match="cuda_graph must be 'auto', True or False"):
        graphed.graph_plan({"cuda_graph": bad}, torch.device("cpu"))
    with pytest.raises(ValueError, match="cuda_graph"):
        train.run("emcl", _flat_stream(n_tasks=1, per_task=10), 0, overrides={"cuda_graph": bad},
                  progress=False)


def test_cpu_default_is_the_eager_loop_and_the_optimizer_is_not_capturable():
    s = _flat_stream(n_tasks=1, per_task=10)
    learner = _learner(s, {})
    assert learner.config["cuda_graph"] == "auto" and learner.routine is None
    assert not learner.opt.param_groups[0]["capturable"]
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        graphed.GlanceRoutine(learner, capture=True)
    with pytest.raises(ValueError, match="warmup"):
        graphed.GlanceRoutine(learner, capture=False, warmup=0)


# --------------------------------------------------------------------------- data residency
def test_stream_batches_on_a_device_are_the_same_batches():
    s = _flat_stream(n_tasks=1, per_task=25)
    plain = list(s.batches(0, 10))
    moved = list(s.batches(0, 10, device="cpu"))
    assert [len(y) for _, y in moved] == [10, 10, 5]
    for (x0, y0), (x1, y1) in zip(plain, moved):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_reservoir_index_draw_is_the_sample_draw_and_task_ids_live_with_the_samples():
    a = replay.ReservoirBuffer(8, (3,), torch.Generator().manual_seed(5))
    b = replay.ReservoirBuffer(8, (3,), torch.Generator().manual_seed(5))
    for buf in (a, b):
        buf.add(torch.rand(6, 3, generator=torch.Generator().manual_seed(1)), torch.arange(6), 2)
    idx = a.sample_indices(4)
    x, y, t = b.sample(4)
    assert idx.device.type == "cpu" and idx.dtype == torch.long
    assert torch.equal(a.x[idx], x) and torch.equal(a.y[idx], y) and torch.equal(t, torch.full((4,), 2))
    assert a.sample_indices(100).numel() == 6
    with pytest.raises(ValueError):
        a.sample_indices(-1)


# --------------------------------------------------------------------------- GPU
def _twins(stream, overrides, capture_both=False):
    """A graphed learner and its twin running the same routine eagerly, with the same
    (capturable) optimizer, on the GPU."""
    graphed_one = _learner(stream, {**overrides, "cuda_graph": True}, "cuda")
    twin = _learner(stream, {**overrides, "cuda_graph": True}, "cuda")
    twin.routine = graphed.GlanceRoutine(twin, capture=capture_both)
    return graphed_one, twin


def _run_both(a, b, stream, check=None):
    for t in range(stream.info.n_tasks):
        for x, y in stream.batches(t, 10, device="cuda"):
            la, lb = a.observe(x, y, t), b.observe(x, y, t)
            if check is not None:
                check(la, lb)


def _assert_close_learners(a, b, rtol, atol):
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        for key, value in b.opt.state[q].items():
            torch.testing.assert_close(a.opt.state[p][key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{name} state {key}: {m}")
    for (name, u), v in zip(a.model.named_buffers(), b.model.buffers()):
        torch.testing.assert_close(u, v, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@needs_gpu
@pytest.mark.parametrize("overrides", [{}, {"shuffle_inner": True}, {"replay": 25, "glances": 1},
                                       {"lr_mode": "recurrent", "lr_scale": 1e-3, "lr_max": 1.0}],
                         ids=["default", "shuffle", "growing-replay", "recurrent"])
def test_captured_glances_replay_like_the_eager_routine(overrides):
    """The same kernels from a graph: equal to the routine run eagerly, to rounding."""
    s = _flat_stream(n_tasks=2, per_task=55)
    a, b = _twins(s, overrides)
    _run_both(a, b, s, check=lambda la, lb: math.isclose(la, lb, rel_tol=1e-5, abs_tol=1e-6) or
              pytest.fail(f"losses {la} and {lb}"))
    assert a.routine.failure is None, a.routine.status
    # the full-replay shape is captured after 2 warm-up glances and replayed from then on
    full = a.routine.shapes[(10, 25 if overrides.get("replay") == 25 else 10)]
    assert full.graph is not None and full.eager_runs == 2 and full.replays >= 5, a.routine.status
    assert a.routine.shapes[(10, 0)].graph is None  # the first batch only: never captured
    _assert_close_learners(a, b, rtol=1e-5, atol=1e-6)
    assert a.opt.skipped_steps == b.opt.skipped_steps == 0


@needs_gpu
def test_graphed_run_matches_the_eager_loop_on_cuda():
    """cuda_graph=True against cuda_graph=False (the eager loop, float hyper-parameters) on
    the same backend: the same training, to float rounding, and the same accuracies."""
    s = _flat_stream(n_tasks=2, per_task=60)
    ov = {"backend": "foreach", "inner_lr": 0.05}
    with warnings.catch_warnings():
        # a glance that cannot be captured runs eagerly with a RuntimeWarning: a failure here
        warnings.filterwarnings("error", message="emcl: could not capture")
        warnings.filterwarnings("error", message="emcl: no CUDA graphs")
        a = train.run("emcl", s, 0, overrides={**ov, "cuda_graph": True}, device="cuda",
                      progress=False)
    b = train.run("emcl", s, 0, overrides={**ov, "cuda_graph": False}, device="cuda", progress=False)
    for ra, rb in zip(a["acc_matrix"], b["acc_matrix"]):
        assert ra == pytest.approx(rb, abs=100 / 30 + 1e-9)  # at most one test sample in 30
    assert a["task_losses"] == pytest.approx(b["task_losses"], rel=1e-4)
    assert a["acc_matrix"][0][0] > 30.0


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms: the same convolution kernels eagerly and in a graph,
    with no atomics in the weight gradients (one-sample batch norm on noise is chaotic enough
    to turn their rounding into visible differences over hundreds of steps)."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


@needs_gpu
def test_graphed_image_stream_matches_the_eager_routine(deterministic_cudnn):
    """Reduced ResNet-18 with batch norm, multi-head masks, 3x32x32 inputs; the losses are
    compared batch by batch, so a difference names the first batch it shows in."""
    s = _image_stream(n_tasks=2, per_task=45)
    a, b = _twins(s, {})
    seen = []

    def same_loss(la, lb):
        seen.append((la, lb))
        if not math.isclose(la, lb, rel_tol=1e-4, abs_tol=1e-5):
            pytest.fail(f"batch {len(seen) - 1}: graphed loss {la}, eager {lb} "
                        f"({a.routine.status}); the batches before: {seen[:-1]}")

    _run_both(a, b, s, check=same_loss)
    assert a.routine.failure is None and a.routine.captures >= 1, a.routine.status
    _assert_close_learners(a, b, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_graphs_are_rebuilt_when_the_optimizer_state_is_replaced():
    s = _flat_stream(n_tasks=2, per_task=60)
    a, b = _twins(s, {})
    batches = list(s.batches(0, 10, device="cuda"))
    for x, y in batches[:4]:
        a.observe(x, y, 0)
        b.observe(x, y, 0)
    assert a.routine.captures == 1
    saved = copy.deepcopy(b.opt.state_dict())
    for learner in (a, b):
        learner.opt.load_state_dict(copy.deepcopy(saved))  # new state tensors
    for x, y in batches[4:]:
        a.observe(x, y, 0)
        b.observe(x, y, 0)
    assert a.routine.captures == 2 and a.routine.failure is None
    _assert_close_learners(a, b, rtol=1e-5, atol=1e-6)


@needs_gpu
def test_a_failed_capture_falls_back_to_eager_and_says_so_once():
    s = _flat_stream(n_tasks=1, per_task=60)
    a, b = _twins(s, {})
    loss = a._loss

    def syncing_loss(x, y, t):  # a host read, as data-dependent control flow would do
        out = loss(x, y, t)
        if torch.cuda.is_current_stream_capturing():
            float(out)
        return out

    a._loss = syncing_loss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_both(a, b, s)
    said = [w for w in caught if "could not capture" in str(w.message)]
    assert len(said) == 1 and a.routine.failure is not None and "eager" in a.routine.status
    _assert_close_learners(a, b, rtol=1e-5, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_on_cuda_with_device_resident_data(method):
    s = _flat_stream(n_tasks=2, per_task=40)
    r = train.run(method, s, 0, device="cuda", progress=False)
    assert r["device"] == "cuda" and all(math.isfinite(v) for v in r["task_losses"])
    cpu = train.run(method, s, 0, device="cpu", progress=False)
    # the same method on the same stream: the GPU's rounding moves a few test samples at most
    assert r["acc"] == pytest.approx(cpu["acc"], abs=15.0), (r["acc_matrix"], cpu["acc_matrix"])
