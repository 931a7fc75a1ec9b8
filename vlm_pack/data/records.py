"""One record normaliser behind every source: any record a user keeps -> one :class:`Sample`.

A record is one row of a dataset as its source stores it; its *record format* says which fields hold the text
and the images. The format is detected from the record (``record_format=`` overrides it)::

    format       text field                                   media fields      who writes it
    webdataset   json {"messages" ...} | txt                  jpg, 0.png, ...   vlm-pack shards, WebDataset
                                                              mp4, 0.webm, ...
    llava        conversations [{"from", "value"}]            image | video     LLaVA-Instruct, LLaVA-Video
                                                              (a path or list)  JSON
    sharegpt     messages | conversations, content a string   images, videos    ShareGPT, LLaMA-Factory
                 with <image> / <video> markers (or from/value
                 turns), + an optional "system" prompt
    messages     messages | conversation, content parts       images | image,   TRL / HF hub datasets,
                 [{"type": "image" | "video"}, {"type":        videos | video    vlm-pack JSONL
                 "text", ...}]                                (or the path in
                                                              a video part)
    caption      caption | text                                images | image,   image-caption pairs
                                                              videos | video

Every record format becomes vlm-pack's message format (``processing.py``): turns ``{"role": "system" | "user" |
"assistant", "content": str | [{"type": "image"} | {"type": "text", "text": ...}]}`` with ``<image>``
marking where an image goes in string content, or a caption string. The turns go through
:func:`vlm_pack.processing.chat.normalise_conversation`, the normaliser every ``Preprocessor`` method uses too, and keep
their text as written (a LLaVA ``"<image>\\nWhat?"`` is the content ``"<image>\\nWhat?"``, newline kept).
Images stay as stored: encoded ``bytes`` (an HF ``Image`` feature read with ``decode=False`` is
``{"bytes", "path"}``), a path (relative paths resolved against ``image_root``), a binary file object (a tar
member) or a PIL image. Videos likewise (bytes, a path, an HF ``Video`` feature's ``{"bytes", "path"}``, a tar
member), in the order of their ``<video>`` markers or ``{"type": "video"}`` parts, apart from the images. A
video part may carry its own path (``{"type": "video", "video" | "url" | "path": "clip.mp4"}``, as HF chat
templates take it) where the record has no videos field. LLaVA-Video JSON marks its one video with ``<image>``: a
``llava`` record with a video and no image has those markers read as ``<video>``.

A record that fits no record format raises :class:`SampleError` listing its keys and the accepted formats.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..processing.chat import IMAGE_MARKER, VIDEO_MARKER, normalise_conversation
from .shards import SampleError, image_fields, parse_text, video_fields

__all__ = ["RECORD_FORMATS", "Sample", "detect_record_format", "normalise_record", "record_key"]

#: Accepted record formats, each with one record example (shown in the error for a record that fits none).
RECORD_FORMATS: dict[str, str] = {
    "webdataset": '{"__key__": "000017", "json": b\'{"messages": [...]}\' | "txt": b"...", "jpg" | "0.png": b"..."}',
    "llava": '{"id": "000017", "image": "coco/000017.jpg" | [...], "conversations": [{"from": "human", '
    '"value": "<image>\\nWhat is shown?"}, {"from": "gpt", "value": "A dog."}]}',
    "sharegpt": '{"messages" | "conversations": [{"role": "user", "content": "<image>What is shown?"}, '
    '{"role": "assistant", "content": "A dog."}], "images": ["a.jpg"]}',
    "messages": '{"images": [...], "messages" | "conversation": [{"role": "user", "content": [{"type": '
    '"image"}, {"type": "text", "text": "What is shown?"}]}, {"role": "assistant", "content": ...}]}',
    "caption": '{"image" | "images": ..., "caption" | "text": "a dog on a beach"}',
}
# Text and image fields each record format reads, in order of preference.
_TEXT_FIELDS = {
    "llava": ("conversations",),
    "sharegpt": ("messages", "conversations"),
    "messages": ("messages", "conversation"),
    "caption": ("caption", "text"),
}
_IMAGE_FIELDS = {
    "llava": ("image", "images"),
    "sharegpt": ("images", "image"),
    "messages": ("images", "image"),
    "caption": ("images", "image"),
}
_VIDEO_FIELDS = {
    "llava": ("video", "videos"),
    "sharegpt": ("videos", "video"),
    "messages": ("videos", "video"),
    "caption": ("videos", "video"),
}
_KEY_FIELDS = ("key", "__key__", "id")
# Where a video part names its own file, first found first: transformers' apply_chat_template reads the keys
# in this order (processing_utils.py, transformers 5.24).
_PART_VIDEO_KEYS = ("video", "url", "path")


@dataclass(frozen=True)
class Sample:
    """One normalised record: what ``forecast_length`` and ``process_sample`` take.

    ``conversation`` is vlm-pack's message format (or a caption string); ``images`` are in placeholder
    order, each encoded ``bytes``, a path ``str``, a binary file object or a PIL image; ``where`` says
    where the record lives (``file.parquet:17``, ``llava.json[3]``, ``shard.tar``) for messages;
    ``videos`` are in ``<video>`` placeholder order, each encoded ``bytes``, a path or a binary file object.
    """

    key: str
    conversation: str | list[dict[str, Any]]
    images: tuple[Any, ...]
    where: str
    videos: tuple[Any, ...] = ()

    @property
    def label(self) -> str:
        """How messages name the sample: where it lives, and its key unless that says it already."""
        return _label(self.where, self.key)


def _label(where: str, key: str) -> str:
    return where if key in where else f"{where} (key {key!r})"


def _first_turn(turns: Any) -> Mapping[str, Any]:
    if (type(turns) is list or (isinstance(turns, Sequence) and not isinstance(turns, (str, bytes)))) and turns:
        first = turns[0]
        if type(first) is dict or isinstance(first, Mapping):
            return first
    return {}


def detect_record_format(record: Mapping[str, Any]) -> str | None:
    """The record format of ``record`` (a key of :data:`RECORD_FORMATS`), or None when it fits none."""
    if "__key__" in record and ("json" in record or "txt" in record):
        return "webdataset"
    if "conversations" in record and "messages" not in record:
        first = _first_turn(record["conversations"])
        if "images" in record or "videos" in record or isinstance(first.get("content"), str):
            return "sharegpt"
        return "llava"
    for name in ("messages", "conversation"):
        if name in record:
            first = _first_turn(record[name])
            string_content = isinstance(first.get("content"), str) or "from" in first
            return "sharegpt" if string_content and name == "messages" else "messages"
    if isinstance(record.get("caption"), str) or isinstance(record.get("text"), str):
        return "caption"
    return None


def _no_format(record: Mapping[str, Any], where: str, record_format: str | None) -> SampleError:
    keys = sorted(str(k) for k in record)
    accepted = "\n".join(f"    {name}: {example}" for name, example in RECORD_FORMATS.items())
    head = "fits no record format" if record_format is None else f"does not fit the format {record_format!r}"
    return SampleError(
        "missing_text",
        f"{where}: the record {head}; its keys are {keys}. Accepted record formats:\n{accepted}\n"
        "Rename its fields to one of these (or pass record_format= / --format to choose one).",
    )


def _json_object(data: Any) -> dict[str, Any] | None:
    try:
        payload = json.loads(data) if isinstance(data, (bytes, str)) else None
    except (ValueError, TypeError):
        return None
    text_fields = {f for fields in _TEXT_FIELDS.values() for f in fields}
    return payload if isinstance(payload, dict) and not text_fields & set(payload) else None


def _turns(turns: Any, where: str) -> list[dict[str, Any]]:
    """ShareGPT/LLaVA ``{"from", "value"}`` or chat ``{"role", "content"}`` turns -> vlm-pack messages, text as
    written: :func:`vlm_pack.processing.chat.normalise_conversation`, the one normaliser of every entry point."""
    if isinstance(turns, str):  # a caption is a record format of its own, never a field of turns
        raise SampleError("bad_text", f"{where}: the conversation must be a non-empty list of turns")
    try:
        return normalise_conversation(turns)  # type: ignore[return-value]
    except ValueError as e:
        raise SampleError("bad_text", f"{where}: {e}") from None


def _media(item: Any, where: str, index: int, root: str | os.PathLike[str] | None, kind: str = "image") -> Any:
    """One stored image or video -> bytes, an existing path, a file object (or, an image, a PIL image)."""
    reason = f"corrupt_{kind}"
    if type(item) is dict or isinstance(item, Mapping):  # an HF Image / Video feature read with decode=False
        data, path = item.get("bytes"), item.get("path")
        if data is not None:
            return bytes(data)
        item = path
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        if not path.is_absolute() and root is not None:
            path = Path(root) / path
        if not path.is_file():
            raise SampleError(
                reason,
                f"{where}: {kind} {index} {os.fspath(item)!r} not found at {path}; relative {kind} paths are "
                "resolved against the source's folder or image_root (--image-root).",
            )
        return str(path)
    if hasattr(item, "read") or (kind == "image" and hasattr(item, "size")):  # a tar member, a PIL image
        return item
    what = "bytes, a path or an image" if kind == "image" else "bytes or a path"
    raise SampleError(reason, f"{where}: {kind} {index} is a {type(item).__name__}, not {what}")


def _medias(raw: Any, where: str, root: str | os.PathLike[str] | None, kind: str = "image") -> tuple[Any, ...]:
    if raw is None:
        return ()
    listed = type(raw) is list or (isinstance(raw, Sequence) and not isinstance(raw, (str, bytes, bytearray)))
    items = raw if listed else [raw]
    return tuple(_media(item, where, i, root, kind) for i, item in enumerate(items))


def _part_videos(turns: Any) -> list[Any]:
    """The files video parts name themselves (``{"type": "video", "video": "clip.mp4"}``), in order."""
    found = []
    for turn in turns if isinstance(turns, list) else ():
        content = turn.get("content") if isinstance(turn, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and part.get("type") == "video":
                named = next((part[k] for k in _PART_VIDEO_KEYS if part.get(k) is not None), None)
                found += [] if named is None else [named]
    return found


def _video_markers(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LLaVA-Video's turns: its ``<image>`` markers stand for the record's video (it has no image); turns
    that mark videos as ``<video>`` already are kept."""
    if any(VIDEO_MARKER in turn["content"] for turn in conversation if isinstance(turn.get("content"), str)):
        return conversation
    return [
        {**turn, "content": turn["content"].replace(IMAGE_MARKER, VIDEO_MARKER)}
        if isinstance(turn.get("content"), str) else turn
        for turn in conversation
    ]  # fmt: skip


def record_key(record: Any, default: str) -> str:
    """The key a record names (``key``, ``__key__`` or ``id``), else ``default``."""
    if isinstance(record, Mapping):
        found = next((record[k] for k in _KEY_FIELDS if record.get(k) is not None), None)
        if found is not None:
            return str(found)
    return default


def normalise_record(
    record: Mapping[str, Any],
    *,
    record_format: str | None = None,
    key: str | None = None,
    where: str = "record",
    image_root: str | os.PathLike[str] | None = None,
) -> Sample:
    """``record`` (one row in any record format of :data:`RECORD_FORMATS`) -> a :class:`Sample`.

    Args:
        record: the row as its source stores it.
        record_format: one of :data:`RECORD_FORMATS` (default: :func:`detect_record_format`).
        key: the sample key when the record has no ``key`` / ``__key__`` / ``id`` field.
        where: where the record lives, for messages.
        image_root: folder relative image paths are resolved against.

    Raises:
        SampleError: ``"missing_text"`` for a record that fits no record format (the message lists its
        keys and the accepted formats), ``"bad_text"`` for a malformed conversation, ``"corrupt_image"`` for an
        image that is missing or not an image value.
    """
    if type(record) is not dict and not isinstance(record, Mapping):
        raise SampleError("bad_text", f"{where}: a record must be a dict, got {type(record).__name__}")
    if record_format is not None and record_format not in RECORD_FORMATS:
        raise ValueError(f"record_format must be one of {sorted(RECORD_FORMATS)}, got {record_format!r}")
    key = record_key(record, key if key is not None else where)
    label = _label(where, key)
    chosen = record_format or detect_record_format(record)
    root = image_root  # a Path only where a relative image path needs it (a forecast reads every row)
    if chosen == "webdataset":
        if "__key__" not in record:
            raise _no_format(record, label, record_format)
        try:
            conversation = parse_text(record)
        except SampleError as e:
            payload = _json_object(record.get("json"))
            if payload is not None and e.reason == "bad_text":  # JSON in no record format: its own keys
                raise _no_format(payload, label, record_format) from None
            raise SampleError(e.reason, f"{label}: {e}") from None
        # An Arrow row (a dataset, parquet) has every image column: None there means no such image.
        images = [record[n] for n in image_fields(record) if record[n] is not None]
        videos = [record[n] for n in video_fields(record) if record[n] is not None]
        videos = _medias(videos, label, root, "video")
        return Sample(key, conversation, _medias(images, label, root), where, videos)
    if chosen is None:
        raise _no_format(record, label, record_format)
    text_field = next((f for f in _TEXT_FIELDS[chosen] if f in record), None)
    if text_field is None:
        raise _no_format(record, label, record_format)
    text = record[text_field]
    if chosen == "caption" or isinstance(text, str):
        if not isinstance(text, str):
            raise SampleError("bad_text", f"{label}: {text_field!r} must be a string")
        conversation: str | list[dict[str, Any]] = text
    else:
        conversation = _turns(text, label)
        system = record.get("system")
        if (
            chosen == "sharegpt"
            and isinstance(system, str)
            and system
            and conversation[0]["role"] != "system"
        ):
            # LLaMA-Factory keeps the system prompt in its own column; it is part of the sample's length
            conversation = [{"role": "system", "content": system}, *conversation]
    image_field = next((f for f in _IMAGE_FIELDS[chosen] if f in record), None)
    images = _medias(record[image_field], label, root) if image_field else ()
    video_field = next((f for f in _VIDEO_FIELDS[chosen] if record.get(f) is not None), None)
    raw_videos = record[video_field] if video_field else _part_videos(text)
    videos = _medias(raw_videos, label, root, "video")
    if chosen == "llava" and videos and not images and not isinstance(conversation, str):
        conversation = _video_markers(conversation)
    return Sample(key, conversation, images, where, videos)
