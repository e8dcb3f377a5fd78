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
from emcl_kernels.backends import BACKENDS
from emcl_kernels.integration import local, tensor_hyperparameter
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
# the numeric hyper-parameters, which capturable mode keeps as 0-d tensors on the device
_NUMERIC_KEYS = ("inner_lr", "meta_lr", "reg", "gamma", "decay", "lr_scale", "lr_min", "lr_max",
                 "eps")
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
        capturable: keep the step counts and the numeric hyper-parameters as 0-d fp32 tensors on
            the parameters' device and never sync with the host, so that ``inner_step()``,
            ``meta_step()`` and ``inner_meta_step()`` can be captured in a CUDA graph and
            replayed. Change a hyper-parameter in place (``group["inner_lr"].fill_(0.01)``);
            rebinding it to a new tensor or number is not seen by a captured graph. Any
            hyper-parameter may also be given as a 0-d tensor without this flag.
        check_finite: if True (default), a step whose gradients hold an inf or a NaN writes
            nothing (parameters, anchors, importances, learning rates and the meta-step count
            stay as they were), is counted in :attr:`skipped_steps` and raises a
            :class:`NonFiniteGradientWarning`. False turns the check off, for speed.

    Integration (README, "Integration"): ``torch.amp.GradScaler.step(opt)`` hands the
    optimizer its scale and ``found_inf`` (``_step_supports_amp_scaling``), which the kernels
    apply as torch's fused optimizers do (grads divided by the scale; nothing written when an
    inf/NaN was found; the meta step count not advanced). DTensor (FSDP2) parameters are updated
    shard by shard, with DTensor state sharded like them. Under ``torch.compile`` the state is
    set up outside the graph, as for torch's optimizers, and float hyper-parameters become
    symbols after their first change instead of recompiling for each value.

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
    warning (as does ``step()`` with ``meta_every`` in capturable mode). When GradScaler (or the caller) gives ``found_inf``,
    that flag replaces the check: GradScaler has checked the same gradients, and its skips are
    its own to count (its scale backs off), so they are neither warned about nor counted here.
    """

    def __init__(self, params, meta_lr: float = 0.1, inner_lr: float = 0.075, reg: float = 50.0,
                 gamma: float = 0.1, decay: float = DEFAULT_DECAY,
                 lr_scale: Optional[float] = DEFAULT_LR_SCALE, lr_mode: str = DEFAULT_LR_MODE,
                 lr_min: float = 0.0, lr_max: float = float("inf"), eps: float = 1e-8,
                 importance: str = "taylor", prox: bool = True,
                 meta_every: Optional[int] = None, backend: str = "auto",
                 capturable: bool = False, check_finite: bool = True):
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
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {capturable!r}")
        self._check_group(defaults)
        defaults["capturable"] = capturable
        self.meta_every = meta_every
        self.backend = backend
        self.check_finite = check_finite
        self._skipped_steps = 0
        self._pending: deque = deque()
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                F.resolve_backend(backend, local(p).device)  # fail now if it cannot run here
        # the count of step() calls that meta_every runs on: a tensor, so that a compiled or
        # captured step() can advance it (see _masked_step); on the device when capturable
        first = next((p for g in self.param_groups for p in g["params"]), None)
        on = local(first).device if capturable and first is not None else "cpu"
        self._calls = torch.zeros((), dtype=torch.int64, device=on)
        # skips counted without a host read (torch.compile, CUDA graph capture, capturable):
        # made here, on the parameters' device, so that a compiled step only updates it
        self._device_skips = torch.zeros((), dtype=torch.float32,
                                         device=local(first).device if first is not None
                                         else "cpu")

    @property
    def _step_calls(self) -> int:
        return int(self._calls.item())

    @_step_calls.setter
    def _step_calls(self, value: int) -> None:
        self._calls.fill_(int(value))

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
                    lp = local(p)
                    if lp.numel() == 0:
                        continue
                    key = (lp.device, lp.untyped_storage().data_ptr(), lp.storage_offset())
                    if key in seen:
                        raise ValueError(
                            f"parameter {pi} of param group {gi} is the same tensor as (or "
                            f"shares memory with) parameter {seen[key][1]} of param group "
                            f"{seen[key][0]}; each parameter may appear only once")
                    seen[key] = (gi, pi)
            for p in group["params"]:  # fail now if the backend cannot run on these tensors
                F.resolve_backend(self.backend, local(p).device)
        except Exception:
            self.param_groups.pop()
            raise
        self._capturable_hyper(self.param_groups[-1])

    @staticmethod
    def _capturable_hyper(group: dict) -> None:
        """capturable: make the group's numeric hyper-parameters 0-d fp32 tensors on its
        parameters' device (a captured graph reads them there; change them in place)."""
        if not group.get("capturable") or not group["params"]:
            return
        device = local(group["params"][0]).device
        for key in _NUMERIC_KEYS:
            value = group[key]
            if tensor_hyperparameter(value):
                if value.device != device or value.dtype != torch.float32:
                    group[key] = value.detach().to(device, torch.float32).clone()
            elif value is not None:
                group[key] = torch.tensor(float(value), dtype=torch.float32, device=device)

    @staticmethod
    def _hyper(group: dict, keys) -> dict:
        hp = {k: group[k] for k in keys}
        if "lr_scale" in hp and hp["lr_scale"] is None:
            reg = group["reg"]
            if tensor_hyperparameter(reg):  # no host sync: captured graphs read reg at replay
                hp["lr_scale"] = torch.where(reg > 0, 1.0 / reg, torch.ones_like(reg))
            else:
                hp["lr_scale"] = 1.0 / reg if reg > 0 else 1.0
        return hp

    # -- state ----------------------------------------------------------------------------------
    def _init_group(self, group: dict, params: list, grads: list, anchors: list,
                    importances: list, meta_lrs: list, steps: list) -> bool:
        """Fill the given lists for one group: params with a gradient, their grads and their
        (lazily made) state. Returns whether the group stores ``meta_lr`` (recurrent mode).

        It fills lists it is given, as torch's own optimizers do, so that ``torch.compile``
        runs it once outside the graph and guards on the state it makes.
        """
        recurrent = group["lr_mode"] == "recurrent"
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                anchor = p.detach().to(compute_dtype(p.dtype), copy=True)
                state["anchor"] = anchor.contiguous()
                state["importance"] = torch.zeros_like(state["anchor"])
                state["step"] = torch.tensor(
                    0.0, dtype=torch.float32,
                    device=local(p).device if group.get("capturable") else "cpu")
            if recurrent and "meta_lr" not in state:
                state["meta_lr"] = torch.full_like(state["anchor"], float(group["meta_lr"]))
            params.append(p)
            grads.append(p.grad)
            anchors.append(state["anchor"])
            importances.append(state["importance"])
            steps.append(state["step"])
            if recurrent:
                meta_lrs.append(state["meta_lr"])
        return recurrent

    def _lists(self, group: dict):
        """The lists of one group (see :meth:`_init_group`); ``meta_lrs`` is None unless the
        group is in recurrent mode."""
        params, grads, anchors, importances, meta_lrs, steps = [], [], [], [], [], []
        recurrent = self._init_group(group, params, grads, anchors, importances, meta_lrs, steps)
        return params, grads, anchors, importances, (meta_lrs if recurrent else None), steps

    def _gather(self) -> list:
        """Every group with its lists, all checked before any tensor is written: the
        hyper-parameters (they may have been changed through ``param_groups``) and, when there
        are several groups, the tensors (``functional`` checks them again per call)."""
        gathered = []
        for i, group in enumerate(self.param_groups):
            self._check_group(group, f"param group {i}")
            gathered.append((group, self._lists(group)))
        if len(gathered) > 1:
            for group, (params, grads, anchors, importances, meta_lrs, _) in gathered:
                F._check_lists(params, grads, anchors, importances, meta_lrs,
                               need_meta_lrs=meta_lrs is not None)
        return gathered

    def _flag(self, gathered: list, found_inf: Optional[Tensor] = None) -> Optional[Tensor]:
        """The skip flag of this step (see [note: skipped steps]), or None when not checking:
        with ``check_finite=False``, or when the caller (GradScaler) gives ``found_inf``, which
        already covers the same gradients."""
        if not self.check_finite or found_inf is not None:
            return None
        return F.found_non_finite([g for _, lists in gathered for g in lists[1]])

    # -- the steps ------------------------------------------------------------------------------
    # [note: AMP] torch.amp.GradScaler.step(opt) sees ``_step_supports_amp_scaling`` and, instead
    # of unscaling the grads itself, sets ``opt.grad_scale`` (the scale, or None when the user
    # already called ``scaler.unscale_(opt)``) and ``opt.found_inf`` (summed over devices) for the
    # duration of ``opt.step()``. The kernels divide the grads by the scale and write nothing
    # when found_inf is non-zero, as torch's fused optimizers do, and the meta step count is
    # advanced by ``1 - found_inf``. Both may also be passed to any step method by hand.
    _step_supports_amp_scaling = True

    def _amp(self, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]):
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        return grad_scale, found_inf

    @torch.no_grad()
    def inner_step(self, *, grad_scale: Optional[Tensor] = None,
                   found_inf: Optional[Tensor] = None) -> None:
        """One inner step (eqs. 14, 15, 19) on every parameter with a gradient.

        ``grad_scale``/``found_inf``: see [note: AMP] (normally set by ``GradScaler.step``).
        """
        grad_scale, found_inf = self._amp(grad_scale, found_inf)
        gathered = self._gather()
        flag = self._flag(gathered, found_inf)
        for group, (params, grads, anchors, importances, _, _) in gathered:
            F.inner_step_(params, grads, anchors, importances, backend=self.backend,
                          grad_scale=grad_scale, found_inf=found_inf if flag is None else flag,
                          check_finite=False, **self._hyper(group, _INNER_KEYS))
        self._count(flag, [], found_inf)

    @torch.no_grad()
    def meta_step(self, *, grad_scale: Optional[Tensor] = None,
                  found_inf: Optional[Tensor] = None) -> None:
        """One meta step (eqs. 13, 7, 8, 10): importance, learning rates, anchor; θ ← θ₀."""
        self._meta(F.meta_step_, _META_KEYS, *self._amp(grad_scale, found_inf))

    @torch.no_grad()
    def inner_meta_step(self, *, grad_scale: Optional[Tensor] = None,
                        found_inf: Optional[Tensor] = None) -> None:
        """The inner step, then the meta step on the same gradient, in one fused pass."""
        self._meta(F.inner_meta_step_, _META_KEYS + ("inner_lr", "gamma", "prox"),
                   *self._amp(grad_scale, found_inf))

    def _meta(self, fn: Callable, keys, grad_scale=None, found_inf=None) -> None:
        gathered = self._gather()
        flag = self._flag(gathered, found_inf)
        for group, (params, grads, anchors, importances, meta_lrs, _) in gathered:
            fn(params, grads, anchors, importances, meta_lrs, backend=self.backend,
               grad_scale=grad_scale, found_inf=found_inf if flag is None else flag,
               check_finite=False, **self._hyper(group, keys))
        self._count(flag, [s for _, lists in gathered for s in lists[5]], found_inf)

    # -- skipped steps (see [note: skipped steps]) ----------------------------------------------
    def _count(self, flag: Optional[Tensor], steps: list,
               found_inf: Optional[Tensor] = None) -> None:
        """Advance the meta-step counters ``steps`` unless the step was skipped; count and warn
        about a skip of the check's own ``flag``, at once for a CPU flag, when the flag has
        landed for a CUDA one. A caller's ``found_inf`` (GradScaler) only holds the counters
        back, without a host sync where they live on its device."""
        if flag is None:
            if found_inf is None:
                if steps:
                    torch._foreach_add_(steps, 1.0)
            else:
                done = {}
                for s in steps:
                    if s.device not in done:
                        done[s.device] = 1.0 - found_inf.reshape(()).to(s.device, torch.float32)
                    s.add_(done[s.device])
            return
        if _no_host_sync():
            # torch.compile tracing or CUDA graph capture: count on the device, no warning
            for s in steps:
                s.add_(1.0 - flag.to(s.device))
            self._count_on_device(flag)
            return
        if flag.device.type != "cuda":
            if flag.item() != 0:
                self._skipped(None)
                return
            if steps:
                torch._foreach_add_(steps, 1.0)
            self._poll(wait=False)
            return
        # a CUDA flag, eagerly: device-side counters (capturable) advance by 1 - flag; CPU ones
        # advance now and are taken back when the flag, read without a sync, says "skipped"
        on_host = [s for s in steps if s.device.type == "cpu"]
        for s in steps:
            if s.device.type != "cpu":
                s.add_(1.0 - flag.to(s.device))
        if on_host:
            torch._foreach_add_(on_host, 1.0)
        self._pending.append(_PendingFlag(flag, on_host))
        self._poll(wait=False)

    def _count_on_device(self, flag: Tensor) -> None:
        self._device_skips.add_(flag.to(self._device_skips.device))

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
        return self._skipped_steps + int(self._device_skips.item())

    def step(self, closure: Optional[Callable[[], Tensor]] = None, *,
             grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None):
        """An inner step; with ``meta_every=k``, every k-th call is the fused inner+meta step.

        ``closure``, if given, re-evaluates the model and returns the loss (computed with
        gradients enabled), as for any ``torch.optim.Optimizer``. ``grad_scale``/``found_inf``:
        see [note: AMP]. A call skipped for an inf/NaN still counts towards ``meta_every``.
        Under torch.compile and in capturable mode the choice between the two is made on the
        device (see :meth:`_masked_step`), so a compiled or captured ``step()`` keeps counting.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.meta_every is not None and (
                torch.compiler.is_compiling() or self._calls.device.type != "cpu"
                or any(g.get("capturable") for g in self.param_groups)):
            self._calls.add_(1)
            self._masked_step(self._calls % self.meta_every == 0, grad_scale, found_inf)
        elif self.meta_every is not None and (self._step_calls + 1) % self.meta_every == 0:
            self.inner_meta_step(grad_scale=grad_scale, found_inf=found_inf)
            self._calls.add_(1)  # after the step: a call that raised is not counted
        else:
            self.inner_step(grad_scale=grad_scale, found_inf=found_inf)
            self._calls.add_(1)
        return loss

    @torch.no_grad()
    def _masked_step(self, is_meta: Tensor, grad_scale, found_inf) -> None:
        """``inner_meta_step()`` where the 0-d bool ``is_meta`` is set, else ``inner_step()``,
        without reading ``is_meta`` on the host: both are computed from the same starting
        tensors and the result is selected with ``torch.where``. Twice the memory traffic of a
        step, but it can be traced by torch.compile and captured in a CUDA graph."""
        state, params = [], []
        for group in self.param_groups:
            ps, _, anchors, importances, meta_lrs, steps = self._lists(group)
            params += ps
            state += [*anchors, *importances, *(meta_lrs or []), *steps]
        if not params:
            return
        grad_scale, found_inf = self._amp(grad_scale, found_inf)
        own = self._flag(self._gather(), found_inf)  # once for both steps below
        if own is not None:
            self._count_on_device(own)
            found_inf = own
        params = [local(p) for p in params]
        state = [local(t) for t in state]
        start_params = [p.clone() for p in params]
        start_state = [t.clone() for t in state]
        self.inner_step(grad_scale=grad_scale, found_inf=found_inf)
        inner_params = [p.clone() for p in params]
        torch._foreach_copy_(params, start_params)
        self.inner_meta_step(grad_scale=grad_scale, found_inf=found_inf)
        for t, inner in zip(params, inner_params):
            t.copy_(torch.where(is_meta.to(t.device), t, inner))
        for t, start in zip(state, start_state):
            t.copy_(torch.where(is_meta.to(t.device), t, start))

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
                    on = local(p).device if self._calls.device.type != "cpu" else "cpu"
                    mine[key] = value.detach().to(dtype=torch.float32, device=on).clone()
                elif torch.is_tensor(value):
                    mine[key] = value.detach().to(device=p.device,
                                                  dtype=compute_dtype(p.dtype)).clone()
        self._step_calls = int(extra.get("step_calls", 0))
        self._skipped_steps = int(extra.get("skipped_steps", 0))
        self._device_skips.zero_()
        for group in self.param_groups:
            self._capturable_hyper(group)
