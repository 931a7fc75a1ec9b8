"""Videos: exact vision-token forecasts from the container header, before any frame is decoded.

::

    video bytes / path --read_video_header()--> VideoHeader(frames, fps, duration, width, height, how)
                                                   | .metadata(): transformers' VideoMetadata (one definition
                                                   |   for the forecast and the decoder)
                       --forecast_video(header, processor)--> VideoForecast(indices, grid_thw, tokens, ...)

- ``header.py``: :func:`read_video_header` (PyAV; MP4 sample table or a demux-only packet count);
- ``forecast.py``: :func:`sampled_frames` (the processor's own ``sample_frames``) and :func:`forecast_video`
  (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, LLaVA-OneVision, InternVL).

PyAV is imported on first use (``pip install "vlm-pack[video]"``).
"""

from __future__ import annotations

from .forecast import VideoForecast, forecast_video, sampled_frames
from .header import VideoHeader, VideoSource, read_video_header

__all__ = [
    "VideoForecast",
    "VideoHeader",
    "VideoSource",
    "forecast_video",
    "read_video_header",
    "sampled_frames",
]
