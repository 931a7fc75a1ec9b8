"""Fixed-size tiles and crops: InternVL 2 / 2.5 / 3, Idefics3 / SmolVLM and Gemma 3.

Every tile the vision encoder sees becomes a fixed number of tokens, so the forecast is the tile count
times that number; the families differ in how they choose the tiling::

    InternVL 640x480, 448 px tiles, 1..12 tiles:
        +-----+-----+-----+-----+
        |  1  |  2  |  3  |  4  |     grid 4 x 3 = 12 tiles + 1 thumbnail = 13 tiles
        +-----+-----+-----+-----+     num_tokens = 13 * 256 = 3328 (<IMG_CONTEXT>)
        |  5  |  6  |  7  |  8  |     wrapper_tokens = 2 (<img>, </img>)
        +-----+-----+-----+-----+
        |  9  | 10  | 11  | 12  |  + [thumb]
        +-----+-----+-----+-----+

InternVL picks the grid whose aspect ratio is closest to the image's; Idefics3 / SmolVLM resize the longest
side and cut whole ``max_image_size`` crops; Gemma 3 has one crop plus optional pan-and-scan crops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .spec import VisionSpec, _check_size


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
    """Side of a square tile in pixels (preprocessor_config.json ``size``)."""
    min_tiles: int = 1
    """Fewest tiles of a grid (``min_patches``)."""
    max_tiles: int = 12
    """Most tiles of a grid, thumbnail not counted (``max_patches``)."""
    crop_to_patches: bool = True
    """Cut the image into a grid of tiles; off, every image is one tile (``crop_to_patches``)."""
    use_thumbnail: bool = True
    """Add a whole-image thumbnail tile to a grid of more than one (always on in ``GotOcr2ImageProcessor``;
    ``use_thumbnail`` of the original InternVL config)."""
    image_seq_length: int = 256
    """``<IMG_CONTEXT>`` tokens per tile (processor_config.json ``image_seq_length``)."""
    patch_size: int = 14
    """Side of a ViT patch in pixels (config.json ``vision_config.patch_size``)."""
    wrapper_tokens: int = 2
    """``<img>`` and ``</img>`` around each image."""

    def __post_init__(self) -> None:
        self._check_positive("tile_size", "min_tiles", "max_tiles", "image_seq_length", "patch_size")

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
    """Longest side in pixels after the first resize (preprocessor_config.json ``size["longest_edge"]``)."""
    max_image_size: int = 364
    """Side of a square crop in pixels (``max_image_size["longest_edge"]``)."""
    image_seq_len: int = 169
    """``<image>`` tokens per crop (processor_config.json ``image_seq_len``; 81 for SmolVLM)."""
    do_resize: bool = True
    """Resize to ``longest_edge`` before cutting crops (``do_resize``)."""
    do_image_splitting: bool = True
    """Cut an image larger than one crop into crops plus a global image; off, every image is one crop
    (``do_image_splitting``)."""
    patch_size: int = 14
    """Side of a ViT patch in pixels (config.json ``vision_config.patch_size``)."""
    newline_pair_tokens: int = 1
    """Tokens the tokenizer makes of ``"\\n\\n"`` (read from the tokenizer by
    :func:`vision_spec_from_processor`)."""
    wrapper_tokens: int = 3
    """Text tokens around a single-crop image: ``<fake_token_around_image><global-img>`` before the
    ``<image>`` tokens, ``<fake_token_around_image>`` after."""
    variant: str = "idefics3"
    """``"idefics3"`` or ``"smolvlm"``: the family name the spec reports."""

    def __post_init__(self) -> None:
        self._check_positive("longest_edge", "max_image_size", "image_seq_len", "patch_size")
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
        """Tile markers and newlines around the ``<image>`` tokens, each ``<row_r_col_c>`` marker one token (as
        in the released tokenizers, which hold them as added tokens). The forecasts with a tokenizer count the
        markers through it instead (``processing._idefics3_extra_tokens``), exact for any tokenizer."""
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
    """Side in pixels every crop is resized to (preprocessor_config.json ``size``)."""
    image_seq_length: int = 256
    """``<image_soft_token>`` tokens per crop after pooling (processor_config.json ``image_seq_length``)."""
    patch_size: int = 14
    """Side of a ViT patch in pixels (config.json ``vision_config.patch_size``)."""
    do_pan_and_scan: bool = False
    """Add pan-and-scan crops of wide or tall images (``do_pan_and_scan``; the processor's default is off)."""
    pan_and_scan_min_crop_size: int = 256
    """Smallest side in pixels a pan-and-scan crop may have (``pan_and_scan_min_crop_size``)."""
    pan_and_scan_max_num_crops: int = 4
    """Most pan-and-scan crops per image (``pan_and_scan_max_num_crops``)."""
    pan_and_scan_min_ratio_to_activate: float = 1.2
    """Long-to-short side ratio from which pan-and-scan cuts crops; squarer images get none
    (``pan_and_scan_min_ratio_to_activate``)."""
    wrapper_tokens: int = 2
    """``<start_of_image>`` and ``<end_of_image>`` around each crop."""

    def num_crops(self, width: int, height: int) -> int:
        """Pan-and-scan crops added to the base image (``num_crops`` in the processor output)."""
        width, height = _check_size(self.family, width, height)
        if not self.do_pan_and_scan:
            return 0
        if width >= height:
            num_crops_w, num_crops_h = self._crops_along(width, height), 1
        else:
            num_crops_w, num_crops_h = 1, self._crops_along(height, width)
        if num_crops_w is None or num_crops_h is None:
            return 0
        crop_size_w = math.ceil(width / num_crops_w)
        crop_size_h = math.ceil(height / num_crops_h)
        if min(crop_size_w, crop_size_h) < self.pan_and_scan_min_crop_size:
            return 0
        return num_crops_w * num_crops_h

    def _crops_along(self, long_side: int, short_side: int) -> int | None:
        """Pan-and-scan crops along the long side; None when the image is too square to activate it."""
        if long_side / short_side < self.pan_and_scan_min_ratio_to_activate:
            return None
        crops = math.floor(long_side / short_side + 0.5)
        crops = min(math.floor(long_side / self.pan_and_scan_min_crop_size), crops)
        crops = max(2, crops)
        return min(self.pan_and_scan_max_num_crops, crops)

    def tiles(self, width: int, height: int) -> int:
        return 1 + self.num_crops(width, height)

    def num_tokens(self, width: int, height: int) -> int:
        return self.image_seq_length * self.tiles(width, height)

    def num_patches(self, width: int, height: int) -> int:
        return self.tiles(width, height) * (self.image_size // self.patch_size) ** 2

    def extra_tokens(self, width: int, height: int) -> int:
        """``<start_of_image>``/``<end_of_image>`` per crop (the surrounding text must be tokenized)."""
        return self.wrapper_tokens * self.tiles(width, height)
