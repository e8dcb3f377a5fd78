"""The ``"reference"`` backend: the per-tensor oracle of :mod:`emcl_kernels.reference`, looped
over the list. Slow and obvious; every other backend is tested against it."""
from __future__ import annotations

from emcl_kernels import reference as _ref


def _meta_lr_of(meta_lrs, i):
    return None if meta_lrs is None else meta_lrs[i]


def inner_step(params, grads, anchors, importances, *, grad_scale=None, found_inf=None, **hp):
    for p, g, a, h in zip(params, grads, anchors, importances):
        _ref.inner_step_(p, g, a, h, grad_scale=grad_scale, found_inf=found_inf, **hp)


def meta_step(params, grads, anchors, importances, meta_lrs, *, importance, grad_scale=None,
              found_inf=None, **hp):
    for i, (p, g, a, h) in enumerate(zip(params, grads, anchors, importances)):
        _ref.meta_step_(p, g, a, h, _meta_lr_of(meta_lrs, i), importance_kind=importance,
                        grad_scale=grad_scale, found_inf=found_inf, **hp)


def inner_meta_step(params, grads, anchors, importances, meta_lrs, *, importance,
                    grad_scale=None, found_inf=None, **hp):
    for i, (p, g, a, h) in enumerate(zip(params, grads, anchors, importances)):
        _ref.inner_meta_step_(p, g, a, h, _meta_lr_of(meta_lrs, i), importance_kind=importance,
                              grad_scale=grad_scale, found_inf=found_inf, **hp)
