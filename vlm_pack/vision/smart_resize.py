"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4.1V: dynamic resolution by ``smart_resize``.

One rule serves the four families: each side is rounded to a multiple of ``patch_size * merge_size`` and the
area is scaled into ``[min_pixels, max_pixels]``; tokens are the ``merge x merge`` groups of patches::

    Qwen2-VL 1920x1080 (checkpoint min/max pixels):
        smart_resize(1080, 1920, factor=28) -> 1092 x 1932   grid (t, h, w) = (1, 78, 138)
        num_patches = 78 * 138 = 10764      num_tokens = 10764 / 2**2 = 2691      wrapper_tokens = 2

Videos share the frame grid: ``grid_t = ceil(frames / temporal_patch_size)`` and the same merge; the
families differ only in how frames are sampled and how the frame count enters the pixel budget
(Qwen2-VL: 2-D ``smart_resize`` per frame; Qwen3-VL and GLM-4.1V: the 3-D ``smart_resize`` below).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .spec import _check_size, _ResizedSpec


def _aspect_error(family: str, height: int, width: int) -> ValueError:
    return ValueError(
        f"{family}: image {width}x{height} (width x height) has aspect ratio "
        f"{max(height, width) / min(height, width):.1f}; the processor's smart_resize rejects "
        "max(h, w) / min(h, w) > 200. Crop or pad the image, or drop the sample."
    )


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
    *,
    family: str = "qwen2_vl",
) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: the resized ``(height, width)``, both multiples of ``factor``.

    Same float64 operations in the same order as
    ``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize``; raises ``ValueError``
    where it does (aspect ratio above 200).
    """
    if max(height, width) / min(height, width) > 200:
        raise _aspect_error(family, height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    return fit_pixel_budget(height, width, h_bar, w_bar, factor, min_pixels, max_pixels)


def fit_pixel_budget(
    height: int, width: int, h_bar: int, w_bar: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``smart_resize``'s budget step, shared by the families that resize this way (Qwen-VL, LFM2-VL): the
    rounded ``(h_bar, w_bar)`` scaled down (floor) into ``max_pixels`` or up (ceil) to ``min_pixels``, keeping
    the aspect ratio and multiples of ``factor``, in transformers' float64 order of operations."""
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _smart_resize_3d(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    family: str,
) -> tuple[int, int]:
    """Qwen3-VL video / GLM-4.1V ``smart_resize``: frames count in the pixel budget, small sides upscale."""
    if num_frames < temporal_factor:
        raise ValueError(
            f"{family}: {num_frames} frame(s) is fewer than the temporal patch size {temporal_factor}; "
            "the processor's smart_resize requires num_frames >= temporal_patch_size."
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise _aspect_error(family, height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class _QwenStyleSpec(_ResizedSpec):
    """Shared parameters and image rules of the Qwen-VL style families (dynamic resolution)."""

    patch_size: int = 14
    """Side of a ViT patch in pixels (preprocessor_config.json ``patch_size``)."""
    merge_size: int = 2
    """Patches merged along each side into one token (``merge_size``)."""
    temporal_patch_size: int = 2
    """Frames in one temporal patch; an image is repeated to fill it (``temporal_patch_size``)."""
    min_pixels: int = 56 * 56
    """Smallest resized area in pixels (``size["shortest_edge"]``, ``min_pixels`` in older configs)."""
    max_pixels: int = 28 * 28 * 16384
    """Largest resized area in pixels (``size["longest_edge"]``, ``max_pixels`` in older configs)."""
    wrapper_tokens: int = 2
    """Special tokens around each image: ``<|vision_start|>`` / ``<|vision_end|>`` and the like."""

    family: ClassVar[str] = "qwen2_vl"

    def __post_init__(self) -> None:
        self._check_positive("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` the processor resizes the image to."""
        width, height = _check_size(self.family, width, height)
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels, family=self.family)
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` row of one image: ``(1, resized_h / patch, resized_w / patch)``."""
        w, h = self.resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        w, h = self.resized_size(width, height)
        # Both sides are multiples of patch * merge: the merge divides each side exactly.
        return (h // self.factor) * (w // self.factor)


@dataclass(frozen=True)
class _QwenVideoSpec(_QwenStyleSpec):
    """The video rule Qwen2-VL and Qwen3-VL share; subclasses say how frames are sampled and resized.

    The video fields' defaults are Qwen2-VL's: its released checkpoints ship no
    video_preprocessor_config.json, so the video processor loads preprocessor_config.json, hence the same
    pixel bounds as images.
    """

    video_min_pixels: int = 3136
    """Smallest resized frame area in pixels, or frames x area under the 3-D rule (video processor
    ``size["shortest_edge"]``)."""
    video_max_pixels: int = 12845056
    """Largest resized frame area in pixels, or frames x area under the 3-D rule (video processor
    ``size["longest_edge"]``)."""
    do_sample_frames: bool = False
    """The video processor samples frames at ``fps`` from the decoded clip itself; off, the frames reach it
    as given (``do_sample_frames``)."""
    fps: float = 2.0
    """Frames per second kept when sampling (``fps``)."""
    min_frames: int = 4
    """Fewest frames sampling keeps (``min_frames``)."""
    max_frames: int = 768
    """Most frames sampling keeps (``max_frames``)."""

    @abc.abstractmethod
    def sample_frames(self, total_frames: int, video_fps: float, fps: float | None = None) -> int:
        """Frames the video processor keeps from a ``total_frames`` clip decoded at ``video_fps``."""

    @abc.abstractmethod
    def _video_resize(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Resized ``(height, width)`` of every frame of a ``num_frames``-frame video."""

    def video_grid(
        self,
        num_frames: int,
        width: int,
        height: int,
        *,
        video_fps: float | None = None,
        fps: float | None = None,
    ) -> tuple[int, int, int]:
        """``video_grid_thw`` row of one video of ``num_frames`` frames of ``width x height``.

        With ``do_sample_frames`` on and ``video_fps`` given, ``num_frames`` is the decoded clip's length
        and the processor's fps sampling is applied first; otherwise the frames reach the processor as given.
        The last temporal group is completed by repeating the last frame: ``grid_t = ceil(frames / tps)``.
        """
        if num_frames <= 0:
            raise ValueError(f"{self.family}: a video needs at least one frame, got {num_frames}.")
        width, height = _check_size(self.family, width, height)
        if self.do_sample_frames and video_fps is not None:
            num_frames = self.sample_frames(num_frames, video_fps, fps)
        h, w = self._video_resize(num_frames, height, width)
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t, h // self.patch_size, w // self.patch_size

    def num_video_tokens(self, num_frames: int, width: int, height: int, **kwargs: Any) -> int:
        """``<|video_pad|>`` tokens of one video (the wrappers are in the family's docstring)."""
        t, h, w = self.video_grid(num_frames, width, height, **kwargs)
        return t * h * w // (self.merge_size * self.merge_size)


@dataclass(frozen=True)
class Qwen2VLSpec(_QwenVideoSpec):
    """Qwen2-VL and Qwen2.5-VL (``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor``).

    Images: ``smart_resize(h, w, factor=patch*merge)``; grid ``(1, H/patch, W/patch)``;
    tokens ``= grid_h * grid_w / merge**2`` ``<|image_pad|>`` between ``<|vision_start|>`` and
    ``<|vision_end|>`` (``wrapper_tokens = 2``).

    Videos: frames as given to the processor (``do_sample_frames`` is off in the released checkpoints),
    each resized with the same 2-D ``smart_resize`` under ``video_min_pixels`` / ``video_max_pixels``;
    ``grid_t = ceil(frames / temporal_patch_size)`` (the last frame is repeated).
    """

    # Qwen/Qwen2-VL-7B-Instruct preprocessor_config.json (Qwen2.5-VL's are the same).
    patch_size: int = 14
    min_pixels: int = 3136
    max_pixels: int = 12845056
    variant: str = "qwen2_vl"
    """``"qwen2_vl"`` or ``"qwen2_5_vl"``: the family name the spec reports."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in ("qwen2_vl", "qwen2_5_vl"):
            raise ValueError(f"Qwen2VLSpec.variant must be 'qwen2_vl' or 'qwen2_5_vl', got {self.variant!r}.")

    @property  # type: ignore[override]
    def family(self) -> str:
        """``"qwen2_vl"`` or ``"qwen2_5_vl"``: both share every image and video rule."""
        return self.variant

    def sample_frames(self, total_frames: int, video_fps: float, fps: float | None = None) -> int:
        """Frames ``Qwen2VLVideoProcessor.sample_frames`` keeps from a ``total_frames`` clip at ``video_fps``."""
        tps = self.temporal_patch_size
        fps = self.fps if fps is None else fps
        max_frames = math.floor(min(self.max_frames, total_frames) / tps) * tps
        num_frames = total_frames / video_fps * fps
        num_frames = min(max(num_frames, self.min_frames), max_frames, total_frames)
        num_frames = math.floor(num_frames / tps) * tps
        if num_frames > total_frames:
            raise ValueError(
                f"{self.family}: cannot sample {num_frames} frames from a {total_frames}-frame video; "
                "decrease fps or min_frames."
            )
        if num_frames <= 0:
            raise ValueError(
                f"{self.family}: frame sampling keeps no frame of a {total_frames}-frame video "
                f"(temporal_patch_size {tps}); the processor fails on it."
            )
        # torch.arange(0, total, total / n) has ceil(total / (total / n)) elements (float64 step).
        return len(np.arange(0, total_frames, total_frames / num_frames))

    def _video_resize(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        # Each frame is resized on its own: the frame count does not enter the pixel budget.
        return smart_resize(
            height, width, self.factor, self.video_min_pixels, self.video_max_pixels, family=self.family
        )


@dataclass(frozen=True)
class Qwen3VLSpec(_QwenVideoSpec):
    """Qwen3-VL: Qwen2-VL's image rule with patch 16 (factor 32); its own video processor.

    Videos (``Qwen3VLVideoProcessor``): ``do_sample_frames`` is on: from a clip of ``T`` frames at
    ``video_fps``, ``n = clamp(int(T / video_fps * fps), min_frames, min(max_frames, T))`` frames at
    ``linspace(0, T-1, n).round()``; a 3-D ``smart_resize`` counts ``round(n / 2) * 2`` frames against
    ``video_max_pixels`` and upscales sides below 32 px; ``grid_t = ceil(n / 2)``. Each temporal group is
    wrapped as ``<{t:.1f} seconds><|vision_start|>`` + ``<|video_pad|>`` * (h*w/4) + ``<|vision_end|>``, so
    the wrapper is 2 special tokens plus the tokenized timestamp text per group (see
    :meth:`video_timestamps`).
    """

    family: ClassVar[str] = "qwen3_vl"

    # Qwen/Qwen3-VL-*-Instruct preprocessor_config.json.
    patch_size: int = 16
    min_pixels: int = 65536
    max_pixels: int = 16777216
    # Qwen/Qwen3-VL-*-Instruct video_preprocessor_config.json.
    video_min_pixels: int = 4096
    video_max_pixels: int = 25165824
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    """Cap each frame at ``max_video_tokens`` tokens within the clip's pixel budget; off in the released
    checkpoints (``cap_pixels_per_frame``)."""
    max_video_tokens: int = 768
    """Tokens per frame the cap allows (``max_video_tokens``)."""

    def sample_frame_indices(
        self, total_frames: int, video_fps: float, fps: float | None = None
    ) -> np.ndarray:
        """Indices ``Qwen3VLVideoProcessor.sample_frames`` keeps: int64 ``(n,)``."""
        if total_frames <= 0:
            raise ValueError(f"{self.family}: a video needs at least one frame, got {total_frames}.")
        fps = self.fps if fps is None else fps
        num_frames = int(total_frames / video_fps * fps)
        num_frames = min(max(num_frames, self.min_frames), self.max_frames, total_frames)
        return np.linspace(0, total_frames - 1, num_frames).round().astype(int)

    def video_timestamps(self, total_frames: int, video_fps: float, fps: float | None = None) -> list[float]:
        """Seconds printed as ``<{t:.1f} seconds>`` before each temporal group (``Qwen3VLProcessor``)."""
        indices = self.sample_frame_indices(total_frames, video_fps, fps).tolist()
        tps = self.temporal_patch_size
        if len(indices) % tps != 0:
            indices.extend(indices[-1] for _ in range(tps - len(indices) % tps))
        stamps = [idx / video_fps for idx in indices]
        return [(stamps[i] + stamps[i + tps - 1]) / 2 for i in range(0, len(stamps), tps)]

    def sample_frames(self, total_frames: int, video_fps: float, fps: float | None = None) -> int:
        """How many frames :meth:`sample_frame_indices` keeps."""
        return len(self.sample_frame_indices(total_frames, video_fps, fps))

    def _video_resize(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        factor = self.factor
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, max_pixels // num_frames), int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return _smart_resize_3d(
            num_frames,
            height,
            width,
            self.temporal_patch_size,
            factor,
            self.video_min_pixels,
            max_pixels,
            self.family,
        )


_GLM_VARIANTS = ("glm4v", "glm4v_moe", "glm46v")


@dataclass(frozen=True)
class Qwen3_5Spec(Qwen3VLSpec):
    """Qwen3.5 / 3.6: ``Qwen3VLProcessor`` with Qwen3-VL's image and video rules and settings
    (Qwen/Qwen3.5-27B preprocessor_config.json: patch 16, merge 2, temporal 2, 65536..16777216 pixels)."""

    family: ClassVar[str] = "qwen3_5"


@dataclass(frozen=True)
class Qwen3_5MoeSpec(Qwen3VLSpec):
    """Qwen3.5 / 3.6 mixture-of-experts (Qwen/Qwen3.5-35B-A3B): the rules and settings of :class:`Qwen3_5Spec`."""

    family: ClassVar[str] = "qwen3_5_moe"


@dataclass(frozen=True)
class Glm4vSpec(_QwenStyleSpec):
    """GLM-4.1V-Thinking (``Glm4vImageProcessor``): 3-D ``smart_resize`` with ``num_frames = 2``.

    An image counts as ``temporal_patch_size`` frames in the pixel budget, and sides below
    ``patch*merge`` are first upscaled (``int(side * scale)``). Tokens ``= grid_h * grid_w / merge**2``
    between ``<|begin_of_image|>`` and ``<|end_of_image|>``.
    """

    # THUDM/GLM-4.1V-9B-Thinking preprocessor_config.json (and zai-org/GLM-4.5V's, GLM-4.6V's).
    patch_size: int = 14
    min_pixels: int = 12544
    max_pixels: int = 9633792
    variant: str = "glm4v"
    """``"glm4v"``, ``"glm4v_moe"`` (GLM-4.5V) or ``"glm46v"`` (GLM-4.6V): the family name the spec reports."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in _GLM_VARIANTS:
            raise ValueError(f"Glm4vSpec.variant must be one of {_GLM_VARIANTS}, got {self.variant!r}.")

    @property  # type: ignore[override]
    def family(self) -> str:
        """The GLM release: all three share the GLM-4.1V image rule."""
        return self.variant

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        width, height = _check_size(self.family, width, height)
        tps = self.temporal_patch_size
        h, w = _smart_resize_3d(
            tps, height, width, tps, self.factor, self.min_pixels, self.max_pixels, self.family
        )
        return w, h
