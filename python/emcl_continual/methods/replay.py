"""Reservoir replay buffer (Vitter's algorithm R over every sample ever seen)."""
from __future__ import annotations

import os

import torch

__all__ = ["ReservoirBuffer"]


class ReservoirBuffer:
    """Keeps a uniform random sample of at most ``capacity`` of all samples passed to :meth:`add`.

    ``generator`` (a CPU ``torch.Generator``) drives every random choice, so a seeded run
    is reproducible, and the same seed draws the same samples on every device. Samples are
    stored on ``device`` (CPU by default); on a GPU, adding and sampling never copy samples
    through the host (only the drawn row indices go up, without a sync).
    """

    def __init__(self, capacity: int, input_shape: tuple, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if int(capacity) < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        need = self.capacity * _bytes_per_sample(self.input_shape, dtype)
        have = device_memory(device)
        if have is not None and need > have:
            # refused before allocating: where memory is overcommitted, the allocation of an
            # impossible buffer succeeds and zeroing it gets the process killed
            raise ValueError(_too_large(self.capacity, self.input_shape, dtype, device))
        try:
            self.x = torch.zeros((self.capacity, *self.input_shape), dtype=dtype, device=device)
            self.y = torch.zeros(self.capacity, dtype=torch.long, device=device)
            self.t = torch.zeros(self.capacity, dtype=torch.long, device=device)
        except (RuntimeError, OverflowError, ValueError) as exc:  # the allocator, or a size torch cannot take
            raise ValueError(_too_large(self.capacity, self.input_shape, dtype, device)) from exc
        self.n_seen = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, x: torch.Tensor, y: torch.Tensor, task) -> None:
        """Offer each sample of the batch ``(x, y)`` (from task ``task``, an int or per-sample tensor)."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{x.shape[0]} inputs but {y.shape[0]} labels")
        if tuple(x.shape[1:]) != self.input_shape and x[0].numel() != _numel(self.input_shape):
            raise ValueError(f"inputs of shape {tuple(x.shape[1:])} do not fit the buffer's {self.input_shape}")
        if isinstance(task, torch.Tensor):
            tasks = task.to(self.t.device)
        else:  # made where the buffer lives: a copy per sample from the host would sync a GPU
            tasks = torch.full((x.shape[0],), int(task), dtype=torch.long, device=self.t.device)
        for i in range(x.shape[0]):
            if self._size < self.capacity:
                j = self._size
                self._size += 1
            else:
                j = int(torch.randint(0, self.n_seen + 1, (1,), generator=self.generator))
            self.n_seen += 1
            if j < self.capacity:
                self.x[j] = x[i].reshape(self.input_shape)
                self.y[j] = y[i]
                self.t[j] = tasks[i]

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``min(n, len(self))`` distinct stored samples, uniformly at random: ``(x, y, task)``."""
        idx = self.to_device(self.sample_indices(n))
        return self.x[idx], self.y[idx], self.t[idx]

    def sample_indices(self, n: int) -> torch.Tensor:
        """The stored rows :meth:`sample` would return, as a CPU int64 tensor of
        ``min(n, len(self))`` distinct indices (the same draw from the generator)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        k = min(int(n), self._size)
        return torch.randperm(self._size, generator=self.generator)[:k]

    def to_device(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` (a CPU tensor) on the buffer's device. To a GPU it goes through pinned
        memory without a sync (a plain ``.to`` from pageable memory waits for the GPU's queue)."""
        if self.x.device.type == "cuda":
            return idx.pin_memory().to(self.x.device, non_blocking=True)
        return idx.to(self.x.device)

    def by_task(self) -> dict:
        """The stored samples grouped by task: ``{task: (x, y)}``."""
        out = {}
        t = self.t[:self._size]
        for task in torch.unique(t).tolist():
            sel = t == task
            out[int(task)] = (self.x[:self._size][sel], self.y[:self._size][sel])
        return out


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes_per_sample(input_shape: tuple, dtype: torch.dtype) -> int:
    return _numel(input_shape) * torch.empty((), dtype=dtype).element_size() + 16  # x, y and t


def device_memory(device) -> int | None:
    """All the memory of ``device`` in bytes (a GPU's, or the machine's RAM for the CPU), or
    None where it cannot be told."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError, RuntimeError, AssertionError):
        pass
    return None


def _too_large(capacity: int, input_shape: tuple, dtype: torch.dtype, device) -> str:
    """The error for a memory that cannot be allocated, in the user's terms."""
    need = capacity * _bytes_per_sample(input_shape, dtype)
    have = device_memory(device)
    has = f" (it has {have / 2**30:.3g} GiB)" if have is not None else ""
    return (f"a replay memory of {capacity} samples of shape {tuple(input_shape)} needs "
            f"{need / 2**30:.3g} GiB, which cannot be allocated on {device}{has}; "
            f"lower memory")
