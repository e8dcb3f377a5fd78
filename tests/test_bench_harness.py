"""benchmarks/harness.py: the options, results head, files, timing loop and table that every
benchmark of the suite shares."""
import json
import os

import pytest
import torch

from benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parser_adds_only_the_common_options_asked_for():
    p = harness.parser("x", "First paragraph.\n\nSecond.", "device", "out", "quick")
    text = p.format_help()
    assert "First paragraph." in text and "Second." not in text
    assert "--device" in text and "--out" in text and "--out-dir" in text and "--quick" in text
    for absent in ("--threads", "--name", "--note", "--no-plot", "--quiet"):
        assert absent not in text
    args = p.parse_args(["--out-dir", "d"])
    assert args.out == "d" and args.device == "auto" and not args.quick
    many = harness.parser("x", "", "threads", "device", many_threads=True, threads=[1, 2],
                          devices=True)
    args = many.parse_args(["--threads", "1", "3", "--device", "cpu", "cpu"])
    assert args.threads == [1, 3] and args.device == ["cpu", "cpu"]
    assert many.parse_args([]).threads == [1, 2]
    with pytest.raises(ValueError, match="unknown common option"):
        harness.parser("x", "", "devise")


def test_device_of_refuses_what_is_not_there():
    assert harness.device_of("cpu") == torch.device("cpu")
    assert harness.device_of("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SystemExit, match="cpu, cuda or auto"):
        harness.device_of("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            harness.device_of("cuda")


def test_threads_are_restored():
    before = torch.get_num_threads()
    with harness.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with harness.threads(1):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_head_names_the_command_machine_and_device():
    inside = os.path.join(ROOT, "benchmarks", "results", "x")
    h = harness.head("demo", ["--out", inside], torch.device("cpu"), schema="s/1", note="n")
    assert h["schema"] == "s/1" and h["note"] == "n" and h["created_utc"].endswith("+00:00")
    assert h["command"] == "python -m benchmarks demo --out benchmarks/results/x"
    assert h["device"] == "cpu" and "CPU" in h["device_name"]
    assert {"summary", "cpu", "torch", "git_commit", "load_average_at_start"} <= set(h["machine"])
    assert (h["busy_warning"] is None) == (h["notes"] == [])


def test_finish_writes_the_json_the_plot_and_the_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    drawn = []

    def plot(result, path):
        drawn.append(path)
        open(path, "wb").write(b"png")

    result = {"records": [1, 2], "notes": ["a note"]}
    harness.finish(result, str(tmp_path / "out"), "stem", plot=plot,
                   table=lambda r: f"{len(r['records'])} records")
    assert json.load(open(tmp_path / "out" / "stem.json"))["records"] == [1, 2]
    assert drawn == [str(tmp_path / "out" / "stem.png")]
    assert set(result["paths"]) == {"json", "png"}
    out = capsys.readouterr().out
    assert "2 records" in out and "note: a note" in out and "stem.json" in out
    again = {"records": []}
    harness.finish(again, str(tmp_path / "out"), "other", plot=plot, no_plot=True)
    assert set(again["paths"]) == {"json"} and len(drawn) == 1
    assert not list((tmp_path / "out").glob("*.part"))


def test_interleaved_runs_every_function_every_round_in_turn():
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in "ab"}
    secs = harness.interleaved(fns, torch.device("cpu"), rounds=3, calls=2, warmup=1)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert {k: len(v) for k, v in secs.items()} == {"a": 3, "b": 3}
    s = harness.summary([0.003, 0.001, 0.002])
    assert s == {"median_ms": pytest.approx(2.0), "q25_ms": pytest.approx(1.5),
                 "q75_ms": pytest.approx(2.5), "min_ms": pytest.approx(1.0), "rounds": 3}


def test_table_aligns_columns_and_shows_missing_values():
    text = harness.table(("name", "ms"), [("adam", 1.23456), ("emcl", None)], title="T")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["name", "ms"]
    assert lines[3].startswith("adam") and lines[3].endswith("1.235")
    assert lines[4].endswith("-") and len(lines[3]) == len(lines[4])


@pytest.mark.parametrize("name", sorted(__import__("benchmarks.suite").suite.REGISTRY))
def test_every_benchmark_prints_its_help(name, capsys):
    from benchmarks import suite
    for module in suite.REGISTRY[name].requires:
        pytest.importorskip(module)
    with pytest.raises(SystemExit) as exc:
        suite.run(name, ["--help"])
    assert exc.value.code == 0
    assert f"usage: python -m benchmarks {name}" in capsys.readouterr().out


def test_load_results_takes_the_newest_and_refuses_another_schema(tmp_path, monkeypatch):
    from benchmarks import common
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="no step_\\*.json in"):
        harness.load_results([], "step", "s/1")
    for stem in ("step_20261127T000000Z_cpu", "step_20261128T000000Z_cpu", "kernels_x"):
        (tmp_path / f"{stem}.json").write_text(json.dumps({"schema": "s/1", "stem": stem}))
    [(source, result)] = harness.load_results([], "step", "s/1")
    assert result["stem"] == "step_20261128T000000Z_cpu"
    assert source == "step_20261128T000000Z_cpu.json"     # outside the repository: its name
    inside = os.path.join(ROOT, "benchmarks", "results", "step_epyc-2core.json")
    assert harness.load_results([inside], "step", "emcl-kernels/bench_step/1")[0][0] == \
        "benchmarks/results/step_epyc-2core.json"
    with pytest.raises(SystemExit, match="is not a kernels results file"):
        harness.load_results([inside], "kernels", "emcl-kernels/bench_kernels/1")
