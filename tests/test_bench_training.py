"""benchmarks/bench_training.py on the CPU: devices (cpu | cuda | auto), every method, the image
streams as random pixels in their shapes, the JSON and the README tables.
The GPU half of ``--device auto`` runs where there is a GPU (``make gpu-check``)."""
from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_training  # noqa: E402

from emcl_continual.data import streams  # noqa: E402
from emcl_continual.methods import METHODS  # noqa: E402
from emcl_continual.training.cost import CostCounter  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """Every method once (EMCL on two backends) on one short permuted-MNIST task, on the CPU."""
    out = tmp_path_factory.mktemp("bench")
    result = bench_training.main(["--device", "cpu", "--n-tasks", "1", "--samples-per-task", "20",
                                  "--backends", "foreach", "cpu", "--out-dir", str(out), "--name", "run"])
    return result, out


def test_every_method_is_timed_on_the_cpu(cpu_run):
    result, out = cpu_run
    # in the registry's order (emcl_continual.methods.METHODS), EMCL once per backend
    assert [r["label"] for r in result["records"]] == \
        [label for m in METHODS for label in (["emcl (foreach)", "emcl (cpu)"] if m == "emcl" else [m])]
    for r in result["records"]:
        assert r["device"] == "cpu" and r["stream"] == "permuted-mnist" and r["graph"] is None
        assert r["train_time_s"] > 0 and r["n_batches"] == 2
        assert r["ms_per_batch"] == pytest.approx(1e3 * r["train_time_s"] / 2)
        assert 0.0 <= r["acc"] <= 100.0 and r["ms_per_batch_steady"] is None
    with open(out / "run.json") as f:
        saved = json.load(f)
    assert saved["schema"] == "emcl-kernels/bench_training/2"
    assert saved["settings"]["devices"] == ["cpu"] and saved["settings"]["device"] == "cpu"
    assert saved["auto_backend"]["cpu"] in ("cpu", "foreach")
    assert saved["machine"]["load_average_at_start"] is not None
    assert saved["machine"]["load_average_at_end"] is not None


def test_readme_tables_from_the_results_file(cpu_run, capsys):
    result, out = cpu_run
    text = bench_training.main(["--table", str(out / "run.json")])["table"]
    assert text == capsys.readouterr().out.strip("\n")
    assert "**permuted-mnist**, 1 task(s) x 20 samples, batch 10: training time, s" in text
    auto = result["auto_backend"]["cpu"]
    emcl = next(r for r in result["summary"] if r["label"] == f"emcl ({auto})")
    first = next(line for line in text.splitlines() if line.startswith("| emcl |"))
    assert first == f"| emcl | {bench_training._num(emcl['train_time_s'])} ({auto}) | {emcl['acc']:.2f} |"
    for m in METHODS:
        assert any(line.startswith(f"| {m} |") for line in text.splitlines()), m
    assert "From `run.json`: cpu: " in text and "load average at start" in text


def test_readme_tables_merge_a_cpu_and_a_gpu_file_with_the_speed_up(cpu_run, tmp_path):
    """A GPU file (here the CPU file relabelled, with halved times) merges into the same rows."""
    result, out = cpu_run
    with open(out / "run.json") as f:
        cpu = json.load(f)
    gpu = copy.deepcopy(cpu)
    gpu["settings"]["device"] = "cuda"
    gpu["device_names"] = {"cuda": "some GPU"}
    gpu["auto_backend"] = {"cuda": "foreach"}
    for r in gpu["summary"]:
        r["device"] = "cuda"
        r["graph"] = True if r["method"] == "emcl" else None
        r["train_time_s"] /= 2
    gpu_path = tmp_path / "gpu.json"
    gpu_path.write_text(json.dumps(gpu))
    text = bench_training.main(["--table", str(out / "run.json"), str(gpu_path)])["table"]
    head = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert head == "| method | CPU | GPU | GPU speed-up | ACC CPU | ACC GPU |"
    sgd = next(line for line in text.splitlines() if line.startswith("| sgd |")).split(" | ")
    assert sgd[3] == "2.0x"
    emcl = next(line for line in text.splitlines() if line.startswith("| emcl |"))
    assert "(foreach, graph)" in emcl and "some GPU" in text


def test_auto_times_the_gpu_only_where_there_is_one(tmp_path):
    """--device auto: the CPU, and the GPU where there is one; --backends auto: EMCL on the
    backend FusedEMCLOptimizer picks on each device (graphed and eager on a GPU)."""
    result = bench_training.main(["--device", "auto", "--quick", "--n-tasks", "1", "--samples-per-task", "10",
                                  "--methods", "emcl", "sgd", "--backends", "auto",
                                  "--out-dir", str(tmp_path)])
    devices = ["cpu", "cuda"] if CUDA else ["cpu"]
    assert result["settings"]["devices"] == devices
    auto = result["auto_backend"]
    expected = []
    for d in devices:
        expected += [(d, "emcl", auto[d], g) for g in ([True, False] if d == "cuda" else [None])]
        expected.append((d, "sgd", None, None))
    assert [(r["device"], r["method"], r["backend"], r["graph"]) for r in result["records"]] == expected
    if not CUDA:
        assert result["notes"] == ["--device auto: no GPU here, timing the CPU only"]


@pytest.mark.skipif(CUDA, reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as err:
        bench_training.main(["--device", "cuda", "--quick", "--out-dir", str(tmp_path)])
    message = str(err.value)
    assert "--device cuda: torch sees no CUDA device here" in message and "\n" not in message
    assert not list(tmp_path.iterdir())


def test_bad_device_stream_and_method_are_clear(capsys):
    with pytest.raises(SystemExit, match="--device: cpu, cuda or auto, got 'tpu'"):
        bench_training.main(["--device", "tpu"])
    for argv, option, choices in ((["--streams", "nope"], "--streams", streams.STREAMS),
                                  (["--streams", "split-cifar100", "--methods", "emcl", "nope"],
                                   "--methods", METHODS)):
        with pytest.raises(SystemExit):
            bench_training.main(argv)
        err = capsys.readouterr().err
        assert f"argument {option}: invalid choice: 'nope'" in err and all(c in err for c in choices)
    with pytest.raises(SystemExit, match="not a training results file"):
        bench_training.main(["--table", os.path.join(bench_training.common.REPO, "results", "efficiency",
                                                     "controlled_cpu.json")])


def test_table_numbers_have_three_digits_and_no_exponent():
    assert [bench_training._num(v) for v in (0.7364, 19.77, 455.6, 3279.6, 14755.3)] == \
        ["0.736", "19.8", "456", "3,280", "14,755"]


def test_labels():
    assert bench_training.label("emcl", "cuda", True) == "emcl (cuda, graph)"
    assert bench_training.label("emcl", "cuda", False) == "emcl (cuda, eager)"
    assert bench_training.label("emcl", "cpu") == "emcl (cpu)" and bench_training.label("er", None) == "er"


# --------------------------------------------------------------------------- image streams
@pytest.mark.parametrize("stream, shape", [("split-cifar100", (3, 32, 32)), ("split-miniimagenet", (3, 84, 84))])
def test_image_streams_without_their_data_are_random_pixels_in_their_shape(stream, shape):
    s = bench_training.make_stream(stream, 0, None, 1, 20)
    assert s.info.name == stream and s.info.input_shape == shape and s.info.n_tasks == 1
    assert s.info.task_classes == [(0, 5)] and s.info.multi_head
    assert "random pixels" in s.info.source
    assert [len(t) for t in s.train] == [20] and tuple(s.train[0].x.shape[1:]) == shape
    assert float(s.train[0].x.std()) > 0.2  # random pixels, not a constant image


def test_image_stream_reports_time_per_batch(tmp_path):
    result = bench_training.main(["--streams", "split-cifar100", "--image-batches", "2",
                                  "--methods", "emcl", "sgd", "--out-dir", str(tmp_path),
                                  "--name", "img"])
    recs = result["records"]
    assert [r["label"] for r in recs] == [f"emcl ({result['auto_backend']['cpu']})", "sgd"]
    for r in recs:
        assert r["stream"] == "split-cifar100" and r["n_batches"] == 2 and len(r["batch_ms"]) == 2
        assert r["acc"] is None and r["ms_per_batch"] == pytest.approx(sum(r["batch_ms"]) / 2, rel=1e-3)
        assert r["ms_per_batch_steady"] == pytest.approx(r["batch_ms"][-1], rel=1e-3)  # 2 batches: the last
    ps = result["settings"]["per_stream"]["split-cifar100"]
    assert ps["n_tasks"] == 1 and ps["samples_per_task"] == 20 and "random pixels" in ps["data_source"]
    table = bench_training.main(["--table", str(tmp_path / "img.json")])["table"]
    assert "ms per batch (steady)" in table and "ACC not meaningful" in table


# ---------------------------------------------------------------------------------------------
# --heldout: the counted cost of each algorithm, and the interleaved rounds
# ---------------------------------------------------------------------------------------------

def _counted(method, overrides, n_tasks=2, per_task=30):
    stream = streams.make_stream("permuted-mnist", 3, n_tasks=n_tasks, samples_per_task=per_task)
    r = bench_training.run_prefix(method, overrides, stream, 3, n_tasks, 10, count=True)
    assert r["incoming_samples"] == n_tasks * per_task
    return r["counts"]


N, B = 60, 10                      # incoming samples (2 tasks of 30) and batch size
BATCHES = N // B


# La-MAML, 5 glances: per glance 10 one-sample inner steps, each followed by the meta-loss on the
# batch and 10 replayed samples (1 + 10 + 10 = 21 samples per inner step; the first glance of
# the first batch has no replay yet: 11)
LAMAML_PASSES = 10 * 11 + 4 * 10 * 21 + (BATCHES - 1) * 5 * 10 * 21


def _mer_steps(k, s=10):
    """MER: per incoming example, s batches of the example and up to k memories (the reservoir
    holds every earlier example until it is full), one SGD step per sample of each batch."""
    return sum(s * (1 + min(k, n)) for n in range(N))


@pytest.mark.parametrize("method, overrides, forward, backward, updates, optimizer_calls", [
    # one SGD step per batch on the batch
    ("sgd", {}, N, N, BATCHES, {"step": BATCHES}),
    # ER: the batch joined with 10 replayed samples, except the first batch (empty buffer)
    ("er", {}, B + (BATCHES - 1) * 2 * B, B + (BATCHES - 1) * 2 * B, BATCHES, {"step": BATCHES}),
    # GEM (the memory split by the stream's 2 tasks: 100 each): task 1's batches also take the
    # gradient of task 0's 30 stored samples (one vmapped call)
    ("gem", {}, N + 3 * 30, N + 3 * 30, BATCHES, {"step": BATCHES}),
    # MER: one forward, backward and update per per-sample step; NumPy fast path and autograd alike
    ("mer", {}, _mer_steps(10), _mer_steps(10), _mer_steps(10), {}),
    ("mer", {"fast_mlp": False}, _mer_steps(10), _mer_steps(10), _mer_steps(10), {}),
    # La-MAML: updates are the 10 fast-weight sets and the meta step of each glance; its
    # optimizer steps the learning rates
    ("lamaml", {}, LAMAML_PASSES, LAMAML_PASSES,
     BATCHES * 5 * 11, {"step": BATCHES * 5}),
    # second order: the meta backward also runs back through each inner forward
    ("lamaml", {"second_order": True}, LAMAML_PASSES, LAMAML_PASSES + BATCHES * 5 * 10, BATCHES * 5 * 11, {"step": BATCHES * 5}),
    # EMCL, one glance: one-sample inner steps over the batch and 10 replayed samples, then the
    # meta-loss on the same 20 (10 and 10 on the first batch)
    ("emcl", {}, 2 * B + (BATCHES - 1) * 4 * B, 2 * B + (BATCHES - 1) * 4 * B, (B + 1) + (BATCHES - 1) * (2 * B + 1),
     {"inner_step": B + (BATCHES - 1) * 2 * B, "meta_step": BATCHES}),
    ("emcl", {"glances": 2}, 2 * (2 * B + (BATCHES - 1) * 4 * B), 2 * (2 * B + (BATCHES - 1) * 4 * B),
     2 * ((B + 1) + (BATCHES - 1) * (2 * B + 1)), {"inner_step": 2 * (B + (BATCHES - 1) * 2 * B), "meta_step": 2 * BATCHES}),
])
def test_counted_cost_is_what_each_algorithm_does(method, overrides, forward, backward, updates, optimizer_calls):
    c = _counted(method, overrides)
    assert (c["forward_samples"], c["backward_samples"], c["updates"], c["optimizer_calls"]) == \
        (forward, backward, updates, optimizer_calls)
    assert c["forward_per_sample"] == pytest.approx(forward / N)
    assert c["updates_per_sample"] == pytest.approx(updates / N)


def test_counter_leaves_the_learner_as_it_was():
    from emcl_continual.training import train
    from emcl_continual.methods import get_method
    from emcl_continual.data.models import build_model

    stream = streams.make_stream("permuted-mnist", 0, n_tasks=1, samples_per_task=10)
    config = train.build_config("emcl", "permuted-mnist", 0, {})
    learner = get_method("emcl")(build_model(stream.info), stream.info, config, torch.device("cpu"))
    counter = CostCounter().attach(learner)
    assert "inner_step" in vars(learner.opt) and learner.model._forward_hooks
    x, y = next(stream.batches(0, 10))
    learner.observe(x, y, 0)
    counter.flush()
    counter.detach()
    assert "inner_step" not in vars(learner.opt) and "step" not in vars(learner.opt)
    assert not learner.model._forward_hooks and not learner.model._forward_pre_hooks
    learner.observe(x, y, 0)  # no longer counted
    assert counter.forward_samples == 20 and counter.updates == 11


def test_heldout_rows_are_the_committed_report_rows():
    heldout = os.path.join(bench_training.common.REPO, "results", "heldout")
    plan, rows = bench_training.heldout_rows(os.path.join(heldout, "permuted-mnist"))
    rows, plan = {r["name"]: r for r in rows}, {r["name"]: r for r in plan["rows"]}
    # La-MAML's selected configuration is its own script's: timed once, under both names
    assert "lamaml" not in rows and rows["lamaml/own-script"]["same_as"] == ["lamaml"]
    for name, r in rows.items():
        assert plan[name]["role"] == "report" and r["overrides"] == plan[name]["overrides"]
    _, rot = bench_training.heldout_rows(os.path.join(heldout, "rotated-mnist"))
    assert {"lamaml", "lamaml/own-script", "emcl", "mer", "emcl/glances=5"} <= {r["name"] for r in rot}
    with pytest.raises(SystemExit, match="not report rows"):
        bench_training.heldout_rows(os.path.join(heldout, "rotated-mnist"), ["emcl/grid0"])


def test_heldout_mode_counts_then_times_interleaved_rounds(tmp_path):
    folder = tmp_path / "heldout" / "permuted-mnist"
    folder.mkdir(parents=True)
    rows = [{"name": m, "method": m, "overrides": {}, "role": "report", "seeds": [10]} for m in ("sgd", "emcl")]
    (folder / "plan.json").write_text(json.dumps({"stream": "permuted-mnist", "report_seeds": [10], "n_tasks": 3,
                                                  "samples_per_task": 20, "data_root": None, "rows": rows}))
    argv = ["--heldout", str(tmp_path / "heldout"), "--streams", "permuted-mnist", "--heldout-samples", "40",
            "--rounds", "3", "--out-dir", str(tmp_path / "out"), "--name", "h"]
    result = bench_training.main(argv)
    assert [(r["round"], r["row"]) for r in result["records"]] == \
        [(0, "sgd"), (0, "emcl"), (1, "emcl"), (1, "sgd"), (2, "sgd"), (2, "emcl")]
    saved = json.load(open(tmp_path / "out" / "h.json"))
    assert saved["schema"] == "emcl-kernels/bench_training/heldout/1"
    m = saved["machine"]
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and m["cpu"]
    assert m["load_average_before"] is not None and m["load_average_after"] is not None
    ps = saved["settings"]["per_stream"]["permuted-mnist"]
    assert (ps["n_tasks_timed"], ps["n_tasks_stream"], ps["seed"]) == (2, 3, 10)
    for s in saved["summary"]:
        times = [r["train_time_s"] for r in saved["records"] if r["row"] == s["row"]]
        assert s["train_time_s_median"] == sorted(times)[1] and s["rounds"] == 3
        assert s["ms_per_sample"] == pytest.approx(1e3 * s["train_time_s_median"] / 40)
        assert s["counts"]["incoming_samples"] == 40
    emcl = next(s for s in saved["summary"] if s["row"] == "emcl")
    assert emcl["counts"]["forward_samples"] == 2 * B + 3 * 4 * B  # 4 batches: the first without replay
    with pytest.raises(SystemExit, match="whole number"):
        bench_training.main(argv[:5] + ["30"] + argv[6:])
