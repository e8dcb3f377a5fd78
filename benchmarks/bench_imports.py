"""What ``import emcl_kernels`` costs beyond ``import torch``: fresh interpreters in alternating
pairs, and the slowest imports under ``python -X importtime`` (benchmarks/README.md, ``imports``).

    python -m benchmarks imports [--runs 7] [--out FILE]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from benchmarks import common, harness

TORCH, PACKAGE = "import torch", "import torch, emcl_kernels"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([common.REPO, os.path.join(common.REPO, "python"),
                                                   os.environ.get("PYTHONPATH", "")]))


def _run(*args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter with ``args``, this checkout first on its path."""
    return subprocess.run([sys.executable, *args], check=True, env=ENV, cwd=common.REPO,
                          capture_output=True, text=True)


def slowest_imports(top: int = 10) -> list:
    """The package's ``top`` modules by cumulative time (their own imports included) under
    ``python -X importtime``, torch imported first: what the package adds."""
    rows = []
    for line in _run("-X", "importtime", "-c", PACKAGE).stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
            if cumulative.isdigit() and name.startswith("emcl_kernels"):
                rows.append((int(cumulative), name))
    return [{"module": n, "cumulative_us": c} for c, n in sorted(rows, reverse=True)[:top]]


def main(argv=None) -> dict:
    """Run the benchmark; return the results (also written to ``--out FILE``)."""
    ap = harness.parser("imports", __doc__)
    ap.add_argument("--runs", type=int, default=7, help="pairs of fresh interpreters")
    ap.add_argument("--out", default=None, help="write the record to this JSON file")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    load_before = common.load_average()
    seconds = {TORCH: [], PACKAGE: []}
    for i in range(args.runs):
        for code in (TORCH, PACKAGE)[::-1 if i % 2 else 1]:
            start = time.perf_counter()
            _run("-c", code)
            seconds[code].append(time.perf_counter() - start)
    extra = [p - t for p, t in zip(seconds[PACKAGE], seconds[TORCH])]
    result = {**harness.head("imports", argv), "runs": args.runs,
              "load_average_before": load_before, "load_average_after": common.load_average(),
              "torch_s": seconds[TORCH], "torch_and_emcl_kernels_s": seconds[PACKAGE],
              "extra_s": extra, "extra_median_s": statistics.median(extra),
              "extra_range_s": [min(extra), max(extra)], "slowest_imports": slowest_imports()}
    print(f"import torch: median {statistics.median(seconds[TORCH]):.2f} s; import torch, "
          f"emcl_kernels: median {statistics.median(seconds[PACKAGE]):.2f} s; emcl_kernels adds "
          f"{result['extra_median_s']:+.2f} s (median of {args.runs} pairs; from "
          f"{min(extra):+.2f} to {max(extra):+.2f} s)")
    for row in result["slowest_imports"][:5]:
        print(f"  {row['module']:40s} {row['cumulative_us'] / 1e3:8.1f} ms")
    if args.out:
        harness.save(result, args.out)
    return result
