"""Render one conversation to prompt text and find the characters a model trains on.

The checkpoint's own chat template (the processor's, else the tokenizer's ``chat_template``) is rendered with
transformers' Jinja renderer, never re-implemented. vlm-pack's own formats (:class:`ChatFormat`) serve only
tokenizers without a template (the offline stand-ins) or an explicit ``template=``.

Trained characters follow the trainers' convention (TRL assistant-only loss, LLaMA-Factory, ms-swift): each
assistant message's content and the end-of-turn token right after it; the formatting after that and
everything outside assistant turns are not trained. For any template the spans are found by rendering
``messages[:i]`` against ``messages[:i+1]``: the turn's header and trailer come from a rendering with the
message's text swapped for sentinels (or from ``{% generation %}`` blocks where the template has them)::

    render(messages[:i])    <|im_start|>system ... <|im_start|>user\\n<|vision_start|><|image_pad|>... <|im_end|>\\n
    render(messages[:i+1])  ... same ...           <|im_start|>assistant\\n A red square. <|im_end|> \\n
                                                   header (-100)           content         end of turn  trailer (-100)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..failures import SampleError
from ..families import DEFAULT_FAMILY, require
from .conversation import (
    IMAGE_MARKER,
    VIDEO_MARKER,
    Conversation,
    _normalise,
    _normalised,
    _parts,
    normalise_conversation,
)

__all__ = [
    "IMAGE_MARKER",
    "VIDEO_MARKER",
    "ChatFormat",
    "Rendering",
    "chat_format",
    "normalise_conversation",
    "render_conversation",
]

Segment = tuple[str, bool]  # (text, trained on)
Template = Callable[[Conversation, int], list[Segment]]
_SENTINEL = "\ue000{}\ue001"  # private-use characters: no template or text contains them


@dataclass(frozen=True)
class Rendering:
    """A rendered prompt: ``text`` with one ``placeholder`` per image and the trained character ``spans``.

    ``add_special_tokens`` is what the tokenizer call must use: ``False`` when the text already starts with
    the BOS token (transformers' own rule in ``apply_chat_template``) or the format writes its own.
    ``video_placeholder``: the token written once per video (``""`` when the sample has none).
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    placeholder: str
    add_special_tokens: bool
    video_placeholder: str = ""


@dataclass(frozen=True)
class ChatFormat:
    """vlm-pack's own rendering of one family: turn prefix/suffix and the text an image becomes."""

    name: str
    turn_start: str  # formatted with role=
    turn_end: str
    image: str  # contains IMAGE_MARKER once
    assistant_end: str = ""  # trained: the model learns to end its turn
    assistant_sep: str = ""  # formatting after the assistant's end token, not trained
    bos: str = ""
    eos_on_caption: str = ""
    video: str = ""  # contains VIDEO_MARKER once; "" where the format has no video

    def render(self, conversation: Conversation, num_images: int, num_videos: int = 0) -> list[Segment]:
        """Render to (text, trained) segments; images (then videos) missing from the text go first in the
        first turn."""
        if num_videos and not self.video:
            raise ValueError(f"vlm-pack's {self.name!r} chat format has no video: give a chat template")
        if isinstance(conversation, str):
            text = conversation.replace(IMAGE_MARKER, self.image).replace(VIDEO_MARKER, self.video)
            missing = num_images if IMAGE_MARKER not in conversation else 0
            missing_videos = num_videos if VIDEO_MARKER not in conversation else 0
            prefix = self.bos + self.image * missing + self.video * missing_videos
            return [(prefix, False), (text + self.eos_on_caption, True)]
        conversation = normalise_conversation(conversation)
        segments: list[Segment] = [(self.bos, False)] if self.bos else []
        parts = [_parts(turn.get("content")) for turn in conversation]
        kinds = [p["type"] for turn_parts in parts for p in turn_parts]
        pending = (self.image * num_images if "image" not in kinds else "") + (
            self.video * num_videos if "video" not in kinds else ""
        )
        shown = {"image": self.image, "video": self.video}
        for turn, turn_parts in zip(conversation, parts):
            role = turn["role"]
            body = "".join(shown[p["type"]] if p["type"] in shown else p["text"] for p in turn_parts)
            if pending and role == "user":
                body, pending = pending + body, ""
            segments.append((self.turn_start.format(role=role, ROLE=role.upper()), False))
            if role == "assistant":
                segments += [(body + self.assistant_end, True), (self.assistant_sep, False)]
            else:
                segments.append((body + self.turn_end, False))
        if pending:
            segments.insert(0, (pending, False))
        return segments


_QWEN_FORMAT = ChatFormat(
    name="qwen",
    turn_start="<|im_start|>{role}\n",
    turn_end="<|im_end|>\n",
    image="<|vision_start|>" + IMAGE_MARKER + "<|vision_end|>",
    video="<|vision_start|>" + VIDEO_MARKER + "<|vision_end|>",
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
# By format name: which family renders with which is its registry record's ``chat_format``.
_FORMATS = {f.name: f for f in (_QWEN_FORMAT, _LLAVA_FORMAT)}


def chat_format(family: str | None) -> ChatFormat:
    """vlm-pack's own format of ``family`` in any spelling (``"Qwen2-VL"``; None: ``DEFAULT_FAMILY``'s):
    the format its ``vlm_pack.families`` record names (Qwen2/2.5/3-VL, LLaVA-1.5, LLaVA-NeXT)."""
    record = require(
        family or DEFAULT_FAMILY,
        "chat_format",
        "chat format",
        "Give a tokenizer or processor with a chat_template, or pass "
        "template=callable(conversation, num_images) -> [(text, trained), ...].",
    )
    return _FORMATS[str(record.chat_format)]


# ------------------------------------------------------------------------------------------------------
# Jinja chat templates (rendered by transformers)
# ------------------------------------------------------------------------------------------------------


def _render(
    template: str, messages: list[dict[str, Any]], env: dict[str, Any], generation: bool = False
) -> Any:
    from transformers.utils import chat_template_utils as hf

    if not generation and all(_PLAIN_KEYS.issuperset(m) for m in messages):
        # What render_jinja_template renders for such messages (role/content only, JSON-plain, as
        # _as_strings makes them) on every transformers 5.x: the compiled template, called with no copy of
        # the messages (its sandbox is immutable). A forecast renders every row: the copy was a quarter.
        from .._compat import compiled_chat_template

        compiled = compiled_chat_template(template)
        return compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=False, **env)
    texts, indices = hf.render_jinja_template(
        conversations=[messages], chat_template=template, return_assistant_tokens_mask=generation, **env
    )
    return (texts[0], [tuple(s) for s in indices[0]]) if generation else texts[0]


_PLAIN_KEYS = frozenset(("role", "content"))


@functools.lru_cache(maxsize=64)
def _string_roles(template: str, env_items: tuple[tuple[str, Any], ...]) -> frozenset[str]:
    """Roles whose content ``template`` renders only as a string (text templates; some assistant branches).

    Probed once per template: a role takes parts when its sentinel text appears and no part dict is printed.
    """
    env = dict(env_items)
    probe = [
        {"role": r, "content": [{"type": "text", "text": _SENTINEL.format(k)}]} for k, r in enumerate(_ROLES)
    ]
    for start in (0, 1):  # with, then without a system turn (some templates refuse one)
        try:
            text = _render(template, probe[start:], env)
        except Exception:  # a template that cannot take parts may raise anything
            continue
        sentinels = [_SENTINEL.format(k) for k in range(len(_ROLES))]
        lost = [k >= start and (x not in text or f"'text': '{x}'" in text) for k, x in enumerate(sentinels)]
        return frozenset(role for role, bad in zip(_ROLES, lost) if bad)
    return frozenset(_ROLES)


_ROLES = ("system", "user", "assistant")


def _as_strings(
    messages: list[dict[str, Any]], placeholder: str, roles: frozenset[str], video: str = ""
) -> list[dict[str, Any]]:
    """For string-only roles: parts joined, images (videos) as their placeholder token."""
    shown = {"image": placeholder, "video": video}
    join = lambda parts: "".join(shown[p["type"]] if p["type"] in shown else p["text"] for p in parts)  # noqa: E731
    return [{**m, "content": join(m["content"])} if m.get("role") in roles else m for m in messages]


def _env(tokenizer: Any) -> dict[str, Any]:
    env = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
    return {k: v for k, v in env.items() if isinstance(v, str)}


def _specials(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens, longest first (candidates for an end-of-turn token)."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found.update(t.content for t in decoder.values() if getattr(t, "special", False))
    return tuple(sorted((t for t in found if t), key=len, reverse=True))


def _texts(message: dict[str, Any]) -> list[str]:
    """The message's text parts, stripped (templates may trim), empty ones dropped."""
    return [p["text"].strip() for p in message["content"] if p["type"] == "text" and p["text"].strip()]


def _find_in_order(text: str, needles: list[str], start: int, end: int) -> tuple[int, int] | None:
    """``(first start, last end)`` of ``needles`` found one after another in ``text[start:end]``."""
    at, first = start, None
    for needle in needles:
        pos = text.find(needle, at, end)
        if pos < 0:
            return None
        first = pos if first is None else first
        at = pos + len(needle)
    return (first, at) if first is not None else (end, end)


def _check_nothing_lost(text: str, messages: list[dict[str, Any]], key: Any) -> None:
    at = 0
    for i, message in enumerate(messages):
        found = _find_in_order(text, _texts(message), at, len(text))
        if found is None:
            raise ValueError(
                f"sample {key!r}: the chat template drops text of message {i} ({message.get('role')!r}); "
                "its text would be lost. Merge the message's text parts into one, or fix the template."
            )
        at = found[1] if _texts(message) else at


class _Turns:
    """Renderings of conversation prefixes, each computed once.

    ``messages`` hold part lists (where texts are looked up); ``inputs`` are what the template gets (the same,
    or plain strings for text-only templates).
    """

    def __init__(self, template: str, messages: list, inputs: list, env: dict[str, Any], key: Any):
        self.template, self.messages, self.inputs, self.env, self.key = template, messages, inputs, env, key
        self.generation = _has_generation(template)
        self.cache: dict[int, str] = {0: ""}

    def prefix(self, n: int) -> str:
        if n not in self.cache:
            self.cache[n] = _render(self.template, self.inputs[:n], self.env)
        return self.cache[n]

    def _marked(self, i: int) -> tuple[dict[str, Any], int]:
        """Message ``i`` with each text part replaced by a sentinel; the number of sentinels."""
        message = self.inputs[i]
        if isinstance(message["content"], str):
            return {**message, "content": _SENTINEL.format(0)}, 1
        marked, k = [], 0
        for part in message["content"]:
            if part["type"] == "text":
                part, k = {"type": "text", "text": _SENTINEL.format(k)}, k + 1
            marked.append(part)
        if k == 0:
            marked, k = [*marked, {"type": "text", "text": _SENTINEL.format(0)}], 1
        return {**message, "content": marked}, k

    def content_region(self, i: int, before: str, turn: str) -> tuple[int, int]:
        """Where message ``i``'s rendered content lies in ``turn`` (= render(messages[:i+1]))."""
        if self.generation:
            _, spans = _render(self.template, self.inputs[: i + 1], self.env, generation=True)
            mine = [s for s in spans if s[0] >= len(before)]
            if mine:
                return min(s[0] for s in mine), max(s[1] for s in mine)
        marked, k = self._marked(i)
        probe = _render(self.template, [*self.inputs[:i], marked], self.env)
        found = [(probe.find(_SENTINEL.format(j)), len(_SENTINEL.format(j))) for j in range(k)]
        found = [(pos, n) for pos, n in found if pos >= 0]
        if not probe.startswith(before) or not found:
            raise self.rewrites(i)
        first, last = found[0][0], max(pos + n for pos, n in found)
        header, trailer = probe[len(before) : first], probe[last:]
        if not turn.startswith(before + header) or not turn.endswith(trailer):
            raise self.rewrites(i)
        return len(before) + len(header), len(turn) - len(trailer)

    def rewrites(self, i: int) -> ValueError:
        return ValueError(
            f"sample {self.key!r}: the chat template renders the turns before message {i} differently once "
            "later turns are added (render(messages[:i]) is not a prefix of render(messages[:i+1])), so the "
            "assistant spans cannot be located. Pass template= (a chat template that renders earlier turns "
            "unchanged) or fix the template."
        )


def _has_generation(template: str) -> bool:
    import re

    return re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None


def _spans_in_full(turns: _Turns, full: str, specials: tuple[str, ...]) -> list[tuple[int, int]]:
    """Assistant spans of a template that renders earlier turns differently once later ones follow (Qwen3 /
    Qwen3.5 write ``<think>...</think>`` only in the turns after the last user query): the whole conversation
    rendered once with every assistant text part a numbered sentinel, which must give ``full`` back when each
    sentinel is replaced by its text (the template copies the texts verbatim), else the rewrite error."""
    inputs, texts = list(turns.inputs), []
    owner: list[int] = []
    for i, message in enumerate(inputs):
        if message.get("role") != "assistant":
            continue
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        marked = []
        for part in parts:
            if part.get("type") == "text":
                texts.append(part["text"])
                owner.append(i)
                part = {"type": "text", "text": _SENTINEL.format(len(texts) - 1)}
            marked.append(part)
        inputs[i] = {**message, "content": marked[0]["text"] if isinstance(content, str) else marked}
    probe = _render(turns.template, inputs, turns.env)
    rebuilt, at, bounds = [], 0, []
    for j, text in enumerate(texts):
        pos = probe.find(_SENTINEL.format(j), at)
        if pos < 0:
            raise turns.rewrites(owner[j])
        rebuilt.append(probe[at:pos])
        start = sum(map(len, rebuilt))
        rebuilt.append(text)
        bounds.append((start, start + len(text)))
        at = pos + len(_SENTINEL.format(j))
    if "".join(rebuilt) + probe[at:] != full:
        raise turns.rewrites(owner[0] if owner else 0)
    spans: dict[int, tuple[int, int]] = {}
    for i, (lo, hi) in zip(owner, bounds):
        spans[i] = (spans[i][0], hi) if i in spans else (lo, hi)
    out = []
    for start, end in spans.values():
        eot = next((s for s in specials if full.startswith(s, end)), "")
        out.append((start, end + len(eot)))
    return out


def _assistant_spans(turns: _Turns, full: str, specials: tuple[str, ...]) -> list[tuple[int, int]]:
    spans = []
    for i, message in enumerate(turns.messages):
        if message.get("role") != "assistant":
            continue
        before, turn = turns.prefix(i), turns.prefix(i + 1)
        if not turn.startswith(before) or not full.startswith(turn):
            return _spans_in_full(turns, full, specials)
        lo, hi = turns.content_region(i, before, turn)
        found = _find_in_order(turn, _texts(message), lo, hi)
        if found is None:
            raise ValueError(
                f"sample {turns.key!r}: the chat template drops or rewrites the text of assistant message {i}; "
                "its text would be lost. Merge the message's text parts into one, or fix the template."
            )
        start, end = found if _texts(message) else (hi, hi)
        eot = next((s for s in specials if turn.startswith(s, end)), "")
        spans.append((start, end + len(eot)))
    return spans


def _render_template(
    template: str,
    messages: list[dict[str, Any]],
    tokenizer: Any,
    placeholder: str,
    key: Any,
    spans: bool,
    video: str = "",
) -> Rendering:
    env = _env(tokenizer)
    inputs = _as_strings(messages, placeholder, _string_roles(template, tuple(sorted(env.items()))), video)
    try:
        turns = _Turns(template, messages, inputs, env, key)
        full = turns.prefix(len(messages))
        _check_nothing_lost(full, messages, key)
        found = _assistant_spans(turns, full, _specials(tokenizer)) if spans else []
    except ValueError:
        raise
    except Exception as e:
        # raise_exception() in a template refuses this sample: bad data. Any other error (a syntax error,
        # a Python error inside the template) propagates: an error of code (vlm_pack.failures).
        from jinja2 import TemplateError, TemplateSyntaxError

        if not isinstance(e, TemplateError) or isinstance(e, TemplateSyntaxError):
            raise
        raise SampleError("bad_text", f"sample {key!r}: the chat template refused it: {e}") from e
    bos = getattr(tokenizer, "bos_token", None)
    return Rendering(full, tuple(found), placeholder, not (bos and full.startswith(bos)), video)


# ------------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------------


def _checkpoint_template(tokenizer: Any, processor: Any) -> str | None:
    for owner in (processor, tokenizer):
        template = getattr(owner, "chat_template", None) if owner is not None else None
        if isinstance(template, dict):
            template = template.get("default")
        if template:
            return template
    return None


def render_conversation(
    conversation: Conversation,
    *,
    tokenizer: Any,
    placeholder: str,
    num_images: int,
    processor: Any = None,
    family: str | None = None,
    template: str | ChatFormat | Template | None = None,
    key: Any = None,
    spans: bool = True,
    num_videos: int = 0,
    video_placeholder: str | None = None,
) -> Rendering:
    """Render ``conversation`` with ``num_images`` images: the prompt text and its trained character spans.

    ``template``: a Jinja chat template string, a :class:`ChatFormat`, or a callable returning
    ``[(text, trained), ...]`` with ``<image>`` where images go. Without it: the processor's, else the
    tokenizer's ``chat_template``, else the own format of ``family``. Raises ``ValueError`` naming ``key`` when
    the text holds a different number of images, contains ``placeholder`` itself, when the template drops
    text, or rewrites earlier turns so that assistant spans cannot be located. ``spans=False`` skips locating
    the trained spans (a forecast needs only the text). ``num_videos`` videos (``{"type": "video"}`` parts or
    ``<video>`` markers) become ``video_placeholder`` each, checked the same way.
    """
    conversation = _normalised(conversation, key)  # every documented format, LLaVA turns included
    video = video_placeholder or ""
    if num_videos and not video:
        raise ValueError(f"sample {key!r} has {num_videos} video(s): render_conversation needs video_placeholder=")
    if isinstance(template, str) or (template is None and _checkpoint_template(tokenizer, processor)):
        jinja = template if isinstance(template, str) else _checkpoint_template(tokenizer, processor)
        messages = _normalise(conversation, num_images, key, num_videos)
        parts = sum(p["type"] == "video" for m in messages for p in m["content"])
        _check_count(parts, num_videos, "video", VIDEO_MARKER, key)  # a template may write its own token
        texts = [p.get("text", "") for m in messages for p in m["content"]]
        for token in (placeholder, video) if video else (placeholder,):
            _check_placeholder_free(texts, token, key)
        rendering = _render_template(jinja, messages, tokenizer, placeholder, key, spans, video)  # type: ignore[arg-type]
        _check_count(rendering.text.count(placeholder), num_images, "image", placeholder, key)
        if video:
            _check_count(rendering.text.count(video), num_videos, "video", video, key)
        return rendering
    if template is None:
        segments = chat_format(family).render(conversation, num_images, num_videos)
    elif isinstance(template, ChatFormat):
        segments = template.render(conversation, num_images, num_videos)
    elif num_videos:
        raise ValueError(f"sample {key!r} has videos: a template callable takes images only; give a chat template")
    else:
        segments = template(conversation, num_images)
    for marker, n, kind in ((IMAGE_MARKER, num_images, "image"), (VIDEO_MARKER, num_videos, "video")):
        _check_count(sum(text.count(marker) for text, _ in segments), n, kind, marker, key)
    for token, marker in ((placeholder, IMAGE_MARKER), (video, VIDEO_MARKER)):
        if token and token != marker:
            _check_placeholder_free([text for text, _ in segments], token, key)
    texts = [text.replace(IMAGE_MARKER, placeholder) for text, _ in segments]
    if video:
        texts = [text.replace(VIDEO_MARKER, video) for text in texts]
    spans, at = [], 0
    for text, (_, trained) in zip(texts, segments):
        if trained and text:
            spans.append((at, at + len(text)))
        at += len(text)
    return Rendering("".join(texts), tuple(spans), placeholder, False, video)


def _check_count(found: int, wanted: int, kind: str, token: str, key: Any) -> None:
    """A ``placeholder_mismatch`` naming the sample unless the rendering holds one ``token`` per ``kind``."""
    if found != wanted:
        raise SampleError(
            "placeholder_mismatch",
            f"sample {key!r}: the rendered prompt holds {found} {kind} placeholder(s) but {wanted} {kind}(s) were "
            f"given ({token!r}); give one {kind} part (or {kind} marker) per {kind}, or none to put them first (the "
            f"template may drop {kind}s in some roles).",
        )


def _check_placeholder_free(texts: list[str], placeholder: str, key: Any) -> None:
    if any(placeholder in text for text in texts):
        raise ValueError(
            f"sample {key!r}: the text contains the vision token {placeholder!r} itself; write "
            f"{IMAGE_MARKER!r} / {VIDEO_MARKER!r} (or an image / video part) where an image / video goes, or "
            "remove the token from the text."
        )
