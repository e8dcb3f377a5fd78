"""EMCL as an array (:mod:`..methods.emcl`): ``N`` runs of Algorithm 1 on stacked MLP weights.

Per incoming batch and glance, as the run alone on its fused path
(:mod:`..methods.emcl_fused`) does it, for every run at once:

1. each run draws its replayed samples from its own reservoir memory (its generator, the draw of
   the run alone);
2. the inner loop, one sample at a time, is one call of the fused glance over the whole array
   (``torch.ops.emcl.mlp_glance_`` with a run dimension: one CPU work item, or one CUDA thread
   block, per run), each run with its own β, λ and γ (a row of the ``[N, 3]`` table), reading
   the optimizer's θ₀ and h of its run;
3. the meta step: the meta-loss of every run on its batch (and replayed samples) at the adapted
   weights, one backward over the array, and one :class:`emcl_kernels.FusedEMCLOptimizer` step of
   a param group with ``runs=N`` (per-run hyper-parameters, per-run skips: the optimizer's arrays
   of runs);
4. each run offers the batch to its memory.

Per run (:attr:`EMCLArray.PER_RUN`): the numeric hyper-parameters the optimizer and the glance
take per run (``inner_lr``, ``meta_lr``, ``reg``, ``gamma``, ``decay``, ``lr_scale``, ``lr_min``,
``lr_max``, ``eps``) and the seed. Shared: everything else (memory, replay, glances, ``lr_mode``,
``importance``, ``prox``, ``fixed_importance``, ``importance_norm``, ...).

What an array serves (:meth:`EMCLArray.refusal` says what it does not): the default
configuration and the variants of the reported tables that run on the fused path alone
(glances, SI importance, Algorithm 1's recurrent meta learning rate, ``fixed_importance``, no
replay, ``prox=False``, ``importance_norm="global"``: each run's γ set to γ₀/mean(h) over its own
slices after every meta step). Refused: ``inner_lr_modulation`` (its inner step θ ← θ − α ⊙ g is
not the glance's), ``importance_norm="tensor"`` (one γ per tensor; the glance takes one per run),
``fused_glance=False`` (autograd's inner loop), ``cuda_graph=True`` (the array does not capture
its steps in CUDA graphs) and an optimizer ``backend`` other than ``auto``/``cpu``/``cuda``.

[note: an array of one] With ``N == 1`` every op is the run alone's on its fused path: the
glance is the same op on the same ``[1, ...]`` views, the meta-loss is :func:`.base.mlp_forward`'s
``F.linear`` path, and the optimizer's ``runs=1`` group steps as a plain group does; so an array of
one gives the run alone's bits (the tests check it). Wider arrays compute the meta-loss with
batched products (rounding may differ); the glance and the optimizer's update are per run and
exact.

On a GPU the glance of the array is one kernel launch per glance (the extension's CUDA kernel,
else Triton's); the array's steps are not captured in CUDA graphs (the run alone's default there
is a captured autograd loop, so an array agrees with it to rounding, not bit for bit).
"""
from __future__ import annotations

import warnings

import torch
from emcl_kernels.interface import resolve_lr_scale

from ..methods.emcl import EMCL, OPTIMIZER_KEYS
from .base import ArrayLearner, ArrayReservoir, ce_per_run, mlp_forward

__all__ = ["EMCLArray"]

#: the optimizer's keys that are numbers (each may differ per run in the optimizer's array groups)
_NUMERIC = ("inner_lr", "meta_lr", "reg", "gamma", "decay", "lr_scale", "lr_min", "lr_max", "eps")


def _logits(weights: list, x: torch.Tensor) -> torch.Tensor:
    """The MLP's logits ``[N, B, classes]`` on ``x[N, B, ...]``: :func:`.base.mlp_forward` for an
    array of one (the run alone's ops); wider, every layer as ``z = W a + b`` on activations held
    as columns (``[N, features, B]``), so that the weight gradients autograd forms (``dz · aᵀ``)
    come out in the weights' own layout, which the optimizer takes as they are (``a · Wᵀ`` on
    rows gives them transposed, and a copy of the first layer's per meta step)."""
    n = x.shape[0]
    if n == 1:
        return mlp_forward(weights, x)
    h = x.reshape(n, x.shape[1], -1).transpose(1, 2)
    layers = len(weights) // 2
    for i in range(layers):
        h = torch.baddbmm(weights[2 * i + 1].unsqueeze(2), weights[2 * i], h)
        if i < layers - 1:
            h = torch.relu(h)
    return h.transpose(1, 2)


class EMCLArray(ArrayLearner):
    """``N`` EMCL runs (fused glance, optimizer over stacked parameters with ``runs=N``)."""

    method = EMCL
    PER_RUN = _NUMERIC

    @classmethod
    def refusal(cls, config: dict):
        """Why a run of ``config`` cannot train in an EMCL array (the variant named), or None."""
        if config.get("inner_lr_modulation", False):
            return ("inner_lr_modulation=True (Table IV's ablation: its inner step theta <- theta - alpha*g "
                    "is not the fused glance's)")
        if config.get("importance_norm") == "tensor":
            return "importance_norm='tensor' (one gamma per tensor; the array's glance takes one gamma per run)"
        if config.get("fused_glance", "auto") is False:
            return "fused_glance=False (autograd's inner loop; the array's inner loop is the fused glance)"
        if config.get("cuda_graph", "auto") is True:
            return "cuda_graph=True (the array does not capture its steps in CUDA graphs)"
        if config.get("backend", "auto") not in ("auto", "cpu", "cuda"):
            return f"backend={config.get('backend')!r} (that optimizer backend's inner steps, not the fused glance)"
        return None

    def __init__(self, weights, info, configs, device):
        super().__init__(weights, info, configs, device)
        for c in self.configs:
            why = type(self).refusal(c)
            if why:
                raise ValueError(f"emcl array: cannot serve {why}")
        if info.multi_head:
            raise ValueError("emcl array: the fused glance of an array serves single-head MLP streams")
        c = self.configs[0]
        self.memory = int(c.get("memory", 0) or 0)
        self.n_replay = int(c.get("replay", 0) or 0)
        self.inner_replay = bool(c.get("inner_replay", True))
        self.meta_replay = bool(c.get("meta_replay", True))
        self.shuffle_inner = bool(c.get("shuffle_inner", False))
        self.glances = int(c.get("glances", 1))
        self.prox = bool(c.get("prox", True))
        self.importance_norm = c.get("importance_norm")
        self.fixed_importance = c.get("fixed_importance")
        self.skipped = [0] * self.width
        self._warned = False
        self.buffer = ArrayReservoir(self.memory, tuple(info.input_shape), self.generators, self.device) \
            if self.memory > 0 else None
        self.per_run += ["skipped"] + (["buffer"] if self.buffer is not None else [])
        self._pick_op()
        self.opt = self._make_optimizer()
        self.gammas = self._base_gammas()
        self._checked = None
        self._table = None
        if self.fixed_importance is not None:
            self._fix_importance(float(self.fixed_importance))
        self._normalize_pull()

    # -- construction ---------------------------------------------------------------------------
    def _pick_op(self) -> None:
        """The glance op of the device: the extension's kernel, else Triton's on a GPU (as the
        run alone's :class:`~emcl_continual.methods.emcl_fused.FusedGlance` picks it)."""
        from emcl_kernels.glance import glance_unavailable_reason

        kind = self.device.type
        why = glance_unavailable_reason("cpu" if kind == "cpu" else "cuda", kind)
        if why is None:
            self._op = torch.ops.emcl.mlp_glance_
            return
        if kind == "cuda" and glance_unavailable_reason("triton", "cuda") is None:
            from emcl_kernels.backends import glance_triton
            self._op = glance_triton.mlp_glance
            return
        raise ValueError(f"emcl array: the fused glance cannot run on {self.device}: {why}")

    def _values(self, key: str) -> list:
        """Each run's optimizer value of ``key`` (``lr_scale`` None resolved to 1/reg per run)."""
        if key == "lr_scale":
            return [resolve_lr_scale(c.get("lr_scale"), float(c.get("reg", 0.0))) for c in self.configs]
        fallback = EMCL.OPTIONAL.get(key)
        return [float(c[key]) if c.get(key) is not None else fallback for c in self.configs]

    def _make_optimizer(self):
        """The optimizer over the stacked weights: one param group with ``runs=N``; a value the
        runs share is given as a number, one that differs as N values."""
        from emcl_kernels import FusedEMCLOptimizer

        c = self.configs[0]
        hyper = {}
        for k in OPTIMIZER_KEYS:
            if k in _NUMERIC:
                vals = self._values(k)
                if any(v is None for v in vals):
                    continue
                hyper[k] = vals[0] if len(set(vals)) == 1 else list(vals)
            elif c.get(k) is not None:
                hyper[k] = c[k]
        return FusedEMCLOptimizer(self.weights, runs=self.width, backend=c.get("backend", "auto"), **hyper)

    def _base_gammas(self) -> list:
        return [float(c["gamma"]) for c in self.configs]

    @torch.no_grad()
    def _fix_importance(self, value: float) -> None:
        """The optimizer's state made by an inner step on zero gradients (θ unchanged), every
        importance set to ``value`` (``fixed_importance``, as the run alone does it)."""
        self._ensure_state()
        for w in self.weights:
            self.opt.state[w]["importance"].fill_(value)

    @torch.no_grad()
    def _ensure_state(self) -> None:
        """θ₀ = θ and h = 0 for every run, made as the first inner step makes them (an inner step
        on zero gradients, which leaves θ where it is)."""
        if all(w in self.opt.state and "anchor" in self.opt.state[w] for w in self.weights):
            return
        for w in self.weights:
            w.grad = torch.zeros_like(w)
        self.opt.inner_step()
        for w in self.weights:
            w.grad = None

    @torch.no_grad()
    def _normalize_pull(self) -> None:
        """``importance_norm="global"``: each run's γ set to γ₀/mean(h) over its own slices (the
        run alone's arithmetic on the run's slices: a float sum of each tensor, in order)."""
        if self.importance_norm is None:
            return
        state = self.opt.state
        imps = [state[w]["importance"] for w in self.weights if w in state and "importance" in state[w]]
        base = self._base_gammas()
        out = []
        for r in range(self.width):
            total = sum(float(h[r].sum()) for h in imps)
            count = sum(h[r].numel() for h in imps)
            mean = total / count if count else 0.0
            out.append(base[r] / mean if mean > 0 else base[r])
        self.gammas = out
        self._table = None

    # -- per-run state ---------------------------------------------------------------------------
    def keep(self, idx: list) -> None:
        """Keep only the runs ``idx``: the weights, memories and generators (the base), and the
        optimizer, made again over the kept weights with the kept runs' values and their slices
        of its state (anchors, importances, meta learning rates, step counts)."""
        old_opt, old_weights = self.opt, self.weights
        gammas = [self.gammas[i] for i in idx]
        super().keep(idx)
        sel = torch.tensor(idx, dtype=torch.long, device=self.device)
        self.opt = self._make_optimizer()
        states = [old_opt.state.get(w, {}) for w in old_weights]
        if any(states):
            sd = self.opt.state_dict()
            sd["state"] = {i: {k: v.detach()[sel.to(v.device)].clone() if torch.is_tensor(v) and v.dim() > 0 else v
                               for k, v in st.items()}
                           for i, st in enumerate(states) if st}
            self.opt.load_state_dict(sd)
        self.gammas = gammas
        self._checked = None
        self._table = None

    # -- the glance ------------------------------------------------------------------------------
    def _hyper_table(self) -> torch.Tensor:
        """``[N, 3]`` fp64 on the device: each run's β, λ, γ (the glance's table)."""
        if self._table is None:
            rows = [[float(c["inner_lr"]), float(c["reg"]), g] for c, g in zip(self.configs, self.gammas)]
            self._table = torch.tensor(rows, dtype=torch.float64).to(self.device)
        return self._table

    def _tensors(self):
        """(params, anchors, importances) of the glance, checked once per optimizer state."""
        from emcl_kernels.glance import _check_layers

        state = self.opt.state
        anchors = [state[w]["anchor"] for w in self.weights]
        imps = [state[w]["importance"] for w in self.weights]
        key = [t.data_ptr() for t in anchors + imps + self.weights]
        if self._checked is None or self._checked[0] != key:
            _check_layers([w.detach() for w in self.weights], anchors, imps, self.width)
            self._checked = (key, [w.detach() for w in self.weights], anchors, imps)
        return self._checked[1:]

    @torch.no_grad()
    def _inner_loop(self, xi: torch.Tensor, yi: torch.Tensor) -> None:
        """Every run's inner steps over its samples ``xi[N, n, ...]`` in order, one fused call."""
        n = int(xi.shape[1])
        if n == 0:
            return
        self._ensure_state()
        params, anchors, imps = self._tensors()
        x = xi.reshape(self.width, n, -1)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        y = yi.reshape(self.width, n).to(torch.int64).contiguous()
        losses = torch.empty((self.width, n), dtype=torch.float32, device=x.device)
        skipped = torch.empty((self.width,), dtype=torch.int64, device=x.device)
        check = bool(self.opt.check_finite)
        self._op(params, anchors, imps, x, y, None, self._hyper_table(), self.prox, check, losses, skipped)
        if check:
            counts = skipped.tolist()
            if any(counts):
                self.skipped = [a + b for a, b in zip(self.skipped, counts)]
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"emcl array: the fused glance skipped {sum(counts)} inner step(s) with a "
                                  "non-finite gradient (runs " + ", ".join(str(r) for r, k in enumerate(counts) if k)
                                  + "; counted in EMCLArray.skipped)", RuntimeWarning, stacklevel=3)

    def _glance(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One inner loop over each run's batch (and replayed samples) and one meta step; each
        run's meta-loss ``[N]``."""
        if self.buffer is not None and len(self.buffer) > 0 and self.n_replay > 0:
            xr, yr = self.buffer.sample(self.n_replay)
            xr = xr.reshape(xr.shape[0], xr.shape[1], *x.shape[2:])
        else:
            xr = yr = None
        if xr is not None and self.inner_replay:
            xi, yi = torch.cat([x, xr], 1), torch.cat([y, yr], 1)
        else:
            xi, yi = x, y
        if self.shuffle_inner:
            order = torch.stack([torch.randperm(xi.shape[1], generator=g) for g in self.generators]).to(xi.device)
            rows = torch.arange(self.width, device=xi.device).unsqueeze(1)
            xi, yi = xi[rows, order], yi[rows, order]
        self._inner_loop(xi, yi)
        if xr is not None and self.meta_replay:
            xm, ym = torch.cat([x, xr], 1), torch.cat([y, yr], 1)
        else:
            xm, ym = x, y
        loss = ce_per_run(_logits(self.weights, xm), ym)
        grads = torch.autograd.grad(loss.sum(), self.weights)
        for w, g in zip(self.weights, grads):
            w.grad = g if g.is_contiguous() else g.contiguous()
        self.opt.meta_step()
        for w in self.weights:
            w.grad = None
        self._normalize_pull()
        return loss.detach()

    def observe(self, x, y, task):
        for _ in range(self.glances):
            loss = self._glance(x, y)
        if self.buffer is not None:
            self.buffer.add(x.detach(), y.detach())
        return loss

    # -- what the run alone records after every task ---------------------------------------------
    @torch.no_grad()
    def diagnostics(self) -> list:
        """Each run's :meth:`EMCL.diagnostics <emcl_continual.methods.emcl.EMCL.diagnostics>`
        (quantiles of h and of the inner pull, over that run's slices), in the order of the runs."""
        state = self.opt.state
        imps = [state[w]["importance"] for w in self.weights if w in state and "importance" in state[w]]
        out = []
        lr_mode = str(self.configs[0]["lr_mode"])
        for r, c in enumerate(self.configs):
            if not imps:
                out.append({})
                continue
            lam = float(c["reg"])
            scale = self.gammas[r] * lam if self.prox else float(c["inner_lr"]) * lam
            hs = [h[r].flatten().double() for h in imps]
            pulls = [h[r].flatten().double() * scale for h in imps]
            h = torch.cat(hs)
            cc = torch.cat(pulls)
            q = torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64, device=h.device)
            hq, cq = torch.quantile(h, q).tolist(), torch.quantile(cc, q).tolist()
            eps = float(c.get("eps", EMCL.OPTIONAL["eps"]))
            d = {"h_mean": float(h.mean()), "h_median": hq[0], "h_p90": hq[1], "h_p99": hq[2],
                 "h_max": float(h.max()), "pull_median": cq[0], "pull_p90": cq[1], "pull_p99": cq[2],
                 "pull_max": float(cc.max()), "pull_gt_0.1": float((cc > 0.1).double().mean()),
                 "pull_gt_0.01": float((cc > 0.01).double().mean()),
                 "pull_kind": "gamma*reg*h (prox)" if self.prox else "inner_lr*reg*h (no prox)"}
            if lr_mode == "inverse":
                d["meta_damped_share"] = float((h / (h + eps) < 0.99).double().mean())
            out.append(d)
        return out
