"""Join several samples' vision tensors the way each model reads a batch of them.

Every HF VLM scatters its image features into the image tokens of ``input_ids`` in reading order (row by
row, left to right), so the images of a packed batch only have to come in packed order. What differs is
the *shape* each model wants the images of several samples in::

    family                       per sample (processor)               joined (N samples)
    Qwen2/2.5/3-VL, GLM-4.1V     pixel_values [P_i, D], grid [n_i, 3]  cat dim 0
    LLaVA-1.5, InternVL, Gemma 3 pixel_values [n_i, C, H, W]           cat dim 0 (InternVL: tiles)
    LLaVA-NeXT, OneVision        pixel_values [n_i, tiles_i, C, H, W]  zero-pad dim 1 to most tiles, cat dim 0
                                 image_sizes [n_i, 2]                  cat dim 0 (the model slices the tiles)
                                 batch_num_images [1] (OneVision)      cat: one entry per *sample*
    Idefics3, SmolVLM            pixel_values [1, N_i, C, H, W]        cat dim 1: [1, sum N_i, C, H, W]
                                 pixel_attention_mask [1, N_i, H, W]   cat dim 1: [1, sum N_i, H, W]
    Granite-Docling              pixel_values [1, N_i, C, H, W]        cat dim 1: [1, sum N_i, C, H, W]
                                 pixel_attention_mask [1, N_i]         cat dim 1: [1, sum N_i] (a tile's mask)
    Mistral3 / Pixtral tower     pixel_values [n_i, C, H_i, W_i]       zero-pad H, W to the max, cat dim 0
                                 image_sizes [n_i, 2]                  cat dim 0 (the tower crops each image)
    Gemma 4                      pixel_values [n_i, P, D] patch rows   cat dim 0
                                 image_position_ids [n_i, P, 2]        cat dim 0
    Molmo2                       pixel_values [N_i, P, D] crops        cat dim 0 (its pooling indices are per image)
    LFM2-VL (SigLIP2-NaFlex)     pixel_values [N_i, P_i, D]            zero-pad P to the max, cat dim 0
                                 pixel_attention_mask [N_i, P_i]       zero-pad P (padding), cat dim 0
                                 spatial_shapes [N_i, 2]               cat dim 0 (patch rows, cols per crop)
    MiniCPM-V 4.6 / 4.7, OCR     pixel_values [1, C, p, p * S_i]       cat dim 3: [1, C, p, p * sum S_i]
    (NaViT-packed)               target_sizes [N_i, 2]                 cat dim 0 (S_i: sum of h * w over rows)

(``N_i``: crops, tiles and thumbnails of sample ``i``'s images in order; NaFlex pads each crop's patches to
the processor's ``max_num_patches``, and the tower reads only the ``spatial_shapes`` patches the mask keeps.)

OneVision's ``batch_num_images`` must stay per sample: one sample with several images skips the anyres
tiling of each image, a sample with one image keeps it. Summing a row into one entry switches every image
of the row to multi-image mode (the token counts then no longer match).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .._compat import shared_empty

__all__ = ["VISION_KEYS", "check_patch_rows", "join_vision"]

#: Vision tensors the HF models take, joined across samples by :func:`join_vision` in packed order.
VISION_KEYS = (
    "pixel_values",
    "pixel_attention_mask",
    "image_grid_thw",
    "image_sizes",
    "spatial_shapes",
    "batch_num_images",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "image_position_ids",
    "target_sizes",
)


def _whole(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor ``parts`` were cut from along dim 0, when they are all of it, in order; else None.

    ``process_pack`` runs a pack's images through one image-processor call and gives each sample its rows
    as a view: joining them again is that tensor (no copy). Only parts that tile their whole storage, back
    to back, qualify, so the result never exposes memory the parts did not cover.
    """
    first = parts[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for part in parts:
        if (
            part.untyped_storage().data_ptr() != storage.data_ptr()
            or part.storage_offset() != offset
            or not part.is_contiguous()
            or part.dtype != first.dtype
            or part.shape[1:] != first.shape[1:]
        ):
            return None
        offset += part.numel()
    if first.storage_offset() != 0 or offset * first.element_size() != storage.nbytes():
        return None
    shape = (sum(part.shape[0] for part in parts), *first.shape[1:])
    return first.new_empty(0).set_(storage, 0, shape)


def _empty_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from 4 MiB on, numpy's memory, which numpy asks the kernel to back with
    huge pages (``madvise(MADV_HUGEPAGE)``, where c10's allocator does not): joining ~80 MB of
    ``pixel_values`` then takes ~450 page faults instead of ~21,000 and 30-50% less time where transparent
    huge pages are in their common ``madvise`` mode (the same as ``torch.empty`` elsewhere)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < 1 << 22:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)``; along dim 0 on the CPU into memory chosen for it (no copy at all for
    parts cut from one tensor, all of it in order: see :func:`_whole`).

    The DataLoader moves a worker's batch to the main process through shared memory: concatenating into
    it directly (as ``default_collate`` does) saves a second copy of ``pixel_values``, the largest tensor
    of a batch. Outside workers, large joins go to huge-page-advised memory (:func:`_empty_cpu`).
    """
    if dim == 0 and (whole := _whole(parts)) is not None:
        return whole
    same = all(p.dtype == parts[0].dtype and not p.requires_grad for p in parts)
    if dim != 0 or parts[0].device.type != "cpu" or not same:
        return torch.cat(parts, dim)
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if torch.utils.data.get_worker_info() is None:
        return torch.cat(parts, 0, out=_empty_cpu(shape, parts[0].dtype))
    return torch.cat(parts, 0, out=shared_empty(parts[0], shape))


def _pad_to(parts: list[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
    """Zero-pad every part at the end of ``dims`` to the largest size among the parts."""
    most = {d: max(p.shape[d] for p in parts) for d in dims}
    out = []
    for p in parts:
        pad = [0] * (2 * p.dim())
        for d in dims:
            pad[2 * (p.dim() - 1 - d) + 1] = most[d] - p.shape[d]
        out.append(F.pad(p, pad) if any(pad) else p)
    return out


def _navit_packed(per_sample: Sequence[dict[str, torch.Tensor]]) -> bool:
    """Every sample's ``pixel_values`` ``[1, C, p, p * S]`` lays its crops' ``p x p`` patches side by side on
    the last axis, ``S`` = the sum of ``h * w`` over its ``target_sizes`` rows ``[N, 2]`` (MiniCPM-V 4.6's image
    processor); the model reads ``pixel_values[:1]`` of a batch, so several samples' patches join on that axis."""
    with_pixels = [s for s in per_sample if "pixel_values" in s]
    if not with_pixels or not all("target_sizes" in s for s in with_pixels):
        return False
    for s in with_pixels:
        pv, sizes = s["pixel_values"], s["target_sizes"].reshape(-1, 2)
        if pv.dim() != 4 or pv.shape[0] != 1 or pv.shape[3] != pv.shape[2] * int(sizes.prod(-1).sum()):
            return False
    return True


def _join_pixel_values(parts: list[torch.Tensor], crops_flat: bool, patch_rows: bool) -> torch.Tensor:
    if patch_rows:  # LFM2-VL: [N_i, P_i, D] crops of patch rows, each padded to P_i
        return _cat(_pad_to(parts, (1,)))
    if all(p.dim() == 3 for p in parts):
        if len({p.shape[0] for p in parts}) > 1:  # [crops_i, patches, D] (Molmo2): [C, H, W] images share C
            return _cat(parts)
        parts = [p[None] for p in parts]  # single [C, H, W] images
    if crops_flat:  # Idefics3 / SmolVLM: [1, N_i, C, H, W] -> [1, sum N_i, C, H, W]
        return _cat(_pad_to(parts, (3, 4)), 1)
    if parts[0].dim() == 5:  # LLaVA-NeXT / OneVision tiles: the model keeps each image's own by image_sizes
        return _cat(_pad_to(parts, (1, 3, 4)))
    if parts[0].dim() == 4:  # Pixtral: each sample padded to its own largest image; the tower crops
        return _cat(_pad_to(parts, (2, 3)))
    return _cat(parts)


def check_patch_rows(vision: dict[str, torch.Tensor], name: str) -> None:
    """ValueError naming ``name`` when a sample's NaFlex crops (LFM2-VL: ``pixel_values`` [N, P, D] with a
    ``pixel_attention_mask`` [N, P]) and its mask disagree on P.

    transformers' ``Lfm2VlImageProcessor`` (5.24) pads every crop's patches to ``max_num_patches`` but does not
    cut them: an image of extreme aspect ratio whose smart-resized size holds more patches (e.g. 10000x20: 1428
    > 1024) gets a mask shorter than its patches, which the vision tower cannot read, alone as packed.
    """
    pixels, mask = vision.get("pixel_values"), vision.get("pixel_attention_mask")
    if pixels is None or mask is None or mask.dim() != 2:
        return
    if pixels.dim() == 5 and pixels.shape[:2] == mask.shape:  # Granite-Docling: one mask entry per tile
        return
    if pixels.dim() != 3 or pixels.shape[:2] != mask.shape:
        raise ValueError(
            f"{name}: pixel_values {tuple(pixels.shape)} and pixel_attention_mask {tuple(mask.shape)} disagree "
            "(an image whose resized size holds more patches than the image processor's max_num_patches: "
            "extreme aspect ratios); crop or pad the image nearer to square, or drop the sample"
        )


def join_vision(per_sample: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The vision tensors of ``per_sample`` (dicts in packed order) joined for one model call.

    Keys are those of :data:`VISION_KEYS` the samples have (samples without images simply lack them).
    Raises ``ValueError`` naming the key when the samples' tensors cannot be joined (e.g. images from two
    different image processors).
    """
    out: dict[str, torch.Tensor] = {}
    masks = [s["pixel_attention_mask"] for s in per_sample if "pixel_attention_mask" in s]
    # Idefics3 / SmolVLM carry a per-crop pixel mask [1, N, H, W]: their crops join along the crop axis;
    # LFM2-VL a per-crop patch mask [N, P]: its crops join along dim 0 as they come
    # (Granite-Docling: Idefics3's tiles [1, N, C, H, W] with a mask entry per tile [1, N]: joined like Idefics3's)
    flat_masks = any(m.dim() == 2 for m in masks)
    tile_masks = flat_masks and all(s["pixel_values"].dim() == 5 for s in per_sample if "pixel_values" in s)
    crops_flat = any(m.dim() == 4 for m in masks) or tile_masks
    patch_rows = flat_masks and not tile_masks
    if crops_flat and patch_rows:
        raise ValueError("cannot join 'pixel_attention_mask' of two model families (pixel and patch masks)")
    # Gemma 4 gives each image's patches as rows, with their (x, y) in image_position_ids.
    patches = any("image_position_ids" in s for s in per_sample)
    navit = _navit_packed(per_sample)
    for key in VISION_KEYS:
        parts = [s[key] for s in per_sample if key in s]
        if not parts:
            continue
        try:
            if key == "pixel_values" and patches:  # Gemma 4: [n_i, max_patches, D] patch rows per image
                out[key] = _cat(parts)
            elif key == "pixel_values" and navit:
                out[key] = _cat(parts, 3)
            elif key == "pixel_values":
                out[key] = _join_pixel_values(parts, crops_flat, patch_rows)
            elif key == "pixel_attention_mask" and tile_masks:
                out[key] = _cat(parts, 1)
            elif key == "pixel_attention_mask" and patch_rows:
                out[key] = _cat(_pad_to(parts, (1,)))
            elif key == "pixel_attention_mask":
                out[key] = _cat(_pad_to(parts, (2, 3)), 1)
            else:
                out[key] = _cat([p.reshape(1) if p.dim() == 0 else p for p in parts])
        except RuntimeError as e:
            raise ValueError(f"cannot join the samples' {key!r}: {e}") from None
    return out
