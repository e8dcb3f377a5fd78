"""Run arrays: ``N`` runs of one method on one MLP stream trained together, as one task of the
sweep (``--array``).

The runs of one method in a stage of the held-out selection share the architecture and the
stream and differ in seed and numeric hyper-parameters: stacked, their weights make batched
matrix products (:mod:`.base`), and the per-call cost of a step (the dispatch of every small
op, the Python around it) is paid once for the array instead of once per run. Each run stays
itself: its own initial weights, data order and generator, the same draws as alone
(:mod:`.base`, the tests record them), a record of today's schema with the array's id and width
(:func:`.train.run_array`).

Which methods: :data:`ARRAY_LEARNERS`; a method without an array learner, or a configuration
its learner cannot serve (an EMCL variant off the fused path), is refused by name
(:func:`refusal`). Which runs can share an array: the same method, stream, split and data, and
the same configuration but for the method's :attr:`~.base.ArrayLearner.PER_RUN` keys and the
seed (:func:`array_signature`).
"""
from __future__ import annotations

import importlib
import json

__all__ = ["ARRAY_LEARNERS", "get_learner", "refusal", "array_signature", "supports_stream", "auto_width",
           "parse_array", "ALONE_RATE_CPU", "AUTO_WIDTH_CPU", "AUTO_WIDTH_GPU"]

ARRAY_LEARNERS = {
    "sgd": "emcl_continual.arrays.sgd:SGDArray",
    "ewc": "emcl_continual.arrays.ewc:EWCArray",
    "agem": "emcl_continual.arrays.agem:AGEMArray",
    "er": "emcl_continual.arrays.er:ERArray",
    "gem": "emcl_continual.arrays.gem:GEMArray",
    "lamaml": "emcl_continual.arrays.lamaml:LaMAMLArray",
    "mer": "emcl_continual.arrays.mer:MERArray",
    "emcl": "emcl_continual.arrays.emcl:EMCLArray",
}

#: the widest array ``--array auto`` makes of each method on the CPU: the width of the most
#: run-samples per second on the measured curves (results/arrays/throughput_cpu.json, one thread,
#: the 2-core Xeon VM shared with other jobs; docs/continual-learning.md). Past it the runs'
#: weights leave the core's cache and the curve is flat or falls. GEM: 1 (its runs train alone):
#: the curve times the second task, where GEM has one past task; over the whole stream its array
#: is slower than its runs alone (the validation stage: 150 s for an array of 8 against 91 s for
#: the 8 runs alone; 4 runs: 83 CPU-s as one array against 51 alone, a third of it the kernel's
#: page faults on the past-task gradients, results/scale/README.md).
AUTO_WIDTH_CPU = {"sgd": 8, "ewc": 16, "agem": 4, "er": 32, "gem": 1, "lamaml": 16, "mer": 16, "emcl": 8}
#: the run alone's run-samples per second on the same curves: how long each method's units take
#: relative to the others, so that the executor starts the longest first
ALONE_RATE_CPU = {"sgd": 21900, "ewc": 8200, "agem": 8600, "er": 14400, "gem": 3800, "lamaml": 142, "mer": 174,
                  "emcl": 5920}
#: on a GPU the device is idle and a run is all launches: the width is bounded by memory only
AUTO_WIDTH_GPU = 32


def get_learner(method: str) -> type:
    """The array learner of ``method`` (ValueError naming the methods that have one)."""
    reason = refusal(method)
    if reason:
        raise ValueError(reason)
    module, _, attr = ARRAY_LEARNERS[method].partition(":")
    return getattr(importlib.import_module(module), attr)


def refusal(method: str, config: dict | None = None) -> str | None:
    """Why ``method`` (with ``config``, a checked configuration, when given) cannot train as an
    array, or None: no array learner, or a variant the learner does not serve
    (:meth:`~.base.ArrayLearner.refusal`, which names it)."""
    if method not in ARRAY_LEARNERS:
        return f"--array: {method} has no run array yet (arrays exist for {', '.join(ARRAY_LEARNERS)})"
    if config is not None:
        why = get_learner(method).refusal(config)
        if why:
            return f"--array: {method} with {why} has no run array"
    return None


def supports_stream(info) -> str | None:
    """Why the stream of ``info`` cannot train as arrays, or None: arrays stack the MLP, so the
    MLP streams (flat inputs, one head) only; the ResNet streams' batch norm keeps batch
    statistics per run that the stacked products do not have."""
    if len(tuple(info.input_shape)) != 1:
        return (f"--array: {info.name} trains the reduced ResNet-18 (batch norm); arrays stack the MLP of the "
                f"MNIST streams only")
    if info.multi_head:
        return f"--array: {info.name} is multi-head; arrays serve the single-head MLP streams only"
    return None


def array_signature(method: str, config: dict) -> str:
    """What runs of ``method`` must share to train in one array: the configuration without the
    seed and the learner's per-run keys."""
    per_run = set(get_learner(method).PER_RUN) | {"seed"}
    return json.dumps({k: v for k, v in sorted(config.items()) if k not in per_run}, sort_keys=True)


def parse_array(word) -> str | int:
    """``--array``'s word: ``off``, ``auto`` or a width >= 1 (``1`` is ``off``); ValueError otherwise."""
    w = str(word).strip().lower()
    if w in ("off", "auto"):
        return w
    if w.isdigit() and int(w) >= 1:
        return "off" if int(w) == 1 else int(w)
    raise ValueError(f"--array {word}: use auto, off or a width (a whole number >= 1)")


def auto_width(method: str, device: str) -> int:
    """The width ``--array auto`` gives ``method``'s arrays on ``device`` (1: no array)."""
    if refusal(method):
        return 1
    if str(device).startswith("cuda"):
        return AUTO_WIDTH_GPU
    return AUTO_WIDTH_CPU.get(method, 1)
