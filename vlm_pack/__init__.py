"""vlm-pack: pack image-text samples for vision-language model training, exactly."""

from ._version import __version__

__all__ = ["__version__"]
