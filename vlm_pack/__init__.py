"""vlm-pack: pack image-text samples for vision-language model training, exactly.

The public API, stage by stage (README.md draws the picture): about thirty names, each one a user calls.

- configure: ``PackingConfig`` (the packing and streaming knobs, shared by every stage and the CLI)
- process and forecast: ``Preprocessor`` (the checkpoint's parts held once: ``forecast``, ``process``,
  ``collator``), ``image_size`` (header only), ``vision_spec`` (a family's vision rule without a processor)
- plan: ``pack`` (offline), ``StreamPacker`` (online, resumable), ``balance_bins`` (data-parallel ranks)
- load: WebDataset streaming: ``PackedWebDataset``, ``write_shards``, ``write_shards_from_folder``,
  ``stream_info``; HF datasets, parquet, LLaVA/ShareGPT JSON: ``forecast_sources``, ``PackedMapDataset`` (a
  cached plan), ``PackedSampler``; ``PackedDataLoader`` for either
- collate: ``PackingCollator`` -> ``PackedBatch``; ``pad_multiple_for``, ``roll_packed`` (the label shift)
- attend: ``varlen_attention``, ``use_varlen_attention`` (HF models)
- scale out: ``shard_for_context_parallel``, ``roll_packed_context_parallel``, ``check_parallel_config``,
  ``PerTokenLoss``, ``token_cross_entropy``
- failures: ``SampleError`` (bad data, counted), ``SampleCodeError`` (a bug, raised), ``FailureBudgetError``

More lives in the modules, imported by name: ``vlm_pack.processing`` (``process_sample``,
``forecast_length`` as functions), ``vlm_pack.collate.remap`` (collapsed <-> expanded ``cu_seqlens`` for Megatron
pipelines of your own), ``vlm_pack.forward.context_parallel``, ``vlm_pack.forward.loss``, ``vlm_pack.forward.attention``,
``vlm_pack.collate.positions``, ``vlm_pack.forward.routers`` (mixture-of-experts statistics and aux loss of real tokens),
``vlm_pack.model_types`` (model types without a record: the model's own rope index per sample, ``RopeIndex``). Opt-in modules, never loaded by ``import vlm_pack``: ``vlm_pack.testing`` (prove:
``check_packed_equivalence``, ``token_mult_prob_error``), ``vlm_pack.offline`` (stand-ins for hub
checkpoints), ``vlm_pack.demo`` (demo data).

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
    "forward.attention": ("use_varlen_attention", "varlen_attention"),
    "collate.collator": ("PackedBatch", "PackingCollator", "pad_multiple_for"),
    "config": ("PackingConfig",),
    "forward.context_parallel": ("check_parallel_config", "roll_packed_context_parallel", "shard_for_context_parallel"),
    "data": ("PackedDataLoader", "PackedMapDataset", "PackedSampler", "PackedWebDataset", "forecast_sources",
             "stream_info", "write_shards", "write_shards_from_folder"),
    "failures": ("FailureBudgetError", "SampleCodeError", "SampleError"),
    "collate.labels": ("roll_packed",),
    "forward.loss": ("PerTokenLoss", "token_cross_entropy"),
    "forward.mixers": ("isolate_token_mixers",),
    "packing": ("StreamPacker", "balance_bins", "pack"),
    "preprocessor": ("Preprocessor",),
    "vision": ("image_size", "vision_spec"),
}  # fmt: skip
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "FailureBudgetError",
    "PackedBatch",
    "PackedDataLoader",
    "PackedMapDataset",
    "PackedSampler",
    "PackedWebDataset",
    "PackingCollator",
    "PackingConfig",
    "PerTokenLoss",
    "Preprocessor",
    "SampleCodeError",
    "SampleError",
    "StreamPacker",
    "__version__",
    "balance_bins",
    "check_parallel_config",
    "forecast_sources",
    "image_size",
    "isolate_token_mixers",
    "pack",
    "pad_multiple_for",
    "roll_packed",
    "roll_packed_context_parallel",
    "shard_for_context_parallel",
    "stream_info",
    "token_cross_entropy",
    "use_varlen_attention",
    "varlen_attention",
    "vision_spec",
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
    from .collate.collator import PackedBatch, PackingCollator, pad_multiple_for
    from .collate.labels import roll_packed
    from .config import PackingConfig
    from .data import (
        PackedDataLoader,
        PackedMapDataset,
        PackedSampler,
        PackedWebDataset,
        forecast_sources,
        stream_info,
        write_shards,
        write_shards_from_folder,
    )
    from .failures import FailureBudgetError, SampleCodeError, SampleError
    from .forward.attention import use_varlen_attention, varlen_attention
    from .forward.context_parallel import (
        check_parallel_config,
        roll_packed_context_parallel,
        shard_for_context_parallel,
    )
    from .forward.loss import PerTokenLoss, token_cross_entropy
    from .packing import StreamPacker, balance_bins, pack
    from .preprocessor import Preprocessor
    from .vision import image_size, vision_spec
