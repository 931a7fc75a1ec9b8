"""LLaVA-1.5 (fixed crop), LLaVA-NeXT (anyres) and LLaVA-OneVision (anyres_max_9).

LLaVA-1.5 center-crops every image to one size: a fixed count. NeXT and OneVision pick the "pinpoint"
resolution that keeps most of the image (``select_best_resolution``), tile it in crops, and count the
features left after trimming the padding back to the image's aspect ratio, plus one newline feature per row
and the base image's features.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .spec import VisionSpec, _check_size


def _drop_cls(features: int, vision_feature_select_strategy: str) -> int:
    """Features the language model sees: the "default" strategy drops the CLS feature."""
    return features - 1 if vision_feature_select_strategy == "default" else features


@dataclass(frozen=True)
class _LlavaCrop(VisionSpec):
    """The CLIP crop LLaVA-1.5 and LLaVA-NeXT share: ``crop_height x crop_width`` px in ``patch_size`` px
    patches, plus ``num_additional_image_tokens`` (CLS) features per crop."""

    crop_height: int = 336
    crop_width: int = 336
    patch_size: int = 14
    num_additional_image_tokens: int = 1
    vision_feature_select_strategy: str = "default"
    wrapper_tokens: int = 0

    @property
    def crop_patches(self) -> int:
        """Patch features of one crop: ``(crop_height // patch_size) * (crop_width // patch_size)``."""
        return (self.crop_height // self.patch_size) * (self.crop_width // self.patch_size)


@dataclass(frozen=True)
class LlavaSpec(_LlavaCrop):
    """LLaVA-1.5: every image is resized and center-cropped to ``crop_size``: a fixed token count.

    ``(crop_h // patch) * (crop_w // patch) + num_additional_image_tokens``, minus one when
    ``vision_feature_select_strategy == "default"`` drops the CLS feature: 576 for llava-1.5 (336 px, 14 px
    patches, CLS dropped).
    """

    family: ClassVar[str] = "llava"

    def num_tokens(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        features = self.crop_patches + self.num_additional_image_tokens
        return _drop_cls(features, self.vision_feature_select_strategy)

    def num_patches(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        return self.crop_patches

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
class _AnyresSpec(VisionSpec):
    """Pinpoint selection NeXT and OneVision share (``image_grid_pinpoints`` is their first field)."""

    image_grid_pinpoints: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_grid_pinpoints", _pinpoints(self.image_grid_pinpoints))
        if not self.image_grid_pinpoints:
            raise ValueError(f"{self.family}: image_grid_pinpoints must not be empty.")

    def best_resolution(self, width: int, height: int) -> tuple[int, int]:
        """The pinpoint ``(width, height)`` the image is resized and padded into."""
        width, height = _check_size(self.family, width, height)
        h, w = select_best_resolution((height, width), self.image_grid_pinpoints)
        return w, h


# Dataclass fields follow the reversed MRO: _AnyresSpec's pinpoints first, then the crop's fields.
@dataclass(frozen=True)
class LlavaNextSpec(_LlavaCrop, _AnyresSpec):
    """LLaVA-NeXT / 1.6 (anyres): base image + the best pinpoint's tiles, unpadded, with image newlines.

    ``tokens = unpadded_h * unpadded_w + unpadded_h (newlines) + base`` where the pinpoint
    ``(H, W)`` = ``select_best_resolution``, the feature grid is ``(H/crop*24, W/crop*24)`` for 336 px
    crops and 14 px patches, and the side that the padding made too long is trimmed back to the image's
    aspect ratio; ``base = 24*24 + num_additional_image_tokens``, minus one for the "default" strategy.
    """

    family: ClassVar[str] = "llava_next"

    image_grid_pinpoints: tuple[tuple[int, int], ...] = _LLAVA_NEXT_PINPOINTS

    def _features(self, width: int, height: int) -> int:
        best_w, best_h = self.best_resolution(width, height)
        scale_h, scale_w = best_h // self.crop_height, best_w // self.crop_width
        ph, pw = self.crop_height // self.patch_size, self.crop_width // self.patch_size
        unpadded, newlines = _unpadded_features(height, width, ph, pw, scale_h, scale_w)
        return unpadded + newlines + ph * pw + self.num_additional_image_tokens

    def num_tokens(self, width: int, height: int) -> int:
        return _drop_cls(self._features(width, height), self.vision_feature_select_strategy)

    def tiles(self, width: int, height: int) -> int:
        """``pixel_values`` crops: 1 base image + the pinpoint's ``ceil(H/crop) * ceil(W/crop)`` tiles."""
        best_w, best_h = self.best_resolution(width, height)
        return 1 + (-(-best_h // self.crop_height)) * (-(-best_w // self.crop_width))

    def num_patches(self, width: int, height: int) -> int:
        return self.tiles(width, height) * self.crop_patches


@dataclass(frozen=True)
class LlavaOnevisionSpec(_AnyresSpec):
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
        super().__post_init__()
        if not self.vision_aspect_ratio.startswith("anyres_max_"):
            raise ValueError(
                f"{self.family}: vision_aspect_ratio must look like 'anyres_max_N', got {self.vision_aspect_ratio!r}."
            )

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
        return _drop_cls(n, self.vision_feature_select_strategy)

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
