"""Tests of the baseline continual-learning methods (sgd, ewc, gem, agem, er, mer, lamaml).

A tiny harness: a small ReLU MLP with the package's ``model(x, task)`` signature and synthetic
"permuted Gaussian clusters" tasks (each task permutes the input features, like MNIST
Permutations), so every test runs in seconds.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.optimize
import scipy.stats
import torch
from torch import nn

from emcl_continual.methods import get_method
from emcl_continual.methods._qp import agem_project, gem_project, solve_gem_dual
from emcl_continual.methods.replay import ReservoirBuffer

BASELINES = ["sgd", "ewc", "gem", "agem", "er", "mer", "lamaml"]
D_IN, N_CLASSES, N_TASKS = 20, 5, 3


class TinyMLP(nn.Module):
    """Two hidden ReLU layers on flattened input, single head (the MNIST model's shape, smaller)."""

    def __init__(self, d_in: int = D_IN, n_classes: int = N_CLASSES, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], -1))


def tiny_info(n_tasks: int = N_TASKS):
    return SimpleNamespace(name="tiny", n_tasks=n_tasks, input_shape=(D_IN,), n_classes=N_CLASSES,
                           task_classes=[(0, N_CLASSES)] * n_tasks, multi_head=False)


def tiny_tasks(n_tasks: int = N_TASKS, n_train: int = 300, n_test: int = 200, seed: int = 0):
    """Gaussian clusters (one per class); task k permutes the features with its own permutation."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(N_CLASSES, D_IN, generator=g) * 3.0
    tasks = []
    for k in range(n_tasks):
        perm = torch.arange(D_IN) if k == 0 else torch.randperm(D_IN, generator=g)

        def draw(n):
            y = torch.randint(0, N_CLASSES, (n,), generator=g)
            x = means[y] + 0.5 * torch.randn(n, D_IN, generator=g)
            return x[:, perm], y

        tasks.append((draw(n_train), draw(n_test)))
    return tasks


def small_config(name: str, **over) -> dict:
    """Each method's permuted-mnist defaults, scaled to the tiny stream and cheap enough for a unit test."""
    cfg = get_method(name).defaults("permuted-mnist")
    cfg["seed"] = 0
    if "memory" in cfg:
        cfg["memory"] = 30
    if name == "mer":
        cfg.update(batches_per_example=2, replay_batch=3)
    if name == "lamaml":
        cfg.update(glances=2, alpha_init=0.1, eta=0.1)
    cfg.update(over)
    return cfg


def accuracy(model, x, y, task) -> float:
    with torch.no_grad():
        return float((model(x, task).argmax(1) == y).float().mean())


def train_task(method, x, y, task, batch=10):
    """One task as ``train.run`` gives it: begin_task, observe per batch, end_task."""
    losses = []
    method.begin_task(task)
    for i in range(0, x.shape[0], batch):
        losses.append(method.observe(x[i : i + batch], y[i : i + batch], task))
    method.end_task(task)
    return losses


def build(name: str, n_tasks: int = N_TASKS, **over):
    torch.manual_seed(0)
    model = TinyMLP()
    method = get_method(name)(model, tiny_info(n_tasks), small_config(name, **over), torch.device("cpu"))
    return model, method


@pytest.mark.parametrize("name", BASELINES)
def test_method_learns_first_task(name):
    """After one task of 200 samples, accuracy is far above chance (20%)."""
    torch.set_num_threads(1)
    (train, test), *_ = tiny_tasks()
    model, method = build(name)
    losses = train_task(method, *train, task=0)
    assert all(math.isfinite(l) for l in losses)
    acc = accuracy(model, *test, task=0)
    assert acc > 0.7, f"{name}: accuracy {acc:.3f} after one task"


@pytest.mark.parametrize("name", BASELINES)
def test_method_runs_across_tasks(name):
    """Three tasks in sequence: every method keeps learning the new task (memories, projections work)."""
    torch.set_num_threads(1)
    tasks = tiny_tasks()
    model, method = build(name)
    for k, (train, _) in enumerate(tasks):
        train_task(method, *train, task=k)
    acc_last = accuracy(model, *tasks[-1][1], task=N_TASKS - 1)
    assert acc_last > 0.6, f"{name}: accuracy {acc_last:.3f} on the last task"
    if name in ("gem", "agem"):
        assert method.n_projections > 0, f"{name} never projected a conflicting gradient"


@pytest.mark.parametrize("name", BASELINES)
def test_defaults_and_validation(name):
    cls = get_method(name)
    for stream in ("permuted-mnist", "many-permutations", "split-cifar100", "split-miniimagenet"):
        assert isinstance(cls.defaults(stream), dict)
    with pytest.raises(ValueError, match="stream"):
        cls.defaults("no-such-stream")
    bad = small_config(name)
    key = "alpha_init" if name == "lamaml" else "lr"
    bad[key] = -1.0
    with pytest.raises(ValueError, match=key):
        cls(TinyMLP(), tiny_info(), bad, torch.device("cpu"))


def test_memory_defaults_follow_paper():
    """Section V: 200 memories on MNIST Permutations (and Rotated MNIST), 500 on Many Permutations;
    La-MAML at its own script's learning rates (alpha0 0.15, eta 0.3 on the permutations: Table II
    has them swapped, kept as TABLE_II_PERMUTED)."""
    for name in ("gem", "agem", "er", "mer", "lamaml"):
        assert get_method(name).defaults("permuted-mnist")["memory"] == 200
        assert get_method(name).defaults("rotated-mnist")["memory"] == 200
        assert get_method(name).defaults("many-permutations")["memory"] == 500
    from emcl_continual.methods.lamaml import TABLE_II_PERMUTED

    lam = get_method("lamaml")
    for stream in ("permuted-mnist", "rotated-mnist"):
        d = lam.defaults(stream)
        assert (d["alpha_init"], d["eta"], d["glances"]) == (0.15, 0.3, 5)
    paper = lam.TABLE_II["permuted-mnist"]
    assert (paper["alpha_init"], paper["eta"]) == (TABLE_II_PERMUTED["alpha_init"], TABLE_II_PERMUTED["eta"]) == (0.3, 0.15)
    assert (lam.defaults("many-permutations")["alpha_init"], lam.defaults("many-permutations")["eta"]) == (0.1, 0.1)
    assert lam.defaults("permuted-mnist")["second_order"] is False
    assert lam.defaults("split-cifar100")["second_order"] is True


# ---------------------------------------------------------------- GEM's quadratic program

def _gem_primal(g, G):
    """Brute-force primal min 1/2||z - g||^2 s.t. G z >= 0 by SLSQP, for comparison."""
    res = scipy.optimize.minimize(lambda z: 0.5 * np.sum((z - g) ** 2), g.copy(), jac=lambda z: z - g,
                                  constraints=[{"type": "ineq", "fun": lambda z: G @ z, "jac": lambda z: G}],
                                  method="SLSQP", options={"ftol": 1e-14, "maxiter": 500})
    return res.x


@pytest.mark.parametrize("t,p,seed", [(1, 7, 0), (3, 11, 1), (5, 37, 2), (9, 64, 3)])
def test_gem_projection_satisfies_constraints_and_is_closest(t, p, seed):
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((t, p))
    g = -G.mean(0) * 2 + 0.3 * rng.standard_normal(p)  # conflicts with the memories
    assert (G @ g < 0).any()
    z = gem_project(torch.from_numpy(g), torch.from_numpy(G), margin=0.0, eps=0.0).numpy()
    assert (G @ z >= -1e-9).all(), G @ z
    ref = _gem_primal(g, G)
    np.testing.assert_allclose(z, ref, atol=1e-5)
    # with the GEM code's ridge eps the violation is bounded by eps * v
    v = solve_gem_dual(G, g, margin=0.0, eps=1e-3)
    z_eps = G.T @ v + g
    assert (G @ z_eps >= -1e-3 * v - 1e-9).all()
    assert (v >= 0).all()


def test_gem_margin_pushes_into_cone():
    rng = np.random.default_rng(5)
    G = rng.standard_normal((4, 30))
    g = -G.sum(0)
    v = solve_gem_dual(G, g, margin=0.5, eps=1e-3)
    assert (v >= 0.5 - 1e-12).all()
    # KKT: lambda = P v + G g >= 0, complementary with v - margin
    P = G @ G.T + 1e-3 * np.eye(4)
    lam = P @ v + G @ g
    assert (lam >= -1e-8).all()
    np.testing.assert_allclose(lam * (v - 0.5), 0, atol=1e-8)


def test_gem_no_conflict_keeps_gradient():
    G = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    g = torch.tensor([0.5, 0.25, -3.0], dtype=torch.float64)
    torch.testing.assert_close(gem_project(g, G, 0.0, 0.0), g)


def test_gem_dual_rejects_bad_shapes():
    with pytest.raises(ValueError):
        solve_gem_dual(np.ones((2, 3)), np.ones(4))


# ---------------------------------------------------------------- A-GEM's projection

def test_agem_projection_hand_made():
    g = torch.tensor([1.0, -2.0, 0.5])
    g_ref = torch.tensor([0.0, 1.0, 0.0])
    # g . g_ref = -2 < 0 -> remove the g_ref component
    torch.testing.assert_close(agem_project(g, g_ref), torch.tensor([1.0, 0.0, 0.5]))
    g_ref2 = torch.tensor([1.0, 1.0, 0.0])  # g . g_ref2 = -1, |g_ref2|^2 = 2
    out = agem_project(g, g_ref2)
    torch.testing.assert_close(out, torch.tensor([1.5, -1.5, 0.5]))
    assert abs(float(out @ g_ref2)) < 1e-6
    # no conflict: unchanged
    g_ok = torch.tensor([3.0, 1.0, -1.0])
    torch.testing.assert_close(agem_project(g_ok, g_ref2), g_ok)
    with pytest.raises(ValueError):
        agem_project(torch.ones(3), torch.ones(4))


def test_agem_projection_random_is_orthogonal_and_minimal():
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        g = torch.randn(101, generator=gen, dtype=torch.float64)
        r = torch.randn(101, generator=gen, dtype=torch.float64)
        out = agem_project(g, r)
        if g @ r < 0:
            assert abs(float(out @ r)) < 1e-10
            # closest point to g in the half space {z : z.r >= 0}
            torch.testing.assert_close(out, g - (g @ r) / (r @ r) * r)
        else:
            torch.testing.assert_close(out, g)


# ---------------------------------------------------------------- reservoir buffer

def test_reservoir_buffer_is_uniform_over_stream():
    """Every stream position ends in the buffer with probability capacity / n (chi-square, fixed seed)."""
    capacity, n_stream, trials = 10, 100, 1000
    counts = np.zeros(n_stream)
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        buf = ReservoirBuffer(capacity, (1,), gen)
        for start in range(0, n_stream, 10):
            ids = torch.arange(start, start + 10, dtype=torch.float32).reshape(10, 1)
            buf.add(ids, torch.zeros(10, dtype=torch.long), start // 50)
        assert len(buf) == capacity
        x, _, _ = buf.sample(capacity)
        stored = x.reshape(-1).long().numpy()
        assert len(set(stored.tolist())) == capacity
        counts[stored] += 1
    expected = trials * capacity / n_stream
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p = scipy.stats.chi2.sf(chi2, df=n_stream - 1)
    assert p > 0.001, f"chi2={chi2:.1f}, p={p:.2g}: the buffer is not a uniform sample"
    # early and late halves of the stream are equally represented
    assert abs(counts[:50].sum() - counts[50:].sum()) < 0.1 * trials * capacity


# ---------------------------------------------------------------- La-MAML and MER specifics

@pytest.mark.parametrize("second_order", [False, True])
def test_lamaml_learning_rates_change(second_order):
    torch.set_num_threads(1)
    (train, _), (train2, _), _ = tiny_tasks()
    model, method = build("lamaml", second_order=second_order)
    before = [a.clone() for a in method.learning_rates()]
    train_task(method, train[0][:60], train[1][:60], task=0)
    train_task(method, train2[0][:60], train2[1][:60], task=1)
    after = method.learning_rates()
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    total = sum(a.numel() for a in after)
    assert changed > 0.5 * total, f"only {changed}/{total} learning rates changed"
    assert all((a >= 0).all() for a in after)  # relu-clipped


def test_lamaml_second_order_differs_from_first_order():
    torch.set_num_threads(1)
    (train, _), *_ = tiny_tasks()
    outs = []
    for so in (False, True):
        _, method = build("lamaml", second_order=so)
        train_task(method, train[0][:40], train[1][:40], task=0)
        outs.append(torch.cat([a.reshape(-1) for a in method.learning_rates()]))
    assert not torch.allclose(outs[0], outs[1])


def _package_mlp(multi_head: bool):
    """The package's MNIST model (models.MLP) at the tiny stream's sizes; multi-head: one head
    of 2 classes per task over 6 classes."""
    from emcl_continual.data.models import MLP
    from emcl_continual.data.streams import StreamInfo

    heads = [(2 * k, 2 * k + 2) for k in range(N_TASKS)] if multi_head else [(0, N_CLASSES)] * N_TASKS
    info = StreamInfo("tiny", N_TASKS, (D_IN,), 2 * N_TASKS if multi_head else N_CLASSES, heads, multi_head)
    torch.manual_seed(0)
    return MLP(info, hidden=32), info


@pytest.mark.parametrize("multi_head", [False, True])
def test_mlp_forward_with_is_functional_call_bit_for_bit(multi_head):
    """La-MAML's fast forward: the same logits and the same gradients (first and second
    order) as torch.func.functional_call with the same weights, bit for bit."""
    from torch.func import functional_call

    model, _ = _package_mlp(multi_head)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(p.shape, generator=g).mul_(0.3).requires_grad_(True) for p in model.parameters()]
    x = torch.randn(7, D_IN, generator=g)
    task = torch.tensor([0, 1, 2, 0, 1, 2, 2]) if multi_head else 0
    names = [n for n, _ in model.named_parameters()]
    ref = functional_call(model, dict(zip(names, weights)), (x, task))
    out = model.forward_with(weights, x, task)
    assert torch.equal(out, ref)
    y = torch.randint(0, 2, (7,), generator=g)
    for create_graph in (False, True):
        ga = torch.autograd.grad(torch.nn.functional.cross_entropy(ref, y), weights, retain_graph=True,
                                 create_graph=create_graph)
        gb = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y), weights, retain_graph=True,
                                 create_graph=create_graph)
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
    with pytest.raises(ValueError, match="5 weights for an MLP with 6"):
        model.forward_with(weights[:5], x, task)


@pytest.mark.parametrize("second_order", [False, True])
def test_lamaml_on_the_mlp_trains_the_same_through_forward_with(second_order):
    """La-MAML takes the MLP's forward_with; its run is the functional_call run, bit for bit."""
    torch.set_num_threads(1)
    (train, _), (train2, _), _ = tiny_tasks()
    finals = []
    for fast in (True, False):
        model, info = _package_mlp(False)
        method = get_method("lamaml")(model, info, small_config("lamaml", second_order=second_order),
                                      torch.device("cpu"))
        assert method.uses_forward_with is True
        method.uses_forward_with = fast
        train_task(method, train[0][:60], train[1][:60], task=0)
        train_task(method, train2[0][:60], train2[1][:60], task=1)
        finals.append([p.detach().clone() for p in model.parameters()] + method.learning_rates())
    assert all(torch.equal(a, b) for a, b in zip(*finals))
    model, info = _package_mlp(False)
    model.net[0].weight.requires_grad_(False)        # a frozen parameter: functional_call serves
    assert get_method("lamaml")(model, info, small_config("lamaml"), torch.device("cpu")).uses_forward_with is False


def test_mer_fast_path_matches_autograd():
    """The hand-written ReLU-MLP per-sample step gives the same trajectory as the autograd path."""
    torch.set_num_threads(1)
    (train, _), (train2, _), _ = tiny_tasks()
    results = []
    for fast in (True, False):
        model, method = build("mer", fast_mlp=fast, gamma=0.7, grad_clip=1.0)
        assert method.uses_fast_path is fast
        train_task(method, train[0][:30], train[1][:30], task=0)
        train_task(method, train2[0][:20], train2[1][:20], task=1)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-5)


def test_mer_fast_path_rejects_other_models():
    class Odd(TinyMLP):
        def forward(self, x, task):
            return torch.tanh(self.net(x.reshape(x.shape[0], -1)))
    cfg = small_config("mer")
    method = get_method("mer")(Odd(), tiny_info(), cfg, torch.device("cpu"))
    assert not method.uses_fast_path


def test_ewc_summed_penalty_has_the_per_task_gradient():
    """EWC keeps one summed quadratic; its gradient equals the GEM code's sum over tasks."""
    torch.set_num_threads(1)
    tasks = tiny_tasks()
    model, method = build("ewc")
    fishers, anchors = [], []
    gen = torch.Generator().manual_seed(7)
    for k, (train, _) in enumerate(tasks):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        method.mem_x, method.mem_y = train[0][:10], train[1][:10]
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(train[0][:10], k), train[1][:10]).backward()
        fishers.append([p.grad.detach().pow(2) for p in model.parameters()])
        anchors.append([p.detach().clone() for p in model.parameters()])
        method._consolidate(k)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    model.zero_grad()
    method.penalty().backward()
    for i, p in enumerate(model.parameters()):
        expected = sum(2 * f[i] * (p.detach() - a[i]) for f, a in zip(fishers, anchors))
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6)


def test_gem_batched_memory_grads_match_loop():
    """GEM's vmap over the task memories gives the per-task backward passes' gradients."""
    torch.set_num_threads(1)
    tasks = tiny_tasks()
    model, method = build("gem")
    for k, (train, _) in enumerate(tasks):
        train_task(method, train[0][:40], train[1][:40], task=k)
    assert method.batched
    past = method.memory.tasks()
    batched = method.memory_grads(past)
    method.batched = False
    looped = method.memory_grads(past)
    assert batched.shape == (len(past), sum(p.numel() for p in model.parameters()))
    torch.testing.assert_close(batched, looped, rtol=1e-4, atol=1e-6)
