"""Fine-tuning: plain SGD on the incoming batches, no memory (the lower bound).

Hyper-parameters: the EMCL paper lists none for fine-tuning. For the MNIST streams the
learning rate is 0.03, the value the paper's Table II gives its other SGD baselines (EWC,
GEM, A-GEM) on CIFAR100/miniImageNet and the batch-size-10 counterpart of the MER code's
``online`` baseline (lr 0.003 at batch size 1, ``mer_examples.sh``); 0.03 for the two image
streams (Table II). Rotated MNIST takes the MNIST Permutations values (here and in every baseline:
the paper has no rotation stream). The reported runs use the lr chosen on validation
(:mod:`emcl_continual.sweep.selection`).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..core.schema import float_rule
from .base import Method

_DEFAULTS = {
    "permuted-mnist": {"lr": 0.03},
    "rotated-mnist": {"lr": 0.03},
    "many-permutations": {"lr": 0.03},
    "split-cifar100": {"lr": 0.03},
    "split-miniimagenet": {"lr": 0.03},
}


class FineTune(Method):
    """One SGD step per incoming batch on its cross-entropy loss."""

    name = "sgd"
    DEFAULTS = _DEFAULTS
    RULES = {"lr": float_rule(open_=True)}

    def observe(self, x: Tensor, y: Tensor, task: int) -> float:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x, task), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())
