"""A compact column of strings: the keys and sources of a forecast, one buffer instead of one object each.

A forecast table of 100 M samples holds two strings per sample. As Python ``str`` objects in a list that is
about 175 bytes a sample (a 60-90 byte object plus its list slot): 17 GB, three times the table's numbers.
:class:`Strings` keeps them as Arrow lays out a string column, UTF-8 bytes end to end plus the offsets::

    items     ["s0", "s17", "dog"]
    data      b"s0s17dog"                       bytes  [sum of the UTF-8 lengths]
    offsets   [0, 2, 5, 8]                      int64  [n + 1]: item i is data[offsets[i]:offsets[i + 1]]

about 8 bytes a sample plus the text. Items come back as ``str`` when indexed or iterated; a ``Strings``
equals any sequence of the same strings, so it reads like the list it replaces.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise
from typing import Any, overload

import numpy as np

__all__ = ["Strings"]


def _utf8(text: str) -> bytes:
    # Lone surrogates (JSON "\ud800") are legal in a str and must come back as they were.
    return text.encode("utf-8", "surrogatepass")


class Strings(Sequence[str]):
    """An immutable sequence of ``str`` stored as one UTF-8 buffer and int64 offsets ``[n + 1]``.

    ``Strings(["a", "b"])`` builds one from any iterable of ``str``; :meth:`concat` joins several;
    :meth:`from_buffers` wraps existing ``(data, offsets)`` (e.g. an Arrow ``large_string`` column's).
    """

    __slots__ = ("data", "offsets")

    def __init__(self, items: Iterable[str] = ()) -> None:
        if isinstance(items, Strings):
            self.data, self.offsets = items.data, items.offsets
            return
        encoded = []
        for item in items:
            if not isinstance(item, str):
                raise TypeError(f"Strings holds str only, got {type(item).__name__} {item!r:.60}")
            encoded.append(_utf8(item))
        sizes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        self.data = b"".join(encoded)
        self.offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(sizes, dtype=np.int64)])

    @classmethod
    def from_buffers(cls, data: bytes, offsets: np.ndarray) -> Strings:
        """``Strings`` over ``data`` cut at ``offsets`` (int ``[n + 1]``, non-decreasing, within ``data``)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or len(offsets) == 0:
            raise ValueError(f"offsets must be 1-D with n + 1 entries, got shape {offsets.shape}")
        if offsets[0] != 0:  # a sliced Arrow column: keep only its own bytes
            data, offsets = bytes(data[offsets[0] : offsets[-1]]), offsets - offsets[0]
        if offsets[-1] > len(data) or (len(offsets) > 1 and np.any(np.diff(offsets) < 0)):
            raise ValueError("offsets must be non-decreasing and end within data")
        out = cls.__new__(cls)
        out.data, out.offsets = bytes(data[: offsets[-1]]), offsets
        return out

    @classmethod
    def concat(cls, parts: Iterable[Strings | Sequence[str]]) -> Strings:
        """One ``Strings`` of ``parts`` end to end (each a ``Strings`` or any sequence of ``str``)."""
        parts = [p if isinstance(p, Strings) else Strings(p) for p in parts]
        if not parts:
            return cls()
        ends = np.cumsum([0] + [len(p.data) for p in parts[:-1]], dtype=np.int64)
        offsets = np.concatenate([np.zeros(1, np.int64)] + [p.offsets[1:] + e for p, e in zip(parts, ends)])
        return cls.from_buffers(b"".join(p.data for p in parts), offsets)

    @property
    def nbytes(self) -> int:
        """Bytes held: the UTF-8 text and the offsets."""
        return len(self.data) + self.offsets.nbytes

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Strings: ...
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return Strings(self[i] for i in range(start, stop, step))
            return Strings.from_buffers(self.data, self.offsets[start : max(start, stop) + 1])
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"Strings index {index} out of range for {n} items")
        return self.data[self.offsets[i] : self.offsets[i + 1]].decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        data, ends = self.data, self.offsets.tolist()
        for a, b in pairwise(ends):
            yield data[a:b].decode("utf-8", "surrogatepass")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Strings):
            return self.data == other.data and np.array_equal(self.offsets, other.offsets)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequences (list) are unhashable too

    def tolist(self) -> list[str]:
        """The items as a list of ``str``."""
        return list(self)

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"Strings([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Strings.from_buffers, (self.data, self.offsets))
