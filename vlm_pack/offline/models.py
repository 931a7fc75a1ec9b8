"""Tiny random models of the genuine transformers classes, whose token ids match the offline tokenizers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._compat import model_from_config
from .processors import _IMAGE_PROCESSOR_PARAMS
from .tokenizers import build_tokenizer, family_tokens

#: Families whose tiny model needs timm and torchvision (Gemma 3n's MobileNetV5 tower is timm's).
NEEDS_TIMM = ("gemma3n",)


def _transformers_class(family: str, kind: str) -> Any:
    """The genuine ``transformers`` config (``kind="config"``) or ``*ForConditionalGeneration`` class of
    ``family``, looked up in transformers' own auto mappings (every family's model type is its name)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    names = CONFIG_MAPPING_NAMES if kind == "config" else MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return getattr(transformers, names[family])


@dataclass(frozen=True)
class _Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vision: int
    vision_layers: int
    init: float

    def vision_tower(self, model_type: str | None, **kw: Any) -> dict[str, Any]:
        out = dict(
            hidden_size=self.vision, intermediate_size=2 * self.vision, num_hidden_layers=self.vision_layers
        )
        out.update(num_attention_heads=2, initializer_range=self.init, **kw)
        return dict(out, model_type=model_type) if model_type else out


def _qwen_like(family: str, d: _Dims, text: dict[str, Any], ids: Any) -> dict[str, Any]:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4.1V: mRoPE over (t, h, w), patch 14 (16 for Qwen3) merged 2x2."""
    glm = family in _GLM_FAMILIES
    half = (d.hidden // d.heads) // 4 if glm else (d.hidden // d.heads) // 2  # GLM: partial rotary 0.5
    section = [half - 2 * (half // 4), half // 4, half // 4]
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}
    vision = dict(
        depth=d.vision_layers,
        num_heads=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=d.init,
    )
    vision.update(
        patch_size=16 if family == "qwen3_vl" else 14, out_hidden_size=d.hidden, hidden_size=d.vision
    )
    vision["intermediate_size"] = 2 * d.vision
    if family == "qwen2_vl":
        vision.update(embed_dim=d.vision, hidden_size=d.hidden, mlp_ratio=2)
    elif family == "qwen2_5_vl":
        vision.update(window_size=112, fullatt_block_indexes=[d.vision_layers - 1])
    elif family == "qwen3_vl":
        text.update(head_dim=d.hidden // d.heads)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[])
    if glm:
        text["rope_parameters"]["partial_rotary_factor"] = 0.5
        if family != "glm4v":
            _glm_moe_text(text)
        vision.update(image_size=336)
        names = ("image_token_id", "<|image|>"), ("image_start_token_id", "<|begin_of_image|>")
        names += (("image_end_token_id", "<|end_of_image|>"), ("video_token_id", "<|video|>"))
        names += (("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>"))
        return dict(vision_config=vision, **{k: ids(t) for k, t in names})
    names = ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")
    names += (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))
    return dict(vision_config=vision, **{k: ids(t) for k, t in names})


_GLM_FAMILIES = ("glm4v", "glm4v_moe", "glm46v")


def _glm_moe_text(text: dict[str, Any]) -> None:
    """GLM-4.5V / 4.6V's mixture-of-experts text model (``glm4v_moe_text``), shrunk: 4 routed experts, 2 per
    token, one shared expert, the first layer dense as in the checkpoints (``first_k_dense_replace``)."""
    text.update(model_type="glm4v_moe_text", n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
    text.update(moe_intermediate_size=text["hidden_size"], first_k_dense_replace=1, n_group=1, topk_group=1)
    text.update(norm_topk_prob=True, routed_scaling_factor=1.0)


def _gemma4(d: _Dims, text: dict[str, Any], tok: Any) -> dict[str, Any]:
    """Gemma 4: 16 px patches pooled 3 x 3; sliding / full text layers (the last one full), per-layer inputs,
    image tokens attending both ways on the sliding layers where ``use_bidirectional_attention="vision"``
    (the released 26B / 31B; pass ``use_bidirectional_attention=None`` for the E2B / E4B behaviour)."""
    head_dim = d.hidden // d.heads
    text.update(model_type="gemma4_text", head_dim=head_dim, global_head_dim=head_dim, sliding_window=8)
    text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=text["vocab_size"])
    text["layer_types"] = ["sliding_attention"] * (d.layers - 1) + ["full_attention"]
    text["use_bidirectional_attention"] = "vision"
    vision = d.vision_tower("gemma4_vision", head_dim=d.vision // 2, patch_size=16, pooling_kernel_size=3)
    vision.update(num_key_value_heads=2)
    ids = dict(image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id)
    return dict(vision_config=vision, audio_config=None, **ids)

def _gemma3n(d: _Dims, text: dict[str, Any], ids: Any) -> dict[str, Any]:
    """Gemma 3n: a MobileNetV5 tower (timm, through ``TimmWrapperModel``: needs timm and torchvision), shrunk
    to four stages of 8/16 channels but keeping its multi-scale fusion adapter (2048 channels on a 16 x 16
    grid: the 256 tokens); a text model of sliding / full layers with AltUp, LAuReL, per-layer inputs,
    activation sparsity on the first layer and, from four layers on, the second half sharing the first
    half's keys and values. Token ids from ``<end_of_image>`` on enter the vision embedder's table, from
    ``<end_of_audio>`` on the audio one's (``Gemma3nMultimodalEmbedder.vocab_offset``), as released."""
    try:
        from timm.models._efficientnet_builder import decode_arch_def
    except ImportError as e:
        raise ImportError(
            f"gemma3n: its vision tower is timm's MobileNetV5 ({e}): pip install timm torchvision"
        ) from None

    head_dim = d.hidden // d.heads
    vision_offset, audio_offset = ids("<end_of_image>"), ids("<end_of_audio>")
    text.update(model_type="gemma3n_text", head_dim=head_dim, sliding_window=8, laurel_rank=8)
    text.update(vocab_size_per_layer_input=vision_offset, hidden_size_per_layer_input=8)
    text["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(d.layers)]
    text["num_kv_shared_layers"] = d.layers // 2 if d.layers >= 4 else 0
    text["activation_sparsity_pattern"] = [0.95] + [0.0] * (d.layers - 1)
    stages = [["er_r1_k3_s2_e4_c8"], ["uir_r1_a3_k5_s2_e2_c16"], ["uir_r1_a3_k5_s2_e2_c16"]]
    stages.append(["uir_r1_a3_k5_s2_e2_c16", "mqa_r1_k3_h2_s1_d8_c16", "uir_r1_a0_k0_s1_e2_c16"])
    vision = dict(architecture="mobilenetv5_300m_enc", hidden_size=2048, initializer_range=d.init)
    vision.update(model_args=dict(block_args=decode_arch_def(stages), stem_size=8))
    vision.update(vocab_offset=vision_offset, vocab_size=audio_offset - vision_offset)
    audio = dict(vocab_offset=audio_offset, vocab_size=text["vocab_size"] - audio_offset, hidden_size=16)
    audio.update(conf_num_attention_heads=2, conf_num_hidden_layers=1, sscp_conv_channel_size=[8, 4])
    names = ("boi_token_id", "<start_of_image>"), ("eoi_token_id", "<end_of_image>")
    names += (("image_token_id", "<image_soft_token>"), ("boa_token_id", "<start_of_audio>"))
    names += (("eoa_token_id", "<end_of_audio>"), ("audio_token_id", "<audio_soft_token>"))
    return dict(vision_config=vision, audio_config=audio, **{k: ids(t) for k, t in names})


def _qwen3_5(family: str, d: _Dims, text: dict[str, Any], ids: Any) -> dict[str, Any]:
    """Qwen3.5 (and its MoE): Qwen3-VL's tower without deepstack; a text model of gated delta-net layers and
    attention 3:1 as released (a tiny one of fewer than 4 layers ends on one attention layer), rotary on a
    quarter of each head (partial_rotary_factor 0.25) in interleaved mRoPE sections."""
    head_dim = 32
    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(d.layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    text.update(head_dim=head_dim, layer_types=kinds, linear_conv_kernel_dim=4)
    text.update(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    half = head_dim // 4 // 2
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
        "mrope_interleaved": True,
    }
    if family == "qwen3_5_moe":  # 4 experts, 2 per token, a shared expert: as the released ones, tiny
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=d.hidden)
        text.update(shared_expert_intermediate_size=d.hidden, router_aux_loss_coef=0.001)
    vision = dict(depth=d.vision_layers, num_heads=2, spatial_merge_size=2, temporal_patch_size=2)
    vision.update(patch_size=16, out_hidden_size=d.hidden, hidden_size=d.vision, intermediate_size=2 * d.vision)
    vision.update(num_position_embeddings=64, initializer_range=d.init)
    names = ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")
    names += (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))
    return dict(vision_config=vision, **{k: ids(t) for k, t in names})


def _family_parts(family: str, d: _Dims, text: dict[str, Any], ids: Any, tok: Any) -> dict[str, Any]:
    """The config's vision tower and multimodal fields; edits ``text`` where the family's LM needs it."""
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", *_GLM_FAMILIES):
        return _qwen_like(family, d, text, ids)
    if family in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5(family, d, text, ids)
    if family in ("llava", "llava_next"):  # CLIP 336; vision_feature_layer=-2 needs two layers
        text["model_type"] = "llama"
        vision = d.vision_tower("clip_vision_model", image_size=336, patch_size=14)
        vision["num_hidden_layers"] = max(2, d.vision_layers + 1)
        out = dict(vision_config=vision, image_token_index=ids("<image>"), vision_feature_layer=-2)
        out.update(vision_feature_select_strategy="default", image_seq_length=576)
        if family == "llava_next":
            out["image_grid_pinpoints"] = _IMAGE_PROCESSOR_PARAMS["llava_next"]["image_grid_pinpoints"]
        return out
    if family == "llava_onevision":  # SigLIP 384 -> 27 x 27 = 729 features per crop
        text["model_type"] = "qwen2"
        out = dict(vision_config=d.vision_tower("siglip_vision_model", image_size=384, patch_size=14))
        out.update(
            image_token_index=ids("<image>"), video_token_index=ids("<video>"), vision_feature_layer=-1
        )
        out["image_grid_pinpoints"] = _IMAGE_PROCESSOR_PARAMS["llava_onevision"]["image_grid_pinpoints"]
        return out
    if family == "internvl":  # InternViT 448, pixel shuffle 0.5 -> 256 tokens per tile
        text["model_type"] = "qwen2"
        vision = d.vision_tower("internvl_vision", image_size=[448, 448], patch_size=[14, 14])
        return dict(vision_config=vision, image_token_id=ids("<IMG_CONTEXT>"), image_seq_length=256)
    if family in ("idefics3", "smolvlm"):  # SigLIP crops 364 (scale 2 -> 169) / 384 (scale 3 -> 81)
        text["model_type"] = "llama"
        size, scale = (364, 2) if family == "idefics3" else (384, 3)
        vision = d.vision_tower(None, image_size=size, patch_size=14)
        return dict(vision_config=vision, image_token_id=ids("<image>"), scale_factor=scale)
    if family == "gemma3":  # SigLIP 896 -> 64 x 64 patches pooled to 256; text layers alternate sliding/full
        head_dim = d.hidden // d.heads
        text.update(
            model_type="gemma3_text", head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8
        )
        text["layer_types"] = ["sliding_attention", "full_attention"] * (d.layers // 2) + [
            "sliding_attention"
        ] * (d.layers % 2)
        out = dict(vision_config=d.vision_tower("siglip_vision_model", image_size=896, patch_size=14))
        out.update(mm_tokens_per_image=256, image_token_index=tok.image_token_id)
        return dict(out, boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id)
    if family == "lfm2_vl":  # SigLIP2-NaFlex 16 px patches, unshuffled 2 x 2; LFM2 text: short convs + attention
        text.update(model_type="lfm2", layer_types=_lfm2_layer_types(d.layers))
        vision = d.vision_tower("siglip2_vision_model", patch_size=16, num_patches=256, vision_use_head=False)
        out = dict(vision_config=vision, image_token_id=ids("<image>"), downsample_factor=2)
        return dict(out, projector_hidden_size=2 * d.hidden)
    if family == "gemma4":
        return _gemma4(d, text, tok)
    if family == "gemma3n":
        return _gemma3n(d, text, ids)
    # mistral3: Pixtral tower, 14 px patches merged 2 x 2
    text["model_type"] = "mistral"
    vision = d.vision_tower("pixtral", image_size=1540, patch_size=14, head_dim=d.vision // 2)
    return dict(
        vision_config=vision, image_token_index=ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1
    )


def _lfm2_layer_types(layers: int) -> list[str]:
    """A short convolution first (so a packed row's earlier sample would reach every later layer through it),
    then attention and convolutions alternating, as LFM2's released configs mix them."""
    return ["conv" if i % 2 == 0 else "full_attention" for i in range(layers)]


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

    Patch, merge and crop sizes equal the released checkpoint's, so ``image_processor(family)`` outputs feed
    the model unchanged; only widths and depths shrink.
    """

    family_tokens(family)  # validates the name
    tok = tokenizer if tokenizer is not None else build_tokenizer(family)
    ids = tok.convert_tokens_to_ids
    d = _Dims(
        hidden_size, num_layers, num_heads, num_kv_heads, vision_hidden_size, vision_layers, initializer_range
    )
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size)
    text.update(num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads)
    text.update(max_position_embeddings=32768, initializer_range=initializer_range)
    text.update({k: tok.convert_tokens_to_ids(v) for k, v in _special_ids(tok).items()})
    parts = _family_parts(family, d, text, ids, tok)
    return _transformers_class(family, "config")(text_config=text, **parts)


def _special_ids(tok: Any) -> dict[str, str]:
    out = {"eos_token_id": tok.eos_token, "pad_token_id": tok.pad_token or tok.eos_token}
    out["bos_token_id"] = tok.bos_token or tok.pad_token or tok.eos_token
    return out


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

    config = tiny_model_config(family, tokenizer, initializer_range=initializer_range, **config_kwargs)
    cls = _transformers_class(family, "model")
    torch.manual_seed(seed)
    model = model_from_config(cls, config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()
