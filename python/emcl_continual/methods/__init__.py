"""Continual-learning methods by ``--method`` name, imported lazily."""
from __future__ import annotations

import importlib

from .base import Method

__all__ = ["METHODS", "Method", "get_method"]

METHODS = {
    "emcl": "emcl_continual.methods.emcl:EMCL",
    "sgd": "emcl_continual.methods.sgd:FineTune",
    "ewc": "emcl_continual.methods.ewc:EWC",
    "gem": "emcl_continual.methods.gem:GEM",
    "agem": "emcl_continual.methods.agem:AGEM",
    "er": "emcl_continual.methods.er:ER",
    "mer": "emcl_continual.methods.mer:MER",
    "lamaml": "emcl_continual.methods.lamaml:LaMAML",
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
