"""FusedEMCLOptimizer: EMCL as a ``torch.optim.Optimizer`` (SPEC section 3)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from emcl_kernels import functional as F
from emcl_kernels.backends import BACKENDS, get_backend
from emcl_kernels.reference import compute_dtype

__all__ = ["FusedEMCLOptimizer"]

# SPEC section 2 leaves lr_mode, lr_scale and decay open; these are the values chosen by the
# Permuted-MNIST ablation (README, "Choosing the open defaults").
DEFAULT_LR_MODE = "inverse"
DEFAULT_DECAY = 0.9
DEFAULT_LR_SCALE = None  # None: 1 / reg, so that alpha * reg * h ~ meta_lr wherever h >> eps

_INNER_KEYS = ("inner_lr", "reg", "gamma", "prox")
_META_KEYS = ("meta_lr", "reg", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max", "eps",
              "importance")


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
    """

    def __init__(self, params, meta_lr: float = 0.1, inner_lr: float = 0.075, reg: float = 50.0,
                 gamma: float = 0.1, decay: float = DEFAULT_DECAY,
                 lr_scale: Optional[float] = DEFAULT_LR_SCALE, lr_mode: str = DEFAULT_LR_MODE,
                 lr_min: float = 0.0, lr_max: float = float("inf"), eps: float = 1e-8,
                 importance: str = "taylor", prox: bool = True,
                 meta_every: Optional[int] = None, backend: str = "auto"):
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
        self._step_calls = 0
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                get_backend(backend, p.device)  # fail now if it cannot run on these tensors

    # -- hyper-parameters ---------------------------------------------------------------------
    @staticmethod
    def _check_group(group: dict) -> None:
        hp = {k: group[k] for k in _INNER_KEYS + _META_KEYS if k in group}
        if hp.get("lr_scale", 0.0) is None:
            hp.pop("lr_scale")
        F.check_hyperparameters(**hp)

    def add_param_group(self, param_group: dict) -> None:
        self._check_group({**self.defaults, **param_group})  # before the group is added
        super().add_param_group(param_group)

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

    # -- the steps ------------------------------------------------------------------------------
    @torch.no_grad()
    def inner_step(self) -> None:
        """One inner step (eqs. 14, 15, 19) on every parameter with a gradient."""
        for group in self.param_groups:
            params, grads, anchors, importances, _, _ = self._init_group(group)
            F.inner_step_(params, grads, anchors, importances, backend=self.backend,
                          **self._hyper(group, _INNER_KEYS))

    @torch.no_grad()
    def meta_step(self) -> None:
        """One meta step (eqs. 13, 7, 8, 10): importance, learning rates, anchor; θ ← θ₀."""
        self._meta(F.meta_step_, _META_KEYS)

    @torch.no_grad()
    def inner_meta_step(self) -> None:
        """The inner step, then the meta step on the same gradient, in one fused pass."""
        self._meta(F.inner_meta_step_, _META_KEYS + ("inner_lr", "gamma", "prox"))

    def _meta(self, fn: Callable, keys) -> None:
        for group in self.param_groups:
            params, grads, anchors, importances, meta_lrs, steps = self._init_group(group)
            fn(params, grads, anchors, importances, meta_lrs, backend=self.backend,
               **self._hyper(group, keys))
            if steps:
                torch._foreach_add_(steps, 1.0)

    def step(self, closure: Optional[Callable[[], Tensor]] = None):
        """An inner step; with ``meta_every=k``, every k-th call is the fused inner+meta step.

        ``closure``, if given, re-evaluates the model and returns the loss (computed with
        gradients enabled), as for any ``torch.optim.Optimizer``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_calls += 1
        if self.meta_every is not None and self._step_calls % self.meta_every == 0:
            self.inner_meta_step()
        else:
            self.inner_step()
        return loss

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer state dict, plus ``"emcl"``: the count of ``step()`` calls that
        ``meta_every`` runs on."""
        sd = super().state_dict()
        sd["emcl"] = {"step_calls": self._step_calls}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by :meth:`state_dict`, on any device and backend.

        The state tensors keep their fp32 (fp64) dtype whatever the parameters' dtype, so a
        bf16 model's master anchors survive the round trip bit for bit. A state saved for
        parameters of other shapes or another order is refused before anything changes.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("emcl", {})
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(saved_groups)} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        id_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("a param group of the state has "
                                 f"{len(saved['params'])} parameters, this optimizer's has "
                                 f"{len(group['params'])}")
            id_to_param.update(zip(saved["params"], group["params"]))
        saved_state = state_dict["state"]
        for pid, st in saved_state.items():
            p = id_to_param.get(pid)
            if p is None:
                raise ValueError(f"the state names parameter id {pid}, which no group holds")
            for key in ("anchor", "importance", "meta_lr"):
                if key in st and tuple(st[key].shape) != tuple(p.shape):
                    raise ValueError(f"state {key!r} of parameter {pid} has shape "
                                     f"{tuple(st[key].shape)} but the parameter has "
                                     f"{tuple(p.shape)}: was it saved for another model or "
                                     "another parameter order?")
        for saved in saved_groups:
            self._check_group(saved)
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
