"""One sample's work order, from its forecast to its checked processing: the sample contract of every loader.

::

    headers only (no pixel, no frame)                       pixels and frames
    tar sample ──read_header──> forecast_job() ──> SampleJob ──process_jobs() / job.process()──> processed
    a plan's row + its length ──────────────────> SampleJob        │  one length check in the
                                                                   └─ preprocessor's layout (checked_length)

A :class:`SampleJob` holds what the forecast saw and decided: the encoded images and videos, the conversation,
the rendered prompt (tokenized once: processing reuses it), the image sizes, each video's forecast (the frames
it keeps, read from its container header once: processing decodes those frames without reading it again) and
the forecast length the sample was packed on. Processing consumes it and checks the processed length against
that forecast (:meth:`Preprocessor.checked_length`): a difference is bad data (``forecast_mismatch``), never a
sample packed at another length.

Every loader runs this one sequence and says only where samples come from and where rows go: the stream
(``data.stream_stages``) and the Energon encoder forecast tar samples with :func:`forecast_job`; the map-style
dataset and TRL's collator build a job from a planned row and the length its plan holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..failures import SampleError
from ..processing.videos import ForecastVideo
from .forecast import video_forecasts

if TYPE_CHECKING:
    from ..preprocessor import Preprocessor
    from ..processing import Prompt
    from .reader import SampleHeader

__all__ = ["SampleJob", "forecast_job", "process_jobs"]


@dataclass(slots=True)
class SampleJob:
    """One sample as forecast, waiting to be processed: what processing needs and the length to check.

    ``length``: the forecast tokens the sample takes in a row (expanded layout's count, in either layout), the
    length its pack was planned on; None only for TRL rows written before lengths were (nothing to check).
    ``video_forecasts``: each video's ``VideoForecast`` by this preprocessor's processor (empty: the videos'
    headers are read when processed, as for a plan's rows, which keep lengths only).
    """

    key: Any
    label: str
    """How errors name the sample (``"key 'k' in shard.tar"``, ``"dataset row 3"``)."""
    images: list[Any]
    """Encoded images (bytes, paths) or PIL images, in placeholder order."""
    conversation: Any
    length: int | None
    videos: list[Any] = field(default_factory=list)
    """Encoded videos (bytes, paths), in placeholder order."""
    video_forecasts: list[Any] = field(default_factory=list)
    prompt: Prompt | None = None
    """The prompt the forecast rendered and tokenized (None: rendered when processed)."""
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    where: Any = None
    """Where the sample lives (a shard URL, a dataset row)."""

    def media(self) -> list[Any]:
        """The videos as processing takes them: each with its forecast where the job has one
        (:class:`~vlm_pack.processing.videos.ForecastVideo`: its header is not read again)."""
        if not self.video_forecasts:
            return list(self.videos)
        return [ForecastVideo(video, forecast) for video, forecast in zip(self.videos, self.video_forecasts)]

    def process(self, pre: Preprocessor) -> dict[str, Any]:
        """The processed sample, its length checked against the forecast.

        Raises:
            SampleError: bad data (an image or video that does not decode, ``forecast_mismatch``).
        """
        media = {"videos": self.media()} if self.videos else {}  # an image-only sample is processed as before
        out = pre.process(self.images, self.conversation, self.key, prompt=self.prompt, **media)
        self.check(pre, out)
        return out

    def check(self, pre: Preprocessor, out: dict[str, Any]) -> int | None:
        """The length ``out`` takes in a row, checked against :attr:`length` (None: no forecast to check).

        Raises:
            SampleError: ``forecast_mismatch`` naming the sample (:meth:`Preprocessor.checked_length`).
        """
        if self.length is None:
            return None
        return pre.checked_length(out, self.length, self.label)


def forecast_job(
    pre: Preprocessor,
    header: SampleHeader,
    images: list[Any],
    videos: list[Any],
    *,
    key: Any,
    label: str,
    where: Any = None,
    keep_prompt: bool = True,
) -> SampleJob:
    """The job of a sample read from its headers (``reader.read_header``: text, image sizes, video container
    headers): each video forecast once, then the sample's length and prompt (``Preprocessor.forecast_prompt``).

    Raises what the forecast raises (bad data or code: ``vlm_pack.failures`` sorts it out).
    """
    forecasts = video_forecasts(pre, header.videos)  # each clip's kept frames and tokens, from its header
    sizes = list(header.image_sizes)
    length, _, prompt = pre.forecast_prompt(header.conversation, sizes, key, keep=keep_prompt, videos=forecasts)
    kept = [f for f in forecasts if getattr(f, "metadata", None) is not None]
    return SampleJob(
        key, label, images, header.conversation, int(length), videos,
        forecasts if len(kept) == len(videos) else [], prompt, sizes, where,
    )  # fmt: skip


def process_jobs(pre: Preprocessor, jobs: Sequence[SampleJob]) -> list[tuple[dict[str, Any], int | None] | SampleError]:
    """A pack's jobs processed together (``Preprocessor.process_pack``: its images through one image-processor
    call where that is exact) and each checked: ``(processed sample, its length in a row)``, or the
    :class:`SampleError` that leaves it out (its data, or ``forecast_mismatch``).

    Raises ``SampleCodeError`` naming the sample for an error of code.
    """
    outs = pre.process_pack(
        [(job.images, job.conversation, job.media()) if job.videos else (job.images, job.conversation) for job in jobs],
        keys=[job.key for job in jobs],
        prompts=[job.prompt for job in jobs],
    )
    checked: list[tuple[dict[str, Any], int | None] | SampleError] = []
    for job, out in zip(jobs, outs):
        if isinstance(out, SampleError):
            checked.append(out)
            continue
        try:
            checked.append((out, job.check(pre, out)))
        except SampleError as mismatch:
            checked.append(mismatch)
    return checked
