#!/bin/bash
# Every condition of the reproducibility measurements (measure.py), one process at a time,
# resumable (finished runs are skipped). Run from the repository root with the clean clone of
# the sweep commit on PYTHONPATH (results/heldout/README.md says how to make it):
#   CLONE=/tmp/sweep PYTHON=/path/to/python nice -n 10 bash results/reproducibility/run.sh
# Two-thread runs wait passively (OMP_WAIT_POLICY=PASSIVE: scheduling only, the partition of the
# work between the threads is the same), so that they do not spin on a loaded machine.
set -e
PY=${PYTHON:-python}
export PYTHONPATH=$CLONE:$CLONE/python
M="$PY -u results/reproducibility/measure.py run"
BASE="--methods sgd er agem ewc"
# the baselines (seconds a run), five report seeds
$M --condition "1 thread" --threads 1 --require-capability AVX512 $BASE --seeds 10 11 12 13 14
$M --condition "1 thread, again" --threads 1 $BASE --seeds 10 11 12 13 14
ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2" --threads 1 --require-capability AVX2 $BASE --seeds 10 11 12 13 14
ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2, again" --threads 1 --require-capability AVX2 $BASE --seeds 10 11 12 13 14
ATEN_CPU_CAPABILITY=default $M --condition "aten=default" --threads 1 --require-capability DEFAULT $BASE --seeds 10 11 12 13 14
MKL_CBWR=AVX2 $M --condition "mkl_cbwr=AVX2" --threads 1 $BASE --seeds 10 11 12 13 14
MKL_CBWR=COMPATIBLE $M --condition "mkl_cbwr=COMPATIBLE" --threads 1 $BASE --seeds 10 11 12 13 14
ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 $M --condition "aten=avx2, mkl_cbwr=AVX2" --threads 1 \
    --require-capability AVX2 $BASE --seeds 10 11 12 13 14
OMP_WAIT_POLICY=PASSIVE ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2, 2 threads" --threads 2 \
    --require-capability AVX2 $BASE --seeds 10 11 12 13 14
OMP_WAIT_POLICY=PASSIVE $M --condition "2 threads" --threads 2 $BASE --seeds 10 11
# EMCL (tens of seconds a run): seeds 10 and 11
ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2" --threads 1 --require-capability AVX2 --methods emcl --seeds 10 11
$M --condition "1 thread" --threads 1 --require-capability AVX512 --methods emcl --seeds 10 11
ATEN_CPU_CAPABILITY=default $M --condition "aten=default" --threads 1 --require-capability DEFAULT --methods emcl --seeds 10 11
MKL_CBWR=AVX2 $M --condition "mkl_cbwr=AVX2" --threads 1 --methods emcl --seeds 10 11
ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2, again" --threads 1 --require-capability AVX2 --methods emcl --seeds 10
OMP_WAIT_POLICY=PASSIVE ATEN_CPU_CAPABILITY=avx2 $M --condition "aten=avx2, 2 threads" --threads 2 \
    --require-capability AVX2 --methods emcl --seeds 10
