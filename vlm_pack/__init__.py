"""vlm-pack: pack image-text samples for vision-language model training, exactly.

The public API, stage by stage (README.md draws the picture):

- configure: ``PackingConfig`` (the packing and streaming knobs, shared by every stage and the CLI)
- forecast: ``vision_spec``, ``vision_spec_from_processor``, ``image_size`` (header only)
- plan: ``pack`` (offline), ``StreamPacker`` (online, resumable), ``balance_bins`` (data-parallel ranks)
- load: ``process_sample``, ``forecast_length``; WebDataset streaming: ``PackedWebDataset``, ``write_shards``;
  HF datasets, parquet, LLaVA/ShareGPT JSON: ``forecast_sources``, ``PackedMapDataset`` (a cached plan)
- collate: ``PackingCollator`` -> ``PackedBatch``; ``remap_cu_seqlens``, ``roll_packed``, ``pad_multiple_for``
- attend: ``varlen_attention``, ``use_varlen_attention`` (HF models)
- scale out: ``shard_for_context_parallel``, ``roll_packed_context_parallel``, ``PerTokenLoss``
- prove: ``vlm_pack.testing`` (``token_mult_prob_error``, ``check_packed_equivalence``)
- offline stand-ins for hub checkpoints: ``vlm_pack.offline``

Every name is imported on first use (PEP 562): ``import vlm_pack`` loads none of the submodules, so the
command line, spawned DataLoader workers and ``import vlm_pack`` in a training script pay only for the
stages they touch (Megatron-Core, matplotlib and the test harness are never imported unless asked for).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import check_transformers
from ._version import __version__

check_transformers()  # below the supported range: a clear ImportError now, not a TypeError in a model later

# public name -> the submodule that defines it (relative to vlm_pack)
_SOURCES: dict[str, tuple[str, ...]] = {
    "attention": ("available_backends", "register_hf_attention", "resolve_backend", "use_varlen_attention",
                  "varlen_attention"),
    "collate": ("PackedBatch", "PackedSeqParams", "PackingCollator", "pad_multiple_for"),
    "config": ("PackingConfig",),
    "failures": ("FailureBudgetError", "SampleCodeError", "SampleError"),
    "data": ("PackedDataLoader", "PackedMapDataset", "PackedSampler", "PackedWebDataset", "PipelineStats",
             "forecast_sources", "stream_info", "write_shards", "write_shards_from_folder"),
    "packing": ("PackedBin", "PackResult", "StreamPacker", "balance_bins", "pack"),
    "parallel": ("ContextParallelShard", "PerTokenLoss", "all_gather_from_context_parallel",
                 "check_parallel_config", "context_parallel_index", "gather_from_context_parallel",
                 "reduce_token_loss", "roll_packed_context_parallel", "shard_for_context_parallel",
                 "token_cross_entropy"),
    "positions": ("mrope_position_ids", "packed_position_ids"),
    "preprocessor": ("Preprocessor",),
    "processing": ("forecast_length", "process_sample", "tokenize_conversation"),
    "remap": ("collapse_cu_seqlens", "remap_cu_seqlens", "remap_cu_seqlens_padded", "roll_packed"),
    "vision": ("VisionSpec", "image_size", "vision_spec", "vision_spec_from_processor"),
}  # fmt: skip
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}
_SUBMODULES = ("offline", "testing")  # public as modules: vp.offline.build_tokenizer, vp.testing...

__all__ = [
    "ContextParallelShard",
    "FailureBudgetError",
    "PackResult",
    "PackedBatch",
    "PackedBin",
    "PackedDataLoader",
    "PackedMapDataset",
    "PackedSampler",
    "PackedSeqParams",
    "PackedWebDataset",
    "PackingCollator",
    "PackingConfig",
    "PerTokenLoss",
    "PipelineStats",
    "Preprocessor",
    "SampleCodeError",
    "SampleError",
    "StreamPacker",
    "VisionSpec",
    "__version__",
    "all_gather_from_context_parallel",
    "available_backends",
    "balance_bins",
    "check_parallel_config",
    "collapse_cu_seqlens",
    "context_parallel_index",
    "forecast_length",
    "forecast_sources",
    "gather_from_context_parallel",
    "image_size",
    "mrope_position_ids",
    "offline",
    "pack",
    "packed_position_ids",
    "pad_multiple_for",
    "process_sample",
    "reduce_token_loss",
    "register_hf_attention",
    "remap_cu_seqlens",
    "remap_cu_seqlens_padded",
    "resolve_backend",
    "roll_packed",
    "roll_packed_context_parallel",
    "shard_for_context_parallel",
    "stream_info",
    "testing",
    "token_cross_entropy",
    "tokenize_conversation",
    "use_varlen_attention",
    "varlen_attention",
    "vision_spec",
    "vision_spec_from_processor",
    "write_shards",
    "write_shards_from_folder",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the eager imports
    from . import offline, testing
    from .attention import (
        available_backends,
        register_hf_attention,
        resolve_backend,
        use_varlen_attention,
        varlen_attention,
    )
    from .collate import PackedBatch, PackedSeqParams, PackingCollator, pad_multiple_for
    from .config import PackingConfig
    from .data import (
        PackedDataLoader,
        PackedMapDataset,
        PackedSampler,
        PackedWebDataset,
        PipelineStats,
        forecast_sources,
        stream_info,
        write_shards,
        write_shards_from_folder,
    )
    from .failures import FailureBudgetError, SampleCodeError, SampleError
    from .packing import PackedBin, PackResult, StreamPacker, balance_bins, pack
    from .parallel import (
        ContextParallelShard,
        PerTokenLoss,
        all_gather_from_context_parallel,
        check_parallel_config,
        context_parallel_index,
        gather_from_context_parallel,
        reduce_token_loss,
        roll_packed_context_parallel,
        shard_for_context_parallel,
        token_cross_entropy,
    )
    from .positions import mrope_position_ids, packed_position_ids
    from .preprocessor import Preprocessor
    from .processing import forecast_length, process_sample, tokenize_conversation
    from .remap import collapse_cu_seqlens, remap_cu_seqlens, remap_cu_seqlens_padded, roll_packed
    from .vision import VisionSpec, image_size, vision_spec, vision_spec_from_processor
