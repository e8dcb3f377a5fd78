"""The paper's Figure 3 (EMCL-SI) and Table IV (the ablation) as held-out rows, run by the sweep
commit's own selection code so that they land in the same files, with the same code tree, as the
stream's other rows.

    cd CLEAN_CLONE_OF_THE_SWEEP_COMMIT        # results/heldout/README.md says how
    PYTHONPATH=$PWD:$PWD/python nice -n 10 python results/heldout/paper_rows.py --stream permuted-mnist

Why a script here and not rows in ``presets.py``: the code tree a run records is a hash of
``python/``, ``emcl_kernels/``, ``csrc/`` and ``setup.py`` (``emcl_continual.core.provenance``), so adding
row definitions there makes a new code version, and the selection command refuses to append its
runs to a stream's files. ``results/`` is outside that hash and outside the dirty check, so this
script, which only names configurations and hands them to the commit's ``selection.run_rows``,
keeps every run of a stream on the one code version (each record still holds its full
configuration and this command).

The rows, each a change of the EMCL configuration selected on validation (``selected.json``):

* ``emcl/si`` -- Figure 3's EMCL-SI: the importance Omega = |g * (theta - theta0)| (gradient
  times the parameter update, as SI) in place of the Taylor |g * theta0|; no open number.
* ``emcl/no-prox`` -- Table IV's second column: inner regularisation kept, the proximal step
  replaced by a plain gradient step on eq. 6 (``prox=False``); no open number.
* ``emcl/inner-lr-modulation`` -- Table IV's third column: the per-element meta learning rates as
  the inner learning rate, no inner regularisation, no proximal step (``inner_lr_modulation``).
  Its open number is the clip of those rates (``modulation_lr_max``): chosen on validation, like
  every method's learning rate, from the four values EMCL's beta is chosen from (the rate it
  replaces in the inner step).
* ``emcl/no-inner-reg`` -- the inner regularisation alone removed (gamma = 0: the proximal pull
  c = gamma * lambda * h is 0 and the inner step is a plain gradient step; the meta step does not
  read gamma): not a column of Table IV, it separates the third column's two changes.

The arithmetic too: one seed of one-sample training amplifies float rounding, so a new row is
paired with the committed EMCL runs only if it computes as they did. The committed runs give
bit for bit the same accuracy matrices under torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``
on an AVX-512 machine; ``results/reproducibility/``), so ``--require-capability`` refuses to run
under any other dispatch, and every record gets the ``processor`` it ran on
(``results/reproducibility/measure.py``; the sweep commit's records lack it).

Stages, each resumable (finished runs are skipped): ``validate`` (the modulation grid on the
validation seeds and split, into ``validation.jsonl``), ``select`` (the clip with the highest
mean validation ACC, ties first; into ``selected.json`` under
``methods["emcl/inner-lr-modulation"]``, which the selection command keeps), ``report`` (the rows
on the report seeds and the test split, into ``report.jsonl``). Every row is added to
``plan.json`` with ``kind="paper"`` so that ``python -m emcl_continual.tables`` finds it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from emcl_continual.core import presets
from emcl_continual.sweep import selection
from emcl_continual.sweep.selection import (DEFAULT_OUT, Row, _check_version, _choose, _write_json, load_runs,
                                      run_rows)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reproducibility"))
from measure import processor  # noqa: E402

# The sweep commit trains one (row, seed) in selection._run_task and its records lack the
# processor; later code records it in provenance["processor"] and runs through its executors.
_train_one = getattr(selection, "_run_task", None)


def _run_task(task: dict) -> dict:
    """The commit's run of one (row, seed), with the processor it ran on added to the record."""
    rec = _train_one(task)
    rec["processor"] = processor()
    return rec

REPORT_ORDER = ("emcl/si", "emcl/no-prox", "emcl/inner-lr-modulation", "emcl/no-inner-reg")
MODULATION = "emcl/inner-lr-modulation"
# the clip of the modulated inner rates: the candidates of EMCL's beta on the MNIST streams
MODULATION_GRID = [{"inner_lr_modulation": True, "modulation_lr_max": v} for v in (0.01, 0.03, 0.1, 0.15)]

FIXED = {
    "emcl/si": ({"importance": "si"},
                "Figure 3's EMCL-SI: importance |g*(theta - theta0)| (SI's gradient times update) for the "
                "Taylor |g*theta0|"),
    "emcl/no-prox": ({"prox": False},
                     "Table IV, column 2: inner regularisation kept, plain gradient step on eq. 6 for the "
                     "proximal step"),
    "emcl/no-inner-reg": ({"gamma": 0.0},
                          "no inner regularisation (gamma = 0: pull c = 0, the inner step is a plain gradient "
                          "step); separates Table IV column 3's two changes"),
}


def validation_rows(emcl: dict) -> list:
    """The modulation clip's four candidates on the validation seeds."""
    return [Row(f"{MODULATION}/grid{i}", "emcl", dict(emcl, **cell), "validation",
                f"Table IV column 3 with the clip of the inner rates at {cell['modulation_lr_max']}",
                presets.VALIDATION_SEEDS, group=f"grid:{MODULATION}", index=i)
            for i, cell in enumerate(MODULATION_GRID)]


def report_rows(emcl: dict, selected: dict) -> list:
    """The rows on the report seeds (the modulation row only once its clip is chosen)."""
    rows = []
    for name in REPORT_ORDER:
        if name in FIXED:
            change, what = FIXED[name]
            rows.append(Row(name, "emcl", dict(emcl, **change), "report", what, presets.REPORT_SEEDS, kind="paper"))
        elif MODULATION in selected.get("methods", {}):
            chosen = selected["methods"][MODULATION]["overrides"]
            rows.append(Row(name, "emcl", chosen, "report",
                            "Table IV, column 3: the meta learning rates as inner learning rate, no inner "
                            "regularisation, no proximal step; clip chosen on validation: "
                            + json.dumps({"modulation_lr_max": chosen["modulation_lr_max"]}),
                            presets.REPORT_SEEDS, kind="paper"))
    return rows


def remember(plan_path: str, rows: list) -> None:
    """Add (or update) ``rows`` in the stream's ``plan.json``, as the selection command does."""
    plan = json.load(open(plan_path))
    names = {r["name"]: i for i, r in enumerate(plan["rows"])}
    for row in rows:
        if row["name"] in names:
            plan["rows"][names[row["name"]]] = dict(row)
        else:
            plan["rows"].append(dict(row))
    _write_json(plan_path, plan)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stream", required=True, choices=sorted(presets.GRIDS))
    p.add_argument("--out", default=None, help=f"the stream's folder (default {DEFAULT_OUT}/STREAM)")
    p.add_argument("--stages", nargs="+", default=["validate", "report"], choices=["validate", "report"])
    p.add_argument("--rows", nargs="+", default=None, choices=REPORT_ORDER,
                   help="report stage: only these rows, in this order")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the committed runs: 1)")
    p.add_argument("--require-capability", default=None,
                   help="refuse to run unless torch dispatches this CPU capability (AVX512, AVX2, DEFAULT)")
    p.add_argument("--allow-dirty", action="store_true", help="run on a working tree that differs from its commit "
                                                                 "(tests and screens only)")
    args = p.parse_args(argv)
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if args.require_capability and cap != args.require_capability:
        raise SystemExit(f"error: torch dispatches {cap}, not {args.require_capability}: set "
                         f"ATEN_CPU_CAPABILITY={args.require_capability.lower()} (it can only lower the dispatch)")
    out = args.out or os.path.join(DEFAULT_OUT, args.stream)
    vpath, rpath = os.path.join(out, "validation.jsonl"), os.path.join(out, "report.jsonl")
    spath, ppath = os.path.join(out, "selected.json"), os.path.join(out, "plan.json")
    for path in (spath, ppath, rpath):
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} does not exist: run the stream's sweep (sweep.sh) first")
    plan = json.load(open(ppath))
    # the stream as the sweep ran it (a shrunk one in tests and screens)
    common = dict(jobs=1, threads=args.threads, data_root=plan.get("data_root"), n_tasks=plan.get("n_tasks"),
                  samples_per_task=plan.get("samples_per_task"))
    emcl = json.load(open(spath))["methods"]["emcl"]["overrides"]

    if _train_one is None:  # later code: its records carry the processor themselves
        _stages(args, emcl, common, plan, vpath, rpath, spath, ppath)
    else:  # one process at a time, in this one: the records get the processor through _run_task
        selection._run_task = _run_task
        try:
            _stages(args, emcl, common, plan, vpath, rpath, spath, ppath)
        finally:
            selection._run_task = _train_one
    print("done; tables: python -m emcl_continual.tables")
    return 0


def _stages(args, emcl: dict, common: dict, plan: dict, vpath: str, rpath: str, spath: str, ppath: str) -> None:
    """validate, select, report (those of ``args.stages``)."""
    selected = json.load(open(spath))
    vrows = validation_rows(emcl)
    if "validate" in args.stages:
        _check_version(vpath, args.allow_dirty, False)
        remember(ppath, vrows)
        run_rows(vrows, vpath, args.stream, "validation", **common)
    try:
        decision = _choose(vrows, {r["key"]: r for r in load_runs(vpath)}, "validation", plan.get("data_root"))
    except RuntimeError as exc:
        print(f"(the modulation clip is not chosen yet: {exc})")
    else:
        decision["overrides"] = decision["chosen"]["overrides"]
        selected = json.load(open(spath))
        selected.setdefault("methods", {})[MODULATION] = decision
        _write_json(spath, selected)

    if "report" in args.stages:
        rows = report_rows(emcl, selected)
        if args.rows:
            by_name = {r["name"]: r for r in rows}
            rows = [by_name[n] for n in args.rows if n in by_name]
        _check_version(rpath, args.allow_dirty, False)
        remember(ppath, rows)
        run_rows(rows, rpath, args.stream, "test", **common)


if __name__ == "__main__":
    sys.exit(main())
