"""The report stage's runs again, with anytime evaluation: the rows of the committed tables
(``results/heldout/STREAM/plan.json``: the same configurations and report seeds) through
``emcl_continual.sweep.selection.run_rows`` with the stream's anytime preset
(:data:`emcl_continual.core.presets.ANYTIME`), into ``results/online/STREAM/report.jsonl``.

    PYTHONPATH=$PWD:$PWD/python python results/online/anytime_rows.py permuted-mnist [ROW ...]

``SEEDS="10 11"`` runs only those of each row's report seeds; ``ORDER=seed`` queues the runs seed
by seed (every row's seed 10, then every row's seed 11, ...) instead of row by row, so that two
slow rows finish the same seeds first.
Rows default to the headline's methods in the order the stability-gap comparison needs them
(EMCL, then ER, La-MAML and MER, then the rest). Finished runs are skipped, so the same command
continues a stopped one. The training of each run is the one the committed record holds (the
anytime evaluation does not touch it): ``results/online/README.md`` says how that was checked.
"""
from __future__ import annotations

import json
import os
import sys

from emcl_continual.core import presets
from emcl_continual.sweep import selection

HERE = os.path.dirname(os.path.abspath(__file__))
HELDOUT = os.path.join(os.path.dirname(HERE), "heldout")
ROWS = ["emcl", "er", "lamaml/own-script", "mer", "sgd", "agem", "ewc", "lamaml", "gem"]


def main(argv: list) -> int:
    if not argv:
        print(__doc__)
        return 2
    stream, names = argv[0], argv[1:] or ROWS
    plan = json.load(open(os.path.join(HELDOUT, stream, "plan.json")))
    by_name = {r["name"]: r for r in plan["rows"] if r["role"] == "report"}
    missing = [n for n in names if n not in by_name]
    if missing and argv[1:]:
        print(f"rows not in {stream}'s plan: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = [selection.Row(**{k: v for k, v in by_name[n].items()}) for n in names if n in by_name]
    if os.environ.get("SEEDS"):
        only = {int(s) for s in os.environ["SEEDS"].split()}
        rows = [selection.Row(**dict(r, seeds=[s for s in r["seeds"] if s in only])) for r in rows]
    if os.environ.get("ORDER") == "seed":
        rows = [selection.Row(**dict(r, seeds=[s])) for s in sorted({s for r in rows for s in r["seeds"]})
                for r in rows if s in r["seeds"]]
    out = os.path.join(HERE, stream)
    os.makedirs(out, exist_ok=True)
    anytime = presets.anytime_preset(stream)
    ppath = os.path.join(out, "plan.json")
    kept = json.load(open(ppath))["rows"] if os.path.exists(ppath) else []
    names_run = list(dict.fromkeys(r["name"] for r in rows))
    merged = [r for r in kept if r["name"] not in names_run] + [dict(by_name[n]) for n in names_run]
    with open(ppath, "w") as fh:  # every row run into this folder so far, as it was run
        json.dump(dict(plan, rows=merged, anytime=anytime), fh, indent=1, sort_keys=True)
    selection.run_rows(rows, os.path.join(out, "report.jsonl"), stream, "test", jobs=int(os.environ.get("JOBS", 1)),
                       threads=1, data_root=plan.get("data_root"), eval_every=anytime["every"],
                       eval_subset=anytime["subset"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
