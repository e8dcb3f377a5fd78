"""benchmarks/harness.py: the options, results head, files, timing loop and table that every
benchmark of the suite shares."""
import json
import os
import time

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


def test_interleave_starts_each_round_one_item_later_or_reverses_odd_rounds():
    def order(**kw):
        return [(rnd, pos, item) for rnd, pos, item, value in
                harness.interleave("abc", 4, lambda item, rnd: item + str(rnd), **kw)]
    assert [i for _, _, i in order()] == list("abc" "bca" "cab" "abc")
    assert [i for _, _, i in order(reverse=True)] == list("abc" "cba" "abc" "cba")
    assert order()[3:6] == [(1, 0, "b"), (1, 1, "c"), (1, 2, "a")]
    assert harness.interleave("ab", 1, lambda item, rnd: item * 2) == [(0, 0, "a", "aa"),
                                                                       (0, 1, "b", "bb")]
    assert harness.interleave([], 3, lambda item, rnd: None) == []


def test_interleave_keeps_the_error_of_an_item_that_raises_and_goes_on_without_it():
    calls, logged = [], []

    def run(item, rnd):
        calls.append(item)
        if item == "b" and rnd == 1:
            raise RuntimeError("out of memory, say")
    errors = {"c": "failed before"}
    done = harness.interleave("abc", 3, run, errors=errors, log=logged.append)
    assert calls == ["a", "b"] + ["b", "a"] + ["a"]    # c sits out; b fails in round 1
    assert [(rnd, pos, item) for rnd, pos, item, _ in done] == [(0, 0, "a"), (0, 1, "b"),
                                                                (1, 2, "a"), (2, 1, "a")]
    assert errors == {"c": "failed before", "b": "RuntimeError: out of memory, say"}
    assert logged == ["b: failed in round 1: RuntimeError: out of memory, say"]
    with pytest.raises(RuntimeError, match="out of memory"):
        harness.interleave("abc", 3, run)


def test_interleaved_times_every_function_every_round_in_turn():
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in "ab"}
    secs = harness.interleaved(fns, torch.device("cpu"), rounds=3, calls=2, warmup=2)
    assert "".join(order) == "ab" "ba" + "aabb" "bbaa" "aabb"   # warm-up, then timed rounds
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
    assert harness.table(("name", "ms"), [("adam", 1.5)], align="><").splitlines()[2] == \
        "adam  1.5"


def test_table_writes_markdown_with_the_columns_aligned_as_asked():
    rows = [("adam", 1.23456, "1.2x"), ("emcl", None, "-")]
    assert harness.table(("name", "ms", "ratio"), rows, markdown=True).splitlines() == [
        "| name | ms | ratio |", "|---|--:|--:|", "| adam | 1.235 | 1.2x |", "| emcl | - | - |"]
    text = harness.table(("a", "b"), [("1", "x")], title="T", markdown=True, align="<<")
    assert text == "T\n| a | b |\n|---|---|\n| 1 | x |"


def test_figure_saves_the_drawing_with_its_legend_and_closes_it(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    path = tmp_path / "f.png"
    before = plt.get_fignums()
    with harness.figure(str(path), "title", nrows=2, ncols=3, size=(6, 4), legend=4) as axes:
        assert axes.shape == (2, 3)
        axes[0][0].plot([1, 2], [3, 4], label="a line")
        fig = axes[0][0].figure
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._suptitle.get_text() == "title"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a line"]
    assert plt.get_fignums() == before
    with pytest.raises(ValueError, match="drawing failed"):
        with harness.figure(str(tmp_path / "g.png"), "t", size=(2, 2)):
            raise ValueError("drawing failed")
    assert plt.get_fignums() == before and not (tmp_path / "g.png").exists()


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


def test_time_calls_times_each_call_on_the_cpu_and_stops_at_its_budget():
    from benchmarks import timing

    calls = []
    secs = timing.time_calls([lambda: calls.append(time.sleep(2e-3))] * 5, torch.device("cpu"))
    assert len(secs) == len(calls) == 5 and all(s >= 2e-3 for s in secs)
    cut = timing.time_calls([lambda: time.sleep(2e-3)] * 50, torch.device("cpu"),
                            max_total_s=5e-3, min_calls=2)
    assert 2 <= len(cut) < 50


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_time_calls_on_a_gpu_leaves_out_the_hosts_launch_gap_of_a_lone_call():
    # A lone call after a synchronization (the roof's, one per round): 0.2 ms of host work before
    # its tiny kernel must not be counted as the call's device time, as in a queued run of calls.
    from benchmarks import timing

    x = torch.ones(1, device="cuda")

    def host_then_kernel():
        time.sleep(2e-4)
        x.add_(1)
    secs = timing.time_calls([host_then_kernel], torch.device("cuda"))
    assert secs[0] < 1e-4, f"{secs[0] * 1e6:.0f} us: the host's gap counted"
    assert x.item() == 2
