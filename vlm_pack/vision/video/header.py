"""``read_video_header``: a video's exact frame count, rate and size from its container, without decoding.

PyAV opens the container and reads the stream header (about 2 ms for an MP4). An MP4 / MOV header carries
the sample count; Matroska and WebM headers carry none (PyAV reports 0), so there the packets are demuxed
(read, not decoded) and counted: one video packet is one frame the decoder hands out. A number the header
does not state exactly is never estimated from duration x rate.

What the decoder will see, measured with PyAV 18 (tests/test_video_forecast.py checks it on every clip):

- frame count: the MP4 sample count, or the demuxed packet count (less the packets an edit list marks
  discarded), equals the frames ``container.decode`` yields (h264 with B-frames, mpeg4, VP8, VP9). An MP4
  whose sample count disagrees with duration x rate (an edit list trimming it) is demuxed;
- cost: libavformat's stream probe (``avformat_find_stream_info``, run by every PyAV open) may decode the
  first frame to learn the pixel format; nothing else is decoded;
- size: ``frame.to_ndarray()`` returns the coded ``width x height``; PyAV does not apply a rotation
  display matrix (``frame.rotation`` only reports it), so the header's coded size is the size the
  processor receives from a PyAV decoder;
- rate: ``stream.average_rate``, the rate transformers' own PyAV loader (``video_utils.read_video_pyav``)
  tells the processor. For an MP4 it is frames / duration, so a variable-frame-rate MP4 gets its mean rate;
  Matroska states the rate its muxer declared. Only where the container gives none, frames / duration.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, Union

VideoSource = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", BinaryIO]

_INSTALL = 'pip install "vlm-pack[video]"'
# Containers whose header frame count is the sample table, i.e. exactly the frames a decoder yields.
_SAMPLE_TABLE_FORMATS = ("mov", "mp4")


@dataclass(frozen=True)
class VideoHeader:
    """A video's container facts, read without decoding (:func:`read_video_header`).

    ``frames`` is exact: the frames a PyAV decoder yields. ``how`` says where it came from: ``"header"``
    (the MP4 sample table) or ``"demux"`` (video packets counted, no decode).
    """

    frames: int
    """Frames the decoder yields (exact)."""
    fps: float
    """The clip's mean rate, as the processor is told it (``stream.average_rate``)."""
    duration: float | None
    """Seconds the container or stream states; ``None`` where neither does."""
    width: int
    """Width in pixels of every decoded frame."""
    height: int
    """Height in pixels of every decoded frame."""
    how: Literal["header", "demux"]
    """``"header"``: the MP4 sample count; ``"demux"``: packets counted without decoding."""

    def metadata(self) -> Any:
        """transformers' ``VideoMetadata`` of this clip: what the video processor must be given.

        One definition for the forecast and the decoder: ``total_num_frames = frames``, ``fps``, the size,
        and ``duration = frames / fps`` (as transformers' ``read_video_pyav`` sets it). A fresh object each
        call: the processor writes ``frames_indices`` into the one it receives.
        """
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(
            total_num_frames=self.frames,
            fps=self.fps,
            width=self.width,
            height=self.height,
            duration=self.frames / self.fps,
            video_backend="pyav",
        )


def _import_av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise ImportError(f"reading videos needs PyAV (the `av` package): {_INSTALL}") from exc
    return av


def _describe(video: VideoSource) -> str:
    if isinstance(video, (bytes, bytearray, memoryview)):
        return f"<{len(video)} bytes of video>"
    if isinstance(video, (str, os.PathLike)):
        return os.fspath(video)
    return repr(getattr(video, "name", None) or video)


def _unreadable(name: str, why: object) -> ValueError:
    return ValueError(
        f"{name}: not a readable video container ({why}). Re-encode it (e.g. `ffmpeg -i IN -c:v libx264 "
        "OUT.mp4`) or drop the sample."
    )


def _rate(stream: Any, frames: int, duration: float | None) -> float:
    """The mean frame rate the processor is told: PyAV's ``average_rate``, else ``guessed_rate``, else
    frames / duration; ``ValueError`` where none is known."""
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate:
            return float(rate)
    if duration:
        return frames / duration
    raise ValueError("the container states no frame rate and no duration")


def _duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE: microseconds
    return None


def _header_frames(container: Any, stream: Any, duration: float | None) -> int | None:
    """The MP4 / MOV sample count where it is the decoder's count, else None (then demux).

    A sample count that disagrees with duration x rate by more than a frame (an edit list trimming the
    clip, a broken index) is not trusted.
    """
    formats = container.format.name.split(",")
    if stream.frames <= 0 or not any(f in _SAMPLE_TABLE_FORMATS for f in formats):
        return None
    rate = stream.average_rate
    if duration is not None and rate and abs(stream.frames - duration * float(rate)) > 1:
        return None
    return int(stream.frames)


def _demux_frames(container: Any, stream: Any) -> int:
    """Video packets with a payload that the demuxer does not mark discarded: the frames the decoder yields.

    Flush packets are empty; an MP4 edit list that starts the clip late marks its leading packets
    ``discard`` and the decoder drops their frames (a 40-sample MP4 trimmed by 3 decodes to 37 frames).
    """
    return sum(1 for packet in container.demux(stream) if packet.size > 0 and not packet.is_discard)


def _open(av: Any, video: VideoSource) -> Any:
    if isinstance(video, (bytes, bytearray, memoryview)):
        return av.open(io.BytesIO(bytes(video)), "r")
    if isinstance(video, (str, os.PathLike)):
        return av.open(os.fspath(video), "r")
    return av.open(video, "r")


def read_video_header(video: VideoSource, *, name: str | None = None) -> VideoHeader:
    """Frame count, mean rate, duration and size of the first video stream of ``video``, without decoding.

    ``video``: encoded bytes, a path, or a seekable binary file that holds the video alone (PyAV seeks
    absolute offsets): it is read from its start, and its position is restored afterwards. ``name`` labels the video in errors (default: the path or the byte count).

    Raises ``ImportError`` naming ``pip install "vlm-pack[video]"`` without PyAV, and ``ValueError`` naming
    the video for a container PyAV cannot open, one without a video stream, or one with no frame.
    """
    av = _import_av()
    label = name or _describe(video)
    start = video.tell() if hasattr(video, "tell") and hasattr(video, "seek") else None
    if start:
        video.seek(0)  # type: ignore[union-attr]  # PyAV reads on from the position, then seeks absolute
    try:
        container = _open(av, video)
    except (av.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise _unreadable(label, exc) from exc
    try:
        return _read(av, container, label)
    finally:
        container.close()
        if start is not None:
            video.seek(start)  # type: ignore[union-attr]


def _read(av: Any, container: Any, label: str) -> VideoHeader:
    if not container.streams.video:
        raise ValueError(
            f"{label}: the container has no video stream (streams: "
            f"{[s.type for s in container.streams] or 'none'}). Pass it as audio or drop the sample."
        )
    stream = container.streams.video[0]
    duration = _duration(container, stream)
    frames = _header_frames(container, stream, duration)
    how: Literal["header", "demux"] = "header"
    if frames is None:
        how = "demux"
        try:
            frames = _demux_frames(container, stream)
        except av.FFmpegError as exc:
            raise _unreadable(label, exc) from exc
    if frames <= 0 or not stream.width or not stream.height:
        raise ValueError(
            f"{label}: the video stream has no decodable frame ({frames} frames, "
            f"{stream.width}x{stream.height}). Re-encode it or drop the sample."
        )
    try:
        fps = _rate(stream, frames, duration)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}; re-mux it with a frame rate or drop the sample.") from exc
    if not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"{label}: frame rate {fps} is not positive; re-mux it or drop the sample.")
    return VideoHeader(
        frames=frames,
        fps=fps,
        duration=duration,
        width=int(stream.width),
        height=int(stream.height),
        how=how,
    )


__all__ = ["VideoHeader", "VideoSource", "read_video_header"]
