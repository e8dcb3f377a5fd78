"""The GPU roof's probes with EMCL's own streams (``common.PROBE_KINDS``; on the CPU the
extension's ``torch.ops.emcl.stream_probe_``): ``inner_pattern`` (kind 3: reads a, b, c, d;
writes a += 1e-6 * (b + c * d)) and ``step_pattern`` (kind 5: a += 1e-6 * b, c += 1e-6 * b,
d written back), one Triton program per ``BLOCK`` elements, unmasked on whole blocks. Why:
benchmarks/README.md, "The memory roof"."""
from __future__ import annotations

import torch

from benchmarks.timing import time_calls

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the GPU roof keeps its other kernels
    triton = None

CONFIGS = ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8))   # (BLOCK, warps) on a GPU
INTERPRETER_CONFIG = (4096, 8)   # on CPU tensors (Triton's interpreter, which ignores warps)
_chosen: dict = {}      # (device, numel, kind) -> (BLOCK, warps)
KINDS = {"inner_pattern": 3, "step_pattern": 5}

if triton is not None:
    @triton.jit
    def _stream_probe(a, b, c, d, n, KIND: tl.constexpr, BLOCK: tl.constexpr,
                      WHOLE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if WHOLE:  # n a multiple of BLOCK: every access full, aligned and unmasked
            offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
            mask = None
        else:
            mask = offs < n
        x = tl.load(a + offs, mask=mask)
        y = tl.load(b + offs, mask=mask)
        z = tl.load(c + offs, mask=mask)
        w = tl.load(d + offs, mask=mask)
        if KIND == 3:
            tl.store(a + offs, x + 1e-6 * (y + z * w), mask=mask)
        else:
            tl.store(a + offs, x + 1e-6 * y, mask=mask)
            tl.store(c + offs, z + 1e-6 * y, mask=mask)
            tl.store(d + offs, w, mask=mask)


def available(device: torch.device) -> bool:
    """Whether the probes run on ``device``: a CUDA device with Triton."""
    return triton is not None and torch.device(device).type == "cuda"


def stream_probe(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                 kind: int) -> None:
    """One pass of probe ``kind`` (3 or 5) over four contiguous fp32 tensors of one size, on
    a GPU in the fastest of :data:`CONFIGS` there (timed on the first call per size)."""
    if triton is None:
        raise RuntimeError("the GPU stream probes need Triton")
    if kind not in KINDS.values():
        raise ValueError(f"kind must be one of {sorted(KINDS.values())}, got {kind}")
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != a.numel()
           or t.device != a.device for t in (a, b, c, d)):
        raise ValueError("the probes take four contiguous fp32 tensors of one size on one device")
    if a.device.type != "cuda":
        _launch(a, b, c, d, kind, *INTERPRETER_CONFIG)
        return
    key = (str(a.device), a.numel(), kind)
    if key not in _chosen:
        _chosen[key] = _fastest_config(a, b, c, d, kind)
    _launch(a, b, c, d, kind, *_chosen[key])


def chosen_configs() -> list:
    """The configuration each GPU probe runs with: one dict per (device, size, kind) timed."""
    names = {v: k for k, v in KINDS.items()}
    return [{"device": dev, "numel": n, "kernel": names[kind], "block": blk, "warps": w}
            for (dev, n, kind), (blk, w) in sorted(_chosen.items())]


def _launch(a, b, c, d, kind: int, block: int, warps: int) -> None:
    n = a.numel()
    _stream_probe[(triton.cdiv(n, block),)](a, b, c, d, n, KIND=kind, BLOCK=block,
                                            WHOLE=n % block == 0, num_warps=warps)


def _fastest_config(a, b, c, d, kind: int, calls: int = 5) -> tuple:
    """The (BLOCK, warps) of :data:`CONFIGS` whose fastest of ``calls`` timed launches (after
    one to compile; CUDA events on a GPU) is the shortest on these tensors."""
    def fastest(cfg) -> float:
        _launch(a, b, c, d, kind, *cfg)
        return min(time_calls([lambda: _launch(a, b, c, d, kind, *cfg)] * calls, a.device))
    return min(CONFIGS, key=fastest)
