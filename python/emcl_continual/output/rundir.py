"""The output folder of ``python -m emcl_continual`` and ``python -m emcl_continual.compare``:
nothing finished is lost, nothing stale passes for new.

* **Checked first.** ``--out DIR`` is created and test-written before any data is read or
  any run starts. A file in its place, a folder that cannot be written, or a folder that
  already holds results (``results.json`` or ``runs.jsonl``) is refused, unless ``--force``
  (the earlier result files are deleted first) or ``--resume`` (see below).
* **Each run is kept as it finishes**: one JSON line appended to ``DIR/runs.jsonl``, flushed
  and fsynced before the next run starts.
* **Summaries after every seed**: ``results.json``, ``results.csv``, the plots (and, for
  ``--method all``, ``comparison.md`` and ``training_time.png``) are rewritten atomically
  (temporary file, then rename). ``results.json`` says ``"status": "complete"`` or
  ``"partial"``, the command, the seeds done and pending, and ``"stale_plots"``: the plots
  that could not be redrawn (their old files, if any, are out of date).
* **Interrupts.** SIGINT / SIGTERM during a run drop only that run; the files are written for
  the finished ones, marked partial, and the command exits 130 saying how to resume.
* **Resume.** ``--resume`` reads ``runs.jsonl``, refuses when the folder was written by another
  configuration (method set, stream, hyper-parameters, data source), skips the finished
  (method, seed) pairs and appends the rest.
* **One command at a time.** :meth:`RunDir.check` takes a lock file, ``DIR/.lock`` (the
  process id, host and command); a second command into the same folder is refused with a
  message naming the first. A lock whose process is gone is taken over, with a note.
  :meth:`RunDir.release` removes it, and removes the folder too when this command created it
  and was refused before :meth:`RunDir.start`.
* **What to write** beside the results is the caller's: ``extra_summary`` (e.g. the
  comparison of ``--method all``) is called with the runs and the folder after every seed.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings

from . import report
from ..core.errors import Interrupted, OutputError
from ..core.fileio import append_line, write_atomic

__all__ = ["OutputError", "Interrupted", "RunDir", "execute", "execute_arrays", "interrupts", "deferred_interrupts", "load_runs",
           "RESULT_FILES", "COMPARISON_FILES", "LOCK_FILE", "TRACKER_DIRS"]

# The files the commands write into --out (--force deletes them): the results, the plots, and
# the comparison of --method all.
COMPARISON_FILES = ("comparison.md", "training_time.png")
RESULT_FILES = ("results.json", "results.csv", "runs.jsonl") + report.PLOT_FILES + COMPARISON_FILES
LOCK_FILE = ".lock"
# The folders --log's trackers write into --out (--force deletes them with the results).
TRACKER_DIRS = ("tensorboard", "wandb", "csv")


# --------------------------------------------------------------------------- signals
class _SignalState:
    defer = 0          # > 0 while files are being written
    pending = None     # a signal that arrived meanwhile


_state = _SignalState()


def _handler(signum, frame):  # noqa: ARG001 - the signal module's signature
    if _state.defer:
        _state.pending = _state.pending or signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupts():
    """Turn SIGINT and SIGTERM into :class:`Interrupted` (in the main thread; elsewhere nothing
    is installed), restoring the previous handlers on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred_interrupts():
    """Hold SIGINT / SIGTERM back until the block is done (so files are written whole), then
    raise :class:`Interrupted` if one arrived."""
    _state.defer += 1
    try:
        yield
    finally:
        _state.defer -= 1
    if not _state.defer and _state.pending is not None:
        signum, _state.pending = _state.pending, None
        raise Interrupted(signum)


# --------------------------------------------------------------------------- the run log
def load_runs(out_dir: str, on_cut=None) -> list:
    """The runs recorded in ``OUT/runs.jsonl`` (one JSON object per line). A last line cut off
    by a crash is left out, and ``on_cut(message)`` called (default: a warning); a damaged line
    elsewhere raises :class:`OutputError`."""
    path = os.path.join(out_dir, "runs.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        lines = [line for line in fh.read().split("\n") if line.strip()]
    runs = []
    for i, line in enumerate(lines):
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                message = f"{path}: the last line is cut off ({exc}); that run is not counted"
                if on_cut is None:
                    warnings.warn(message, stacklevel=2)
                else:
                    on_cut(message)
                break
            raise OutputError(f"{path} line {i + 1} is not a JSON run record ({exc}); fix or remove that line")
    return runs


def _describe(out_dir: str) -> str:
    """What the earlier results in ``out_dir`` are, for the refusal message."""
    try:
        with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, ValueError):
        obj = {}
    try:
        n = len(load_runs(out_dir))
    except (OutputError, OSError):
        n = None
    status = obj.get("status")
    what = f"a {status} run" if status else "results"
    if n is not None:
        what += f" ({n} run{'s' if n != 1 else ''} in runs.jsonl)"
    if obj.get("command"):
        what += f" of `{obj['command']}`"
    return what


def _without_seed(config: dict) -> dict:
    return {k: v for k, v in (config or {}).items() if k != "seed"}


def _roundtrip(obj):
    return json.loads(json.dumps(obj))


def _first_difference(there: dict, here: dict) -> str | None:
    """``"emcl reg: 10.0 there, 5.0 here"`` for the first key where two identities differ."""
    if there.get("stream") != here.get("stream"):
        return f"stream: {there.get('stream')} there, {here.get('stream')} here"
    a, b = there.get("configs", {}), here.get("configs", {})
    if set(a) != set(b):
        return f"methods: {', '.join(sorted(a))} there, {', '.join(sorted(b))} here"
    for m in sorted(a):
        for k in sorted(set(a[m]) | set(b[m])):
            if a[m].get(k, "(unset)") != b[m].get(k, "(unset)"):
                return f"{m} {k}: {a[m].get(k, '(unset)')!r} there, {b[m].get(k, '(unset)')!r} here"
    da, db = there.get("data", {}), here.get("data", {})
    for k in sorted(set(da) | set(db)):
        if da.get(k) != db.get(k):
            return f"{k}: {da.get(k)!r} there, {db.get(k)!r} here"
    return None


def _record_difference(run: dict, identity: dict) -> str | None:
    """How a recorded run differs from ``identity`` (for folders written before identities were
    recorded), or None."""
    configs = identity["configs"]
    where = f"{run.get('method')} seed {run.get('seed')}"
    if run.get("stream") != identity["stream"]:
        return f"{where} ran on stream {run.get('stream')}, this command on {identity['stream']}"
    if run.get("method") not in configs:
        return f"{where}: method {run.get('method')} is not in this command's methods ({', '.join(configs)})"
    there, here = _roundtrip(_without_seed(run.get("config"))), configs[run["method"]]
    for k in sorted(set(there) | set(here)):
        if there.get(k, "(unset)") != here.get(k, "(unset)"):
            return f"{where} ran with {k}={there.get(k, '(unset)')!r}, this command has {here.get(k, '(unset)')!r}"
    batch = identity.get("data", {}).get("batch_size")
    if batch is not None and run.get("batch_size", batch) != batch:
        return f"{where} ran with batch size {run.get('batch_size')}, this command has {batch}"
    return None


# --------------------------------------------------------------------------- the lock
def _first_missing(path: str) -> str | None:
    """The outermost folder of ``path`` that does not exist yet (None when ``path`` exists)."""
    path = os.path.abspath(path)
    missing = None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _read_lock(path: str) -> dict:
    """The lock's content (``{}`` when it cannot be read or parsed)."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.loads(fh.read() or "{}")
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _lock_alive(holder: dict, path: str) -> bool:
    """Whether the command that wrote the lock may still be running: a process of this host
    that exists, any lock of another host (it cannot be checked from here), or a lock without
    content written in the last 10 s (being taken right now)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        try:
            return time.time() - os.path.getmtime(path) < 10
        except OSError:
            return False
    if holder.get("host") not in (None, socket.gethostname()):
        return True
    return _pid_alive(pid)


def _holder_text(holder: dict) -> str:
    if not holder.get("pid"):
        return "an unreadable lock"
    text = f"`{holder.get('command', '?')}` (pid {holder['pid']}"
    if holder.get("host") and holder["host"] != socket.gethostname():
        text += f" on {holder['host']}"
    if holder.get("started"):
        text += f", started {holder['started']}"
    return text + ")"


def _in_use(path: str, lock: str, holder: dict) -> str:
    return (f"--out {path} is in use by {_holder_text(holder)}; a second command would write the same runs "
            f"twice. Wait for it to finish or name another folder (if that command is no longer running, "
            f"delete {lock})")


# --------------------------------------------------------------------------- the folder
class RunDir:
    """One command's output folder.

    ``identity``: what makes runs comparable (``{"stream", "configs": {method: config without
    seed}, "data": {...}}``); ``plan``: the (method, seed) pairs this command runs; ``command``:
    the command line, recorded, used in the resume hint and written into the lock;
    ``extra_summary``: ``(figure, write)``: ``write(runs, folder)`` is called after every seed
    (before results.json); what it raises is recorded as the stale figure ``figure``.
    """

    def __init__(self, path: str, *, identity: dict, plan: list, command: str, force: bool = False,
                 resume: bool = False, extra_summary: tuple | None = None, resume_command: str | None = None):
        if force and resume:
            raise OutputError("--force and --resume contradict each other: --resume keeps the runs in --out, "
                              "--force deletes them")
        self.path = path
        self.identity = _roundtrip(identity)
        self.plan = [(m, int(s)) for m, s in plan]
        self.command = command
        self.resume_command = resume_command
        self.force, self.resume = force, resume
        self.extra_summary = extra_summary
        self.runs: list = []
        self.started = time.perf_counter()
        self.stale: dict = {}
        self._checked = False
        self._started = False
        self._created = None    # the top folder this command created (the folder or a parent), if any
        self._locked = False
        self._rewrite_log = False

    # -- before any run
    def open(self) -> list:
        """:meth:`check`, then :meth:`start`. Returns the runs kept."""
        self.check()
        return self.start()

    def check(self) -> list:
        """Check the folder (see the module docstring) and load the runs to keep (``--resume``);
        changes nothing in it but creating it. Raises :class:`OutputError` with a one-line
        reason. Returns the runs kept."""
        path = self.path
        if os.path.exists(path) and not os.path.isdir(path):
            raise OutputError(f"--out {path} is a file, not a folder; name a folder (it is created if missing)")
        self._created = _first_missing(path)
        try:
            os.makedirs(path, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            self.release()
            raise OutputError(f"--out {path}: cannot write there ({exc.strerror or exc}); "
                              f"name a folder you can write") from None
        try:
            self._lock()
            return self._check_contents()
        except BaseException:
            self.release()
            raise

    def _check_contents(self) -> list:
        path = self.path
        holds = [f for f in ("results.json", "runs.jsonl") if os.path.isfile(os.path.join(path, f))]
        if holds and not (self.force or self.resume):
            raise OutputError(f"--out {path} already holds {_describe(path)}; pass --resume to continue it "
                              f"(or add seeds to it), --force to replace it, or name another folder")
        self.runs = self._check_resumable() if holds and self.resume else []
        self._checked = True
        return list(self.runs)

    def start(self) -> list:
        """Mark the folder as this command's: with ``force`` delete the earlier result files,
        then write the summaries (status partial until every planned run is done)."""
        if not self._checked:
            self.check()
        self._started = True
        with deferred_interrupts():
            if self.force:
                self._remove_earlier()
            if self._rewrite_log:
                text = "".join(json.dumps(r) + "\n" for r in self.runs)
                write_atomic(os.path.join(self.path, "runs.jsonl"), lambda fh: fh.write(text))
            self.write()
        return list(self.runs)

    def _remove_earlier(self) -> None:
        for name in os.listdir(self.path):
            p = os.path.join(self.path, name)
            # the result files, and temporary files of a write that was cut off (".<file>.<random>.tmp")
            ours = name in RESULT_FILES or (name.endswith(".tmp") and any(name.startswith(f".{f}.")
                                                                           for f in RESULT_FILES))
            if ours and os.path.isfile(p):
                try:
                    os.unlink(p)
                except OSError as exc:
                    raise OutputError(f"--force: cannot delete {p} ({exc.strerror or exc})") from None
            elif name in TRACKER_DIRS and os.path.isdir(p) and not os.path.islink(p):
                try:
                    shutil.rmtree(p)
                except OSError as exc:
                    raise OutputError(f"--force: cannot delete {p} ({exc.strerror or exc})") from None

    def _check_resumable(self) -> list:
        cut = []
        runs = load_runs(self.path, on_cut=cut.append)
        try:
            with open(os.path.join(self.path, "results.json"), encoding="utf-8") as fh:
                obj = json.load(fh)
        except (OSError, ValueError):
            obj = {}
        obj = obj if isinstance(obj, dict) else {}
        earlier = obj.get("identity")
        if not os.path.isfile(os.path.join(self.path, "runs.jsonl")) and isinstance(obj.get("runs"), list):
            runs = obj["runs"]  # a folder written before runs.jsonl existed: its results.json holds the runs
            self._rewrite_log = True
        if cut:
            print(f"note: {cut[0]}; it runs again", file=sys.stderr, flush=True)
            self._rewrite_log = True  # the next line must not be appended to the cut one
        diff = _first_difference(earlier, self.identity) if earlier else None
        for r in runs:
            diff = diff or _record_difference(r, self.identity)
        if diff:
            raise OutputError(f"--resume: {self.path} holds runs of another configuration ({diff}); "
                              f"name another --out, or pass --force instead of --resume to replace them")
        seen = set()
        for r in runs:
            key = (r["method"], int(r["seed"]))
            if key in seen:
                raise OutputError(f"{os.path.join(self.path, 'runs.jsonl')} records {key[0]} seed {key[1]} twice; "
                                  f"remove one of the two lines")
            seen.add(key)
        return runs

    # -- the lock
    @property
    def lock_path(self) -> str:
        return os.path.join(self.path, LOCK_FILE)

    def _lock(self) -> None:
        """Take ``DIR/.lock`` or raise :class:`OutputError` naming the command that holds it."""
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        for _ in range(3):
            try:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(self.lock_path)
                if _lock_alive(holder, self.lock_path):
                    raise OutputError(_in_use(self.path, self.lock_path, holder)) from None
                try:
                    os.unlink(self.lock_path)
                except FileNotFoundError:
                    pass
                print(f"note: --out {self.path}: took over the lock of "
                      f"{_holder_text(holder)}, which is no longer running", file=sys.stderr, flush=True)
                continue
            except OSError as exc:
                raise OutputError(f"--out {self.path}: cannot create the lock {self.lock_path} "
                                  f"({exc.strerror or exc})") from None
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(mine))
            self._locked = True
            return
        raise OutputError(f"--out {self.path}: another command keeps taking {self.lock_path}; name another folder")

    def release(self) -> None:
        """Remove the lock if this command holds it; when this command created the folder and
        never started writing results into it (a refused command), remove the folder too."""
        if self._locked:
            self._locked = False
            try:
                if _read_lock(self.lock_path).get("pid") == os.getpid():
                    os.unlink(self.lock_path)
            except OSError:
                pass
        if self._created and not self._started:
            top, self._created = os.path.abspath(self._created), None
            folder = os.path.abspath(self.path)
            while True:
                try:
                    os.rmdir(folder)  # only when empty: nothing but what this command made
                except OSError:
                    break
                if folder == top:
                    break
                folder = os.path.dirname(folder)

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- as runs finish
    @property
    def done(self) -> set:
        """The (method, seed) pairs recorded so far."""
        return {(r["method"], int(r["seed"])) for r in self.runs}

    def add(self, run: dict) -> None:
        """Append ``run`` to ``runs.jsonl`` and flush it to disk."""
        line = json.dumps(run) + "\n"
        with deferred_interrupts():
            append_line(os.path.join(self.path, "runs.jsonl"), line)
            self.runs.append(run)

    def status(self) -> dict:
        """``status`` ("complete" / "partial"), seeds done and pending, runs pending."""
        done = self.done
        pending = [[m, s] for m, s in self.plan if (m, s) not in done]
        methods = list(self.identity["configs"])
        seeds = sorted({s for _, s in self.plan} | {s for _, s in done})
        return {"status": "partial" if pending else "complete",
                "seeds_done": [s for s in seeds if all((m, s) in done for m in methods)],
                "seeds_pending": sorted({s for _, s in pending}),
                "runs_done": len(done), "runs_pending": pending}

    def write(self) -> dict:
        """Rewrite every summary file from the runs so far (atomically). Returns the plots that
        could not be written, ``{file: reason}``."""
        with deferred_interrupts():
            errors: dict = {}
            runs = self.runs
            if self.extra_summary is not None and runs:
                figure, write = self.extra_summary
                try:
                    write(runs, self.path)
                except Exception as exc:  # the figure (its table is written before it)
                    errors[figure] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            extra = dict(self.status(), command=self.command, identity=self.identity,
                         resume_command=self.resume_command,
                         wall_time_s=time.perf_counter() - self.started,
                         updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            obj = report.write_results(runs, self.path, extra=extra, stale=errors)
            self.stale = obj["plot_errors"]
            return self.stale


# --------------------------------------------------------------------------- the loop
def _warnings_of(caught) -> list:
    counts: dict = {}
    for w in caught:
        key = (w.category.__name__, str(w.message))
        counts[key] = counts.get(key, 0) + 1
    return [{"category": c, "message": m, "count": n} for (c, m), n in counts.items()]


def _keep(record: dict, caught, out: RunDir | None, new: list, on_run) -> None:
    """Save one finished run: its warnings, into ``out``, into ``new``, then ``on_run``."""
    record["warnings"] = _warnings_of(caught)
    if out is not None:
        out.add(record)
    new.append(record)
    if on_run is not None:
        on_run(record)


@contextlib.contextmanager
def _summaries_kept(out: RunDir | None):
    """On an interrupt or an error, write ``out``'s summaries for the finished runs (partial)
    before the exception propagates (the first error is the one to report)."""
    try:
        yield
    except BaseException:
        if out is not None:
            try:
                out.write()
            except Exception:
                pass
        raise


def execute(seeds: list, methods: list, make_stream, train, out: RunDir | None = None, on_run=None) -> list:
    """Run every (method, seed) not yet in ``out``: seeds outer, so that a cut-off command
    leaves whole seeds. ``make_stream(seed)`` builds a seed's stream (only when one of its runs
    is left); ``train(method, stream, seed)`` returns a run record, to which the warnings raised
    during the run are added (``"warnings"``: category, message, count); ``on_run(record)`` is
    called after the record is saved. Summaries are rewritten after every seed; on an
    interrupt or an error they are written for the finished runs (partial) before it
    propagates. Returns the new runs."""
    done = out.done if out is not None else set()
    new = []
    with _summaries_kept(out):
        for seed in seeds:
            todo = [m for m in methods if (m, seed) not in done]
            if not todo:
                continue
            stream = make_stream(seed)
            for m in todo:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    record = train(m, stream, seed)
                _keep(record, caught, out, new, on_run)
            if out is not None:
                out.write()
    return new


def execute_arrays(seeds: list, methods: list, widths: dict, make_stream, train_array, out: RunDir | None = None,
                   on_run=None) -> list:
    """Run every (method, seed) not yet in ``out`` as run arrays: per method (in order), its
    pending seeds in arrays of at most ``widths[method]`` runs. ``make_stream(seed)`` builds a
    seed's stream (once, shared by the methods); ``train_array(method, streams, seeds)`` returns
    ``(records, failures)`` (:func:`emcl_continual.arrays.train.run_array`); each record is saved
    and reported as :func:`execute` does, the summaries rewritten after every array. Runs that
    diverged raise :class:`~emcl_continual.core.errors.RunFailed` naming them once their array's
    other runs are saved. Returns the new runs."""
    from ..core.errors import RunFailed

    done = out.done if out is not None else set()
    streams: dict = {}
    new = []
    with _summaries_kept(out):
        for m in methods:
            todo = [s for s in seeds if (m, s) not in done]
            width = max(1, int(widths[m]))
            for i in range(0, len(todo), width):
                chunk = todo[i:i + width]
                for s in chunk:
                    if s not in streams:
                        streams[s] = make_stream(s)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    records, failures = train_array(m, {s: streams[s] for s in chunk}, chunk)
                for record in records:
                    _keep(record, caught, out, new, on_run)
                if out is not None:
                    out.write()
                if failures:
                    raise RunFailed("; ".join(f"{m} seed {chunk[i]} failed: {reason}" for i, reason in failures))
    return new
