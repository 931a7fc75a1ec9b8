"""Video stand-ins for checks: clips encoded by PyAV and the family's processor with its video processor.

::

    clip = encode_clip(frames=12, width=96, height=64, fps=6)        # MP4 bytes (libx264), moving shapes
    proc = processor_with_video("qwen2_5_vl", size={"shortest_edge": 3136, "longest_edge": 12544})
    sample = Preprocessor(processor=proc).process([], conversation, videos=[clip])

Both need the ``[video]`` extra (PyAV, and torchvision for transformers' video processors).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..families import require

__all__ = ["encode_clip", "processor_with_video", "truncated_clip"]


_CODECS = {"mp4": ("libx264", "yuv420p"), "mkv": ("libx264", "yuv420p"), "webm": ("libvpx", "yuv420p")}


def _frame(index: int, width: int, height: int, seed: int) -> np.ndarray:
    """``[H, W, 3]`` uint8: a gradient with a square that moves across frames (so frames differ)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    tint = rng.integers(0, 256, 3)
    image = np.stack([(x * 255) // max(width, 1), (y * 255) // max(height, 1), (x + y + 7 * index) % 256], -1)
    image = (image + tint) % 256
    side = max(4, min(width, height) // 4)
    left = (index * 5) % max(1, width - side)
    top = (index * 3) % max(1, height - side)
    image[top : top + side, left : left + side] = (255 - tint) % 256
    return image.astype(np.uint8)


def encode_clip(
    frames: int = 8, width: int = 96, height: int = 64, fps: float = 4.0, container: str = "mp4", seed: int = 0
) -> bytes:
    """An encoded clip of ``frames`` frames (``container``: mp4, mkv or webm), made with PyAV."""
    from fractions import Fraction

    import av

    codec, pix_fmt = _CODECS[container]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska" if container == "mkv" else container) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(_frame(index, width, height, seed), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def truncated_clip(frames: int = 30, width: int = 96, height: int = 64) -> bytes:
    """An MP4 with its index up front ("faststart"), cut in half: its header still states ``frames`` frames
    (what a forecast reads), the decoder yields fewer (what a decode meets in a truncated download). Noise
    frames, so that the cut falls inside the frames' data."""
    import tempfile
    from pathlib import Path

    import av

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "faststart.mp4"  # faststart rewrites a file, not a buffer
        with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as out:
            stream = out.add_stream("libx264", rate=10)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for index in range(frames):
                pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        data = path.read_bytes()
    return data[: len(data) // 2]


def processor_with_video(
    family: str,
    tokenizer: Any = None,
    *,
    chat_template: str | None = None,
    image_overrides: dict[str, Any] | None = None,
    **video_overrides: Any,
) -> Any:
    """``family``'s HF processor (offline tokenizer and image processor, ``vlm_pack.offline``) with its video
    processor: transformers' class with its own defaults under ``video_overrides``. Needs torchvision."""
    import transformers

    from ..offline.processors import _PROCESSOR_PARAMS, image_processor
    from ..offline.tokenizers import build_tokenizer

    record = require(family, "video_processor", "video processor")
    video_cls = getattr(transformers, str(record.video_processor))
    if type(video_cls).__name__ == "DummyObject":  # transformers' stand-in for a missing backend
        raise ImportError(f"{record.video_processor} needs torchvision: pip install \"vlm-pack[video]\"")
    name, params = _PROCESSOR_PARAMS[record.name]
    return getattr(transformers, name)(
        image_processor=image_processor(record.name, **(image_overrides or {})),
        tokenizer=tokenizer if tokenizer is not None else build_tokenizer(record.name),
        video_processor=video_cls(**video_overrides),
        chat_template=chat_template,
        **params,
    )
