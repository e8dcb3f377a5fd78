"""The type and domain of a hyper-parameter (:class:`Rule`) and the check of a value against it.

A leaf for the methods: each method file declares a ``RULES`` dict of these for its keys
(``methods/base.py``), and :mod:`.config` applies them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["Rule", "int_rule", "float_rule", "BOOL", "MAX_COUNT", "check_value"]


@dataclass(frozen=True)
class Rule:
    """Type and domain of one hyper-parameter.

    ``type`` is int, float, bool or str; numbers must be finite (unless ``finite=False``) and
    within ``[low, high]`` (``low_open``: ``low`` itself excluded); strings one of ``choices``
    (when given; a bool rule with ``choices`` takes those strings too, e.g. cuda_graph's
    "auto"); ``none``: None is accepted too. ``note`` says what the value means.
    """

    type: type
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    choices: tuple = ()
    none: bool = False
    finite: bool = True
    note: str = ""

    def describe(self) -> str:
        """``"an integer >= 1"``, ``"a number in [0, 1]"``, ``"True or False"``, ..."""
        if self.type is bool:
            text = "True or False" + "".join(f" or {c!r}" for c in self.choices)
        elif self.type is str:
            text = "one of " + ", ".join(map(repr, self.choices)) if self.choices else "a string"
        else:
            text = "an integer" if self.type is int else "a number"
            fmt = (lambda v: str(int(v))) if self.type is int else (lambda v: f"{v:g}")
            if self.low is not None and self.high is not None and not (self.type is int and self.high == MAX_COUNT):
                text += f" in {'(' if self.low_open else '['}{fmt(self.low)}, {fmt(self.high)}]"
            elif self.low is not None:
                text += f" {'>' if self.low_open else '>='} {fmt(self.low)}"
        if self.none:
            text += " or None"
        return text


# The largest count a key may hold (memory sizes, batch sizes, visits): past it a value is a
# typo (memory=1e300), not a size any tensor here could have.
MAX_COUNT = 2**31 - 1


def int_rule(low: int, note: str = "", high: int = MAX_COUNT) -> Rule:
    """An int in ``[low, high]``."""
    return Rule(int, low, high=high, note=note)


def float_rule(low: float = 0.0, *, open_: bool = False, high: float | None = None, none: bool = False,
               finite: bool = True, note: str = "") -> Rule:
    """A float >= ``low`` (> with ``open_``), <= ``high``; None too with ``none``."""
    return Rule(float, low, open_, high, none=none, finite=finite, note=note)


BOOL = Rule(bool)


def check_value(key: str, value, rule: Rule | None):
    """``value`` normalized to ``rule``'s type (an integral float for an int, an int for a float,
    ``"true"`` / ``"false"`` for a bool); raises :class:`ConfigError` ``"<key> must be ..., got ..."``."""
    if rule is None:
        return value
    if value is None:
        if rule.none:
            return None
        raise ConfigError(f"{key} must be {rule.describe()}, got None")
    bad = ConfigError(f"{key} must be {rule.describe()}, got {value!r}"
                      + (f" ({rule.note})" if rule.note else ""))
    if rule.type is bool:
        if isinstance(value, bool) or (isinstance(value, str) and value in rule.choices):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad
    if rule.type is str:
        if not isinstance(value, str) or (rule.choices and value not in rule.choices):
            raise bad
        return value
    # numbers (a string is not one, even "2": the command line parses its values)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad
    number = float(value) if not isinstance(value, int) else value
    if isinstance(number, float) and (math.isnan(number) or (math.isinf(number) and rule.finite)):
        raise ConfigError(f"{key} must be finite, got {value!r}")
    if rule.type is int:
        if isinstance(number, float):
            if not number.is_integer():
                raise bad
            number = int(number)
    else:
        number = float(number)
    if rule.low is not None and (number < rule.low or (rule.low_open and number == rule.low)):
        raise bad
    if rule.high is not None and number > rule.high:
        if rule.type is int and rule.high == MAX_COUNT:
            raise ConfigError(f"{key} must be {rule.describe()} and at most {MAX_COUNT}, got {value!r}"
                              + (f" ({rule.note})" if rule.note else ""))
        raise bad
    return number
