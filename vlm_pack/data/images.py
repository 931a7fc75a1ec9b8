"""An image's size from its header, and the limits a sample's images are held to before any pixel is decoded.

Every path that forecasts or loads a sample sizes its images here (:func:`image_sizes`): the header-only
forecast (``forecast_sources``, ``build_plan``, ``forecast_ray``, the CLI), ``PackedMapDataset`` when a pack
loads, and the stream (:func:`refuse_large_image`), so ``max_image_pixels`` holds the same everywhere and
``--verify`` names what it finds (a decompression bomb, a truncated file).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ..failures import SampleError
from .records import Sample

__all__ = ["image_sizes", "refuse_large_image"]


def image_sizes(
    sample: Sample,
    *,
    exif_transpose: bool = True,
    verify: bool = False,
    max_image_pixels: int | None = None,
) -> list[tuple[int, int]]:
    """``(width, height)`` of each image of ``sample`` as the processor will see it, from headers only.

    An image whose header declares more than ``max_image_pixels`` is refused there, before any pixel is
    decoded (:func:`refuse_large_image`). ``verify=True`` also decodes every image's pixels (catches a file
    cut short after its header). Raises :class:`SampleError` naming the sample and image: ``"corrupt_image"``
    for an unreadable one, ``"image_too_large"`` for one over the limit (or that Pillow refuses as a
    decompression bomb).
    """
    from ..vision import image_size

    sizes = []
    for i, image in enumerate(sample.images):
        if hasattr(image, "size") and not hasattr(image, "read"):  # a decoded PIL image: used as it is
            sizes.append(tuple(image.size))
            continue
        name = f"{sample.label}, image {i}"
        try:
            size = image_size(image, exif_transpose=exif_transpose, name=name)
        except ValueError as e:
            raise SampleError("corrupt_image", str(e)) from None
        refuse_large_image(name, size, max_image_pixels)
        if verify:
            _decode_fully(image, name)
        sizes.append(size)
    return sizes


def refuse_large_image(name: str, size: tuple[int, int], limit: int | None) -> None:
    """Raise ``SampleError("image_too_large")`` naming the image when its header's ``(width, height)`` has
    more than ``limit`` pixels (``PackingConfig.max_image_pixels``; None: no cap): before decoding, at plan
    time and at load time alike."""
    width, height = size
    if limit is None or width * height <= limit:
        return
    raise SampleError(
        "image_too_large",
        f"{name}: its header declares {width}x{height} = {width * height:,} pixels > max_image_pixels "
        f"{limit:,}; refused before decoding (a decompression bomb or an oversized scan). Downscale it, or raise "
        "PackingConfig.max_image_pixels (--max-image-pixels; None: no cap) if such images are expected.",
    )


def _decode_fully(image: Any, name: str) -> None:
    """Decode every pixel of ``image`` (bytes, a path or a seekable binary file; left where it was); raises
    ``SampleError`` naming the real cause: Pillow's decompression-bomb limit, or a truncated or corrupt file."""
    from PIL import Image

    try:
        if hasattr(image, "read"):
            at = image.tell()
            data = image.read()
            image.seek(at)
        else:
            data = image if isinstance(image, bytes) else Path(image).read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Image.DecompressionBombError as e:
        raise SampleError(
            "image_too_large",
            f"{name}: Pillow refuses to decode it as a decompression bomb ({e}); not decoded. Downscale it, or "
            "raise PIL.Image.MAX_IMAGE_PIXELS if such images are expected.",
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise SampleError(
            "corrupt_image",
            f"{name}: the header reads but the pixels do not decode ({e}): the file is truncated or corrupt.",
        ) from None
