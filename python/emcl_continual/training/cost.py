"""Machine-independent cost of training: forward passes, backward passes and weight updates,
counted by hooks on a learner while it trains (:class:`CostCounter`).

The counts are the cost columns of the results tables (``reports.efficiency``); the benchmark
``python -m benchmarks training --heldout`` makes them, one counted pass per report row.
"""
from __future__ import annotations

import torch

__all__ = ["CostCounter"]


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func's wrappers (vmap's batched tensors, grad's tracking
    tensors), so that a forward under ``vmap`` counts every sample of its batch dimension."""
    from torch._C import _functorch as ft
    while ft.is_batchedtensor(t) or ft.is_functorch_wrapped_tensor(t):
        t = ft.get_unwrapped(t)
    return t


class _CountBackward(torch.autograd.Function):
    """The identity on the model's output; its backward counts the samples the gradient
    carries (under ``torch.func`` transforms too: ``generate_vmap_rule``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, counter):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.counter = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        ctx.counter._backward(grad)
        return grad, None


class CostCounter:
    """Counts, while attached to a learner, what its training costs in machine-independent units.

    * **forward passes**: samples through the model's forward (a forward hook on the model,
      and a wrapper of its ``forward_with`` where it has one; a batch of 20 is 20; a forward
      under ``torch.func.vmap`` counts every sample of every vmapped batch), and forward calls;
    * **backward passes**: samples whose gradient flows back through a model forward (an
      identity :class:`torch.autograd.Function` on the model's output counts the rows of the
      gradient reaching it, whether from ``backward()``, ``torch.autograd.grad`` or
      ``torch.func.grad``), and backward calls;
    * **weight updates**: how many times the weights the model computes with change between two
      uses: before each forward the tensors the forward will read (``functional_call``'s and
      ``forward_with``'s fast weights included) are compared, by storage and version counter,
      with the previous forward's, and a call of the optimizer's ``step`` / ``inner_step`` /
      ``meta_step`` marks a change whose writes the version counters may not see (native
      kernels); forwards inside a ``torch.func`` transform (GEM's vmapped memory gradients, on
      wrapped copies of the current weights) are not compared. An update not followed by a
      forward within a call is counted when the call returns (:meth:`flush`). Consecutive
      writes with no forward between them are one update (MER's Reptile interpolation after its
      last SGD step, La-MAML's learning-rate step with its weight step);
    * MER's hand-written per-sample step (``_ReluMLPStepper.sgd_step``, NumPy on the weights'
      memory, no torch forward) counts one forward, one backward and one update per call;
    * EMCL's fused glance (``FusedGlance.inner_loop``, its inner loop in one native call)
      counts, per sample, what the autograd loop it replaces does: one forward, one backward,
      one ``inner_step`` and one update;
    * optimizer calls by name (``step``, ``inner_step``, ``meta_step``) as the method makes
      them (a call one of them makes of another counts once), whatever they update (La-MAML's
      ``step`` moves its learning rates).

    ``attach(learner)`` installs the hooks and wrappers, ``detach()`` removes them; counts are
    in :meth:`counts`.
    """

    def __init__(self):
        self.forward_samples = self.forward_calls = 0
        self.backward_samples = self.backward_calls = 0
        self.updates = 0
        self.optimizer_calls: dict = {}
        self._last = None  # (storage address, version) of the tensors the previous forward read
        self._held = ()
        self._pending = False
        self._in_optimizer = 0
        self._handles: list = []
        self._restore: list = []
        self._model = None
        self._sample_numel = 1

    # -- counting ------------------------------------------------------------------------------
    def _weights_now(self) -> tuple:
        return tuple(_unwrap(getattr(mod, name)) for mod, name in self._slots)

    def _check_update(self, weights: tuple) -> None:
        now = tuple((w.data_ptr(), w._version) for w in weights)
        if self._last is not None and (self._pending or now != self._last):
            self.updates += 1
        self._pending = False
        self._last = now
        self._held = weights  # keeps their storages alive: no later tensor can reuse an address

    def _samples(self, t: torch.Tensor) -> int:
        return _unwrap(t).numel() // self._sample_numel

    def _pre_forward(self, module, args, weights=None):
        from torch._C import _functorch as ft
        if ft.maybe_current_level() is not None:
            return  # inside a torch.func transform (GEM's vmapped memory gradients): the weights it
                    # reads are wrapped copies of the current ones, not an update
        self._check_update(self._weights_now() if weights is None else tuple(weights))

    def _post_forward(self, module, args, output):
        self.forward_calls += 1
        self.forward_samples += self._samples(args[0])
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _CountBackward.apply(output, self)
        return output

    def _backward(self, grad: torch.Tensor) -> None:
        self.backward_calls += 1
        g = _unwrap(grad)
        self.backward_samples += g.numel() // g.shape[-1] if g.dim() > 1 else 1

    def flush(self) -> None:
        """Count an update made since the last forward (call after each ``observe`` / ``end_task``)."""
        if self._model is not None:
            self._check_update(self._weights_now())

    # -- attaching -----------------------------------------------------------------------------
    def attach(self, learner) -> "CostCounter":
        model = learner.model
        self._model = model
        self._slots = [(mod, name) for mod in model.modules() for name, _ in mod.named_parameters(recurse=False)]
        self._sample_numel = 1
        for d in learner.info.input_shape:
            self._sample_numel *= int(d)
        self._handles.append(model.register_forward_pre_hook(self._pre_forward))
        self._handles.append(model.register_forward_hook(self._post_forward))
        opt = getattr(learner, "opt", None)
        if opt is not None:
            for name in ("step", "inner_step", "meta_step"):
                if callable(getattr(opt, name, None)):
                    self._wrap(opt, name, self._optimizer_call(name, getattr(opt, name)))
        stepper = getattr(learner, "_stepper", None)
        if stepper is not None:
            self._wrap(stepper, "sgd_step", self._stepper_call(stepper.sgd_step))
        fused = getattr(learner, "fused", None)
        if fused is not None and callable(getattr(fused, "inner_loop", None)):
            self._wrap(fused, "inner_loop", self._fused_glance_call(fused.inner_loop))
        if callable(getattr(model, "forward_with", None)):
            self._wrap(model, "forward_with", self._forward_with_call(model.forward_with))
        return self

    def _wrap(self, obj, name: str, fn) -> None:
        had = name in vars(obj)
        self._restore.append((obj, name, vars(obj).get(name), had))
        setattr(obj, name, fn)

    def _optimizer_call(self, name: str, fn):
        def call(*args, **kwargs):
            if self._in_optimizer == 0:  # a call made inside another (inner_step -> step) is that call
                self.optimizer_calls[name] = self.optimizer_calls.get(name, 0) + 1
            self._in_optimizer += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._in_optimizer -= 1
            self._pending = True
            return out
        return call

    def _forward_with_call(self, fn):
        """The model's ``forward_with(weights, x, task)`` (La-MAML's fast weights on the MLP),
        counted as its ``forward`` is, with ``weights`` as the tensors the forward reads."""
        def call(weights, x, task=0):
            self._pre_forward(self._model, (x,), weights)
            return self._post_forward(self._model, (x,), fn(weights, x, task))
        return call

    def _stepper_call(self, fn):
        def call(*args, **kwargs):
            self._check_update(self._weights_now())
            self.forward_calls += 1
            self.forward_samples += 1
            self.backward_calls += 1
            self.backward_samples += 1
            out = fn(*args, **kwargs)
            self._pending = True
            return out
        return call

    def _fused_glance_call(self, fn):
        """EMCL's fused glance ``inner_loop(xi, yi, ti)``: per sample the forward, backward,
        ``inner_step`` and update of the autograd loop it replaces (an optimizer call it makes
        itself, the zero-gradient step that creates the state, is part of the glance)."""
        def call(xi, yi, ti):
            for _ in range(int(xi.shape[0])):
                self._check_update(self._weights_now())
                self.forward_calls += 1
                self.forward_samples += 1
                self.backward_calls += 1
                self.backward_samples += 1
                self.optimizer_calls["inner_step"] = self.optimizer_calls.get("inner_step", 0) + 1
                self._pending = True
            self._in_optimizer += 1
            try:
                return fn(xi, yi, ti)
            finally:
                self._in_optimizer -= 1
        return call

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        for obj, name, old, had in reversed(self._restore):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._handles, self._restore, self._model, self._last, self._held = [], [], None, None, ()

    def counts(self, n_samples: int) -> dict:
        """Totals and per incoming sample (``n_samples``: the samples the stream delivered)."""
        per = 1.0 / max(1, n_samples)
        return {"incoming_samples": n_samples,
                "forward_samples": self.forward_samples, "forward_calls": self.forward_calls,
                "backward_samples": self.backward_samples, "backward_calls": self.backward_calls,
                "updates": self.updates, "optimizer_calls": dict(self.optimizer_calls),
                "forward_per_sample": self.forward_samples * per,
                "backward_per_sample": self.backward_samples * per,
                "updates_per_sample": self.updates * per}
