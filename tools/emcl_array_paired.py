"""EMCL's runs alone against the same runs as one array: the paired check of the EMCL run array.

    OMP_NUM_THREADS=1 PYTHONPATH=.:python python tools/emcl_array_paired.py \
        --out results/arrays/emcl_paired_cpu.json

Trains each (seed, configuration) of ``--seeds`` x ``--inner-lr`` on Permuted MNIST's validation
split (the selection's split, full length unless ``--n-tasks``/``--samples-per-task``) twice:
alone (:func:`emcl_continual.training.train.run`, EMCL's fused path) and all together as one array
(:func:`emcl_continual.arrays.train.run_array`), one after the other, on one thread. Writes each
run's ACC both ways and the difference, the process CPU time of each side, and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from emcl_continual.arrays.train import run_array  # noqa: E402
from emcl_continual.core.provenance import code_version, processor  # noqa: E402
from emcl_continual.data.streams import make_stream  # noqa: E402
from emcl_continual.training.train import run  # noqa: E402

STREAM = "permuted-mnist"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/emcl_array_paired.py", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[100, 101])
    p.add_argument("--inner-lr", nargs="+", type=float, default=[0.03, 0.1])
    p.add_argument("--n-tasks", type=int, default=None)
    p.add_argument("--samples-per-task", type=int, default=None)
    p.add_argument("--out", default=os.path.join("results", "arrays", "emcl_paired_cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    streams = {s: make_stream(STREAM, s, split="validation", n_tasks=args.n_tasks,
                              samples_per_task=args.samples_per_task) for s in args.seeds}
    runs = [{"seed": s, "overrides": {"inner_lr": lr}} for lr in args.inner_lr for s in args.seeds]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load0 = os.getloadavg()
    t0 = time.process_time()
    alone = [run("emcl", streams[r["seed"]], r["seed"], overrides=r["overrides"], progress=False) for r in runs]
    t_alone = time.process_time() - t0
    t0 = time.process_time()
    records, failed = run_array("emcl", STREAM, runs, streams=streams, array_id="paired")
    t_array = time.process_time() - t0
    if failed:
        raise SystemExit(f"runs of the array failed: {failed}")
    rows = []
    for r, a, b in zip(runs, alone, records):
        rows.append({"seed": r["seed"], "overrides": r["overrides"], "acc_alone": a["acc"], "acc_array": b["acc"],
                     "acc_difference": b["acc"] - a["acc"], "same_matrix": a["acc_matrix"] == b["acc_matrix"],
                     "train_time_s_alone": a["train_time_s"], "train_time_s_array_share": b["train_time_s"]})
        print(f"seed {r['seed']} {r['overrides']}: ACC alone {a['acc']:.2f}, in the array {b['acc']:.2f} "
              f"({b['acc'] - a['acc']:+.2f})", flush=True)
    diffs = [abs(x["acc_difference"]) for x in rows]
    out = {"what": "EMCL runs alone against the same runs as one array (ACC on the validation split)",
           "stream": STREAM, "split": "validation", "n_tasks": alone[0]["n_tasks"],
           "samples_per_task": alone[0]["samples_per_task"], "width": len(runs), "runs": rows,
           "max_abs_acc_difference": max(diffs), "mean_acc_difference": sum(x["acc_difference"] for x in rows) / len(rows),
           "process_time_s": {"alone_one_after_another": t_alone, "array": t_array, "ratio": t_alone / t_array,
                              "note": "whole runs: training and every evaluation"},
           "train_time_s": {"alone_sum": sum(a["train_time_s"] for a in alone),
                            "array": records[0]["array"]["train_time_s"],
                            "note": "wall clock of observe/begin_task/end_task only, on the shared machine"},
           "started_utc": started, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_average_before": load0, "load_average_after": os.getloadavg(),
           "machine": {"cpu": processor().get("model_name"), "logical_cpus": os.cpu_count(),
                       "platform": platform.platform(), "torch": torch.__version__, "threads": 1,
                       "shared": "2-core VM shared with other engineers' jobs: process CPU time, upper bounds"},
           "command": "python tools/emcl_array_paired.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": code_version().get("commit"), "dirty": code_version().get("dirty")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(f"{args.out}: max |ACC difference| {max(diffs):.2f}; process time alone {t_alone:.1f} s, "
          f"array {t_array:.1f} s ({t_alone / t_array:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
