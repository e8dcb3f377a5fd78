"""The suite's timers, free of anything else in ``benchmarks`` so that every module can use them
(``gpu_probes`` times its configurations with them, and ``common``'s roof uses the probes):
``time.perf_counter`` on CPU, CUDA events on a GPU, a summary of repeats, and a repeat count
that fits a time budget."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], None], device: torch.device, clock: Callable = time.perf_counter) -> float:
    """Seconds of one call by ``clock`` (default the wall clock), with the device synchronized
    before and after."""
    synchronize(device)
    start = clock()
    fn()
    synchronize(device)
    return clock() - start


#: GPU clock cycles (about 1 ms) the device spins before the first call :func:`time_calls` times:
#: after a synchronization an idle GPU would start that call's event at once and wait for the
#: host to prepare and launch the call, so a lone call (the roof's, one per round) would count the
#: launch gap that a queued run of calls (the kernels') hides.
LEAD_CYCLES = 2_000_000


def time_calls(fns: Sequence[Callable[[], None]], device: torch.device, *,
               max_total_s: Optional[float] = None, min_calls: int = 1) -> list:
    """Seconds of each call of ``fns`` (in order): CUDA events on a GPU (device time between the
    call's first and last launch, the GPU kept busy while the host launches the first call:
    :data:`LEAD_CYCLES`), ``time.perf_counter`` around each call on CPU, where
    ``max_total_s`` stops early (after at least ``min_calls`` calls) once the calls have taken
    that long, so a machine that turns slow mid-run cannot stretch the run."""
    if device.type == "cuda":
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in fns]
        torch.cuda.synchronize(device)
        torch.cuda._sleep(LEAD_CYCLES)
        for fn, (start, end) in zip(fns, events):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    out = []
    for fn in fns:
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
        if max_total_s is not None and len(out) >= min_calls and sum(out) > max_total_s:
            break
    return out


def timer_name(device: torch.device) -> str:
    return "cuda_events" if device.type == "cuda" else "perf_counter"


@dataclass
class Stats:
    """Summary of the timed repeats of one measurement, in milliseconds."""
    median_ms: float
    min_ms: float
    q25_ms: float
    q75_ms: float
    repeats: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> "Stats":
        ms = sorted(s * 1e3 for s in seconds)
        if not ms:
            raise ValueError("no timings")
        q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
        return cls(statistics.median(ms), ms[0], q[0], q[2], len(ms))


def repeats_for(estimate_s: float, budget_s: float, min_reps: int, max_reps: int) -> int:
    """As many repeats as fit in ``budget_s`` given one call takes ``estimate_s``, clamped."""
    if estimate_s <= 0:
        return max_reps
    return int(max(min_reps, min(max_reps, math.ceil(budget_s / estimate_s))))


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9
