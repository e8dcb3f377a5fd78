"""The paper's networks, each called as ``model(x, task) -> logits`` over all classes.

* :class:`MLP`: 784-100-100-10 with ReLU (MNIST Permutations, Many Permutations; single head).
* :class:`ReducedResNet18`: ResNet-18 with three times fewer feature maps (``nf=20``), as in
  GEM's code, for 3x32x32 (Split CIFAR100) and 3x84x84 (Split miniImageNet) inputs.

On a multi-head stream the logits of classes outside the task's ``[start, end)`` are
filled with a large negative number, so ``F.cross_entropy(model(x, t), y)`` is the task
loss and ``argmax`` only picks the task's own classes. ``task`` may be an int or a
tensor of per-sample task ids (for replayed samples from several tasks).

``build_model(info, init=...)`` chooses the initialisation of the linear layers:

* ``"torch"`` (default): PyTorch's own ``nn.Linear`` init (Kaiming-uniform weights with
  a = sqrt(5), uniform biases in ±1/sqrt(fan_in)).
* ``"xavier"``: Xavier-uniform weights (gain 1, ±sqrt(6/(fan_in + fan_out))) and zero biases,
  GEM's ``model/common.py`` ``Xavier`` that the MER code reuses for the MNIST MLP.
* ``"kaiming"``: Kaiming-normal weights (fan_in, ReLU gain) and zero biases, La-MAML's
  ``model/meta/learner.py`` for its MNIST MLP (without ``--xav_init``).

The convolutions and batch norms of the ResNet keep PyTorch's init under every choice.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .streams import StreamInfo

__all__ = ["MLP", "ReducedResNet18", "TaskMasked", "build_model", "init_linear_", "INITS"]

MASK_VALUE = -1e9

INITS = ("torch", "xavier", "kaiming")


class TaskMasked(nn.Module):
    """Base class: holds the class mask per task and applies it to the logits."""

    def __init__(self, info: StreamInfo):
        super().__init__()
        self.multi_head = bool(info.multi_head)
        self.n_classes = int(info.n_classes)
        mask = torch.ones(info.n_tasks, info.n_classes, dtype=torch.bool)  # True = masked out
        for t, (lo, hi) in enumerate(info.task_classes):
            if not 0 <= lo < hi <= info.n_classes:
                raise ValueError(f"task {t} classes [{lo}, {hi}) are outside [0, {info.n_classes})")
            mask[t, lo:hi] = False
        self.register_buffer("task_mask", mask, persistent=False)

    def mask_logits(self, logits: torch.Tensor, task) -> torch.Tensor:
        if not self.multi_head:
            return logits
        if isinstance(task, torch.Tensor):
            m = self.task_mask[task.to(self.task_mask.device).long()]
        else:
            if not 0 <= int(task) < self.task_mask.shape[0]:
                raise IndexError(f"task {task} is outside [0, {self.task_mask.shape[0]})")
            m = self.task_mask[int(task)]
        fill = MASK_VALUE if logits.dtype in (torch.float32, torch.float64) else torch.finfo(logits.dtype).min
        return logits.masked_fill(m, fill)


class MLP(TaskMasked):
    """Fully connected network with two hidden layers of ``hidden`` ReLU units (paper: 100)."""

    def __init__(self, info: StreamInfo, hidden: int = 100):
        super().__init__(info)
        n_in = 1
        for d in info.input_shape:
            n_in *= int(d)
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, info.n_classes))
        self._n_weights = 2 * sum(isinstance(m, nn.Linear) for m in self.net)   # weight, bias

    def forward(self, x: torch.Tensor, task=0) -> torch.Tensor:
        return self.mask_logits(self.net(x.reshape(x.shape[0], -1)), task)

    def forward_with(self, weights, x: torch.Tensor, task=0) -> torch.Tensor:
        """:meth:`forward` with ``weights`` (a weight and a bias per layer, in
        ``parameters()`` order) in place of the parameters: the same ops on the same inputs, so
        the same logits and gradients, bit for bit, as ``torch.func.functional_call`` with
        those weights, without its swap of every parameter in and out of the module (which
        costs more than the MLP's arithmetic on one sample)."""
        if len(weights) != self._n_weights:
            raise ValueError(f"forward_with: {len(weights)} weights for an MLP with {self._n_weights}")
        h = x.reshape(x.shape[0], -1)
        i = 0
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                h = F.linear(h, weights[i], weights[i + 1])
                i += 2
            else:           # nn.ReLU, the only other layer of the net
                h = F.relu(h)
        return self.mask_logits(h, task)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ReducedResNet18(TaskMasked):
    """GEM's reduced ResNet-18: ``nf`` = 20 feature maps in the first stage (64 / 3.2),
    stages of nf, 2nf, 4nf, 8nf, two BasicBlocks each, 4x4 average pooling, a linear head.

    For 32x32 inputs the features are 8nf = 160; for 84x84 inputs the 11x11 last stage
    pools to 2x2, 640 features (the layout of the MIR / ER code bases for miniImageNet).
    """

    def __init__(self, info: StreamInfo, nf: int = 20):
        super().__init__(info)
        if len(info.input_shape) != 3:
            raise ValueError(f"ReducedResNet18 needs (C, H, W) inputs, got {info.input_shape}")
        c, h, w = (int(d) for d in info.input_shape)
        self.input_shape = (c, h, w)
        self.conv1 = nn.Conv2d(c, nf, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(nf)
        layers, in_planes = [], nf
        for i, stride in enumerate((1, 2, 2, 2)):
            planes = nf * 2 ** i
            layers.append(nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)))
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        with torch.no_grad():
            n_feat = self._features(torch.zeros(2, c, h, w)).shape[1]
        self.linear = nn.Linear(n_feat, info.n_classes)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.avg_pool2d(out, 4)
        return out.flatten(1)

    def forward(self, x: torch.Tensor, task=0) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.input_shape)
        return self.mask_logits(self.linear(self._features(x)), task)


@torch.no_grad()
def init_linear_(model: nn.Module, init: str) -> nn.Module:
    """Re-initialise every ``nn.Linear`` of ``model`` in place by ``init`` (see the module docstring)."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    if init == "torch":
        return model
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if init == "xavier":
                nn.init.xavier_uniform_(m.weight, gain=1.0)
            else:
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                m.bias.zero_()
    return model


def build_model(info: StreamInfo, init: str = "torch") -> nn.Module:
    """The paper's network for ``info``: the MLP for flat 784-feature inputs, the reduced
    ResNet-18 for images; its linear layers initialised by ``init`` (module docstring)."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    model = MLP(info) if len(info.input_shape) == 1 else ReducedResNet18(info)
    return init_linear_(model, init)
