"""--log tensorboard,wandb,csv: what each tracker wrote, read back with the tracker's own reader
(TensorBoard's event accumulator; W&B's offline transaction log, record by record) or as files
(CSV), and compared with the command's runs.jsonl; the refusals without the optional extras.

The round trips need ``make setup-trackers`` (requirements-trackers.txt) and skip themselves
without it; CI installs it."""
from __future__ import annotations

import csv
import glob
import importlib.util
import json
import os
import struct

import pytest

from emcl_continual import cli
from emcl_continual.output import trackers
from emcl_continual.sweep import selection

HAVE_TB = importlib.util.find_spec("tensorboard") is not None
HAVE_WANDB = importlib.util.find_spec("wandb") is not None
needs_tb = pytest.mark.skipif(not HAVE_TB, reason="tensorboard is not installed (make setup-trackers)")
needs_wandb = pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (make setup-trackers)")

SMALL = ["--stream", "permuted-mnist", "--n-tasks", "3", "--samples-per-task", "40", "--quiet"]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One command with every installed tracker: two methods, two seeds, anytime evaluation."""
    out = str(tmp_path_factory.mktemp("trackers") / "out")
    names = ["csv"] + (["tensorboard"] if HAVE_TB else []) + (["wandb"] if HAVE_WANDB else [])
    assert cli.main(["--method", "sgd", "er", "--seeds", "0", "1", "--eval-every", "15", "--eval-subset", "10",
                     "--out", out, "--log", ",".join(names)] + SMALL) == 0
    runs = [json.loads(line) for line in open(os.path.join(out, "runs.jsonl"))]
    assert len(runs) == 4
    return out, runs


def _expected(run: dict) -> tuple[dict, dict]:
    """The values every tracker must hold for ``run``, computed from runs.jsonl here (not by the
    module under test): {tag: {step: value}} and {final metric: value}."""
    rec = run["anytime"]
    ends = rec["task_starts"][1:] + [rec["samples"][-1]]
    series: dict = {}
    for t, step in enumerate(ends):
        series.setdefault("task/avg_acc", {})[step] = run["avg_acc_curve"][t]
        series.setdefault("task/learned_acc", {})[step] = run["acc_matrix"][t][t]
        series.setdefault("task/loss", {})[step] = run["task_losses"][t]
        series.setdefault("task/online_acc", {})[step] = 100 * rec["online_correct"][t] / rec["online_seen"][t]
    for s, k, row in zip(rec["samples"], rec["task"], rec["acc"]):
        series.setdefault("anytime/seen_mean", {})[s] = sum(row) / len(row)
        series.setdefault("anytime/task1", {})[s] = row[0]
        if k:
            series.setdefault("anytime/earlier_mean", {})[s] = sum(row[:k]) / k
    final = {"acc": run["acc"], "bwt": run["bwt"], "forgetting": run["metrics"]["forgetting"],
             "train_time_s": run["train_time_s"], "aaa": run["anytime_metrics"]["aaa"],
             "wc_acc": run["anytime_metrics"]["wc_acc"], "online_acc": run["anytime_metrics"]["online_acc"],
             "gap_mean": run["anytime_metrics"]["gap_mean"]}
    return series, final


def _check(series_got: dict, final_got: dict, run: dict, rel: float) -> None:
    series, final = _expected(run)
    for tag, points in series.items():
        assert tag in series_got, tag
        assert sorted(series_got[tag]) == sorted(points), tag
        for step, v in points.items():
            assert series_got[tag][step] == pytest.approx(v, rel=rel, abs=rel), (tag, step)
    for k, v in final.items():
        assert final_got[k] == pytest.approx(v, rel=rel, abs=rel), k


def test_csv_round_trip(logged):
    out, runs = logged
    for run in runs:
        folder = os.path.join(out, "csv", f"{run['method']}-seed{run['seed']}")
        series: dict = {}
        with open(os.path.join(folder, "scalars.csv")) as fh:
            for row in csv.DictReader(fh):
                series.setdefault(row["tag"], {})[int(row["step"])] = float(row["value"])
        with open(os.path.join(folder, "final.csv")) as fh:
            final = {row["metric"]: float(row["value"]) for row in csv.DictReader(fh)}
        _check(series, final, run, rel=0)
        config = json.load(open(os.path.join(folder, "config.json")))
        assert config["config"] == run["config"] and config["eval_every"] == 15
        for png in ("avg_accuracy.png", "anytime_accuracy.png", "stability_gap.png"):
            assert os.path.getsize(os.path.join(folder, png)) > 1000


@needs_tb
def test_tensorboard_round_trip(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, runs = logged
    for run in runs:
        ea = EventAccumulator(os.path.join(out, "tensorboard", f"{run['method']}-seed{run['seed']}"),
                              size_guidance={"scalars": 0, "images": 0, "tensors": 0})
        ea.Reload()
        series = {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}
        final = {tag[len("final/"):]: next(iter(v.values())) for tag, v in series.items() if tag.startswith("final/")}
        _check(series, final, run, rel=1e-6)  # TensorBoard stores scalars as float32
        assert {"plots/avg_accuracy", "plots/anytime_accuracy", "plots/stability_gap"} <= set(ea.Tags()["images"])
        text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert json.loads(text)["config"] == run["config"]


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _wandb_records(path: str) -> list:
    """The protobuf records of a W&B transaction log (``run-ID.wandb``): a 7-byte header (':W&B',
    magic 0xBEE1, version 0), then LevelDB-log blocks of 32 KiB whose chunks carry a CRC (4 bytes),
    a length (2) and a type (1: full, 2: first, 3: middle, 4: last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, "not a W&B transaction log"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            parts = payload
        elif kind == 2:
            parts = payload
            continue
        elif kind == 3:
            parts += payload
            continue
        elif kind == 4:
            parts += payload
        else:
            raise AssertionError(f"chunk type {kind} at byte {pos}")
        rec = pb.Record()
        rec.ParseFromString(parts)
        records.append(rec)
    return records


@needs_wandb
def test_wandb_offline_round_trip(logged):
    out, runs = logged
    logs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(logs) == len(runs), "one offline W&B run per run"
    by_name = {}
    for path in logs:
        records = _wandb_records(path)
        name = next(r.run.display_name for r in records if r.WhichOneof("record_type") == "run")
        series: dict = {}
        final: dict = {}
        config: dict = {}
        for r in records:
            kind = r.WhichOneof("record_type")
            if kind == "history":
                step = next(int(json.loads(i.value_json)) for i in r.history.item if _key(i) == "_step")
                for i in r.history.item:
                    if not _key(i).startswith("_") and not _key(i).startswith("plots/"):
                        series.setdefault(_key(i), {})[step] = float(json.loads(i.value_json))
            elif kind == "summary":
                for i in r.summary.update:
                    if _key(i).startswith("final/"):
                        final[_key(i)[len("final/"):]] = float(json.loads(i.value_json))
            elif kind == "config":
                for i in r.config.update:
                    config[_key(i)] = json.loads(i.value_json)
            elif kind == "run":
                for i in r.run.config.update:
                    config[_key(i)] = json.loads(i.value_json)
        by_name[name] = (series, final, config)
    for run in runs:
        series, final, config = by_name[f"{run['method']}-seed{run['seed']}"]
        _check(series, final, run, rel=1e-12)
        cfg = config["config"]["value"] if isinstance(config["config"], dict) and "value" in config["config"] \
            else config["config"]
        assert cfg == run["config"]


def test_unknown_or_repeated_tracker_is_refused(capsys, tmp_path):
    for value, match in (("tensorbard", "unknown tracker 'tensorbard'"), ("csv,csv", "named twice"),
                         ("csv,", "separated by commas")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--log", value, "--out", str(tmp_path / "x")] + SMALL)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and match in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_extra_is_refused_in_one_line(name, monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--log", f"csv,{name}", "--out", str(tmp_path / "x")] + SMALL)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --log {name} needs the {name} package, an optional extra: make setup-trackers "
                   "(pip install -r requirements-trackers.txt)")
    assert not (tmp_path / "x").exists()


def test_log_needs_out(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--log", "csv"] + SMALL)
    assert "--log csv needs --out" in capsys.readouterr().err


def test_selection_logs_each_new_run(tmp_path):
    """selection.run_rows with trackers: one tracker run per new record, named by configuration."""
    rows = [selection.Row("er", "er", {"lr": 0.1}, "report", "er", [10]),
            selection.Row("sgd", "sgd", {}, "report", "sgd", [10])]
    out = str(tmp_path / "permuted-mnist")
    selection.run_rows(rows, os.path.join(out, "report.jsonl"), "permuted-mnist", "test", n_tasks=2,
                       samples_per_task=20, eval_every=10, eval_subset=10,
                       trackers=trackers.Trackers(["csv"], out, with_config=True), log=lambda line: None)
    recs = selection.load_runs(os.path.join(out, "report.jsonl"))
    names = sorted(os.listdir(os.path.join(out, "csv")))
    assert names == sorted(trackers.run_name(r, with_config=True) for r in recs)
    for r in recs:
        final = dict(csv.reader(open(os.path.join(out, "csv", trackers.run_name(r, True), "final.csv"))))
        assert float(final["acc"]) == r["acc"]


def test_force_replaces_the_tracker_runs_and_resume_adds_to_them(tmp_path):
    out = str(tmp_path / "out")
    base = ["--method", "sgd", "--n-tasks", "2", "--samples-per-task", "20", "--quiet", "--out", out, "--log", "csv"]
    assert cli.main(base + ["--seeds", "1"]) == 0
    assert cli.main(base + ["--seeds", "1", "2", "--resume"]) == 0
    assert sorted(os.listdir(os.path.join(out, "csv"))) == ["sgd-seed1", "sgd-seed2"]
    assert cli.main(base + ["--seeds", "3", "--force"]) == 0
    assert sorted(os.listdir(os.path.join(out, "csv"))) == ["sgd-seed3"]
