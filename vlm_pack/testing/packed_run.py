"""The packed side of ``check_packed_equivalence``: each sample found where the packed batch's boundaries
put it (tokens and labels intact, none missing or doubled), the model's token mixers checked, then the
packed forward's next-token log-probs::

    batch.input_ids  (R, T)   row 0  a0 a1 a2 a3 b0 b1 b2 c0 c1 .
    cu_seqlens_padded          0           4        7     9        -> spans (sample, row, offset, length)
    packed_forward(model, batch) -> logits (R, T, V) -> log-probs (R, T)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..collate.labels import IGNORE_INDEX
from ..forward.mixers import TokenMixer, find_token_mixers, mixer_problems
from .metric import next_token_logprobs


def _tensor(batch: Any, name: str) -> torch.Tensor:
    value = getattr(batch, name, None)
    if value is None and isinstance(batch, dict):
        value = batch.get(name)
    if value is None:
        raise TypeError(f"the packed batch has no {name!r}: pass a vlm_pack PackedBatch (collator output)")
    return torch.as_tensor(value)


def _packed_spans(batch: Any, num_samples: int) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """Where each original sample sits in the packed batch: (sample, row, offset, length) and problems."""
    input_ids = _tensor(batch, "input_ids")
    row_len = input_ids.shape[-1]
    starts = _tensor(batch, "cu_seqlens_padded")[:-1].tolist()
    lengths = _tensor(batch, "seq_lens").tolist()
    order = _tensor(batch, "sample_index").tolist()
    spans = [(int(i), s // row_len, s % row_len, int(n)) for i, s, n in zip(order, starts, lengths)]
    problems = []
    seen = [span[0] for span in spans]
    missing = sorted(set(range(num_samples)) - set(seen))
    if missing:
        problems.append(
            f"sample(s) {missing[:10]} are not in the packed batch (the collator dropped them: raise its "
            "capacity or give fewer samples)"
        )
    dupes = sorted({i for i in seen if seen.count(i) > 1})
    if dupes:
        problems.append(f"sample(s) {dupes[:10]} appear more than once in the packed batch")
    extra = sorted({i for i in seen if not 0 <= i < num_samples})
    if extra:
        problems.append(
            f"the packed batch holds sample index(es) {extra[:10]} but only {num_samples} samples were given: "
            "pass the same samples to the collator and to the harness"
        )
    return spans, problems


def _placement_problems(
    spans: list[tuple[int, int, int, int]],
    samples: list[dict[str, Any]],
    packed_ids: torch.Tensor,
    packed_labels: torch.Tensor | None,
) -> list[str]:
    """Samples whose tokens (or labels) are not where the batch's boundaries put them."""
    problems = []
    for i, row, off, length in spans:
        if not 0 <= i < len(samples):
            continue
        want = samples[i]["input_ids"]
        got = packed_ids[row, off : off + length]
        if length != len(want) or not torch.equal(got.cpu(), want.cpu()):
            problems.append(
                f"sample {i}: the tokens at row {row} offset {off} (length {length}) are not the "
                f"sample's {len(want)} input_ids"
            )
        elif packed_labels is not None and "labels" in samples[i]:
            # HF convention: the sample's own labels, its first position -100 (the previous sample's
            # last token must not learn to predict it).
            want_labels = samples[i]["labels"].clone()
            want_labels[0] = IGNORE_INDEX
            if not torch.equal(packed_labels[row, off : off + length].cpu(), want_labels.cpu()):
                problems.append(
                    f"sample {i}: packed labels differ from the sample's labels (with -100 at its first token)"
                )
    return problems


def _collate(collator: Callable[[Sequence[Any]], Any], given: list[Any]) -> Any:
    # A PackingCollator built with return_style= returns model kwargs; the check needs the PackedBatch.
    batch = getattr(collator, "collate", collator)(given)
    if isinstance(batch, dict):
        raise TypeError(
            "the collator returned a dict of model inputs; check_packed_equivalence needs the PackedBatch "
            "(a vlm_pack PackingCollator, or pass packed_batch=)"
        )
    return batch


def _packed_batch(
    collator: Callable[[Sequence[Any]], Any] | None, given: list[Any], packed_batch: Any, device: torch.device | str
) -> Any:
    """The batch under test on ``device``: ``packed_batch`` when given, else what ``collator`` makes of ``given``."""
    batch = _collate(collator, given) if packed_batch is None else packed_batch
    return batch.to(device) if hasattr(batch, "to") and not isinstance(batch, dict) else batch


def _packed_logprobs(
    model: Any, batch: Any, packed_forward: Callable[[Any, Any], torch.Tensor], packed_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs (R, T) of the packed forward, and the packed ids on the logits' device."""
    logits = packed_forward(model, batch)
    if logits.shape[:-1] != packed_ids.shape:
        raise ValueError(
            f"packed_forward returned logits {tuple(logits.shape)} for input_ids {tuple(packed_ids.shape)}; "
            "it must return (R, T, V) aligned with batch.input_ids"
        )
    packed_ids = packed_ids.to(logits.device)
    return next_token_logprobs(logits, packed_ids), packed_ids


@dataclass
class _Packed:
    """The packed side of the check: next-token log-probs (R, T) and ids (R, T) on the logits' device, the
    labels (R, T) when ``targets="labels"``, where each sample lies, what is wrong with the batch or the
    model's token mixers, and those mixers."""

    logp: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor | None
    spans: list[tuple[int, int, int, int]]
    problems: list[str]
    mixers: list[TokenMixer]


def _run_packed(
    model: Any,
    batch: Any,
    packed_forward: Callable[[Any, Any], torch.Tensor],
    samples: list[dict[str, Any]],
    targets: str,
) -> _Packed:
    """Find every sample in the packed ``batch`` (placement checked before the forward), then run it."""
    packed_ids = _tensor(batch, "input_ids")
    packed_labels = _tensor(batch, "labels") if targets == "labels" or hasattr(batch, "labels") else None
    spans, problems = _packed_spans(batch, len(samples))
    mixers = find_token_mixers(model) if isinstance(model, torch.nn.Module) else []
    problems += mixer_problems(model, mixers)
    problems += _placement_problems(spans, samples, packed_ids, packed_labels)
    logp, packed_ids = _packed_logprobs(model, batch, packed_forward, packed_ids)
    labels = packed_labels.to(logp.device) if targets == "labels" else None
    return _Packed(logp, packed_ids, labels, spans, problems, mixers)
