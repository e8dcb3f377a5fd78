"""Experiment trackers: ``--log tensorboard,wandb,csv`` (any subset) for the main command and the
selection.

One tracker run per finished run, written from its record (the same values as ``runs.jsonl``):

* **configuration**: the run's full configuration with method, stream, seed, split and the anytime
  settings (TensorBoard: a text summary ``config`` holding the JSON; W&B: the run's config; CSV:
  ``config.json``);
* **per-task metrics** at the step of the samples seen when the task ended: ``task/avg_acc`` (mean
  accuracy over the tasks learned so far), ``task/learned_acc`` (R[t][t]), ``task/loss`` and, with
  anytime evaluation, ``task/online_acc``;
* **the anytime curves** (``--eval-every``) at every point: ``anytime/seen_mean`` (mean over the
  tasks seen so far), ``anytime/task1`` and ``anytime/earlier_mean`` (mean over the tasks before
  the one being trained, from the second task on);
* **the final metrics** (:data:`FINAL`: ACC, the BWTs, LA, forgetting, FWT, the times, and AAA,
  min-ACC, WC-Acc, online accuracy, the stability gap's means when present) as ``final/NAME`` at the
  last step (TensorBoard), the run's summary (W&B) or ``final.csv``;
* **the plots** of that run (average accuracy; anytime accuracy and stability gap when present):
  images ``plots/NAME`` (TensorBoard), ``wandb.Image`` (W&B), PNG files beside the CSVs.

Where: ``OUT/tensorboard/RUN/`` (event files), ``OUT/wandb/`` (W&B's own layout), ``OUT/csv/RUN/``,
``RUN`` being ``METHOD-seedS`` (the selection: ``METHOD-HASH-seedS``, the hash naming the
configuration). W&B runs offline unless the environment says otherwise (``WANDB_MODE``), under the
project ``WANDB_PROJECT`` (default ``emcl-continual``).

TensorBoard and wandb are optional extras (``make setup-trackers``, ``requirements-trackers.txt``),
never needed by the rest of the package: without them the flag is refused in one line naming the
extra, before any run.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import tempfile

__all__ = ["TRACKERS", "FINAL", "parse_log", "run_name", "Trackers", "scalars_of"]

TRACKERS = ("tensorboard", "wandb", "csv")
EXTRA = "make setup-trackers (pip install -r requirements-trackers.txt)"
# The final metrics a tracker run holds, from the record's metrics, anytime metrics and times.
FINAL = ("acc", "bwt", "bwt_over_t", "learning_acc", "forgetting", "fwt", "train_time_s", "eval_time_s",
         "aaa", "min_acc", "wc_acc", "online_acc", "gap_mean", "end_drop_mean", "anytime_eval_time_s")


def _missing(name: str) -> str | None:
    """Why tracker ``name`` cannot run here (None when it can)."""
    import importlib.util

    if name == "tensorboard":
        if importlib.util.find_spec("tensorboard") is None:
            return "the tensorboard package"
    elif name == "wandb":
        if importlib.util.find_spec("wandb") is None:
            return "the wandb package"
    return None


def parse_log(text: str | None) -> list:
    """``"tensorboard,csv"`` -> ``["tensorboard", "csv"]``; ``ValueError`` for an unknown, repeated or
    empty name, or for a tracker whose package is not installed (naming the extra)."""
    if text is None:
        return []
    names = [n.strip() for n in str(text).split(",")]
    if not all(names):
        raise ValueError(f"--log {text}: give tracker names separated by commas ({', '.join(TRACKERS)})")
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"--log {text}: unknown tracker {n!r}; choose from {', '.join(TRACKERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--log {text}: a tracker is named twice")
    for n in names:
        why = _missing(n)
        if why:
            raise ValueError(f"--log {n} needs {why}, an optional extra: {EXTRA}")
    return names


def run_name(record: dict, with_config: bool = False) -> str:
    """``METHOD-seedS``; with ``with_config``, ``METHOD-HASH-seedS`` (HASH: 8 hex digits of the
    run's overrides)."""
    if with_config:
        h = hashlib.sha1(json.dumps(record.get("overrides", {}), sort_keys=True).encode()).hexdigest()[:8]
        return f"{record['method']}-{h}-seed{record['seed']}"
    return f"{record['method']}-seed{record['seed']}"


def config_of(record: dict) -> dict:
    """What a tracker run records as its configuration."""
    out = {"method": record["method"], "stream": record["stream"], "seed": record["seed"],
           "split": record.get("split"), "batch_size": record.get("batch_size"), "n_tasks": record.get("n_tasks"),
           "samples_per_task": record.get("samples_per_task"), "config": record.get("config", {})}
    if record.get("anytime"):
        out["eval_every"] = record["anytime"]["every"]
        out["eval_subset"] = record["anytime"]["subset"]
    return out


def scalars_of(record: dict) -> tuple[dict, dict]:
    """``({step: {tag: value}}, {name: value})``: every per-task and anytime value at its step
    (samples seen), and the final metrics. This is what every tracker writes, and what the
    round-trip tests compare with."""
    steps: dict = {}
    n = record.get("samples_per_task") or 0
    T = len(record["acc_matrix"])
    any_rec = record.get("anytime")
    online = (record.get("anytime_metrics") or {}).get("online_acc_per_task") or []
    ends = [(t + 1) * n for t in range(T)]  # samples seen at the end of each task
    if any_rec and len(any_rec.get("task_starts", [])) == T:
        ends = list(any_rec["task_starts"][1:]) + [any_rec["samples"][-1]]
    for t, step in enumerate(ends):
        vals = steps.setdefault(int(step), {})
        vals["task/avg_acc"] = float(record["avg_acc_curve"][t])
        vals["task/learned_acc"] = float(record["acc_matrix"][t][t])
        vals["task/loss"] = float(record["task_losses"][t])
        if t < len(online) and online[t] is not None:
            vals["task/online_acc"] = float(online[t])
    if any_rec:
        for s, k, row in zip(any_rec["samples"], any_rec["task"], any_rec["acc"]):
            vals = steps.setdefault(int(s), {})
            vals["anytime/seen_mean"] = sum(row) / len(row)
            vals["anytime/task1"] = float(row[0])
            if k > 0:
                vals["anytime/earlier_mean"] = sum(row[:k]) / k
    final = {}
    sources = [record.get("metrics") or {}, record.get("anytime_metrics") or {}, record]
    for name in FINAL:
        for src in sources:
            v = src.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                final[name] = float(v)
                break
    return steps, final


def _plots(record: dict, folder: str) -> dict:
    """The run's own plots as PNG files in ``folder``: {name: path}."""
    from .plots import plot_anytime_accuracy, plot_avg_accuracy, plot_stability_gap

    out = {"avg_accuracy": plot_avg_accuracy([record], os.path.join(folder, "avg_accuracy.png"))}
    if record.get("anytime"):
        out["anytime_accuracy"] = plot_anytime_accuracy([record], os.path.join(folder, "anytime_accuracy.png"))
        out["stability_gap"] = plot_stability_gap([record], os.path.join(folder, "stability_gap.png"))
    return out


class Trackers:
    """The trackers of one command: :meth:`log_run` writes one tracker run per finished run record
    into ``out`` (module docstring). ``names`` as :func:`parse_log` returns them."""

    def __init__(self, names: list, out: str, with_config: bool = False):
        self.names = list(names)
        self.out = out
        self.with_config = with_config

    def __bool__(self) -> bool:
        return bool(self.names)

    def log_run(self, record: dict) -> None:
        """One tracker run per tracker for ``record``."""
        if not self.names:
            return
        name = run_name(record, self.with_config)
        steps, final = scalars_of(record)
        config = config_of(record)
        with tempfile.TemporaryDirectory() as tmp:
            plots = _plots(record, tmp)
            for tracker in self.names:
                getattr(self, "_" + tracker)(name, config, steps, final, plots)

    # -- one writer per tracker ---------------------------------------------------------------
    def _tensorboard(self, name, config, steps, final, plots) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = os.path.join(self.out, "tensorboard", name)
        shutil.rmtree(folder, ignore_errors=True)  # a run logged again (--force) replaces its events
        w = SummaryWriter(log_dir=folder)
        try:
            w.add_text("config", json.dumps(config, sort_keys=True), 0)
            for step in sorted(steps):
                for tag, v in sorted(steps[step].items()):
                    w.add_scalar(tag, v, step)
            last = max(steps) if steps else 0
            for k, v in final.items():
                w.add_scalar(f"final/{k}", v, last)
            import matplotlib.image as mpimg

            for k, path in plots.items():
                img = mpimg.imread(path)[..., :3]
                w.add_image(f"plots/{k}", img, last, dataformats="HWC")
        finally:
            w.close()

    def _wandb(self, name, config, steps, final, plots) -> None:
        import wandb

        folder = os.path.join(self.out, "wandb")
        os.makedirs(folder, exist_ok=True)
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "emcl-continual"), name=name, config=config,
                         dir=self.out, mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")
        try:
            for step in sorted(steps):
                run.log(dict(steps[step]), step=step)
            run.log({f"plots/{k}": wandb.Image(p) for k, p in plots.items()}, step=max(steps) if steps else 0)
            run.summary.update({f"final/{k}": v for k, v in final.items()})
        finally:
            run.finish()

    def _csv(self, name, config, steps, final, plots) -> None:
        folder = os.path.join(self.out, "csv", name)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as fh:
            json.dump(config, fh, indent=1, sort_keys=True)
        with open(os.path.join(folder, "scalars.csv"), "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["step", "tag", "value"])
            for step in sorted(steps):
                for tag, v in sorted(steps[step].items()):
                    w.writerow([step, tag, repr(v)])
        with open(os.path.join(folder, "final.csv"), "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["metric", "value"])
            for k, v in final.items():
                w.writerow([k, repr(v)])
        for k, path in plots.items():
            shutil.copy(path, os.path.join(folder, f"{k}.png"))
