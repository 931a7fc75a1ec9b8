"""Conversations in every documented format, normalised once: ``{"role", "content"}`` turns whose content is
a string or a list of parts ``{"type": "image" | "video" | "text"}``; ``<image>`` / ``<video>`` markers in text
stand for an image / a video where it appears (what :mod:`vlm_pack.processing.chat` renders)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..failures import SampleError

__all__ = ["IMAGE_MARKER", "VIDEO_MARKER", "Conversation", "Turns", "normalise_conversation"]

#: Where an image goes in a conversation's text (and in :class:`ChatFormat` renderings).
IMAGE_MARKER = "<image>"
#: Where a video goes in a conversation's text (and in :class:`ChatFormat` renderings).
VIDEO_MARKER = "<video>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")

Conversation = str | Sequence[dict[str, Any]]


# ------------------------------------------------------------------------------------------------------
# Conversations: every documented format becomes {"role", "content"} turns (one normaliser for every entry
# point); content parts: every message's content becomes [{"type": "image"} | {"type": "text", ...}, ...]
# ------------------------------------------------------------------------------------------------------

# Speakers of role/content turns and of LLaVA / ShareGPT from/value turns (any case) -> the role.
_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def normalise_conversation(conversation: Conversation) -> str | list[dict[str, Any]]:
    """Any documented conversation -> vlm-pack's turns ``{"role": "system" | "user" | "assistant", "content":
    str | [{"type": "image"} | {"type": "text", "text": str}, ...]}``; a caption string is returned as is.

    Accepted turns: ``{"role", "content"}`` (content a string with ``<image>`` markers or a list of parts; an
    ``image_url`` part is an image; part fields set to None, as Arrow stores them, are dropped) and LLaVA /
    ShareGPT ``{"from": "human" | "gpt" | "system", "value": str}``. Text is kept as written: ``"<image>\nQ"``
    stays ``"<image>\nQ"`` (its image part, then ``"\nQ"``). Other turn keys that are not None are kept
    (a template may read them). Every reader and every :class:`~vlm_pack.Preprocessor` method goes through
    this one function. Raises ``ValueError`` saying what is wrong and what is accepted.
    """
    if isinstance(conversation, str) or type(conversation) is Turns:
        return conversation
    if not isinstance(conversation, Sequence) or isinstance(conversation, bytes) or not conversation:
        raise ValueError("a conversation must be a caption string or a non-empty list of turns")
    return Turns(_turn(turn) for turn in conversation)


class Turns(list):  # type: list[dict[str, Any]]
    """Turns :func:`normalise_conversation` made. A reader normalises a record once and the renderers
    normalise what they are given again: for these that costs nothing (a forecast renders every row)."""

    __slots__ = ()


def _turn(turn: Any) -> dict[str, Any]:
    # ``type(x) is dict`` first: an ABC isinstance costs ~10x more, and a forecast checks every turn and part
    if type(turn) is not dict and not isinstance(turn, Mapping):
        raise ValueError(f"every turn must be a dict, got {type(turn).__name__} {turn!r:.80}")
    if "from" in turn and "role" not in turn:  # LLaVA / ShareGPT
        speaker, value = turn.get("from"), turn.get("value")
        role = _SPEAKERS.get(str(speaker).lower()) if isinstance(speaker, str) else None
        if role is None:
            raise ValueError(f"unknown speaker {speaker!r} of a LLaVA turn (expected human/gpt/system)")
        if not isinstance(value, str):
            raise ValueError(f"a LLaVA turn's 'value' must be a string, got {type(value).__name__}")
        rest = {k: v for k, v in turn.items() if k not in ("from", "value") and v is not None}
        return {**rest, "role": role, "content": value}
    given = turn.get("role")
    role = _SPEAKERS.get(given.lower()) if isinstance(given, str) else None
    if role is None:
        raise ValueError(
            f"turn role {given!r} is not system/user/assistant: give {{'role', 'content'}} turns "
            "(or LLaVA {'from': 'human' | 'gpt', 'value'} turns)"
        )
    content = turn.get("content")
    if type(content) is list or (isinstance(content, Sequence) and not isinstance(content, (str, bytes))):
        content = [_part(part) for part in content]
    elif not isinstance(content, str):
        raise ValueError(f"a {role} turn has no string or list 'content'")
    rest = {k: v for k, v in turn.items() if k not in ("role", "content") and v is not None}
    return {**rest, "role": role, "content": content}


def _part(part: Any) -> dict[str, Any]:
    kind = part.get("type") if type(part) is dict or isinstance(part, Mapping) else None
    if kind in ("image", "image_url"):
        return {"type": "image"}  # the image itself comes with the sample's images, in order
    if kind in ("video", "video_url"):
        return {"type": "video"}  # the video itself comes with the sample's videos, in order
    if kind == "text":
        text = part.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"a text part's 'text' must be a string, got {type(text).__name__}")
        return {"type": "text", "text": text or ""}
    raise ValueError(f"content part type must be 'image', 'video' or 'text', got {kind!r}")


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised content (:func:`normalise_conversation`) as image/video/text parts; a string's ``<image>``
    and ``<video>`` markers become image and video parts, the text around them kept as written."""
    if isinstance(content, str):
        if "<" not in content:  # most text: no marker (a forecast splits every turn)
            return [{"type": "text", "text": content}] if content else []
        out: list[dict[str, Any]] = []
        for i, piece in enumerate(_MARKERS.split(content)):
            if i % 2:
                out.append({"type": "image" if piece == IMAGE_MARKER else "video"})
            elif piece:
                out.append({"type": "text", "text": piece})
        return out
    out = []
    for part in content:
        out += [part] if part["type"] != "text" else _parts(part["text"])
    return out


def _normalise(conversation: Conversation, num_images: int, key: Any, num_videos: int = 0) -> list[dict[str, Any]]:
    """Normalised messages with part lists; with no image (video) part anywhere, the images (then the videos)
    open the first user turn."""
    if isinstance(conversation, str):
        if _MARKERS.search(conversation):
            raise ValueError(
                f"sample {key!r}: a caption with {IMAGE_MARKER!r} / {VIDEO_MARKER!r} markers cannot go through "
                "a chat template; give a conversation (a list of turns) instead."
            )
        # A caption trains like a one-turn chat: the images are the prompt, the caption the answer.
        conversation = [{"role": "user", "content": []}, {"role": "assistant", "content": conversation}]
    messages = [{**t, "content": _parts(t["content"])} for t in _normalised(conversation, key)]
    kinds = {p["type"] for m in messages for p in m["content"]}
    missing = [{"type": "image"}] * (num_images if "image" not in kinds else 0)
    missing += [{"type": "video"}] * (num_videos if "video" not in kinds else 0)
    if missing:
        first_user = next((m for m in messages if m.get("role") == "user"), None)
        if first_user is None:
            raise ValueError(f"sample {key!r} has images or videos but no user turn to put them in.")
        first_user["content"] = missing + first_user["content"]
    return messages


def _normalised(conversation: Conversation, key: Any) -> Any:
    """:func:`normalise_conversation`, its error a ``bad_text`` :class:`SampleError` naming the sample."""
    try:
        return normalise_conversation(conversation)
    except ValueError as e:
        raise SampleError("bad_text", f"sample {key!r}: {e}") from None
