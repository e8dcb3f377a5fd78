"""``--download``: fetch MNIST or CIFAR-100 into ``--data-root`` through torchvision's datasets.

    python -m emcl_continual --stream split-cifar100 --download --data-root data
    python -m emcl_continual.selection --stream permuted-mnist --download --data-root data --jobs 2

torchvision's :class:`~torchvision.datasets.MNIST` and :class:`~torchvision.datasets.CIFAR100`
download the files, check the MD5 checksum of each and unpack them into the layout that
:mod:`emcl_continual.data.sources` reads: ``ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
and ``ROOT/cifar-100-python/{train,test,meta}``. Where the files come from is each class's own
class attributes (MNIST: ``mirrors`` and ``resources``, the file names with their MD5;
CIFAR100: ``url``, ``tgz_md5`` and the MD5 of each unpacked file in ``train_list``,
``test_list`` and ``meta``). A :class:`Source` holds these values, by default the ones
torchvision ships (:func:`default_source`); :func:`fetch` downloads through a subclass that
carries them, so torchvision's own classes are never changed. ``--download-mirror URL`` takes
the same files from another server (:func:`mirrored`, checked against the same checksums).

A data set that is already there (every file its loader reads is found) is not downloaded
again; nothing is fetched when no run needs the data. A download that fails (no network, a
server that does not answer within :data:`TIMEOUT_S`, a file that does not match its checksum)
raises :class:`~emcl_continual.core.errors.DownloadError`, one line naming the URL and what to do.

miniImageNet has no download: torchvision does not have it, and its pickles
(``mini-imagenet-cache-{train,val,test}.pkl``) are fetched by hand (docs/continual-learning.md,
"Getting the data").
"""
from __future__ import annotations

import os
import socket
import tarfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.error import URLError

from . import sources as _data
from ..core.errors import DownloadError, UsageError

__all__ = ["DATASETS", "TIMEOUT_S", "Source", "dataset_of", "default_source", "mirrored", "fetch",
           "check_request", "download_for_stream"]

# The data set behind each stream ("mnist", "cifar100"; None: no download).
DATASETS = {"permuted-mnist": "mnist", "rotated-mnist": "mnist", "many-permutations": "mnist",
            "split-cifar100": "cifar100", "split-miniimagenet": None}

# Seconds a server may stay silent (connecting, or between two reads) before the download fails.
TIMEOUT_S = 60.0

_NAMES = {"mnist": "MNIST", "cifar100": "CIFAR-100"}


@dataclass(frozen=True)
class Source:
    """Where a data set's files come from and what they must hash to.

    ``urls``: base URLs, each ending in ``/``; a file's URL is a base URL followed by its name
    (MNIST tries them in order; CIFAR-100 uses the first). ``md5``: file name -> MD5 hex digest,
    for every file torchvision checks (MNIST: the four ``.gz`` files; CIFAR-100: the archive and
    the ``train``, ``test`` and ``meta`` pickles it holds).
    """

    dataset: str
    urls: tuple
    md5: dict

    def file_urls(self, name: str) -> list[str]:
        """The URLs of file ``name``, in the order they are tried."""
        urls = self.urls if self.dataset == "mnist" else self.urls[:1]
        return [u + name for u in urls]


def dataset_of(stream: str) -> str | None:
    """The data set ``--download`` fetches for ``stream`` ("mnist", "cifar100"), None for
    split-miniimagenet; an unknown stream raises ValueError."""
    if stream not in DATASETS:
        raise ValueError(f"unknown stream {stream!r}; choose one of {', '.join(DATASETS)}")
    return DATASETS[stream]


def _torchvision_class(dataset: str):
    from torchvision import datasets

    if dataset == "mnist":
        return datasets.MNIST
    if dataset == "cifar100":
        return datasets.CIFAR100
    raise ValueError(f"unknown data set {dataset!r}; choose 'mnist' or 'cifar100'")


def default_source(dataset: str) -> Source:
    """The URLs and checksums torchvision's class for ``dataset`` ships with."""
    cls = _torchvision_class(dataset)
    if dataset == "mnist":
        return Source("mnist", tuple(cls.mirrors), {name: md5 for name, md5 in cls.resources})
    if not cls.url.endswith("/" + cls.filename):
        raise RuntimeError(f"torchvision's CIFAR100.url {cls.url!r} does not end in its filename {cls.filename!r}")
    base = cls.url[:len(cls.url) - len(cls.filename)]
    md5 = {cls.filename: cls.tgz_md5, cls.meta["filename"]: cls.meta["md5"]}
    md5.update({name: digest for name, digest in cls.train_list + cls.test_list})
    return Source("cifar100", (base,), md5)


def mirrored(source: Source, url: str) -> Source:
    """``source`` served from the base URL ``url`` instead (same file names, same checksums)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a mirror is an http:// or https:// URL, got {url!r}")
    return Source(source.dataset, (url if url.endswith("/") else url + "/",), dict(source.md5))


def _dataset_class(source: Source):
    """A subclass of torchvision's class that downloads from ``source``. It keeps the class
    name, which names MNIST's folder (``ROOT/MNIST/raw``)."""
    base = _torchvision_class(source.dataset)
    try:
        if source.dataset == "mnist":
            attrs = {"mirrors": list(source.urls),
                     "resources": [(name, source.md5[name]) for name, _ in base.resources]}
        else:
            attrs = {"url": source.urls[0] + base.filename, "filename": base.filename,
                     "tgz_md5": source.md5[base.filename],
                     "train_list": [[name, source.md5[name]] for name, _ in base.train_list],
                     "test_list": [[name, source.md5[name]] for name, _ in base.test_list],
                     "meta": dict(base.meta, md5=source.md5[base.meta["filename"]])}
    except KeyError as exc:
        raise ValueError(f"the {source.dataset} source has no checksum for {exc.args[0]!r}") from None
    return type(base.__name__, (base,), attrs)


@contextmanager
def _socket_timeout(seconds: float):
    """urllib, which torchvision downloads with, waits forever on a silent server by default."""
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(before)


def _reason(exc: BaseException) -> str:
    """What went wrong, in a few words, from what torchvision raised."""
    text = " ".join(str(exc).split())
    if "got:" in text:  # MNIST: "Error downloading F: Tried M1, got: E1 Tried M2, got: E2"
        text = text.rsplit("got:", 1)[1].strip()
    if text in ("File not found or corrupted.", ""):
        return "the downloaded file does not match its MD5 checksum (a broken download, or a server with other files)"
    if text.startswith("Dataset not found or corrupted") or text.startswith("Dataset metadata file not found"):
        return "the unpacked files do not match their MD5 checksums"
    return text or type(exc).__name__


def _failed_file(source: Source, root: str) -> str:
    """The file a failed download was fetching: the first one torchvision has not unpacked yet."""
    if source.dataset == "mnist":
        raw = os.path.join(root, "MNIST", "raw")
        for name in source.md5:
            if not os.path.isfile(os.path.join(raw, name[:-3] if name.endswith(".gz") else name)):
                return name
        return next(iter(source.md5))
    return _torchvision_class("cifar100").filename


def _absent(dataset: str, root: str) -> list[str]:
    """The files to download: those the loader would not find, and for MNIST also each ``.gz`` in
    ``ROOT/MNIST/raw`` without its unpacked file. torchvision writes a ``.gz`` there under its
    final name while downloading it and unpacks it only after its checksum matched, so such a file
    may be an interrupted download; torchvision checks it again (and fetches it again if it differs)."""
    missing = _data.missing_files(dataset, root)
    if dataset == "mnist":
        raw = os.path.join(root, "MNIST", "raw")
        for split in ("train", "test"):
            for name in _data.MNIST_FILES[split]:
                if (name not in missing and os.path.isfile(os.path.join(raw, name + ".gz"))
                        and not os.path.isfile(os.path.join(raw, name))):
                    missing.append(name)
    return missing


def fetch(dataset: str, root: str, source: Source | None = None, log=print) -> bool:
    """Download ``dataset`` ("mnist" or "cifar100") into ``root`` unless its files are there.

    Returns True when something was downloaded. ``source``: where from (default: torchvision's
    URLs and checksums). ``log``: one line before a download starts and one when it is done.
    Raises :class:`~emcl_continual.core.errors.DownloadError` naming the URL when it fails.
    """
    source = default_source(dataset) if source is None else source
    if source.dataset != dataset:
        raise ValueError(f"a {source.dataset} source cannot fetch {dataset}")
    if not _absent(dataset, root):
        return False
    cls = _dataset_class(source)
    folder = os.path.join(root, "MNIST", "raw") if dataset == "mnist" else os.path.join(root, _data.CIFAR100_DIR)
    first = source.file_urls(_failed_file(source, root))[0]
    log(f"downloading {_NAMES[dataset]} from {first.rsplit('/', 1)[0]}/ into {folder}")
    try:
        os.makedirs(root, exist_ok=True)
        with _socket_timeout(TIMEOUT_S):
            cls(root=root, train=True, download=True)
            cls(root=root, train=False, download=False)
    except (URLError, OSError, RuntimeError, tarfile.TarError, EOFError, zlib.error) as exc:
        urls = source.file_urls(_failed_file(source, root))
        tried = f" (also tried {', '.join(urls[1:])})" if len(urls) > 1 else ""
        raise DownloadError(
            f"cannot download {urls[0]}{tried} into {folder}: {_reason(exc)}. Check the network (a proxy is "
            f"taken from HTTPS_PROXY / HTTP_PROXY), pass --download-mirror URL for a server with the same files, "
            f"or put the files there by hand (docs/continual-learning.md, 'Getting the data')") from exc
    missing = _data.missing_files(dataset, root)
    if missing:  # torchvision's layout and the loaders' disagree: say so rather than fail later
        raise DownloadError(f"{_NAMES[dataset]} was downloaded into {root} but {', '.join(missing)} "
                            f"is not where emcl_continual.data looks for it")
    log(f"downloaded {_NAMES[dataset]} into {folder}")
    return True


def check_request(stream: str, data_root: str | None, task_file: str | None = None,
                  mirror: str | None = None) -> None:
    """Refuse a ``--download`` that cannot be done, before any work: no ``--data-root`` to
    download into, a ``--task-file`` (which replaces the data), split-miniimagenet (no download),
    a mirror that is not an http(s) URL. Raises :class:`~emcl_continual.core.errors.UsageError`."""
    if data_root is None:
        raise UsageError("--download needs --data-root DIR, the folder to download into")
    if task_file is not None:
        raise UsageError("--download and --task-file contradict each other: the task file replaces the data set")
    try:
        dataset = dataset_of(stream)
    except ValueError as exc:
        raise UsageError(f"--download: {exc}") from None
    if dataset is None:
        raise UsageError(f"--download: {stream} has no download (torchvision does not have miniImageNet); "
                         f"put mini-imagenet-cache-{{train,val,test}}.pkl in "
                         f"{os.path.join(data_root, 'miniimagenet')}/ "
                         f"by hand (docs/continual-learning.md, 'Getting the data')")
    if mirror is not None and not mirror.startswith(("http://", "https://")):
        raise UsageError(f"--download-mirror {mirror}: expected an http:// or https:// URL")


def download_for_stream(stream: str, data_root: str, mirror: str | None = None, log=print) -> bool:
    """Fetch the data set of ``stream`` into ``data_root`` (after :func:`check_request`);
    ``mirror``: a base URL serving the same files. Returns True when something was downloaded."""
    dataset = dataset_of(stream)
    source = default_source(dataset)
    if mirror is not None:
        source = mirrored(source, mirror)
    return fetch(dataset, data_root, source, log=log)
