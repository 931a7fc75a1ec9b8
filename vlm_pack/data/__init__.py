"""Streaming from WebDataset tar shards to packed batches (and writing such shards)."""

from .shards import IMAGE_EXTENSIONS, image_fields, parse_text, write_shards, write_shards_from_folder

__all__ = [
    "IMAGE_EXTENSIONS",
    "image_fields",
    "parse_text",
    "write_shards",
    "write_shards_from_folder",
]
