"""The generated video clips of tests/test_video_forecast.py and benchmarks/bench_video_forecast.py.

69 clips encoded with PyAV: MP4 (h264, mpeg4), WebM (VP8, VP9) and Matroska (h264, mpeg4); 1-300 frames;
1-60 fps with 29.97; 64 px to 1920 px (big frames stay short); odd and even counts and sizes; a
variable-frame-rate MP4 and MKV (packets re-stamped at irregular steps); an MP4 whose edit list trims its
first 3 of 40 frames (the decoder yields 37); an MP4 rotated 90 degrees by its display matrix.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

_CODECS = [
    ("mp4", "h264"),
    ("mp4", "mpeg4"),
    ("webm", "libvpx"),
    ("webm", "libvpx-vp9"),
    ("matroska", "h264"),
    ("matroska", "mpeg4"),
]
_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 31, 32, 61, 97, 150, 300]
_RATES = [Fraction(1), Fraction(2), Fraction(5), Fraction(10), Fraction(12), Fraction(15), Fraction(24),
          Fraction(25), Fraction(30000, 1001), Fraction(30), Fraction(50), Fraction(60)]  # fmt: skip
_SMALL = [(64, 64), (96, 64), (64, 112), (160, 120), (128, 72), (200, 100), (320, 240)]
# Big frames stay short so that the processors' resizes stay fast.
_BIG = [
    ("mp4", "h264", 3, Fraction(30), 1920, 1080),
    ("webm", "libvpx-vp9", 2, Fraction(25), 1080, 1920),
    ("matroska", "h264", 5, Fraction(30000, 1001), 1280, 720),
    ("mp4", "mpeg4", 4, Fraction(60), 640, 360),
    ("webm", "libvpx", 1, Fraction(24), 854, 480),
    ("webm", "libvpx-vp9", 7, Fraction(15), 65, 49),  # odd sides
    ("webm", "libvpx", 9, Fraction(10), 99, 67),
]


def _encode(fmt: str, codec: str, count: int, rate: Fraction, width: int, height: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        ramp = np.linspace(0, 255, width).astype(np.int64)[None, :, None]
        for i in range(count):
            image = np.broadcast_to((ramp + 13 * i) % 256, (height, width, 3)).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def _variable_rate(fmt: str, count: int = 40, steps_ms: tuple[int, ...] = (33, 80, 17, 120)) -> bytes:
    """A clip whose packets carry irregular timestamps (mpeg4 has no B-frames: pts = dts)."""
    source = av.open(io.BytesIO(_encode("matroska", "mpeg4", count, Fraction(30), 96, 64)))
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream_from_template(source.streams.video[0])
        stream.time_base = Fraction(1, 1000)
        pts = 0
        packets = (p for p in source.demux(source.streams.video[0]) if p.size > 0)
        for i, packet in enumerate(packets):
            step = steps_ms[i % len(steps_ms)]
            packet.stream, packet.time_base = stream, Fraction(1, 1000)
            packet.pts = packet.dts = pts
            packet.duration = step
            pts += step
            out.mux(packet)
    source.close()
    return buf.getvalue()


def _specs() -> list[tuple[str, str, int, Fraction, int, int]]:
    specs = [
        (*_CODECS[i % 6], _COUNTS[i % 16], _RATES[(5 * i) % 12], *_SMALL[(3 * i) % 7]) for i in range(58)
    ]
    return specs + _BIG


def _edit_list_mp4(count: int = 40, trim: int = 3) -> bytes:
    """An MP4 whose edit list starts ``trim`` frames in: ``count`` samples, ``count - trim`` decoded frames."""
    source = av.open(io.BytesIO(_encode("matroska", "mpeg4", count, Fraction(25), 96, 64)))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream_from_template(source.streams.video[0])
        stream.time_base = Fraction(1, 25)
        for i, packet in enumerate(p for p in source.demux(source.streams.video[0]) if p.size > 0):
            packet.stream, packet.time_base = stream, Fraction(1, 25)
            packet.pts = packet.dts = i - trim  # negative start times: the muxer writes a trimming edit list
            packet.duration = 1
            out.mux(packet)
    source.close()
    return buf.getvalue()


def _rotated_mp4(count: int = 10, degrees: int = 90) -> bytes:
    """A 96x64 MP4 carrying a display matrix that rotates it by ``degrees`` (PyAV decodes it unrotated)."""
    source = av.open(io.BytesIO(_encode("matroska", "mpeg4", count, Fraction(25), 96, 64)))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream_from_template(source.streams.video[0])
        stream.set_display_rotation(degrees)
        for packet in source.demux(source.streams.video[0]):
            if packet.size > 0:
                packet.stream = stream
                out.mux(packet)
    source.close()
    return buf.getvalue()


def clip_set() -> list[tuple[str, bytes]]:
    """``(name, encoded bytes)`` of every clip; the name says container, codec, frames, rate and size."""
    made = [(f"{fmt}-{codec}-{n}f-{float(r):g}fps-{w}x{h}", _encode(fmt, codec, n, r, w, h))
            for fmt, codec, n, r, w, h in _specs()]  # fmt: skip
    extra = [("vfr-mp4", _variable_rate("mp4")), ("vfr-mkv", _variable_rate("matroska"))]
    return [*made, *extra, ("editlist-mp4", _edit_list_mp4()), ("rotated-mp4", _rotated_mp4())]
