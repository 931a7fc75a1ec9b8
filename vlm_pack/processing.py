"""Turn one conversation with images into the token ids a VLM trains on, and forecast that length.

Two entry points share one tokenisation, so the forecast is the processed length by construction:

- ``forecast_length(conversation, image_sizes, ...)``: the expanded length from the text and the image
  *header* sizes only (no decode), for the packer;
- ``process_sample(images, conversation, ...)``: the real thing, with the real HF image processor: token ids,
  labels, ``pixel_values`` and the family's grid / size tensors, ready for ``PackingCollator``.

A conversation is rendered by the family's chat format into segments; ``<image>`` marks where an image goes.
Qwen wraps each image in ``<|vision_start|> ... <|vision_end|>``. Only assistant turns are trained on::

    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
        {"role": "assistant", "content": "A red square."},
    ]

    Qwen2-VL, one image of grid (1, 4, 6) -> 6 vision tokens (merge 2):

    tokens  <|im_start|> user \\n <|vision_start|> P P P P P P <|vision_end|> What is shown? <|im_end|> \\n
            <|im_start|> assistant \\n A red square. <|im_end|> \\n
    labels  -100 ...................................................................................... -100
            -100 ..................... A red square. <|im_end|> -100

    layout="expanded":  P repeated once per vision embedding (as HF processors produce)
    layout="collapsed": P once per image (Megatron style); ``tokens_per_image`` says what it becomes

A plain string is a caption: its images come first (or where ``<image>`` appears in it) and the whole
caption is trained on.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "IMAGE_MARKER",
    "ChatFormat",
    "chat_format",
    "forecast_length",
    "load_image",
    "process_sample",
    "render_prompt",
    "tokenize_conversation",
]

#: Where an image goes in a rendered conversation.
IMAGE_MARKER = "<image>"

Conversation = str | Sequence[dict[str, Any]]
Segment = tuple[str, bool]  # (text, trained on)


@dataclass(frozen=True)
class ChatFormat:
    """How one family renders a conversation: turn prefix/suffix and the text an image becomes."""

    name: str
    turn_start: str  # formatted with role=
    turn_end: str
    image: str  # contains IMAGE_MARKER once
    assistant_end: str = ""  # trained: the model learns to end its turn
    assistant_sep: str = ""  # formatting after the assistant's end token, not trained
    bos: str = ""
    eos_on_caption: str = ""

    def render(self, conversation: Conversation, num_images: int) -> list[Segment]:
        """Render to (text, trained) segments; images missing from the text go first in the first turn."""
        if isinstance(conversation, str):
            text = conversation.replace(IMAGE_MARKER, self.image)
            missing = num_images if IMAGE_MARKER not in conversation else 0
            prefix = self.bos + self.image * missing
            return [(prefix, False), (text + self.eos_on_caption, True)]
        if not isinstance(conversation, Sequence) or not conversation:
            raise ValueError("a conversation must be a caption string or a non-empty list of turns")
        segments: list[Segment] = [(self.bos, False)] if self.bos else []
        n_marked = sum(_count_images(turn) for turn in conversation)
        pending = num_images if n_marked == 0 else 0
        for turn in conversation:
            role = turn.get("role")
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"turn role must be system/user/assistant, got {role!r}")
            body = _content_text(turn.get("content"), self.image)
            if pending and role == "user":
                body, pending = self.image * pending + body, 0
            segments.append((self.turn_start.format(role=role, ROLE=role.upper()), False))
            if role == "assistant":
                segments += [(body + self.assistant_end, True), (self.assistant_sep, False)]
            else:
                segments.append((body + self.turn_end, False))
        if pending:
            segments.insert(0, (self.image * pending, False))
        return segments


def _count_images(turn: dict[str, Any]) -> int:
    content = turn.get("content")
    if isinstance(content, str):
        return content.count(IMAGE_MARKER)
    return sum(1 for part in content or [] if part.get("type") == "image")


def _content_text(content: Any, image_text: str) -> str:
    if isinstance(content, str):
        return content.replace(IMAGE_MARKER, image_text)
    if content is None:
        raise ValueError("a turn has no 'content'")
    out = []
    for part in content:
        kind = part.get("type")
        if kind == "image":
            out.append(image_text)
        elif kind == "text":
            out.append(part.get("text", ""))
        else:
            raise ValueError(f"content part type must be 'image' or 'text', got {kind!r}")
    return "".join(out)


_QWEN_FORMAT = ChatFormat(
    name="qwen",
    turn_start="<|im_start|>{role}\n",
    turn_end="<|im_end|>\n",
    image="<|vision_start|>" + IMAGE_MARKER + "<|vision_end|>",
    assistant_end="<|im_end|>",
    assistant_sep="\n",
    eos_on_caption="<|im_end|>",
)
_LLAVA_FORMAT = ChatFormat(
    name="llava",
    turn_start="{ROLE}: ",
    turn_end=" ",
    image=IMAGE_MARKER + "\n",
    assistant_end="</s>",
    bos="<s>",
    eos_on_caption="</s>",
)
_FORMATS = {
    "qwen2_vl": _QWEN_FORMAT,
    "qwen2_5_vl": _QWEN_FORMAT,
    "qwen3_vl": _QWEN_FORMAT,
    "llava": _LLAVA_FORMAT,
    "llava_next": _LLAVA_FORMAT,
}


def chat_format(family: str) -> ChatFormat:
    """The chat format of ``family`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``llava``, ``llava_next``)."""
    try:
        return _FORMATS[family]
    except KeyError:
        raise ValueError(
            f"no chat format for family {family!r}; known: {', '.join(_FORMATS)}. "
            "Pass template=callable(conversation, num_images) -> [(text, trained), ...] for others."
        ) from None


# The image token each family's processor expands; a vocabulary may hold several (LLaVA-OneVision's Qwen2
# vocabulary has both), so the family decides, not the first token found.
_FAMILY_IMAGE_TOKEN = {
    "qwen2_vl": "<|image_pad|>",
    "qwen2_5_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "llava": IMAGE_MARKER,
    "llava_next": IMAGE_MARKER,
}


def _image_token(tokenizer: Any, family: str | None = None) -> tuple[str, int]:
    """``(token, id)`` of the image placeholder: ``tokenizer.image_token[_id]``, else the family's token."""
    token_id = getattr(tokenizer, "image_token_id", None)
    if token_id is not None:
        return str(tokenizer.convert_ids_to_tokens(int(token_id))), int(token_id)
    family = family or getattr(tokenizer, "vlm_pack_family", None)
    named = getattr(tokenizer, "image_token", None)
    if named:
        candidates = [named]
    elif family in _FAMILY_IMAGE_TOKEN:
        candidates = [_FAMILY_IMAGE_TOKEN[family]]
    else:
        candidates = ["<|image_pad|>", IMAGE_MARKER, "<IMG_CONTEXT>"]
    for token in candidates:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is not None and tid != tokenizer.unk_token_id:
            return token, int(tid)
    raise ValueError(
        f"the tokenizer has none of the image tokens {candidates}: set tokenizer.image_token and "
        "tokenizer.image_token_id (or add the token with tokenizer.add_special_tokens)."
    )


def _image_token_id(tokenizer: Any, family: str | None = None) -> int:
    return _image_token(tokenizer, family)[1]


def render_prompt(
    conversation: Conversation,
    *,
    tokenizer: Any,
    family: str | None = None,
    num_images: int = 0,
    template: Callable[[Conversation, int], list[Segment]] | None = None,
    key: Any = None,
) -> tuple[list[Segment], list[str]]:
    """The rendered segments of ``conversation`` and their texts with ``<image>`` replaced by the
    tokenizer's image token: ``"".join(texts)`` is the prompt :func:`tokenize_conversation` tokenizes
    (so a batch of prompts can be tokenized in one call with the same ids). Raises as it does."""
    if template is None:
        if family is None:
            family = getattr(tokenizer, "vlm_pack_family", None)
        segments = chat_format(family or "qwen2_vl").render(conversation, num_images)
    else:
        segments = template(conversation, num_images)
    image_token, _ = _image_token(tokenizer, family)
    n_markers = sum(text.count(IMAGE_MARKER) for text, _ in segments)
    if n_markers != num_images:
        raise ValueError(
            f"sample {key!r}: the text has {n_markers} image placeholder(s) but {num_images} image(s) were "
            "given; give one image per placeholder (or no placeholder at all to put the images first)."
        )
    if image_token != IMAGE_MARKER and any(image_token in text for text, _ in segments):
        raise ValueError(
            f"sample {key!r}: the text contains the image token {image_token!r} itself; write "
            f"{IMAGE_MARKER!r} where an image goes (or remove the token from the text)."
        )
    return segments, [text.replace(IMAGE_MARKER, image_token) for text, _ in segments]


def tokenize_conversation(
    conversation: Conversation,
    *,
    tokenizer: Any,
    family: str | None = None,
    num_images: int = 0,
    template: Callable[[Conversation, int], list[Segment]] | None = None,
    key: Any = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of ``conversation`` in the collapsed layout (one image token per image) and a trained mask.

    The conversation is rendered by ``template`` (a callable returning ``[(text, trained), ...]`` with
    ``<image>`` where images go), else by the chat format of ``family`` (default: the tokenizer's
    ``vlm_pack_family``, else ``qwen2_vl``); the tokenizer's own ``chat_template`` is not used. ``<image>``
    becomes the tokenizer's image token and the whole prompt is tokenized in one call, as an HF processor
    does, so tokens merge across turn boundaries exactly as there (``"ASSISTANT: the"`` -> ``" the"``).
    A token is trained when any of its characters is in a trained segment; image tokens never are.

    Raises ``ValueError`` naming ``key`` when the text has a different number of image places than
    ``num_images``, or contains the image token itself.
    """
    segments, texts = render_prompt(
        conversation, tokenizer=tokenizer, family=family, num_images=num_images, template=template, key=key
    )
    image_token, image_id = _image_token(tokenizer, family)
    full = "".join(texts)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # slow (Python) tokenizers have no offsets: tokenize segment by segment
        ids, mask = [], []
        for text, (_, trained) in zip(texts, segments):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            mask += [trained] * len(piece)
    else:
        ids = list(enc["input_ids"])
        char_trained = torch.zeros(len(full) + 1, dtype=torch.long)
        at = 0
        for text, (_, trained) in zip(texts, segments):
            char_trained[at + 1 : at + 1 + len(text)] = int(trained)
            at += len(text)
        cum = char_trained.cumsum(0)  # cum[e] - cum[s]: trained characters in [s, e)
        spans = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
        mask = ((cum[spans[:, 1]] - cum[spans[:, 0]]) > 0).tolist()
    mask = [m and i != image_id for i, m in zip(ids, mask)]
    if ids.count(image_id) != num_images:
        raise ValueError(
            f"sample {key!r}: {num_images} image(s) became {ids.count(image_id)} image token(s) "
            f"{image_token!r}; the tokenizer must keep {image_token!r} as one special token."
        )
    return ids, mask


def forecast_length(
    conversation: Conversation,
    image_sizes: Sequence[tuple[int, int]],
    *,
    tokenizer: Any,
    spec: Any,
    family: str | None = None,
    template: Callable[[Conversation, int], list[Segment]] | None = None,
    key: Any = None,
) -> tuple[int, list[int]]:
    """Expanded length of a sample and its per-image token counts, from image ``(width, height)`` only.

    ``spec`` is a vision spec (``vlm_pack.vision_spec(...)``); the result equals
    ``len(process_sample(...)["input_ids"])`` for the same conversation and images.
    """
    ids, _ = tokenize_conversation(
        conversation,
        tokenizer=tokenizer,
        family=family,
        num_images=len(image_sizes),
        template=template,
        key=key,
    )
    counts = [int(n) for n in spec.sample_tokens(list(image_sizes))] if image_sizes else []
    return len(ids) - len(counts) + sum(counts), counts


def load_image(source: Any) -> Any:
    """A PIL RGB image from a path, bytes or PIL image, with EXIF orientation applied (as HF ``load_image``)."""
    from PIL import Image, ImageOps

    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(source)))
        image = ImageOps.exif_transpose(image)
    elif isinstance(source, (str, os.PathLike)):
        image = Image.open(source)
        image = ImageOps.exif_transpose(image)
    else:
        raise TypeError(f"cannot load an image from {type(source).__name__}: give a path, bytes or PIL image")
    return image.convert("RGB")


def _llava_counts(image_processor: Any, tokenizer: Any, images: list[Any], processor: Any) -> list[int]:
    if processor is None:
        import transformers

        cls = (
            transformers.LlavaNextProcessor
            if hasattr(image_processor, "image_grid_pinpoints")
            else transformers.LlavaProcessor
        )
        # The llava-hf checkpoints' processor settings.
        processor = cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
    sizes = [(im.height, im.width) for im in images]
    return [int(n) for n in processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]]


def process_sample(
    images: Sequence[Any],
    conversation: Conversation,
    *,
    tokenizer: Any = None,
    image_processor: Any = None,
    processor: Any = None,
    family: str | None = None,
    layout: str = "expanded",
    template: Callable[[Conversation, int], list[Segment]] | None = None,
    key: Any = None,
) -> dict[str, torch.Tensor]:
    """One processed sample (1-D tensors) for ``PackingCollator``.

    Give either an HF ``processor`` (its tokenizer and image processor are used) or ``tokenizer`` +
    ``image_processor``. Returns ``input_ids`` (L,), ``labels`` (L,) with -100 outside assistant turns and on
    image tokens, ``tokens_per_image`` (n,) (embeddings each image becomes), ``pixel_values`` and, by
    family, ``image_grid_thw`` (n, 3) and ``mm_token_type_ids`` (L,) (Qwen) or ``image_sizes`` (n, 2)
    (LLaVA-NeXT). ``layout="collapsed"`` keeps one image token per image.
    """
    if processor is not None:
        tokenizer = tokenizer or processor.tokenizer
        image_processor = image_processor or processor.image_processor
    if tokenizer is None:
        raise ValueError("process_sample needs tokenizer= (or processor=)")
    if layout not in ("expanded", "collapsed"):
        raise ValueError(f"layout must be 'expanded' or 'collapsed', got {layout!r}")
    ids, mask = tokenize_conversation(
        conversation, tokenizer=tokenizer, family=family, num_images=len(images), template=template, key=key
    )
    out: dict[str, torch.Tensor] = {}
    counts: list[int] = []
    if images:
        if image_processor is None:
            raise ValueError(
                f"sample {key!r} has images: process_sample needs image_processor= (or processor=)"
            )
        pil = [load_image(im) for im in images]
        vision = image_processor(images=pil, return_tensors="pt")
        out["pixel_values"] = vision["pixel_values"]
        if "image_grid_thw" in vision:
            grid = vision["image_grid_thw"]
            merge = int(getattr(image_processor, "merge_size", 2))
            out["image_grid_thw"] = grid
            counts = (grid.prod(-1) // (merge * merge)).tolist()
        else:
            if "image_sizes" in vision:
                out["image_sizes"] = vision["image_sizes"]
            counts = _llava_counts(image_processor, tokenizer, pil, processor)
    image_id = _image_token_id(tokenizer, family)
    input_ids = torch.tensor(ids, dtype=torch.long)
    trained = torch.tensor(mask, dtype=torch.bool)
    if layout == "expanded" and counts:
        repeats = torch.ones_like(input_ids)
        repeats[input_ids == image_id] = torch.tensor(counts, dtype=torch.long)
        input_ids = input_ids.repeat_interleave(repeats)
        trained = trained.repeat_interleave(repeats)
    out["input_ids"] = input_ids
    out["labels"] = torch.where(trained, input_ids, torch.full_like(input_ids, -100))
    out["tokens_per_image"] = torch.tensor(counts, dtype=torch.long)
    if "image_grid_thw" in out or (family or getattr(tokenizer, "vlm_pack_family", "")).startswith("qwen"):
        out["mm_token_type_ids"] = (input_ids == image_id).long()
    return out
