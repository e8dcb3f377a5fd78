"""The paper's stream-level settings (section V: memory sizes, batch size), the selection
protocol (validation and report seeds, the grid each method is tuned over) and EMCL's named
variants, as plain data.

Each method declares its own hyper-parameters, Table II's among them, in its file
(``methods/<name>.py``: ``DEFAULTS``, ``TABLE_II``); :mod:`emcl_continual.sweep.selection` runs the
protocol.
"""
from __future__ import annotations

__all__ = ["MEMORY", "BATCH_SIZE", "VALIDATION_SEEDS",
           "REPORT_SEEDS", "GRIDS", "grid", "EMCL_VARIANTS", "ALGORITHM_1_GRID", "IMPORTANCE_SEARCH",
           "STREAM_NAMES", "ANYTIME", "ANYTIME_SUBSET", "anytime_preset"]

STREAM_NAMES = ("permuted-mnist", "rotated-mnist", "many-permutations", "split-cifar100", "split-miniimagenet")

# Section V: replay buffer of 200, 500, 200, 200 samples; batch size 10 from the stream.
# Rotated MNIST (not in the paper): 200, the memory of La-MAML's rotation runs.
MEMORY = {"permuted-mnist": 200, "rotated-mnist": 200, "many-permutations": 500, "split-cifar100": 200,
          "split-miniimagenet": 200}
BATCH_SIZE = 10

# --------------------------------------------------------------------------- anytime evaluation
# Images per task of the fixed evaluation subset (emcl_continual.training.anytime) when nothing else is said.
ANYTIME_SUBSET = 200
# The streams where evaluation during the stream is cheap next to training (an MLP's forward pass on
# a few hundred images per seen task): evaluate every `every` incoming samples on `subset` images of
# each seen task. Permuted / Rotated MNIST: 20 points per 1,000-sample task, 200 of the 1,000
# evaluation images (about as many forward passes as the end-of-task evaluation of every task).
# Many Permutations: 10 points per 200-sample task and 100 images, since up to 100 tasks are seen.
# The CIFAR-100 / miniImageNet ResNets are left out: there the same record would cost as much as training.
ANYTIME = {
    "permuted-mnist": {"every": 50, "subset": 200},
    "rotated-mnist": {"every": 50, "subset": 200},
    "many-permutations": {"every": 20, "subset": 100},
}


def anytime_preset(stream: str) -> dict:
    """``{"every", "subset"}`` of :data:`ANYTIME` for ``stream`` (a copy); ``ValueError`` for a stream
    with none."""
    if stream not in ANYTIME:
        raise ValueError(f"no anytime-evaluation preset for stream {stream!r} (presets: {', '.join(ANYTIME)}); "
                         f"give the number of samples, e.g. --eval-every 50")
    return dict(ANYTIME[stream])


# --------------------------------------------------------------------------- selection protocol
# Hyper-parameters are chosen on VALIDATION_SEEDS with the validation split (images held out of
# the training set); reported numbers come from REPORT_SEEDS with the test split. No seed is in
# both, and no choice ever looks at a test image.
VALIDATION_SEEDS = (100, 101)
REPORT_SEEDS = (10, 11, 12, 13, 14)

# The same budget for every method: 4 configurations, each a change of the method's defaults,
# over the hyper-parameters "related to the learning rate" (the paper's grid search, section V).
# Each method keeps its source's number of visits per incoming batch (EMCL: Algorithm 1's one;
# La-MAML: its script's 5 / 10); equal-visit rows are reported beside (selection.py).
_LR4 = [{"lr": v} for v in (0.01, 0.03, 0.1, 0.3)]
_MNIST_GRIDS = {
    "sgd": _LR4,
    "ewc": [{"lr": lr, "reg": reg} for lr in (0.03, 0.1) for reg in (1.0, 10.0)],
    "agem": _LR4,
    "er": _LR4,
    "gem": _LR4,
    "mer": [{"lr": 0.01, "beta": 0.03}, {"lr": 0.03, "beta": 0.03}, {"lr": 0.1, "beta": 0.03},
            {"lr": 0.03, "beta": 0.1}],
    "lamaml": [{"alpha_init": 0.15, "eta": 0.3}, {"alpha_init": 0.3, "eta": 0.15}, {"alpha_init": 0.1, "eta": 0.1},
               {"alpha_init": 0.3, "eta": 0.3}],
    "emcl": [{"inner_lr": v} for v in (0.01, 0.03, 0.1, 0.15)],
}
GRIDS = {
    "permuted-mnist": _MNIST_GRIDS,
    "rotated-mnist": _MNIST_GRIDS,
    "many-permutations": dict(_MNIST_GRIDS,
                              ewc=[{"lr": lr, "reg": reg} for lr in (0.03, 0.1) for reg in (0.1, 1.0)],
                              lamaml=[{"alpha_init": 0.1, "eta": 0.1}, {"alpha_init": 0.15, "eta": 0.3},
                                      {"alpha_init": 0.03, "eta": 0.1}, {"alpha_init": 0.3, "eta": 0.3}],
                              emcl=[{"inner_lr": v} for v in (0.01, 0.03, 0.1, 0.15)]),
}


def grid(method: str, stream: str) -> list:
    """The configurations ``method`` is tuned over on ``stream`` (copies)."""
    if stream not in GRIDS:
        raise ValueError(f"no selection grid for stream {stream!r}; grids exist for {', '.join(GRIDS)}")
    if method not in GRIDS[stream]:
        raise ValueError(f"no selection grid for method {method!r}; grids exist for {', '.join(GRIDS[stream])}")
    return [dict(c) for c in GRIDS[stream][method]]


# --------------------------------------------------------------------------- EMCL's named variants
# Each is a change of EMCL's (selected) configuration: the controls and ablations of docs/results.md's
# "Deviations from the paper". "lr_scale_times_inv_reg" is turned into lr_scale = value / reg.
EMCL_VARIANTS = {
    "importance-off": {
        "what": "h held at a constant 1e-4 in every element (decay 1), no prox: Reptile over one-sample SGD steps",
        "overrides": {"fixed_importance": 1e-4, "decay": 1.0, "prox": False}},
    "no-replay": {
        "what": "no replay memory: inner loop and meta-loss on the incoming batch only",
        "overrides": {"memory": 0, "replay": 0}},
    "no-inner-replay": {
        "what": "replayed samples in the meta-loss only, not in the inner loop",
        "overrides": {"inner_replay": False}},
    "algorithm-1": {
        "what": "Algorithm 1 as written: Table II's beta, inner loop over the batch only, no replay, one glance, "
                "eq. 8's recurrent meta learning rate",
        "overrides": {"inner_lr": 0.15, "memory": 0, "replay": 0, "glances": 1, "lr_mode": "recurrent"}},
    "table-ii-beta": {
        "what": "Table II's inner learning rate beta = 0.15, everything else as selected",
        "overrides": {"inner_lr": 0.15}},
    "decay=0.5": {"what": "importance decay eta = 0.5", "overrides": {"decay": 0.5}},
    "lr_scale=0.5/reg": {"what": "meta-step scale r = 0.5/lambda", "overrides": {"lr_scale_times_inv_reg": 0.5}},
    "glances=2": {"what": "each incoming batch visited twice", "overrides": {"glances": 2}},
    "glances=5": {"what": "each incoming batch visited 5 times (La-MAML's budget)", "overrides": {"glances": 5}},
    "init=xavier": {"what": "Xavier-uniform weights, zero biases (GEM/MER's MLP init)", "overrides": {"init": "xavier"}},
}

# Algorithm 1 as written needs the two numbers eq. 8 leaves open (the scale r and the clip of
# alpha: without a clip, alpha <- alpha * r / h compounds to overflow); chosen on validation with
# the same budget of 4 as every method.
ALGORITHM_1_GRID = [{"lr_scale": r, "lr_max": m} for r in (1e-5, 1e-4) for m in (1e2, 1e3)]

# Making the importance act: the inner pull normalised by the mean importance,
# c = gamma * reg * h / mean(h), globally or per tensor, for three pull strengths gamma * reg of an
# element of average importance (0.001, 0.01, 0.1 with reg = 10). Judged on validation against
# the importance-off variant; the winner is reported beside importance-off and beside the same
# pull with h held constant (uniform pull: what the pull does without the importance).
IMPORTANCE_SEARCH = [{"importance_norm": norm, "gamma": g} for norm in ("global", "tensor")
                     for g in (1e-4, 1e-3, 1e-2)]
