"""Experience Replay with a reservoir buffer (Chaudhry et al. 2019, "On tiny episodic memories").

Per incoming batch: draw ``replay_batch`` samples from the reservoir buffer, take one SGD step
on the mean loss of the incoming batch joined with them, then add the incoming batch to the
buffer (reservoir sampling over every sample seen, so the buffer is a uniform sample of the
stream).

Hyper-parameters: not in the EMCL paper's tables (ER is not one of its rows). Memory is the
paper's section V size (200 / 500 / 200 / 200); lr 0.1 and the replay batch (10 for
permutations, 25 for many permutations) are the MER code's ER settings for those memories
(``mer_examples.sh``, ``eralg4``); 10 and lr 0.03 on the image streams (La-MAML's ER runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.schema import float_rule, int_rule
from ._utils import mixed_task_loss
from .base import Method
from .replay import ReservoirBuffer

_DEFAULTS = {
    "permuted-mnist": {"lr": 0.1, "memory": 200, "replay_batch": 10},
    "rotated-mnist": {"lr": 0.1, "memory": 200, "replay_batch": 10},
    "many-permutations": {"lr": 0.1, "memory": 500, "replay_batch": 25},
    "split-cifar100": {"lr": 0.03, "memory": 200, "replay_batch": 10},
    "split-miniimagenet": {"lr": 0.03, "memory": 200, "replay_batch": 10},
}


class ER(Method):
    """Reservoir experience replay."""

    name = "er"
    DEFAULTS = _DEFAULTS
    RULES = {"lr": float_rule(open_=True), "memory": int_rule(1), "replay_batch": int_rule(1)}

    def __init__(self, model: nn.Module, info, config: dict, device: torch.device):
        super().__init__(model, info, config, device)
        self.buffer = ReservoirBuffer(int(self.config["memory"]), tuple(info.input_shape), self.generator,
                                      device=device)  # on the model's device: no host round trips
        self.replay_batch = int(self.config["replay_batch"])

    def observe(self, x: Tensor, y: Tensor, task: int) -> float:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        if len(self.buffer) > 0:
            mx, my, mt = self.buffer.sample(self.replay_batch)
            bx = torch.cat((x, mx))
            by = torch.cat((y, my))
            bt = torch.cat((torch.full((x.shape[0],), task, dtype=torch.long, device=x.device), mt.long()))
            loss = mixed_task_loss(self.model, bx, by, bt, multi_head=self.info.multi_head)
        else:
            loss = F.cross_entropy(self.model(x, task), y)
        loss.backward()
        self.opt.step()
        self.buffer.add(x.detach(), y.detach(), task)
        return float(loss.detach())
