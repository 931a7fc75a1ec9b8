"""Certify a model type: each sample's log-probs in one packed row against the same sample alone.

``certify_model_type("paddleocr_vl")`` builds the type's tiny genuine model and real processor offline
(``vlm_pack.offline.tiny_model_for_type`` / ``processor_for_type``), processes three samples through the
processor's own ``__call__`` on Pillow images (two images, one image, text only), packs them into one row with
:class:`~vlm_pack.PackingCollator` (the route of ``vlm_pack.model_types`` for a type without a record) and
compares, per sample, the next-token log-probs of the packed forward with those of the sample run alone (the
processor's output as it is, the model computing its own positions)::

    alone    model(**processor(sample_i))                          -> logp_i           i = 0, 1, 2
    packed   model(**collator([s0, s1, s2]).model_inputs(style))   -> logp, sliced per sample
    error    token_mult_prob_error(logp_i, packed slice)           1.0 = exact

once per attention (``sdpa``, ``eager``). The :class:`Certificate` says exact, or why not (the measured error,
an unknown token mixer, what could not be built). Nothing is isolated by hand: a model whose text layers mix
tokens without attention is called as a user's loop calls it, and vlm-pack's packed-call guard must isolate its
mixers at the first packed call, from the rows' restarting positions (a type without a record has no marker).

``videos=True`` (torchvision and PyAV) adds a video sample at the head of the row: a clip encoded with PyAV,
forecast from its header and processed the way a user's pipeline does (``Preprocessor``: the processor's own
video step forecasts it, only the frames the forecast counted are decoded), checked against the processor on
the sample alone (its own frame sampling of the whole decoded clip): the forecast must equal the processed
length and the ids the processor's. That sample alone through the model is the video's oracle::

    video    Preprocessor(processor).process([], conversation, videos=[clip])      (packed)
             processor(text=prompt, videos=[every frame], video_metadata=...)       (alone)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .metric import next_token_logprobs, token_mult_prob_error

__all__ = ["Certificate", "certify_model_type", "type_samples", "video_sample"]

#: Three samples: images per sample and the text after them.
_SAMPLES = (
    (((96, 64), (64, 96)), "Compare the two pictures. The first is wide, the second is tall."),
    (((80, 80),), "What is in the picture? A small square of colour."),
    ((), "Write a haiku about training loss: it falls like the rain."),
)
TOLERANCE = 1.0001
#: The video sample: frames, width, height, fps of its clip, the question and the answer.
_CLIP = (6, 64, 48, 3.0)
_VIDEO_TURNS = ("What moves in the clip?", "A bright square drifts to the right.")
# A chat template of the shape the sample's prompt is written in (``_video_prompt``): placeholders for IMAGE and
# VIDEO, filled per processor.
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}IMAGE{% elif c.type == 'video' %}VIDEO"
    "{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


@dataclass
class Certificate:
    """What certifying one model type found. ``errors``: token_mult_prob_error per attention (1.0 exact);
    ``reason``: why it is not certified (None when it is); ``positions``: ``"1-D"`` or the rope rows."""

    model_type: str
    positions: str = ""
    mixers: list[str] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    video: str = ""
    """With ``videos=True``: the video sample's forecast against what processing made of it."""
    reason: str | None = None
    built: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return (
            self.reason is None
            and bool(self.errors)
            and all(math.isfinite(e) and e <= TOLERANCE for e in self.errors.values())
        )

    def __str__(self) -> str:
        errors = ", ".join(f"{k} {v:.7f}" for k, v in self.errors.items()) or "none measured"
        verdict = "EXACT" if self.exact else "NOT EXACT"
        lines = [f"{self.model_type}: {verdict}: token_mult_prob_error {errors}"]
        lines.append(f"  positions: {self.positions or 'n/a'}; token mixers: {', '.join(self.mixers) or 'none'}")
        if self.video:
            lines.append(f"  video: {self.video}")
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _picture(width: int, height: int, seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def type_samples(processor: Any, placeholder: str | None = None) -> list[dict[str, torch.Tensor]]:
    """The three samples of :data:`_SAMPLES` through ``processor.__call__`` (one example each, ``[1, L]``);
    ``placeholder``: what the text holds per image (default the processor's ``image_token``)."""
    placeholder = placeholder or getattr(processor, "image_token", None)
    if not placeholder:
        raise ValueError(f"{type(processor).__name__} names no image_token to place images in the text")
    out = []
    for k, (sizes, text) in enumerate(_SAMPLES):
        images = [_picture(w, h, seed=10 * k + j) for j, (w, h) in enumerate(sizes)]
        # text between the images, as chat templates have it (two adjacent images would read as one run)
        prompt = "".join(f"Picture {j + 1}: {placeholder}\n" for j in range(len(images))) + text
        kwargs: dict[str, Any] = dict(text=[prompt], return_tensors="pt")
        if images:
            kwargs["images"] = [images]
        try:
            try:
                processed = processor(**kwargs)
            except ValueError:
                if not images:
                    raise
                processed = processor(**dict(kwargs, images=images))  # processors that take no nesting (GOT-OCR2)
            out.append(_fp32(processed))  # fp32 throughout (some image processors return bf16 pixels, Llama 4's)
        except Exception:
            if images:
                raise
            # some processors take no text-only sample (PaliGemma): two samples with images remain
    return out


def _fp32(processed: Any) -> dict[str, Any]:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in processed.items()}


def video_sample(processor: Any, placeholder: str | None = None) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``(packed, alone, how)``: the video sample as vlm-pack processes it (its forecast checked against its
    processed length) and as the processor makes it of the whole decoded clip, sampling frames itself (the
    ids checked equal). ``processor`` gets a chat template of :data:`_TEMPLATE`'s shape. A ValueError says what
    differs; vlm-pack's refusals (``InternalCheckError``) raise as they are."""
    from ..preprocessor import Preprocessor
    from ..processing.videos import decode_frames
    from ..vision.video import read_video_header
    from .clips import encode_clip

    if getattr(processor, "video_processor", None) is None:
        raise ValueError(f"{type(processor).__name__} was built without its video processor (torchvision?)")
    image = placeholder or str(processor.image_token)
    processor.chat_template = _TEMPLATE.replace("IMAGE", image).replace("VIDEO", processor.video_token)
    frames, width, height, fps = _CLIP
    clip = encode_clip(frames=frames, width=width, height=height, fps=fps, seed=7)
    header = read_video_header(clip)
    question, answer = _VIDEO_TURNS
    conversation = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    pre = Preprocessor(processor=processor)
    forecast, _ = pre.forecast(conversation, [], videos=[header])
    packed = pre.process([], conversation, videos=[clip])
    length = int(packed["input_ids"].shape[-1])
    if forecast != length:
        raise ValueError(f"video sample: forecast {forecast} != processed length {length}")
    prompt = f"<|im_start|>user\n{processor.video_token}{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
    metadata = header.metadata()
    metadata.frames_indices = list(range(header.frames))  # as transformers' own loaders set it
    alone = processor(text=[prompt], videos=[decode_frames(clip, range(header.frames))], video_metadata=[metadata],
                      return_tensors="pt")  # fmt: skip
    if alone["input_ids"][0].tolist() != packed["input_ids"].tolist():
        raise ValueError(f"video sample: vlm-pack's ids ({length}) differ from the processor's own on the sample alone "
                         f"({alone['input_ids'].shape[-1]})")  # fmt: skip
    how = (f"forecast {forecast} = processed {length} (video tokens {int(packed['tokens_per_video'].sum())}), ids = "
           "the processor's own on the sample alone")  # fmt: skip
    return packed, _fp32(alone), how


def _alone_logprobs(model: Any, sample: dict[str, Any]) -> torch.Tensor:
    """``[L - 1]`` next-token log-probs of ``sample`` run alone, as the processor gave it."""
    logits = model(**sample, use_cache=False).logits
    return next_token_logprobs(logits, sample["input_ids"])[0, :-1]


def _packed_logprobs(model: Any, batch: Any, style: str) -> torch.Tensor:
    logits = model(**batch.model_inputs(style)).logits
    return next_token_logprobs(logits.reshape(*batch.input_ids.shape, -1), batch.input_ids).reshape(-1)


def _compare(alone: list[torch.Tensor], packed: torch.Tensor, batch: Any) -> tuple[float, float]:
    starts = batch.cu_seqlens_padded[:-1].tolist()
    lengths = batch.seq_lens.tolist()
    a, b = [], []
    for i, start, length in zip(batch.sample_index.tolist(), starts, lengths):
        a.append(alone[i])
        b.append(packed[start : start + length - 1])
    a_all, b_all = torch.cat(a), torch.cat(b)
    return float(token_mult_prob_error(a_all, b_all)), float((a_all - b_all).abs().max())


def _mixers(model: Any) -> tuple[list[str], str | None]:
    """The model's token mixers (``"conv (short_conv)"``) and why it cannot be certified (an unknown one), else
    None. Left as they are: the packed-call guard isolates them at the first packed call."""
    from ..forward.mixers import find_token_mixers

    found = find_token_mixers(model)
    names = [f"{m.name.rsplit('.', 1)[-1]} ({m.kind})" for m in found]
    unknown = [m for m in found if m.kind == "unknown"]
    if unknown:
        return names, f"a token mixer vlm-pack cannot isolate: {unknown[0].how}"
    return names, None


def _still_leaking(model: Any) -> str | None:
    from ..forward.mixers import find_token_mixers

    left = [m.name for m in find_token_mixers(model) if m.isolation == "none"]
    return f"the packed call left token mixers un-isolated: {', '.join(left)}" if left else None


def _build(cert: Certificate, styles: tuple[str, ...], seed: int) -> tuple[Any, Any, tuple[str, ...]] | None:
    """``(processor, tiny model, the attentions it has)`` of ``cert``'s type, or None with ``cert.reason`` set."""
    from ..offline.model_types import NotBuildable, processor_for_type, tiny_model_for_type

    try:
        processor = processor_for_type(cert.model_type)
        try:
            model = tiny_model_for_type(cert.model_type, processor, seed=seed, attn_implementation=styles[0])
        except ValueError as e:
            if "does not support an attention implementation" not in str(e) or len(styles) < 2:
                raise
            cert.notes.append(f"{styles[0]}: the model has no such attention")
            styles = styles[1:]
            model = tiny_model_for_type(cert.model_type, processor, seed=seed, attn_implementation=styles[0])
    except NotBuildable as e:
        cert.reason = str(e)
        return None
    except Exception as e:  # the type's own code refused the shrunk config
        cert.reason = f"the tiny model does not build: {type(e).__name__}: {_short(e)}"
        return None
    cert.built = True
    return processor, model, styles


@torch.no_grad()
def certify_model_type(
    model_type: str,
    *,
    styles: tuple[str, ...] = ("sdpa", "eager"),
    seed: int = 0,
    restart_positions: bool = True,
    videos: bool = False,
) -> Certificate:
    """Build, process, pack and compare as the module docstring draws; never raises for the model type's sake:
    what fails is the certificate's ``reason``. ``restart_positions=False`` is the negative control: the text
    row numbered across the whole row, so that transformers finds one sequence (the check must then fail).
    ``videos=True``: a video sample heads the row (:func:`video_sample`)."""
    from ..collate.collator import PackingCollator
    from ..model_types import RopeIndex, find_rope_index
    from ..offline.model_types import placeholder_for_type

    cert = Certificate(model_type)
    built = _build(cert, styles, seed)
    if built is None:
        return cert
    processor, model, styles = built
    cert.mixers, cert.reason = _mixers(model)
    if cert.reason:
        return cert
    owner = find_rope_index(model)
    rope_index = RopeIndex(owner) if owner is not None else None
    try:
        samples = type_samples(processor, placeholder_for_type(model_type, processor))
    except Exception as e:
        cert.reason = f"its processor does not process the samples: {type(e).__name__}: {_short(e)}"
        return cert
    references = list(samples)  # what each sample is alone
    if videos:
        try:
            packed, alone, cert.video = video_sample(processor, placeholder_for_type(model_type, processor))
        except Exception as e:
            cert.reason = f"videos: {type(e).__name__}: {_short(e, 400)}"
            return cert
        samples, references = [packed, *samples], [alone, *references]
    cert.tokens = sum(int(s["input_ids"].shape[-1]) for s in samples)
    if any("token_type_ids" in s and not bool(s["token_type_ids"].any()) for s in samples):
        cert.notes.append("token_type_ids all 0 in these samples (no suffix): two-way prefix attention not exercised")
    try:
        collator = PackingCollator(cert.tokens, model_config=model.config, tokenizer=processor, rope_index=rope_index)
        batch = collator(samples)
    except Exception as e:
        cert.reason = f"the collator refuses the samples: {type(e).__name__}: {_short(e)}"
        return cert
    if not restart_positions:
        whole = torch.arange(batch.input_ids.shape[-1]).expand(batch.input_ids.shape)
        if batch.position_ids.dim() == 3:
            batch.position_ids[0] = whole
        else:
            batch.position_ids = whole.clone()
    rows = batch.position_ids.shape[0] - 1 if batch.position_ids.dim() == 3 else 0
    cert.positions = f"model's rope index ({rows} rows) + text row" if rope_index is not None else "1-D, restarted"
    if not restart_positions:
        cert.positions += " (text row NOT restarted: negative control)"
    for style in styles:
        try:
            model.set_attn_implementation(style)
            alone = [_alone_logprobs(model, s) for s in references]
            packed = _packed_logprobs(model, batch, style)
            cert.errors[style], cert.max_abs_diff[style] = _compare(alone, packed, batch)
        except Exception as e:
            cert.reason = f"{style}: the forward fails: {type(e).__name__}: {_short(e)}"
            return cert
    if not cert.exact:
        worst = max(cert.errors.values())
        cert.reason = f"packed != alone: token_mult_prob_error {worst:.4f} with transformers' own packed handling"
    elif restart_positions:
        cert.reason = _still_leaking(model)
    return cert


def _short(error: BaseException, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
