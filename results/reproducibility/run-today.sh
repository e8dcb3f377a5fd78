#!/bin/bash
# The same measurements with today's code: a clean clone of a later commit (TODAY) on PYTHONPATH,
# its extension built from its own csrc/. Resumable like run.sh.
#   TODAY=/tmp/today PYTHON=/path/to/python nice -n 10 bash results/reproducibility/run-today.sh
set -e
PY=${PYTHON:-python}
export PYTHONPATH=$TODAY:$TODAY/python
C=$(git -C "$TODAY" rev-parse --short HEAD)
M="$PY -u results/reproducibility/measure.py run"
BASE="--methods sgd er agem ewc --seeds 10 11 12 13 14"
ATEN_CPU_CAPABILITY=avx2 $M --condition "code $C, aten=avx2" --threads 1 --require-capability AVX2 $BASE
$M --condition "code $C, 1 thread" --threads 1 --require-capability AVX512 $BASE
ATEN_CPU_CAPABILITY=avx2 $M --condition "code $C, aten=avx2" --threads 1 --require-capability AVX2 --methods emcl --seeds 10 11
$M --condition "code $C, 1 thread" --threads 1 --require-capability AVX512 --methods emcl --seeds 10
