"""EMCL's step (SPEC section 2, [note: the step call] of :mod:`emcl_kernels.interface`) as two
multi-tensor Triton kernels: :func:`emcl_step_kernel` (the update) and
:func:`emcl_check_kernel` (the read-only finite check of the gradients).

One launch of each covers every tensor of a (device, dtype) group. Program ``pid`` works on
chunk ``pid``: at most ``BLOCK`` consecutive elements of one tensor. Three int64 tables, built
on the host by :mod:`emcl_kernels.backends.triton` and cached there, tell it where:

    chunks   [C, 3]  (tensor index, first element of the chunk, elements in the chunk)
    tensors  [T, 4]  addresses of (param, anchor, importance, meta_lr or 0)
    grads    [T]     address of the gradient (a table of its own: a new one is made when the
                     gradients are reallocated, while the state table stays)

A program loads its rows, turns the addresses into typed pointers
(``tl.load(table).to(tl.pointer_type(...))``) and runs the per-element math of :func:`_update`.
Nothing else comes from the host as a number: the hyper-parameters are read from the fp64
``hyper`` tensor (raw values, :data:`~emcl_kernels.interface.HYPER_FIELDS`), combined in fp64
in the order of :mod:`emcl_kernels.reference` and rounded once to the compute dtype, per
program; the skip (``counters[FOUND]``, ``found_inf``) and the cadence (``counters[CALLS]``)
are read from the device. So a captured CUDA graph of a launch reads the current values at
every replay.

The same source runs compiled on a GPU and under Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``; see DEVELOPERS.md, "Triton"), which is why:

- bf16 stores are rounded to nearest-even by integer bit arithmetic (in :func:`_update`),
  because the interpreter truncates an fp32 -> bf16 cast where the compiled cast rounds;
  the value handed to the cast is then exact in bf16 and both paths store the same bits;
- no constant is ever a bf16/fp16 scalar (every operand is upcast before the math), and the
  finite check tests exponent bits instead of computing with the values;
- every access is masked or known to be in bounds (the interpreter does not fault on an
  out-of-bounds access, it corrupts memory);
- only builtins of ``triton.language`` are called (no ``tl.zeros``, ``tl.max``, ``tl.sum``:
  those are ``@jit`` functions of Triton's standard library, see DEVELOPERS.md), and a program
  calls one ``@jit`` helper, once per piece of its chunk (each call costs the interpreter
  milliseconds);
- the kernels have fixed launch parameters, no ``@triton.autotune``: the update is in place, so
  an autotuner's benchmarking runs would apply the step several times.
"""
from __future__ import annotations

import triton
import triton.language as tl

from emcl_kernels.interface import (COUNTER, HYPER, HYPER_FIELDS, IMPORTANCE, LR_MODE,
                                    LR_SCALE_FROM_REG, OP, PARAM_DTYPES, RUN_FOUND)

__all__ = ["emcl_step_kernel", "emcl_check_kernel", "PARAM_CODES", "CHUNK_COLUMNS",
           "TENSOR_COLUMNS"]

#: ``PARAM`` constexpr codes: the index of the dtype in the interface's ``PARAM_DTYPES``.
PARAM_CODES = {name: i for i, name in enumerate(PARAM_DTYPES)}
CHUNK_COLUMNS = 3   # tensor index (an array's: tensor * runs + run), first element, elements
TENSOR_COLUMNS = 4  # param, anchor, importance, meta_lr (0 unless recurrent)

# The interface's layouts and codes as constexpr globals (the only globals a @jit function may
# read; their values are part of the compilation cache key).
_P_F32 = tl.constexpr(PARAM_CODES["float32"])
_P_BF16 = tl.constexpr(PARAM_CODES["bfloat16"])
_P_F16 = tl.constexpr(PARAM_CODES["float16"])
_P_F64 = tl.constexpr(PARAM_CODES["float64"])
_H_INNER_LR = tl.constexpr(HYPER["inner_lr"])
_H_META_LR = tl.constexpr(HYPER["meta_lr"])
_H_REG = tl.constexpr(HYPER["reg"])
_H_GAMMA = tl.constexpr(HYPER["gamma"])
_H_DECAY = tl.constexpr(HYPER["decay"])
_H_LR_SCALE = tl.constexpr(HYPER["lr_scale"])
_H_LR_MIN = tl.constexpr(HYPER["lr_min"])
_H_LR_MAX = tl.constexpr(HYPER["lr_max"])
_H_EPS = tl.constexpr(HYPER["eps"])
_FROM_REG = tl.constexpr(LR_SCALE_FROM_REG)
_C_FOUND = tl.constexpr(COUNTER["found"])
_C_CALLS = tl.constexpr(COUNTER["calls"])
_C_SKIPPED = tl.constexpr(COUNTER["skipped"])
_C_DONE = tl.constexpr(COUNTER["done"])
_C_RUN_FOUND = tl.constexpr(RUN_FOUND)
_H_COUNT = tl.constexpr(len(HYPER_FIELDS))
_RUN_BLOCK = tl.constexpr(128)  # runs handled per iteration of the finalize's per-run loop
_OP_INNER = tl.constexpr(OP["inner"])
_OP_META = tl.constexpr(OP["meta"])
_OP_CADENCE = tl.constexpr(OP["cadence"])
_LR_RECURRENT = tl.constexpr(LR_MODE["recurrent"])
_LR_CONSTANT = tl.constexpr(LR_MODE["constant"])
_IMP_SI = tl.constexpr(IMPORTANCE["si"])
# The largest finite values of the compute dtypes (exact in fp64; the fp32 one is exact in fp32).
_MAX_F32 = tl.constexpr(3.4028234663852886e38)
_MAX_F64 = tl.constexpr(1.7976931348623157e308)


@triton.jit
def _update(p_ptr, g_ptr, a_ptr, h_ptr, lr_ptr, mask, grad_scale, inner_lr, reg, gamma_reg,
            max_finite, decay, one_minus_decay, rate_num, lr_min, lr_hi, eps,
            PARAM: tl.constexpr, DO_INNER: tl.constexpr, DO_META: tl.constexpr,
            PROX: tl.constexpr, IMPORTANCE_KIND: tl.constexpr, LR_MODE: tl.constexpr,
            HAS_GRAD_SCALE: tl.constexpr):
    """Load, update and store the elements ``mask`` selects (blocks of pointers given): the
    per-element math of SPEC section 2, in the order of operations of
    ``emcl_kernels.reference``. The scalars are already in the compute dtype; ``rate_num`` is
    r (recurrent), α₀·r (inverse) or α₀ (constant); ``lr_hi`` is min(lr_max, max_finite)."""
    cdt = a_ptr.dtype.element_ty     # compute dtype = state dtype: fp32, or fp64 for fp64 params
    theta = tl.load(p_ptr, mask=mask, other=0.0).to(cdt)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(cdt)
    theta0 = tl.load(a_ptr, mask=mask, other=0.0)
    h = tl.load(h_ptr, mask=mask, other=0.0)
    if HAS_GRAD_SCALE:
        g = g / grad_scale

    if DO_INNER:
        if PROX:
            theta_hat = theta - inner_lr * g                      # eq. 14
            c = tl.minimum(gamma_reg * h, max_finite,             # γ·λ·h (overflow: the max)
                           propagate_nan=tl.PropagateNan.ALL)
            w = c / (1 + c)                                       # eq. 19, (θ̂ + c·θ₀)/(1 + c)
            theta = theta_hat - w * (theta_hat - theta0)          #   as θ̂ − w·(θ̂ − θ₀)
        else:
            theta = theta - inner_lr * (g + reg * h * (theta - theta0))

    if DO_META:
        if IMPORTANCE_KIND == _IMP_SI:
            omega = tl.abs(g * (theta - theta0))                  # EMCL-SI
        else:
            omega = tl.abs(g * theta0)                            # eq. 13
        h = decay * h + one_minus_decay * omega                   # eq. 7
        tl.store(h_ptr, h, mask=mask)
        if LR_MODE == _LR_CONSTANT:                               # constant: α = α₀
            theta0 = theta0 - (rate_num * h) * reg * (theta0 - theta)
        else:
            if LR_MODE == _LR_RECURRENT:                          # eq. 8: α·r / (h + ε)
                alpha = tl.load(lr_ptr, mask=mask, other=0.0)
                rate = alpha * rate_num / (h + eps)
            else:                                                 # inverse: α₀·r / (h + ε)
                rate = rate_num / (h + eps)
            # clamp as torch.clamp does it: NaN stays NaN
            rate = tl.minimum(tl.maximum(rate, lr_min, propagate_nan=tl.PropagateNan.ALL),
                              lr_hi, propagate_nan=tl.PropagateNan.ALL)
            if LR_MODE == _LR_RECURRENT:
                tl.store(lr_ptr, rate, mask=mask)
            theta0 = theta0 - (rate * h) * reg * (theta0 - theta)  # eq. 10, α·h first
        tl.store(a_ptr, theta0, mask=mask)
        theta = theta0                                            # θ ← θ₀

    if PARAM == _P_BF16:
        # bf16: round to nearest-even by integer arithmetic (the interpreter's cast truncates):
        # adding 0x7FFF plus the lowest kept bit and clearing the 16 low bits rounds (and
        # overflows to inf as it should); NaN passes through. The cast is then exact.
        bits = theta.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = (bits >> 16) << 16
        rounded = tl.where(theta != theta, theta, bits.to(tl.float32, bitcast=True))
        tl.store(p_ptr, rounded.to(tl.bfloat16), mask=mask)
    elif PARAM == _P_F16:
        tl.store(p_ptr, theta.to(tl.float16), mask=mask)         # RNE compiled and interpreted
    else:
        tl.store(p_ptr, theta, mask=mask)


# n_steps, meta_every and runs change with the model, the user's cadence and the array: not
# specialized (Triton would compile a variant for 1 and for multiples of 16, possibly inside a
# CUDA graph capture)
@triton.jit(do_not_specialize=["n_steps", "meta_every", "runs"])
def emcl_step_kernel(chunks, tensors, grads, hyper, counters, steps, n_steps, meta_every, runs,
                     grad_scale_ptr, found_inf_ptr,
                     PARAM: tl.constexpr, OP: tl.constexpr, PROX: tl.constexpr,
                     IMPORTANCE_KIND: tl.constexpr, LR_MODE: tl.constexpr,
                     HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                     FINALIZE: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                     ARRAY: tl.constexpr):
    """One step of one group: one chunk of one tensor per program (see the module docstring).

    ``OP``, ``PROX``, ``IMPORTANCE_KIND``, ``LR_MODE``: the interface's codes. ``n_steps``:
    elements of ``steps`` (0: not counted; program 0 adds 1 to each after a meta update that
    was not skipped). ``meta_every``: read by ``OP == cadence`` only. ``FINALIZE``: the program
    that finishes last advances the counters ([note: last program]).

    [note: runs in Triton] ``ARRAY``: the call is an array of ``runs`` runs ([note: runs] in
    ``emcl_kernels.interface``; ``runs`` is read only then). Its chunk table never lets a chunk
    cross a run boundary, and its first column is ``tensor * runs + run``: a program takes the
    hyper-parameters of its run's row of ``hyper`` and skips when its run's found flag is set;
    program 0 counts each run's ``steps`` (``i * runs + r``) after its own flag; the last
    program adds each run's flag to its skip count and clears it. A chunk starts anywhere in
    its tensor, so its vector path also needs its first element 16-byte aligned. Every element
    goes through the same ``_update`` as in a call over its run alone. Without ``ARRAY`` the
    kernel is the single run's as it was.

    ``BLOCK``: elements per chunk; ``SUB``: elements per iteration of the scalar path
    ([note: vector path]).

    [note: vector path] The path is chosen per chunk at run time. A full chunk whose tensors
    all start at a multiple of 16 bytes (``BLOCK`` being a multiple of 8, so does the chunk)
    gets pointers marked 16-byte aligned and an all-true mask the compiler can see, hence
    16-byte accesses, ``BLOCK / (32 * num_warps)`` elements per thread in one go. A full chunk
    of a tensor at an odd address, and the tail chunk of each tensor, run the same math with
    scalar accesses, in a loop over ``SUB``-element pieces: a scalar element costs a register
    where four fp32 share one vector load, and the kernel's register count is the largest of
    its paths (ptxas, sm_90, 8 warps, BLOCK 4096: the fp32 combined step needs 106 registers
    this way, 155 when the scalar path took the whole chunk at once). One odd tensor costs only
    its own chunks the vector path. fp64 chunks are half as long (the host halves ``BLOCK``):
    the same bytes per chunk, 146 registers instead of 254.
    """
    pid = tl.program_id(0).to(tl.int64)
    # What every program reads before any program of this call can change it ([note: last
    # program]): the skip flags and, for the cadence, the call count.
    found = tl.load(counters + _C_FOUND)
    go = found == 0
    if HAS_FOUND_INF:
        go = go & (tl.load(found_inf_ptr) == 0)
    go_all = go                                     # every run's (the steps' count reads it)
    if OP == _OP_CADENCE:
        calls = tl.load(counters + _C_CALLS)
        is_meta = (calls + 1) % meta_every == 0

    row = chunks + pid * 3
    t = tl.load(row)
    start = tl.load(row + 1)
    count = tl.load(row + 2)
    hp = hyper                                      # this program's row of hyper
    if ARRAY:                                       # [note: runs in Triton]
        run = t % runs
        t = t // runs
        go = go & (tl.load(counters + _C_RUN_FOUND + run) == 0)
        hp = hyper + run * _H_COUNT
    if go:
        # Hyper-parameters: raw fp64 values, combined in fp64 in the order of
        # emcl_kernels.reference, then rounded once to the compute dtype.
        reg64 = tl.load(hp + _H_REG)
        scale64 = tl.load(hp + _H_LR_SCALE)
        decay64 = tl.load(hp + _H_DECAY)
        # r = lr_scale, or 1 / reg for the sentinel (1 when reg == 0: 1 / 1)
        r64 = tl.where(scale64 == _FROM_REG, 1.0 / tl.where(reg64 > 0, reg64, 1.0), scale64)
        if PARAM == _P_F64:
            max_finite64 = _MAX_F64
        else:
            max_finite64 = _MAX_F32
        if LR_MODE == _LR_CONSTANT:
            rate_num64 = tl.load(hp + _H_META_LR)                  # α₀
        elif LR_MODE == _LR_RECURRENT:
            rate_num64 = r64                                       # r
        else:
            rate_num64 = tl.load(hp + _H_META_LR) * r64            # α₀·r
        lr_hi64 = tl.minimum(tl.load(hp + _H_LR_MAX), max_finite64)

        row_t = tensors + t * 4
        p_addr = tl.load(row_t)
        a_addr = tl.load(row_t + 1)
        h_addr = tl.load(row_t + 2)
        g_addr = tl.load(grads + t)
        if PARAM == _P_F32:
            p_ptr = p_addr.to(tl.pointer_type(tl.float32)) + start
            g_ptr = g_addr.to(tl.pointer_type(tl.float32)) + start
        elif PARAM == _P_BF16:
            p_ptr = p_addr.to(tl.pointer_type(tl.bfloat16)) + start
            g_ptr = g_addr.to(tl.pointer_type(tl.bfloat16)) + start
        elif PARAM == _P_F16:
            p_ptr = p_addr.to(tl.pointer_type(tl.float16)) + start
            g_ptr = g_addr.to(tl.pointer_type(tl.float16)) + start
        else:
            p_ptr = p_addr.to(tl.pointer_type(tl.float64)) + start
            g_ptr = g_addr.to(tl.pointer_type(tl.float64)) + start
        if PARAM == _P_F64:
            state = tl.pointer_type(tl.float64)
        else:
            state = tl.pointer_type(tl.float32)
        a_ptr = a_addr.to(state) + start
        h_ptr = h_addr.to(state) + start
        lr_ptr = a_ptr                                     # not read unless recurrent
        any_addr = p_addr | g_addr | a_addr | h_addr
        if LR_MODE == _LR_RECURRENT:
            lr_addr = tl.load(row_t + 3)
            lr_ptr = lr_addr.to(state) + start
            any_addr = any_addr | lr_addr
        aligned = (any_addr & 15) == 0
        if ARRAY:  # the chunk's first element too (16 bytes of the parameter dtype)
            if PARAM == _P_F64:
                aligned = aligned & ((start & 1) == 0)
            elif PARAM == _P_F32:
                aligned = aligned & ((start & 3) == 0)
            else:
                aligned = aligned & ((start & 7) == 0)

        cdt = a_ptr.dtype.element_ty
        grad_scale = tl.full([], 1.0, cdt)
        if HAS_GRAD_SCALE:
            grad_scale = tl.load(grad_scale_ptr).to(cdt)
        inner_lr = tl.load(hp + _H_INNER_LR).to(cdt)
        reg = reg64.to(cdt)
        gamma_reg = (tl.load(hp + _H_GAMMA) * reg64).to(cdt)      # γ·λ
        max_finite = tl.full([], max_finite64, cdt)
        decay = decay64.to(cdt)
        one_minus_decay = (1.0 - decay64).to(cdt)                 # 1 − η
        rate_num = rate_num64.to(cdt)
        lr_min = tl.load(hp + _H_LR_MIN).to(cdt)
        lr_hi = lr_hi64.to(cdt)
        eps = tl.load(hp + _H_EPS).to(cdt)

        # The same _update call in each branch ([note: vector path]); the cadence picks INNER
        # or INNER_META at run time (one uniform branch per program). Written out on purpose:
        # the same branches behind one @triton.jit helper (vector/scalar choice inside it) cost
        # 10-40 more registers on sm_90 for fp32/bf16/fp16 (ptxas -v, 8 warps, BLOCK 4096;
        # e.g. the fp32 cadence step 104 -> 127), hence fewer resident warps.
        offs = tl.arange(0, BLOCK)
        soffs = tl.arange(0, SUB)
        vector = (count == BLOCK) & aligned
        if OP == _OP_CADENCE:
            if is_meta:
                if vector:
                    _update(tl.multiple_of(p_ptr, 16) + offs, tl.multiple_of(g_ptr, 16) + offs,
                            tl.multiple_of(a_ptr, 16) + offs, tl.multiple_of(h_ptr, 16) + offs,
                            tl.multiple_of(lr_ptr, 16) + offs, offs < BLOCK, grad_scale,
                            inner_lr, reg, gamma_reg, max_finite, decay, one_minus_decay,
                            rate_num, lr_min, lr_hi, eps, PARAM, True, True, PROX,
                            IMPORTANCE_KIND, LR_MODE, HAS_GRAD_SCALE)
                else:
                    for s in range(0, count, SUB):
                        o = s + soffs
                        _update(p_ptr + o, g_ptr + o, a_ptr + o, h_ptr + o, lr_ptr + o,
                                o < count, grad_scale, inner_lr, reg, gamma_reg, max_finite,
                                decay, one_minus_decay, rate_num, lr_min, lr_hi, eps, PARAM,
                                True, True, PROX, IMPORTANCE_KIND, LR_MODE, HAS_GRAD_SCALE)
            else:
                if vector:
                    _update(tl.multiple_of(p_ptr, 16) + offs, tl.multiple_of(g_ptr, 16) + offs,
                            tl.multiple_of(a_ptr, 16) + offs, tl.multiple_of(h_ptr, 16) + offs,
                            tl.multiple_of(lr_ptr, 16) + offs, offs < BLOCK, grad_scale,
                            inner_lr, reg, gamma_reg, max_finite, decay, one_minus_decay,
                            rate_num, lr_min, lr_hi, eps, PARAM, True, False, PROX,
                            IMPORTANCE_KIND, LR_MODE, HAS_GRAD_SCALE)
                else:
                    for s in range(0, count, SUB):
                        o = s + soffs
                        _update(p_ptr + o, g_ptr + o, a_ptr + o, h_ptr + o, lr_ptr + o,
                                o < count, grad_scale, inner_lr, reg, gamma_reg, max_finite,
                                decay, one_minus_decay, rate_num, lr_min, lr_hi, eps, PARAM,
                                True, False, PROX, IMPORTANCE_KIND, LR_MODE, HAS_GRAD_SCALE)
        else:
            if vector:
                _update(tl.multiple_of(p_ptr, 16) + offs, tl.multiple_of(g_ptr, 16) + offs,
                        tl.multiple_of(a_ptr, 16) + offs, tl.multiple_of(h_ptr, 16) + offs,
                        tl.multiple_of(lr_ptr, 16) + offs, offs < BLOCK, grad_scale,
                        inner_lr, reg, gamma_reg, max_finite, decay, one_minus_decay,
                        rate_num, lr_min, lr_hi, eps, PARAM, OP != _OP_META, OP != _OP_INNER,
                        PROX, IMPORTANCE_KIND, LR_MODE, HAS_GRAD_SCALE)
            else:
                for s in range(0, count, SUB):
                    o = s + soffs
                    _update(p_ptr + o, g_ptr + o, a_ptr + o, h_ptr + o, lr_ptr + o,
                            o < count, grad_scale, inner_lr, reg, gamma_reg, max_finite,
                            decay, one_minus_decay, rate_num, lr_min, lr_hi, eps, PARAM,
                            OP != _OP_META, OP != _OP_INNER, PROX, IMPORTANCE_KIND, LR_MODE,
                            HAS_GRAD_SCALE)

    # steps: +1 per param after a meta update that was not skipped (program 0, every param,
    # empty ones included: they have no chunk); in an array, per run: element i * runs + r
    # after run r's own flag
    if OP != _OP_INNER:
        if pid == 0:
            counted = go_all
            if OP == _OP_CADENCE:
                counted = go_all & is_meta
            if counted:
                soffs = tl.arange(0, BLOCK)
                for s in range(0, n_steps, BLOCK):
                    smask = (s + soffs) < n_steps
                    v = tl.load(steps + s + soffs, mask=smask, other=0.0)
                    if ARRAY:
                        flags = tl.load(counters + _C_RUN_FOUND + (s + soffs) % runs,
                                        mask=smask, other=1)
                        v = tl.where(flags == 0, v + 1.0, v)
                    else:
                        v = v + 1.0
                    tl.store(steps + s + soffs, v, mask=smask)

    if FINALIZE:
        # [note: last program] counters[FOUND] and counters[CALLS] are read above by every
        # program, and written below by one, after all the others are done with them:
        # 1. every thread of a program has done its loads (of FOUND, CALLS, found_inf) before
        #    the barrier; the atomic that follows is a release (acq_rel) at GPU scope, and PTX
        #    release is cumulative, so the whole program's loads are ordered before it;
        # 2. the atomics on DONE form one modification order: exactly one program reads
        #    num_programs - 1, and its acquire makes every other program's release (hence all
        #    their loads) happen before what it does next;
        # 3. that program alone then writes CALLS, SKIPPED, FOUND (from the values it read
        #    itself: nobody else writes them during the launch) and puts DONE back to 0.
        # The next kernel on the stream (the next group's step, the next step's check) sees
        # those writes by stream order. In the interpreter programs run one after another and
        # the last one in the grid is the last to add.
        tl.debug_barrier()
        done = tl.atomic_add(counters + _C_DONE, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            if OP == _OP_CADENCE:
                tl.store(counters + _C_CALLS, calls + 1)
            skipped = tl.load(counters + _C_SKIPPED)
            tl.store(counters + _C_SKIPPED, skipped + (found != 0).to(tl.int64))
            tl.store(counters + _C_FOUND, found * 0)
            if ARRAY:  # each run's skip count += its flag, then the flag is cleared
                roffs = tl.arange(0, _RUN_BLOCK)
                for s in range(0, runs, _RUN_BLOCK):
                    rmask = (s + roffs) < runs
                    flag_ptr = counters + _C_RUN_FOUND + s + roffs
                    flags = tl.load(flag_ptr, mask=rmask, other=0)
                    skip_ptr = flag_ptr + runs
                    skips = tl.load(skip_ptr, mask=rmask, other=0)
                    tl.store(skip_ptr, skips + (flags != 0).to(tl.int64), mask=rmask)
                    tl.store(flag_ptr, flags * 0, mask=rmask)
            tl.store(counters + _C_DONE, done * 0)


@triton.jit(do_not_specialize=["runs"])
def emcl_check_kernel(chunks, grads, counters, runs, PARAM: tl.constexpr, BLOCK: tl.constexpr,
                      ARRAY: tl.constexpr):
    """``counters[FOUND] = 1`` when an element of a chunk of the gradients is inf or NaN; in an
    array of ``runs`` runs (``ARRAY``; its chunk table as the update's, [note: runs in
    Triton]), ``counters[RUN_FOUND + r] = 1`` for the run ``r`` of the chunk.

    Read-only on the gradients: each element's exponent bits are tested (all ones: inf or
    NaN), and the flag is stored through a block of pointers to the flag masked by
    the test (no reduction, so no standard-library @jit function; every writer writes 1). The
    update kernel, launched after it on the same stream, reads the flag."""
    pid = tl.program_id(0).to(tl.int64)
    row = chunks + pid * 3
    t = tl.load(row)
    start = tl.load(row + 1)
    count = tl.load(row + 2)
    if ARRAY:
        run = t % runs
        t = t // runs
    g_addr = tl.load(grads + t)
    offs = tl.arange(0, BLOCK)
    if PARAM == _P_F32:
        g_ptr = g_addr.to(tl.pointer_type(tl.float32)) + start
    elif PARAM == _P_BF16:
        g_ptr = g_addr.to(tl.pointer_type(tl.bfloat16)) + start
    elif PARAM == _P_F16:
        g_ptr = g_addr.to(tl.pointer_type(tl.float16)) + start
    else:
        g_ptr = g_addr.to(tl.pointer_type(tl.float64)) + start
    # [note: alignment hint] tl.multiple_of marks the op that defines g_ptr, which both
    # branches share: the hint holds in the unaligned branch too. What keeps that branch scalar
    # is its mask, `offs < count` with count read from the table (no divisibility the compiler
    # can see); an unmasked load there is vectorized like the aligned one and faults on an odd
    # address (the PTX test checks that the `& 15` test survives).
    aligned = (g_addr & 15) == 0
    if ARRAY:  # the chunk's first element too (a chunk starts anywhere in its tensor)
        if PARAM == _P_F64:
            aligned = aligned & ((start & 1) == 0)
        elif PARAM == _P_F32:
            aligned = aligned & ((start & 3) == 0)
        else:
            aligned = aligned & ((start & 7) == 0)
    if (count == BLOCK) & aligned:
        g = tl.load(tl.multiple_of(g_ptr, 16) + offs)
    else:
        g = tl.load(g_ptr + offs, mask=offs < count, other=0.0)
    if PARAM == _P_F64:
        bits = g.to(tl.uint64, bitcast=True)
        bad = (bits & 0x7FF0000000000000) == 0x7FF0000000000000
    else:
        bits = g.to(tl.float32).to(tl.uint32, bitcast=True)   # bf16/fp16 -> fp32 is exact
        bad = (bits & 0x7F800000) == 0x7F800000
    if ARRAY:
        flag = counters + _C_RUN_FOUND + run + offs * 0
    else:
        flag = counters + _C_FOUND + offs * 0
    tl.store(flag, tl.full([BLOCK], 1, tl.int64), mask=bad)
