"""The op interface every backend implements, written once.

Nothing here imports torch: ``setup.py`` and the C++ header generator read these tables too.
``csrc/emcl_interface.h`` is generated from this file (``python -m emcl_kernels.interface``
prints it; ``tests/test_interface.py`` fails when the committed header is stale), and the
compiled extension reports the layout it was built with (``torch.ops.emcl.interface()``), so
that a stale build is refused with a message instead of reading the wrong slots.

[note: the step call] One step of one (device, dtype) group of tensors is one call

    backend.step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, *,
                 op, prox, importance, lr_mode, meta_every, check, finalize,
                 grad_scale=None, found_inf=None, runs=1)

and when a step covers several groups on one device, ``backend.check_finite(grads, counters,
runs)`` is called for every group first and every ``step`` then has ``check=False``, so that one
non-finite gradient anywhere skips the whole step in every group (in an array of runs: that
run, in every group; see [note: runs]).

Tensors (all on one device; Python validated them before the call, the C++ ops check them
again cheaply so that a direct ``torch.ops.emcl`` call cannot crash):

- ``params``, ``grads``: θ and g, one parameter dtype (:data:`PARAM_DTYPES`).
- ``anchors``, ``importances``: θ₀ and h in the compute dtype (fp32; fp64 for fp64 params).
- ``meta_lrs``: α, one tensor per param when ``lr_mode`` is recurrent, else an empty list.
- Tensor ``i`` of every list has the shape and the strides of ``params[i]``, and is dense and
  non-overlapping (contiguous, channels_last, ...): a kernel treats it as ``numel`` elements
  from its data pointer. No two tensors overlap in memory.
- ``steps``: 1-d fp32 of ``runs`` elements per param, param-major (element ``i * runs + r`` is
  run ``r``'s meta-step count of param ``i``, the ``step`` of its optimizer state), or empty (not
  counted). ``+1`` for every meta update that is not skipped.
- ``hyper``: contiguous fp64, ``runs`` rows of :data:`HYPER_FIELDS` (row ``r`` is run ``r``'s;
  1-d for ``runs == 1``) (raw values; the kernels
  combine them in fp64, in the order of ``emcl_kernels.reference``, and round once to the
  compute dtype). ``lr_scale`` = :data:`LR_SCALE_FROM_REG` means ``1 / reg`` (1 when reg is 0).
- ``counters``: 1-d contiguous int64, laid out by :data:`COUNTER_FIELDS`, one per device,
  shared by every call of a step on that device; for ``runs > 1`` followed by ``runs`` per-run
  found flags and ``runs`` per-run skip counts (:func:`counters_size`).
- ``runs`` (>= 1): the number of runs the call's tensors hold ([note: runs]).
- ``grad_scale``, ``found_inf``: None or one-element fp32 (``torch.amp.GradScaler``): g is
  divided by ``grad_scale``; ``found_inf != 0`` skips the step.

Scalars: ``op`` (:data:`OPS`), ``prox`` (bool), ``importance`` (:data:`IMPORTANCE_KINDS`),
``lr_mode`` (:data:`LR_MODES`), ``meta_every`` (>= 1; read by ``op=CADENCE`` only), ``check``
(run :func:`check_finite` over this call's grads first), ``finalize`` (this is the last call of
the step on this device: advance the counters, see below).

What a call does:

1. ``check``: any inf/NaN in ``grads`` sets ``counters[FOUND] = 1`` (``runs > 1``: any inf/NaN
   in run ``r``'s elements sets ``counters[RUN_FOUND + r] = 1``).
2. ``skip = counters[FOUND] != 0 or (found_inf is given and found_inf != 0)``; run ``r`` skips
   when ``skip`` or ``counters[RUN_FOUND + r] != 0``.
3. ``op``: INNER, META or INNER_META; CADENCE is INNER_META when
   ``(counters[CALLS] + 1) % meta_every == 0``, else INNER (the counter is read before any
   call of the step changes it).
4. For every run that does not skip: the update of SPEC section 2 on its elements, with its row
   of ``hyper``; its ``steps`` ``+= 1`` when it was a meta update.
5. ``finalize``: ``counters[CALLS] += 1`` if ``op == CADENCE``; ``counters[SKIPPED] += 1`` if
   ``counters[FOUND] != 0``; then ``counters[FOUND] = 0``; for ``runs > 1`` and every run ``r``:
   ``counters[RUN_SKIPPED + r] += 1`` if ``counters[RUN_FOUND + r] != 0``, then
   ``counters[RUN_FOUND + r] = 0``. (``counters[DONE]`` is scratch for the GPU kernels'
   last-block bookkeeping and is 0 between calls.)

[note: runs] An array of ``runs`` runs: every tensor of the call holds ``numel / runs`` elements
of each run, run-major in memory (run ``r`` owns flat elements ``[r * n, (r + 1) * n)``, ``n =
numel / runs``: the leading dimension is the run and the outermost in memory). Run ``r`` computes
exactly what a call over its slices alone with ``hyper``'s row ``r`` computes, bit for bit; its
non-finite gradient skips it alone (a GradScaler's ``found_inf`` and ``counters[FOUND]`` skip
every run). One call still serves the whole (device, dtype) group, whatever ``runs``.

Every hyper-parameter is within :func:`emcl_kernels.validation`'s domain, so no scalar the
kernels form overflows (see [note: domains] there).
"""
from __future__ import annotations

__all__ = ["HYPER_FIELDS", "HYPER", "LR_SCALE_FROM_REG", "HYPER_DEFAULTS", "resolve_lr_scale",
           "COUNTER_FIELDS", "COUNTER", "RUN_FOUND", "counters_size", "run_skipped_at", "OPS",
           "OP", "LR_MODES", "LR_MODE", "IMPORTANCE_KINDS", "IMPORTANCE", "PARAM_DTYPES",
           "INTERFACE_VERSION", "STEP_ARGS", "STEP_POSITIONAL", "CHECK_FINITE_ARGS",
           "STEP_SCHEMA", "CHECK_FINITE_SCHEMA", "layout_string", "render_header"]

#: Bumped whenever the meaning of an argument changes (the header and the build carry it).
INTERFACE_VERSION = 3

#: Layout of ``hyper`` (fp64): raw hyper-parameters, SPEC section 1's names.
HYPER_FIELDS = ("inner_lr", "meta_lr", "reg", "gamma", "decay", "lr_scale", "lr_min", "lr_max",
                "eps")
HYPER = {name: i for i, name in enumerate(HYPER_FIELDS)}
#: ``hyper[LR_SCALE] == LR_SCALE_FROM_REG``: r = 1 / reg (1 when reg == 0), the default.
LR_SCALE_FROM_REG = -1.0
#: The value a call gets for a hyper-parameter it does not name (``lr_scale``: the sentinel).
HYPER_DEFAULTS = {"lr_max": float("inf"), "eps": 1e-8, "lr_scale": LR_SCALE_FROM_REG}


def resolve_lr_scale(lr_scale, reg):
    """r from ``hyper``'s numbers: ``lr_scale``, or 1 / reg (1 when reg is 0) for None or the
    :data:`LR_SCALE_FROM_REG` sentinel. The host's rule; the kernels' are ``lr_scale_of`` in
    csrc/emcl_math.h and the update kernel's ``r64`` in triton_kernels.py."""
    if lr_scale is not None and lr_scale != LR_SCALE_FROM_REG:
        return lr_scale
    return 1.0 / reg if reg > 0 else 1.0

#: Layout of ``counters`` (int64, one per device).
COUNTER_FIELDS = ("found", "calls", "skipped", "done")
COUNTER = {name: i for i, name in enumerate(COUNTER_FIELDS)}
#: For ``runs > 1``: run ``r``'s found flag is ``counters[RUN_FOUND + r]``, its skip count
#: ``counters[run_skipped_at(runs) + r]``.
RUN_FOUND = len(COUNTER_FIELDS)


def run_skipped_at(runs: int) -> int:
    """Where the per-run skip counts start in ``counters`` for ``runs`` runs."""
    return RUN_FOUND + runs


def counters_size(runs: int = 1) -> int:
    """The length of a device's ``counters`` for arrays of ``runs`` runs (1: no array)."""
    return len(COUNTER_FIELDS) + (2 * runs if runs > 1 else 0)

#: ``op``: which update a call does.
OPS = ("inner", "meta", "inner_meta", "cadence")
OP = {name: i for i, name in enumerate(OPS)}
#: ``lr_mode`` codes (SPEC section 2).
LR_MODES = ("recurrent", "inverse", "constant")
LR_MODE = {name: i for i, name in enumerate(LR_MODES)}
#: ``importance`` codes.
IMPORTANCE_KINDS = ("taylor", "si")
IMPORTANCE = {name: i for i, name in enumerate(IMPORTANCE_KINDS)}
#: Parameter dtypes, by torch name.
PARAM_DTYPES = ("float32", "bfloat16", "float16", "float64")

# The arguments of ``step``, in order: (name, schema type). Positional up to ``counters``,
# keyword-only after it. [note: schemas] The ops update their tensors in place and return
# nothing, like torch's _fused_adam_; every written list has its own alias set so that
# functionalization (torch.compile) knows what each call mutates.
STEP_ARGS = (
    ("params", "Tensor(a!)[]"), ("grads", "Tensor[]"), ("anchors", "Tensor(b!)[]"),
    ("importances", "Tensor(c!)[]"), ("meta_lrs", "Tensor(d!)[]"), ("steps", "Tensor(e!)"),
    ("hyper", "Tensor"), ("counters", "Tensor(f!)"),
    ("op", "int"), ("prox", "bool"), ("importance", "int"), ("lr_mode", "int"),
    ("meta_every", "int"), ("check", "bool"), ("finalize", "bool"),
    ("grad_scale", "Tensor?=None"), ("found_inf", "Tensor?=None"), ("runs", "int=1"),
)
STEP_POSITIONAL = 8  # params .. counters
CHECK_FINITE_ARGS = (("grads", "Tensor[]"), ("counters", "Tensor(a!)"), ("runs", "int=1"))


def _schema(name: str, args, positional: int) -> str:
    parts = []
    for i, (arg, typ) in enumerate(args):
        if i == positional:
            parts.append("*")
        typ, _, default = typ.partition("=")
        parts.append(f"{typ} {arg}" + (f"={default}" if default else ""))
    return f"{name}({', '.join(parts)}) -> ()"


STEP_SCHEMA = _schema("step_", STEP_ARGS, STEP_POSITIONAL)
CHECK_FINITE_SCHEMA = _schema("check_finite_", CHECK_FINITE_ARGS, len(CHECK_FINITE_ARGS))


def layout_string() -> str:
    """The tables as one line; the compiled extension returns the same line from
    ``torch.ops.emcl.interface()`` when it was built from this version."""
    parts = [f"v{INTERFACE_VERSION}", "hyper=" + ",".join(HYPER_FIELDS),
             "counters=" + ",".join(COUNTER_FIELDS), "ops=" + ",".join(OPS),
             "lr_modes=" + ",".join(LR_MODES), "importance=" + ",".join(IMPORTANCE_KINDS)]
    return ";".join(parts)


def _enum(name: str, cpp_names, values) -> list:
    lines = [f"enum class {name} : int {{"]
    lines += [f"  {cpp} = {i}," for i, cpp in enumerate(cpp_names)]
    lines.append("};")
    return lines


def _camel(name: str) -> str:
    return "k" + "".join(part.capitalize() for part in name.split("_"))


def render_header() -> str:
    """``csrc/emcl_interface.h``: these tables as C++ constants."""
    out = ["// GENERATED by `python -m emcl_kernels.interface > csrc/emcl_interface.h` from",
           "// emcl_kernels/interface.py: do not edit (tests/test_interface.py checks it is current).",
           "#pragma once", "", "namespace emcl {", "",
           f"constexpr int kInterfaceVersion = {INTERFACE_VERSION};",
           f'constexpr const char* kLayout = "{layout_string()}";',
           f'constexpr const char* kStepSchema = "{STEP_SCHEMA}";',
           f'constexpr const char* kCheckFiniteSchema = "{CHECK_FINITE_SCHEMA}";', "",
           "// Slots of the fp64 `hyper` tensor.",
           "namespace hyper {"]
    out += [f"constexpr int {_camel(n)} = {i};" for i, n in enumerate(HYPER_FIELDS)]
    out += [f"constexpr int kCount = {len(HYPER_FIELDS)};", "}  // namespace hyper",
            f"constexpr double kLrScaleFromReg = {LR_SCALE_FROM_REG!r};", "",
            "// Slots of the int64 `counters` tensor.", "namespace counter {"]
    out += [f"constexpr int {_camel(n)} = {i};" for i, n in enumerate(COUNTER_FIELDS)]
    out += [f"constexpr int kCount = {len(COUNTER_FIELDS)};",
            "// runs > 1: per-run found flags at kRunFound + r, skip counts at kRunFound + runs + r",
            f"constexpr int kRunFound = {len(COUNTER_FIELDS)};", "}  // namespace counter", ""]
    out += _enum("Op", [_camel(n) for n in OPS], OPS)
    out += _enum("LrMode", [_camel(n) for n in LR_MODES], LR_MODES)
    out += _enum("Importance", [_camel(n) if n != "si" else "kSI" for n in IMPORTANCE_KINDS],
                 IMPORTANCE_KINDS)
    out += ["", "}  // namespace emcl", ""]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover - a generator
    import sys
    sys.stdout.write(render_header())
