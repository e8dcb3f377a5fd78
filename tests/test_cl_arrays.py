"""Run arrays (emcl_continual.arrays): N runs of one method trained together.

What is checked, on tiny Permuted-MNIST streams (2 tasks of 30 samples) with the real
methods: an array of one gives the run alone's bits (every method but MER, whose run alone
steps with NumPy's BLAS; EMCL in each variant its array serves); inside a wider array every run makes exactly the draws it makes
alone (every generator call recorded both ways), starts from the same weights and sees the
same batches in the same order, and ends within rounding of its run alone; La-MAML's
hand-written meta-gradients equal autograd's (float64) to rounding; a run that
diverges is dropped and reported while the others finish; the selection's ``--array``
through the local executor gives the runs, numbers and selection of ``--array off``, records
the array, and resumes only the unfinished runs; Ray runs an array as one task (skips
without Ray, ``make setup-ray``).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from emcl_continual import arrays
from emcl_continual.core import presets
from emcl_continual.sweep import executors as sweep, selection
from emcl_continual.arrays import base as array_base
from emcl_continual.arrays.train import run_array
from emcl_continual.methods import get_method
from emcl_continual.methods.base import Method
from emcl_continual.data.models import build_model
from emcl_continual.data.streams import make_stream
from emcl_continual.training.train import run

STREAM = "permuted-mnist"
SMALL = dict(n_tasks=2, samples_per_task=30)
BITWISE = ["sgd", "er", "ewc", "agem", "gem", "lamaml", "emcl"]
EVERY = BITWISE + ["mer"]
#: a second configuration of each method (a per-run key changed)
OTHER = {"sgd": {"lr": 0.01}, "er": {"lr": 0.03}, "gem": {"lr": 0.1}, "ewc": {"lr": 0.03, "reg": 1.0}, "agem": {"lr": 0.1},
         "lamaml": {"alpha_init": 0.3, "eta": 0.15}, "mer": {"lr": 0.01, "beta": 0.1},
         "emcl": {"inner_lr": 0.1, "gamma": 0.2, "lr_scale": 0.05}}


MLP_STREAMS = ("permuted-mnist", "rotated-mnist", "many-permutations")
_BUILT: dict = {}


def _streams(name):
    if name not in _BUILT:
        _BUILT[name] = {s: make_stream(name, s, **SMALL) for s in (0, 1)}
    return _BUILT[name]


@pytest.fixture(scope="module")
def streams():
    return _streams(STREAM)


def _alone(method, streams, seed, overrides):
    return run(method, streams[seed], seed, overrides=overrides, progress=False)


@pytest.mark.parametrize("method", BITWISE)
def test_an_array_of_one_gives_the_run_alones_bits(method, streams):
    alone = _alone(method, streams, 0, {})
    (rec,), failed = run_array(method, STREAM, [{"seed": 0, "overrides": {}}], streams=streams)
    assert not failed
    for field in ("acc", "bwt", "acc_matrix", "acc_before", "metrics", "task_losses", "config", "split", "n_tasks"):
        assert rec[field] == alone[field], field
    assert rec["array"]["width"] == 1 and rec["array"]["index"] == 0
    assert set(alone) <= set(rec)          # today's schema, plus the array


class _Recorder:
    """Every call of torch.randperm / torch.randint with a generator, by generator."""

    def __init__(self, monkeypatch):
        self.calls: dict = {}
        for name in ("randperm", "randint"):
            real = getattr(torch, name)

            def wrapped(*args, _real=real, _name=name, **kwargs):
                out = _real(*args, **kwargs)
                g = kwargs.get("generator")
                if g is not None:
                    self.calls.setdefault(id(g), []).append((_name, args, out.tolist()))
                return out
            monkeypatch.setattr(torch, name, wrapped)


@pytest.mark.parametrize("stream", MLP_STREAMS)
@pytest.mark.parametrize("method", EVERY)
def test_every_run_of_an_array_makes_the_draws_it_makes_alone(method, stream, monkeypatch):
    """Runs (seed 0, default), (seed 1, default), (seed 0, another configuration): each one's
    generator calls, initial weights and batches, recorded alone and in the array of three, on
    each MLP stream."""
    streams = _streams(stream)
    runs = [{"seed": 0, "overrides": {}}, {"seed": 1, "overrides": {}}, {"seed": 0, "overrides": OTHER[method]}]
    rec = _Recorder(monkeypatch)
    seen_alone, gens_alone, init_alone = [], [], []
    cls = get_method(method)
    real_init, real_observe = cls.__init__, cls.observe

    def init(self, model, *a, **k):
        init_alone.append([p.detach().clone() for p in model.parameters()])
        real_init(self, model, *a, **k)
        gens_alone.append(self.generator)       # held: an id is unique only while its object lives

    def observe(self, x, y, task):
        seen_alone[-1].append(y.clone())
        return real_observe(self, x, y, task)
    monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(cls, "observe", observe)
    alone = []
    for r in runs:
        seen_alone.append([])
        alone.append(_alone(method, streams, r["seed"], r["overrides"]))
    monkeypatch.setattr(cls, "__init__", real_init)
    monkeypatch.setattr(cls, "observe", real_observe)

    learner_cls = arrays.get_learner(method)
    captured = {}
    real_ainit, real_aobserve = learner_cls.__init__, learner_cls.observe

    def ainit(self, weights, *a, **k):
        captured["init"] = [w.detach().clone() for w in weights]
        real_ainit(self, weights, *a, **k)
        captured["gens"] = list(self.generators)
        captured["seen"] = []

    def aobserve(self, x, y, task):
        captured["seen"].append(y.clone())
        return real_aobserve(self, x, y, task)
    monkeypatch.setattr(learner_cls, "__init__", ainit)
    monkeypatch.setattr(learner_cls, "observe", aobserve)
    records, failed = run_array(method, stream, runs, streams=streams)
    assert not failed and len(records) == 3
    for r in range(3):
        mine = rec.calls.get(id(captured["gens"][r]), [])
        theirs = rec.calls.get(id(gens_alone[r]), [])
        assert mine == theirs, f"run {r}: {len(mine)} draws in the array, {len(theirs)} alone"
        assert all(torch.equal(w[r], p) for w, p in zip(captured["init"], init_alone[r]))
        assert len(captured["seen"]) == len(seen_alone[r])
        assert all(torch.equal(a[r], b) for a, b in zip(captured["seen"], seen_alone[r]))
    if method in ("er", "lamaml", "mer", "emcl"):   # SGD and EWC draw nothing, A-GEM only past ref_batch (below)
        assert all(rec.calls.get(id(g)) for g in captured["gens"])
    for r in range(3):        # and ends where the run alone ends, to rounding
        assert abs(records[r]["acc"] - alone[r]["acc"]) <= 2.0
        for a, b in zip(records[r]["task_losses"], alone[r]["task_losses"]):
            assert a == pytest.approx(b, rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("learn_lr", [True, False])
def test_lamamls_hand_written_meta_gradients_are_autograds(streams, learn_lr):
    """La-MAML's array computes the first-order meta-gradients by hand, the first layer's fast
    weights implicit (arrays/lamaml.py): against autograd through the inner loop in float64, on
    three runs whose learning rates have both signs (the relu and its mask matter), with and
    without a replay part in the meta batch; with ``learn_lr`` off no learning-rate gradient is
    made and an update leaves the learning rates as they are."""
    from emcl_continual.arrays.base import ce_per_run, mlp_forward
    from emcl_continual.training.config import build_config
    info = streams[0].info
    models = []
    for s in range(3):
        torch.manual_seed(s)
        models.append(build_model(info))
    configs = [build_config("lamaml", STREAM, s, {"learn_lr": learn_lr}) for s in range(3)]
    arr = arrays.get_learner("lamaml")(array_base.stack_weights(models), info, configs, "cpu")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for a in arr.alpha:
            a.add_(torch.randn(a.shape, generator=gen) * 0.2)
    n = 10
    x, y = torch.rand(3, n, 784, generator=gen), torch.randint(0, 10, (3, n), generator=gen)
    for replay in (0, 10):
        bx = torch.cat((torch.rand(3, replay, 784, generator=gen), x), 1)
        by = torch.cat((torch.randint(0, 10, (3, replay), generator=gen), y), 1)
        W = [w.detach().double().requires_grad_(True) for w in arr.weights]
        A = [a.detach().double().requires_grad_(True) for a in arr.alpha]
        fast, losses = list(W), []
        for i in range(n):
            g = torch.autograd.grad(ce_per_run(mlp_forward(fast, x[:, i:i + 1].double()), y[:, i:i + 1]).sum(), fast)
            fast = [w - gi * torch.relu(a) for w, gi, a in zip(fast, g, A)]
            losses.append(ce_per_run(mlp_forward(fast, bx.double()), by))
        meta = torch.stack(losses, 1).mean(1)
        grads = torch.autograd.grad(meta.sum(), W + A)
        got, wg, ag, scale = arr._meta_grads_first_order(x, y, bx, by)
        assert torch.allclose(got.double(), meta.detach(), rtol=1e-5, atol=0)
        for mine, ref in zip(wg, grads[:len(W)]):
            assert (mine.double() * scale - ref).abs().max() <= 1e-5 * ref.abs().max()
        if learn_lr:
            assert any(bool((a < 0).any()) for a in arr.alpha)
            for mine, ref in zip(ag, grads[len(W):]):
                assert (-mine.double() * scale - ref).abs().max() <= 1e-5 * ref.abs().max()
        else:
            assert ag is None
    before = [a.detach().clone() for a in arr.alpha]
    w0 = [w.detach().clone() for w in arr.weights]
    arr.observe(x, y, 0)
    assert all(torch.equal(a, b) for a, b in zip(arr.alpha, before)) != learn_lr
    assert not any(torch.equal(w, v) for w, v in zip(arr.weights, w0))


def test_agem_draws_its_reference_batch_per_run_when_the_memory_outgrows_it(streams, monkeypatch):
    runs = [{"seed": 0, "overrides": {"ref_batch": 5}}, {"seed": 1, "overrides": {"ref_batch": 5}}]
    rec = _Recorder(monkeypatch)
    gens = {}
    real = Method.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        gens[len(gens)] = self.generator
    monkeypatch.setattr(Method, "__init__", init)
    for r in runs:
        _alone("agem", streams, r["seed"], r["overrides"])
    monkeypatch.setattr(Method, "__init__", real)
    cap = {}
    real_a = array_base.ArrayLearner.__init__

    def ainit(self, *a, **k):
        real_a(self, *a, **k)
        cap["gens"] = list(self.generators)
    monkeypatch.setattr(array_base.ArrayLearner, "__init__", ainit)
    run_array("agem", STREAM, runs, streams=streams)
    for r in range(2):
        assert rec.calls[id(cap["gens"][r])] == rec.calls[id(gens[r])] and rec.calls[id(gens[r])]


def test_a_run_that_diverges_is_dropped_and_the_others_finish(streams):
    runs = [{"seed": 0, "overrides": {}}, {"seed": 1, "overrides": {"lr": 1e30}}, {"seed": 1, "overrides": {}}]
    records, failed = run_array("sgd", STREAM, runs, streams=streams)
    assert [i for i, _ in failed] == [1] and "diverged" in failed[0][1]
    assert [r["array"]["index"] for r in records] == [0, 2]
    for r, (seed, ov) in zip(records, [(0, {}), (1, {})]):
        alone = _alone("sgd", streams, seed, ov)
        assert abs(r["acc"] - alone["acc"]) <= 2.0 and r["array"]["width"] == 3


def test_arrays_refuse_what_they_cannot_train(streams):
    with pytest.raises(ValueError, match="nosuch has no run array"):
        arrays.get_learner("nosuch")
    from emcl_continual.training.config import build_config
    for ov, word in (({"inner_lr_modulation": True}, "inner_lr_modulation"), ({"importance_norm": "tensor"}, "tensor"),
                     ({"fused_glance": False}, "fused_glance"), ({"cuda_graph": True}, "cuda_graph"),
                     ({"backend": "foreach"}, "foreach")):
        why = arrays.refusal("emcl", build_config("emcl", STREAM, 0, ov))
        assert why and word in why and "emcl with" in why, (ov, why)
        with pytest.raises(ValueError, match=word):
            run_array("emcl", STREAM, [{"seed": 0, "overrides": ov}], streams=streams)
    for ov in ({}, {"importance_norm": "global"}, {"glances": 2}, {"importance": "si"}):
        assert arrays.refusal("emcl", build_config("emcl", STREAM, 0, ov)) is None
    assert arrays.parse_array("auto") == "auto" and arrays.parse_array("1") == "off" and arrays.parse_array(8) == 8
    for bad in ("0", "-2", "wide"):
        with pytest.raises(ValueError, match="--array"):
            arrays.parse_array(bad)
    with pytest.raises(ValueError, match="differ only in seed and lr"):
        run_array("sgd", STREAM, [{"seed": 0, "overrides": {}}, {"seed": 0, "overrides": {"init": "xavier"}}],
                  streams=streams)
    from emcl_continual.data.streams import StreamInfo
    resnet = StreamInfo("split-cifar100", 20, (3, 32, 32), 100, [(i * 5, i * 5 + 5) for i in range(20)], True)
    assert "batch norm" in arrays.supports_stream(resnet)


@pytest.fixture
def two_seeds(monkeypatch):
    monkeypatch.setattr(presets, "VALIDATION_SEEDS", (100, 101))
    monkeypatch.setattr(presets, "ALGORITHM_1_GRID", [{"lr_scale": 1e-4, "lr_max": 1e2}])


TINY = ["--n-tasks", "2", "--samples-per-task", "20", "--allow-dirty", "--until", "select-a"]


def test_the_selection_with_arrays_gives_the_runs_and_selection_of_runs_alone(tmp_path, two_seeds, capsys):
    args = TINY + ["--methods", "sgd", "er", "emcl"]
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    assert selection.main(["--out", off] + args) == 0
    assert selection.main(["--out", on, "--array", "4"] + args) == 0
    out = capsys.readouterr().out
    assert "26 of them in 7 array(s)" in out       # sgd, er: 2 arrays each; emcl: 2 of its grid, 1 of Algorithm 1
    ro = {r["key"]: r for r in selection.load_runs(os.path.join(off, "validation.jsonl"))}
    ra = {r["key"]: r for r in selection.load_runs(os.path.join(on, "validation.jsonl"))}
    assert set(ro) == set(ra) and len(ra) == (2 * 4 + 4 + 1) * 2
    for k, r in ra.items():
        alg1 = r["overrides"].get("lr_mode") == "recurrent"      # EMCL's Algorithm 1 row: an array of its 2 seeds
        assert r["array"]["width"] == (2 if alg1 else 4), k
        assert abs(r["acc"] - ro[k]["acc"]) <= 1.0
        assert set(ro[k]) <= set(r)
    so, sa = (json.load(open(os.path.join(d, "selected.json"))) for d in (off, on))
    assert {m: d["overrides"] for m, d in so["methods"].items()} == {m: d["overrides"] for m, d in sa["methods"].items()}
    timing = selection.load_runs(os.path.join(on, selection.TIMINGS_FILE))[-1]
    assert timing["array"] == 4 and sorted(a["width"] for a in timing["arrays"]) == [2, 4, 4, 4, 4, 4, 4]
    # resume: two runs of an array lost; started again, only they run (as one array of two)
    path = os.path.join(on, "validation.jsonl")
    keep = [r for r in selection.load_runs(path) if not (r["method"] == "er" and r["overrides"]["lr"] == 0.01)]
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in keep)
    capsys.readouterr()
    assert selection.main(["--out", on, "--array", "auto"] + args) == 0
    out = capsys.readouterr().out
    assert "2 run(s) to do" in out and "2 of them in 1 array(s)" in out
    again = {r["key"]: r for r in selection.load_runs(path)}
    assert set(again) == set(ro)


def test_an_array_that_fails_whole_fails_each_of_its_runs(tmp_path, two_seeds, monkeypatch):
    path = str(tmp_path / "sel" / "validation.jsonl")
    row = selection.Row("er/a", "er", {"lr": 0.1}, "validation", "a", (100, 101))

    def boom(task):
        raise RuntimeError("out of luck")
    monkeypatch.setattr(sweep, "run_array_task", boom)
    with pytest.raises(selection.RunsFailed, match="2 of 2 run"):
        selection.run_rows([row], path, STREAM, "validation", n_tasks=1, samples_per_task=10, array=2)
    fails = selection.load_runs(str(tmp_path / "sel" / selection.FAILED_FILE))
    assert sorted(f["seed"] for f in fails) == [100, 101] and all("out of luck" in f["reason"] for f in fails)


def test_a_diverged_run_of_an_array_goes_to_failed_jsonl(tmp_path, two_seeds):
    """A run that diverges and a run the method refuses (a configuration error): both reported in
    failed.jsonl, the others kept."""
    path = str(tmp_path / "sel" / "validation.jsonl")
    rows = [selection.Row("sgd/a", "sgd", {"lr": 0.1}, "validation", "a", (100,)),
            selection.Row("sgd/b", "sgd", {"lr": 1e30}, "validation", "b", (100,)),
            selection.Row("sgd/bad", "sgd", {"lr": -1.0}, "validation", "bad", (100,))]
    with pytest.raises(selection.RunsFailed, match="2 of 3 run"):
        selection.run_rows(rows, path, STREAM, "validation", n_tasks=1, samples_per_task=30, array="auto")
    fails = {f["row"]: f for f in selection.load_runs(str(tmp_path / "sel" / selection.FAILED_FILE))}
    assert set(fails) == {"sgd/b", "sgd/bad"} and "diverged" in fails["sgd/b"]["reason"]
    assert "lr" in fails["sgd/bad"]["reason"]
    assert [r["overrides"] for r in selection.load_runs(path)] == [{"lr": 0.1}]


def test_ray_runs_an_array_as_one_task(tmp_path, two_seeds, capsys):
    """Through a local Ray cluster of one node: the records of the local executor's arrays."""
    ray = pytest.importorskip("ray")
    args = TINY + ["--methods", "sgd", "--array", "4"]
    local, viaray = str(tmp_path / "local"), str(tmp_path / "ray")
    assert selection.main(["--out", local] + args) == 0
    try:
        assert selection.main(["--out", viaray, "--executor", "ray", "--jobs", "1"] + args) == 0
    finally:
        if ray.is_initialized():
            ray.shutdown()
    rl = {r["key"]: r for r in selection.load_runs(os.path.join(local, "validation.jsonl"))}
    rr = {r["key"]: r for r in selection.load_runs(os.path.join(viaray, "validation.jsonl"))}
    assert set(rl) == set(rr) and len(rr) == 8
    for k in rl:
        assert rr[k]["acc_matrix"] == rl[k]["acc_matrix"] and rr[k]["executor"] == "ray"
        assert rr[k]["array"]["width"] == 4


def test_the_main_command_trains_seeds_as_arrays_and_names_what_it_cannot(tmp_path, capsys):
    from emcl_continual import cli

    common = ["--stream", STREAM, "--n-tasks", "2", "--samples-per-task", "20", "--seeds", "0", "1", "2", "--quiet"]
    assert cli.main(["--method", "sgd", "er", "--out", str(tmp_path / "off")] + common) == 0
    assert cli.main(["--method", "sgd", "er", "--array", "2", "--out", str(tmp_path / "on")] + common) == 0
    off = {(r["method"], r["seed"]): r for r in map(json.loads, open(tmp_path / "off" / "runs.jsonl"))}
    on = {(r["method"], r["seed"]): r for r in map(json.loads, open(tmp_path / "on" / "runs.jsonl"))}
    assert set(off) == set(on)
    for k, r in on.items():
        assert abs(r["acc"] - off[k]["acc"]) <= 1.0
        assert r["array"]["width"] == (2 if k[1] < 2 else 1)      # seeds 0 1 together, then seed 2
    if (on[("sgd", 2)]["array"]["width"]) == 1:
        assert on[("sgd", 2)]["acc_matrix"] == off[("sgd", 2)]["acc_matrix"]   # an array of one: the run's bits
    with pytest.raises(SystemExit) as exc:
        cli.main(["--method", "sgd", "emcl", "--array", "4", "--set", "inner_lr_modulation=True"] + common)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "emcl with inner_lr_modulation=True" in err and "--array auto" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--method", "sgd", "--stream", "split-cifar100", "--array", "4", "--seeds", "0"])
    assert exc.value.code == 2 and "batch norm" in capsys.readouterr().err


def test_arrays_start_slowest_first_and_runs_without_an_array_stay_alone():
    tasks = []
    for m in ("sgd", "emcl", "mer"):      # EMCL's Table IV ablation has no array: its runs stay alone
        for i, seed in enumerate((100, 101)):
            tasks.append({"key": f"{m}|{seed}", "method": m, "seed": seed, "split": "validation",
                          "overrides": {"inner_lr_modulation": True} if m == "emcl" else {},
                          "stream": STREAM, "data_root": None, "role": "validation", "row": m, "want": "cpu"})
    units = sweep.make_arrays(tasks, "auto", STREAM)
    assert [u["method"] for u in units] == ["mer", "sgd", "emcl", "emcl"]
    assert [len(u["runs"]) for u in units[:2]] == [2, 2] and "runs" not in units[2]
    assert sweep.make_arrays(tasks, "off", STREAM) == tasks
    other = [dict(t, overrides={"init": "xavier"}) if t["method"] == "sgd" and t["seed"] == 101 else t
             for t in tasks]
    assert [u["method"] for u in sweep.make_arrays(other, 4, STREAM)] == ["mer", "sgd", "sgd", "emcl", "emcl"]


@pytest.mark.parametrize("method", EVERY)
def test_dropping_a_run_keeps_every_other_runs_state(method, streams):
    """An array of three that drops its middle run after a task trains runs 0 and 2 as an array
    of those two trained from the start does (every per-run state sliced alike: weights, memories,
    generators, Fisher terms, learning rates)."""
    from emcl_continual.training.config import build_config

    info = streams[0].info
    seeds = [0, 1, 0]
    cfgs = [build_config(method, STREAM, s, ov) for s, ov in zip(seeds, ({}, {}, OTHER[method]))]

    def learner(idx):
        models = []
        for i in idx:
            torch.manual_seed(seeds[i])
            models.append(build_model(info))
        return arrays.get_learner(method)(array_base.stack_weights(models), info,
                                          [cfgs[i] for i in idx], "cpu")

    def batches(idx, t):
        x = torch.stack([streams[seeds[i]].train[t].x for i in idx])
        y = torch.stack([streams[seeds[i]].train[t].y for i in idx])
        return [(x[:, b:b + 10], y[:, b:b + 10]) for b in range(0, y.shape[1], 10)]

    three, two = learner([0, 1, 2]), learner([0, 2])
    for lrn, idx in ((three, [0, 1, 2]), (two, [0, 2])):
        lrn.begin_task(0)
        for x, y in batches(idx, 0):
            lrn.observe(x, y, 0)
        lrn.end_task(0)
    three.keep([0, 2])
    assert three.width == 2
    for lrn in (three, two):
        lrn.begin_task(1)
    for (x, y) in batches([0, 2], 1):
        a, b = three.observe(x, y, 1), two.observe(x, y, 1)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a, b)
    for wa, wb in zip(three.weights, two.weights):
        assert torch.allclose(wa, wb, rtol=1e-4, atol=1e-5)


#: EMCL's variants of the reported tables that its array serves (presets.EMCL_VARIANTS, the
#: selection's Algorithm 1 grid and importance search), with a per-run key changed for a second run
EMCL_VARIANTS = {
    "glances=2, shuffled": ({"glances": 2, "shuffle_inner": True}, {"inner_lr": 0.1}),
    "si": ({"importance": "si"}, {"gamma": 0.1, "decay": 0.5}),
    "algorithm-1": ({"inner_lr": 0.15, "memory": 0, "replay": 0, "lr_mode": "recurrent", "lr_scale": 1e-4,
                     "lr_max": 100.0}, {"lr_scale": 1e-5, "lr_max": 1000.0}),
    "importance-off": ({"fixed_importance": 1e-4, "decay": 1.0, "prox": False}, {"inner_lr": 0.01}),
    "importance_norm=global": ({"importance_norm": "global", "gamma": 1e-3}, {"gamma": 1e-2}),
    "no-inner-replay": ({"inner_replay": False}, {"meta_lr": 0.1, "eps": 1e-6}),
}


@pytest.mark.parametrize("variant", list(EMCL_VARIANTS))
def test_emcl_variants_array_of_one_bits_and_wider_within_rounding(variant, streams):
    """Each served variant: an array of one gives the run alone's bits (diagnostics included);
    an array of three (two seeds, a per-run key changed) ends within rounding of each run alone."""
    base, other = EMCL_VARIANTS[variant]
    alone = _alone("emcl", streams, 0, base)
    (rec,), failed = run_array("emcl", STREAM, [{"seed": 0, "overrides": base}], streams=streams)
    assert not failed
    for field in ("acc", "acc_matrix", "task_losses", "config", "diagnostics"):
        assert rec[field] == alone[field], field
    runs = [{"seed": 0, "overrides": base}, {"seed": 1, "overrides": base}, {"seed": 1, "overrides": dict(base, **other)}]
    records, failed = run_array("emcl", STREAM, runs, streams=streams)
    assert not failed and [r["array"]["width"] for r in records] == [3, 3, 3]
    for r, run_ in zip(records, runs):
        solo = _alone("emcl", streams, run_["seed"], run_["overrides"])
        assert r["config"] == solo["config"]
        assert abs(r["acc"] - solo["acc"]) <= 2.0
        for a, b in zip(r["task_losses"], solo["task_losses"]):
            assert a == pytest.approx(b, rel=1e-3, abs=1e-4)
        for da, db in zip(r["diagnostics"], solo["diagnostics"]):
            assert da["h_mean"] == pytest.approx(db["h_mean"], rel=1e-2, abs=1e-9)


def test_emcl_array_weights_stay_within_rounding_of_the_runs_alone(streams):
    """The weights an EMCL array of four ends with, run by run, against each run alone's: within
    a tolerance that a run's mix-up (another run's β, memory or generator) would break."""
    from emcl_continual.training.config import build_config
    from emcl_continual.methods import get_method

    info = streams[0].info
    runs = [(0, {}), (1, {}), (0, {"inner_lr": 0.1}), (1, {"gamma": 0.05, "lr_scale": 0.05})]
    cfgs = [build_config("emcl", STREAM, s, ov) for s, ov in runs]
    models = []
    for s, _ in runs:
        torch.manual_seed(s)
        models.append(build_model(info))
    arr = arrays.get_learner("emcl")(array_base.stack_weights(models), info, cfgs, "cpu")
    solos = [get_method("emcl")(m, info, c, "cpu") for m, c in zip(models, cfgs)]
    for t in range(2):
        x = torch.stack([streams[s].train[t].x for s, _ in runs])
        y = torch.stack([streams[s].train[t].y for s, _ in runs])
        for b in range(0, y.shape[1], 10):
            la = arr.observe(x[:, b:b + 10], y[:, b:b + 10], t)
            ls = [solo.observe(x[r, b:b + 10], y[r, b:b + 10], t) for r, solo in enumerate(solos)]
            assert la.tolist() == pytest.approx(ls, rel=1e-4, abs=1e-5)
    for r, solo in enumerate(solos):
        for w, p in zip(arr.weights, solo.model.parameters()):
            assert torch.allclose(w[r], p, rtol=1e-4, atol=1e-5), r
        assert not torch.equal(arr.weights[0][r], arr.weights[0][(r + 1) % 4])


def test_a_diverging_emcl_run_is_dropped_and_the_others_finish(streams):
    runs = [{"seed": 0, "overrides": {}}, {"seed": 1, "overrides": {"inner_lr": 1e30, "meta_lr": 1e30}},
            {"seed": 1, "overrides": {}}]
    records, failed = run_array("emcl", STREAM, runs, streams=streams)
    assert [i for i, _ in failed] == [1] and "diverged" in failed[0][1]
    assert [r["array"]["index"] for r in records] == [0, 2]
    for r, (seed, ov) in zip(records, [(0, {}), (1, {})]):
        alone = _alone("emcl", streams, seed, ov)
        assert abs(r["acc"] - alone["acc"]) <= 2.0 and r["array"]["width"] == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", EVERY)
def test_an_array_on_the_gpu_trains_as_on_the_cpu(method, streams):
    """Every method's array of three (two seeds, a per-run key changed) on CUDA: the same draws
    (each run's generator lives on the CPU), so the same batches, and losses and accuracies within
    the rounding of another device's arithmetic of the same array on the CPU."""
    runs = [{"seed": 0, "overrides": {}}, {"seed": 1, "overrides": {}}, {"seed": 1, "overrides": OTHER[method]}]
    on_cpu, failed_cpu = run_array(method, STREAM, runs, streams=streams, device="cpu")
    on_gpu, failed_gpu = run_array(method, STREAM, runs, streams=streams, device="cuda")
    assert not failed_cpu and not failed_gpu
    for c, g in zip(on_cpu, on_gpu):
        assert g["device"].startswith("cuda") and g["config"] == c["config"]
        for a, b in zip(g["task_losses"], c["task_losses"]):
            assert a == pytest.approx(b, rel=2e-2, abs=1e-3)
        assert abs(g["acc"] - c["acc"]) <= 5.0
    # the runs stayed apart on the device: run 1 and its other configuration differ
    assert on_gpu[1]["task_losses"] != on_gpu[2]["task_losses"]
