"""Continual-learning methods by ``--method`` name, imported lazily.

:data:`METHODS` is the one list of methods, cheapest first (``--method all`` and
``python -m emcl_continual.compare`` run them in this order, so that an interrupted sweep has
the most methods finished). A new method is one file on :class:`~.base.Method` and one line
here.
"""
from __future__ import annotations

import importlib

from .base import Method

__all__ = ["METHODS", "Method", "get_method"]

METHODS = {
    "sgd": "emcl_continual.methods.sgd:FineTune",
    "ewc": "emcl_continual.methods.ewc:EWC",
    "agem": "emcl_continual.methods.agem:AGEM",
    "er": "emcl_continual.methods.er:ER",
    "gem": "emcl_continual.methods.gem:GEM",
    "emcl": "emcl_continual.methods.emcl:EMCL",
    "lamaml": "emcl_continual.methods.lamaml:LaMAML",
    "mer": "emcl_continual.methods.mer:MER",
}


def get_method(name: str) -> type:
    """The :class:`Method` subclass registered as ``name``."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    module, _, attr = METHODS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise ValueError(f"method {name!r} is registered but its module {module} is not present") from exc
        raise
    return getattr(mod, attr)
