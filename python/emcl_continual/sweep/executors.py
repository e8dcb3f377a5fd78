"""Where the held-out selection's runs train and what executes them.

**Devices** (``--device``, :func:`parse_devices`): ``cpu`` (the default), ``cuda``, ``cuda:N`` or
``auto``, for every method or per method (``--device auto``, ``--device cpu emcl=cuda``).
``auto`` takes a GPU for a run only where the run is measured faster there, and keeps the rest
on host cores (:func:`gpu_pays`): EMCL with its glances captured in CUDA graphs
(:mod:`emcl_continual.methods.emcl_graphed`), i.e. every EMCL configuration whose
:func:`~emcl_continual.methods.emcl.glance_plan` captures on a GPU. The measurements behind the
rule: on an H200, EMCL's captured glances trained 5 Permuted-MNIST tasks in 0.9 s
(``benchmarks/results/gpu/20261127T072131Z_h200_stage2/main_job_cuda/results.json``); on an
H100, the same one-sample inner step took 716.6 µs eagerly on CUDA against 357.9 µs on one
CPU thread, and the eager EMCL run 85.4 s on the GPU against 57.0 s on that machine's CPU
(docs/continual-learning.md, "GPU"). Every baseline steps eagerly (GEM's QP, A-GEM's
projection sign and the multi-head replay losses read data on the host), and no baseline has
been measured faster on a GPU: ``auto`` keeps them on the CPU, and so does it keep EMCL's
configurations that stay eager (``inner_lr_modulation``, ``importance_norm``,
``cuda_graph=False``).

**Placement** (:class:`GpuPlacer`): the local executor runs ``--jobs`` runs at a time over the
host and the GPUs. Before a GPU run starts it is put on the GPU with the most room: the
device's free memory now (``torch.cuda.mem_get_info``: other processes count) less
``--gpu-memory-mib`` for every run of this sweep already on it (those that have not allocated
yet included); at most ``--runs-per-gpu`` runs share a GPU. A run that does not fit waits for a
run to finish while the runs behind it that fit start; a run that fits on no GPU while none of
this sweep's runs is running is reported failed.

**Arrays** (``--array``, :func:`make_arrays`): the runs of a method that has an array learner
(:mod:`emcl_continual.arrays`) and share all but their seed and per-run numbers are grouped into
arrays, each one task of the executor (:func:`run_array_task`), the slowest methods' first; the
driver writes one record per run and one failure per run of an array that fails or a run of it
that diverged.

**Executors**: :class:`LocalExecutor` (this process for one job, else a pool of spawned
processes) and :class:`RayExecutor` (``--executor ray``: each run a Ray task asking for
``--threads`` CPUs and, on a GPU, ``1/--runs-per-gpu`` of one; ``--ray-address`` connects to a
running cluster, else a local one is started). Both hand finished runs back to the driver,
:func:`execute`, which writes every record itself: the same JSON-lines files whatever executes
the runs. A run that raises, or whose record names another code tree than the driver's, is
reported and appended to ``failed.jsonl`` beside the results, never to them, and the command
runs it again when started again.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import time
import traceback

__all__ = ["parse_devices", "check_devices", "gpu_pays", "want_device", "GpuPlacer",
           "LocalExecutor", "RayExecutor", "RunFailed", "SweepError", "execute", "run_task", "run_array_task",
           "make_arrays", "wait_for_memory",
           "make_executor", "failure_record"]

MIB = 1 << 20


class RunFailed(Exception):
    """A run that did not give a record this sweep can keep (its reason in the message)."""


class SweepError(ValueError):
    """A bad ``--device``, ``--jobs``, ... or an executor that cannot start (one line)."""


# --------------------------------------------------------------------------- devices
def _check_word(word: str, where: str) -> str:
    """``cpu``, ``auto``, ``cuda`` or ``cuda:N`` (N a whole number), else ValueError."""
    w = word.strip()
    if w in ("cpu", "auto", "cuda"):
        return w
    if w.startswith("cuda:") and w[5:].isdigit():
        return f"cuda:{int(w[5:])}"
    raise SweepError(f"--device {where}: {word!r} is not a device; use cpu, cuda, cuda:N or auto")


def parse_devices(specs, methods) -> dict:
    """``--device`` words -> ``{method: word}`` for every method of ``methods``.

    Each spec is a device for every method (``cuda``) or ``METHOD=DEVICE`` for one; a later spec
    wins over an earlier one, a per-method one over a plain one whatever the order. The default
    is ``cpu``. Raises ValueError for an unknown method or device word."""
    plain, per = "cpu", {}
    for spec in specs or []:
        if "=" in spec:
            m, word = spec.split("=", 1)
            m = m.strip()
            if m not in methods:
                raise SweepError(f"--device {spec}: {m!r} is not one of this sweep's methods "
                                 f"({', '.join(methods)})")
            per[m] = _check_word(word, spec)
        else:
            plain = _check_word(spec, spec)
    return {m: per.get(m, plain) for m in methods}


def check_devices(words: dict, cuda_count: int, executor: str = "local") -> list:
    """Raise :class:`SweepError` when a word asks for a GPU that is not there; return notes for
    ``auto`` without a GPU. ``cuda_count``: the GPUs torch sees here (0 without CUDA), or the
    GPUs of the Ray cluster (``executor="ray"``, where Ray picks the GPU: no ``cuda:N``)."""
    notes = []
    where = "in the Ray cluster" if executor == "ray" else "visible to torch"
    for m, w in words.items():
        if executor == "ray" and w.startswith("cuda:"):
            raise SweepError(f"--device: {m} on {w}: with --executor ray, Ray picks the GPU; use cuda or auto")
        if w == "cuda" and cuda_count == 0:
            raise SweepError(f"--device: {m} on cuda, but no CUDA GPU is {where}; use cpu, or auto "
                             "to take a GPU only where there is one and it pays")
        if w.startswith("cuda:") and int(w[5:]) >= cuda_count:
            raise SweepError(f"--device: {m} on {w}, but torch sees {cuda_count} GPU(s)"
                             + (f", cuda:0 to cuda:{cuda_count - 1}" if cuda_count else ""))
    if cuda_count == 0 and "auto" in words.values():
        notes.append(f"--device auto: no CUDA GPU {where}, every run on the CPU")
    return notes


def gpu_pays(method: str, config: dict) -> bool:
    """Whether a run of ``method`` with the full ``config`` is measured faster on a GPU than on
    host cores: EMCL whose glances are captured in CUDA graphs there (see the module docstring).
    Asks :func:`~emcl_continual.methods.emcl.glance_plan` for a CUDA device, which needs no GPU."""
    if method != "emcl":
        return False
    from ..methods.emcl import glance_plan

    return bool(glance_plan(config, "cuda")[1])


def want_device(method: str, overrides: dict, stream: str, word: str, cuda_count: int) -> str:
    """The device one run asks for: ``cpu``, ``cuda`` (any GPU) or ``cuda:N``, from its method's
    ``--device`` word (``auto``: ``cuda`` where :func:`gpu_pays` and a GPU is there)."""
    if word != "auto":
        return word
    if cuda_count == 0:
        return "cpu"
    from ..training.config import build_config

    return "cuda" if gpu_pays(method, build_config(method, stream, 0, overrides)) else "cpu"


def _cuda_mem_info(device: str) -> tuple:
    import torch

    return torch.cuda.mem_get_info(torch.device(device))


class GpuPlacer:
    """Which GPU a run goes on, from the memory the GPUs have now and what this sweep placed.

    ``devices``: the GPUs (``["cuda:0", ...]``); ``need``: bytes one run is given;
    ``per_gpu``: runs at most on one GPU (None: no cap); ``mem_info(device) -> (free, total)``
    bytes (default ``torch.cuda.mem_get_info``)."""

    def __init__(self, devices, need: int, per_gpu: int | None = None, mem_info=None):
        if need <= 0:
            raise SweepError(f"--gpu-memory-mib must be positive, got {need / MIB:g}")
        if per_gpu is not None and per_gpu < 1:
            raise SweepError(f"--runs-per-gpu must be >= 1, got {per_gpu}")
        self.devices = list(devices)
        self.need = int(need)
        self.per_gpu = per_gpu
        self.mem_info = mem_info or _cuda_mem_info
        self.running = {d: 0 for d in self.devices}

    def room(self, device: str) -> int:
        """Bytes a new run may take on ``device``: its free memory now less ``need`` for every
        run of this sweep on it. A run that has allocated is counted twice (in the free memory
        and in its share): the placer may leave room unused, never place a run where it does
        not fit."""
        free, _total = self.mem_info(device)
        return int(free - self.running[device] * self.need)

    def place(self, want: str) -> str | None:
        """``"cpu"`` for ``"cpu"``; for ``"cuda"`` the GPU with the most room that fits one run,
        for ``"cuda:N"`` that GPU if it fits; None when the run has to wait."""
        if want == "cpu":
            return "cpu"
        candidates = self.devices if want == "cuda" else [want]
        best, best_room = None, None
        for d in candidates:
            if d not in self.running:
                raise SweepError(f"{d} is not one of the GPUs of this sweep ({', '.join(self.devices) or 'none'})")
            if self.per_gpu is not None and self.running[d] >= self.per_gpu:
                continue
            r = self.room(d)
            if r >= self.need and (best_room is None or r > best_room):
                best, best_room = d, r
        if best is not None:
            self.running[best] += 1
        return best

    def release(self, device: str) -> None:
        """A run on ``device`` finished."""
        if device in self.running:
            self.running[device] = max(0, self.running[device] - 1)

    def why_not(self, want: str) -> str:
        """Why a run asking for ``want`` cannot start now (for the failure of a run that never fits)."""
        candidates = self.devices if want == "cuda" else [want]
        parts = []
        for d in candidates:
            free, total = self.mem_info(d)
            parts.append(f"{d}: {free / MIB:.0f} MiB free of {total / MIB:.0f}, {self.running[d]} run(s) of this sweep")
        return (f"a run needs --gpu-memory-mib {self.need / MIB:.0f}; " + "; ".join(parts))


def wait_for_memory(device: str, need: int, timeout_s: float, poll_s: float = 2.0, mem_info=None) -> float:
    """Wait until ``device`` has ``need`` bytes free (a Ray task's check before its run);
    returns the seconds waited; raises :class:`RunFailed` after ``timeout_s``."""
    mem_info = mem_info or _cuda_mem_info
    start = time.monotonic()
    while True:
        free, total = mem_info(device)
        if free >= need:
            return time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            raise RunFailed(f"{device} on {socket.gethostname()} had {free / MIB:.0f} MiB free of "
                            f"{total / MIB:.0f} for {timeout_s:.0f} s; the run needs {need / MIB:.0f}")
        time.sleep(poll_s)


# --------------------------------------------------------------------------- one run
def _init_worker(threads: int) -> None:
    """A run's process uses ``threads`` threads: torch's, and the BLAS and OpenMP pools of
    NumPy and SciPy (GEM's QP), which otherwise start one thread per core of the machine, so
    that ``--jobs`` runs at a time use ``--jobs`` x ``--threads`` cores and no more."""
    import torch

    torch.set_num_threads(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a requirement (requirements.txt)
        return
    threadpool_limits(limits=threads)


def run_task(task: dict) -> dict:
    """One run where an executor runs it: build the stream, train on ``task["device"]``, return
    the record (with the driver's command, this host, the executor and the wall time). An array
    task (``task["runs"]``, :func:`make_arrays`) goes to :func:`run_array_task`."""
    if task.get("runs"):
        return run_array_task(task)
    import torch

    from ..data.streams import make_stream
    from ..training.train import run

    started = time.perf_counter()
    device = task.get("device", "cpu")
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # CUDA graphs capture on the current device
    stream = make_stream(task["stream"], task["seed"], data_root=task["data_root"], split=task["split"],
                         n_tasks=task.get("n_tasks"), samples_per_task=task.get("samples_per_task"))
    try:
        r = run(task["method"], stream, task["seed"], overrides=task["overrides"], device=device, progress=False,
                eval_every=task.get("eval_every"), eval_subset=task.get("eval_subset"))
    finally:
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()  # give the run's cached blocks back before the next run is placed
    r.update(key=task["key"], role=task["role"], overrides=task["overrides"], data_root=task["data_root"],
             wall_time_s=time.perf_counter() - started, host=socket.gethostname(),
             executor=task.get("executor", "local"))
    if task.get("ray_node"):
        r["ray_node"] = task["ray_node"]
    if task.get("command"):
        r["provenance"]["command"] = task["command"]
    try:
        r["load_avg"] = os.getloadavg()
    except OSError:
        pass
    return r


def run_array_task(task: dict) -> dict:
    """An array of runs (:func:`make_arrays`) where an executor runs it: train them together
    (:func:`emcl_continual.arrays.train.run_array`) on ``task["device"]``; returns
    ``{"array": id, "records": [...], "failed": [{"key", "reason"}]}``, each record completed as
    :func:`run_task` completes a run's (its ``wall_time_s`` is the array's)."""
    import torch

    from ..arrays.train import run_array

    started = time.perf_counter()
    device = task.get("device", "cpu")
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    runs = task["runs"]
    try:
        recs, fails = run_array(task["method"], task["stream"], [{"seed": r["seed"], "overrides": r["overrides"]}
                                                                 for r in runs],
                                split=task["split"], data_root=task["data_root"], n_tasks=task.get("n_tasks"),
                                samples_per_task=task.get("samples_per_task"), device=device,
                                array_id=task["array_id"])
    finally:
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    wall = time.perf_counter() - started
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    for r in recs:
        member = runs[r["array"]["index"]]
        r.update(key=member["key"], role=member["role"], overrides=member["overrides"], data_root=task["data_root"],
                 wall_time_s=wall, host=socket.gethostname(), executor=task.get("executor", "local"))
        if task.get("ray_node"):
            r["ray_node"] = task["ray_node"]
        if task.get("command"):
            r["provenance"]["command"] = task["command"]
        if load is not None:
            r["load_avg"] = load
    return {"array": task["array_id"], "records": recs,
            "failed": [{"key": runs[i]["key"], "reason": reason} for i, reason in fails]}


def make_arrays(tasks: list, word, stream: str, log=None) -> list:
    """``tasks`` (runs, each with ``want``) as the units an executor runs under ``--array word``
    (``off``, ``auto`` or a width): the runs of a method that has an array learner
    (:mod:`emcl_continual.arrays`) and an MLP stream, grouped by what they must share (method,
    device, split, data, the configuration but for the per-run keys: :func:`~emcl_continual.
    arrays.array_signature`) and cut into arrays of at most the width (``auto``:
    :func:`~emcl_continual.arrays.auto_width` per method and device), each one task
    ``{"runs": [...], "array_id", ...}``; every other run stays a task of its own. A group of one
    run stays a plain run. Order: the arrays first, the slowest method's first
    (:data:`~emcl_continual.arrays.ALONE_RATE_CPU`: a stage's wall clock is at least its longest
    unit's, so that one starts at once), then the runs alone in their order."""
    import hashlib

    from .. import arrays
    from ..training.config import build_config

    if word == "off":
        return list(tasks)
    units, groups, order = [], {}, []
    notes = set()
    for t in tasks:
        why = arrays.refusal(t["method"])
        if why is None:
            from ..data.streams import STREAMS
            spec = STREAMS.get(stream, {})
            if spec.get("kind") == "split":
                why = f"--array: {stream} trains the reduced ResNet-18 (batch norm); arrays serve the MLP streams"
        if why:
            notes.add(why)
            order.append(("run", t))
            continue
        try:
            cfg = build_config(t["method"], stream, t["seed"], t["overrides"])
        except ValueError:      # a configuration the method refuses: the run fails alone, as without arrays
            order.append(("run", t))
            continue
        why = arrays.refusal(t["method"], cfg)     # a variant the array does not serve: the run trains alone
        if why:
            notes.add(why)
            order.append(("run", t))
            continue
        gk = (t["method"], t["want"], t["split"], t.get("data_root"), t.get("n_tasks"), t.get("samples_per_task"),
              arrays.array_signature(t["method"], cfg))
        if gk not in groups:
            groups[gk] = []
            order.append(("group", gk))
        groups[gk].append(t)
    if log is not None:
        for note in sorted(notes):
            log(f"note: {note}; those runs train alone")
    alone = []
    for kind, item in order:
        if kind == "run":
            alone.append(item)
            continue
        members = groups[item]
        width = word if isinstance(word, int) else arrays.auto_width(item[0], item[1])
        for i in range(0, len(members), max(1, width)):
            chunk = members[i:i + max(1, width)]
            if len(chunk) == 1:
                units.append(chunk[0])
                continue
            aid = hashlib.sha1("\n".join(m["key"] for m in chunk).encode()).hexdigest()[:12]
            first = chunk[0]
            units.append({"key": f"array:{aid}", "array_id": aid, "runs": chunk, "method": first["method"],
                          "seed": [m["seed"] for m in chunk], "overrides": [m["overrides"] for m in chunk],
                          "split": first["split"], "stream": first["stream"], "data_root": first.get("data_root"),
                          "n_tasks": first.get("n_tasks"), "samples_per_task": first.get("samples_per_task"),
                          "role": first.get("role"), "row": first.get("row"), "command": first.get("command"),
                          "want": first["want"]})
    units.sort(key=lambda u: (arrays.ALONE_RATE_CPU.get(u["method"], float("inf")) if u.get("runs") else float("inf")))
    return units + alone


def _ray_run_task(task: dict) -> dict:
    """A Ray task: set the threads, check the GPU's memory, run."""
    import ray

    _init_worker(int(task.get("threads", 1)))
    task = dict(task, ray_node=ray.get_runtime_context().get_node_id())
    if str(task.get("device", "cpu")).startswith("cuda"):
        task = dict(task, device="cuda:0")  # Ray sets CUDA_VISIBLE_DEVICES to the GPU it gave
        waited = wait_for_memory("cuda:0", int(task["gpu_need"]), float(task.get("gpu_wait_s", 600)))
        rec = run_task(task)
        rec["gpu_wait_s"] = waited
        return rec
    return run_task(task)


# --------------------------------------------------------------------------- executors
class _Inline:
    """Runs each task in this process as it is submitted (one job)."""

    def submit(self, fn, task):
        fut = cf.Future()
        try:
            fut.set_result(fn(task))
        except Exception as exc:  # noqa: BLE001 - a failed run is the driver's to report
            fut.set_exception(exc)
        return fut

    def shutdown(self):
        pass


class LocalExecutor:
    """``jobs`` runs at a time on this machine, ``threads`` torch threads each, GPU runs placed
    by a :class:`GpuPlacer` (built when a run asks for a GPU)."""

    name = "local"

    def __init__(self, jobs: int = 1, threads: int = 1, *, gpu_need: int = 1024 * MIB,
                 runs_per_gpu: int | None = None, cuda_count: int = 0, mem_info=None):
        if jobs < 1:
            raise SweepError(f"--jobs must be >= 1, got {jobs}")
        if threads < 1:
            raise SweepError(f"--threads must be >= 1, got {threads}")
        self.slots, self.threads = int(jobs), int(threads)
        self.placer = GpuPlacer([f"cuda:{i}" for i in range(cuda_count)], gpu_need, runs_per_gpu, mem_info)
        self._pool = None

    def gpu_count(self) -> int:
        """The GPUs runs may be placed on."""
        return len(self.placer.devices)

    def start(self) -> None:
        """Start the processes (once)."""
        if self._pool is not None:
            return
        if self.slots == 1:
            _init_worker(self.threads)
            self._pool = _Inline()
        else:
            import multiprocessing as mp

            self._pool = cf.ProcessPoolExecutor(self.slots, mp_context=mp.get_context("spawn"),
                                                initializer=_init_worker, initargs=(self.threads,))

    def place(self, task: dict) -> str | None:
        return self.placer.place(task["want"])

    def why_not(self, task: dict) -> str:
        return self.placer.why_not(task["want"])

    def submit(self, task: dict):
        return self._pool.submit(run_task, task)

    def release(self, device: str) -> None:
        self.placer.release(device)

    def close(self, cancel: bool = False) -> None:
        """Wait for the pool's runs, or with ``cancel`` (an error, an interrupt) drop the
        queued ones and end the running ones: their processes are terminated, not left to
        finish (or to outlive the command) unseen."""
        if self._pool is not None:
            if isinstance(self._pool, cf.ProcessPoolExecutor):
                workers = list((getattr(self._pool, "_processes", None) or {}).values()) if cancel else []
                self._pool.shutdown(wait=not cancel, cancel_futures=cancel)
                for proc in workers:
                    if proc.is_alive():
                        proc.terminate()
                for proc in workers:
                    proc.join(timeout=10)
            self._pool = None


def _ray():
    try:
        import ray
    except ImportError:
        raise SweepError("--executor ray: Ray is not installed here; pip install -r requirements-ray.txt "
                         "-c requirements.txt (make setup-ray), or use the local executor") from None
    return ray


def _import_paths() -> list:
    """The folders this process imports emcl_continual and emcl_kernels from (a Ray worker gets
    them on its PYTHONPATH: a cluster whose nodes share this checkout's path imports the same code)."""
    import emcl_continual
    import emcl_kernels

    here = os.path.dirname(os.path.dirname(os.path.abspath(emcl_continual.__file__)))
    kern = os.path.dirname(os.path.dirname(os.path.abspath(emcl_kernels.__file__)))
    return list(dict.fromkeys([here, kern]))


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse an address whose host:port takes no connection (``ray.init`` would retry for minutes);
    ``auto`` and ``ray://`` addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise SweepError(f"--ray-address {address}: give HOST:PORT of the cluster's head (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise SweepError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the "
                         f"cluster's head (ray start --head) or leave --ray-address out to start a local "
                         f"cluster") from None


class RayExecutor:
    """Each run a Ray task with ``num_cpus=threads`` and, on a GPU, ``num_gpus=1/runs_per_gpu``.

    ``address``: a running cluster's address (``ray.init(address=...)``), or None to start a
    local one (``jobs`` x ``threads`` CPUs, no dashboard). ``jobs``: runs in flight at most
    (default: the cluster's CPUs over ``threads``, read when it starts)."""

    name = "ray"

    def __init__(self, address: str | None, jobs: int | None = None, threads: int = 1, *,
                 gpu_need: int = 1024 * MIB, runs_per_gpu: int | None = None, gpu_wait_s: float = 600.0):
        self.ray = _ray()
        if threads < 1:
            raise SweepError(f"--threads must be >= 1, got {threads}")
        if jobs is not None and jobs < 1:
            raise SweepError(f"--jobs must be >= 1, got {jobs}")
        self.address, self.jobs, self.threads = address, jobs, int(threads)
        self.gpu_need, self.gpu_wait_s = int(gpu_need), float(gpu_wait_s)
        self.per_gpu = runs_per_gpu or 8
        self.slots = jobs or 1
        self._fn = None
        self._connected = False
        self._gpus = 0

    def gpu_count(self) -> int:
        """The cluster's GPUs (read when it started)."""
        return self._gpus

    def start(self) -> None:
        """Connect to the cluster or start a local one (once)."""
        if self._connected:
            return
        ray = self.ray
        paths = _import_paths() + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}
        kwargs = dict(include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)
        if self.address:
            _check_reachable(self.address)
            try:
                ray.init(address=self.address, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the reason is Ray's, said in one line
                raise SweepError(f"--ray-address {self.address}: cannot connect ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        else:
            ray.init(num_cpus=(self.jobs or os.cpu_count() or 1) * self.threads, **kwargs)
        self._connected = True
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < self.threads:
            raise SweepError(f"--executor ray: the cluster has {cpus} CPU(s), a run asks for --threads {self.threads}")
        self.slots = self.jobs or max(1, cpus // self.threads)
        self._gpus = int(ray.cluster_resources().get("GPU", 0))
        self._fn = ray.remote(_ray_run_task)

    def place(self, task: dict) -> str | None:
        return task["want"]  # Ray places the run; the task checks the GPU's memory before it starts

    def why_not(self, task: dict) -> str:  # pragma: no cover - place never refuses
        return "not placed"

    def submit(self, task: dict):
        gpu = 0.0 if task["want"] == "cpu" else 1.0 / self.per_gpu
        opts = dict(num_cpus=self.threads, num_gpus=gpu, max_retries=2, retry_exceptions=False)
        ref = self._fn.options(**opts).remote(dict(task, threads=self.threads, gpu_need=self.gpu_need,
                                                   gpu_wait_s=self.gpu_wait_s))
        return ref.future()

    def release(self, device: str) -> None:
        pass

    def close(self, cancel: bool = False) -> None:  # noqa: ARG002 - Ray's tasks end with the driver
        if self._connected:
            self.ray.shutdown()
            self._connected = False


def make_executor(kind: str, *, jobs, threads, address=None, gpu_need=1024 * MIB, runs_per_gpu=None,
                  cuda_count=0, gpu_wait_s=600.0):
    """The executor of ``--executor kind`` (``local`` or ``ray``)."""
    if kind == "local":
        return LocalExecutor(jobs or 1, threads, gpu_need=gpu_need, runs_per_gpu=runs_per_gpu, cuda_count=cuda_count)
    if kind == "ray":
        return RayExecutor(address, jobs, threads, gpu_need=gpu_need, runs_per_gpu=runs_per_gpu, gpu_wait_s=gpu_wait_s)
    raise SweepError(f"--executor {kind}: use local or ray")


# --------------------------------------------------------------------------- the driver
def _one_line(exc: BaseException) -> str:
    exc = getattr(exc, "cause", None) or exc  # a Ray task's error carries the run's own exception
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def execute(tasks: list, executor, *, code_tree: str | None, on_record, on_failure, log) -> list:
    """Run ``tasks`` (each with ``want``: its device) through ``executor``, in order as far as
    slots and GPU memory allow; ``on_record(record)`` for each kept run, ``on_failure(task,
    reason, detail)`` for each failed one. A record of another code tree than ``code_tree`` is a
    failure. Returns the failures ``[(task, reason)]``."""
    pending = list(tasks)
    running: dict = {}
    failures = []

    def fail(task, reason, detail=""):
        for member in task.get("runs") or [task]:   # an array's failure is each of its runs'
            failures.append((member, reason))
            on_failure(member, reason, detail)

    def keep(rec):
        tree = rec.get("provenance", {}).get("code_tree")
        if code_tree is not None and tree != code_tree:
            return (f"ran code tree {tree} on {rec.get('host')}, the driver's is {code_tree}: "
                    "one sweep, one code version; not kept")
        on_record(rec)
        return None

    try:
        executor.start()
        while pending or running:
            for task in list(pending):
                if len(running) >= executor.slots:
                    break
                device = executor.place(task)
                if device is None:
                    continue  # it waits for room on a GPU; the runs behind it may start
                pending.remove(task)
                try:
                    fut = executor.submit(dict(task, device=device, executor=executor.name))
                except Exception as exc:  # noqa: BLE001 - e.g. a process pool broken by a killed run
                    executor.release(device)
                    fail(task, _one_line(exc))
                    continue
                running[fut] = (task, device)
            if not running:
                for task in pending:  # nothing of this sweep runs, and still they do not fit
                    fail(task, f"does not fit: {executor.why_not(task)}")
                break
            done, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
            for fut in done:
                task, device = running.pop(fut)
                executor.release(device)
                try:
                    rec = fut.result()
                except Exception as exc:  # noqa: BLE001 - any failure of a run: reported, kept pending
                    fail(task, _one_line(exc), "".join(traceback.format_exception(exc))[-4000:])
                    continue
                if task.get("runs"):                 # an array: its records, and its runs that diverged
                    by_key = {m["key"]: m for m in task["runs"]}
                    for r in rec["records"]:
                        why = keep(r)
                        if why:
                            fail(by_key[r["key"]], why)
                    for f in rec["failed"]:
                        fail(by_key[f["key"]], f["reason"])
                    continue
                why = keep(rec)
                if why:
                    fail(task, why)
    except BaseException:
        executor.close(cancel=True)
        raise
    executor.close()
    return failures


def failure_record(task: dict, reason: str, detail: str = "") -> dict:
    """The line ``failed.jsonl`` gets for a failed run."""
    return {"key": task["key"], "row": task.get("row"), "method": task["method"], "seed": task["seed"],
            "overrides": task["overrides"], "split": task["split"], "device": task.get("want"),
            "reason": reason, "detail": detail, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
