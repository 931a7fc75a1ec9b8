"""``forecast_video``: a video's vision tokens from its header and the family's video processor, no decode.

The count is a function of the header (frames, rate, size) and the processor's settings only::

    VideoHeader --sampled_frames()--> indices the processor keeps (its own public ``sample_frames``)
                --per-family rule---> grid (t, h, w) / tokens per frame --> VideoForecast.tokens

So a clip longer than a token budget can be refused before any frame is decoded::

    fc = forecast_video(read_video_header(path), processor)   # ~ms: header (or demux) + arithmetic
    if fc.tokens > capacity: refuse(...)                      # never decoded

Rules (transformers 5.24):

- Qwen2-VL / Qwen2.5-VL (``Qwen2VLVideoProcessor``, models/qwen2_vl/video_processing_qwen2_vl.py): every
  kept frame resized by the 2-D ``smart_resize`` within ``size`` (shortest_edge .. longest_edge); with
  ``cap_pixels_per_frame`` the longest edge is ``max(min(longest, int(max_video_tokens * f**2 * 0.9) *
  tps // n), int(shortest * 1.05))``; ``grid_t = ceil(n / tps)`` (the last frame repeated).
  ``second_per_grid_t = tps / metadata.sampled_fps`` (qwen2_5_vl/processing_qwen2_5_vl.py).
- Qwen3-VL / Qwen3.5 (``Qwen3VLVideoProcessor``, qwen3_vl/video_processing_qwen3_vl.py): the 3-D
  ``smart_resize`` counting the kept frames against the budget; the cap is ``max(min(max_video_tokens *
  f**2, longest // n), int(shortest * 1.05)) * n``. One ``<{t:.1f} seconds>`` per temporal group,
  ``t`` the mean of the group's first and last frame times (qwen3_vl/processing_qwen3_vl.py).
- GLM-4.1V / 4.5V / 4.6V (``Glm4vVideoProcessor``, glm4v/video_processing_glm4v.py; GLM-4.6V's
  ``Glm46VVideoProcessor`` samples otherwise, resizes alike, glm46v/): Qwen3-VL's 3-D
  ``smart_resize`` (no pixel cap); per temporal group ``<|begin_of_image|>`` + its tokens +
  ``<|end_of_image|>`` + ``t`` (GLM-4.1V ``int(t)``, GLM-4.6V ``f"{t:.1f} seconds"``), ``t`` the group's
  first kept frame time (glm4v/processing_glm4v.py, glm46v/processing_glm46v.py ``replace_video_token``).
- LLaVA-OneVision (llava_onevision/processing_llava_onevision.py): per frame
  ``ceil(int(sqrt(num_image_tokens)) / 2) ** 2`` pooled tokens, plus one newline token per video.
- InternVL (internvl/processing_internvl.py): each kept frame is an image of ``image_seq_length``
  ``<IMG_CONTEXT>`` tokens between ``<img>`` / ``</img>`` (the ``Frame{i}:`` text is the prompt's).

``cap_pixels_per_frame=None`` (the 5.24 default, with a warning) is the processor's uncapped behaviour.

Any other processor (its class named by no record, or rewriting its record's: a model type without a record)
takes the exact route: its own sampling and video step on blank frames of the header's size
(``vlm_pack.vision.oracle.ProcessorSpec``), or is refused by name (:func:`_exact_forecast`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ...failures import InternalCheckError
from ...families import names, video_family
from ..smart_resize import _smart_resize_3d, smart_resize
from .header import VideoHeader
from .sampling import VideoForecast, _sample, _settings, _video_processor, sampled_frames


def _edges(size: Any) -> tuple[int, int]:
    get = size.get if isinstance(size, Mapping) else lambda k: getattr(size, k, None)
    shortest, longest = get("shortest_edge"), get("longest_edge")
    if not shortest or not longest:
        raise InternalCheckError(f"the video processor's size needs shortest_edge and longest_edge, got {size}.")
    return int(shortest), int(longest)


def _qwen_size(settings: dict[str, Any]) -> tuple[int, int]:
    shortest, longest = _edges(settings["size"])
    # ``_standardize_kwargs`` folds the deprecated min_pixels / max_pixels kwargs into size.
    shortest = settings.get("min_pixels") or shortest
    longest = settings.get("max_pixels") or longest
    return shortest, longest


def _qwen2_resize(vp: Any, s: dict[str, Any], n: int, height: int, width: int) -> tuple[int, int]:
    factor = s["patch_size"] * s["merge_size"]
    shortest, longest = _qwen_size(s)
    if s.get("cap_pixels_per_frame"):
        total = int(vp.max_video_tokens * factor * factor * 0.9)
        longest = max(min(longest, total * s["temporal_patch_size"] // n), int(shortest * 1.05))
    return smart_resize(height, width, factor, shortest, longest, family=type(vp).__name__)


def _qwen3_resize(vp: Any, s: dict[str, Any], n: int, height: int, width: int) -> tuple[int, int]:
    factor = s["patch_size"] * s["merge_size"]
    shortest, longest = _qwen_size(s)
    if s.get("cap_pixels_per_frame"):
        per_frame = max(min(vp.max_video_tokens * factor * factor, longest // n), int(shortest * 1.05))
        longest = per_frame * n
    tps = s["temporal_patch_size"]
    return _smart_resize_3d(n, height, width, tps, factor, shortest, longest, type(vp).__name__)


def _group_times(indices: list[int], fps: float, tps: int) -> tuple[float, ...]:
    """Qwen3-VL's per-group seconds: indices padded with the last to a multiple of ``tps``, then the mean of
    each group's first and last frame time."""
    padded = indices + [indices[-1]] * (-len(indices) % tps)
    times = [i / fps for i in padded]
    return tuple((times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps))


def _glm_times(indices: list[int], fps: float, groups: int) -> tuple[float, ...]:
    """GLM-4.1V / 4.6V's per-group seconds: the first kept frame's time of each temporal group
    (``timestamps[::2]``), the last repeated up to ``groups``; the processor prints them its own way."""
    times = [i / fps for i in indices][::2][:groups]
    return tuple(times + [times[-1]] * (groups - len(times)))


def _qwen(vp: Any, header: VideoHeader, s: dict[str, Any], qwen3: bool, glm: bool = False) -> VideoForecast:
    indices, metadata = _sample(vp, header, s)
    n, tps, patch, merge = len(indices), s["temporal_patch_size"], s["patch_size"], s["merge_size"]
    if n == 0:
        raise ValueError(
            f"{type(vp).__name__}: frame sampling keeps no frame of a {header.frames}-frame clip."
        )
    resize = _qwen3_resize if qwen3 else _qwen2_resize
    h, w = header.height, header.width
    if s.get("do_resize", True):
        h, w = resize(vp, s, n, h, w)
    grid = (-(-n // tps), h // patch, w // patch)
    per_group = grid[1] * grid[2] // (merge * merge)
    return VideoForecast(
        indices=tuple(indices),
        grid_thw=grid,
        frame_tokens=(per_group,) * grid[0],
        tokens=per_group * grid[0],
        timestamps=_glm_times(indices, metadata.fps, grid[0]) if glm else (
            _group_times(indices, metadata.fps, tps) if qwen3 else None
        ),
        second_per_grid_t=None if qwen3 else tps / metadata.sampled_fps,
        num_patches=grid[0] * grid[1] * grid[2],
        metadata=metadata,
    )


def _per_frame(vp: Any, header: VideoHeader, s: dict[str, Any], per_frame: int, extra: int) -> VideoForecast:
    indices, metadata = _sample(vp, header, s)
    return VideoForecast(
        indices=tuple(indices),
        grid_thw=None,
        frame_tokens=(per_frame,) * len(indices),
        tokens=per_frame * len(indices) + extra,
        metadata=metadata,
    )


def _processor_number(processor: Any, attr: str, given: int | None, cls: str) -> int:
    value = given if given is not None else getattr(processor, attr, None)
    if not isinstance(value, int) or value <= 0:
        raise InternalCheckError(
            f"{cls}: the token count per frame comes from the processor's `{attr}`; pass the full processor "
            f"(not its video processor) or {attr}=..."
        )
    return value


def forecast_video(
    header: VideoHeader,
    processor: Any,
    *,
    num_image_tokens: int | None = None,
    image_seq_length: int | None = None,
    **videos_kwargs: Any,
) -> VideoForecast:
    """The vision tokens (and grid, kept frames, timestamps) of a video with this header, without decoding.

    ``processor``: the family's processor, or its video processor (Qwen-VL). A processor whose class no record
    names (or that rewrites its record's) is forecast by its own video step, never by a record its video
    processor resembles (:func:`_exact_forecast`). LLaVA-OneVision and InternVL
    take their per-frame count from the processor (``num_image_tokens`` / ``image_seq_length``): pass the
    full processor or that number. ``videos_kwargs`` are call-time overrides (``fps=1``,
    ``do_sample_frames=True``, ``cap_pixels_per_frame=True``, ...) exactly as given to the processor.

    Raises ``ValueError`` where the processor would fail on the clip (too few frames for its sampling or
    its temporal patch): bad data, counted as such. A processor without a video processor, one it has no rule
    for, or settings it cannot read raise :class:`~vlm_pack.failures.InternalCheckError`: every clip would
    fail, so a pipeline stops at the first instead of counting each sample as bad.
    """
    vp = _video_processor(processor)
    if _is_full(processor) and _takes_exact_route(processor):
        return _exact_forecast(header, processor, videos_kwargs)
    settings = _settings(vp, videos_kwargs)
    record = video_family(vp)
    wraps = record.video_wraps if record is not None else None
    if wraps in ("frames", "timed_image_frames"):  # Qwen3-VL / 3.5, GLM-4.1V / 4.6V: the 3-D resize, no cap
        return _qwen(vp, header, settings, qwen3=True, glm=wraps == "timed_image_frames")
    if wraps == "template":  # Qwen2-VL / 2.5-VL
        return _qwen(vp, header, settings, qwen3=False)
    if wraps == "none":  # LLaVA-OneVision: pooled frames and one newline token
        image_tokens = _processor_number(processor, "num_image_tokens", num_image_tokens, type(vp).__name__)
        pooled = math.ceil(int(math.sqrt(image_tokens)) / 2) ** 2
        return _per_frame(vp, header, settings, pooled, extra=1)
    if wraps == "image_frames":  # InternVL: each kept frame an image
        seq = _processor_number(processor, "image_seq_length", image_seq_length, type(vp).__name__)
        return _per_frame(vp, header, settings, seq, extra=0)
    raise InternalCheckError(
        f"no video forecast rule for {type(vp).__name__}: no family record names it or a class it derives from "
        f"(Family.video_processor); records with videos: {', '.join(names('video_wraps'))}. A processor without "
        "a record is forecast by its own video step: vlm_pack.vision.oracle.exact_spec(processor).video_forecast"
    )


def _is_full(processor: Any) -> bool:
    return getattr(processor, "tokenizer", None) is not None and getattr(processor, "image_processor", None) is not None


def _takes_exact_route(processor: Any) -> bool:
    from ..from_processor import takes_exact_route

    return takes_exact_route(processor)


# processor -> its exact-route spec (settings hashed once per processor, not once per video)
_SPECS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _exact_forecast(header: VideoHeader, processor: Any, videos_kwargs: dict[str, Any]) -> VideoForecast:
    """The exact route for a video: the processor's own sampling on the header's metadata and its own video step
    on blank frames of the header's size (``ProcessorSpec.video_forecast``, memoized), its text kept as the
    forecast's ``stand_in``. A processor that cannot be driven so is refused by name (InternalCheckError: every
    clip would fail); a clip its sampling or video step refuses (ValueError) is bad data."""
    from ..._compat import video_step_missing
    from ..oracle import ContentDependent, drives, exact_spec

    name = type(processor).__name__
    why = drives(processor) or video_step_missing(processor)
    if why:
        raise InternalCheckError(
            f"{name}: no family record names it and vlm-pack cannot run its own video step ({why}), so its videos "
            "are not forecast (no other family's rule is applied by resemblance). Train its videos unpacked, or "
            "upgrade transformers (>= 5.18 runs any processor that implements replace_video_token)."
        )
    try:
        spec = _SPECS[processor]
    except KeyError:
        spec = exact_spec(processor)
        _SPECS[processor] = spec
    except TypeError:  # a processor that cannot be weakly referenced
        spec = exact_spec(processor)
    try:
        token, text, left = spec.video_stand_in(header, **videos_kwargs)
        forecast = spec.video_forecast(header, **videos_kwargs)
    except ValueError:
        raise
    except ContentDependent as exc:
        raise InternalCheckError(f"{exc}. Its videos are not packed: switch that off, or train them unpacked.") from None
    except Exception as exc:
        import transformers

        raise InternalCheckError(
            f"{name} (transformers {transformers.__version__}, no vlm-pack record): its own video step fails on "
            f"{header.frames} blank {header.width}x{header.height} frames: {type(exc).__name__}: {exc}. vlm-pack "
            "forecasts such a processor's videos only by running it; train its videos unpacked or report it."
        ) from exc
    if token != processor.video_token:
        raise InternalCheckError(
            f"{name} (no vlm-pack record) writes a video's frames as {token!r} tokens, not its video_token "
            f"{processor.video_token!r}: vlm-pack counts a record-less processor's video embeddings as video tokens, "
            "so its videos are refused; train them unpacked or report it."
        )
    metadata = header.metadata()
    metadata.frames_indices = list(forecast.indices)
    return replace(forecast, metadata=metadata, stand_in=(token, text, left))


__all__ = ["VideoForecast", "forecast_video", "sampled_frames"]
