#!/bin/bash
# Figure 3's EMCL-SI and Table IV's columns on the MNIST streams (paper_rows.py), in order of
# importance, one training process at a time, each step resumable (finished runs are skipped).
# torch's AVX2 kernels: the arithmetic of the committed runs (results/reproducibility/).
# Run from the clean clone of the sweep commit the stream's files record (results/heldout/README.md):
#   PYTHONPATH=$PWD:$PWD/python PYTHON=/path/to/python nice -n 10 bash results/heldout/sweep-paper-rows.sh [STREAM ...]
set -e
PY=${PYTHON:-python}
export ATEN_CPU_CAPABILITY=avx2
ROWS="$PY -u results/heldout/paper_rows.py --threads 1 --require-capability AVX2"
for S in ${@:-permuted-mnist rotated-mnist many-permutations}; do
  $ROWS --stream $S --stages report --rows emcl/si emcl/no-prox
  $ROWS --stream $S --stages validate report --rows emcl/inner-lr-modulation emcl/no-inner-reg
done
