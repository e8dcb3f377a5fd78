"""The paper's hyper-parameters per stream (Table II and section V), as plain data.

Methods read their defaults from here (``Method.defaults(stream)``); the CLI's
``--set key=value`` overrides any of them.
"""
from __future__ import annotations

__all__ = ["TABLE_II", "MEMORY", "BATCH_SIZE", "paper_values"]

STREAM_NAMES = ("permuted-mnist", "many-permutations", "split-cifar100", "split-miniimagenet")

# Section V: replay buffer of 200, 500, 200, 200 samples; batch size 10 from the stream.
MEMORY = {"permuted-mnist": 200, "many-permutations": 500, "split-cifar100": 200, "split-miniimagenet": 200}
BATCH_SIZE = 10

# Table II, per method and stream ("-" in the paper is left out).
TABLE_II = {
    "ewc": {"split-cifar100": {"lr": 0.03, "reg": 100.0}, "split-miniimagenet": {"lr": 0.03, "reg": 100.0}},
    "gem": {"split-cifar100": {"lr": 0.03, "memory": 200}, "split-miniimagenet": {"lr": 0.03, "memory": 200}},
    "agem": {"split-cifar100": {"lr": 0.03, "memory": 200}, "split-miniimagenet": {"lr": 0.03, "memory": 200}},
    "lamaml": {
        "permuted-mnist": {"alpha_init": 0.3, "eta": 0.15, "memory": 200},
        "many-permutations": {"alpha_init": 0.1, "eta": 0.1, "memory": 500},
        "split-cifar100": {"alpha_init": 0.1, "eta": 0.3, "memory": 200},
        "split-miniimagenet": {"alpha_init": 0.1, "eta": 0.3, "memory": 200},
    },
    "emcl": {
        "permuted-mnist": {"meta_lr": 0.3, "inner_lr": 0.15, "reg": 10.0, "gamma": 0.3},
        "many-permutations": {"meta_lr": 0.15, "inner_lr": 0.03, "reg": 10.0, "gamma": 0.1},
        "split-cifar100": {"meta_lr": 0.1, "inner_lr": 0.075, "reg": 50.0, "gamma": 0.1},
        "split-miniimagenet": {"meta_lr": 0.1, "inner_lr": 0.075, "reg": 50.0, "gamma": 0.1},
    },
}


def paper_values(method: str, stream: str) -> dict:
    """Table II's values for ``method`` on ``stream`` plus the paper's memory size (a copy)."""
    if stream not in MEMORY:
        raise ValueError(f"unknown stream {stream!r}; choose one of {', '.join(STREAM_NAMES)}")
    out = {"memory": MEMORY[stream]}
    out.update(TABLE_II.get(method, {}).get(stream, {}))
    return out
