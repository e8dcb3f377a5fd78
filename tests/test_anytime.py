"""Anytime evaluation (emcl_continual.training.anytime) and the metrics computed from its record
(metrics.anytime_metrics): a run trains the same bits with and without it, for every method; the
record has the points it promises; every metric against a record computed by hand."""
from __future__ import annotations

import pytest
import torch

from emcl_continual.core import metrics as M
from emcl_continual.data import streams
from emcl_continual.training import train
from emcl_continual.training.anytime import AnytimeEvaluator, subset_indices
from emcl_continual.methods import METHODS


def _tiny_stream(n_tasks: int = 3, per_task: int = 40, n_eval: int = 30, seed: int = 0) -> streams.Stream:
    g = torch.Generator().manual_seed(seed)
    info = streams.StreamInfo("permuted-mnist", n_tasks, (784,), 10, [(0, 10)] * n_tasks, False)

    def task(t, n):
        return streams.TaskData(torch.rand(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g), t)

    return streams.Stream(info, [task(t, per_task) for t in range(n_tasks)], [task(t, n_eval) for t in range(n_tasks)])


# Small enough to run every method in seconds; the replay methods see a memory of a few samples.
SMALL = {"memory": 12, "replay": 4}


def _overrides(method: str) -> dict:
    from emcl_continual.methods import get_method
    keys = get_method(method).keys("permuted-mnist")
    return {k: v for k, v in SMALL.items() if k in keys}


def _run_capturing(monkeypatch, method: str, **kwargs):
    """train.run on a fresh tiny stream; returns the result, the trained model's state and the
    global generator's state afterwards."""
    models = []
    build = train.build_model

    def keep(*a, **k):
        m = build(*a, **k)
        models.append(m)
        return m

    monkeypatch.setattr(train, "build_model", keep)
    torch.manual_seed(1234)
    r = train.run(method, _tiny_stream(), seed=3, overrides=_overrides(method), progress=False, **kwargs)
    state = {k: v.detach().clone() for k, v in models[-1].state_dict().items()}
    return r, state, torch.get_rng_state()


@pytest.mark.parametrize("method", list(METHODS))
def test_anytime_evaluation_trains_the_same_bits(monkeypatch, method):
    plain, p_state, p_rng = _run_capturing(monkeypatch, method)
    for every in (10, 15):  # every batch; and points that fall inside batches
        anytime, a_state, a_rng = _run_capturing(monkeypatch, method, eval_every=every, eval_subset=7)
        assert plain["acc_matrix"] == anytime["acc_matrix"]
        assert plain["task_losses"] == anytime["task_losses"]
        assert p_state.keys() == a_state.keys()
        for k in p_state:
            assert torch.equal(p_state[k], a_state[k]), (method, every, k)
        assert torch.equal(p_rng, a_rng), "the global generator moved differently"
        assert "anytime" not in plain and "anytime" in anytime
        assert anytime["anytime_eval_time_s"] > 0


def test_record_points_boundaries_and_online_counts():
    stream = _tiny_stream(n_tasks=3, per_task=40)
    r = train.run("sgd", stream, seed=0, progress=False, eval_every=15, eval_subset=7)
    rec = r["anytime"]
    # the first batch end at or past each multiple of 15 (15 -> 20, 30, 45 -> 50, 60, 75 -> 80, 90,
    # 105 -> 110, 120), plus every boundary (40; 80 and 120 are points already)
    assert rec["samples"] == [0, 20, 30, 40, 50, 60, 80, 90, 110, 120]
    assert rec["task"] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [len(row) for row in rec["acc"]] == [k + 1 for k in rec["task"]]
    assert rec["task_starts"] == [0, 40, 80]
    assert rec["online_seen"] == [40, 40, 40]
    assert rec["subset_sizes"] == [7, 7, 7]
    for row in rec["acc"]:
        for v in row:
            assert 0 <= v <= 100 and abs(v * 7 / 100 - round(v * 7 / 100)) < 1e-9  # k of 7 images
    # the final point is the final model: on the subset it agrees with an evaluation of those images
    idx = subset_indices(30, 7)
    final = [M.accuracy(_model_of(r, stream), td.x[idx], td.y[idx], td.task) for td in stream.test]
    assert rec["acc"][-1] == pytest.approx(final)


def _model_of(result, stream):
    """The model a finished run trained, rebuilt: sgd on the same stream and seed, no evaluator."""
    models = []
    build = train.build_model

    def keep(*a, **k):
        m = build(*a, **k)
        models.append(m)
        return m

    train.build_model = keep
    try:
        again = train.run("sgd", stream, seed=0, progress=False)
    finally:
        train.build_model = build
    assert again["acc_matrix"] == result["acc_matrix"]
    return models[-1]


def test_online_accuracy_is_counted_before_training():
    """A model whose prediction is the label only after it trained on the batch: the online
    accuracy must count what it predicted before."""

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.known = 0

        def forward(self, x, task):
            out = torch.zeros(x.shape[0], 10)
            out[:, 0] = 1.0  # predicts class 0 unless it has seen the batch
            if self.known:
                out[:, 3] = 2.0
            return out

    stream = _tiny_stream(n_tasks=1, per_task=20)
    stream.train[0].y[:] = 3
    stream.test[0].y[:] = 3
    model = Oracle()
    ev = AnytimeEvaluator(stream.test, every=10, subset=None)
    ev.start(model)
    for x, y in stream.batches(0, 10):
        ev.before_batch(model, x, y, 0)
        model.known = 1  # "trains"
        ev.after_batch(model, 10, 0)
    ev.end_task(model, 0)
    rec = ev.record()
    assert rec["online_correct"] == [10]  # the first batch was wrong before training, the second right
    assert rec["online_seen"] == [20]
    assert rec["acc"] == [[0.0], [100.0], [100.0]]
    assert M.online_acc(rec) == 50.0


def test_subset_is_fixed_and_independent_of_the_global_generator():
    torch.manual_seed(0)
    a = subset_indices(1000, 200)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    b = subset_indices(1000, 200)
    assert torch.equal(a, b) and torch.equal(state, torch.get_rng_state())
    assert len(set(a.tolist())) == 200 and a.tolist() == sorted(a.tolist())
    assert torch.equal(subset_indices(50, 200), torch.arange(50))
    assert torch.equal(subset_indices(50, None), torch.arange(50))


@pytest.mark.parametrize("every, subset", [(0, 10), (-5, 10), (1.5, 10), (True, 10), (10, 0), (10, 2.0)])
def test_bad_arguments_are_refused(every, subset):
    with pytest.raises(ValueError, match="eval_every|eval_subset"):
        AnytimeEvaluator(_tiny_stream().test, every=every, subset=subset)


def test_evaluator_and_eval_every_together_are_refused():
    s = _tiny_stream()
    with pytest.raises(ValueError, match="not both"):
        train.run("sgd", s, eval_every=10, evaluator=AnytimeEvaluator(s.test, 10), progress=False)


# --------------------------------------------------------------------------- the metrics by hand
# Three tasks of 4 samples, a point every 2 samples and at each boundary.
#   samples  task  acc
#     0       0    [10]
#     2       0    [60]
#     4       0    [80]            end of task 0
#     6       1    [40, 50]        task 0 drops right after the switch
#     8       1    [70, 90]        end of task 1
#    10       2    [50, 30, 60]
#    12       2    [60, 70, 80]    end of the stream
RECORD = {
    "samples": [0, 2, 4, 6, 8, 10, 12],
    "task": [0, 0, 0, 1, 1, 2, 2],
    "acc": [[10], [60], [80], [40, 50], [70, 90], [50, 30, 60], [60, 70, 80]],
    "online_correct": [1, 2, 4],
    "online_seen": [4, 4, 4],
}


def test_aaa_by_hand():
    # means of the points after the first sample: 60, 80, 45, 80, 140/3, 70
    expected = (60 + 80 + 45 + 80 + 140 / 3 + 70) / 6
    assert M.aaa(RECORD) == pytest.approx(expected)


def test_min_acc_and_wc_acc_by_hand():
    # task 0 after its end (points with task > 0): 40, 70, 50, 60 -> 40; task 1 after its end: 30, 70 -> 30
    assert M.min_acc(RECORD) == pytest.approx((40 + 30) / 2)
    # WC-Acc = 1/3 * 80 (last task, final) + 2/3 * 35
    assert M.wc_acc(RECORD) == pytest.approx(80 / 3 + 2 / 3 * 35)


def test_stability_gap_by_hand():
    gaps = M.stability_gap(RECORD)
    # tasks of 4 samples: the window is the first sample after the switch, so the first point
    # switch into task 1: before = 80 (task 0 at 4); during task 1: 40 at 6, 70 at 8 -> gap 40 at 2 samples;
    # half the drop regained (>= 60) at 8: 4 samples after the switch; at the end 70: end drop 10
    assert gaps[0] == {"task": 1, "before": 80.0, "min": 40.0, "gap": 40.0, "at": 2, "recover": 4,
                       "end": 70.0, "end_drop": 10.0}
    # switch into task 2: before = mean(70, 90) = 80; during: mean(50, 30) = 40 at 10, mean(60, 70) = 65 at 12
    # gap 40 at 2 samples; 65 >= 40 + 20 at 12: recovered 4 samples after the switch; end drop 15
    assert gaps[1] == {"task": 2, "before": 80.0, "min": 40.0, "gap": 40.0, "at": 2, "recover": 4,
                       "end": 65.0, "end_drop": 15.0}
    m = M.anytime_metrics(RECORD)
    assert m["gap_mean"] == 40.0 and m["gap_min_mean"] == 40.0 and m["recover_mean"] == 4.0
    assert m["end_drop_mean"] == 12.5
    assert m["not_recovered"] == 0


def test_stability_gap_window():
    """The minimum is looked for in the first quarter of the task only: a late fall is forgetting,
    counted in end_drop, not a gap."""
    rec = {"samples": [0, 8, 10, 12, 14, 16], "task": [0, 0, 1, 1, 1, 1],
           "acc": [[0], [90], [70, 5], [80, 5], [85, 5], [20, 5]]}
    g = M.stability_gap(rec)[0]  # task 1: 8 samples, window 2: the point at 10 only
    assert (g["min"], g["gap"], g["at"], g["recover"], g["end_drop"]) == (70.0, 20.0, 2, 4, 70.0)
    g = M.stability_gap(rec, window=8)[0]  # the whole task
    assert (g["min"], g["gap"], g["at"], g["recover"]) == (20.0, 70.0, 8, None)
    with pytest.raises(ValueError, match="window"):
        M.stability_gap(rec, window=0)


def test_stability_gap_without_recovery_or_drop():
    rec = {"samples": [0, 2, 4, 6, 8], "task": [0, 0, 1, 1, 1],
           "acc": [[0], [90], [50, 10], [55, 20], [58, 30]]}
    g = M.stability_gap(rec)[0]
    # the switch at 2 samples: before 90, min 50 at 4 (2 after the switch), never back to 70 within the task
    assert (g["before"], g["min"], g["gap"], g["at"], g["recover"]) == (90.0, 50.0, 40.0, 2, None)
    assert M.anytime_metrics(rec)["not_recovered"] == 1
    rising = {"samples": [0, 2, 4], "task": [0, 0, 1], "acc": [[0], [50], [60, 10]]}
    g = M.stability_gap(rising)[0]
    assert g["gap"] == -10.0 and g["recover"] == 0


def test_online_accuracy_by_hand():
    assert M.online_acc(RECORD) == pytest.approx(100 * 7 / 12)
    m = M.anytime_metrics(RECORD)
    assert m["online_acc_per_task"] == [25.0, 50.0, 100.0]
    assert M.online_acc({"samples": [0], "task": [0], "acc": [[1]]}) is None


def test_single_task_record():
    rec = {"samples": [0, 5, 10], "task": [0, 0, 0], "acc": [[10], [40], [70]]}
    assert M.aaa(rec) == 55.0
    assert M.min_acc(rec) is None
    assert M.wc_acc(rec) == 70.0
    assert M.stability_gap(rec) == []
    assert M.anytime_metrics(rec)["gap_mean"] is None


@pytest.mark.parametrize("bad, match", [
    ({"samples": [], "task": [], "acc": []}, "same non-zero length"),
    ({"samples": [0, 1], "task": [0], "acc": [[1]]}, "same non-zero length"),
    ({"samples": [0, 1], "task": [0, 1], "acc": [[1], [1]]}, "point 1: task 1 needs 2"),
    ({"samples": [2, 1], "task": [0, 0], "acc": [[1], [1]]}, "must not decrease"),
])
def test_bad_records_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        M.anytime_metrics(bad)


def test_metrics_of_a_real_record_are_consistent():
    r = train.run("er", _tiny_stream(), seed=1, overrides=_overrides("er"), progress=False, eval_every=10)
    m = r["anytime_metrics"]
    rec = r["anytime"]
    assert m == M.anytime_metrics(rec)
    assert 0 <= m["aaa"] <= 100 and 0 <= m["online_acc"] <= 100
    # each earlier task's minimum is at most its final accuracy
    assert m["min_acc"] <= sum(rec["acc"][-1][:2]) / 2 + 1e-9
    assert m["wc_acc"] == pytest.approx(rec["acc"][-1][2] / 3 + 2 / 3 * m["min_acc"])
    assert len(m["gap"]) == 2


# --------------------------------------------------------------------------- the tables
def test_tables_carry_the_anytime_runs(tmp_path, monkeypatch):
    """The report rows run again with anytime evaluation (results/online/STREAM/report.jsonl):
    the headline gains AAA, WC-Acc and online accuracy, the online block every metric and EMCL's
    paired differences, the figures are drawn, and the runs end where the committed ones did."""
    import json
    import os

    from emcl_continual.core import presets
    from emcl_continual.reports import tables
    from emcl_continual.sweep import selection

    monkeypatch.setattr(presets, "VALIDATION_SEEDS", (100,))
    monkeypatch.setattr(presets, "REPORT_SEEDS", (10, 11))
    monkeypatch.setattr(presets, "EMCL_VARIANTS", {k: v for k, v in presets.EMCL_VARIANTS.items()
                                                   if k in ("importance-off", "algorithm-1")})
    monkeypatch.setattr(presets, "IMPORTANCE_SEARCH", [{"importance_norm": "global", "gamma": 1e-3}])
    monkeypatch.setattr(presets, "ALGORITHM_1_GRID", [{"lr_scale": 1e-4, "lr_max": 1e2}])
    real = selection.report_rows
    monkeypatch.setattr(selection, "report_rows",
                        lambda *a, **k: [r for r in real(*a, **k) if r["name"] in ("emcl", "er", "sgd")])
    small = ["--n-tasks", "2", "--samples-per-task", "20", "--allow-dirty"]
    heldout = str(tmp_path / "heldout" / "permuted-mnist")
    assert selection.main(["--out", heldout, "--methods", "sgd", "er", "emcl", "--stages", "validate-a", "report"]
                          + small) == 0
    plan = json.load(open(os.path.join(heldout, "plan.json")))
    rows = [selection.Row(**r) for r in plan["rows"] if r["role"] == "report"]
    online = str(tmp_path / "online" / "permuted-mnist")
    selection.run_rows(rows, os.path.join(online, "report.jsonl"), "permuted-mnist", "test", n_tasks=2,
                       samples_per_task=20, eval_every=10, eval_subset=20, log=lambda line: None)
    runs = selection.load_runs(os.path.join(online, "report.jsonl"))
    assert len(runs) == 6 and all(r["anytime"]["every"] == 10 for r in runs)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- tables:permuted-mnist/headline -->\n<!-- /tables:permuted-mnist/headline -->\n"
                      "<!-- tables:permuted-mnist/online -->\n<!-- /tables:permuted-mnist/online -->\n")
    tables.write_all(str(tmp_path), str(readme))
    text = readme.read_text()
    assert "AAA | WC-Acc | online acc" in text
    assert "| **emcl** | 2 of 2 |" in text and "| er | " in text
    assert "6 of 6 runs end with the accuracy matrix of the committed run" in text
    sr = tables.StreamResults(heldout)
    emcl, er = sr.online_runs("emcl"), sr.online_runs("er")
    expected = M.paired({r["seed"]: r["anytime_metrics"]["aaa"] for r in emcl},
                        {r["seed"]: r["anytime_metrics"]["aaa"] for r in er})
    assert f"{expected['mean']:+.2f} ± {expected['std']:.2f}" in text
    for f in ("anytime_accuracy.png", "stability_gap.png"):
        assert os.path.getsize(os.path.join(online, f)) > 1000
    assert tables.write_all(str(tmp_path), str(readme), check=True) == []


def test_archived_cost_file_is_what_the_results_page_quotes():
    """What the presets' anytime evaluation costs, measured once by the former ``training
    --anytime`` mode (benchmarks/results/archive/anytime_cost_cpu_0563600.json): every method
    trained the same bits with and without it, and docs/results.md quotes the file's whole-stream
    evaluation times and, per method, that time over its training of the stream (extrapolated
    per sample from its run on the stream's first tasks)."""
    import json
    import os
    import re

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "benchmarks", "results", "archive", "anytime_cost_cpu_0563600.json")) as fh:
        result = json.load(fh)
    with open(os.path.join(repo, "docs", "results.md")) as fh:
        page = " ".join(fh.read().split())
    assert {r["method"] for r in result["per_method"]} == set(METHODS)
    assert all(r["same_accuracy_matrix"] for r in result["per_method"])
    whole = {w["stream"]: w for w in result["whole_stream"]}
    assert f"evaluation takes {whole['permuted-mnist']['anytime_eval_time_s']:.1f} s (401 points" in page
    assert f"Rotated MNIST {whole['rotated-mnist']['anytime_eval_time_s']:.1f} s" in page
    assert f"Many Permutations {whole['many-permutations']['anytime_eval_time_s']:.1f} s for 1,001 points" in page
    w, prefix = whole[result["stream"]], result["n_tasks"] * result["samples_per_task"]
    pct = {r["method"]: f"{100 * w['anytime_eval_time_s'] / (r['train_time_s_off'] / prefix * w['samples']):.0f}"
           for r in result["per_method"]}
    names = {"sgd": "fine-tuning", "er": "ER", "ewc": "EWC", "agem": "A-GEM", "emcl": "EMCL", "gem": "GEM"}
    for method, name in names.items():
        assert re.search(rf"\b{pct[method]} % for {name}\b", page), (method, pct[method])
    assert pct["lamaml"] == pct["mer"] and f"{pct['mer']} % for La-MAML and MER" in page
