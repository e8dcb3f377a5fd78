"""``--download`` through torchvision, against an HTTP server on 127.0.0.1 that serves small
files in the real formats: MNIST's gzipped IDX files, CIFAR-100's python ``tar.gz`` (the
``train``, ``test`` and ``meta`` pickles under ``cifar-100-python/``). No other network.

torchvision checks the MD5 of what it downloads; the official checksums cannot match files
written here, so the tests give :func:`emcl_continual.data.download.fetch` a
:class:`~emcl_continual.data.download.Source` with the local URL and these files' checksums (the
command-line tests put that source in place of torchvision's). The official checksums are
used where a test checks that a mismatch is refused.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import os
import pickle
import socket
import struct
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest
import torch

from emcl_continual.data import download, sources as data, streams
from emcl_continual.sweep import selection
from emcl_continual.core.errors import DownloadError
from cli_testing import TINY, run_cli
from emcl_testing import child_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


# --------------------------------------------------------------------------- files in the real formats
def _idx_gz(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0)  # the same bytes every call


def _mnist_files(n_train=60, n_test=30) -> tuple[dict, dict]:
    """{file name: bytes} as torchvision's mirrors serve them, and the arrays they hold."""
    rng = np.random.default_rng(11)
    files, arrays = {}, {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28)).astype(np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        files[f"{split}-images-idx3-ubyte.gz"] = _idx_gz(x)
        files[f"{split}-labels-idx1-ubyte.gz"] = _idx_gz(y)
        arrays[split] = (x, y)
    return files, arrays


def _cifar_files(per_class_train=6, per_class_test=2) -> tuple[dict, dict, dict]:
    """The bytes of ``cifar-100-python.tar.gz`` (a folder ``cifar-100-python`` with the python
    pickles ``train``, ``test`` and ``meta``, as on the CIFAR page), the pickles' own bytes, and
    the arrays."""
    rng = np.random.default_rng(12)
    members, arrays = {}, {}
    for split, k in (("train", per_class_train), ("test", per_class_test)):
        fine = np.repeat(np.arange(100), k)
        rng.shuffle(fine)
        pixels = rng.integers(0, 256, size=(len(fine), 3072)).astype(np.uint8)
        entry = {"filenames": [f"img_{i}.png" for i in range(len(fine))], "batch_label": f"{split} batch 1 of 1",
                 "fine_labels": fine.tolist(), "coarse_labels": (fine // 5).tolist(), "data": pixels}
        members[split] = pickle.dumps(entry, protocol=2)
        arrays[split] = (pixels, fine)
    members["meta"] = pickle.dumps({"fine_label_names": [f"class_{c}" for c in range(100)],
                                    "coarse_label_names": [f"super_{c}" for c in range(20)]}, protocol=2)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return {"cifar-100-python.tar.gz": buf.getvalue()}, members, arrays


def _md5(payload: bytes) -> str:
    return hashlib.md5(payload).hexdigest()


# --------------------------------------------------------------------------- the local server
class _Server:
    """A threaded HTTP server on 127.0.0.1 serving ``folder``; ``requests`` lists the paths asked for."""

    def __init__(self, folder):
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, fmt, *args):
                server.requests.append(self.path)

        handler = functools.partial(Handler, directory=str(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def no_proxy(monkeypatch):
    """urllib would send requests for 127.0.0.1 to a proxy named in the environment."""
    for var in _PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def mirror(tmp_path, no_proxy):
    """The local server with the MNIST and CIFAR-100 files in its folder."""
    folder = tmp_path / "www"
    folder.mkdir()
    mnist, mnist_arrays = _mnist_files()
    cifar, cifar_members, cifar_arrays = _cifar_files()
    for name, payload in {**mnist, **cifar}.items():
        (folder / name).write_bytes(payload)
    server = _Server(folder)
    server.sources = {
        "mnist": download.Source("mnist", (server.url,), {n: _md5(b) for n, b in mnist.items()}),
        "cifar100": download.Source("cifar100", (server.url,), {**{n: _md5(b) for n, b in cifar.items()},
                                                                **{n: _md5(b) for n, b in cifar_members.items()}}),
    }
    server.arrays = {"mnist": mnist_arrays, "cifar100": cifar_arrays}
    yield server
    server.close()


def _closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connection refused, as when offline)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


# --------------------------------------------------------------------------- fetch
def test_mnist_downloaded_into_torchvisions_layout_and_read_exactly(tmp_path, mirror):
    root = str(tmp_path / "data")
    lines = []
    assert download.fetch("mnist", root, mirror.sources["mnist"], log=lines.append) is True
    raw = os.path.join(root, "MNIST", "raw")
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        assert os.path.isfile(os.path.join(raw, name))
    assert {p.lstrip("/") for p in mirror.requests} == set(mirror.sources["mnist"].md5)
    assert lines[0] == f"downloading MNIST from {mirror.url.rstrip('/')}/ into {raw}"
    for split, tv_split in (("train", "train"), ("test", "t10k")):
        got = data.load_mnist(root, split)
        x, y = mirror.arrays["mnist"][tv_split]
        assert torch.equal(got.y, torch.from_numpy(y.astype(np.int64)))
        assert torch.equal(got.x, torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) / 255))
    s = streams.make_stream("permuted-mnist", 0, data_root=root, n_tasks=2, samples_per_task=20)
    assert [len(t) for t in s.train] == [20, 20] and "MNIST from" in s.info.source
    # there now: a second call asks the server for nothing
    before = len(mirror.requests)
    assert download.fetch("mnist", root, mirror.sources["mnist"]) is False
    assert len(mirror.requests) == before


def test_cifar100_tarball_unpacked_and_read_exactly(tmp_path, mirror):
    root = str(tmp_path / "data")
    assert download.fetch("cifar100", root, mirror.sources["cifar100"], log=lambda line: None) is True
    assert {p.lstrip("/") for p in mirror.requests} == {"cifar-100-python.tar.gz"}
    for split in ("train", "test"):
        got = data.load_cifar100(root, split)
        pixels, fine = mirror.arrays["cifar100"][split]
        assert got.y.tolist() == fine.tolist()
        assert torch.equal(got.x, torch.from_numpy(pixels.reshape(-1, 3, 32, 32).astype(np.float32) / 255))
    s = streams.make_stream("split-cifar100", 1, data_root=root, n_tasks=3)
    assert s.info.multi_head and [len(t) for t in s.test] == [10, 10, 10]
    before = len(mirror.requests)
    assert download.fetch("cifar100", root, mirror.sources["cifar100"]) is False
    assert len(mirror.requests) == before


def test_mnist_tries_the_next_mirror_when_one_is_down(tmp_path, mirror):
    src = mirror.sources["mnist"]
    both = download.Source("mnist", (_closed_port_url(), mirror.url), src.md5)
    assert download.fetch("mnist", str(tmp_path / "d"), both, log=lambda line: None) is True
    assert data.load_mnist(str(tmp_path / "d"), "test").y.shape == (30,)


def test_files_already_in_another_accepted_layout_are_not_downloaded(tmp_path, no_proxy):
    """The loaders also read ROOT/raw/*.gz; such a root needs no download (the source here
    could not answer)."""
    files, _ = _mnist_files()
    (tmp_path / "raw").mkdir()
    for name, payload in files.items():
        (tmp_path / "raw" / name).write_bytes(payload)
    offline = download.mirrored(download.default_source("mnist"), _closed_port_url())
    assert download.fetch("mnist", str(tmp_path), offline) is False


def test_interrupted_mnist_download_is_fetched_again(tmp_path, mirror):
    """A truncated .gz in MNIST/raw, as an interrupted download leaves it: the loader alone would
    find it and fail; fetch lets torchvision check it and download it again."""
    files, _ = _mnist_files()
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name, payload in files.items():
        (raw / name).write_bytes(payload if name.startswith("t10k") else payload[:len(payload) // 2])
    assert data.missing_files("mnist", str(tmp_path)) == []
    assert download.fetch("mnist", str(tmp_path), mirror.sources["mnist"], log=lambda line: None) is True
    assert {p.lstrip("/") for p in mirror.requests} == {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"}
    assert data.load_mnist(str(tmp_path), "train").y.shape == (60,)


@pytest.mark.parametrize("dataset, first_file", [("mnist", "train-images-idx3-ubyte.gz"),
                                                 ("cifar100", "cifar-100-python.tar.gz")])
def test_file_not_matching_torchvisions_checksum_is_refused(tmp_path, mirror, dataset, first_file):
    """The server has files other than the official ones: torchvision's own checksums refuse them."""
    official_elsewhere = download.mirrored(download.default_source(dataset), mirror.url)
    with pytest.raises(DownloadError) as exc:
        download.fetch(dataset, str(tmp_path / "d"), official_elsewhere, log=lambda line: None)
    msg = str(exc.value)
    assert f"cannot download {mirror.url}{first_file}" in msg and "MD5 checksum" in msg, msg
    assert data.missing_files(dataset, str(tmp_path / "d"))


def test_unreachable_server_is_one_error_naming_the_url(tmp_path, no_proxy):
    url = _closed_port_url()
    with pytest.raises(DownloadError) as exc:
        download.fetch("cifar100", str(tmp_path), download.mirrored(download.default_source("cifar100"), url),
                       log=lambda line: None)
    msg = str(exc.value)
    assert msg.startswith(f"cannot download {url}cifar-100-python.tar.gz into ")
    assert "Connection refused" in msg and "--download-mirror" in msg and "\n" not in msg


def test_default_source_is_torchvisions():
    from torchvision import datasets

    m = download.default_source("mnist")
    assert m.urls == tuple(datasets.MNIST.mirrors) and m.md5 == dict(datasets.MNIST.resources)
    c = download.default_source("cifar100")
    assert c.file_urls("cifar-100-python.tar.gz") == [datasets.CIFAR100.url]
    assert c.md5["cifar-100-python.tar.gz"] == datasets.CIFAR100.tgz_md5
    assert c.md5["train"] == datasets.CIFAR100.train_list[0][1] and c.md5["meta"] == datasets.CIFAR100.meta["md5"]


# --------------------------------------------------------------------------- the commands
@pytest.mark.parametrize("argv, words", [
    (["--download"], "--download needs --data-root"),
    (["--download", "--data-root", "D", "--stream", "split-miniimagenet"], "mini-imagenet-cache-"),
    (["--download", "--data-root", "D", "--task-file", "t.pt"], "--task-file"),
    (["--download", "--data-root", "D", "--download-mirror", "ftp://example.org/"], "http:// or https://"),
    (["--data-root", "D", "--download-mirror", "http://127.0.0.1:9/"], "only with --download"),
])
def test_cli_refuses_a_download_it_cannot_do(tmp_path, capsys, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, argv + TINY)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert not (tmp_path / "D").exists()


def test_cli_downloads_then_trains_on_the_downloaded_files(tmp_path, capsys, monkeypatch, mirror):
    monkeypatch.setattr(download, "default_source", lambda dataset: mirror.sources[dataset])
    root = tmp_path / "data"
    argv = ["--method", "sgd", "--download", "--data-root", str(root), "--n-tasks", "2", "--samples-per-task", "20",
            "--threads", "1", "--out", str(tmp_path / "out")]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    assert f"downloaded MNIST into {root / 'MNIST' / 'raw'}" in out
    assert f"data: MNIST from {root}" in out and "ACC" in out
    # resumed: nothing to run, nothing downloaded again
    before = len(mirror.requests)
    code, out, err = run_cli(capsys, argv + ["--resume"])
    assert code == 0 and "downloading" not in out and len(mirror.requests) == before


def _child_env():
    env = {k: v for k, v in child_env().items() if k not in _PROXY_VARS}
    return dict(env, no_proxy="127.0.0.1,localhost")


def test_offline_command_exits_1_with_one_line_naming_the_url(tmp_path):
    """Through real processes, the main command and the selection: nothing listens at the URL."""
    url = _closed_port_url()
    root = tmp_path / "data"
    p = subprocess.run([sys.executable, "-m", "emcl_continual", "--method", "sgd", "--download", "--data-root",
                        str(root), "--download-mirror", url, *TINY], capture_output=True, text=True,
                       env=_child_env(), cwd=str(tmp_path), timeout=300)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: cannot download {url}train-images-idx3-ubyte.gz into "
                               f"{root / 'MNIST' / 'raw'}: "), p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "emcl_continual.selection", "--stream", "rotated-mnist", "--methods",
                        "sgd", "--download", "--data-root", str(root), "--download-mirror", url, "--out",
                        str(tmp_path / "sel"), "--allow-dirty"], capture_output=True, text=True,
                       env=_child_env(), cwd=str(tmp_path), timeout=300)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: cannot download {url}train-images-idx3-ubyte.gz into "), p.stderr
    assert not (tmp_path / "sel").exists()  # refused before the sweep's folder was made


def test_selection_downloads_once_before_its_runs(tmp_path, monkeypatch, mirror, capsys):
    monkeypatch.setattr(download, "default_source", lambda dataset: mirror.sources[dataset])
    root, out = tmp_path / "data", tmp_path / "sel"
    argv = ["--stream", "permuted-mnist", "--methods", "sgd", "--until", "validate-a", "--download",
            "--data-root", str(root), "--out", str(out), "--n-tasks", "1", "--samples-per-task", "10",
            "--allow-dirty"]
    assert selection.main(argv) == 0
    runs = selection.load_runs(str(out / "validation.jsonl"))
    assert runs and all(r["data_root"] == str(root) and "MNIST from" in r["data_source"] for r in runs)
    assert {p.lstrip("/") for p in mirror.requests} == set(mirror.sources["mnist"].md5)
    assert "downloaded MNIST into" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # a usage error, before any work
        selection.main(["--stream", "permuted-mnist", "--download", "--out", str(tmp_path / "other")])
    assert exc.value.code == 2 and "--download needs --data-root" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
