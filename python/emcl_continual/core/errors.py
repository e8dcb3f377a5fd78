"""The errors the continual-learning commands raise, and the exit code each kind gets.

A leaf module: it imports nothing from this package, so every other module can take its
errors from here without importing the command line.

====  ==========================================================================
0     done
1     bad data file, a download that failed, a run that failed, a file or plot that
      could not be written, any other error
2     bad option, hyper-parameter, seed or device; ``--out`` unusable or in use
130   interrupted (SIGINT or SIGTERM)
====  ==========================================================================
"""
from __future__ import annotations

import signal

__all__ = ["EXIT_CODES", "ConfigError", "UsageError", "OutputError", "PlotError", "RunFailed", "WriteError",
           "DataFileError", "DownloadError", "Interrupted", "CommandInterrupted"]

EXIT_CODES = {"ok": 0, "error": 1, "usage": 2, "interrupted": 130}


class ConfigError(ValueError):
    """A command-line option or hyper-parameter value that cannot be used; the message is one
    line naming the option and what it accepts (exit code 2)."""


class UsageError(ConfigError):
    """A command-line option that cannot be used (exit code 2)."""


class OutputError(ConfigError):
    """``--out`` cannot be used as asked: a file, not writable, holds other results, or another
    command is writing into it (exit code 2)."""


class PlotError(RuntimeError):
    """Results were written but some figures were not (exit code 1)."""


class RunFailed(RuntimeError):
    """A run raised; the message names it and what was saved (exit code 1)."""


class WriteError(OSError):
    """A file could not be written; the message names the file and the reason (exit code 1)."""

    def __init__(self, path: str, exc: OSError):
        super().__init__(exc.errno, f"cannot write {path}: {exc.strerror or exc}")
        self.path = path

    def __str__(self) -> str:
        return self.strerror


class DataFileError(FileNotFoundError):
    """A data file is missing or malformed; the message names the file and where it belongs
    (exit code 1)."""


class DownloadError(RuntimeError):
    """A data set could not be downloaded (no network, a server that does not answer, a file that
    does not match its checksum); the message names the URL and what to do instead (exit code 1)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class CommandInterrupted(Exception):
    """A command was interrupted; the message says what was saved and how to resume (exit code 130)."""
