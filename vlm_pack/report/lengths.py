"""Forecast: :class:`SampleInfo` -> :class:`LengthTable` (text tokens, vision tokens, where each image sits)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

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

    from vlm_pack.processing import _image_token_id, tokenize_conversation

    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    family = family or getattr(tokenizer, "vlm_pack_family", None) or spec.family
    image_id = _image_token_id(tokenizer, family)
    keys: list[str] = []
    sources: list[str] = []
    text: list[int] = []
    patches: list[int] = []
    counts: list[int] = []
    starts: list[int] = []
    ptr = [0]
    invalid: list[tuple[str, str, str]] = []
    bar = tqdm(
        samples, desc="forecast", unit=" samples", disable=(not progress) if progress is not None else None
    )
    for s in bar:
        if s.error is not None:
            if on_error == "raise":
                raise SampleReadError(s.error)
            invalid.append((s.key, s.source, s.error))
            continue
        try:
            ids, _ = tokenize_conversation(
                s.conversation, tokenizer=tokenizer, family=family, num_images=len(s.image_sizes), key=s.key
            )
            n = [int(t) for t in spec.sample_tokens(list(s.image_sizes))] if s.image_sizes else []
            p = sum(int(spec.num_patches(w, h)) for w, h in s.image_sizes)
        except (ValueError, TypeError) as e:
            if on_error == "raise":
                msg = str(e) if s.key in str(e) else f"sample {s.key!r}: {e}"
                raise SampleReadError(f"{s.source}: {msg}") from None
            invalid.append((s.key, s.source, str(e)))
            continue
        # Collapsed placeholder positions -> expanded starts: shift by the earlier images' extra tokens.
        pos = np.flatnonzero(np.asarray(ids) == image_id)
        if n:
            extra = np.concatenate([[0], np.cumsum(np.asarray(n) - 1)[:-1]])
            starts.extend((pos + extra).tolist())
        counts.extend(n)
        keys.append(s.key)
        sources.append(s.source)
        text.append(len(ids) - len(n))
        patches.append(p)
        ptr.append(len(counts))
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    ptr_a, counts_a = i64(ptr), i64(counts)
    csum = np.concatenate([[0], np.cumsum(counts_a)])
    vision = csum[ptr_a[1:]] - csum[ptr_a[:-1]]  # per-sample sums; samples without images get 0
    return LengthTable(
        keys, sources, i64(text), vision.astype(np.int64), i64(patches), ptr_a, counts_a, i64(starts), invalid
    )
