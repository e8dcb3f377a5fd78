"""Install emcl-kernels.

The package is pure Python plus a C++/CUDA extension, ``emcl_kernels._C`` (``csrc/``), built
with ``torch.utils.cpp_extension`` against the torch that is already installed, so install it
with build isolation off (``pyproject.toml`` makes every pip from 21.3 on use the PEP 517/660
build, also pip 23.x/24.x with a setuptools that no longer has a working ``setup.py develop``)::

    pip install --no-build-isolation -e .

What gets built:
- with a usable CUDA toolkit (``nvcc`` under ``CUDA_HOME``, and a CUDA build of torch): the CPU
  and the CUDA kernels, for ``TORCH_CUDA_ARCH_LIST`` (default ``"8.0;9.0+PTX"``: sm_80 and sm_90
  code, and sm_90 PTX that newer GPUs compile at load time);
- otherwise: the CPU kernels only.

The extension is required: a compile error, a library that does not load, or one that fails
the self-check fails the install with the compiler's messages. The self-check
(``tools/ext_selfcheck.py``) loads the new library in a subprocess and calls an op with a bad
argument; if that does not raise the expected Python exception (a toolchain whose C++
exceptions crash the process), the install fails naming the compilers and how to choose
others (``CC=/usr/bin/gcc CXX=/usr/bin/g++``).

Environment:
- ``EMCL_NO_EXTENSION=1``: build nothing (pure Python: the "reference", "foreach" and "triton"
  backends; "cpu"/"cuda" are missing). The one way to install without the compiled backends.
- ``EMCL_NO_CUDA=1``: build the CPU kernels only, even where nvcc exists.
- ``CC``, ``CXX``: the C and C++ compilers (torch compiles with ``CXX``, default ``c++``, links
  with ``CC``'s driver, and passes ``-ccbin $CC`` to nvcc).
- ``CUDA_HOME``, ``TORCH_CUDA_ARCH_LIST``, ``MAX_JOBS`` (parallel compile jobs, ninja).
- ``EMCL_REQUIRE_EXTENSION``: obsolete (requiring the extension is the default); ignored.
"""
import importlib.util
import os
import shutil
import sys
import sysconfig

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"  # SASS for A100 and H100/H200, PTX for newer GPUs
MIN_TORCH = (2, 11)
NO_EXTENSION_HINT = "(EMCL_NO_EXTENSION=1 installs the pure-Python backends only)"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _log(msg: str) -> None:
    print(f"emcl-kernels setup: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str) -> "NoReturn":  # noqa: F821
    """End the build with ``msg`` (pip shows it with the build's output)."""
    raise SystemExit(f"\nemcl-kernels setup: ERROR: {msg}\n")


def _load_selfcheck():
    path = os.path.join(HERE, "tools", "ext_selfcheck.py")
    if not os.path.isfile(path):
        _fail(f"{path} is missing: it checks the built extension. Install from a full checkout "
              "of the repository.")
    spec = importlib.util.spec_from_file_location("_emcl_ext_selfcheck", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch builds with ninja only when ``ninja`` runs from PATH; ``pip install ninja`` puts it
    in the environment's scripts folder, which is not on PATH unless the environment is
    activated (``.venv/bin/python -m pip ...``). Without ninja torch compiles one file at a
    time."""
    if shutil.which("ninja"):
        return
    candidates = [sysconfig.get_path("scripts")]
    try:
        import ninja  # the PyPI package
        candidates.insert(0, getattr(ninja, "BIN_DIR", ""))
    except ImportError:
        pass
    for folder in candidates:
        if folder and os.path.isfile(os.path.join(folder, "ninja")):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return


def _import_torch():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        _fail(f"torch is not importable here ({type(exc).__name__}: {exc}). emcl_kernels._C "
              "is compiled against the torch already installed in the environment, so install "
              "torch (>= 2.11) first and build with build isolation off:\n"
              "    pip install --no-build-isolation -e .\n"
              "(with build isolation pip builds in a temporary environment without your torch) "
              + NO_EXTENSION_HINT)
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        _fail(f"emcl-kernels needs torch >= {'.'.join(map(str, MIN_TORCH))}; this environment "
              f"has torch {torch.__version__}")
    return torch, cpp_extension


def _cuda_home(torch, cpp_extension):
    """The CUDA toolkit root to build with, or None with the reason it cannot be used."""
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


def _openmp_flag(torch):
    """("-fopenmp", None) when the CPU kernels can share torch's OpenMP threads ([note: OpenMP]),
    else (None, why not)."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "this torch does not run its intra-op threads on OpenMP"
    if not sys.platform.startswith("linux"):
        return None, f"OpenMP flags are only set up for Linux here (this is {sys.platform})"
    return "-fopenmp", None


def _extensions():
    """(ext_modules, cmdclass): empty when EMCL_NO_EXTENSION is set."""
    if _flag("EMCL_NO_EXTENSION"):
        _log("EMCL_NO_EXTENSION is set: not building emcl_kernels._C (pure Python only)")
        return [], {}
    torch, cpp_extension = _import_torch()
    selfcheck = _load_selfcheck()
    _ninja_on_path()

    cuda_home, why_not = _cuda_home(torch, cpp_extension)
    sources = [os.path.join(CSRC, f) for f in ("emcl_ops.cpp", "emcl_cpu.cpp", "emcl_cpu_avx2.cpp",
                                                  "emcl_cpu_avx512.cpp",
                                                  "emcl_glance_cpu.cpp")]
    cxx = ["-O3"]  # torch adds the C++ standard it was built with
    link = []
    # [note: OpenMP] at::parallel_for is a header template: it spreads a loop over torch's
    # intra-op threads only where the including file is compiled with OpenMP (_OPENMP), and
    # runs it on the calling thread otherwise, silently. torch's Linux wheels run their own
    # ops on OpenMP, so the CPU kernels are built with it too (the same libgomp as torch's).
    openmp, openmp_why = _openmp_flag(torch)
    if openmp:
        cxx.append(openmp)
        link.append(openmp)
    else:
        _log(f"the CPU kernels will run on ONE thread whatever torch.set_num_threads says: "
             f"{openmp_why}")
    if cuda_home is not None:
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home  # torch guesses it at import; make it agree
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        _log(f"building the CPU and CUDA kernels against torch {torch.__version__} "
             f"(CUDA_HOME={cuda_home}, TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})")
        ext = cpp_extension.CUDAExtension(
            "emcl_kernels._C",
            # the update's kernels in one file per dtype: nvcc compiles them in parallel
            sources + [os.path.join(CSRC, f) for f in ("emcl_cuda.cu", "emcl_cuda_f32.cu",
                                                       "emcl_cuda_f64.cu", "emcl_cuda_bf16.cu",
                                                       "emcl_cuda_f16.cu",
                                                       "emcl_glance_cuda.cu")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=link,
        )
    else:
        _log(f"building the CPU kernels only against torch {torch.__version__}: {why_not}")
        ext = cpp_extension.CppExtension("emcl_kernels._C", sources,
                                         extra_compile_args={"cxx": cxx},
                                         extra_link_args=link)
    build_ext = _build_ext_class(cpp_extension.BuildExtension, selfcheck, cuda_home is not None)
    return [ext], {"build_ext": build_ext}


def _build_ext_class(base, selfcheck, with_cuda: bool):
    """torch's BuildExtension that fails with a clear message when the extension does not
    build, does not load, fails its self-check, or is not where the installed package imports
    it from."""

    class build_ext(base):
        def _compilers(self) -> str:
            linker = getattr(getattr(self, "compiler", None), "linker_so", None)
            return selfcheck.describe_compilers(linker=linker, with_cuda=with_cuda)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any compiler/linker failure
                _fail(f"building {ext.name} FAILED: {type(exc).__name__}: {exc}\n"
                      "The compiler's messages are above. The build used:\n"
                      f"{self._compilers()}\n"
                      "Fix the error, or choose other compilers with CC/CXX (and CUDA_HOME for "
                      "nvcc); EMCL_NO_CUDA=1 builds the CPU kernels only. " + NO_EXTENSION_HINT)
            path = self.get_ext_fullpath(ext.name)
            _log(f"self-check of {path}: loading it in a subprocess and calling an op with a "
                 "bad argument")
            result = selfcheck.run_check(path)
            if not result.ok:
                _fail(selfcheck.failure_message(result, self._compilers(), path))
            _log(f"self-check passed: {result.summary}")

        def run(self):
            super().run()
            # Where the install will import the library from: the source tree for an editable
            # or --inplace build (setuptools copies it there), else the build folder that the
            # wheel is made from.
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if not os.path.isfile(path):
                    _fail(f"{ext.name} was built but {path} does not exist, so the installed "
                          "package would have no compiled backends. Please report this with "
                          "your pip and setuptools versions. " + NO_EXTENSION_HINT)
                _log(f"{ext.name} is at {path}")

    return build_ext


ext_modules, cmdclass = _extensions()

setup(
    name="emcl-kernels",
    version="0.1.0",
    description="EMCL (Zou & Lin) as fused multi-tensor PyTorch optimizer kernels",
    packages=["emcl_kernels", "emcl_kernels.backends", "emcl_continual",
              *(f"emcl_continual.{sub}" for sub in ("core", "data", "methods", "training", "arrays", "output",
                                                   "sweep", "reports"))],
    package_dir={"emcl_continual": "python/emcl_continual"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
    install_requires=["torch>=2.11", "numpy", "tqdm", "matplotlib"],
    # emcl_continual.avalanche (EMCLStrategy); quadprog for Avalanche's own GEM. CI installs the
    # exact versions of requirements-avalanche.txt under requirements.txt's pins (make setup-avalanche).
    # ray: the held-out selection's --executor ray (CI: requirements-ray.txt, make setup-ray).
    extras_require={"avalanche": ["avalanche-lib>=0.6.0,<0.7", "quadprog"],
                    "frameworks": ["transformers>=5", "accelerate>=1", "lightning>=2.4", "timm>=1"],
                    "ray": ["ray>=2.40"]},
)
