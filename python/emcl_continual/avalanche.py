"""EMCL as an Avalanche strategy: :class:`EMCLStrategy` (avalanche-lib 0.6.0).

    from emcl_continual.avalanche import EMCLStrategy
    strategy = EMCLStrategy(model=model, preset="permuted-mnist", evaluator=evaluator)
    for exp in benchmark.train_stream:
        strategy.train(exp, shuffle=False)   # Avalanche shuffles each experience unless told not to
        strategy.eval(benchmark.test_stream)

Needs avalanche-lib 0.6.0: ``pip install --no-build-isolation -e '.[avalanche]'`` from a clone
(``quadprog`` comes with it, for Avalanche's GEM), or ``make setup-avalanche``. Avalanche is
imported when this module is, never by the rest of the package; without it the import raises an
ImportError that says how to install it.

Algorithm 1 on Avalanche's :class:`SupervisedMetaLearningTemplate` (the base of its LaMAML),
per incoming mini-batch, exactly as :class:`emcl_continual.methods.emcl.EMCL` (``--method emcl``):

* ``_inner_updates``: draw ``replay`` samples from the reservoir; the inner loop over the batch
  (and the replayed samples, ``inner_replay``), one sample at a time, ``loss.backward();
  opt.inner_step()``;
* ``_outer_update``: the meta-loss on the batch (and the replayed samples, ``meta_replay``) at the
  adapted weights, ``opt.meta_step()`` (θ = θ₀ after it); ``glances`` > 1 repeats inner loop and
  meta step on the same batch; then the batch is offered to the reservoir.

The replay memory is this project's :class:`~emcl_continual.methods.replay.ReservoirBuffer`, updated
after every batch and drawn from within the current experience (Avalanche's own storage
policies update at the end of an experience, and LaMAML's never replays the current one). With
the same model, seed, hyper-parameters and batch order (``train(exp, shuffle=False)``,
``train_mb_size=10``), a run equals ``python -m emcl_continual --method emcl`` entry for entry
(``tests/test_avalanche.py``).

Models. The forward is ``model(x, t)`` for an Avalanche :class:`MultiTaskModule` and for this
project's models (:mod:`emcl_continual.data.models`, whose multi-head variant masks the logits by
task), ``model(x)`` for any other module. A parameter that takes no part in a sample's loss (a
multi-head model's other heads) gets a zero gradient rather than none, as the masked logits of
this project's multi-head models give it: every parameter is then stepped every time (its pull
to θ₀ and its importance decay go on, and the meta step sets θ = θ₀ everywhere); frozen
parameters (``requires_grad=False``) are left alone.

Models that grow (``MultiHeadClassifier``'s new heads, ``IncrementalClassifier``'s wider head):
at each experience Avalanche's model adaptation runs and :meth:`make_optimizer` puts the new
parameters into the optimizer (the existing param group, as Avalanche does for every optimizer;
one group per new tensor with ``importance_norm="tensor"``); ``FusedEMCLOptimizer`` follows
that edit at its next step and starts their state there (θ₀ = θ, h = 0). A replaced (grown)
tensor starts over the same way.

EMCL's state across experiences (``optimizer_state``). Algorithm 1 carries the anchors θ₀ and
the importances h from task to task: that is what protects old tasks. Avalanche's
``make_optimizer`` may reset an optimizer's state at an experience boundary
(``reset_optimizer_state``; it always does at the first one), which would wipe them, and its
older ``reset_optimizer`` refuses more than one param group (``importance_norm="tensor"`` has
one per tensor). ``optimizer_state="keep"`` (default) never resets: every parameter keeps its
anchor, importance and meta learning rate across experiences, whatever flag Avalanche passes.
``"reset"`` clears the whole state at every experience boundary (each experience starts from
h = 0: EMCL without memory of earlier importances, an ablation).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from .core import presets
from .methods.emcl import TABLE_II as EMCL_TABLE_II
from .methods.replay import ReservoirBuffer

INSTALL_HINT = ("pip install avalanche-lib==0.6.0 quadprog  (from a clone: "
                "pip install --no-build-isolation -e '.[avalanche]', or make setup-avalanche)")

try:
    from avalanche.models import MultiTaskModule
    from avalanche.models.dynamic_optimizers import update_optimizer
    from avalanche.training.plugins.evaluation import default_evaluator
    from avalanche.training.templates import SupervisedMetaLearningTemplate
except ImportError as exc:  # pragma: no cover - exercised where avalanche-lib is absent
    raise ImportError(f"emcl_continual.avalanche needs avalanche-lib, which is not installed ({exc}). "
                      f"Install it with: {INSTALL_HINT}") from exc

from emcl_kernels import FusedEMCLOptimizer

__all__ = ["EMCLStrategy", "OPTIMIZER_KEYS", "PRESETS", "INSTALL_HINT", "avalanche_benchmark"]

# FusedEMCLOptimizer's hyper-parameters the strategy takes (None: the optimizer's default).
OPTIMIZER_KEYS = ("meta_lr", "inner_lr", "reg", "gamma", "decay", "lr_scale", "lr_mode", "lr_min", "lr_max",
                  "eps", "importance", "prox")

# Table II's EMCL columns, by stream name (meta_lr α₀, inner_lr β, reg λ, gamma γ) plus the paper's
# replay memory for that stream. This project's runs use β = 0.03 on the MNIST streams (chosen on
# validation data, docs/results.md "Selection on validation data"): pass inner_lr=0.03 to get them.
# (Rotated MNIST has no column: it takes MNIST Permutations', as --method emcl does.)
PRESETS = {stream: {"memory": presets.MEMORY[stream],
                    **EMCL_TABLE_II["permuted-mnist" if stream == "rotated-mnist" else stream]}
           for stream in presets.STREAM_NAMES}

OPTIMIZER_STATES = ("keep", "reset")
IMPORTANCE_NORMS = (None, "global", "tensor")


class EMCLStrategy(SupervisedMetaLearningTemplate):
    """EMCL (Zou & Lin, Algorithm 1) with :class:`~emcl_kernels.FusedEMCLOptimizer`, as an
    Avalanche strategy (module docstring).

    Args:
        model: the network; an Avalanche ``MultiTaskModule`` or this project's models are
            called as ``model(x, t)``, anything else as ``model(x)``.
        preset: a Table II column by stream name (:data:`PRESETS`: ``"permuted-mnist"``,
            ``"many-permutations"``, ``"split-cifar100"``, ``"split-miniimagenet"``,
            ``"rotated-mnist"``): its α₀, β, λ, γ and replay memory. Explicit keyword arguments
            override it; without a preset the optimizer's own defaults apply.
        meta_lr, inner_lr, reg, gamma, decay, lr_scale, lr_mode, lr_min, lr_max, eps, importance,
            prox: :class:`~emcl_kernels.FusedEMCLOptimizer`'s hyper-parameters (None: preset,
            else the optimizer's default; ``lr_scale`` None is 1/reg).
        memory: reservoir size (None: the preset's, else 200; 0: no replay).
        replay: replayed samples drawn per incoming batch (and per glance).
        inner_replay, meta_replay: the inner loop / the meta-loss also visit the replayed samples.
        glances: inner loop + meta step repeated on each incoming batch (Algorithm 1: 1).
        importance_norm: None, ``"global"`` or ``"tensor"``: the inner pull γλh/mean(h)
            (γ of each group set to γ₀/mean(h) after every meta step; ``"tensor"``: a group per tensor).
        optimizer_state: ``"keep"`` (default) or ``"reset"`` at experience boundaries (module docstring).
        backend: the optimizer's backend (``"auto"`` or a name from ``available_backends()``).
        seed: seeds the reservoir's generator (as ``--method emcl``'s ``seed``).
        criterion, train_mb_size (default 10, the paper's batch), train_epochs (1: one pass),
            eval_mb_size, device, plugins, evaluator, eval_every, peval_mode: Avalanche's.
    """

    def __init__(self, *, model: nn.Module, preset: Optional[str] = None,
                 meta_lr=None, inner_lr=None, reg=None, gamma=None, decay=None, lr_scale=None,
                 lr_mode=None, lr_min=None, lr_max=None, eps=None, importance=None, prox=None,
                 memory: Optional[int] = None, replay: int = presets.BATCH_SIZE,
                 inner_replay: bool = True, meta_replay: bool = True, glances: int = 1,
                 importance_norm: Optional[str] = None, optimizer_state: str = "keep",
                 backend: str = "auto", seed: int = 0,
                 criterion=None, train_mb_size: int = presets.BATCH_SIZE, train_epochs: int = 1,
                 eval_mb_size: int = 1000, device="cpu", plugins: Optional[Sequence] = None,
                 evaluator=default_evaluator, eval_every: int = -1, peval_mode: str = "epoch"):
        given = dict(meta_lr=meta_lr, inner_lr=inner_lr, reg=reg, gamma=gamma, decay=decay, lr_scale=lr_scale,
                     lr_mode=lr_mode, lr_min=lr_min, lr_max=lr_max, eps=eps, importance=importance, prox=prox)
        base: dict = {}
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"EMCLStrategy: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
            base = dict(PRESETS[preset])
        hyper = {k: v for k, v in base.items() if k in OPTIMIZER_KEYS}
        hyper.update({k: v for k, v in given.items() if v is not None})
        self.hyper = hyper
        if memory is None:
            memory = base.get("memory", presets.MEMORY["permuted-mnist"])
        if int(memory) < 0 or int(replay) < 0:
            raise ValueError(f"EMCLStrategy: memory and replay must be >= 0, got {memory} and {replay}")
        if isinstance(glances, bool) or not isinstance(glances, int) or glances < 1:
            raise ValueError(f"EMCLStrategy: glances must be an integer >= 1, got {glances!r}")
        if importance_norm not in IMPORTANCE_NORMS:
            raise ValueError(f"EMCLStrategy: importance_norm must be one of {IMPORTANCE_NORMS}, "
                             f"got {importance_norm!r}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"EMCLStrategy: optimizer_state must be one of {OPTIMIZER_STATES}, "
                             f"got {optimizer_state!r}")
        self.memory, self.n_replay = int(memory), int(replay)
        self.inner_replay, self.meta_replay = bool(inner_replay), bool(meta_replay)
        self.glances = glances
        self.importance_norm = importance_norm
        self.optimizer_state = optimizer_state
        self.seed = int(seed)

        model = model.to(device)  # the same Parameter objects: the optimizer holds them from here on
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p]} for p in params] if importance_norm == "tensor" else params
        optimizer = FusedEMCLOptimizer(groups, backend=backend, **hyper)
        self.base_gamma = float(optimizer.param_groups[0]["gamma"])
        super().__init__(model=model, optimizer=optimizer,
                         criterion=nn.CrossEntropyLoss() if criterion is None else criterion,
                         train_mb_size=train_mb_size, train_epochs=train_epochs, eval_mb_size=eval_mb_size,
                         device=device, plugins=plugins, evaluator=evaluator, eval_every=eval_every,
                         peval_mode=peval_mode)
        # --method emcl's reservoir generator: Method._generator(1) with config["seed"]
        self.generator = torch.Generator().manual_seed(self.seed * 1000003 + 1)
        self.buffer: Optional[ReservoirBuffer] = None  # made at the first batch (its input shape)
        self._replayed = None

    # ------------------------------------------------------------------------ the model
    def _forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, MultiTaskModule) or _takes_task(self.model):
            return self.model(x, t)
        return self.model(x)

    def forward(self):
        """The model's output on the current mini-batch (training metrics and evaluation)."""
        return self._forward(self.mb_x, self.mb_task_id)

    def _loss(self, x, y, t) -> torch.Tensor:
        return self._criterion(self._forward(x, t), y)

    def _trained_params(self) -> list:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _zero_missing_grads(self) -> None:
        """A zero gradient for every trained parameter that got none (module docstring)."""
        for p in self._trained_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    # ------------------------------------------------------------------------ the optimizer
    def make_optimizer(self, reset_optimizer_state=False, remove_params=False, verbose_optimizer=False,
                       **kwargs):
        """Put the model's new parameters into the optimizer (after Avalanche's model adaptation);
        the state is kept or reset by ``optimizer_state``, not by ``reset_optimizer_state``."""
        opt = self.optimizer
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if self.importance_norm == "tensor":
            # one group per tensor: Avalanche's group inference would refuse a new tensor whose
            # neighbours sit in different groups, so each new (or replaced) tensor gets its own group
            old = self.optimized_param_id or {}
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            for name, p in named.items():
                if id(p) in held:
                    continue
                prev = old.get(name)
                group = next((g for g in opt.param_groups if prev is not None
                              and any(q is prev for q in g["params"])), None)
                if group is not None:  # a grown tensor: same group, fresh state
                    group["params"] = [p]
                    opt.state.pop(prev, None)
                else:
                    opt.add_param_group({"params": [p], "gamma": self.base_gamma})
            self.optimized_param_id = named
        else:
            self.optimized_param_id = update_optimizer(opt, named, self.optimized_param_id, reset_state=False,
                                                       remove_params=remove_params, verbose=verbose_optimizer)
        if self.optimizer_state == "reset":
            opt.state.clear()

    # ------------------------------------------------------------------------ Algorithm 1
    def _inner_updates(self, **kwargs):
        """Draw the replayed samples; the inner loop, one sample at a time, ``inner_step()``."""
        x, y, t = self.mb_x, self.mb_y, self.mb_task_id.long()
        if self.buffer is None and self.memory > 0:
            self.buffer = ReservoirBuffer(self.memory, tuple(x.shape[1:]), self.generator, device=self.device,
                                          dtype=x.dtype)
        self._glance_inner(x, y, t)

    def _glance_inner(self, x, y, t) -> None:
        if self.buffer is not None and len(self.buffer) > 0 and self.n_replay > 0:
            self._replayed = self.buffer.sample(self.n_replay)
        else:
            self._replayed = None
        if self._replayed is not None and self.inner_replay:
            xr, yr, tr = self._replayed
            x, y, t = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([t, tr])
        opt = self.optimizer
        self.model.zero_grad(set_to_none=True)
        for k in range(x.shape[0]):
            self._loss(x[k:k + 1], y[k:k + 1], t[k:k + 1]).backward()
            self._zero_missing_grads()
            opt.inner_step()
            self.model.zero_grad(set_to_none=True)

    def _glance_meta(self, x, y, t) -> torch.Tensor:
        if self._replayed is not None and self.meta_replay:
            xr, yr, tr = self._replayed
            x, y, t = torch.cat([x, xr]), torch.cat([y, yr]), torch.cat([t, tr])
        loss = self._loss(x, y, t)
        loss.backward()
        self._zero_missing_grads()
        self.optimizer.meta_step()
        self.model.zero_grad(set_to_none=True)
        self._normalize_pull()
        return loss.detach()

    def _outer_update(self, **kwargs):
        """The meta step (then the other glances); the batch offered to the reservoir."""
        x, y, t = self.mb_x, self.mb_y, self.mb_task_id.long()
        loss = self._glance_meta(x, y, t)
        for _ in range(self.glances - 1):
            self._glance_inner(x, y, t)
            loss = self._glance_meta(x, y, t)
        if self.buffer is not None:
            self.buffer.add(x, y, t)
        self.loss = loss

    @torch.no_grad()
    def _normalize_pull(self) -> None:
        """``importance_norm``: each group's γ set to γ₀/mean(h), so that c = γ₀·λ·h/mean(h)."""
        if self.importance_norm is None:
            return
        opt = self.optimizer
        sums = []
        for g in opt.param_groups:
            hs = [opt.state[p]["importance"] for p in g["params"] if "importance" in opt.state.get(p, {})]
            sums.append((sum(float(h.sum()) for h in hs), sum(h.numel() for h in hs)))
        if self.importance_norm == "global":
            total, count = sum(s for s, _ in sums), sum(n for _, n in sums)
            means = [total / count if count else 0.0] * len(sums)
        else:
            means = [s / n if n else 0.0 for s, n in sums]
        for g, mean in zip(opt.param_groups, means):
            g["gamma"] = self.base_gamma / mean if mean > 0 else self.base_gamma


def _takes_task(model: nn.Module) -> bool:
    """This project's models (``model(x, task)``, multi-head ones masking the logits by task)."""
    from .data.models import TaskMasked
    return isinstance(model, TaskMasked)


def avalanche_benchmark(stream):
    """An Avalanche benchmark of this project's :class:`~emcl_continual.data.streams.Stream`: one
    experience per task, task label = task index, the training samples in the stream's order."""
    from avalanche.benchmarks import tensors_benchmark
    n = len(stream.train)
    return tensors_benchmark([(td.x, td.y) for td in stream.train], [(td.x, td.y) for td in stream.test],
                             task_labels=list(range(n)), complete_test_set_only=False)
