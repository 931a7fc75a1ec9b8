"""Locally trained byte-level BPE tokenizers carrying each family's special tokens (no download)."""

from __future__ import annotations

import functools
from typing import Any

from .._checks import family_entry
from .._compat import set_named_special_tokens

# One vocabulary for every family keeps token ids stable across tests; these are trained into it (ids 0..14).
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

_QWEN_ROLES = dict(
    image_token="<|image_pad|>",
    video_token="<|video_pad|>",
    vision_start_token="<|vision_start|>",
    vision_end_token="<|vision_end|>",
)
_IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
_IDEFICS3_ROLES = dict(
    image_token="<image>",
    fake_image_token="<fake_token_around_image>",
    global_image_token="<global-img>",
    end_of_utterance_token="<end_of_utterance>",
)


_QWEN = dict(core=dict(pad_token="<|endoftext|>", eos_token="<|im_end|>"), roles=_QWEN_ROLES, extra=[])
# Qwen3.5's vocabulary adds reasoning and tool tags as plain (not special) added tokens: `plain` below.
_QWEN3_5 = dict(
    _QWEN, plain=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
)
_LLAVA = dict(
    core=dict(pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>"),
    roles=dict(image_token="<image>"),
    extra=[],
)
_GLM = dict(
    core=dict(pad_token="<|endoftext|>", eos_token="<|endoftext|>"),
    roles=dict(image_token="<|image|>", video_token="<|video|>"),
    extra=[
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "<|video|>",
    ],
)
# Per family: ``core`` (bos/eos/pad/unk), ``roles`` (named tokens set as tokenizer attributes), ``extra`` tokens,
# ``plain``: added tokens that are not special (kept by ``decode(skip_special_tokens=True)``);
# those of the released checkpoints' tokenizers (named in comments).
_FAMILY_TOKENS: dict[str, dict[str, Any]] = {
    "qwen2_vl": _QWEN,  # Qwen/Qwen2-VL-7B-Instruct
    "qwen2_5_vl": _QWEN,  # Qwen/Qwen2.5-VL-7B-Instruct
    "qwen3_vl": _QWEN,  # Qwen/Qwen3-VL-*-Instruct
    "qwen3_5": _QWEN3_5,  # Qwen/Qwen3.5-27B
    "qwen3_5_moe": _QWEN3_5,  # Qwen/Qwen3.5-35B-A3B
    "llava": _LLAVA,  # llava-hf/llava-1.5-7b-hf
    "llava_next": _LLAVA,  # llava-hf/llava-v1.6-mistral-7b-hf
    # llava-hf/llava-onevision-qwen2-7b-ov-hf (a Qwen2 vocabulary with <image> and <video> added)
    "llava_onevision": dict(
        core=dict(pad_token="<|endoftext|>", eos_token="<|im_end|>"),
        roles=dict(image_token="<image>", video_token="<video>"),
        extra=["<video>"],
    ),
    # OpenGVLab/InternVL3-1B-hf (Qwen2.5 vocabulary)
    "internvl": dict(
        core=dict(pad_token="<|endoftext|>", eos_token="<|im_end|>"),
        roles=dict(
            start_image_token="<img>",
            end_image_token="</img>",
            context_image_token="<IMG_CONTEXT>",
            video_token="<video>",
        ),
        extra=["<video>"],
    ),
    # HuggingFaceM4/Idefics3-8B-Llama3 (Llama 3 vocabulary)
    "idefics3": dict(
        core=dict(
            bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>", pad_token="<|finetune_pad|>"
        ),
        roles=_IDEFICS3_ROLES,
        extra=["<|begin_of_text|>", "<|finetune_pad|>", *_IDEFICS3_TOKENS],
    ),
    # HuggingFaceTB/SmolVLM-Instruct (SmolLM2 vocabulary: <|im_start|> is its BOS)
    "smolvlm": dict(
        core=dict(bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>"),
        roles=_IDEFICS3_ROLES,
        extra=list(_IDEFICS3_TOKENS),
    ),
    # google/gemma-3-4b-it
    "gemma3": dict(
        core=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        roles=dict(
            boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
        ),
        extra=[
            "<bos>",
            "<eos>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ],
    ),
    # google/gemma-4-E4B-it, google/gemma-4-31B-it: turns <|turn>role ... <turn|>, images <|image>...<image|>
    "gemma4": dict(
        core=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        roles=dict(
            boi_token="<|image>",
            eoi_token="<image|>",
            image_token="<|image|>",
            boa_token="<|audio>",  # Gemma4Processor refuses a tokenizer without its audio tokens
            eoa_token="<audio|>",
            audio_token="<|audio|>",
        ),
        extra=["<bos>", "<eos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|think|>", "<|audio>", "<audio|>", "<|audio|>"],
    ),
    # google/gemma-3n-E4B-it: Gemma 3's turns; <end_of_image> and <image_soft_token> open the vision
    # embedder's table (ids 262144, 262145: Gemma3nVisionConfig.vocab_offset), <end_of_audio> and
    # <audio_soft_token> the audio one (262272, 262273); the offline ids keep that order (tiny_model_config)
    "gemma3n": dict(
        core=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        roles=dict(
            boi_token="<start_of_image>",
            eoi_token="<end_of_image>",
            image_token="<image_soft_token>",
            boa_token="<start_of_audio>",  # Gemma3nProcessor refuses a tokenizer without its audio tokens
            eoa_token="<end_of_audio>",
            audio_token="<audio_soft_token>",
        ),
        extra=[
            "<bos>",
            "<eos>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<start_of_audio>",
            "<end_of_image>",
            "<image_soft_token>",
            "<end_of_audio>",
            "<audio_soft_token>",
        ],
    ),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503 (Tekken vocabulary; Pixtral image tokens)
    "mistral3": dict(
        core=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"),
        roles=dict(image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]"),
        extra=[
            "[INST]",
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[IMG]",
            "[IMG_BREAK]",
            "[IMG_END]",
        ],
    ),
    # LiquidAI/LFM2-VL-1.6B (LFM2 vocabulary: image start / end, thumbnail and tile markers as added tokens)
    "lfm2_vl": dict(
        core=dict(bos_token="<|startoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>"),
        roles=dict(
            image_token="<image>",
            image_start_token="<|image_start|>",
            image_end_token="<|image_end|>",
            image_thumbnail="<|img_thumbnail|>",
        ),
        extra=[
            "<|startoftext|>",
            "<|pad|>",
            "<|image_start|>",
            "<|image_end|>",
            "<|img_thumbnail|>",
            # every grid of at most max_tiles=10 tiles
            *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11) if r * c <= 10),
        ],
    ),
    # zai-org/GLM-4.1V-9B-Thinking
    "glm4v": _GLM,
    # zai-org/GLM-4.5V, zai-org/GLM-4.6V (the GLM-4.5 vocabulary: its thinking blocks are special tokens)
    "glm4v_moe": dict(_GLM, extra=[*_GLM["extra"], "<think>", "</think>"]),
    "glm46v": dict(_GLM, extra=[*_GLM["extra"], "<think>", "</think>"]),
}


#: Families with an offline tokenizer, image processor, processor and tiny model.
FAMILIES = tuple(_FAMILY_TOKENS)

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


def family_tokens(family: str) -> dict[str, Any]:
    """The special-token layout of ``family`` (``core``, ``roles``, ``extra``); ``ValueError`` if unknown."""
    return family_entry(_FAMILY_TOKENS, family, "vlm_pack.offline tokenizer")


def build_tokenizer(
    family: str = "qwen2_vl", vocab_size: int = 1024, chat_template: str | None = None
) -> Any:
    """A locally trained fast tokenizer with ``family``'s special tokens (no download).

    The returned ``PreTrainedTokenizerFast`` carries the released tokenizer's named tokens as attributes with
    their ids (``image_token`` / ``image_token_id``; Qwen's ``vision_start_token``; InternVL's
    ``context_image_token``; Gemma 3's ``boi_token`` ...), its bos / eos / pad tokens, and ``chat_template``
    when given. The 15 shared special tokens and the BPE merges are the same for every family (ids 0..1023);
    a family's own tokens are appended after them.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    layout = family_tokens(family)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)))
    tok.add_special_tokens({"additional_special_tokens": [*_SPECIAL_TOKENS, *layout["extra"]]})
    tok.add_special_tokens(dict(layout["core"]))
    tok.add_tokens(list(layout.get("plain", ())))
    # The named tokens as transformers' model-specific special tokens (``tok.boi_token`` / ``tok.boi_token_id``
    # ...), written to tokenizer_config.json, so a saved stand-in loads back with them as a released one does.
    # Set after the tokens are added: the ids stay those of the list above.
    set_named_special_tokens(tok, dict(layout["roles"]))
    tok.vlm_pack_family = family
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
