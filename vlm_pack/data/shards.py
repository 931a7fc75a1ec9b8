"""Write image-text samples into WebDataset tar shards, and read one sample's fields back.

A shard is a plain tar file. Every sample is a group of consecutive members that share a key (the file
name up to its first dot); the rest of the name is the field::

    shard-000000.tar
    ├── 000000017.jpg        single image          key "000000017", field "jpg"
    ├── 000000017.json       {"messages": [...]}   the conversation (chat messages)
    ├── 000000018.0.png      first image           key "000000018", field "0.png"
    ├── 000000018.1.webp     second image          key "000000018", field "1.webp"
    ├── 000000018.json
    ├── 000000019.jpg
    └── 000000019.txt        a caption             key "000000019", field "txt"

Images keep their encoded bytes (no re-encoding, so a JPEG stays the same JPEG); the order of a sample's
images is the order of its ``<image>`` placeholders: the unnumbered field first, then ``0.*``, ``1.*`` ...
Videos are members of their own extensions (``KEY.mp4``, ``KEY.0.webm``, ``KEY.1.mkv`` ...), numbered and
ordered the same way, apart from the images: the order of the ``<video>`` placeholders.
The text is either ``txt`` (a caption: the image(s) followed by the caption as the assistant's answer) or
``json`` holding a conversation in one of the accepted record formats (see :func:`parse_text`).

``write_shards(records, "out/shard-%06d.tar", maxcount=1000)`` converts a list or generator of records;
``write_shards_from_folder(folder, out)`` converts a folder of images with same-stem ``.txt``/``.json``.
"""

from __future__ import annotations

import io
import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..failures import SampleError  # the one data-error type (defined with the failure policy)

__all__ = [
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "SampleError",
    "image_fields",
    "parse_text",
    "video_fields",
    "write_shards",
    "write_shards_from_folder",
]

#: Field extensions read as images (lower case; ``jpeg`` is stored as ``jpg``).
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")

_MAGIC = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)
_IMAGE_FIELD = re.compile(r"^(?:(\d+)\.)?(" + "|".join(IMAGE_EXTENSIONS) + r")$")
#: Field extensions read as videos (containers PyAV opens; lower case).
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi")
_VIDEO_FIELD = re.compile(r"^(?:(\d+)\.)?(" + "|".join(VIDEO_EXTENSIONS) + r")$")


def _sniff(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    return None


def _sniff_video(data: bytes) -> str | None:
    if data[4:8] == b"ftyp":  # ISO base media (MP4, MOV): the first box names the brand
        return "mov" if data[8:10] == b"qt" else "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: the DocType in the first bytes says WebM or Matroska
        return "webm" if b"webm" in data[:64] else "mkv"
    if data[:4] == b"RIFF" and data[8:11] == b"AVI":
        return "avi"
    return None


def _encode_video(video: Any, where: str) -> tuple[bytes, str]:
    """``video`` (path, bytes or ``(bytes, ext)``) -> (its bytes, as stored, and the field extension)."""
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[0], (bytes, bytearray)):
        return bytes(video[0]), _normalise_ext(video[1])
    if isinstance(video, (bytes, bytearray, memoryview)):
        data = bytes(video)
        ext = _sniff_video(data)
        if ext is None:
            raise ValueError(
                f"{where}: cannot tell the container of {len(data)} video bytes from their header; pass "
                "(bytes, 'mp4') to name it."
            )
        return data, ext
    if isinstance(video, (str, os.PathLike)):
        path = Path(video)
        ext = _normalise_ext(path.suffix)
        if ext not in VIDEO_EXTENSIONS:
            raise ValueError(f"{where}: {path} does not end in a video extension ({', '.join(VIDEO_EXTENSIONS)}).")
        return path.read_bytes(), ext
    raise TypeError(f"{where}: a video must be a path, encoded bytes or (bytes, ext), not {type(video).__name__}.")


def _normalise_ext(ext: str) -> str:
    ext = ext.lower().lstrip(".")
    return {"jpeg": "jpg", "tif": "tiff"}.get(ext, ext)


def _encode_image(image: Any, image_format: str, where: str) -> tuple[bytes, str]:
    """``image`` (path, bytes, ``(bytes, ext)`` or PIL image) -> (encoded bytes, field extension)."""
    if isinstance(image, tuple) and len(image) == 2 and isinstance(image[0], (bytes, bytearray)):
        return bytes(image[0]), _normalise_ext(image[1])
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        ext = _sniff(data)
        if ext is None:
            raise ValueError(
                f"{where}: cannot tell the format of {len(data)} image bytes from their header; "
                "pass (bytes, 'jpg') to name it."
            )
        return data, ext
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        ext = _normalise_ext(path.suffix)
        if ext not in IMAGE_EXTENSIONS:
            raise ValueError(
                f"{where}: {path} does not end in an image extension ({', '.join(IMAGE_EXTENSIONS)})."
            )
        return path.read_bytes(), ext
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        fmt = _normalise_ext(image.format or image_format)
        fmt = fmt if fmt in ("jpg", "png", "webp") else _normalise_ext(image_format)
        buf = io.BytesIO()
        save = image.convert("RGB") if fmt == "jpg" and image.mode not in ("RGB", "L") else image
        save.save(buf, format={"jpg": "JPEG"}.get(fmt, fmt.upper()))
        return buf.getvalue(), fmt
    raise TypeError(
        f"{where}: an image must be a path, encoded bytes, (bytes, ext) or a PIL image, not {type(image).__name__}."
    )


_TEXT_FIELDS = ("conversation", "conversations", "messages", "caption", "text")
_RECORD_FIELDS = frozenset(("key", "__key__", "images", "image", "videos", "video", "meta", *_TEXT_FIELDS))


def _record_fields(record: Any, index: int, image_format: str) -> tuple[str | None, dict[str, bytes]]:
    """One user record -> (key or None, {field: bytes}) ready for ``TarWriter``."""
    where = f"record {index}"
    if isinstance(record, Mapping):
        key = record.get("key", record.get("__key__"))
        if key is not None:
            where = f"record {index} (key {str(key)!r})"
        # An unknown field (a misspelt "caption", LLaVA's "id") would otherwise vanish from the shard.
        unknown = sorted(str(k) for k in record if k not in _RECORD_FIELDS)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}; a record holds {sorted(_RECORD_FIELDS)}. Put other "
                "data under 'meta' (stored in the sample's json)."
            )
        texts = [name for name in _TEXT_FIELDS if name in record]
        if len(texts) > 1:
            raise ValueError(f"{where}: give one text field, not {texts}")
        images_fields = [name for name in ("images", "image") if name in record]
        if len(images_fields) > 1:
            raise ValueError(f"{where}: give 'images' or 'image', not both")
        images = record[images_fields[0]] if images_fields else []
        videos = _one_field(record, ("videos", "video"), where)
        text: Any = record[texts[0]] if texts else None
        meta = record.get("meta")
    elif isinstance(record, Sequence) and not isinstance(record, (str, bytes)) and len(record) == 2:
        key, (images, text), meta, videos = None, record, None, []
    else:
        raise TypeError(
            f"{where}: expected a dict with 'images' and 'conversation'/'caption', or an (images, text) pair; "
            f"got {type(record).__name__}."
        )
    if key is not None:
        key = str(key)
        where = f"record {index} (key {key!r})"
        if not key or "." in key.rsplit("/", 1)[-1]:
            raise ValueError(
                f"{where}: WebDataset keys end at the first dot of the file name; use a key without '.' "
                "in its last path component."
            )
    images, videos = _as_list(images), _as_list(videos)
    fields: dict[str, bytes] = {}
    for i, image in enumerate(images):
        data, ext = _encode_image(image, image_format, f"{where}, image {i}")
        fields[ext if len(images) == 1 else f"{i}.{ext}"] = data
    for i, video in enumerate(videos):
        data, ext = _encode_video(video, f"{where}, video {i}")
        fields[ext if len(videos) == 1 else f"{i}.{ext}"] = data
    if isinstance(text, str):
        fields["txt"] = text.encode("utf-8")
    elif isinstance(text, list):
        payload = dict(meta or {})
        payload["messages"] = text
        fields["json"] = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    elif isinstance(text, Mapping):
        fields["json"] = json.dumps({**(meta or {}), **text}, ensure_ascii=False).encode("utf-8")
    elif text is not None:
        raise TypeError(
            f"{where}: text must be a caption string or a list of chat messages, not {type(text).__name__}."
        )
    elif meta:
        fields["json"] = json.dumps(dict(meta), ensure_ascii=False).encode("utf-8")
    if not fields:
        raise ValueError(f"{where}: a record needs at least one image or a text.")
    return key, fields


def _one_field(record: Mapping[str, Any], names: tuple[str, ...], where: str) -> Any:
    given = [name for name in names if name in record]
    if len(given) > 1:
        raise ValueError(f"{where}: give {' or '.join(repr(n) for n in names)}, not both")
    return record[given[0]] if given else []


def _as_list(items: Any) -> list[Any]:
    """One media item or a list of them -> a list (a ``(bytes, ext)`` pair is one item)."""
    if items is None:
        return []
    if not isinstance(items, (list, tuple)) or (
        isinstance(items, tuple) and len(items) == 2 and isinstance(items[0], (bytes, bytearray))
    ):
        return [items]
    return list(items)


def _shard_pattern(output: str | os.PathLike) -> str:
    output = os.fspath(output)
    if "%" in output:
        return output
    if output.endswith((".tar", ".tar.gz", ".tgz")):
        raise ValueError(
            f"output {output!r} names one file; give a pattern such as 'out/shard-%06d.tar' or a directory."
        )
    return os.path.join(output, "shard-%06d.tar")


def write_shards(
    records: Iterable[Any],
    output: str | os.PathLike,
    *,
    maxcount: int = 1000,
    maxsize: float = 1e9,
    start_shard: int = 0,
    image_format: str = "png",
    key_format: str = "{:09d}",
) -> list[str]:
    """Write ``records`` into WebDataset tar shards; return the shard paths in order.

    Args:
        records: a list or generator of samples, each either a dict ::

                {"key": "abc",                          # optional; default key_format.format(index)
                 "images": [path | bytes | (bytes, "jpg") | PIL.Image, ...],   # or one image
                 "videos": [path | bytes | (bytes, "mp4"), ...],   # optional, or one video (stored as is)
                 "conversation": [{"role": "user", "content": [{"type": "image"}, ...]}, ...]
                   | "conversations": [{"from": "human", "value": "<image>\\n..."}, ...]   # LLaVA
                   | "caption": "a dog on a beach",
                 "meta": {...}}                         # optional, stored in the json

            or an ``(images, text)`` pair whose text is a caption string or a list of messages.
            Paths and bytes are stored as they are (corrupt bytes stay corrupt: the reader reports them);
            PIL images are encoded as their ``format`` or ``image_format``.
        output: a ``%``-pattern such as ``"out/shard-%06d.tar"`` or a directory (``shard-%06d.tar`` inside).
        maxcount / maxsize: start a new shard after this many samples / bytes.
        start_shard: number of the first shard.
        image_format: encoding of PIL images that carry no format ("png", "jpg" or "webp").
        key_format: format of default keys from the record's index.

    Raises:
        ValueError / TypeError naming the record for a malformed record or a duplicate key.
    """
    import webdataset as wds

    pattern = _shard_pattern(output)
    Path(pattern).parent.mkdir(parents=True, exist_ok=True)
    iterator = iter(records)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError("write_shards: no records to write.") from None
    paths: list[str] = []
    seen: set[str] = set()
    writer = wds.ShardWriter(
        pattern,
        maxcount=maxcount,
        maxsize=maxsize,
        start_shard=start_shard,
        verbose=0,
        post=paths.append,
        mtime=0.0,  # byte-identical shards for identical input
    )
    try:

        def _all() -> Iterator[Any]:
            yield first
            yield from iterator

        for index, record in enumerate(_all()):
            key, fields = _record_fields(record, index, image_format)
            key = key if key is not None else key_format.format(index)
            if key in seen:
                raise ValueError(f"record {index}: duplicate key {key!r}; keys must be unique across shards.")
            seen.add(key)
            writer.write({"__key__": key, **fields})
    finally:
        writer.close()
    return paths


def write_shards_from_folder(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    maxcount: int = 1000,
    maxsize: float = 1e9,
    recursive: bool = True,
) -> list[str]:
    """Convert a folder of images with same-stem ``.txt`` captions or ``.json`` conversations into shards.

    ``photos/dog.jpg`` + ``photos/dog.txt`` become one sample with key ``photos/dog``. A ``.json`` may list
    several images, relative to its folder (``{"images": ["a.jpg", "b.png"], "messages": [...]}``); those
    images then belong to that sample only. An image with no text is skipped with a warning naming it; a
    text with no image becomes a text-only sample. Samples are written in sorted path order.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"write_shards_from_folder: {root} is not a directory.")
    files = sorted(p for p in (root.rglob("*") if recursive else root.glob("*")) if p.is_file())
    by_stem: dict[Path, dict[str, Path]] = {}
    for path in files:
        by_stem.setdefault(path.with_suffix(""), {})[_normalise_ext(path.suffix)] = path
    claimed: set[Path] = set()
    texts: dict[Path, tuple[Any, list[Path]]] = {}
    for stem, exts in by_stem.items():
        if "json" in exts:
            payload = json.loads(exts["json"].read_text(encoding="utf-8"))
            listed = payload.get("images") if isinstance(payload, dict) else None
            images = [exts["json"].parent / p for p in listed] if listed else []
            for image in images:
                if not image.is_file():
                    raise ValueError(f"{exts['json']}: lists image {image}, which does not exist.")
            claimed.update(images)
            if isinstance(payload, dict):
                payload = {k: v for k, v in payload.items() if k != "images"}
            texts[stem] = (payload, images)
        elif "txt" in exts:
            texts[stem] = (exts["txt"].read_text(encoding="utf-8"), [])

    def records() -> Iterator[dict[str, Any]]:
        for stem, exts in by_stem.items():
            own = [p for e, p in exts.items() if e in IMAGE_EXTENSIONS and p not in claimed]
            if stem not in texts:
                for image in own:
                    warnings.warn(
                        f"write_shards_from_folder: skipping {image}: no {stem.name}.txt or .json next to it.",
                        stacklevel=3,
                    )
                continue
            text, listed = texts[stem]
            key = stem.relative_to(root).as_posix().replace(".", "_")
            yield {
                "key": key,
                "images": listed or own,
                "conversation" if not isinstance(text, str) else "caption": text,
            }

    return write_shards(records(), output, maxcount=maxcount, maxsize=maxsize)


def image_fields(sample: Mapping[str, Any]) -> list[str]:
    """The image fields of a WebDataset sample dict, in placeholder order (``jpg`` first, then ``0.*``, ``1.*``)."""
    found = []
    for name in sample:
        m = _IMAGE_FIELD.match(name)
        if m is not None:
            found.append((-1 if m.group(1) is None else int(m.group(1)), name))
    return [name for _, name in sorted(found)]


def video_fields(sample: Mapping[str, Any]) -> list[str]:
    """The video fields of a WebDataset sample dict, in placeholder order (``mp4`` first, then ``0.*``, ``1.*``)."""
    found = []
    for name in sample:
        m = _VIDEO_FIELD.match(name)
        if m is not None:
            found.append((-1 if m.group(1) is None else int(m.group(1)), name))
    return [name for _, name in sorted(found)]


def _llava_turns(turns: list[Any]) -> list[dict[str, Any]]:
    """LLaVA / ShareGPT ``[{"from": "human", "value": "<image>\\nWhat is ..."}, ...]`` -> role/content turns,
    text as written: :func:`vlm_pack.processing.chat.normalise_conversation`, the one normaliser of every entry point."""
    from ..processing.chat import normalise_conversation

    try:
        return normalise_conversation(turns)  # type: ignore[return-value]
    except ValueError as e:
        raise SampleError("bad_text", str(e)) from None


def parse_text(sample: Mapping[str, Any]) -> str | list[dict[str, Any]]:
    """The caption or conversation of a WebDataset sample dict (raw ``bytes`` fields).

    Accepted: ``txt`` (a caption); ``json`` holding a list of messages, or a dict with ``messages`` /
    ``conversation`` / ``conversations`` (chat messages ``{"role", "content"}`` or LLaVA turns
    ``{"from": "human"|"gpt", "value": "<image>\\n..."}``), or with ``caption`` / ``text``.

    Raises:
        SampleError (a ValueError): reason ``"missing_text"`` when the sample has no text field, ``"bad_text"``
        for undecodable JSON / UTF-8 or an unknown record format (the message says which).
    """
    if "json" in sample:
        try:
            payload = json.loads(sample["json"])
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SampleError("bad_text", f"json field is not valid JSON: {exc}") from None
        if isinstance(payload, dict):
            for name in ("messages", "conversation", "conversations"):
                if name in payload:
                    payload = payload[name]
                    break
            else:
                for name in ("caption", "text", "txt"):
                    if isinstance(payload.get(name), str):
                        return payload[name]
                if "txt" not in sample:
                    raise SampleError(
                        "bad_text",
                        "json field has no 'messages', 'conversation(s)', 'caption' or 'text' entry",
                    )
                payload = None
        if payload is not None:
            if not isinstance(payload, list) or not all(isinstance(t, dict) for t in payload):
                raise SampleError("bad_text", "json conversation must be a list of message dicts")
            if payload and "from" in payload[0]:
                return _llava_turns(payload)
            return payload
    if "txt" in sample:
        try:
            return sample["txt"].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SampleError("bad_text", f"txt field is not UTF-8: {exc}") from None
    raise SampleError("missing_text", "missing text: the sample has neither a 'txt' nor a 'json' field")
