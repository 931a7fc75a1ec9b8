"""One failure policy for every path that reads samples: bad data is counted and skipped, a bug raises.

Every stage that can meet a bad sample (reading a record, the header-only forecast, decoding and
processing the packed samples; streaming, map-style and forecast alike) hands the exception to
:func:`skip_reason`, which decides by the exception's *type*, never by its message::

    an exception while reading, forecasting or processing one sample
     ├─ an error of the data: counted under its reason, warned about, the sample skipped
     │    SampleError(reason, ...)    vlm-pack's checks: a malformed record, a missing or bad text, an
     │                                image that does not decode (ImageDecodeError), a sample too long
     │    ValueError                  a value another library's code refuses: an HF processor refusing
     │                                an input, a template callable refusing a sample on purpose
     │    jinja2 TemplateError        the chat template's raise_exception() (a syntax error is code)
     │    PIL UnidentifiedImageError, DecompressionBombError
     └─ an error of code: SampleCodeError naming the sample, raised from the original exception
          AttributeError, TypeError, NameError, KeyError, IndexError, RuntimeError, ...: a chat template
          or callable that raises them, or a bug in vlm-pack. Skipping it would skip every sample.
          InternalCheckError: a ValueError of vlm-pack's own checks of its parts, settings or state (a
          tokenizer that splits the image placeholder, patch rows that disagree with their grids).

A systematic failure stops the run instead of becoming an empty epoch (:class:`FailureBudget`, one per
stage, as Megatron-Energon's failure tolerance): more than ``PackingConfig.max_consecutive_failures`` bad
samples in a row, or an epoch in which no sample was good (:func:`no_good_sample`), raise
:class:`FailureBudgetError` naming the most common reason and one sample of each reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BAD_REASONS",
    "REASONS",
    "FailureBudget",
    "FailureBudgetError",
    "ImageDecodeError",
    "InternalCheckError",
    "SampleCodeError",
    "SampleError",
    "describe_failures",
    "example",
    "no_good_sample",
    "skip_reason",
    "tally",
]

#: Why a sample (or a shard) was skipped: the reasons bad data is counted under.
REASONS: dict[str, str] = {
    "unreadable_shard": "a shard that cannot be opened or read to its end (counted, not a sample)",
    "missing_text": "a record without a text it can be read from (it fits no record format)",
    "bad_text": "a text that does not parse, or that the chat template refuses",
    "corrupt_image": "an image whose header does not read, or that is missing",
    "image_too_large": "an image whose header declares more than max_image_pixels (not decoded)",
    "placeholder_mismatch": "the text's image places differ from the sample's images",
    "image_rejected": "an image the processor's size rule refuses",
    "too_long": "a sample longer than capacity (oversized='skip')",
    "vision_too_large": "a sample with more vision cost than vision_capacity",
    "decode_error": "pixels that do not decode, or a processor that refuses the sample",
    "forecast_mismatch": "a processed length that differs from the forecast the plan was made on",
}
BAD_REASONS = tuple(REASONS)

_MAX_DETAIL = 300  # characters of an exception message quoted in a budget error


class SampleError(ValueError):
    """Bad data in one sample, with ``reason`` (one of :data:`REASONS`) for counting it.

    A ``ValueError`` (so ``except ValueError`` still catches it); the reason lets callers count bad samples
    by cause without matching message text. The message names the sample.
    """

    default_reason = "bad_text"

    def __init__(self, reason: str, message: str | None = None) -> None:
        if message is None:  # the message alone: how torch's DataLoader re-raises a worker's exception
            reason, message = self.default_reason, reason
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across DataLoader workers and process pools
        return (type(self), (self.reason, str(self)))


class ImageDecodeError(SampleError, OSError):
    """An image whose pixels do not decode (reason ``"decode_error"``); an ``OSError`` too, as Pillow's."""

    default_reason = "decode_error"


class InternalCheckError(ValueError):
    """One of vlm-pack's own checks of its parts, settings or state failed while processing a sample: a
    tokenizer that splits the image placeholder, an image processor the family cannot take, patch rows that
    disagree with their grids. An error of code (every sample would fail it): :func:`skip_reason` raises
    :class:`SampleCodeError` for it and never counts it as bad data. A ``ValueError``, as before, so
    ``except ValueError`` still catches it."""


class SampleCodeError(RuntimeError):
    """A sample met an error of code (a chat template or callable that raises, a bug in vlm-pack).

    Raised from the original exception (``__cause__``), naming the sample; ``key`` is its key where known.
    Never skipped: an error of code would skip every sample.
    """

    def __init__(self, message: str, key: Any = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.key))


class FailureBudgetError(RuntimeError):
    """Samples fail systematically: too many in a row, or none of an epoch was good (see the message)."""


def _data_types() -> tuple[type[BaseException], ...]:
    from jinja2 import TemplateError
    from PIL import Image, UnidentifiedImageError

    return (ValueError, TemplateError, UnidentifiedImageError, Image.DecompressionBombError)


def _is_data_error(exc: BaseException) -> bool:
    from jinja2 import TemplateSyntaxError

    if isinstance(exc, (SampleCodeError, FailureBudgetError, TemplateSyntaxError, InternalCheckError)):
        return False  # a template that does not compile, or a check of vlm-pack's parts: fails every sample
    return isinstance(exc, _data_types())


def skip_reason(exc: BaseException, default: str, sample: str, key: Any = None) -> str:
    """The reason to count ``exc`` under when it is an error of the data; else raise.

    Args:
        exc: what reading, forecasting or processing the sample raised.
        default: the reason of a data error that carries none (a plain ``ValueError``): the stage's.
        sample: how messages name the sample (``"key 'k' in shard.tar"``, ``"dataset[3] (key 'k')"``).
        key: the sample's key, kept on a :class:`SampleCodeError`.

    Raises:
        SampleCodeError: from ``exc``, for an error of code (see the module docstring).
        FailureBudgetError, SampleCodeError: ``exc`` itself, unchanged.
    """
    if isinstance(exc, (SampleCodeError, FailureBudgetError)):
        raise exc
    if isinstance(exc, SampleError):
        return exc.reason
    if _is_data_error(exc):
        return default
    raise SampleCodeError(
        f"{sample}: {type(exc).__name__}: {exc}\n  This is an error of code (a chat template or callable "
        "given to vlm-pack, or vlm-pack itself), not of the data, so it is raised instead of skipping the "
        "sample: every sample would hit it. The original traceback is above.",
        key,
    ) from exc


def describe_failures(counts: Mapping[str, int], examples: Mapping[str, str]) -> str:
    """``"most common reason: decode_error (95 of 101); one sample of each reason: decode_error: ..."``."""
    total = sum(counts.values())
    ordered = sorted(counts, key=lambda reason: (-counts[reason], reason))
    if not ordered:
        return "no reason recorded"
    shown = "; ".join(f"{reason} ({counts[reason]}): {examples.get(reason, 'no example kept')}" for reason in ordered)
    return f"most common reason: {ordered[0]} ({counts[ordered[0]]} of {total}); one sample of each reason: {shown}"


_HINT = (
    "This is systematic (every image unreadable, a processor, template or setting that refuses every "
    "sample, a wrong path), not a few bad samples: fix what the samples above show."
)


def no_good_sample(what: str, counts: Mapping[str, int], examples: Mapping[str, str]) -> FailureBudgetError:
    """The error of an epoch (or a pack, a plan) in which no sample was good: ``counts`` per reason and an
    example sample per reason (:func:`describe_failures`)."""
    return FailureBudgetError(
        f"{what}: no sample was good, all {sum(counts.values())} were skipped as bad; "
        f"{describe_failures(counts, examples)}.\n  {_HINT}"
    )


def tally(failures: Iterable[tuple[str, str]]) -> tuple[dict[str, int], dict[str, str]]:
    """``(reason, example)`` pairs, in order -> counts per reason and the first example of each reason."""
    counts: dict[str, int] = {}
    examples: dict[str, str] = {}
    for reason, quoted in failures:
        counts[reason] = counts.get(reason, 0) + 1
        examples.setdefault(reason, quoted)
    return counts, examples


def example(sample: str, detail: str) -> str:
    """How a failure budget quotes one bad sample: its name and the start of what was wrong."""
    detail = " ".join(detail.split())
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    return f"{sample} ({detail})"


@dataclass
class FailureBudget:
    """Consecutive bad samples of one stage; :meth:`failure` raises once more than ``limit`` are in a row.

    One per stage (the forecast, the processing of packed samples), as each sees samples in its own
    order: a good forecast resets the forecast's run, a processed sample the processing's. ``what`` names
    the stage in the message; ``limit`` None: no limit.
    """

    limit: int | None
    what: str
    streak: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def success(self) -> None:
        """A good sample: the run of bad ones ends."""
        if self.streak:
            self.streak = 0
            self.counts.clear()
            self.examples.clear()

    def failure(self, reason: str, sample: str, detail: str) -> None:
        """A bad sample (``sample`` names it, ``detail`` says what was wrong).

        Raises:
            FailureBudgetError: when more than ``limit`` bad samples came in a row.
        """
        self.streak += 1
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, example(sample, detail))
        if self.limit is not None and self.streak > self.limit:
            raise FailureBudgetError(
                f"{self.what}: {self.streak} bad samples in a row, more than "
                f"PackingConfig.max_consecutive_failures={self.limit}; "
                f"{describe_failures(self.counts, self.examples)}.\n  {_HINT} If such runs are expected, raise "
                "max_consecutive_failures (None: no limit)."
            )
