"""Where the samples of one call go: which row each sample lands in, and the offsets of the flat ``R*T`` buffer.

``one_row`` lays one planned bin out as one row, in the order given (what every pipeline does: a plan's bin
per call); ``repack`` groups a list of samples into as few rows as a strategy finds (in-batch packing, a
``DataLoader`` of plain batches). ``row_plan`` turns either into a :class:`RowPlan`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["RowPlan", "one_row", "repack", "row_plan"]


@dataclass
class RowPlan:
    """Where the packed samples go: packed order, rows, and the offsets of the flat buffer (int64).

    ``lens`` ``[N]`` real lengths in the layout's own space, ``cu_real`` ``[N + 1]`` their cumulative sum,
    ``cu_padded`` ``[N + 1]`` sample offsets in the flat ``R*T`` buffer (collapsed: its collapsed length).
    """

    order: list[int]
    row_of: list[int]
    num_rows: int
    row_length: int
    lens: torch.Tensor
    cu_real: torch.Tensor
    cu_padded: torch.Tensor

    @property
    def total(self) -> int:
        return int(self.cu_padded[-1])

    @functools.cached_property
    def dest(self) -> torch.Tensor:
        """Destination of every real token in the flat buffer: its sample's offset plus its index inside."""
        return torch.arange(int(self.cu_real[-1])) + torch.repeat_interleave(
            self.cu_padded[:-1] - self.cu_real[:-1], self.lens
        )

    def scatter(self, parts: list[torch.Tensor], fill: int) -> torch.Tensor:
        """Per-sample ``[L_i]`` tensors in packed order -> the flat buffer ``[total]``, ``fill`` elsewhere."""
        cat = torch.cat(parts)
        flat = torch.full((self.total,), fill, dtype=cat.dtype)
        flat[self.dest] = cat
        return flat


def one_row(padded: list[int], capacity: int, max_samples_per_bin: int | None) -> list[list[int]] | None:
    """One bin as one row, its samples in the order given; None when they fit no single row of ``capacity``
    tokens (``padded``: each sample's span) and ``max_samples_per_bin`` samples."""
    if sum(padded) > capacity or (max_samples_per_bin is not None and len(padded) > max_samples_per_bin):
        return None
    return [list(range(len(padded)))]


def repack(
    padded: list[int], capacity: int, strategy: str, max_samples_per_bin: int | None
) -> list[list[int]]:
    """The samples (``padded``: each one's span, each at most ``capacity``) grouped into rows by ``strategy``
    (``vlm_pack.packing.pack``): inside a row samples keep their input order and rows are sorted by their
    first sample, so the layout is reproducible and easy to read."""
    from ..packing import pack

    result = pack(padded, capacity, strategy=strategy, max_samples_per_bin=max_samples_per_bin)
    return sorted((sorted(b) for b in result.bins), key=lambda b: b[0])


def row_plan(
    rows: list[list[int]], padded: list[int], expanded: list[int], lens: list[int], row_length: int | None
) -> RowPlan:
    """The flat buffer of ``rows`` (sample indices per row): every sample spans ``padded[i]`` expanded tokens
    (its ``expanded[i]`` plus padding), the row's last sample also the row's tail up to ``row_length`` (None:
    the fullest row's length); ``lens[i]`` is its real length in the layout's own space (collapsed: fewer).
    """
    order = [i for row in rows for i in row]
    used = [sum(padded[i] for i in row) for row in rows]
    row_length = max(used) if row_length is None else row_length
    # Expanded spans: the padded length, plus the row's tail for its last sample.
    exp_span = torch.tensor([padded[i] for i in order], dtype=torch.int64)
    last_in_row = torch.cumsum(torch.tensor([len(row) for row in rows], dtype=torch.int64), 0) - 1
    exp_span[last_in_row] += torch.tensor([row_length - u for u in used], dtype=torch.int64)
    pad_count = exp_span - torch.tensor([expanded[i] for i in order], dtype=torch.int64)
    real = torch.tensor([lens[i] for i in order], dtype=torch.int64)
    span = real + pad_count  # padding is text, the same count in both layouts
    return RowPlan(
        order=order,
        row_of=[r for r, row in enumerate(rows) for _ in row],
        num_rows=len(rows),
        row_length=row_length,
        lens=real,
        cu_real=F.pad(torch.cumsum(real, 0), (1, 0)),
        cu_padded=F.pad(torch.cumsum(span, 0), (1, 0)),
    )
