"""Steps skipped for non-finite gradients: counted on the device, read lazily, warned about.

The kernels count a skip in ``counters[SKIPPED]`` (emcl_kernels.interface) on the device; the
host learns about it without waiting for the GPU:

- CPU counters are read at once after each step (a read of host memory, nothing to wait for).
- CUDA counters are copied into one pinned buffer, without a sync, at most every
  :data:`POLL_EVERY` steps; the copy is read when its event has completed (checked without
  blocking at later steps). A warning may therefore come up to about ``POLL_EVERY`` steps late on a
  GPU. Reading :attr:`FusedEMCLOptimizer.skipped_steps` or ``state_dict()`` waits for the count.
- While a CUDA graph is captured nothing is read (a compiled step never calls this).

The buffer and the event are made once per counters tensor; no step allocates.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

import torch
from torch import Tensor

from emcl_kernels.interface import COUNTER, RUN_FOUND

__all__ = ["NonFiniteGradientWarning", "SkipLog", "POLL_EVERY"]

_SKIPPED = COUNTER["skipped"]
#: Steps between two non-blocking reads of a GPU's skip count.
POLL_EVERY = 16


class NonFiniteGradientWarning(RuntimeWarning):
    """A step of :class:`FusedEMCLOptimizer` was skipped: its gradients held an inf or a NaN."""


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package and
    torch (the user's ``opt.step()``), whatever the path through them."""
    inside = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
              os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


class SkipLog:
    """The skip count of one optimizer: ``base`` skips from before (a loaded checkpoint) plus
    what its home device's counters have counted since."""

    def __init__(self, base: int = 0):
        self.base = int(base)
        self.reported = 0          # skips of the counters already warned about
        self.runs_reported = 0     # per-run skips (an array's) already warned about
        self.run_base = None       # per-run skips from before (a loaded checkpoint)
        self._counters: Optional[Tensor] = None
        self._host: Optional[Tensor] = None      # pinned copy (CUDA) or a view (CPU)
        self._event = None
        self._pending = False
        self._since_poll = 0
        self._on_cpu = False

    def watching(self, counters: Tensor) -> bool:
        return self._counters is counters

    def watch(self, counters: Tensor, carry: bool = False) -> None:
        """Count the skips of ``counters`` (the optimizer's home device) from now on (``carry``:
        a copy of the counters watched so far, with room for more runs: the reports go on)."""
        self._counters = counters
        if not carry:
            self.reported = 0
        self.runs_reported = 0
        self._pending = False
        self._on_cpu = counters.device.type == "cpu"
        if self._on_cpu:
            self._host = counters.numpy()  # shares the counters' memory: a read costs ~0.1 µs
        else:
            self._host = torch.zeros(1, dtype=counters.dtype, pin_memory=True)
            self._event = torch.cuda.Event()

    def after_step(self) -> None:
        """Warn about skips seen since the last call (never blocks, never syncs)."""
        c = self._counters
        if c is None:
            return
        if self._on_cpu:
            n = int(self._host[_SKIPPED])
            if n > self.reported:
                self._report(n)
            if len(self._host) > RUN_FOUND:
                runs = (len(self._host) - RUN_FOUND) // 2
                m = int(self._host[RUN_FOUND + runs:].sum())
                if m > self.runs_reported:
                    self._report_runs(m)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        if self._pending:
            if not self._event.query():
                return
            self._pending = False
            self._report(int(self._host[0]))
        self._since_poll += 1
        if self._since_poll >= POLL_EVERY:
            self._since_poll = 0
            self._host.copy_(c[_SKIPPED:_SKIPPED + 1], non_blocking=True)
            self._event.record(torch.cuda.current_stream(c.device))
            self._pending = True

    def total(self) -> int:
        """Every skip so far (waits for the device)."""
        c = self._counters
        if c is None:
            return self.base
        n = int(c[_SKIPPED])
        self._report(n)
        return self.base + n

    def run_totals(self, runs: int) -> list:
        """Each run's skips so far, for an optimizer with array groups of ``runs`` runs (waits
        for the device)."""
        base = list(self.run_base) if self.run_base is not None else [0] * runs
        c = self._counters
        if c is None or c.numel() <= RUN_FOUND:
            return base
        counts = c[RUN_FOUND + runs:RUN_FOUND + 2 * runs].tolist()
        return [a + b for a, b in zip(base, counts)]

    def _report_runs(self, m: int) -> None:
        warnings.warn(f"FusedEMCLOptimizer: {m - self.runs_reported} run(s) of an array skipped "
                      "a step: their gradients hold an inf or a NaN, so nothing of theirs was "
                      "written; the other runs stepped (per-run counts in .skipped_runs)",
                      NonFiniteGradientWarning, stacklevel=_caller_stacklevel())
        self.runs_reported = m

    def _report(self, n: int) -> None:
        for _ in range(n - self.reported):
            warnings.warn("FusedEMCLOptimizer skipped a step: its gradients hold an inf or a "
                          "NaN, so nothing was written (the count is in .skipped_steps; "
                          "check_finite=False turns the check off)",
                          NonFiniteGradientWarning, stacklevel=_caller_stacklevel())
        self.reported = max(self.reported, n)
