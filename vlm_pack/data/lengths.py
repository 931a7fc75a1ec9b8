"""A :class:`~vlm_pack.data.forecast.LengthTable` as one parquet file: written once by whichever engine
forecast it (``forecast_sources``' processes, ``vlm_pack.integrations.ray``), read back exactly.

One row per forecast sample, in source order::

    column          type          what
    row             int64         ordinal among all records read, invalid ones included (LengthTable.index)
    key, source     string        the sample's key and where it was read
    text_tokens     int64         tokens that are not image or video placeholders
    vision_tokens   int64         image placeholder tokens (sum over the sample's images)
    video_tokens    int64         video placeholder tokens (sum over the sample's videos)
    num_videos      int64         videos of the sample
    length          int64         text_tokens + vision_tokens + video_tokens: the processed length
    num_patches     int64         vision-encoder patches (images and videos)
    image_tokens    list<int64>   placeholders of each image
    image_starts    list<int64>   where each image's block starts inside the sample
    video_groups    list<int64>   temporal groups t of each video's grid (0: a family without one)
    video_group_patches list<int64> encoder patches h * w of one group of each video

The samples that could not be forecast (``LengthTable.invalid``, with their reason codes) ride in the
schema's metadata (``vlm_pack`` key, JSON). Needs ``pyarrow`` (``pip install 'vlm-pack[hf]'``).
"""

from __future__ import annotations

import json
import os
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from .forecast import LengthTable
from .strings import Strings

__all__ = ["read_lengths", "write_lengths"]

# 2: video_tokens and num_videos (a format-1 table, written before videos, reads as none); 3: each video's
# grid, video_groups and video_group_patches (a format-2 table reads with them None: videos costed as before)
LENGTHS_FORMAT = 3
_READS = (1, 2, 3)
_META = b"vlm_pack"


def write_lengths(table: LengthTable, path: str | os.PathLike[str]) -> Path:
    """Write ``table`` to ``path`` (parquet; written next to it and renamed into place). Returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if table.index is None:
        raise ValueError(
            "write_lengths: this LengthTable has no row ids (index is None); forecast it with "
            "forecast_sources or vlm_pack.integrations.ray.forecast_ray."
        )
    ptr = np.asarray(table.image_ptr, dtype=np.int64)
    if ptr[-1] >= 2**31:
        ptr_type = pa.int64()
        make = pa.LargeListArray.from_arrays
    else:
        ptr_type = pa.int32()
        make = pa.ListArray.from_arrays
    offsets = pa.array(ptr, ptr_type)
    columns = {
        "row": pa.array(np.asarray(table.index, dtype=np.int64)),
        "key": _arrow_strings(table.keys),
        "source": _arrow_strings(table.sources),
        "text_tokens": pa.array(table.text_tokens, pa.int64()),
        "vision_tokens": pa.array(table.vision_tokens, pa.int64()),
        "video_tokens": pa.array(_or_zeros(table.video_tokens, len(table)), pa.int64()),
        "num_videos": pa.array(_or_zeros(table.num_videos, len(table)), pa.int64()),
        "length": pa.array(table.lengths, pa.int64()),
        "num_patches": pa.array(table.num_patches, pa.int64()),
        "image_tokens": make(offsets, pa.array(table.image_tokens, pa.int64())),
        "image_starts": make(offsets, pa.array(table.image_starts, pa.int64())),
    }
    if table.video_groups is not None and table.video_group_patches is not None:
        vptr = pa.array(np.concatenate([[0], np.cumsum(_or_zeros(table.num_videos, len(table)))]), pa.int64())
        for name in ("video_groups", "video_group_patches"):
            columns[name] = pa.LargeListArray.from_arrays(vptr, pa.array(getattr(table, name), pa.int64()))
    meta = {
        "format": LENGTHS_FORMAT,
        "invalid": [list(item) for item in table.invalid],
        "invalid_reasons": list(table.invalid_reasons),
    }
    arrow = pa.table(columns).replace_schema_metadata({_META: json.dumps(meta).encode()})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(arrow, tmp)
    os.replace(tmp, path)
    return path


def _or_zeros(values: np.ndarray | None, n: int) -> np.ndarray:
    return np.zeros(n, np.int64) if values is None else np.asarray(values, np.int64)


def _arrow_strings(strings: Strings, piece: int = 1 << 20) -> Any:
    """A :class:`Strings` as an Arrow string column, built a piece at a time (never one str per item at once)."""
    import pyarrow as pa

    items = iter(strings)  # one pass: a slice of a Strings would be front-coded again only to be decoded
    pieces = [pa.array(list(islice(items, piece)), pa.string()) for _ in range(0, len(strings), piece)]
    return pa.chunked_array(pieces, pa.string())


def _strings(column: Any, piece: int = 1 << 20) -> Strings:
    """An Arrow string column as :class:`Strings`, read a piece at a time."""
    if column.null_count:
        raise ValueError("a lengths table's key and source columns may not hold nulls")
    return Strings.concat(column.slice(i, piece).to_pylist() for i in range(0, len(column), piece))


def read_lengths(path: str | os.PathLike[str]) -> LengthTable:
    """The :class:`LengthTable` :func:`write_lengths` wrote to ``path``, equal array for array."""
    import pyarrow.parquet as pq

    arrow = pq.read_table(path)
    raw = (arrow.schema.metadata or {}).get(_META)
    if raw is None:
        raise ValueError(
            f"{path}: not a vlm-pack lengths table (no {_META.decode()!r} schema metadata); write it with "
            "vlm_pack.data.lengths.write_lengths or `vlm-pack analyze ... --lengths FILE.parquet`."
        )
    meta = json.loads(raw)
    if meta.get("format") not in _READS:
        raise ValueError(
            f"{path}: lengths table format {meta.get('format')!r}, this vlm-pack reads {LENGTHS_FORMAT}; "
            "forecast the data again."
        )
    i64 = lambda name: arrow.column(name).to_numpy().astype(np.int64, copy=False)  # noqa: E731
    tokens = arrow.column("image_tokens").combine_chunks()
    offsets = tokens.offsets.to_numpy().astype(np.int64)
    return LengthTable(
        keys=_strings(arrow.column("key")),
        sources=_strings(arrow.column("source")),
        text_tokens=i64("text_tokens"),
        vision_tokens=i64("vision_tokens"),
        num_patches=i64("num_patches"),
        image_ptr=offsets - offsets[0],
        image_tokens=tokens.flatten().to_numpy().astype(np.int64, copy=False),
        image_starts=arrow.column("image_starts").combine_chunks().flatten().to_numpy().astype(np.int64),
        invalid=[tuple(item) for item in meta["invalid"]],
        index=i64("row"),
        invalid_reasons=list(meta["invalid_reasons"]),
        num_videos=i64("num_videos") if "num_videos" in arrow.column_names else None,
        video_tokens=i64("video_tokens") if "video_tokens" in arrow.column_names else None,
        video_groups=_flat(arrow, "video_groups"),
        video_group_patches=_flat(arrow, "video_group_patches"),
    )


def _flat(arrow: Any, name: str) -> np.ndarray | None:
    """A list column's values end to end (int64), or None where the table has no such column."""
    if name not in arrow.column_names:
        return None
    return arrow.column(name).combine_chunks().flatten().to_numpy().astype(np.int64)
