"""The contract every family's forecast meets: :class:`VisionSpec`, and the size checks they share.

A spec is a frozen dataclass whose methods are pure functions of the image's ``(width, height)`` as the
processor sees it (after EXIF transposition, see :func:`vlm_pack.vision.image_size`). The families live
next door, grouped by the rule they follow (``smart_resize.py``, ``anyres.py``, ``tiles.py``, ...).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np

from .._checks import checked_count

_PIXELS_FIX = (
    "image sizes must be positive whole pixels: check the image header (see vlm_pack.vision.image_size)."
)


def _check_size(family: str, width: Any, height: Any) -> tuple[int, int]:
    if type(width) is int and type(height) is int and width > 0 and height > 0:  # the common case, fast
        return width, height
    return (
        checked_count(width, f"{family}: image width", _PIXELS_FIX),
        checked_count(height, f"{family}: image height", _PIXELS_FIX),
    )


class MarkerPrompt(NamedTuple):
    """A processor's expansion of one image written with ONE image token per crop (``text``), for families whose
    processor writes tile markers between the crops (``wraps="processor_markers"``): tokenized, it gives the
    marker tokens the image adds besides its image tokens, for any tokenizer.

    ``image``: the image token written in ``text``; ``edges``: the special tokens opening and closing ``text``,
    which the tokenizer must keep whole (then the expansion tokenizes alone as it does inside a prompt).
    """

    text: str
    image: str
    edges: tuple[str, str]


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

    def _check_positive(self, *names: str) -> None:
        """ValueError naming the field when one of ``names`` is not a positive integer (a bad spec, not bad data)."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{self.family}: {name} must be a positive integer, got {value!r}.")

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
        for pair, (width, height) in enumerate(pairs.tolist()):
            try:
                out[pair] = fn(width, height)
            except (ValueError, TypeError) as e:
                first = int(np.flatnonzero(inverse == pair)[0])
                raise type(e)(f"image {first} ({width}x{height}): {e}") from None
        return out[inverse]

    def to_dict(self) -> dict[str, Any]:
        """The spec's parameters (family included), e.g. for logging next to a packing plan."""
        out: dict[str, Any] = {"family": self.family}
        for f in fields(self):  # type: ignore[arg-type]
            out[f.name] = getattr(self, f.name)
        return out


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
