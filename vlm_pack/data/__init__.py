"""Streaming from WebDataset tar shards to packed batches, and writing such shards.

- :mod:`vlm_pack.data.shards`: ``write_shards`` / ``write_shards_from_folder`` (convert data to tar shards),
  ``parse_text`` / ``image_fields`` (read one sample's fields back);
- :mod:`vlm_pack.data.pipeline`: ``PackedWebDataset`` (shards -> forecast -> pack -> preprocess -> collate,
  split by rank and worker, resumable) and ``PackedDataLoader`` (a DataLoader that tracks it).
"""

from .pipeline import (
    BAD_REASONS,
    BadSample,
    BadSampleWarning,
    PackedDataLoader,
    PackedWebDataset,
    PipelineStats,
    build_packed_pipeline,
    stream_info,
)
from .shards import IMAGE_EXTENSIONS, image_fields, parse_text, write_shards, write_shards_from_folder

__all__ = [
    "BAD_REASONS",
    "IMAGE_EXTENSIONS",
    "BadSample",
    "BadSampleWarning",
    "PackedDataLoader",
    "PackedWebDataset",
    "PipelineStats",
    "build_packed_pipeline",
    "image_fields",
    "parse_text",
    "stream_info",
    "write_shards",
    "write_shards_from_folder",
]
