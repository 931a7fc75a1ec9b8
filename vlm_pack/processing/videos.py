"""Decoding a sample's videos: only the frames the forecast counted, handed to the processor as sampled.

The forecast and the decoder share one sampling (``vlm_pack.vision.video``), so a video is never decoded
twice and never decoded at all where its header already says it does not fit::

    bytes / path --read_video_header()--> VideoHeader --forecast_video(header, processor)--> indices, tokens
                 --decode_frames(indices)--> frames [T, H, W, 3] uint8 (PyAV: every frame decoded in order,
                                             only the kept ones converted and held)
    processor(text=..., videos=[frames], video_metadata=[header.metadata() + indices], do_sample_frames=False)

The processor then samples nothing and reads the clip's rate and the kept indices from the metadata:
Qwen2.5-VL's ``second_per_grid_ts`` (``temporal_patch_size / metadata.sampled_fps``,
models/qwen2_5_vl/processing_qwen2_5_vl.py) and Qwen3-VL's ``<t seconds>`` text
(``_calculate_timestamps(metadata.frames_indices, metadata.fps)``, models/qwen3_vl/processing_qwen3_vl.py) are
what they are when the processor samples the whole decoded clip itself.

Bad data (a container PyAV cannot open or decode, fewer frames than the header states, a clip the
processor's sampling refuses) is a :class:`~vlm_pack.failures.SampleError` naming the sample and the video,
counted and skipped by the pipelines; a processed video that differs from its forecast is a vlm-pack bug
(:class:`~vlm_pack.failures.InternalCheckError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..failures import InternalCheckError, SampleError

__all__ = ["DecodedVideo", "DecodedVideos", "ForecastVideo", "decode_frames", "load_videos"]


@dataclass(frozen=True)
class ForecastVideo:
    """An encoded video and the forecast its header gave when the sample was forecast
    (``vlm_pack.data.job.SampleJob``): :func:`load_videos` decodes its kept frames without reading the header
    again. ``forecast.metadata`` must be set (``forecast_video`` sets it); ``source``: bytes, a path or a file."""

    source: Any
    forecast: Any  # vlm_pack.vision.video.VideoForecast, by this processor


@dataclass(frozen=True)
class DecodedVideo:
    """One video of a sample: its kept frames, the metadata the processor reads, and its forecast.

    ``frames``: ``[T, H, W, 3]`` uint8, the frames ``forecast.indices`` names, in order; ``metadata``:
    transformers' ``VideoMetadata`` of the whole clip with ``frames_indices`` = the kept indices.
    """

    frames: np.ndarray
    metadata: Any
    forecast: Any  # vlm_pack.vision.video.VideoForecast


class DecodedVideos(tuple):  # tuple[DecodedVideo, ...]
    """A sample's decoded videos, in order, and the keyword arguments the processor takes them with."""

    __slots__ = ()

    def processor_kwargs(self) -> dict[str, Any]:
        """``videos=`` / ``video_metadata=`` / ``do_sample_frames=False`` for ``processor(text=..., ...)``."""
        return dict(
            videos=[video.frames for video in self],
            video_metadata=[video.metadata for video in self],
            do_sample_frames=False,
        )


def _open(av: Any, source: Any) -> Any:
    import io
    import os

    if isinstance(source, (bytes, bytearray, memoryview)):
        return av.open(io.BytesIO(bytes(source)), "r")
    if isinstance(source, (str, os.PathLike)):
        return av.open(os.fspath(source), "r")
    return av.open(source, "r")  # a binary file, read from where it stands (as read_video_header does)


def decode_frames(source: Any, indices: Sequence[int], name: str = "video") -> np.ndarray:
    """The frames ``indices`` (increasing or not, repeats allowed) of ``source``'s first video stream,
    ``[len(indices), H, W, 3]`` uint8 RGB, decoded with PyAV.

    Every frame up to the last kept one is decoded (codecs predict frames from earlier ones), but only the
    kept ones are converted to RGB and held: memory is the kept frames, never the clip.

    Raises:
        SampleError: reason ``"decode_error"`` naming ``name`` when the container does not open or decode,
            or holds fewer frames than ``indices`` needs (a truncated file whose header states more).
    """
    from ..vision.video.header import _import_av

    av = _import_av()
    wanted = sorted({int(i) for i in indices})
    keep = frozenset(wanted)
    if not wanted:
        raise InternalCheckError(f"{name}: no frame to decode (the forecast kept none)")
    kept: dict[int, np.ndarray] = {}
    position = 0
    try:
        with _open(av, source) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if position in keep:
                    kept[position] = frame.to_ndarray(format="rgb24")
                position += 1
                if position > wanted[-1]:
                    break
    except (av.FFmpegError, OSError, IndexError, EOFError) as exc:
        # without its traceback: that holds this frame's stream (a threaded decoder) alive until a gc, which a
        # forked loader worker then runs, and freeing the decoder there hangs (avcodec_free_context)
        raise SampleError(
            "decode_error", f"{name} does not decode: {type(exc).__name__}: {exc}"
        ) from exc.with_traceback(None)
    if len(kept) != len(wanted):
        raise SampleError(
            "decode_error",
            f"{name} does not decode: it yields {position} frame(s), but frame {wanted[-1]} is needed (its header "
            "states more frames than it holds: a truncated file). Re-encode it or drop the sample.",
        )
    return np.stack([kept[int(i)] for i in indices])


def load_videos(videos: Sequence[Any], processor: Any, key: Any) -> DecodedVideos:
    """Each of a sample's ``videos`` (bytes, paths or binary files) read, forecast and decoded for
    ``processor`` (the family's processor with its video processor); errors name the sample and the video.
    A :class:`ForecastVideo` brings its forecast: its header is not read again.

    Raises:
        SampleError: reason ``"decode_error"`` for a video that does not read, decode or sample (bad data).
    """
    from ..vision.video import forecast_video, read_video_header
    from .markers import _check_frame_counts, _video_record

    out = []
    for index, source in enumerate(videos):
        name = f"sample {key!r}, video {index}"
        if isinstance(source, ForecastVideo):  # forecast from its header once, when the sample was planned
            out.append((source.source, source.forecast))
            continue
        try:
            forecast = forecast_video(read_video_header(source, name=name), processor)
        except ImportError:
            raise
        except ValueError as exc:
            if isinstance(exc, (SampleError, InternalCheckError)):
                raise
            raise SampleError("decode_error", f"{name}: {exc}") from exc
        out.append((source, forecast))
    exact = all(forecast.stand_in is not None for _, forecast in out)  # a processor no record names
    if len(out) > 1 and not exact and _video_record(None, processor).video_wraps == "image_frames":
        _check_frame_counts([forecast for _, forecast in out], key)  # refused before any decode
    decoded = []
    for index, (source, forecast) in enumerate(out):
        frames = decode_frames(source, forecast.indices, f"sample {key!r}, video {index}")
        decoded.append(DecodedVideo(frames, forecast.processor_metadata(), forecast))
    return DecodedVideos(decoded)


def video_embedding_id(processor: Any) -> int | None:
    """The id the model scatters a video's features into: the processor's ``video_token_id``, except for a
    family whose processor writes the frames as image tokens (``Family.video_as_images``: InternVL,
    internvl/processing_internvl.py; GLM-4.1V, glm4v/processing_glm4v.py ``replace_video_token``)."""
    from .markers import _video_family
    from .render import _embedding_token_id

    record = _video_family(None, processor)
    if record is not None and record.video_as_images:
        return _embedding_token_id(processor)
    return getattr(processor, "video_token_id", None)


def check_processed(videos: DecodedVideos, processed: dict[str, Any], key: Any) -> None:
    """InternalCheckError naming the sample unless each processed video is its forecast: the same
    embeddings (``tokens_per_video``) and, where the family has one, the same ``video_grid_thw`` row."""
    counts = [int(n) for n in processed["tokens_per_video"]]
    grids = processed.get("video_grid_thw")
    for index, video in enumerate(videos):
        forecast = video.forecast
        grid = tuple(int(x) for x in grids[index]) if grids is not None else None
        if counts[index] != forecast.tokens or (forecast.grid_thw is not None and grid != forecast.grid_thw):
            raise InternalCheckError(
                f"sample {key!r}, video {index}: the processor made {counts[index]} tokens (grid {grid}) of the "
                f"{len(forecast.indices)} frames forecast as {forecast.tokens} tokens (grid {forecast.grid_thw}): "
                "vlm-pack's video forecast disagrees with this processor; report it with the processor's settings"
            )
