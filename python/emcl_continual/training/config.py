"""What the continual-learning commands accept: hyper-parameter keys and values, seeds, devices,
and the configuration of a run (:func:`build_config`).

Every check here raises :class:`ConfigError` with one line that names the option, the key
and what would be accepted, before any data is read or any run starts.

**Keys.** A method's keys are those its class declares (``Method.keys(stream)``: its
``defaults(stream)`` and the ``OPTIONAL`` keys it reads with a fallback) and the run-level ones
every method takes (:data:`RUN_DEFAULTS`: ``init``). An override no method of the run knows is
refused with the closest known key ("did you mean 'glances'?"); ``seed`` is refused
(``--seeds`` sets it).

**Values.** Each method declares the :class:`~.schema.Rule` of each of its keys (``RULES``) and
its rules between keys (``validate``) in its own file; this module merges the defaults with the
overrides and applies them (:data:`RUN_RULES` for the run-level keys). A key without a rule
takes its type from its default value (int, float, bool or str) and any finite value of that
type.

:func:`build_config` calls :func:`validate_config`, so every caller of ``train.run`` gets the
same checks as the command line.
"""
from __future__ import annotations

import ast
import difflib

from ..core.errors import ConfigError
from ..core.schema import Rule, check_value
from ..methods import get_method

__all__ = ["ConfigError", "Rule", "RUN_DEFAULTS", "RUN_RULES", "SEED_LIMIT", "parse_value", "parse_overrides",
           "known_keys", "rule_for", "check_value", "validate_config", "build_config", "split_overrides",
           "check_seeds", "resolve_device"]


# Run-level options every method accepts (``--set init=xavier``): the linear layers' init
# (:func:`emcl_continual.data.models.build_model`).
RUN_DEFAULTS = {"init": "torch"}
RUN_RULES: dict[str, Rule] = {
    "init": Rule(str, choices=("torch", "xavier", "kaiming"), note="the linear layers' init"),
}

# Every method seeds its generator with seed * 1_000_003 + offset (offset <= 17:
# Method.GENERATOR_OFFSET) and torch takes seeds in [-2**63, 2**64): seeds must stay below this.
SEED_LIMIT = (2**64 - 1 - 17) // 1_000_003 + 1


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
    return {**RUN_DEFAULTS, **get_method(method).keys(stream)}


def rule_for(method: str, key: str, default=None) -> Rule | None:
    """The rule of ``key`` for ``method``: the method's own, the run-level one, else one made
    from the type of ``default`` (None when that says nothing)."""
    rule = get_method(method).RULES.get(key) or RUN_RULES.get(key)
    if rule is not None:
        return rule
    for typ in (bool, int, float, str):
        if type(default) is typ:
            return Rule(typ)
    return None


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
    cls = get_method(method)
    out = {}
    for key, value in config.items():
        if key == "seed" or key in cls.RULES:
            out[key] = value
            continue
        try:
            out[key] = check_value(key, value, rule_for(method, key, known.get(key)))
        except ConfigError as exc:
            raise ConfigError(f"{where(key)}: {exc}") from None
    return cls.check(out, where)


def build_config(method: str, stream: str, seed: int, overrides: dict | None = None,
                 origins: dict | None = None) -> dict:
    """:data:`RUN_DEFAULTS` and ``defaults(stream)`` of ``method``, updated with ``overrides``,
    checked by :func:`validate_config` (unknown keys and bad values raise ``ConfigError``),
    plus ``seed``."""
    config = {**RUN_DEFAULTS, **get_method(method).defaults(stream), **(overrides or {})}
    config = validate_config(method, stream, config, overrides, origins)
    config["seed"] = int(seed)
    return config


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
