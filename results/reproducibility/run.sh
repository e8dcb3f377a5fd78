#!/bin/bash
# Every condition of the reproducibility measurements (measure.py), one process at a time,
# resumable (finished runs are skipped). Run from the repository root with the clean clone of
# the sweep commit on PYTHONPATH (results/heldout/README.md says how to make it):
#   CLONE=/tmp/sweep PYTHON=/path/to/python nice -n 10 bash results/reproducibility/run.sh
set -e
PY=${PYTHON:-python}
export PYTHONPATH=$CLONE:$CLONE/python
M="$PY -u results/reproducibility/measure.py run"
BASE="--methods sgd er agem ewc --seeds 10 11 12 13 14"
EMCL="--methods emcl --seeds 10 11"
for what in "$BASE" "$EMCL"; do
  $M --condition "1 thread" --threads 1 --require-capability AVX512 $what
  $M --condition "1 thread, again" --threads 1 $what
  $M --condition "2 threads" --threads 2 $what
  ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2" --threads 1 --require-capability AVX2 $what
  ATEN_CPU_CAPABILITY=default $M --condition "aten=default" --threads 1 --require-capability DEFAULT $what
  MKL_CBWR=AVX2 $M --condition "mkl_cbwr=AVX2" --threads 1 $what
  MKL_CBWR=AVX512 $M --condition "mkl_cbwr=AVX512" --threads 1 $what
  MKL_CBWR=COMPATIBLE $M --condition "mkl_cbwr=COMPATIBLE" --threads 1 $what
  ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 $M --condition "aten=avx2, mkl_cbwr=AVX2" --threads 1 \
      --require-capability AVX2 $what
done
