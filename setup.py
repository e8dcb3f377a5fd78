"""Install emcl-kernels.

The package is pure Python plus an optional C++/CUDA extension, ``emcl_kernels._C`` (``csrc/``),
built with ``torch.utils.cpp_extension`` against the torch that is already installed, so install
it with build isolation off:  ``pip install --no-build-isolation -e .``

What gets built:
- with a usable CUDA toolkit (``nvcc`` under ``CUDA_HOME``, and a CUDA build of torch): the CPU
  and the CUDA kernels, for ``TORCH_CUDA_ARCH_LIST`` (default ``"8.0;9.0+PTX"``: sm_80 and sm_90
  code, and sm_90 PTX that newer GPUs compile at load time);
- otherwise: the CPU kernels only.

Environment:
- ``EMCL_NO_EXTENSION=1``: build nothing (pure Python; the "cpu"/"cuda" backends are missing).
- ``EMCL_NO_CUDA=1``: build the CPU kernels only, even where nvcc exists.
- ``EMCL_REQUIRE_EXTENSION=1``: a failed extension build fails the install (CI uses this so a
  CUDA compile error fails CI). Without it a failed build only warns: the package still installs
  and ``emcl_kernels.backends.backend_status()`` says why "cpu"/"cuda" are missing.
- ``MAX_JOBS``: parallel compile jobs (ninja).
"""
import os
import sys
import traceback

from setuptools import setup
from setuptools.command.build_ext import build_ext as _setuptools_build_ext

CSRC = "csrc"
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"  # SASS for A100 and H100/H200, PTX for newer GPUs


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _log(msg: str) -> None:
    print(f"emcl-kernels setup: {msg}", file=sys.stderr)


def _cuda_home():
    """The CUDA toolkit root to build with, or None with the reason it cannot be used."""
    import torch
    from torch.utils import cpp_extension

    if _flag("EMCL_NO_CUDA"):
        return None, "EMCL_NO_CUDA is set"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    if not home:
        return None, "no CUDA toolkit found (set CUDA_HOME)"
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None, f"no nvcc at {nvcc} (set CUDA_HOME to the toolkit root)"
    return home, None


def _extensions():
    """The extension modules to build (an empty list when nothing can or should be built)."""
    if _flag("EMCL_NO_EXTENSION"):
        _log("EMCL_NO_EXTENSION is set: not building emcl_kernels._C")
        return [], None
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError as exc:
        if _flag("EMCL_REQUIRE_EXTENSION"):
            raise
        _log(f"torch is not importable ({exc}): not building emcl_kernels._C "
             "(install torch first and use pip install --no-build-isolation)")
        return [], None

    cuda_home, why_not = _cuda_home()
    sources = [os.path.join(CSRC, f) for f in ("emcl_ops.cpp", "emcl_cpu.cpp", "emcl_cpu_avx2.cpp")]
    cxx = ["-O3"]  # torch adds the C++ standard it was built with
    if cuda_home is not None:
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home  # torch guesses it at import; make it agree
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        _log(f"building the CPU and CUDA kernels (CUDA_HOME={cuda_home}, "
             f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})")
        ext = cpp_extension.CUDAExtension(
            "emcl_kernels._C",
            sources + [os.path.join(CSRC, "emcl_cuda.cu")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        )
    else:
        _log(f"building the CPU kernels only: {why_not}")
        ext = cpp_extension.CppExtension("emcl_kernels._C", sources,
                                         extra_compile_args={"cxx": cxx})
    return [ext], cpp_extension.BuildExtension


def _build_ext_class(base):
    """``base`` (torch's BuildExtension) that turns a failed build into a warning unless
    EMCL_REQUIRE_EXTENSION is set."""
    base = base or _setuptools_build_ext

    class build_ext(base):
        _emcl_failed = False

        def run(self):
            try:
                super().run()
            except Exception:  # noqa: BLE001 - any compiler/linker failure
                self._failed()

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception:  # noqa: BLE001
                self._failed()

        def copy_extensions_to_source(self):  # --inplace / editable: nothing to copy if failed
            if not self._emcl_failed:
                super().copy_extensions_to_source()

        def _failed(self):
            if _flag("EMCL_REQUIRE_EXTENSION"):
                raise
            if self._emcl_failed:
                return
            type(self)._emcl_failed = True
            traceback.print_exc()
            _log("building emcl_kernels._C FAILED; installing without it. The 'cpu' and 'cuda' "
                 "backends will be unavailable (emcl_kernels.backends.backend_status() says "
                 "why). Set EMCL_REQUIRE_EXTENSION=1 to make this an error.")

    return build_ext


ext_modules, build_ext_base = _extensions()
cmdclass = {"build_ext": _build_ext_class(build_ext_base)} if ext_modules else {}

setup(
    name="emcl-kernels",
    version="0.1.0",
    description="EMCL (Zou & Lin) as fused multi-tensor PyTorch optimizer kernels",
    packages=["emcl_kernels", "emcl_kernels.backends", "emcl_continual",
              "emcl_continual.methods"],
    package_dir={"emcl_continual": "python/emcl_continual"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
    install_requires=["torch>=2.11", "numpy", "tqdm", "matplotlib"],
)
