"""What the commands of this package share: an argument parser whose errors are one line, and
:func:`guarded`, which turns what a command raises into ``error: <one line>`` on stderr and
the exit code of :data:`~.errors.EXIT_CODES`."""
from __future__ import annotations

import argparse
import sys
import traceback

from .errors import (EXIT_CODES, CommandInterrupted, ConfigError, DataFileError, DownloadError, PlotError, RunFailed,
                     UsageError, WriteError)

__all__ = ["make_parser", "guarded", "one_line"]


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors raised as :class:`UsageError` (one line, exit 2)."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def make_parser(**kwargs) -> argparse.ArgumentParser:
    """An ``argparse.ArgumentParser`` whose errors are :class:`~.errors.UsageError`."""
    return _Parser(**kwargs)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def guarded(fn, debug: bool = False) -> int:
    """Run ``fn()``; turn what it raises into ``error: <one line>`` on stderr and
    ``SystemExit`` with the exit code of :data:`~.errors.EXIT_CODES` (with ``debug``, the
    traceback is printed first). Returns ``fn``'s result (0) otherwise."""
    try:
        return fn()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: B902 - every error becomes one line and an exit code
        code, line = _classify(exc, debug)
        if debug:
            traceback.print_exception(exc)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        raise SystemExit(code) from None


def _classify(exc: BaseException, debug: bool) -> tuple[int, str]:
    if isinstance(exc, CommandInterrupted):
        return EXIT_CODES["interrupted"], f"interrupted: {exc}"
    if isinstance(exc, KeyboardInterrupt):  # before the handlers were installed, or after they were removed
        return EXIT_CODES["interrupted"], "interrupted"
    if isinstance(exc, ConfigError):  # options, hyper-parameters, seeds, device, --out
        return EXIT_CODES["usage"], f"error: {one_line(exc)}"
    if isinstance(exc, (DataFileError, DownloadError, PlotError, RunFailed, WriteError)):
        return EXIT_CODES["error"], f"error: {one_line(exc)}"
    if not isinstance(exc, Exception):  # e.g. GeneratorExit: not ours to turn into a line
        raise exc
    return EXIT_CODES["error"], (f"error: {type(exc).__name__}: {one_line(exc)}"
                                 + ("" if debug else " (--debug shows the traceback)"))
