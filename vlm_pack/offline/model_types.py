"""Tiny genuine models of any image-text-to-text model type, with the type's real processor, built offline.

``tiny_model_for_type(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (the released
architecture's defaults), shrinks its text and vision sub-configs (few layers, small widths, the patch, merge
and image sizes kept so that the real image processor's outputs fit), points its special-token ids at a stand-in
tokenizer and builds the ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` class of the type::

    AutoConfig.for_model(type).to_dict()    text: hidden 4096, 32 layers ...   vision: hidden 1152, 27 layers ...
        -- _shrink -->                      text: hidden 64, 2 layers          vision: hidden 32, 2 layers
        + token ids of processor_for_type(type)'s tokenizer (image_token_id, vision_start_token_id, bos/eos/pad)
        -- config class --> model class (fp32, eval, weights ~ N(0, 0.2): packing errors show)

``processor_for_type(model_type)`` builds the type's processor class (``PROCESSOR_MAPPING_NAMES``) around its
image processor constructed with its own defaults (the PIL class, else the torchvision one where torchvision
loads) and ``build_tokenizer``'s vocabulary with every token the processor names (``image_token``,
``boi_token`` ...) added as a special token. What cannot be built that way raises :class:`NotBuildable`
naming why (no processor class, an image processor that needs torchvision, a model that needs timm ...);
``scripts/families_table.py`` records that as the type's reason.

Per-type settings the generic shrink cannot guess live in ``type_overrides._OVERRIDES`` (stand-ins, like the rest of
``vlm_pack.offline``); everything vlm-pack itself knows about a family stays in ``vlm_pack.families``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from typing import Any

from .tokenizers import build_tokenizer
from .type_overrides import override as _override

__all__ = [
    "NotBuildable",
    "image_text_to_text_types",
    "placeholder_for_type",
    "processor_for_type",
    "tiny_config_for_type",
    "tiny_model_for_type",
]


class NotBuildable(RuntimeError):
    """A model type whose tiny model or processor cannot be built offline here; the message says why."""


def image_text_to_text_types() -> tuple[str, ...]:
    """Every model type the installed transformers maps to image-text-to-text, in its own order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return tuple(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


# ------------------------------------------------------------------------------------------------------------
# the processor
# ------------------------------------------------------------------------------------------------------------

_TEXT = dict(hidden=64, layers=2, heads=4, kv_heads=2)
_VISION = dict(hidden=32, layers=2, heads=2)
_INIT = 0.2


def _transformers_attr(name: str, model_type: str, what: str) -> Any:
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or type(cls).__name__ == "DummyObject":
        raise NotBuildable(f"{what} {name} does not import here (a backend it needs is missing: torchvision?)")
    return cls


def _image_processor(model_type: str) -> Any:
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    classes = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
    if _override(model_type, "image_processor_class"):
        classes = {"pil": _override(model_type, "image_processor_class")}
    for backend in ("pil", "torchvision"):
        name = classes.get(backend)
        if name is None:
            continue
        try:
            return _transformers_attr(name, model_type, "image processor")(**(_override(model_type, "image_processor") or {}))
        except NotBuildable:
            continue
    if not classes:
        raise NotBuildable("transformers maps no image processor to this model type")
    raise NotBuildable(f"its image processor ({', '.join(classes.values())}) needs torchvision, which does not load here")


_TOKEN_ATTR = re.compile(r"^(?!.*(?:_ids?|_index)$).*_token$")


def _named_tokens(obj: Any) -> dict[str, str]:
    """Attributes ``*_token`` of ``obj`` (a processor or tokenizer) holding a token string."""
    out = {}
    for name in dir(obj):
        if not _TOKEN_ATTR.match(name) or name.startswith("_"):
            continue
        with contextlib.suppress(Exception):
            value = getattr(obj, name)
            if isinstance(value, str) and value and len(value) < 40:
                out[name] = value
    return out


def _processor_class(model_type: str) -> Any:
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = _override(model_type, "processor_class") or PROCESSOR_MAPPING_NAMES.get(model_type)
    if name is None:
        raise NotBuildable("transformers maps no processor class to this model type (its checkpoints' remote code)")
    if name == "PixtralProcessor":  # importable without torchvision (vlm_pack.offline.processors)
        from .processors import _pixtral_processor_class

        return _pixtral_processor_class()
    return _transformers_attr(name, model_type, "processor")


def _tokens_in_source(cls: type) -> list[str]:
    """Special-token strings written in the processor's source (``"<|vision_start|>"`` ...), to add to the vocabulary."""
    try:
        source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return []
    return sorted(set(re.findall(r"""["'](<[|/]?[A-Za-z_][\w|:\-]*[|]?>|\[[A-Z_]{3,}\])["']""", source)))


def _tokenizer_roles(cls: type) -> dict[str, str]:
    """Named tokens the processor reads off its tokenizer (``tokenizer.image_start_token``) that the stand-in
    lacks, each given a token of its own name (``<|image_start|>``)."""
    try:
        source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return {}
    base = build_tokenizer("qwen2_vl")
    wanted = set(re.findall(r"tokenizer\.(\w+_token)\b(?!_id)", source))
    return {name: f"<|{name[: -len('_token')]}|>" for name in sorted(wanted)
            if name not in ("bos_token", "eos_token", "pad_token", "unk_token") and getattr(base, name, None) is None}


@functools.cache
def _stand_in_tokenizer(model_type: str, extra: tuple[str, ...], roles: tuple[tuple[str, str], ...]) -> Any:
    from .._compat import set_named_special_tokens

    tok = build_tokenizer("qwen2_vl")
    tok.add_special_tokens({"bos_token": "<s>"})  # processors that prepend or look for one (Mllama)
    tok.add_tokens(list(extra), special_tokens=True)
    set_named_special_tokens(tok, dict(roles))
    tok.vlm_pack_family = None  # no vlm-pack record: the collator must not take Qwen's
    return tok


def _video_processor(model_type: str, image_processor: Any = None) -> Any:
    """The type's video processor with its defaults where torchvision loads (some processors read settings off
    it even for images: MiniCPM-V 4.6's ``slice_mode``), else None. Its patch geometry (``patch_size``,
    ``temporal_patch_size``) is ``image_processor``'s where both have one: one tower embeds both, as a
    checkpoint's two preprocessor configs agree (the classes' defaults need not: LFM3-VL's)."""
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    name = VIDEO_PROCESSOR_MAPPING_NAMES.get(model_type)
    if isinstance(name, dict):  # by backend
        name = name.get("torchvision") or next(iter(name.values()), None)
    if not name:
        return None
    settings = {}
    for key in ("patch_size", "temporal_patch_size"):
        value = getattr(image_processor, key, None)
        if isinstance(value, int):
            settings[key] = value
    try:
        cls = _transformers_attr(name, model_type, "video processor")
        settings = {k: v for k, v in settings.items() if isinstance(getattr(cls, k, None), int)}
        given = _override(model_type, "video_processor") or {}
        try:
            return cls(**{**settings, **given})
        except ValueError:  # a class that fixes its own (ERNIE-4.5-VL's temporal patch 2 under images' 1)
            return cls(**given)
    except Exception:  # torchvision absent: the image + text path
        return None


def _llava_counts(model_type: str, cls: type) -> dict[str, Any]:
    """LLaVA-style processors count image tokens from ``patch_size`` / ``vision_feature_select_strategy`` /
    ``num_additional_image_tokens``, which their checkpoints' processor_config.json sets from the model config
    (the constructor defaults are None): the same from the type's default config (a CLIP tower's CLS token
    is the additional one)."""
    from transformers import AutoConfig

    params = inspect.signature(cls.__init__).parameters
    if "patch_size" not in params or params["patch_size"].default is not None:
        return {}
    config = AutoConfig.for_model(model_type)
    vision = getattr(config, "vision_config", None)
    out: dict[str, Any] = {"patch_size": getattr(vision, "patch_size", None)}
    strategy = getattr(config, "vision_feature_select_strategy", None)
    if "vision_feature_select_strategy" in params and strategy is not None:
        out["vision_feature_select_strategy"] = strategy
    if "num_additional_image_tokens" in params:
        out["num_additional_image_tokens"] = 1 if getattr(vision, "model_type", "") == "clip_vision_model" else 0
    return out


def processor_for_type(model_type: str) -> Any:
    """The model type's real processor: its image processor (own defaults) and a stand-in tokenizer carrying
    every token the processor names; its video processor (own defaults, ``type_overrides``' ``video_processor``) where
    torchvision loads. Audio parts are left out (``None``)."""
    cls = _processor_class(model_type)
    image_processor = _image_processor(model_type)
    roles_given = {**_tokenizer_roles(cls), **(_override(model_type, "roles") or {})}
    extra = tuple(_tokens_in_source(cls)) + tuple(_override(model_type, "tokens") or ()) + tuple(roles_given.values())
    roles = tuple(sorted(roles_given.items()))
    tok = _stand_in_tokenizer(model_type, tuple(dict.fromkeys(t for t in extra if t)), roles)
    attributes = cls.get_attributes()
    kwargs: dict[str, Any] = {}
    for part in attributes:
        if part == "image_processor":
            kwargs[part] = image_processor
        elif part == "tokenizer":
            kwargs[part] = tok
        elif part == "video_processor":
            kwargs[part] = _video_processor(model_type, image_processor)
        else:
            kwargs[part] = None
    kwargs.update(_llava_counts(model_type, cls))
    kwargs.update(_override(model_type, "processor_kwargs") or {})
    from .processors import _without_video

    built = _without_video(cls) if set(attributes) - {"image_processor", "tokenizer"} else cls
    try:
        proc = built(**kwargs)
    except NotBuildable:
        raise
    except Exception as e:
        raise NotBuildable(f"{cls.__name__} does not build from its image processor and a stand-in tokenizer: "
                           f"{type(e).__name__}: {str(e)[:200]}") from None
    missing = [t for t in _named_tokens(proc).values() if t not in tok.get_vocab()]
    if missing:  # a token named only at run time: add it and build again
        tok = _stand_in_tokenizer(model_type, tuple(dict.fromkeys([*extra, *missing])), roles)
        kwargs["tokenizer"] = tok
        proc = built(**kwargs)
    for name, value in (_override(model_type, "attributes") or {}).items():
        setattr(proc, name, value)
    return proc


def placeholder_for_type(model_type: str, processor: Any) -> str:
    """What a prompt writes for one image: the processor's ``image_token``, or the wrapped form its processor
    insists on (``type_overrides``' ``placeholder``, formatted with the processor's named tokens)."""
    form = _override(model_type, "placeholder")
    if form is None:
        return str(processor.image_token)
    return str(form.format(**_named_tokens(processor)))


# ------------------------------------------------------------------------------------------------------------
# the config
# ------------------------------------------------------------------------------------------------------------



def _shrink_layer_types(kinds: list[str]) -> list[str]:
    """One layer of each kind, in first-seen order (two layers at least): a hybrid keeps its mixers."""
    distinct = list(dict.fromkeys(kinds))
    if len(distinct) == 1:
        return distinct * 2
    return distinct


def _rescale_sections(sections: list[int], half: int) -> list[int]:
    """mRoPE sections (t, h, w) summing to ``half`` (the rotary half-dim), in the original proportions."""
    total = sum(sections)
    out = [max(1, s * half // total) for s in sections]
    out[0] += half - sum(out)
    return out


def _shrink_rope(text: dict[str, Any], head_dim: int) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if not isinstance(rope, dict):
            continue
        if "mrope_section" in rope:
            partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0
            rope["mrope_section"] = _rescale_sections(list(rope["mrope_section"]), int(head_dim * partial) // 2)
        if "mrope_section" in text:
            pass
    if isinstance(text.get("mrope_section"), list):
        partial = text.get("partial_rotary_factor", 1.0) or 1.0
        text["mrope_section"] = _rescale_sections(text["mrope_section"], int(head_dim * partial) // 2)


_TEXT_SIZES = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, ffn_hidden_size=128,
    # multi-head latent attention (DeepSeek-V3 text models)
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # linear attention / gated delta net
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    # Mamba2
    mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, mamba_n_groups=1,
    mamba_d_state=16, mamba_expand=2, mamba_d_head=16, mamba_n_heads=8,
    global_head_dim=16, hidden_size_per_layer_input=8,
)
_CAPS = dict(
    num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, num_nextn_predict_layers=0, moe_k=2, moe_num_experts=4,
    sliding_window=32,
)
_VISION_SIZES = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=2, num_heads=2, embed_dim=32, head_dim=16,
    num_key_value_heads=2, projection_dim=32,
)


def _shrink_text(text: dict[str, Any], vocab: int) -> None:
    released_layers = text.get("num_hidden_layers")
    # DeepSeek-V3's attention (Kimi-K2.5, Mistral Large 3): the rotary's head_dim is the rotated part of a head
    rope_is_head = text.get("qk_rope_head_dim") and text.get("head_dim") == text.get("qk_rope_head_dim")
    # as many key / value heads as query heads stays so (multi-head latent attention expands its keys per head)
    mha = isinstance(text.get("num_key_value_heads"), int) and text["num_key_value_heads"] == text.get("num_attention_heads")
    for key, value in _TEXT_SIZES.items():
        if isinstance(text.get(key), int):
            text[key] = value
    if "head_dim" in text and text["head_dim"] is None:  # derived from the released width in the model code
        text["head_dim"] = _TEXT_SIZES["head_dim"]
    if rope_is_head:
        text["head_dim"] = text["qk_rope_head_dim"]
    if mha:
        text["num_key_value_heads"] = text["num_attention_heads"]
    for key, cap in _CAPS.items():
        if isinstance(text.get(key), int) and not isinstance(text.get(key), bool):
            text[key] = min(text[key], cap)
    for key, value in (("moe_num_experts", 4), ("moe_intermediate_size", 32)):
        if isinstance(text.get(key), list):
            text[key] = [value for _ in text[key]]
    kinds = text.get("layer_types")
    if isinstance(kinds, list) and kinds:
        text["layer_types"] = _shrink_layer_types(kinds)
        text["num_hidden_layers"] = len(text["layer_types"])
    elif "num_hidden_layers" in text:
        text["num_hidden_layers"] = _TEXT["layers"]
    per_layer = [k for k, v in text.items() if isinstance(v, list) and k != "layer_types"
                 and (k.endswith("_layer_types") or (released_layers and len(v) == released_layers))]
    for key in per_layer:
        text[key] = (text[key] * text["num_hidden_layers"])[: text["num_hidden_layers"]]  # MoE / dense per layer
    for key in ("mlp_only_layers", "full_attn_layers"):
        if isinstance(text.get(key), list):
            text[key] = [i for i in text[key] if i < text["num_hidden_layers"]]
    text["vocab_size"] = vocab
    text["initializer_range"] = _INIT
    text["use_cache"] = False
    # multi-head latent attention rotates qk_rope_head_dim of each head; others the head (or a part of it)
    rotary = text.get("qk_rope_head_dim") or text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    _shrink_rope(text, rotary)


_WIDTH_KEY = re.compile(r"hidden|_dim$|_size$|width")


def _same_widths(part: dict[str, Any], released: int, small: int) -> None:
    """Other width keys of ``part`` that held the released width (``mm_hidden_size``, ``vit_hidden_size`` ...)."""
    for key, value in list(part.items()):
        if isinstance(value, int) and not isinstance(value, bool) and value == released and _WIDTH_KEY.search(key):
            part[key] = small


def _clamp_layer_ids(part: dict[str, Any], layers: int) -> None:
    """A tower layer index (``insert_layer_id``) past the shrunk tower's ``layers`` set to its last layer: left
    as released it never runs (MiniCPM-V 4.6's insert merger: the final merger then assumes it ran and reads
    the next image's patches as this one's)."""
    for key, value in list(part.items()):
        if re.search(r"_layer_(?:id|idx|index)$", key) and isinstance(value, int) and value >= layers:
            part[key] = layers - 1


def _shrink_vision(vision: dict[str, Any], text_hidden: int, layers: int) -> None:
    released = vision.get("hidden_size")
    if isinstance(released, int) and released > _VISION_SIZES["hidden_size"]:
        _same_widths(vision, released, _VISION_SIZES["hidden_size"])
    for key, value in _VISION_SIZES.items():
        if isinstance(vision.get(key), int):
            vision[key] = value
    for key in ("num_hidden_layers", "depth", "num_layers"):
        if isinstance(vision.get(key), int):
            vision[key] = layers
    if isinstance(vision.get("layer_types"), list) and vision["layer_types"]:  # LFM3-VL's tower mixes convolutions
        vision["layer_types"] = _shrink_layer_types(vision["layer_types"])
        vision["num_hidden_layers"] = max(layers, len(vision["layer_types"]))
        vision["layer_types"] = (vision["layer_types"] * layers)[: vision["num_hidden_layers"]]
    for key in ("out_hidden_size", "text_hidden_size"):
        if isinstance(vision.get(key), int):
            vision[key] = text_hidden
    for key in ("deepstack_visual_indexes",):
        if isinstance(vision.get(key), list):
            vision[key] = []
    _clamp_layer_ids(vision, layers)
    if isinstance(vision.get("fullatt_block_indexes"), list):
        vision["fullatt_block_indexes"] = [layers - 1]
    if isinstance(vision.get("mlp_ratio"), (int, float)):
        vision["mlp_ratio"] = type(vision["mlp_ratio"])(2)
    vision["initializer_range"] = _INIT


def _fixed_size(image_processor: Any) -> int | None:
    """The square side every image is resized (or cropped) to, where the image processor has one: the tower's
    ``image_size`` of the released checkpoint (config defaults and processor defaults often differ)."""
    crop = getattr(image_processor, "crop_size", None) if getattr(image_processor, "do_center_crop", False) else None
    for size in (crop, getattr(image_processor, "size", None)):
        if size is None:
            continue
        size = dict(size) if not isinstance(size, dict) else size
        if size.get("height") and size.get("height") == size.get("width"):
            return int(size["height"])
    return None


def _vision_layers(top: dict[str, Any]) -> int:
    """Vision layers enough for the layers the projector reads (``vision_feature_layer`` -2, or a list)."""
    layer = top.get("vision_feature_layer")
    wanted = [layer] if isinstance(layer, int) else list(layer) if isinstance(layer, list) else []
    need = max([abs(int(x)) if x < 0 else int(x) + 1 for x in wanted] or [0])
    return max(_VISION["layers"], need)


def _token_ids(config: dict[str, Any], proc: Any, tok: Any) -> None:
    """Point every ``*_token_id`` / ``*_token_index`` of the config at the stand-in tokenizer's token of the
    same name on the processor (or tokenizer); bos / eos / pad at the tokenizer's own."""
    named = {**_named_tokens(tok), **_named_tokens(proc)}
    vocab = tok.get_vocab()
    for key in list(config):
        match = re.match(r"^(.*_token)(?:_id|_index)$", key)
        if match is None:
            continue
        stem = match.group(1)
        if stem in ("bos_token", "eos_token", "pad_token"):
            value = getattr(tok, f"{stem}_id", None)
            config[key] = value if value is not None else tok.eos_token_id
            continue
        for source in (proc, tok):
            value = getattr(source, f"{stem}_id", None)
            if isinstance(value, int):
                config[key] = value
                break
        else:
            if stem in named and named[stem] in vocab:
                config[key] = vocab[named[stem]]


def tiny_config_for_type(model_type: str, processor: Any = None) -> Any:
    """The type's config shrunk as the module docstring draws, with ``processor``'s token ids."""
    from transformers import AutoConfig

    proc = processor if processor is not None else processor_for_type(model_type)
    tok = proc.tokenizer
    config = AutoConfig.for_model(model_type).to_dict()
    vocab = len(tok)
    text_key = "text_config" if isinstance(config.get("text_config"), dict) else None
    text = config[text_key] if text_key else config
    released_widths = {k: v for k, v in (("text", text.get("hidden_size")),
                                         ("vision", (config.get("vision_config") or {}).get("hidden_size")))}
    _shrink_text(text, vocab)
    hidden = text["hidden_size"]
    side = _fixed_size(getattr(proc, "image_processor", None))
    for key, sub in config.items():
        if key != text_key and key.endswith("_config") and isinstance(sub, dict):
            _shrink_vision(sub, hidden, _vision_layers(config))
            if side is not None and key == "vision_config" and isinstance(sub.get("image_size"), int):
                sub["image_size"] = side
            patch = getattr(getattr(proc, "image_processor", None), "patch_size", None)
            if key == "vision_config" and isinstance(patch, int) and isinstance(sub.get("patch_size"), int):
                sub["patch_size"] = patch  # the processor cuts the patches the tower embeds
    if text_key:  # projector widths on the top-level config (mm_hidden_size ...)
        for kind, small in (("vision", _VISION_SIZES["hidden_size"]), ("text", hidden)):
            if isinstance(released_widths[kind], int) and released_widths[kind] > small:
                _same_widths(config, released_widths[kind], small)
        config["vocab_size"] = vocab if "vocab_size" in config else config.get("vocab_size")
        if config.get("vocab_size") is None:
            config.pop("vocab_size")
        config["initializer_range"] = _INIT
        _clamp_layer_ids(config, _vision_layers(config))
    for part in (config, text):
        _token_ids(part, proc, tok)
    for key, value in (_override(model_type, "top") or {}).items():
        config[key] = value
    for key, token in (_override(model_type, "token_ids") or {}).items():  # ids the token names alone don't give
        config[key] = tok.convert_tokens_to_ids(token)
    for key, value in (_override(model_type, "text") or {}).items():
        text[key] = value
    for key, value in (_override(model_type, "vision") or {}).items():
        config["vision_config"][key] = value
    for part, values in (_override(model_type, "sub") or {}).items():
        config[part].update(values)
    config.pop("model_type", None)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        config.pop(key, None)
    return AutoConfig.for_model(model_type, **config)


def tiny_model_for_type(
    model_type: str,
    processor: Any = None,
    *,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> Any:
    """A tiny randomly initialised model of ``model_type``'s image-text-to-text class (fp32, eval mode), its
    token ids those of ``processor`` (default :func:`processor_for_type`)."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from .._compat import model_from_config

    config = tiny_config_for_type(model_type, processor)
    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type], None)
    if cls is None or type(cls).__name__ == "DummyObject":
        raise NotBuildable(f"{MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]} does not import here")
    torch.manual_seed(seed)
    model = model_from_config(cls, config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.float().eval()  # parts a config pins to bf16 (Llama 4's) too
