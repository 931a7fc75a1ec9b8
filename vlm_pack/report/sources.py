"""Reading: sources (tar shards, JSONL manifests) -> :class:`SampleInfo`, image sizes from headers only."""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_JSONL_SUFFIXES = (".jsonl", ".json")


class SampleReadError(ValueError):
    """One sample could not be read or forecast (its message names the shard or manifest line and the key).

    Raised under ``on_error="raise"``; with ``on_error="skip"`` the sample is listed instead.
    """


@dataclass(frozen=True)
class SampleInfo:
    """One sample as the forecaster needs it: no pixels, just sizes.

    ``image_sizes`` are ``(width, height)`` as the processor will see them (EXIF orientation applied unless
    scanning with ``exif_transpose=False``), in placeholder order. ``source`` says where the sample lives
    (``shard.tar`` or ``manifest.jsonl:LINE``) for error messages and pack plans.
    """

    key: str
    source: str
    conversation: Any
    image_sizes: tuple[tuple[int, int], ...]
    error: str | None = None  # set (and nothing else usable) for an unreadable sample under on_error="skip"


def expand_sources(sources: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Shards and manifests named by ``sources``: files, directories (their ``*.tar``/``*.jsonl``), globs and
    WebDataset brace ranges (``shard-{000..009}.tar``).

    Raises ``ValueError`` naming the argument when it matches nothing or is neither a tar shard nor JSONL.
    """
    import braceexpand

    out: list[Path] = []
    for arg in sources:
        text = os.fspath(arg)
        if "://" in text or text.startswith("pipe:"):
            raise ValueError(
                f"{text!r}: remote shards are not read by the analysis (it seeks to image headers); "
                "copy them locally or analyze a local sample of them."
            )
        matched: list[Path] = []
        for pattern in braceexpand.braceexpand(text):
            path = Path(pattern)
            if path.is_dir():
                found = sorted(p for p in path.iterdir() if _kind(p) is not None)
                if not found:
                    raise ValueError(f"{text!r}: the directory holds no .tar shard or .jsonl manifest.")
                matched += found
            elif path.exists():
                matched.append(path)
            elif glob.has_magic(pattern):
                matched += sorted(Path(p) for p in glob.glob(pattern) if _kind(Path(p)) is not None)
            else:
                raise ValueError(
                    f"{pattern!r} does not exist: give WebDataset .tar shards or a .jsonl manifest."
                )
        if not matched:
            raise ValueError(f"{text!r} matches no .tar shard or .jsonl manifest.")
        for path in matched:
            if _kind(path) is None:
                raise ValueError(
                    f"{str(path)!r} is neither a WebDataset shard ({', '.join(_TAR_SUFFIXES)}) nor a JSONL "
                    "manifest (.jsonl)."
                )
        out += matched
    return out


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(_TAR_SUFFIXES):
        return "tar"
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    return None


def scan_samples(
    sources: Sequence[str | os.PathLike[str]],
    *,
    exif_transpose: bool = True,
    image_root: str | os.PathLike[str] | None = None,
    on_error: str = "raise",
    verify: bool = False,
) -> Iterator[SampleInfo]:
    """Yield every sample of ``sources`` (see :func:`expand_sources`) with its image sizes read from headers.

    WebDataset shards: consecutive members sharing a key form a sample (``key.json`` / ``key.txt`` text,
    ``key.jpg`` or ``key.0.png``, ``key.1.webp`` ... images; see ``vlm_pack.data``). Only each image's first
    bytes are read. JSONL manifests: one sample per line, ``{"key": ..., "images": ["a.jpg", ...],
    "conversation" | "messages" | "conversations" | "caption": ...}`` with image paths relative to the
    manifest's folder (or ``image_root``).

    Header-only (default): the text parses, every placeholder has an image, and each image's header gives
    a format and a size. ``verify=True`` also decodes every image's pixels with Pillow, which catches a file
    cut short after its header (reads every image byte: much slower).

    Raises :class:`SampleReadError` (a ``ValueError``) naming the shard / line and key for an unreadable sample (text missing or not
    parseable, corrupt image header, missing image file); with ``on_error="skip"`` such a sample is yielded
    with only ``key``, ``source`` and ``error`` set. An unreadable shard or manifest always raises.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    for path in expand_sources(sources):
        if _kind(path) == "tar":
            yield from _scan_tar(path, exif_transpose, on_error, verify)
        else:
            yield from _scan_jsonl(path, exif_transpose, image_root, on_error, verify)


_TEXT_LAYOUTS = (
    'put the conversation under "messages" (chat turns {"role", "content"}) or "conversations" (LLaVA '
    'turns {"from", "value"}), or a caption under "caption" (README: "Data formats")'
)


def _text_error(error: Exception, json_bytes: Any) -> str:
    """``parse_text``'s message, with the record's own keys and the accepted layouts when none was found."""
    message = str(error)
    if "has no" not in message or not isinstance(json_bytes, (bytes, str)):
        return message
    try:
        keys = sorted(json.loads(json_bytes))
    except (ValueError, TypeError):
        return message
    return f"its JSON has no text entry vlm-pack reads (its keys: {keys}); {_TEXT_LAYOUTS}"


def _decode_fully(image: Any, name: str) -> None:
    """Decode every pixel of ``image`` (bytes, a path or a seekable binary file; left rewound)."""
    from PIL import Image

    try:
        if hasattr(image, "read"):
            image.seek(0)
            data = image.read()
            image.seek(0)
        else:
            data = image if isinstance(image, bytes) else Path(image).read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(
            f"{name}: the header reads but the pixels do not decode ({e}): the file is truncated or corrupt."
        ) from None


def _sample_from_fields(
    sample: dict[str, Any], where: str, exif_transpose: bool, on_error: str, verify: bool = False
) -> SampleInfo:
    from vlm_pack.data.reader import read_header
    from vlm_pack.data.shards import SampleError

    key = sample["__key__"]
    image_name = lambda name: f"{where}: sample {key!r}, field {name!r}"  # noqa: E731
    try:
        conversation, names, sizes = read_header(sample, exif_transpose=exif_transpose, image_name=image_name)
        for name in names if verify else ():
            _decode_fully(sample[name], image_name(name))
    except (SampleError, ValueError) as e:
        # Image messages already name shard, key and field (image_name above); text ones get them here.
        if getattr(e, "reason", "corrupt_image") == "corrupt_image":
            message = str(e)
        else:
            message = f"{where}: sample {key!r}: {_text_error(e, sample.get('json'))}"
        if on_error == "raise":
            raise SampleReadError(message) from None
        return SampleInfo(key, where, None, (), error=message)
    return SampleInfo(key, where, conversation, tuple(sizes))


def _scan_tar(path: Path, exif_transpose: bool, on_error: str, verify: bool) -> Iterator[SampleInfo]:
    from vlm_pack.data.reader import lazy_tar_samples

    where = str(path)
    try:
        tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by the with-block below
    except (tarfile.TarError, OSError) as e:
        raise ValueError(f"{where}: not a readable tar shard ({e}).") from None
    with tar:
        # Random access: image members stay unread file objects; image_size reads their header and seeks back.
        samples = lazy_tar_samples(tar, where)
        key: str | None = None
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                break
            except (tarfile.TarError, ValueError) as e:  # ValueError: a field twice in one sample
                detail = e.args[0] if e.args else e
                at = "its first sample could not be read" if key is None else f"after sample {key!r}"
                raise ValueError(f"{where}: corrupt tar shard: {at} ({detail}).") from None
            key = sample["__key__"]
            yield _sample_from_fields(sample, where, exif_transpose, on_error, verify)


def _scan_jsonl(
    path: Path, exif_transpose: bool, image_root: str | os.PathLike[str] | None, on_error: str, verify: bool
) -> Iterator[SampleInfo]:
    root = Path(image_root) if image_root is not None else path.parent
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            key = f"{path.stem}-{lineno}"
            try:
                key, sample = _jsonl_sample(line, where, key, root, exif_transpose, verify)
            except ValueError as e:
                if on_error == "raise":
                    raise SampleReadError(str(e)) from None
                sample = SampleInfo(key, where, None, (), error=str(e))
            yield sample


def _jsonl_sample(
    line: str, where: str, key: str, root: Path, exif_transpose: bool, verify: bool = False
) -> tuple[str, SampleInfo]:
    from vlm_pack.data import parse_text
    from vlm_pack.vision import image_size

    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}).") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {type(record).__name__}.")
    key = str(record.get("key", record.get("__key__", record.get("id", key))))
    raw = record.get("images", record.get("image", []))
    paths = [raw] if isinstance(raw, str) else list(raw or [])
    if not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{where}: sample {key!r}: 'images' must be a list of file paths.")
    try:
        conversation = parse_text({"json": line.encode("utf-8")})
    except ValueError as e:
        raise ValueError(f"{where}: sample {key!r}: {_text_error(e, line)}") from None
    sizes = []
    for p in paths:
        file = root / p
        if not file.is_file():
            raise ValueError(
                f"{where}: sample {key!r}: image {p!r} not found at {file}; image paths are relative "
                "to the manifest's folder (or pass --image-root)."
            )
        name = f"{where}: sample {key!r} ({p})"
        sizes.append(image_size(file, exif_transpose=exif_transpose, name=name))
        if verify:
            _decode_fully(file, name)
    return key, SampleInfo(key, where, conversation, tuple(sizes))
