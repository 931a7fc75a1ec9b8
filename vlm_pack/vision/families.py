"""The family registry: :func:`vision_spec` builds a spec by family name with its checkpoint's defaults.

Every default is the released checkpoint's ``preprocessor_config.json`` (the comment above each entry names
the checkpoint); constructor defaults in transformers often differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._checks import canonical_family, family_entry
from .anyres import LlavaNextSpec, LlavaOnevisionSpec, LlavaSpec
from .megatron import MegatronSpec
from .pixtral import PixtralSpec
from .smart_resize import Glm4vSpec, Qwen2VLSpec, Qwen3VLSpec
from .spec import VisionSpec
from .tiles import Gemma3Spec, Idefics3Spec, InternVLSpec

_SMOLVLM_DEFAULTS = dict(longest_edge=4 * 384, max_image_size=384, image_seq_len=81, variant="smolvlm")

_FAMILY_FACTORIES: dict[str, Callable[..., VisionSpec]] = {
    # Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2_vl": lambda **kw: Qwen2VLSpec(**kw),
    "qwen2_5_vl": lambda **kw: Qwen2VLSpec(**{"variant": "qwen2_5_vl", **kw}),
    # Qwen/Qwen3-VL-8B-Instruct (image and video preprocessor configs)
    "qwen3_vl": lambda **kw: Qwen3VLSpec(**kw),
    # THUDM/GLM-4.1V-9B-Thinking
    "glm4v": lambda **kw: Glm4vSpec(**kw),
    # llava-hf/llava-1.5-7b-hf
    "llava": lambda **kw: LlavaSpec(**kw),
    # llava-hf/llava-v1.6-mistral-7b-hf
    "llava_next": lambda **kw: LlavaNextSpec(**kw),
    # llava-hf/llava-onevision-qwen2-7b-ov-hf
    "llava_onevision": lambda **kw: LlavaOnevisionSpec(**kw),
    # OpenGVLab/InternVL3-8B-hf (also InternVL2 / 2.5: 448 px tiles, 1..12, thumbnail)
    "internvl": lambda **kw: InternVLSpec(**kw),
    # HuggingFaceM4/Idefics3-8B-Llama3
    "idefics3": lambda **kw: Idefics3Spec(**kw),
    # HuggingFaceTB/SmolVLM-Instruct
    "smolvlm": lambda **kw: Idefics3Spec(**{**_SMOLVLM_DEFAULTS, **kw}),
    # google/gemma-3-4b-it
    "gemma3": lambda **kw: Gemma3Spec(**kw),
    # mistral-community/pixtral-12b
    "pixtral": lambda **kw: PixtralSpec(**kw),
    # Megatron-LM LLaVA with CLIP ViT-L/14 @ 336 px
    "megatron": lambda **kw: MegatronSpec(**kw),
}

#: Family names accepted by :func:`vision_spec`.
FAMILIES: tuple[str, ...] = tuple(_FAMILY_FACTORIES)


def vision_spec(family: str, **overrides: Any) -> VisionSpec:
    """The spec of ``family`` (any spelling: ``"Qwen2.5-VL"``, see :func:`vlm_pack._checks.canonical_family`)
    with its released checkpoint's parameters, ``overrides`` replacing some.

    >>> vision_spec("qwen2_vl").num_tokens(1920, 1080)
    2691
    >>> vision_spec("qwen2_vl", max_pixels=200704).num_tokens(1920, 1080)  # capped at 256 tokens
    252
    """
    key = canonical_family(family, strict=False)  # the one normaliser every entry point uses
    spelled = "" if key == family else f"({family!r} reads as {key!r}.)"
    factory = family_entry(_FAMILY_FACTORIES, key, "vision spec", spelled)
    try:
        return factory(**overrides)
    except TypeError as e:
        raise TypeError(f"vision_spec({family!r}): {e}") from None
