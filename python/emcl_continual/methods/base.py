"""The base every continual-learning method is written on.

A method is one file: a :class:`Method` subclass that declares

* ``name`` (its ``--method`` name, registered in :data:`emcl_continual.methods.METHODS`);
* ``DEFAULTS``: its hyper-parameters per stream (the paper's Table II values among them), read
  by :meth:`defaults`; ``OPTIONAL``: keys it reads with a fallback, left out of the defaults;
* ``RULES``: the type and domain of each of those keys (:class:`~emcl_continual.core.schema.Rule`),
  and :meth:`validate` for rules between keys;
* :meth:`make_optimizer` (plain SGD on ``lr`` unless it says otherwise) and :meth:`observe`;
  :meth:`begin_task` / :meth:`end_task` when it acts at task boundaries.

The base owns the model, the checked configuration, the device, the method's random
generator and its optimizer. ``train.run`` builds the model, creates the method with the
configuration of :func:`emcl_continual.training.config.build_config` (defaults, overrides, ``seed``),
then per task calls ``begin_task(t)``, ``observe(x, y, t)`` once per incoming batch, and
``end_task(t)``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..core.errors import ConfigError
from ..core.schema import Rule, check_value
from ..data.streams import StreamInfo

__all__ = ["Method"]


class Method:
    """A continual learner: sees each batch once, with its task id."""

    name: str = "method"
    #: stream name -> {key: value}
    DEFAULTS: dict = {}
    #: keys read with a fallback, not in ``defaults(stream)``: key -> the fallback value
    OPTIONAL: dict = {}
    #: key -> :class:`~emcl_continual.core.schema.Rule`, for every key of ``DEFAULTS`` and ``OPTIONAL``
    RULES: dict[str, Rule] = {}
    #: the generator is seeded with ``seed * 1_000_003 + GENERATOR_OFFSET``
    GENERATOR_OFFSET: int = 17

    # -- the configuration --------------------------------------------------------------------
    @classmethod
    def defaults(cls, stream: str) -> dict:
        """A copy of this method's hyper-parameters for ``stream``; ``ValueError`` for a stream
        it has none for."""
        if stream not in cls.DEFAULTS:
            raise ValueError(f"{cls.name}: no hyper-parameters for stream {stream!r}; "
                             f"known streams: {sorted(cls.DEFAULTS)}")
        return dict(cls.DEFAULTS[stream])

    @classmethod
    def keys(cls, stream: str) -> dict:
        """Every key this method reads on ``stream``, with its default (or fallback) value."""
        return {**cls.OPTIONAL, **cls.defaults(stream)}

    @classmethod
    def validate(cls, config: dict) -> None:
        """Rules between keys, checked after each value has passed its own rule; raise
        ``ValueError`` with a message that starts with the key it is about."""

    @classmethod
    def check(cls, config: dict, where=None) -> dict:
        """``config`` with every key of :attr:`RULES` checked and normalized by its rule, then
        :meth:`validate`. Raises :class:`~emcl_continual.core.errors.ConfigError` with
        ``where(key)`` (default: the method's name) before the message."""
        where = where or (lambda key: cls.name)
        out = dict(config)
        missing = [k for k in cls.RULES if k not in out and k not in cls.OPTIONAL]
        if missing:
            raise ConfigError(f"{cls.name}: missing hyper-parameter(s) {', '.join(map(repr, missing))} "
                              f"(config keys: {sorted(out)})")
        for key, rule in cls.RULES.items():
            if key in out:
                try:
                    out[key] = check_value(key, out[key], rule)
                except ConfigError as exc:
                    raise ConfigError(f"{where(key)}: {exc}") from None
        try:
            cls.validate(out)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            named = max((k for k in out if str(exc).startswith(k)), key=len, default=None)
            raise ConfigError(f"{where(named) if named else cls.name}: {exc}") from None
        return out

    # -- the learner --------------------------------------------------------------------------
    def __init__(self, model: nn.Module, info: StreamInfo, config: dict, device: torch.device):
        self.model = model
        self.info = info
        self.device = torch.device(device)
        self.config = type(self).check(config)
        self.generator = torch.Generator().manual_seed(
            int(self.config.get("seed", 0)) * 1_000_003 + self.GENERATOR_OFFSET)
        self.opt = self.make_optimizer()

    def make_optimizer(self):
        """The optimizer of the model's parameters (called once, at the end of ``__init__``):
        SGD with ``config["lr"]``."""
        return torch.optim.SGD(self.model.parameters(), lr=float(self.config["lr"]))

    def begin_task(self, task: int) -> None:
        """Called before the first batch of task ``task``."""

    def end_task(self, task: int) -> None:
        """Called after the last batch of task ``task``, before it is evaluated."""

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: int) -> float:
        """Learn from one incoming batch of task ``task``; return its training loss."""
        raise NotImplementedError(f"{type(self).__name__} does not implement observe()")
