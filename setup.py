"""Install emcl-kernels.

The package is pure Python plus an optional C++/CUDA extension (``csrc/``) built with
``torch.utils.cpp_extension`` against the torch that is already installed, so install it with
build isolation off:  ``pip install --no-build-isolation -e .``
"""
from setuptools import setup

setup(
    name="emcl-kernels",
    version="0.1.0",
    description="EMCL (Zou & Lin) as fused multi-tensor PyTorch optimizer kernels",
    packages=["emcl_kernels", "emcl_kernels.backends", "emcl_continual",
              "emcl_continual.methods"],
    package_dir={"emcl_continual": "python/emcl_continual"},
    python_requires=">=3.9",
    install_requires=["torch>=2.11", "numpy", "tqdm", "matplotlib"],
)
