"""Checks shared across the package: a value that must be a whole count, a family name looked up in a table.

An image side (``vision/``) and a sample's length or vision cost (``packing/``) are the same kind of input:
an integer that came from someone else's data, where a float, a bool or a zero is a bug upstream. The error
names the value and where it came from (``what``) and says how to fix it (``fix``).

A family that lacks a rule (``vlm_pack.families.require``, the offline stand-ins) is answered the same way:
what is missing, for which family, and the families that have it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

_V = TypeVar("_V")


def checked_count(value: Any, what: str, fix: str, *, allow_zero: bool = False) -> int:
    """``value`` as an ``int`` > 0 (>= 0 with ``allow_zero``), else an error naming ``what`` and ``fix``.

    TypeError for a non-integer (bools included: ``True`` is a bug, not a count of one; numpy integers are
    accepted), ValueError for a zero or negative value, e.g. ``"sample 'a': length 0 is zero; <fix>"``.
    Callers test the common case (``type(value) is int and value > 0``) inline and call this on the rest.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} {value!r} ({type(value).__name__}) is not an integer; {fix}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} {value} is {'zero' if value == 0 else 'negative'}; {fix}")
    return value


def family_entry(table: Mapping[str, _V], family: str, what: str, fix: str = "") -> _V:
    """``table[family]``, else a ValueError naming ``what`` is missing, the families that have it and ``fix``.

    E.g. ``"no chat format for family 'blip2'; supported: qwen2_vl, llava. Give a tokenizer ..."``.
    """
    try:
        return table[family]
    except KeyError:
        message = f"no {what} for family {family!r}; supported: {', '.join(table)}."
        raise ValueError(f"{message} {fix}" if fix else message) from None
