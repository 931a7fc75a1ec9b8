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

A systematic failure stops the run instead of becoming an empty epoch or a run on a sliver of the data
(:class:`FailureBudget`, one per stage, as Megatron-Energon's failure tolerance), raising
:class:`FailureBudgetError` naming the most common reason, one sample of each reason and, last, the most
common reason's fix (:data:`FIXES`):

- a run: more than ``PackingConfig.max_consecutive_failures`` bad samples in a row;
- a share: more than ``PackingConfig.max_bad_fraction`` of the samples the stage has seen were bad. The share
  is judged only once the stage has seen :data:`MIN_SEEN_FOR_FRACTION` samples (a few bad samples among the
  first ones say nothing of the data), then after every sample, and at the end of the stage's run
  (:meth:`Guard.finish`). Good samples between bad ones do not reset it: images missing under a forgotten
  ``image_root`` with text-only rows between them stop the run instead of packing 4% of the data;
- an epoch (a rank's share, a plan) in which no sample was good (:func:`no_good_sample`).

Every stage runs through one loop (webdataset's ``handler=`` is the model): a run declares its policy once,
``FailurePolicy.of(who, config, report)`` (``on_error``, the budget's limit and where a skipped sample is
reported), and each of its stages is a :class:`Guard` of it (``policy.stage("header-only forecast",
"bad_text")``) with its own budget, as each stage sees the samples in its own order::

    out = guard.call(fn, *args, sample="key 'k' in shard.tar", key="k")   # fn's result, or a Skip
    if isinstance(out, Skip): ...                                          # counted, warned, budget spent
    guard.good()                                                           # the sample passed the stage
    guard.bad(SampleError("too_long", detail), sample, key)               # a check of the caller's own

``on_error="raise"`` raises the first bad sample's error naming it (its class kept: an
:class:`ImageDecodeError` is still an ``OSError``). A stage whose failures come back as values (a process
pool's, a batched call's) classifies each with :func:`data_error` and hands it to :meth:`Guard.bad`.

A forecast that disagrees with the processed length (:func:`forecast_mismatch`) is bad data under its own
reason ``forecast_mismatch``: the sample cannot be packed as planned (a longer one would overflow its row, a
shorter one is not the pack the plan made), so it is left out, counted and warned about like any bad sample,
and raised under ``on_error="raise"``. It is never packed at a length other than its forecast. A mismatch on
every sample (a vision spec that does not match the processor: a vlm-pack bug) trips the failure budget
and stops the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BAD_REASONS",
    "FIXES",
    "MIN_SEEN_FOR_FRACTION",
    "REASONS",
    "Failure",
    "FailureBudget",
    "FailureBudgetError",
    "FailurePolicy",
    "Guard",
    "ImageDecodeError",
    "InternalCheckError",
    "SampleCodeError",
    "SampleError",
    "Skip",
    "data_error",
    "describe_failures",
    "example",
    "fix_line",
    "forecast_mismatch",
    "no_good_sample",
    "skip_reason",
    "tally",
]

#: Why a sample (or a shard) was skipped: the reasons bad data is counted under.
REASONS: dict[str, str] = {
    "unreadable_shard": "a shard that cannot be opened or read to its end (counted, not a sample)",
    "empty_shard": "a shard that holds no sample (counted, not a sample)",
    "missing_text": "a record without a text it can be read from (it fits no record format)",
    "bad_text": "a text that does not parse, or that the chat template refuses",
    "corrupt_image": "an image whose header does not read, or that is missing",
    "corrupt_video": "a video whose container does not open or read, or that is missing",
    "image_too_large": "an image whose header declares more than max_image_pixels (not decoded)",
    "placeholder_mismatch": "the text's image places differ from the sample's images",
    "image_rejected": "an image the processor's size rule refuses",
    "too_long": "a sample longer than capacity (oversized='skip')",
    "vision_too_large": "a sample with more vision cost than vision_capacity",
    "decode_error": "pixels that do not decode, or a processor that refuses the sample",
    "forecast_mismatch": "a processed length that differs from the forecast the plan was made on (left out)",
}
BAD_REASONS = tuple(REASONS)

#: What to do about each reason when it is systematic (the last line of a :class:`FailureBudgetError`, and
#: of ``vlm-pack``'s error).
FIXES: dict[str, str] = {
    "unreadable_shard": "check the shard paths and that every shard was written to its end",
    "empty_shard": "write the shard again, or leave it out of the shard list",
    "missing_text": "give the records a text field of one record format, or name it with record_format=",
    "bad_text": "check the text field's format, the chat template, and record_format= (--format)",
    "corrupt_image": "an image not found: relative image paths resolve against each source's folder, so give "
    "image_root= (--image-root) the folder the images are under; an image whose header does not read: "
    "re-encode or replace it",
    "corrupt_video": "check the video paths (image_root= / --image-root) and pip install 'vlm-pack[video]'",
    "image_too_large": "downscale such images, or raise max_image_pixels (--max-image-pixels; None: no cap)",
    "placeholder_mismatch": "make the text's image placeholders match the sample's images",
    "image_rejected": "check the image processor's size limits against the images",
    "too_long": "raise capacity (--capacity), or cap the image processor's max_pixels",
    "vision_too_large": "raise vision_capacity (--vision-capacity)",
    "decode_error": "re-encode or replace the images that do not decode; analyze --verify lists them",
    "forecast_mismatch": "rebuild the plan with the processor the run uses; if nothing changed, report it",
}

#: Samples a stage must have seen before the share of bad ones is judged (``max_bad_fraction``).
MIN_SEEN_FOR_FRACTION = 100

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


def fix_line(counts: Mapping[str, int]) -> str:
    """``"most common reason: corrupt_image (144 of 150 bad); fix: ..."``: the last line of a budget error."""
    if not counts:
        return ""
    reason = min(counts, key=lambda r: (-counts[r], r))
    fix = FIXES.get(reason, "fix what the samples above show")
    return f"most common reason: {reason} ({counts[reason]} of {sum(counts.values())} bad); fix: {fix}"


def no_good_sample(what: str, counts: Mapping[str, int], examples: Mapping[str, str]) -> FailureBudgetError:
    """The error of an epoch (or a pack, a plan) in which no sample was good: ``counts`` per reason and an
    example sample per reason (:func:`describe_failures`)."""
    return FailureBudgetError(
        f"{what}: no sample was good, all {sum(counts.values())} were skipped as bad; "
        f"{describe_failures(counts, examples)}.\n  {_HINT}\n  {fix_line(counts)}"
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
    """The bad samples of one stage: :meth:`failure` raises once more than ``limit`` are in a row, and
    :meth:`failure`, :meth:`success` or :meth:`finish` once more than ``max_bad_fraction`` of those seen are
    bad (judged from the :data:`MIN_SEEN_FOR_FRACTION`-th sample seen on; the module docstring).

    One per stage (the forecast, the processing of packed samples), as each sees samples in its own
    order: a good forecast resets the forecast's run, a processed sample the processing's (the share is never
    reset). ``what`` names the stage in the message; ``limit`` / ``max_bad_fraction`` None: no limit.
    """

    limit: int | None
    what: str
    max_bad_fraction: float | None = None
    streak: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    seen: int = 0  # samples the stage judged, good and bad
    totals: dict[str, int] = field(default_factory=dict)  # every bad sample, per reason (never reset)
    first: dict[str, str] = field(default_factory=dict)  # the first example of each reason (never reset)

    @property
    def bad(self) -> int:
        """Bad samples the stage has seen."""
        return sum(self.totals.values())

    def success(self) -> None:
        """A good sample: the run of bad ones ends.

        Raises:
            FailureBudgetError: when more than ``max_bad_fraction`` of the samples seen are bad.
        """
        self.seen += 1
        if self.streak:
            self.streak = 0
            self.counts.clear()
            self.examples.clear()
        if self.seen == MIN_SEEN_FOR_FRACTION:  # the share only falls on a good sample: judged once here
            self._judge()

    def failure(self, reason: str, sample: str, detail: str) -> None:
        """A bad sample (``sample`` names it, ``detail`` says what was wrong).

        Raises:
            FailureBudgetError: when more than ``limit`` bad samples came in a row, or more than
                ``max_bad_fraction`` of the samples seen are bad.
        """
        self.seen += 1
        self.streak += 1
        quoted = example(sample, detail)
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, quoted)
        self.totals[reason] = self.totals.get(reason, 0) + 1
        self.first.setdefault(reason, quoted)
        if self.limit is not None and self.streak > self.limit:
            raise FailureBudgetError(
                f"{self.what}: {self.streak} bad samples in a row, more than "
                f"PackingConfig.max_consecutive_failures={self.limit}; "
                f"{describe_failures(self.counts, self.examples)}.\n  {_HINT} If such runs are expected, raise "
                f"max_consecutive_failures (None: no limit).\n  {fix_line(self.counts)}"
            )
        self._judge()

    def finish(self) -> None:
        """The end of the stage's run: the share of bad samples over all it has seen.

        Raises:
            FailureBudgetError: when more than ``max_bad_fraction`` of them were bad.
        """
        self._judge()

    def _judge(self) -> None:
        fraction = self.max_bad_fraction
        if fraction is None or self.seen < MIN_SEEN_FOR_FRACTION or self.bad <= fraction * self.seen:
            return
        raise FailureBudgetError(
            f"{self.what}: {self.bad} of {self.seen} samples seen were bad ({self.bad / self.seen:.1%}), more "
            f"than PackingConfig.max_bad_fraction={fraction:g}; {describe_failures(self.totals, self.first)}.\n"
            f"  {_HINT} If so much bad data is expected, raise max_bad_fraction (--max-bad-fraction; None: no "
            f"limit).\n  {fix_line(self.totals)}"
        )


def data_error(exc: BaseException, default: str, sample: str, key: Any = None) -> SampleError:
    """``exc`` as the :class:`SampleError` its sample is skipped with (itself when it is one; else a
    ``SampleError`` of :func:`skip_reason`'s reason, naming ``sample``, from ``exc``); raises an error of code
    as :func:`skip_reason` does. For stages whose failures travel as values (process pools, batched calls)."""
    reason = skip_reason(exc, default, sample, key)
    if isinstance(exc, SampleError):
        return exc
    error = SampleError(reason, f"{sample}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def forecast_mismatch(forecast: int, processed: int, sample: str) -> SampleError:
    """The error of a sample whose processed length is not its forecast (see the module docstring)."""
    return SampleError(
        "forecast_mismatch",
        f"FORECAST MISMATCH: forecast {forecast} != processed length {processed} for {sample}: it cannot be "
        "packed as planned, so it is left out. The data or the processor changed since the forecast (a "
        "stale plan, a processor edited after the dataset was built), or the vision spec does not match the "
        "image processor: if neither changed, please report it.",
    )


@dataclass(frozen=True)
class Failure:
    """One bad sample as a stage reports it: ``reason`` (:data:`REASONS`), ``sample`` (how messages name
    it), ``detail`` (what was wrong), ``key`` and ``where`` (its shard or row, for the run's own stats)."""

    reason: str
    sample: str
    detail: str
    key: Any = None
    where: Any = None


@dataclass(frozen=True)
class Skip:
    """What :meth:`Guard.call` returns for a sample left out: its reason, how a budget quotes it, and what was
    wrong (``detail``, whole: for a report that travels with the data, as Energon's packs carry it)."""

    reason: str
    example: str
    detail: str = ""


@dataclass(frozen=True)
class FailurePolicy:
    """The failure policy of one run, declared once: ``on_error`` ("skip" or "raise"), the failure budget's
    ``limit`` (``PackingConfig.max_consecutive_failures``; None: no limit) and ``max_bad_fraction``
    (``PackingConfig``'s; None: no limit), and ``report`` (called with each :class:`Failure` skipped: the
    run's warning and stats). ``who`` names the run in budget errors."""

    who: str
    on_error: str = "skip"
    limit: int | None = None
    report: Callable[[Failure], None] | None = None
    max_bad_fraction: float | None = None

    @classmethod
    def of(cls, who: str, config: Any, report: Callable[[Failure], None] | None = None) -> FailurePolicy:
        """The policy ``config`` (a :class:`~vlm_pack.PackingConfig`) declares for the run ``who``."""
        return cls(who, config.on_error, config.max_consecutive_failures, report, config.max_bad_fraction)

    def stage(self, what: str, default: str) -> Guard:
        """A guarded stage of this run (``what`` names it; ``default``: the reason of a plain data error)."""
        return Guard(self, FailureBudget(self.limit, f"{self.who}, {what}", self.max_bad_fraction), default)


@dataclass
class Guard:
    """One stage of a run under its :class:`FailurePolicy`: try, classify, report, count (module docstring)."""

    policy: FailurePolicy
    budget: FailureBudget
    default: str

    def call(self, fn: Callable[..., Any], *args: Any, sample: str, key: Any = None, where: Any = None) -> Any:
        """``fn(*args)``, or a :class:`Skip` after :meth:`bad` when it raised an error of the data; an error
        of code raises :class:`SampleCodeError` naming ``sample``. The caller calls :meth:`good` once the
        sample passed the whole stage (its own checks after ``fn`` included)."""
        try:
            return fn(*args)
        except Exception as exc:
            reason = skip_reason(exc, self.default, sample, key)
            error = exc if isinstance(exc, SampleError) else SampleError(reason, f"{type(exc).__name__}: {exc}")
            if error is not exc:
                error.__cause__ = exc
            try:
                return self.bad(error, sample, key, where)
            finally:
                # the error's traceback holds this frame, which holds the error: a cycle that keeps whatever
                # the failed call held (a PyAV decoder) alive until a gc; a forked worker's gc then hangs in it
                del error

    def bad(self, error: SampleError, sample: str, key: Any = None, where: Any = None) -> Skip:
        """A bad sample: raised naming it under ``on_error="raise"``; else reported, counted in the budget
        (raises :class:`FailureBudgetError` when spent) and returned as a :class:`Skip`."""
        detail = str(error)
        if self.policy.on_error == "raise":
            raised = type(error)(error.reason, f"bad sample: {error.reason}: {sample}: {detail} "
                                 "(on_error='skip' skips such samples and counts them)")
            raise raised from error
        if self.policy.report is not None:
            self.policy.report(Failure(error.reason, sample, detail, key, where))
        self.budget.failure(error.reason, sample, detail)
        return Skip(error.reason, example(sample, detail), detail)

    def good(self) -> None:
        """The sample passed the stage: the run of bad ones ends."""
        self.budget.success()

    def finish(self) -> None:
        """The stage's run is over: judge the share of bad samples over all it saw (:meth:`FailureBudget.finish`)."""
        self.budget.finish()
