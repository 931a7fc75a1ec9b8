"""Exact vision-token forecasts from image sizes, and image sizes from file headers.

To fill a packing bin, the packer must know how many tokens each sample becomes *before* any image is
decoded. That count is a pure function of the image's ``(width, height)`` and the processor's parameters,
but every family has its own resize / tiling rule, and approximations under-forecast: an under-forecast
overflows the bin at training time. This module reproduces each Hugging Face processor's rule, float64
operation for float64 operation (Python ``round`` is half-to-even), so that the forecast equals what the
processor produces, for every size the processor accepts, and raises ``ValueError`` where it fails::

    image bytes --image_size()--> (width, height) --spec.num_tokens()--> placeholder tokens
      (header only,                                 + spec.wrapper_tokens    (<|vision_start|> ...)
       EXIF-aware)                                  spec.num_patches()       (ViT patches, 2nd budget)

    Qwen2-VL 1920x1080: 2691 tokens (smart_resize.py)   InternVL 640x480: 13 tiles, 3328 tokens (tiles.py)

Vocabulary used throughout:

- ``num_tokens(width, height)``: the placeholder tokens the language model sees for one image (the tokens a
  processor's ``replace_image_token`` repeats: ``<|image_pad|>``, ``<image>``, ``<IMG_CONTEXT>``, ...;
  LLaVA-NeXT's image-newline features are image features and are counted here);
- ``wrapper_tokens``: special tokens around each image that are *not* placeholders (``<|vision_start|>`` /
  ``<|vision_end|>``, ``<img>`` / ``</img>``); ``extra_tokens(width, height)`` generalises it where the
  wrapper depends on the size (Idefics3 tile markers, Pixtral row breaks); ``total_tokens`` is the sum;
- ``num_patches(width, height)``: vision-encoder patch embeddings before any merge / pooling (class tokens
  excluded), i.e. ``pixel_values`` rows for Qwen: the second budget, for ViT memory;
- ``tiles(width, height)``: the crops the vision encoder sees (thumbnail / base image included).

Every spec is a frozen dataclass whose defaults are the released checkpoint's ``preprocessor_config.json``
(constructor defaults in transformers often differ: Qwen2-VL's default ``max_pixels`` is 1003520, the
checkpoint's 12845056). Build one with :func:`vision_spec` (family name and overrides) or
:func:`vision_spec_from_processor` (a live HF image processor / processor).

EXIF: sizes are the size the processor sees; :func:`image_size` honours the EXIF orientation as
transformers' ``load_image`` does (``exif_transpose=False`` when your loader does not transpose): see
``headers.py``.

Where things live (one file per rule; every name below is importable from ``vlm_pack.vision``):

- ``spec.py``: :class:`VisionSpec`, the contract every family meets, and the size checks;
- ``smart_resize.py``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V (``smart_resize``; images and videos);
- ``anyres.py``: LLaVA-1.5 (fixed crop), LLaVA-NeXT and LLaVA-OneVision (anyres pinpoints);
- ``tiles.py``: InternVL, Idefics3 / SmolVLM, Gemma 3, LFM2-VL (fixed-size tiles and crops);
- ``pixtral.py``: Pixtral (patches with row breaks);
- ``patch_budget.py``: Gemma 4 (aspect kept, whole pooled patches within a token budget);
- ``megatron.py``: Megatron-LM / NeMo LLaVA (fixed embeddings per tile);
- ``families.py``: :func:`vision_spec`, a family's spec by name (which rule each family has: ``vlm_pack.families``);
- ``from_processor.py``: :func:`vision_spec_from_processor`: a record's fast rule for the processor classes it
  names (one reader per rule), the exact route for any other processor, refusal by name otherwise;
- ``oracle.py``: :class:`ProcessorSpec`, the exact route: the processor's own image step on blank canvases of
  the header's size (memoized by settings and sizes), for any processor with ``replace_image_token``;
- ``headers.py``: :func:`image_size`, header-only sizes of JPEG / PNG / GIF / WebP (others via Pillow);
- ``video/``: :func:`read_video_header` (a video's exact frame count, rate and size without decoding) and
  :func:`forecast_video` (its tokens in the family's video processor: Qwen-VL, LLaVA-OneVision, InternVL).
"""

from __future__ import annotations

from .anyres import LlavaNextSpec, LlavaOnevisionSpec, LlavaSpec, select_best_resolution
from .families import vision_spec
from .from_processor import vision_spec_from_processor
from .headers import ImageSource, image_size
from .megatron import MegatronSpec
from .oracle import ProcessorSpec
from .patch_budget import Gemma4Spec
from .pixtral import PixtralSpec
from .smart_resize import Glm4vSpec, Qwen2VLSpec, Qwen3VLSpec, smart_resize
from .spec import VisionSpec
from .tiles import Gemma3nSpec, Gemma3Spec, Idefics3Spec, InternVLSpec, Lfm2VlSpec
from .video import VideoForecast, VideoHeader, VideoSource, forecast_video, read_video_header, sampled_frames

__all__ = [
    "Gemma3Spec",
    "Gemma3nSpec",
    "Gemma4Spec",
    "Glm4vSpec",
    "Idefics3Spec",
    "ImageSource",
    "InternVLSpec",
    "Lfm2VlSpec",
    "LlavaNextSpec",
    "LlavaOnevisionSpec",
    "LlavaSpec",
    "MegatronSpec",
    "PixtralSpec",
    "ProcessorSpec",
    "Qwen2VLSpec",
    "Qwen3VLSpec",
    "VideoForecast",
    "VideoHeader",
    "VideoSource",
    "VisionSpec",
    "forecast_video",
    "image_size",
    "read_video_header",
    "sampled_frames",
    "select_best_resolution",
    "smart_resize",
    "vision_spec",
    "vision_spec_from_processor",
]
