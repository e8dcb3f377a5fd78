"""EMCL inside Avalanche (emcl_continual.avalanche.EMCLStrategy).

Needs avalanche-lib 0.6.0 (``make setup-avalanche``, or ``pip install --no-build-isolation -e '.[avalanche]'``);
skipped with the reason where it is not installed, except the test of the error an absent Avalanche gives.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_absent_avalanche_names_the_install_command():
    """Importing the module without avalanche-lib raises an ImportError that says how to install
    it; the rest of the package never imports it."""
    code = ("import sys; sys.modules['avalanche'] = None\n"
            "import emcl_continual, emcl_continual.data.streams, emcl_continual.training.train\n"
            "assert 'avalanche' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n    import emcl_continual.avalanche\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('imported without avalanche')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python"),
                                                        os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pip install avalanche-lib==0.6.0" in out.stdout and "-e '.[avalanche]'" in out.stdout, out.stdout


try:
    import avalanche
except ImportError:  # the tests below skip; the one above runs
    avalanche = None
needs_avalanche = pytest.mark.skipif(avalanche is None,
                                     reason="avalanche-lib is not installed (make setup-avalanche)")

if avalanche is not None:
    from avalanche.evaluation.metrics import accuracy_metrics
    from avalanche.models import IncrementalClassifier, MultiHeadClassifier, MultiTaskModule
    from avalanche.training.plugins import EvaluationPlugin, SupervisedPlugin

    from emcl_continual.avalanche import PRESETS, EMCLStrategy, avalanche_benchmark
else:
    MultiTaskModule = SupervisedPlugin = object

from emcl_continual.core import metrics  # noqa: E402
from emcl_continual.data.models import build_model  # noqa: E402
from emcl_continual.data.streams import make_stream  # noqa: E402
from emcl_continual.training.train import run  # noqa: E402

N_TASKS, PER_TASK = 3, 60


@pytest.fixture(scope="module")
def stream():
    return make_stream("permuted-mnist", 0, n_tasks=N_TASKS, samples_per_task=PER_TASK)


def _evaluator():
    return EvaluationPlugin(accuracy_metrics(experience=True, stream=True), loggers=[])


def _avalanche_run(stream, seed=0, **kwargs):
    """The strategy on the stream's batches in order; this project's accuracy matrix after each
    experience and Avalanche's metrics of the last evaluation."""
    torch.manual_seed(seed)
    model = build_model(stream.info)  # as train.run builds it
    strategy = EMCLStrategy(model=model, evaluator=_evaluator(), seed=seed, **kwargs)
    bench = avalanche_benchmark(stream)
    matrix, last = [], None
    for exp in bench.train_stream:
        strategy.train(exp, shuffle=False, eval_streams=[])
        matrix.append(metrics.evaluate(model, stream.test))
        last = strategy.eval(bench.test_stream)
    return strategy, matrix, last


# --method emcl's defaults on permuted-mnist: Table II's column with the selected beta = 0.03
MNIST = dict(preset="permuted-mnist", inner_lr=0.03)


@needs_avalanche
@pytest.mark.parametrize("change", [{}, {"glances": 2}, {"importance_norm": "tensor"}],
                         ids=["algorithm-1", "glances-2", "importance-norm-tensor"])
def test_strategy_equals_method_emcl_on_the_same_batches(stream, change, one_torch_thread):
    # the strategy's inner loop is autograd's, so the method's is too (not the fused glance)
    ref = run("emcl", stream, 0, overrides=dict(change, fused_glance=False),
              progress=False)["acc_matrix"]
    strategy, got, _ = _avalanche_run(stream, **MNIST, **change)
    diff = max(abs(a - b) for ra, rb in zip(got, ref) for a, b in zip(ra, rb))
    print(f"{change}: max |R_avalanche - R_emcl| = {diff:.3g} (points of %)\n{got}\n{ref}")
    assert len(got) == N_TASKS
    assert diff <= 1e-5, f"{change}: accuracy matrices differ by {diff}:\n{got}\n{ref}"
    assert strategy.buffer is not None and len(strategy.buffer) == min(200, N_TASKS * PER_TASK)
    assert strategy.optimizer.param_groups[0]["lr"] == 0.03


@needs_avalanche
def test_avalanche_metrics_match_this_projects_acc(stream, one_torch_thread):
    _, matrix, last = _avalanche_run(stream, **MNIST)
    final = matrix[-1]
    for j in range(N_TASKS):
        key = f"Top1_Acc_Exp/eval_phase/test_stream/Task{j:03d}/Exp{j:03d}"
        assert abs(100.0 * last[key] - final[j]) <= 1e-9, (key, last[key], final[j])
    stream_key = next(k for k in last if k.startswith("Top1_Acc_Stream/eval_phase/test_stream"))
    # every task's test set has the same size here, so the stream accuracy is ACC (the mean)
    assert len({len(td) for td in stream.test}) == 1
    assert abs(100.0 * last[stream_key] - metrics.acc(matrix)) <= 1e-9


@needs_avalanche
def test_avalanches_own_loggers_are_kept(stream, tmp_path, one_torch_thread):
    """EMCLStrategy keeps the evaluator's loggers: Avalanche's TensorboardLogger writes every metric
    of every evaluation, read back with TensorBoard's event reader and equal to what eval returned."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (make setup-trackers)")
    from avalanche.logging import TensorboardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorboardLogger(tb_log_dir=str(tmp_path))
    evaluator = EvaluationPlugin(accuracy_metrics(experience=True, stream=True), loggers=[tb])
    torch.manual_seed(0)
    strategy = EMCLStrategy(model=build_model(stream.info), evaluator=evaluator, seed=0, **MNIST)
    assert any(lg is tb for lg in strategy.evaluator.loggers)
    bench = avalanche_benchmark(stream)
    returned = []
    for exp in bench.train_stream:
        strategy.train(exp, shuffle=False, eval_streams=[])
        returned.append(strategy.eval(bench.test_stream))
    tb.writer.flush()
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    stream_key = next(k for k in returned[-1] if k.startswith("Top1_Acc_Stream/eval_phase/test_stream"))
    assert stream_key in tags, sorted(tags)
    logged = [e.value for e in ea.Scalars(stream_key)]
    assert logged == pytest.approx([r[stream_key] for r in returned], abs=1e-6)
    for j in range(N_TASKS):
        key = f"Top1_Acc_Exp/eval_phase/test_stream/Task{j:03d}/Exp{j:03d}"
        assert ea.Scalars(key)[-1].value == pytest.approx(returned[-1][key], abs=1e-6)


class MultiHeadMLP(MultiTaskModule):
    """A trunk and Avalanche's MultiHeadClassifier: a new head per new task label."""

    def __init__(self, hidden=32):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(784, hidden), nn.ReLU())
        self.classifier = MultiHeadClassifier(hidden, initial_out_features=10)

    def forward_single_task(self, x, task_label):
        return self.classifier(self.trunk(x), task_label)


class Recorder(SupervisedPlugin):
    """Records the parameters and the optimizer's state once the experience's model adaptation
    and make_optimizer have run (before its first batch), and at its end."""

    def __init__(self):
        super().__init__()
        self.start, self.end = [], []

    @staticmethod
    def _snapshot(strategy):
        opt = strategy.optimizer
        params = {n: p.detach().clone() for n, p in strategy.model.named_parameters()}
        held = {n for n, p in strategy.model.named_parameters()
                if any(q is p for g in opt.param_groups for q in g["params"])}
        imp = {n: opt.state[p]["importance"].clone() for n, p in strategy.model.named_parameters()
               if "importance" in opt.state.get(p, {})}
        return {"params": params, "held": held, "importance": imp, "groups": len(opt.param_groups)}

    def before_training_epoch(self, strategy, **kwargs):
        self.start.append(self._snapshot(strategy))

    def after_training_exp(self, strategy, **kwargs):
        self.end.append(self._snapshot(strategy))


@needs_avalanche
@pytest.mark.parametrize("importance_norm", [None, "tensor"])
def test_growing_multi_head_model_trains_its_new_heads(stream, importance_norm, one_torch_thread):
    torch.manual_seed(0)
    model = MultiHeadMLP()
    rec = Recorder()
    strategy = EMCLStrategy(model=model, preset="permuted-mnist", memory=50,  # Table II's beta 0.15
                            importance_norm=importance_norm, evaluator=_evaluator(), plugins=[rec])
    opt = strategy.optimizer
    bench = avalanche_benchmark(stream)
    diagonal = []  # accuracy on task t after training on it (its head exists from experience t on)
    for t, exp in enumerate(bench.train_stream):
        strategy.train(exp, shuffle=False, eval_streams=[])
        res = strategy.eval(bench.test_stream[t:t + 1])
        diagonal.append(res[f"Top1_Acc_Exp/eval_phase/test_stream/Task{t:03d}/Exp{t:03d}"])
    assert strategy.optimizer is opt
    for t in range(N_TASKS):
        head = [f"classifier.classifiers.{t}.classifier.weight", f"classifier.classifiers.{t}.classifier.bias"]
        start, end = rec.start[t], rec.end[t]
        for name in head:
            assert name in start["params"], f"task {t}: no head {name} after model adaptation"
            assert name in start["held"], f"task {t}: {name} is not in the optimizer's param groups"
            moved = float((end["params"][name] - start["params"][name]).abs().max())
            assert moved > 1e-4, f"task {t}: the new head {name} did not train (moved {moved})"
            assert float(end["importance"][name].abs().sum()) > 0, f"task {t}: {name} has no importance"
        if t > 0:  # the heads of earlier tasks keep training on the replayed samples, with their state
            old = f"classifier.classifiers.{t - 1}.classifier.weight"
            assert torch.equal(start["importance"][old], rec.end[t - 1]["importance"][old])
    print(f"importance_norm={importance_norm}: accuracy on task t after task t: {diagonal}")
    if importance_norm == "tensor":
        # a group per tensor, the new ones with the strategy's hyper-parameters
        assert rec.end[-1]["groups"] == len(list(model.parameters()))
        keys = ("meta_lr", "lr", "reg", "decay", "lr_mode", "eps", "importance", "prox")
        first = opt.param_groups[0]
        for g in opt.param_groups[1:]:
            assert all(g[k] == first[k] for k in keys), (g, first)
    else:
        assert rec.end[-1]["groups"] == 1
        # each new head learned its task: above chance (10 %) after its 60 samples (seeded: 20-28 %;
        # a new head's init draws from torch's global generator, which Avalanche's data loaders also
        # advance: the numbers depend on how many loaders ran before, not on chance between runs)
        assert min(diagonal) > 0.15, diagonal


@needs_avalanche
@pytest.mark.parametrize("policy", ["keep", "reset"])
def test_optimizer_state_across_experiences(stream, policy, one_torch_thread):
    torch.manual_seed(0)
    rec = Recorder()
    strategy = EMCLStrategy(model=build_model(stream.info), preset="permuted-mnist", inner_lr=0.03,
                            memory=50, optimizer_state=policy, evaluator=_evaluator(), plugins=[rec])
    bench = avalanche_benchmark(stream)
    for exp in list(bench.train_stream)[:2]:
        # reset_optimizer_state=True is what Avalanche's own reset asks for at a boundary
        strategy.train(exp, shuffle=False, eval_streams=[], reset_optimizer_state=True)
    assert rec.end[0]["importance"], "no state after the first experience"
    if policy == "keep":
        for name, h in rec.end[0]["importance"].items():
            assert torch.equal(rec.start[1]["importance"][name], h), name
    else:
        assert rec.start[1]["importance"] == {}
        assert rec.end[1]["importance"]  # made again by the next steps


@needs_avalanche
def test_presets_by_name_and_overrides(stream):
    model = build_model(stream.info)
    s = EMCLStrategy(model=model, preset="split-cifar100", evaluator=_evaluator())
    g = s.optimizer.param_groups[0]
    assert (g["meta_lr"], g["lr"], g["reg"], g["gamma"]) == (0.1, 0.075, 50.0, 0.1)
    assert s.memory == PRESETS["split-cifar100"]["memory"] == 200
    s = EMCLStrategy(model=model, preset="many-permutations", gamma=0.5, memory=0, evaluator=_evaluator())
    g = s.optimizer.param_groups[0]
    assert (g["meta_lr"], g["lr"], g["gamma"]) == (0.15, 0.03, 0.5)
    assert s.memory == 0
    with pytest.raises(ValueError, match="unknown preset"):
        EMCLStrategy(model=model, preset="nope", evaluator=_evaluator())
    with pytest.raises(ValueError, match="glances"):
        EMCLStrategy(model=model, glances=0, evaluator=_evaluator())
    with pytest.raises(ValueError, match="optimizer_state"):
        EMCLStrategy(model=model, optimizer_state="wipe", evaluator=_evaluator())


class GrowingMLP(nn.Module):
    """A trunk and Avalanche's IncrementalClassifier: the head tensor is replaced by a wider one
    when an experience brings new classes."""

    def __init__(self, hidden=32):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(784, hidden), nn.ReLU())
        self.classifier = IncrementalClassifier(hidden, initial_out_features=2)

    def forward(self, x):
        return self.classifier(self.trunk(x))


@needs_avalanche
def test_grown_head_tensor_is_trained_with_fresh_state(one_torch_thread):
    """Class-incremental digits {0,1}, {2,3}, {4,5}: Avalanche swaps the head's weight for a wider
    tensor in the same param group; the optimizer steps the new tensor (state made at its first step)."""
    from avalanche.benchmarks import tensors_benchmark
    pool = make_stream("permuted-mnist", 0, n_tasks=1, samples_per_task=1000).train[0]
    train, test = [], []
    for c in range(3):
        sel = (pool.y == 2 * c) | (pool.y == 2 * c + 1)
        x, y = pool.x[sel], pool.y[sel]
        train.append((x[:60], y[:60]))
        test.append((x[60:], y[60:]))
    bench = tensors_benchmark(train, test, task_labels=[0, 0, 0], complete_test_set_only=False)
    torch.manual_seed(0)
    model = GrowingMLP()
    rec = Recorder()
    strategy = EMCLStrategy(model=model, preset="permuted-mnist", memory=50, evaluator=_evaluator(),
                            plugins=[rec])
    for exp in bench.train_stream:
        strategy.train(exp, shuffle=False, eval_streams=[])
    name = "classifier.classifier.weight"
    for t in range(3):
        start, end = rec.start[t], rec.end[t]
        assert start["params"][name].shape[0] == 2 * (t + 1)
        assert name in start["held"], f"experience {t}: the grown head is not in the optimizer"
        assert float((end["params"][name] - start["params"][name]).abs().max()) > 1e-4
        assert end["importance"][name].shape == end["params"][name].shape
    assert rec.end[-1]["groups"] == 1
    assert len(strategy.optimizer.state) == len(list(model.parameters()))  # the replaced tensors' state is gone
