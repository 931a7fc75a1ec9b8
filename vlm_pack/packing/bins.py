"""What packing returns and what it accepts: result types (``PackResult``, ``PackedBin``, ``Unpacked``)
and the input validation every packer shares (error messages name the sample and the fix)."""

from __future__ import annotations

import itertools
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------- validation


def _first_non_integer(values: Any) -> int:
    """Index of the first element that is not a Python/numpy integer (bools count as non-integers)."""
    for i, v in enumerate(values):
        if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
            return i
    return -1


def _as_int_array(values: Any, name: str, *, allow_zero: bool) -> np.ndarray:
    """``values`` as a 1-D int64 array, or a ValueError/TypeError naming the offending index."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if not hasattr(values, "__len__"):  # a generator or other one-pass iterable
            values = list(values)
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError) as e:  # ragged nested lists
            raise TypeError(f"{name} must be a 1-D sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one entry per sample), got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name}[{i}] = {arr[i].item()!r} is not an integer; {name} must be whole token counts "
                f"(check that sample {i} was measured, not averaged)"
            )
        raise TypeError(
            f"{name} has float dtype {arr.dtype} ({name}[0] = {arr[0].item()!r}); token counts must be integers: pass "
            f"integers, e.g. np.asarray({name}, dtype=np.int64)"
        )
    if kind not in "iu":
        i = _first_non_integer(arr.tolist() if kind == "O" else arr)
        i = max(i, 0)
        v = arr[i]
        v = v.item() if isinstance(v, np.generic) else v
        raise TypeError(f"{name}[{i}] = {v!r} ({type(v).__name__}) is not an integer; {name} must hold ints")
    if kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise ValueError(f"{name}[{i}] = {arr[i]} does not fit in int64")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        bad = arr < 0 if allow_zero else arr <= 0
        if bad.any():
            i = int(np.argmax(bad))
            what = "negative" if arr[i] < 0 else "zero"
            need = "non-negative" if allow_zero else "positive (at least one token)"
            raise ValueError(
                f"{name}[{i}] = {int(arr[i])} is {what}; {name} must be {need}. "
                f"Drop or fix sample {i} before packing."
            )
    return arr


def _as_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def padded_lengths(lengths: Any, multiple: int) -> np.ndarray:
    """int64 ``[N]``: each length rounded up to a multiple of ``multiple``, the span the sample takes in a row.

    ``PackingCollator(pad_to_multiple_of=multiple)`` pads every sample to this span, so a plan must be made on
    these lengths for each of its bins to be one row: ``pack`` and ``StreamPacker`` (``pad_to_multiple_of=``)
    and every planner of vlm-pack round with this one function. ``padded_lengths([4093, 4097], 4)`` is
    ``[4096, 4100]``: one bin of 8192 raw, two once padded.
    """
    multiple = _as_positive_int(multiple, "pad_to_multiple_of")
    lens = np.asarray(lengths, dtype=np.int64)
    return lens if multiple == 1 else round_up(lens, multiple)


def round_up(value: Any, multiple: int) -> Any:
    """``value`` (an int or an integer array) rounded up to a multiple of ``multiple``: the one rounding rule
    of the planners (:func:`padded_lengths`, ``StreamPacker``) and of ``PackingCollator``'s padding checks."""
    return -(-value // multiple) * multiple


def _length_text(length: int, multiple: int) -> str:
    """``"4097"``, or ``"4097 (padded to 4100)"`` when padding to ``multiple`` changes it."""
    span = round_up(length, multiple)
    return str(length) if span == length else f"{length} (padded to {span}, a multiple of {multiple})"


def _oversize_message(who: str, length: int, capacity: int, multiple: int = 1) -> str:
    return (
        f"{who} has expanded length {_length_text(length, multiple)} > capacity {capacity}. Raise capacity to "
        f"at least {round_up(length, multiple)}, or pass oversized='truncate' (clip it to {capacity} "
        f"tokens) or oversized='skip' (leave it out; it is reported with its reason)"
    )


def _vision_oversize_message(who: str, cost: int, vision_capacity: int) -> str:
    return (
        f"{who} has vision cost {cost} > vision_capacity {vision_capacity}. Raise vision_capacity "
        f"to at least {cost}, downscale its images (fewer vision tokens), or pass oversized='skip' "
        f"(a vision budget cannot be truncated: 'truncate' skips such samples too)"
    )


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A sample left out of every bin, and why (``index`` is the sample index, or its key when streaming)."""

    index: Any
    reason: str


class PackResult:
    """Bins as flat arrays; per-bin Python lists are built only when :attr:`bins` is read.

    Attributes:
        order: int64 ``[num_packed]``: sample indices, bin by bin; inside a bin in placement order
            (longest first for the decreasing strategies, data order for ``ff``/``nf``).
        bin_offsets: int64 ``[num_bins + 1]``: bin ``i`` is ``order[bin_offsets[i]:bin_offsets[i+1]]``.
        bin_lengths: int64 ``[num_bins]``: tokens used per bin (sum of ``lengths`` of its samples).
        bin_vision: int64 ``[num_bins]`` vision cost per bin, or None when packing had no vision budget.
        lengths: int64 ``[num_samples]``: the lengths packing used: padded to ``pad_to_multiple_of`` (the span
            each sample takes in its row), truncated ones clipped to capacity.
        pad_to_multiple_of: the multiple the lengths were padded to (1: as given).
        vision: int64 ``[num_samples]``: the per-sample vision costs given to :func:`pack`, or None.
        unpacked: samples in no bin, with the reason (``Unpacked(index, reason)``).
        truncated: sample index -> original length, for samples clipped to ``capacity``.
    """

    __slots__ = (
        "_bins",
        "_sample_bin",
        "bin_lengths",
        "bin_offsets",
        "bin_vision",
        "capacity",
        "lengths",
        "max_samples_per_bin",
        "order",
        "pad_to_multiple_of",
        "strategy",
        "truncated",
        "unpacked",
        "vision",
        "vision_capacity",
    )

    def __init__(
        self,
        *,
        order: np.ndarray,
        bin_offsets: np.ndarray,
        lengths: np.ndarray,
        capacity: int,
        strategy: str,
        vision: np.ndarray | None = None,
        vision_capacity: int | None = None,
        max_samples_per_bin: int | None = None,
        unpacked: list[Unpacked] | None = None,
        truncated: dict[int, int] | None = None,
        bin_lengths: np.ndarray | None = None,
        bin_vision: np.ndarray | None = None,
        pad_to_multiple_of: int = 1,
    ) -> None:
        self.order = order
        self.pad_to_multiple_of = pad_to_multiple_of
        self.bin_offsets = bin_offsets
        self.lengths = lengths
        self.capacity = capacity
        self.strategy = strategy
        self.vision = vision
        self.vision_capacity = vision_capacity
        self.max_samples_per_bin = max_samples_per_bin
        self.unpacked = unpacked if unpacked is not None else []
        self.truncated = truncated if truncated is not None else {}
        if bin_lengths is None:
            bin_lengths = _segment_sums(lengths[order], bin_offsets)
        if bin_vision is None and vision is not None:
            bin_vision = _segment_sums(vision[order], bin_offsets)
        self.bin_lengths = bin_lengths
        self.bin_vision = bin_vision
        self._bins: list[list[int]] | None = None
        self._sample_bin: np.ndarray | None = None

    @property
    def num_bins(self) -> int:
        return int(self.bin_offsets.size - 1)

    def __len__(self) -> int:
        return self.num_bins

    @property
    def num_samples(self) -> int:
        """Samples given to :func:`pack` (packed + unpacked)."""
        return int(self.lengths.size)

    @property
    def bin_sizes(self) -> np.ndarray:
        """int64 ``[num_bins]``: samples per bin."""
        return np.diff(self.bin_offsets)

    @property
    def total_tokens(self) -> int:
        return int(self.bin_lengths.sum())

    @property
    def efficiency(self) -> float:
        """Packed tokens / (num_bins * capacity); 0.0 when there are no bins."""
        return self.total_tokens / (self.num_bins * self.capacity) if self.num_bins else 0.0

    @property
    def lower_bound(self) -> int:
        """No packing of the packed samples can use fewer bins than this.

        ``ceil(sum(lengths) / capacity)``, and likewise for the vision budget and ``max_samples_per_bin``
        when given (the largest of these).
        """
        lb = -(-self.total_tokens // self.capacity)
        if self.bin_vision is not None and self.vision_capacity:
            lb = max(lb, -(-int(self.bin_vision.sum()) // self.vision_capacity))
        if self.max_samples_per_bin:
            lb = max(lb, -(-int(self.order.size) // self.max_samples_per_bin))
        return int(lb)

    def bin(self, i: int) -> np.ndarray:
        """Sample indices of bin ``i`` (an int64 view into :attr:`order`)."""
        i = operator.index(i)
        if not -self.num_bins <= i < self.num_bins:
            raise IndexError(f"bin {i} out of range for {self.num_bins} bins")
        i %= self.num_bins
        return self.order[self.bin_offsets[i] : self.bin_offsets[i + 1]]

    @property
    def bins(self) -> list[list[int]]:
        """Bins as lists of sample indices (built on first access, then cached)."""
        if self._bins is None:
            flat = self.order.tolist()
            offs = self.bin_offsets.tolist()
            self._bins = [flat[a:b] for a, b in itertools.pairwise(offs)]
        return self._bins

    @property
    def sample_bin(self) -> np.ndarray:
        """int64 ``[num_samples]``: the bin of each sample, -1 for unpacked samples."""
        if self._sample_bin is None:
            sb = np.full(self.num_samples, -1, dtype=np.int64)
            sb[self.order] = np.repeat(np.arange(self.num_bins, dtype=np.int64), self.bin_sizes)
            self._sample_bin = sb
        return self._sample_bin

    def __repr__(self) -> str:
        return (
            f"PackResult(strategy={self.strategy!r}, num_bins={self.num_bins}, lower_bound={self.lower_bound}, "
            f"capacity={self.capacity}, efficiency={self.efficiency:.4f}, packed={self.order.size}, "
            f"unpacked={len(self.unpacked)}, truncated={len(self.truncated)})"
        )


def _segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values[offsets[i]:offsets[i+1]]`` per segment; segments are non-empty. Shapes [N], [B+1] -> [B]."""
    if offsets.size <= 1:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(values, offsets[:-1]).astype(np.int64, copy=False)


@dataclass(slots=True, repr=False)
class PackedBin:
    """One bin from a :class:`StreamPacker`: the samples' keys and lengths in placement order, and totals.

    ``visions`` / ``vision_total`` are the per-sample vision costs and their sum when the packer has
    a ``vision_capacity`` (else None / 0). Two bins are equal when they hold the same samples and totals.
    """

    keys: list[Any]
    lengths: list[int]
    total: int
    visions: list[int] | None = None
    vision_total: int = 0
    # clock of the last placement (best-fit tie-break while open): bookkeeping, not part of the bin
    _mtime: int = field(default=0, compare=False)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        v = "" if self.visions is None else f", visions={self.visions}, vision_total={self.vision_total}"
        return f"PackedBin(keys={self.keys}, lengths={self.lengths}, total={self.total}{v})"
