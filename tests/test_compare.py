"""Tests of ``--method all``: the comparison table beside Table III, the training-time figure,
and the resumable sweep of :mod:`emcl_continual.reports.compare`."""
from __future__ import annotations

import json
import os

import pytest
import torch

from emcl_continual.reports import compare
from emcl_continual.cli import main as cli_main
from emcl_continual.methods import METHODS
from emcl_continual.output.rundir import OutputError


def _fake_run(method, seed, acc, bwt, t, stream="permuted-mnist"):
    return {"method": method, "stream": stream, "seed": seed, "acc": acc, "bwt": bwt, "train_time_s": t,
            "eval_time_s": 0.1, "machine": "test-machine", "avg_acc_curve": [acc], "acc_matrix": [[acc]]}


def test_all_methods_are_registered():
    assert set(compare.ALL_METHODS) == set(METHODS)


def test_paper_table_values():
    """Spot checks against the paper's Table III."""
    assert compare.PAPER_TABLE_III["permuted-mnist"]["lamaml"][:4] == (73.92, 1.05, -7.91, 0.87)
    assert compare.PAPER_TABLE_III["many-permutations"]["emcl"][:4] == (48.12, 1.48, -14.09, 0.74)
    assert compare.PAPER_TABLE_III["permuted-mnist"]["mer"][4] is True  # dagger
    assert "mer" not in compare.PAPER_TABLE_III["split-cifar100"]


def test_comparison_table_means_and_deltas(tmp_path):
    runs = [_fake_run("ewc", 0, 60.0, -12.0, 3.0), _fake_run("ewc", 1, 62.0, -14.0, 5.0),
            _fake_run("sgd", 0, 50.0, -30.0, 1.0)]
    table = compare.comparison_table(runs, "permuted-mnist")
    ewc = next(line for line in table.splitlines() if line.startswith("| EWC"))
    # mean 61, std (ddof=1) sqrt(2) = 1.41; paper 62.32 -> delta -1.32
    assert "61.00 ± 1.41" in ewc and "62.32 ± 1.34 †" in ewc and "-1.32" in ewc and "-13.00 ± 1.41" in ewc
    sgd = next(line for line in table.splitlines() if line.startswith("| Fine-tune"))
    assert "| - |" in sgd  # not in Table III
    out = compare.write_comparison(runs, str(tmp_path))
    assert os.path.getsize(out["figure"]) > 1000
    assert (tmp_path / "comparison.md").read_text().startswith("Stream `permuted-mnist`")


def test_write_comparison_needs_a_stream_for_mixed_runs(tmp_path):
    runs = [_fake_run("ewc", 0, 60.0, -12.0, 3.0), _fake_run("ewc", 0, 30.0, -12.0, 3.0, stream="many-permutations")]
    with pytest.raises(ValueError, match="name one"):
        compare.write_comparison(runs, str(tmp_path))


def test_cli_method_all_on_a_tiny_stream(tmp_path):
    """Every method runs end to end through the CLI; the outputs name all of them."""
    torch.set_num_threads(1)
    out = tmp_path / "all"
    rc = cli_main(["--method", "all", "--stream", "permuted-mnist", "--n-tasks", "2", "--samples-per-task", "20",
                   "--seeds", "0", "--out", str(out), "--quiet", "--set", "glances=1", "--set", "batches_per_example=1"])
    assert rc == 0
    table = (out / "comparison.md").read_text()
    for m in compare.ALL_METHODS:
        assert f"| {compare.PAPER_NAMES[m]} |" in table
    assert (out / "training_time.png").stat().st_size > 1000
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted(r["method"] for r in runs) == sorted(compare.ALL_METHODS)


def test_run_all_resumes(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    import emcl_continual.data.streams as streams

    real = streams.make_stream
    monkeypatch.setattr(streams, "make_stream", lambda name, seed, **kw: real(name, seed, n_tasks=2, samples_per_task=20))
    out = str(tmp_path / "sweep")
    compare.run_all("permuted-mnist", [0], out, ["sgd"], log=None)
    first = compare.load_runs(out)
    compare.run_all("permuted-mnist", [0, 1], out, ["sgd"], log=None)
    second = compare.load_runs(out)
    assert len(first) == 1 and len(second) == 2
    assert second[0] == first[0]
    assert os.path.exists(os.path.join(out, "comparison.md"))


def test_compare_refuses_a_folder_of_another_configuration(tmp_path, monkeypatch):
    """compare keeps its folder with the main CLI's protocol: resumes by default, refuses runs
    of another configuration, --force starts over."""
    torch.set_num_threads(1)
    import emcl_continual.data.streams as streams

    real = streams.make_stream
    monkeypatch.setattr(streams, "make_stream", lambda name, seed, **kw: real(name, seed, n_tasks=2, samples_per_task=20))
    out = str(tmp_path / "sweep")
    compare.run_all("permuted-mnist", [0], out, ["sgd"], log=None)
    with open(os.path.join(out, "results.json")) as fh:
        assert json.load(fh)["status"] == "complete"
    assert os.path.exists(os.path.join(out, "comparison.md"))
    with pytest.raises(OutputError, match="sgd lr: 0.03 there, 0.2 here"):
        compare.run_all("permuted-mnist", [0, 1], out, ["sgd"], overrides={"sgd": {"lr": 0.2}}, log=None)
    runs = compare.run_all("permuted-mnist", [1], out, ["sgd"], overrides={"sgd": {"lr": 0.2}}, log=None,
                           force=True)
    assert [(r["seed"], r["config"]["lr"]) for r in runs] == [(1, 0.2)]


def test_compare_table_only_keeps_the_status(tmp_path, monkeypatch, capsys):
    import emcl_continual.data.streams as streams

    real = streams.make_stream
    monkeypatch.setattr(streams, "make_stream", lambda name, seed, **kw: real(name, seed, n_tasks=2, samples_per_task=20))
    out = str(tmp_path / "sweep")
    compare.run_all("permuted-mnist", [0], out, ["sgd"], log=None)
    os.remove(os.path.join(out, "comparison.md"))
    assert compare.main(["--out", out, "--table-only"]) == 0
    with open(os.path.join(out, "results.json")) as fh:
        obj = json.load(fh)
    assert obj["status"] == "complete" and obj["identity"]["configs"]["sgd"]["lr"] == 0.03
    assert os.path.exists(os.path.join(out, "comparison.md"))


def test_compare_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--out", str(tmp_path / "x"), "--seeds", "1", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --seeds: seed 1 is given twice; each seed is one run, and a repeated seed would be "
                   "counted twice in the mean and std"]
