#!/bin/bash
# The held-out sweeps in order of importance, each step resumable (finished runs are skipped).
# Run from a clean checkout of the sweep commit (results/heldout/README.md says which and how):
#   PYTHONPATH=$PWD:$PWD/python nice -n 10 bash results/heldout/sweep.sh [STREAM ...]
# Two training processes at a time, one torch thread each.
set -e
PY=${PYTHON:-python}
SEL="$PY -u -m emcl_continual.selection --jobs ${JOBS:-2} --threads 1"
for S in ${@:-permuted-mnist rotated-mnist many-permutations}; do
  # 1. EMCL: its grid and Algorithm 1's cells on validation; the controls on the report seeds
  $SEL --stream $S --methods emcl --stages validate-a report \
       --rows emcl emcl/importance-off emcl/no-replay emcl/algorithm-1
  # 2. La-MAML: its grid on validation; its own script's values (headline) and the selected one
  $SEL --stream $S --methods lamaml --stages validate-a report --rows lamaml/own-script lamaml
  # 3. making the importance act: the search on validation, then the chosen pull and the uniform pull
  $SEL --stream $S --methods emcl --stages validate-b report --rows emcl/importance-best emcl/uniform-pull
  # 4. EMCL's ablations that undo one deviation each
  $SEL --stream $S --methods emcl --stages report \
       --rows emcl/table-ii-beta emcl/no-inner-replay emcl/recurrent emcl/decay=0.5 emcl/lr_scale=0.5/reg
  # 5. the baselines, cheapest first
  $SEL --stream $S --methods sgd ewc agem er --stages validate-a report --rows sgd ewc agem er
  $SEL --stream $S --methods gem --stages validate-a report --rows gem
  $SEL --stream $S --methods mer --stages validate-a report --rows mer
  # 6. equal visits per batch, and the init of GEM/MER
  $SEL --stream $S --methods emcl lamaml --stages report \
       --rows lamaml/glances=1 emcl/glances=2 emcl/glances=5 emcl/init=xavier
done
