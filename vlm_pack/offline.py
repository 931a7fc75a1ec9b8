"""Offline stand-ins for hub checkpoints: tokenizers, image processors and tiny models.

vlm-pack's tests, demo, notebook and examples run on machines that cannot reach a model hub. This module
builds, from nothing but installed packages:

- ``build_tokenizer(family)``: a byte-level BPE tokenizer trained in about a second on a built-in corpus,
  carrying the family's special tokens (``<|image_pad|>``, ``<|vision_start|>`` ... for Qwen; ``<image>`` for
  LLaVA; ``<IMG_CONTEXT>`` for InternVL) so that chat templates and placeholder expansion work as with the
  released tokenizer;
- ``image_processor(family, **overrides)``: the real Hugging Face PIL image processor constructed with the
  released checkpoint's parameters (constructor defaults differ from checkpoints: Qwen2-VL's default
  ``max_pixels`` is 1003520, the checkpoint's 12845056);
- ``tiny_model_config(family, tokenizer)`` / ``tiny_model(...)``: a real transformers model of the family,
  a few layers wide, with random weights, whose special-token ids match the tokenizer.

With a real checkpoint, use ``AutoTokenizer`` / ``AutoImageProcessor`` instead: everything else in vlm-pack
takes those objects unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = [
    "FAMILIES",
    "build_tokenizer",
    "image_processor",
    "processor",
    "tiny_model",
    "tiny_model_config",
]

#: Families with an offline tokenizer, image processor and tiny model.
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next")

_QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_LLAVA = ("llava", "llava_next")

# One vocabulary for every family keeps token ids stable across tests; each family names its own roles.
_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<image>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
]

_ROLES = {
    "qwen": dict(
        image_token="<|image_pad|>",
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
    ),
    "llava": dict(
        image_token="<image>", pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    ),
}

_CORPUS_WORDS = (
    "the a an of to in and is are was were be been on at by for with from this that these those it its "
    "image picture photo document screenshot chart table figure page text caption question answer describe "
    "what where when who why how which many much color red green blue yellow black white gray large small "
    "left right top bottom center person people dog cat car tree house street sky water building sign "
    "number one two three four five six seven eight nine ten hundred thousand year time day night "
    "shows contains appears looks wearing holding standing sitting walking running reading writing "
    "user assistant system please explain summarize list count compare find read translate title "
    "model vision language token tokens packing sequence sample batch train training loss attention"
).split()


def _corpus(n_lines: int = 4000) -> list[str]:
    # A fixed linear congruential generator: the same vocabulary on every machine and Python version.
    state = 12345
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(12):
            state = (1103515245 * state + 12345) % (2**31)
            words.append(_CORPUS_WORDS[state % len(_CORPUS_WORDS)])
        state = (1103515245 * state + 12345) % (2**31)
        words.append(str(state % 1000))
        lines.append(" ".join(words) + ".")
    return lines


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def _family_kind(family: str) -> str:
    if family in _QWEN:
        return "qwen"
    if family in _LLAVA:
        return "llava"
    raise ValueError(f"Unknown family {family!r}: vlm_pack.offline supports {', '.join(FAMILIES)}.")


def build_tokenizer(family: str = "qwen2_vl", vocab_size: int = 1024) -> Any:
    """A locally trained fast tokenizer with ``family``'s special tokens (no download).

    The returned ``PreTrainedTokenizerFast`` has ``image_token`` / ``image_token_id`` (and for Qwen the
    ``vision_start`` / ``vision_end`` / ``video`` tokens) set as the released processor expects, a
    ``pad_token`` and an ``eos_token``. All families share one vocabulary of ``vocab_size`` ids.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    roles = _ROLES[_family_kind(family)]
    backend = Tokenizer.from_str(_tokenizer_json(vocab_size))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{
            k: v
            for k, v in roles.items()
            if k.endswith(("pad_token", "eos_token", "bos_token", "unk_token")) and v
        },
    )
    tok.add_special_tokens({"additional_special_tokens": list(_SPECIAL_TOKENS)})
    for role, token in roles.items():
        if (
            role.endswith("_token")
            and role not in ("pad_token", "eos_token", "bos_token", "unk_token")
            and token
        ):
            setattr(tok, role, token)
            setattr(tok, role + "_id", tok.convert_tokens_to_ids(token))
    tok.vlm_pack_family = family
    return tok


# Parameters of the released checkpoints' preprocessor_config.json.
_PROCESSOR_PARAMS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2_vl": dict(
        cls="Qwen2VLImageProcessorPil",
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 3136, "longest_edge": 12845056},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    ),
    # Qwen/Qwen3-VL-*-Instruct
    "qwen3_vl": dict(
        cls="Qwen2VLImageProcessorPil",
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ),
    # llava-hf/llava-1.5-7b-hf
    "llava": dict(
        cls="LlavaImageProcessorPil",
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        do_center_crop=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    ),
    # llava-hf/llava-v1.6-mistral-7b-hf
    "llava_next": dict(
        cls="LlavaNextImageProcessorPil",
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        do_center_crop=True,
        do_pad=True,
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    ),
}
_PROCESSOR_PARAMS["qwen2_5_vl"] = _PROCESSOR_PARAMS["qwen2_vl"]


def image_processor(family: str = "qwen2_vl", **overrides: Any) -> Any:
    """The real transformers PIL image processor of ``family`` with the released checkpoint's parameters.

    ``overrides`` replace checkpoint parameters, e.g. ``image_processor("qwen2_vl", size={"shortest_edge":
    3136, "longest_edge": 200704})`` to cap Qwen images at 256 vision tokens.
    """
    import transformers

    _family_kind(family)
    params = {k: v for k, v in _PROCESSOR_PARAMS[family].items() if k != "cls"}
    params.update(overrides)
    return getattr(transformers, _PROCESSOR_PARAMS[family]["cls"])(**params)


def _text_dims(hidden_size: int, num_layers: int, heads: int, kv_heads: int, vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
    )


def tiny_model_config(
    family: str = "qwen2_vl",
    tokenizer: Any = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_hidden_size: int = 32,
    vision_layers: int = 1,
    initializer_range: float = 0.02,
) -> Any:
    """A tiny transformers config of ``family`` whose token ids match ``tokenizer``.

    Patch and merge sizes equal the released checkpoint's, so ``image_processor(family)`` outputs feed the
    model unchanged; only widths and depths shrink.
    """
    import transformers

    tok = tokenizer if tokenizer is not None else build_tokenizer(family)
    vocab = len(tok)
    text = _text_dims(hidden_size, num_layers, num_heads, num_kv_heads, vocab)
    text["initializer_range"] = initializer_range
    head_dim = hidden_size // num_heads
    ids = lambda t: tok.convert_tokens_to_ids(t)  # noqa: E731
    if family in _QWEN:
        # mrope_section splits head_dim/2 rotary frequencies over (t, h, w).
        half = head_dim // 2
        section = [half - 2 * (half // 4), half // 4, half // 4]
        qwen_ids = dict(
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
        text.update(
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        )
        if family == "qwen2_vl":
            text["rope_parameters"] = {
                "rope_type": "default",
                "mrope_section": section,
                "rope_theta": 10000.0,
            }
            vision = dict(
                depth=vision_layers,
                embed_dim=vision_hidden_size,
                hidden_size=hidden_size,
                num_heads=2,
                mlp_ratio=2,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                initializer_range=initializer_range,
            )
            return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **qwen_ids)
        if family == "qwen2_5_vl":
            text["rope_parameters"] = {
                "rope_type": "default",
                "mrope_section": section,
                "rope_theta": 10000.0,
            }
            vision = dict(
                depth=vision_layers,
                hidden_size=vision_hidden_size,
                intermediate_size=2 * vision_hidden_size,
                num_heads=2,
                out_hidden_size=hidden_size,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=112,
                fullatt_block_indexes=[vision_layers - 1],
                initializer_range=initializer_range,
            )
            return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **qwen_ids)
        # Qwen3-VL interleaves mRoPE frequencies; its section still sums to head_dim // 2.
        text.update(
            head_dim=head_dim,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": section,
                "mrope_interleaved": True,
                "rope_theta": 10000.0,
            },
        )
        vision = dict(
            depth=vision_layers,
            hidden_size=vision_hidden_size,
            intermediate_size=2 * vision_hidden_size,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[],
            initializer_range=initializer_range,
        )
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **qwen_ids)

    if family in _LLAVA:
        text.update(
            model_type="llama",
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
        )
        vision = dict(
            model_type="clip_vision_model",
            hidden_size=vision_hidden_size,
            intermediate_size=2 * vision_hidden_size,
            num_hidden_layers=max(2, vision_layers + 1),  # vision_feature_layer=-2 needs two layers
            num_attention_heads=2,
            image_size=336,
            patch_size=14,
            initializer_range=initializer_range,
        )
        common = dict(
            text_config=text,
            vision_config=vision,
            image_token_index=ids("<image>"),
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            image_seq_length=576,
        )
        if family == "llava":
            return transformers.LlavaConfig(**common)
        return transformers.LlavaNextConfig(
            image_grid_pinpoints=_PROCESSOR_PARAMS["llava_next"]["image_grid_pinpoints"], **common
        )
    _family_kind(family)
    raise AssertionError("unreachable")


def tiny_model(
    family: str = "qwen2_vl",
    tokenizer: Any = None,
    *,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    initializer_range: float = 0.02,
    **config_kwargs: Any,
) -> Any:
    """A tiny randomly initialised ``*ForConditionalGeneration`` of ``family`` in fp32 eval mode.

    ``initializer_range`` around 0.2 makes attention sharp enough that packing mistakes show up in
    log-prob comparisons (with 0.02 every token attends almost uniformly and errors hide).
    """
    import torch
    import transformers

    config = tiny_model_config(family, tokenizer, initializer_range=initializer_range, **config_kwargs)
    cls = {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "llava": transformers.LlavaForConditionalGeneration,
        "llava_next": transformers.LlavaNextForConditionalGeneration,
    }[family]
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def processor(family: str = "llava", tokenizer: Any = None, **overrides: Any) -> Any:
    """The full HF processor (tokenizer + image processor) for the LLaVA families, as released.

    Qwen processors carry a video processor that needs torchvision, so they cannot be built without it;
    for Qwen use ``build_tokenizer`` + ``image_processor`` with ``vlm_pack.processing.process_sample``.
    """
    import transformers

    if family not in _LLAVA:
        raise ValueError(
            f"processor({family!r}): only {', '.join(_LLAVA)} processors construct without torchvision; "
            "use build_tokenizer() and image_processor() with vlm_pack.process_sample instead."
        )
    tok = tokenizer if tokenizer is not None else build_tokenizer(family)
    cls = transformers.LlavaProcessor if family == "llava" else transformers.LlavaNextProcessor
    # llava-hf checkpoints count the CLS token (+1) and drop it again with the "default" strategy: 576.
    return cls(
        image_processor=image_processor(family, **overrides),
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
