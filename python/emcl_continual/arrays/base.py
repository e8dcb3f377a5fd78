"""What every array learner is built on: stacked MLP weights, per-run losses and steps, per-run
replay memories, and :class:`ArrayLearner`.

An array holds ``N`` runs of one method on one MLP stream. Every weight of the MLP is one
tensor with a leading dimension ``N`` (run ``r``'s ``nn.Linear`` weight is ``W[r]``), and an
incoming batch is ``x[N, B, 784]``, ``y[N, B]``: row ``r`` is the batch run ``r`` sees alone
(each run keeps its own stream, so runs of different seeds see different permutations). A
linear layer is one ``baddbmm`` over the array; the runs never mix, because every op works
within a run's slice and a loss is summed over runs only to be differentiated (the gradient of
``sum_r L_r`` with respect to run ``r``'s weights is that of ``L_r``).

[note: an array of one] With ``N == 1`` the helpers here run the ops the run alone runs
(``F.linear``, ``F.cross_entropy`` with its mean, ``param.add_(grad, alpha=-lr)``, ``torch.dot``,
``clip_grad_norm_``) on the run's slice, so an array of one gives the run's bits (the tests check
it); wider arrays run the batched ops, whose sums may round differently.

Randomness: run ``r`` has its own ``torch.Generator``, seeded as the method seeds its generator
alone (``seed * 1_000_003 + GENERATOR_OFFSET``), and every draw of the run (replay sampling,
reservoir slots, a method's own sampling) is made from it, in the order the run makes it alone.
The initial weights are the run's own model's, built after ``torch.manual_seed(seed)`` as
``train.run`` builds it; the data order is its stream's.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["stack_weights", "mlp_forward", "ce_per_run", "per_run_sum", "sgd_", "clip_per_run_", "run_view",
           "ArrayReservoir", "ArrayRing", "ArrayLearner"]


def stack_weights(models: Sequence[torch.nn.Module]) -> list:
    """An array's weights from its runs' own models: each parameter stacked over the runs (run
    first), a leaf that requires grad, in the models' parameter order."""
    with torch.no_grad():
        return [torch.stack([p.detach() for p in ps]).requires_grad_(True)
                for ps in zip(*[list(m.parameters()) for m in models])]


def run_view(t: Tensor, n: int) -> Tensor:
    """A per-run vector ``t[N]`` shaped to broadcast against a tensor of ``n`` dimensions whose
    first is the run."""
    return t.reshape(t.shape[0], *([1] * (n - 1)))


def mlp_forward(weights: Sequence[Tensor], x: Tensor) -> Tensor:
    """Logits ``[N, B, classes]`` of the ReLU MLP with stacked ``weights`` (weight, bias per
    layer, each with the run first) on ``x[N, B, ...]``: the ops of ``MLP.forward`` per run."""
    n = x.shape[0]
    h = x.reshape(n, x.shape[1], -1)
    layers = len(weights) // 2
    if n == 1:       # [note: an array of one]; views, not selects (a select's backward writes a whole zero tensor)
        h = h.reshape(h.shape[1:])
        for i in range(layers):
            h = F.linear(h, weights[2 * i].reshape(weights[2 * i].shape[1:]),
                         weights[2 * i + 1].reshape(weights[2 * i + 1].shape[1:]))
            if i < layers - 1:
                h = F.relu(h)
        return h.unsqueeze(0)
    for i in range(layers):
        h = torch.baddbmm(weights[2 * i + 1].unsqueeze(1), h, weights[2 * i].transpose(1, 2))
        if i < layers - 1:
            h = F.relu(h)
    return h


def ce_per_run(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of each run's batch: ``[N]`` from logits ``[N, B, C]`` and labels ``[N, B]``."""
    n, b, c = logits.shape
    if n == 1:
        return F.cross_entropy(logits.reshape(b, c), y.reshape(b)).reshape(1)
    return F.cross_entropy(logits.reshape(n * b, c), y.reshape(n * b), reduction="none").view(n, b).mean(1)


def per_run_sum(t: Tensor) -> Tensor:
    """The sum of each run's slice of ``t``: ``[N]``."""
    if t.shape[0] == 1:
        return t.sum().reshape(1)
    return t.reshape(t.shape[0], -1).sum(1)


def sgd_(weights: Sequence[Tensor], grads: Sequence[Tensor], lr: Tensor, lr_floats: Sequence[float]) -> None:
    """``w -= lr_r * g`` per run, in place (torch's SGD without momentum: ``add_(g, alpha=-lr)``).
    ``lr``: the per-run rates as a tensor ``[N]``; ``lr_floats`` the same as numbers."""
    with torch.no_grad():
        if len(lr_floats) == 1:
            for w, g in zip(weights, grads):
                w.add_(g, alpha=-lr_floats[0])
            return
        neg = -lr
        for w, g in zip(weights, grads):
            w.addcmul_(g, run_view(neg, w.dim()))


def clip_per_run_(grads: Sequence[Tensor], max_norm: Tensor, max_floats: Sequence[float]) -> None:
    """``torch.nn.utils.clip_grad_norm_`` per run: each run's gradients (its slices of ``grads``)
    scaled by ``min(1, max_norm / (norm + 1e-6))``, the norm over all of that run's slices."""
    n = grads[0].shape[0]
    if n == 1:
        torch.nn.utils.clip_grad_norm_([g[0] for g in grads], max_floats[0])
        return
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), 2, dim=1) for g in grads], dim=1)
    total = torch.linalg.vector_norm(norms, 2, dim=1)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(run_view(coef, g.dim()))


class ArrayReservoir:
    """The reservoir memory (:class:`~emcl_continual.methods.replay.ReservoirBuffer`) of every run of an
    array, stored together (``x[N, capacity, ...]``) and drawn per run from that run's generator,
    with the draws of the buffer alone: while it fills, sample ``i`` goes to slot ``i`` (every
    run alike); then each run draws its slot ``randint(0, seen + 1)`` per sample; ``sample(k)``
    is each run's ``randperm(size)[:k]``. All runs have seen the same number of samples, so the
    sizes agree."""

    def __init__(self, capacity: int, input_shape: tuple, generators: list, device, dtype=torch.float32):
        if int(capacity) < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.generators = list(generators)
        n = len(self.generators)
        self.x = torch.zeros((n, self.capacity, *self.input_shape), dtype=dtype, device=device)
        self.y = torch.zeros((n, self.capacity), dtype=torch.long, device=device)
        self.n_seen = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def keep(self, idx: list) -> None:
        """Keep only the runs ``idx`` (in that order)."""
        sel = torch.tensor(idx, dtype=torch.long, device=self.x.device)
        self.x, self.y = self.x[sel], self.y[sel]
        self.generators = [self.generators[i] for i in idx]

    def add(self, x: Tensor, y: Tensor) -> None:
        """Offer each sample of every run's batch (``x[N, B, ...]``, ``y[N, B]``)."""
        n, b = y.shape
        xs = x.reshape(n, b, *self.input_shape)
        rows, slots, cols = [], [], []
        for i in range(b):
            if self._size < self.capacity:
                self.x[:, self._size] = xs[:, i]
                self.y[:, self._size] = y[:, i]
                self._size += 1
            else:
                for r, g in enumerate(self.generators):
                    j = int(torch.randint(0, self.n_seen + 1, (1,), generator=g))
                    if j < self.capacity:
                        rows.append(r)
                        slots.append(j)
                        cols.append(i)
            self.n_seen += 1
        if rows:
            last = {}
            for r, j, i in zip(rows, slots, cols):    # a slot drawn twice keeps the later sample
                last[(r, j)] = i
            r_t = torch.tensor([k[0] for k in last], dtype=torch.long, device=self.x.device)
            j_t = torch.tensor([k[1] for k in last], dtype=torch.long, device=self.x.device)
            i_t = torch.tensor(list(last.values()), dtype=torch.long, device=self.x.device)
            self.x[r_t, j_t] = xs[r_t, i_t]
            self.y[r_t, j_t] = y[r_t, i_t]

    def sample_indices(self, k: int) -> Tensor:
        """Each run's ``randperm(size)[:k]`` from its generator: ``[N, min(k, size)]`` (CPU)."""
        m = min(int(k), self._size)
        return torch.stack([torch.randperm(self._size, generator=g)[:m] for g in self.generators])

    def sample(self, k: int) -> tuple[Tensor, Tensor]:
        """``min(k, len(self))`` distinct stored samples per run: ``x[N, m, ...]``, ``y[N, m]``."""
        idx = self.sample_indices(k).to(self.x.device)
        rows = torch.arange(idx.shape[0], device=self.x.device).unsqueeze(1)
        return self.x[rows, idx], self.y[rows, idx]


class ArrayRing:
    """GEM's per-task ring memory (:class:`~emcl_continual.methods._utils.TaskRingMemory`) of
    every run of an array: no draws (the newest ``per_task`` samples of each task), so one
    pointer and count per task serve every run."""

    def __init__(self, per_task: int, input_shape: tuple, n: int, device):
        if per_task < 1:
            raise ValueError(f"per-task memory must hold at least one sample, got {per_task}")
        self.per_task, self.input_shape, self.n, self.device = int(per_task), tuple(input_shape), n, device
        self._x: dict = {}
        self._y: dict = {}
        self._count: dict = {}
        self._ptr: dict = {}

    def keep(self, idx: list) -> None:
        """Keep only the runs ``idx``."""
        sel = torch.tensor(idx, dtype=torch.long, device=self.device)
        for k in self._x:
            self._x[k], self._y[k] = self._x[k][sel], self._y[k][sel]
        self.n = len(idx)

    def add(self, x: Tensor, y: Tensor, task: int) -> None:
        """Write every run's batch into task ``task``'s ring (the oldest entries are overwritten)."""
        if task not in self._x:
            self._x[task] = torch.zeros((self.n, self.per_task, *self.input_shape), dtype=x.dtype, device=self.device)
            self._y[task] = torch.zeros((self.n, self.per_task), dtype=torch.long, device=self.device)
            self._count[task] = 0
            self._ptr[task] = 0
        xs = x.reshape(x.shape[0], x.shape[1], *self.input_shape)
        for i in range(x.shape[1]):
            p = self._ptr[task]
            self._x[task][:, p] = xs[:, i]
            self._y[task][:, p] = y[:, i]
            self._ptr[task] = (p + 1) % self.per_task
            self._count[task] = min(self._count[task] + 1, self.per_task)

    def tasks(self) -> list:
        """Task ids with stored samples, in insertion order."""
        return list(self._x)

    def get(self, task: int) -> tuple[Tensor, Tensor]:
        """The stored ``(x[N, n, ...], y[N, n])`` of one task."""
        n = self._count[task]
        return self._x[task][:, :n], self._y[task][:, :n]


class ArrayLearner:
    """``N`` runs of one method trained together (the array counterpart of
    :class:`~emcl_continual.methods.base.Method`).

    ``weights``: the stacked MLP weights (leaf tensors, run first); ``configs``: each run's
    checked configuration (seed included). Keys in :attr:`PER_RUN` may differ between the
    runs (numeric hyper-parameters, held as tensors ``[N]`` by :meth:`hyper`); every other key
    must be the same in every run (:func:`emcl_continual.arrays.array_signature`).

    ``observe(x, y, task)`` returns each run's loss as a tensor ``[N]``; :meth:`keep` drops
    runs (a run that diverged) from every per-run state: subclasses list theirs in
    :attr:`per_run` (names of tensors or lists with the run first)."""

    method: type = None          # the Method class this learner is the array of
    PER_RUN: tuple = ("lr",)

    @classmethod
    def refusal(cls, config: dict) -> str | None:
        """Why a run of ``config`` cannot train in this array (the variant, named), or None; the
        selection and the main command ask it before they make arrays."""
        return None

    def __init__(self, weights: list, info, configs: list, device):
        self.weights = weights
        self.info = info
        self.configs = list(configs)
        self.device = torch.device(device)
        self.generators = [torch.Generator().manual_seed(int(c.get("seed", 0)) * 1_000_003
                                                         + self.method.GENERATOR_OFFSET) for c in self.configs]
        self.per_run = ["configs", "generators"]
        self._hyper: dict = {}

    @property
    def width(self) -> int:
        """Runs in the array now."""
        return len(self.configs)

    def hyper(self, key: str) -> Tensor:
        """Each run's ``config[key]`` as a float32 tensor ``[N]`` on the device."""
        if key not in self._hyper:
            self._hyper[key] = torch.tensor([float(c[key]) for c in self.configs], dtype=torch.float32,
                                            device=self.device)
        return self._hyper[key]

    def floats(self, key: str) -> list:
        """Each run's ``config[key]`` as a number."""
        return [float(c[key]) for c in self.configs]

    def keep(self, idx: list) -> None:
        """Keep only the runs ``idx`` (ascending), in every per-run state."""
        n_old = len(self.configs)
        sel = torch.tensor(idx, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.weights = [w[sel].detach().requires_grad_(w.requires_grad) for w in self.weights]
        for name in self.per_run:
            value = getattr(self, name)
            if isinstance(value, Tensor):
                setattr(self, name, value[sel].detach().requires_grad_(value.requires_grad))
            elif isinstance(value, (ArrayReservoir, ArrayRing)):
                value.keep(idx)
            elif isinstance(value, list) and value and isinstance(value[0], Tensor) and value[0].dim() > 0 \
                    and value[0].shape[0] == n_old:
                setattr(self, name, [v[sel].detach().requires_grad_(v.requires_grad) for v in value])
            elif isinstance(value, list):
                setattr(self, name, [value[i] for i in idx])
        self._hyper.clear()

    def begin_task(self, task: int) -> None:
        """Called before the first batch of task ``task``."""

    def end_task(self, task: int) -> None:
        """Called after the last batch of task ``task``, before it is evaluated."""

    def observe(self, x: Tensor, y: Tensor, task: int) -> Tensor:
        """Learn from one incoming batch per run; return each run's loss ``[N]``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement observe()")

    def loss_grads(self, x: Tensor, y: Tensor) -> tuple[Tensor, list]:
        """Each run's mean cross-entropy on its batch ``[N]`` and the gradients of the weights."""
        loss = ce_per_run(mlp_forward(self.weights, x), y)
        grads = torch.autograd.grad(loss.sum(), self.weights)
        return loss.detach(), list(grads)
