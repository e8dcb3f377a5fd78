"""The build of the extension and life without it.

- setup.py: a build that fails ends the install with the compiler's message; a build without
  torch importable fails saying to install torch and use --no-build-isolation;
  EMCL_NO_EXTENSION=1 is the one way to install pure Python.
- The self-check (tools/ext_selfcheck.py): a built library whose C++ checks do not reach Python
  as exceptions (the process crashes, or the bad call returns) fails the build with a message
  naming the compilers; tested on simulated broken libraries, on the real build, and through
  setup.py on a small library that really compiles.
- Without emcl_kernels._C the package still imports and says why "cpu"/"cuda" are missing.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")

_spec = importlib.util.spec_from_file_location("ext_selfcheck", os.path.join(TOOLS, "ext_selfcheck.py"))
selfcheck = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = selfcheck
_spec.loader.exec_module(selfcheck)

# The switches setup.py reads; each test sets the ones it means (CI may export some).
_CLEAN_ENV = {"EMCL_NO_EXTENSION": "0", "EMCL_NO_CUDA": "1", "EMCL_REQUIRE_EXTENSION": "0",
              "MAX_JOBS": "2"}


def _run(code: str, cwd=ROOT, env=None, args=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    cmd = [sys.executable] + (args if args is not None else ["-c", code])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_package_imports_without_the_extension():
    code = textwrap.dedent("""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "emcl_kernels._C":
                    raise ImportError("blocked by the test")
        sys.meta_path.insert(0, Block())
        import torch
        import emcl_kernels
        from emcl_kernels.backends import backend_status, available_backends, get_backend
        from emcl_kernels.backends import BackendUnavailableError
        status = backend_status()
        assert "emcl_kernels._C is not built" in status["cpu"], status
        assert "emcl_kernels._C is not built" in status["cuda"], status
        assert "cpu" not in available_backends() and "foreach" in available_backends()
        try:
            get_backend("cpu", torch.device("cpu"))
        except BackendUnavailableError as e:
            assert "'cpu'" in str(e) and "not built" in str(e), e
        else:
            raise AssertionError("backend='cpu' did not raise")
        from emcl_kernels.backends import auto_backend
        assert auto_backend(torch.device("cpu")) == "foreach"
        # the plan key and the functional checks run their Python passes, and a step works
        from emcl_kernels.backends.extension import entry_point
        from emcl_kernels import functional, plan
        assert entry_point("step") is None and plan._plan_grads is None
        assert plan._identical is plan._py_identical and functional._plainly_valid_call is None
        p = torch.nn.Parameter(torch.randn(3))
        opt = emcl_kernels.FusedEMCLOptimizer([p], meta_every=2)
        for _ in range(3):
            p.grad = torch.randn(3)
            opt.step()
        assert opt.state[p]["step"].item() == 1
        print("ok")
    """)
    out = _run(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# The self-check on simulated libraries: a .py file stands in for the compiled library and
# registers the op the check calls, with the behaviour of a good or a broken build.
# ---------------------------------------------------------------------------------------------

def _fake_library(tmp_path, op: str, body: str) -> str:
    """A stand-in for emcl_kernels._C that registers ``emcl::<op>`` with ``body`` as its
    implementation (``args`` are the op's arguments)."""
    from emcl_kernels.interface import CHECK_FINITE_SCHEMA
    schema = {"check_finite_": CHECK_FINITE_SCHEMA}[op]
    path = tmp_path / f"fake_{op}.py"
    lines = ["import ctypes, os, torch",
             "_lib = torch.library.Library('emcl', 'DEF')",
             f"_lib.define({schema!r})",
             "def _impl(*args, **kwargs):"]
    lines += ["    " + line for line in textwrap.dedent(body).strip().splitlines()]
    lines.append(f"_lib.impl({op!r}, _impl, 'CompositeExplicitAutograd')")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_self_check_detects_a_crash(tmp_path):
    # The failure of the GPU image's /opt/gcc build: the bad call kills the process.
    lib = _fake_library(tmp_path, "check_finite_", "ctypes.string_at(0)  # segfault")
    result = selfcheck.run_check(lib)
    assert not result.ok
    assert "SIGSEGV" in result.summary and "check_finite_" in result.summary, result.summary
    message = selfcheck.failure_message(result, selfcheck.describe_compilers(), lib)
    assert "CC=/usr/bin/gcc CXX=/usr/bin/g++" in message
    assert "C++ compiler" in message and "EMCL_NO_EXTENSION=1" in message


def test_self_check_detects_a_missing_exception(tmp_path):
    lib = _fake_library(tmp_path, "check_finite_", "return None")
    result = selfcheck.run_check(lib)
    assert not result.ok
    assert "returned normally" in result.summary and "TypeError" in result.summary


def test_self_check_detects_the_wrong_exception(tmp_path):
    # e.g. a c10::TypeError that arrives as a plain RuntimeError (type info lost on the way)
    lib = _fake_library(tmp_path, "check_finite_", "raise RuntimeError('counters must be int64')")
    result = selfcheck.run_check(lib)
    assert not result.ok
    assert "RuntimeError instead of TypeError" in result.summary, result.summary


def test_self_check_passes_a_library_that_raises(tmp_path):
    lib = _fake_library(tmp_path, "check_finite_", """
        grads, counters = args
        if counters.dtype != torch.int64:
            raise TypeError(f"counters must be int64, got {counters.dtype}")
    """)
    result = selfcheck.run_check(lib)
    assert result.ok, result.output
    assert "check_finite_ raised TypeError: counters must be int64" in result.summary


def test_self_check_fails_a_library_without_the_ops_or_that_does_not_load(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("import torch\n")
    result = selfcheck.run_check(str(empty))
    assert not result.ok and "check_finite_ is not registered" in result.summary, result.summary
    broken = tmp_path / "_C.cpython-x.so"
    broken.write_bytes(b"not an ELF file")
    result = selfcheck.run_check(str(broken))
    assert not result.ok and "could not be loaded" in result.summary, result.summary
    result = selfcheck.run_check(str(tmp_path / "missing.so"))
    assert not result.ok and "no built library" in result.summary


def test_describe_compilers_names_cxx_and_cc_with_their_versions():
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler on PATH")
    text = selfcheck.describe_compilers(env={"CXX": gxx, "CC": gxx, "PATH": os.environ["PATH"]},
                                        with_cuda=True)
    assert f"C++ compiler: {gxx}" in text and "(CXX)" in text
    assert "nvcc host compiler" in text and "-ccbin $CC" in text
    version = subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout
    assert version.splitlines()[0] in text
    text = selfcheck.describe_compilers(env={"PATH": os.environ["PATH"]})
    assert "CXX unset, so c++" in text


def test_self_check_passes_on_this_build():
    """The real emcl_kernels._C: its C++ op raises the Python exception the check expects."""
    spec = importlib.util.find_spec("emcl_kernels._C")
    if spec is None or not spec.origin:
        pytest.skip("emcl_kernels._C is not built here")
    result = selfcheck.run_check(spec.origin)
    assert result.ok, result.summary + "\n" + result.output


# ---------------------------------------------------------------------------------------------
# setup.py
# ---------------------------------------------------------------------------------------------

def _copy_project(tmp_path, break_source: bool = False):
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    shutil.copytree(TOOLS, tmp_path / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "emcl_kernels"), tmp_path / "emcl_kernels",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(os.path.join(ROOT, "python"), tmp_path / "python",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if break_source:  # a compile error at the top of every source: the build fails at once
        for src in list((tmp_path / "csrc").glob("*.cpp")) + list((tmp_path / "csrc").glob("*.cu")):
            src.write_text('#include "deliberately_broken_by_the_test.h"\n' + src.read_text())


def _build(tmp_path, env=None, args=("build_ext", "--inplace")):
    return _run("", cwd=tmp_path, env={**_CLEAN_ENV, **(env or {})},
                args=["setup.py", *args])


def _hide_torch(tmp_path) -> str:
    """A folder to put first on PYTHONPATH so that `import torch` fails, as in an isolated
    build environment."""
    fake = tmp_path / "no_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch' (hidden by the test)\")\n")
    return str(fake.parent)


def test_no_extension_flag_builds_nothing(tmp_path):
    _copy_project(tmp_path, break_source=True)
    out = _build(tmp_path, env={"EMCL_NO_EXTENSION": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EMCL_NO_EXTENSION" in out.stderr
    assert not list((tmp_path / "emcl_kernels").glob("_C*.so"))


def test_failed_build_fails_the_install_with_the_compiler_message(tmp_path):
    _copy_project(tmp_path, break_source=True)
    out = _build(tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "deliberately_broken_by_the_test.h" in text  # the compiler's own message
    assert "building emcl_kernels._C FAILED" in out.stderr
    assert "C++ compiler" in out.stderr and "EMCL_NO_EXTENSION=1" in out.stderr
    assert not list((tmp_path / "emcl_kernels").glob("_C*.so"))


def test_build_without_torch_fails_saying_to_install_torch_first(tmp_path):
    _copy_project(tmp_path)
    out = _build(tmp_path, env={"PYTHONPATH": _hide_torch(tmp_path)}, args=("egg_info",))
    assert out.returncode != 0
    assert "torch is not importable" in out.stderr, out.stderr[-3000:]
    assert "--no-build-isolation" in out.stderr and "install torch" in out.stderr


def test_no_extension_installs_pure_python_without_torch(tmp_path):
    """EMCL_NO_EXTENSION=1 through pip's PEP 517 build (no index, torch not importable): a
    wheel of the Python packages, without _C."""
    _copy_project(tmp_path, break_source=True)
    target = tmp_path / "site"
    env = {**_CLEAN_ENV, "EMCL_NO_EXTENSION": "1", "PIP_NO_INDEX": "1",
           "PYTHONPATH": _hide_torch(tmp_path)}
    out = _run("", cwd=tmp_path, env=env,
               args=["-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-compile",
                     "--target", str(target), "."])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (target / "emcl_kernels" / "functional.py").is_file()
    assert (target / "emcl_continual" / "__init__.py").is_file()
    subs = sorted(p.parent.name for p in (tmp_path / "python" / "emcl_continual").glob("*/__init__.py"))
    assert "core" in subs and [s for s in subs if not (target / "emcl_continual" / s / "__init__.py").is_file()] == []
    assert not list(target.glob("emcl_kernels/_C*"))


# A small library with the real op's check, to run the self-check inside a real build. Its op
# calls std::terminate() (as an uncaught C++ exception would) when EMCL_TEST_TERMINATE is set
# in the environment of the process that calls it.
_TINY_OPS = r"""
#include <Python.h>
#include <cstdlib>
#include <exception>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace {
void check_finite_(at::TensorList grads, const at::Tensor& counters) {
  if (std::getenv("EMCL_TEST_TERMINATE") != nullptr) std::terminate();
  TORCH_CHECK_TYPE(counters.scalar_type() == at::kLong, "counters must be int64, got ",
                   counters.scalar_type());
}
}  // namespace

TORCH_LIBRARY(emcl, m) {
  m.def("check_finite_(Tensor[] grads, Tensor(a!) counters) -> ()");
  m.impl("check_finite_", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(check_finite_));
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
"""


def test_build_runs_the_self_check_and_fails_when_the_library_crashes(tmp_path):
    """setup.py compiles a small library with one op; its check raises (the build passes and
    the library is in place), then the same library made to terminate on the bad call fails the
    build with the compilers named."""
    # The compilers the environment chose (gpu-check sets CC/CXX when the default toolchain
    # fails the self-check), else those on PATH.
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cxx is None or cc is None:
        pytest.skip("no C/C++ compiler on PATH")
    _copy_project(tmp_path)
    csrc = tmp_path / "csrc"
    (csrc / "emcl_ops.cpp").write_text(_TINY_OPS)
    (csrc / "emcl_cpu.cpp").write_text("// empty for the test\n")
    (csrc / "emcl_cpu_avx2.cpp").write_text("// empty for the test\n")
    (csrc / "emcl_cpu_avx512.cpp").write_text("// empty for the test\n")
    env = {"CXX": cxx, "CC": cc}

    out = _build(tmp_path, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "self-check passed: torch.ops.emcl.check_finite_ raised TypeError" in out.stderr
    assert len(list((tmp_path / "emcl_kernels").glob("_C*.so"))) == 1

    out = _build(tmp_path, env={**env, "EMCL_TEST_TERMINATE": "1"})  # objects are up to date
    assert out.returncode != 0
    assert "failed its self-check" in out.stderr and "SIGABRT" in out.stderr, out.stderr[-4000:]
    assert f"C++ compiler: {cxx}" in out.stderr and "CC=/usr/bin/gcc CXX=/usr/bin/g++" in out.stderr
