"""Exact vision-token forecasts from image sizes, and image sizes from file headers.

To fill a packing bin, the packer must know how many tokens each sample becomes *before* any image is
decoded. That count is a pure function of the image's ``(width, height)`` and the processor's parameters,
but every family has its own resize / tiling rule, and approximations under-forecast: an under-forecast
overflows the bin at training time. This module reproduces each Hugging Face processor's rule, float64
operation for float64 operation (Python ``round`` is half-to-even), so that the forecast equals what the
processor produces, for every size the processor accepts, and raises ``ValueError`` where it fails::

    image bytes --image_size()--> (width, height) --spec.num_tokens()--> placeholder tokens
      (header only,                                 + spec.wrapper_tokens    (<|vision_start|> ...)
       EXIF-aware)                                  spec.num_patches()       (ViT patches, 2nd budget)

    Qwen2-VL 1920x1080 (checkpoint min/max pixels):
        smart_resize(1080, 1920, factor=28) -> 1092 x 1932   grid (t, h, w) = (1, 78, 138)
        num_patches = 78 * 138 = 10764      num_tokens = 10764 / 2**2 = 2691      wrapper_tokens = 2

    InternVL 640x480, 448 px tiles, 1..12 tiles:
        +-----+-----+-----+-----+
        |  1  |  2  |  3  |  4  |     grid 4 x 3 = 12 tiles + 1 thumbnail = 13 tiles
        +-----+-----+-----+-----+     num_tokens = 13 * 256 = 3328 (<IMG_CONTEXT>)
        |  5  |  6  |  7  |  8  |     wrapper_tokens = 2 (<img>, </img>)
        +-----+-----+-----+-----+
        |  9  | 10  | 11  | 12  |  + [thumb]
        +-----+-----+-----+-----+

Vocabulary used throughout:

- ``num_tokens(width, height)``: the placeholder tokens the language model sees for one image (the tokens a
  processor's ``replace_image_token`` repeats: ``<|image_pad|>``, ``<image>``, ``<IMG_CONTEXT>``, ...;
  LLaVA-NeXT's image-newline features are image features and are counted here);
- ``wrapper_tokens``: special tokens around each image that are *not* placeholders (``<|vision_start|>`` /
  ``<|vision_end|>``, ``<img>`` / ``</img>``); ``extra_tokens(width, height)`` generalises it where the
  wrapper depends on the size (Idefics3 tile markers, Pixtral row breaks); ``total_tokens`` is the sum;
- ``num_patches(width, height)``: vision-encoder patch embeddings before any merge / pooling (class tokens
  excluded), i.e. ``pixel_values`` rows for Qwen: the second budget, for ViT memory;
- ``tiles(width, height)``: the crops the vision encoder sees (thumbnail / base image included).

Every spec is a frozen dataclass whose defaults are the released checkpoint's ``preprocessor_config.json``
(constructor defaults in transformers often differ: Qwen2-VL's default ``max_pixels`` is 1003520, the
checkpoint's 12845056). Build one with :func:`vision_spec` (family name and overrides) or
:func:`vision_spec_from_processor` (a live HF image processor / processor).

EXIF: transformers' ``load_image`` (used when a processor or chat template is given a path, URL or base64
string) applies ``PIL.ImageOps.exif_transpose``, so a JPEG stored as 4000x3000 with orientation 6 reaches
the processor as 3000x4000. :func:`image_size` therefore honours orientations 5-8 by default; pass
``exif_transpose=False`` when your pipeline hands ``PIL.Image.open(...)`` results to the processor without
transposing them (WebDataset's PIL decoder, Megatron-Energon), because then the stored size is what the
processor sees. The rule is the same for every family: it belongs to the loader, not to the processor.
"""

from __future__ import annotations

import abc
import io
import math
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, BinaryIO, ClassVar, Union

import numpy as np

__all__ = [
    "FAMILIES",
    "Gemma3Spec",
    "Glm4vSpec",
    "Idefics3Spec",
    "ImageSource",
    "InternVLSpec",
    "LlavaNextSpec",
    "LlavaOnevisionSpec",
    "LlavaSpec",
    "MegatronSpec",
    "PixtralSpec",
    "Qwen2VLSpec",
    "Qwen3VLSpec",
    "VisionSpec",
    "image_size",
    "smart_resize",
    "vision_spec",
    "vision_spec_from_processor",
]

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]


# ----------------------------------------------------------------------------------------------------------
# Size validation
# ----------------------------------------------------------------------------------------------------------


def _as_pixels(family: str, name: str, value: Any) -> int:
    # bool is an int subclass; a size of True is a bug upstream, not one pixel.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{family}: image {name} must be an integer number of pixels, got {value!r}.")
    value = int(value)
    if value <= 0:
        raise ValueError(
            f"{family}: image {name} must be a positive number of pixels, got {value}; "
            "check the image header (see vlm_pack.vision.image_size)."
        )
    return value


def _check_size(family: str, width: Any, height: Any) -> tuple[int, int]:
    if type(width) is int and type(height) is int and width > 0 and height > 0:  # the common case, fast
        return width, height
    return _as_pixels(family, "width", width), _as_pixels(family, "height", height)


class VisionSpec(abc.ABC):
    """Token and patch forecast for one image of one VLM family.

    Subclasses are frozen dataclasses; all methods are pure functions of ``(width, height)``. Sizes are the
    size the processor sees (after EXIF transposition, see :func:`image_size`).
    """

    family: str
    wrapper_tokens: int

    @abc.abstractmethod
    def num_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens the language model sees for one image (wrappers excluded)."""

    @abc.abstractmethod
    def num_patches(self, width: int, height: int) -> int:
        """Vision-encoder patch embeddings for one image, before merging or pooling (no class tokens)."""

    @abc.abstractmethod
    def tiles(self, width: int, height: int) -> int:
        """Crops fed to the vision encoder for one image (thumbnail / base image included)."""

    def extra_tokens(self, width: int, height: int) -> int:
        """Non-placeholder tokens around one image; ``wrapper_tokens`` unless the family's depend on size."""
        _check_size(self.family, width, height)
        return self.wrapper_tokens

    def total_tokens(self, width: int, height: int) -> int:
        """``num_tokens + extra_tokens``: every token one image adds to the sequence."""
        return self.num_tokens(width, height) + self.extra_tokens(width, height)

    def sample_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Placeholder tokens of each image of ONE sample given as ``(width, height)`` pairs.

        Equal to ``[num_tokens(w, h) ...]`` except for families whose rule depends on the number of images
        in the sample (LLaVA-OneVision drops anyres tiling for multi-image samples).
        """
        return [self.num_tokens(w, h) for w, h in sizes]

    def num_tokens_batch(self, widths: Iterable[int], heights: Iterable[int]) -> np.ndarray:
        """``num_tokens`` for many images: int64 array ``(N,)``; computed once per distinct size."""
        return self._batch(self.num_tokens, widths, heights)

    def num_patches_batch(self, widths: Iterable[int], heights: Iterable[int]) -> np.ndarray:
        """``num_patches`` for many images: int64 array ``(N,)``; computed once per distinct size."""
        return self._batch(self.num_patches, widths, heights)

    @staticmethod
    def _batch(fn: Callable[[int, int], int], widths: Iterable[int], heights: Iterable[int]) -> np.ndarray:
        w = np.asarray(widths if isinstance(widths, np.ndarray) else list(widths))
        h = np.asarray(heights if isinstance(heights, np.ndarray) else list(heights))
        if w.shape != h.shape or w.ndim != 1:
            raise ValueError(f"widths and heights must be 1-D of equal length, got {w.shape} and {h.shape}.")
        if w.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not (np.issubdtype(w.dtype, np.integer) and np.issubdtype(h.dtype, np.integer)):
            raise TypeError(f"widths and heights must be integer arrays, got {w.dtype} and {h.dtype}.")
        pairs, inverse = np.unique(np.stack([w, h], axis=1), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        out = np.empty(len(pairs), dtype=np.int64)
        for k, (a, b) in enumerate(pairs.tolist()):
            try:
                out[k] = fn(a, b)
            except (ValueError, TypeError) as e:
                first = int(np.flatnonzero(inverse == k)[0])
                raise type(e)(f"image {first} ({a}x{b}): {e}") from None
        return out[inverse]

    def to_dict(self) -> dict[str, Any]:
        """The spec's parameters (family included), e.g. for logging next to a packing plan."""
        out: dict[str, Any] = {"family": self.family}
        for f in fields(self):  # type: ignore[arg-type]
            out[f.name] = getattr(self, f.name)
        return out


# ----------------------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4.1V: dynamic resolution, smart_resize
# ----------------------------------------------------------------------------------------------------------


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


class _ResizedSpec(VisionSpec):
    """One crop, resized to whole patches: families whose patches follow from ``resized_size``."""

    patch_size: int

    @abc.abstractmethod
    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` the processor resizes the image to (multiples of ``patch_size``)."""

    def num_patches(self, width: int, height: int) -> int:
        w, h = self.resized_size(width, height)
        return (h // self.patch_size) * (w // self.patch_size)

    def tiles(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        return 1


@dataclass(frozen=True)
class _QwenStyleSpec(_ResizedSpec):
    """Shared parameters and image rules of the Qwen-VL style families (dynamic resolution)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384
    wrapper_tokens: int = 2

    family: ClassVar[str] = "qwen2_vl"

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{self.family}: {name} must be a positive integer, got {value!r}.")

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
class Qwen2VLSpec(_QwenStyleSpec):
    """Qwen2-VL and Qwen2.5-VL (``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor``).

    Images: ``smart_resize(h, w, factor=patch*merge)``; grid ``(1, H/patch, W/patch)``;
    tokens ``= grid_h * grid_w / merge**2`` ``<|image_pad|>`` between ``<|vision_start|>`` and
    ``<|vision_end|>`` (``wrapper_tokens = 2``).

    Videos: frames as given to the processor (``do_sample_frames`` is off in the released checkpoints),
    each resized with the same 2-D ``smart_resize`` under ``video_min_pixels`` / ``video_max_pixels``;
    ``grid_t = ceil(frames / temporal_patch_size)`` (the last frame is repeated).
    """

    patch_size: int = 14
    min_pixels: int = 3136
    max_pixels: int = 12845056
    # Released Qwen2-VL / Qwen2.5-VL checkpoints ship no video_preprocessor_config.json: the video
    # processor loads preprocessor_config.json, hence the same pixel bounds as images.
    video_min_pixels: int = 3136
    video_max_pixels: int = 12845056
    do_sample_frames: bool = False
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    variant: str = "qwen2_vl"

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

        With ``do_sample_frames=True`` and ``video_fps`` given, ``num_frames`` is the decoded clip's length
        and the processor's fps sampling is applied first; otherwise the frames are taken as given.
        """
        if num_frames <= 0:
            raise ValueError(f"{self.family}: a video needs at least one frame, got {num_frames}.")
        width, height = _check_size(self.family, width, height)
        if self.do_sample_frames and video_fps is not None:
            num_frames = self.sample_frames(num_frames, video_fps, fps)
        h, w = smart_resize(
            height, width, self.factor, self.video_min_pixels, self.video_max_pixels, family=self.family
        )
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t, h // self.patch_size, w // self.patch_size

    def num_video_tokens(self, num_frames: int, width: int, height: int, **kwargs: Any) -> int:
        """``<|video_pad|>`` tokens of one video (plus ``wrapper_tokens`` around the whole video)."""
        t, h, w = self.video_grid(num_frames, width, height, **kwargs)
        return t * h * w // (self.merge_size * self.merge_size)


@dataclass(frozen=True)
class Qwen3VLSpec(_QwenStyleSpec):
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

    patch_size: int = 16
    min_pixels: int = 65536
    max_pixels: int = 16777216
    # Qwen/Qwen3-VL-*-Instruct video_preprocessor_config.json.
    video_min_pixels: int = 4096
    video_max_pixels: int = 25165824
    do_sample_frames: bool = True
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

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

    def video_grid(
        self,
        num_frames: int,
        width: int,
        height: int,
        *,
        video_fps: float | None = None,
        fps: float | None = None,
    ) -> tuple[int, int, int]:
        """``video_grid_thw`` row of one video.

        With ``video_fps`` (and ``do_sample_frames``), ``num_frames`` is the decoded clip's length and the
        processor's sampling is applied; without it, ``num_frames`` frames reach the processor unsampled.
        """
        if num_frames <= 0:
            raise ValueError(f"{self.family}: a video needs at least one frame, got {num_frames}.")
        width, height = _check_size(self.family, width, height)
        if self.do_sample_frames and video_fps is not None:
            num_frames = len(self.sample_frame_indices(num_frames, video_fps, fps))
        factor = self.factor
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            per_frame = max(min(frame_cap, max_pixels // num_frames), int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        h, w = _smart_resize_3d(
            num_frames,
            height,
            width,
            self.temporal_patch_size,
            factor,
            self.video_min_pixels,
            max_pixels,
            self.family,
        )
        grid_t = (num_frames + -num_frames % self.temporal_patch_size) // self.temporal_patch_size
        return grid_t, h // self.patch_size, w // self.patch_size

    def num_video_tokens(self, num_frames: int, width: int, height: int, **kwargs: Any) -> int:
        """``<|video_pad|>`` tokens of one video (wrappers: 2 per temporal group + timestamp text)."""
        t, h, w = self.video_grid(num_frames, width, height, **kwargs)
        return t * h * w // (self.merge_size * self.merge_size)


@dataclass(frozen=True)
class Glm4vSpec(_QwenStyleSpec):
    """GLM-4.1V-Thinking (``Glm4vImageProcessor``): 3-D ``smart_resize`` with ``num_frames = 2``.

    An image counts as ``temporal_patch_size`` frames in the pixel budget, and sides below
    ``patch*merge`` are first upscaled (``int(side * scale)``). Tokens ``= grid_h * grid_w / merge**2``
    between ``<|begin_of_image|>`` and ``<|end_of_image|>``.
    """

    family: ClassVar[str] = "glm4v"

    patch_size: int = 14
    min_pixels: int = 12544
    max_pixels: int = 9633792

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        width, height = _check_size(self.family, width, height)
        tps = self.temporal_patch_size
        h, w = _smart_resize_3d(
            tps, height, width, tps, self.factor, self.min_pixels, self.max_pixels, self.family
        )
        return w, h


# ----------------------------------------------------------------------------------------------------------
# LLaVA-1.5, LLaVA-NeXT (anyres), LLaVA-OneVision (anyres_max_9)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlavaSpec(VisionSpec):
    """LLaVA-1.5: every image is resized and center-cropped to ``crop_size``: a fixed token count.

    ``(crop_h // patch) * (crop_w // patch) + num_additional_image_tokens``, minus one when
    ``vision_feature_select_strategy == "default"`` drops the CLS feature: 576 for llava-1.5 (336 px, 14 px
    patches, CLS dropped).
    """

    family: ClassVar[str] = "llava"

    crop_height: int = 336
    crop_width: int = 336
    patch_size: int = 14
    num_additional_image_tokens: int = 1
    vision_feature_select_strategy: str = "default"
    wrapper_tokens: int = 0

    def num_tokens(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        n = (self.crop_height // self.patch_size) * (self.crop_width // self.patch_size)
        n += self.num_additional_image_tokens
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    def num_patches(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        return (self.crop_height // self.patch_size) * (self.crop_width // self.patch_size)

    def tiles(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        return 1


def select_best_resolution(original_size: tuple[int, int], possible_resolutions: Sequence) -> tuple[int, int]:
    """``transformers.image_processing_utils.select_best_resolution``: best pinpoint ``(height, width)``."""
    original_height, original_width = original_size
    best_fit = None
    max_effective_resolution = 0
    min_wasted_resolution = float("inf")
    for height, width in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = int(original_width * scale), int(original_height * scale)
        effective_resolution = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted_resolution = (width * height) - effective_resolution
        if effective_resolution > max_effective_resolution or (
            effective_resolution == max_effective_resolution and wasted_resolution < min_wasted_resolution
        ):
            max_effective_resolution = effective_resolution
            min_wasted_resolution = wasted_resolution
            best_fit = (height, width)
    if best_fit is None:
        raise ValueError(f"no pinpoint fits an image of {original_width}x{original_height} (width x height).")
    return best_fit


def _unpadded_features(
    height: int,
    width: int,
    patches_height: int,
    patches_width: int,
    scale_height: int,
    scale_width: int,
    max_num_patches: int | None = None,
) -> tuple[int, int]:
    """``_get_unpadded_features`` of LLaVA-NeXT (and, with ``max_num_patches``, of LLaVA-OneVision).

    Returns the image features left after trimming the padded side, and the number of newline features.
    """
    current_height = patches_height * scale_height
    current_width = patches_width * scale_width
    original_aspect_ratio = width / height
    current_aspect_ratio = current_width / current_height
    if original_aspect_ratio > current_aspect_ratio:
        new_height = int(round(height * (current_width / width), 7))
        padding = (current_height - new_height) // 2
        current_height -= padding * 2
    else:
        new_width = int(round(width * (current_height / height), 7))
        padding = (current_width - new_width) // 2
        current_width -= padding * 2
    unpadded_features = current_height * current_width
    newline_features = current_height
    if max_num_patches is not None:
        ratio = math.sqrt(current_height * current_width / (max_num_patches * patches_height**2))
        if ratio > 1.1:
            unpadded_features = int(current_height // ratio) * int(current_width // ratio)
            newline_features = int(current_height // ratio)
    return unpadded_features, newline_features


def _pinpoints(value: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(h), int(w)) for h, w in value)


_LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
_ONEVISION_PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))


@dataclass(frozen=True)
class LlavaNextSpec(VisionSpec):
    """LLaVA-NeXT / 1.6 (anyres): base image + the best pinpoint's tiles, unpadded, with image newlines.

    ``tokens = unpadded_h * unpadded_w + unpadded_h (newlines) + base`` where the pinpoint
    ``(H, W)`` = ``select_best_resolution``, the feature grid is ``(H/crop*24, W/crop*24)`` for 336 px
    crops and 14 px patches, and the side that the padding made too long is trimmed back to the image's
    aspect ratio; ``base = 24*24 + num_additional_image_tokens``, minus one for the "default" strategy.
    """

    family: ClassVar[str] = "llava_next"

    image_grid_pinpoints: tuple[tuple[int, int], ...] = _LLAVA_NEXT_PINPOINTS
    crop_height: int = 336
    crop_width: int = 336
    patch_size: int = 14
    num_additional_image_tokens: int = 1
    vision_feature_select_strategy: str = "default"
    wrapper_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_grid_pinpoints", _pinpoints(self.image_grid_pinpoints))
        if not self.image_grid_pinpoints:
            raise ValueError(f"{self.family}: image_grid_pinpoints must not be empty.")

    def best_resolution(self, width: int, height: int) -> tuple[int, int]:
        """The pinpoint ``(width, height)`` the image is resized and padded into."""
        width, height = _check_size(self.family, width, height)
        h, w = select_best_resolution((height, width), self.image_grid_pinpoints)
        return w, h

    def _features(self, width: int, height: int) -> int:
        best_w, best_h = self.best_resolution(width, height)
        scale_h, scale_w = best_h // self.crop_height, best_w // self.crop_width
        ph, pw = self.crop_height // self.patch_size, self.crop_width // self.patch_size
        unpadded, newlines = _unpadded_features(height, width, ph, pw, scale_h, scale_w)
        return unpadded + newlines + ph * pw + self.num_additional_image_tokens

    def num_tokens(self, width: int, height: int) -> int:
        n = self._features(width, height)
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    def tiles(self, width: int, height: int) -> int:
        """``pixel_values`` crops: 1 base image + the pinpoint's ``ceil(H/crop) * ceil(W/crop)`` tiles."""
        best_w, best_h = self.best_resolution(width, height)
        return 1 + (-(-best_h // self.crop_height)) * (-(-best_w // self.crop_width))

    def num_patches(self, width: int, height: int) -> int:
        per_tile = (self.crop_height // self.patch_size) * (self.crop_width // self.patch_size)
        return self.tiles(width, height) * per_tile


@dataclass(frozen=True)
class LlavaOnevisionSpec(VisionSpec):
    """LLaVA-OneVision: NeXT's anyres with SigLIP 384 px crops, 27x27 = 729 features, ``anyres_max_9``.

    After unpadding, a feature grid larger than 1.1x the area of 9 crops is shrunk by
    ``r = sqrt(h*w / (9 * 27**2))`` to ``int(h // r) * int(w // r)`` (+ ``int(h // r)`` newlines).
    In a sample with several images, no image is tiled: each gets ``729 + 1`` tokens.
    """

    family: ClassVar[str] = "llava_onevision"

    image_grid_pinpoints: tuple[tuple[int, int], ...] = _ONEVISION_PINPOINTS
    size: int = 384
    num_image_tokens: int = 729
    vision_aspect_ratio: str = "anyres_max_9"
    vision_feature_select_strategy: str = "full"
    patch_size: int = 14
    wrapper_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_grid_pinpoints", _pinpoints(self.image_grid_pinpoints))
        if not self.image_grid_pinpoints:
            raise ValueError(f"{self.family}: image_grid_pinpoints must not be empty.")
        if not self.vision_aspect_ratio.startswith("anyres_max_"):
            raise ValueError(
                f"{self.family}: vision_aspect_ratio must look like 'anyres_max_N', got {self.vision_aspect_ratio!r}."
            )

    def best_resolution(self, width: int, height: int) -> tuple[int, int]:
        """The pinpoint ``(width, height)`` the image is resized and padded into."""
        width, height = _check_size(self.family, width, height)
        h, w = select_best_resolution((height, width), self.image_grid_pinpoints)
        return w, h

    def num_tokens(self, width: int, height: int, *, multi_image: bool = False) -> int:
        """Placeholders of one image; ``multi_image=True`` for an image of a several-image sample."""
        if multi_image:
            _check_size(self.family, width, height)
            n = self.num_image_tokens + 1
        else:
            best_w, best_h = self.best_resolution(width, height)
            scale_h, scale_w = best_h // self.size, best_w // self.size
            side = int(math.sqrt(self.num_image_tokens))
            # str.strip removes characters, not a prefix: the processor parses "anyres_max_9" this way.
            max_num_patches = int(self.vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005
            unpadded, newlines = _unpadded_features(
                height, width, side, side, scale_h, scale_w, max_num_patches=max_num_patches
            )
            n = unpadded + newlines + self.num_image_tokens
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    def sample_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        multi = len(sizes) > 1
        return [self.num_tokens(w, h, multi_image=multi) for w, h in sizes]

    def tiles(self, width: int, height: int, *, multi_image: bool = False) -> int:
        """``pixel_values`` crops: 1 base + the pinpoint's tiles (1, padded to square, when multi-image)."""
        if multi_image:
            _check_size(self.family, width, height)
            return 1
        best_w, best_h = self.best_resolution(width, height)
        return 1 + (-(-best_h // self.size)) * (-(-best_w // self.size))

    def num_patches(self, width: int, height: int, *, multi_image: bool = False) -> int:
        per_tile = (self.size // self.patch_size) ** 2
        return self.tiles(width, height, multi_image=multi_image) * per_tile

    def num_video_tokens(self, num_frames: int, width: int, height: int) -> int:
        """``<video>`` tokens: ``frames * ceil(27/2)**2 + 1`` (2x2 pooled frames + one newline)."""
        _check_size(self.family, width, height)
        if num_frames <= 0:
            raise ValueError(f"{self.family}: a video needs at least one frame, got {num_frames}.")
        pooled = math.ceil(int(math.sqrt(self.num_image_tokens)) / 2)
        return num_frames * pooled * pooled + 1


# ----------------------------------------------------------------------------------------------------------
# InternVL 2 / 2.5 / 3 (GotOcr2 crop_to_patches), Idefics3 / SmolVLM, Gemma 3, Pixtral
# ----------------------------------------------------------------------------------------------------------


def _tile_arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """``get_all_supported_aspect_ratios``: ``(columns, rows)`` grids, stably sorted by tile count."""
    grids = [
        (w, h)
        for w in range(1, max_tiles + 1)
        for h in range(1, max_tiles + 1)
        if min_tiles <= w * h <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


@dataclass(frozen=True)
class InternVLSpec(VisionSpec):
    """InternVL 2 / 2.5 / 3 (``GotOcr2ImageProcessor`` with ``crop_to_patches``; original
    ``dynamic_preprocess``).

    Among grids ``(cols, rows)`` with ``min_tiles <= cols*rows <= max_tiles`` (sorted by tile count), take
    the one whose ``cols/rows`` is closest to ``width/height``; on an exact tie a later grid wins while
    ``width*height > 0.5 * tile**2 * cols*rows``. Tiles ``= cols*rows`` plus a thumbnail when that is not 1;
    tokens ``= image_seq_length * tiles`` ``<IMG_CONTEXT>`` inside ``<img>...</img>``.
    """

    family: ClassVar[str] = "internvl"

    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    crop_to_patches: bool = True
    use_thumbnail: bool = True
    image_seq_length: int = 256
    patch_size: int = 14
    wrapper_tokens: int = 2

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """``(columns, rows)`` of the tiling (``(1, 1)`` when the image is not cropped)."""
        width, height = _check_size(self.family, width, height)
        if not (self.crop_to_patches and self.max_tiles > 1):
            return 1, 1
        aspect_ratio = width / height
        area = width * height
        best_ratio_diff = float("inf")
        best_grid = (1, 1)
        for grid in _tile_arrangements(self.min_tiles, self.max_tiles):
            ratio_diff = abs(aspect_ratio - grid[0] / grid[1])
            if ratio_diff < best_ratio_diff:
                best_ratio_diff = ratio_diff
                best_grid = grid
            elif (
                ratio_diff == best_ratio_diff
                and area > 0.5 * self.tile_size * self.tile_size * grid[0] * grid[1]
            ):
                best_grid = grid
        return best_grid

    def tiles(self, width: int, height: int) -> int:
        cols, rows = self.tile_grid(width, height)
        n = cols * rows
        return n + 1 if (self.use_thumbnail and n != 1) else n

    def num_tokens(self, width: int, height: int) -> int:
        return self.image_seq_length * self.tiles(width, height)

    def num_patches(self, width: int, height: int) -> int:
        return self.tiles(width, height) * (self.tile_size // self.patch_size) ** 2


_IDEFICS3_MAX_IMAGE_SIZE = 4096  # transformers' MAX_IMAGE_SIZE: "4k resolution as absolute maximum"


def _rescale_to_max_len(height: int, width: int, max_len: int, min_len: int = 1) -> tuple[int, int]:
    """Idefics3 ``_resize_output_size_rescale_to_max_len``: longest side to ``max_len``, other side even."""
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        if height % 2 != 0:
            height += 1
    elif height > width:
        height = max_len
        width = int(height * aspect_ratio)
        if width % 2 != 0:
            width += 1
    return max(height, min_len), max(width, min_len)


def _scale_below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    """Idefics3 ``_resize_output_size_scale_below_upper_bound``."""
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


@dataclass(frozen=True)
class Idefics3Spec(VisionSpec):
    """Idefics3 and SmolVLM: longest side to ``longest_edge``, then split into ``max_image_size`` crops.

    The preprocessing the model sees (``Idefics3ImageProcessor._preprocess``): resize so the longest side is
    ``longest_edge`` (other side rounded up to even, capped at 4096); round both sides up to multiples of
    ``max_image_size`` (the short side via ``int(long / aspect)`` of the resized image); when larger than one
    crop, ``rows x cols`` crops + 1 global image. Each crop gives ``image_seq_len`` ``<image>`` tokens.

    The prompt wraps them in text tokens (``extra_tokens``): per crop ``<fake_token_around_image>
    <row_r_col_c>``, ``\\n`` after each row, ``\\n<fake_token_around_image><global-img>`` ...
    ``<fake_token_around_image>`` around the global image. ``newline_pair_tokens`` is how many tokens the
    tokenizer makes of ``"\\n\\n"`` (1 for the released Llama-3 / SmolLM tokenizers).
    """

    longest_edge: int = 4 * 364
    max_image_size: int = 364
    image_seq_len: int = 169
    do_resize: bool = True
    do_image_splitting: bool = True
    patch_size: int = 14
    newline_pair_tokens: int = 1
    wrapper_tokens: int = 3
    variant: str = "idefics3"

    def __post_init__(self) -> None:
        if self.variant not in ("idefics3", "smolvlm"):
            raise ValueError(f"Idefics3Spec.variant must be 'idefics3' or 'smolvlm', got {self.variant!r}.")

    @property  # type: ignore[override]
    def family(self) -> str:
        """``"idefics3"`` or ``"smolvlm"``: SmolVLM's image processor is Idefics3's."""
        return self.variant

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """``(cols, rows)`` of crops; ``(0, 0)`` when the image is a single crop (as the processor reports)."""
        width, height = _check_size(self.family, width, height)
        if self.do_resize:
            height, width = _rescale_to_max_len(height, width, self.longest_edge)
            height, width = _scale_below_upper_bound(height, width, _IDEFICS3_MAX_IMAGE_SIZE)
        if not self.do_image_splitting:
            return 0, 0
        m = self.max_image_size
        aspect_ratio = width / height
        if width >= height:
            width = math.ceil(width / m) * m
            height = int(width / aspect_ratio)
            height = math.ceil(height / m) * m
        else:
            height = math.ceil(height / m) * m
            width = int(height * aspect_ratio)
            width = math.ceil(width / m) * m
        if height > m or width > m:
            return (width - m) // m + 1, (height - m) // m + 1
        return 0, 0

    def tiles(self, width: int, height: int) -> int:
        cols, rows = self.tile_grid(width, height)
        return cols * rows + 1

    def num_tokens(self, width: int, height: int) -> int:
        return self.image_seq_len * self.tiles(width, height)

    def num_patches(self, width: int, height: int) -> int:
        return self.tiles(width, height) * (self.max_image_size // self.patch_size) ** 2

    def extra_tokens(self, width: int, height: int) -> int:
        """Tile markers and newlines around the ``<image>`` tokens (each special marker one token)."""
        cols, rows = self.tile_grid(width, height)
        if rows == 0:
            return self.wrapper_tokens
        return self.wrapper_tokens + rows * (2 * cols + 1) + (self.newline_pair_tokens - 1)


@dataclass(frozen=True)
class Gemma3Spec(VisionSpec):
    """Gemma 3: every crop is resized to 896x896 and pooled to ``image_seq_length`` (256) tokens.

    Pan-and-scan (off in the released processor) adds crops of very wide / tall images; each crop adds
    another 256 ``<image_soft_token>`` and its own ``<start_of_image>``/``<end_of_image>`` plus text
    (``"Here is the original image ..."``) that must be tokenized. ``wrapper_tokens = 2`` counts the
    ``<start_of_image>``/``<end_of_image>`` pair of the base image; the processor also surrounds it with
    ``"\\n\\n"`` text.
    """

    family: ClassVar[str] = "gemma3"

    image_size: int = 896
    image_seq_length: int = 256
    patch_size: int = 14
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    wrapper_tokens: int = 2

    def num_crops(self, width: int, height: int) -> int:
        """Pan-and-scan crops added to the base image (``num_crops`` in the processor output)."""
        width, height = _check_size(self.family, width, height)
        if not self.do_pan_and_scan:
            return 0
        if width >= height:
            if width / height < self.pan_and_scan_min_ratio_to_activate:
                return 0
            num_crops_w = math.floor(width / height + 0.5)
            num_crops_w = min(math.floor(width / self.pan_and_scan_min_crop_size), num_crops_w)
            num_crops_w = max(2, num_crops_w)
            num_crops_w = min(self.pan_and_scan_max_num_crops, num_crops_w)
            num_crops_h = 1
        else:
            if height / width < self.pan_and_scan_min_ratio_to_activate:
                return 0
            num_crops_h = math.floor(height / width + 0.5)
            num_crops_h = min(math.floor(height / self.pan_and_scan_min_crop_size), num_crops_h)
            num_crops_h = max(2, num_crops_h)
            num_crops_h = min(self.pan_and_scan_max_num_crops, num_crops_h)
            num_crops_w = 1
        crop_size_w = math.ceil(width / num_crops_w)
        crop_size_h = math.ceil(height / num_crops_h)
        if min(crop_size_w, crop_size_h) < self.pan_and_scan_min_crop_size:
            return 0
        return num_crops_w * num_crops_h

    def tiles(self, width: int, height: int) -> int:
        return 1 + self.num_crops(width, height)

    def num_tokens(self, width: int, height: int) -> int:
        return self.image_seq_length * self.tiles(width, height)

    def num_patches(self, width: int, height: int) -> int:
        return self.tiles(width, height) * (self.image_size // self.patch_size) ** 2

    def extra_tokens(self, width: int, height: int) -> int:
        """``<start_of_image>``/``<end_of_image>`` per crop (the surrounding text must be tokenized)."""
        return self.wrapper_tokens * self.tiles(width, height)


@dataclass(frozen=True)
class PixtralSpec(_ResizedSpec):
    """Pixtral: longest side capped at ``longest_edge``, sides rounded up to whole patches.

    ``ratio = max(h / L, w / L)``; above 1 both sides are floored after dividing by it; each side becomes
    ``ceil(side / patch)`` patches. The prompt holds ``rows * cols`` ``[IMG]`` placeholders (patches merged
    by ``spatial_merge_size``) and one ``[IMG_BREAK]`` per row, the last replaced by ``[IMG_END]``
    (``extra_tokens = rows``).
    """

    family: ClassVar[str] = "pixtral"

    patch_size: int = 16
    longest_edge: int = 1024
    spatial_merge_size: int = 1
    wrapper_tokens: int = 0

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` after the processor's resize (multiples of ``patch_size``)."""
        width, height = _check_size(self.family, width, height)
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height = math.floor(height / ratio)
            width = math.floor(width / ratio)
        if height == 0 or width == 0:
            raise ValueError(
                f"{self.family}: an image this elongated shrinks to a side of 0 px when its longest side is "
                f"capped at {self.longest_edge}; the processor cannot resize it. Crop or pad it "
                "(max(h, w) / min(h, w) must stay <= longest_edge)."
            )
        p = self.patch_size * self.spatial_merge_size  # the processor resizes to multiples of patch * merge
        return ((width - 1) // p + 1) * p, ((height - 1) // p + 1) * p

    def token_grid(self, width: int, height: int) -> tuple[int, int]:
        """``(rows, cols)`` of ``[IMG]`` tokens."""
        w, h = self.resized_size(width, height)
        p = self.patch_size * self.spatial_merge_size
        return h // p, w // p

    def num_tokens(self, width: int, height: int) -> int:
        rows, cols = self.token_grid(width, height)
        return rows * cols

    def extra_tokens(self, width: int, height: int) -> int:
        rows, _ = self.token_grid(width, height)
        return rows


# ----------------------------------------------------------------------------------------------------------
# Megatron-LM LLaVA style: fixed tokens per tile
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MegatronSpec(VisionSpec):
    """Megatron-LM / NeMo LLaVA (``clip_vit_model.get_num_image_embeddings``): a fixed count per tile.

    ``per_tile = (img_h // patch) * (img_w // patch) + class_token_len`` (CLIP 1, SigLIP 0, 0 when
    ``--disable-vision-class-token``), times 0.25 with pixel shuffle; ``tokens = tiles * per_tile``.
    Tiles follow InternVL's dynamic tiling when ``max_tiles > 1`` (``use_tiling``), with a thumbnail.
    The input ids hold ONE placeholder (-200) per image, expanded to ``tokens`` embeddings in the model:
    see ``vlm_pack.remap`` for the collapsed -> expanded ``cu_seqlens`` mapping.
    """

    family: ClassVar[str] = "megatron"

    img_h: int = 336
    img_w: int = 336
    patch_dim: int = 14
    class_token_len: int = 1
    disable_vision_class_token: bool = False
    pixel_shuffle: bool = False
    max_tiles: int = 1
    min_tiles: int = 1
    use_thumbnail: bool = True
    wrapper_tokens: int = 0

    @property
    def tokens_per_tile(self) -> int:
        """``get_num_image_embeddings`` for one tile."""
        n = (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)
        if not self.disable_vision_class_token:
            n += self.class_token_len
        if self.pixel_shuffle:
            n = int(n * 0.25)
        return n

    def tiles(self, width: int, height: int) -> int:
        if self.max_tiles <= 1:
            _check_size(self.family, width, height)
            return 1
        tiler = InternVLSpec(
            tile_size=self.img_h,
            min_tiles=self.min_tiles,
            max_tiles=self.max_tiles,
            use_thumbnail=self.use_thumbnail,
        )
        return tiler.tiles(width, height)

    def num_tokens(self, width: int, height: int) -> int:
        return self.tiles(width, height) * self.tokens_per_tile

    def num_patches(self, width: int, height: int) -> int:
        return self.tiles(width, height) * (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)


# ----------------------------------------------------------------------------------------------------------
# Family registry and construction from Hugging Face processors
# ----------------------------------------------------------------------------------------------------------

_SMOLVLM_DEFAULTS = dict(longest_edge=4 * 384, max_image_size=384, image_seq_len=81, variant="smolvlm")

_FAMILY_FACTORIES: dict[str, Callable[..., VisionSpec]] = {
    # Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2_vl": lambda **kw: Qwen2VLSpec(**kw),
    "qwen2_5_vl": lambda **kw: Qwen2VLSpec(**{"variant": "qwen2_5_vl", **kw}),
    # Qwen/Qwen3-VL-8B-Instruct (image and video preprocessor configs)
    "qwen3_vl": lambda **kw: Qwen3VLSpec(**kw),
    # THUDM/GLM-4.1V-9B-Thinking
    "glm4v": lambda **kw: Glm4vSpec(**kw),
    # llava-hf/llava-1.5-7b-hf
    "llava": lambda **kw: LlavaSpec(**kw),
    # llava-hf/llava-v1.6-mistral-7b-hf
    "llava_next": lambda **kw: LlavaNextSpec(**kw),
    # llava-hf/llava-onevision-qwen2-7b-ov-hf
    "llava_onevision": lambda **kw: LlavaOnevisionSpec(**kw),
    # OpenGVLab/InternVL3-8B-hf (also InternVL2 / 2.5: 448 px tiles, 1..12, thumbnail)
    "internvl": lambda **kw: InternVLSpec(**kw),
    # HuggingFaceM4/Idefics3-8B-Llama3
    "idefics3": lambda **kw: Idefics3Spec(**kw),
    # HuggingFaceTB/SmolVLM-Instruct
    "smolvlm": lambda **kw: Idefics3Spec(**{**_SMOLVLM_DEFAULTS, **kw}),
    # google/gemma-3-4b-it
    "gemma3": lambda **kw: Gemma3Spec(**kw),
    # mistral-community/pixtral-12b
    "pixtral": lambda **kw: PixtralSpec(**kw),
    # Megatron-LM LLaVA with CLIP ViT-L/14 @ 336 px
    "megatron": lambda **kw: MegatronSpec(**kw),
}

#: Family names accepted by :func:`vision_spec`.
FAMILIES: tuple[str, ...] = tuple(_FAMILY_FACTORIES)


def _normalize_family(family: str) -> str:
    key = family.strip().lower().replace("-", "_").replace(".", "_")
    aliases = {
        "qwen2vl": "qwen2_vl",
        "qwen25_vl": "qwen2_5_vl",
        "qwen3vl": "qwen3_vl",
        "glm4_1v": "glm4v",
        "llava_1_5": "llava",
        "llava1_5": "llava",
        "llava_1_6": "llava_next",
        "llava_ov": "llava_onevision",
        "internvl2": "internvl",
        "internvl2_5": "internvl",
        "internvl3": "internvl",
        "got_ocr2": "internvl",
    }
    return aliases.get(key, key)


def vision_spec(family: str, **overrides: Any) -> VisionSpec:
    """The spec of ``family`` with its released checkpoint's parameters, ``overrides`` replacing some.

    >>> vision_spec("qwen2_vl").num_tokens(1920, 1080)
    2691
    >>> vision_spec("qwen2_vl", max_pixels=200704).num_tokens(1920, 1080)  # capped at 256 tokens
    252
    """
    key = _normalize_family(family)
    if key not in _FAMILY_FACTORIES:
        raise ValueError(f"Unknown VLM family {family!r}; supported: {', '.join(FAMILIES)}.")
    try:
        return _FAMILY_FACTORIES[key](**overrides)
    except TypeError as e:
        raise TypeError(f"vision_spec({family!r}): {e}") from None


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict, a transformers ``SizeDict`` or an attribute holder."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        value = obj.get(key, default)
    else:
        value = getattr(obj, key, default)
    return default if value is None else value


def _hw(size: Any, what: str) -> tuple[int, int]:
    """``(height, width)`` from a size dict with height/width or shortest_edge."""
    h, w = _get(size, "height"), _get(size, "width")
    if h is not None and w is not None:
        return int(h), int(w)
    se = _get(size, "shortest_edge")
    if se is not None:
        return int(se), int(se)
    raise ValueError(f"cannot read {what} from {size!r}: expected height/width or shortest_edge.")


def _strip_backend(name: str) -> str:
    for suffix in ("Pil", "Fast"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _qwen_video_kwargs(video: Any) -> dict[str, Any]:
    if video is None:
        return {}
    size = _get(video, "size")
    out: dict[str, Any] = {}
    if _get(size, "shortest_edge") is not None:
        out["video_min_pixels"] = int(_get(size, "shortest_edge"))
    if _get(size, "longest_edge") is not None:
        out["video_max_pixels"] = int(_get(size, "longest_edge"))
    for name in (
        "fps",
        "min_frames",
        "max_frames",
        "do_sample_frames",
        "cap_pixels_per_frame",
        "max_video_tokens",
    ):
        value = _get(video, name)
        if value is not None:
            out[name] = value
    return out


_SUPPORTED_PROCESSORS = (
    "Qwen2VLImageProcessor[Pil] (Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor)",
    "Glm4vImageProcessor[Pil] (Glm4vProcessor)",
    "LlavaImageProcessor[Pil] / CLIPImageProcessor (LlavaProcessor)",
    "LlavaNextImageProcessor[Pil] (LlavaNextProcessor)",
    "LlavaOnevisionImageProcessor[Pil] (LlavaOnevisionProcessor)",
    "GotOcr2ImageProcessor[Pil] (InternVLProcessor)",
    "Idefics3ImageProcessor[Pil] (Idefics3Processor)",
    "SmolVLMImageProcessor[Pil] (SmolVLMProcessor)",
    "Gemma3ImageProcessor[Pil] (Gemma3Processor)",
    "PixtralImageProcessor[Pil] (PixtralProcessor)",
)


def vision_spec_from_processor(obj: Any) -> VisionSpec:
    """Build the spec from a Hugging Face image processor or processor instance.

    Reads the parameters the object stores (``patch_size``, ``merge_size``, ``size``, pinpoints, tile limits,
    and, from a full processor, ``image_seq_length`` / ``num_image_tokens`` / ``patch_size`` /
    ``vision_feature_select_strategy`` and the video processor's settings), so a spec always matches the
    checkpoint the processor was loaded from. A bare ``Qwen2VLImageProcessor`` with 16 px patches is taken as
    Qwen3-VL (image rules are the same; pass the full processor for the right video rules).
    """
    image_proc = getattr(obj, "image_processor", None)
    processor = obj if image_proc is not None else None
    image_proc = image_proc if image_proc is not None else obj
    ip_name = _strip_backend(type(image_proc).__name__)
    proc_name = type(processor).__name__ if processor is not None else ""
    ip = image_proc

    if ip_name in ("Qwen2VLImageProcessor", "Glm4vImageProcessor"):
        size = _get(ip, "size")
        kwargs: dict[str, Any] = dict(
            patch_size=int(_get(ip, "patch_size")),
            merge_size=int(_get(ip, "merge_size")),
            temporal_patch_size=int(_get(ip, "temporal_patch_size")),
            min_pixels=int(_get(size, "shortest_edge")),
            max_pixels=int(_get(size, "longest_edge")),
        )
        if ip_name == "Glm4vImageProcessor":
            return Glm4vSpec(**kwargs)
        kwargs.update(_qwen_video_kwargs(getattr(processor, "video_processor", None)))
        if proc_name.startswith("Qwen3VL") or (not proc_name and kwargs["patch_size"] == 16):
            return Qwen3VLSpec(**kwargs)
        if proc_name.startswith("Qwen2_5"):
            kwargs["variant"] = "qwen2_5_vl"
        return Qwen2VLSpec(
            **{k: v for k, v in kwargs.items() if k not in ("cap_pixels_per_frame", "max_video_tokens")}
        )

    strategy = _get(processor, "vision_feature_select_strategy")
    if ip_name in ("LlavaImageProcessor", "CLIPImageProcessor", "LlavaNextImageProcessor"):
        crop = _get(ip, "crop_size") if _get(ip, "do_center_crop", False) else _get(ip, "size")
        if ip_name != "LlavaNextImageProcessor" and _get(crop, "height") is None:
            # Without the center crop, a shortest_edge resize keeps the aspect ratio: a per-image count
            # the released LLaVA processors never produce.
            raise ValueError(
                f"{type(ip).__name__} with do_center_crop=False and size={crop!r}: the LLaVA token count then "
                "depends on the aspect ratio, which vlm_pack does not model; enable do_center_crop."
            )
        crop_h, crop_w = _hw(crop, "the crop size")
        kwargs = dict(crop_height=crop_h, crop_width=crop_w)
        if processor is not None:
            kwargs.update(
                patch_size=int(_get(processor, "patch_size", 14)),
                num_additional_image_tokens=int(_get(processor, "num_additional_image_tokens", 0)),
                vision_feature_select_strategy=strategy or "full",
            )
        if ip_name == "LlavaNextImageProcessor":
            return LlavaNextSpec(image_grid_pinpoints=_get(ip, "image_grid_pinpoints"), **kwargs)
        return LlavaSpec(**kwargs)

    if ip_name == "LlavaOnevisionImageProcessor":
        kwargs = dict(
            image_grid_pinpoints=_get(ip, "image_grid_pinpoints"), size=_hw(_get(ip, "size"), "size")[0]
        )
        if processor is not None:
            kwargs.update(
                num_image_tokens=int(_get(processor, "num_image_tokens", 729)),
                vision_aspect_ratio=_get(processor, "vision_aspect_ratio", "anyres_max_9"),
                vision_feature_select_strategy=strategy or "full",
            )
        return LlavaOnevisionSpec(**kwargs)

    if ip_name == "GotOcr2ImageProcessor":
        kwargs = dict(
            tile_size=_hw(_get(ip, "size"), "size")[0],
            min_tiles=int(_get(ip, "min_patches", 1)),
            max_tiles=int(_get(ip, "max_patches", 12)),
            crop_to_patches=bool(_get(ip, "crop_to_patches", False)),
        )
        if processor is not None:
            kwargs["image_seq_length"] = int(_get(processor, "image_seq_length", 256))
        return InternVLSpec(**kwargs)

    if ip_name in ("Idefics3ImageProcessor", "SmolVLMImageProcessor"):
        kwargs = dict(
            longest_edge=int(_get(_get(ip, "size"), "longest_edge")),
            max_image_size=int(_get(_get(ip, "max_image_size"), "longest_edge")),
            do_resize=bool(_get(ip, "do_resize", True)),
            do_image_splitting=bool(_get(ip, "do_image_splitting", True)),
            variant="smolvlm" if ip_name.startswith("SmolVLM") else "idefics3",
        )
        if processor is not None:
            kwargs["image_seq_len"] = int(_get(processor, "image_seq_len"))
            tok = getattr(processor, "tokenizer", None)
            if tok is not None:
                kwargs["newline_pair_tokens"] = len(tok("\n\n", add_special_tokens=False)["input_ids"])
        elif ip_name.startswith("SmolVLM"):
            kwargs["image_seq_len"] = int(_SMOLVLM_DEFAULTS["image_seq_len"])  # type: ignore[call-overload]
        return Idefics3Spec(**kwargs)

    if ip_name == "Gemma3ImageProcessor":
        # preprocessor_config.json leaves pan-and-scan null; Gemma3Processor's images_kwargs fill them in.
        defaults = dict(getattr(processor, "images_kwargs", None) or {}) if processor is not None else {}
        kwargs = dict(image_size=_hw(_get(ip, "size"), "size")[0])
        for name in (
            "do_pan_and_scan",
            "pan_and_scan_min_crop_size",
            "pan_and_scan_max_num_crops",
            "pan_and_scan_min_ratio_to_activate",
        ):
            value = _get(ip, name, defaults.get(name))
            if value is not None:
                kwargs[name] = value
        if processor is not None:
            kwargs["image_seq_length"] = int(_get(processor, "image_seq_length", 256))
        return Gemma3Spec(**kwargs)

    if ip_name == "PixtralImageProcessor":
        patch = _get(ip, "patch_size")
        patch_size = int(_get(patch, "height")) if not isinstance(patch, int) else patch
        kwargs = dict(patch_size=patch_size, longest_edge=int(_get(_get(ip, "size"), "longest_edge")))
        if processor is not None:
            merge = int(_get(processor, "spatial_merge_size", 1))
            if int(_get(processor, "patch_size", patch_size)) != patch_size:
                raise ValueError(
                    f"{proc_name}: processor patch_size {processor.patch_size} differs from the image "
                    f"processor's {patch_size}; vlm_pack supports Pixtral processors where they agree."
                )
            kwargs["spatial_merge_size"] = merge
        return PixtralSpec(**kwargs)

    what = (
        f"processor {type(obj).__name__!r} (image processor {type(image_proc).__name__!r})"
        if processor is not None
        else f"{type(obj).__name__!r}, which is not a supported image processor or processor instance"
    )
    raise ValueError(
        f"vision_spec_from_processor: unsupported {what}. Supported: {'; '.join(_SUPPORTED_PROCESSORS)}. "
        f"For other models build a spec directly: vision_spec(family, ...) with family in {', '.join(FAMILIES)}."
    )


# ----------------------------------------------------------------------------------------------------------
# image_size: (width, height) from the header, without decoding pixels
# ----------------------------------------------------------------------------------------------------------

_PREFIX = 64 * 1024  # bytes read up front from files: enough for nearly every header


class _Reader:
    """Random access over bytes or a seekable binary file; ``get`` returns fewer bytes at the end."""

    __slots__ = ("base", "buf", "complete", "fp")

    def __init__(self, buf: Any, fp: BinaryIO | None = None, base: int = 0) -> None:
        self.buf = buf
        self.fp = fp
        self.base = base
        self.complete = fp is None or len(buf) < _PREFIX

    def get(self, offset: int, n: int) -> bytes:
        end = offset + n
        if end <= len(self.buf) or self.complete:
            return bytes(self.buf[offset:end])
        assert self.fp is not None
        self.fp.seek(self.base + offset)
        return self.fp.read(n)


class _Corrupt(ValueError):
    pass


def _u16be(b: bytes, o: int = 0) -> int:
    return (b[o] << 8) | b[o + 1]


def _exif_orientation(data: bytes) -> int | None:
    """The Orientation tag (0x0112) of IFD0 of a TIFF-structured EXIF block, or None if absent."""
    for _ in range(2):  # Pillow strips up to two "Exif\0\0" prefixes (PNG eXIf chunks often carry one)
        if data[:6] == b"Exif\x00\x00":
            data = data[6:]
    # Pillow's TIFF prefixes (42 either way round); anything else, BigTIFF included, yields no EXIF tags.
    if data[:4] in (b"II*\x00", b"II\x00*"):
        bo = "<"
    elif data[:4] in (b"MM\x00*", b"MM*\x00"):
        bo = ">"
    else:
        return None
    (ifd,) = struct.unpack_from(bo + "I", data, 4)
    if ifd + 2 > len(data):
        return None
    (count,) = struct.unpack_from(bo + "H", data, ifd)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(data):
            return None
        tag, typ, n = struct.unpack_from(bo + "HHI", data, entry)
        if tag != 0x0112:
            continue
        if n != 1:
            return -1  # present but not a single value: no transposition
        fmt = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i"}.get(typ)
        return struct.unpack_from(bo + fmt, data, entry + 8)[0] if fmt else -1
    return None


_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def _orientation(exif: bytes | None, xmp: bytes | None) -> int:
    """Pillow's ``getexif()`` Orientation: EXIF's tag, else XMP's ``tiff:Orientation``, else 1."""
    if exif is not None:
        value = _exif_orientation(exif)
        if value is not None:
            return value
    if xmp:
        match = _XMP_ORIENTATION.search(xmp)
        if match:
            return int(match[2])
    return 1


def _jpeg(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    pos = 2
    size = None
    exif = xmp = None
    while True:
        head = r.get(pos, 4)
        if len(head) < 2:
            raise _Corrupt("JPEG ends before its start-of-scan marker (truncated header)")
        if head[0] != 0xFF:  # Pillow skips junk between segments
            pos += 1
            continue
        marker = head[1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x00 or marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length field
            pos += 2
            continue
        if marker == 0xD9:
            break
        if len(head) < 4:
            raise _Corrupt("JPEG segment header is truncated")
        seglen = _u16be(head, 2)
        if seglen < 2:
            raise _Corrupt(f"JPEG segment 0xFF{marker:02X} has invalid length {seglen}")
        if marker == 0xDA:  # start of scan: the header is over
            break
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            sof = r.get(pos + 4, 6)
            if len(sof) < 6:
                raise _Corrupt("JPEG start-of-frame segment is truncated")
            if sof[0] != 8:
                raise _Corrupt(f"{sof[0]}-bit JPEG: Pillow (hence the processor) cannot decode it")
            if sof[5] not in (1, 3, 4):
                raise _Corrupt(f"JPEG with {sof[5]} components: Pillow cannot decode it")
            size = (_u16be(sof, 3), _u16be(sof, 1))  # Pillow keeps the last SOF
        elif marker == 0xE1 and want_exif:
            body = r.get(pos + 4, seglen - 2)
            if len(body) < seglen - 2:
                raise _Corrupt("JPEG APP1 segment is truncated")
            # As Pillow: Exif APP1s are concatenated (one TIFF structure), the last XMP packet wins.
            if body[:6] == b"Exif\x00\x00":
                exif = body if exif is None else exif + body[6:]
            elif body[:29] == b"http://ns.adobe.com/xap/1.0/\x00":
                xmp = body[29:]
        pos += 2 + seglen
    if size is None:
        raise _Corrupt("JPEG has no start-of-frame segment before its image data")
    return size[0], size[1], _orientation(exif, xmp) if want_exif else 1


_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_CHUNK = struct.Struct(">I4s")


def _png(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    head = r.get(8, 25)
    if len(head) < 25:
        raise _Corrupt("PNG ends inside its IHDR chunk (truncated header)")
    if head[4:8] != b"IHDR":
        raise _Corrupt(f"PNG's first chunk is {head[4:8]!r}, not IHDR")
    width, height = struct.unpack_from(">II", head, 8)
    if not want_exif:
        return width, height, 1
    # Pillow reads eXIf / text chunks before and (when the image is loaded) after the image data.
    exif = raw_profile = xmp_str = xmp = None
    pos = 8
    seen_idat = animated = False
    mem = r.buf if r.complete else None  # in memory: unpack chunk headers in place (hot loop over IDATs)
    end = len(r.buf)
    while True:
        if mem is not None:
            if pos + 8 > end:
                break
            length, cid = _PNG_CHUNK.unpack_from(mem, pos)
        else:
            chunk = r.get(pos, 8)
            if len(chunk) < 8:
                break  # a truncated tail loses only metadata, as with Pillow's tolerant chunk reader
            length, cid = _PNG_CHUNK.unpack(chunk)
        if cid == b"IEND" or (animated and seen_idat and cid == b"fcTL"):
            break
        if cid == b"acTL":
            animated = True
        elif cid == b"IDAT":
            seen_idat = True
        elif cid in (b"eXIf", b"tEXt", b"zTXt", b"iTXt"):
            body = r.get(pos + 8, length)
            if cid == b"eXIf":
                exif = b"Exif\x00\x00" + body
            else:
                key, _, value = body.partition(b"\x00")
                if cid == b"zTXt":
                    try:
                        value = zlib.decompress(value[1:]) if value[:1] == b"\x00" else b""
                    except zlib.error:
                        value = b""
                elif cid == b"iTXt":
                    parts = value[2:].split(b"\x00", 2)
                    if len(value) < 2 or len(parts) < 3:
                        pos += 12 + length
                        continue
                    text = parts[2]
                    if value[0]:
                        try:
                            text = zlib.decompress(text) if value[1] == 0 else b""
                        except zlib.error:
                            text = b""
                    value = text
                if key == b"exif" and cid == b"tEXt":
                    exif = value
                elif key == b"Raw profile type exif":
                    raw_profile = value
                elif key == b"XML:com.adobe.xmp":
                    xmp_str = value
                    if cid == b"iTXt":
                        xmp = value
        pos += 12 + length
    if exif is None and raw_profile is not None:
        try:
            exif = bytes.fromhex("".join(raw_profile.decode("latin-1").split("\n")[3:]))
        except ValueError:
            exif = None
    return width, height, _orientation(exif, xmp_str if xmp_str is not None else xmp)


def _gif(r: _Reader) -> tuple[int, int, int]:
    head = r.get(0, 13)
    if len(head) < 13:
        raise _Corrupt("GIF ends inside its logical screen descriptor")
    width, height = struct.unpack_from("<HH", head, 6)
    flags = head[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    # Pillow enlarges the canvas to the first frame's extent when that frame spills over it.
    while True:
        block = r.get(pos, 1)
        if not block:
            raise _Corrupt("GIF ends before its first image descriptor")
        if block == b"!":
            pos += 2
            while True:
                n = r.get(pos, 1)
                if not n:
                    raise _Corrupt("GIF extension block is truncated")
                pos += 1 + n[0]
                if n[0] == 0:
                    break
        elif block == b",":
            desc = r.get(pos + 1, 8)
            if len(desc) < 8:
                raise _Corrupt("GIF image descriptor is truncated")
            x0, y0, w, h = struct.unpack("<HHHH", desc)
            return max(width, x0 + w), max(height, y0 + h), 1
        elif block == b";":
            raise _Corrupt("GIF ends (trailer) before its first image descriptor")
        else:
            pos += 1  # Pillow skips stray bytes between blocks


def _webp(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    head = r.get(12, 18)
    if len(head) < 8:
        raise _Corrupt("WebP ends before its first chunk")
    fourcc = head[:4]
    if fourcc == b"VP8 ":
        if len(head) < 18 or head[11:14] != b"\x9d\x01\x2a":
            raise _Corrupt("WebP VP8 frame header is truncated or invalid")
        w, h = struct.unpack_from("<HH", head, 14)
        return w & 0x3FFF, h & 0x3FFF, 1
    if fourcc == b"VP8L":
        if len(head) < 13 or head[8] != 0x2F:
            raise _Corrupt("WebP VP8L header is truncated or invalid")
        bits = int.from_bytes(head[9:13], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 1
    if fourcc == b"VP8X":
        if len(head) < 18:
            raise _Corrupt("WebP VP8X header is truncated")
        width = 1 + int.from_bytes(head[12:15], "little")
        height = 1 + int.from_bytes(head[15:18], "little")
        orientation = 1
        if want_exif and head[8] & 0x0C:  # EXIF (0x08) or XMP (0x04) flag
            exif = xmp = None
            pos = 12
            while True:
                chunk = r.get(pos, 8)
                if len(chunk) < 8:
                    break
                cid, length = chunk[:4], int.from_bytes(chunk[4:], "little")
                if cid == b"EXIF" and exif is None:
                    exif = r.get(pos + 8, length)
                elif cid == b"XMP " and xmp is None:
                    xmp = r.get(pos + 8, length)
                pos += 8 + length + (length & 1)
            orientation = _orientation(exif, xmp)
        return width, height, orientation
    raise _Corrupt(f"WebP has an unknown first chunk {fourcc!r}")


def _pillow(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    from PIL import Image, UnidentifiedImageError

    fp: Any
    if r.fp is not None and r.base == 0:
        fp = r.fp  # Pillow's plugins seek to absolute offsets: only a stream starting at 0 works as is
        fp.seek(0)
    elif r.complete:
        fp = io.BytesIO(bytes(r.buf))
    else:
        assert r.fp is not None
        r.fp.seek(r.base + len(r.buf))
        fp = io.BytesIO(bytes(r.buf) + r.fp.read())
    try:
        with Image.open(fp) as im:
            width, height = im.size
            orientation = im.getexif().get(0x0112, 1) if want_exif else 1
    except UnidentifiedImageError:
        raise _Corrupt("not an image format Pillow can identify") from None
    except Image.DecompressionBombError as e:
        raise _Corrupt(f"Pillow refuses to open it ({e})") from None
    except Exception as e:  # Pillow's plugins raise anything on garbage
        raise _Corrupt(f"Pillow cannot read its header ({type(e).__name__}: {e})") from None
    return width, height, orientation if isinstance(orientation, int) else -1


def _parse(r: _Reader, want_exif: bool) -> tuple[int, int]:
    sig = r.get(0, 16)
    if sig[:3] == b"\xff\xd8\xff":
        w, h, orientation = _jpeg(r, want_exif)
    elif sig[:8] == _PNG_SIG:
        w, h, orientation = _png(r, want_exif)
    elif sig[:6] in (b"GIF87a", b"GIF89a"):
        w, h, orientation = _gif(r)
    elif sig[:4] == b"RIFF" and sig[8:12] == b"WEBP":
        w, h, orientation = _webp(r, want_exif)
    elif not sig:
        raise _Corrupt("empty input")
    else:
        w, h, orientation = _pillow(r, want_exif)
    if w <= 0 or h <= 0:
        raise _Corrupt(f"header declares a {w}x{h} image")
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{type(source).__name__} of {len(source)} bytes>"
    name = getattr(source, "name", None)
    return repr(name) if isinstance(name, str) else f"<{type(source).__name__}>"


def image_size(
    source: ImageSource, *, exif_transpose: bool = True, name: str | None = None
) -> tuple[int, int]:
    """``(width, height)`` of an image, read from its header only (pixels are never decoded).

    Args:
        source: a path (``str`` / ``PathLike``), in-memory bytes (``bytes`` / ``bytearray`` /
            ``memoryview``), or a binary file object (read from its current position, which is restored).
        exif_transpose: honour the EXIF / XMP Orientation as ``PIL.ImageOps.exif_transpose`` (hence
            transformers' ``load_image``) does: orientations 5-8 swap width and height. Pass ``False`` when
            the processor receives ``PIL.Image.open`` results untransposed.
        name: how to call the image in error messages (e.g. a WebDataset key); defaults to the path or type.

    JPEG, PNG (incl. APNG), GIF and WebP (VP8, VP8L, VP8X) are parsed by hand; other formats fall back to
    Pillow's lazy ``Image.open(...).size``. Corrupt or truncated headers raise ``ValueError`` naming the
    source.
    """
    label = name if name is not None else _describe(source)
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            buf = source if not isinstance(source, memoryview) else source.cast("B")
            return _parse(_Reader(buf), exif_transpose)
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as fp:
                return _parse(_Reader(fp.read(_PREFIX), fp, 0), exif_transpose)
        if hasattr(source, "read"):
            start = source.tell() if source.seekable() else None
            if start is None:  # unseekable stream: take it whole
                return _parse(_Reader(source.read()), exif_transpose)
            try:
                return _parse(_Reader(source.read(_PREFIX), source, start), exif_transpose)
            finally:
                source.seek(start)
    except _Corrupt as e:
        raise ValueError(f"image_size({label}): {e}.") from None
    except (struct.error, IndexError) as e:
        raise ValueError(f"image_size({label}): corrupt or truncated header ({e}).") from None
    except OSError as e:
        raise ValueError(f"image_size({label}): cannot read it ({e}).") from None
    raise TypeError(
        f"image_size: expected a path, bytes-like object or binary file object, got {type(source).__name__}."
    )
