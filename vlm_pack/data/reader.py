"""Read WebDataset samples back: tar members grouped into samples, and a sample's text + image sizes.

The one reader behind both consumers of shards, so the analysis forecasts exactly the samples the training
stream packs::

    shard.tar ──┬─ stream_tar_samples(url)     every member's bytes, sequential     PackedWebDataset
                │   (webdataset gopen: local, pipe:, http...)
                └─ lazy_tar_samples(tar, url)  json/txt bytes; image members as     vlm-pack analyze
                    (random-access TarFile)      seekable file objects (not read)     (forecast_sources)
                          │
                          ▼   webdataset group_by_keys: key = name up to the first dot, field = the rest
    {"__key__": "000018", "__url__": url, "json": b"...", "0.png": <bytes|file>, "1.webp": ..., "mp4": ...}
                          │
                          ▼   read_header(): parse_text + image_fields + vision.image_size (header only)
                          │                  + video_fields + read_video_header (container header, no decode)
    SampleHeader(conversation, image_names=["0.png", "1.webp"], image_sizes=[(w, h), (w, h)],
                 video_names=["mp4"], videos=[VideoHeader(frames, fps, duration, width, height, how)])
                          or SampleError(reason="missing_text" | "bad_text" | "corrupt_image" | "corrupt_video")

``lazy_tar_samples`` never reads image bytes: ``image_size`` reads a few header bytes of each image member and
seeks back, and the tar itself is walked header to header, so an analysis costs a few KB per image. A video
member is opened by PyAV in place (its header, and for MKV / WebM its packets, demuxed, never decoded).
Videos need the ``video`` extra (PyAV); without it a sample with a video raises ``SampleCodeError`` naming the
sample and ``pip install "vlm-pack[video]"``, and image-only samples never import it.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from ..failures import SampleCodeError
from ..vision import image_size
from .shards import SampleError, image_fields, parse_text, video_fields

__all__ = ["SampleHeader", "ShardCutError", "lazy_tar_samples", "read_header", "stream_tar_samples", "video_headers"]

#: Fields read whole by ``lazy_tar_samples`` (the text); every other member stays an unread file object.
TEXT_FIELDS = ("json", "txt")
# webdataset's tar_file_iterator skips these members (``__key__``-like metadata), and so do we.
_SKIP_META = re.compile(r"__[^/]*__($|/)")


class SampleHeader(NamedTuple):
    """What a sample's forecast needs: its text, its images' ``(width, height)`` and its videos' container
    headers (``vlm_pack.vision.video.VideoHeader``), each in placeholder order."""

    conversation: str | list[dict[str, Any]]
    image_names: list[str]
    image_sizes: list[tuple[int, int]]
    video_names: list[str] = []  # noqa: RUF012 - a NamedTuple default, never mutated
    videos: list[Any] = []  # noqa: RUF012


def video_headers(videos: Sequence[Any], names: Sequence[str], key: Any = None) -> list[Any]:
    """The ``VideoHeader`` of each video (bytes, a path or a seekable binary file; left where it was), read
    from its container without decoding (``vlm_pack.vision.video.read_video_header``).

    Raises:
        SampleError: reason ``"corrupt_video"`` naming the video for a container that does not open or read.
        SampleCodeError: without PyAV (the ``video`` extra), naming the sample and ``pip install
        "vlm-pack[video]"``: every video sample would fail alike, so it is never counted as bad data.
    """
    if not videos:
        return []
    from ..vision.video import read_video_header

    headers = []
    for video, name in zip(videos, names):
        try:
            headers.append(read_video_header(video, name=name))
        except ImportError as exc:
            raise SampleCodeError(f"{name}: a video sample, and {exc}; image-only samples need no extra.", key) from exc
        except ValueError as exc:  # the reader's own: a container PyAV cannot open or read, named
            raise SampleError("corrupt_video", str(exc)) from None
    return headers


class ShardCutError(OSError):
    """A shard that ends (or breaks) in the middle: ``lost`` is the key of the sample it cut short (None when
    the cut fell between samples, or the member's name could not be read), ``after`` the last sample read
    whole. Every sample before the cut was yielded first (:func:`stream_tar_samples`)."""

    def __init__(self, message: str, lost: str | None = None, after: str | None = None) -> None:
        super().__init__(message)
        self.lost, self.after = lost, after


def stream_tar_samples(url: str) -> Iterator[dict[str, Any]]:
    """Samples of one shard, every field as ``bytes``, read front to back through ``webdataset.gopen``.

    Any URL webdataset opens (local path, ``pipe:``, ``http(s)://``...); members grouped into samples as
    webdataset's ``tar_file_iterator`` and ``group_by_keys`` do. A shard that breaks part-way (a half-written
    tar, an I/O error) yields every sample it holds whole before the break, then raises
    :class:`ShardCutError` naming the sample the cut left incomplete (``lost``): none is lost unnamed. Other
    errors (unreadable, a duplicate field in one sample) propagate as raised by webdataset.
    """
    import webdataset as wds
    from webdataset.tariterators import group_by_keys

    stream = wds.gopen(url, "rb")
    cut: list[tuple[str | None, BaseException]] = []  # (the member being read, what broke)
    try:

        def members() -> Iterator[dict[str, Any]]:
            name = None
            try:
                tar = tarfile.open(fileobj=stream, mode="r|*")  # noqa: SIM115 - the stream is closed below
                for info in tar:
                    name = info.name
                    if info.isreg() and not _SKIP_META.match(name) and not _is_meta(name):
                        yield {"fname": name, "data": tar.extractfile(info).read(), "__url__": url}  # type: ignore[union-attr]
                    tar.members = []  # a streamed tar keeps no index
                    name = None
            except (tarfile.TarError, OSError, EOFError) as exc:
                cut.append((name, exc))  # end the members: group_by_keys yields the sample it holds

        held, last = None, None
        for sample in group_by_keys(members()):
            if held is not None:
                yield held
                last = held["__key__"]
            held = sample
        if cut:
            from webdataset.tariterators import base_plus_ext

            name, exc = cut[0]
            lost = base_plus_ext(name)[0] if name else None
            if held is not None and lost is not None and held["__key__"] != lost:
                yield held  # whole: the cut fell inside a member of the next sample
                last = held["__key__"]
            elif lost is None and held is not None:  # the cut in a member's header: perhaps held's own
                lost = held["__key__"]
            what = f"sample {lost!r} is cut short and left out" if lost else "no sample is cut"
            if name:
                what += f" (member {name!r})"
            raise ShardCutError(
                f"{url}: the shard breaks part-way ({type(exc).__name__}: {exc}); {what}; every sample before "
                f"it was read (the last: {last!r}). A half-written or truncated tar: write it again.",
                lost,
                last,
            ) from exc
        if held is not None:
            yield held
    finally:
        stream.close()


def _is_meta(name: str) -> bool:
    """webdataset's ``tar_file_iterator`` skips top-level ``__...__`` metadata members."""
    return "/" not in name and name.startswith("__") and name.endswith("__")


def lazy_tar_samples(tar: tarfile.TarFile, url: str) -> Iterator[dict[str, Any]]:
    """Samples of an open random-access ``tar`` (``tarfile.open(path, "r:*")``): text fields (``json``,
    ``txt``) as ``bytes``, every other field as the member's unread, seekable file object.

    Grouping, field names and skipped members are those of :func:`stream_tar_samples`. The file objects stay
    valid while ``tar`` is open. Raises ``tarfile.TarError`` for a corrupt tar and ``ValueError`` for a field
    that occurs twice in one sample.
    """
    from webdataset.tariterators import base_plus_ext, group_by_keys

    def members() -> Iterator[dict[str, Any]]:
        for info in tar:
            if not info.isreg() or _SKIP_META.match(info.name):
                continue
            field = base_plus_ext(info.name)[1]
            file = tar.extractfile(info)
            data = file.read() if field is not None and field.lower() in TEXT_FIELDS else file  # type: ignore[union-attr]
            yield {"fname": info.name, "data": data, "__url__": url}

    return group_by_keys(members())


def read_header(
    sample: Mapping[str, Any],
    *,
    exif_transpose: bool = True,
    image_name: Callable[[str], str] | None = None,
) -> SampleHeader:
    """Text, image sizes and video headers of a sample dict (fields as ``bytes`` or binary file objects); no
    pixel decoded.

    Args:
        sample: a WebDataset sample dict, e.g. from :func:`stream_tar_samples` or :func:`lazy_tar_samples`.
        exif_transpose: passed to ``vision.image_size``.
        image_name: how an image field is named in error messages (default: ``"KEY.FIELD"``).

    Raises:
        SampleError: reason ``"missing_text"`` / ``"bad_text"`` (see ``parse_text``; also a turn whose
        ``content`` is neither a string nor a list of parts), ``"corrupt_image"`` with ``image_size``'s
        message for the first unreadable image header, or ``"corrupt_video"`` for an unreadable video
        container (:func:`video_headers`, which also says what raises without PyAV).
    """
    conversation = parse_text(sample)
    _check_contents(conversation)
    if image_name is None:
        key = sample.get("__key__")
        image_name = lambda name: f"{key}.{name}"  # noqa: E731
    names = image_fields(sample)
    sizes = []
    for name in names:
        try:
            sizes.append(image_size(sample[name], exif_transpose=exif_transpose, name=image_name(name)))
        except ValueError as exc:
            raise SampleError("corrupt_image", str(exc)) from None
    video_names = video_fields(sample)
    videos = video_headers([sample[n] for n in video_names], [image_name(n) for n in video_names], sample.get("__key__"))
    return SampleHeader(conversation, names, sizes, video_names, videos)


def _check_contents(conversation: str | list[dict[str, Any]]) -> None:
    """Refuse, as bad data, a turn whose content the chat rendering cannot read (a number, a dict): what
    it would otherwise raise there is a TypeError, which the failure policy takes for an error of code."""
    if isinstance(conversation, str):
        return
    for i, turn in enumerate(conversation):
        content = turn.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise SampleError(
                "bad_text", f"turn {i}: 'content' must be a string or a list of parts, not {type(content).__name__}"
            )
