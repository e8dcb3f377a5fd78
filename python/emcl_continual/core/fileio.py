"""Writing files so that a reader, or a command cut off mid-write, sees the old file or the new
one, never half of one; a failed write raises :class:`~.errors.WriteError` naming the file."""
from __future__ import annotations

import os
import tempfile

from .errors import WriteError

__all__ = ["write_atomic", "append_line"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file


def write_atomic(path: str, write, binary: bool = False) -> str:
    """Call ``write(fh)`` on a temporary file beside ``path`` (text in UTF-8, or ``binary``),
    flush it to disk, then rename it over ``path``. On any error, or an interrupt, the
    temporary file is removed and ``path`` is left as it was; an ``OSError`` (a full disk, a
    folder that cannot be written) becomes :class:`~.errors.WriteError` naming ``path``."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        os.fchmod(fd, _FILE_MODE)
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(path, exc) from exc
        raise
    return path


def append_line(path: str, line: str) -> None:
    """Append ``line`` to ``path`` and flush it to disk; an ``OSError`` becomes
    :class:`~.errors.WriteError` naming ``path``."""
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise WriteError(path, exc) from exc
