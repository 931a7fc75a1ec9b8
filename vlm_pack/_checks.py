"""The one check the vision forecasts and the packers share: a value that must be a whole count.

An image side (``vision/``) and a sample's length or vision cost (``packing/``) are the same kind of input:
an integer that came from someone else's data, where a float, a bool or a zero is a bug upstream. The error
names the value and where it came from (``what``) and says how to fix it (``fix``).
"""

from __future__ import annotations

import numbers
from typing import Any


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
