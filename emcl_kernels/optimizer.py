"""FusedEMCLOptimizer: EMCL as a ``torch.optim.Optimizer`` (SPEC section 3)."""
from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from emcl_kernels.integration import local
from emcl_kernels.interface import OP
from emcl_kernels.plan import Runtime, check_group, check_run_layout, resolve_backend, run
from emcl_kernels.runs import PerRun, declared_runs, group_runs, normalize_runs
from emcl_kernels.skips import NonFiniteGradientWarning
from emcl_kernels.validation import (GROUP_NAMES, NUMERIC_KEYS, PARAM_DTYPES, check_flag,
                                     check_no_overlap, group_spelling, state_dtype)

__all__ = ["FusedEMCLOptimizer", "NonFiniteGradientWarning"]

# SPEC section 2 leaves lr_mode, lr_scale and decay open; these are the values chosen by the
# Permuted-MNIST ablation; the rows emcl/recurrent, emcl/lr_scale=0.5/reg and emcl/decay=0.5
# measure them on held-out seeds (docs/results.md, "Deviations from the paper").
DEFAULT_LR_MODE = "inverse"
DEFAULT_DECAY = 0.9
DEFAULT_LR_SCALE = None  # None: 1 / reg, so that alpha * reg * h ~ meta_lr wherever h >> eps
DEFAULT_LR = 0.075       # β

# step() without meta_every: the cadence op whose meta step never comes due (its calls are
# still counted on the device, for the checkpoint)
_NEVER = 1 << 62
_UPDATES = {"inner": OP["inner"], "meta": OP["meta"], "inner_meta": OP["inner_meta"]}


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
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``: warnings
            then name them) or param groups; a group may override every hyper-parameter
            ([note: group keys]), not ``meta_every``, ``check_finite`` or ``backend``.
        lr: :math:`\beta`, the inner learning rate (default 0.075): the rate torch's LR
            schedulers and the training frameworks drive ([note: lr]). ``inner_lr`` is the same
            keyword (the paper's name).
        meta_lr: :math:`\alpha_0`, the base meta learning rate.
        reg: :math:`\lambda`, the strength of the importance-weighted pull to :math:`\theta_0`.
        gamma: :math:`\gamma`, the proximal step scalar.
        decay: :math:`\eta`, the importance moving-average decay, in [0, 1].
        lr_scale: :math:`r`; None means ``1 / reg`` (so :math:`\alpha\lambda h \approx \alpha_0`
            wherever :math:`h \gg \epsilon`). A param group holds it as ``meta_lr_scale``.
        lr_mode: ``"inverse"``, ``"recurrent"`` or ``"constant"``.
        lr_min, lr_max: the clip of the meta learning rate.
        eps: :math:`\epsilon` in :math:`h + \epsilon` (at least the smallest normal float32).
        importance: ``"taylor"`` (eq. 13) or ``"si"`` (the EMCL-SI ablation).
        prox: proximal inner update (eq. 19) or the plain gradient step.
        meta_every: if set, every ``meta_every``-th ``step()`` also does the meta step; the count
            is kept on the device, so a captured or compiled ``step()`` keeps the cadence.
        backend: ``"auto"`` or a name from :func:`emcl_kernels.available_backends`.
        capturable: keep the numeric hyper-parameters as 0-d float64 tensors on the
            parameters' device (views of the one tensor the kernels read), so that a step
            captured in a CUDA graph reads their current values at replay. Change them in place
            (``group["lr"].fill_(0.01)``: a torch scheduler does that); a value rebound to a
            new number or tensor is taken at the next eager step, but a captured graph keeps
            reading the old storage.
            In-place changes are not re-validated. Without this flag any hyper-parameter may
            also be given as a 0-d tensor; it is then read and checked at every step.
        check_finite: if True (default), a step whose gradients hold an inf or a NaN writes
            nothing (parameters, anchors, importances, learning rates and the meta-step count
            stay as they were), is counted in :attr:`skipped_steps` and raises a
            :class:`NonFiniteGradientWarning`. False turns the check off, for speed.
        inner_lr: the paper's name for ``lr`` (give one of them).
        weight_decay: 0 only (what frameworks pass); a non-zero decay is refused with the reason
            (EMCL's regulariser is the importance-weighted pull to the anchor).

    [note: lr] ``lr`` is :math:`\beta`: every param group holds it, torch's schedulers, the HF
    Trainer, accelerate, Lightning and timm drive it, and the inner update reads it at every
    step. The meta rate :math:`\alpha_0` is not scheduled: a schedule on ``lr`` already scales
    what each meta step can keep (the inner steps' progress), and scaling ``meta_lr`` by the same
    factor made a small transformer and Permuted MNIST worse (docs/integration.md, from
    results/dropin/). A schedule of ``meta_lr`` remains the user's to write (it is a group key).

    [note: group keys] A param group spells two hyper-parameters the torch way: β as ``lr``
    (given as ``inner_lr`` it is renamed; set on a group later it is refused, never ignored) and
    r as ``meta_lr_scale`` (``lr_scale`` in a param group is timm's multiplier of ``lr``, which
    timm's schedulers apply; a group given only ``lr_scale`` is warned about). State dicts
    saved with the old keys load.

    Zero-initialised parameters ([note: zero parameters] in :mod:`emcl_kernels.zeros`): a tensor
    that is all zero where its state starts never leaves 0 under the Taylor importance; the first
    step names such tensors in a :class:`~emcl_kernels.zeros.ZeroParameterWarning`, and
    :func:`~emcl_kernels.zeros.zero_aware_groups` is the remedy.

    Integration (docs/integration.md): ``torch.amp.GradScaler.step(opt)`` hands the
    optimizer its scale and ``found_inf`` (``_step_supports_amp_scaling``), which the kernels
    apply as torch's fused optimizers do (grads divided by the scale; nothing written when an
    inf/NaN was found; the meta step count not advanced). DTensor (FSDP2) parameters are updated
    shard by shard, with DTensor state sharded like them, and every rank skips the same steps.
    Under ``torch.compile`` the state and the plans are set up outside the graph, as for torch's
    optimizers.

    [note: plans] The optimizer validates when its configuration changes (construction,
    ``add_param_group``, a parameter gaining or losing its gradient, a changed mode, a new
    value of a hyper-parameter, ``load_state_dict``) and keeps one
    :class:`~emcl_kernels.plan.Plan` per (param group, device, dtype). A step then gathers the
    gradients and makes one backend call per plan (the compiled backends check the gradients
    themselves, in C++ or in the Triton launcher); the meta-step counts (``state["step"]``, views
    of one tensor per plan) and the call and skip counters stay on the device. State tensors are
    held by the plans: replace one only through :meth:`load_state_dict` (or change it in place).

    [note: skipped steps] The check is one read-only pass over all gradients of the step that
    sets a flag on the device (see ``emcl_kernels.functional``, [note: non-finite gradients]);
    every backend skips on that flag, so one bad gradient anywhere skips the whole step, in every
    param group. How and when the host learns of a skip: :mod:`emcl_kernels.skips`. The
    ``meta_every`` cadence counts ``step()`` calls, skipped or not. When GradScaler (or the caller)
    gives ``found_inf``, that flag replaces the check: GradScaler has checked the same
    gradients, and its skips are its own to count (its scale backs off), so they are neither
    warned about nor counted here.
    """

    def __init__(self, params, lr: Optional[float] = None, *, meta_lr: float = 0.1,
                 reg: float = 50.0, gamma: float = 0.1, decay: float = DEFAULT_DECAY,
                 lr_scale: Optional[float] = DEFAULT_LR_SCALE, lr_mode: str = DEFAULT_LR_MODE,
                 lr_min: float = 0.0, lr_max: float = float("inf"), eps: float = 1e-8,
                 importance: str = "taylor", prox: bool = True,
                 meta_every: Optional[int] = None, backend: str = "auto",
                 capturable: bool = False, check_finite: bool = True,
                 inner_lr: Optional[float] = None, weight_decay: float = 0.0,
                 runs: Optional[int] = None):
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {capturable!r}")
        if meta_every is not None and (isinstance(meta_every, bool)
                                       or not isinstance(meta_every, int) or meta_every < 1):
            raise ValueError(f"meta_every must be None or a positive int, got {meta_every!r}")
        from emcl_kernels.backends import BACKENDS
        if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, "
                             f"got {backend!r}")
        given = {k: v for k, v in (("lr", lr), ("inner_lr", inner_lr)) if v is not None}
        lr = group_spelling(given, "FusedEMCLOptimizer()").get("lr", DEFAULT_LR)
        defaults = dict(lr=lr, meta_lr=meta_lr, reg=reg, gamma=gamma, decay=decay,
                        meta_lr_scale=lr_scale, lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max,
                        eps=eps, importance=importance, prox=prox, weight_decay=weight_decay,
                        runs=runs)
        defaults = normalize_runs(defaults, "FusedEMCLOptimizer()")
        self._check_group(defaults, "the defaults")
        defaults["capturable"] = capturable
        self.meta_every = meta_every
        self.backend = backend
        self.check_finite = check_finite
        self._reset_runtime(calls=0, skips=0)
        super().__init__(params, defaults)
        self._own_hooks()

    def _reset_runtime(self, calls: int, skips: int) -> None:
        """Forget plans and device counters; the counts start from ``calls`` and ``skips``."""
        self._runtime = Runtime(self, calls=calls, skips=skips)

    # -- hyper-parameters ---------------------------------------------------------------------
    @staticmethod
    def _check_group(group: dict, where: str = "param group") -> dict:
        return check_group(group, where)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch semantics); its parameters get state at their first step.

        Refused, with nothing added, when a hyper-parameter is out of its domain, a parameter
        is not a floating-point tensor, appears twice or shares memory with another parameter
        of any group, or the backend cannot run on a parameter's device.
        """
        where = f"param group {len(self.param_groups)}"
        if isinstance(param_group, dict):
            param_group = group_spelling(param_group, where)
            param_group = normalize_runs(
                param_group, where, group_runs({**self.defaults, **param_group}, where))
            if "lr_scale" in param_group and "meta_lr_scale" not in param_group:
                warnings.warn(
                    f"{where} has 'lr_scale' = {param_group['lr_scale']!r}, which "
                    "FusedEMCLOptimizer does not read: a param group holds EMCL's r as "
                    "'meta_lr_scale' (the constructor's lr_scale=), since 'lr_scale' in a group is "
                    "timm's multiplier of lr (timm's schedulers apply it). Set 'meta_lr_scale' "
                    "for r", UserWarning, stacklevel=2)
            self._check_group({**self.defaults, **{k: v for k, v in param_group.items()
                                                   if k != "params"}}, where)
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            named = []
            for g, other in enumerate(self.param_groups):
                for pi, p in enumerate(other["params"]):
                    where = f"parameter {pi} of param group {g}"
                    if p.dtype not in PARAM_DTYPES:
                        raise TypeError(f"{where} has dtype {p.dtype}; FusedEMCLOptimizer "
                                        "updates floating-point parameters (float32, "
                                        "bfloat16, float16, float64)")
                    if p.device.type != "meta":
                        named.append((where, p))
            check_no_overlap(named)
            runs = declared_runs(group, where)
            for pi, p in enumerate(group["params"]):
                if p.device.type != "meta":  # fail now if the backend cannot run on these
                    resolve_backend(self.backend, local(p).device)
                check_run_layout(f"parameter {pi} of {where}", p, runs)
            self._runtime._array_runs()  # one number of runs for every array group
            if group.get("capturable"):
                self._runtime.adopt_capturable(gi)
        except Exception:
            self.param_groups.pop()
            raise
        self._runtime.plans = None

    # -- the steps ------------------------------------------------------------------------------
    # [note: AMP] torch.amp.GradScaler.step(opt) sees ``_step_supports_amp_scaling`` and, instead
    # of unscaling the grads itself, sets ``opt.grad_scale`` (the scale, or None when the user
    # already called ``scaler.unscale_(opt)``) and ``opt.found_inf`` (summed over devices) for the
    # duration of ``opt.step()``. The kernels divide the grads by the scale and write nothing
    # when found_inf is non-zero, as torch's fused optimizers do, and the meta step count is
    # not advanced. Both may also be passed to any step method by hand.
    _step_supports_amp_scaling = True

    def _amp(self, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]):
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        check_flag("grad_scale", grad_scale)
        check_flag("found_inf", found_inf)
        return grad_scale, found_inf

    # [note: torch.compile] Dynamo runs a method named ``_init_group`` eagerly, with the real
    # tensors, when it traces a step (torch/_dynamo/variables/optimizer.py): that is where the
    # plans are built or refreshed, outside the graph; the lists it fills become graph inputs
    # (guarded, and marked static for CUDA graphs) and the specs it returns become constants.
    # The traced step then makes the same backend calls as an eager one, with ``hyper`` made in
    # the graph from the groups' values ([note: compiled hyper-parameters] in plan.py), since a
    # call of the compiled graph does not run this method.
    def _init_group(self, group: dict, params: list, grads: list, anchors: list,
                    importances: list, meta_lrs: list, extras: list) -> tuple:
        """Fill the lists with this group's plans' tensors (``extras``: steps, hyper, counters
        of each plan) and return one spec per plan: (tensors, meta_lrs, prox, importance,
        lr_mode, device)."""
        runtime = self._runtime
        runtime.tracing = True
        try:
            plans, all_grads = runtime.gather()
        finally:
            runtime.tracing = False
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        specs = []
        for plan, g in zip(plans, all_grads):
            if plan.group != gi:
                continue
            params += plan.params
            grads += g
            anchors += plan.anchors
            importances += plan.importances
            meta_lrs += plan.meta_lrs
            extras += [plan.steps, plan.hyper, runtime.counters[plan.device]]
            specs.append((len(plan.params), len(plan.meta_lrs), plan.prox, plan.importance,
                          plan.lr_mode, str(plan.device)))
        return tuple(specs)

    @torch.no_grad()
    def _step(self, op: int, meta_every: int, grad_scale, found_inf) -> None:
        grad_scale, found_inf = self._amp(grad_scale, found_inf)
        check = self.check_finite and found_inf is None
        runtime = self._runtime
        if torch.compiler.is_compiling():
            if runtime.runs > 1 or any(g.get("runs") for g in self.param_groups):
                raise RuntimeError(
                    "torch.compile of a FusedEMCLOptimizer step with array groups (runs=N) is "
                    "not supported: step it eagerly (one native call per plan already serves "
                    "every run) or capture it in a CUDA graph with capturable=True")
            plans, grads, counters = runtime.traced_plans()
            if plans:
                run(plans, grads, counters, op=op, meta_every=meta_every, check=check,
                    grad_scale=grad_scale, found_inf=found_inf, mesh=runtime.mesh)
            return
        runtime.step(op, meta_every, check=check, grad_scale=grad_scale, found_inf=found_inf)

    def step(self, closure: Optional[Callable[[], Tensor]] = None, *,
             update: Optional[str] = None, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None):
        """An inner step; with ``meta_every=k``, every k-th call is the fused inner+meta step.

        ``update`` names one update instead: ``"inner"``, ``"meta"`` or ``"inner_meta"`` (what
        :meth:`inner_step`, :meth:`meta_step` and :meth:`inner_meta_step` do, through here, so
        that torch's step hooks, LR schedulers and trainers that count ``step()`` calls see every
        update: [note: one step method]). Such a call does not count towards ``meta_every``.

        ``closure``, if given, re-evaluates the model and returns the loss (computed with
        gradients enabled), as for any ``torch.optim.Optimizer``. ``grad_scale``/``found_inf``:
        see [note: AMP]. A call skipped for an inf/NaN still counts towards ``meta_every``. The
        calls are counted on the device, so a compiled or captured ``step()`` keeps the cadence.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if update is None:
            self._step(OP["cadence"], self.meta_every or _NEVER, grad_scale, found_inf)
        else:
            op = _UPDATES.get(update) if isinstance(update, str) else None
            if op is None:
                raise ValueError(f"update must be None (the meta_every cadence) or one of "
                                 f"{', '.join(map(repr, _UPDATES))}, got {update!r}")
            self._step(op, 1, grad_scale, found_inf)
        return loss

    # [note: one step method] The paper's two updates are ``step(update=...)`` calls: torch's
    # ``Optimizer.step`` wrapper (step pre/post hooks, the profiler's record, the flag an LR
    # scheduler checks to warn about a scheduler stepped before its optimizer) then runs for
    # every update, and a wrapper that counts optimizer steps (Lightning's LightningOptimizer,
    # which EMCL's methods reach through its ``step``, accelerate's AcceleratedOptimizer) counts
    # inner and meta steps, with no EMCL-specific code in the trainer.
    def inner_step(self, *, grad_scale: Optional[Tensor] = None,
                   found_inf: Optional[Tensor] = None) -> None:
        """One inner step (eqs. 14, 15, 19) on every parameter with a gradient:
        ``step(update="inner")``. ``grad_scale``/``found_inf``: see [note: AMP] (normally set
        by ``GradScaler.step``)."""
        self.step(update="inner", grad_scale=grad_scale, found_inf=found_inf)

    def meta_step(self, *, grad_scale: Optional[Tensor] = None,
                  found_inf: Optional[Tensor] = None) -> None:
        """One meta step (eqs. 13, 7, 8, 10): importance, learning rates, anchor; θ ← θ₀.
        ``step(update="meta")``."""
        self.step(update="meta", grad_scale=grad_scale, found_inf=found_inf)

    def inner_meta_step(self, *, grad_scale: Optional[Tensor] = None,
                        found_inf: Optional[Tensor] = None) -> None:
        """The inner step, then the meta step on the same gradient, in one fused pass:
        ``step(update="inner_meta")``."""
        self.step(update="inner_meta", grad_scale=grad_scale, found_inf=found_inf)

    # -- counters -------------------------------------------------------------------------------
    @property
    def _step_calls(self) -> int:
        """The count of ``step()`` calls that ``meta_every`` runs on (waits for the device)."""
        return self._runtime.step_calls

    @_step_calls.setter
    def _step_calls(self, value: int) -> None:
        self._runtime.step_calls = value

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for non-finite gradients (kept in checkpoints). Reading
        it waits for the steps still in flight on a GPU."""
        return self._runtime.skips.total()

    @property
    def runs(self) -> int:
        """The number of runs of the array groups (1 when there are none)."""
        return self._runtime._array_runs()

    @property
    def skipped_runs(self) -> list:
        """For an optimizer with array groups: how many steps each run skipped for a
        non-finite gradient of its own (a step that every run skipped is counted in
        :attr:`skipped_steps`); kept in checkpoints. Reading it waits for a GPU's steps."""
        runs = self.runs
        if runs == 1:
            return []
        return self._runtime.skips.run_totals(runs)

    # -- checkpoints ----------------------------------------------------------------------------
    # [note: checkpoint hooks] torch's state_dict runs its pre-hooks, packs the state, then its
    # post-hooks; what EMCL adds to the dict (the "emcl" entry, the step counts as tensors of
    # their own, capturable values as numbers) is the first post-hook, so that a user's hooks
    # see and may change the final dict. load_state_dict runs the user's pre-hooks first (one
    # may change or replace what is loaded), then checks what they produced, then loads it and
    # runs the post-hooks: the order torch's optimizers follow.
    def _own_hooks(self) -> None:
        """Register [note: checkpoint hooks]' post-hook once (again after an unpickle, which
        gives an optimizer empty hook dicts)."""
        hooks = self._optimizer_state_dict_post_hooks
        if not any(h is _finish_state_dict for h in hooks.values()):
            self.register_state_dict_post_hook(_finish_state_dict, prepend=True)

    def state_dict(self) -> dict:
        """torch's optimizer state dict, plus ``"emcl"``: the count of ``step()`` calls that
        ``meta_every`` runs on, the count of skipped steps, and every parameter's shape (so
        that a load into another model or another parameter order is refused). Capturable
        hyper-parameters are saved as numbers. Hooks: [note: checkpoint hooks]."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by :meth:`state_dict`, on any device and backend.

        The load_state_dict pre-hooks run first and what they return is what is loaded. Then
        everything is checked before anything changes: the groups and their hyper-parameters,
        the parameters' shapes and order, every state tensor's kind, shape and values (finite
        anchors, finite non-negative importances and rates, whole non-negative step counts) and
        the counters. The state tensors keep their fp32 (fp64) values whatever the parameters'
        dtype, so a bf16 model's master anchors survive the round trip bit for bit; they are put
        on the parameters' device, in the parameters' memory layout. A state saved before param
        groups held β as ``lr`` (under ``inner_lr``) loads as ``lr``. Entries of the state that
        are not a parameter's (a hook's) are kept as they are, as torch does.
        """
        from emcl_kernels.checkpoint import check_state_dict
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_state, extra, id_to_param, saved_groups = check_state_dict(self, state_dict)
        state: defaultdict = defaultdict(dict)
        for key, st in state_dict["state"].items():
            if key not in id_to_param:
                state[key] = st
        for pid, st in saved_state.items():
            p = id_to_param[pid]
            mine = state[p]
            for key, value in st.items():
                if key == "step":
                    value = torch.as_tensor(value).detach()
                    mine[key] = value.reshape(() if value.numel() == 1 and value.dim() == 0
                                              else (-1,)).to(
                        dtype=torch.float32, device=local(p).device).clone()
                else:
                    mine[key] = torch.empty_like(p, dtype=state_dtype(p.dtype)).copy_(value)
        groups = []
        for group, saved in zip(self.param_groups, saved_groups):
            new = deepcopy({k: v for k, v in saved.items() if k != "params"})
            new["params"] = group["params"]
            if "param_names" in group and "param_names" not in new:
                new["param_names"] = group["param_names"]
            groups.append(new)
        groups = [normalize_runs(g, f"param group {gi}") for gi, g in enumerate(groups)]
        self._runtime.retire()
        self.state, self.param_groups = state, groups
        self._reset_runtime(calls=extra["step_calls"], skips=extra["skipped_steps"])
        self._runtime.skips.run_base = extra["skipped_runs"]
        for gi, group in enumerate(self.param_groups):
            if group.get("capturable"):
                self._runtime.adopt_capturable(gi)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # -- copies and pickles ---------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["state"] = {p: _own_steps(st) for p, st in state["state"].items()}
        state["emcl"] = {"meta_every": self.meta_every, "backend": self.backend,
                         "check_finite": self.check_finite, "step_calls": self._step_calls,
                         "skipped_steps": self.skipped_steps}
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        extra = state.pop("emcl", None)
        super().__setstate__(state)
        self._own_hooks()
        if extra is None:
            return
        self.meta_every = extra.get("meta_every")
        self.backend = extra.get("backend", "auto")
        self.check_finite = extra.get("check_finite", True)
        self._reset_runtime(calls=extra.get("step_calls", 0),
                            skips=extra.get("skipped_steps", 0))
        for gi, group in enumerate(self.param_groups):
            if group.get("capturable"):
                self._runtime.adopt_capturable(gi)


def _own_steps(st):
    """A parameter's state with its ``step`` a tensor of its own (in the optimizer it is a view
    of its plan's one counter tensor); anything that is not a parameter's state as it is."""
    if not isinstance(st, dict) or not isinstance(st.get("step"), Tensor):
        return st
    return {k: (v.detach().clone() if k == "step" else v) for k, v in st.items()}


_CAPTURABLE_KEYS = tuple(GROUP_NAMES.get(k, k) for k in NUMERIC_KEYS)


def _finish_state_dict(opt: FusedEMCLOptimizer, sd: dict) -> None:
    """The state_dict post-hook that completes EMCL's dict ([note: checkpoint hooks])."""
    sd["state"] = {k: _own_steps(st) for k, st in sd["state"].items()}
    for group in sd["param_groups"]:
        for k in _CAPTURABLE_KEYS:
            v = group.get(k)
            if group.get("capturable") and isinstance(v, Tensor):
                group[k] = float(v.item()) if v.dim() == 0 else v.tolist()
            elif isinstance(v, PerRun):  # plain lists: torch.load(weights_only=True) reads them
                group[k] = list(v)
    sd["emcl"] = {"step_calls": opt._step_calls, "skipped_steps": opt.skipped_steps,
                  "skipped_runs": opt.skipped_runs or None,
                  "param_shapes": [[list(p.shape) for p in group["params"]]
                                   for group in opt.param_groups]}
