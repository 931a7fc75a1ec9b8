"""A compact column of strings: the keys and sources of a forecast, a few bytes each instead of an object each.

A forecast table of 100 M samples holds two strings per sample. As Python ``str`` objects in a list they cost
about 175 bytes a sample (a 60-90 byte object plus its list slot): 17 GB, three times the table's numbers.
Keys and sources come in source order and mostly differ from the one before only at their end
(``train-00042-000123`` after ``train-00042-000122``; ``/data/a.parquet:17`` after ``/data/a.parquet:16``), so
:class:`Strings` front-codes them: each item keeps only the UTF-8 bytes after the prefix it shares with the item
before, and every ``BLOCK``-th item (and the first of every concatenated part) is kept whole, so any item is
rebuilt from at most ``BLOCK`` pieces::

    items     ["img-120", "img-121", "img-13", "cat"]
    shared    [0,         6,         5,        0]        int32 [n]   bytes shared with the item before
    data      b"img-120" b"1" b"3" b"cat"                bytes       what is left of each item, end to end
    offsets   [0, 7, 8, 9, 12]                           int64 [n+1] item i's rest is data[offsets[i]:offsets[i+1]]

A forecast's keys and sources then take ~14 bytes a sample each (the rest of the item, 8 + 4 bytes of offsets
and shared length) instead of ~80. Items come back as ``str`` when indexed or iterated, and a ``Strings``
equals any sequence of the same strings, so it reads like the list it replaces.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["Strings"]

BLOCK = 16  # an item kept whole at least this often: random access rebuilds from <= BLOCK pieces
_PIECE = 1 << 15  # items front-coded per vectorised step (bounds the [piece, width] scratch array)


def _utf8(text: str) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"Strings holds str only, got {type(text).__name__} {text!r:.60}")
    # Lone surrogates (JSON "\ud800") are legal in a str and must come back as they were.
    return text.encode("utf-8", "surrogatepass")


def _shared_prefixes(encoded: list[bytes]) -> np.ndarray:
    """int32 ``[n]``: bytes item i shares with item i - 1 (0 for every ``BLOCK``-th item and the first)."""
    n = len(encoded)
    shared = np.zeros(n, np.int32)
    lengths = np.fromiter(map(len, encoded), np.int64, n)
    for lo in range(0, n, _PIECE):
        hi = min(n, lo + _PIECE)
        width = int(lengths[lo:hi].max()) if hi > lo else 0
        if width == 0 or hi - lo < 2:
            continue
        # fixed-width bytes: the C loop pads with NULs; a trailing NUL of an item is bounded by its length below
        grid = np.array(encoded[lo:hi], dtype=f"S{width}").view(np.uint8).reshape(hi - lo, width)
        differ = grid[1:] != grid[:-1]
        first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
        shared[lo + 1 : hi] = np.minimum(first, np.minimum(lengths[lo + 1 : hi], lengths[lo : hi - 1]))
    shared[::BLOCK] = 0
    return shared


class Strings(Sequence[str]):
    """An immutable sequence of ``str``, front-coded (see the module docstring).

    ``Strings(["a", "b"])`` builds one from any iterable of ``str``; :meth:`concat` joins several. Indexing is
    O(``BLOCK``), iterating O(total bytes); ``nbytes`` says what it holds.
    """

    __slots__ = ("data", "offsets", "shared")

    def __init__(self, items: Iterable[str] = ()) -> None:
        if isinstance(items, Strings):
            self.data, self.offsets, self.shared = items.data, items.offsets, items.shared
            return
        encoded = [_utf8(item) for item in items]
        shared = _shared_prefixes(encoded)
        rests = [item[s:] for item, s in zip(encoded, shared.tolist())]
        sizes = np.fromiter(map(len, rests), np.int64, len(rests))
        self.data = b"".join(rests)
        self.offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(sizes, dtype=np.int64)])
        self.shared = shared

    @classmethod
    def _from_parts(cls, data: bytes, offsets: np.ndarray, shared: np.ndarray) -> Strings:
        out = cls.__new__(cls)
        out.data, out.offsets, out.shared = data, offsets, shared
        return out

    @classmethod
    def concat(cls, parts: Iterable[Strings | Sequence[str]]) -> Strings:
        """One ``Strings`` of ``parts`` end to end (each a ``Strings`` or any sequence of ``str``)."""
        parts = [p if isinstance(p, Strings) else Strings(p) for p in parts]
        if not parts:
            return cls()
        starts = np.cumsum([0] + [len(p.data) for p in parts[:-1]], dtype=np.int64)
        offsets = np.concatenate([np.zeros(1, np.int64)] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
        # each part's first item is whole (shared 0), so it stays a block head here
        return cls._from_parts(b"".join(p.data for p in parts), offsets, np.concatenate([p.shared for p in parts]))

    @property
    def nbytes(self) -> int:
        """Bytes held: the items' rests, the offsets and the shared lengths."""
        return len(self.data) + self.offsets.nbytes + self.shared.nbytes

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _range(self, start: int, stop: int) -> Iterator[bytes]:
        """The UTF-8 of items ``start .. stop - 1``, rebuilt from the item kept whole at or before ``start``."""
        if start >= stop:
            return
        window = self.shared[max(0, start - BLOCK + 1) : start + 1].tolist()
        head = start - (len(window) - 1 - max(k for k, keep in enumerate(window) if keep == 0))
        data, ends, shared = self.data, self.offsets[head : stop + 1].tolist(), self.shared[head:stop].tolist()
        previous = b""
        for k, keep in enumerate(shared):
            previous = previous[:keep] + data[ends[k] : ends[k + 1]]
            if head + k >= start:
                yield previous

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Strings: ...
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return Strings(b.decode("utf-8", "surrogatepass") for b in self._range(start, stop))
            return Strings(self[i] for i in range(start, stop, step))
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"Strings index {index} out of range for {n} items")
        return next(self._range(i, i + 1)).decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        for item in self._range(0, len(self)):
            yield item.decode("utf-8", "surrogatepass")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Strings) and self.data == other.data and np.array_equal(self.shared, other.shared):
            return np.array_equal(self.offsets, other.offsets)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as list: equal to lists, so not hashable

    def tolist(self) -> list[str]:
        """The items as a list of ``str``."""
        return list(self)

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"Strings([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Strings._from_parts, (self.data, self.offsets, self.shared))
