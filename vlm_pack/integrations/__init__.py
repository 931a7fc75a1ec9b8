"""Adapters to the trainers users already run; each imports its library only when used.

- :mod:`vlm_pack.integrations.trl`: TRL ``SFTTrainer`` on packed VLM rows (``pip install 'vlm-pack[trl]'``):
  ``packed_sft_config`` / ``check_sft_config``, ``packed_dataset`` (a ``datasets.Dataset`` of pack plans),
  ``TRLPackingCollator`` and ``PackedSFTTrainer`` (the right ``num_tokens``).
- :mod:`vlm_pack.integrations.energon`: Megatron-Energon (``pip install 'vlm-pack[energon]'``):
  ``VLMPackingTaskEncoder`` (header forecasts, best-fit packs, ``PackedBatch`` samples with restore keys) and
  ``packed_train_dataset``.
- :mod:`vlm_pack.integrations.ray`: Ray Data (``pip install 'vlm-pack[ray]'``): ``forecast_ray`` and
  ``build_plan_ray``, the single-process lengths table and plan, bit for bit, over a Ray cluster.

``import vlm_pack.integrations`` imports none of these libraries; ``vlm_pack.integrations.PackedSFTTrainer`` (or
``from vlm_pack.integrations.trl import ...``) imports TRL at that moment.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "PackedSFTTrainer": "trl",
    "TRLPackingCollator": "trl",
    "check_sft_config": "trl",
    "packed_dataset": "trl",
    "packed_sft_config": "trl",
    "PackedVLMSample": "energon",
    "VLMPackingTaskEncoder": "energon",
    "VLMSample": "energon",
    "packed_train_dataset": "energon",
    "build_plan_ray": "ray",
    "forecast_ray": "ray",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'vlm_pack.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
