"""Task streams of the paper (Table I, section V): single pass, task identity given.

``make_stream(name, seed, ...)`` builds a :class:`Stream`, a list of training tasks and
one test set per task. Everything (the embedded MNIST split, the permutations, the
samples drawn for each task, their order within the task) follows from ``seed``.

| stream | tasks x samples | classes | input | head |
|---|---|---|---|---|
| ``permuted-mnist`` | 20 x 1000 | 10 | 784 | single |
| ``many-permutations`` | 100 x 200 | 10 | 784 | single |
| ``split-cifar100`` | 20 x 2500 | 5 per task | 3x32x32 | multi |
| ``split-miniimagenet`` | 20 x 2500 | 5 per task | 3x84x84 | multi |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from . import data as _data

__all__ = ["StreamInfo", "TaskData", "Stream", "STREAMS", "make_stream", "stream_from_tasks"]


@dataclass
class StreamInfo:
    """What a model and a method need to know about a stream."""

    name: str
    n_tasks: int
    input_shape: tuple
    n_classes: int
    task_classes: list  # list[tuple[int, int]]: [start, end) of each task's classes
    multi_head: bool
    source: str = ""  # where the data came from, for the results


@dataclass
class TaskData:
    """One task's samples: ``x`` (n, *input_shape) float32, ``y`` (n,) int64."""

    x: torch.Tensor
    y: torch.Tensor
    task: int

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Stream:
    """A sequence of tasks with a test set per task."""

    info: StreamInfo
    train: list
    test: list
    seed: int = 0
    meta: dict = field(default_factory=dict)

    def batches(self, task: int, batch_size: int = 10, device: torch.device | str | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield task ``task``'s training samples once, ``batch_size`` at a time, in the stream's
        fixed order (shuffled once from the seed when the stream was built).

        ``device``: the task's samples are copied there once, before the first batch, and the
        batches are slices of that copy (on a GPU: one transfer per task, none per batch).
        """
        if not 0 <= task < len(self.train):
            raise IndexError(f"task {task} is outside [0, {len(self.train)})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        td = self.train[task]
        x, y = td.x, td.y
        if device is not None:
            x, y = x.to(device), y.to(device)
        for start in range(0, len(td), batch_size):
            yield x[start:start + batch_size], y[start:start + batch_size]

    def n_batches(self, batch_size: int = 10) -> int:
        return sum((len(t) + batch_size - 1) // batch_size for t in self.train)


# The paper's Table I.
STREAMS = {
    "permuted-mnist": dict(n_tasks=20, samples_per_task=1000, classes_per_task=10, kind="permutations"),
    "many-permutations": dict(n_tasks=100, samples_per_task=200, classes_per_task=10, kind="permutations"),
    "split-cifar100": dict(n_tasks=20, samples_per_task=2500, classes_per_task=5, kind="split"),
    "split-miniimagenet": dict(n_tasks=20, samples_per_task=2500, classes_per_task=5, kind="split"),
}

# Test images per task of a permutation stream (the same base images, permuted per task):
# the whole held-out split of the embedded digits (1,000), a seeded subset of full MNIST's 10,000.
PERMUTATION_TEST_CAP = 2000


def _check_name(name: str) -> dict:
    if name not in STREAMS:
        raise ValueError(f"unknown stream {name!r}; choose one of {', '.join(STREAMS)}")
    return STREAMS[name]


def _shuffled(x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(len(y), generator=g)
    return x[order].contiguous(), y[order].contiguous()


def _embedded_split(g: torch.Generator) -> tuple[_data.ImageSet, _data.ImageSet]:
    """Shuffle the embedded 5,000 digits and hold out 100 per class (1,000) as the test split."""
    full = _data.load_embedded_mnist()
    train_idx, test_idx = [], []
    for c in range(10):
        idx = torch.nonzero(full.y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        test_idx.append(idx[:100])
        train_idx.append(idx[100:])
    tr = torch.cat(train_idx)
    te = torch.cat(test_idx)
    src = full.source + ": 4,000 training / 1,000 test images"
    return (_data.ImageSet(full.x[tr], full.y[tr], src), _data.ImageSet(full.x[te], full.y[te], src))


def _permutation_stream(name: str, spec: dict, n_tasks: int, per_task: int, g: torch.Generator,
                        data_root: str | None, seed: int) -> Stream:
    if data_root is None:
        train, test = _embedded_split(g)
        source = train.source
    else:
        train, test = _data.load_mnist(data_root, "train"), _data.load_mnist(data_root, "test")
        source = f"MNIST from {data_root} ({len(train.y)} training / {len(test.y)} test images)"
    if per_task > len(train.y):
        raise ValueError(f"{name}: {per_task} samples per task asked, the training pool has {len(train.y)}")
    n_test = min(len(test.y), PERMUTATION_TEST_CAP)
    test_idx = torch.randperm(len(test.y), generator=g)[:n_test]
    test_x, test_y = test.x[test_idx], test.y[test_idx]
    tr_tasks, te_tasks = [], []
    for t in range(n_tasks):
        perm = torch.randperm(784, generator=g)
        idx = torch.randperm(len(train.y), generator=g)[:per_task]
        tr_tasks.append(TaskData(train.x[idx][:, perm].contiguous(), train.y[idx].clone(), t))
        te_tasks.append(TaskData(test_x[:, perm].contiguous(), test_y.clone(), t))
    info = StreamInfo(name, n_tasks, (784,), 10, [(0, 10)] * n_tasks, False, source)
    return Stream(info, tr_tasks, te_tasks, seed)


def _split_stream(name: str, spec: dict, n_tasks: int, per_task: int, g: torch.Generator,
                  per_class_train: list, per_class_test: list, source: str, seed: int,
                  input_shape: tuple) -> Stream:
    cpt = spec["classes_per_task"]
    if n_tasks * cpt > len(per_class_train):
        raise ValueError(f"{name}: {n_tasks} tasks x {cpt} classes need {n_tasks * cpt} classes, "
                         f"the data has {len(per_class_train)}")
    tr_tasks, te_tasks = [], []
    for t in range(n_tasks):
        classes = range(t * cpt, (t + 1) * cpt)
        xs = torch.cat([per_class_train[c] for c in classes])
        ys = torch.cat([torch.full((len(per_class_train[c]),), c, dtype=torch.long) for c in classes])
        x, y = _shuffled(xs, ys, g)
        tr_tasks.append(TaskData(x[:per_task].contiguous(), y[:per_task].contiguous(), t))
        xt = torch.cat([per_class_test[c] for c in classes])
        yt = torch.cat([torch.full((len(per_class_test[c]),), c, dtype=torch.long) for c in classes])
        te_tasks.append(TaskData(xt, yt, t))
    info = StreamInfo(name, n_tasks, input_shape, n_tasks * cpt,
                      [(t * cpt, (t + 1) * cpt) for t in range(n_tasks)], True, source)
    return Stream(info, tr_tasks, te_tasks, seed)


def make_stream(name: str, seed: int = 0, *, data_root: str | None = None, task_file: str | None = None,
                n_tasks: int | None = None, samples_per_task: int | None = None) -> Stream:
    """Build stream ``name`` (see :data:`STREAMS`) reproducibly from ``seed``.

    ``data_root``: where torchvision's MNIST / CIFAR-100 files or the miniImageNet
    pickles are (see :mod:`emcl_continual.data`); left out, the permutation streams
    use the embedded MNIST digits. ``task_file``: a GEM / La-MAML ``.pt`` file instead.
    ``n_tasks`` / ``samples_per_task`` shrink the stream (for quick runs and tests).
    """
    spec = _check_name(name)
    n_tasks = spec["n_tasks"] if n_tasks is None else int(n_tasks)
    per_task = spec["samples_per_task"] if samples_per_task is None else int(samples_per_task)
    if n_tasks < 1 or per_task < 1:
        raise ValueError(f"n_tasks and samples_per_task must be >= 1, got {n_tasks} and {per_task}")
    g = torch.Generator().manual_seed(int(seed))
    if task_file is not None:
        train, test = _data.load_task_file(task_file)
        return stream_from_tasks(name, train, test, seed, n_tasks=n_tasks, samples_per_task=per_task,
                                 source=f"task file {task_file}")
    if spec["kind"] == "permutations":
        return _permutation_stream(name, spec, n_tasks, per_task, g, data_root, seed)
    if data_root is None:
        raise _data.DataFileError(
            f"stream {name!r} needs its data set on disk: pass --data-root DIR "
            + ("with DIR/cifar-100-python/{train,test}" if name == "split-cifar100"
               else "with DIR/miniimagenet/mini-imagenet-cache-{train,val,test}.pkl")
            + " (or --task-file FILE.pt)")
    if name == "split-cifar100":
        tr, te = _data.load_cifar100(data_root, "train"), _data.load_cifar100(data_root, "test")
        ptr = [tr.x[tr.y == c] for c in range(100)]
        pte = [te.x[te.y == c] for c in range(100)]
        source = f"CIFAR-100 from {data_root}"
        return _split_stream(name, spec, n_tasks, per_task, g, ptr, pte, source, seed, (3, 32, 32))
    # split-miniimagenet: each class's images split 5:1 into train / test (500 / 100 of 600)
    per_class, _names = _data.load_miniimagenet(data_root)
    ptr, pte = [], []
    for imgs in per_class:
        x = torch.from_numpy(np.ascontiguousarray(imgs)).permute(0, 3, 1, 2).float().div_(255.0)
        x = x[torch.randperm(len(x), generator=g)]
        n_train = max(1, (len(x) * 5) // 6)
        ptr.append(x[:n_train])
        pte.append(x[n_train:])
    source = f"miniImageNet from {data_root} ({len(per_class)} classes)"
    return _split_stream(name, spec, n_tasks, per_task, g, ptr, pte, source, seed, (3, 84, 84))


def stream_from_tasks(name: str, train: list, test: list, seed: int = 0, *, n_tasks: int | None = None,
                      samples_per_task: int | None = None, source: str = "task file") -> Stream:
    """A stream from ready-made task lists (``[(x, y), ...]``, as a GEM / La-MAML file holds).

    Each training task is subsampled to ``samples_per_task`` (seeded) and shuffled.
    Permutation streams expect 784 features; split streams 3x32x32 or 3x84x84 images
    with each task's labels a contiguous block of classes.
    """
    spec = _check_name(name)
    g = torch.Generator().manual_seed(int(seed))
    n_tasks = len(train) if n_tasks is None else min(int(n_tasks), len(train))
    feats = train[0][0][0].numel()
    if spec["kind"] == "permutations":
        if feats != 784:
            raise ValueError(f"{name}: task file samples have {feats} features, expected 784 (28x28)")
        shape = (784,)
    else:
        shapes = {3072: (3, 32, 32), 3 * 84 * 84: (3, 84, 84)}
        if feats not in shapes:
            raise ValueError(f"{name}: task file samples have {feats} features, expected 3072 or 21168")
        shape = shapes[feats]
    tr_tasks, te_tasks, classes = [], [], []
    for t in range(n_tasks):
        x, y = train[t]
        x, y = _shuffled(x.reshape(-1, *shape), y, g)
        if samples_per_task is not None:
            x, y = x[:samples_per_task].contiguous(), y[:samples_per_task].contiguous()
        tr_tasks.append(TaskData(x, y, t))
        xt, yt = test[t]
        te_tasks.append(TaskData(xt.reshape(-1, *shape).contiguous(), yt, t))
        both = torch.cat([y, yt])
        classes.append((int(both.min()), int(both.max()) + 1))
    n_classes = max(c[1] for c in classes)
    multi = spec["kind"] == "split"
    if not multi:
        classes = [(0, n_classes)] * n_tasks
    info = StreamInfo(name, n_tasks, shape, n_classes, classes, multi, source)
    return Stream(info, tr_tasks, te_tasks, seed)
