"""Real transformers image processors and processors, built offline with the released checkpoints' parameters."""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

from .._compat import pil_image_processor_class
from .tokenizers import build_tokenizer, family_tokens

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_HALF = [0.5, 0.5, 0.5]

# Parameters of the released checkpoints' preprocessor_config.json (constructor defaults differ).
_QWEN2 = dict(
    cls="Qwen2VLImageProcessorPil",
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 3136, "longest_edge": 12845056},
    image_mean=_CLIP_MEAN,
    image_std=_CLIP_STD,
)
_LLAVA = dict(
    cls="LlavaImageProcessorPil",
    size={"shortest_edge": 336},
    crop_size={"height": 336, "width": 336},
    do_center_crop=True,
    image_mean=_CLIP_MEAN,
    image_std=_CLIP_STD,
)


def _idefics3(crop: int, cls: str) -> dict[str, Any]:
    return dict(
        cls=cls,
        size={"longest_edge": 4 * crop},
        max_image_size={"longest_edge": crop},
        do_image_splitting=True,
        image_mean=_HALF,
        image_std=_HALF,
    )


_IMAGE_PROCESSOR_PARAMS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2_vl": _QWEN2,
    "qwen2_5_vl": _QWEN2,
    # Qwen/Qwen3-VL-*-Instruct
    "qwen3_vl": dict(
        _QWEN2,
        patch_size=16,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        image_mean=_HALF,
        image_std=_HALF,
    ),
    # Qwen/Qwen3.5-27B, Qwen/Qwen3.5-35B-A3B: Qwen3-VL's preprocessor settings
    "qwen3_5": dict(
        _QWEN2,
        patch_size=16,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        image_mean=_HALF,
        image_std=_HALF,
    ),
    "qwen3_5_moe": dict(
        _QWEN2,
        patch_size=16,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        image_mean=_HALF,
        image_std=_HALF,
    ),
    # zai-org/GLM-4.1V-9B-Thinking
    "glm4v": dict(
        _QWEN2, cls="Glm4vImageProcessorPil", size={"shortest_edge": 12544, "longest_edge": 9633792}
    ),
    # zai-org/GLM-4.5V, zai-org/GLM-4.6V (the GLM-4.1V rule; GLM-4.6V under its own class name)
    "glm4v_moe": dict(
        _QWEN2, cls="Glm4vImageProcessorPil", size={"shortest_edge": 12544, "longest_edge": 9633792}
    ),
    "glm46v": dict(
        _QWEN2, cls="Glm46VImageProcessorPil", size={"shortest_edge": 12544, "longest_edge": 9633792}
    ),
    # llava-hf/llava-1.5-7b-hf
    "llava": _LLAVA,
    # llava-hf/llava-v1.6-mistral-7b-hf
    "llava_next": dict(
        _LLAVA,
        cls="LlavaNextImageProcessorPil",
        do_pad=True,
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    ),
    # llava-hf/llava-onevision-qwen2-7b-ov-hf
    "llava_onevision": dict(
        cls="LlavaOnevisionImageProcessorPil",
        size={"height": 384, "width": 384},
        do_pad=True,
        image_grid_pinpoints=[[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)],
        image_mean=_HALF,
        image_std=_HALF,
    ),
    # OpenGVLab/InternVL3-1B-hf
    "internvl": dict(
        cls="GotOcr2ImageProcessorPil",
        size={"height": 448, "width": 448},
        crop_to_patches=True,
        min_patches=1,
        max_patches=12,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ),
    # HuggingFaceM4/Idefics3-8B-Llama3: 364 px crops, longest side 4 crops
    "idefics3": _idefics3(364, "Idefics3ImageProcessorPil"),
    # HuggingFaceTB/SmolVLM-Instruct: 384 px crops
    "smolvlm": _idefics3(384, "SmolVLMImageProcessorPil"),
    # google/gemma-3-4b-it
    "gemma3": dict(
        cls="Gemma3ImageProcessorPil", size={"height": 896, "width": 896}, image_mean=_HALF, image_std=_HALF
    ),
    # LiquidAI/LFM2-VL-1.6B: the image processor's defaults (512 px tiles, 2..10 of them, 64..256 tokens per
    # image); transformers has it only as a torchvision class
    "lfm2_vl": dict(
        cls="Lfm2VlImageProcessor",
        torchvision=True,
        image_mean=_HALF,
        image_std=_HALF,
    ),
    # google/gemma-4-E4B-it: 16 px patches pooled 3 x 3, at most 280 soft tokens, pixels in [0, 1]
    "gemma4": dict(cls="Gemma4ImageProcessorPil", patch_size=16, max_soft_tokens=280, pooling_kernel_size=3),
    # google/gemma-3n-E4B-it: SiglipImageProcessor to 768 x 768, pixels rescaled to [0, 1], not normalised
    "gemma3n": dict(
        cls="SiglipImageProcessorPil",
        size={"height": 768, "width": 768},
        do_normalize=False,
        image_mean=_HALF,
        image_std=_HALF,
    ),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503 (Pixtral tower: 14 px patches merged 2x2)
    "mistral3": dict(
        cls="PixtralImageProcessorPil",
        size={"longest_edge": 1540},
        patch_size={"height": 14, "width": 14},
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
    ),
}

# Processor class and the released processor_config.json settings.
_PROCESSOR_PARAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_vl": ("Qwen2VLProcessor", {}),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", {}),
    "qwen3_vl": ("Qwen3VLProcessor", {}),
    "qwen3_5": ("Qwen3VLProcessor", {}),
    "qwen3_5_moe": ("Qwen3VLProcessor", {}),
    "glm4v": ("Glm4vProcessor", {}),
    "glm4v_moe": ("Glm4vProcessor", {}),
    "glm46v": ("Glm46VProcessor", {}),
    # llava-hf checkpoints count the CLS token (+1) and drop it again with the "default" strategy: 576.
    "llava": (
        "LlavaProcessor",
        dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    ),
    "llava_next": (
        "LlavaNextProcessor",
        dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    ),
    "llava_onevision": (
        "LlavaOnevisionProcessor",
        dict(num_image_tokens=729, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9"),
    ),
    "internvl": ("InternVLProcessor", dict(image_seq_length=256)),
    "idefics3": ("Idefics3Processor", dict(image_seq_len=169)),
    "smolvlm": ("SmolVLMProcessor", dict(image_seq_len=81)),
    "gemma3": ("Gemma3Processor", dict(image_seq_length=256)),
    "gemma4": ("Gemma4Processor", dict(image_seq_length=280)),
    "gemma3n": ("Gemma3nProcessor", dict(image_seq_length=256, audio_seq_length=188)),
    "mistral3": ("PixtralProcessor", dict(patch_size=14, spatial_merge_size=2)),
    "lfm2_vl": ("Lfm2VlProcessor", {}),
}

#: Families whose image processor transformers has only as a torchvision class.
NEEDS_TORCHVISION = tuple(f for f, params in _IMAGE_PROCESSOR_PARAMS.items() if params.get("torchvision"))


def _torchvision_image_processor_class(name: str, family: str) -> type:
    """``transformers.<name>``, or an ImportError naming the fix where torchvision does not load."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or type(cls).__name__ == "DummyObject":  # transformers' stand-in for a missing backend
        raise ImportError(
            f"{family}: transformers {transformers.__version__} has its image processor {name} only as a "
            "torchvision class, and torchvision does not load here: pip install torchvision (matching torch)."
        )
    return cls


def image_processor(family: str = "qwen2_vl", **overrides: Any) -> Any:
    """The real transformers PIL image processor of ``family`` with the released checkpoint's parameters.

    ``overrides`` replace checkpoint parameters, e.g. ``image_processor("qwen2_vl", size={"shortest_edge":
    3136, "longest_edge": 200704})`` to cap Qwen images at 256 vision tokens.
    """

    family_tokens(family)  # validates the name
    params = {k: v for k, v in _IMAGE_PROCESSOR_PARAMS[family].items() if k not in ("cls", "torchvision")}
    params.update(overrides)
    name = _IMAGE_PROCESSOR_PARAMS[family]["cls"]
    if family in NEEDS_TORCHVISION:
        return _torchvision_image_processor_class(name, family)(**params)
    return pil_image_processor_class(name)(**params)


# Parts an image + text processor is built without: video processors need torchvision; Gemma 4's audio
# feature extractor is not needed for images.
_OPTIONAL_PARTS = ("video_processor", "feature_extractor")


@functools.cache
def _without_video(cls: type) -> type:
    """``cls`` accepting ``video_processor=None``: video processors need torchvision, images do not.

    ``ProcessorMixin.check_argument_for_proper_class`` refuses ``None``; the subclass lets only that through and
    defers to the parent for everything else, so the image + text path is the released class's own code.
    """

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name in _OPTIONAL_PARTS and argument is None:
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The parts it was built without are no attributes while it saves: transformers reads `_auto_class` off
        # each one. Only here: transformers 5.6's __init__ checks its keyword arguments against get_attributes.
        sub = type(self)
        sub.get_attributes = classmethod(lambda _: [n for n in cls.get_attributes() if getattr(self, n, None) is not None])
        try:
            return cls.save_pretrained(self, *args, **kwargs)
        finally:
            del sub.get_attributes

    return type(
        cls.__name__,
        (cls,),
        {"check_argument_for_proper_class": check_argument_for_proper_class, "save_pretrained": save_pretrained},
    )


@contextlib.contextmanager
def _smolvlm_without_num2words() -> Iterator[None]:
    """SmolVLMProcessor refuses to construct without ``num2words``, which only its *video* prompts use.

    During construction only, a stand-in that raises when called takes its place: images never call it.
    """
    module = sys.modules["transformers.models.smolvlm.processing_smolvlm"]
    if module.num2words is not None:
        yield
        return

    def num2words(*_: Any, **__: Any) -> str:
        raise ImportError("SmolVLM video prompts need `pip install num2words`")

    module.num2words = num2words
    try:
        yield
    finally:
        module.num2words = None


def _pixtral_processor_class() -> type:
    """``PixtralProcessor``, importable without torchvision.

    ``processing_pixtral`` imports ``get_resize_output_image_size`` from the torchvision-backed image
    processing module; the PIL module defines the same function, so it stands in for that import.
    """
    name = "transformers.models.pixtral.image_processing_pixtral"
    try:
        import transformers.models.pixtral.processing_pixtral as mod
    except ImportError:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        sys.modules[name] = types.SimpleNamespace(
            get_resize_output_image_size=pil.get_resize_output_image_size
        )  # type: ignore[assignment]
        try:
            import transformers.models.pixtral.processing_pixtral as mod
        finally:
            del sys.modules[name]
    return mod.PixtralProcessor


def processor(
    family: str = "llava", tokenizer: Any = None, *, chat_template: str | None = None, **overrides: Any
) -> Any:
    """The full HF processor of ``family`` (tokenizer + image processor) as released, built offline.

    ``overrides`` go to :func:`image_processor`; ``chat_template`` (the checkpoint's ``chat_template.json``)
    is attached when given. Processors that carry a video processor (Qwen, GLM-4.1V, OneVision, InternVL,
    SmolVLM) are built without one (video needs torchvision): images and text go through the released class.
    """
    import transformers

    tok = tokenizer if tokenizer is not None else build_tokenizer(family)
    family_tokens(family)  # validates the name
    name, params = _PROCESSOR_PARAMS[family]
    cls = _pixtral_processor_class() if name == "PixtralProcessor" else getattr(transformers, name)
    kwargs: dict[str, Any] = dict(
        image_processor=image_processor(family, **overrides), tokenizer=tok, **params
    )
    optional = [part for part in _OPTIONAL_PARTS if part in cls.get_attributes()]
    if optional:
        cls = _without_video(cls)
        kwargs.update(dict.fromkeys(optional))
    with _smolvlm_without_num2words() if name == "SmolVLMProcessor" else contextlib.nullcontext():
        return cls(chat_template=chat_template, **kwargs)
