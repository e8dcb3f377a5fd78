"""EMCL (paper Algorithm 1) driven by :class:`emcl_kernels.FusedEMCLOptimizer`.

Per incoming batch ``b`` of task ``t``:

1. draw ``replay`` samples from the reservoir buffer (when ``memory`` > 0);
2. **inner loop**, one sample at a time over the batch (and the replayed samples when
   ``inner_replay``): ``loss(x_k).backward(); opt.inner_step()`` -- the proximal step of
   eqs. 14-15/19 (or the plain gradient step on eq. 6 with ``prox=False``);
3. **meta step**: the meta-loss on the batch (plus the replayed samples when
   ``meta_replay``) at the adapted weights θ_k, ``backward``, ``opt.meta_step()`` -- the
   importance update (eq. 7, Taylor or SI), the meta learning rates (eq. 8, ``lr_mode``)
   and the closed-form meta-update (eq. 10), after which θ = θ₀;
4. offer the batch to the reservoir buffer.

``glances`` > 1 repeats steps 1-3 on the same incoming batch (a fresh replay draw each time),
as La-MAML's code base lets its methods do (``--glances``; La-MAML itself runs 5 on MNIST
Permutations and 10 on Many Permutations): still a single pass over the stream, with more
meta steps per batch. The default is Algorithm 1's one visit on every stream; the reported
tables show 2 and 5 beside it. ``shuffle_inner`` visits the incoming and replayed samples of
the inner loop in a random order instead of the incoming ones first.

Defaults and where they differ from the paper (docs/results.md, "Deviations from the paper", lists
each with its measured effect): Table II's α₀, λ, γ; β chosen on validation data from the grid
of :data:`emcl_continual.core.presets.GRIDS` (Table II's 0.15 is one of the candidates); a 200/500-sample
reservoir memory with 10 replayed samples visited by the inner loop and the meta-loss (the
paper's meta-loss over tasks 1..t implies stored past samples, its training details do not list
EMCL among the methods that store them: this is the first reading); ``lr_mode="inverse"``
with r = 1/λ in place of eq. 8's recurrence (which compounds r/h every step); η = 0.9.

Ablation (paper Table IV, third column) ``inner_lr_modulation=True``: no regularization in
the inner loop; each inner step is θ ← θ − α ⊙ g with α the per-element meta learning
rates the optimizer holds (La-MAML style), clipped to ``[0, modulation_lr_max]``.

On the MLP streams the eager inner loop (the CPU's default) runs as one fused call per glance
(:mod:`emcl_continual.methods.emcl_fused`: the same one-sample steps, the gradient never in
memory; ``fused_glance=False`` keeps autograd's loop). On a GPU (``cuda_graph="auto"``, the
default) each glance is captured in a CUDA graph and
replayed (:mod:`emcl_continual.methods.emcl_graphed`: static input buffers, one graph per shape, the
optimizer built with ``capturable=True``); ``cuda_graph=False`` keeps the eager loop below,
``cuda_graph=True`` also runs the static-buffer routine on the CPU (eagerly, bit for bit the
eager loop).

Controls of what the Taylor importance h does (docs/results.md, "Deviations from the paper"):

* ``fixed_importance=h̄`` (with ``decay=1``): h is held at the constant h̄ in every element for
  the whole run (the optimizer's state is created by a zero-gradient inner step, an exact
  no-op, and its importance filled with h̄; ``decay=1`` makes eq. 7 ``h ← 1·h + 0·Ω``).
  With ``prox=False``, ``lr_mode="inverse"`` and r = 1/λ this computes, per element,
  inner θ ← θ − β·(g + λ·h̄·(θ − θ₀)) and meta θ₀ ← θ₀ + α₀·h̄/(h̄ + ε)·(θ − θ₀): for
  h̄ = 1e-4 (the ``importance-off`` preset) a pull of βλh̄ = 3e-5 of the distance to θ₀ per inner
  step and a meta step of 0.9999·α₀, i.e. Reptile over one-sample SGD steps: EMCL with the
  importance taken out of both updates.
* ``importance_norm="global"`` / ``"tensor"``: the inner step's proximal pull uses h divided by
  its mean over all parameters / over the parameter's own tensor, c = γ·λ·h/mean(h) instead of
  γ·λ·h, so that γλ is the pull of an element of average importance whatever the scale of h
  (|g·θ₀| is ~1e-5 on the MNIST MLP, where γλh is ~1e-5 and the pull does nothing). It is done
  by setting each param group's γ to γ/mean(h) after every meta step (one group per tensor for
  ``"tensor"``); the meta step does not read γ, and with r = 1/λ it does not depend on the scale
  of h either, so this changes the inner step only. With ``fixed_importance`` it gives the
  *uniform pull* control: c = γλ in every element. Both run eagerly (no CUDA graph): the pull
  changes γ between glances.

:meth:`EMCL.diagnostics` (recorded after every task) gives quantiles of h and of the pull c,
and the share of elements where the pull or the importance term of the meta step acts.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from emcl_kernels.backends import BACKENDS
from emcl_kernels.functional import check_hyperparameters
from emcl_kernels.interface import IMPORTANCE_KINDS, LR_MODES
from emcl_kernels.interface import resolve_lr_scale

from ..core.presets import BATCH_SIZE, MEMORY
from ..core.schema import BOOL, Rule, float_rule, int_rule
from ..data.streams import StreamInfo
from .base import Method
from .emcl_fused import FusedGlance, fused_plan
from .emcl_graphed import GlanceRoutine, graph_plan
from .replay import ReservoirBuffer

__all__ = ["EMCL", "OPTIMIZER_KEYS", "glance_plan"]

# Config keys handed to FusedEMCLOptimizer as per-group hyper-parameters.
OPTIMIZER_KEYS = ("meta_lr", "inner_lr", "reg", "gamma", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max",
                  "eps", "importance", "prox")

# The open choices of SPEC section 2, settled by the ablation on Permuted MNIST
# (results/ablation_permuted_mnist.md); lr_scale=None means 1/reg.
ABLATION_DEFAULTS = {"lr_mode": "inverse", "lr_scale": None, "decay": 0.9}

IMPORTANCE_NORMS = (None, "global", "tensor")

# β on MNIST Permutations / Rotated MNIST: the candidate the selection on validation data chose
# (presets.GRIDS; a test checks it against results/heldout/). Table II's 0.15 diverges from
# one-sample inner steps there.
SELECTED_INNER_LR = 0.03

# Table II: α₀ (meta_lr), β (inner_lr), λ (reg), γ (gamma) per stream.
TABLE_II = {
    "permuted-mnist": {"meta_lr": 0.3, "inner_lr": 0.15, "reg": 10.0, "gamma": 0.3},
    "many-permutations": {"meta_lr": 0.15, "inner_lr": 0.03, "reg": 10.0, "gamma": 0.1},
    "split-cifar100": {"meta_lr": 0.1, "inner_lr": 0.075, "reg": 50.0, "gamma": 0.1},
    "split-miniimagenet": {"meta_lr": 0.1, "inner_lr": 0.075, "reg": 50.0, "gamma": 0.1},
}


def glance_plan(config: dict, device) -> tuple:
    """``(use_routine, capture, why_not)``: how EMCL with ``config`` runs its glances on ``device``
    (:func:`~emcl_continual.methods.emcl_graphed.graph_plan`, and eagerly for the normalised
    pull, which sets γ on the host after every meta step). Needs no GPU: it reads the device's
    type only, so the selection's ``--device auto`` asks it on any machine."""
    use_routine, capture, why_not = graph_plan(config, torch.device(device))
    if config.get("importance_norm") is not None and use_routine:
        use_routine, capture = False, False
        why_not = why_not or "importance_norm changes gamma between glances"
    return use_routine, capture, why_not


class EMCL(Method):
    """Efficient Meta-learning for Continual Learning with the fused optimizer."""

    name = "emcl"
    TABLE_II = TABLE_II
    GENERATOR_OFFSET = 1
    OPTIONAL = {"lr_min": 0.0, "lr_max": float("inf"), "eps": 1e-8}
    RULES = {
        "memory": int_rule(0, "replay memory size; 0 turns replay off"),
        "meta_lr": float_rule(), "inner_lr": float_rule(), "reg": float_rule(), "gamma": float_rule(),
        "lr_mode": Rule(str, choices=tuple(LR_MODES)),
        "lr_scale": float_rule(none=True, note="None: 1/reg"),
        "decay": float_rule(high=1.0),
        "lr_min": float_rule(), "lr_max": float_rule(finite=False), "eps": float_rule(open_=True),
        "importance": Rule(str, choices=tuple(IMPORTANCE_KINDS)),
        "prox": BOOL,
        "replay": int_rule(0, "replayed samples per incoming batch; 0 turns replay off"),
        "inner_replay": BOOL, "meta_replay": BOOL, "shuffle_inner": BOOL,
        "glances": int_rule(1),
        "inner_lr_modulation": BOOL,
        "modulation_lr_max": float_rule(none=True, note="None: meta_lr"),
        "fixed_importance": float_rule(open_=True, none=True, note="None: h is the Taylor moving average"),
        "importance_norm": Rule(str, choices=("global", "tensor"), none=True, note="None: the pull is gamma*reg*h"),
        "backend": Rule(str, choices=("auto",) + tuple(sorted(BACKENDS))),
        "cuda_graph": Rule(bool, choices=("auto",), note="'auto': capture on a GPU, eager on a CPU"),
        "fused_glance": Rule(bool, choices=("auto",),
                             note="'auto': the MLP's eager inner loop in one fused call (emcl_fused.py)"),
    }

    @classmethod
    def defaults(cls, stream: str) -> dict:
        if stream not in MEMORY:
            raise ValueError(f"emcl: no hyper-parameters for stream {stream!r}; known streams: {sorted(MEMORY)}")
        # Rotated MNIST has no Table II column: it takes MNIST Permutations' (same network and task size)
        column = "permuted-mnist" if stream == "rotated-mnist" else stream
        cfg = {"memory": MEMORY[stream], **TABLE_II[column]}
        if column == "permuted-mnist":
            cfg["inner_lr"] = SELECTED_INNER_LR  # Table II's β = 0.15 is one of the selection's candidates
        cfg.update(ABLATION_DEFAULTS)
        cfg.update({
            "importance": "taylor",
            "prox": True,
            "replay": BATCH_SIZE,          # replayed samples per incoming batch
            "inner_replay": True,          # the inner loop also visits the replayed samples
            "meta_replay": True,           # the meta-loss also covers them
            "shuffle_inner": False,        # inner loop in random order (else: incoming samples first)
            "glances": 1,                  # Algorithm 1: one inner loop and one meta step per incoming batch
            "inner_lr_modulation": False,  # Table IV ablation: α as inner lr, no inner regularization
            "modulation_lr_max": None,     # clip of α in that ablation (None: meta_lr)
            "fixed_importance": None,      # control: h held at this constant (needs decay=1)
            "importance_norm": None,       # pull c = γλh/mean(h): "global" or "tensor" (None: γλh)
            "backend": "auto",
            "cuda_graph": "auto",          # glances replayed from CUDA graphs on a GPU (emcl_graphed.py)
            "fused_glance": "auto",        # the MLP's eager inner loop as one fused call (emcl_fused.py)
        })
        return cfg

    @classmethod
    def validate(cls, config: dict) -> None:
        """The optimizer's own checks of its keys (cross-key rules such as lr_max >= lr_min), and
        fixed_importance's need of decay=1."""
        check_hyperparameters(**{k: config[k] for k in OPTIMIZER_KEYS if config.get(k) is not None})
        if config.get("fixed_importance") is not None and float(config.get("decay", 0.9)) != 1.0:
            raise ValueError("fixed_importance holds h constant, which needs decay=1 "
                             "(eq. 7: h <- 1*h + 0*Omega); add --set decay=1.0")

    def make_optimizer(self):
        """:class:`emcl_kernels.FusedEMCLOptimizer` with the optimizer keys of the configuration
        (``lr_scale=None``: :func:`emcl_kernels.interface.resolve_lr_scale`, 1/reg), one param
        group per tensor for ``importance_norm="tensor"``, ``capturable`` when the glances are
        captured in CUDA graphs."""
        from emcl_kernels import FusedEMCLOptimizer

        cfg = self.config
        hyper = {k: cfg[k] for k in OPTIMIZER_KEYS if k in cfg and cfg[k] is not None}
        hyper["lr_scale"] = resolve_lr_scale(hyper.get("lr_scale"), float(cfg.get("reg", 0.0)))
        self.hyper = hyper
        self.importance_norm = cfg.get("importance_norm")
        use_routine, capture, why_not = glance_plan(cfg, self.device)
        self.graph_choice = (use_routine, capture, why_not)
        if self.importance_norm == "tensor":
            params = [{"params": [p]} for p in self.model.parameters()]
        else:
            params = list(self.model.parameters())
        return FusedEMCLOptimizer(params, backend=cfg.get("backend", "auto"), capturable=capture, **hyper)

    def __init__(self, model: nn.Module, info: StreamInfo, config: dict, device: torch.device):
        super().__init__(model, info, config, device)
        self._weights = list(model.parameters())   # what _zero_grads clears
        cfg = self.config
        use_routine, capture, why_not = self.graph_choice
        self.fixed_importance = cfg.get("fixed_importance")
        self.base_gamma = float(self.hyper.get("gamma", 0.0))
        if self.fixed_importance is not None:
            self._fix_importance(float(self.fixed_importance))
        self._normalize_pull()
        self.memory = int(cfg.get("memory", 0) or 0)
        self.n_replay = int(cfg.get("replay", 0) or 0)
        self.inner_replay = bool(cfg.get("inner_replay", True))
        self.meta_replay = bool(cfg.get("meta_replay", True))
        self.shuffle_inner = bool(cfg.get("shuffle_inner", False))
        self.glances = int(cfg.get("glances", 1))
        self.modulation = bool(cfg.get("inner_lr_modulation", False))
        mod_max = cfg.get("modulation_lr_max")
        self.modulation_lr_max = float(self.hyper["meta_lr"] if mod_max is None else mod_max)
        self.buffer = ReservoirBuffer(self.memory, info.input_shape, self.generator, device=self.device) \
            if self.memory > 0 else None
        self.routine = GlanceRoutine(self, capture=capture) if use_routine else None
        use_fused, self.fused_why_not = fused_plan(cfg, model, self.device, eager=not use_routine)
        self.fused = FusedGlance(self) if use_fused else None
        if why_not is not None:
            warnings.warn(f"emcl: no CUDA graphs on {self.device}: {why_not}; the glances run eagerly",
                          RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _fix_importance(self, value: float) -> None:
        """Create the optimizer's state with an inner step on zero gradients (g = 0 and θ = θ₀, so
        the proximal step θ̂ − w·(θ̂ − θ₀) with θ̂ = θ leaves θ where it is, as does the plain one)
        and set every importance to ``value``."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.opt.inner_step()
        self._zero_grads()
        for p in params:
            self.opt.state[p]["importance"].fill_(value)

    def _importances(self):
        """(param group, [importance tensors]) for every group, skipping parameters without state."""
        for group in self.opt.param_groups:
            yield group, [self.opt.state[p]["importance"] for p in group["params"]
                          if p in self.opt.state and "importance" in self.opt.state[p]]

    @torch.no_grad()
    def _normalize_pull(self) -> None:
        """``importance_norm``: set each group's γ to γ₀/mean(h), so that c = γ₀·λ·h/mean(h)."""
        if self.importance_norm is None:
            return
        groups = list(self._importances())
        if self.importance_norm == "global":
            total = sum(float(h.sum()) for _, hs in groups for h in hs)
            count = sum(h.numel() for _, hs in groups for h in hs)
            means = [total / count if count else 0.0] * len(groups)
        else:
            means = [sum(float(h.sum()) for h in hs) / max(1, sum(h.numel() for h in hs)) for _, hs in groups]
        for (group, _), mean in zip(groups, means):
            # h = 0 everywhere (before the first meta step): c = 0 whatever γ is
            group["gamma"] = self.base_gamma / mean if mean > 0 else self.base_gamma

    @torch.no_grad()
    def diagnostics(self) -> dict:
        """How much the importance acts, over every parameter element now: quantiles of h, of
        the inner pull c (γ·λ·h with the group's γ, prox) or β·λ·h (no prox), the share of
        elements with a pull above 0.1 / 0.01, and the share whose meta step is held below
        99 % of α₀·r·λ by the importance (inverse mode: h/(h + ε) < 0.99)."""
        hs, pulls = [], []
        for group, imps in self._importances():
            lam = float(group["reg"])
            scale = float(group["gamma"]) * lam if group["prox"] else float(group["lr"]) * lam
            for h in imps:
                hs.append(h.flatten().double())
                pulls.append(h.flatten().double() * scale)
        if not hs:
            return {}
        h = torch.cat(hs)
        c = torch.cat(pulls)
        q = torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64, device=h.device)
        hq, cq = torch.quantile(h, q).tolist(), torch.quantile(c, q).tolist()
        eps = float(self.opt.param_groups[0]["eps"])
        out = {"h_mean": float(h.mean()), "h_median": hq[0], "h_p90": hq[1], "h_p99": hq[2], "h_max": float(h.max()),
               "pull_median": cq[0], "pull_p90": cq[1], "pull_p99": cq[2], "pull_max": float(c.max()),
               "pull_gt_0.1": float((c > 0.1).double().mean()), "pull_gt_0.01": float((c > 0.01).double().mean()),
               "pull_kind": "gamma*reg*h (prox)" if self.opt.param_groups[0]["prox"] else "inner_lr*reg*h (no prox)"}
        if self.opt.param_groups[0]["lr_mode"] == "inverse":
            out["meta_damped_share"] = float((h / (h + eps) < 0.99).double().mean())
        return out

    def _zero_grads(self) -> None:
        """``model.zero_grad(set_to_none=True)`` over the parameters listed once: the module walk
        of ``zero_grad`` after every one-sample inner step cost ~10 % of an eager MNIST run."""
        for p in self._weights:
            p.grad = None

    def _loss(self, x: torch.Tensor, y: torch.Tensor, t) -> torch.Tensor:
        return F.cross_entropy(self.model(x, t), y)

    @torch.no_grad()
    def _modulated_inner_step(self) -> None:
        """θ ← θ − α ⊙ g with the optimizer's current meta learning rates α (Table IV ablation)."""
        group = self.opt.param_groups[0]
        mode, a0 = group["lr_mode"], float(group["meta_lr"])
        for p in (q for g in self.opt.param_groups for q in g["params"]):
            if p.grad is None:
                continue
            state = self.opt.state.get(p, {})
            if mode == "recurrent" and "meta_lr" in state:
                alpha = state["meta_lr"]
            elif mode == "inverse" and "importance" in state:
                alpha = a0 * float(group["meta_lr_scale"]) / (state["importance"] + float(group["eps"]))
                alpha = alpha.clamp(float(group["lr_min"]), float(group["lr_max"]))
            else:
                alpha = torch.full_like(p, a0, dtype=torch.float32)
            alpha = alpha.clamp(0.0, self.modulation_lr_max)
            p.sub_((alpha * p.grad.float()).to(p.dtype))

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: int) -> float:
        self.model.train()
        tb = torch.full((x.shape[0],), int(task), dtype=torch.long, device=x.device)
        for _ in range(self.glances):
            loss = self._glance(x, y, tb)
        if self.buffer is not None:
            self.buffer.add(x, y, task)
        return float(loss)  # the routine's loss is a device tensor: one read per batch

    def _glance(self, x: torch.Tensor, y: torch.Tensor, tb: torch.Tensor) -> float | torch.Tensor:
        """One inner loop over the batch (and replayed samples) and one meta step; the meta-loss
        (a device tensor from the static-buffer routine)."""
        if self.routine is not None:
            return self.routine.glance(x, y, tb)
        opt = self.opt
        if self.buffer is not None and len(self.buffer) > 0 and self.n_replay > 0:
            xr, yr, tr = self.buffer.sample(self.n_replay)
        else:
            xr = yr = tr = None

        # inner loop: one sample at a time
        if xr is not None and self.inner_replay:
            xi, yi, ti = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([tb, tr])
        else:
            xi, yi, ti = x, y, tb
        if self.shuffle_inner:
            order = torch.randperm(xi.shape[0], generator=self.generator).to(xi.device)
            xi, yi, ti = xi[order], yi[order], ti[order]
        self._zero_grads()
        if self.fused is not None:   # the same inner steps in one call (emcl_fused.py)
            self.fused.inner_loop(xi, yi, ti)
        else:
            for k in range(xi.shape[0]):
                self._loss(xi[k:k + 1], yi[k:k + 1], ti[k:k + 1]).backward()
                if self.modulation:
                    self._modulated_inner_step()
                else:
                    opt.inner_step()
                self._zero_grads()

        # meta step on the batch (and the replayed samples)
        if xr is not None and self.meta_replay:
            xm, ym, tm = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([tb, tr])
        else:
            xm, ym, tm = x, y, tb
        loss = self._loss(xm, ym, tm)
        loss.backward()
        opt.meta_step()
        self._zero_grads()
        self._normalize_pull()
        return float(loss.detach())
