"""What a run records about the code and the command that produced it.

:func:`code_version` gives the git commit, the *code tree* (a hash of the blobs of
``python/``, ``emcl_kernels/``, ``csrc/`` and ``setup.py`` at that commit, leaving out the modules
that only read and write result files (:data:`OUTPUT_ONLY`): it changes when code a run executes
changes, not when results, tables or docs are committed), whether the working tree differed from
the commit outside ``results/`` and ``runs/`` (``dirty``), and a hash of the compiled extension in
use. A sweep whose runs share one ``code_tree``, none ``dirty``, ran on one code version.
:func:`command_line` is the command that started this process, as one can type it again.
:func:`processor` is the CPU and the code paths torch takes on it: one seed of one-sample
training amplifies float rounding, so a run reproduces number for number only where the
arithmetic is the same (same processor kind, torch CPU capability, BLAS path and thread count).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
from functools import lru_cache

__all__ = ["code_version", "command_line", "processor", "CODE_PATHS"]

# The paths whose content is "the code" (everything a run's numbers depend on).
CODE_PATHS = ("python", "emcl_kernels", "csrc", "setup.py")
# Paths whose changes do not make a run "dirty": results and scratch outputs.
OUTPUT_PATHS = ("results", "runs")
# Modules no training run executes (tables and plots from result files): not part of the code tree.
OUTPUT_ONLY = ("python/emcl_continual/tables.py", "python/emcl_continual/reports/tables.py",
               "python/emcl_continual/output/plots.py", "python/emcl_continual/output/report.py")

# The folder of the emcl_continual package (this module is in its core/ sub-package).
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Environment variables that choose the arithmetic a run does (torch's kernels, MKL's BLAS path, threads).
ARITHMETIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")


def _git(root: str, *args: str, strip: bool = True) -> str:
    out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip() or f"git {' '.join(args)} failed")
    return out.stdout.strip() if strip else out.stdout

# The efficiency page (emcl_continual.reports.efficiency) is made from result files too.
OUTPUT_ONLY = OUTPUT_ONLY + ("python/emcl_continual/reports/efficiency.py",)


def _extension_hash() -> str | None:
    try:
        import emcl_kernels
    except ImportError:
        return None
    folder = os.path.dirname(os.path.abspath(emcl_kernels.__file__))
    names = sorted(n for n in os.listdir(folder) if n.startswith("_C") and n.endswith((".so", ".pyd")))
    if not names:
        return None
    h = hashlib.sha256()
    with open(os.path.join(folder, names[0]), "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def code_version() -> dict:
    """``{"commit", "code_tree", "dirty", "dirty_paths", "extension"}`` of the checkout this package
    is imported from (cached for the process); ``commit`` is None with an ``error`` outside git."""
    out: dict = {"commit": None, "code_tree": None, "dirty": None, "dirty_paths": [],
                 "extension": _extension_hash()}
    try:
        root = _git(_HERE, "rev-parse", "--show-toplevel")
        out["commit"] = _git(root, "rev-parse", "HEAD")
        listing = _git(root, "ls-tree", "-r", "HEAD", "--", *CODE_PATHS, strip=False)
        blobs = [line for line in listing.splitlines() if line.split("\t", 1)[-1] not in OUTPUT_ONLY]
        out["code_tree"] = hashlib.sha256("\n".join(blobs).encode()).hexdigest()[:16]
        status = _git(root, "status", "--porcelain", "--untracked-files=normal", "--", ".",
                      *[f":(exclude){p}" for p in OUTPUT_PATHS], strip=False)
        paths = [line[3:] for line in status.splitlines() if line.strip()]
        out["dirty"] = bool(paths)
        out["dirty_paths"] = paths[:20]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        out["error"] = f"no git information: {exc}"
    return out


@lru_cache(maxsize=1)
def _cpu() -> dict:
    """The CPU model and its vector extensions, from /proc/cpuinfo (the platform's name elsewhere)."""
    out: dict = {"machine": platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as fh:
            first = fh.read().split("\n\n", 1)[0]
    except OSError:
        out["model_name"] = platform.processor() or None
        return out
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    flags = set(fields.get("flags", "").split())
    out.update(model_name=fields.get("model name"), vendor=fields.get("vendor_id"), family=fields.get("cpu family"),
               model=fields.get("model"), stepping=fields.get("stepping"),
               isa=[f for f in _ISA_FLAGS if f in flags])
    return out


def processor() -> dict:
    """The processor a run computes on and what chooses its arithmetic: the CPU model (name,
    family / model / stepping, vector extensions), torch's dispatched CPU capability
    (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2, DEFAULT, ...; lowered with the
    environment variable ``ATEN_CPU_CAPABILITY``), torch's thread count now, and the environment
    variables of :data:`ARITHMETIC_ENV` that are set."""
    import torch

    out = dict(_cpu())
    out.update(torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), torch_threads=torch.get_num_threads(),
               env={k: os.environ[k] for k in ARITHMETIC_ENV if k in os.environ})
    return out


def command_line(argv: list | None = None) -> str:
    """The command that started this process (``python -m pkg.mod args`` for a module run)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    first = os.path.abspath(argv[0]) if argv[0] not in ("", "-c") else argv[0]
    package_root = os.path.dirname(_HERE)
    if first.startswith(_HERE + os.sep):
        rel = os.path.relpath(first, package_root)[:-3].replace(os.sep, ".")
        head = ["python", "-m", rel[: -len(".__main__")] if rel.endswith(".__main__") else rel]
    else:
        head = ["python", argv[0]]
    return " ".join(shlex.quote(a) for a in head + argv[1:])
