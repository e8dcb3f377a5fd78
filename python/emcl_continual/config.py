"""What the continual-learning commands accept: hyper-parameter keys and values, seeds, devices.

Every check here raises :class:`ConfigError` with one line that names the option, the key
and what would be accepted, before any data is read or any run starts.

**Keys.** A method's keys are those of its ``defaults(stream)`` plus the few it reads with a
fallback (:data:`OPTIONAL_KEYS`) and the run-level ones every method takes
(``train.RUN_DEFAULTS``: ``init``). An override no method of the run knows is refused with the
closest known key ("did you mean 'glances'?"); ``seed`` is refused (``--seeds`` sets it).

**Values.** One schema, :data:`RULES` (per key name) and :data:`METHOD_RULES` (where one
method needs another domain for the same name), gives each key its type and domain. A key
that is in neither takes its type from its default value (int, float, bool or str) and any
finite value of that type. To give a new key a domain, add one line to :data:`RULES`.
EMCL's optimizer keys are checked once more by the optimizer's own
``emcl_kernels.functional.check_hyperparameters`` (cross-key rules such as lr_max >= lr_min).

``train.build_config`` calls :func:`validate_config`, so every caller of ``train.run`` gets
the same checks as the command line.
"""
from __future__ import annotations

import ast
import difflib
import math
from dataclasses import dataclass

__all__ = ["ConfigError", "Rule", "RULES", "METHOD_RULES", "OPTIONAL_KEYS", "SEED_LIMIT", "parse_value",
           "parse_overrides", "known_keys", "rule_for", "check_value", "validate_config", "split_overrides",
           "check_seeds", "resolve_device"]


class ConfigError(ValueError):
    """A command-line option or hyper-parameter value that cannot be used; the message is one
    line naming the option and what it accepts."""


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
            if self.low is not None and self.high is not None:
                text += f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
            elif self.low is not None:
                text += f" {'>' if self.low_open else '>='} {self.low:g}"
        if self.none:
            text += " or None"
        return text


def _int(low: int, note: str = "") -> Rule:
    return Rule(int, low, note=note)


def _float(low: float = 0.0, *, open_: bool = False, high: float | None = None, none: bool = False,
           finite: bool = True, note: str = "") -> Rule:
    return Rule(float, low, open_, high, none=none, finite=finite, note=note)


_BOOL = Rule(bool)

# One rule per key name, whatever the method (METHOD_RULES below for the exceptions).
RULES: dict[str, Rule] = {
    # learning rates and strengths
    "lr": _float(open_=True),
    "meta_lr": _float(), "inner_lr": _float(),
    "alpha_init": _float(open_=True), "eta": _float(open_=True), "beta": _float(open_=True),
    "reg": _float(), "gamma": _float(), "margin": _float(), "eps": _float(),
    "decay": _float(high=1.0),
    "lr_scale": _float(none=True, note="None: 1/reg"),
    "lr_min": _float(), "lr_max": _float(finite=False),
    "modulation_lr_max": _float(none=True, note="None: meta_lr"),
    "grad_clip": _float(note="0: no clipping"),
    # counts
    "memory": _int(0, "replay memory size; 0 turns replay off"),
    "replay": _int(0, "replayed samples per incoming batch; 0 turns replay off"),
    "replay_batch": _int(1), "ref_batch": _int(1), "n_memories": _int(1),
    "glances": _int(1), "batches_per_example": _int(1),
    # switches
    "prox": _BOOL, "inner_replay": _BOOL, "meta_replay": _BOOL, "shuffle_inner": _BOOL,
    "inner_lr_modulation": _BOOL, "second_order": _BOOL, "learn_lr": _BOOL,
    "batched_memory_grads": _BOOL, "fast_mlp": _BOOL,
    "cuda_graph": Rule(bool, choices=("auto",), note="'auto': capture on a GPU, eager on a CPU"),
    # run-level (train.RUN_DEFAULTS) and EMCL's importance controls
    "init": Rule(str, choices=("torch", "xavier", "kaiming"), note="the linear layers' init"),
    "fixed_importance": _float(open_=True, none=True, note="None: h is the Taylor moving average"),
    "importance_norm": Rule(str, choices=("global", "tensor"), none=True, note="None: the pull is gamma*reg*h"),
}

# The same key name with another domain for one method (what the method itself requires).
METHOD_RULES: dict[str, dict[str, Rule]] = {
    "emcl": {"eps": _float(open_=True)},
    "gem": {"memory": _int(1)},
    "agem": {"memory": _int(1)},
    "er": {"memory": _int(1)},
    "mer": {"memory": _int(1), "gamma": _float(open_=True)},
    "lamaml": {"memory": _int(1), "grad_clip": _float(open_=True)},
}

# Keys a method reads with a fallback but leaves out of defaults(stream).
OPTIONAL_KEYS: dict[str, dict[str, object]] = {
    "emcl": {"lr_min": 0.0, "lr_max": float("inf"), "eps": 1e-8},
    "gem": {"batched_memory_grads": True},
    "mer": {"fast_mlp": True},
}

# Every method seeds generators with seed * 1_000_003 + offset (offset <= 17: methods/base.py,
# methods/_utils.py) and torch takes seeds in [-2**63, 2**64): seeds must stay below this.
SEED_LIMIT = (2**64 - 1 - 17) // 1_000_003 + 1


def _choice_rules() -> dict[str, Rule]:
    from emcl_kernels.backends import BACKENDS
    from emcl_kernels.interface import IMPORTANCE_KINDS, LR_MODES

    return {"lr_mode": Rule(str, choices=tuple(LR_MODES)), "importance": Rule(str, choices=tuple(IMPORTANCE_KINDS)),
            "backend": Rule(str, choices=("auto",) + tuple(sorted(BACKENDS)))}


# --------------------------------------------------------------------------- parsing
def parse_value(text: str):
    """``"0.1"`` -> 0.1, ``"True"`` -> True, ``"None"`` -> None, ``"inf"`` / ``"nan"`` -> float,
    anything else stays a string."""
    if text.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
        return float(text)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def parse_overrides(items: list, option: str = "--set") -> tuple[dict, dict]:
    """``["reg=10", "prox=False"]`` -> ``({"reg": 10, "prox": False}, {"reg": "--set reg=10", ...})``:
    the values and, per key, the option text to name in errors. A key given twice is refused."""
    values, origins = {}, {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"{option} expects KEY=VALUE, got {item!r}")
        if key in values:
            raise ConfigError(f"{option} {item}: {key!r} is already set by {origins[key]}")
        values[key] = parse_value(value.strip())
        origins[key] = f"{option} {item}"
    return values, origins


# --------------------------------------------------------------------------- keys and values
def known_keys(method: str, stream: str) -> dict:
    """Every key ``method`` reads on ``stream``, with its default value."""
    from .methods import get_method
    from .train import RUN_DEFAULTS

    keys = dict(RUN_DEFAULTS)
    keys.update(OPTIONAL_KEYS.get(method, {}))
    keys.update(get_method(method).defaults(stream))
    return keys


def rule_for(method: str, key: str, default=None) -> Rule | None:
    """The rule of ``key`` for ``method``: the method's own, the shared one, else one made from
    the type of ``default`` (None when that says nothing)."""
    rule = METHOD_RULES.get(method, {}).get(key) or RULES.get(key)
    if rule is None and key in ("lr_mode", "importance", "backend"):
        rule = _choice_rules()[key]
    if rule is not None:
        return rule
    for typ in (bool, int, float, str):
        if type(default) is typ:
            return Rule(typ)
    return None


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
        raise bad
    return number


def _suggest(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def validate_config(method: str, stream: str, config: dict, overrides: dict | None = None,
                    origins: dict | None = None) -> dict:
    """Check ``config`` (``method``'s defaults on ``stream`` updated with ``overrides``) and
    return it normalized. An override key ``method`` does not know, or any value outside its
    domain, raises :class:`ConfigError` naming the option (``origins[key]``, default
    ``"override <key>=<value>"``)."""
    origins = origins or {}
    known = known_keys(method, stream)

    def where(key):
        if key in origins:
            return origins[key]
        if overrides and key in overrides:
            return f"{method} override {key}={overrides[key]!r}"
        return f"{method} default {key}"

    for key in overrides or {}:
        if key == "seed":
            raise ConfigError(f"{where(key)}: the seed is not a hyper-parameter; use --seeds")
        if key not in known:
            listing = f" ({method}'s keys: {', '.join(sorted(known))})" if len(known) <= 12 else ""
            raise ConfigError(f"{where(key)}: {method} has no hyper-parameter {key!r}"
                              f"{_suggest(key, known) or listing}")
    out = {}
    for key, value in config.items():
        if key == "seed":
            out[key] = value
            continue
        try:
            out[key] = check_value(key, value, rule_for(method, key, known.get(key)))
        except ConfigError as exc:
            raise ConfigError(f"{where(key)}: {exc}") from None
    if method == "emcl":
        _check_emcl_optimizer(out, where)
    return out


def _check_emcl_optimizer(config: dict, where) -> None:
    from emcl_kernels.functional import check_hyperparameters

    from .methods.emcl import OPTIMIZER_KEYS

    hyper = {k: config[k] for k in OPTIMIZER_KEYS if config.get(k) is not None}
    try:
        check_hyperparameters(**hyper)
    except (TypeError, ValueError) as exc:
        named = next((k for k in hyper if str(exc).startswith(k)), None)
        raise ConfigError(f"{where(named) + ': ' if named else 'emcl: '}{exc}") from None


def split_overrides(methods: list, stream: str, overrides: dict, origins: dict | None = None) -> tuple[dict, list]:
    """Give each method the overrides it knows. Returns ``(per_method, notes)``: the overrides of
    each method, and one note per key that only some of the methods know. A key none of them
    knows raises :class:`ConfigError` naming the option, the methods and the closest key."""
    origins = origins or {}
    keys = {m: known_keys(m, stream) for m in methods}
    per_method: dict = {m: {} for m in methods}
    notes = []
    for key, value in overrides.items():
        origin = origins.get(key, f"{key}={value!r}")
        if key == "seed":
            raise ConfigError(f"{origin}: the seed is not a hyper-parameter; use --seeds")
        knowers = [m for m in methods if key in keys[m]]
        if not knowers:
            every = set().union(*keys.values())
            who = f"{methods[0]} has no" if len(methods) == 1 else f"none of {', '.join(methods)} has a"
            listing = (f" ({methods[0]}'s keys: {', '.join(sorted(every))})"
                       if len(methods) == 1 and len(every) <= 12 else "; --show-config lists the keys")
            raise ConfigError(f"{origin}: {who} hyper-parameter {key!r}{_suggest(key, every) or listing}")
        if len(knowers) < len(methods):
            notes.append(f"{origin} applies to {', '.join(knowers)} only (the others have no {key!r})")
        for m in knowers:
            per_method[m][key] = value
    return per_method, notes


# --------------------------------------------------------------------------- seeds, devices
def check_seeds(seeds: list, option: str = "--seeds") -> list:
    """Seeds as ints, each in ``[0, SEED_LIMIT)`` and given once; raises :class:`ConfigError`."""
    if not seeds:
        raise ConfigError(f"{option}: give at least one seed")
    seen = set()
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigError(f"{option}: seeds are integers, got {s!r}")
        if not 0 <= s < SEED_LIMIT:
            raise ConfigError(f"{option}: seed {s} is outside [0, {SEED_LIMIT}) (the methods seed their "
                              f"generators with seed x 1000003 + offset, and torch takes seeds below 2**64)")
        if s in seen:
            raise ConfigError(f"{option}: seed {s} is given twice; each seed is one run, and a repeated "
                              f"seed would be counted twice in the mean and std")
        seen.add(s)
    return list(seeds)


def resolve_device(text: str):
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` -> ``(torch.device, what was picked)``.

    ``auto`` is the GPU where torch sees one, else the CPU. A CUDA device torch cannot use
    raises :class:`ConfigError` saying so.
    """
    import torch

    text = (text or "cpu").strip()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), f"--device auto: using the GPU cuda:0 ({torch.cuda.get_device_name(0)})"
        return torch.device("cpu"), "--device auto: no CUDA GPU visible to torch, using the CPU"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {text}: not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cpu":
        return torch.device("cpu"), None
    if device.type != "cuda":
        raise ConfigError(f"--device {text}: only cpu, cuda, cuda:N and auto are supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {text}: no CUDA GPU is visible to torch (torch.cuda.is_available() is "
                          f"False); use --device cpu, or --device auto to take a GPU only where there is one")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {text}: torch sees {torch.cuda.device_count()} GPU(s), cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")
    return device, None
