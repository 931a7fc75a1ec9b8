"""Forecast: :class:`SampleInfo` -> :class:`LengthTable` (text tokens, vision tokens, where each image sits)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..data.forecast import LengthTable
from .sources import SampleInfo, SampleReadError

__all__ = ["LengthTable", "forecast_lengths"]  # LengthTable lives with the forecast over sources


def forecast_lengths(
    samples: Iterable[SampleInfo],
    *,
    tokenizer: Any,
    spec: Any,
    family: str | None = None,
    on_error: str = "raise",
    progress: bool | None = None,
) -> LengthTable:
    """Tokenize each conversation and forecast its images' placeholders: a :class:`LengthTable`.

    For samples read by :func:`scan_samples`; ``vlm_pack.data.forecast.forecast_sources`` reads and
    forecasts any source in one go, in parallel processes.

    ``spec`` is a ``vlm_pack.vision`` spec; ``family`` picks the chat format (default: the tokenizer's
    ``vlm_pack_family``, else the spec's family). ``on_error="skip"`` records bad samples in
    ``LengthTable.invalid`` instead of raising. ``progress`` shows a tqdm bar (``None``: only on a terminal).
    """
    from tqdm import tqdm

    from vlm_pack.data.forecast import forecast_sized
    from vlm_pack.data.records import Sample
    from vlm_pack.data.shards import SampleError
    from vlm_pack.preprocessor import Preprocessor

    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    bar = tqdm(
        samples, desc="forecast", unit=" samples", disable=(not progress) if progress is not None else None
    )
    items = (
        (
            s.source,
            s.key,
            SampleError("unreadable", s.error)
            if s.error is not None
            else Sample(s.key, s.conversation, (), s.source),
            list(s.image_sizes),
        )
        for s in bar
    )
    pre = Preprocessor(tokenizer, family=family, spec=spec)
    try:
        return forecast_sized(items, pre, on_error=on_error)
    except SampleError as e:
        raise SampleReadError(str(e)) from None
