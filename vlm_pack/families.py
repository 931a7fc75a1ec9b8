"""The family registry: everything vlm-pack knows about a model family, in one :class:`Family` record.

A family is a transformers ``model_type`` (``megatron``: Megatron-LM's LLaVA). Every entry point that takes a
family name (``Preprocessor``, ``PackingCollator``, ``vision_spec``, ``process_sample``, the position ids, the
CLI) reads this registry and nothing else, so every spelling means the same family everywhere
(``"Qwen2-VL"``, ``"qwen2.5-vl"``, ``"llava-1.6"``, ``"InternVL2.5"``)::

    field           qwen2_vl                  idefics3            gemma3            read by
    aliases         ()                        ()                  ()                family(), canonical()
    vision          smart_resize.Qwen2VLSpec  tiles.Idefics3Spec  tiles.Gemma3Spec  vision_spec (forecasts)
    image_token     <|image_pad|>             <image>             (the processor's) processing (fallback)
    wraps           template                  processor_markers   processor_text    processing, data/forecast
    mrope           qwen2_vl                  None (1-D)          None (1-D)        positions, collate, batch
    two_way_images  False                     False               True              collate, batch (masks)
    two_way_layers  (full, sliding)           (full, sliding)     (full, sliding)   collate (masks)
    two_way_switch  None                      None                None              collate (masks)
    collapsed       True                      False               True              Preprocessor
    chat_format     qwen                      None                None              chat (no chat template)
    token_mixers    ()                        ()                  ()                mixers, batch
    experts         False                     False               False             batch (router mask)
    video_token     <|video_pad|>             None                None              processing (videos)
    video_processor Qwen2VLVideoProcessor     None                None              testing (clips)
    video_wraps     template                  None (no video)     None              processing (videos)

Packed layouts: *expanded* rows hold one token per image embedding, as HF processors write them; *collapsed*
rows one placeholder per image (Megatron), expanded inside the model, which needs each image's embedding tokens
in one run. Who writes the tokens around an image's embeddings (``wraps``) decides how a forecast counts them:
the chat template (already in the rendered prompt), the processor (counted per image), or nobody.

Adding a family: one :class:`Family` record in ``_RECORDS`` below (``name`` = its transformers
``model_type``; ``vision=_rule("module.SpecClass", **the checkpoint's defaults)``), plus, only when no rule in
``vlm_pack/vision/`` fits, one vision-rule file there. Nothing else changes: ``tests/test_family_registry.py``
fails on a family name written into any other module.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from ._checks import family_entry

if TYPE_CHECKING:
    from .vision.spec import VisionSpec

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "VIDEO_WRAPS",
    "WRAPS",
    "Family",
    "VisionRule",
    "canonical",
    "family",
    "lookup",
    "names",
    "owner",
    "require",
    "video_family",
]

#: Who writes the tokens around each image's embeddings, and so how a forecast counts them.
WRAPS: dict[str, str] = {
    "none": "nobody: the placeholder becomes the image's embeddings only (LLaVA, Megatron)",
    "template": "the chat template, around the placeholder the processor expands (Qwen's <|vision_start|>)",
    "processor": "the processor: special tokens spec.extra_tokens counts (InternVL's <img>, Pixtral's breaks)",
    "processor_markers": "the processor: tile markers counted through the tokenizer (Idefics3's <row_1_col_1>)",
    "processor_text": "the processor: text that merges with the prompt around it (Gemma 3's '\\n\\n')",
}
#: Who writes the tokens around each video's embeddings, and so how a forecast counts them.
VIDEO_WRAPS: dict[str, str] = {
    "none": "nobody: the placeholder becomes frames x pooled tokens + 1 (LLaVA-OneVision)",
    "template": "the chat template, around the placeholder the processor expands (Qwen2/2.5-VL)",
    "frames": "the processor: '<t seconds>' and <|vision_start|>..<|vision_end|> per temporal grid (Qwen3-VL)",
    "image_frames": "the processor: each kept frame an image, 'Frame{i}: <img>' + its image tokens + '</img>', the "
    "frames joined by newlines; the model embeds them as images (InternVL)",
    "timed_image_frames": "the processor: per temporal grid '<|begin_of_image|>' + its image tokens + "
    "'<|end_of_image|>{int seconds}', inside the template's <|begin_of_video|>..<|end_of_video|> (GLM-4.1V/4.5V/4.6V)",
}
# Video wraps whose frames the processor writes as image tokens (the model embeds them where images go).
_VIDEO_AS_IMAGES = ("image_frames", "timed_image_frames")
Wraps = Literal["none", "template", "processor", "processor_markers", "processor_text"]


@dataclass(frozen=True)
class VisionRule:
    """A spec class of ``vlm_pack/vision/`` (``path``: ``"module.Class"``) and the defaults a family builds it
    with, under the caller's overrides. The class is imported when first built: the registry itself loads no
    numpy (``vlm-pack --help`` reads it)."""

    path: str
    defaults: tuple[tuple[str, Any], ...] = ()

    def __call__(self, **overrides: Any) -> VisionSpec:
        module, _, name = self.path.rpartition(".")
        cls = getattr(importlib.import_module(f"{__package__}.vision.{module}"), name)
        return cls(**{**dict(self.defaults), **overrides})  # type: ignore[no-any-return]


def _rule(path: str, **defaults: Any) -> VisionRule:
    return VisionRule(path, tuple(defaults.items()))


@dataclass(frozen=True)
class Family:
    """One model family: its names and every rule vlm-pack applies to it (see the module docstring)."""

    name: str
    """The canonical name: the transformers ``model_type``."""
    aliases: tuple[str, ...] = ()
    """Release names, in any spelling (case, ``-``, ``_``, ``.`` and spaces do not matter)."""
    vision: VisionRule | None = None
    """Builds the vision spec with the released checkpoint's defaults (keyword overrides); None: no rule
    (``vision_spec_from_processor`` still reads a live processor)."""
    image_token: str | None = None
    """The token the processor expands into the image embeddings, when the tokenizer names none."""
    wraps: Wraps = "none"
    """Who writes the tokens around each image's embeddings: a key of :data:`WRAPS`."""
    mrope: str | None = None
    """The ``get_rope_index`` variant of its 4-row mRoPE position ids (``qwen2_vl``, ``qwen2_5_vl``,
    ``qwen3_vl``: ``vlm_pack.collate.positions``); None: 1-D per-sample positions."""
    two_way_images: bool = False
    """Image tokens attend both ways inside their image (``token_type_ids``): packed rows need its masks."""
    two_way_layers: tuple[str, ...] = ("full_attention", "sliding_attention")
    """The layer types whose masks let image tokens attend both ways (Gemma 4: the sliding ones only)."""
    two_way_switch: tuple[str, str] | None = None
    """``(text config attribute, value)`` that turns the two-way image blocks on; None: always on.
    Gemma 4: ``("use_bidirectional_attention", "vision")`` (its E2B / E4B leave it None: causal)."""
    images_past_window_until: tuple[int, int] | None = None
    """Before this transformers release the sliding layers let image tokens see their whole image past the
    window, and the packed masks do the same there (Gemma 4: (5, 13), ``vlm_pack._compat.images_past_window``)."""
    collapsed: bool = True
    """``layout="collapsed"`` works: each image's embedding tokens form one run (no markers between them)."""
    chat_format: str | None = None
    """vlm-pack's own chat format (``vlm_pack.processing.chat``) for tokenizers without a chat template."""
    token_mixers: tuple[str, ...] = ()
    """Layers of its text model that mix tokens without attention (``"gated_delta_net"``, ``"short_conv"``):
    packed rows must reach them with the sample boundaries too (``vlm_pack.forward.mixers``)."""
    video_token: str | None = None
    """The token the processor expands into a video's embeddings (``<|video_pad|>``, OneVision's ``<video>``)."""
    video_processor: str | None = None
    """The transformers video processor class of its processor (``Qwen2VLVideoProcessor``)."""
    video_wraps: str | None = None
    """Who writes the tokens around a video's embeddings, a key of :data:`VIDEO_WRAPS`; None: vlm-pack
    processes no video for this family (a video sample gets an error naming the families that do)."""
    processors: tuple[str, ...] = ()
    """The transformers processor classes whose text this record's ``vision`` rule reproduces: a processor of
    one of them (or of a subclass that rewrites none of its methods) is forecast by the fast rule, read from
    the instance's settings (``vision_spec_from_processor``) and checked against the processor itself when a
    ``Preprocessor`` is built (``vlm_pack.vision.selfcheck``). Each class on one record: records that share
    another's processor (Qwen3.5 uses ``Qwen3VLProcessor``) leave it empty. A processor of a class no record
    names takes the exact route (``vlm_pack.vision.oracle``), never a record's rule by resemblance."""
    image_processors: tuple[str, ...] = ()
    """The image processor classes (``Pil`` / ``Fast`` suffix dropped) a bare instance of which, given without
    its processor, is read with this record's rule. A bare image processor writes no text around an image, so
    only its own counts matter; each class on one record, and a class no record names is refused."""
    bare_processor: tuple[str, tuple[tuple[str, Any], ...]] | None = None
    """``(processor class, its checkpoints' settings)`` that ``process_sample`` builds around a bare image
    processor of ``image_processors`` and a tokenizer to count image tokens (None: ``processor=`` needed)."""
    one_call_image_processors: tuple[str, ...] = ()
    """Image processor classes (exact names) whose one call over a pack's images equals a call per sample
    joined by ``join_vision`` (nothing padded to the call): ``process_pack`` makes one call per pack."""
    mixers_behind_processor: bool = False
    """Checkpoints of a family with ``token_mixers`` ship this family's processor (Qwen3.5 / 3.6 ship
    ``Qwen3VLProcessor``), so a processor read off the hub cannot tell them apart: packed rows carry the
    mixers' marker ``seq_idx`` too (``PackedBatch.model_inputs``), which a model without mixers ignores and an
    un-isolated mixer refuses, so a Qwen3.5 checkpoint collated as Qwen3-VL never leaks silently."""
    experts: bool = False
    """Its text model routes tokens to experts and counts them in an auxiliary load-balancing loss that reads
    the 2-D ``attention_mask``, and whose text model takes a mask mapping: packed rows pass one (``real_tokens``
    of a ``MaskMapping``) so that padding never reaches the router's statistics (Qwen3.5-MoE). GLM-4.5V / 4.6V
    stay False: their aux loss over real tokens is ``vlm_pack.forward.routers`` (why: its module docstring)."""

    @property
    def video_as_images(self) -> bool:
        """Its processor writes a video's frames as image tokens (InternVL, GLM-4.1V): counted per video by
        where they stand, embedded by the model as images."""
        return self.video_wraps in _VIDEO_AS_IMAGES

    def __post_init__(self) -> None:
        if self.wraps not in WRAPS:
            raise ValueError(f"family {self.name!r}: wraps={self.wraps!r} is none of {', '.join(WRAPS)}")
        if self.video_wraps is not None and (self.video_wraps not in VIDEO_WRAPS or not self.video_token):
            raise ValueError(f"family {self.name!r}: video_wraps={self.video_wraps!r} needs a video_token and "
                             f"one of {', '.join(VIDEO_WRAPS)}")


# Each ``vision`` default is the released checkpoint's preprocessor_config.json (named above each record);
# constructor defaults in transformers often differ.
_LLAVA_HF_COUNTS = (("patch_size", 14), ("vision_feature_select_strategy", "default"), ("num_additional_image_tokens", 1))

_RECORDS = (
    # Qwen/Qwen2-VL-7B-Instruct
    Family(
        "qwen2_vl",
        vision=_rule("smart_resize.Qwen2VLSpec"),
        image_token="<|image_pad|>",
        wraps="template",
        mrope="qwen2_vl",
        chat_format="qwen",
        video_token="<|video_pad|>",
        video_processor="Qwen2VLVideoProcessor",
        video_wraps="template",
        processors=("Qwen2VLProcessor",),
        image_processors=("Qwen2VLImageProcessor",),
        one_call_image_processors=("Qwen2VLImageProcessorPil",),
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct
    Family(
        "qwen2_5_vl",
        vision=_rule("smart_resize.Qwen2VLSpec", variant="qwen2_5_vl"),
        image_token="<|image_pad|>",
        wraps="template",
        mrope="qwen2_5_vl",
        chat_format="qwen",
        video_token="<|video_pad|>",
        video_processor="Qwen2VLVideoProcessor",
        video_wraps="template",
        processors=("Qwen2_5_VLProcessor",),
    ),
    # Qwen/Qwen3-VL-8B-Instruct (image and video preprocessor configs)
    Family(
        "qwen3_vl",
        vision=_rule("smart_resize.Qwen3VLSpec"),
        image_token="<|image_pad|>",
        wraps="template",
        mrope="qwen3_vl",
        chat_format="qwen",
        video_token="<|video_pad|>",
        video_processor="Qwen3VLVideoProcessor",
        video_wraps="frames",
        processors=("Qwen3VLProcessor",),
        mixers_behind_processor=True,
    ),
    Family(
        "qwen3_vl_moe",
        image_token="<|image_pad|>",
        wraps="template",
        mrope="qwen3_vl",
        video_token="<|video_pad|>",
        video_processor="Qwen3VLVideoProcessor",
        video_wraps="frames",
        mixers_behind_processor=True,
    ),
    # Qwen/Qwen3.5-27B (Qwen3VLProcessor; image settings as Qwen3-VL's). Text model: gated delta-net layers
    # and attention 3:1 (modeling_qwen3_5.py, 5.24); positions: Qwen3-VL's get_rope_index (videos split per frame)
    Family(
        "qwen3_5",
        ("Qwen3.5", "Qwen3.6"),
        vision=_rule("smart_resize.Qwen3_5Spec"),
        image_token="<|image_pad|>",
        wraps="template",
        mrope="qwen3_vl",
        video_token="<|video_pad|>",
        video_processor="Qwen3VLVideoProcessor",
        video_wraps="frames",
        token_mixers=("gated_delta_net",),
    ),
    # Qwen/Qwen3.5-35B-A3B: the same with a mixture-of-experts MLP, whose router reads a 2-D padding mask
    Family(
        "qwen3_5_moe",
        ("Qwen3.5-MoE", "Qwen3.6-MoE"),
        vision=_rule("smart_resize.Qwen3_5MoeSpec"),
        image_token="<|image_pad|>",
        wraps="template",
        mrope="qwen3_vl",
        video_token="<|video_pad|>",
        video_processor="Qwen3VLVideoProcessor",
        video_wraps="frames",
        token_mixers=("gated_delta_net",),
        experts=True,
    ),
    # THUDM/GLM-4.1V-9B-Thinking; its mRoPE numbers images as Qwen2-VL and splits videos into one-frame
    # grids as Qwen3-VL's does. Its video frames are <|image|> tokens, so transformers' model (5.24,
    # modeling_glm4v.py get_placeholder_mask) takes images or videos in one forward, not both (GLM-4.5V/4.6V too)
    Family(
        "glm4v",
        ("GLM-4.1V",),
        vision=_rule("smart_resize.Glm4vSpec"),
        image_token="<|image|>",
        wraps="template",
        mrope="qwen3_vl",
        video_token="<|video|>",
        video_processor="Glm4vVideoProcessor",
        video_wraps="timed_image_frames",
        processors=("Glm4vProcessor",),
        image_processors=("Glm4vImageProcessor",),
        one_call_image_processors=("Glm4vImageProcessorPil",),
    ),
    # zai-org/GLM-4.5V: the GLM-4.1V processor and get_rope_index (glm4v_moe/modular_glm4v_moe.py) around a
    # mixture-of-experts text model (transformers >= 4.56). Not `experts`: its text model hands attention_mask to
    # create_causal_mask, which refuses a MaskMapping and makes a 2-D mask one span over the row (the samples
    # would attend across each other); its aux loss over real tokens is vlm_pack.forward.routers.load_balancing_loss
    Family(
        "glm4v_moe",
        ("GLM-4.5V",),
        vision=_rule("smart_resize.Glm4vSpec", variant="glm4v_moe"),
        image_token="<|image|>",
        wraps="template",
        mrope="qwen3_vl",
        video_token="<|video|>",
        video_processor="Glm4vVideoProcessor",
        video_wraps="timed_image_frames",
    ),
    # zai-org/GLM-4.6V: Glm4vForConditionalGeneration and the GLM-4.1V processor under their own names
    # (glm46v/modular_glm46v.py; transformers >= 5.0); the released text model is GLM-4.5V's MoE, and the
    # model computes no aux loss (vlm_pack.forward.routers: record_router_logits, load_balancing_loss)
    Family(
        "glm46v",
        ("GLM-4.6V",),
        vision=_rule("smart_resize.Glm4vSpec", variant="glm46v"),
        image_token="<|image|>",
        wraps="template",
        mrope="qwen3_vl",
        video_token="<|video|>",
        video_processor="Glm46VVideoProcessor",
        video_wraps="timed_image_frames",
        processors=("Glm46VProcessor",),
        image_processors=("Glm46VImageProcessor",),
    ),
    # llava-hf/llava-1.5-7b-hf
    Family(
        "llava",
        ("LLaVA-1.5",),
        vision=_rule("anyres.LlavaSpec"),
        image_token="<image>",
        chat_format="llava",
        processors=("LlavaProcessor",),
        image_processors=("LlavaImageProcessor", "CLIPImageProcessor"),
        bare_processor=("LlavaProcessor", _LLAVA_HF_COUNTS),  # 14 px patches, CLIP's CLS token dropped
    ),
    # llava-hf/llava-v1.6-mistral-7b-hf
    Family(
        "llava_next",
        ("LLaVA-1.6",),
        vision=_rule("anyres.LlavaNextSpec"),
        image_token="<image>",
        chat_format="llava",
        processors=("LlavaNextProcessor",),
        image_processors=("LlavaNextImageProcessor",),
        bare_processor=("LlavaNextProcessor", _LLAVA_HF_COUNTS),
    ),
    # llava-hf/llava-onevision-qwen2-7b-ov-hf
    Family(
        "llava_onevision",
        ("LLaVA-OV",),
        vision=_rule("anyres.LlavaOnevisionSpec"),
        image_token="<image>",
        video_token="<video>",
        video_processor="LlavaOnevisionVideoProcessor",
        video_wraps="none",
        processors=("LlavaOnevisionProcessor",),
        image_processors=("LlavaOnevisionImageProcessor",),
    ),
    # OpenGVLab/InternVL3-8B-hf (also InternVL2 / 2.5: 448 px tiles, 1..12, thumbnail)
    Family(
        "internvl",
        ("InternVL2", "InternVL2.5", "InternVL3"),
        vision=_rule("tiles.InternVLSpec"),
        image_token="<IMG_CONTEXT>",
        wraps="processor",
        video_token="<video>",
        video_processor="InternVLVideoProcessor",
        video_wraps="image_frames",
        processors=("InternVLProcessor",),
        image_processors=("GotOcr2ImageProcessor",),
    ),
    # HuggingFaceM4/Idefics3-8B-Llama3
    Family(
        "idefics3",
        vision=_rule("tiles.Idefics3Spec"),
        image_token="<image>",
        wraps="processor_markers",
        collapsed=False,
        processors=("Idefics3Processor",),
        image_processors=("Idefics3ImageProcessor",),
    ),
    # HuggingFaceTB/SmolVLM-Instruct
    Family(
        "smolvlm",
        vision=_rule(
            "tiles.Idefics3Spec",
            longest_edge=4 * 384,
            max_image_size=384,
            image_seq_len=81,
            variant="smolvlm",
        ),
        image_token="<image>",
        wraps="processor_markers",
        collapsed=False,
        processors=("SmolVLMProcessor",),
        image_processors=("SmolVLMImageProcessor",),
    ),
    # LiquidAI/LFM2-VL-1.6B (transformers >= 5.0: Lfm2VlImageProcessor, a torchvision class); its text model
    # LFM2 mixes tokens in short-convolution layers besides attention
    Family(
        "lfm2_vl",
        ("LFM2-VL",),
        vision=_rule("tiles.Lfm2VlSpec"),
        image_token="<image>",
        wraps="processor_markers",
        collapsed=False,
        token_mixers=("short_conv",),
        processors=("Lfm2VlProcessor",),
        image_processors=("Lfm2VlImageProcessor",),
    ),
    # google/gemma-3-4b-it (the template writes <start_of_image>, which the processor expands)
    Family(
        "gemma3",
        vision=_rule("tiles.Gemma3Spec"),
        wraps="processor_text",
        two_way_images=True,
        processors=("Gemma3Processor",),
        image_processors=("Gemma3ImageProcessor",),
    ),
    # google/gemma-4-31B-it (transformers >= 5.5): images wrapped in <|image> <image|> by the processor; with
    # use_bidirectional_attention="vision" image tokens attend both ways on the sliding layers only
    Family(
        "gemma4",
        ("Gemma-4",),
        vision=_rule("patch_budget.Gemma4Spec"),
        image_token="<|image|>",
        wraps="processor",
        two_way_images=True,
        two_way_layers=("sliding_attention",),
        two_way_switch=("use_bidirectional_attention", "vision"),
        images_past_window_until=(5, 13),
        collapsed=False,
        processors=("Gemma4Processor",),
        image_processors=("Gemma4ImageProcessor",),
    ),
    # google/gemma-3n-E4B-it (transformers >= 4.53): 256 tokens per image whatever its size, wrapped in
    # "\n\n<start_of_image>" ... "<end_of_image>\n\n" by the processor as Gemma 3's; image tokens attend causally
    # (modeling_gemma3n.py: no token_type_ids mask); AltUp, LAuReL and per-layer inputs act per token
    Family(
        "gemma3n",
        ("Gemma-3n",),
        vision=_rule("tiles.Gemma3nSpec"),
        image_token="<image_soft_token>",
        wraps="processor_text",
        collapsed=False,
        processors=("Gemma3nProcessor",),
    ),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503: a Pixtral tower (vision_spec_from_processor reads it)
    Family("mistral3", image_token="[IMG]", wraps="processor", collapsed=False),
    # mistral-community/pixtral-12b
    Family(
        "pixtral",
        vision=_rule("pixtral.PixtralSpec"),
        image_token="[IMG]",
        wraps="processor",
        collapsed=False,
        processors=("PixtralProcessor",),
        image_processors=("PixtralImageProcessor",),
    ),
    # Megatron-LM LLaVA with CLIP ViT-L/14 @ 336 px
    Family("megatron", vision=_rule("megatron.MegatronSpec")),
)

#: Every family by canonical name, in registry order.
FAMILIES: Mapping[str, Family] = MappingProxyType({record.name: record for record in _RECORDS})

#: The family assumed where none is given or found (vlm-pack's own chat format, the CLI, mRoPE helpers).
DEFAULT_FAMILY = "qwen2_vl"


def _squash(name: str) -> str:
    return re.sub(r"[\s_.\-]", "", name.lower())


def _by_squashed() -> dict[str, str]:
    out: dict[str, str] = {}
    for record in _RECORDS:
        for spelling in (record.name, *record.aliases):
            taken = out.setdefault(_squash(spelling), record.name)
            if taken != record.name:  # a new record's name or alias must not name an existing family
                raise ValueError(f"family name {spelling!r} of {record.name!r} already names {taken!r}")
    return out


_BY_SQUASHED = _by_squashed()


def _by_class(kind: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for record in _RECORDS:
        for name in getattr(record, kind):
            taken = out.setdefault(name, record.name)
            if taken != record.name:  # one class, one rule: a second record would be a guess between them
                raise ValueError(f"{kind} class {name!r} of {record.name!r} is already {taken!r}'s")
    return out


_BY_CLASS = {kind: _by_class(kind) for kind in ("processors", "image_processors")}


def owner(kind: Literal["processors", "image_processors"], class_name: str) -> Family | None:
    """The record whose ``kind`` field names the transformers class ``class_name`` (each class is named by
    one record at most), or None."""
    found = _BY_CLASS[kind].get(class_name)
    return FAMILIES[found] if found is not None else None


def video_family(video_processor: Any) -> Family | None:
    """The record whose ``video_processor`` names the class of ``video_processor`` (a transformers video
    processor instance), or the nearest base class of it a record names; None where no record does. Records
    sharing a video processor (Qwen2-VL and Qwen2.5-VL, Qwen3-VL and Qwen3.5) share its ``video_wraps``."""
    for cls in type(video_processor).__mro__:
        for record in _RECORDS:
            if record.video_wraps and record.video_processor == cls.__name__:
                return record
    return None


def canonical(name: str | None, *, strict: bool = True) -> str | None:
    """The canonical name of family ``name``: case, ``-``, ``_``, ``.`` and spaces do not matter.

    ``canonical("Qwen2-VL") == canonical("qwen2vl") == "qwen2_vl"``; ``"Qwen2.5-VL"`` is ``"qwen2_5_vl"``,
    ``"llava-1.6"`` is ``"llava_next"``; None (or ``""``) is None. A name that is no family of
    :data:`FAMILIES` raises a ValueError listing them, or with ``strict=False`` (a config's ``model_type``,
    which may be any model's) is returned as given.
    """
    if name is None or name == "":  # not given (callers read an empty name as none, as `family or ...` did)
        return None
    if not isinstance(name, str):
        raise TypeError(f"a family name must be a string, got {type(name).__name__} {name!r}")
    if name in FAMILIES:  # the per-sample calls (processing._render) pass canonical names: no regex
        return name
    found = _BY_SQUASHED.get(_squash(name))
    if found is not None:
        return found
    if not strict:
        return name
    raise ValueError(
        f"unknown VLM family {name!r}; known families: {', '.join(FAMILIES)} (in any case, with or "
        "without '-', '_' or '.'). For another model pass its processor= (its chat template and image rules) "
        "or its model_config= (a model type vlm-pack has no rule for gets 1-D positions)."
    )


def family(name: str) -> Family:
    """The record of family ``name`` in any spelling; a ValueError listing the known names for another."""
    key = canonical(name)
    if key is None:
        raise ValueError(f"no family name given; known families: {', '.join(FAMILIES)}")
    return FAMILIES[key]


def lookup(name: str | None) -> Family | None:
    """The record of ``name`` in any spelling; None for None, ``""`` or a model type without a record."""
    return FAMILIES.get(canonical(name, strict=False))  # type: ignore[arg-type]


def names(having: str | None = None) -> tuple[str, ...]:
    """The canonical names, in registry order: all, or those whose field ``having`` is set (not None/False).

    >>> names("mrope")
    ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe', 'qwen3_5', 'qwen3_5_moe', 'glm4v', 'glm4v_moe',
     'glm46v')
    """
    if having is not None and having not in {f.name for f in fields(Family)}:
        raise ValueError(
            f"Family has no field {having!r}; its fields: {', '.join(f.name for f in fields(Family))}"
        )
    return tuple(r.name for r in _RECORDS if having is None or getattr(r, having) not in (None, False))


def require(name: str | None, having: str, what: str, fix: str = "") -> Family:
    """The record of ``name`` (any spelling) where its field ``having`` is set, else a ValueError naming
    ``what`` and the families that have it: ``"no vision spec for family 'blip2'; supported: qwen2_vl, ..."``."""
    record = lookup(name)
    if record is not None and getattr(record, having) not in (None, False):  # per sample: no table built
        return record
    supported: dict[str, Any] = {n: FAMILIES[n] for n in names(having)}
    return family_entry(supported, canonical(name, strict=False), what, fix)  # type: ignore[arg-type]
