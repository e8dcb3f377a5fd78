"""EMCL's glance on an MLP as one fused call: one-sample inner steps without a gradient in memory.

EMCL's inner loop (paper Algorithm 1) runs, per incoming batch and per glance, one inner step
per sample: the forward pass of one sample, the cross-entropy backward, and the inner update
(SPEC section 2, eqs. 14, 15, 19) of every parameter. On an MLP the gradient of a one-sample
step is, for each layer, an outer product (the layer's backward signal times its input), so it
need not exist in memory: :func:`mlp_glance_` forms it element by element inside the update
and moves only θ (read for the forward pass, read and written by the update), θ₀ and h.

The network: ``L`` linear layers ``z_l = W_l a_{l-1} + b_l`` with ReLU between them (none
after the last), the logits ``z_L``; classes marked ``True`` in the sample's ``mask`` are
excluded (the task's logit mask of ``emcl_continual.data.models.TaskMasked``: their logits do not
enter the softmax and get no gradient). The loss is the cross-entropy of one sample, the
update every mode of the inner step (``prox`` and not), fp32.

Entry points (each checks every argument before anything is written):

* :func:`mlp_glance_`: ``n`` one-sample inner steps, in order, on one run's parameters;
* :func:`mlp_glance_array_`: the same for ``R`` independent runs whose tensors are stacked along
  a leading run dimension (``[R, out, in]`` weights, ``[R, out]`` biases, per-run
  hyper-parameters as length-``R`` tensors): one CPU work item, or one thread block / Triton
  program, per run;
* :func:`mlp_inner_step_`: one step (a glance of one sample).

Backends: ``"cpu"`` (``csrc/emcl_glance_cpu.cpp``), ``"cuda"`` (``csrc/emcl_glance_cuda.cu``),
``"triton"`` (``emcl_kernels/backends/glance_triton.py``) and ``"reference"``
(:func:`reference_glance_`, below: the readable version, written in the CPU kernel's order of
operations so that the two agree bit for bit).

[note: glance order] The order of the arithmetic, which the CPU kernel and the reference share:

* forward, per output row: the dot product over ``in`` in ``LANES`` (16) partial sums, input
  ``j`` added to lane ``j % 16`` in increasing ``j``, the lanes summed as a tree (lane ``k`` +=
  lane ``k + s`` for s = 8, 4, 2, 1), then the bias added; ReLU keeps ``z > 0``;
* softmax and loss in fp64 (``exp``/``log`` of the C library: ``math.exp`` here): ``m`` the
  largest unmasked logit, ``s`` the sum over unmasked classes in order of ``exp(z − m)``,
  ``p = exp((z − m) − log s)``; the logits' signal ``δ_L = fp32(p − [k = y])`` (0 where masked),
  the loss ``fp32((log s + m) − z_y)``;
* backward: ``δ_{l-1}[j] = Σ_i W_l[i, j]·δ_l[i]`` summed in increasing ``i`` from +0, with the
  weights before this step's update, then zero where ``z_{l-1} ≤ 0``;
* update, per element, the gradient ``g = δ_l[i]·a_{l-1}[j]`` (``δ_l[i]`` for the bias) and with
  ``β``, ``λ`` and ``c_s = γ·λ`` combined in fp64 and rounded once to fp32:
  ``prox``: ``θ̂ = θ − β·g``, ``c = min(c_s·h, FLT_MAX)`` (taken on the bits as int32: +inf
  and NaN give FLT_MAX), ``w = c/(1 + c)``,
  ``θ ← θ̂ − w·(θ̂ − θ₀)``; else ``θ ← θ − β·(g + (λ·h)·(θ − θ₀))`` (the expressions of
  :func:`emcl_kernels.reference.inner_update`, evaluated left to right). No fused multiply-add.

[note: glance skips] With ``check_finite`` a step whose gradient holds an inf or a NaN writes
nothing (the optimizer's ``check_finite``, per step and per run) and counts one skip for its run.
The gradient is never formed, so the check is on its factors: every ``g = δ_l[i]·a_{l-1}[j]`` is
finite exactly when every ``δ_l`` and ``a_{l-1}`` is finite and ``max|δ_l|·max|a_{l-1}|`` does
not overflow (rounding is monotonic, so the largest product overflows first).

Against autograd (``F.cross_entropy(model(x), y).backward(); optimizer.inner_step()``) the
update is the same up to the order of the sums (BLAS's in the forward and backward passes,
torch's softmax): ``tests/test_glance.py`` states and checks the tolerance.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["mlp_glance_", "mlp_glance_array_", "mlp_inner_step_", "reference_glance_",
           "GlanceResult", "GLANCE_BACKENDS", "LANES", "glance_unavailable_reason",
           "resolve_glance_backend"]

#: Partial sums of the forward dot products ([note: glance order]).
LANES = 16
GLANCE_BACKENDS = ("auto", "reference", "cpu", "cuda", "triton")
_FLT_MAX_BITS = 0x7F7FFFFF  # FLT_MAX as int32 bits


class GlanceResult(NamedTuple):
    """What a glance returns besides the updated parameters: ``losses`` [R, n] (fp32, the loss
    of each step's sample at the weights before that step) and ``skipped`` [R] (int64, steps
    skipped for a non-finite gradient, [note: glance skips]); without the run dimension for
    :func:`mlp_glance_`."""
    losses: Tensor
    skipped: Tensor


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _tensor_list(name: str, value) -> list:
    if isinstance(value, Tensor) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(value).__name__}")
    out = list(value)
    for i, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
    return out


def _check_layers(params, anchors, importances, runs: Optional[int]):
    """The three lists of one call, checked: returns (params, anchors, importances, widths, R)."""
    params = _tensor_list("params", params)
    anchors = _tensor_list("anchors", anchors)
    importances = _tensor_list("importances", importances)
    if len(params) == 0 or len(params) % 2:
        raise ValueError(f"params must hold a weight and a bias per layer (an even, non-zero "
                         f"count), got {len(params)} tensors")
    for name, lst in (("anchors", anchors), ("importances", importances)):
        if len(lst) != len(params):
            raise ValueError(f"{name} has {len(lst)} tensors for {len(params)} params")
    lead = 0 if runs is None else 1
    device = params[0].device
    widths = []
    for l in range(len(params) // 2):
        w, b = params[2 * l], params[2 * l + 1]
        if w.dim() != 2 + lead or b.dim() != 1 + lead:
            want = "[R, out, in] and [R, out]" if lead else "[out, in] and [out]"
            raise ValueError(f"layer {l}: the weight and bias must be {want}, got "
                             f"{tuple(w.shape)} and {tuple(b.shape)}")
        if lead and (w.shape[0] != runs or b.shape[0] != runs):
            raise ValueError(f"layer {l}: the run dimension must be {runs}, got "
                             f"{tuple(w.shape)} and {tuple(b.shape)}")
        out_f, in_f = int(w.shape[-2]), int(w.shape[-1])
        if b.shape[-1] != out_f:
            raise ValueError(f"layer {l}: bias of {b.shape[-1]} for a weight of {out_f} rows")
        if out_f == 0 or in_f == 0:
            raise ValueError(f"layer {l}: empty weight {tuple(w.shape)}")
        if l == 0:
            widths.append(in_f)
        elif in_f != widths[-1]:
            raise ValueError(f"layer {l}: takes {in_f} inputs but layer {l - 1} gives "
                             f"{widths[-1]}")
        widths.append(out_f)
    for i, p in enumerate(params):
        for name, lst in (("params", params), ("anchors", anchors), ("importances", importances)):
            t = lst[i]
            if t.dtype != torch.float32:
                raise TypeError(f"{name}[{i}] must be float32 (the fused glance is fp32), "
                                f"got {t.dtype}")
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device}, params[0] on {device}")
            if t.shape != p.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, params[{i}] "
                                 f"{tuple(p.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous")
    spans = []
    for name, lst in (("params", params), ("anchors", anchors), ("importances", importances)):
        for i, t in enumerate(lst):
            if t.numel():
                start = t.data_ptr()
                spans.append((start, start + t.numel() * 4, f"{name}[{i}]"))
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{n0} and {n1} share memory; the glance writes params in place")
    return params, anchors, importances, widths


def _check_samples(x: Tensor, y: Tensor, mask: Optional[Tensor], widths, device, runs: int):
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise TypeError("x and y must be tensors")
    if x.dim() != 3 or x.shape[0] != runs or x.shape[2] != widths[0]:
        raise ValueError(f"x must be [R={runs}, n, {widths[0]}], got {tuple(x.shape)}")
    n = int(x.shape[1])
    if tuple(y.shape) != (runs, n):
        raise ValueError(f"y must be [R={runs}, n={n}], got {tuple(y.shape)}")
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if y.dtype != torch.int64:
        raise TypeError(f"y must be int64 class indices, got {y.dtype}")
    for name, t in (("x", x), ("y", y)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the params on {device}")
    classes = widths[-1]
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= classes):
        raise ValueError(f"y holds a class outside [0, {classes})")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError("mask must be a bool tensor (True: the class is masked out) or None")
        if tuple(mask.shape) != (runs, n, classes):
            raise ValueError(f"mask must be [R={runs}, n={n}, {classes}], got "
                             f"{tuple(mask.shape)}")
        if mask.device != device:
            raise ValueError(f"mask is on {mask.device}, the params on {device}")
        if n and bool(mask.gather(2, y.unsqueeze(2)).any()):
            raise ValueError("a sample's label is a masked class (its loss is not defined)")
        if n and bool(mask.all(dim=2).any()):
            raise ValueError("a sample's mask excludes every class")
    return (x.contiguous(), y.contiguous(),
            None if mask is None else mask.contiguous())


def _hyper_column(name: str, value, runs: int) -> Tensor:
    if isinstance(value, Tensor):
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != runs):
            raise ValueError(f"{name} must be a number or a tensor of {runs} values, got shape "
                             f"{tuple(value.shape)}")
        col = value.detach().to("cpu", torch.float64).expand(runs)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        col = torch.full((runs,), float(value), dtype=torch.float64)
    else:
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if not bool(torch.isfinite(col).all()) or bool((col < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0, got {col.tolist()}")
    return col


def _hyper(inner_lr, reg, gamma, runs: int) -> Tensor:
    """[R, 3] fp64: β, λ, γ per run."""
    return torch.stack([_hyper_column("inner_lr", inner_lr, runs),
                        _hyper_column("reg", reg, runs),
                        _hyper_column("gamma", gamma, runs)], dim=1).contiguous()


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------

def glance_unavailable_reason(name: str, device_type: str) -> Optional[str]:
    """None when glance backend ``name`` can run on ``device_type``, else why not."""
    if name == "reference":
        return None
    if name in ("cpu", "cuda"):
        if device_type != name:
            return f"the {name!r} glance runs on {name} tensors, these are on {device_type}"
        from emcl_kernels.backends import extension
        if extension.LOAD_ERROR is not None:
            return extension.LOAD_ERROR
        key = "CPU" if name == "cpu" else "CUDA"
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key("emcl::mlp_glance_", key)
        except RuntimeError:
            has = False
        if not has:
            return (f"emcl_kernels._C has no {key} kernel of the fused glance (built from an "
                    "older source, or without CUDA); rebuild with "
                    "pip install --no-build-isolation -e .")
        return None
    if name == "triton":
        from emcl_kernels.backends import glance_triton
        return glance_triton.unavailable_reason(device_type)
    raise ValueError(f"unknown glance backend {name!r}; choose one of {GLANCE_BACKENDS}")


def resolve_glance_backend(backend: str, device_type: str) -> str:
    """The backend ``backend`` names on ``device_type`` (``"auto"``: the compiled kernel of the
    device, else Triton on a GPU, else the reference); raises when it cannot run there."""
    if backend not in GLANCE_BACKENDS:
        raise ValueError(f"unknown glance backend {backend!r}; choose one of {GLANCE_BACKENDS}")
    if backend == "auto":
        order = ("cuda", "triton") if device_type == "cuda" else ("cpu", "reference")
        reasons = []
        for name in order:
            why = glance_unavailable_reason(name, device_type)
            if why is None:
                return name
            reasons.append(f"{name}: {why}")
        raise RuntimeError("no fused-glance backend can run on " + device_type + ": "
                           + "; ".join(reasons))
    why = glance_unavailable_reason(backend, device_type)
    if why is not None:
        raise RuntimeError(f"glance backend {backend!r} cannot run here: {why}")
    return backend


# ---------------------------------------------------------------------------------------------
# The reference, in the CPU kernel's order ([note: glance order])
# ---------------------------------------------------------------------------------------------

def _dot_rows(w: Tensor, a: Tensor) -> Tensor:
    """``w @ a`` for w [out, in], a [in] in the kernel's order: 16 lanes, then a tree."""
    out_f, in_f = w.shape
    pad = (-in_f) % LANES
    if pad:
        w = torch.cat([w, w.new_zeros(out_f, pad)], dim=1)
        a = torch.cat([a, a.new_zeros(pad)])
    prods = (w * a).view(out_f, -1, LANES)
    acc = torch.zeros(out_f, LANES, dtype=w.dtype, device=w.device)
    for c in range(prods.shape[1]):
        acc = acc + prods[:, c, :]
    s = LANES // 2
    while s:
        acc = torch.cat([acc[:, :s] + acc[:, s:2 * s], acc[:, s:]], dim=1)
        s //= 2
    return acc[:, 0]


def _softmax_signal(z: Tensor, label: int, mask: Optional[Tensor]):
    """(δ_L fp32, loss fp32) from the logits ``z`` (fp32) in fp64 with the C library's exp/log."""
    zs = z.tolist()
    live = [k for k in range(len(zs)) if mask is None or not bool(mask[k])]
    m = max(zs[k] for k in live)
    s = 0.0
    for k in live:
        s += math.exp(zs[k] - m)
    lse = math.log(s)
    delta = [0.0] * len(zs)
    for k in live:
        delta[k] = math.exp((zs[k] - m) - lse) - (1.0 if k == label else 0.0)
    loss = (lse + m) - zs[label]
    return torch.tensor(delta, dtype=torch.float32), torch.tensor(loss, dtype=torch.float32)


def _f32(v: float) -> Tensor:
    return torch.tensor(v, dtype=torch.float64).to(torch.float32)


def _clamp_max(c: Tensor) -> Tensor:
    """min(c, FLT_MAX) as the kernels take it: on the bits as int32, so +inf and NaN give
    FLT_MAX ([note: glance order])."""
    return torch.clamp(c.view(torch.int32), max=_FLT_MAX_BITS).view(torch.float32)


def _update(theta: Tensor, g: Tensor, theta0: Tensor, h: Tensor, beta: Tensor, reg: Tensor,
            cs: Tensor, prox: bool) -> Tensor:
    if prox:
        that = theta - beta * g
        c = _clamp_max(cs * h)
        w = c / (1 + c)
        return that - w * (that - theta0)
    return theta - beta * (g + (reg * h) * (theta - theta0))


@torch.no_grad()
def _reference_step(params, anchors, importances, x: Tensor, label: int, mask, hyper_row,
                    prox: bool, check_finite: bool):
    """One step of one run (tensors without the run dimension); returns (loss, skipped)."""
    n_layers = len(params) // 2
    acts = [x]
    zs = []
    for l in range(n_layers):
        w, b = params[2 * l], params[2 * l + 1]
        z = _dot_rows(w, acts[-1]) + b
        zs.append(z)
        if l + 1 < n_layers:
            acts.append(torch.where(z > 0, z, torch.zeros_like(z)))
    delta, loss = _softmax_signal(zs[-1], label, mask)
    deltas = [None] * n_layers
    deltas[-1] = delta
    for l in range(n_layers - 1, 0, -1):
        w = params[2 * l]
        back = torch.zeros(w.shape[1], dtype=torch.float32)
        for i in range(w.shape[0]):
            back = back + w[i] * deltas[l][i]
        deltas[l - 1] = torch.where(zs[l - 1] > 0, back, torch.zeros_like(back))
    if check_finite:
        for l in range(n_layers):
            d, a = deltas[l], acts[l]
            if not (bool(torch.isfinite(d).all()) and bool(torch.isfinite(a).all())):
                return loss, 1
            top = d.abs().max() * a.abs().max()
            if not bool(torch.isfinite(top)):
                return loss, 1
    beta, reg, gamma = (float(v) for v in hyper_row)
    beta32, reg32, cs32 = _f32(beta), _f32(reg), _f32(gamma * reg)
    for l in range(n_layers):
        w, b = params[2 * l], params[2 * l + 1]
        g_w = deltas[l][:, None] * acts[l][None, :]
        w.copy_(_update(w, g_w, anchors[2 * l], importances[2 * l], beta32, reg32, cs32, prox))
        b.copy_(_update(b, deltas[l], anchors[2 * l + 1], importances[2 * l + 1], beta32, reg32,
                        cs32, prox))
    return loss, 0


@torch.no_grad()
def reference_glance_(params, anchors, importances, x: Tensor, y: Tensor, mask: Optional[Tensor],
                      hyper: Tensor, *, prox: bool = True, check_finite: bool = True,
                      losses: Tensor, skipped: Tensor) -> None:
    """The glance of every run, step by step in [note: glance order], on CPU tensors with the
    run dimension (``hyper`` [R, 3] fp64: β, λ, γ). Writes params, ``losses`` and ``skipped``."""
    runs, n = x.shape[0], x.shape[1]
    for r in range(runs):
        p_r = [p[r] for p in params]
        a_r = [a[r] for a in anchors]
        h_r = [h[r] for h in importances]
        count = 0
        for k in range(n):
            loss, skip = _reference_step(p_r, a_r, h_r, x[r, k], int(y[r, k]),
                                         None if mask is None else mask[r, k], hyper[r].tolist(),
                                         prox, check_finite)
            losses[r, k] = loss
            count += skip
        skipped[r] = count


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def _run(backend: str, params, anchors, importances, x, y, mask, hyper, prox, check_finite):
    device = params[0].device
    runs, n = int(x.shape[0]), int(x.shape[1])
    losses = torch.zeros((runs, n), dtype=torch.float32, device=device)
    skipped = torch.zeros((runs,), dtype=torch.int64, device=device)
    name = resolve_glance_backend(backend, device.type)
    if name == "reference":
        if device.type != "cpu":
            raise RuntimeError("the reference glance runs on CPU tensors")
        reference_glance_(params, anchors, importances, x, y, mask, hyper, prox=prox,
                          check_finite=check_finite, losses=losses, skipped=skipped)
    elif name == "triton":
        from emcl_kernels.backends import glance_triton
        glance_triton.mlp_glance(params, anchors, importances, x, y, mask, hyper.to(device),
                                 prox, check_finite, losses, skipped)
    else:
        torch.ops.emcl.mlp_glance_(params, anchors, importances, x, y, mask, hyper.to(device),
                                   prox, check_finite, losses, skipped)
    return GlanceResult(losses, skipped)


@torch.no_grad()
def mlp_glance_array_(params: Sequence[Tensor], anchors: Sequence[Tensor],
                      importances: Sequence[Tensor], x: Tensor, y: Tensor, *,
                      mask: Optional[Tensor] = None, inner_lr, reg, gamma, prox: bool = True,
                      check_finite: bool = True, backend: str = "auto") -> GlanceResult:
    """``n`` one-sample inner steps, in order, for each of ``R`` runs, in place on ``params``.

    ``params``: per layer a weight ``[R, out, in]`` and a bias ``[R, out]`` (fp32, contiguous;
    the order of ``nn.Sequential(Linear, ReLU, ..., Linear).parameters()``); ``anchors`` (θ₀)
    and ``importances`` (h) alike. ``x`` [R, n, in] fp32, ``y`` [R, n] int64, ``mask``
    [R, n, classes] bool (True: the class is masked out) or None. ``inner_lr`` (β), ``reg``
    (λ), ``gamma`` (γ): numbers or length-R tensors. ``prox``: the proximal step (eq. 19) or the
    plain gradient step on eq. 6. Returns the per-step losses and skip counts (:class:`GlanceResult`).
    """
    if isinstance(params, Tensor) or not isinstance(params, Sequence) or not params:
        raise TypeError("params must be a non-empty list of tensors")
    first = params[0]
    if not isinstance(first, Tensor) or first.dim() < 1:
        raise ValueError("params[0] must be a weight [R, out, in]")
    runs = int(first.shape[0])
    params, anchors, importances, widths = _check_layers(params, anchors, importances, runs)
    if not isinstance(prox, bool) or not isinstance(check_finite, bool):
        raise TypeError("prox and check_finite must be bools")
    x, y, mask = _check_samples(x, y, mask, widths, first.device, runs)
    hyper = _hyper(inner_lr, reg, gamma, runs)
    return _run(backend, params, anchors, importances, x, y, mask, hyper, prox, check_finite)


@torch.no_grad()
def mlp_glance_(params: Sequence[Tensor], anchors: Sequence[Tensor],
                importances: Sequence[Tensor], x: Tensor, y: Tensor, *,
                mask: Optional[Tensor] = None, inner_lr: float, reg: float, gamma: float,
                prox: bool = True, check_finite: bool = True,
                backend: str = "auto") -> GlanceResult:
    """``n`` one-sample inner steps, in order, on one MLP's parameters, in place.

    ``params``: per layer a weight ``[out, in]`` and a bias ``[out]`` (fp32, contiguous), in
    ``parameters()`` order; ``anchors`` and ``importances`` alike (the optimizer's
    ``state[p]["anchor"]`` / ``["importance"]``). ``x`` [n, in], ``y`` [n], ``mask``
    [n, classes] bool or None. Returns ``losses`` [n] and ``skipped`` (0-d).
    """
    params, anchors, importances, widths = _check_layers(params, anchors, importances, None)
    if not isinstance(prox, bool) or not isinstance(check_finite, bool):
        raise TypeError("prox and check_finite must be bools")
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x must be [n, {widths[0]}], got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if not isinstance(y, Tensor) or y.dim() != 1:
        raise ValueError("y must be [n] class indices")
    x3, y2 = x.unsqueeze(0), y.unsqueeze(0)
    m3 = None if mask is None else (mask.unsqueeze(0) if isinstance(mask, Tensor) else mask)
    x3, y2, m3 = _check_samples(x3, y2, m3, widths, params[0].device, 1)
    hyper = _hyper(inner_lr, reg, gamma, 1)
    up = [t.unsqueeze(0) for t in params]
    ua = [t.unsqueeze(0) for t in anchors]
    uh = [t.unsqueeze(0) for t in importances]
    res = _run(backend, up, ua, uh, x3, y2, m3, hyper, prox, check_finite)
    return GlanceResult(res.losses[0], res.skipped[0])


def mlp_inner_step_(params: Sequence[Tensor], anchors: Sequence[Tensor],
                    importances: Sequence[Tensor], x: Tensor, y, *, mask: Optional[Tensor] = None,
                    inner_lr: float, reg: float, gamma: float, prox: bool = True,
                    check_finite: bool = True, backend: str = "auto") -> GlanceResult:
    """One one-sample inner step: :func:`mlp_glance_` on ``x`` [in] and its label ``y``."""
    if not isinstance(x, Tensor) or x.dim() != 1:
        raise ValueError("x must be one sample [in]")
    yt = y if isinstance(y, Tensor) else torch.tensor(int(y), device=x.device)
    if yt.dim() != 0:
        raise ValueError("y must be one class index")
    res = mlp_glance_(params, anchors, importances, x.unsqueeze(0), yt.reshape(1).long(),
                      mask=None if mask is None else mask.unsqueeze(0), inner_lr=inner_lr,
                      reg=reg, gamma=gamma, prox=prox, check_finite=check_finite,
                      backend=backend)
    return GlanceResult(res.losses[0], res.skipped)
