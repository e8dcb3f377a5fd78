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
program per ``BLOCK`` elements of four equal-size contiguous fp32 tensors.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the GPU roof keeps its other kernels
    triton = None

BLOCK = 4096
NUM_WARPS = 8
KINDS = {"inner_pattern": 3, "step_pattern": 5}

if triton is not None:
    @triton.jit
    def _stream_probe(a, b, c, d, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
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
    grid = (triton.cdiv(n, BLOCK),)
    kwargs = {"num_warps": NUM_WARPS} if a.device.type == "cuda" else {}
    _stream_probe[grid](a, b, c, d, n, KIND=kind, BLOCK=BLOCK, **kwargs)
