"""Config validation helpers shared by the engine's config (``engine.config``) and the
deployment YAML's (``cluster.config``): one message format for every refused value. No torch
here: ``cluster.config`` imports this, and the ingress and CLI import that.

Every failure is a ``ConfigError`` whose message is ``<key>: must be <what is allowed>, got
<value given>``; the allowed part names the type and the range, with a bound that comes from
another field named after it in parentheses::

    models[0].deployment_config.num_replicas: must be an integer >= 1 or null, got 0
    max_cpu_loras: must be an integer >= 4 (max_loras), got 2
    block_size: must be one of 8, 16, 32, 64, 128, got 12

Where the checks live: each engine section (``ModelConfig``, ``CacheConfig``, ...) checks
itself in ``__post_init__`` and names the flat vLLM argument, which is also the key under a
deployment's ``engine_kwargs`` (the cluster prefixes its key path when it re-raises): it is
built from keyword arguments (and replaced per rank), so it must never exist invalid. Each
cluster section is first built strictly from YAML (types, unknown and missing keys), then
checked by its ``check(path)`` method with the key path of where it sits in the YAML
(``models[0].deployment_config``), which only its parent knows. Both use the typed checks
below; ``require`` is for what no typed check says (a cross-field rule, a divisibility), and
its message keeps the same ``must ..., got ...`` shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from engine.errors import ConfigError

Number = int | float


def require(ok: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def describe_range(
    *,
    gt: Number | None = None,
    ge: Number | None = None,
    lt: Number | None = None,
    le: Number | None = None,
) -> str:
    """``>= 1``, ``> 0``, ``<= 8``, or with both ends ``in [0, 65535]`` / ``in (0, 1]``."""
    low = ("(", gt) if gt is not None else ("[", ge) if ge is not None else None
    high = (")", lt) if lt is not None else ("]", le) if le is not None else None
    if low is not None and high is not None:
        return f"in {low[0]}{low[1]!r}, {high[1]!r}{high[0]}"
    if low is not None:
        return f"{'>' if gt is not None else '>='} {low[1]!r}"
    if high is not None:
        return f"{'<' if lt is not None else '<='} {high[1]!r}"
    return ""


def _in_range(
    value: Number, gt: Number | None, ge: Number | None, lt: Number | None, le: Number | None
) -> bool:
    # Written as comparisons that must all hold, so that NaN is out of every range.
    return (
        (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )


def _allowed(kind: str, rng: str, note: str, optional: bool) -> str:
    text = " ".join(part for part in (kind, rng) if part)
    if note:
        text += f" ({note})"
    return text + (" or null" if optional else "")


def check_int(
    value: object,
    key: str,
    *,
    gt: int | None = None,
    ge: int | None = None,
    lt: int | None = None,
    le: int | None = None,
    note: str = "",
    optional: bool = False,
) -> None:
    """An integer (not a bool) within the given bounds; ``None`` passes when ``optional``.
    ``note`` names where a bound comes from (``ge=max_loras, note="max_loras"``)."""
    if optional and value is None:
        return
    ok = is_int(value) and _in_range(value, gt, ge, lt, le)  # type: ignore[arg-type]
    rng = describe_range(gt=gt, ge=ge, lt=lt, le=le)
    require(ok, key, f"must be {_allowed('an integer', rng, note, optional)}, got {value!r}")


def check_positive_int(value: object, key: str, *, optional: bool = False) -> None:
    """An integer >= 1."""
    check_int(value, key, ge=1, optional=optional)


def check_number(
    value: object,
    key: str,
    *,
    gt: Number | None = None,
    ge: Number | None = None,
    lt: Number | None = None,
    le: Number | None = None,
    note: str = "",
    optional: bool = False,
) -> None:
    """An int or float (not a bool, not NaN) within the given bounds; ``None`` passes when
    ``optional``. ``note`` names a bound's source or the unit (``note="GiB"``)."""
    if optional and value is None:
        return
    ok = is_number(value) and _in_range(value, gt, ge, lt, le)  # type: ignore[arg-type]
    rng = describe_range(gt=gt, ge=ge, lt=lt, le=le)
    require(ok, key, f"must be {_allowed('a number', rng, note, optional)}, got {value!r}")


def check_choice(value: object, key: str, choices: Sequence[object], *, note: str = "") -> None:
    """One of ``choices``, of its type too (``16.0`` is not the block size ``16``, ``True`` not
    ``1``; compared with ``==``, so unhashable values are refused, not raised)."""
    allowed = "one of " + ", ".join(repr(c) for c in choices)
    ok = any(_same_kind(value, c) and value == c for c in choices)
    require(ok, key, f"must be {_allowed(allowed, '', note, False)}, got {value!r}")


def _same_kind(value: object, choice: object) -> bool:
    """Whether ``value`` may equal ``choice``: an integer for an integer choice (numpy's too,
    never a bool or a float), else the choice's own type."""
    if is_int(choice):
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return type(value) is type(choice)


def check_bool(value: object, key: str) -> None:
    """``True`` or ``False``, not a truthy number or string."""
    require(isinstance(value, bool), key, f"must be true or false, got {value!r}")


def check_str(
    value: object, key: str, *, non_empty: bool = False, note: str = "", optional: bool = False
) -> None:
    """A string (non-empty when ``non_empty``); ``None`` passes when ``optional``."""
    if optional and value is None:
        return
    ok = isinstance(value, str) and (bool(value) or not non_empty)
    kind = "a non-empty string" if non_empty else "a string"
    require(ok, key, f"must be {_allowed(kind, '', note, optional)}, got {value!r}")
