"""What the generic shrink of :mod:`vlm_pack.offline.model_types` cannot guess, per model type: the released
checkpoints' settings that a type's config or processor class does not default to (a patch size, a rotary
section, a token id), so that a tiny model of the type reads its real processor's outputs as the released
model does. Data only; one entry per type, each with the checkpoint it comes from."""

from __future__ import annotations

from typing import Any

# GLM-4.1V's rotary: half of each head, sections (8, 12, 12) of 32, shrunk to a 16-wide head
_GLM_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1])
# Per model type, what the generic shrink cannot guess: config keys (``text``, ``vision``, ``top``; ``token_ids``:
# top-level keys given the stand-in tokenizer's id of a token), the processor's (``processor_kwargs``), its image
# processor's (``image_processor``), extra tokens.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # PaddlePaddle/PaddleOCR-VL: mRoPE sections of the released text config (16, 24, 24 of 64), shrunk
    "paddleocr_vl": dict(text=dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                        mrope_section=[2, 3, 3]))),
    # tencent/HunyuanOCR: its rotary base scaled by alpha, four xD-RoPE sections (16 each of 64), shrunk; its
    # processor takes an image only as <|image_start|><|image_pad|><|image_end|> in the text
    "hunyuan_vl": dict(text=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, alpha=1000.0,
                                                      mrope_section=[2, 2, 2, 2])),
                       placeholder="{image_start_token}{image_token}{image_end_token}"),
    # baidu/ERNIE-4.5-VL-28B-A3B: the model code's default sections (22, 22, 20 of 64), shrunk
    "ernie4_5_vl_moe": dict(text=dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                           mrope_section=[3, 3, 2])),
                            # its frames' drawn timestamps need the checkpoint's font file (same token counts)
                            video_processor=dict(draw_on_frames=False)),
    # KamilaMila/FastVLM-*: transformers' own conversion (models/fast_vlm/convert_fastvlm_weights_to_hf.py) ships
    # LlavaProcessor around CLIPImageProcessor (1024 px, mean 0, std 1) with patch_size 64 (FastViTHD downsamples
    # by 2^6): 256 tokens an image; the same at 256 px: 16. Its tower is timm's fastvit_mci3 as released (a timm
    # architecture has no size to shrink), whose 3072 features the projector reads
    "fast_vlm": dict(vision=dict(hidden_size=3072),
                     processor_class="LlavaProcessor", image_processor_class="CLIPImageProcessor",
                     image_processor=dict(size={"shortest_edge": 256}, crop_size={"height": 256, "width": 256},
                                          image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0]),
                     processor_kwargs=dict(patch_size=64)),
    # mistralai/Mistral-Large-3: the PixtralProcessor read with its model's vision settings (patch 14, a 2 x 2
    # patch merger, images up to 1540 px); the class defaults (16, no merge) are another checkpoint's
    "mistral_large4": dict(processor_kwargs=dict(patch_size=14, spatial_merge_size=2),
                           image_processor=dict(patch_size={"height": 14, "width": 14}, size={"longest_edge": 1540})),
    # AIDC-AI/Ovis2: the processor writes each image as <IMG_START> <IMG_ATOM>... <IMG_GRID> ... <IMG_END> (an
    # f-string the source scan misses); the model's image_token_id is the atom, its five visual indicators the rest;
    # its AIMv2 tower at 448 px, 2 x 2 patches merged (hidden_stride): the processor's 256 atoms a crop; its visual
    # embedding table is as wide as the top-level hidden_size, the text model's (the tiny text width, 64)
    "ovis2": dict(vision=dict(image_size=448, hidden_stride=2), image_processor=dict(size={"height": 448, "width": 448}),
                  top=dict(hidden_size=64),
                  tokens=("<IMG_START>", "<IMG_ATOM>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"),
                  token_ids=dict(image_token_id="<IMG_ATOM>",
                                 visual_indicator_token_ids=["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>",
                                                             "<IMG_END>"])),
    # baidu/Qianfan-OCR: its prompts hold <image>, which the processor expands into its context tokens
    "qianfan_ocr": dict(placeholder="<image>", image_processor=dict(size={"height": 448, "width": 448})),
    # llava-hf/vip-llava-7b-hf: CLS dropped, as its projector does
    "vipllava": dict(processor_kwargs=dict(vision_feature_select_strategy="default")),
    # nvidia/Cosmos3-Edge: its model reads the token types its processor writes when asked
    "cosmos3_edge": dict(attributes=dict(return_mm_token_type_ids=True)),
    # allenai/Molmo2: the adapter reads two layers of the tower (the last two of the tiny one); its image features
    # go into the <im_patch> tokens its processor writes
    "molmo2": dict(sub=dict(adapter_config=dict(vision_feature_layer=[-1, -2])),
                   token_ids=dict(image_patch_id="<im_patch>")),
    # Qwen4-Exp: its config leaves the indexer unset; a budget (16 tokens, blocks of 4) below a sample's length
    "qwen4_exp": dict(text=dict(hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                indexer_budget=16, indexer_compress_ratio=4)),
    # Step3.7: 14 px patches (the image processor's patch_size is its 504 px crops); a sliding window and layer
    "step3p7": dict(vision=dict(patch_size=14),
                    text=dict(sliding_window=32, layer_types=["full_attention", "sliding_attention"],
                              rope_parameters={kind: dict(rope_type="default", rope_theta=10000.0)
                                               for kind in ("full_attention", "sliding_attention")})),
    # ibm-granite Granite 4 Vision: its config leaves the projector unset: a window Q-Former taking 8 x 8 patch
    # windows to 4 x 4 queries (the processor counts its tokens with the same rate), two tower layers fed to the
    # two text layers (deepstack), spatial groups into both; its config gives the Q-Former a head per 64 of the
    # tower's width; 336 px tiles of 14 px patches (24 x 24: whole windows)
    "granite4_vision": dict(vision=dict(hidden_size=64, patch_size=14, image_size=336),
                            image_processor=dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
                            top=dict(downsample_rate="4/8", deepstack_layer_map=[(-1, 0), (-2, 1)],
                                     spatial_target_layers=[0, 1]),
                            processor_kwargs=dict(downsample_rate="4/8", patch_size=14)),
    # Llama 4: the pixel shuffle (0.5) makes 4 x 32 channels, which the adapter's first layer (intermediate_size)
    # reads; its image features go into the <|patch|> tokens its processor writes (<|image|> opens a tile)
    "llama4": dict(token_ids=dict(image_token_index="<|patch|>"), vision=dict(intermediate_size=128, projector_input_dim=64, projector_output_dim=64,
                               vision_output_dim=64)),
    # facebook/Perception-LM-1B: a timm PE tower (vit_pe_core_large_patch14_336 at 448 px) its config leaves
    # unset, here 2 layers of width 32; 2 x 2 pooling, which the processor counts with the same patch size
    "perception_lm": dict(vision=dict(architecture="vit_pe_core_large_patch14_336",
                                      model_args=dict(embed_dim=32, depth=2, num_heads=2, img_size=(448, 448))),
                          top=dict(projector_pooling_ratio=2),
                          processor_kwargs=dict(patch_size=14, pooling_ratio=2),
                          image_processor=dict(max_num_tiles=4)),
    # Qwen omni thinkers: no processor class mapped; their checkpoints ship the omni processor (audio left out)
    # around Qwen2-VL's image processor, and the vision_start_token_id their rope index reads (the config class
    # lacks it). Qwen2.5-Omni-7B's thinker: mRoPE sections of the released text config (16, 24, 24 of 64), shrunk
    "qwen2_5_omni_thinker": dict(processor_class="Qwen2_5OmniProcessor", image_processor_class="Qwen2VLImageProcessorPil",
                                 token_ids=dict(vision_start_token_id="<|vision_start|>"),
                                 text=dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                                mrope_section=[2, 3, 3]))),
    "qwen3_omni_moe_thinker": dict(processor_class="Qwen3OmniMoeProcessor",
                                   image_processor_class="Qwen2VLImageProcessorPil",
                                   token_ids=dict(vision_start_token_id="<|vision_start|>")),
    # stepfun-ai/GOT-OCR-2.0-hf: 1024 px (64 x 64 patches, projected to the 256 tokens its processor writes)
    "got_ocr2": dict(image_processor=dict(size={"height": 1024, "width": 1024}), vision=dict(image_size=1024)),
    # GLM-5-Next: as many key / value heads as query heads
    "glm5_next": dict(text=dict(num_key_value_heads=4)),
    # transformers maps no processor to GLM-OCR or GLM-GA; their models are GLM-4.1V's (modular), whose processor
    # and image processor stand in here
    "glm_ocr": dict(processor_class="Glm4vProcessor", image_processor_class="Glm4vImageProcessorPil",
                    text=dict(rope_parameters=_GLM_ROPE)),
    "glmga": dict(processor_class="Glm46VProcessor", text=dict(rope_parameters=_GLM_ROPE)),
    # lmms-lab/LLaVA-OneVision-1.5: its tower embeds one frame per patch (temporal patch 1)
    "llava_onevision1_5": dict(image_processor=dict(temporal_patch_size=1)),
    # CohereLabs/aya-vision-8b: 364 px SigLIP crops (26 x 26 patches, pixel-shuffled by 2)
    "aya_vision": dict(image_processor=dict(size={"height": 364, "width": 364}),
                       processor_kwargs=dict(img_size=364)),
    # llava-hf/LLaVA-NeXT-Video-7B-hf: CLIP 336 px, 14 px patches, CLS dropped
    "llava_next_video": dict(processor_kwargs=dict(patch_size=14, vision_feature_select_strategy="default",
                                                   num_additional_image_tokens=1),
                             image_processor=dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
                             vision=dict(image_size=336)),
    # DAMO-NLP-SG/VideoLLaMA3: its token compression drops patches by content, which no header forecasts (vlm-pack
    # refuses that); its videos pack with it off
    "video_llama_3": dict(video_processor=dict(use_token_compression=False)),
    # nvidia Nemotron-H Omni: its video processor's normalisation comes from the checkpoint (None by default)
    "nemotron_h_omni": dict(video_processor=dict(norm_mean=[0.48145466, 0.4578275, 0.40821073],
                                                 norm_std=[0.26862954, 0.26130258, 0.27577711])),
    # google/paligemma-3b-pt-224: 224 px, 256 image tokens
    "paligemma": dict(image_processor=dict(size={"height": 224, "width": 224}, image_seq_length=256),
                      vision=dict(image_size=224)),
}


def override(model_type: str, key: str) -> Any:
    return _OVERRIDES.get(model_type, {}).get(key)
