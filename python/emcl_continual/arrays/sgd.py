"""Fine-tuning as an array: one SGD step per incoming batch per run (:mod:`..methods.sgd`)."""
from __future__ import annotations

from ..methods.sgd import FineTune
from .base import ArrayLearner, sgd_


class SGDArray(ArrayLearner):
    """``N`` fine-tuning runs; ``lr`` per run."""

    method = FineTune
    PER_RUN = ("lr",)

    def observe(self, x, y, task):
        loss, grads = self.loss_grads(x, y)
        sgd_(self.weights, grads, self.hyper("lr"), self.floats("lr"))
        return loss
