"""The fused glance of an MLP in Triton (:mod:`emcl_kernels.glance`): one program per run.

Program ``r`` runs run ``r``'s ``n`` one-sample inner steps in order: per step the forward pass
(tiles of ``BLOCK_R`` rows by ``BLOCK_C`` columns, the row sums with ``tl.sum``), the softmax
cross-entropy in fp32, the backward signals (the same tiles, summed over rows), the finite
check of the gradient's factors ([note: glance skips] in ``emcl_kernels/glance.py``) and the
update with the gradient ``δ_l[i]·a_{l-1}[j]`` formed in registers. The activations and backward
signals go through a small global scratch buffer per run (a block barrier between the
phases), as Triton has no shared-memory arrays of run-time size.

The layers are found through an int64 table, one row per layer: the addresses of the weight,
bias, their anchors and importances (run 0's; run ``r`` adds ``r`` times the tensor's size),
the layer's inputs and outputs, and the scratch offsets of its input and of its backward
signal. ``NUM_LAYERS`` is a compile-time constant (the layer loops are unrolled).

Like the other Triton kernels this runs on CPU tensors under the interpreter when
``TRITON_INTERPRET=1`` was set before the first import of Triton's kernels (DEVELOPERS.md,
"Running the kernels without a GPU"); the sums run in another order than the CPU kernel's,
so it is compared with the reference within fp32 tolerance.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # Triton is an optional dependency
    triton = tl = None
    _IMPORT_ERROR: Optional[str] = f"Triton could not be imported ({exc}); pip install triton"
else:
    _IMPORT_ERROR = None

__all__ = ["mlp_glance", "unavailable_reason", "INTERPRETED", "BLOCK_R", "BLOCK_C",
           "NUM_WARPS"]

#: Rows and columns of a weight tile.
BLOCK_R: int = 32
BLOCK_C: int = 128
#: Warps per program on the GPU (ignored by the interpreter).
NUM_WARPS: int = 4
_ROW_ENTRIES = 10  # int64 entries per layer in the table


if _IMPORT_ERROR is None:
    _ROW = tl.constexpr(_ROW_ENTRIES)

    @triton.jit
    def _isfinite(v):
        return (v == v) & (tl.abs(v) < float("inf"))

    @triton.jit
    def _glance_kernel(table, x_ptr, y_ptr, mask_ptr, hyper_ptr, scratch_ptr, losses_ptr,
                       skipped_ptr, n, scratch_stride, logits_off,
                       NUM_LAYERS: tl.constexpr, PROX: tl.constexpr, CHECK: tl.constexpr,
                       HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        beta = tl.load(hyper_ptr + 3 * r).to(tl.float32)
        reg64 = tl.load(hyper_ptr + 3 * r + 1)
        reg = reg64.to(tl.float32)
        cs = (tl.load(hyper_ptr + 3 * r + 2) * reg64).to(tl.float32)
        scratch = scratch_ptr + r * scratch_stride
        in0 = tl.load(table + 6)
        n_classes = tl.load(table + (NUM_LAYERS - 1) * _ROW + 7)
        rows = tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        ks = tl.arange(0, BLOCK_K)
        skips = r * 0
        for k in range(n):
            sample = r * n + k
            x_row = x_ptr + sample * in0
            # forward
            for l in tl.static_range(NUM_LAYERS):
                base = table + l * _ROW
                w_ptr = tl.load(base + 0).to(tl.pointer_type(tl.float32))
                b_ptr = tl.load(base + 1).to(tl.pointer_type(tl.float32))
                n_in = tl.load(base + 6)
                n_out = tl.load(base + 7)
                w_ptr += r * n_in * n_out
                b_ptr += r * n_out
                if l == 0:
                    a_ptr = x_row
                else:
                    a_ptr = scratch + tl.load(base + 8)
                if l + 1 < NUM_LAYERS:
                    z_ptr = scratch + tl.load(table + (l + 1) * _ROW + 8)
                else:
                    z_ptr = scratch + logits_off
                for i0 in range(0, n_out, BLOCK_R):
                    ri = i0 + rows
                    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
                    for j0 in range(0, n_in, BLOCK_C):
                        cj = j0 + cols
                        wt = tl.load(w_ptr + ri[:, None] * n_in + cj[None, :],
                                     mask=(ri[:, None] < n_out) & (cj[None, :] < n_in), other=0.0)
                        at = tl.load(a_ptr + cj, mask=cj < n_in, other=0.0)
                        acc += tl.sum(wt * at[None, :], axis=1)
                    z = acc + tl.load(b_ptr + ri, mask=ri < n_out, other=0.0)
                    if l + 1 < NUM_LAYERS:
                        z = tl.where(z <= 0.0, 0.0, z)
                    tl.store(z_ptr + ri, z, mask=ri < n_out)
                tl.debug_barrier()
            # softmax cross-entropy
            label = tl.load(y_ptr + sample)
            live = ks < n_classes
            if HAS_MASK:
                mk = tl.load(mask_ptr + sample * n_classes + ks, mask=ks < n_classes, other=1)
                live = live & (mk == 0)
            zl = tl.load(scratch + logits_off + ks, mask=ks < n_classes, other=0.0)
            zm = tl.where(live, zl, -float("inf"))
            m = tl.max(zm, axis=0)
            e = tl.where(live, tl.exp(zm - m), 0.0)
            lse = tl.log(tl.sum(e, axis=0))
            p = tl.where(live, tl.exp((zl - m) - lse), 0.0)
            onehot = tl.where(ks == label, 1.0, 0.0)
            dl = tl.where(live, p - onehot, 0.0)
            last = table + (NUM_LAYERS - 1) * _ROW
            tl.store(scratch + tl.load(last + 9) + ks, dl, mask=ks < n_classes)
            z_y = tl.sum(tl.where(ks == label, zl, 0.0), axis=0)
            tl.store(losses_ptr + sample, (lse + m) - z_y)
            bad = (label < 0) | (label >= n_classes)
            tl.debug_barrier()
            # backward signals, with the weights before the update
            for ll in tl.static_range(NUM_LAYERS - 1):
                l = NUM_LAYERS - 1 - ll
                base = table + l * _ROW
                w_ptr = tl.load(base + 0).to(tl.pointer_type(tl.float32))
                n_in = tl.load(base + 6)
                n_out = tl.load(base + 7)
                w_ptr += r * n_in * n_out
                d_ptr = scratch + tl.load(base + 9)
                a_ptr = scratch + tl.load(base + 8)
                back_ptr = scratch + tl.load(table + (l - 1) * _ROW + 9)
                for j0 in range(0, n_in, BLOCK_C):
                    cj = j0 + cols
                    back = tl.zeros([BLOCK_C], dtype=tl.float32)
                    for i0 in range(0, n_out, BLOCK_R):
                        ri = i0 + rows
                        wt = tl.load(w_ptr + ri[:, None] * n_in + cj[None, :],
                                     mask=(ri[:, None] < n_out) & (cj[None, :] < n_in), other=0.0)
                        d = tl.load(d_ptr + ri, mask=ri < n_out, other=0.0)
                        back += tl.sum(wt * d[:, None], axis=0)
                    a = tl.load(a_ptr + cj, mask=cj < n_in, other=0.0)
                    tl.store(back_ptr + cj, tl.where(a > 0.0, back, 0.0), mask=cj < n_in)
                tl.debug_barrier()
            # the finite check of the gradient's factors
            if CHECK:
                for l in tl.static_range(NUM_LAYERS):
                    base = table + l * _ROW
                    n_in = tl.load(base + 6)
                    n_out = tl.load(base + 7)
                    if l == 0:
                        a_ptr = x_row
                    else:
                        a_ptr = scratch + tl.load(base + 8)
                    d_ptr = scratch + tl.load(base + 9)
                    ma = tl.zeros([BLOCK_C], dtype=tl.float32)
                    for j0 in range(0, n_in, BLOCK_C):
                        cj = j0 + cols
                        a = tl.load(a_ptr + cj, mask=cj < n_in, other=0.0)
                        bad = bad | (tl.sum(tl.where(_isfinite(a), 0, 1), axis=0) > 0)
                        ma = tl.maximum(ma, tl.abs(a))
                    md = tl.zeros([BLOCK_C], dtype=tl.float32)
                    for i0 in range(0, n_out, BLOCK_C):
                        ci = i0 + cols
                        d = tl.load(d_ptr + ci, mask=ci < n_out, other=0.0)
                        bad = bad | (tl.sum(tl.where(_isfinite(d), 0, 1), axis=0) > 0)
                        md = tl.maximum(md, tl.abs(d))
                    top = tl.max(md, axis=0) * tl.max(ma, axis=0)
                    bad = bad | (top == float("inf"))
            if bad:
                skips += 1
            else:
                for l in tl.static_range(NUM_LAYERS):
                    base = table + l * _ROW
                    n_in = tl.load(base + 6)
                    n_out = tl.load(base + 7)
                    off_w = r * n_in * n_out
                    w_ptr = tl.load(base + 0).to(tl.pointer_type(tl.float32)) + off_w
                    w0_ptr = tl.load(base + 2).to(tl.pointer_type(tl.float32)) + off_w
                    hw_ptr = tl.load(base + 4).to(tl.pointer_type(tl.float32)) + off_w
                    b_ptr = tl.load(base + 1).to(tl.pointer_type(tl.float32)) + r * n_out
                    b0_ptr = tl.load(base + 3).to(tl.pointer_type(tl.float32)) + r * n_out
                    hb_ptr = tl.load(base + 5).to(tl.pointer_type(tl.float32)) + r * n_out
                    if l == 0:
                        a_ptr = x_row
                    else:
                        a_ptr = scratch + tl.load(base + 8)
                    d_ptr = scratch + tl.load(base + 9)
                    for i0 in range(0, n_out, BLOCK_R):
                        ri = i0 + rows
                        d = tl.load(d_ptr + ri, mask=ri < n_out, other=0.0)
                        for j0 in range(0, n_in, BLOCK_C):
                            cj = j0 + cols
                            offs = ri[:, None] * n_in + cj[None, :]
                            msk = (ri[:, None] < n_out) & (cj[None, :] < n_in)
                            a = tl.load(a_ptr + cj, mask=cj < n_in, other=0.0)
                            g = d[:, None] * a[None, :]
                            th = tl.load(w_ptr + offs, mask=msk, other=0.0)
                            th0 = tl.load(w0_ptr + offs, mask=msk, other=0.0)
                            h = tl.load(hw_ptr + offs, mask=msk, other=0.0)
                            if PROX:
                                that = th - beta * g
                                c = tl.minimum(cs * h, 3.4028234663852886e38)
                                wgt = c / (1.0 + c)
                                new = that - wgt * (that - th0)
                            else:
                                new = th - beta * (g + (reg * h) * (th - th0))
                            tl.store(w_ptr + offs, new, mask=msk)
                        th = tl.load(b_ptr + ri, mask=ri < n_out, other=0.0)
                        th0 = tl.load(b0_ptr + ri, mask=ri < n_out, other=0.0)
                        h = tl.load(hb_ptr + ri, mask=ri < n_out, other=0.0)
                        if PROX:
                            that = th - beta * d
                            c = tl.minimum(cs * h, 3.4028234663852886e38)
                            wgt = c / (1.0 + c)
                            new = that - wgt * (that - th0)
                        else:
                            new = th - beta * (d + (reg * h) * (th - th0))
                        tl.store(b_ptr + ri, new, mask=ri < n_out)
            tl.debug_barrier()
        tl.store(skipped_ptr + r, skips.to(tl.int64))

    INTERPRETED: bool = type(_glance_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def unavailable_reason(device_type: Optional[str]) -> Optional[str]:
    """None when the Triton glance can run on ``device_type`` tensors here, else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if INTERPRETED:
        if device_type in (None, "cpu"):
            return None
        return ("the Triton glance was loaded under Triton's interpreter (TRITON_INTERPRET=1), "
                f"which runs CPU tensors only, not {device_type!r} tensors")
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "no GPU is visible to torch"
    return ("Triton runs CPU tensors only through its interpreter: set TRITON_INTERPRET=1 "
            "before emcl_kernels.backends.glance_triton is first imported")


def mlp_glance(params, anchors, importances, x, y, mask, hyper, prox: bool, check_finite: bool,
               losses, skipped) -> None:
    """Launch the glance of every run (checked tensors with the run dimension, as
    :func:`emcl_kernels.glance.mlp_glance_array_` passes them)."""
    why = unavailable_reason(params[0].device.type)
    if why is not None:
        raise RuntimeError(why)
    layers = len(params) // 2
    runs, n = int(x.shape[0]), int(x.shape[1])
    rows = []
    offset = 0
    in_offsets = [0] * layers
    for l in range(1, layers):       # the hidden activations (inputs of layers 1..L-1)
        in_offsets[l] = offset
        offset += int(params[2 * l].shape[2])
    delta_offsets = []
    for l in range(layers):          # the backward signal of every layer's outputs
        delta_offsets.append(offset)
        offset += int(params[2 * l].shape[1])
    logits_off = offset
    offset += int(params[-2].shape[1])
    for l in range(layers):
        w = params[2 * l]
        rows.append([w.data_ptr(), params[2 * l + 1].data_ptr(), anchors[2 * l].data_ptr(),
                     anchors[2 * l + 1].data_ptr(), importances[2 * l].data_ptr(),
                     importances[2 * l + 1].data_ptr(), int(w.shape[2]), int(w.shape[1]),
                     in_offsets[l], delta_offsets[l]])
    device = params[0].device
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1).to(device)
    scratch = torch.empty((max(runs, 1), offset), dtype=torch.float32, device=device)
    classes = int(params[-2].shape[1])
    mask_arg = mask.view(torch.uint8) if mask is not None else x
    if runs == 0:
        return
    _glance_kernel[(runs,)](table, x, y, mask_arg, hyper, scratch, losses, skipped, n, offset,
                            logits_off, NUM_LAYERS=layers, PROX=prox, CHECK=check_finite,
                            HAS_MASK=mask is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                            BLOCK_K=triton.next_power_of_2(classes), num_warps=NUM_WARPS)
