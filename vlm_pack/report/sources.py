"""Reading for the analysis: any source -> :class:`SampleInfo` (image sizes from headers only).

A thin view of ``vlm_pack.data.sources`` (one reader and one record normaliser for every source: datasets,
parquet, LLaVA / ShareGPT JSON, JSONL, WebDataset), kept for callers that iterate samples themselves; the
CLI forecasts with ``vlm_pack.data.forecast.forecast_sources``, which runs the same steps in parallel.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SampleReadError(ValueError):
    """One sample could not be read or forecast (its message names the shard or manifest line and the key).

    Raised under ``on_error="raise"``; with ``on_error="skip"`` the sample is listed instead.
    """


@dataclass(frozen=True)
class SampleInfo:
    """One sample as the forecaster needs it: no pixels, just sizes.

    ``image_sizes`` are ``(width, height)`` as the processor will see them (EXIF orientation applied unless
    scanning with ``exif_transpose=False``), in placeholder order. ``source`` says where the sample lives
    (``shard.tar``, ``manifest.jsonl:LINE``, ``train.parquet:ROW``, ``llava.json[INDEX]``) for error
    messages and pack plans.
    """

    key: str
    source: str
    conversation: Any
    image_sizes: tuple[tuple[int, int], ...]
    error: str | None = None  # set (and nothing else usable) for an unreadable sample under on_error="skip"


def expand_sources(sources: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files (and ``save_to_disk`` folders) named by ``sources``: files, directories, globs and
    WebDataset brace ranges (``shard-{000..009}.tar``); see ``vlm_pack.data.sources.open_sources``.

    Raises ``ValueError`` naming the argument when it matches nothing or is no source.
    """
    from vlm_pack.data.sources import open_sources

    return [Path(source.name) for source in open_sources(list(sources))]


def scan_samples(
    sources: Any,
    *,
    exif_transpose: bool = True,
    image_root: str | os.PathLike[str] | None = None,
    on_error: str = "raise",
    verify: bool = False,
    layout: str | None = None,
) -> Iterator[SampleInfo]:
    """Yield every sample of ``sources`` with its image sizes read from headers, in this process.

    Sources: WebDataset shards, JSONL / JSON files (vlm-pack's manifest, LLaVA-Instruct, ShareGPT,
    LLaMA-Factory), parquet files, ``save_to_disk`` folders, ``datasets`` objects (see
    ``vlm_pack.data.sources``); record layouts per ``vlm_pack.data.records`` (``layout`` forces one).
    Relative image paths resolve against the file's folder, or ``image_root``.

    Header-only (default): the text parses, every placeholder has an image, and each image's header gives
    a format and a size. ``verify=True`` also decodes every image's pixels with Pillow, which catches a file
    cut short after its header (reads every image byte: much slower).

    Raises :class:`SampleReadError` (a ``ValueError``) naming where the sample lives and its key for an
    unreadable sample; with ``on_error="skip"`` such a sample is yielded with only ``key``, ``source`` and
    ``error`` set. An unreadable file always raises.
    """
    from vlm_pack.data.forecast import image_sizes
    from vlm_pack.data.shards import SampleError
    from vlm_pack.data.sources import iter_samples

    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    for where, key, sample in iter_samples(sources, layout=layout, image_root=image_root, on_error="skip"):
        try:
            if isinstance(sample, SampleError):
                raise sample
            sizes = image_sizes(sample, exif_transpose=exif_transpose, verify=verify)
        except SampleError as e:
            if on_error == "raise":
                raise SampleReadError(str(e)) from None
            yield SampleInfo(key if isinstance(sample, SampleError) else sample.key, where, None, (), str(e))
            continue
        yield SampleInfo(sample.key, sample.where, sample.conversation, tuple(sizes))
