"""Turn one conversation with images into the token ids a VLM trains on, and forecast that length.

A user calls these through :class:`vlm_pack.Preprocessor` (``process``, ``forecast``, ``tokenize``), which
holds the checkpoint's parts once; the functions here are what it calls. Two entry points share one rendering (:func:`vlm_pack.processing.chat.render_conversation`: the checkpoint's own chat
template, or vlm-pack's format for tokenizers without one), so the forecast is the processed length:

- ``forecast_length(conversation, image_sizes, ...)``: the expanded length from the text and the image
  *header* sizes only (no decode), for the packer;
- ``process_sample(images, conversation, ...)``: the real thing: with an HF ``processor`` its own expansion
  and tokenization of the rendered prompt (the ids are ``processor(text=prompt, images=...)["input_ids"]``),
  labels on the assistant spans, and the processor's vision tensors, ready for ``PackingCollator``.

Only assistant content and its end-of-turn token are trained::

    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
        {"role": "assistant", "content": "A red square."},
    ]

    Qwen2-VL's template, one image of grid (1, 4, 6) -> 6 vision tokens (merge 2):

    tokens  <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n   (the template's default system turn)
            <|im_start|> user \\n <|vision_start|> P P P P P P <|vision_end|> What is shown? <|im_end|> \\n
            <|im_start|> assistant \\n A red square. <|im_end|> \\n
    labels  -100 .............................................................................. -100
            -100 ..................... A red square. <|im_end|> -100

    layout="expanded":  P repeated once per vision embedding (as HF processors produce)
    layout="collapsed": P once per image (Megatron style); ``tokens_per_image`` says what it becomes

A plain string is a caption: the images are the prompt and the whole caption is trained on.

Rooms: ``render`` (placeholder, template, collapsed ids), ``markers`` (tokens a processor writes around an
image), ``length`` (the one forecast and the expanded length), ``images`` (loading), ``placement`` (the HF
processor path), ``layout`` (tokenizer + image processor, the collapsed layout), ``videos`` (decoding only the
frames a video's forecast keeps, PyAV), ``sample`` (process_sample, process_pack).

Videos (``{"type": "video"}`` parts or ``<video>`` markers; ``process_sample(..., videos=[bytes or path])``) go
through an HF ``processor`` with its video processor, expanded layout only, and forecast from their headers
(``forecast_rows`` rows ``(conversation, sizes, key, video headers)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .chat import IMAGE_MARKER, ChatFormat, chat_format
from .images import load_image
from .length import Forecast, expanded_length, forecast_length, forecast_rows
from .markers import _marker_extra_tokens as _marker_extra_tokens  # read by tests
from .render import Prompt, tokenize_conversation
from .render import _embedding_token_id as _embedding_token_id  # read by tests
from .render import _placeholder as _placeholder  # read by data.fingerprint

if TYPE_CHECKING:
    from .sample import process_pack, process_sample

__all__ = [
    "IMAGE_MARKER",
    "ChatFormat",
    "Forecast",
    "Prompt",
    "chat_format",
    "expanded_length",
    "forecast_length",
    "forecast_rows",
    "load_image",
    "process_pack",
    "process_sample",
    "tokenize_conversation",
]


def __getattr__(name: str) -> Any:
    # processing a sample needs torch, forecasting one does not: ``sample`` is imported on first use, so a
    # forecast-only process (a Ray forecast worker) never loads torch (PEP 562)
    if name in ("process_pack", "process_sample"):
        from . import sample

        return getattr(sample, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
