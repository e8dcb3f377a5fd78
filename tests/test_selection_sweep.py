"""The held-out selection's devices, GPU placement and executors (emcl_continual.sweep).

CPU paths run for real; the placement arithmetic runs with its real functions and a memory
reading given by the test (the one input a machine without a GPU cannot give); the runs on a
GPU skip without CUDA; the Ray executor runs on a local two-node Ray cluster (127.0.0.1, no
dashboard) against the local executor, and skips where Ray is not installed
(``make setup-ray``).
"""
from __future__ import annotations

import json
import os
import re
import time
import warnings

import pytest
import torch

from emcl_continual import presets, selection, sweep, sweep_diff
from emcl_continual.config import build_config
from emcl_continual.methods.emcl import glance_plan

GIB = 1 << 30
TINY = ["--n-tasks", "2", "--samples-per-task", "20", "--allow-dirty"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def one_seed(monkeypatch):
    monkeypatch.setattr(presets, "VALIDATION_SEEDS", (100,))
    monkeypatch.setattr(presets, "REPORT_SEEDS", (10,))
    monkeypatch.setattr(presets, "ALGORITHM_1_GRID", [{"lr_scale": 1e-4, "lr_max": 1e2}])


# --------------------------------------------------------------------------- devices
def test_device_words_per_method_and_plain():
    methods = ("sgd", "emcl", "er")
    assert sweep.parse_devices(None, methods) == {"sgd": "cpu", "emcl": "cpu", "er": "cpu"}
    assert sweep.parse_devices(["auto"], methods) == {"sgd": "auto", "emcl": "auto", "er": "auto"}
    # a per-method word wins over a plain one in either order; cuda:07 is cuda:7
    assert sweep.parse_devices(["emcl=cuda:07", "cpu"], methods) == {"sgd": "cpu", "emcl": "cuda:7", "er": "cpu"}
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        sweep.parse_devices(["gpu"], methods)
    with pytest.raises(ValueError, match="'mer' is not one of this sweep's methods"):
        sweep.parse_devices(["mer=cuda"], methods)
    with pytest.raises(ValueError, match="cuda:x"):
        sweep.parse_devices(["emcl=cuda:x"], methods)


def test_a_gpu_that_is_not_there_is_refused():
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        sweep.check_devices({"emcl": "cuda", "sgd": "cpu"}, 0)
    with pytest.raises(ValueError, match="torch sees 2 GPU"):
        sweep.check_devices({"emcl": "cuda:2"}, 2)
    assert sweep.check_devices({"emcl": "cuda:1"}, 2) == []
    assert "every run on the CPU" in sweep.check_devices({"emcl": "auto"}, 0)[0]


def test_auto_takes_the_gpu_for_captured_emcl_only():
    stream = "permuted-mnist"
    emcl = build_config("emcl", stream, 0, {})
    assert sweep.gpu_pays("emcl", emcl)
    for overrides in ({"importance_norm": "global", "gamma": 1e-3}, {"inner_lr_modulation": True},
                      {"cuda_graph": False}):
        assert not sweep.gpu_pays("emcl", build_config("emcl", stream, 0, overrides)), overrides
    for m in ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml"):
        assert not sweep.gpu_pays(m, build_config(m, stream, 0, {})), m
    assert sweep.want_device("emcl", {}, stream, "auto", 1) == "cuda"
    assert sweep.want_device("emcl", {"importance_norm": "tensor"}, stream, "auto", 1) == "cpu"
    assert sweep.want_device("er", {}, stream, "auto", 1) == "cpu"
    assert sweep.want_device("emcl", {}, stream, "auto", 0) == "cpu"
    assert sweep.want_device("er", {}, stream, "cuda:1", 2) == "cuda:1"
    # the rule is the method's own decision: EMCL built on the CPU asks the same function
    assert glance_plan(emcl, "cpu") == (False, False, None)


def test_every_row_of_the_protocol_gets_a_device_under_auto():
    """The rows of a real plan: auto puts exactly the rows whose glances are captured on the GPU."""
    rows = selection.validation_rows_a("permuted-mnist")
    wants = {r["name"]: sweep.want_device(r["method"], r["overrides"], "permuted-mnist", "auto", 1) for r in rows}
    assert {n for n, w in wants.items() if w == "cuda"} == {r["name"] for r in rows if r["method"] == "emcl"}
    assert not [n for n, w in wants.items() if w == "cuda" and not n.startswith("emcl")]


# --------------------------------------------------------------------------- placement
class Memory:
    """Free and total bytes per GPU, as torch.cuda.mem_get_info gives them; the test changes them."""

    def __init__(self, **free_total):
        self.state = {k.replace("_", ":"): list(v) for k, v in free_total.items()}

    def __call__(self, device):
        return tuple(self.state[device])


def test_placer_puts_a_run_where_there_is_most_room_and_never_overbooks():
    mem = Memory(cuda_0=(3 * GIB, 8 * GIB), cuda_1=(5 * GIB, 8 * GIB))
    p = sweep.GpuPlacer(["cuda:0", "cuda:1"], 2 * GIB, mem_info=mem)
    assert p.place("cpu") == "cpu" and p.running == {"cuda:0": 0, "cuda:1": 0}
    assert p.place("cuda") == "cuda:1"          # 5 GiB free against 3
    assert p.place("cuda") == "cuda:0"          # 3 GiB of room on each (5 - 2 on cuda:1): the first
    assert p.place("cuda") == "cuda:1"          # cuda:0 has 3 - 2 = 1 GiB of room, cuda:1 3
    assert p.place("cuda") is None              # 1 GiB of room on each: it waits
    assert p.place("cuda:0") is None
    mem.state["cuda:0"][0] = 8 * GIB            # another process gave its memory back
    assert p.place("cuda:0") == "cuda:0"        # 8 - 2 = 6 GiB of room
    p.release("cuda:1")
    assert p.running == {"cuda:0": 2, "cuda:1": 1}
    assert "needs --gpu-memory-mib 2048" in p.why_not("cuda") and "cuda:1: 5120 MiB free" in p.why_not("cuda")


def test_placer_caps_runs_per_gpu_and_checks_its_inputs():
    mem = Memory(cuda_0=(80 * GIB, 80 * GIB))
    p = sweep.GpuPlacer(["cuda:0"], GIB, per_gpu=2, mem_info=mem)
    assert [p.place("cuda") for _ in range(3)] == ["cuda:0", "cuda:0", None]
    with pytest.raises(ValueError, match="cuda:3 is not one of the GPUs"):
        p.place("cuda:3")
    with pytest.raises(ValueError, match="--gpu-memory-mib must be positive"):
        sweep.GpuPlacer(["cuda:0"], 0, mem_info=mem)
    with pytest.raises(ValueError, match="--runs-per-gpu must be >= 1"):
        sweep.GpuPlacer(["cuda:0"], GIB, per_gpu=0, mem_info=mem)


def test_wait_for_memory_waits_then_gives_up():
    mem = Memory(cuda_0=(GIB, 8 * GIB))
    assert sweep.wait_for_memory("cuda:0", GIB, 1.0, poll_s=0.01, mem_info=mem) < 0.5
    with pytest.raises(sweep.RunFailed, match="1024 MiB free of 8192 for 0 s; the run needs 2048"):
        sweep.wait_for_memory("cuda:0", 2 * GIB, 0.05, poll_s=0.01, mem_info=mem)


def _task(key, method="sgd", overrides=None, want="cpu", seed=0):
    return {"key": key, "method": method, "overrides": overrides or {}, "seed": seed, "split": "validation",
            "stream": "permuted-mnist", "data_root": None, "role": "validation", "row": key, "n_tasks": 1,
            "samples_per_task": 10, "want": want, "command": "python -m emcl_continual.selection (test)"}


def test_execute_runs_cpu_runs_behind_a_gpu_run_that_never_fits():
    """A run waiting for GPU memory does not hold the CPU runs behind it; when nothing of the
    sweep runs and it still does not fit, it is reported failed (and nothing ran on a GPU)."""
    from emcl_continual.provenance import code_version

    ex = sweep.LocalExecutor(1, 1, gpu_need=4 * GIB, cuda_count=1, mem_info=Memory(cuda_0=(GIB, 8 * GIB)))
    kept, failed = [], []
    failures = sweep.execute([_task("gpu", want="cuda"), _task("a"), _task("b", seed=1)], ex,
                             code_tree=code_version()["code_tree"], on_record=kept.append,
                             on_failure=lambda t, reason, detail: failed.append((t["key"], reason)), log=print)
    assert [r["key"] for r in kept] == ["a", "b"] and all(r["device"] == "cpu" for r in kept)
    assert failed == [(f[0]["key"], f[1]) for f in failures] and failed[0][0] == "gpu"
    assert "does not fit" in failed[0][1] and "1024 MiB free" in failed[0][1]
    assert kept[0]["provenance"]["command"] == "python -m emcl_continual.selection (test)"


class PlacedOnCpu(sweep.LocalExecutor):
    """The local executor's placement (its real GpuPlacer, with the test's memory reading) and
    three threads that train every run on the CPU: what the driver's waiting does, on a machine
    without a GPU. Records where each run was placed and the most runs one GPU held at once."""

    def __init__(self, mem):
        super().__init__(3, 1, gpu_need=2 * GIB, cuda_count=1, mem_info=mem)
        self.placed, self.most = [], 0

    def start(self):
        import concurrent.futures as cf
        self._pool = cf.ThreadPoolExecutor(3)

    def place(self, task):
        device = super().place(task)
        if device is not None:
            self.placed.append((task["key"], device))
            self.most = max(self.most, self.placer.running["cuda:0"])
        return device

    def submit(self, task):
        return self._pool.submit(sweep.run_task, dict(task, device="cpu"))

    def close(self, cancel=False):
        self._pool.shutdown(wait=True)


def test_a_gpu_run_that_does_not_fit_waits_and_the_cpu_runs_behind_it_start():
    from emcl_continual.provenance import code_version

    ex = PlacedOnCpu(Memory(cuda_0=(3 * GIB, 8 * GIB)))  # room for one run of 2 GiB at a time
    kept = []
    failures = sweep.execute([_task("g1", want="cuda"), _task("g2", want="cuda", seed=1), _task("c1", seed=2)],
                             ex, code_tree=code_version()["code_tree"], on_record=kept.append,
                             on_failure=lambda *a: None, log=print)
    assert failures == [] and sorted(r["key"] for r in kept) == ["c1", "g1", "g2"]
    assert ex.placed[:2] == [("g1", "cuda:0"), ("c1", "cpu")]  # g2 waited, c1 behind it started
    assert ex.placed[2] == ("g2", "cuda:0") and ex.most == 1 and ex.placer.running == {"cuda:0": 0}


def test_a_record_of_another_code_tree_is_not_kept():
    ex = sweep.LocalExecutor(1, 1)
    kept, failed = [], []
    sweep.execute([_task("a")], ex, code_tree="0" * 16, on_record=kept.append,
                  on_failure=lambda t, reason, detail: failed.append(reason), log=print)
    assert kept == [] and "one sweep, one code version" in failed[0] and "0" * 16 in failed[0]


def test_a_failed_run_is_reported_kept_pending_and_the_others_written(tmp_path, one_seed, capsys):
    """Two processes; one run fails (a configuration the method refuses when it is built): the
    others are written, the failure goes to failed.jsonl and RunsFailed is raised (the command's
    exit status 1); started again (in this process), only the failed run runs."""
    out = tmp_path / "sel"
    path = str(out / "validation.jsonl")
    good = selection.Row("sgd/a", "sgd", {"lr": 0.1}, "validation", "a", (100, 101))
    bad = selection.Row("sgd/bad", "sgd", {"lr": -1.0}, "validation", "bad", (100,))
    with pytest.raises(selection.RunsFailed, match="1 of 3 run"):
        selection.run_rows([bad, good], path, "permuted-mnist", "validation", jobs=2, n_tasks=1, samples_per_task=10)
    kept = selection.load_runs(path)
    assert sorted(r["seed"] for r in kept) == [100, 101] and {r["overrides"]["lr"] for r in kept} == {0.1}
    fails = selection.load_runs(str(out / selection.FAILED_FILE))
    assert len(fails) == 1 and fails[0]["key"] == selection.run_key("sgd", {"lr": -1.0}, 100, "validation")
    assert "lr" in fails[0]["reason"] and fails[0]["detail"]
    capsys.readouterr()
    with pytest.raises(selection.RunsFailed, match="1 of 1 run"):
        selection.run_rows([bad, good], path, "permuted-mnist", "validation", jobs=1, n_tasks=1, samples_per_task=10)
    assert "1 run(s) to do" in capsys.readouterr().out
    timing = selection.load_runs(str(out / selection.TIMINGS_FILE))
    assert [(t["runs"], t["failed"], t["slots"]) for t in timing] == [(3, 1, 2), (1, 1, 1)]


def test_every_finished_run_says_how_many_are_done_and_about_how_long_the_rest_take(
        tmp_path, one_seed, capsys):
    """Each run's line counts the finished runs, failed ones included, out of the stage's,
    with the time left at the pace so far; the last says no time."""
    path = str(tmp_path / "sel" / "validation.jsonl")
    good = selection.Row("sgd/a", "sgd", {"lr": 0.1}, "validation", "a", (100, 101))
    bad = selection.Row("sgd/bad", "sgd", {"lr": -1.0}, "validation", "bad", (100,))
    with pytest.raises(selection.RunsFailed):
        selection.run_rows([good, bad], path, "permuted-mnist", "validation", jobs=1, n_tasks=1,
                           samples_per_task=10)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")]
    assert [ln.split()[1] for ln in lines] == ["[1/3,", "[2/3,", "[3/3]"]
    assert all(re.search(r"~\d+(\.\d)? (s|min|h) left\]", ln) for ln in lines[:2])
    assert "FAILED" in lines[2]
    assert [selection._duration(s) for s in (45, 89.4, 720, 12600)] == ["45 s", "89 s", "12 min",
                                                                           "3.5 h"]


def test_the_command_says_device_errors_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "x")
    for argv, text in ((["--device", "tpu"], "'tpu' is not a device"),
                       (["--device", "cpu", "foo=cuda"], "'foo' is not one of this sweep's methods"),
                       (["--ray-address", "127.0.0.1:1"], "--ray-address goes with --executor ray"),
                       (["--jobs", "0"], "--jobs must be >= 1"),
                       (["--gpu-memory-mib", "0"], "--gpu-memory-mib must be positive")):
        with pytest.raises(SystemExit) as exc:
            selection.main(["--out", out] + argv)
        assert exc.value.code == 2 and text in capsys.readouterr().err, argv
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            selection.main(["--out", out, "--device", "emcl=cuda"])
        assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_local_jobs_and_auto_without_a_gpu_give_the_one_job_numbers(tmp_path, one_seed, capsys):
    """--jobs 2 --device auto on a machine without a GPU: every run on the CPU, the same records as
    one job (same keys, same accuracies and matrices), and a resume that runs nothing."""
    args = TINY + ["--methods", "sgd", "emcl", "--until", "validate-a"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert selection.main(["--out", a] + args) == 0
    assert selection.main(["--out", b, "--jobs", "2", "--device", "auto" if not torch.cuda.is_available() else "cpu"]
                          + args) == 0
    ra = {r["key"]: r for r in selection.load_runs(os.path.join(a, "validation.jsonl"))}
    rb = {r["key"]: r for r in selection.load_runs(os.path.join(b, "validation.jsonl"))}
    assert set(ra) == set(rb) and len(ra) == 4 + 4 + 1
    for k in ra:
        assert (ra[k]["acc"], ra[k]["acc_matrix"], ra[k]["task_losses"]) == (rb[k]["acc"], rb[k]["acc_matrix"],
                                                                             rb[k]["task_losses"]), k
        assert rb[k]["device"] == "cpu" and rb[k]["executor"] == "local"
    # each command that ran something timed it: one line per stage run, with its runs and slots
    timing = selection.load_runs(os.path.join(b, selection.TIMINGS_FILE))
    assert len(timing) == 1 and timing[0]["runs"] == 9 and timing[0]["failed"] == 0
    assert timing[0]["slots"] == 2 and timing[0]["executor"] == "local" and timing[0]["split"] == "validation"
    assert timing[0]["wall_s"] > 0 and timing[0]["host"]["logical_cpus"] == os.cpu_count()
    assert timing[0]["rows"] == sorted(r["name"] for r in selection.validation_rows_a("permuted-mnist",
                                                                                     ["sgd", "emcl"]))
    capsys.readouterr()
    assert selection.main(["--out", b, "--jobs", "2"] + args) == 0
    assert "run(s) to do" not in capsys.readouterr().out
    assert len(selection.load_runs(os.path.join(b, selection.TIMINGS_FILE))) == 1   # nothing ran: no line
    # the two sweeps side by side (python -m emcl_continual.sweep_diff): the same bits, the same
    # selection, both timed
    d = sweep_diff.diff(a, b)
    assert d["runs_in_both"] == 9 and d["only_a"] == d["only_b"] == 0
    assert all(m["identical"] == m["runs"] and m["max_abs_diff"] == 0 for m in d["methods"].values())
    assert set(d["selection"]) == {"sgd", "emcl", "emcl/algorithm-1"}
    assert all(s["same"] and s["a"] is not None for s in d["selection"].values())
    assert d["timing_a"]["slots"] == [1] and d["timing_b"]["slots"] == [2] and d["time_ratio_a_over_b"] > 0
    assert sweep_diff.main([a, b, "--out", str(tmp_path / "diff")]) == 0
    text = (tmp_path / "diff.md").read_text()
    assert "the same for 3 of 3 groups" in text and "| sgd | 4 | 4 | 0.00 |" in text
    # what it refuses, in one line: a folder that is not there, one without runs, no run in common
    with pytest.raises(SystemExit) as exc:
        sweep_diff.main([a, str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="holds no runs"):
        sweep_diff.diff(a, str(empty))
    other = tmp_path / "other"
    other.mkdir()
    unrelated = {**next(iter(rb.values())), "key": "x|{}|1|validation|embedded"}
    (other / "validation.jsonl").write_text(json.dumps(unrelated) + "\n")
    with pytest.raises(SystemExit, match="no run in common"):
        sweep_diff.diff(a, str(other))


# --------------------------------------------------------------------------- on a GPU
@needs_cuda
def test_auto_on_a_gpu_puts_captured_emcl_there_and_the_baselines_on_the_cpu(tmp_path, one_seed):
    args = TINY + ["--methods", "sgd", "emcl", "--until", "validate-a"]
    cpu, gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    assert selection.main(["--out", cpu] + args) == 0
    assert selection.main(["--out", gpu, "--jobs", "3", "--device", "auto"] + args) == 0
    rc = {r["key"]: r for r in selection.load_runs(os.path.join(cpu, "validation.jsonl"))}
    rg = {r["key"]: r for r in selection.load_runs(os.path.join(gpu, "validation.jsonl"))}
    assert set(rc) == set(rg)
    for k, r in rg.items():
        want = "cuda" if r["method"] == "emcl" else "cpu"
        assert r["device"].startswith(want), (k, r["device"])
        # same runs within numerical noise (different kernels, one-sample steps over 2 small tasks)
        assert abs(r["acc"] - rc[k]["acc"]) < 5.0, k


@needs_cuda
def test_placer_reads_the_real_gpu_memory():
    free, total = torch.cuda.mem_get_info(0)
    assert sweep.GpuPlacer(["cuda:0"], free + GIB).place("cuda") is None
    p = sweep.GpuPlacer(["cuda:0"], min(free // 4, GIB))
    assert p.place("cuda:0") == "cuda:0" and p.room("cuda:0") <= free


@needs_cuda
def test_emcl_built_on_a_gpu_captures_exactly_where_auto_says_it_pays():
    from emcl_continual.methods import get_method
    from emcl_continual.models import build_model
    from emcl_continual.streams import make_stream

    info = make_stream("permuted-mnist", 0, n_tasks=1, samples_per_task=10).info
    for overrides in ({}, {"importance_norm": "global", "gamma": 1e-3}, {"cuda_graph": False},
                      {"inner_lr_modulation": True}):
        cfg = build_config("emcl", "permuted-mnist", 0, overrides)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager ones say once why they stay eager
            m = get_method("emcl")(build_model(info).cuda(), info, cfg, torch.device("cuda"))
        assert m.graph_choice[1] == sweep.gpu_pays("emcl", cfg), overrides


# --------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two nodes with one CPU each (the head and a second node), on
    127.0.0.1, no dashboard; shut down (its own processes) after the module.

    Ray turns a loopback address given to ``ray.init`` into the machine's outward address,
    where a node bound to 127.0.0.1 does not answer, unless its switch for clusters on one
    machine (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every Ray address is the loopback) is
    off; the nodes this fixture starts inherit the variable, this process gets its value."""
    before = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report of the cluster's use to Ray's servers
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    imported_before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # the variable's value, where Ray was imported before it was set

    started = time.perf_counter()
    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 * (1 << 20))
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    print(f"ray cluster of 2 nodes up in {time.perf_counter() - started:.1f} s at {cluster.address}")
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()
    ray_constants.ENABLE_RAY_CLUSTER = imported_before
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_ray_executor_gives_the_local_executors_runs_and_numbers(tmp_path, ray_cluster, monkeypatch, capsys):
    """A tiny selection through Ray on two nodes and through two local processes: the same runs
    (keys), the same per-run metrics, the same selection; a failed run is reported and kept
    pending; started again, Ray runs only what is left."""
    monkeypatch.setattr(presets, "VALIDATION_SEEDS", (100, 101))
    monkeypatch.setattr(presets, "ALGORITHM_1_GRID", [{"lr_scale": 1e-4, "lr_max": 1e2}])
    args = TINY + ["--methods", "sgd", "emcl", "--until", "select-a"]
    local, viaray = str(tmp_path / "local"), str(tmp_path / "ray")
    t0 = time.perf_counter()
    assert selection.main(["--out", local, "--jobs", "2"] + args) == 0
    t1 = time.perf_counter()
    assert selection.main(["--out", viaray, "--executor", "ray", "--ray-address", ray_cluster.address] + args) == 0
    t2 = time.perf_counter()
    print(f"local executor {t1 - t0:.1f} s, ray executor {t2 - t1:.1f} s")
    rl = {r["key"]: r for r in selection.load_runs(os.path.join(local, "validation.jsonl"))}
    rr = {r["key"]: r for r in selection.load_runs(os.path.join(viaray, "validation.jsonl"))}
    assert set(rl) == set(rr) and len(rr) == (4 + 4 + 1) * 2
    for k in rl:
        for field in ("acc", "bwt", "acc_matrix", "acc_before", "metrics", "task_losses", "config", "split",
                      "eval_size"):
            assert rl[k][field] == rr[k][field], (k, field)
        assert rr[k]["executor"] == "ray" and rl[k]["executor"] == "local"
        assert rr[k]["provenance"]["code_tree"] == rl[k]["provenance"]["code_tree"]
        assert rr[k]["provenance"]["command"] == rl[k]["provenance"]["command"].replace(
            f"--out {local} --jobs 2", f"--out {viaray} --executor ray --ray-address {ray_cluster.address}")
    assert len({r["ray_node"] for r in rr.values()}) == 2  # both nodes ran runs
    sl, sr = (json.load(open(os.path.join(d, "selected.json"))) for d in (local, viaray))
    assert sl["methods"] == sr["methods"]
    # a run that fails in a Ray worker: reported, in failed.jsonl, not in the results; the rest written
    bad = selection.Row("sgd/bad", "sgd", {"lr": -1.0}, "validation", "bad", (100,))
    good = selection.Row("sgd/new", "sgd", {"lr": 0.05}, "validation", "new", (100,))
    path = os.path.join(viaray, "validation.jsonl")
    with pytest.raises(selection.RunsFailed, match="1 of 2 run"):
        selection.run_rows([bad, good], path, "permuted-mnist", "validation", executor="ray",
                           ray_address=ray_cluster.address, n_tasks=2, samples_per_task=20)
    fails = selection.load_runs(os.path.join(viaray, selection.FAILED_FILE))
    assert [f["row"] for f in fails] == ["sgd/bad"] and "lr" in fails[0]["reason"]
    assert "RayTaskError" not in fails[0]["reason"]  # the run's own error, not Ray's wrapper
    assert len(selection.load_runs(path)) == len(rr) + 1
    capsys.readouterr()
    assert selection.main(["--out", viaray, "--executor", "ray", "--ray-address", ray_cluster.address] + args) == 0
    assert "run(s) to do" not in capsys.readouterr().out


# --------------------------------------------------------------------------- interrupted
def _workers(pid: int) -> list:
    """The pool workers (spawned processes) among ``pid``'s children."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as fh:
            for child in fh.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    if b"spawn_main" in cmd.read():
                        out.append(int(child))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process tree from /proc")
def test_a_stage_stopped_by_sigterm_keeps_its_runs_times_itself_and_ends_its_workers(tmp_path):
    """`timeout` around a sweep sends SIGTERM: the command ends at once with 130, the runs written
    stay, the stage's timing line says it was interrupted and after how many runs, the pool's
    workers do not outlive it, and the same command runs only the rest."""
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "python")]))
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "emcl_continual.selection", "--out", str(out), "--jobs", "2",
           "--methods", "sgd", "emcl", "--until", "validate-a"] + TINY
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    runs = out / "validation.jsonl"
    deadline = time.time() + 240
    while not (runs.exists() and runs.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    workers = _workers(proc.pid)
    assert workers
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: SIGTERM after" in err and "the same command runs the other" in err
    kept = selection.load_runs(str(runs))
    timing = selection.load_runs(str(out / selection.TIMINGS_FILE))
    assert len(timing) == 1 and timing[0]["interrupted"] == "SIGTERM"
    n = timing[0]["runs"]              # sgd's and emcl's grids and Algorithm 1's cells, 2 seeds
    assert n == 24 and timing[0]["done"] == len(kept) < n
    deadline = time.time() + 20
    while any(map(_alive, workers)) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, workers))
    # a diff against a cut-off stage compares the runs, not the times
    d = sweep_diff.diff(str(out), str(out))
    assert d["time_ratio_a_over_b"] is None and d["timing_a"]["interrupted"] == ["SIGTERM"]
    assert "interrupted by SIGTERM after" in sweep_diff.markdown(d)
    # resumed: only the runs not kept run, and the stage is then complete
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{n - len(kept)} run(s) to do" in done.stdout
    assert len(selection.load_runs(str(runs))) == n


def test_a_signal_while_a_record_is_written_still_counts_that_record(tmp_path, one_seed, monkeypatch):
    """SIGTERM arriving while a finished run's line is being written: the line is written whole
    and counted in the stage's timing line ("done" = the lines in the file), never one without
    the other."""
    import signal

    path = tmp_path / "validation.jsonl"
    real_fsync = os.fsync
    sent = []

    def fsync_then_signal(fd):
        real_fsync(fd)
        if not sent and os.path.exists(path) and os.path.getsize(path) > 0:
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)   # after the write, before its count

    monkeypatch.setattr(os, "fsync", fsync_then_signal)
    rows = selection.validation_rows_a("permuted-mnist", ("sgd",))
    from emcl_continual.errors import CommandInterrupted

    with pytest.raises(CommandInterrupted, match="SIGTERM"):
        selection.run_rows(rows, str(path), "permuted-mnist", "validation", jobs=1, n_tasks=2,
                           samples_per_task=20)
    assert sent
    timing = selection.load_runs(str(tmp_path / selection.TIMINGS_FILE))
    assert timing[0]["interrupted"] == "SIGTERM"
    assert timing[0]["done"] == len(selection.load_runs(str(path))) == 1


def test_a_run_process_keeps_to_its_threads():
    """--threads sizes every thread pool of a run's process: torch's, and the BLAS and OpenMP
    pools NumPy and SciPy start with one thread per core (GEM's QP), so that --jobs runs at a
    time use --jobs x --threads cores."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    executor = sweep.LocalExecutor(jobs=2, threads=1)
    executor.start()
    try:
        pools = executor._pool.submit(threadpoolctl.threadpool_info).result(timeout=120)
    finally:
        executor.close()
    assert {p["user_api"] for p in pools} >= {"blas", "openmp"}, pools
    assert {p["num_threads"] for p in pools} == {1}, pools


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process table from /proc")
def test_a_cancelled_local_executor_ends_the_runs_in_flight():
    """close(cancel=True), as on an error or an interrupt, terminates the workers still running
    a run rather than leaving them to finish it unseen (or outlive the command)."""
    executor = sweep.LocalExecutor(jobs=2)
    executor.start()
    busy = [executor._pool.submit(time.sleep, 120) for _ in range(2)]
    deadline = time.time() + 60
    while not all(f.running() for f in busy):
        assert time.time() < deadline
        time.sleep(0.1)
    pids = list(executor._pool._processes)
    t0 = time.time()
    executor.close(cancel=True)
    # by the process table: the pool's own thread may reap a worker first, and then
    # multiprocessing's is_alive() cannot tell
    while any(map(_alive, pids)) and time.time() - t0 < 30:
        time.sleep(0.05)
    assert not any(map(_alive, pids))


def test_sweep_diff_names_the_folders_relative_to_where_it_runs(tmp_path, monkeypatch):
    # results files name the repository's folders as `results/...`, not this machine's absolute path
    monkeypatch.chdir(tmp_path)
    assert sweep_diff._shown(str(tmp_path / "results" / "x")) == os.path.join("results", "x")
    outside = os.path.abspath(os.path.join(str(tmp_path), os.pardir, "elsewhere"))
    assert sweep_diff._shown(outside) == outside
