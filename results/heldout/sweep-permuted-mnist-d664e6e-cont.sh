#!/bin/bash
# permuted-mnist from step 2 on, at the pinned commit d664e6e (its La-MAML selection equals the
# own-script defaults, so the separate "lamaml" row would rerun the same configuration: left out)
set -e
PY=${PYTHON:-python}
SEL="$PY -u -m emcl_continual.selection --jobs ${JOBS:-2} --threads 1"
S=permuted-mnist
$SEL --stream $S --methods lamaml --stages report --rows lamaml/own-script
$SEL --stream $S --methods emcl --stages validate-b report --rows emcl/importance-best emcl/uniform-pull
$SEL --stream $S --methods emcl --stages report \
     --rows emcl/table-ii-beta emcl/no-inner-replay emcl/recurrent emcl/decay=0.5 emcl/lr_scale=0.5/reg
$SEL --stream $S --methods sgd ewc agem er --stages validate-a report --rows sgd ewc agem er
$SEL --stream $S --methods gem --stages validate-a report --rows gem
$SEL --stream $S --methods mer --stages validate-a report --rows mer
$SEL --stream $S --methods emcl lamaml --stages report \
     --rows lamaml/glances=1 emcl/glances=2 emcl/glances=5 emcl/init=xavier
