"""Read records where users keep them: HF ``datasets``, parquet, LLaVA / ShareGPT JSON, JSONL, WebDataset.

Every source is cut into *chunks* a worker process reads (a range of a dataset's rows or of a JSONL file's
bytes, a shard; parquet batches, JSON slices shipped to it), so a forecast runs over ``num_proc``
processes and still yields the records in source order::

    sources ──> open_sources() ──> Source ──> chunks() ──> read_chunk() ──> (where, key, record) ──>
    ["train.parquet",             kind, rows   Chunk        rows as dicts               normalise_record()
     ds, "llava.json"]                                      (image bytes undecoded)       -> Sample

    kind       what it is                                   a chunk           where / default key
    dataset    datasets.Dataset, or a save_to_disk folder   rows [a, b)       dataset[17] / "17"
    iterable   datasets.IterableDataset                     records (read     dataset[17] / "17"
                                                            in order here)
    parquet    *.parquet (HF Image columns: bytes or path)  Arrow batches     f.parquet:17 / f-17
    json       one JSON array (LLaVA-Instruct, ShareGPT,    a slice           f.json[17] / f-17
               LLaMA-Factory)
    jsonl      one JSON object a line                       lines             f.jsonl:18 / f-18
    tar        WebDataset shard                             the shard         f.tar / its __key__

Image bytes are never decoded here: parquet and dataset rows are read as Arrow (an ``Image`` feature is
``{"bytes", "path"}``), an ``IterableDataset`` with ``decode(False)``, tar members as unread file objects.
Relative image paths resolve against ``image_root``, else the folder of the file that names them.
"""

from __future__ import annotations

import glob
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ON_ERROR, check_choice
from .records import Sample, normalise_record, record_key
from .shards import SampleError

__all__ = [
    "SOURCE_SUFFIXES",
    "Chunk",
    "Source",
    "chunk_samples",
    "chunks",
    "iter_samples",
    "open_sources",
    "read_chunk",
]

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
#: File name endings read as sources, by kind.
SOURCE_SUFFIXES = {"tar": _TAR_SUFFIXES, "jsonl": (".jsonl",), "json": (".json",), "parquet": (".parquet",)}
_SAVED_DATASET = ("dataset_info.json", "state.json")  # what save_to_disk writes next to its .arrow files


@dataclass
class Source:
    """One source: ``kind`` (see the module table), ``ref`` (a path, a dataset, or parsed JSON records),
    ``name`` for messages, ``num_rows`` (None while unknown), and ``image_root`` for relative paths."""

    kind: str
    ref: Any
    name: str
    num_rows: int | None
    image_root: Path | None
    handle: Any = field(default=None, repr=False, compare=False)  # opened lazily, in the reading process


@dataclass(frozen=True)
class Chunk:
    """A piece of source ``source`` (an index into the ``open_sources`` list) that ``read_chunk`` reads:
    rows ``[start, stop)`` (of a dataset, by reference; of parquet, shipped as the Arrow ``batch``; of
    JSON or an iterable dataset, shipped as ``records``), or for JSON Lines the bytes ``[start, stop)``
    whose first line is ``line``."""

    source: int
    start: int = 0
    stop: int | None = None
    batch: Any = None
    records: tuple[Any, ...] = ()
    line: int = 1
    group: int | None = None  # parquet: the row group the reading process reads itself (no ``batch``)


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for kind, suffixes in SOURCE_SUFFIXES.items():
        if name.endswith(suffixes):
            return kind
    return None


def _stem(path: Path) -> str:
    """The file name without its source suffix (``a.b.jsonl`` -> ``a.b``, ``s.tar.gz`` -> ``s``)."""
    name = path.name
    for suffixes in SOURCE_SUFFIXES.values():
        for suffix in suffixes:
            if name.lower().endswith(suffix):
                return name[: -len(suffix)]
    return name


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        all((path / n).is_file() for n in _SAVED_DATASET) or (path / "dataset_dict.json").is_file()
    )


def _dataset_source(ds: Any, name: str, image_root: Path | None) -> Source:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise ValueError(
                f"{name}: a DatasetDict with splits {sorted(ds)}; give one split (ds['train'], or the "
                "split's folder of a save_to_disk DatasetDict)."
            )
        ds = next(iter(ds.values()))
    if isinstance(ds, datasets.Dataset):
        return Source("dataset", ds, name, len(ds), image_root)
    if isinstance(ds, datasets.IterableDataset):
        return Source("iterable", ds.decode(False), name, None, image_root)
    raise TypeError(f"{name}: expected a datasets.Dataset or IterableDataset, got {type(ds).__name__}")


def _file_source(path: Path, image_root: Path | None) -> Source:
    kind = _kind(path)
    root = image_root if image_root is not None else path.parent
    name = str(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged file
            raise ValueError(f"{name}: not a readable parquet file ({e}).") from None
        return Source("parquet", path, name, rows, root)
    if kind == "json":
        return _json_source(path, root)
    if kind == "jsonl":
        with open(path, "rb") as f:
            rows = sum(1 for line in f if line.strip())
        return Source("jsonl", path, name, rows, root)
    return Source("tar", path, name, None, root)


def _json_source(path: Path, root: Path) -> Source:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several objects one per line: JSON Lines under a .json name
            return Source("jsonl", path, str(path), sum(1 for ln in text.splitlines() if ln.strip()), root)
        raise ValueError(f"{path}: not valid JSON ({e}).") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of records, got {type(data).__name__}.")
    return Source("json", data, str(path), len(data), root)


def _expand_path(text: str) -> list[Path]:
    import braceexpand

    if "://" in text or text.startswith("pipe:"):
        raise ValueError(
            f"{text!r}: remote sources are not read (the forecast seeks to image headers); copy them "
            "locally, or load them with datasets and pass the Dataset object."
        )
    matched: list[Path] = []
    for pattern in braceexpand.braceexpand(text):
        path = Path(pattern)
        if _is_saved_dataset(path):
            matched.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and _kind(p) is not None)
            if not found:
                raise ValueError(
                    f"{text!r}: the directory holds no source ({_suffix_list()}) and is no save_to_disk "
                    "dataset."
                )
            matched += found
        elif path.exists():
            matched.append(path)
        elif glob.has_magic(pattern):
            matched += sorted(Path(p) for p in glob.glob(pattern) if _kind(Path(p)) is not None)
        else:
            raise ValueError(f"{pattern!r} does not exist: give {_suffix_list()} files or a dataset folder.")
    if not matched:
        raise ValueError(f"{text!r} matches no source ({_suffix_list()}).")
    for path in matched:
        if not path.is_dir() and _kind(path) is None:
            raise ValueError(
                f"{str(path)!r} is not a source vlm-pack reads: give WebDataset shards, JSONL, JSON or "
                f"parquet files ({_suffix_list()}) or a save_to_disk folder."
            )
    return matched


def _suffix_list() -> str:
    return ", ".join(s for suffixes in SOURCE_SUFFIXES.values() for s in suffixes)


def open_sources(
    sources: Any | Sequence[Any], *, image_root: str | os.PathLike[str] | None = None
) -> list[Source]:
    """The :class:`Source` of every item of ``sources``: ``datasets`` objects, files, folders (their
    source files, or a ``save_to_disk`` dataset), globs and WebDataset brace ranges (``s-{000..009}.tar``).

    Raises ``ValueError`` naming the argument that matches nothing or is no source.
    """
    root = Path(image_root) if image_root is not None else None
    items = (
        [sources] if isinstance(sources, (str, os.PathLike)) or not isinstance(sources, Sequence) else sources
    )
    out: list[Source] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            out.append(_dataset_source(item, "dataset", root))
            continue
        for path in _expand_path(os.fspath(item)):
            if path.is_dir():
                import datasets

                out.append(_dataset_source(datasets.load_from_disk(str(path)), str(path), root))
            else:
                out.append(_file_source(path, root))
    return out


def chunks(sources: Sequence[Source], chunk_rows: int = 1024) -> Iterator[Chunk]:
    """Cut ``sources`` into chunks of about ``chunk_rows`` records, in source order."""
    for index, src in enumerate(sources):
        if src.kind == "dataset":
            for start in range(0, src.num_rows or 0, chunk_rows):
                yield Chunk(index, start, min(start + chunk_rows, src.num_rows or 0))
        elif src.kind == "parquet":
            yield from _parquet_chunks(index, src.ref, chunk_rows)
        elif src.kind == "json":
            for start in range(0, len(src.ref), chunk_rows):
                stop = min(start + chunk_rows, len(src.ref))
                yield Chunk(index, start, stop, records=tuple(src.ref[start:stop]))
        elif src.kind == "iterable":
            yield from _iterable_chunks(index, src.ref, chunk_rows)
        elif src.kind == "jsonl":
            yield from _jsonl_chunks(index, src.ref, chunk_rows)
        else:  # a tar shard is read whole, front to back
            yield Chunk(index)


def _jsonl_chunks(index: int, path: Path, chunk_rows: int) -> Iterator[Chunk]:
    start = offset = rows = 0
    first = line = 1
    with open(path, "rb") as f:
        for text in f:
            offset += len(text)
            line += 1
            rows += bool(text.strip())
            if rows == chunk_rows:
                yield Chunk(index, start, offset, line=first)
                start, first, rows = offset, line, 0
    if rows:
        yield Chunk(index, start, offset, line=first)


def _parquet_chunks(index: int, path: Path, chunk_rows: int) -> Iterator[Chunk]:
    # Row groups of at most a few chunks are chunks themselves, read by the worker (nothing read here, nothing
    # shipped: the main process and the pipe would cap the scaling). Larger ones (often the whole file) are
    # streamed here and shipped as Arrow batches: a row group cannot be read from the middle.
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow's errors for a damaged footer
        raise ValueError(f"{path}: unreadable parquet file ({e}).") from None
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if len(sizes) > 1 and max(sizes) <= 4 * chunk_rows:
        start = 0
        for group, rows in enumerate(sizes):
            if rows:
                yield Chunk(index, start, start + rows, group=group)
            start += rows
        return
    start = 0
    batches = pq.ParquetFile(path).iter_batches(batch_size=chunk_rows)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # pyarrow's errors for a damaged file
            raise ValueError(f"{path}: unreadable parquet data after row {start} ({e}).") from None
        yield Chunk(index, start, start + batch.num_rows, batch=batch)
        start += batch.num_rows


def _iterable_chunks(index: int, ds: Any, chunk_rows: int) -> Iterator[Chunk]:
    batch: list[Any] = []
    start = 0
    for row in ds:
        batch.append(row)
        if len(batch) == chunk_rows:
            yield Chunk(index, start, start + len(batch), records=tuple(batch))
            start, batch = start + len(batch), []
    if batch:
        yield Chunk(index, start, start + len(batch), records=tuple(batch))


def _dataset_rows(src: Source, chunk: Chunk) -> list[dict[str, Any]]:
    # One handle per source and process: a worker reads many chunks of the same dataset.
    if src.handle is None:  # Arrow format: Image columns stay {"bytes", "path"}, nothing is decoded
        src.handle = src.ref.with_format("arrow")
    return src.handle[chunk.start : chunk.stop].to_pylist()


def read_chunk(sources: Sequence[Source], chunk: Chunk) -> Iterator[tuple[str, str, Any]]:
    """``(where, default key, record)`` of every record of ``chunk``, in order.

    Raises ``ValueError`` for an unreadable file (a damaged shard or parquet file); a bad *record* is
    yielded as it is, for :func:`normalise_record` to report.
    """
    src = sources[chunk.source]
    stem = _stem(Path(src.name))
    if src.kind in ("dataset", "iterable"):
        rows = _dataset_rows(src, chunk) if src.kind == "dataset" else chunk.records
        for row, record in enumerate(rows, chunk.start):
            yield f"{src.name}[{row}]", str(row), record
    elif src.kind in ("parquet", "json"):
        rows = _parquet_rows(src, chunk).to_pylist() if src.kind == "parquet" else chunk.records
        fmt = "{}:{}" if src.kind == "parquet" else "{}[{}]"
        for row, record in enumerate(rows, chunk.start):
            yield fmt.format(src.name, row), f"{stem}-{row}", record
    elif src.kind == "jsonl":
        yield from _jsonl_records(src.ref, stem, chunk)
    else:
        yield from _tar_records(src.ref)


def _parquet_rows(src: Source, chunk: Chunk) -> Any:
    """The Arrow rows of a parquet chunk: shipped with it, or its row group read here."""
    if chunk.batch is not None:
        return chunk.batch
    import pyarrow.parquet as pq

    try:
        if src.handle is None:  # one handle per source and process, as for datasets
            src.handle = pq.ParquetFile(src.ref)
        return src.handle.read_row_group(chunk.group)
    except Exception as e:
        raise ValueError(f"{src.ref}: unreadable parquet data in row group {chunk.group} ({e}).") from None


def _jsonl_records(path: Path, stem: str, chunk: Chunk) -> Iterator[tuple[str, str, Any]]:
    with open(path, "rb") as f:
        f.seek(chunk.start)
        lines = f.read(chunk.stop - chunk.start).split(b"\n")  # not splitlines: JSON strings hold U+2028
    for lineno, line in enumerate(lines, chunk.line):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            record = SampleError("bad_text", f"{where}: not valid JSON ({e}).")
        yield where, f"{stem}-{lineno}", record


def _tar_records(path: Path) -> Iterator[tuple[str, str, Any]]:
    from .reader import lazy_tar_samples

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
            yield where, key, sample
        if key is None:  # an empty shard: listed with the records left out, never a silent nothing
            yield where, Path(where).name, SampleError("empty_shard", f"{where}: the shard holds no sample.")


def chunk_samples(
    sources: Sequence[Source], chunk: Chunk, *, record_format: str | None = None
) -> Iterator[tuple[str, str, Sample | SampleError]]:
    """``(where, default key, sample)`` for every record of ``chunk``; a record that cannot be normalised
    comes as its :class:`SampleError` instead (whose message names where it lives and its key)."""
    src = sources[chunk.source]
    for where, key, record in read_chunk(sources, chunk):
        if not isinstance(record, SampleError):
            try:
                record = normalise_record(
                    record, record_format=record_format, key=key, where=where, image_root=src.image_root
                )
            except SampleError as e:
                key, record = record_key(record, key), e
        yield where, key, record


def iter_samples(
    sources: Any | Sequence[Any],
    *,
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    on_error: str = "skip",
) -> Iterator[tuple[str, str, Sample | SampleError]]:
    """``(where, default key, sample)`` for every record of ``sources`` (see :func:`open_sources`), in
    order, read in this process.

    A record that cannot be normalised comes as its :class:`SampleError` in place of the sample, for the
    caller to count and report (``on_error="skip"``, the default everywhere), or raises it
    (``on_error="raise"``). ``record_format``: one of ``RECORD_FORMATS`` (default: detected per record).
    """
    check_choice("on_error", on_error, ON_ERROR)
    opened = open_sources(sources, image_root=image_root)
    for chunk in chunks(opened):
        for where, key, sample in chunk_samples(opened, chunk, record_format=record_format):
            if isinstance(sample, SampleError) and on_error == "raise":
                raise sample
            yield where, key, sample
