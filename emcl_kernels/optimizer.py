"""FusedEMCLOptimizer: EMCL as a ``torch.optim.Optimizer`` (SPEC section 3)."""
from __future__ import annotations

import os
import sys
import warnings
from collections import deque
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from emcl_kernels import functional as F
from emcl_kernels.backends import BACKENDS, get_backend
from emcl_kernels.reference import compute_dtype

__all__ = ["FusedEMCLOptimizer", "NonFiniteGradientWarning"]

# SPEC section 2 leaves lr_mode, lr_scale and decay open; these are the values chosen by the
# Permuted-MNIST ablation (README, "Choosing the open defaults").
DEFAULT_LR_MODE = "inverse"
DEFAULT_DECAY = 0.9
DEFAULT_LR_SCALE = None  # None: 1 / reg, so that alpha * reg * h ~ meta_lr wherever h >> eps

_INNER_KEYS = ("inner_lr", "reg", "gamma", "prox")
_META_KEYS = ("meta_lr", "reg", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max", "eps",
              "importance")
_STATE_KEYS = ("anchor", "importance", "meta_lr", "step")


class NonFiniteGradientWarning(RuntimeWarning):
    """A step of :class:`FusedEMCLOptimizer` was skipped: its gradients held an inf or a NaN."""


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package and
    torch (the user's ``opt.step()``), whatever the path through them."""
    inside = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
              os.path.dirname(os.path.abspath(torch.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _no_host_sync() -> bool:
    """True while torch.compile traces or a CUDA graph is being captured."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _PendingFlag:
    """A skip flag on a CUDA device, copied to pinned host memory without a sync; ``ready()``
    says (without blocking) whether the copy has landed. ``steps`` are the meta-step counters
    that were advanced for the step and must be taken back if it turns out to be skipped."""

    def __init__(self, flag: Tensor, steps: list):
        self.host = torch.empty((), dtype=torch.float32, pin_memory=True)
        self.host.copy_(flag, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(flag.device))
        self.steps = steps

    def ready(self, wait: bool) -> bool:
        if wait:
            self.event.synchronize()
            return True
        return self.event.query()


class FusedEMCLOptimizer(Optimizer):
    r"""EMCL (Zou & Lin): an importance-regularized inner loop with a closed-form meta-update.

    Every parameter :math:`\theta` keeps three fp32 state tensors: the meta-parameter (anchor)
    :math:`\theta_0`, the moving-average Taylor importance :math:`h` and, for
    ``lr_mode="recurrent"``, a per-element meta learning rate :math:`\alpha`.

    .. math::
        \textbf{inner step} \text{ (one per inner sample, eqs. 14, 15, 19)}: \quad
        c = \gamma\lambda h, \qquad
        \theta \leftarrow \frac{\theta - \beta g + c\,\theta_0}{1 + c}
        \quad (\texttt{prox=False}: \theta \leftarrow \theta - \beta\,(g + \lambda h(\theta - \theta_0)))

        \textbf{meta step} \text{ (one per batch, eqs. 13, 7, 8, 10)}: \quad
        \Omega = |g \cdot \theta_0| \;(\texttt{importance="si"}: |g\cdot(\theta-\theta_0)|), \qquad
        h \leftarrow \eta h + (1-\eta)\,\Omega,

        \alpha = \mathrm{clip}\!\left(\frac{\alpha_0 r}{h+\epsilon}\right) \;(\texttt{"inverse"}),\quad
        \alpha \leftarrow \mathrm{clip}\!\left(\frac{\alpha r}{h+\epsilon}\right) \;(\texttt{"recurrent"}),\quad
        \alpha = \alpha_0 \;(\texttt{"constant"}),

        \theta_0 \leftarrow \theta_0 - \alpha\lambda h\,(\theta_0 - \theta), \qquad \theta \leftarrow \theta_0

    State starts as :math:`\theta_0 = \theta`, :math:`h = 0`, :math:`\alpha = \alpha_0` the first time a
    parameter has a gradient. Parameters whose ``grad`` is None are skipped.

    Use it as in the paper (Algorithm 1)::

        for x, y in batch:                           # inner loop, one sample at a time
            loss_fn(model(x), y).backward(); opt.inner_step(); opt.zero_grad()
        loss_fn(model(xb), yb).backward(); opt.meta_step(); opt.zero_grad()

    or as a drop-in optimizer: ``step()`` is an inner step, and with ``meta_every=k`` every k-th
    ``step()`` is the inner step followed by the meta step on the same gradient (one fused pass).

    Args:
        params: parameters or param groups (each group may override any hyper-parameter).
        meta_lr: :math:`\alpha_0`, the base meta learning rate.
        inner_lr: :math:`\beta`, the inner learning rate.
        reg: :math:`\lambda`, the strength of the importance-weighted pull to :math:`\theta_0`.
        gamma: :math:`\gamma`, the proximal step scalar.
        decay: :math:`\eta`, the importance moving-average decay, in [0, 1].
        lr_scale: :math:`r`; None means ``1 / reg`` (so :math:`\alpha\lambda h \approx \alpha_0`
            wherever :math:`h \gg \epsilon`).
        lr_mode: ``"inverse"``, ``"recurrent"`` or ``"constant"``.
        lr_min, lr_max: the clip of the meta learning rate.
        eps: :math:`\epsilon` in :math:`h + \epsilon`.
        importance: ``"taylor"`` (eq. 13) or ``"si"`` (the EMCL-SI ablation).
        prox: proximal inner update (eq. 19) or the plain gradient step.
        meta_every: if set, every ``meta_every``-th ``step()`` also does the meta step.
        backend: ``"auto"`` or a name from :func:`emcl_kernels.available_backends`.
        check_finite: if True (default), a step whose gradients hold an inf or a NaN writes
            nothing (parameters, anchors, importances, learning rates and the meta-step count
            stay as they were), is counted in :attr:`skipped_steps` and raises a
            :class:`NonFiniteGradientWarning`. False turns the check off, for speed.

    [note: skipped steps] The check is one fused pass over all gradients of the step that
    leaves one 0-d flag on the device (:func:`emcl_kernels.functional.found_non_finite`); every
    backend skips on that flag, so one bad gradient anywhere skips the whole step, in every
    param group. On CPU the flag is read at once: the warning and the count come with the step.
    On CUDA it is copied to pinned host memory without a sync and read when it has landed (at
    a later step, or at once when :attr:`skipped_steps` or :meth:`state_dict` is read, which
    wait for it): the warning may come a step or two late, and the CPU-side meta-step counter
    ``state["step"]`` is advanced at once and taken back when the skip is seen. The
    ``meta_every`` cadence counts ``step()`` calls, skipped or not. While torch.compile traces
    or a CUDA graph is captured nothing is read on the host: skips are counted on the device
    (read by :attr:`skipped_steps`) and the step counters advance by ``1 - flag``, without a
    warning.
    """

    def __init__(self, params, meta_lr: float = 0.1, inner_lr: float = 0.075, reg: float = 50.0,
                 gamma: float = 0.1, decay: float = DEFAULT_DECAY,
                 lr_scale: Optional[float] = DEFAULT_LR_SCALE, lr_mode: str = DEFAULT_LR_MODE,
                 lr_min: float = 0.0, lr_max: float = float("inf"), eps: float = 1e-8,
                 importance: str = "taylor", prox: bool = True,
                 meta_every: Optional[int] = None, backend: str = "auto",
                 check_finite: bool = True):
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
        if meta_every is not None and (isinstance(meta_every, bool)
                                       or not isinstance(meta_every, int) or meta_every < 1):
            raise ValueError(f"meta_every must be None or a positive int, got {meta_every!r}")
        if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, "
                             f"got {backend!r}")
        defaults = dict(meta_lr=meta_lr, inner_lr=inner_lr, reg=reg, gamma=gamma, decay=decay,
                        lr_scale=lr_scale, lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max,
                        eps=eps, importance=importance, prox=prox)
        self._check_group(defaults)
        self.meta_every = meta_every
        self.backend = backend
        self.check_finite = check_finite
        self._step_calls = 0
        self._skipped_steps = 0
        self._pending: deque = deque()
        self._device_skips: dict = {}   # skips counted under torch.compile / CUDA graph capture
        super().__init__(params, defaults)

    # -- hyper-parameters ---------------------------------------------------------------------
    @staticmethod
    def _check_group(group: dict, where: str = "param group") -> None:
        missing = [k for k in _INNER_KEYS + _META_KEYS if k not in group]
        if missing:
            raise ValueError(f"{where} lacks the hyper-parameter(s) {', '.join(missing)}; "
                             "was it made for another optimizer?")
        hp = {k: group[k] for k in _INNER_KEYS + _META_KEYS}
        if hp["lr_scale"] is None:
            hp.pop("lr_scale")
        F.check_hyperparameters(**hp)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch semantics); its parameters get state at their first step.

        Refused, with nothing added, when a hyper-parameter is out of its domain, a parameter
        appears twice or shares memory with another parameter of any group, or the backend
        cannot run on a parameter's device.
        """
        self._check_group({**self.defaults, **param_group})  # before the group is added
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            seen = {}
            for gi, other in enumerate(self.param_groups):
                for pi, p in enumerate(other["params"]):
                    if p.numel() == 0:
                        continue
                    key = (p.device, p.untyped_storage().data_ptr(), p.storage_offset())
                    if key in seen:
                        raise ValueError(
                            f"parameter {pi} of param group {gi} is the same tensor as (or "
                            f"shares memory with) parameter {seen[key][1]} of param group "
                            f"{seen[key][0]}; each parameter may appear only once")
                    seen[key] = (gi, pi)
            for p in group["params"]:
                get_backend(self.backend, p.device)  # fail now if it cannot run on these tensors
        except Exception:
            self.param_groups.pop()
            raise

    @staticmethod
    def _hyper(group: dict, keys) -> dict:
        hp = {k: group[k] for k in keys}
        if "lr_scale" in hp and hp["lr_scale"] is None:
            hp["lr_scale"] = 1.0 / group["reg"] if group["reg"] > 0 else 1.0
        return hp

    # -- state ----------------------------------------------------------------------------------
    def _init_group(self, group: dict):
        """The lists of one group: params with a gradient, their grads and (lazily made) state."""
        params, grads, anchors, importances, meta_lrs, steps = [], [], [], [], [], []
        recurrent = group["lr_mode"] == "recurrent"
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                anchor = p.detach().to(compute_dtype(p.dtype), copy=True)
                state["anchor"] = anchor.contiguous()
                state["importance"] = torch.zeros_like(state["anchor"])
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if recurrent and "meta_lr" not in state:
                state["meta_lr"] = torch.full_like(state["anchor"], float(group["meta_lr"]))
            params.append(p)
            grads.append(p.grad)
            anchors.append(state["anchor"])
            importances.append(state["importance"])
            steps.append(state["step"])
            if recurrent:
                meta_lrs.append(state["meta_lr"])
        return params, grads, anchors, importances, (meta_lrs if recurrent else None), steps

    def _gather(self) -> list:
        """Every group with its lists, all checked before any tensor is written: the
        hyper-parameters (they may have been changed through ``param_groups``) and, when there
        are several groups, the tensors (``functional`` checks them again per call)."""
        gathered = []
        for i, group in enumerate(self.param_groups):
            self._check_group(group, f"param group {i}")
            gathered.append((group, self._init_group(group)))
        if len(gathered) > 1:
            for group, (params, grads, anchors, importances, meta_lrs, _) in gathered:
                F._check_lists(params, grads, anchors, importances, meta_lrs,
                               need_meta_lrs=meta_lrs is not None)
        return gathered

    def _flag(self, gathered: list) -> Optional[Tensor]:
        """The skip flag of this step (see [note: skipped steps]), or None when not checking."""
        if not self.check_finite:
            return None
        return F.found_non_finite([g for _, lists in gathered for g in lists[1]])

    # -- the steps ------------------------------------------------------------------------------
    @torch.no_grad()
    def inner_step(self) -> None:
        """One inner step (eqs. 14, 15, 19) on every parameter with a gradient."""
        gathered = self._gather()
        flag = self._flag(gathered)
        for group, (params, grads, anchors, importances, _, _) in gathered:
            F.inner_step_(params, grads, anchors, importances, backend=self.backend,
                          found_inf=flag, check_finite=False, **self._hyper(group, _INNER_KEYS))
        self._count(flag, [])

    @torch.no_grad()
    def meta_step(self) -> None:
        """One meta step (eqs. 13, 7, 8, 10): importance, learning rates, anchor; θ ← θ₀."""
        self._meta(F.meta_step_, _META_KEYS)

    @torch.no_grad()
    def inner_meta_step(self) -> None:
        """The inner step, then the meta step on the same gradient, in one fused pass."""
        self._meta(F.inner_meta_step_, _META_KEYS + ("inner_lr", "gamma", "prox"))

    def _meta(self, fn: Callable, keys) -> None:
        gathered = self._gather()
        flag = self._flag(gathered)
        for group, (params, grads, anchors, importances, meta_lrs, _) in gathered:
            fn(params, grads, anchors, importances, meta_lrs, backend=self.backend,
               found_inf=flag, check_finite=False, **self._hyper(group, keys))
        self._count(flag, [s for _, lists in gathered for s in lists[5]])

    # -- skipped steps (see [note: skipped steps]) ----------------------------------------------
    def _count(self, flag: Optional[Tensor], steps: list) -> None:
        """Advance the meta-step counters ``steps`` unless the step was skipped; count and warn
        about a skip, at once for a CPU flag, when the flag has landed for a CUDA one."""
        if flag is not None and _no_host_sync():
            # torch.compile tracing or CUDA graph capture: count on the device, no warning
            for s in steps:
                s.add_(1.0 - flag.to(s.device))
            if flag.device not in self._device_skips:
                self._device_skips[flag.device] = torch.zeros((), dtype=torch.float32,
                                                              device=flag.device)
            self._device_skips[flag.device].add_(flag)
            return
        if flag is not None and flag.device.type != "cuda":
            if flag.item() != 0:
                self._skipped(None)
                return
            flag = None
        if steps:
            torch._foreach_add_(steps, 1.0)
        if flag is not None:
            self._pending.append(_PendingFlag(flag, steps))
        self._poll(wait=False)

    def _poll(self, wait: bool) -> None:
        while self._pending and self._pending[0].ready(wait):
            pending = self._pending.popleft()
            if pending.host.item() != 0:
                self._skipped(pending.steps)

    def _skipped(self, steps_to_take_back: Optional[list]) -> None:
        self._skipped_steps += 1
        if steps_to_take_back:
            torch._foreach_sub_(steps_to_take_back, 1.0)
        warnings.warn("FusedEMCLOptimizer skipped a step: its gradients hold an inf or a NaN, "
                      "so nothing was written (the count is in .skipped_steps; "
                      "check_finite=False turns the check off)",
                      NonFiniteGradientWarning, stacklevel=_caller_stacklevel())

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for non-finite gradients (kept in checkpoints). Reading
        it waits for the flags of steps still in flight on a GPU."""
        self._poll(wait=True)
        return self._skipped_steps + sum(int(t.item()) for t in self._device_skips.values())

    def step(self, closure: Optional[Callable[[], Tensor]] = None):
        """An inner step; with ``meta_every=k``, every k-th call is the fused inner+meta step.

        ``closure``, if given, re-evaluates the model and returns the loss (computed with
        gradients enabled), as for any ``torch.optim.Optimizer``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        calls = self._step_calls + 1
        if self.meta_every is not None and calls % self.meta_every == 0:
            self.inner_meta_step()
        else:
            self.inner_step()
        self._step_calls = calls  # a call that raised is not counted
        return loss

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer state dict, plus ``"emcl"``: the count of ``step()`` calls that
        ``meta_every`` runs on, the count of skipped steps, and every parameter's shape (so
        that a load into another model or another parameter order is refused)."""
        self._poll(wait=True)
        sd = super().state_dict()
        sd["emcl"] = {"step_calls": self._step_calls, "skipped_steps": self.skipped_steps,
                      "param_shapes": [[list(p.shape) for p in group["params"]]
                                       for group in self.param_groups]}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by :meth:`state_dict`, on any device and backend.

        The state tensors keep their fp32 (fp64) dtype whatever the parameters' dtype, so a
        bf16 model's master anchors survive the round trip bit for bit. A state saved for
        parameters of other shapes or another order is refused before anything changes.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
        state_dict = dict(state_dict)
        extra = state_dict.pop("emcl", {})
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(saved_groups)} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        for i, saved in enumerate(saved_groups):
            self._check_group(saved, f"param group {i} of the state")
        id_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("a param group of the state has "
                                 f"{len(saved['params'])} parameters, this optimizer's has "
                                 f"{len(group['params'])}")
            id_to_param.update(zip(saved["params"], group["params"]))
        for gi, (shapes, group) in enumerate(zip(extra.get("param_shapes", []),
                                                 self.param_groups)):
            for pi, (shape, p) in enumerate(zip(shapes, group["params"])):
                if tuple(shape) != tuple(p.shape):
                    raise ValueError(f"parameter {pi} of param group {gi} has shape "
                                     f"{tuple(p.shape)} but had {tuple(shape)} when the state "
                                     "was saved: was it saved for another model or another "
                                     "parameter order?")
        saved_state = state_dict["state"]
        for pid, st in saved_state.items():
            p = id_to_param.get(pid)
            if p is None:
                raise ValueError(f"the state names parameter id {pid}, which no group holds")
            unknown = sorted(set(st) - set(_STATE_KEYS))
            if unknown or not {"anchor", "importance"} <= set(st):
                raise ValueError(f"the state of parameter {pid} has keys {sorted(st)}; EMCL "
                                 f"keeps {', '.join(_STATE_KEYS)} (anchor and importance "
                                 "always): was it saved by another optimizer?")
            for key in ("anchor", "importance", "meta_lr", "step"):
                if key in st and not (torch.is_tensor(st[key]) and st[key].is_floating_point()):
                    raise ValueError(f"state {key!r} of parameter {pid} must be a "
                                     "floating-point tensor")
            for key in ("anchor", "importance", "meta_lr"):
                if key in st and tuple(st[key].shape) != tuple(p.shape):
                    raise ValueError(f"state {key!r} of parameter {pid} has shape "
                                     f"{tuple(st[key].shape)} but the parameter has "
                                     f"{tuple(p.shape)}: was it saved for another model or "
                                     "another parameter order?")
        self._poll(wait=True)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; put back the saved fp32 values.
        for pid, st in saved_state.items():
            p = id_to_param[pid]
            mine = self.state[p]
            for key, value in st.items():
                if key == "step":
                    mine[key] = value.detach().to(dtype=torch.float32, device="cpu").clone()
                elif torch.is_tensor(value):
                    mine[key] = value.detach().to(device=p.device,
                                                  dtype=compute_dtype(p.dtype)).clone()
        self._step_calls = int(extra.get("step_calls", 0))
        self._skipped_steps = int(extra.get("skipped_steps", 0))
        self._device_skips = {}
