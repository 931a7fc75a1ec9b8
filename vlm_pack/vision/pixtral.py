"""Pixtral: the longest side capped at ``longest_edge``, sides rounded up to whole patches, row breaks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .spec import _check_size, _ResizedSpec


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
        """``(width, height)`` after the processor's resize (multiples of ``patch_size * spatial_merge_size``)."""
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
