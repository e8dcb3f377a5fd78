"""Instructions per element of one optimizer step, from two callgrind runs of
``benchmarks/count_step_instructions.py`` that differ only in ``--steps``.

    python benchmarks/callgrind_per_element.py few.out many.out --steps 4 --numel 1048576

The difference of the two program totals is ``--steps`` steps without the start-up (importing
torch, building the tensors); divided by steps and elements it is the instructions per element
of one step, kernel and host side together. The per-function breakdown (self cost, the same
difference) says where they go. Prints JSON.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess

_LINE = re.compile(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)")


def function_costs(path: str) -> tuple:
    """(program total, Counter of self Ir per function) of one callgrind output file."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", path],
                         capture_output=True, text=True, check=True).stdout
    total, costs = None, collections.Counter()
    for line in out.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        n, name = int(m.group(1).replace(",", "")), m.group(2)
        if "PROGRAM TOTALS" in name:
            total = n
            continue
        name = re.sub(r" \[/.*\]$", "", name)        # the object file
        head, _, rest = name.partition(":")          # the source file, if any
        if rest and "(" not in head:
            name = rest
        costs[name] += n
    if total is None:
        raise ValueError(f"{path}: no PROGRAM TOTALS line in callgrind_annotate's output")
    return total, costs


def main(argv=None) -> None:
    """Parse the arguments and print the per-element counts as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("few")
    ap.add_argument("many")
    ap.add_argument("--steps", type=int, required=True, help="steps in many minus steps in few")
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.numel < 1:
        ap.error("--steps and --numel must be >= 1")
    t_few, c_few = function_costs(args.few)
    t_many, c_many = function_costs(args.many)
    per = args.steps * args.numel
    diff = collections.Counter({k: v - c_few.get(k, 0) for k, v in c_many.items()})
    print(json.dumps({
        "instructions_per_step": (t_many - t_few) / args.steps,
        "instructions_per_element": (t_many - t_few) / per,
        "top_functions_per_element": [{"function": k[:300], "per_element": round(v / per, 4)}
                                      for k, v in diff.most_common(args.top)],
    }, indent=1))


if __name__ == "__main__":
    main()
