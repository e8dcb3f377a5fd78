"""Does a freshly built ``emcl_kernels._C`` turn its C++ argument checks into Python exceptions?

An extension built with a broken toolchain can load, and even compute right, but die on the
first ``TORCH_CHECK`` that fails: the C++ exception is never caught, and the process aborts or
segfaults instead of raising (seen on a GPU image whose ``/opt/gcc`` wrapper compiled torch
extensions that crash on any failed check). Every misuse of the ops would then kill the user's
program, and the test suite dies in the middle.

So after compiling, ``setup.py`` loads the new library in a *subprocess* (a crash must not take
pip down with it) and calls one op with a bad argument that the op's own C++ code rejects:

``torch.ops.emcl.check_finite_(grads, counters)`` with a float32 ``counters`` tensor (the
interface of ``emcl_kernels/interface.py`` wants int64; the C++ code checks it with
``TORCH_CHECK_TYPE`` -> ``TypeError``).

The check passes only when that call raises exactly the expected Python exception. Anything
else -- the library does not load, the process dies from a signal, the call returns, or raises
another exception type -- fails the install with a message that names the compilers that built
the library and how to choose others (``CC`` / ``CXX``).

Standard library only: ``setup.py`` imports this file before anything is installed, and
``python tools/ext_selfcheck.py [PATH]`` runs the same check on a built library by hand
(default: the ``emcl_kernels/_C*.so`` beside the sources).
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["CheckResult", "PROBE", "run_check", "describe_compilers", "failure_message",
           "find_built_library", "main"]

#: The module name the library is loaded under (its init function is ``PyInit__C``).
MODULE_NAME = "emcl_kernels._C"

# Lines the probe prints; the parent reads them back.
_OK, _WRONG, _NONE, _NOOP, _CALLING = ("EMCL_SELFCHECK_OK", "EMCL_SELFCHECK_WRONG_EXCEPTION",
                                       "EMCL_SELFCHECK_NO_EXCEPTION", "EMCL_SELFCHECK_NO_OP",
                                       "EMCL_SELFCHECK_CALLING")

#: The program run in the subprocess: ``python -c PROBE PATH``. PATH is a compiled library, or
#: a ``.py`` file standing in for one (the tests use that to simulate broken builds).
PROBE = r'''
import importlib.machinery, importlib.util, sys
path = sys.argv[1]
import torch
name = "emcl_kernels._C"
if path.endswith(".py"):
    loader = importlib.machinery.SourceFileLoader(name, path)
else:
    loader = importlib.machinery.ExtensionFileLoader(name, path)
spec = importlib.util.spec_from_file_location(name, path, loader=loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)  # registers torch.ops.emcl.*

def registered(op):
    try:
        getattr(torch.ops.emcl, op)
    except (AttributeError, RuntimeError):
        return False
    return True

if registered("check_finite_"):
    op, expected = "check_finite_", TypeError
    def call():  # counters must be int64: the C++ op rejects float32 with TORCH_CHECK_TYPE
        torch.ops.emcl.check_finite_([torch.ones(3)], torch.zeros(4, dtype=torch.float32))
else:
    print("EMCL_SELFCHECK_NO_OP torch.ops.emcl.check_finite_ is not registered by " + path,
          flush=True)
    sys.exit(3)
print("EMCL_SELFCHECK_CALLING torch.ops.emcl." + op + ", expecting " + expected.__name__,
      flush=True)
try:
    call()
except expected as exc:
    first = (str(exc).strip().splitlines() or [""])[0]
    print("EMCL_SELFCHECK_OK torch.ops.emcl." + op + " raised " + type(exc).__name__ + ": "
          + first, flush=True)
    sys.exit(0)
except BaseException as exc:
    first = (str(exc).strip().splitlines() or [""])[0]
    print("EMCL_SELFCHECK_WRONG_EXCEPTION torch.ops.emcl." + op + " raised "
          + type(exc).__name__ + " instead of " + expected.__name__ + ": " + first, flush=True)
    sys.exit(4)
print("EMCL_SELFCHECK_NO_EXCEPTION torch.ops.emcl." + op + " returned normally on a bad "
      "argument instead of raising " + expected.__name__, flush=True)
sys.exit(5)
'''


@dataclass
class CheckResult:
    """What the probe saw. ``ok`` is True only when the bad call raised the expected error."""
    ok: bool
    summary: str        # one sentence: what happened
    output: str         # the probe's stdout and stderr (tail)
    returncode: Optional[int]

    def __bool__(self) -> bool:
        return self.ok


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_check(path: str, python: str = sys.executable, timeout: float = 300.0,
              env: Optional[Mapping[str, str]] = None) -> CheckResult:
    """Load the library at ``path`` in a fresh ``python`` process and call an op with a bad
    argument; see the module docstring."""
    if not os.path.isfile(path):
        return CheckResult(False, f"there is no built library at {path}", "", None)
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("PYTHONUNBUFFERED", "1")
    # The probe loads the library by its path and imports no emcl_kernels; it runs in the
    # temp folder so that no source file beside the library can shadow a module torch imports.
    try:
        proc = subprocess.run([python, "-c", PROBE, os.path.abspath(path)], capture_output=True,
                              text=True, timeout=timeout, env=run_env,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or "") + (exc.stderr or "")
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return CheckResult(False, f"loading {path} and calling an op with a bad argument did "
                           f"not finish within {timeout:.0f} s", out[-4000:], None)
    out = (proc.stdout + proc.stderr)[-4000:]
    lines = proc.stdout.splitlines()
    said = {tag: next((ln[len(tag):].strip() for ln in lines if ln.startswith(tag)), None)
            for tag in (_OK, _WRONG, _NONE, _NOOP, _CALLING)}
    rc = proc.returncode
    if rc == 0 and said[_OK] is not None:
        return CheckResult(True, said[_OK], out, rc)
    if rc < 0:
        where = (f"while calling {said[_CALLING]}" if said[_CALLING] is not None
                 else "while loading it")
        return CheckResult(False, f"the process died with {_signal_name(rc)} {where}: a C++ "
                           "exception from a failed argument check was not turned into a "
                           "Python exception", out, rc)
    for tag in (_NONE, _WRONG, _NOOP):
        if said[tag] is not None:
            return CheckResult(False, said[tag], out, rc)
    if said[_CALLING] is not None:
        return CheckResult(False, f"the process exited with status {rc} while calling "
                           f"{said[_CALLING]}", out, rc)
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return CheckResult(False, f"the library could not be loaded (exit status {rc}): {last}",
                       out, rc)


def _version(exe: str) -> str:
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({exe} --version failed: {exc})"
    first = ((proc.stdout or proc.stderr).strip().splitlines() or ["?"])[0]
    return first


def _describe(label: str, command: Optional[Sequence[str]], source: str) -> str:
    if not command:
        return f"  {label}: unknown ({source})"
    exe = command[0]
    found = shutil.which(exe)
    if found is None:
        return f"  {label}: {exe} ({source}; not found on PATH)"
    real = os.path.realpath(found)
    where = found if real == found else f"{found} -> {real}"
    return f"  {label}: {exe} = {where} ({source}), {_version(found)}"


def describe_compilers(env: Optional[Mapping[str, str]] = None,
                       linker: Optional[Sequence[str]] = None, with_cuda: bool = False) -> str:
    """The compilers torch's extension build uses here, resolved on PATH, with ``--version``.

    torch compiles C++ with ``$CXX`` (default ``c++``), links with Python's ``LDSHARED``
    (``$CC`` replaces its compiler; ``linker`` is the command setuptools actually used when the
    caller knows it), and nvcc compiles host code with ``-ccbin $CC`` when ``CC`` is set, else
    with the ``g++`` on PATH."""
    env = os.environ if env is None else env
    lines = [_describe("C++ compiler", [env.get("CXX") or "c++"],
                       "CXX" if env.get("CXX") else "CXX unset, so c++")]
    if linker:
        lines.append(_describe("linker", list(linker), "LDSHARED, or CC, or Python's default"))
    elif env.get("CC"):
        lines.append(_describe("linker", [env["CC"]], "CC"))
    if with_cuda:
        lines.append(_describe("nvcc host compiler", [env.get("CC") or "g++"],
                               "-ccbin $CC" if env.get("CC") else "CC unset, so nvcc's g++"))
    return "\n".join(lines)


def failure_message(result: CheckResult, compilers: str, path: str) -> str:
    """The error an install ends with when the check fails."""
    alt = "CC=/usr/bin/gcc CXX=/usr/bin/g++"
    return (
        f"emcl-kernels setup: the freshly built {MODULE_NAME} ({path}) failed its self-check: "
        f"{result.summary}.\n"
        "The check loads the library in a subprocess and calls one op with a bad argument; a "
        "working build raises a Python exception there. The library was built with:\n"
        f"{compilers}\n"
        "A toolchain whose C++ exceptions do not cross into torch (a compiler wrapper, or a "
        "compiler other than the one torch was built with) gives this. Choose another compiler "
        f"and build again, e.g.\n    {alt} pip install --no-build-isolation -e .\n"
        "(any GCC or Clang that torch supports; CC also sets the linker and nvcc's host "
        "compiler). EMCL_NO_EXTENSION=1 installs the pure-Python backends only.\n"
        "The check's output:\n" + _indent(result.output or "(none)"))


def _indent(text: str) -> str:
    return "\n".join("    " + ln for ln in text.rstrip().splitlines())


def find_built_library(root: str) -> Optional[str]:
    """The ``emcl_kernels/_C*.so`` (or ``.pyd``) under ``root``, the newest if several."""
    hits = glob.glob(os.path.join(root, "emcl_kernels", "_C*.so")) + \
        glob.glob(os.path.join(root, "emcl_kernels", "_C*.pyd"))
    return max(hits, key=os.path.getmtime) if hits else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="the built library (default: "
                        "emcl_kernels/_C*.so in the checkout)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = args.path or find_built_library(root)
    if path is None:
        print(f"no emcl_kernels/_C*.so under {root}: build it first "
              "(pip install --no-build-isolation -e .)", file=sys.stderr)
        return 2
    result = run_check(os.path.abspath(path), timeout=args.timeout)
    if result.ok:
        print(f"self-check passed: {result.summary}")
        return 0
    print(failure_message(result, describe_compilers(), path), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
