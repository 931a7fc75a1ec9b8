"""Offline stand-ins for hub checkpoints: tokenizers, image processors, processors and tiny models.

vlm-pack's tests, demo, notebook and examples run on machines that cannot reach a model hub. This package
builds, from nothing but installed packages, for every family in :data:`FAMILIES`:

- ``build_tokenizer(family)``: a byte-level BPE tokenizer trained in about a second on a built-in corpus,
  carrying the family's special tokens (``<|image_pad|>`` for Qwen, ``<image>`` for LLaVA, ``<IMG_CONTEXT>``
  for InternVL, ``<start_of_image>`` for Gemma 3, ``[IMG]`` for Mistral 3 ...) so that chat templates and
  placeholder expansion work as with the released tokenizer;
- ``image_processor(family, **overrides)``: the real Hugging Face PIL image processor (for the families of
  :data:`NEEDS_TORCHVISION`, LFM2-VL, its torchvision one) constructed with the released checkpoint's parameters (constructor defaults differ from checkpoints: Qwen2-VL's default
  ``max_pixels`` is 1003520, the checkpoint's 12845056);
- ``processor(family, tokenizer, chat_template=...)``: the family's real HF processor class around both
  (built without a video processor, which needs torchvision);
- ``tiny_model_config(family, tokenizer)`` / ``tiny_model(...)``: a real transformers model of the family,
  a few layers wide, with random weights, whose special-token ids match the tokenizer;
- for any image-text-to-text model type, record or not: ``processor_for_type(model_type)`` (its real processor
  around its image processor and a stand-in tokenizer) and ``tiny_model_for_type(model_type, processor)`` (its
  config shrunk: ``model_types.py``).

With a real checkpoint, use ``AutoProcessor`` / ``AutoTokenizer`` instead: everything else in vlm-pack
takes those objects unchanged.
"""

from __future__ import annotations

from .model_types import NotBuildable, processor_for_type, tiny_model_for_type
from .models import NEEDS_TIMM, tiny_model, tiny_model_config
from .processors import NEEDS_TORCHVISION, image_processor, processor
from .tokenizers import FAMILIES, _tokenizer_json, build_tokenizer

__all__ = [
    "FAMILIES",
    "NEEDS_TIMM",
    "NEEDS_TORCHVISION",
    "NotBuildable",
    "build_tokenizer",
    "image_processor",
    "processor",
    "processor_for_type",
    "tiny_model",
    "tiny_model_config",
    "tiny_model_for_type",
]
_ = _tokenizer_json  # re-exported for tests that pin the vocabulary
