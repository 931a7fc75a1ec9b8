"""Loading a sample's images: paths, bytes or PIL images to RGB, with EXIF orientation, bad files as data errors."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

from ..failures import ImageDecodeError, SampleError


def load_image(source: Any, name: str = "image") -> Any:
    """A PIL RGB image from a path, bytes or PIL image, with EXIF orientation applied (as HF ``load_image``).

    Raises:
        ImageDecodeError: (a ``SampleError`` and an ``OSError``, reason ``"decode_error"``) naming ``name``
            when the file is missing, unreadable, truncated, not an image, or a decompression bomb: bad
            data, counted and skipped by the pipelines.
        SampleError: reason ``"corrupt_image"`` for a value that is no image (not a path, bytes or image).
    """
    import struct

    from PIL import Image, ImageOps

    if not isinstance(source, (Image.Image, bytes, bytearray, memoryview, str, os.PathLike)):
        raise SampleError(
            "corrupt_image",
            f"{name}: cannot load an image from {type(source).__name__}: give a path, bytes or PIL image",
        )
    try:
        if isinstance(source, Image.Image):
            image = source
        else:
            image = Image.open(
                io.BytesIO(bytes(source)) if not isinstance(source, (str, os.PathLike)) else source
            )
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")  # decodes the pixels: a truncated file fails here
    # Pillow's decoders report bad files as OSError (UnidentifiedImageError, "image file is truncated"),
    # SyntaxError (broken PNG chunks), EOFError, struct.error or ValueError, and bombs as their own error
    except (OSError, SyntaxError, EOFError, ValueError, struct.error, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(
            "decode_error", f"{name} does not decode: {type(exc).__name__}: {exc}"
        ) from exc


def _load_images(images: Sequence[Any], key: Any) -> list[Any]:
    """``load_image`` of each of a sample's images, errors naming the sample and the image."""
    return [load_image(image, f"sample {key!r}, image {i}") for i, image in enumerate(images)]


