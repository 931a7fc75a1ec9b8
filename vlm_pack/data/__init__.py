"""Streaming from WebDataset tar shards to packed batches, and writing such shards.

- :mod:`vlm_pack.data.shards`: ``write_shards`` / ``write_shards_from_folder`` (convert data to tar shards),
  ``parse_text`` / ``image_fields`` (read one sample's fields back);
- :mod:`vlm_pack.data.reader`: ``stream_tar_samples`` / ``lazy_tar_samples`` (tar members -> sample dicts, the
  lazy one leaving images unread) and ``read_header`` (text + header-only image sizes, or ``SampleError``),
  shared by the pipeline and ``vlm-pack analyze``;
- :mod:`vlm_pack.data.pipeline`: ``PackedWebDataset`` (shards -> forecast -> pack -> preprocess -> collate,
  split by rank and worker, resumable; knobs from a ``PackingConfig``) and ``PackedDataLoader`` (a
  DataLoader that tracks it);
- :mod:`vlm_pack.data.stream`: one stream's work inside a DataLoader worker (``StreamRunner``, reading only
  the frozen ``WorkerSpec`` the dataset builds), run as the stages of :mod:`vlm_pack.data.stream_stages` (read
  -> forecast -> pack -> load); :mod:`vlm_pack.data.stream_meta`: the metadata each batch carries
  (``stream_info``) and the ``StreamEnd`` marker;
- :mod:`vlm_pack.data.job`: ``SampleJob``, the sample contract of every loader (forecast -> process -> one
  length check in the preprocessor's layout; a video's header read once);
- :mod:`vlm_pack.data.tracker`: ``StreamTracker``, the main process's record of what each stream delivered
  (``observe``, ``state_dict`` / ``load_state_dict``, epochs, stats);
- :mod:`vlm_pack.data.state`: the typed resume state (``PipelineState`` ...) and its versioned JSON;
- :mod:`vlm_pack.data.stats`: ``PipelineStats``, ``BadSample``, the skip reasons ``BAD_REASONS``;
- :mod:`vlm_pack.data.records`: one record normaliser for every record format (``RECORD_FORMATS``: webdataset, llava,
  sharegpt, messages, caption) -> ``Sample``;
- :mod:`vlm_pack.data.sources`: readers of ``datasets`` objects, ``save_to_disk`` folders, parquet, JSON,
  JSONL and shards, cut into chunks (``open_sources``, ``iter_samples``);
- :mod:`vlm_pack.data.forecast`: ``forecast_sources`` (header-only, ``num_proc`` processes) ->
  ``LengthTable``;
- :mod:`vlm_pack.data.fingerprint`: ``fingerprint`` (everything in a ``Preprocessor`` that changes a token)
  and ``changed_parts`` (what differs between two);
- :mod:`vlm_pack.data.plan`: ``build_plan`` (a dataset -> forecast -> packs dealt to ranks) and
  ``plan_from_lengths`` (a lengths table -> the same, nothing forecast); :mod:`vlm_pack.data.plan_folder`:
  ``Plan`` (the bins over a dataset's rows dealt to ranks, with the key and cost that made them; saved as a
  folder, memory-mapped per rank);
- :mod:`vlm_pack.data.lengths`: ``write_lengths`` / ``read_lengths`` (a ``LengthTable`` as one parquet file);
- :mod:`vlm_pack.data.map_style`: ``PackedMapDataset`` (a ``datasets.Dataset`` -> a cached or given,
  rank-balanced plan -> ``PackedBatch`` by index) and ``PackedSampler`` (resumable).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the submodule that defines it. Imported on first use (PEP 562): a process that needs one
# stage (a Ray forecast worker: the forecast and the header reader) does not load torch with the datasets.
_SOURCES: dict[str, tuple[str, ...]] = {
    "forecast": ("LengthTable", "forecast_sources"),
    "lengths": ("read_lengths", "write_lengths"),
    "map_style": ("PackedMapDataset", "PackedSampler", "plan_info"),
    "pipeline": ("PackedDataLoader", "PackedWebDataset"),
    "plan": ("Plan", "build_plan", "plan_from_lengths"),
    "reader": ("SampleHeader", "lazy_tar_samples", "read_header", "stream_tar_samples"),
    "records": ("RECORD_FORMATS", "Sample", "detect_record_format", "normalise_record"),
    "shards": ("IMAGE_EXTENSIONS", "SampleError", "image_fields", "parse_text", "write_shards",
               "write_shards_from_folder"),
    "sources": ("iter_samples", "open_sources"),
    "state": ("PipelineState",),
    "stats": ("BAD_REASONS", "BadSample", "BadSampleWarning", "PipelineStats"),
    "stream_meta": ("StreamEnd", "stream_info"),
}  # fmt: skip
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "BAD_REASONS",
    "IMAGE_EXTENSIONS",
    "RECORD_FORMATS",
    "BadSample",
    "BadSampleWarning",
    "LengthTable",
    "PackedDataLoader",
    "PackedMapDataset",
    "PackedSampler",
    "PackedWebDataset",
    "PipelineState",
    "PipelineStats",
    "Plan",
    "Sample",
    "SampleError",
    "SampleHeader",
    "StreamEnd",
    "build_plan",
    "detect_record_format",
    "forecast_sources",
    "image_fields",
    "iter_samples",
    "lazy_tar_samples",
    "normalise_record",
    "open_sources",
    "parse_text",
    "plan_from_lengths",
    "plan_info",
    "read_header",
    "read_lengths",
    "stream_info",
    "stream_tar_samples",
    "write_lengths",
    "write_shards",
    "write_shards_from_folder",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the eager imports
    from .forecast import LengthTable, forecast_sources
    from .lengths import read_lengths, write_lengths
    from .map_style import PackedMapDataset, PackedSampler, plan_info
    from .pipeline import PackedDataLoader, PackedWebDataset
    from .plan import Plan, build_plan, plan_from_lengths
    from .reader import SampleHeader, lazy_tar_samples, read_header, stream_tar_samples
    from .records import RECORD_FORMATS, Sample, detect_record_format, normalise_record
    from .shards import (
        IMAGE_EXTENSIONS,
        SampleError,
        image_fields,
        parse_text,
        write_shards,
        write_shards_from_folder,
    )
    from .sources import iter_samples, open_sources
    from .state import PipelineState
    from .stats import BAD_REASONS, BadSample, BadSampleWarning, PipelineStats
    from .stream_meta import StreamEnd, stream_info
