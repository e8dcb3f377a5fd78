"""What ``import emcl_kernels`` costs beyond ``import torch``: its cumulative import time under
``python -X importtime`` in fresh interpreters, torch imported first (benchmarks/README.md,
``imports``).

    python -m benchmarks imports [--runs 7] [--out FILE]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

from benchmarks import common, harness

CODE = "import torch, emcl_kernels"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([common.REPO, os.path.join(common.REPO, "python"),
                                                   os.environ.get("PYTHONPATH", "")]))


def importtime_ms() -> float:
    """``emcl_kernels``' cumulative time (its own imports included) under ``python -X importtime``
    in a fresh interpreter, this checkout first on its path, torch imported before it: what the
    package adds, free of the interpreter's start-up and of torch's import."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", CODE], check=True, env=ENV,
                          cwd=common.REPO, capture_output=True, text=True)
    for line in proc.stderr.splitlines():
        parts = [part.strip() for part in line.split("|")]
        if len(parts) == 3 and parts[2] == "emcl_kernels":
            return int(parts[1]) / 1e3
    raise RuntimeError("python -X importtime printed no line for emcl_kernels")


def main(argv=None) -> dict:
    """Run the benchmark; return the results (also written to ``--out FILE``)."""
    ap = harness.parser("imports", __doc__)
    ap.add_argument("--runs", type=int, default=7, help="fresh interpreters")
    ap.add_argument("--out", default=None, help="write the record to this JSON file")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    result = harness.head("imports", argv)
    ms = [importtime_ms() for _ in range(args.runs)]
    result.update(runs=args.runs, load_average_after=common.load_average(), importtime_ms=ms,
                  importtime_median_ms=statistics.median(ms), importtime_range_ms=[min(ms), max(ms)])
    print(f"import emcl_kernels after import torch: median {result['importtime_median_ms']:.1f} ms "
          f"under -X importtime ({args.runs} interpreters; from {min(ms):.1f} to {max(ms):.1f} ms)")
    if args.out:
        harness.save(result, args.out)
    return result
