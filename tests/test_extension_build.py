"""The build of the extension and life without it: setup.py honours EMCL_NO_EXTENSION and
EMCL_REQUIRE_EXTENSION, a failed build does not fail the install, and without emcl_kernels._C
the package still imports and says why "cpu"/"cuda" are missing."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, cwd=ROOT, env=None, args=None):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    cmd = [sys.executable] + (args if args is not None else ["-c", code])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


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
        print("ok")
    """)
    out = _run(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def _copy_project(tmp_path, break_source: bool):
    shutil.copy(os.path.join(ROOT, "setup.py"), tmp_path)
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    shutil.copytree(os.path.join(ROOT, "emcl_kernels"), tmp_path / "emcl_kernels",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (tmp_path / "python" / "emcl_continual" / "methods").mkdir(parents=True)
    if break_source:  # a compile error at the top of every source: the build fails at once
        for src in list((tmp_path / "csrc").glob("*.cpp")) + list((tmp_path / "csrc").glob("*.cu")):
            src.write_text('#include "deliberately_broken_by_the_test.h"\n' + src.read_text())


def _build(tmp_path, **env):
    # EMCL_REQUIRE_EXTENSION may be set by the caller's environment (CI sets it): each test
    # says whether it wants it.
    base = {"EMCL_NO_CUDA": "1", "MAX_JOBS": "1", "EMCL_REQUIRE_EXTENSION": "0",
            "EMCL_NO_EXTENSION": "0"}
    return _run("", cwd=tmp_path, env={**base, **env},
                args=["setup.py", "-q", "build_ext", "--inplace"])


def test_no_extension_flag_builds_nothing(tmp_path):
    _copy_project(tmp_path, break_source=True)
    out = _build(tmp_path, EMCL_NO_EXTENSION="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EMCL_NO_EXTENSION" in out.stderr
    assert not list((tmp_path / "emcl_kernels").glob("_C*.so"))


def test_failed_build_warns_but_installs(tmp_path):
    _copy_project(tmp_path, break_source=True)
    out = _build(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "building emcl_kernels._C FAILED" in out.stderr
    assert not list((tmp_path / "emcl_kernels").glob("_C*.so"))


def test_failed_build_fails_when_the_extension_is_required(tmp_path):
    _copy_project(tmp_path, break_source=True)
    out = _build(tmp_path, EMCL_REQUIRE_EXTENSION="1")
    assert out.returncode != 0
    assert "deliberately_broken_by_the_test.h" in out.stdout + out.stderr
