"""The interface every continual-learning method implements.

``train.py`` builds the model, creates the method with ``config`` = ``defaults(stream)``
updated by the user's overrides (plus ``seed``), then calls :meth:`Method.observe` once per
incoming batch. Methods own their optimizers and replay buffers.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..streams import StreamInfo

__all__ = ["Method"]


class Method:
    """A continual learner: sees each batch once, with its task id."""

    name: str = "method"

    @classmethod
    def defaults(cls, stream: str) -> dict:
        """Hyper-parameters for stream ``stream`` (the paper's Table II / section V)."""
        return {}

    def __init__(self, model: nn.Module, info: StreamInfo, config: dict, device: torch.device):
        self.model = model
        self.info = info
        self.config = dict(config)
        self.device = torch.device(device)

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: int) -> float:
        """Learn from one incoming batch of task ``task``; return its training loss."""
        raise NotImplementedError(f"{type(self).__name__} does not implement observe()")

    # helpers shared by the methods ---------------------------------------------------------
    def _generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded from ``config["seed"]`` (+ ``offset``), for replay sampling."""
        return torch.Generator().manual_seed(int(self.config.get("seed", 0)) * 1000003 + offset)
