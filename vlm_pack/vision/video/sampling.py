"""What a video becomes in its processor (:class:`VideoForecast`) and the frames the processor keeps of it
(:func:`sampled_frames`, its own public ``sample_frames`` on the header's metadata): shared by the family rules
(``forecast.py``) and the exact route (``vlm_pack.vision.oracle``), below both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ...failures import InternalCheckError
from .header import VideoHeader

__all__ = ["VideoForecast", "sampled_frames"]

# Keys ``BaseVideoProcessor.preprocess`` pops before it binds the rest to ``sample_frames``.
_NOT_SAMPLING = ("input_data_format", "do_convert_rgb", "device", "video_metadata", "do_sample_frames")


@dataclass(frozen=True)
class VideoForecast:
    """What a video becomes in the family's processor, computed from its header.

    ``tokens`` counts the placeholder tokens (``<|video_pad|>``, ``<video>``, ``<IMG_CONTEXT>``); the
    special tokens and text around them (``<|vision_start|>``, Qwen3-VL's ``<t seconds>``, InternVL's
    ``Frame{i}: <img>``) are the prompt's, and ``timestamps`` gives the text Qwen3-VL prints.
    """

    indices: tuple[int, ...]
    """Frame indices the processor keeps (into the decoded clip)."""
    grid_thw: tuple[int, int, int] | None
    """Qwen-VL ``video_grid_thw`` row; ``None`` for families without one."""
    frame_tokens: tuple[int, ...]
    """Placeholder tokens per temporal group (Qwen-VL) or per kept frame (LLaVA-OneVision, InternVL)."""
    tokens: int
    """Placeholder tokens of the whole video (LLaVA-OneVision: its newline token included)."""
    timestamps: tuple[float, ...] | None = None
    """Qwen3-VL / Qwen3.5: seconds printed before each temporal group (GLM-4.1V / 4.6V: after it); ``None``
    elsewhere. (With sampling off they are every frame's; transformers' Qwen3VLProcessor then has no
    ``frames_indices`` and fails.)"""
    second_per_grid_t: float | None = None
    """Qwen2-VL / Qwen2.5-VL: ``second_per_grid_ts`` entry (Qwen2.5-VL's processor passes it)."""
    num_patches: int | None = None
    """Vision-encoder patches before the merge (``pixel_values_videos`` rows) for Qwen-VL, else ``None``."""
    metadata: Any = field(default=None, compare=False, repr=False)
    """transformers' ``VideoMetadata`` as the processor is given it (``frames_indices`` = ``indices``): what
    its own ``replace_video_token`` reads to write the text around the video's tokens; None where unknown."""
    stand_in: tuple[str, str, int] | None = field(default=None, compare=False, repr=False)
    """The exact route's (a processor no record names, ``vision/oracle.py``): ``(embedding token, the text the
    processor writes for the video with each run of that token written once, the tokens that leaves out)``;
    None where a family's rule forecast the video."""

    def processor_metadata(self) -> Any:
        """A fresh copy of :attr:`metadata` (the processor writes into the one it receives), or None."""
        if self.metadata is None:
            return None
        return replace(self.metadata, frames_indices=list(self.indices))


def _video_processor(processor: Any) -> Any:
    vp = getattr(processor, "video_processor", processor)
    if vp is None or not hasattr(vp, "sample_frames"):
        raise InternalCheckError(
            f"{type(processor).__name__} has no video processor: build the processor with one "
            '(transformers video processors need torchvision: pip install "vlm-pack[video]").'
        )
    return vp


def _settings(vp: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs ``preprocess`` runs with: each ``valid_kwargs`` key from the instance, then overrides."""
    names = getattr(vp.valid_kwargs, "__annotations__", {})
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise InternalCheckError(f"{type(vp).__name__} takes no video kwargs {unknown}; valid: {sorted(names)}.")
    settings = {name: getattr(vp, name, None) for name in names}
    settings.update(overrides)
    return settings


def _sample(vp: Any, header: VideoHeader, settings: dict[str, Any]) -> tuple[list[int], Any]:
    """(kept indices, the metadata the processor saw, ``frames_indices`` set when it sampled)."""
    metadata = header.metadata()
    if not settings.get("do_sample_frames"):
        return list(range(header.frames)), metadata
    kwargs = {k: v for k, v in settings.items() if k not in _NOT_SAMPLING}
    try:
        indices = vp.sample_frames(metadata=metadata, **kwargs)
    except (ValueError, ZeroDivisionError, RuntimeError) as exc:
        raise ValueError(
            f"{type(vp).__name__} cannot sample frames of a {header.frames}-frame clip at {header.fps:g} fps "
            f"({exc}); change fps / num_frames / min_frames, or drop the sample."
        ) from exc
    indices = [int(i) for i in indices]
    metadata.frames_indices = indices
    return indices, metadata


def sampled_frames(header: VideoHeader, video_processor: Any, **videos_kwargs: Any) -> list[int]:
    """Indices of the frames the video processor keeps from a clip with this header.

    With the processor's ``do_sample_frames`` on (or passed in ``videos_kwargs``), its own public
    ``sample_frames`` is called with :meth:`VideoHeader.metadata` and the settings ``preprocess`` would
    bind (transformers/video_processing_utils.py ``BaseVideoProcessor.preprocess``); otherwise every frame.
    ``video_processor`` may be a full processor carrying one.
    """
    vp = _video_processor(video_processor)
    return _sample(vp, header, _settings(vp, videos_kwargs))[0]
