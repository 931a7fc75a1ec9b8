"""Gemma 4: an aspect-kept resize to whole pooled patches within a patch budget.

``Gemma4ImageProcessor`` (``models/gemma4/image_processing_pil_gemma4.py``, ``get_aspect_ratio_preserving_size``)
scales the image by ``sqrt(max_patches * patch**2 / (H * W))`` (up or down), floors each side to a multiple of
``patch * pool`` (48 px), and, where one side floors to 0, gives it one 48 px step and the other
``floor(long / short)`` steps, at most ``max_soft_tokens`` of them::

    max_patches = max_soft_tokens * pool**2          (280 soft tokens: 2520 patches of 16 px)
    tokens      = (H' / 16) * (W' / 16) / 9           wrapped in <|image> ... <image|> by the processor

``max_soft_tokens`` is one of 70, 140, 280, 560, 1120 (the processor refuses others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .spec import _check_size, _ResizedSpec

__all__ = ["Gemma4Spec"]

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class Gemma4Spec(_ResizedSpec):
    """Gemma 4 (``Gemma4ImageProcessor``): one crop, aspect kept, ``max_soft_tokens`` pooled tokens at most."""

    family: ClassVar[str] = "gemma4"
    wrapper_tokens: int = 2  # <|image> and <image|>, written by the processor

    # google/gemma-4-*-it preprocessor_config.json
    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280

    def __post_init__(self) -> None:
        self._check_positive("patch_size", "pooling_kernel_size", "max_soft_tokens")
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"gemma4: max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, got {self.max_soft_tokens}")

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        width, height = _check_size(self.family, width, height)
        pool, patch = self.pooling_kernel_size, self.patch_size
        max_patches = self.max_soft_tokens * pool**2
        factor = math.sqrt(max_patches * patch**2 / (height * width))  # float64, as the processor
        step = pool * patch
        h = math.floor(factor * height / step) * step
        w = math.floor(factor * width / step) * step
        if h == 0 and w == 0:
            raise ValueError(f"gemma4: {width}x{height} resizes to 0 x 0 (the processor refuses it)")
        longest = (max_patches // pool**2) * step
        if h == 0:
            h, w = step, min(math.floor(width / height) * step, longest)
        elif w == 0:
            h, w = min(math.floor(height / width) * step, longest), step
        return w, h

    def num_tokens(self, width: int, height: int) -> int:
        return self.num_patches(width, height) // self.pooling_kernel_size**2
