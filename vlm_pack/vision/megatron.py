"""Megatron-LM / NeMo LLaVA: a fixed number of embeddings per tile, one placeholder per image in the ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .spec import VisionSpec, _check_size
from .tiles import InternVLSpec


@dataclass(frozen=True)
class MegatronSpec(VisionSpec):
    """Megatron-LM / NeMo LLaVA (``clip_vit_model.get_num_image_embeddings``): a fixed count per tile.

    ``per_tile = (img_h // patch) * (img_w // patch) + class_token_len`` (CLIP 1, SigLIP 0, 0 when
    ``--disable-vision-class-token``), times 0.25 with pixel shuffle; ``tokens = tiles * per_tile``.
    Tiles follow InternVL's dynamic tiling when ``max_tiles > 1`` (``use_tiling``), with a thumbnail.
    The input ids hold ONE placeholder (-200) per image, expanded to ``tokens`` embeddings in the model:
    see ``vlm_pack.collate.remap`` for the collapsed -> expanded ``cu_seqlens`` mapping.
    """

    family: ClassVar[str] = "megatron"

    img_h: int = 336
    """Height in pixels of the tile the vision encoder takes (Megatron-LM ``--img-h``)."""
    img_w: int = 336
    """Width in pixels of that tile (``--img-w``); tiling uses square tiles of side ``img_h``."""
    patch_dim: int = 14
    """Side of a ViT patch in pixels (``--patch-dim``)."""
    class_token_len: int = 1
    """Class tokens the ViT prepends to each tile: 1 for CLIP and InternViT, 0 for SigLIP, which has none
    (``class_token_len`` of ``CLIPViTModel``)."""
    disable_vision_class_token: bool = False
    """Drop the class tokens from the image embeddings (``--disable-vision-class-token``)."""
    pixel_shuffle: bool = False
    """Merge 2x2 patches into one embedding, a quarter of the count (``--pixel-shuffle``)."""
    max_tiles: int = 1
    """Most tiles per image; above 1 turns on InternVL's dynamic tiling (``--use-tiling --max-num-tiles``)."""
    min_tiles: int = 1
    """Fewest tiles of a tiling grid (``min_num=1`` in Megatron-LM's ``get_visual_transform``)."""
    use_thumbnail: bool = True
    """Add a whole-image thumbnail tile when the image is cut into more than one (``--use-thumbnail``)."""
    wrapper_tokens: int = 0
    """Tokens around each image's placeholder in the ids: none unless the prompt template adds image tags."""

    def __post_init__(self) -> None:
        self._check_positive("img_h", "img_w", "patch_dim", "min_tiles", "max_tiles")

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
