"""EMCL's updates (SPEC section 2) as one multi-tensor Triton kernel.

One launch covers every tensor of a (device, dtype) group. Program ``pid`` updates chunk
``pid``: ``BLOCK`` consecutive elements of one tensor. Three int64 tables, built on the host
by :mod:`emcl_kernels.backends.triton` and cached there, tell it where:

    chunks   [C, 2]  (tensor index, first element of the chunk)
    tensors  [T, 5]  addresses of (param, anchor, importance, meta_lr or 0) and numel
    grads    [T]     address of the gradient (a table of its own: refreshed when the
                     gradients are reallocated, while the state table stays)

A program loads its row of each, turns the addresses into typed pointers
(``tl.load(table).to(tl.pointer_type(...))``) and runs the per-element math of the modes chosen
by ``tl.constexpr`` flags. The math is done in fp32 (fp64 for fp64 parameters); the state is
fp32 (fp64). The same source runs compiled on a GPU and under Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``; see DEVELOPERS.md, "Triton"), which is why:

- bf16 stores are rounded to nearest-even by integer bit arithmetic (:func:`_round_to_bf16`),
  because the interpreter truncates an fp32 -> bf16 cast where the compiled cast rounds;
  the value handed to the cast is then exact in bf16 and both paths store the same bits;
- no constant is ever a bf16/fp16 scalar (every operand is upcast before the math);
- every access is masked or known to be in bounds (the interpreter does not fault on an
  out-of-bounds access, it corrupts memory);
- the kernel has fixed launch parameters, no ``@triton.autotune``: the kernel updates in place,
  so an autotuner's benchmarking runs would apply the step several times (and the interpreter
  rejects multi-config autotuning anyway).

Hyper-parameters come in a small fp64 tensor (``hyper``, laid out by :data:`HYPER_FIELDS`), so
that fp64 parameters get fp64 hyper-parameters; fp32 math reads them rounded to fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["emcl_kernel", "HYPER_FIELDS", "PARAM_CODES", "LR_MODE_CODES",
           "TENSOR_COLUMNS", "CHUNK_COLUMNS"]

# Codes of the constexpr arguments (ints, which every Triton version takes as constexprs).
PARAM_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}
LR_MODE_CODES = {"recurrent": 0, "inverse": 1, "constant": 2}

# Layout of the ``hyper`` tensor: scalars already combined on the host in fp64, in the same
# order of operations as emcl_kernels.reference (Python evaluates ``gamma * reg * h`` as
# ``(gamma * reg) * h``, and so on).
HYPER_FIELDS = (
    "inner_lr",        # β
    "reg",             # λ
    "gamma_reg",       # γ·λ                     (prox inner step)
    "decay",           # η
    "one_minus_decay",  # 1 − η
    "lr_scale",        # r                       (recurrent)
    "base_rate",       # α₀·r                    (inverse)
    "meta_lr",         # α₀                      (constant)
    "lr_min",
    "lr_max",
    "eps",             # ε
    "max_finite",      # the largest finite value of the compute dtype
)
TENSOR_COLUMNS = 5  # param, anchor, importance, meta_lr, numel
CHUNK_COLUMNS = 2   # tensor index, start


@triton.jit
def _update(p_ptr, g_ptr, a_ptr, h_ptr, lr_ptr, mask, hyper, grad_scale, ok,
            PARAM: tl.constexpr, DO_INNER: tl.constexpr, DO_META: tl.constexpr,
            PROX: tl.constexpr, SI: tl.constexpr, LR_MODE: tl.constexpr,
            HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr):
    """Load, update and store the elements ``mask`` selects (blocks of pointers given).

    Written without calls to other jit functions: each such call costs the interpreter
    milliseconds per program."""
    cdt = a_ptr.dtype.element_ty     # compute dtype = state dtype: fp32, or fp64 for fp64 params
    if HAS_FOUND_INF:
        mask = mask & ok             # found_inf != 0: read nothing, write nothing
    theta = tl.load(p_ptr, mask=mask, other=0.0).to(cdt)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(cdt)
    theta0 = tl.load(a_ptr, mask=mask, other=0.0)
    h = tl.load(h_ptr, mask=mask, other=0.0)
    if HAS_GRAD_SCALE:
        g = g / grad_scale
    reg = tl.load(hyper + 1).to(cdt)

    if DO_INNER:
        inner_lr = tl.load(hyper + 0).to(cdt)
        if PROX:
            theta_hat = theta - inner_lr * g                      # eq. 14
            c = tl.load(hyper + 2).to(cdt) * h                    # γ·λ·h (overflow: the max)
            c = tl.minimum(c, tl.load(hyper + 11).to(cdt), propagate_nan=tl.PropagateNan.ALL)
            w = c / (1 + c)                                       # eq. 19, (θ̂ + c·θ₀)/(1 + c)
            theta = theta_hat - w * (theta_hat - theta0)          #   as θ̂ − w·(θ̂ − θ₀)
        else:
            theta = theta - inner_lr * (g + reg * h * (theta - theta0))

    if DO_META:
        if SI:
            omega = tl.abs(g * (theta - theta0))                  # EMCL-SI
        else:
            omega = tl.abs(g * theta0)                            # eq. 13
        decay = tl.load(hyper + 3).to(cdt)
        one_minus_decay = tl.load(hyper + 4).to(cdt)
        h = decay * h + one_minus_decay * omega                   # eq. 7
        tl.store(h_ptr, h, mask=mask)
        if LR_MODE == 2:                                          # constant: α = α₀
            theta0 = theta0 - (tl.load(hyper + 7).to(cdt) * h) * reg * (theta0 - theta)
        else:
            lr_min = tl.load(hyper + 8).to(cdt)
            lr_max = tl.load(hyper + 9).to(cdt)
            eps = tl.load(hyper + 10).to(cdt)
            if LR_MODE == 0:                                      # recurrent, eq. 8
                alpha = tl.load(lr_ptr, mask=mask, other=0.0)
                rate = alpha * tl.load(hyper + 5).to(cdt) / (h + eps)
            else:                                                 # inverse: α₀·r / (h + ε)
                rate = tl.load(hyper + 6).to(cdt) / (h + eps)
            # clamp as torch.clamp does it: NaN stays NaN
            rate = tl.minimum(tl.maximum(rate, lr_min, propagate_nan=tl.PropagateNan.ALL),
                              lr_max, propagate_nan=tl.PropagateNan.ALL)
            if LR_MODE == 0:
                tl.store(lr_ptr, rate, mask=mask)
            theta0 = theta0 - (rate * h) * reg * (theta0 - theta)  # eq. 10
        tl.store(a_ptr, theta0, mask=mask)
        theta = theta0                                            # θ ← θ₀

    if PARAM == 1:
        # bf16: round to nearest-even by integer arithmetic (the interpreter's cast truncates):
        # adding 0x7FFF plus the lowest kept bit and clearing the 16 low bits rounds (and
        # overflows to inf as it should); NaN passes through. The cast is then exact.
        bits = theta.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = (bits >> 16) << 16
        rounded = tl.where(theta != theta, theta, bits.to(tl.float32, bitcast=True))
        tl.store(p_ptr, rounded.to(tl.bfloat16), mask=mask)
    elif PARAM == 2:
        tl.store(p_ptr, theta.to(tl.float16), mask=mask)         # RNE compiled and interpreted
    else:
        tl.store(p_ptr, theta, mask=mask)


@triton.jit
def emcl_kernel(chunks, tensors, grads, hyper, grad_scale_ptr, found_inf_ptr,
                PARAM: tl.constexpr, DO_INNER: tl.constexpr, DO_META: tl.constexpr,
                PROX: tl.constexpr, SI: tl.constexpr, LR_MODE: tl.constexpr,
                HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of one tensor per program. See the module docstring for the tables.

    ``PARAM``: the parameter dtype (:data:`PARAM_CODES`). ``ALIGNED``: every address in the
    tables is a multiple of 16 bytes, so (``BLOCK`` being a multiple of 8) every chunk starts
    16-byte aligned and full chunks get vector accesses."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(chunks + pid * 2)
    start = tl.load(chunks + pid * 2 + 1)
    row = tensors + t * 5
    numel = tl.load(row + 4)
    p_addr = tl.load(row + 0)
    g_addr = tl.load(grads + t)
    if PARAM == 0:
        p_ptr = p_addr.to(tl.pointer_type(tl.float32)) + start
        g_ptr = g_addr.to(tl.pointer_type(tl.float32)) + start
    elif PARAM == 1:
        p_ptr = p_addr.to(tl.pointer_type(tl.bfloat16)) + start
        g_ptr = g_addr.to(tl.pointer_type(tl.bfloat16)) + start
    elif PARAM == 2:
        p_ptr = p_addr.to(tl.pointer_type(tl.float16)) + start
        g_ptr = g_addr.to(tl.pointer_type(tl.float16)) + start
    else:
        p_ptr = p_addr.to(tl.pointer_type(tl.float64)) + start
        g_ptr = g_addr.to(tl.pointer_type(tl.float64)) + start
    if PARAM == 3:
        state = tl.pointer_type(tl.float64)
    else:
        state = tl.pointer_type(tl.float32)
    a_ptr = tl.load(row + 1).to(state) + start
    h_ptr = tl.load(row + 2).to(state) + start
    lr_ptr = a_ptr                                     # not read unless recurrent
    if LR_MODE == 0:
        lr_ptr = tl.load(row + 3).to(state) + start
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        a_ptr = tl.multiple_of(a_ptr, 16)
        h_ptr = tl.multiple_of(h_ptr, 16)
        lr_ptr = tl.multiple_of(lr_ptr, 16)

    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr).to(a_ptr.dtype.element_ty)
    offs = tl.arange(0, BLOCK)
    ok = offs < BLOCK
    if HAS_FOUND_INF:
        # Compared as a block: the interpreter cannot combine a comparison of a loaded scalar
        # with a block mask (numpy raises on the '&'). tl.full, not tl.zeros: tl.zeros is a
        # @jit function of triton.language, compiled-only if triton was imported before
        # TRITON_INTERPRET=1 was set.
        ok = (tl.full([BLOCK], 0.0, tl.float32) + tl.load(found_inf_ptr)) == 0

    count = numel - start
    # Full chunks get a mask the compiler can prove constant (vector accesses); the last chunk
    # of each tensor masks its tail. The same code runs in both branches, only the mask differs
    # (one mask chosen at run time would hide its constancy from the compiler).
    if count >= BLOCK:
        _update(p_ptr + offs, g_ptr + offs, a_ptr + offs, h_ptr + offs, lr_ptr + offs,
                offs < BLOCK, hyper, grad_scale, ok, PARAM, DO_INNER, DO_META, PROX, SI,
                LR_MODE, HAS_GRAD_SCALE, HAS_FOUND_INF)
    else:
        _update(p_ptr + offs, g_ptr + offs, a_ptr + offs, h_ptr + offs, lr_ptr + offs,
                offs < count, hyper, grad_scale, ok, PARAM, DO_INNER, DO_META, PROX, SI,
                LR_MODE, HAS_GRAD_SCALE, HAS_FOUND_INF)
