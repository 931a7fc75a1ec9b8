"""vlm-pack: pack image-text samples for vision-language model training, exactly.

The public API, stage by stage (see README.md for the picture):

- forecast: ``vision_spec``, ``vision_spec_from_processor``, ``image_size`` (header only)
- plan: ``pack`` (offline), ``StreamPacker`` (online, resumable), ``balance_bins`` (data-parallel ranks)
- load: ``process_sample``, ``forecast_length``
- collate: ``PackingCollator`` -> ``PackedBatch``; ``remap_cu_seqlens``, ``roll_packed``, ``pad_multiple_for``
- prove: ``vlm_pack.testing`` (``token_mult_prob_error``, ``check_packed_equivalence``)
- offline stand-ins for hub checkpoints: ``vlm_pack.offline``
"""

from ._version import __version__
from .collate import PackedBatch, PackedSeqParams, PackingCollator, pad_multiple_for
from .data import write_shards, write_shards_from_folder
from .packing import PackedBin, PackResult, StreamPacker, balance_bins, pack
from .positions import mrope_position_ids, packed_position_ids
from .processing import forecast_length, process_sample, tokenize_conversation
from .remap import collapse_cu_seqlens, remap_cu_seqlens, remap_cu_seqlens_padded, roll_packed
from .vision import VisionSpec, image_size, vision_spec, vision_spec_from_processor

__all__ = [
    "PackResult",
    "PackedBatch",
    "PackedBin",
    "PackedSeqParams",
    "PackingCollator",
    "StreamPacker",
    "VisionSpec",
    "__version__",
    "balance_bins",
    "collapse_cu_seqlens",
    "forecast_length",
    "image_size",
    "mrope_position_ids",
    "pack",
    "packed_position_ids",
    "pad_multiple_for",
    "process_sample",
    "remap_cu_seqlens",
    "remap_cu_seqlens_padded",
    "roll_packed",
    "tokenize_conversation",
    "vision_spec",
    "vision_spec_from_processor",
    "write_shards",
    "write_shards_from_folder",
]
