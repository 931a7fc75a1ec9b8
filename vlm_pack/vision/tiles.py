"""Fixed-size tiles and crops: InternVL 2 / 2.5 / 3, Idefics3 / SmolVLM, Gemma 3 and LFM2-VL.

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
side and cut whole ``max_image_size`` crops; Gemma 3 has one crop plus optional pan-and-scan crops; LFM2-VL
cuts only large images, into InternVL's closest grid of 512 px tiles, and keeps small ones whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from .smart_resize import fit_pixel_budget
from .spec import MarkerPrompt, VisionSpec, _check_size


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
        markers through it instead (:meth:`marker_prompt`), exact for any tokenizer."""
        cols, rows = self.tile_grid(width, height)
        if rows == 0:
            return self.wrapper_tokens
        return self.wrapper_tokens + rows * (2 * cols + 1) + (self.newline_pair_tokens - 1)

    def marker_prompt(self, width: int, height: int, named: Callable[[str, str], str]) -> MarkerPrompt:
        """``get_image_prompt_string`` of one image with ONE ``<image>`` per crop; ``named(attr, default)``
        reads the processor's (else the tokenizer's) token names."""
        cols, rows = self.tile_grid(width, height)
        image = named("image_token", "<image>")
        fake = named("fake_image_token", "<fake_token_around_image>")
        # Idefics3Processor names it global_image_tag, SmolVLM's tokenizer global_image_token
        global_tag = named("global_image_tag", named("global_image_token", "<global-img>"))
        tail = f"{fake}{global_tag}{image}{fake}"
        if rows == 0 and cols == 0:
            return MarkerPrompt(tail, image, (fake, fake))
        crops = (
            "".join(f"{fake}<row_{r}_col_{c}>{image}" for c in range(1, cols + 1)) for r in range(1, rows + 1)
        )
        return MarkerPrompt("".join(row + "\n" for row in crops) + "\n" + tail, image, (fake, fake))


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


@dataclass(frozen=True)
class Gemma3nSpec(VisionSpec):
    """Gemma 3n: every image is resized to one ``image_size`` square (``SiglipImageProcessor``, no crops) and
    MobileNetV5's multi-scale fusion adapter pools it to a 16 x 16 grid: ``image_seq_length`` (256) tokens,
    whatever the image's size (``Gemma3nProcessor``, ``models/gemma3n/processing_gemma3n.py``).

    The processor writes ``"\\n\\n<start_of_image>" + 256 x <image_soft_token> + "<end_of_image>\\n\\n"`` for each
    ``<image_soft_token>`` the template writes: the ``"\\n\\n"`` merge with the text around it as Gemma 3's do.
    """

    family: ClassVar[str] = "gemma3n"

    image_size: int = 768
    """Side in pixels every image is resized to (preprocessor_config.json ``size``)."""
    image_seq_length: int = 256
    """``<image_soft_token>`` tokens per image (processor_config.json ``image_seq_length``)."""
    wrapper_tokens: int = 2
    """``<start_of_image>`` and ``<end_of_image>`` around each image."""

    def __post_init__(self) -> None:
        self._check_positive("image_size", "image_seq_length")

    def num_crops(self, width: int, height: int) -> int:
        """Crops added to the base image: none (Gemma 3n has no pan-and-scan)."""
        _check_size(self.family, width, height)
        return 0

    def tiles(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        return 1

    def num_tokens(self, width: int, height: int) -> int:
        _check_size(self.family, width, height)
        return self.image_seq_length

    def num_patches(self, width: int, height: int) -> int:
        """The tower's output positions: a convolutional tower has no patches; its 16 x 16 grid is pooled
        into nothing further (``Gemma3nModel.get_image_features`` reshapes it to 256 tokens)."""
        return self.num_tokens(width, height)


def _round_by_factor(number: float, factor: int) -> int:
    """``round_by_factor``: the nearest multiple of ``factor`` (Python's ``round``: halves to even)."""
    return round(number / factor) * factor


@dataclass(frozen=True)
class Lfm2VlSpec(VisionSpec):
    """LFM2-VL (``Lfm2VlImageProcessor``, ``Lfm2VlProcessor``): SigLIP2-NaFlex patches of ``encoder_patch_size``
    pixels, pixel-unshuffled ``downsample_factor`` x ``downsample_factor`` into one token each.

    An image is first smart-resized (both sides multiples of 32 px; between ``min_image_tokens`` and
    ``max_image_tokens`` tokens). One whose sides, rounded to 32 px, hold more than ``max_pixels_tolerance``
    times ``max_image_tokens`` tokens' pixels is *large*: it is resized to the grid of ``tile_size`` tiles
    (``min_tiles..max_tiles``) whose aspect ratio is closest to its own, each tile ``(512/16/2)**2 = 256``
    tokens, and its smart-resized self becomes the thumbnail::

        1400x900 (large): grid 3 x 2 tiles of 512 px     <|image_start|>
            +-----+-----+-----+                             <|img_row_1_col_1|> <image> x 256
            | 1,1 | 1,2 | 1,3 |                             ...  (row by row, left to right)
            +-----+-----+-----+   + thumbnail 608x384       <|img_row_2_col_3|> <image> x 256
            | 2,1 | 2,2 | 2,3 |     = 19 x 12 = 228 tokens  <|img_thumbnail|> <image> x 228
            +-----+-----+-----+                           <|image_end|>
        num_tokens = 6 * 256 + 228 = 1764; extra_tokens = 2 + 6 + 1 = 9

    A small image is its smart-resized self alone, ``ceil(h/32) * ceil(w/32)`` tokens inside
    ``<|image_start|>...<|image_end|>``. The forecast with a tokenizer counts the markers through it
    (:meth:`marker_prompt`); ``extra_tokens`` assumes each marker is one token, as in the released tokenizer.
    """

    family: ClassVar[str] = "lfm2_vl"

    encoder_patch_size: int = 16
    """Side of a SigLIP2 patch in pixels (``encoder_patch_size``)."""
    downsample_factor: int = 2
    """Pixel-unshuffle factor: ``downsample_factor**2`` patches make one token (``downsample_factor``)."""
    min_image_tokens: int = 64
    """Fewest tokens of a smart-resized image: smaller images are scaled up (``min_image_tokens``)."""
    max_image_tokens: int = 256
    """Most tokens of a smart-resized image or thumbnail (``max_image_tokens``)."""
    do_image_splitting: bool = True
    """Cut large images into tiles; off, every image is smart-resized alone (``do_image_splitting``)."""
    min_tiles: int = 2
    """Fewest tiles of a large image's grid (``min_tiles``)."""
    max_tiles: int = 10
    """Most tiles of a large image's grid, thumbnail not counted (``max_tiles``)."""
    tile_size: int = 512
    """Side of a square tile in pixels (``tile_size``)."""
    use_thumbnail: bool = True
    """Add the smart-resized image after a grid of more than one tile (``use_thumbnail``)."""
    max_pixels_tolerance: float = 2.0
    """An image is large when its 32 px-rounded area exceeds this many times the pixels of
    ``max_image_tokens`` tokens (``max_pixels_tolerance``)."""
    use_image_special_tokens: bool = True
    """The processor writes ``<|image_start|>``, ``<|image_end|>``, tile and thumbnail markers
    (``Lfm2VlProcessor.use_image_special_tokens``); off, only the ``<image>`` tokens."""

    def __post_init__(self) -> None:
        self._check_positive(
            "encoder_patch_size", "downsample_factor", "min_image_tokens", "max_image_tokens", "min_tiles"
        )
        self._check_positive("max_tiles", "tile_size")
        if self.splits and self.min_tiles > self.max_tiles:
            raise ValueError(f"lfm2_vl: min_tiles {self.min_tiles} must be <= max_tiles {self.max_tiles}.")

    @property
    def splits(self) -> bool:
        """Large images are cut into tiles (``resize_and_split``: not when ``min_tiles == max_tiles == 1``)."""
        return self.do_image_splitting and not (self.min_tiles == self.max_tiles == 1)

    @property
    def _factor(self) -> int:
        return self.encoder_patch_size * self.downsample_factor

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` after ``smart_resize``: the single image, or a large image's thumbnail."""
        width, height = _check_size(self.family, width, height)
        f = self._factor
        unit = self.encoder_patch_size**2 * self.downsample_factor**2
        min_pixels, max_pixels = self.min_image_tokens * unit, self.max_image_tokens * unit
        h_bar = max(f, _round_by_factor(height, f))
        w_bar = max(f, _round_by_factor(width, f))
        h_bar, w_bar = fit_pixel_budget(height, width, h_bar, w_bar, f, min_pixels, max_pixels)
        return w_bar, h_bar

    def is_large(self, width: int, height: int) -> bool:
        """``_is_image_too_large``: the rounded area exceeds ``max_pixels_tolerance`` x the token budget's."""
        width, height = _check_size(self.family, width, height)
        f, p = self._factor, self.encoder_patch_size
        h_bar = max(p, _round_by_factor(height, f))
        w_bar = max(p, _round_by_factor(width, f))
        budget = self.max_image_tokens * p**2 * self.downsample_factor**2 * self.max_pixels_tolerance
        return h_bar * w_bar > budget

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """``(columns, rows)`` of tiles; ``(1, 1)`` for an image processed whole."""
        if not (self.splits and self.is_large(width, height)):
            return 1, 1
        ratios = sorted(
            {
                (w, h)
                for n in range(self.min_tiles, self.max_tiles + 1)
                for w in range(1, n + 1)
                for h in range(1, n + 1)
                if self.min_tiles <= w * h <= self.max_tiles
            },
            key=lambda r: r[0] * r[1],
        )
        # find_closest_aspect_ratio; sorted() of a set: the processor's own order, so its ties break alike
        best_diff, best = float("inf"), (1, 1)
        for cols, rows in ratios:
            diff = abs(width / height - cols / rows)
            if diff < best_diff:
                best_diff, best = diff, (cols, rows)
            elif diff == best_diff and width * height > 0.5 * self.tile_size**2 * cols * rows:
                best = (cols, rows)
        return best

    def _multi_tile(self, cols: int, rows: int) -> bool:
        return cols > 1 or rows > 1

    def _thumbnail_tokens(self, width: int, height: int) -> int:
        """``_compute_tokens_for_image`` of the smart-resized size."""
        w, h = self.resized_size(width, height)
        p, d = self.encoder_patch_size, self.downsample_factor
        return math.ceil((h // p) / d) * math.ceil((w // p) / d)

    @property
    def tokens_per_tile(self) -> int:
        """``_compute_tokens_per_tile``: 256 for 512 px tiles of 16 px patches unshuffled 2 x 2."""
        return math.ceil((self.tile_size // self.encoder_patch_size) / self.downsample_factor) ** 2

    def tiles(self, width: int, height: int) -> int:
        cols, rows = self.tile_grid(width, height)
        if cols * rows == 1:
            return 1
        return cols * rows + int(self.use_thumbnail)

    def num_tokens(self, width: int, height: int) -> int:
        cols, rows = self.tile_grid(width, height)
        thumbnail = self._thumbnail_tokens(width, height)
        # The processor counts a 1 x 1 grid (min_tiles=1) as the smart-resized image, as written here.
        if not self._multi_tile(cols, rows):
            return thumbnail
        return cols * rows * self.tokens_per_tile + (thumbnail if self.use_thumbnail else 0)

    def num_patches(self, width: int, height: int) -> int:
        """SigLIP2 patches before unshuffling (padding to the processor's ``max_num_patches`` not counted)."""
        cols, rows = self.tile_grid(width, height)
        w, h = self.resized_size(width, height)
        p = self.encoder_patch_size
        whole = (h // p) * (w // p)
        tile = (self.tile_size // p) ** 2
        if self._multi_tile(cols, rows):
            return cols * rows * tile + (whole if self.use_thumbnail else 0)
        # a large image's 1 x 1 grid (min_tiles=1) is one tile-sized crop
        return tile if self.splits and self.is_large(width, height) else whole

    @property
    def wrapper_tokens(self) -> int:  # type: ignore[override]
        """``<|image_start|>`` and ``<|image_end|>`` (none without the image special tokens)."""
        return 2 if self.use_image_special_tokens else 0

    def extra_tokens(self, width: int, height: int) -> int:
        """Start / end, one ``<|img_row_r_col_c|>`` per tile and ``<|img_thumbnail|>``, each one token."""
        cols, rows = self.tile_grid(width, height)
        if not self.use_image_special_tokens or not self._multi_tile(cols, rows):
            return self.wrapper_tokens
        return self.wrapper_tokens + cols * rows + int(self.use_thumbnail)

    def marker_prompt(self, width: int, height: int, named: Callable[[str, str], str]) -> MarkerPrompt:
        """``_build_image_tokens`` of one image with ONE image token per tile (and thumbnail); ``named(attr,
        default)`` reads the processor's (else the tokenizer's) token names."""
        image = named("image_token", "<image>")
        cols, rows = self.tile_grid(width, height)
        if not self.use_image_special_tokens:
            return MarkerPrompt(image * self.tiles(width, height), image, (image, image))
        start, end = named("image_start_token", "<|image_start|>"), named("image_end_token", "<|image_end|>")
        parts = [start]
        if self._multi_tile(cols, rows):
            parts += [f"<|img_row_{r}_col_{c}|>{image}" for r in range(1, rows + 1) for c in range(1, cols + 1)]
            if self.use_thumbnail:
                parts.append(named("image_thumbnail_token", "<|img_thumbnail|>") + image)
        else:
            parts.append(image)
        return MarkerPrompt("".join(parts) + end, image, (start, end))
