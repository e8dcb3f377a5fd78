"""Memory probes with EMCL's own streams on a GPU: the roof kernels ``inner_pattern`` and
``step_pattern`` of :data:`benchmarks.common.ROOF_KERNELS`, which on the CPU are the
extension's ``torch.ops.emcl.stream_probe_`` (kinds 3 and 5).

On HBM a read costs less than a write, so a kernel that reads four streams per write (EMCL's
inner step: θ, g, θ₀, h read, θ written) outruns every roof kernel of fewer reads per write: on
the H200 of 2026-11-28 the inner step ran at 4114-4255 GB/s, 1.13-1.17x a copy and above every
roof kernel then timed (``bench_kernels`` called it a bug). The roof therefore needs the
steps' own stream mixes, done with as little arithmetic as keeps every load:

- kind 3, the inner step's streams: reads a, b, c, d; writes a += 1e-6 * (b + c * d);
- kind 5, the fused step's streams: reads a, b, c, d; writes a += 1e-6 * b, c += 1e-6 * b and d
  unchanged (seven streams, 28 B per fp32 element, as fused Adam's).

The values match the CPU probes', so repeats stay finite; ``b`` is never written. One Triton
program per ``BLOCK`` elements of four equal-size contiguous fp32 tensors. A roof kernel must
be at least as lean as the step it bounds: where the size is a whole number of blocks (every
roof size) the loads and stores carry no mask and their offsets are marked contiguous and
block-aligned, so that they compile to 16-byte accesses, as the full chunks of EMCL's Triton
kernel do ([note: vector path] in ``emcl_kernels/backends/triton_kernels.py``). And the block
size and warps that stream fastest differ by a few per cent between GPUs (on the H200 the
Triton step's inner pattern ran at 0.95-1.04x a copy across four of them), so on a GPU each
probe times the :data:`CONFIGS` once per size on its first call and keeps the fastest
(:func:`chosen_configs` says which), rather than bounding a tuned step with an untuned probe.
"""
from __future__ import annotations

import torch

from benchmarks.timing import time_calls

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the GPU roof keeps its other kernels
    triton = None

BLOCK = 4096            # the interpreter's (CPU) configuration
NUM_WARPS = 8
CONFIGS = ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8))   # (BLOCK, warps) on a GPU
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
    """One pass of probe ``kind`` (3 or 5) over four contiguous fp32 tensors of one size."""
    if triton is None:
        raise RuntimeError("the GPU stream probes need Triton")
    if kind not in KINDS.values():
        raise ValueError(f"kind must be one of {sorted(KINDS.values())}, got {kind}")
    n = a.numel()
    for t in (a, b, c, d):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n \
                or t.device != a.device:
            raise ValueError("the probes take four contiguous fp32 tensors of one size, "
                             "on one device")
    if a.device.type != "cuda":
        _launch(a, b, c, d, kind, BLOCK, None)
        return
    key = (a.device, n, kind)
    if key not in _chosen:
        _chosen[key] = _fastest_config(a, b, c, d, kind)
    _launch(a, b, c, d, kind, *_chosen[key])


def chosen_configs() -> list:
    """The configuration each GPU probe runs with: one dict per (device, size, kind) timed."""
    names = {v: k for k, v in KINDS.items()}
    return [{"device": str(dev), "numel": n, "kernel": names[kind], "block": blk, "warps": w}
            for (dev, n, kind), (blk, w) in sorted(_chosen.items(),
                                                    key=lambda kv: (str(kv[0][0]), *kv[0][1:]))]


def _launch(a, b, c, d, kind: int, block: int, warps) -> None:
    n = a.numel()
    kwargs = {} if warps is None else {"num_warps": warps}
    _stream_probe[(triton.cdiv(n, block),)](a, b, c, d, n, KIND=kind, BLOCK=block,
                                            WHOLE=n % block == 0, **kwargs)


def _fastest_config(a, b, c, d, kind: int, calls: int = 5) -> tuple:
    """The (BLOCK, warps) of :data:`CONFIGS` whose fastest of ``calls`` timed launches (after
    one to compile; ``timing.time_calls``: CUDA events on a GPU) is the shortest, on these
    tensors: each config runs ``calls + 1`` times."""
    best, best_s = None, float("inf")
    for cfg in CONFIGS:
        _launch(a, b, c, d, kind, *cfg)
        secs = min(time_calls([lambda: _launch(a, b, c, d, kind, *cfg)] * calls,
                                     a.device))
        if secs < best_s:
            best, best_s = cfg, secs
    return best
