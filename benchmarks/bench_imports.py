"""What ``import emcl_kernels`` costs beyond ``import torch``.

    python -m benchmarks imports [--runs 7] [--tree CHECKOUT] [--out FILE]

Fresh interpreters in alternating pairs, and the slowest imports under ``python -X importtime``:
benchmarks/README.md, ``imports``.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from benchmarks import common, harness

TORCH = "import torch"
PACKAGE = "import torch, emcl_kernels"


def _env(tree: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, os.path.join(tree, "python"),
                                         env.get("PYTHONPATH", "")])
    return env


def _seconds(code: str, tree: str) -> float:
    """Wall seconds of a fresh interpreter running ``code`` with ``tree`` first on its path."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(tree), cwd=tree,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _commit(tree: str):
    proc = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or None


def slowest_imports(tree: str, top: int = 10) -> list:
    """The package's ``top`` modules by cumulative time (their own imports included) under
    ``python -X importtime -c "import torch, emcl_kernels"``: torch is imported first, so what
    they list is what the package adds."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", PACKAGE], check=True,
                          env=_env(tree), cwd=tree, capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if cumulative.isdigit():
            rows.append((int(cumulative), name))
    inside = [r for r in rows if r[1].startswith("emcl_kernels")]
    return [{"module": n, "cumulative_us": c} for c, n in sorted(inside, reverse=True)[:top]]


def main(argv=None) -> dict:
    """Run the benchmark; return the results (also written to ``--out FILE``)."""
    ap = harness.parser("imports", __doc__)
    ap.add_argument("--runs", type=int, default=7, help="pairs of fresh interpreters")
    ap.add_argument("--tree", default=common.REPO,
                    help="the checkout whose emcl_kernels is imported (default: this one)")
    ap.add_argument("--out", default=None, help="write the record to this JSON file")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    tree = os.path.abspath(args.tree)
    if not os.path.isfile(os.path.join(tree, "emcl_kernels", "__init__.py")):
        ap.error(f"--tree {args.tree}: no emcl_kernels package there")
    load_before = common.load_average()
    torch_s, package_s = [], []
    for i in range(args.runs):
        order = (TORCH, PACKAGE) if i % 2 == 0 else (PACKAGE, TORCH)
        times = {code: _seconds(code, tree) for code in order}
        torch_s.append(times[TORCH])
        package_s.append(times[PACKAGE])
    extra = [p - t for p, t in zip(package_s, torch_s)]
    result = {
        **harness.head("imports", argv), "runs": args.runs,
        "tree": "this checkout" if tree == common.REPO else "another checkout",
        "tree_commit": _commit(tree),
        "load_average_before": load_before, "load_average_after": common.load_average(),
        "torch_s": torch_s, "torch_and_emcl_kernels_s": package_s,
        "extra_s": extra, "extra_median_s": statistics.median(extra),
        "extra_range_s": [min(extra), max(extra)],
        "slowest_imports": slowest_imports(tree),
    }
    print(f"import torch: median {statistics.median(torch_s):.2f} s; import torch, emcl_kernels: "
          f"median {statistics.median(package_s):.2f} s; emcl_kernels adds "
          f"{result['extra_median_s']:+.2f} s (median of {args.runs} pairs; from "
          f"{min(extra):+.2f} to {max(extra):+.2f} s)")
    for row in result["slowest_imports"][:5]:
        print(f"  {row['module']:40s} {row['cumulative_us'] / 1e3:8.1f} ms")
    if args.out:
        harness.save(result, args.out)
    return result
