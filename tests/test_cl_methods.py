"""The Method base: what a method declares in its one file (defaults, Table II values, rules,
validate, optimizer), the task hooks train.run calls, and the package's import graph."""
from __future__ import annotations

import ast
import os

import pytest
import torch
import torch.nn.functional as F

from emcl_continual.data import streams
from emcl_continual.training import config, train
from emcl_continual.training.config import ConfigError
from emcl_continual.methods import METHODS, Method, get_method
from emcl_continual.core.schema import float_rule, int_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "python", "emcl_continual")


def _tiny_stream(n_tasks: int = 3, per_task: int = 30, seed: int = 0) -> streams.Stream:
    g = torch.Generator().manual_seed(seed)
    info = streams.StreamInfo("permuted-mnist", n_tasks, (784,), 10, [(0, 10)] * n_tasks, False)

    def task(t, n):
        return streams.TaskData(torch.rand(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g), t)

    return streams.Stream(info, [task(t, per_task) for t in range(n_tasks)], [task(t, 10) for t in range(n_tasks)])


# --------------------------------------------------------------------------- a new method is one file
class Recorder(Method):
    """A method written the way a new one is: its defaults, rules and validate() beside its code."""

    name = "recorder"
    DEFAULTS = {"permuted-mnist": {"lr": 0.05, "visits": 1}}
    RULES = {"lr": float_rule(open_=True), "visits": int_rule(1)}
    calls: list = []

    @classmethod
    def validate(cls, config: dict) -> None:
        if config["lr"] * config["visits"] > 1:
            raise ValueError("visits times lr must stay <= 1")

    def begin_task(self, task: int) -> None:
        Recorder.calls.append(("begin", task))

    def end_task(self, task: int) -> None:
        Recorder.calls.append(("end", task))

    def observe(self, x, y, task):
        Recorder.calls.append(("observe", task))
        for _ in range(self.config["visits"]):
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x, task), y)
            loss.backward()
            self.opt.step()
        return float(loss.detach())


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setitem(METHODS, "recorder", f"{__name__}:Recorder")
    Recorder.calls = []
    return Recorder


def test_a_new_method_is_one_class_and_one_line_in_the_registry(recorder):
    stream = _tiny_stream()
    r = train.run("recorder", stream, 0, overrides={"visits": 2}, progress=False)
    assert r["config"] == {"init": "torch", "lr": 0.05, "visits": 2, "seed": 0}
    # train.run calls the hooks around each task's batches (3 batches of 10 per task)
    expected = [c for t in range(3) for c in [("begin", t)] + [("observe", t)] * 3 + [("end", t)]]
    assert Recorder.calls == expected
    # the method's rules and validate() are the command line's checks
    with pytest.raises(ConfigError, match="visits must be an integer >= 1, got 0"):
        config.build_config("recorder", "permuted-mnist", 0, {"visits": 0})
    with pytest.raises(ConfigError, match="override visits=30: visits times lr must stay <= 1"):
        config.build_config("recorder", "permuted-mnist", 0, {"visits": 30})
    with pytest.raises(ConfigError, match="recorder has no hyper-parameter 'visit'; did you mean 'visits'"):
        config.build_config("recorder", "permuted-mnist", 0, {"visit": 3})
    assert config.known_keys("recorder", "permuted-mnist") == {"init": "torch", "lr": 0.05, "visits": 1}


def test_the_base_owns_model_config_device_generator_and_optimizer(recorder):
    stream = _tiny_stream()
    model = torch.nn.Linear(784, 10)
    m = Recorder(model, stream.info, {"lr": 0.05, "visits": 1, "seed": 3}, "cpu")
    assert m.device == torch.device("cpu") and m.config["seed"] == 3
    assert isinstance(m.opt, torch.optim.SGD) and m.opt.param_groups[0]["lr"] == 0.05
    same = torch.Generator().manual_seed(3 * 1_000_003 + Method.GENERATOR_OFFSET)
    assert torch.equal(torch.randperm(50, generator=m.generator), torch.randperm(50, generator=same))
    with pytest.raises(ConfigError, match="recorder: missing hyper-parameter"):
        Recorder(model, stream.info, {"lr": 0.05}, "cpu")
    with pytest.raises(ConfigError, match="recorder: lr must be a number > 0"):
        Recorder(model, stream.info, {"lr": 0.0, "visits": 1}, "cpu")


@pytest.mark.parametrize("name", list(METHODS))
def test_every_key_of_every_method_has_its_rule_in_its_class(name):
    cls = get_method(name)
    for stream in ("permuted-mnist", "rotated-mnist", "many-permutations", "split-cifar100"):
        keys = cls.keys(stream)
        assert set(keys) == set(cls.RULES), (name, stream, set(keys) ^ set(cls.RULES))
        assert cls.check(dict(keys, seed=0))["seed"] == 0


# Where a method's defaults leave Table II, and why (each file's docstring says more): EMCL's β
# was selected on validation data; La-MAML runs its own script's values (Table II swaps them).
LEAVES_TABLE_II = {("emcl", "permuted-mnist", "inner_lr"), ("lamaml", "permuted-mnist", "alpha_init"),
                   ("lamaml", "permuted-mnist", "eta")}


@pytest.mark.parametrize("name", list(METHODS))
def test_table_ii_is_declared_by_each_method_and_its_defaults_follow_it(name):
    cls = get_method(name)
    for stream, values in getattr(cls, "TABLE_II", {}).items():
        defaults = cls.defaults(stream)
        for key, value in values.items():
            if (name, stream, key) not in LEAVES_TABLE_II:
                assert defaults[key] == value, (name, stream, key)


# --------------------------------------------------------------------------- EWC consolidates at the task end
def test_ewc_consolidates_in_end_task_not_by_guessing_from_the_task_id():
    stream = _tiny_stream()
    cfg = config.build_config("ewc", "permuted-mnist", 0)
    torch.manual_seed(0)
    from emcl_continual.data.models import build_model

    ewc = get_method("ewc")(build_model(stream.info), stream.info, cfg, "cpu")
    for x, y in stream.batches(0, 10):
        ewc.observe(x, y, 0)
    assert ewc.n_consolidated == 0
    for x, y in stream.batches(1, 10):  # a new task id without end_task: nothing is guessed
        ewc.observe(x, y, 1)
    assert ewc.n_consolidated == 0
    ewc.end_task(1)
    assert ewc.n_consolidated == 1 and ewc.mem_x is None
    assert any(float(f.abs().sum()) > 0 for f in ewc.fisher_sum)
    ewc.end_task(2)  # a task without batches adds nothing
    assert ewc.n_consolidated == 1


# --------------------------------------------------------------------------- no import circles
def _imports(path: str, module: str, modules: set) -> set:
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            named = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            out.update(named or ([target] if target in modules else []))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
    return out - {module}


def test_no_import_circles_in_the_package():
    """Every import in the package, at the top of a module or inside a function, goes one way."""
    files = {}
    for folder, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, n), os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                files[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, n)
    graph = {m: _imports(p, m, set(files)) for m, p in files.items()}
    # a module importing its own package's __init__ is not a circle of ours to break
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    circles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)
    for leaf in ("emcl_continual.core.errors", "emcl_continual.core.schema", "emcl_continual.core.fileio"):
        assert graph[leaf] <= {"emcl_continual.core.errors"}, (leaf, graph[leaf])
    assert "emcl_continual.reports.compare" not in graph["emcl_continual.output.rundir"]
    assert "emcl_continual.training.train" not in graph["emcl_continual.training.config"]
